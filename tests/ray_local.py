"""A Ray session of this machine for the tests, always shut down."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def local_ray(namespace: str, num_cpus: int, **options: object) -> Iterator[None]:
    """`ray.init` on this machine, in `namespace`, with `num_cpus` (tests
    oversubscribe: their actors wait on I/O, and a pending actor would hang
    a test) and `options` (e.g. num_gpus); its temp dir, where Ray keeps its
    sockets, short and ours."""
    import ray

    tmp = tempfile.mkdtemp(prefix="hgray", dir="/tmp")
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _temp_dir=tmp, log_to_driver=False,
                 namespace=namespace, configure_logging=False, **options)
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def ray_with_directory(namespace: str, num_cpus: int, **options: object) -> Iterator[None]:
    """`local_ray` with the default hoplite directory actor started in it;
    at the end this process's runtime is shut down and the actor stopped."""
    import hoplite_gpu as hg
    import hoplite_gpu.ray as hray

    with local_ray(namespace, num_cpus, **options):
        hray.start_directory()
        try:
            yield
        finally:
            hg.shutdown()
            hray.stop_directory()
