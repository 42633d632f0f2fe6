"""One host's node in the multi-source benchmark (benchmarks/multisource.py):
join the directory, say ready, then answer one JSON command per stdin line
with one JSON line on stdout, until stdin closes. Run inside a host's network
namespace.

Commands (each carries a `timeout` in seconds; an error is answered as
{"error": "..."} and the node goes on):

- put {name, size}: put the deterministic input (`payload.make_input(0, size)`);
  answers its CRC32.
- get {name}: get the object, timed from the call to its return; answers the
  start and end (wall time), whether it is byte-identical to the input
  (`payload.check`) and its CRC32.
- complete {name, count}: wait until the directory knows `count` complete
  copies that serve nobody; answers the holders.
- reach {name, node, nbytes}: wait until the directory says that holder `node`
  has at least `nbytes` (its progress reports come every 0.1 s); answers what
  it has and when it was seen.
- info {name}: what the directory knows of the object (`object_info`).
- failovers: this node's (pull failed, bytes flowed again) wall times.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from typing import Any

import hoplite_gpu as hg

from .payload import check, join, make_input, serve_commands

#: How often `complete` and `reach` ask the directory: well within the 0.1 s
#: between a pull's progress reports, and light on the directory's CPU
POLL_S = 0.01
OPS = ("put", "get", "complete", "reach", "info", "failovers")


def _oid(name: str) -> hg.ObjectID:
    return hg.ObjectID.from_name(name)


def _holders(name: str) -> list[dict]:
    return hg.object_info(_oid(name))["holders"]


def _until(what: str, timeout: float, test) -> Any:
    """Poll `test()` until it returns something other than None, or raise at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = test()
        if got is not None:
            return got
        time.sleep(POLL_S)
    raise TimeoutError(f"{what}: not seen within {timeout:g}s")


class Commands:
    def __init__(self) -> None:
        #: results of gets, kept so that nothing the store lends is freed under us
        self.held: dict[str, Any] = {}

    def put(self, name: str, size: int, timeout: float) -> dict:
        value = make_input(0, size)
        hg.put(value, _oid(name))
        self.held[name] = value
        return {"crc": zlib.crc32(value)}

    def get(self, name: str, size: int, timeout: float) -> dict:
        start = time.time()
        value = hg.get(_oid(name), timeout=timeout)
        end = time.time()
        self.held[name] = value
        ok, crc = check("broadcast", 1, value, size, 0)
        return {"start": start, "end": end, "ok": ok, "crc": crc}

    def complete(self, name: str, count: int, timeout: float) -> dict:
        def idle_copies() -> list[dict] | None:
            holders = _holders(name)
            idle = [h for h in holders if h["complete"] and not h["serving"]]
            return holders if len(idle) >= count else None

        return {"holders": _until(f"{count} idle complete copies of {name!r}", timeout,
                                  idle_copies)}

    def reach(self, name: str, node: str, nbytes: int, timeout: float) -> dict:
        def has() -> int | None:
            mine = [h["nbytes"] for h in _holders(name) if h["node"] == node]
            return mine[0] if mine and mine[0] >= nbytes else None

        got = _until(f"{node} holding {nbytes} bytes of {name!r}", timeout, has)
        return {"nbytes": got, "seen": time.time()}

    def info(self, name: str, timeout: float) -> dict:
        return hg.object_info(_oid(name))

    def failovers(self, timeout: float) -> dict:
        return {"failovers": [(a, b) for _, a, b in list(hg.runtime().node.failovers)]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--node-host", required=True)
    args = p.parse_args()
    join(args.address, args.token, args.node_host)
    return serve_commands(Commands(), OPS)


if __name__ == "__main__":
    sys.exit(main())
