"""Device objects between processes sharing one GPU: put/get/reduce/allreduce of
CuPy and torch CUDA arrays, over TCP (pinned staging) and UCX (device memory
end to end), against a NumPy oracle. Marked `gpu`: skipped without CUDA."""

from __future__ import annotations

import cluster_tasks as t
import numpy as np
import pytest

from hoplite_gpu.cluster import LocalCluster
from hoplite_gpu.transports import get_backend

pytestmark = pytest.mark.gpu

N = 4
TRANSPORTS = ["tcp", "ucx"]
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _transport(name: str) -> str:
    try:
        get_backend(name)
    except Exception as exc:  # ConfigError: ucxx missing
        pytest.skip(f"transport {name} unusable here: {exc}")
    return name


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(request):
    with LocalCluster(N, chunk_size=1 << 20, transport=_transport(request.param)) as c:
        yield c


@pytest.mark.parametrize("n", [1000, 3_000_000], ids=["inline", "pipelined"])
@pytest.mark.parametrize("array_type", ["cupy", "torch", "numpy"])
def test_put_get_between_processes(cluster, n, array_type):
    name = f"dev-{n}-{array_type}"
    cluster.run(0, t.put_device, name, 1, n, "float32")
    got = cluster.run(1, t.get_device, name, array_type)
    assert got["kind"] == array_type and got["on_gpu"] == (array_type != "numpy")
    expected = np.random.default_rng(1).uniform(0.5, 1.5, n).astype(np.float32)
    np.testing.assert_array_equal(got["values"], expected.astype(np.float64))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
def test_device_reduce_matches_numpy(cluster, dtype, op):
    n = 1_500_000
    names = [f"dr-{dtype}-{op}-{w}" for w in range(1, N)]
    for w, name in enumerate(names, start=1):
        cluster.run(w, t.put_device, name, w, n, dtype)
    got = cluster.run(0, t.reduce_device, names, op, f"dr-{dtype}-{op}-out",
                      "torch" if dtype == "bfloat16" else "cupy")
    assert got["on_gpu"]
    inputs = np.stack([_host_values(w, n, dtype) for w in range(1, N)])
    want = {"sum": inputs.sum(0), "avg": inputs.mean(0), "prod": inputs.prod(0),
            "min": inputs.min(0), "max": inputs.max(0)}[op]
    np.testing.assert_allclose(got["values"], want, rtol=TOL[dtype] * N, atol=TOL[dtype] * N)


def _host_values(seed: int, n: int, dtype: str) -> np.ndarray:
    """What put_device put, rounded to `dtype` like the device copy, as float64."""
    host = np.random.default_rng(seed).uniform(0.5, 1.5, n)
    if dtype == "bfloat16":
        import ml_dtypes

        return host.astype(ml_dtypes.bfloat16).astype(np.float64)
    return host.astype(dtype).astype(np.float64)


def test_device_allreduce(cluster):
    n = 2_000_000
    names = [f"ar-dev-{w}" for w in range(N)]
    for w in range(N):
        cluster.run(w, t.put_device, names[w], 10 + w, n, "float32")
    got = cluster.run(0, t.reduce_device, names, "sum", "ar-dev-out")
    every = [cluster.run(w, t.get_device, "ar-dev-out") for w in range(N)]
    want = np.stack([_host_values(10 + w, n, "float32") for w in range(N)]).sum(0)
    for g in [got, *every]:
        assert g["on_gpu"]
        np.testing.assert_allclose(g["values"], want, rtol=1e-5)
