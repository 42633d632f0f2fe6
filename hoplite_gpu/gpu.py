"""GPU discovery with NVML (the `nvidia-ml-py` package, imported as `pynvml`).

Never raises for a missing GPU, driver or package: `discover()` returns a
report whose ``problem`` says plainly why no GPU is usable, and the CPU path
(NumPy + TCP) keeps working. The `pynvml` *package* on PyPI is deprecated and
warns on import; `nvidia-ml-py` provides the same module without the warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GPU:
    index: int
    name: str
    memory_bytes: int
    bus_id: str
    #: Indices of the GPUs this one reaches over NVLink.
    nvlink_peers: list[int] = field(default_factory=list)


@dataclass
class GPUReport:
    gpus: list[GPU] = field(default_factory=list)
    driver: str | None = None
    cuda_driver: str | None = None
    #: Why no GPU is usable (no package, no driver, no device); None when some are.
    problem: str | None = None

    def lines(self) -> list[str]:
        if self.problem:
            return [f"GPUs: none usable ({self.problem}); the CPU path (NumPy + TCP) works"]
        out = [f"GPUs: {len(self.gpus)}, driver {self.driver}, CUDA driver API {self.cuda_driver}"]
        for g in self.gpus:
            peers = ", ".join(map(str, g.nvlink_peers)) or "none"
            out.append(f"  [{g.index}] {g.name}  {g.memory_bytes / 2**30:.1f} GiB  "
                       f"bus {g.bus_id}  NVLink peers: {peers}")
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def discover(nvml: Any = None) -> GPUReport:
    """What NVML sees. `nvml` replaces the pynvml module (tests pass a fake)."""
    if nvml is None:
        try:
            import pynvml as nvml  # noqa: PLC0415 - optional
        except ImportError:
            return GPUReport(problem="nvidia-ml-py is not installed: "
                                     "pip install 'hoplite-gpu[gpu]'")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return GPUReport(problem=f"no NVIDIA driver found: {exc}")
    try:
        try:
            report = GPUReport(driver=_text(nvml.nvmlSystemGetDriverVersion()))
        except nvml.NVMLError as exc:
            return GPUReport(problem=f"NVML could not read the driver version: {exc}")
        try:
            v = nvml.nvmlSystemGetCudaDriverVersion()
            report.cuda_driver = f"{v // 1000}.{v % 1000 // 10}"
        except nvml.NVMLError:
            report.cuda_driver = "unknown"
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(nvml.nvmlDeviceGetCount())]
            for i, h in enumerate(handles):
                report.gpus.append(GPU(
                    index=i, name=_text(nvml.nvmlDeviceGetName(h)),
                    memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                    bus_id=_text(nvml.nvmlDeviceGetPciInfo(h).busId),
                    nvlink_peers=_nvlink_peers(nvml, handles, i)))
        except nvml.NVMLError as exc:  # a GPU fallen off the bus, no permission, ...
            report.problem = (f"NVML could not query GPU {len(report.gpus)}: {exc} "
                              "(nvidia-smi shows what the driver sees)")
            return report
        if not report.gpus:
            report.problem = "the NVIDIA driver reports no GPU"
        return report
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _nvlink_peers(nvml: Any, handles: list, i: int) -> list[int]:
    peers = []
    for j, other in enumerate(handles):
        if j == i:
            continue
        try:
            status = nvml.nvmlDeviceGetP2PStatus(handles[i], other, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
        except nvml.NVMLError:
            continue  # older drivers, or no NVLink on this board
        if status == nvml.NVML_P2P_STATUS_OK:
            peers.append(j)
    return peers


def cuda_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy  # noqa: PLC0415 - optional
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # CUDA runtime present but broken: treat as no GPU
        return False
