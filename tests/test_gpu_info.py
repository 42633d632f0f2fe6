"""GPU discovery (`hoplite-gpu info`): plain answers with and without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from hoplite_gpu.gpu import discover


class _NVMLError(Exception):
    pass


def fake_nvml(count: int = 2, nvlink: bool = True, init_error: str | None = None):
    """A stand-in for pynvml with `count` 80 GiB GPUs, all NVLink peers if `nvlink`."""
    m = types.SimpleNamespace(NVMLError=_NVMLError, NVML_P2P_CAPS_INDEX_NVLINK=3,
                              NVML_P2P_STATUS_OK=0)
    m.shut = 0

    def init():
        if init_error:
            raise _NVMLError(init_error)

    def shutdown():
        m.shut += 1

    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlSystemGetDriverVersion = lambda: b"580.1"
    m.nvmlSystemGetCudaDriverVersion = lambda: 13000
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 << 30)
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{h:02x}:00.0")
    m.nvmlDeviceGetP2PStatus = lambda a, b, what: 0 if nvlink else 4
    return m


def test_lists_gpus_and_nvlink_peers():
    nvml = fake_nvml(count=3)
    report = discover(nvml)
    assert report.problem is None and nvml.shut == 1
    assert [g.nvlink_peers for g in report.gpus] == [[1, 2], [0, 2], [0, 1]]
    assert report.cuda_driver == "13.0" and report.driver == "580.1"
    text = "\n".join(report.lines())
    assert "H100" in text and "80.0 GiB" in text and "NVLink peers: 1, 2" in text


def test_no_nvlink_says_none():
    lines = discover(fake_nvml(count=2, nvlink=False)).lines()
    assert all("NVLink peers: none" in line for line in lines[1:])


def test_no_driver_is_a_plain_answer():
    report = discover(fake_nvml(init_error="NVML Shared Library Not Found"))
    assert report.gpus == [] and "no NVIDIA driver" in report.problem
    assert "CPU path" in report.lines()[0]


def test_driver_without_devices():
    assert "no GPU" in discover(fake_nvml(count=0)).problem


def test_info_command_runs_here():
    """On any machine `hoplite-gpu info` exits 0 and says what it found about GPUs."""
    out = subprocess.run([sys.executable, "-m", "hoplite_gpu", "info"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "GPUs:" in out.stdout and "transport tcp: usable" in out.stdout
    assert "shared memory between nodes of this host: " in out.stdout
    if "transport ucx: usable" in out.stdout and "UCXPY_PROGRESS_MODE" not in os.environ:
        # the default UCX progress mode, and what it costs
        assert "progress: blocking (each process keeps a core busy" in out.stdout
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        assert "none usable" in out.stdout
    else:
        pytest.skip("a GPU driver is present; the no-GPU wording is not expected")


def test_info_says_when_cupy_sees_no_gpu(tmp_path):
    """CuPy installed where CUDA is not usable: "installed" alone would suggest
    device arrays work."""
    fake = tmp_path / "cupy"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "hoplite_gpu", "info"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "cupy: installed, but it sees no CUDA device" in out.stdout
