"""Doc claims (README.md, docs/*.md) that the code does not keep, checked
quickly. Each test states what the docs say; tests/test_docs_claims.py has
the earlier ones."""

from __future__ import annotations

import asyncio
import logging

from hoplite_gpu.config import Config
from hoplite_gpu.directory import server as dir_server
from hoplite_gpu.directory import state as s
from hoplite_gpu.directory.reduce_plan import allreduce_slices
from hoplite_gpu.errors import TransportError
from hoplite_gpu.node.node import Node

MiB = 1 << 20


def _oid(slice_: int, rank: int) -> bytes:
    return bytes([slice_, rank]) + bytes(18)


def test_sliced_allreduce_slices_are_reduced_on_chains_with_the_default_cost_model():
    """docs/cost-model.md "Sliced allreduce": "slice j (1/N of the array) is
    reduced on a chain rooted at rank j ... so every slice, partial sum or
    result, moves from rank r to rank r+1 only, as in a ring"; likewise
    docs/architecture.md ("Reduce") and docs/configuration.md
    (HOPLITE_ALLREDUCE_SLICING: "reduced on a chain rooted at that rank").

    The directory picks each slice's tree degree with `choose_degree` like any
    reduce: with the default settings, 8 ranks and a 32 MiB array (4 MiB
    slices, which is sliced) it builds binary trees, so a step folds two
    children and slices travel between ranks that are not neighbours."""
    cfg = Config()
    ranks, slice_bytes = 8, cfg.chunk_size  # the least a slice may be
    assert allreduce_slices(ranks * slice_bytes, ranks, cfg.chunk_size) == ranks  # sliced
    layout = {"kind": "numpy", "dtype": "<f4", "shape": [slice_bytes // 4],
              "nbytes": slice_bytes}
    d = s.Directory(latency_s=cfg.link_latency_s, bytes_per_s=cfg.link_bytes_per_s,
                    chunk_size=cfg.chunk_size, lease_s=cfg.node_lease_s)
    address = {f"n{r}": f"tcp://127.0.0.1:{1000 + r}" for r in range(ranks)}
    for node, addr in address.items():
        d.handle(s.NodeJoined(node, addr))
    # As `collectives._sliced`: every rank lends its slices (the barrier), then
    # slice j's reduce lists rank j+1, ..., j, rooted at rank j and relayed.
    for j in range(ranks):
        for r in range(ranks):
            d.handle(s.Put(f"n{r}", 1, _oid(j, r), slice_bytes, layout))
            d.handle(s.Completed(f"n{r}", _oid(j, r)))
    hops = []
    for j in range(ranks):
        listed = tuple(_oid(j, (j + 1 + i) % ranks) for i in range(ranks))
        out = d.handle(s.ReduceRequested("n0", 10 + j, _oid(100, j), listed, "sum", ranks,
                                         root_input=_oid(j, j), relay=True))
        for cmd in out:
            if isinstance(cmd, s.StartReduceStep):
                hops += [(cmd.node, child.address, j) for child in cmd.step.children]
    off_ring = [(f"rank {int(node[1:])} pulls from {addr} for slice {j}")
                for node, addr, j in hops
                if addr != address[f"n{(int(node[1:]) - 1) % ranks}"]]
    assert not off_ring, ("slices do not move from rank r to rank r+1 only: "
                          + "; ".join(off_ring[:4]))


def test_a_directory_address_is_dialled_over_its_scheme_or_else_the_nodes_setting():
    """docs/configuration.md and docs/protocol.md: nodes dial the scheme of
    the directory's address, and a bare "host:port" over their own
    HOPLITE_CONTROL_TRANSPORT (the docs once said tcp, whatever the node's)."""
    def dialled(setting: str, address: str) -> str:
        return Node(Config(control_transport=setting, shared_memory=False), "token",
                    address).directory_address

    assert dialled("ucx", "127.0.0.1:7777") == "ucx://127.0.0.1:7777"
    assert dialled("tcp", "127.0.0.1:7777") == "tcp://127.0.0.1:7777"
    assert dialled("ucx", "tcp://127.0.0.1:7777") == "tcp://127.0.0.1:7777"


class _Unwritable:
    peer = "tcp://127.0.0.1:1"

    def send_nowait(self, data: bytes) -> int:
        raise TransportError("took no bytes for 5s; cut off")

    async def close(self) -> None:
        pass


def test_a_node_cut_off_is_in_the_directory_log_at_its_default_level(caplog):
    """README "Troubleshooting": the directory "cuts off a node that takes none
    of its messages for HOPLITE_NODE_LEASE_S (`cannot write to node ...` in
    its log)". `hoplite-gpu directory` logs at WARNING unless told otherwise
    (--log-level defaults to HOPLITE_LOG_LEVEL, WARNING), but that line is
    logged at INFO, so the log the README points to never shows it."""
    caplog.set_level(logging.DEBUG, logger="hoplite_gpu.directory")

    async def cut_off() -> None:
        peer = dir_server._Peer("n1", _Unwritable(), stall_s=Config().node_lease_s)
        try:
            peer.outbox.post({"op": "drop"})  # the write fails: the node is cut off
        finally:
            await peer.outbox.close()

    asyncio.run(cut_off())
    lines = [r for r in caplog.records if "cannot write to node" in r.getMessage()]
    assert lines, "the directory logged nothing about the node it could not write to"
    default = logging.getLevelName(Config().log_level)
    assert max(r.levelno for r in lines) >= default, (
        f"'cannot write to node' is logged at {lines[0].levelname}, below the directory's "
        f"default log level {Config().log_level}")
