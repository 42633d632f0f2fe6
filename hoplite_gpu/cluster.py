"""LocalCluster: a directory process plus N worker processes on this machine,
for the demo, the tests and benchmarks. Workers run picklable functions sent
to them, inside an initialised hoplite-gpu runtime."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .auth import new_token
from .config import Config, check_timeout
from .errors import HopliteError, InvalidArgument, Timeout
from .lifecycle import Closing, stop_process
from .tls import load as load_tls

_ADDRESS = re.compile(r"listening on (\S+)")


class WorkerError(HopliteError):
    """A function sent to a worker raised. The message says what; it carries the
    worker's traceback too unless the error was one of ours (a HopliteError,
    whose message says it all); `worker_traceback` always has it."""

    worker_traceback = ""


def _worker_main(conn, address: str, token: str, settings: dict[str, Any]) -> None:
    import signal

    import hoplite_gpu as hg

    # Ctrl-C reaches the whole process group: the driver stops the workers
    # (and reports the interrupt); a traceback from each would only bury it,
    # and one still in a job is killed after a moment.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        hg.init(address, token=token, **settings)
        conn.send_bytes(_answer(0, "ok", hg.node_id()))  # (job 0: being ready)
    except BaseException as exc:  # (said to the driver, not only to our stderr)
        conn.send_bytes(_answer(0, "err", _error(exc)))
        return
    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:
            break
        if not job:
            break
        seq, payload = pickle.loads(job)
        try:
            # (unpickled here: an argument this process cannot rebuild is the
            # job's error, not the worker's death)
            fn, args, kwargs = pickle.loads(payload)
            answer = _answer(seq, "ok", fn(*args, **kwargs))
        except BaseException as exc:  # report everything, the worker lives on
            answer = _answer(seq, "err", _error(exc))
        conn.send_bytes(answer)
    hg.shutdown()


def _answer(seq: int, status: str, value: Any) -> bytes:
    """A job's answer; its value pickled apart, so that a value the driver
    cannot rebuild is that job's error, found once the job is known."""
    return pickle.dumps((seq, status, pickle.dumps(value)))


def _error(exc: BaseException) -> tuple[str, str, bool]:
    return (f"{type(exc).__name__}: {exc}", traceback.format_exc(), isinstance(exc, HopliteError))


@dataclasses.dataclass
class _DirectoryProcess:
    """A `hoplite-gpu directory` process, the thread reading its output, and
    the address it listens on."""

    proc: subprocess.Popen
    output: threading.Thread
    address: str


class LocalCluster(Closing):
    """``with LocalCluster(8) as c: c.map(fn, [args0, args1, ...])``.

    `standbys` more directory processes start beside the first, and every
    node is given all their addresses (``"first,standby,..."``): when the
    one in use is gone, nodes move to the next (`kill_directory`)."""

    def __init__(self, num_workers: int = 8, *, token: str | None = None,
                 start_timeout: float = 60.0, directory_args: Sequence[str] = (),
                 standbys: int = 0, **settings: Any) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise InvalidArgument(f"num_workers must be an int >= 0; got {num_workers!r}")
        if isinstance(standbys, bool) or not isinstance(standbys, int) or standbys < 0:
            raise InvalidArgument(f"standbys must be an int >= 0 (standby directories); "
                                  f"got {standbys!r}")
        # Checked here, with the HOPLITE_* variables the processes inherit,
        # where the error can be read (a worker's or the directory's would
        # only say that it exited); None: the default.
        settings = {k: v for k, v in settings.items() if v is not None}
        load_tls(Config.from_env(None, **settings))  # (unreadable TLS files too)
        self.num_workers = num_workers
        self.token = token or new_token()
        self.settings = settings
        self.start_timeout = check_timeout(start_timeout)
        self.directory_args = list(directory_args)
        self.standbys = standbys
        #: what workers are given: the directories' addresses, comma-separated
        self.address = ""
        self.node_ids: list[str] = []
        #: the directory processes, the first (the one nodes use first) first
        self._directories: list[_DirectoryProcess] = []
        self._procs: list[mp.Process] = []
        self._conns: list[Any] = []
        #: per worker, the jobs to send, sent by a thread of its own (a large
        #: job never blocks the caller, nor waits for a large answer to be read)
        self._outboxes: list[queue.SimpleQueue[bytes | None]] = []
        self._senders: list[threading.Thread] = []
        #: per worker, the jobs whose answers are awaited, oldest first (0:
        #: its start); a job given up at its deadline leaves, and its late
        #: answer is dropped when it comes
        self._jobs: list[collections.deque[int]] = []
        #: per worker, answers that came while another job's was awaited
        #: (job number -> answer), each taken by its own job's `_recv`
        self._early: list[dict[int, list]] = []
        self._seq = itertools.count(1)

    # ------------------------------------------------------------ set-up ---
    def _open(self) -> None:
        self.start()

    def start(self) -> None:
        """Start the directory and the workers, within `start_timeout` seconds in
        all; if any of it fails, whatever had started is stopped again."""
        if self._procs or self._directories:
            raise HopliteError("this LocalCluster is started already")
        deadline = time.monotonic() + self.start_timeout
        try:
            self._start_directory()
            for _ in range(self.standbys):
                self._directories.append(self._spawn_directory(0))
            self.address = ",".join(d.address for d in self._directories)
            for _ in range(self.num_workers):
                self._procs.append(None)  # type: ignore[arg-type]
                self._conns.append(None)
                self._outboxes.append(queue.SimpleQueue())
                self._senders.append(None)  # type: ignore[arg-type]
                self._jobs.append(collections.deque([0]))
                self._early.append({})
                self._attach(len(self._procs) - 1)
            self.node_ids = [self._recv(i, max(0.0, deadline - time.monotonic()))
                             for i in range(self.num_workers)]
        except BaseException:
            self.close()
            raise

    def _attach(self, worker: int) -> None:
        """Start worker `worker`'s process and the thread sending its jobs."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, self.address, self.token, self.settings),
                           daemon=True)
        proc.start()
        child.close()
        outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        sender = threading.Thread(target=_send_jobs, args=(parent, outbox),
                                  name=f"hoplite-worker-{worker}-jobs", daemon=True)
        sender.start()
        self._procs[worker], self._conns[worker] = proc, parent
        self._outboxes[worker], self._senders[worker] = outbox, sender

    def restart(self, worker: int) -> str:
        """Replace a (dead) worker by a fresh process, as a task system restarts a
        failed task; returns the new node id."""
        self.kill(worker)
        self._outboxes[worker].put(None)
        self._senders[worker].join(5)
        self._conns[worker].close()
        self._jobs[worker] = collections.deque([0])
        self._early[worker] = {}
        self._attach(worker)
        self.node_ids[worker] = self._recv(worker, self.start_timeout)
        return self.node_ids[worker]

    @property
    def _directory(self) -> subprocess.Popen | None:
        """The first directory's process (None before `start` and after `close`)."""
        return self._directories[0].proc if self._directories else None

    @property
    def directory_addresses(self) -> list[str]:
        """Each directory's address, the first first (a killed one's too)."""
        return [d.address for d in self._directories]

    def restart_directory(self, which: int = 0) -> None:
        """Kill directory `which` (0: the first) and start a new one on the
        same address: nodes that used it must reconnect and re-register what
        they hold (the directory's state is soft); to the others it is a
        standby again."""
        directory = self._directory_at(which)
        port = int(directory.address.rpartition(":")[2])
        self._stop_directory(directory, kill=True)
        self._directories[which] = self._spawn_directory(port)

    def kill_directory(self, which: int = 0) -> None:
        """SIGKILL directory `which` (0: the first; then the standbys in
        order) and reap it. It is not started again: nodes move to a standby."""
        stop_process(self._directory_at(which).proc, kill=True)

    def directory_pid(self, which: int = 0) -> int:
        """The process id of directory `which` (0: the first)."""
        return self._directory_at(which).proc.pid

    def _directory_at(self, which: int) -> _DirectoryProcess:
        if not self._directories:
            raise HopliteError("this LocalCluster is not running: start() it first")
        if isinstance(which, bool) or not isinstance(which, int) \
                or not 0 <= which < len(self._directories):
            raise HopliteError(f"no directory {which!r}: this cluster has directories "
                               f"0 to {len(self._directories) - 1}")
        return self._directories[which]

    @staticmethod
    def _stop_directory(directory: _DirectoryProcess, kill: bool = False) -> None:
        stop_process(directory.proc, kill=kill)
        directory.output.join(5)  # (it reads to the end of the exited process's output)
        for pipe in (directory.proc.stdin, directory.proc.stdout):
            if pipe:
                pipe.close()

    def _start_directory(self) -> None:
        """Start the first directory."""
        first = self._spawn_directory(0)
        self._directories.append(first)
        self.address = first.address

    def _spawn_directory(self, port: int) -> _DirectoryProcess:
        env = {**os.environ, "HOPLITE_TOKEN": self.token, "PYTHONUNBUFFERED": "1",
               # the directory schedules with the same settings as the workers
               **{f"HOPLITE_{k.upper()}": str(v) for k, v in self.settings.items()}}
        cmd = [sys.executable, "-m", "hoplite_gpu", "directory", "--host", "127.0.0.1", "--port", str(port),
               "--until-stdin-closes", *self.directory_args]
        # Its stdin is a pipe only we hold: if this process dies, however, so does it.
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        found: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            # The address, then whatever else it prints, so its pipe never fills.
            assert proc.stdout is not None
            with contextlib.suppress(OSError, ValueError):  # (closed under us)
                for line in proc.stdout:
                    match = _ADDRESS.search(line)
                    if match:
                        found.put(match.group(1))
            found.put(None)  # it exited

        output = threading.Thread(target=read, name="hoplite-directory-output", daemon=True)
        output.start()
        directory = _DirectoryProcess(proc, output, "")
        try:
            address = found.get(timeout=self.start_timeout)
        except queue.Empty:
            self._stop_directory(directory, kill=True)
            raise Timeout(f"the directory did not start within {self.start_timeout:g}s") from None
        if address is None:
            code = proc.wait()
            self._stop_directory(directory)
            raise HopliteError(f"the directory exited with code {code} before listening")
        directory.address = address
        return directory

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # Interrupted (Ctrl-C, or a `kill` turned into one): workers still in a
        # job get a moment, not the usual grace.
        self.close(grace=1.0 if exc_type is KeyboardInterrupt else 10.0)

    def close(self, grace: float = 10.0) -> None:
        """Stop the workers (each ends once its job is done, or is killed after
        `grace` seconds in all) and the directory."""
        for outbox in self._outboxes:
            outbox.put(b"")  # (the worker's end: it stops once its job is done)
            outbox.put(None)  # (the sender's)
        deadline = time.monotonic() + grace
        for proc, conn in zip(self._procs, self._conns, strict=True):
            if proc is None:
                continue
            while proc.is_alive() and time.monotonic() < deadline:
                # Answers nobody collected are read (and dropped): a worker
                # blocked sending a large one would otherwise never end.
                with contextlib.suppress(EOFError, OSError):
                    while conn.poll(0):
                        conn.recv_bytes()
                proc.join(min(0.05, max(0.0, deadline - time.monotonic())))
        for proc in self._procs:
            if proc is not None and proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        for sender in self._senders:
            if sender is not None:
                sender.join(5)
        self._procs, self._conns, self._outboxes, self._senders = [], [], [], []
        self._jobs, self._early = [], []
        for directory in self._directories:
            self._stop_directory(directory)
        self._directories = []

    # ------------------------------------------------------------- work ---
    def submit(self, worker: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start `fn(*args, **kwargs)` on a worker; collect it with `result`."""
        self._submit(worker, fn, args, kwargs)

    def _submit(self, worker: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> int:
        return self._send(worker, self._job(worker, fn, args, kwargs))

    def _job(self, worker: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
        """The job, pickled, for a worker that is running; nothing is sent."""
        self._check_worker(worker)
        if not self._procs[worker].is_alive():
            raise WorkerError(f"worker {worker} died (exit code {self._exitcode(worker)})")
        try:
            return pickle.dumps((fn, args, kwargs))
        except Exception as exc:  # (pickle raises PicklingError, AttributeError, TypeError ...)
            raise InvalidArgument(
                f"a LocalCluster job must be picklable, as it is sent to another process: "
                f"a function defined at a module's top level and plain arguments; "
                f"{getattr(fn, '__qualname__', fn)!r}: {type(exc).__name__}: {exc}") from exc

    def _send(self, worker: int, payload: bytes) -> int:
        seq = next(self._seq)
        self._jobs[worker].append(seq)
        self._outboxes[worker].put(pickle.dumps((seq, payload)))
        return seq

    def _exitcode(self, worker: int) -> int | None:
        proc = self._procs[worker]
        proc.join(1)  # (reaped first: a process that just ended has no code before)
        return proc.exitcode

    def _check_worker(self, worker: int) -> None:
        if not self._procs:
            raise HopliteError("this LocalCluster is not running: start() it (or use it in "
                               "a `with` block) first")
        if not (isinstance(worker, int) and 0 <= worker < len(self._conns)):
            raise HopliteError(f"no worker {worker!r}: this cluster has workers "
                               f"0 to {len(self._conns) - 1}")

    def result(self, worker: int, timeout: float = 300.0) -> Any:
        """The answer of the oldest job submitted to `worker` and not yet
        collected. A result given up (its timeout, Ctrl-C) gives that job
        up: its answer, when it comes, is dropped."""
        return self._recv(worker, check_timeout(timeout, zero=True))

    def _recv(self, worker: int, timeout: float, seq: int | None = None) -> Any:
        """The answer of job `seq` (None: the oldest awaited) of `worker`;
        answers of its other awaited jobs that come first are kept for them."""
        self._check_worker(worker)
        jobs, early = self._jobs[worker], self._early[worker]
        if not jobs:
            raise HopliteError(f"worker {worker} has no job whose result is awaited")
        seq = jobs[0] if seq is None else seq
        deadline = time.monotonic() + timeout
        try:
            answer = early.pop(seq, None)
            while answer is None:
                got = self._next_answer(worker, deadline)
                if got is None:
                    raise Timeout(f"worker {worker} did not answer within {timeout:g}s")
                number, *rest = pickle.loads(got)
                if number == seq:
                    answer = rest
                elif number in jobs:
                    early[number] = rest  # another caller's, still awaited
                # else: the answer of a job given up, dropped
        except BaseException:
            # Given up (its deadline, Ctrl-C): its answer, when it comes, is
            # dropped, not taken for a later call's.
            with contextlib.suppress(ValueError):
                jobs.remove(seq)
            raise
        jobs.remove(seq)
        status, data = answer
        try:
            value = pickle.loads(data)
        except Exception as exc:  # e.g. an exception class this process cannot rebuild
            raise WorkerError(f"worker {worker} answered a value this process cannot "
                              f"unpickle: {type(exc).__name__}: {exc}") from None
        if status == "err":
            what, trace, ours = value
            err = WorkerError(f"worker {worker} raised {what}" + ("" if ours else f"\n{trace}"))
            err.worker_traceback = trace
            raise err
        return value

    def _next_answer(self, worker: int, deadline: float) -> bytes | None:
        """The worker's next answer, or None at the deadline."""
        conn = self._conns[worker]
        try:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                return None
            return conn.recv_bytes()
        except (EOFError, OSError):
            raise WorkerError(f"worker {worker} died (exit code "
                              f"{self._exitcode(worker)})") from None

    def run(self, worker: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
            **kwargs: Any) -> Any:
        timeout = check_timeout(timeout, zero=True)  # (before anything is sent)
        return self._recv(worker, timeout, self._submit(worker, fn, args, kwargs))

    def map(self, fn: Callable[..., Any], args: Sequence[Sequence[Any]], *,
            workers: Sequence[int] | None = None, timeout: float = 300.0) -> list[Any]:
        """Run ``fn(*args[i])`` on ``workers[i]`` (default: worker i), all at
        once; a call that cannot run whole (a worker that does not exist or
        died, a job that cannot be pickled) runs none of it."""
        timeout = check_timeout(timeout, zero=True)
        args = list(args)
        workers = list(range(len(args))) if workers is None else list(workers)
        if len(workers) != len(args):
            raise InvalidArgument(f"map got {len(args)} argument tuples for {len(workers)} "
                                  "workers; give one worker per tuple")
        jobs = [(w, self._job(w, fn, tuple(a), {})) for w, a in zip(workers, args, strict=True)]
        sent = [(w, self._send(w, payload)) for w, payload in jobs]
        out: list[Any] = []
        try:
            deadline = time.monotonic() + timeout
            for w, seq in sent:
                out.append(self._recv(w, max(0.0, deadline - time.monotonic()), seq))
            return out
        finally:
            # One failed: the others' answers are not awaited any more (each
            # is dropped when it comes, not taken for a later call's).
            for w, seq in sent[len(out):]:
                with contextlib.suppress(ValueError):
                    self._jobs[w].remove(seq)
                self._early[w].pop(seq, None)

    def kill(self, worker: int) -> None:
        self._check_worker(worker)
        if self._procs[worker].is_alive():
            self._procs[worker].kill()
        self._procs[worker].join(5)

    def pid(self, worker: int) -> int | None:
        self._check_worker(worker)
        return self._procs[worker].pid


def _send_jobs(conn: Any, outbox: queue.SimpleQueue) -> None:
    while (job := outbox.get()) is not None:
        try:
            conn.send_bytes(job)
        except (OSError, ValueError):  # the worker is gone: its answers say so
            return

