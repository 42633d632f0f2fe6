"""The Ray helpers (hoplite_gpu/ray.py) as a Ray user meets them:
`join` / `join_async` timeouts of the wrong kind, an object put by a Ray task
whose worker Ray does not keep, a directory on every interface that serves
UCX, and a name Ray refuses. Each test fails on the code it was written
against; every wait is bounded."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time

import numpy as np
import pytest

# Single-machine Ray on loopback (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from ray_local import ray_with_directory  # noqa: E402

import hoplite_gpu as hg  # noqa: E402
import hoplite_gpu.ray as hray  # noqa: E402
from hoplite_gpu.transports import usable  # noqa: E402


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray (as tests/ray_local.py starts it) that also declares one
    GPU, so that a `@ray.remote(num_gpus=1)` task is scheduled here as on a
    GPU machine; with the default directory actor."""
    with ray_with_directory("hoplite-ray-helpers", 8, num_gpus=1):
        yield


def _bounded(fn, limit: float):
    """fn() on a thread: ("ok", value), ("raised", exc) or ("running", None)."""
    out: list = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001 (handed to the assert)
            out.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    return (out[0] if out else ("running", None)), t


# ------------------------------------------------------------------ timeouts ---
@pytest.mark.parametrize("how, timeout", [
    ("join", None),              # TypeError: unsupported operand type(s) for +: 'float' and 'NoneType'
    ("join_async", None),        # the same
    ("join", float("inf")),      # OverflowError: cannot convert float infinity to integer (inside ray.get)
    ("join", "5"),               # TypeError
])
def test_join_timeout_of_the_wrong_kind_is_a_hoplite_error(ray_session, how, timeout):
    """Every other call of the package reads `timeout=None` as "the default"
    and refuses anything else that is not a number of seconds up to a year
    with InvalidArgument (config.check_timeout). join()/join_async() do
    arithmetic on it unchecked: None and "5" end in a raw TypeError, inf in
    an OverflowError from inside ray.get."""
    hg.shutdown()
    if how == "join":
        call = lambda: hray.join(timeout=timeout)  # noqa: E731
    else:
        call = lambda: asyncio.run(hray.join_async(timeout=timeout))  # noqa: E731
    (state, value), _ = _bounded(call, 30)
    try:
        assert state != "running", f"{how}(timeout={timeout!r}) still running after 30 s"
        if timeout is None and state == "ok":
            return  # the default timeout, as hg.get(timeout=None)
        assert state == "raised" and isinstance(value, hg.InvalidArgument), (
            f"{how}(timeout={timeout!r}) -> {state} {type(value).__name__}: {value}")
    finally:
        hg.shutdown()


def test_join_with_a_nan_timeout_gives_up(ray_session):
    """join(timeout=nan) before the directory actor exists never returns:
    `_find` polls until `time.monotonic() > deadline`, which is never true
    for a NaN deadline, so the caller (an actor's __init__) hangs for ever
    instead of getting InvalidArgument (or DirectoryUnavailable)."""
    name = "review-nan"
    (state, value), thread = _bounded(lambda: hray.join(name=name, timeout=math.nan), 5)
    try:
        assert state == "raised" and isinstance(value, hg.HopliteError), (
            f"join(timeout=nan) -> {state} {value!r} (after 5 s)")
    finally:
        if thread.is_alive():  # let the stuck join find an actor of that name and end
            hray.start_directory(name=name)
            thread.join(30)
        hg.shutdown()
        hray.stop_directory(name=name)


# ----------------------------------------------------- objects put by tasks ---
@ray.remote(num_gpus=1)
def _produce_on_a_gpu_task(n: int):
    hray.join()
    return hg.put(np.arange(n, dtype=np.float32)), os.getpid()


def test_an_object_put_by_a_gpu_task_that_ended_is_reported_lost_at_once(ray_session):
    """A node is its process, and Ray does not reuse the worker of a
    `num_gpus > 0` task (max_calls defaults to 1 there: the worker exits
    after one task; idle CPU-task workers above the pool's soft limit are
    reclaimed the same way). The object a GPU task put and returned leaves
    with its worker, and a consumer's get waited its whole timeout (300 s
    by default) to end in Timeout "nobody has put it yet". It must be told
    at once that the object was lost, and why."""
    n = 300_000  # 1.2 MB: not inline, so the directory does not hold its bytes
    hg.shutdown()
    try:
        oid, pid = ray.get(_produce_on_a_gpu_task.remote(n), timeout=60)
        hray.join()
        deadline = time.monotonic() + 15  # a consumer that reads a moment later
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(hg.ObjectNotFound, match="lost.*lives only as long as a process"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # (the directory sees the node go within a lease)
                try:
                    hg.get(oid, timeout=2)
                except hg.Timeout:
                    continue
                pytest.fail("the object of a task whose worker exited was still readable")
        assert time.monotonic() - start < 10
    finally:
        hg.shutdown()


# --------------------------------------------------------- start_directory ---


def test_directory_on_every_interface_keeps_its_control_transport(ray_session):
    """docs/guide-ray.md: on a multi-node Ray cluster pass host="0.0.0.0" to
    start_directory; docs/configuration.md (HOPLITE_CONTROL_TRANSPORT): "nodes dial the
    scheme of the directory's address". DirectoryActor rewrites the address
    of a 0.0.0.0 directory as f"tcp://{ip}:{port}", dropping its scheme, so a
    directory serving UCX is announced as tcp://...; every join() then dials
    TCP into a UCX listener and ends in Timeout "did not accept us"
    (with host="127.0.0.1" the same directory announces ucx://... and works)."""
    if not usable("ucx"):
        pytest.skip("ucxx is not usable here")
    name = "review-ucx-any"
    hg.shutdown()
    try:
        info = hray.start_directory(name=name, host="0.0.0.0", control_transport="ucx")
        assert info["address"].startswith("ucx://"), (
            f"a UCX directory on 0.0.0.0 is announced as {info['address']}")
    finally:
        hg.shutdown()
        hray.stop_directory(name=name)


@ray.remote
def _joined_in_tls(name: str) -> tuple[bool, float]:
    from hoplite_gpu import api

    hray.join(name=name, timeout=30)
    value = np.arange(1000, dtype=np.float64)
    return api.runtime().tls is not None, float(hg.get(hg.put(value), timeout=30).sum())


def test_a_directory_in_tls_is_joined_by_tasks_without_tls_settings(ray_session, tmp_path):
    """start_directory hands the driver's TLS files to the actor, whose
    process may lack the driver's environment; a task whose environment
    names no TLS files joins with the directory's (the same paths on every
    machine), in TLS."""
    pytest.importorskip("cryptography")
    from benchmarks.tls import make_certificates

    files = make_certificates(tmp_path)["node"]
    name = "review-tls"
    hg.shutdown()
    try:
        info = hray.start_directory(name=name, **files)
        assert {k: info[k] for k in files} == files
        assert ray.get(_joined_in_tls.remote(name), timeout=60) == (True, 499500.0)
    finally:
        hg.shutdown()
        hray.stop_directory(name=name)


def test_start_directory_with_an_empty_name_is_invalid_argument(ray_session):
    """start_directory(name="") ends in Ray's own ValueError "The actor name
    must be specified to use `get_if_exists`" (and join(name="") waits its
    whole timeout, then says no actor of that name exists), instead of an
    InvalidArgument up front, as for the package's other bad arguments."""
    with pytest.raises(hg.InvalidArgument):
        hray.start_directory(name="")


def test_joining_before_ray_init_is_refused_and_starts_no_ray():
    """Before ray.init(), Ray's get_actor started a local Ray of its own: the
    join then waited out its timeout to find no directory there, and the
    program's own ray.init(address=...) afterwards failed ("called ray.init
    twice")."""
    import subprocess
    import sys

    code = ("import ray, hoplite_gpu as hg, hoplite_gpu.ray as hray\n"
            "for call in (lambda: hray.join(timeout=5), hray.start_directory):\n"
            "    try:\n"
            "        call()\n"
            "    except hg.NotInitialized as exc:\n"
            "        assert 'ray.init()' in str(exc), exc\n"
            "    else:\n"
            "        raise SystemExit('not refused')\n"
            "assert not ray.is_initialized(), 'a Ray was started'\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("port", [70000, -1, "8000", None])
def test_start_directory_with_a_bad_port_is_refused_before_any_actor(ray_session, port):
    """A port the actor cannot bind killed it in its __init__: the caller got
    DirectoryUnavailable wrapping Ray's traceback, colour codes included."""
    with pytest.raises(hg.InvalidArgument, match="port"):
        hray.start_directory(name="review-bad-port", port=port)


@pytest.mark.parametrize("standbys", [-1, hray.MAX_STANDBYS + 1, True, 1.0])
def test_start_directory_with_a_bad_standby_count_is_refused_before_any_actor(ray_session,
                                                                               standbys):
    with pytest.raises(hg.InvalidArgument, match="standbys"):
        hray.start_directory(name="review-bad-standbys", standbys=standbys)
    with pytest.raises(ValueError):
        ray.get_actor("review-bad-standbys")
