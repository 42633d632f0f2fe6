"""UCX transport on ucxx, the maintained successor of ucx-py (ucx-py is archived
and has no CUDA 13 build).

UCX moves *messages* (tag API); the runtime above speaks a *byte stream* with
exact-size receives. This module adapts one to the other without losing UCX's
zero-copy receives:

* Every ``send(*buffers)`` becomes one **head** message plus one **data**
  message per large buffer. The head lists the buffers as records
  (``inline``: its bytes travel inside the head; ``host``/``device``: it follows
  as its own data message) and carries the inline bytes. Heads and data use two
  tags, and UCX keeps each tag's messages in order, so the receiver pairs the
  i-th data record with the i-th data message.
* ``recv_into(buf)`` consumes records in order. When a data message fits in
  what is still wanted, it is received **straight into** ``buf`` (a device
  buffer too: UCX picks cuda_copy / cuda_ipc / RDMA by itself); only a data
  message that straddles two ``recv_into`` calls goes through a staging buffer.
  The runtime's data frames (a small header, then a whole chunk) always line
  up, so chunks never take that path.
* Messages (`send_message`) go on a third tag, one UCX message per frame and
  no head: the receiver posts a receive of exactly each frame's size
  (`post_message`), straight into its buffer, and may post several at once.
  Heads (`recv_head`) are the first lane's: a `recv_next` that waits for a
  message listens for them only once the message is slow to come
  (`_HEAD_POLL_S`), since ucxx polls every posted receive on every turn of
  the loop.

Progress runs in ucxx's ``blocking`` mode. ucxx (0.52) itself keeps one core
per process busy in it, even when idle (99 % measured here, against 0 % over
TCP): its requests are awaited by yielding to the loop until they complete,
and its event fd is never re-armed. ``UCXPY_PROGRESS_MODE=event`` (opt-in)
lets `ucx_progress` drive the worker instead: an idle process sleeps on the
worker's fd (0 % measured), and a 1 KiB round trip takes 41 us (40 us
spinning). It is not the default yet: in the chaos test over UCX a node
process crashed (a segfault) in 6 of 28 runs with it; the likely cause, in
ucxx's handshake, is worked around below (`_UCXX_HANDSHAKE_S`), and 0 of 32
runs crashed with it since (not yet measured on a GPU); see README "GPUs and
UCX" and ``python -m benchmarks progress``.

Peer failure: endpoints are made through a listener with UCX endpoint error
handling on, so a peer that dies fails the pending requests, which become
`TransportClosed`. UCX's shared-memory transports need error handling *off*
(which a listener endpoint cannot do), so two processes on one host talk over
UCX's tcp (or cuda_ipc for device buffers); see docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import struct
import threading
import weakref
from collections.abc import Callable
from typing import Any

from hoplite_gpu.errors import (
    ConfigError,
    ConnectionRefused,
    InvalidArgument,
    Timeout,
    TransportClosed,
    TransportError,
)

from . import ucx_progress
from .base import (
    HEAD,
    STEP,
    Backend,
    Bind,
    Handler,
    Head,
    Listener,
    Stream,
    StreamCaps,
    split_address,
)

#: UCX settings applied unless the user set them (environment wins).
UCX_DEFAULTS = {
    # UCX 1.21 warns on every init about variables ucxx itself sets.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # UCX's default 8 KB TCP segments cap a stream near 1 GB/s; 512k gave 3-4 GB/s.
    "UCX_TCP_TX_SEG_SIZE": "512k",
    "UCX_TCP_RX_SEG_SIZE": "512k",
    # A restarted directory listens again on its old port at once, as over TCP.
    "UCX_TCP_CM_REUSEADDR": "y",
    "UCX_RDMA_CM_REUSEADDR": "y",
}

log = logging.getLogger("hoplite_gpu.transports.ucx")

_HEAD_TAG = None  # the endpoint's own message tag
_DATA_TAG = 1  # hashed by ucxx with the endpoint's tag: distinct per connection
_MESSAGE_TAG = 2  # messages: one UCX message per frame, no head (send_message)
#: The lanes a message travels on (heads, data after a head, messages), and their tags.
_LANE_HEAD, _LANE_DATA, _LANE_MESSAGE = 0, 1, 2
_TAGS = (_HEAD_TAG, _DATA_TAG, _MESSAGE_TAG)
#: A `recv_next` waiting for a message listens for heads too once it has
#: waited this long: a receive left posted is polled by ucxx on every turn of
#: the loop, which made each 64 MiB message on an H100 take twice as long.
_HEAD_POLL_S = 0.05
_INLINE, _HOST, _DEVICE = 0, 1, 2
_HEAD = struct.Struct("<HI")  # records, inline bytes
_RECORD = struct.Struct("<BQ")  # kind, size
#: Buffers up to this size travel inside the head (one message instead of two).
INLINE_MAX = 16 * 1024
#: At most this many inline bytes in one head (the receiver's head buffer).
_INLINE_BUDGET = 64 * 1024
_MAX_RECORDS = 256
_HEAD_MAX = _HEAD.size + _MAX_RECORDS * _RECORD.size + _INLINE_BUDGET
#: The largest message a receive stages on the host when it straddles the
#: receive (a control message is at most MAX_MESSAGE; frames arrive whole).
_MAX_STAGED = 64 << 20
#: The same, before the peer proved the cluster token: the handshake's own
#: messages travel inline and are never staged.
_MAX_STAGED_UNPROVEN = 64 << 10
#: The message of close()'s cancels (for whoever reads them).
_CLOSED = "hoplite: stream closed"

#: First bytes an accepted connection receives.
_WELCOME = b"hoplite-ucx/1"
#: ucxx's own handshake on a new connection (its "peer info": 16 bytes each
#: way) waits with `asyncio.wait_for(request.wait(), connect_timeout)`. When
#: that times out, the receive stays posted while its 16-byte buffer is freed,
#: and a late answer (a peer that was stopped, or slow) is written into freed
#: memory: seen here as a segmentation fault in Python's allocator, in about
#: 1 of 10 chaos runs over UCX (docs/fault-tolerance.md). So ucxx is given a
#: day, and our own deadline is applied outside its handshake without
#: cancelling it (`_connect_endpoint`): the handshake ends when the peer
#: answers or its endpoint fails, and its buffer lives until then.
_UCXX_HANDSHAKE_S = 86400.0

#: UCXPY_PROGRESS_MODE value that turns on the event-driven progress of
#: ucx_progress (opt-in: see the module doc).
EVENT_MODE = "event"

_init_lock = threading.Lock()
_ucxx: Any = None


def default_tls() -> str:
    """The UCX_TLS used when the user sets none.

    Listing transports matters: with UCX's default (all), every message
    between two processes on one host took about 8 ms in blocking progress
    mode here (UCX 1.21; shared memory transports are chosen but signal
    completions late), against 0.03 ms with an explicit list. Shared memory is
    left out anyway: it needs endpoint error handling off (see module doc)."""
    tls = ["tcp", "self"]
    if os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        tls.insert(0, "rc")  # InfiniBand / RoCE: RDMA
    if os.path.exists("/dev/nvidiactl"):
        tls += ["cuda_copy", "cuda_ipc"]  # device memory, NVLink / PCIe peer copies
    return ",".join(tls)


def _load() -> Any:
    """Import and initialise ucxx once per process (blocking progress mode unless
    UCXPY_PROGRESS_MODE says otherwise; ucxx reads UCXPY_ENABLE_PYTHON_FUTURE)."""
    global _ucxx
    with _init_lock:
        if _ucxx is None:
            for key, value in UCX_DEFAULTS.items():
                os.environ.setdefault(key, value)
            os.environ.setdefault("UCX_TLS", default_tls())
            import ucxx  # noqa: PLC0415 - optional dependency, imported on first use

            # Blocking unless the user picks another of ucxx's modes with its own
            # variable (UCXPY_PROGRESS_MODE): see README "Configuration".
            # "event" is ours: ucxx's blocking mode driven by ucx_progress.
            mode = os.environ.get("UCXPY_PROGRESS_MODE", "blocking")
            ucxx.init(progress_mode="blocking" if mode == EVENT_MODE else mode)
            _ucxx = ucxx
    return _ucxx


def _event_progress(ucxx: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Let ucx_progress drive `loop`'s UCX progress, where the user opted in."""
    if os.environ.get("UCXPY_PROGRESS_MODE") == EVENT_MODE:
        ucx_progress.install(ucxx, loop)


def _abort(endpoint: Any) -> None:
    """Close `endpoint` (a ucxx Endpoint) now, and let its UCX objects go now,
    on this thread (the loop's).

    ucxx ends an endpoint in a `weakref.finalize` callback, which runs in
    whatever thread drops the Python object's last reference: often the user's
    thread, when a garbage collection there finds a reference cycle through a
    stream (an exception's traceback makes one), or at exit. That thread then
    touches the UCX worker while the loop's thread progresses it, and UCX
    workers are not thread-safe; counted in the chaos test over UCX: dozens
    of such finalizers per run from the main thread. Running the finalizer
    here, right after the abort, leaves nothing for another thread to do."""
    with contextlib.suppress(Exception):
        endpoint.abort()
    registry = getattr(weakref.finalize, "_registry", None)
    if not isinstance(registry, dict):
        return
    with contextlib.suppress(Exception):  # e.g. a collection changed it while we copy
        mine = [fin for fin, info in registry.copy().items()
                if getattr(info, "weakref", lambda: None)() is endpoint]
        for fin in mine:
            fin()


def _is_device(buf: Any) -> bool:
    return hasattr(buf, "__cuda_array_interface__")


def _nbytes(buf: Any) -> int:
    if _is_device(buf):
        return int(buf.nbytes)
    return memoryview(buf).nbytes


def _flat(buf: Any) -> Any:
    """A 1-D byte view of `buf` (host memoryview or device uint8 array)."""
    if _is_device(buf):
        import cupy  # noqa: PLC0415 - only with device buffers

        return cupy.asarray(buf).view(cupy.uint8).reshape(-1)
    view = memoryview(buf)
    if not view.c_contiguous:
        # UCX moves `nbytes` contiguous bytes from the first element: a strided
        # view would send its parent's bytes, or receive over memory between
        # its elements. Refused, as the TCP transport's socket calls do.
        raise InvalidArgument("the UCX transport moves contiguous buffers only; got a "
                              "strided view (copy it into a contiguous one first)")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _sync_device(buf: Any) -> None:
    """Wait for the work that produced `buf` before UCX reads it.

    UCX copies device memory on its own CUDA streams, unordered with the stream
    the producer (a CuPy kernel, a torch op) ran on; without this a send could
    ship the bytes from before the kernel finished."""
    stream = buf.__cuda_array_interface__.get("stream")
    import cupy  # noqa: PLC0415 - only with device buffers

    if stream is None:  # the producer did not say: wait for the whole device
        cupy.cuda.runtime.deviceSynchronize()
    elif stream in (1, 2):  # the legacy / per-thread default stream
        cupy.cuda.Stream.null.synchronize()
    else:
        cupy.cuda.ExternalStream(stream).synchronize()


def _closed_error(peer: str, what: str, exc: BaseException | None) -> TransportClosed:
    reason = f": {exc}" if exc else ""
    return TransportClosed(f"UCX connection to {peer} closed during {what}{reason}")


def describe() -> str:
    """UCX's version, and the UCX transports it found (for `hoplite-gpu info`)."""
    ucxx = _load()
    tls = sorted(ucxx.get_active_transports())
    device = [t for t in tls if t.startswith("cuda") or t in ("rc", "dc", "ud", "gdr_copy")]
    tls_env = os.environ.get("UCX_TLS", "?")
    mode = os.environ.get("UCXPY_PROGRESS_MODE", "blocking")
    if mode == EVENT_MODE and ucx_progress.supported(ucxx):
        cost = "event-driven: idle processes use no CPU; opt-in, see README"
    elif mode == "thread" and os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "0") != "0":
        cost = "idle processes stay cold; slower per message"
    else:
        cost = "each process keeps a core busy, also when idle"
    return (f"UCX {ucxx.__ucx_version__}, ucxx {ucxx.__version__}; UCX_TLS={tls_env}; "
            f"available: {', '.join(tls)}; device-capable: {', '.join(device) or 'none'}; "
            f"progress: {mode} ({cost}; see README 'GPUs and UCX')")


class UCXStream(Stream):
    #: Each sent buffer is one UCX message, received in place only whole;
    #: device buffers may be passed to send/recv_into as they are. A message's
    #: frame is one UCX message with no head, so a large chunk costs one UCX
    #: message instead of two (the second costs about 0.1 ms on an H100, see
    #: benchmarks/ucx_patterns.py); it goes whole, never in parts.
    caps = StreamCaps(partial_receive=False, device=True)
    #: Two sends in flight: while one chunk's bytes move (a rendezvous the peer
    #: completes), the next chunk's head is already there, so the peer posts
    #: its receive as soon as the previous one ends, not a round trip later.
    send_window = 2

    def __init__(self, endpoint: Any, peer: str) -> None:
        self._ep = endpoint
        self.peer = peer
        self._closed = False
        self._send_lock = asyncio.Lock()
        self._recv_lock = asyncio.Lock()
        self._head = bytearray(_HEAD_MAX)
        #: Records received but not yet consumed: [kind, size, inline bytes or None, offset].
        self._pending: list[list] = []
        #: the largest straddling message staged on the host (see `authenticated`)
        self._max_staged = _MAX_STAGED_UNPROVEN
        self._busy: set[asyncio.Task] = set()
        #: How many of this stream's data sends have completed: a send waiting
        #: past `send_stall_s` fails only if none did meanwhile (`_sent_within`).
        self._sends_done = 0
        #: tasks that close() woke (cancelled) while they waited on UCX
        self._woken: set[asyncio.Task] = set()
        #: called once if the peer closes while the stream lies idle (`watch_idle`)
        self._on_idle_end: Callable[[], None] | None = None
        #: messages posted with post_message, oldest first, and a head being
        #: read for recv_next (see `recv_next`)
        self._posted: collections.deque[_Posted] = collections.deque()
        self._head_task: asyncio.Task | None = None
        self._loop = asyncio.get_running_loop()
        # UCX reports a peer's close through the endpoint's error callback
        # (endpoints made with error handling; others never call it).
        with contextlib.suppress(Exception):
            endpoint.set_close_callback(self._endpoint_closed)
        #: Event-driven request waits (None: ucxx's own, which spin; see ucx_progress).
        self._driver = ucx_progress.installed(self._loop)
        self._tags = None
        if self._driver is not None:
            tags = tuple(ucx_progress.endpoint_tags(endpoint, tag) for tag in _TAGS)
            if any(t is None for t in tags):
                self._driver = None
            else:
                self._tags = tags

    def _send(self, buf: Any, lane: int) -> Any:
        if self._closed:  # closed while this task waited for the lock
            raise _closed_error(self.peer, "send", None)
        if self._driver is None:
            return self._ep.send(buf, tag=_TAGS[lane])
        return self._driver.send(self._ep, self._tags[lane][0], buf, active=_is_device(buf))

    def _recv(self, buf: Any, lane: int) -> Any:
        """A receive of the next message on `lane` (for data: one whose head has
        arrived); polled to completion only into device memory (ucx_progress)."""
        if self._closed:
            raise _closed_error(self.peer, "receive", None)
        if self._driver is None:
            return self._ep.recv(buf, tag=_TAGS[lane])
        return self._driver.recv(self._ep, self._tags[lane][1], buf, active=_is_device(buf))

    @property
    def closed(self) -> bool:
        return self._closed

    def watch_idle(self, on_end: Callable[[], None]) -> None:
        if self._closed or not getattr(self._ep, "alive", True):
            on_end()
        else:
            self._on_idle_end = on_end

    def unwatch_idle(self) -> None:
        self._on_idle_end = None

    def _endpoint_closed(self) -> None:
        """ucxx's close callback: the peer went (or the endpoint is being freed)."""
        on_end, self._on_idle_end = self._on_idle_end, None
        if on_end is not None and not self._closed:
            with contextlib.suppress(RuntimeError):  # (a loop already closed)
                self._loop.call_soon_threadsafe(on_end)

    def authenticated(self) -> None:
        # A peer that has proved nothing cannot make us allocate the 64 MiB a
        # later message may be staged in (docs/protocol.md).
        self._max_staged = _MAX_STAGED

    # ------------------------------------------------------------- send ---
    def _encode(self, buffers: tuple) -> tuple[bytes, list]:
        records, inline, data = [], [], []
        budget = _INLINE_BUDGET
        if len(buffers) > _MAX_RECORDS:  # rare: fold host buffers into one
            buffers = (b"".join(bytes(_flat(b)) for b in buffers),)
        for buf in buffers:
            n = _nbytes(buf)
            if n == 0:
                continue
            if _is_device(buf):
                records.append(_RECORD.pack(_DEVICE, n))
                data.append(buf)
            elif n <= INLINE_MAX and n <= budget:
                budget -= n
                records.append(_RECORD.pack(_INLINE, n))
                inline.append(bytes(_flat(buf)))
            else:
                records.append(_RECORD.pack(_HOST, n))
                data.append(_flat(buf))
        body = b"".join(inline)
        return _HEAD.pack(len(records), len(body)) + b"".join(records) + body, data

    async def send(self, *buffers: Any) -> None:
        if self._closed:
            raise _closed_error(self.peer, "send", None)
        head, data = self._encode(buffers)
        if not data and len(head) == _HEAD.size:
            return  # nothing to send
        device_bytes = self._sync_all(data)
        if not data:  # a head alone (control messages, acks): no tasks to make
            if self.send_stall_s is None:
                async with self._send_lock:
                    await self._guard("send", self._send(head, _LANE_HEAD))
            else:  # (a head of 8 KiB or more waits for the peer, as data does)
                await self._post_then_wait([(head, _LANE_HEAD)])
            return
        await self._post_then_wait([(head, _LANE_HEAD)] + [(buf, _LANE_DATA) for buf in data])
        if device_bytes:
            log.debug("ucx send to %s: %d device bytes fetched by the peer", self.peer,
                      device_bytes)

    async def send_message(self, *frames: Any) -> None:
        if self._closed:
            raise _closed_error(self.peer, "send", None)
        if not frames:
            raise InvalidArgument("send_message: a message has at least one frame")
        bufs = [f if _is_device(f) else _flat(f) for f in frames]
        self._sync_all(bufs)
        await self._post_then_wait([(buf, _LANE_MESSAGE) for buf in bufs])

    def _sync_all(self, buffers: list) -> int:
        """Wait for the producers of the device buffers among `buffers` (see
        `_sync_device`); return how many device bytes there are."""
        device_bytes = 0
        for buf in buffers:
            if _is_device(buf):
                _sync_device(buf)
                device_bytes += _nbytes(buf)
        if device_bytes:
            log.debug("ucx send to %s: %d device bytes, producer's stream synchronised",
                      self.peer, device_bytes)
        return device_bytes

    async def _post_then_wait(self, messages: list[tuple[Any, int]]) -> None:
        """Post `messages` ((buffer, lane) each) in order under the send lock,
        then wait for them outside it, so the next send may be posted while
        these complete (a large message completes only when the peer has
        fetched it; see `send_window`)."""
        async with self._send_lock:
            # gather starts its tasks in order, and each posts its UCX request
            # before its first suspension; one turn of the loop runs those first
            # steps, and only then may the lock go to the next send.
            sent = asyncio.gather(*(self._send(buf, lane) for buf, lane in messages))
            try:
                await asyncio.sleep(0)
            except BaseException:  # cancelled: part of a message may be out
                sent.cancel()
                await self.close()
                with contextlib.suppress(BaseException):
                    await sent  # (its error is this stream's end, already ours)
                raise
        if self.send_stall_s is None:
            await self._guard("send", sent)
        else:
            await self._guard("send", self._sent_within(sent, self.send_stall_s))

    async def _sent_within(self, sent: asyncio.Future, stall: float) -> None:
        """Wait for `sent`, failing if no send of this stream completes for
        `stall` seconds. A UCX message reports no bytes moving, only its end,
        and a large one ends when the peer has fetched it all: so the clock
        starts again whenever an earlier send (of a `send_window` deeper than
        1) completes, and a peer that stops receiving is cut off after one
        quiet `stall`. The puller applies the same rule to each message it
        receives, so an honest one has given up by then."""
        sent.add_done_callback(self._count_sent)
        while True:
            seen = self._sends_done
            try:
                done, _ = await asyncio.wait({sent}, timeout=stall)
            except BaseException:  # (our caller cancelled, or close() woke us)
                sent.cancel()
                raise
            if done:
                sent.result()
                return
            if self._sends_done == seen:
                await self.close()  # (its requests are cancelled; `sent` ends with them)
                # Waited for, not awaited: its error is the stream's end, and a
                # cancel of our caller meanwhile must stay a cancel.
                await asyncio.wait({sent})
                if not sent.cancelled():
                    sent.exception()  # (retrieved: the cut is what we report)
                raise Timeout(f"{self.peer} took no message for {stall:g}s; cut off")

    def _count_sent(self, sent: asyncio.Future) -> None:
        if not sent.cancelled() and sent.exception() is None:
            self._sends_done += 1

    # --------------------------------------------------------- messages ---
    def _post(self, buffers: tuple, on_step: Callable[[int], None] | None) -> _Posted:
        """Post a receive per frame now, in order (several may be posted: UCX
        matches messages to them in that order)."""
        if self._closed:
            raise _closed_error(self.peer, "receive", None)
        if not buffers:
            raise InvalidArgument("post_message: a message has at least one frame")
        dests = [_flat(b) for b in buffers]
        tasks = [asyncio.ensure_future(self._recv_frame(d)) for d in dests]
        for task in tasks:
            task.add_done_callback(_retrieved)
        done = tasks[0] if len(tasks) == 1 else asyncio.gather(*tasks)
        if done is not tasks[0]:
            done.add_done_callback(_retrieved)
        return _Posted(done, sum(_nbytes(d) for d in dests), on_step)

    async def _recv_frame(self, dest: Any) -> None:
        # ucxx does not say how many bytes a receive took: a message shorter
        # than `dest` goes unnoticed, so each frame's size must be known (the
        # pull protocol fixes them all). A longer one fails the receive
        # (truncated), which ends the stream.
        try:
            await self._guard("receive", self._recv(dest, _LANE_MESSAGE))
        except TransportClosed as exc:
            if "Truncated" in type(exc.__cause__).__name__:  # (ucxx's UCXX... or UCX...)
                raise TransportClosed(
                    f"UCX connection to {self.peer} closed: a message longer than the "
                    f"{_nbytes(dest)}-byte buffer posted for it") from exc
            raise
        if _is_device(dest):
            log.debug("ucx message from %s: %d device bytes in", self.peer, _nbytes(dest))

    def post_message(self, *buffers: Any, on_step: Callable[[int], None] | None = None,
                     step: int = STEP) -> None:
        self._posted.append(self._post(buffers, on_step))

    async def recv_message(self, *buffers: Any, on_step: Callable[[int], None] | None = None,
                           step: int = STEP) -> None:
        # (a caller's cancel reaches the receive, which ends the stream: UCX
        # cannot withdraw a posted receive)
        posted = self._post(buffers, on_step)
        await posted.done
        posted.landed()

    async def recv_head(self) -> Head:
        task, self._head_task = self._head_task, None
        if task is None:
            return HEAD.unpack(await self.recv_exactly(HEAD.size))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._head_task = task  # (still on its way: the next call takes it)
            raise

    async def recv_next(self) -> Head | None:
        if not self._posted:
            return await self.recv_head()
        oldest = self._posted[0]
        if not oldest.done.done() and self._head_task is None:
            await asyncio.wait({oldest.done}, timeout=_HEAD_POLL_S)
        if not oldest.done.done():  # slow: the sender may be waiting for bytes, or failing
            if self._head_task is None:
                if self._closed:
                    raise _closed_error(self.peer, "receive", None)
                self._head_task = asyncio.ensure_future(self._read_head())
                self._head_task.add_done_callback(_retrieved)
            await asyncio.wait({oldest.done, self._head_task},
                               return_when=asyncio.FIRST_COMPLETED)
            if not oldest.done.done():
                return await self.recv_head()
        self._posted.popleft()
        oldest.landed()
        return None

    async def _read_head(self) -> Head:
        return HEAD.unpack(await self.recv_exactly(HEAD.size))

    # ---------------------------------------------------------- receive ---
    async def _next_head(self) -> None:
        await self._guard("receive", self._recv(self._head, _LANE_HEAD))
        count, inline = _HEAD.unpack_from(self._head, 0)
        # (checked: a peer, authenticated or not yet, must not make us read
        # past the head or allocate what it pleases)
        if count > _MAX_RECORDS or inline > _INLINE_BUDGET:
            raise self._bad_head(f"{count} records, {inline} inline bytes")
        pos = _HEAD.size
        body = pos + count * _RECORD.size
        for _ in range(count):
            kind, size = _RECORD.unpack_from(self._head, pos)
            pos += _RECORD.size
            if kind not in (_INLINE, _HOST, _DEVICE) or (
                    kind == _INLINE and body + size > len(self._head)):
                raise self._bad_head(f"a record of kind {kind} and {size} bytes")
            if kind == _INLINE:
                self._pending.append([kind, size, bytes(self._head[body:body + size]), 0])
                body += size
            else:
                self._pending.append([kind, size, None, 0])

    async def recv_steps(self, buffer: memoryview, step: int,
                         on_step: Callable[[int], None]) -> None:
        """Whole messages arrive whole: receiving `buffer` step by step would
        only split (and stage) messages, so it is received at once."""
        await self.recv_into(buffer)
        on_step(_nbytes(buffer))

    async def recv_into(self, buffer: Any) -> None:
        if self._closed:
            raise _closed_error(self.peer, "receive", None)
        dest = _flat(buffer)
        want, got = _nbytes(buffer), 0
        async with self._recv_lock:
            try:
                await self._fill(dest, want)
            except TransportClosed as exc:
                got = getattr(exc, "got", 0)
                raise TransportClosed(f"{exc} (after {got} of {want} bytes)") from exc

    async def _fill(self, dest: Any, want: int) -> None:
        got = 0
        try:
            while got < want:
                if not self._pending:
                    await self._next_head()
                    continue
                rec = self._pending[0]
                kind, size, data, offset = rec
                if data is None and size <= want - got:
                    # The whole message fits: receive it in place (zero copy).
                    if kind == _DEVICE:
                        log.debug("ucx receive from %s: head in, posting %d device bytes",
                                  self.peer, size)
                    await self._guard("receive", self._recv(dest[got:got + size], _LANE_DATA))
                    if kind == _DEVICE:
                        log.debug("ucx receive from %s: %d device bytes in", self.peer, size)
                    got += size
                    self._pending.pop(0)
                    continue
                if data is None:  # straddles this call: stage it on the host
                    if size > self._max_staged:  # (our own messages that straddle are small)
                        raise self._bad_head(f"a message of {size} bytes straddling a receive")
                    staged = bytearray(size)
                    await self._guard("receive", self._recv(staged, _LANE_DATA))
                    rec[2] = data = memoryview(staged)
                take = min(size - offset, want - got)
                _copy_into(dest, got, data, offset, take)
                got += take
                rec[3] = offset + take
                if rec[3] == size:
                    self._pending.pop(0)
        except TransportClosed as exc:
            exc.got = got
            raise

    def _bad_head(self, what: str) -> TransportError:
        """A head no peer of ours sends: this stream ends here."""
        if not self._closed:
            self._closed = True
            _abort(self._ep)
        return TransportError(f"malformed UCX message head from {self.peer}: {what}")

    # ------------------------------------------------------------ close ---
    async def _guard(self, what: str, aw: Any) -> Any:
        """Await a UCX operation, converting its errors at this boundary. A
        close() from elsewhere wakes it with TransportClosed; a cancel of its
        own caller stays a cancel, even when a close() follows it (ucxx may
        then end the operation with an error of its own)."""
        task = asyncio.current_task()
        self._busy.add(task)
        try:
            return await aw
        except Timeout:  # (a stalled peer: the stream is closed, the message is ours)
            raise
        except (asyncio.CancelledError, Exception) as exc:
            woken = task is not None and task in self._woken
            cancelled = task is not None and task.cancelling() > (1 if woken else 0)
            if woken:
                self._woken.discard(task)
                task.uncancel()  # (close()'s cancel, not our caller's)
            # A message cut short leaves the stream out of step (a receive stays
            # posted and would take the peer's next message; a send may have
            # sent its head only): end the stream, which cancels its requests.
            await self.close()
            if cancelled:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise asyncio.CancelledError() from exc
            if isinstance(exc, asyncio.CancelledError):
                raise _closed_error(self.peer, what, None) from None
            raise _closed_error(self.peer, what, exc) from exc  # ucxx's UCXError, ValueError
        finally:
            self._busy.discard(task)
            # A cancelled task keeps its error, whose traceback holds this
            # frame: this frame must not hold the task too, or that cycle
            # (and every buffer the frames below name) waits for a full pass
            # of the garbage collector, which large buffers do not hasten.
            del task

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _abort(self._ep)
        me = asyncio.current_task()
        for task in list(self._busy):
            if task is not me:
                self._woken.add(task)
                task.cancel(_CLOSED)


class _Posted:
    """A message's posted receives: done when every frame is in."""

    __slots__ = ("done", "nbytes", "on_step")

    def __init__(self, done: asyncio.Future, nbytes: int,
                 on_step: Callable[[int], None] | None) -> None:
        self.done, self.nbytes, self.on_step = done, nbytes, on_step

    def landed(self) -> None:
        """Raise the receive's error, or report the message whole."""
        self.done.result()
        if self.on_step is not None:
            self.on_step(self.nbytes)


def _retrieved(fut: asyncio.Future) -> None:
    """A receive nobody may await any more (its stream failed) is not
    reported as an error never retrieved."""
    if not fut.cancelled():
        fut.exception()


def _copy_into(dest: Any, at: int, src: memoryview, offset: int, n: int) -> None:
    if isinstance(dest, memoryview):
        dest[at:at + n] = src[offset:offset + n]
    else:  # a device destination, filled from host staging
        import numpy  # noqa: PLC0415

        dest[at:at + n].set(numpy.frombuffer(src, numpy.uint8, n, offset))


class _Port:
    """A ucxx listener and the `UCXListener` it currently serves (None: refuse).

    ucxx frees a listener only once every endpoint it accepted is gone, and a
    connection request reaching a half-freed one crashes the process (ucxx
    0.52). So a ucxx listener is never dropped: closing ours detaches it, later
    connections are refused by `_dispatch`, and listening again on the same port
    in this process reattaches it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.owner: UCXListener | None = None
        self.ucxx_listener: Any = None


_ports: dict[int, _Port] = {}


async def _dispatch(port: _Port, endpoint: Any) -> None:
    owner = port.owner
    if owner is None or owner._closing:
        _abort(endpoint)  # the client's welcome never comes: it reports refusal
        return
    await owner._accept(endpoint)


class UCXListener(Listener):
    def __init__(self, host: str, handler: Handler) -> None:
        self._handler = handler
        self._host = host
        self._streams: set[UCXStream] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._port: _Port | None = None
        self._number = 0

    def start(self, port: int) -> None:
        ucxx = _load()
        if ":" in self._host:
            raise InvalidArgument(
                f"cannot listen on {self._host}: ucxx listeners accept IPv4 connections only; "
                "use an IPv4 address or the tcp transport")
        try:
            socket.getaddrinfo(self._host, port, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            raise ConnectionRefused(f"cannot listen on {self._host}:{port}: {exc}") from exc
        loop = asyncio.get_running_loop()
        _event_progress(ucxx, loop)
        bound = _ports.get(port) if port else None
        if bound is not None and bound.owner is None and bound.loop is loop:
            bound.owner = self
        else:
            bound = _Port(loop)
            try:
                bound.ucxx_listener = ucxx.create_listener(
                    functools.partial(_dispatch, bound), port,
                    connect_timeout=_UCXX_HANDSHAKE_S)  # (see _UCXX_HANDSHAKE_S)
            except Exception as exc:
                raise ConnectionRefused(f"cannot listen on UCX port {port}: {exc}") from exc
            bound.owner = self
            _ports[bound.ucxx_listener.port] = bound
        self._port, self._number = bound, bound.ucxx_listener.port

    @property
    def address(self) -> str:
        return f"ucx://{self._host}:{self._number}"

    async def _accept(self, endpoint: Any) -> None:
        stream = UCXStream(endpoint, f"ucx-peer-{endpoint.uid:#x}")
        self._streams.add(stream)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await stream.send(_WELCOME)
            await self._handler(stream)
        except TransportClosed:
            pass
        finally:
            self._tasks.discard(task)
            del task  # (see `UCXStream._guard`)
            self._streams.discard(stream)
            await stream.close()

    async def close(self) -> None:
        self._closing = True
        if self._port is not None and self._port.owner is self:
            self._port.owner = None
        for stream in list(self._streams):
            await stream.close()
        me = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not me]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class UCXBackend(Backend):
    scheme = "ucx"
    ipv6 = False  # ucxx listeners bind IPv4 only

    def __init__(self) -> None:
        _load()  # fail at selection time (ConfigError via the registry) if unusable

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        listener = UCXListener(host, handler)
        listener.start(port)
        return listener

    async def connect(self, address: str, timeout: float, bind: Bind | None = None) -> Stream:
        if bind is not None:  # (ucxx picks an endpoint's source itself)
            raise ConfigError("the ucx transport cannot choose where a connection starts "
                              "(source address or port): rails bind and HOPLITE_PATHS need tcp")
        _, host, port = split_address(address, "ucx")
        ucxx = _load()
        loop = asyncio.get_running_loop()
        _event_progress(ucxx, loop)
        deadline = loop.time() + timeout  # one deadline for the endpoint and the welcome
        try:
            ep = await _connect_endpoint(ucxx, host, port, timeout)
        except TimeoutError as exc:
            raise Timeout(f"connecting to {host}:{port} over UCX took longer than "
                          f"{timeout:g}s") from exc
        except Exception as exc:  # UCXError subclasses: unreachable, refused, reset
            raise ConnectionRefused(f"cannot connect to {host}:{port} over UCX: {exc}") from exc
        stream = UCXStream(ep, f"{host}:{port}")
        # The listener's welcome tells an accepted connection from one that a
        # closed listener dropped right after UCX's own handshake.
        welcome = bytearray(len(_WELCOME))
        try:
            async with asyncio.timeout_at(deadline):
                await stream.recv_into(memoryview(welcome))
        except TimeoutError as exc:
            await stream.close()
            raise Timeout(f"connecting to {host}:{port} over UCX took longer than {timeout:g}s "
                          "(no welcome from the listener)") from exc
        except TransportClosed as exc:
            await stream.close()
            raise ConnectionRefused(f"{host}:{port} refused the UCX connection") from exc
        if welcome != _WELCOME:
            await stream.close()
            raise ConnectionRefused(f"{host}:{port} is not a hoplite-gpu UCX listener")
        return stream


async def _connect_endpoint(ucxx: Any, host: str, port: int, timeout: float) -> Any:
    """ucxx's `create_endpoint`, given up on after `timeout` (TimeoutError)
    without being cancelled: cancelling it mid-handshake frees a buffer that
    UCX may still write into (see `_UCXX_HANDSHAKE_S`). One given up on is
    closed when it ends, if it ends with an endpoint."""
    task = asyncio.ensure_future(ucxx.create_endpoint(host, port,
                                                      connect_timeout=_UCXX_HANDSHAKE_S))
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if task in done:
        return task.result()
    task.add_done_callback(_close_abandoned)
    raise TimeoutError


def _close_abandoned(task: asyncio.Future) -> None:
    if task.cancelled() or task.exception() is not None:
        return  # (the exception is retrieved: a peer that went away is no news)
    _abort(task.result())
