"""The runtime's lifecycle as a user's program lives it: interrupts, tokens,
fork and interpreter exit. Each test fails on a confirmed bug."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
from in_process import wait_child

import hoplite_gpu as hg


class _Interrupted(BaseException):
    """What the test's SIGINT handler raises: a Ctrl-C that pytest leaves to the test."""


def _second_node(rt):
    """Another node of the runtime's cluster, on the runtime's own loop."""
    from hoplite_gpu.node.node import Node

    async def start():
        node = Node(rt.config, rt.token, rt.address)
        await node.start()
        return node

    return rt.call(start(), 10)


def test_a_blocking_get_interrupted_by_ctrl_c_does_not_go_on_pulling():
    """Ctrl-C during a blocking call that waits on the loop's path leaves its
    task running: the get the user gave up goes on waiting and, once a peer
    puts the object, pulls a copy the process holds until shutdown (a call
    past its deadline, or a direct call interrupted, is withdrawn instead)."""
    rt = hg.init(direct_calls=False, timeout_s=30)
    other = _second_node(rt)
    oid = hg.ObjectID.from_name("interrupted-get")
    main = threading.main_thread().ident

    def on_sigint(*_):
        raise _Interrupted

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            hg.get(oid)
        except _Interrupted:
            pass
        timer.join(5)
        rt.call(other.put(np.ones(300_000), oid), 10)
        time.sleep(0.7)
        holders = [h["node"] for h in hg.object_info(oid)["holders"]]
        assert hg.node_id() not in holders, "the interrupted get pulled the object anyway"
        assert hg.node_stats()["held_bytes"] == 0
    finally:
        signal.signal(signal.SIGINT, previous)
        rt.call(other.close(), 10)
        hg.shutdown()


def test_a_token_of_arbitrary_bytes_from_the_environment_is_usable_or_refused_clearly(monkeypatch):
    """HOPLITE_TOKEN made of random bytes (`head -c 16 /dev/urandom`) reaches
    Python as a str with surrogate escapes; the handshake's `token.encode()`
    then raises a raw UnicodeEncodeError on every connection."""
    monkeypatch.setenv("HOPLITE_TOKEN", os.fsdecode(b"\xff\xfesecret\x80"))
    try:
        hg.init(connect_timeout_s=3, timeout_s=5)
    except hg.HopliteError:
        return  # refused with the project's own error (ConfigError): fine
    try:
        assert hg.get(hg.put(b"abc"), timeout=5) == b"abc"
    finally:
        hg.shutdown()


def test_a_child_forked_while_another_thread_is_in_init_can_init():
    """`init` holds the module's lock while it connects. A process forked at
    that moment (multiprocessing's fork start method, say) inherits the lock
    held by a thread that does not exist in it: its own `init()` (and its
    `shutdown()` at exit) wait forever."""
    silent = socket.socket()  # accepts connections, never says hello
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1]

    def joining():
        try:
            hg.init(f"127.0.0.1:{port}", token="x", connect_timeout_s=2)
        except hg.HopliteError:
            pass

    th = threading.Thread(target=joining)
    th.start()
    try:
        time.sleep(0.3)  # that thread is now in init, waiting for the handshake
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (forking a threaded process)
            pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            code = 0
            try:
                hg.init(timeout_s=5)
                if hg.get(hg.put(b"child"), timeout=5) != b"child":
                    code = 3
                hg.shutdown()
            except BaseException:
                code = 2
            os._exit(code)
        status = wait_child(pid, 6, "the forked child's init() hung (the lock it inherited "
                                    "is held by a thread it does not have)")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        th.join(10)
        silent.close()
        hg.shutdown()


_OUTLIVING_MAIN = textwrap.dedent("""
    import threading, time
    import numpy as np
    import hoplite_gpu as hg
    from hoplite_gpu.node.node import Node

    rt = hg.init(timeout_s=10, shared_memory=False)  # (every pull over TCP, as between hosts)

    async def start():
        node = Node(rt.config, rt.token, rt.address)
        await node.start()
        return node

    other = rt.call(start(), 10)
    oid = rt.call(other.put(np.arange(300_000, dtype=np.float64), hg.ObjectID.random()), 10)

    def worker():
        while threading.main_thread().is_alive():
            time.sleep(0.01)
        time.sleep(0.3)  # the interpreter is now waiting for this thread to end
        try:
            value = hg.get(oid, timeout=5)
            print("GOT", value[-1], flush=True)
        except BaseException as exc:
            print("RAISED", type(exc).__name__, exc, flush=True)
        rt.call(other.close(), 5)

    threading.Thread(target=worker).start()  # not a daemon: the process waits for it
""")


def test_a_thread_that_outlives_the_main_thread_can_still_pull():
    """Once the main thread returns, Python shuts the default thread-pool
    executors down before it joins the other threads; the TCP transport
    resolves every address through the loop's default executor, so any new
    connection (a pull from a peer, a reconnect) then fails with a raw
    RuntimeError("cannot schedule new futures after shutdown"), though the
    runtime is still up (the atexit shutdown has not run)."""
    proc = subprocess.run([sys.executable, "-c", _OUTLIVING_MAIN], capture_output=True,
                          text=True, timeout=30)
    assert "GOT 299999.0" in proc.stdout, proc.stdout + proc.stderr[-2000:]


_FORKS_THEN_DIES = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import hoplite_gpu as hg

    hg.init(sys.argv[1], token=sys.argv[2], timeout_s=10)
    oid = hg.put(np.ones(1 << 20, np.uint8))  # (not inline: held by this node alone)
    pid = os.fork()
    if pid == 0:  # a data-loader worker, say: outlives its parent a while
        time.sleep(30)
        os._exit(0)
    print(oid.hex(), pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_forked_child_does_not_hide_its_parents_death():
    """A child forked after `init` shared the parent's directory connection,
    so when the parent died the connection lived on in the child: the
    directory saw the node go only when its lease ran out (here 30 s), and
    every get of its objects waited that long to fail over or be told."""
    from hoplite_gpu.cluster import LocalCluster
    from hoplite_gpu.errors import ObjectNotFound

    with LocalCluster(0, node_lease_s=30, heartbeat_interval_s=1) as c:
        proc = subprocess.Popen([sys.executable, "-c", _FORKS_THEN_DIES, c.address, c.token],
                                stdout=subprocess.PIPE, text=True)
        oid_hex, child = proc.stdout.readline().split()  # (the child holds the pipe open)
        proc.wait(30)
        proc.stdout.close()
        try:
            hg.init(c.address, token=c.token, timeout_s=10)
            oid = hg.ObjectID(bytes.fromhex(oid_hex))
            start, holders = time.monotonic(), None
            while time.monotonic() - start < 10:
                try:
                    holders = hg.object_info(oid).get("holders")
                except ObjectNotFound:
                    holders = []
                if not holders:
                    break
                time.sleep(0.1)
            assert not holders, (f"the directory still lists the dead node as holding the object "
                                 f"{time.monotonic() - start:.1f}s after it died: {holders}")
        finally:
            os.kill(int(child), signal.SIGKILL)
            hg.shutdown()


@pytest.fixture
def runtime_settings() -> dict:
    """The `local` runtime's settings here."""
    return {"chunk_size": 64 * 1024, "timeout_s": 20}


def test_a_forked_child_gets_a_prompt_clear_answer_and_can_init(local):
    """In a forked child the runtime's loop thread does not exist, but the
    runtime still looks open (`loop.is_running()` is copied state): a call is
    queued to a loop nobody runs and blocks its whole deadline plus 5 s of
    grace before a misleading Timeout; `init()` is refused as "already
    called", and `shutdown()` blocks for 15 s."""
    small = hg.put(b"abc")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (forking a threaded process)
        pid = os.fork()
    if pid == 0:  # the child: exit code says what went wrong
        signal.alarm(30)
        code = 0
        try:
            start = time.monotonic()
            try:
                hg.get(small, timeout=0.5)
            except hg.HopliteError:
                pass
            if time.monotonic() - start > 2.5:
                os._exit(1)  # hung past its 0.5 s deadline
            try:
                hg.init(timeout_s=5)  # the child's own runtime
                if hg.get(hg.put(b"child"), timeout=2) != b"child":
                    code = 3
                hg.shutdown()
            except BaseException:
                code = 2
        finally:
            os._exit(code)
    status = wait_child(pid, 60, "the forked child did not finish within 60 s")
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, {1: "a call in the child hung past its deadline",
                       2: "init() in the child failed",
                       3: "the child's own runtime returned the wrong value"}.get(code, code)
