"""The UCX transport's stream (transports/ucx.py) where it parts from what the
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



@ucx_only
def test_connect_keeps_one_deadline_for_the_endpoint_and_the_welcome(scheme, monkeypatch):
    """`connect(address, timeout)` waited up to `timeout` for UCX's endpoint
    and then up to `timeout` again for the listener's welcome, so a slow
    peer held the caller for nearly twice its deadline (and the late answer
    was then called a refusal). Now one deadline covers both, and running
    out is Timeout."""
    import time

    from hoplite_gpu.errors import Timeout
    from hoplite_gpu.transports import get_backend, ucx

    real_connect = ucx._connect_endpoint

    async def slow_endpoint(ucxx, host, port, timeout):
        ep = await real_connect(ucxx, host, port, timeout)
        await asyncio.sleep(0.6)  # UCX's handshake took most of the deadline
        return ep

    real_accept = ucx.UCXListener._accept

    async def slow_welcome(self, endpoint):
        await asyncio.sleep(1.2)  # the listener is slow to answer too
        await real_accept(self, endpoint)

    monkeypatch.setattr(ucx, "_connect_endpoint", slow_endpoint)
    monkeypatch.setattr(ucx.UCXListener, "_accept", slow_welcome)

    async def main() -> tuple[type | None, float]:
        backend = get_backend(scheme)
        listener = await backend.listen("127.0.0.1", 0, lambda stream: asyncio.sleep(5))
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(10):
                stream = await backend.connect(listener.address, 1.0)
                await stream.close()
                return None, time.monotonic() - t0
        except Timeout:
            return Timeout, time.monotonic() - t0
        finally:
            await listener.close()

    raised, took = asyncio.run(main())
    assert raised is Timeout and took < 1.15, (raised, took)
