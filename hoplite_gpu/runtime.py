"""The process-wide runtime: a node whose asyncio loop runs on a background
thread, so the blocking API works from any thread and the async API from any
other event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from . import tls
from .auth import new_token
from .config import Config
from .direct import MISS, PULL, DirectCalls
from .directory.server import DirectoryServer
from .errors import ConfigError, HopliteError, RuntimeClosed, Timeout
from .ids import ObjectID
from .node.node import Node

T = TypeVar("T")
#: A call's node operations: (node, seconds left) -> the coroutines to run together.
Steps = Callable[[Node, float], list[Coroutine]]
log = logging.getLogger("hoplite_gpu")

#: Extra seconds a blocking call waits beyond the operation's own deadline, so
#: the operation's own (more precise) Timeout error wins the race.
_GRACE_S = 5.0
#: How long a call given up by its caller (a cancelled await, Ctrl-C) waits for
#: its work on the loop to end: that work reclaims lent inputs, and the caller's
#: memory must be its own again when the call has returned.
GIVE_UP_S = 5.0


def time_left(deadline: float) -> float:
    """Seconds left until `deadline` (time.monotonic()), at least a millisecond."""
    return max(0.001, deadline - time.monotonic())


class _Call(concurrent.futures.Future):
    """A call's outcome, plus `ended`: settled once its task on the loop has
    finished, cleanup included (or never started)."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: concurrent.futures.Future[None] = concurrent.futures.Future()

    def end(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


class Runtime:
    """One node (and, in local mode, the embedded directory) on a private loop thread."""

    def __init__(self, config: Config, address: str | None) -> None:
        if address is None:
            token = config.token or new_token()
        elif not config.token:
            raise ConfigError(
                f"connecting to the directory at {address} needs the cluster token: "
                "pass init(address, token=...) or set HOPLITE_TOKEN")
        else:
            token = config.token
        self.config = config.replace(token=token)
        self.token = token
        #: TLS for every TCP connection (None: none), its files checked before
        #: anything connects
        self.tls = tls.load(self.config)
        #: the process that made it: a forked child has a copy of this object
        #: but neither the loop thread nor a node of its own
        self.pid = os.getpid()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="hoplite-gpu-loop", daemon=True)
        # `submit` refuses work while the loop is not running: wait until it runs,
        # or a loaded machine makes init fail with RuntimeClosed.
        running = threading.Event()
        self._loop.call_soon(running.set)
        self._thread.start()
        if not running.wait(30):
            raise RuntimeClosed("the hoplite-gpu loop thread did not start within 30s")
        self._calls: set[asyncio.Task] = set()
        #: futures of blocking calls not settled yet (cancelled if the loop stops first)
        self._waiting: set[concurrent.futures.Future] = set()
        self._waiting_lock = threading.Lock()
        self.directory: DirectoryServer | None = None
        self.node: Node | None = None
        self.direct: DirectCalls | None = None
        #: group size -> whether the last adaptive sliced allreduce of that many
        #: ranks found every rank on one host
        self.one_host_groups: dict[int, bool] = {}
        #: set when `close` starts: calls submitted from then on are refused
        self._closing = False
        try:
            self.call(self._start(address), config.connect_timeout_s + 30)
        except BaseException:
            self.close()
            raise
        assert self.node is not None
        #: blocking puts and gets of small objects made on the caller's thread
        self.direct = DirectCalls(self.node, self._loop, token)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def _start(self, address: str | None) -> None:
        if address is None:
            self.directory = DirectoryServer(self.token, host="127.0.0.1", port=0,
                                             tls=self.tls, **self.config.directory_settings())
            address = await self.directory.start()
        self.node = Node(self.config, self.token, address, tls=self.tls)
        await self.node.start()

    @property
    def address(self) -> str:
        """The address of the directory in use."""
        assert self.node is not None
        return self.node.directory_address

    @property
    def addresses(self) -> list[str]:
        """Every directory this runtime may use (standbys too), in the order tried."""
        assert self.node is not None
        return list(self.node.link.addresses)

    @property
    def closed(self) -> bool:
        return self.forked or not self._loop.is_running()

    @property
    def forked(self) -> bool:
        """This is a forked child's copy of its parent's runtime."""
        return os.getpid() != self.pid

    def let_go_in_child(self) -> None:
        """In a forked child: let go of the parent's connections and listeners.

        A forked child shares every socket of its parent, and a connection
        ends only once every process holding it has closed it. So while a
        child lived (a data-loader worker, a pool process), the parent's
        death went unseen: the directory waited out the node's lease instead
        of seeing its connection end, and a peer pulling from it waited out
        its stall timeout; a peer connecting got into the dead listener's
        backlog instead of being refused. Each such descriptor becomes
        /dev/null here, not closed: the child's copies of the socket objects
        still hold the number, and closing it later must not close whatever
        the child opened under the same number meanwhile."""
        fds: set[int] = set()
        selector = getattr(self._loop, "_selector", None)
        with contextlib.suppress(Exception):  # (a loop without one: nothing registered)
            fds.update(key.fd for key in selector.get_map().values())
        if self.direct is not None:
            fds.update(self.direct.descriptors())
        try:
            null = os.open(os.devnull, os.O_RDWR)
        except OSError:
            return
        try:
            for fd in fds - {null}:
                with contextlib.suppress(OSError):
                    os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the loop thread; its future is settled by the task's own
        last step. (`asyncio.run_coroutine_threadsafe` settles it from a done-
        callback, one loop iteration later: a wake-up more for every blocking call.)
        Cancelling the future cancels the task."""
        if self.closed or self._closing:
            coro.close()
            raise RuntimeClosed("the hoplite-gpu runtime is shut down; call hoplite_gpu.init() again")
        fut: _Call = _Call()
        loop = self._loop
        with self._waiting_lock:
            self._waiting.add(fut)
        fut.add_done_callback(self._settled)

        def start() -> None:
            if fut.cancelled() or self._closing:  # (closing: the task might never run)
                coro.close()
                fut.cancel()
                fut.end()
                return
            task = loop.create_task(_settle(coro, fut))
            self._calls.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._calls.discard)
            fut.add_done_callback(
                lambda f: f.cancelled() and not loop.is_closed() and
                loop.call_soon_threadsafe(task.cancel))

        try:
            loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed after the check above
            coro.close()
            fut.end()
            raise RuntimeClosed("the hoplite-gpu runtime is shut down; call hoplite_gpu.init() "
                                "again") from None
        return fut

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the runtime's loop and block for its result."""
        if self.on_loop_thread():
            coro.close()
            raise HopliteError("a blocking hoplite-gpu call was made on the runtime's own loop "
                               "thread; use the *_async variant there")
        fut = self.submit(coro)
        try:
            # result() waits on the future's own condition: cheaper per call than
            # concurrent.futures.wait, which builds a waiter and an event each time.
            return fut.result(timeout + _GRACE_S)
        except concurrent.futures.CancelledError:
            raise RuntimeClosed("the hoplite-gpu runtime was shut down during the call") from None
        except concurrent.futures.TimeoutError:
            if fut.done():  # finished just now, or failed with a TimeoutError of its own
                return fut.result()
            fut.cancel()
            raise Timeout(f"the runtime did not answer within {timeout + _GRACE_S:g}s") from None
        except BaseException:  # e.g. KeyboardInterrupt: the call is given up, not left running
            fut.cancel()
            # (its cleanup first: lent inputs are reclaimed before we return)
            concurrent.futures.wait([fut.ended], GIVE_UP_S)
            raise

    async def call_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` from another event loop (e.g. a Ray async actor's)."""
        if asyncio.get_running_loop() is self._loop:
            return await coro
        fut = self.submit(coro)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if self.closed or self._closing:
                raise RuntimeClosed("the hoplite-gpu runtime was shut down during the call") from None
            # Given up by our caller: the call's task is cancelled too, and its
            # cleanup (lent inputs reclaimed) ends before the cancellation does.
            fut.cancel()
            await asyncio.wait([asyncio.wrap_future(fut.ended)], timeout=GIVE_UP_S)
            raise

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def direct_here(self) -> DirectCalls | None:
        """The direct path, where this thread may take it (not the loop's own)."""
        return None if self.direct is None or self.on_loop_thread() else self.direct

    # ---------------------------------------- blocking verbs of a caller's thread ---
    # Each tries the direct path first (a small host object, `hoplite_gpu.direct`)
    # and hands the loop what that path leaves, within the same deadline.
    def put_here(self, value: Any, oid: ObjectID, limit: float) -> bool:
        """Register a small host `value` from this thread; False: the loop must."""
        direct = self.direct_here()
        return direct is not None and direct.put(value, oid, limit)

    def get(self, oid: ObjectID, limit: float, array_type: str) -> Any:
        """`oid`'s value within `limit` seconds."""
        direct = self.direct_here()
        if direct is None:
            return self.call(self.node.get(oid, limit, array_type), limit)
        deadline = time.monotonic() + limit
        value = direct.get(oid, limit, array_type)
        if value is not MISS:
            return value
        left = time_left(deadline)
        return self.call(self.node.get(oid, left, array_type, limit), left)

    def get_many(self, oids: list[ObjectID], limit: float) -> list[Any]:
        """The values of `oids`, asked for at once, within `limit` seconds."""
        deadline = time.monotonic() + limit
        direct = self.direct_here()
        values = MISS if direct is None else direct.get_all(oids, limit)
        if values is MISS:
            return self.together(lambda node, left: [node.get(oid, left) for oid in oids],
                                 limit)
        # what came inline is here; the loop pulls the rest from the senders
        # the directory gave us
        pulls = [i for i, v in enumerate(values) if v is PULL]
        if pulls:
            got = self.together(lambda node, left: [node.get(oids[i], left) for i in pulls],
                                time_left(deadline))
            for i, value in zip(pulls, got, strict=True):
                values[i] = value
        return values

    def reduce_here(self, request: Any, value: Any, mine: ObjectID, then: str | None,
                    limit: float, otherwise: Callable[[float], Any]) -> Any:
        """A collective's reduce of a small host input from this thread (see
        `DirectCalls.reduce`); `otherwise(seconds left)` runs the call through
        the loop when the direct path cannot."""
        deadline = time.monotonic() + limit
        direct = self.direct_here()
        if direct is not None:
            out = direct.reduce(request, value, mine, then, limit)
            if out is PULL:  # the result is the loop's to pull: the reduce and our put are in
                left = time_left(deadline)
                return self.call(self.node.get(ObjectID(request.target), left), left)
            if out is not MISS:
                return out
        return otherwise(time_left(deadline))

    def together(self, steps: Steps, limit: float,
                 lent: ObjectID | list[ObjectID] | None = None) -> list[Any]:
        """Run a call's node operations at once, in one blocking call, and return
        their results. Each starts in order (so the directory sees e.g. a reduce
        request before the put of an input, on the one ordered connection), and
        a call of small objects costs one round trip instead of one per step. If
        one fails, the others are cancelled and its error is raised; `limit`
        bounds the whole call. `lent`: inputs put with ``lend=True``, reclaimed
        before the call returns, however it ends."""
        return self.call(self._joint(steps, limit, lent), limit)

    async def together_async(self, steps: Steps, limit: float,
                             lent: ObjectID | list[ObjectID] | None = None) -> list[Any]:
        """`together` awaited from another event loop; cancelling the awaiting
        task cancels the steps (and reclaims `lent`) as a failed step does."""
        return await self.call_async(self._joint(steps, limit, lent))

    async def _joint(self, steps: Steps, limit: float,
                     lent: ObjectID | list[ObjectID] | None) -> list[Any]:
        """`together`'s work, on the runtime's loop."""
        tasks = [asyncio.ensure_future(c) for c in steps(self.node, limit)]
        try:
            # A step may wait on its own, longer deadline (a put's directory
            # request is bounded by timeout_s); steps bounded by `limit` end
            # first, with their own errors (the margin).
            async with asyncio.timeout(limit + 0.1):
                return await asyncio.gather(*tasks)
        except TimeoutError as exc:
            if isinstance(exc, Timeout):
                raise
            raise Timeout(f"the call did not finish within {limit:g}s") from None
        finally:
            for task in tasks:
                task.cancel()  # the rest, once one failed; finished ones ignore it
            # ... and the call returns once they have stopped: a put given up
            # (registering, or copying the caller's array) withdraws its copy, so
            # none is left that would never complete, and the array is read no more.
            running = [task for task in tasks if not task.done()]
            if running:
                await asyncio.wait(running, timeout=GIVE_UP_S)
            loans = [] if lent is None else [lent] if isinstance(lent, ObjectID) else lent
            loans = [oid for oid in loans if self.node.is_lent(oid)]  # (small inputs are copied)
            # All at once: each may wait up to a second for a reader to let go.
            if loans:
                await asyncio.gather(*[self.node.reclaim(oid) for oid in loans])

    def close(self) -> None:
        self._closing = True
        if self.forked:
            return  # the loop, the node and their sockets are the parent's
        if self.direct is not None:
            self.direct.close()
        if self.closed and not self._thread.is_alive():
            return
        interrupted = None
        try:  # (a Ctrl-C anywhere in here still stops the loop: `finally`)
            if self._loop.is_running():
                interrupted = self._drain()
                fut = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
                try:
                    fut.result(15)
                except KeyboardInterrupt as exc:  # a second Ctrl-C: stop waiting for a clean close
                    interrupted = exc
                except Exception as exc:  # shutting down: report, never raise
                    log.warning("shutdown was not clean: %r", exc)
        finally:
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(15)
            if not self._loop.is_running():
                self._loop.close()
            # A call submitted while the loop was shutting down would otherwise
            # wait out its whole deadline: its task never ran, or never finished.
            with self._waiting_lock:
                left, self._waiting = list(self._waiting), set()
            for fut in left:
                fut.cancel()
        if interrupted is not None:
            raise interrupted  # (once closed: Ctrl-C only cut the wait for pulls short)

    def _drain(self) -> KeyboardInterrupt | None:
        """Let peers finish pulling what only this node holds whole, for at most
        `shutdown_grace_s` (`Node.drain`); Ctrl-C cuts the wait short, and is
        returned to be raised once the runtime is closed."""
        grace = self.config.shutdown_grace_s
        if self.node is None or grace <= 0 or self.on_loop_thread():
            return None
        fut = None
        try:  # (Ctrl-C may come as soon as the drain starts, before `fut` is known)
            fut = asyncio.run_coroutine_threadsafe(self.node.drain(grace), self._loop)
            fut.result(grace + _GRACE_S)
        except KeyboardInterrupt as exc:
            if fut is not None:
                fut.cancel()  # (else `_close` ends the drain)
            return exc
        except Exception as exc:  # (shutting down: report, never raise)
            if fut is not None:
                fut.cancel()
            log.warning("shutdown did not wait for peers' pulls: %r", exc)
        return None

    def _settled(self, fut: concurrent.futures.Future) -> None:
        with self._waiting_lock:
            self._waiting.discard(fut)

    async def _close(self) -> None:
        if self.node is not None:
            await self.node.close()
        if self.directory is not None:
            await self.directory.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _settle(coro: Coroutine[Any, Any, T], fut: _Call) -> None:
    """Await `coro` and hand its outcome to `fut` at once (a cancelled task cancels it)."""
    try:
        try:
            result = await coro
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as exc:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        if fut.set_running_or_notify_cancel():
            fut.set_result(result)
    finally:
        fut.end()
