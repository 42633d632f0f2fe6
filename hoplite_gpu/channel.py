"""Versioned weight broadcast: a learner publishes versions of a set of named
arrays (a state dict); readers fetch the newest version, or wait for a newer
one, and always get one complete version, never a mix.

Each version's arrays are ordinary immutable objects, named from the channel,
the version and the key, and put in order (so a reader pipelines the first
arrays while later ones are still being put); a small manifest is put after the
arrays and only then does the directory's head for the channel move. A late
joiner gets the current version without the learner doing anything. The
publisher frees versions older than its last `keep`; a reader caught fetching a
freed version starts over from the newest.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import msgpack

from . import api
from .errors import HopliteError, InvalidArgument, ObjectNotFound, Timeout
from .ids import ObjectID

#: How long a reader waits for one array before checking whether its version was freed.
_PROBE_S = 1.0


def _oid(name: str, version: int, part: str) -> ObjectID:
    return ObjectID.from_name(f"hoplite-channel/{name}/{version}/{part}")


def _exists(oid: ObjectID) -> bool:
    try:
        api.object_info(oid)
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

    # ------------------------------------------------------------ publisher ---
    def publish(self, tensors: Mapping[str, Any], *, version: int | None = None) -> int:
        """Put every array, then make this version the channel's head; returns it."""
        if not isinstance(tensors, Mapping) or not tensors:
            raise InvalidArgument("publish takes a non-empty mapping of name -> array")
        if not all(isinstance(k, str) for k in tensors):
            raise InvalidArgument("weight names must be str")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)
                                    or version < 0):
            raise InvalidArgument(f"version must be an int >= 0; got {version!r}")
        rt = api.runtime()
        latest = self.latest_version()
        if version is None:
            version = max(latest, self._tried) + 1
        elif version <= latest:
            # Its ids may exist with other bytes, and the head never moves back.
            raise InvalidArgument(f"channel {self.name!r}: version {version} is not newer than "
                                  f"its head, {latest}; publish a newer version (or none: "
                                  "the next one is chosen)")
        self._tried = max(self._tried, version)
        keys = list(tensors)
        done: list[ObjectID] = []
        try:
            for key in keys:
                done.append(api.put(tensors[key], _oid(self.name, version, "t/" + key)))
            manifest = msgpack.packb({"version": version, "keys": keys}, use_bin_type=True)
            api.put(manifest, _oid(self.name, version, "manifest"))
        except BaseException:
            # None of this version may stay: a later publish of it would find
            # these ids taken and keep their bytes, mixing two versions.
            for oid in done:
                with contextlib.suppress(HopliteError):
                    api.delete(oid)
            raise
        # From here the head may move even if this call fails (an answer that
        # came after the deadline): the version is freed with the others.
        self._published[version] = keys
        rt.call(rt.node.channel_publish(self.name, version), rt.config.timeout_s)
        self._free_old(version)
        return version

    def _free_old(self, head: int) -> None:
        for old in [v for v in self._published if v <= head - self.keep]:
            for key in self._published.pop(old):
                api.delete(_oid(self.name, old, "t/" + key))
            api.delete(_oid(self.name, old, "manifest"))

    # --------------------------------------------------------------- reader ---
    def latest_version(self) -> int:
        """The newest published version, or -1 if there is none yet (does not wait)."""
        rt = api.runtime()
        return rt.call(rt.node.channel_head(self.name, -1, rt.config.timeout_s, wait=False),
                       rt.config.timeout_s)

    def fetch(self, *, newer_than: int = -1, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        """The newest version (waiting for one newer than `newer_than`), as
        ``(version, {name: array})`` in the order they were published."""
        if not isinstance(newer_than, int) or isinstance(newer_than, bool):
            raise InvalidArgument(f"newer_than must be an int (-1: any version); got "
                                  f"{newer_than!r}")
        rt = api.runtime()
        limit = api._timeout(rt, timeout)
        deadline = time.monotonic() + limit
        while True:
            left = max(0.001, deadline - time.monotonic())
            head = rt.call(rt.node.channel_head(self.name, newer_than, left), left)
            got = self._fetch_version(head, deadline)
            if got is not None:
                return head, got
            newer_than = max(newer_than, head - 1)  # that version was freed: take a newer one

    def _fetch_version(self, version: int, deadline: float) -> dict[str, Any] | None:
        manifest = self._get(_oid(self.name, version, "manifest"), version, deadline)
        if manifest is None:
            return None
        keys = msgpack.unpackb(manifest, raw=False)["keys"]
        out: dict[str, Any] = {}
        for key in keys:
            value = self._get(_oid(self.name, version, "t/" + key), version, deadline)
            if value is None:
                return None
            out[key] = value
        return out

    def _get(self, oid: ObjectID, version: int, deadline: float) -> Any | None:
        """The object, or None if its version has been freed meanwhile."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"channel {self.name!r}: version {version} did not arrive in time")
            try:
                return api.get(oid, timeout=min(_PROBE_S, left))
            except ObjectNotFound:
                return None
            except Timeout:
                # Freed by the publisher (whose `keep` may be smaller than
                # ours): a newer version exists and this one is gone.
                if self.latest_version() > version and not _exists(oid):
                    return None
