"""Versioned weight broadcast: a learner publishes versions of a set of named
arrays (a state dict); readers fetch the newest version, or wait for a newer
one, and always get one complete version, never a mix.

A version is one object per kind of memory (`hoplite_gpu.packing`): every
tensor's bytes back to back, so a fetch is one pipelined, receiver-driven
transfer at a broadcast's speed, with no per-tensor cost. A small manifest,
named like the version's parts from the channel and the version number, says
where each tensor lies; it is put after the parts, and only then does the
directory's head for the channel move, so a reader never sees a version
before all of it is in, and two readers of two versions never mix them. A
version is first claimed: a publisher puts the version's claim, an empty
object whose shape only it uses, and since objects are immutable a second
publisher of that version gets `ObjectExists` (and, choosing versions itself,
takes the next one) instead of mixing its bytes into the first one's. A late
joiner gets the current version without the learner doing anything. The
publisher frees versions older than its last `keep` published ones; a reader
caught fetching a freed version (too far behind) starts over from the
newest, and a version no copy is left of raises `VersionLost` at once.

`fetch(out=...)` writes a version into the caller's own arrays (checked
against the version first); `load_into` does so for a torch module; and
`hoplite_gpu.double_buffer.DoubleBuffer` serves one version while the next
arrives into a second set of arrays.

Every call has an asyncio twin (`publish_async`, `fetch_async`, ...) for
event loops of the caller's own, such as a Ray async actor's or a serving
replica's: one body, run on the runtime's loop either way, so a cancelled
twin stops the call as its timeout would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Coroutine, Mapping
from typing import Any

import numpy as np

from . import api, device, packing
from . import messages as m
from .errors import (
    DirectoryUnavailable,
    HopliteError,
    InvalidArgument,
    ObjectExists,
    ObjectNotFound,
    Timeout,
    VersionLost,
)
from .ids import ObjectID
from .values import to_buffer

#: How long a reader waits for a part before checking whether its version was freed.
_PROBE_S = 1.0
#: Versions are below this: the wire carries them as 64-bit signed ints (and
#: the next one is chosen as the head + 1).
_MAX_VERSION = (1 << 63) - 1


def _oid(name: str, version: int, part: str) -> ObjectID:
    return ObjectID.from_name(f"hoplite-channel/{name}/{version}/{part}")


def _part(name: str, version: int, index: int) -> ObjectID:
    return _oid(name, version, f"pack/{index}")


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


async def _all(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Every coroutine's result; on the first error the others are stopped."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _registered(node: Any, oid: ObjectID, nbytes: int,
                      pieces: list[tuple[int, Any]]) -> asyncio.Future:
    """Start the put of a host part; its task, once the directory has the
    part (or once the put is done: a small part travels inline)."""
    known = asyncio.get_running_loop().create_future()

    def registered() -> None:
        if not known.done():
            known.set_result(None)

    task = asyncio.ensure_future(node.put_pieces(oid, nbytes, pieces, registered=registered))
    try:
        await asyncio.wait({task, known}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _stopped([task])
        raise
    if task.done():
        task.result()  # (its error, if it failed)
    return task


async def _stopped(tasks: list[asyncio.Future]) -> None:
    """Cancel the tasks not done, and wait until none runs (none reads the
    caller's arrays any more)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _check_version(version: Any, what: str, low: int = 0) -> None:
    if (not isinstance(version, int) or isinstance(version, bool)
            or not low <= version < _MAX_VERSION):
        raise InvalidArgument(f"{what} must be an int in [{low}, 2**63 - 1); got {version!r}")


class WeightChannel:
    """``WeightChannel("policy").publish(state_dict)`` on the learner;
    ``version, weights = WeightChannel("policy").fetch()`` on every actor."""

    def __init__(self, name: str, *, keep: int = 2) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"a channel needs a non-empty name; got {name!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidArgument(f"keep must be an int >= 1; got {keep!r}")
        self.name, self.keep = name, keep
        self._published: dict[int, int] = {}  # version -> its parts, for freeing
        #: the highest version this publisher tried: a failed one is not reused
        self._tried = -1
        self._adopted = False
        #: the host part's bytes of the last version this channel published or
        #: fetched: the next one's buffer is made ready ahead (`_prepare`)
        self._host_bytes = 0

    # ------------------------------------------------------------ publisher ---
    def publish(self, tensors: Mapping[str, Any], *, version: int | None = None,
                timeout: float | None = None) -> int:
        """Lay every array out in the version's parts, then make this version
        the channel's head; returns it. `timeout` bounds the whole call
        (default: the runtime's `timeout_s`)."""
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
        if version is not None:
            _check_version(version, "version")
        rt = api.runtime()
        return rt, api._timeout(rt, timeout)

    async def _publish(self, node: Any, tensors: Mapping[str, Any], version: int | None,
                       limit: float) -> int:
        try:
            async with asyncio.timeout(limit):
                return await self._publish_steps(node, tensors, version)
        except TimeoutError as exc:
            if isinstance(exc, Timeout):
                raise
            raise Timeout(f"channel {self.name!r}: publish did not finish within "
                          f"{limit:g}s") from None

    async def _publish_steps(self, node: Any, tensors: Mapping[str, Any],
                             version: int | None) -> int:
        latest = await node.channel_head(self.name, -1, node.config.timeout_s, wait=False)
        if version is not None and version <= latest:
            # Its ids may exist with other bytes, and the head never moves back.
            raise InvalidArgument(f"channel {self.name!r}: version {version} is not newer than "
                                  f"its head, {latest}; publish a newer version (or none: "
                                  "the next one is chosen)")
        # (before the claim: a value that cannot be sent costs no version number)
        encoded = {key: to_buffer(value) for key, value in tensors.items()}
        slots, parts = packing.plan([(key, layout) for key, (_, layout) in encoded.items()])
        if not self._adopted:
            await self._adopt(node, latest)
        version = await self._claim(node, version, latest)
        copying = await self._put_version(node, version, encoded, slots, parts)
        try:
            # From here the head may move even if this call fails (an answer that
            # came after the deadline): the version is freed with the others.
            self._published[version] = len(parts)
            await node.channel_publish(self.name, version)
            # Readers pull the front of the host part while its tail is still
            # copied in; the caller's arrays are read until that copy ends.
            await asyncio.gather(*copying)
        finally:
            await _stopped(copying)
        await self._free_old(node, version)
        self._host_bytes = sum(p.nbytes for p in parts if not p.device)
        self._prepare(node)  # (for the next version)
        return version

    async def _put_version(self, node: Any, version: int, encoded: dict[str, Any],
                           slots: list[packing.Slot], parts: list[packing.Part]
                           ) -> list[asyncio.Future]:
        """Put the version's parts, then its manifest; returns the copies still
        under way (a host part is registered before its bytes are in)."""
        made = [_oid(self.name, version, "claim")]
        copying: list[asyncio.Future] = []
        try:
            for index, part in enumerate(parts):
                pieces = [(s.offset, encoded[s.key][0]) for s in slots if s.part == index]
                made.append(_part(self.name, version, index))
                if part.device:
                    await node.put(device.pack(part.nbytes, pieces), made[-1])
                else:
                    copying.append(await _registered(node, made[-1], part.nbytes, pieces))
            # (`held`: the versions this publisher has not freed, which a
            # publisher that restarts takes over, whatever their numbers)
            manifest = packing.to_manifest(version, slots, parts, sorted(self._published))
            made.append(_oid(self.name, version, "manifest"))
            await node.put(m.encode(manifest), made[-1])
        except BaseException:
            # None of this version may stay: a later publish of it would find
            # these ids taken and keep their bytes, mixing two versions. In the
            # background: a publish past its deadline (or cancelled) returns at
            # once, and the deletes are not cut short by that deadline.
            await _stopped(copying)
            node.in_background(_quietly(node.delete_many(made)))
            raise
        return copying

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
                    self._published[old] = len(manifest.parts)
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
            await node.delete_many([*(_part(self.name, old, i)
                                      for i in range(self._published[old])),
                                    _oid(self.name, old, "manifest"),
                                    _oid(self.name, old, "claim")])
            self._published.pop(old, None)

    # ------------------------------------------------------------ who has it ---
    def holders(self, version: int) -> dict[str, Any]:
        """Who holds `version`: ``{"version", "nbytes", "complete": [node ids
        holding all of it], "partial": {node id: bytes so far}, "lost"}``
        (from what the directory knows of its parts, as `object_info`).
        ObjectNotFound if the channel has no such version (never published,
        or freed)."""
        _check_version(version, "version")
        rt = api.runtime()
        return rt.call(self._holders(rt.node, version), rt.config.timeout_s)

    async def holders_async(self, version: int) -> dict[str, Any]:
        """`holders`, awaitable."""
        _check_version(version, "version")
        rt = api.runtime()
        return await rt.call_async(self._holders(rt.node, version))

    async def _holders(self, node: Any, version: int) -> dict[str, Any]:
        oid = _oid(self.name, version, "manifest")
        if not await _exists(node, oid):
            # (a manifest too large to travel inline is lost with its holders too)
            raise ObjectNotFound(f"channel {self.name!r} has no version {version}: never "
                                 "published, freed by its publisher, or lost with it")
        raw = await node.get(oid, node.config.timeout_s)
        _, parts = packing.read_manifest(f"manifest of version {version}",
                                         m.decode_manifest(f"manifest of version {version}", raw))
        have: dict[str, int] = {}
        whole: set[str] | None = None
        lost = False
        for index in range(len(parts)):
            try:
                info = await node.query(_part(self.name, version, index))
            except ObjectNotFound:  # (the manifest is there: the part was lost, not freed)
                lost = True
                continue
            done = {h["node"] for h in info["holders"] if h["complete"]}
            whole = done if whole is None else whole & done
            for h in info["holders"]:
                have[h["node"]] = have.get(h["node"], 0) + h["nbytes"]
        complete = sorted(whole or ()) if not lost else []
        return {"version": version, "nbytes": sum(p.nbytes for p in parts),
                "complete": complete, "lost": lost,
                "partial": {n: b for n, b in sorted(have.items()) if n not in complete}}

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

    def fetch(self, *, newer_than: int = -1, timeout: float | None = None,
              out: Mapping[str, Any] | None = None,
              array_type: str = "cupy") -> tuple[int, dict[str, Any]]:
        """The newest version (waiting for one newer than `newer_than`), as
        ``(version, {name: array})`` in the order they were published: NumPy
        arrays are read-only views of the received version (no copy), torch
        tensors fresh copies, device arrays fresh arrays of `array_type`.

        With `out` (name -> NumPy array, torch tensor or CuPy array), the
        version is written into those arrays instead, and `out` returned:
        their names, shapes and element types must be the version's (checked
        before its bytes are pulled; InvalidArgument says what differs). No
        tensor is allocated: the version is received into a buffer the node
        reuses once the publisher frees that version."""
        rt, limit, found = self._check_fetch(newer_than, timeout, out, array_type)
        version, slots, parts, made = rt.call(
            self._fetch(rt.node, newer_than, limit, found, array_type), limit)
        return version, self._finish(slots, parts, made, found, out, array_type)

    async def fetch_async(self, *, newer_than: int = -1, timeout: float | None = None,
                          out: Mapping[str, Any] | None = None,
                          array_type: str = "cupy") -> tuple[int, dict[str, Any]]:
        """`fetch`, awaitable (copies into `out` run on a worker thread)."""
        rt, limit, found = self._check_fetch(newer_than, timeout, out, array_type)
        version, slots, parts, made = await rt.call_async(
            self._fetch(rt.node, newer_than, limit, found, array_type))
        if found is None:
            return version, self._finish(slots, parts, made, found, out, array_type)
        return version, await asyncio.to_thread(self._finish, slots, parts, made, found, out,
                                                array_type)

    def load_into(self, module: Any, *, newer_than: int = -1,
                  timeout: float | None = None) -> int:
        """Write the newest version into a torch module's parameters and
        buffers, in place (`fetch(out=module.state_dict())`); returns the
        version. Forward passes running meanwhile may see a mix of versions:
        `DoubleBuffer` serves one while the next arrives."""
        version, _ = self.fetch(newer_than=newer_than, timeout=timeout,
                                out=_state_dict(module, "load_into"))
        return version

    async def load_into_async(self, module: Any, *, newer_than: int = -1,
                              timeout: float | None = None) -> int:
        """`load_into`, awaitable."""
        version, _ = await self.fetch_async(newer_than=newer_than, timeout=timeout,
                                            out=_state_dict(module, "load_into_async"))
        return version

    @staticmethod
    def _check_fetch(newer_than: int, timeout: float | None, out: Any,
                     array_type: str) -> tuple[Any, float, dict[str, packing.Target] | None]:
        _check_version(newer_than, "newer_than (-1: any version)", low=-1)
        api._check_array_type(array_type)
        found = None if out is None else packing.targets(out)
        rt = api.runtime()
        return rt, api._timeout(rt, timeout), found

    def _finish(self, slots: list[packing.Slot], parts: list[Any], made: dict[str, Any],
                found: dict[str, packing.Target] | None, out: Mapping[str, Any] | None,
                array_type: str) -> dict[str, Any]:
        """What a fetch returns, finished on the caller's thread: host copies
        into `out` (the node's loop made the device ones), or the values."""
        if found is not None:
            packing.copy_into(slots, parts, found, loop=False)
            return out
        made.update(packing.values(slots, parts, array_type, loop=False))
        return {slot.key: made[slot.key] for slot in slots}

    async def _fetch(self, node: Any, newer_than: int, limit: float,
                     found: dict[str, packing.Target] | None = None, array_type: str = "cupy"
                     ) -> tuple[int, list[packing.Slot], list[Any], dict[str, Any]]:
        deadline = time.monotonic() + limit
        self._prepare(node)  # (while the next version is awaited)
        while True:
            left = max(0.001, deadline - time.monotonic())
            head = await node.channel_head(self.name, newer_than, left)
            got = await self._fetch_version(node, head, deadline, found)
            if got is not None:
                slots, parts = got
                self._host_bytes = sum(p.nbytes for p in parts if isinstance(p, np.ndarray))
                self._prepare(node)  # (for the next version)
                made = {}
                if found is not None:  # (device copies: ordered on this thread's stream)
                    packing.copy_into(slots, parts, found, loop=True)
                else:
                    made = packing.values(slots, parts, array_type, loop=True)
                node.channel_seen(self.name, head)
                return head, slots, parts, made
            # That version was freed: a newer one is out (the reader was too
            # far behind). (Asking again for `head` would get it back at once.)
            newer_than = max(newer_than, head)

    def _prepare(self, node: Any) -> None:
        """In the background, have a buffer of the last version's host part,
        its pages touched, free in this node's pool for the next version
        (`ChunkStore.prepare`; nothing once the versions' buffers cycle
        through the pool): fresh memory's page faults are then paid while
        the reader waits or the learner trains, not while the version
        arrives."""
        if self._host_bytes:
            node.in_background(node.store.prepare(self._host_bytes))

    async def _fetch_version(self, node: Any, version: int, deadline: float,
                             found: dict[str, packing.Target] | None = None
                             ) -> tuple[list[packing.Slot], list[Any]] | None:
        """The version's slots and parts, or None if it was freed meanwhile.
        A device part comes as CuPy (NumPy without a GPU): each tensor is
        made from it as the caller asks, or copied into the caller's array."""
        raw = await self._get(node, _oid(self.name, version, "manifest"), version, deadline)
        if raw is None:
            return None
        what = f"channel {self.name!r}: the manifest of version {version}"
        slots, parts = packing.read_manifest(what, m.decode_manifest(what, raw))
        if found is not None:
            packing.check(f"fetch(out=...) of channel {self.name!r}, version {version}",
                          slots, found)
        got = await _all([self._get(node, _part(self.name, version, i), version, deadline,
                                    "cupy" if part.device else "numpy")
                          for i, part in enumerate(parts)])
        return None if any(g is None for g in got) else (slots, got)

    async def _get(self, node: Any, oid: ObjectID, version: int, deadline: float,
                   array_type: str = "numpy") -> Any | None:
        """The object, or None if its version has been freed meanwhile;
        `VersionLost` if no copy of it is left. One get runs to the fetch's
        deadline (a large part may take long to arrive); every `_PROBE_S`
        without it, a check of whether the version was freed."""
        late = Timeout(f"channel {self.name!r}: version {version} did not arrive in time")
        left = deadline - time.monotonic()
        if left <= 0:
            raise late
        pending = asyncio.ensure_future(node.get(oid, left, array_type))
        try:
            while True:
                done, _ = await asyncio.wait(
                    [pending], timeout=min(_PROBE_S, max(0.001, deadline - time.monotonic())))
                if done:
                    try:
                        return pending.result()
                    except ObjectNotFound as exc:
                        return await self._gone(node, version, deadline, exc)
                if time.monotonic() >= deadline:
                    raise late
                if await self._freed(node, oid, version, deadline):
                    return None
        finally:
            pending.cancel()  # (a get given up: its pull stops)

    async def _gone(self, node: Any, version: int, deadline: float, exc: ObjectNotFound) -> None:
        """A part of `version` is gone: freed (a newer version is out: None,
        the reader moves on to it) or lost (it is the head: `VersionLost`)."""
        left = max(0.001, min(deadline - time.monotonic(), node.config.timeout_s))
        if await node.channel_head(self.name, -1, left, wait=False) > version:
            return None
        cause = ("every process that held all of it (its publisher, and any reader that had "
                 "fetched it) left the cluster" if "was lost" in str(exc) else str(exc))
        raise VersionLost(f"channel {self.name!r}: version {version} is lost: {cause}; "
                          f"fetch(newer_than={version}) waits for a newer one",
                          self.name, version) from None

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

    def double_buffer(self, front: Any, back: Any) -> Any:
        """A `DoubleBuffer` of this channel over two sets of arrays (or two
        torch modules): one serves while the next version arrives into the
        other."""
        from .double_buffer import DoubleBuffer

        return DoubleBuffer(self, front, back)


def _state_dict(module: Any, call: str) -> Mapping[str, Any]:
    state = getattr(module, "state_dict", None)
    if not callable(state):
        raise InvalidArgument(f"{call} takes a torch module (with a state_dict()); got "
                              f"{type(module).__name__}")
    return state()
