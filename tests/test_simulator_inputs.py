"""The simulators (hoplite_gpu/simulator.py) and the CLI's `simulate`
subcommand at the edges of their inputs: times the cost model and a real
node would give, decisions the real directory would take, the pieces a
reduce is simulated in, and inputs that must be refused."""

from __future__ import annotations

import resource
import subprocess
import sys

import numpy as np
import pytest

from hoplite_gpu import cli
from hoplite_gpu.errors import InvalidArgument
from hoplite_gpu.simulator import simulate_broadcast, simulate_reduce

MiB = 1 << 20


# ------------------------------------------------------------- latency ---
def test_every_hop_of_a_chain_pays_the_link_latency():
    # The simulator's own docstring: `latency` seconds per message; the cost
    # model (docs/cost-model.md): T_chain ~ S/B + (N - 1)(C/B + L), "L is paid
    # once per hop". The last receiver of a chain of n gets its bytes after
    # they crossed n links, so it cannot finish before n latencies have passed.
    n, S, C, B, L = 10, 4 * MiB, 1 * MiB, 1.25e9, 5e-3
    r = simulate_broadcast(n, S, bandwidth=B, latency=L, chunk=C)
    assert r.depth() == n
    bound = S / B + (n - 1) * (C / B + L)
    assert r.makespan >= bound, (
        f"a chain of {n} hops finished in {r.makespan * 1e3:.1f} ms, under the model's "
        f"{bound * 1e3:.1f} ms: chunks cross a hop with no latency")


# ------------------------------------------- decisions as a real node's ---
def test_a_late_receiver_pulls_from_the_partial_copy_furthest_ahead():
    # Fan-out 2. n1 pulls alone from n0 until t=2; then n2 joins n0 (each at
    # B/2) and n3 pipelines from n1 at full rate. At t=4, n3 holds about 5
    # chunks and n2 about 3. A real node posts `progress` while it pulls
    # (pulls.py, `_fetch_from`) and the directory serves the partial copy
    # furthest ahead (tests/test_directory_state.py::
    # test_the_most_advanced_partial_copy_is_preferred), so n5 must get n3.
    S, C, B = 64 * MiB, 4 * MiB, 1.25e7
    r = simulate_broadcast(5, S, bandwidth=B, latency=1e-4, chunk=C,
                           max_receivers_per_sender=2, arrivals=[0.0, 2.0, 2.0, 4.0, 4.0])
    up = dict(r.edges)
    assert up["n3"] == "n1" and up["n2"] == "n0"
    assert up["n5"] == "n3", f"n5 pulls from {up['n5']}, which is behind n3"


# ------------------------------------------------------ odd arguments ---
def test_a_zero_byte_broadcast_reaches_every_receiver():
    r = simulate_broadcast(3, 0, bandwidth=1.25e9, latency=1e-4, chunk=4 * MiB)
    assert sorted(r.done_at) == ["n1", "n2", "n3"], r.done_at


@pytest.mark.parametrize("arrivals", [[0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
def test_arrivals_of_the_wrong_length_are_refused(arrivals):
    # Too few: receivers that never ask, left out of the makespan; too many:
    # locates from nodes that never joined, silently ignored.
    with pytest.raises(ValueError):
        simulate_broadcast(3, 8 * MiB, bandwidth=1.25e9, latency=1e-4, chunk=4 * MiB,
                           arrivals=arrivals)


# ------------------------------------------------------------------ CLI ---
def _cli(argv):
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse: a message and status 2, no traceback
        return exc.code


@pytest.mark.parametrize("latency", ["-1", "nan", "inf", "-1e-4"])
def test_cli_simulate_refuses_a_latency_that_is_negative_or_not_finite(latency, capsys):
    rc = _cli(["simulate", "--receivers", "2", "--size", "1MiB", f"--latency={latency}"])
    out = capsys.readouterr().out
    assert rc not in (0, None), f"--latency {latency} was accepted:\n{out}"


def test_cli_simulate_header_does_not_round_sub_mebibyte_sizes_to_zero(capsys):
    assert _cli(["simulate", "--receivers", "1", "--size", "64KiB", "--chunk", "16KiB"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert " 0 MiB" not in header, header


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def test_cli_simulate_with_a_one_byte_chunk_is_refused_not_a_traceback():
    # 256 MiB in 1-byte chunks: 2**28 chunks. The simulator allocates a list of
    # that many floats for the origin (2 GiB) and would then run for days.
    r = subprocess.run([sys.executable, "-m", "hoplite_gpu", "simulate", "--receivers", "2",
                        "--chunk", "1"], capture_output=True, text=True, timeout=30,
                       preexec_fn=_limit_memory)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-600:]


def test_cli_simulate_refuses_a_run_of_hours_at_once():
    """4 KiB chunks of 256 MiB to the default 1,000 receivers: 65 million chunk
    transfers per schedule, about an hour of simulation; refused at once."""
    r = subprocess.run([sys.executable, "-m", "hoplite_gpu", "simulate", "--chunk", "4KiB"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "chunk transfers per schedule" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("sim", [simulate_broadcast, simulate_reduce])
@pytest.mark.parametrize("bad, says", [
    ({"chunk": 0}, "chunk must be a positive"),
    ({"chunk": -4096}, "chunk must be a positive"),
    ({"chunk": 1.5}, "chunk must be a positive"),
    ({"bandwidth": 0.0}, "bandwidth must be a positive"),
    ({"bandwidth": float("nan")}, "bandwidth must be a positive"),
    ({"latency": -1e-3}, "latency must be 0 or more"),
    ({"latency": float("inf")}, "latency must be 0 or more"),
])
def test_a_model_that_means_nothing_is_refused(sim, bad, says):
    """A 0-byte chunk ran the reduce with 1-byte pieces, a 0 bandwidth divided
    by zero, a negative latency never finished: each is refused by name."""
    with pytest.raises(InvalidArgument, match=says):
        sim(4, 4096, **bad)
    r = sim(4, 4096, chunk=np.int64(4096))  # (NumPy integers are fine)
    assert (r.makespan if sim is simulate_broadcast else r.done_at) > 0


@pytest.mark.parametrize("stripes", [3, -1, 1.5])
def test_a_stripe_count_the_directory_does_not_take_is_refused_by_name(stripes):
    with pytest.raises(InvalidArgument, match="simulate_broadcast: stripes must be"):
        simulate_broadcast(4, 8 * MiB, stripes=stripes)


def test_cli_simulate_json_gives_the_setting_in_force_against_the_bound(capsys, monkeypatch):
    import json

    monkeypatch.setenv("HOPLITE_MAX_RECEIVERS_PER_SENDER", "2")
    monkeypatch.setenv("HOPLITE_STRIPES", "1")
    assert cli.main(["simulate", "--receivers", "7", "--size", "64MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_receivers_per_sender"] == "2" and out["bound_s"] == 64 * 2**20 / 1.25e9
    assert out["stripes"] == "off"
    assert out["ratio_to_bound"] == pytest.approx(out["seconds"] / out["bound_s"])
    expected = simulate_broadcast(7, 64 * 2**20, bandwidth=1.25e9, latency=1e-4,
                                  chunk=4 * 2**20, max_receivers_per_sender=2)
    assert out["seconds"] == pytest.approx(expected.makespan)
    assert {(s["max_receivers_per_sender"], s["stripes"]) for s in out["schedules"]} == {
        ("2", "off"), ("auto", "off"), ("1", "off"), ("4", "off"), ("7", "off"), ("2", "2")}


def test_cli_simulate_spreads_the_arrivals_it_is_told(capsys):
    import json

    runs = {}
    for spread in ("0", "0.5"):
        cli.main(["simulate", "--receivers", "7", "--size", "16MiB", "--json",
                  "--arrival-spread", spread])
        runs[spread] = json.loads(capsys.readouterr().out)
    assert runs["0.5"]["arrival_spread_s"] == 0.5
    assert runs["0.5"]["seconds"] > 0.5 > runs["0"]["seconds"]  # the last one arrives at 0.5 s


def test_cli_simulate_reduce_counts_the_pieces_it_really_simulates(monkeypatch, capsys):
    """`hoplite-gpu simulate --op reduce` refuses a run of more than
    `MAX_SIM_HOPS` chunk transfers per schedule ("about 15 s each"), but it
    counts `ceil(size / --chunk)` per input, while `ReduceSim` now simulates
    `fold_unit(size, chunk)` pieces: 8 per 4 MiB input at the default 4 MiB
    chunk. So `--size 4MiB --inputs 1000000` passes the guard (1M
    "transfers") and then simulates 8M piece transfers, minutes per schedule
    (16,384 inputs already take 5 s), while the very same simulation asked
    for as `--chunk 512KiB` is refused at once. The header also says "4 MiB
    chunks" for 512 KiB pieces. Here the limit is lowered to 64 transfers and
    16 inputs of 4 MiB (128 pieces) are asked for: the CLI runs them."""
    monkeypatch.setattr(cli, "MAX_SIM_HOPS", 64)
    # The same simulation spelled with its real unit is refused:
    assert _cli(["simulate", "--op", "reduce", "--size", "4MiB", "--chunk", "512KiB",
                 "--inputs", "16"]) not in (0, None)
    capsys.readouterr()
    rc = _cli(["simulate", "--op", "reduce", "--size", "4MiB", "--inputs", "16"])
    out = capsys.readouterr()
    assert rc not in (0, None), (
        "16 inputs of 4 MiB in 512 KiB fold pieces (128 transfers, over the limit of 64) "
        f"were simulated:\n{out.out}")
    assert "chunk transfers per schedule" in str(rc)  # (SystemExit's message)
