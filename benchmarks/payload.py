"""Inputs and result checks shared by every system in the emulated benchmark.

Rank r's input is a float32 array of integer values in [-1000, 1000], given by
a hash of r and of the element index modulo a prime, so any process can compute
any slice of any rank's input without holding it. Sums of up to 16 000 such inputs are exact in
float32, so a reduce's result is checked exactly, not within a tolerance.

Ops: broadcast (rank 0's input on every rank), reduce (the sum on rank 0),
allreduce (the sum everywhere), gather (every input, in rank order, on rank 0),
allgather (every input everywhere).
"""

from __future__ import annotations

import argparse
import functools
import zlib
from collections.abc import Sequence

import numpy as np

OPS = ("broadcast", "reduce", "allreduce", "gather", "allgather")
_PERIOD = 262147  # a prime number of elements: a chunk copied to a wrong offset shows


@functools.lru_cache(maxsize=64)
def _base(rank: int) -> np.ndarray:
    j = np.arange(_PERIOD, dtype=np.uint64)
    v = (j * np.uint64(2654435761) + np.uint64(rank * 97531 + 12345)) % np.uint64(1 << 32)
    return ((v >> np.uint64(13)) % np.uint64(2001)).astype(np.float32) - np.float32(1000)


def values(rank: int, lo: int, hi: int) -> np.ndarray:
    """Elements lo..hi-1 of rank `rank`'s input (periodic with a prime period)."""
    return _base(rank)[np.arange(lo, hi, dtype=np.int64) % _PERIOD]


def plain_empty(shape: int | tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An uninitialised array in plain 4 KiB pages, as hoplite-gpu's store maps
    its buffers (hoplite_gpu/node/pool.py). `np.empty` advises the kernel to use
    transparent huge pages for large arrays, and a first touch of those was 3-4.5 x
    slower on the VMs measured: baselines' result buffers use this instead, so
    every system's first call pays the same price per page it touches."""
    import mmap

    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if n < (1 << 20):
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, n), dtype=dtype).reshape(shape)


def make_input(rank: int, nbytes: int) -> np.ndarray:
    n = nbytes // 4
    base = _base(rank)
    out = plain_empty(n)
    for lo in range(0, n, _PERIOD):
        out[lo:lo + _PERIOD] = base[:min(_PERIOD, n - lo)]
    return out


def _windows(n: int) -> list[tuple[int, int]]:
    k = min(n, 1 << 14)
    return sorted({(0, k), (n // 2 - k // 2, n // 2 - k // 2 + k), (n - k, n)})


def expected(op: str, world: int, lo: int, hi: int) -> np.ndarray:
    if op == "broadcast":
        return values(0, lo, hi)
    total = np.zeros(hi - lo, dtype=np.float32)
    for r in range(world):
        total += values(r, lo, hi)
    return total


@functools.lru_cache(maxsize=16)
def _period(op: str, world: int, rank: int) -> np.ndarray:
    """One period of the expected result (of rank `rank`'s piece for gathers)."""
    if op in ("gather", "allgather"):
        return _base(rank)
    return expected(op, world, 0, _PERIOD)


def _expected_crc(op: str, world: int, n: int, rank: int, crc: int = 0) -> int:
    """CRC32 of the whole expected result (of rank `rank`'s piece for gathers),
    chained on `crc`: the result repeats with the inputs' period."""
    period = _period(op, world, rank)
    for lo in range(0, n, _PERIOD):
        crc = zlib.crc32(period[:min(_PERIOD, n - lo)], crc)
    return crc


def holds_result(op: str, rank: int) -> bool:
    return rank == 0 or op in ("broadcast", "allreduce", "allgather")


def check(op: str, world: int, result: np.ndarray | Sequence[np.ndarray] | None, nbytes: int,
          rank: int) -> tuple[bool, int | None]:
    """(exact match of the whole result, CRC32 of it); ranks that hold no
    result return (True, None). Three windows of every piece are compared
    element by element (what differs is then easy to see), and the whole by
    its CRC32 against that of the expected result."""
    if not holds_result(op, rank):
        return True, None
    if result is None:
        return False, None
    n = nbytes // 4
    if op in ("gather", "allgather"):
        pieces = [np.asarray(p) for p in result]  # a list of arrays or an N x n array
        if len(pieces) != world:
            return False, None
        crc, want, ok = 0, 0, True
        for r, piece in enumerate(pieces):
            piece = np.asarray(piece, dtype=np.float32).reshape(-1)
            ok = ok and piece.size == n and all(
                np.array_equal(piece[a:b], values(r, a, b)) for a, b in _windows(n))
            crc = zlib.crc32(piece, crc)
            want = _expected_crc(op, world, n, r, want)
        return ok and crc == want, crc
    arr = np.asarray(result, dtype=np.float32).reshape(-1)
    ok = arr.size == n and all(np.array_equal(arr[a:b], expected(op, world, a, b))
                               for a, b in _windows(n))
    crc = zlib.crc32(arr)
    return ok and crc == _expected_crc(op, world, n, 0), crc


def link_volume(op: str, world: int, nbytes: int) -> int:
    """A floor on the bytes that one call must carry over the hosts' downlinks
    (summed over hosts; headers excluded), whatever the algorithm: a broadcast's
    receivers need S each; in a reduce every non-root host must send S (its
    S bytes of input, or of partial sums, cannot be compressed: a
    reduce-scatter's (N-1)/N S plus its reduced shard to the root is S too);
    an allreduce sends at least 2(N-1)/N S per rank, 2(N-1) S in all; a gather
    brings (N-1) S to the root and an allgather (N-1) S to every rank. If fewer
    bytes crossed the links, some went another way (shared memory, loopback)."""
    s, n = nbytes, world
    return {"broadcast": (n - 1) * s,           # every receiver's downlink carries S
            "reduce": (n - 1) * s,              # every non-root's S must leave it
            "allreduce": 2 * (n - 1) * s,
            "gather": (n - 1) * s,              # the root's downlink
            "allgather": n * (n - 1) * s}[op]


def eth0_address() -> str:
    """This process's address on the emulated link (proves which host it runs on)."""
    import subprocess

    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", "eth0"], capture_output=True,
                         text=True, check=False).stdout.split()
    return out[out.index("inet") + 1].split("/")[0] if "inet" in out else ""


def page_faults() -> int:
    """Page faults (minor and major) of this process so far: first touches of
    fresh memory, which cost the kernel a zeroed page each."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt + ru.ru_majflt


def cpu_seconds() -> float:
    """User + system CPU time of this process, every thread included."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def join(address: str, token: str, node_host: str, **settings: object) -> int:
    """`hg.init` on an emulated host; returns how many times it was tried
    again. `Runtime.__init__` submits its first call before its loop thread
    runs the loop: on a loaded machine that can refuse it (RuntimeClosed)."""
    import time

    import hoplite_gpu as hg

    for retries in range(4):
        try:
            hg.init(address, token=token, node_host=node_host, **settings)
            return retries
        except hg.RuntimeClosed:
            hg.shutdown()
            if retries == 3:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def serve_commands(commands: object, ops: Sequence[str]) -> int:
    """A node script's loop: say it is ready, then answer each JSON command
    on standard input (`{"op": name, ...}` -> `commands.name(...)`) with one
    JSON line (`{"error": ...}` naming the command if it failed), until
    standard input ends; the runtime is shut down however it ends."""
    import json
    import sys

    import hoplite_gpu as hg

    try:
        print(json.dumps({"ready": True, "node": hg.node_id(), "host": eth0_address()}),
              flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            op = request.pop("op", None)
            try:
                if op not in ops:
                    raise ValueError(f"unknown command {op!r}; known: {', '.join(ops)}")
                answer = getattr(commands, op)(**request)
            except Exception as exc:  # (answered: the harness says which command failed)
                answer = {"error": f"{op}: {type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)
        return 0
    finally:
        hg.shutdown()


def rank_arguments(parser: argparse.ArgumentParser, ops: Sequence[str]) -> None:
    """The arguments every hoplite-gpu rank script of an emulated cluster takes
    from its harness: the directory, this rank's host and place, the call."""
    parser.add_argument("--address", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--node-host", required=True)
    parser.add_argument("--op", choices=ops, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--size", type=int, required=True, help="bytes per rank")
    parser.add_argument("--iters", type=int, default=1)
