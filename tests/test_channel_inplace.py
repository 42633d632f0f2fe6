"""Weight channel versions written into the caller's own arrays:
`fetch(out=...)` against a plain fetch for every dtype, its checks, no
allocation in steady state (measured), `load_into` a torch module, and
`DoubleBuffer` serving one version while the next arrives."""

from __future__ import annotations

import threading
import time
import tracemalloc

import numpy as np
import pytest
from in_process import local_mode, run_nodes
from test_channel_layout import _dtype_cases

import hoplite_gpu as hg
from hoplite_gpu.channel import WeightChannel, _part
from hoplite_gpu.cluster import LocalCluster
from hoplite_gpu.config import Config

MiB = 1 << 20


def _garbage_like(value):
    """A writable, contiguous array to fetch `value` into, full of 0xAB bytes."""
    if isinstance(value, bytes):
        return np.full(len(value), 0xAB, np.uint8)
    if type(value).__module__.startswith("torch"):
        import torch

        out = torch.empty_like(value, memory_format=torch.contiguous_format)
        out.view(torch.uint8).fill_(0xAB) if out.numel() else None
        return out
    out = np.empty_like(np.asarray(value), order="C")
    out.reshape(-1).view(np.uint8)[:] = 0xAB
    return out


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if type(value).__module__.startswith("torch"):
        import torch

        return value.contiguous().view(torch.uint8).numpy().tobytes() if value.numel() else b""
    return np.ascontiguousarray(value).tobytes()


def test_fetch_out_writes_every_dtype_as_a_plain_fetch_returns_it():
    cases = _dtype_cases()
    out = {key: _garbage_like(value) for key, value in cases.items()}
    addresses = {key: _bytes_address(a) for key, a in out.items()}
    with local_mode(timeout_s=20):
        v = WeightChannel("out-dtypes").publish(cases)
        _, plain = WeightChannel("out-dtypes").fetch(timeout=10)
        version, got = WeightChannel("out-dtypes").fetch(timeout=10, out=out)
    assert version == v and got is out
    for key in cases:
        assert _bytes(out[key]) == _bytes(plain[key]) == _bytes(cases[key]), key
        assert _bytes_address(out[key]) == addresses[key], f"{key} was replaced, not written"


def _bytes_address(value) -> int:
    if type(value).__module__.startswith("torch"):
        return value.data_ptr()
    return value.__array_interface__["data"][0]


def test_fetch_out_takes_arrays_of_another_library_with_the_same_elements():
    torch = pytest.importorskip("torch")
    import ml_dtypes

    state = {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
             "h": np.linspace(0, 1, 7).astype(ml_dtypes.bfloat16),
             "t": torch.arange(6, dtype=torch.int64)}
    out = {"w": torch.zeros(3, 4), "h": torch.zeros(7, dtype=torch.bfloat16),
           "t": np.zeros(6, np.int64)}
    with local_mode(timeout_s=10):
        WeightChannel("cross").publish(state)
        WeightChannel("cross").fetch(timeout=10, out=out)
    assert out["w"].numpy().tobytes() == state["w"].tobytes()
    assert out["h"].view(torch.int16).numpy().tobytes() == state["h"].tobytes()
    assert out["t"].tolist() == list(range(6))


@pytest.mark.parametrize(("change", "says"), [
    (lambda o: o.pop("b"), "out lacks 'b'"),
    (lambda o: o.update(extra=np.zeros(1)), "out has 'extra', which the version does not"),
    (lambda o: o.update(a=np.zeros((4, 3), np.float32)), "'a' is float32 [3, 4] in the version, "
                                                         "float32 [4, 3] in out"),
    (lambda o: o.update(b=np.zeros(5, np.int32)), "'b' is int64 [5] in the version, int32 [5]"),
    (lambda o: o.update(b=np.zeros(5, ">i8")), "'b' is int64 [5] in the version, >i8 [5]"),
])
def test_fetch_out_says_how_the_callers_arrays_differ_from_the_version(change, says):
    out = {"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.int64)}
    change(out)
    with local_mode(timeout_s=10):
        WeightChannel("differ").publish({"a": np.ones((3, 4), np.float32),
                                         "b": np.ones(5, np.int64)})
        with pytest.raises(hg.InvalidArgument, match="version 0") as info:
            WeightChannel("differ").fetch(timeout=5, out=out)
    assert says in str(info.value) and "fetch(out=...)" in str(info.value)


@pytest.mark.parametrize(("value", "says"), [
    (np.zeros(4).view(), None),
    (np.zeros(8)[::2], "out['w'] is not C-contiguous"),
    ([0.0] * 4, "out['w'] is a builtins.list"),
])
def test_fetch_out_refuses_arrays_it_cannot_write_in_place_before_anything_is_asked(value, says):
    if says is None:
        value.flags.writeable = False
        says = "out['w'] is read-only"
    with local_mode(timeout_s=10):
        with pytest.raises(hg.InvalidArgument, match=says.replace("[", r"\[")):
            WeightChannel("refuse").fetch(timeout=5, out={"w": value})  # (no version: no wait)
        with pytest.raises(hg.InvalidArgument, match="mapping"):
            WeightChannel("refuse").fetch(timeout=5, out=[np.zeros(4)])


def test_a_mismatch_is_found_before_the_versions_bytes_are_pulled():
    cfg = Config(shared_memory=False, timeout_s=10)

    async def body(directory, learner, reader):
        await WeightChannel("early")._publish(learner, {"w": np.ones(4 * MiB, np.uint8)},
                                              None, 5.0)
        from hoplite_gpu import packing

        found = packing.targets({"w": np.zeros(4 * MiB + 1, np.uint8)})
        with pytest.raises(hg.InvalidArgument, match="out does not match"):
            await WeightChannel("early")._fetch(reader, -1, 5.0, found)
        assert reader.store.get(_part("early", 0, 0)) is None

    run_nodes([cfg, cfg], body, bound=30)


# ------------------------------------------------------ steady state ---
def publish_step(channel: str, version: int, sizes: list[int]) -> int:
    """(on the learner) version `version` of a state dict of `sizes` float32s."""
    state = {f"t{i}": np.full(n, version + i, np.float32) for i, n in enumerate(sizes)}
    return WeightChannel(channel, keep=2).publish(state, version=version)


def test_fetch_out_allocates_nothing_for_the_tensors_in_steady_state(monkeypatch):
    """Measured in the reader: fresh store buffers (the pool's misses) and
    the Python heap's peak (tracemalloc, which sees NumPy's allocations)
    over versions fetched in steady state, against a 24 MiB version."""
    import hoplite_gpu.node.pool as pool

    sizes = [4 << 20, 1 << 20, 1000, 777, 2 << 20, 5, *[300] * 50]
    nbytes = 4 * sum(sizes)
    fresh: list[int] = []
    real = pool.host_buffer

    def counting(n, shared=False):
        fresh.append(n)
        return real(n, shared)

    with LocalCluster(1, shared_memory=False, timeout_s=30) as cluster:
        hg.init(cluster.address, token=cluster.token, shared_memory=False, timeout_s=30)
        try:
            monkeypatch.setattr(pool, "host_buffer", counting)
            ch = WeightChannel("steady")
            out = {f"t{i}": np.zeros(n, np.float32) for i, n in enumerate(sizes)}
            hits = []
            for v in range(8):
                assert cluster.run(0, publish_step, "steady", v, sizes, timeout=60) == v
                if v == 4:  # (versions 0-3 fill the pool: the steady state starts here)
                    fresh.clear()
                    tracemalloc.start()
                    tracemalloc.reset_peak()
                assert ch.fetch(newer_than=v - 1, timeout=20, out=out)[0] == v
                assert all(out[f"t{i}"][0] == v + i for i in range(len(sizes)))
                hits.append(hg.node_stats()["pool_hits"])
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        finally:
            hg.shutdown()
    assert not [n for n in fresh if n >= nbytes], (
        f"fresh buffers of {fresh} bytes for versions of {nbytes} bytes in steady state")
    assert hits[-1] - hits[3] == 4, f"pool hits per fetch: {hits}"
    assert peak < nbytes / 50, f"the heap's peak grew by {peak} bytes ({nbytes} per version)"


def test_the_next_versions_buffer_is_ready_in_the_pool_before_it_is_published():
    """On the reader: once a version is fetched, a buffer of its size, its
    pages touched, waits free in the pool while the reader waits for the
    next, and that version lands in it (a pool hit) although every older
    buffer is still held; on the learner likewise after a publish. Fresh
    memory's first touch cost 0.65-0.76 s per 256 MiB per process on the
    machine measured (`python -m benchmarks machine`)."""
    sizes = [2 << 20, 1 << 20, 300]
    nbytes = 4 * sum(sizes)
    with LocalCluster(1, shared_memory=False, timeout_s=30) as cluster:
        hg.init(cluster.address, token=cluster.token, shared_memory=False, timeout_s=30)
        try:
            ch = WeightChannel("ahead")
            held = []
            for v in range(2):
                assert cluster.run(0, publish_step, "ahead", v, sizes, timeout=60) == v
                held.append(ch.fetch(newer_than=v - 1, timeout=20)[1])  # (keeps each version)
                deadline = time.monotonic() + 10
                while hg.node_stats()["pooled_bytes"] < nbytes and time.monotonic() < deadline:
                    time.sleep(0.02)
                stats = hg.node_stats()
                assert stats["pooled_bytes"] >= nbytes, stats
                if v == 0:
                    before = stats["pool_hits"]
            assert hg.node_stats()["pool_hits"] > before
            assert float(held[1]["t0"][0]) == 1.0 and float(held[0]["t0"][0]) == 0.0
            learner = cluster.run(0, pooled_after_publish, "ahead", 2, sizes, timeout=60)
            assert learner >= nbytes, learner
        finally:
            hg.shutdown()


def pooled_after_publish(channel: str, version: int, sizes: list[int]) -> int:
    """(on the learner) publish `version`; the pool's free bytes once the
    next version's buffer is made (waited for, bounded)."""
    publish_step(channel, version, sizes)
    deadline = time.monotonic() + 10
    while hg.node_stats()["pooled_bytes"] < 4 * sum(sizes) and time.monotonic() < deadline:
        time.sleep(0.02)
    return hg.node_stats()["pooled_bytes"]


# ---------------------------------------------------------- torch ---
def test_load_into_writes_a_torch_modules_parameters_and_buffers_in_place():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                   torch.nn.ReLU(), torch.nn.Linear(32, 4))

    learner, actor = model(), model()
    learner(torch.randn(8, 16))  # (running statistics: buffers differ from the actor's)
    params = {name: (p, p.data_ptr()) for name, p in actor.state_dict(keep_vars=True).items()}
    with local_mode(timeout_s=10):
        v = WeightChannel("module").publish(learner.state_dict())
        assert WeightChannel("module").load_into(actor, timeout=10) == v
        with pytest.raises(hg.InvalidArgument, match="load_into takes a torch module"):
            WeightChannel("module").load_into({"w": np.zeros(1)})
    for name, value in learner.state_dict().items():
        p, ptr = params[name]
        assert torch.equal(p, value) and p.data_ptr() == ptr, name
    x = torch.randn(3, 16)
    learner.eval(), actor.eval()
    assert torch.equal(learner(x), actor(x))


# --------------------------------------------------------- double buffer ---
def _state(v: float) -> dict[str, np.ndarray]:
    return {"a": np.full(50_000, v, np.float32), "b": np.full((30, 7), v, np.float64)}


def test_a_double_buffer_serves_whole_versions_while_the_next_arrives():
    with local_mode(timeout_s=10):
        learner = WeightChannel("double")
        weights = WeightChannel("double").double_buffer(_state(-1), _state(-1))
        assert weights.version == -1
        seen, stop, wrong = [], threading.Event(), []

        def serve() -> None:
            while not stop.is_set():
                with weights.serving() as (version, arrays):
                    lo = min(float(a.min()) for a in arrays.values())
                    hi = max(float(a.max()) for a in arrays.values())
                    if lo != hi or (version >= 0 and lo != version):
                        wrong.append((version, lo, hi))
                    seen.append(version)

        server = threading.Thread(target=serve)
        server.start()
        try:
            for v in range(6):
                assert learner.publish(_state(v)) == v
                assert weights.update(timeout=10) == v
            deadline = time.monotonic() + 5
            while (not seen or seen[-1] != 5) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            stop.set()
            server.join(10)
        assert not wrong, f"a serving call saw a mix: {wrong[:3]}"
        assert seen == sorted(seen) and seen[-1] == 5 and weights.version == 5


def test_a_double_buffer_never_writes_the_side_a_serving_call_still_reads():
    with local_mode(timeout_s=10):
        learner = WeightChannel("pinned")
        front, back = _state(-1), _state(-1)
        weights = WeightChannel("pinned").double_buffer(front, back)
        learner.publish(_state(0))
        assert weights.update() == 0
        with weights.serving() as (version, arrays):  # a long request on version 0 (`back`)
            assert version == 0 and arrays is back
            learner.publish(_state(1))
            assert weights.update() == 1  # into `front`, which nobody reads
            learner.publish(_state(2))
            start = time.monotonic()
            with pytest.raises(hg.Timeout, match="1 serving call"):
                weights.update(timeout=0.3)  # would write into `back`, still read
            assert 0.25 < time.monotonic() - start < 3
            assert float(arrays["a"][0]) == 0.0 and weights.version == 1
        assert weights.update(timeout=5) == 2
        with weights.serving() as (version, arrays):
            assert version == 2 and arrays is back and float(arrays["b"][0, 0]) == 2.0
        with pytest.raises(hg.InvalidArgument, match="two sets"):
            WeightChannel("pinned").double_buffer(front, front)
