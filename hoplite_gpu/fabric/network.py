"""A fabric with a routing and the fluid engine, driven by messages and timers.

`send(src, dst, nbytes, done)` starts a message now, and `done(t)` is called
once its bytes are all through; `send_many` starts many at once (arrays), and
its `done(t, which)` gets the positions of those through at t. The router lays
each message on the fabric as one or more flows. `at(t, fn)` calls `fn(t)` at
time t. Messages sent at one instant (by the callbacks of one event and the
timers due then) start together, as one batch the router sees whole. `run()`
plays events until nothing is left.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import numpy as np

from ..errors import InvalidArgument
from .engine import MERGE, FluidEngine
from .routes import RouteTable
from .routing import make_router
from .topology import Fabric

Done = Callable[[float], None]
DoneMany = Callable[[float, np.ndarray], None]


class _Grow:
    """An int array that grows by doubling, indexed by message id."""

    def __init__(self) -> None:
        self.a = np.zeros(1024, np.int64)

    def fit(self, n: int) -> np.ndarray:
        if n > len(self.a):
            grown = np.zeros(max(n, 2 * len(self.a)), np.int64)
            grown[:len(self.a)] = self.a
            self.a = grown
        return self.a


class Network:
    def __init__(self, fabric: Fabric, routing: str, *, seed: int = 0, merge: float = MERGE,
                 subflows: int | None = None) -> None:
        if not 0 <= merge < 1:
            raise InvalidArgument(f"Network: merge must be in [0, 1); got {merge!r}")
        self.fabric = fabric
        self.routes = RouteTable(fabric.links)
        self.router = make_router(routing, fabric, self.routes, seed=seed, subflows=subflows)
        self.engine = FluidEngine(fabric.capacity, self.routes, merge=merge)
        self._timers: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._batch: list[tuple[np.ndarray, np.ndarray, np.ndarray, DoneMany]] = []
        self.messages = 0          # message ids handed out
        self._left = _Grow()       # message -> parts not ended
        self._group = _Grow()      # message -> its send's group
        self._groups: dict[int, list] = {}   # group -> [first message, done, messages left]
        self._single: set[int] = set()       # messages sent alone (by `send`)
        self.host_bytes = np.zeros(fabric.links)
        self._route_bytes = np.zeros(1024)
        self.flows = 0
        #: the largest part of a message that crossed a switch-to-switch link
        self.largest_part = 0.0

    @property
    def now(self) -> float:
        return self.engine.t

    def send(self, src: int, dst: int, nbytes: float, done: Done) -> None:
        hosts = self.fabric.hosts
        if not (0 <= src < hosts and 0 <= dst < hosts):
            raise InvalidArgument(f"Network.send: hosts are 0 to {hosts - 1}; got {src} to {dst}")
        if src == dst:
            raise InvalidArgument(f"Network.send: host {src} sending to itself crosses no link")
        if not 0 < nbytes < math.inf:
            raise InvalidArgument(f"Network.send: nbytes must be positive and finite; "
                                  f"got {nbytes}")
        self._batch.append((int(src), int(dst), float(nbytes), done))

    def send_many(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                  done: DoneMany) -> None:
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        nbytes = np.asarray(nbytes, np.float64)
        hosts = self.fabric.hosts
        if not len(src) == len(dst) == len(nbytes) or not len(src):
            raise InvalidArgument("Network.send_many: src, dst and nbytes need one entry per "
                                  f"message; got {len(src)}, {len(dst)}, {len(nbytes)}")
        if src.min() < 0 or dst.min() < 0 or max(src.max(), dst.max()) >= hosts:
            raise InvalidArgument(f"Network.send_many: hosts are 0 to {hosts - 1}; got "
                                  f"{int(min(src.min(), dst.min()))} to "
                                  f"{int(max(src.max(), dst.max()))}")
        if (src == dst).any():
            raise InvalidArgument(f"Network.send_many: host {int(src[src == dst][0])} sending "
                                  "to itself crosses no link")
        ok = (nbytes > 0) & (nbytes < math.inf)
        if not ok.all():
            raise InvalidArgument(f"Network.send_many: nbytes must be positive and finite; got "
                                  f"{float(nbytes[~ok][0])}")
        self._batch.append((src, dst, nbytes, done))

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        if not t >= self.now:
            raise InvalidArgument(f"Network.at: time {t!r} is before now ({self.now})")
        heapq.heappush(self._timers, (t, next(self._seq), fn))

    def run(self) -> float:
        """Play every event; return the time of the last."""
        engine = self.engine
        while True:
            self._start_batch()
            due = self._timers[0][0] if self._timers else math.inf
            if engine.active == 0 and due == math.inf:
                return engine.t
            self._ended(*engine.advance(due))
            while self._timers and self._timers[0][0] <= engine.t:
                _, _, fn = heapq.heappop(self._timers)
                fn(engine.t)

    def _start_batch(self) -> None:
        """Start every message sent since the last event, in the order sent."""
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        first = self.messages
        srcs, dsts, sizes, made = [], [], [], []
        at = first
        for s, d, n, done in batch:
            gid = next(self._seq)
            if isinstance(s, int):     # one message: its `done` takes the time only
                self._single.add(at)
                srcs.append(s), dsts.append(d), sizes.append(n)
                count = 1
            else:
                srcs.extend(s.tolist()), dsts.extend(d.tolist()), sizes.extend(n.tolist())
                count = len(s)
            self._groups[gid] = [at, done, count]
            made.append((gid, at, count))
            at += count
        src, dst = np.array(srcs, np.int64), np.array(dsts, np.int64)
        nbytes = np.array(sizes)
        self.messages = at
        left, group = self._left.fit(at), self._group.fit(at)
        for gid, start, count in made:
            group[start:start + count] = gid
        flow, route, size = self.router.assign(src, dst, nbytes)
        left[first:self.messages] = np.bincount(flow, minlength=len(src))
        np.add.at(self.host_bytes, self.fabric.host_up[src], nbytes)
        np.add.at(self.host_bytes, self.fabric.host_down[dst], nbytes)
        has = route >= 0
        if has.any():
            top = int(route.max()) + 1
            if top > len(self._route_bytes):
                grown = np.zeros(max(top, 2 * len(self._route_bytes)))
                grown[:len(self._route_bytes)] = self._route_bytes
                self._route_bytes = grown
            np.add.at(self._route_bytes, route[has], size[has])
            self.largest_part = max(self.largest_part, float(size[has].max()))
        self.flows += len(flow)
        self.engine.add(self.fabric.host_up[src[flow]], self.fabric.host_down[dst[flow]],
                        route, size, flow + first)

    def _ended(self, tags: np.ndarray, route: np.ndarray, nbytes: np.ndarray) -> None:
        if not len(tags):
            return
        self.router.ended(route, nbytes)
        left = self._left.a
        ids, times = np.unique(tags, return_counts=True)
        left[ids] -= times
        through = ids[left[ids] == 0]
        if not len(through):
            return
        # (message ids rise with their groups' ids: `through` is sorted by group)
        gids, starts = np.unique(self._group.a[through], return_index=True)
        for gid, mine in zip(gids.tolist(), np.split(through, starts[1:]), strict=True):
            entry = self._groups[gid]
            entry[2] -= len(mine)
            if entry[2] == 0:
                del self._groups[gid]
            if entry[0] in self._single:
                self._single.discard(entry[0])
                entry[1](self.engine.t)
            else:
                entry[1](self.engine.t, mine - entry[0])

    def link_bytes(self) -> np.ndarray:
        """Bytes each link carried so far."""
        carried = self.host_bytes.copy()
        if len(self.routes):
            rb = np.zeros(len(self.routes))
            n = min(len(rb), len(self._route_bytes))
            rb[:n] = self._route_bytes[:n]
            carried += self.routes.link_bytes(rb)
        return carried
