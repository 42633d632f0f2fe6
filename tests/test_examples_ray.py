"""The examples (examples/*.py) and the Ray helpers they use (hoplite_gpu/ray.py),
as a newcomer meets them: arguments that cannot work, an example's `run`
called again in the same Ray session, and `join` / `join_async` called the way
Ray actors call them (from several threads or coroutines at once, and again
after the directory actor was started anew)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

# Single-machine Ray on loopback (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from ray_local import ray_with_directory  # noqa: E402

import hoplite_gpu as hg  # noqa: E402
import hoplite_gpu.ray as hray  # noqa: E402
from hoplite_gpu import api  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str):
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray whose workers can import the examples by name (as
    benchmarks/rayemu.py arranges), with the default directory actor."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES), old) if p)
    try:
        with ray_with_directory("hoplite-examples", num_cpus=8):
            yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@contextlib.contextmanager
def _directory(name: str, **kwargs):
    hg.shutdown()
    try:
        yield hray.start_directory(name=name, **kwargs)
    finally:
        hg.shutdown()
        hray.stop_directory(name=name)


def _slow_init(monkeypatch, callers: int) -> None:
    """api.init waits (at most 1.5 s) until `callers` calls are in it: a join
    that is slow to connect, as on a loaded machine."""
    real, barrier = api.init, threading.Barrier(callers)

    def init(*args, **kwargs):
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "init", init)


# ------------------------------------------------------------ hoplite_gpu.ray ---
def test_join_from_concurrent_threads_is_idempotent(ray_session, monkeypatch):
    """join() is documented idempotent, and a threaded actor
    (max_concurrency > 1) calls it at the top of each method: calls that
    overlap each see no runtime yet, each call api.init, and all but one get
    InvalidArgument("init() was already called")."""
    with _directory("ux-threads"):
        _slow_init(monkeypatch, 3)
        results: list = [None] * 3

        def call(i: int) -> None:
            try:
                results[i] = hray.join(name="ux-threads", timeout=20)
            except Exception as exc:  # noqa: BLE001 (collected for the assert)
                results[i] = exc

        threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"concurrent join() calls failed: {errors!r}"
        assert results[0] is results[1] is results[2] is api._runtime


def test_join_async_from_concurrent_coroutines_is_idempotent(ray_session, monkeypatch):
    """The same in an async actor: methods that each start with
    `await hray.join_async()` run concurrently on the actor's loop."""
    with _directory("ux-coros"):
        _slow_init(monkeypatch, 3)

        async def main():
            return await asyncio.gather(*[hray.join_async(name="ux-coros", timeout=20)
                                          for _ in range(3)], return_exceptions=True)

        results = asyncio.run(main())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"concurrent join_async() calls failed: {errors!r}"
        assert results[0] is results[1] is results[2] is api._runtime


def test_join_after_the_directory_restarted_on_its_port_uses_the_new_token(ray_session):
    """A directory actor started again on the same fixed port (after
    stop_directory, or after it crashed) has a new token. join() compares only
    the address, so it keeps the old runtime, which can never authenticate
    with the new directory: every call then fails with DirectoryUnavailable
    after its timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hg.shutdown()
    try:
        first = hray.start_directory(name="ux-port", port=port)
        hray.join(name="ux-port", timeout=20, timeout_s=3)
        hray.stop_directory(name="ux-port")
        second = hray.start_directory(name="ux-port", port=port)
        assert second["address"] == first["address"] and second["token"] != first["token"]
        hray.join(name="ux-port", timeout=20, timeout_s=3)
        oid = hg.put(np.arange(8, dtype=np.float32))
        assert hg.get(oid, timeout=3).sum() == 28
    finally:
        hg.shutdown()
        hray.stop_directory(name="ux-port")


# ------------------------------------------------------------------ examples ---
def test_rl_weights_run_twice_in_one_ray_session(ray_session):
    """`run` is the examples' reusable entry (benchmarks/rayemu.py calls it):
    it starts its own actors and kills them, but its channel name is fixed and
    its versions are explicit from 0, so a second call in the same session
    fails: publish(version=0) is 'not newer than its head'."""
    rl_weights = _example("rl_weights")
    hray.join()
    for _ in range(2):
        res = rl_weights.run(1, 1 << 14, 1)
        assert res["actors"] == 1 and len(res["hoplite_s"]) == 1


def test_async_sgd_run_twice_in_one_ray_session(ray_session):
    """The same for async_sgd.run: WeightChannel("sgd").publish(version=0)
    raises InvalidArgument on the second call."""
    async_sgd = _example("async_sgd")
    hray.join()
    for _ in range(2):
        res = async_sgd.run(1, 1, 1 << 12, 2, max_delay=0.0)
        assert len(res["hoplite_s"]) == 1


class _RayStarted(Exception):
    pass


@pytest.mark.parametrize("name, argv", [
    ("rl_weights", ["--iterations", "0"]),            # StatisticsError after the whole run
    ("rl_weights", ["--actors", "1", "--kill"]),      # ValueError: max() arg is an empty sequence
    ("async_sgd", ["--steps", "1"]),                  # StatisticsError (step 0 is the warm-up)
    ("async_sgd", ["--size-mib", "0"]),               # IndexError in its own check
    ("ensemble_serving", ["--queries", "0"]),         # StatisticsError
    ("ensemble_serving", ["--models", "1", "--kill"]),  # AssertionError "the variants disagree"
])
def test_example_refuses_arguments_it_cannot_run(name, argv, monkeypatch):
    """Arguments that cannot give a result start Ray and the actors, run, and
    end in a raw StatisticsError / ValueError / IndexError (or a false 'the
    variants disagree'), instead of a usage error before anything starts."""
    module = _example(name)

    @contextlib.contextmanager
    def no_ray(*args, **kwargs):
        raise _RayStarted(f"{name} {' '.join(argv)} went on to start Ray")
        yield

    monkeypatch.setattr(module, "local_ray", no_ray)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code not in (0, None)
