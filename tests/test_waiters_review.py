"""How the directory's state machine serves waiting gets as copies appear
(state.py `_serve_waiting`, `_serve_relay_arrival`, `_best_sender`), driven
with events through `Directory.handle` as tests/test_directory_state.py and
tests/test_scale_review.py do: no network, no nodes.
"""

from __future__ import annotations

from benchmarks import directory_scale
from hoplite_gpu.directory import state as s

# (the directory and objects as the directory-scale benchmark builds them)
oid, joined, put_complete = directory_scale.oid, directory_scale.joined, directory_scale.put_complete
ARRAY = {"kind": "numpy", "dtype": "<f4", "shape": [1 << 18], "nbytes": 1 << 20}


def senders(out: list[s.Command], node: str) -> list[str]:
    return [c.body.sender for c in out
            if isinstance(c, s.Reply) and c.node == node and getattr(c.body, "sender", None) is not None]


# ---------------------------------------------------------------- relays ---
def test_a_relays_next_node_is_served_once_the_node_before_it_gave_up_its_copy():
    """A sliced allreduce relays slice results rank to rank (`relay`); a rank
    waits for the rank before it "to hold or pull the result" and takes any
    other holder only once that rank's node is *gone* or failed it
    (`_best_sender`: `before in self.nodes` and not a holder -> None, "as it
    will"). A rank whose call gave up (its own deadline, a cancelled task)
    stays alive but tells the directory it holds nothing: `unreceived` sends
    `dropped` for its unfinished result, and its lent inputs are reclaimed
    "as if its task had died" (node.py `reclaim`). It never asks again, so
    the next rank's get of that slice waits on it forever: every Progress
    and Completed re-checks it and again finds the rule says wait. The
    user sees `Timeout` at the next rank's deadline (and the rank after it
    waits on that one, and so on round the relay) although the slice's root
    holds a complete copy the whole time, where a node that died instead
    would have let them all finish."""
    d = joined(5)
    for i in range(4):
        put_complete(d, f"n{i + 1}", oid(i), ARRAY)
    target = oid(100)
    # slice 1 of 4 ranks on n1..n4: chain 2, 3, 0 -> 1, relayed n2 -> n3 -> n4 -> n1
    d.handle(s.ReduceRequested("n0", 1, target, (oid(2), oid(3), oid(0), oid(1)), "sum", 4,
                               root_input=oid(1), relay=True))
    assert d.objects[target].relay == ("n2", "n3", "n4", "n1")
    assert senders(d.handle(s.Locate("n3", 10, target)), "n3") == ["n2"]
    d.handle(s.Completed("n2", target))  # the slice is reduced: n2 holds all of it
    # n3's call gives up before its pull ends: it drops its copy and never asks again
    d.handle(s.Dropped("n3", target))
    assert "n3" in d.nodes and "n3" not in d.objects[target].holders

    out = d.handle(s.Locate("n4", 11, target))
    # (anything else about the object happening meanwhile changes nothing today)
    out += d.handle(s.Locate("n1", 12, target))
    assert senders(out, "n4") == ["n2"], (
        "n4's get of the relayed slice still waits for n3, which dropped its copy and "
        f"will never ask again, though n2 holds a complete copy; waiting: "
        f"{list(d.objects[target].waiting)}")
