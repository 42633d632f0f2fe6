"""Edges of the UCX transport (transports/ucx.py) where it parts from what the
Stream/Listener contract (transports/base.py), the TCP backend and the docs
promise. Each test is bounded with asyncio.timeout (UCX can hang) and runs
only where ucxx is usable (the `ucx` entry of `tc.scheme_params()`)."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest
import transport_checks as tc

ucx_only = pytest.mark.parametrize(
    "scheme", [p for p in tc.scheme_params() if p.values[0] == "ucx"])


@ucx_only
def test_recv_steps_takes_a_message_larger_than_64_mib(scheme):
    """recv_steps must fill its buffer whatever sizes the sender used (TCP
    does; docs/protocol.md: a UCX message that straddles receives "is staged
    on the host"). UCX falls back to the base recv_steps, which receives step
    by step, so one send of more than 64 MiB (_MAX_STAGED) straddles a step
    and the stream ends with TransportError "malformed UCX message head",
    although the peer sent nothing malformed."""
    n = (64 << 20) + 1
    data = np.full(n, 0x5A, np.uint8)
    data[-1] = 7
    dest = np.zeros(n, np.uint8)
    marks: list[int] = []

    async def main() -> None:
        async with asyncio.timeout(20):
            async with tc.connected_pair(scheme) as (client, server):
                sending = asyncio.ensure_future(client.send(memoryview(data)))
                try:
                    await server.recv_steps(memoryview(dest), 4 << 20, marks.append)
                    await sending
                finally:
                    sending.cancel()
                    with contextlib.suppress(BaseException):
                        await sending

    asyncio.run(main())
    assert marks and marks[-1] == n
    np.testing.assert_array_equal(dest, data)


@ucx_only
def test_a_cancelled_receive_stays_cancelled_when_its_stream_is_closed_too(scheme):
    """A task blocked in recv_into is cancelled by its owner, who then closes
    the stream (the usual clean-up order). Over TCP the task ends cancelled
    (close() marks its own cancels, `_CLOSED`); over UCX `_guard` takes any
    cancel on a closed stream for close()'s, uncancels it and raises
    TransportClosed, so the owner's cancellation is lost: the task goes on
    (a retry loop catching TransportClosed keeps running after its cancel)."""

    async def main() -> asyncio.Task:
        async with asyncio.timeout(10):
            async with tc.connected_pair(scheme) as (client, _server):
                task = asyncio.ensure_future(client.recv_into(memoryview(bytearray(10))))
                await asyncio.sleep(0.05)
                assert not task.done()
                task.cancel()
                await client.close()
                with contextlib.suppress(BaseException):
                    await task
                return task

    task = asyncio.run(main())
    assert task.cancelled(), \
        f"the cancelled receive ended with {task.exception()!r} instead of its cancellation"

