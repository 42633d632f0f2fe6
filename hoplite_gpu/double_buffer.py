"""Serving one version of a weight channel while the next one arrives.

A `DoubleBuffer` holds two sets of the same arrays (two state dicts, or two
torch modules): the front serves, the back receives. `update` fetches a newer
version into the back (`WeightChannel.fetch(out=...)`, in place), then swaps
the two under a lock, so a serving call sees one whole version, the old or
the new, never a mix, and never waits for a transfer. A serving call pins the
side it reads (`serving`); the next update writes into that side only once
every call that pinned it has let go (bounded by the update's deadline).

    weights = channel.double_buffer(model_a, model_b)
    # the updater (a thread or a task):   weights.update()
    # every request:
    with weights.serving() as (version, model):
        model(batch)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from . import api
from .errors import InvalidArgument, Timeout


def _arrays(side: Any) -> Mapping[str, Any]:
    """The arrays a side is written through: itself, or a module's state dict
    (its tensors share the parameters' memory)."""
    if isinstance(side, Mapping):
        return side
    return side.state_dict()


class DoubleBuffer:
    """Two sets of arrays of one channel: `serving()` the front, `update()` the back."""

    def __init__(self, channel: Any, front: Any, back: Any) -> None:
        for name, side in (("front", front), ("back", back)):
            if not isinstance(side, Mapping) and not callable(getattr(side, "state_dict", None)):
                raise InvalidArgument(f"DoubleBuffer: {name} must be a mapping of name -> "
                                      f"array or a torch module; got {type(side).__name__}")
        if front is back:
            raise InvalidArgument("DoubleBuffer: front and back must be two sets of arrays "
                                  "(a version arrives into one while the other serves)")
        self.channel = channel
        self._sides = (front, back)
        self._front = 0
        self._version = -1
        self._pins = [0, 0]
        self._state = threading.Condition()
        self._updating = threading.Lock()  # (held by the one update writing the back)

    @property
    def version(self) -> int:
        """The version the front holds (-1: none fetched yet, the arrays as given)."""
        with self._state:
            return self._version

    @contextlib.contextmanager
    def serving(self) -> Iterator[tuple[int, Any]]:
        """``(version, front)`` for the length of the block: that side is not
        written until the block ends."""
        with self._state:
            side = self._front
            self._pins[side] += 1
            held = self._version, self._sides[side]
        try:
            yield held
        finally:
            with self._state:
                self._pins[side] -= 1
                self._state.notify_all()

    def update(self, *, timeout: float | None = None) -> int:
        """Fetch a version newer than the front's into the back, then make the
        back the front; returns the new version. Waits (up to `timeout`, the
        runtime's `timeout_s` by default) for a newer version, and for the
        serving calls still reading the back to end."""
        deadline = time.monotonic() + api._timeout(api.runtime(), timeout)
        self._begin("update")
        try:
            back = self._unpinned_back(deadline)
            version, _ = self.channel.fetch(newer_than=self.version, timeout=_left(deadline),
                                            out=_arrays(self._sides[back]))
            return self._swap(back, version)
        finally:
            self._updating.release()

    async def update_async(self, *, timeout: float | None = None) -> int:
        """`update`, awaitable (the wait for the pins runs on a worker thread)."""
        deadline = time.monotonic() + api._timeout(api.runtime(), timeout)
        self._begin("update_async")
        try:
            back = await asyncio.to_thread(self._unpinned_back, deadline)
            version, _ = await self.channel.fetch_async(
                newer_than=self.version, timeout=_left(deadline), out=_arrays(self._sides[back]))
            return self._swap(back, version)
        finally:
            self._updating.release()

    def _begin(self, call: str) -> None:
        if not self._updating.acquire(blocking=False):
            raise InvalidArgument(f"DoubleBuffer.{call}: another update of this buffer is under "
                                  "way (updates write the back one at a time)")

    def _unpinned_back(self, deadline: float) -> int:
        with self._state:
            back = 1 - self._front
            if not self._state.wait_for(lambda: self._pins[back] == 0, timeout=_left(deadline)):
                raise Timeout(f"DoubleBuffer: {self._pins[back]} serving call(s) still read the "
                              "previous version: the next one cannot be written into it")
            return back

    def _swap(self, back: int, version: int) -> int:
        with self._state:
            self._front, self._version = back, version
        return version


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
