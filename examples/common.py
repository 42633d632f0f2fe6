"""Shared set-up for the examples: a local Ray on loopback with its own temp dir,
the hoplite directory actor, and small timing helpers."""

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


def crc(arrays) -> int:
    c = 0
    for a in arrays:
        c = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), c)
    return c


def report(title: str, hoplite_s: list[float], ray_s: list[float], unit: str = "s") -> None:
    h, r = statistics.median(hoplite_s), statistics.median(ray_s)
    print(f"\n{title}")
    print(f"  hoplite-gpu : median {h * 1e3:8.1f} ms over {len(hoplite_s)} runs")
    print(f"  Ray baseline: median {r * 1e3:8.1f} ms over {len(ray_s)} runs")
    print(f"  ratio (Ray / hoplite-gpu): {r / h:.2f} x")
