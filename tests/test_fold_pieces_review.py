"""Review of host reduce steps folding and handing on `reduce_plan.fold_unit`
pieces (at most 1 MiB, an eighth of a smaller object down to 256 KiB): what
the change left behind that still counts in whole chunks."""

from __future__ import annotations

from hoplite_gpu import cli


def _cli(argv):
    try:
        return cli.main(argv)
    except SystemExit as exc:  # the CLI's refusals: a message and a status
        return exc.code


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
