"""One host's node in the weight channel benchmark (benchmarks/channel.py): join
the directory, say ready, then answer one JSON command per stdin line with one
JSON line on stdout, until stdin closes. Run inside a host's network namespace.

Commands (each carries a `timeout` in seconds; an error is answered as
{"error": "..."} and the node goes on):

- prepare {version}: (the learner) make version `version` of the state dict
  (`weights.state_dict`), untimed; answers its CRC32.
- publish {version}: (the learner) publish it; answers the wall times of the
  call's start and end.
- fetch {newer_than, out}: (an actor) fetch the newest version newer than
  `newer_than`, as views or (`out`) into arrays made once; answers the wall
  time it returned, the version, and the CRC32 of what it holds (taken after).
- relay {version, nbytes}: wait until the directory says some actor holds at
  least `nbytes` of the version, not all of it, while another pulls from it
  (a relay of the chain; progress reports come every 0.1 s); answers its
  node id and what it held.
- holders {version}: `WeightChannel.holders`.
- put_plain {version} / get_plain {version}: the yardstick: the same bytes
  as one plain array under a name of the version (`hg.put`, `hg.get`), the
  learner freeing the one two versions back as the channel's `keep=2` does.
- failovers: this node's (pull failed, bytes flowed again) wall times.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import hoplite_gpu as hg
from hoplite_gpu.channel import WeightChannel, _part

from .payload import join, serve_commands
from .weights import crc, empty_like, mixed_sizes, state_dict

#: How often `relay` asks the directory: its progress reports come every 0.1 s,
#: and asking more often only loads the cores the run is measured on
POLL_S = 0.05
OPS = ("prepare", "publish", "fetch", "relay", "holders", "failovers", "put_plain",
       "get_plain")


class Commands:
    def __init__(self, channel: str, sizes: list[int]) -> None:
        self.channel, self.sizes = WeightChannel(channel), sizes
        self.state: dict[str, Any] = {}
        self.held: dict[str, Any] = {}  # (what a fetch returned: kept until the next one)
        self.out: dict[str, Any] | None = None

    def prepare(self, version: int, timeout: float) -> dict:
        self.state = state_dict(self.sizes, version)
        return {"crc": crc(self.state.values())}

    def publish(self, version: int, timeout: float) -> dict:
        start = time.time()
        got = self.channel.publish(self.state, version=version, timeout=timeout)
        return {"start": start, "end": time.time(), "version": got}

    def fetch(self, newer_than: int, out: bool, timeout: float) -> dict:
        if out and self.out is None:
            self.out = empty_like(self.sizes)
        self.held = {}
        version, self.held = self.channel.fetch(newer_than=newer_than, timeout=timeout,
                                                out=self.out if out else None)
        end = time.time()
        return {"end": end, "version": version, "crc": crc(self.held.values()),
                "tensors": len(self.held)}

    def put_plain(self, version: int, timeout: float) -> dict:
        flat = np.concatenate([a.reshape(-1) for a in self.state.values()])  # (untimed)
        start = time.time()
        hg.put(flat, _plain(self.channel.name, version))
        if version >= 2:
            hg.delete(_plain(self.channel.name, version - 2))
        return {"start": start, "end": time.time(), "version": version}

    def get_plain(self, version: int, timeout: float) -> dict:
        self.held = {}
        got = hg.get(_plain(self.channel.name, version), timeout=timeout)
        end = time.time()
        self.held = {"flat": got}
        # (CRC32 chains: the flat array's is the tensors' in order)
        return {"end": end, "version": version, "crc": crc([got]), "tensors": len(self.sizes)}

    def relay(self, version: int, nbytes: int, timeout: float) -> dict:
        oid = _part(self.channel.name, version, 0)
        me = hg.node_id()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = hg.object_info(oid)
            for h in info["holders"]:
                if (h["node"] != me and not h["complete"] and h["serving"]
                        and nbytes <= h["nbytes"] < info["size"]):
                    return {"node": h["node"], "nbytes": h["nbytes"], "seen": time.time()}
            time.sleep(POLL_S)
        raise TimeoutError(f"no actor relaying version {version} held {nbytes} bytes of it "
                           f"within {timeout:g}s")

    def holders(self, version: int, timeout: float) -> dict:
        return self.channel.holders(version)

    def failovers(self, timeout: float) -> dict:
        return {"failovers": [(a, b) for _, a, b in list(hg.runtime().node.failovers)]}


def _plain(channel: str, version: int) -> hg.ObjectID:
    return hg.ObjectID.from_name(f"plain/{channel}/{version}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--node-host", required=True)
    p.add_argument("--channel", required=True)
    p.add_argument("--size", type=int, required=True, help="the state dict's bytes")
    args = p.parse_args()
    join(args.address, args.token, args.node_host)
    return serve_commands(Commands(args.channel, mixed_sizes(args.size)), OPS)


if __name__ == "__main__":
    sys.exit(main())
