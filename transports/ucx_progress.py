"""UCX progress without a spinning core: ucxx's blocking mode, event-driven.

Why this module exists. In ucxx 0.52's ``blocking`` progress mode two things
keep a process's core busy even when nothing happens:

* its progress object watches the worker's event fd but never re-arms the
  worker after the first event, so the fd stays readable and the loop calls
  ``worker.progress()`` on every iteration;
* a request is awaited with ``UCXRequest.wait_yield``, which yields to the loop
  until the request completes; a node always has a receive posted (its
  connections' next message), so that loop never ends.

Measured on a 2-core VM (``python -m benchmarks progress``): 99-100 % of a core
per process while idle, against 0 % over TCP.

What we do instead, where the user opts in with ``UCXPY_PROGRESS_MODE=event``
(not the default yet: in the chaos test over UCX a node process crashed with
a segfault in 6 of 28 runs with it, and later also in 2 of 20 without it.
The likely cause, ucxx's connection handshake writing into a freed buffer
after a timeout, is worked around in `ucx.py` (`_UCXX_HANDSHAKE_S`); since,
0 of 32 runs crashed with it and 0 of 20 without; it is not yet measured on
a GPU. See README "GPUs and UCX"):

* `Progress` takes the place of ucxx's progress object for that loop (it is
  registered in ucxx's table before the loop's first listener or endpoint, so
  ucxx does not make its own). It progresses the worker when the fd fires and
  re-arms it (``ucp_worker_arm``) before the loop goes back to sleep.
* Requests are posted on the endpoint and their completion is checked after
  every progress call; the waiting coroutine gets an asyncio future.
* Device transfers are *active*: the worker is progressed on every loop
  iteration until they complete, since completions of device copies (cuda_ipc,
  cuda_copy) need not raise an fd event.
* Host transfers (UCX's tcp raises fd events) are polled only for `LINGER_S`
  after the last request was posted or completed: a reply or the next chunk
  usually comes within it, and waking from epoll costs more; after that the
  loop sleeps on the fd. Measured on a 2-core VM, with the linger at 0.2 /
  0.5 / 1 ms: 1 MiB round trip between two processes 477 / 249-258 /
  250-263 us (polled to completion: 250-280 us); 1 KiB broadcast among 4
  processes 3.48 / 3.85 / 4.70 ms; 64 MiB broadcast on 8 emulated hosts over
  UCX 1.07 / 1.12 / 1.13-1.15 s (polled to completion: 1.49 s). Polling a
  whole host transfer spends the CPU the transfers need where processes
  share cores.
* A watchdog progresses the worker every `WATCHDOG_S` seconds in case an event
  is missed (ucxx does the same, once a second).

Not measured yet: over InfiniBand a head above UCX's rendezvous threshold is
read by RDMA; if that completion raises no fd event, a waiting receiver
notices it only at the next watchdog tick. A device send is polled while its
peer is slow to post the matching receive (as ucxx did).

This reaches into ucxx internals (``Endpoint._ep``, ``Endpoint._tags``, the
progress table, the progress object ucxx.init made). `install` checks for each and returns None when one is
missing; the transport then uses ucxx's own awaitables and its documented
spinning.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between safety progress calls while the worker is armed.
WATCHDOG_S = 0.25
#: After a request was last posted or completed, keep polling this long before
#: sleeping on the fd: a reply usually follows within it, and waking from epoll
#: costs more (see the module doc for what was measured).
LINGER_S = 0.0005


class Progress:
    """Drives one ucxx worker from one asyncio loop."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop, tag_cls: Any,
                 array_cls: Any) -> None:
        self._worker = worker
        self._loop = loop
        self._tag = tag_cls
        self._array = array_cls
        #: In flight: request -> (future, buffer kept alive, active?).
        self._pending: dict[Any, tuple[asyncio.Future, Any, bool]] = {}
        self._active = 0
        #: When a request was last posted or completed: polling goes on for
        #: LINGER_S after it.
        self._busy_at = 0.0
        self._task: asyncio.Task | None = None
        self._closed = False
        self.replaced: Any = None
        worker.init_blocking_progress_mode()
        self._fd = worker.epoll_file_descriptor
        loop.add_reader(self._fd, self._on_event)
        self._watchdog = loop.call_later(WATCHDOG_S, self._on_watchdog)
        self._wake()

    # ----------------------------------------------------------- driving ---
    def _progress(self) -> None:
        self._worker.progress()
        if not self._pending:
            return
        done = [req for req in self._pending if req.completed]
        if done:
            self._busy_at = self._loop.time()
        for req in done:
            fut, _, active = self._pending.pop(req)
            if active:
                self._active -= 1
            if fut.done():  # its waiter was cancelled
                continue
            try:
                req.check_error()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def _wake(self) -> None:
        if self._task is None and not self._closed:
            self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        """Progress until nothing is active and the worker can be armed."""
        clock = self._loop.time
        try:
            while not self._closed:
                self._progress()
                await asyncio.sleep(0)  # let the woken waiters run (and post more)
                if self._active:
                    continue
                if clock() - self._busy_at < LINGER_S:
                    continue
                self._progress()
                if self._worker.arm():  # nothing pending in UCX: sleep on the fd
                    return
        except Exception:  # a worker error: the watchdog and the next event go on
            log.exception("UCX progress failed")
        finally:
            self._task = None

    def _on_event(self) -> None:
        if self._task is not None:
            return  # polling: the fd stays readable until the worker is armed again
        self._progress()
        self._wake()

    def _on_watchdog(self) -> None:
        if self._closed:
            return
        self._watchdog = self._loop.call_later(WATCHDOG_S, self._on_watchdog)
        self._progress()
        self._wake()

    # ---------------------------------------------------------- requests ---
    async def _wait(self, request: Any, buffer: Any, active: bool) -> None:
        """Wait for a request posted just now. Called in the same step as the
        post, so the request and its buffer are held until UCX is done with
        them, whatever happens to the waiter."""
        if request.completed:
            request.check_error()
            return
        fut = self._loop.create_future()
        self._busy_at = self._loop.time()
        self._pending[request] = (fut, buffer, active)
        if active:
            self._active += 1
        self._wake()
        try:
            await fut
        except asyncio.CancelledError:
            entry = self._pending.get(request)
            if entry is not None and entry[2]:  # nobody waits: stop polling for it
                self._pending[request] = (entry[0], entry[1], False)
                self._active -= 1
            raise

    async def send(self, endpoint: Any, tag: int, buffer: Any, active: bool) -> None:
        """Post a tagged send on `endpoint` (a ucxx Endpoint) and wait for it.
        Nothing is posted unless this coroutine runs (a cancelled caller that
        never started it sends nothing). `active`: poll until it completes."""
        if _failed(endpoint):
            await endpoint.send(buffer, tag=tag, force_tag=True)  # ucxx's own checks
            return
        buf = buffer if isinstance(buffer, self._array) else self._array(buffer)
        await self._wait(endpoint._ep.tag_send(buf, self._tag(tag)), buf, active)

    async def recv(self, endpoint: Any, tag: int, buffer: Any, active: bool) -> None:
        """Post a tagged receive into `buffer` and wait for it. `active`: poll
        until it completes (device memory). A receive whose
        waiter is cancelled stays posted (UCX offers no cancel of one request):
        the stream must be closed then, which cancels it."""
        if _failed(endpoint):
            # ucxx's own receive: it still delivers a message that a peer sent
            # before it went away (found on the worker, not the endpoint).
            await endpoint.recv(buffer, tag=tag, force_tag=True)
            return
        buf = buffer if isinstance(buffer, self._array) else self._array(buffer)
        await self._wait(endpoint._ep.tag_recv(buf, self._tag(tag), _TAG_MASK_FULL), buf, active)

    def close(self) -> None:
        self._closed = True
        self._watchdog.cancel()
        self._loop.remove_reader(self._fd)


def _failed(endpoint: Any) -> bool:
    """Whether `endpoint` is closed or UCX reported an error on it. A request
    posted on such an endpoint can crash the process (ucxx 0.52: a segfault
    in tag_recv after a peer was killed), so those go through ucxx's own
    calls, which check first. No progress runs between this check and the
    post (same thread, no await), so the state cannot change in between."""
    try:
        endpoint._ep.raise_on_error()
    except Exception:  # noqa: BLE001 - any error state, or no UCX endpoint any more
        return True
    return bool(endpoint.closed)


_TAG_MASK_FULL: Any = None
_HASH64BITS: Any = None
#: Weak: a runtime's loop that has closed takes its driver with it.
_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Progress] = (
    weakref.WeakKeyDictionary())


def _internals(ucxx: Any) -> dict | None:
    """The ucxx internals this module uses, or None where this ucxx differs from
    the one it was written against (0.52) or does not run in blocking mode."""
    try:
        from ucxx._lib.arr import Array  # noqa: PLC0415 - private, checked here
        from ucxx._lib.libucxx import UCXEndpoint, UCXWorker  # noqa: PLC0415
        from ucxx._lib_async import application_context as app  # noqa: PLC0415
        from ucxx._lib_async.utils import hash64bits  # noqa: PLC0415
        from ucxx.types import Tag, TagMaskFull  # noqa: PLC0415

        ctx = ucxx.core._get_ctx()
        found = dict(worker=ctx.worker, table=app.ProgressTasks, array=Array, tag=Tag,
                     mask=TagMaskFull, hash64bits=hash64bits)
    except (ImportError, AttributeError):
        return None
    if ctx.progress_mode != "blocking" or not (
            all(hasattr(UCXWorker, name) for name in
                ("arm", "progress", "epoll_file_descriptor", "init_blocking_progress_mode"))
            and all(hasattr(UCXEndpoint, name) for name in ("tag_send", "tag_recv"))):
        return None
    return found


def supported(ucxx: Any) -> bool:
    """Whether `install` can take over progress (for `hoplite-gpu info`)."""
    return _internals(ucxx) is not None


def install(ucxx: Any, loop: asyncio.AbstractEventLoop) -> Progress | None:
    """The event-driven progress for `loop`, made on first use; None where
    `_internals` finds none, or where ucxx's own progress object for `loop` is
    not the one we know how to stop."""
    global _TAG_MASK_FULL, _HASH64BITS
    driver = _drivers.get(loop)
    if driver is not None:
        return driver
    found = _internals(ucxx)
    if found is None:
        return None
    table = found["table"]
    stock = table.get(loop)
    if stock is not None and not all(hasattr(stock, n) for n in ("arm_task", "progress_task")):
        return None
    if stock is not None:  # ucxx.init made its own for this loop: stop it
        for task in (stock.arm_task, stock.progress_task):
            if task is not None:
                task.cancel()
    _TAG_MASK_FULL, _HASH64BITS = found["mask"], found["hash64bits"]
    driver = Progress(found["worker"], loop, found["tag"], found["array"])
    # Kept referenced: ucxx's object removes the fd's reader (now ours) when it
    # is garbage collected.
    driver.replaced = stock
    table[loop] = driver  # ucxx's continuous_ucx_progress now leaves this loop to us
    _drivers[loop] = driver
    return driver


def endpoint_tags(endpoint: Any, tag: Any) -> tuple[int, int] | None:
    """(send tag, receive tag) that ucxx's Endpoint.send/recv would use for the
    user tag `tag` (None: the endpoint's own), computed once per connection."""
    tags = getattr(endpoint, "_tags", None)
    if not isinstance(tags, dict) or "msg_send" not in tags or "msg_recv" not in tags:
        return None
    if tag is None:
        return tags["msg_send"], tags["msg_recv"]
    return (_HASH64BITS(tags["msg_send"], hash(tag)),
            _HASH64BITS(tags["msg_recv"], hash(tag)))


def installed(loop: asyncio.AbstractEventLoop) -> Progress | None:
    """The driver `install` made for `loop`, if any."""
    return _drivers.get(loop)
