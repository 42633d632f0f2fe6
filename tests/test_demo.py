"""The demo's headline (`hoplite-gpu demo`): the tree the directory built,
each receiver's time, and a yardstick that fits how the bytes moved: one
local copy of the object through shared memory, the bound S/B over TCP."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from hoplite_gpu import demo

LABEL = {"n0": "sender", "n1": "receiver 1", "n2": "receiver 2", "n3": "receiver 3"}


def _render(tree) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(tree)
    return out.getvalue()


def test_the_tree_nests_each_receiver_under_the_sender_it_pulled_from():
    edges = [["n1", "n0"], ["n2", "n1"], ["n3", "n1"]]
    done = {"n1": (0.0, 0.010), "n2": (0.001, 0.012), "n3": (0.002, 0.013)}
    lines = _render(demo.tree_of(edges, "n0", done, LABEL)).splitlines()
    depth = {re.search(r"receiver \d", ln)[0]: ln.index("receiver")
             for ln in lines if "receiver" in ln}
    assert depth["receiver 1"] < depth["receiver 2"] == depth["receiver 3"], lines
    assert "receiver 2: done after 12.0 ms (own 11.0 ms)" in "\n".join(lines)


def test_the_tree_names_the_other_senders_of_a_pull_from_several():
    """A pull of a large object may take pieces from several complete copies
    (`Location.also`): the receiver sits under the first sender and names
    the others."""
    edges = [["n1", "n0"], ["n2", "n0"], ["n3", "n0"], ["n3", "n1"], ["n3", "n2"]]
    done = {n: (0.0, 0.005) for n in ("n1", "n2", "n3")}
    text = _render(demo.tree_of(edges, "n0", done, LABEL))
    assert "receiver 3: done after 5.0 ms (own 5.0 ms, also from receiver 1, receiver 2)" in text


def test_a_receiver_with_no_edge_is_still_shown():
    """object_info keeps the latest 1,024 edges: a receiver whose edge is gone
    is listed at the top, not dropped."""
    text = _render(demo.tree_of([["n1", "n0"]], "n0", {"n1": (0, 0.001), "n2": (0, 0.002)},
                                LABEL))
    assert "receiver 2: done after 2.0 ms" in text and "(its sender not listed)" in text


def test_with_shared_memory_the_broadcast_is_compared_with_one_local_copy():
    lines = demo.headline(7, 256 << 20, 0.010, shared=True, copy_s=0.050, p2p_s=0.002,
                          cores=2, workers=8)
    assert "0.20 x one local copy" in lines[0] and "50.0 ms" in lines[0]
    assert "point-to-point" not in " ".join(lines)  # (a mapping's 2 ms is no yardstick)


def test_over_tcp_the_broadcast_is_compared_with_the_bound():
    lines = demo.headline(7, 256 << 20, 0.560, shared=False, copy_s=0.050, p2p_s=0.080,
                          cores=2, workers=8, rounds=3)
    assert "7.00 x the bound S/B" in lines[0] and "(median of 3 rounds)" in lines[0]
    assert "B = 3.36 GB/s" in lines[0] and "local copy" not in " ".join(lines)


@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared-memory", "tcp"])
def test_the_demo_prints_the_yardstick_of_the_mode_it_ran_in(shared, monkeypatch, capsys):
    """About 4 s each: a local cluster of 3 workers."""
    monkeypatch.setenv("HOPLITE_SHARED_MEMORY", shared)
    assert demo.run_demo(num_workers=3, size=2 << 20) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the tree the directory built" in out
    assert len(re.findall(r"receiver \d: done after [\d.]+ ms", out)) == 2, out
    yardstick = "x one local copy of it" if shared == "1" else "x the bound S/B"
    assert yardstick in out, out
