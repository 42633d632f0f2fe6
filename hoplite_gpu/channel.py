"""Versioned weight broadcast: a learner publishes versions of a set of named
arrays (a state dict); readers fetch the newest version, or wait for a newer
one, and always get one complete version, never a mix.

Each version's arrays are ordinary immutable objects, named from the channel,
the version and the key; a small manifest is put after the arrays and only
then does the directory's head for the channel move, so a reader never sees a
version before all of it is in (it then pulls the arrays, each pipelined). A
version is first claimed: a publisher puts the version's claim, an empty
object whose shape only it uses, and since objects are immutable a second
publisher of that version gets `ObjectExists` (and, choosing versions itself,
takes the next one) instead of mixing its arrays into the first one's. A late
joiner gets the current version without the learner doing anything. The
publisher frees versions older than its last `keep` published ones; a reader
caught fetching a freed version starts over from the newest.

Every call has an asyncio twin (`publish_async`, `fetch_async`,
`latest_version_async`) for event loops of the caller's own, such as a Ray
async actor's or a serving replica's: one body, run on the runtime's loop
either way, so a cancelled twin stops the call as its timeout would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import api
from . import messages as m
from .errors import (
    DirectoryUnavailable,
    HopliteError,
    InvalidArgument,
    ObjectExists,
    ObjectNotFound,
    Timeout,
)
from .ids import ObjectID

#: How long a reader waits for one array before checking whether its version was freed.
_PROBE_S = 1.0
#: Versions are below this: the wire carries them as 64-bit signed ints (and
#: the next one is chosen as the head + 1).
_MAX_VERSION = (1 << 63) - 1


def _oid(name: str, version: int, part: str) -> ObjectID:
    return ObjectID.from_name(f"hoplite-channel/{name}/{version}/{part}")


async def _quietly(coro: Any) -> None:
    """`coro`, its errors dropped (cleanup that may find the directory away)."""
    with contextlib.suppress(HopliteError):
        await coro


async def _exists(node: Any, oid: ObjectID) -> bool:
    try:
        await node.query(oid)
    except ObjectNotFound:
        return False
    return True


class WeightChannel:
    """``WeightChannel("policy").publish(state_dict)`` on the learner;
    ``version, weights = WeightChannel("policy").fetch()`` on every actor."""

    def __init__(self, name: str, *, keep: int = 2) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"a channel needs a non-empty name; got {name!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidArgument(f"keep must be an int >= 1; got {keep!r}")
        self.name, self.keep = name, keep
        self._published: dict[int, list[str]] = {}  # version -> keys, for freeing
        #: the highest version this publisher tried: a failed one is not reused
        self._tried = -1
        self._adopted = False

    # ------------------------------------------------------------ publisher ---
    def publish(self, tensors: Mapping[str, Any], *, version: int | None = None,
                timeout: float | None = None) -> int:
        """Put every array, then make this version the channel's head; returns
        it. `timeout` bounds the whole call (default: the runtime's `timeout_s`)."""
        rt, limit = self._check_publish(tensors, version, timeout)
        return rt.call(self._publish(rt.node, tensors, version, limit), limit)

    async def publish_async(self, tensors: Mapping[str, Any], *, version: int | None = None,
                            timeout: float | None = None) -> int:
        """`publish`, awaitable."""
        rt, limit = self._check_publish(tensors, version, timeout)
        return await rt.call_async(self._publish(rt.node, tensors, version, limit))

    def _check_publish(self, tensors: Mapping[str, Any], version: int | None,
                       timeout: float | None) -> tuple[Any, float]:
        if not isinstance(tensors, Mapping) or not tensors:
            raise InvalidArgument("publish takes a non-empty mapping of name -> array")
        if not all(isinstance(k, str) for k in tensors):
            raise InvalidArgument("weight names must be str")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)
                                    or not 0 <= version < _MAX_VERSION):
            raise InvalidArgument(f"version must be an int in [0, 2**63 - 1); got {version!r}")
        rt = api.runtime()
        return rt, api._timeout(rt, timeout)

    async def _publish(self, node: Any, tensors: Mapping[str, Any], version: int | None,
                       limit: float) -> int:
        try:
            async with asyncio.timeout(limit):
                return await self._publish_steps(node, tensors, version, limit)
        except TimeoutError as exc:
            if isinstance(exc, Timeout):
                raise
            raise Timeout(f"channel {self.name!r}: publish did not finish within "
                          f"{limit:g}s") from None

    async def _publish_steps(self, node: Any, tensors: Mapping[str, Any], version: int | None,
                             limit: float) -> int:
        latest = await node.channel_head(self.name, -1, limit, wait=False)
        if version is not None and version <= latest:
            # Its ids may exist with other bytes, and the head never moves back.
            raise InvalidArgument(f"channel {self.name!r}: version {version} is not newer than "
                                  f"its head, {latest}; publish a newer version (or none: "
                                  "the next one is chosen)")
        if not self._adopted:
            await self._adopt(node, latest)
        version = await self._claim(node, version, latest)
        keys = list(tensors)
        done: list[ObjectID] = []
        try:
            for key in keys:
                done.append(await node.put(tensors[key], _oid(self.name, version, "t/" + key)))
            # (`held`: the versions this publisher has not freed, which a
            # publisher that restarts takes over, whatever their numbers)
            manifest = m.encode(m.Manifest(version=version, keys=keys,
                                           held=sorted(self._published)))
            await node.put(manifest, _oid(self.name, version, "manifest"))
        except BaseException:
            # None of this version may stay: a later publish of it would find
            # these ids taken and keep their bytes, mixing two versions. In the
            # background: a publish past its deadline (or cancelled) returns at
            # once, and the deletes are not cut short by that deadline.
            node.in_background(_quietly(node.delete_many(
                [*done, _oid(self.name, version, "claim")])))
            raise
        # From here the head may move even if this call fails (an answer that
        # came after the deadline): the version is freed with the others.
        self._published[version] = keys
        await node.channel_publish(self.name, version)
        await self._free_old(node, version)
        return version

    async def _adopt(self, node: Any, latest: int) -> None:
        """Take over the newest versions an earlier publisher left (a learner
        restarted): they are freed as this publisher's own are, instead of
        staying with every reader that fetched them."""
        candidates = set(range(max(0, latest - self.keep + 1), latest + 1))
        done: set[int] = set()
        while candidates - done:
            old = max(candidates - done)  # (the head first: its manifest names the rest)
            done.add(old)
            oid = _oid(self.name, old, "manifest")
            try:
                if old not in self._published and await _exists(node, oid):
                    manifest = m.decode_manifest(
                        f"manifest {oid.hex()}", await node.get(oid, node.config.connect_timeout_s))
                    self._published[old] = manifest.keys
                    candidates.update(v for v in manifest.held if 0 <= v < old)
            except (HopliteError, ValueError, KeyError, TypeError):
                continue  # (freed meanwhile, or not a manifest of ours: left as it is)
        self._adopted = True  # (only now: a publish cut short here adopts at the next one)

    async def _claim(self, node: Any, version: int | None, latest: int) -> int:
        """Claim `version` (None: the next free one) for this publisher alone.
        The claim is an empty array of shape (0, n), n drawn at random: a put
        of the id with another layout is refused (objects are immutable), so
        of two publishers of one version exactly one gets it."""
        shape = (0, int.from_bytes(os.urandom(7), "big") + 1)
        for _ in range(64):  # (versions taken by others: the next one)
            chosen = max(latest, self._tried) + 1 if version is None else version
            self._tried = max(self._tried, chosen)
            try:
                await node.put(np.empty(shape, dtype=np.uint8), _oid(self.name, chosen, "claim"))
                if not await _exists(node, _oid(self.name, chosen, "manifest")):
                    return chosen
                # Published before, by a publisher that is gone, to a
                # directory that restarted since (it knows no head then):
                # readers still hold that version, and a put of its ids with
                # new bytes would be taken for more copies of the old ones.
                raise ObjectExists
            except ObjectExists:
                if version is not None:
                    raise ObjectExists(f"channel {self.name!r}: version {version} was published "
                                       "(or claimed) by another publisher") from None
        raise ObjectExists(f"channel {self.name!r}: 64 versions in a row were claimed by other "
                           "publishers")

    async def _free_old(self, node: Any, head: int) -> None:
        # Versions this publisher published, not version numbers: skipped
        # numbers (failed publishes, explicit versions) free nothing early.
        # A version is forgotten only once freed: a publish cut short here
        # frees it at the next one.
        for old in sorted(v for v in self._published if v <= head)[:-self.keep]:
            await node.delete_many([*(_oid(self.name, old, "t/" + key)
                                      for key in self._published[old]),
                                    _oid(self.name, old, "manifest"),
                                    _oid(self.name, old, "claim")])
            self._published.pop(old, None)

    # --------------------------------------------------------------- reader ---
    def latest_version(self) -> int:
        """The newest published version, or -1 if there is none yet (does not wait)."""
        rt = api.runtime()
        return rt.call(rt.node.channel_head(self.name, -1, rt.config.timeout_s, wait=False),
                       rt.config.timeout_s)

    async def latest_version_async(self) -> int:
        """`latest_version`, awaitable."""
        rt = api.runtime()
        return await rt.call_async(rt.node.channel_head(self.name, -1, rt.config.timeout_s,
                                                        wait=False))

    def fetch(self, *, newer_than: int = -1, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """The newest version (waiting for one newer than `newer_than`), as
        ``(version, {name: array})`` in the order they were published."""
        rt, limit = self._check_fetch(newer_than, timeout)
        return rt.call(self._fetch(rt.node, newer_than, limit), limit)

    async def fetch_async(self, *, newer_than: int = -1,
                          timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """`fetch`, awaitable."""
        rt, limit = self._check_fetch(newer_than, timeout)
        return await rt.call_async(self._fetch(rt.node, newer_than, limit))

    @staticmethod
    def _check_fetch(newer_than: int, timeout: float | None) -> tuple[Any, float]:
        if (not isinstance(newer_than, int) or isinstance(newer_than, bool)
                or not -1 <= newer_than < _MAX_VERSION):
            raise InvalidArgument(f"newer_than must be an int in [-1, 2**63 - 1) (-1: any "
                                  f"version); got {newer_than!r}")
        rt = api.runtime()
        return rt, api._timeout(rt, timeout)

    async def _fetch(self, node: Any, newer_than: int, limit: float) -> tuple[int, dict[str, Any]]:
        deadline = time.monotonic() + limit
        while True:
            left = max(0.001, deadline - time.monotonic())
            head = await node.channel_head(self.name, newer_than, left)
            got = await self._fetch_version(node, head, deadline)
            if got is not None:
                node.channel_seen(self.name, head)
                return head, got
            # That version was freed (a newer one is out) or lost with its
            # publisher: wait for a newer one. (Asking again for `head` would
            # get it back at once, and a lost one's get fails at once: a
            # loop hammering the directory until the deadline.)
            newer_than = max(newer_than, head)

    async def _fetch_version(self, node: Any, version: int,
                             deadline: float) -> dict[str, Any] | None:
        manifest = await self._get(node, _oid(self.name, version, "manifest"), version, deadline)
        if manifest is None:
            return None
        keys = m.decode_manifest(f"manifest of version {version}", manifest).keys
        out: dict[str, Any] = {}
        for key in keys:
            value = await self._get(node, _oid(self.name, version, "t/" + key), version, deadline)
            if value is None:
                return None
            out[key] = value
        return out

    async def _get(self, node: Any, oid: ObjectID, version: int, deadline: float) -> Any | None:
        """The object, or None if its version has been freed meanwhile. One get
        runs to the fetch's deadline (a large array may take long to arrive);
        every `_PROBE_S` without it, a check of whether the version was freed."""
        late = Timeout(f"channel {self.name!r}: version {version} did not arrive in time")
        left = deadline - time.monotonic()
        if left <= 0:
            raise late
        pending = asyncio.ensure_future(node.get(oid, left))
        try:
            while True:
                done, _ = await asyncio.wait(
                    [pending], timeout=min(_PROBE_S, max(0.001, deadline - time.monotonic())))
                if done:
                    try:
                        return pending.result()
                    except ObjectNotFound:
                        return None
                if time.monotonic() >= deadline:
                    raise late
                if await self._freed(node, oid, version, deadline):
                    return None
        finally:
            pending.cancel()  # (a get given up: its pull stops)

    async def _freed(self, node: Any, oid: ObjectID, version: int, deadline: float) -> bool:
        """Whether the publisher (whose `keep` may be smaller than ours) freed
        `version`: a newer one exists and this one's object is gone. Not known
        while the directory is away (a restart): then not, as far as we know."""
        left = max(0.001, min(deadline - time.monotonic(), node.config.timeout_s))
        try:
            async with asyncio.timeout(left):  # (both requests within the fetch's deadline)
                head = await node.channel_head(self.name, -1, left, wait=False)
                return head > version and not await _exists(node, oid)
        except (DirectoryUnavailable, TimeoutError):  # (Timeout is a TimeoutError)
            return False
