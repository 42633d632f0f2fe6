"""A deadline on one awaited future, as a timer on the future itself.

`asyncio.timeout` cancels the awaiting task at the deadline and uncancels it
after: it looks up the current task on entry (a `getpid` system call on
Python 3.11) and reschedules itself on exit. The request paths (every get,
put and reduce request) await one future each, so they fail that future
instead."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class Expired(Exception):
    """The deadline of `until` passed."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(Expired())


async def until(fut: asyncio.Future, deadline: float) -> Any:
    """Await `fut`, which fails with Expired at `deadline` (time.monotonic())."""
    timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()),
                                                  _expire, fut)
    try:
        return await fut
    finally:
        timer.cancel()
