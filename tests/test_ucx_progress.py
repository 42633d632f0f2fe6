"""The UCX transport's progress driver (transports/ucx_progress.py) on a stand-in
worker: idle waits sleep on the event fd, transfers in flight are polled, a
cancelled waiter stops the polling, and request errors reach their waiter.
Runs without ucxx; the real worker is covered by the UCX test pass and by
tests/test_progress_bench.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from transports import ucx_progress
from transports.ucx_progress import Progress


class FakeRequest:
    def __init__(self) -> None:
        self.completed = False
        self.error: BaseException | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


class FakeWorker:
    """A worker whose event fd is one end of a socket pair: `signal` makes it
    readable, progress() drains it and completes the requests marked due."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self.epoll_file_descriptor = self._r.fileno()
        self.progress_calls = 0
        self.due: list[FakeRequest] = []
        self.busy = False  # arm() refuses while UCX has work of its own

    def init_blocking_progress_mode(self) -> None:
        pass

    def progress(self) -> None:
        self.progress_calls += 1
        try:
            while self._r.recv(64):
                pass
        except BlockingIOError:
            pass
        for req in self.due:
            req.completed = True
        self.due.clear()

    def arm(self) -> bool:
        return not self.busy

    def signal(self, *requests: FakeRequest) -> None:
        self.due.extend(requests)
        self._w.send(b"x")

    def close(self) -> None:
        self._r.close()
        self._w.close()


def _run(case):
    """The suite has no asyncio plugin: each test runs its coroutine on a fresh loop."""
    def test():
        asyncio.run(asyncio.wait_for(case(), 10))
    test.__name__ = case.__name__
    test.__doc__ = case.__doc__
    return test


@contextlib.asynccontextmanager
async def _driver() -> AsyncIterator[tuple[Progress, FakeWorker]]:
    worker = FakeWorker()
    driver = Progress(worker, asyncio.get_running_loop(), int, bytes)
    try:
        yield driver, worker
    finally:
        driver.close()
        worker.close()


async def _calls_during(worker: FakeWorker, seconds: float, settle: float = 0.01) -> int:
    """Progress calls in `seconds`, counted after `settle` (past the linger)."""
    await asyncio.sleep(settle)
    calls = worker.progress_calls
    await asyncio.sleep(seconds)
    return worker.progress_calls - calls


@_run
async def test_an_idle_wait_sleeps_on_the_fd_and_wakes_on_an_event():
    async with _driver() as (driver, worker):
        req = FakeRequest()
        waiter = asyncio.ensure_future(driver._wait(req, None, active=False))
        # settled: armed, asleep
        assert await _calls_during(worker, 0.1, settle=0.05) <= 1  # the watchdog at most
        assert not waiter.done()
        worker.signal(req)
        await asyncio.wait_for(waiter, 1.0)


@_run
async def test_a_transfer_in_flight_is_polled_until_it_completes():
    async with _driver() as (driver, worker):
        req = FakeRequest()
        waiter = asyncio.ensure_future(driver._wait(req, None, active=True))
        # past the linger that any request gets: every loop iteration, not on events only
        assert await _calls_during(worker, 0.02) > 5
        req.completed = True  # completes without any fd event (a device copy)
        await asyncio.wait_for(waiter, 1.0)
        assert await _calls_during(worker, 0.05) <= 1  # linger, then armed again


@_run
async def test_a_cancelled_active_waiter_stops_the_polling():
    async with _driver() as (driver, worker):
        waiter = asyncio.ensure_future(driver._wait(FakeRequest(), None, active=True))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await _calls_during(worker, 0.05) <= 1


@_run
async def test_a_failed_request_raises_in_its_waiter():
    async with _driver() as (driver, worker):
        req = FakeRequest()
        req.error = ConnectionResetError("peer gone")
        waiter = asyncio.ensure_future(driver._wait(req, None, active=False))
        await asyncio.sleep(0.01)
        worker.signal(req)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(waiter, 1.0)


@_run
async def test_the_watchdog_completes_a_request_whose_event_was_missed():
    async with _driver() as (driver, worker):
        req = FakeRequest()
        waiter = asyncio.ensure_future(driver._wait(req, None, active=False))
        await asyncio.sleep(0.01)
        worker.due.append(req)  # completes at the next progress, but no event comes
        await asyncio.wait_for(waiter, ucx_progress.WATCHDOG_S * 2 + 0.5)


@_run
async def test_arming_waits_until_ucx_has_no_work_left():
    async with _driver() as (driver, worker):
        worker.busy = True
        worker.signal()
        await asyncio.sleep(0.02)
        assert worker.progress_calls > 5  # arm() refused: keep progressing
        worker.busy = False
        assert await _calls_during(worker, 0.05) <= 1
