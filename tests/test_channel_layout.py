"""A weight channel's version laid out as one object per kind of memory
(hoplite_gpu/packing.py): the plan, the manifest and its checks, one object
whatever the number of tensors, and every dtype the channel accepts coming
back as it went in."""

from __future__ import annotations

import numpy as np
import pytest
from in_process import local_mode

import hoplite_gpu as hg
from hoplite_gpu import messages as m
from hoplite_gpu import packing
from hoplite_gpu.channel import WeightChannel, _oid
from hoplite_gpu.values import Layout, to_buffer


def _layout(value) -> Layout:
    return to_buffer(value)[1]


def _dtype_cases() -> dict[str, object]:
    """One value of every kind of element the channel takes (NumPy, ml_dtypes,
    torch, bytes), shapes from 0-d to 3-d, an empty one, a non-contiguous one."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    out: dict[str, object] = {}
    for code in ("?", "i1", "i2", "<i4", "<i8", "u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8",
                 "<c8", "<c16", "<M8[ns]", "<m8[s]", "S5", "<U3", ">f4", ">i8"):
        dt = np.dtype(code)
        raw = rng.integers(0, 256, 24 * dt.itemsize, dtype=np.uint8)
        out[f"np/{code}"] = raw.view(dt).reshape(2, 3, -1)
    out["np/bfloat16"] = rng.standard_normal(33).astype(ml_dtypes.bfloat16)
    out["np/float8_e4m3fn"] = rng.standard_normal(17).astype(ml_dtypes.float8_e4m3fn)
    out["np/structured"] = np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i4"), ("b", "<f8")])
    out["np/scalar"] = np.float64(3.25)
    out["np/empty"] = np.empty((0, 4), np.float32)
    out["np/strided"] = np.arange(40, dtype=np.int16)[::3]
    out["bytes"] = b"some bytes"
    try:
        import torch
    except ImportError:
        return out
    for name in ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
                 "uint8", "bool", "complex64", "complex128", "float8_e4m3fn"):
        dtype = getattr(torch, name)
        raw = torch.from_numpy(rng.integers(0, 256, 30 * 16, dtype=np.uint8))
        out[f"torch/{name}"] = raw[:30 * torch.empty((), dtype=dtype).element_size()] \
            .view(dtype).reshape(5, -1)
    return out


# ------------------------------------------------------------------ plan ---
def test_tensors_lie_back_to_back_aligned_host_and_device_apart():
    host = [("a", _layout(np.zeros(3, np.uint8))), ("b", _layout(np.zeros(10, np.float64))),
            ("c", _layout(np.zeros(0, np.float32))), ("d", _layout(np.zeros(1, np.int8)))]
    dev = Layout("device", "<f4", (5,), 20)
    slots, parts = packing.plan([host[0], ("g", dev), *host[1:], ("h", dev)])
    assert parts == [packing.Part(193, False), packing.Part(84, True)]
    where = {s.key: (s.part, s.offset) for s in slots}
    assert where == {"a": (0, 0), "b": (0, 64), "c": (0, 192), "d": (0, 192),
                     "g": (1, 0), "h": (1, 64)}
    assert [s.key for s in slots] == ["a", "g", "b", "c", "d", "h"]  # (the caller's order)
    assert packing.plan([("h", dev)])[1] == [packing.Part(20, True)]


def test_the_manifest_goes_both_ways_and_a_bad_one_is_named():
    slots, parts = packing.plan([("w", _layout(np.zeros((2, 3), np.float32))),
                                 ("b", _layout(np.zeros(4, np.int64)))])
    manifest = packing.to_manifest(5, slots, parts, [3, 4])
    back = m.decode_manifest("x", m.encode(manifest))
    assert back.version == 5 and back.held == [3, 4]
    assert packing.read_manifest("x", back) == (slots, parts)

    def bad(**change) -> m.Manifest:
        t = manifest.tensors[1]
        fields = {f: getattr(t, f) for f in t.__struct_fields__} | change
        return m.Manifest(version=5, parts=manifest.parts,
                          tensors=[manifest.tensors[0], m.PackedTensor(**fields)])

    for change, says in [({"offset": 65}, "within a part"), ({"part": 1}, "within a part"),
                         ({"kind": "device"}, "within a part"), ({"key": "w"}, "twice"),
                         ({"nbytes": 31}, "inconsistent"), ({"dtype": "<f99"}, "dtype")]:
        with pytest.raises(hg.ProtocolError, match=says):
            packing.read_manifest("the manifest of version 5", bad(**change))
    with pytest.raises(hg.ProtocolError, match="not a channel manifest"):
        m.decode_manifest("x", m.encode(m.Done(ok=True)))


# ------------------------------------------------------------- channel ---
def test_a_version_of_hundreds_of_tensors_is_one_object():
    """The issue: a state dict of hundreds of small tensors paid per-object
    costs hundreds of times (one put, locate and pull per tensor)."""
    with local_mode(timeout_s=20):
        rng = np.random.default_rng(3)
        state = {f"layer{i}.w": rng.standard_normal(rng.integers(1, 3000)).astype(np.float32)
                 for i in range(300)}
        ch = WeightChannel("many")
        v = ch.publish(state)
        info = hg.object_info(_oid("many", v, "pack/0"))
        assert info["size"] == packing.plan([(k, _layout(a)) for k, a in state.items()])[1][0] \
            .nbytes
        assert hg.node_stats()["objects"] == 3  # the claim, the pack and the manifest
        version, got = WeightChannel("many").fetch(timeout=10)
        assert version == v and list(got) == list(state)
        for key, value in state.items():
            np.testing.assert_array_equal(got[key], value)
            assert not got[key].flags.writeable  # (a view of the received version)


def test_every_dtype_comes_back_as_it_went_in():
    cases = _dtype_cases()
    with local_mode(timeout_s=20):
        v = WeightChannel("dtypes").publish(cases)
        version, got = WeightChannel("dtypes").fetch(timeout=10)
    assert version == v and list(got) == list(cases)
    for key, value in cases.items():
        if key == "bytes":
            assert got[key] == value
        elif key.startswith("torch/"):
            import torch

            assert type(got[key]) is torch.Tensor and got[key].dtype == value.dtype
            assert got[key].shape == value.shape
            assert got[key].view(torch.uint8).numpy().tobytes() == \
                value.view(torch.uint8).numpy().tobytes()
        else:
            want = np.asarray(value)
            assert got[key].dtype == want.dtype and got[key].shape == want.shape, key
            assert got[key].tobytes() == want.tobytes(), key


def test_a_value_the_channel_cannot_send_costs_no_version_number():
    with local_mode(timeout_s=10):
        ch = WeightChannel("refused")
        with pytest.raises(hg.UnsupportedValue):
            ch.publish({"w": np.zeros(3), "bad": object()})
        assert ch.latest_version() == -1 and hg.node_stats()["objects"] == 0
        assert ch.publish({"w": np.zeros(3)}) == 0


def test_the_head_moves_once_the_version_is_registered_and_readers_stream_its_copy():
    """A version's host part is registered before its bytes are copied in,
    as a put is, so readers start while the publisher still copies (before,
    every tensor was copied before the head moved, and a version's readers
    waited for the whole copy first); publish returns only once the copy is
    done, for the caller's arrays are read until then."""
    from in_process import run_nodes

    from hoplite_gpu.channel import _part
    from hoplite_gpu.config import Config

    cfg = Config(shared_memory=False, timeout_s=10, chunk_size=1 << 16)

    async def body(directory, learner, reader):
        state = {f"w{i}": np.full(1 << 20, i, np.float32) for i in range(8)}  # 32 MiB
        at_head, real = [], learner.channel_publish

        async def publish(name, version):
            at_head.append(learner.store.get(_part(name, version, 0)).ready)
            return await real(name, version)

        learner.channel_publish = publish
        ch = WeightChannel("streamed")
        v = await ch._publish(learner, state, None, 10.0)
        assert at_head[0] < 32 << 20, "the head moved only once the copy was done"
        assert learner.store.get(_part("streamed", v, 0)).complete
        version, slots, parts, _ = await WeightChannel("streamed")._fetch(reader, -1, 10.0)
        got = packing.values(slots, parts, "numpy", loop=False)
        assert version == v and all((got[k] == a).all() for k, a in state.items())

    run_nodes([cfg, cfg], body, bound=30)


def test_a_publish_given_up_while_its_version_is_copied_leaves_it_lost_not_torn():
    """The head has moved and readers stream the host part while the
    publisher copies it; a publish cut off then (its deadline, a cancel)
    must stop reading the caller's arrays, and its readers must not be left
    with half a version: the part is dropped and they hear `VersionLost`."""
    import asyncio

    from in_process import run_nodes

    from hoplite_gpu.config import Config

    cfg = Config(shared_memory=False, timeout_s=10, chunk_size=1 << 16)

    async def body(directory, learner, reader):
        state = {f"w{i}": np.full(1 << 20, i, np.float32) for i in range(8)}
        real = learner.channel_publish

        async def publish_then_cut(name, version):
            await real(name, version)
            raise asyncio.CancelledError  # (as a cancel landing right after the head moved)

        learner.channel_publish = publish_then_cut
        with pytest.raises(asyncio.CancelledError):
            await WeightChannel("cut-copy")._publish(learner, state, None, 10.0)
        with pytest.raises(hg.VersionLost, match="version 0 is lost"):
            await WeightChannel("cut-copy")._fetch(reader, -1, 5.0)

    run_nodes([cfg, cfg], body, bound=30)
