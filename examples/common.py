"""Shared set-up for the examples: a local Ray on loopback with its own temp dir,
the hoplite directory actor, actor placement on emulated hosts, and small timing
helpers. The examples' `run` functions also run across emulated hosts, one Ray
node per network namespace (benchmarks/rayemu.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import zlib

# Single-machine Ray binds to loopback with this off (read when ray is imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

import hoplite_gpu.ray as hray  # noqa: E402


@contextlib.contextmanager
def local_ray(num_cpus: int = 32):
    """A local Ray (oversubscribed: the actors here mostly wait on I/O) plus the
    hoplite directory actor; everything is torn down afterwards."""
    tmp = tempfile.mkdtemp(prefix="hgex", dir="/tmp")
    ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
             configure_logging=False)
    try:
        hray.start_directory()
        hray.join()  # the driver is a node too
        yield
    finally:
        import hoplite_gpu as hg

        hg.shutdown()
        hray.stop_directory()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def on_host(host: int | None) -> dict:
    """Ray actor options that place an actor on emulated host `host` (every Ray
    node there has a custom resource ``host_<i>``: 1, see benchmarks/rayemu.py);
    None: anywhere (one machine)."""
    return {} if host is None else {"resources": {f"host_{host}": 0.001}}


def crc(arrays) -> int:
    c = 0
    for a in arrays:
        c = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), c)
    return c


def summary(hoplite_s: list[float], ray_s: list[float]) -> dict:
    """Medians of both variants and their ratio (Ray / hoplite-gpu: > 1 means hoplite-gpu is faster)."""
    h, r = statistics.median(hoplite_s), statistics.median(ray_s)
    return {"hoplite_s": hoplite_s, "ray_s": ray_s, "hoplite_median_s": h, "ray_median_s": r,
            "ratio_ray_to_hoplite": r / h}


def report(title: str, hoplite_s: list[float], ray_s: list[float]) -> None:
    h, r = statistics.median(hoplite_s), statistics.median(ray_s)
    print(f"\n{title}")
    print(f"  hoplite-gpu : median {h * 1e3:8.1f} ms over {len(hoplite_s)} runs")
    print(f"  Ray baseline: median {r * 1e3:8.1f} ms over {len(ray_s)} runs")
    print(f"  ratio (Ray / hoplite-gpu): {r / h:.2f} x")
