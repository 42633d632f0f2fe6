"""A weight channel's device tensors (CuPy, torch CUDA) beside host ones: one
device part, fetched as device arrays and into device arrays in place,
within a process and between two. Marked `gpu`: skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
from in_process import local_mode

from hoplite_gpu.channel import WeightChannel
from hoplite_gpu.cluster import LocalCluster

pytestmark = pytest.mark.gpu


def _state(version: int) -> dict:
    import cupy
    import torch

    return {"host": np.full(1000, version, np.float32),
            "cupy": cupy.full((64, 33), version, dtype=cupy.float16),
            "torch": torch.full((3_000_000,), version, dtype=torch.bfloat16, device="cuda"),
            "small": cupy.arange(5, dtype=cupy.int64) + version}


def _check(got: dict, version: int) -> None:
    import cupy
    import torch

    assert isinstance(got["cupy"], cupy.ndarray) and got["cupy"].dtype == cupy.float16
    assert float(got["cupy"].min()) == float(got["cupy"].max()) == version
    assert got["torch"].is_cuda and got["torch"].dtype == torch.bfloat16
    assert float(got["torch"].min()) == float(got["torch"].max()) == version
    assert (got["small"] == cupy.arange(5) + version).all()
    assert (np.asarray(got["host"]) == version).all()


def publish(channel: str, version: int) -> int:
    return WeightChannel(channel).publish(_state(version), version=version)


def fetch_both_ways(channel: str, version: int) -> bool:
    """A plain fetch (device tensors as torch CUDA tensors), then one into
    device arrays in place; whether the arrays kept their memory."""
    import cupy
    import torch

    _, plain = WeightChannel(channel).fetch(newer_than=version - 1, timeout=30,
                                            array_type="torch")
    for key in ("cupy", "torch", "small"):
        assert plain[key].is_cuda, key
    assert float(plain["torch"].float().min()) == float(plain["torch"].float().max()) == version
    assert plain["small"].tolist() == [version + i for i in range(5)]
    out = {"host": np.zeros(1000, np.float32), "cupy": cupy.zeros((64, 33), cupy.float16),
           "torch": torch.zeros(3_000_000, dtype=torch.bfloat16, device="cuda"),
           "small": cupy.zeros(5, cupy.int64)}
    ptr = out["torch"].data_ptr()
    WeightChannel(channel).fetch(newer_than=version - 1, timeout=30, out=out)
    _check(out, version)
    return out["torch"].data_ptr() == ptr


def test_device_tensors_travel_as_one_device_part_and_land_in_place():
    with local_mode(timeout_s=30):
        v = WeightChannel("gpu-local").publish(_state(3))
        assert fetch_both_ways("gpu-local", v)


def test_device_tensors_between_processes():
    with LocalCluster(2, chunk_size=1 << 20, timeout_s=60) as cluster:
        for v in range(2):
            assert cluster.run(0, publish, "gpu-pair", v, timeout=120) == v
            assert cluster.run(1, fetch_both_ways, "gpu-pair", v, timeout=120)
