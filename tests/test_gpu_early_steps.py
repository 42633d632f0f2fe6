"""Early reduce steps on device objects: a tree position whose input is in
folds the children that came ahead into a partial result on the device, and
its next step takes that device result as its input. Seven in-process nodes
put CuPy arrays one after another, the last one late, over TCP (pinned
staging) and UCX (device memory end to end). Marked `gpu`: skipped without
CUDA."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from in_process import run_nodes

import hoplite_gpu as hg
from hoplite_gpu.transports import get_backend

pytestmark = pytest.mark.gpu

K = 7
MiB = 1 << 20


@pytest.fixture(params=["tcp", "ucx"])
def transport(request):
    try:
        get_backend(request.param)
    except Exception as exc:  # ConfigError: ucxx missing
        pytest.skip(f"transport {request.param} unusable here: {exc}")
    return request.param


@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_device_inputs_that_trickle_in_fold_early_on_the_device(transport, op):
    cp = pytest.importorskip("cupy")
    if not cp.cuda.is_available():
        pytest.skip("no CUDA device")
    n = (2 * MiB) // 4
    host = [np.random.default_rng(40 + i).uniform(0.5, 1.5, n).astype(np.float32)
            for i in range(K)]
    ids = [hg.ObjectID.from_name(f"gpu-early-{transport}-{op}-{i}") for i in range(K)]
    target = hg.ObjectID.from_name(f"gpu-early-{transport}-{op}-out")
    # small device chunks, so that a 2 MiB object is pipelined in pieces
    config = hg.Config(transport=transport, shared_memory=False, timeout_s=20.0,
                       device_chunk_size=MiB // 2)
    early_steps = []

    async def body(directory, *nodes):
        directory.state.latency_s = 1e-3  # a binary tree for 7 x 2 MiB
        handle = directory.state.handle

        def watch(event):
            out = handle(event)
            early_steps.extend(c for c in out if type(c).__name__ == "StartReduceStep"
                               and c.step.early)
            return out

        directory.state.handle = watch
        await nodes[0].reduce(ids, op, K, target)
        for i in range(K - 1):
            await nodes[i].put(cp.asarray(host[i]), ids[i])
        await asyncio.sleep(0.5)
        await nodes[K - 1].put(cp.asarray(host[K - 1]), ids[K - 1])
        got = await nodes[3].get(target, 20, "cupy")
        assert isinstance(got, cp.ndarray), type(got)
        want = {"sum": np.sum, "max": np.max, "avg": np.mean}[op](
            np.stack(host).astype(np.float64), axis=0)
        np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=1e-5)
        assert directory.state.reduces[target.binary].restarts == 0

    run_nodes([config] * K, body, bound=90)
    assert early_steps, "no early step ran: this test no longer covers them"
