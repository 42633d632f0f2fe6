"""Shared fixtures. `local` is a runtime of this process alone (its own
directory), shut down after the test; a module changes its settings by
defining its own `runtime_settings` fixture."""

import os
import tempfile

import pytest

import hoplite_gpu as hg


def _cuda_available() -> bool:
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


CUDA = _cuda_available()


def pytest_configure(config):
    """`TEST_IN_TLS=1`: the run's runtimes speak TLS. A CA and one
    certificate are made for the run (benchmarks/tls.py, with the
    `cryptography` package) and set as HOPLITE_TLS_* for this process and
    every process it starts (`make test` runs the core tests so)."""
    if os.environ.get("TEST_IN_TLS") != "1":
        return
    from benchmarks.tls import make_certificates

    folder = tempfile.mkdtemp(prefix="hoplite-test-tls-")
    for setting, path in make_certificates(folder)["node"].items():
        os.environ[f"HOPLITE_{setting.upper()}"] = path


@pytest.hookimpl(tryfirst=True)  # (before `-m` deselects by marker)
def pytest_collection_modifyitems(config, items):
    if os.environ.get("HOPLITE_TRANSPORT") == "ucx":
        for item in items:
            if "slow_over_ucx" in item.keywords:
                item.add_marker(pytest.mark.slow)
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def runtime_settings() -> dict:
    """The settings `local` starts its runtime with (override per module)."""
    return {"timeout_s": 20}


@pytest.fixture
def local(runtime_settings):
    """A runtime of this process alone, with `runtime_settings`; yields it,
    and always shuts it down."""
    hg.init(**runtime_settings)
    try:
        yield hg.api.runtime()
    finally:
        hg.shutdown()
