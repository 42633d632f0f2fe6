"""The device path's host side (hoplite_gpu/device.py, gpu.py, the
device and foreign-array handling in values.py, `hoplite-gpu info`): what a
process without a usable GPU, driver or optional package gets. Every test
here runs on a CPU-only machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path

import numpy as np
import pytest

from hoplite_gpu import device
from hoplite_gpu.errors import HopliteError, UnsupportedValue
from hoplite_gpu.gpu import discover
from hoplite_gpu.values import to_buffer

ROOT = Path(__file__).resolve().parent.parent


# --- gpu.discover / `hoplite-gpu info`: NVML errors after a successful init ---


class _NVMLError(Exception):
    pass


def _nvml(failing: str | None = None):
    """A pynvml stand-in with one 80 GiB GPU whose `failing` call raises an NVML error."""
    m = types.SimpleNamespace(NVMLError=_NVMLError, NVML_P2P_CAPS_INDEX_NVLINK=3,
                              NVML_P2P_STATUS_OK=0)
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: "580.1"
    m.nvmlSystemGetCudaDriverVersion = lambda: 13000
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: "NVIDIA H100"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 << 30)
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId="00000000:01:00.0")
    m.nvmlDeviceGetP2PStatus = lambda a, b, what: 0

    def fail(*args):
        raise _NVMLError("GPU is lost")

    if failing:
        setattr(m, failing, fail)
    return m


@pytest.mark.parametrize("failing", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo",
                                     "nvmlDeviceGetCount"])
def test_discover_answers_plainly_when_nvml_fails_after_init(failing):
    """gpu.py promises that discover() never raises and says in `problem`
    why no GPU is usable; but only nvmlInit's NVMLError (and the CUDA
    version's) is caught, so an NVML error from any later query (a GPU fallen off the bus, a query the board
    does not support, no permission) escapes as a raw pynvml exception."""
    report = discover(_nvml(failing))  # a report (problem, or what could be read)
    assert "\n".join(report.lines()).startswith("GPUs:")


def test_info_command_survives_an_nvml_error_after_init(tmp_path):
    """`hoplite-gpu info` is the diagnostic tool; with a driver that answers
    nvmlInit but fails a device query it must still print its report and
    exit 0, not end in a pynvml traceback."""
    (tmp_path / "pynvml.py").write_text(textwrap.dedent("""
        import types
        class NVMLError(Exception):
            pass
        NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK = 3, 0
        def nvmlInit(): pass
        def nvmlShutdown(): pass
        def nvmlSystemGetDriverVersion(): return "580.1"
        def nvmlSystemGetCudaDriverVersion(): return 13000
        def nvmlDeviceGetCount(): return 1
        def nvmlDeviceGetHandleByIndex(i):
            raise NVMLError("GPU is lost")
    """))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    out = subprocess.run([sys.executable, "-m", "hoplite_gpu", "info"], capture_output=True,
                         text=True, timeout=60, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GPUs:" in out.stdout and "Traceback" not in out.stderr


# --- device.materialize: array_type="torch" where torch is not installed ---


def test_get_as_torch_without_torch_installed_is_a_project_error(monkeypatch):
    """On a GPU node installed with the `gpu` extra (CuPy, ucxx, NVML: no
    torch), get(..., array_type="torch") of a device object reaches
    device.materialize's bare `import torch` and raises ModuleNotFoundError,
    where values.py answers the same missing package for a torch object with
    UnsupportedValue ("pip install torch"). CuPy and the GPU are stood in for
    here; the failing line is the import."""
    fake_cupy = types.SimpleNamespace(asarray=np.asarray, array=np.array, int16=np.int16,
                                      uint8=np.uint8)
    monkeypatch.setattr(device, "_present", True)
    monkeypatch.setattr(device, "_cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails
    buf = np.arange(12, dtype=np.uint8)
    with pytest.raises(HopliteError):
        device.materialize(buf, np.dtype("<f4"), (3,), "torch")


# --- foreign arrays: DLPack exporters and non-CPU torch tensors ---


class _DeviceQueryFails:
    """A DLPack exporter whose device query raises (as an exporter does for an
    array it no longer holds)."""

    def __dlpack__(self, **kwargs):
        raise BufferError("released")

    def __dlpack_device__(self):
        raise RuntimeError("array has been deleted")


def test_put_of_a_dlpack_object_whose_device_query_fails_is_unsupported_value():
    """device.is_device_array catches a failing __dlpack_device__ (and says
    "not a device array"), then values._from_dlpack calls it again outside
    any try, so put() raises the exporter's raw RuntimeError instead of
    UnsupportedValue."""
    with pytest.raises(UnsupportedValue):
        to_buffer(_DeviceQueryFails())


def test_non_cpu_torch_tensor_refusal_does_not_say_the_gpu_path_is_missing():
    """A torch tensor on a device other than the CPU or CUDA (here `meta`) is
    refused with "device tensors need the GPU path, which is not built yet",
    but the GPU path is built (docs/guide-gpus-and-ucx.md: torch CUDA tensors are
    stored on the GPU): the message sends users looking for a missing feature."""
    torch = pytest.importorskip("torch")
    with pytest.raises(UnsupportedValue) as info:
        to_buffer(torch.empty(2, device="meta"))
    assert "not built yet" not in str(info.value)


# --- bfloat16 device objects need ml_dtypes on every node ---


def _bfloat16_device_layout_needs_ml_dtypes() -> bool:
    """Whether a process without ml_dtypes refuses a bfloat16 device layout."""
    code = textwrap.dedent("""
        import sys
        sys.modules["ml_dtypes"] = None
        from hoplite_gpu.errors import HopliteError
        from hoplite_gpu.values import Layout
        try:
            Layout.from_wire({"kind": "device", "dtype": "bfloat16", "shape": [4], "nbytes": 8})
        except HopliteError as exc:
            print("refused:", exc)
        else:
            print("parsed")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.startswith("refused")


def test_gpu_extras_install_what_bfloat16_device_objects_need():
    """A torch CUDA bfloat16 tensor is put as a device layout with dtype
    "bfloat16"; every node that receives or reduces it parses that layout
    with values._wire_numpy_dtype, which needs ml_dtypes (ProtocolError "needs
    ml_dtypes" otherwise). docs/guide-gpus-and-ucx.md's install, `pip install '.[gpu]'` (or
    `.[gpu-cu13]`), does not bring ml_dtypes (only the `test` extra does), so
    bfloat16 device objects, which the GPU guide reports as working, fail
    on a GPU node installed as documented."""
    if not _bfloat16_device_layout_needs_ml_dtypes():
        return  # (device bfloat16 layouts no longer need ml_dtypes: nothing to install)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = project["dependencies"]
    for extra in ("gpu", "gpu-cu13"):
        deps = base + project["optional-dependencies"][extra]
        assert any(d.replace("-", "_").startswith("ml_dtypes") for d in deps), extra
