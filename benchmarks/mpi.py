"""The OpenMPI baseline on the emulated hosts: install it when missing, then run
one `mpirun` whose ranks each live in their own host's network namespace.

How the ranks end up on different "hosts": `mpirun` runs inside host 0's
namespace and starts every rank locally (all ranks look like one node to it),
but through a wrapper script that enters the namespace of the rank's host
(`ip netns exec <ns>`, picked from OMPI_COMM_WORLD_RANK) before running Python.
The ranks' PMIx clients reach mpirun's PMIx server over host 0's eth0
(PMIX_MCA_ptl_tcp_remote_connections=1, PMIX_MCA_ptl_tcp_if_include=eth0).
Data moves only through the TCP BTL bound to eth0 (`--mca btl self,tcp`): the
shared-memory BTL is off, so every byte crosses the shaped links, which the
harness checks by counting the bytes on the links (see `LinkCounters`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence

from .emulated import PY, EmulatedCluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every run, both variants: the ranks talk TCP over the shaped eth0 only.
TRANSPORT_MCA = {"btl": "self,tcp", "btl_tcp_if_include": "eth0", "pml": "ob1",
                 "oob_tcp_if_include": "eth0"}

# openmpi-tuned: the bandwidth-optimal algorithm of coll/tuned for each op, with
# 1 MiB segments (OpenMPI 4.1 numbering, see `ompi_info --param coll tuned --level 9`).
TUNED_MCA = {
    "coll_tuned_use_dynamic_rules": "1",
    "coll_tuned_bcast_algorithm": "3",               # pipeline (a chain)
    "coll_tuned_bcast_algorithm_segmentsize": "1048576",
    "coll_tuned_reduce_algorithm": "3",              # pipeline (a chain)
    "coll_tuned_reduce_algorithm_segmentsize": "1048576",
    "coll_tuned_allreduce_algorithm": "5",           # segmented ring
    "coll_tuned_allreduce_algorithm_segmentsize": "1048576",
    "coll_tuned_gather_algorithm": "1",              # basic linear (the root's downlink is the limit)
    "coll_tuned_allgather_algorithm": "4",           # ring
}


class MPIUnavailable(RuntimeError):
    """OpenMPI or mpi4py is missing and could not be installed."""


def have_mpi() -> bool:
    if shutil.which("mpirun") is None:
        return False
    probe = subprocess.run([PY, "-c", "import mpi4py"], capture_output=True)
    return probe.returncode == 0


def ensure_mpi(log=print) -> str:
    """Install OpenMPI (apt) and mpi4py (pip, into this interpreter) if missing;
    return OpenMPI's version. Raises MPIUnavailable with the failing step."""
    if shutil.which("mpirun") is None:
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            raise MPIUnavailable("mpirun not found and cannot install it here (needs root and apt-get): "
                                 "install OpenMPI (apt-get install -y openmpi-bin libopenmpi-dev)")
        log("installing OpenMPI: apt-get install -y openmpi-bin libopenmpi-dev")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        steps = (["apt-get", "update"],
                 ["apt-get", "install", "-y", "--no-install-recommends", "openmpi-bin", "libopenmpi-dev"])
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1200)
            if done.returncode != 0:
                raise MPIUnavailable(f"{' '.join(argv)} failed (exit {done.returncode}):\n"
                                     f"{done.stderr[-2000:]}")
        if shutil.which("mpirun") is None:
            raise MPIUnavailable("apt-get installed openmpi-bin but mpirun is still not on PATH")
    probe = subprocess.run([PY, "-c", "import mpi4py"], capture_output=True)
    if probe.returncode != 0:
        log(f"installing mpi4py into {sys.executable} (pip install mpi4py)")
        done = subprocess.run([PY, "-m", "pip", "install", "-q", "mpi4py"], capture_output=True,
                              text=True, timeout=1200)
        if done.returncode != 0:
            raise MPIUnavailable(f"pip install mpi4py failed (exit {done.returncode}); it builds "
                                 f"against libopenmpi-dev's mpicc:\n{done.stderr[-2000:]}")
        probe = subprocess.run([PY, "-c", "from mpi4py import MPI"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise MPIUnavailable(f"mpi4py installed but does not load: {probe.stderr[-1000:]}")
    return mpi_version()


def mpi_version() -> str:
    out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else "unknown"


_WRAPPER = """#!/bin/sh
# Enter the network namespace of this rank's host, then run the rank.
case "$OMPI_COMM_WORLD_RANK" in
{cases}
*) echo "no namespace for rank $OMPI_COMM_WORLD_RANK" >&2; exit 2;;
esac
"""


def _wrapper(namespaces: Sequence[str]) -> str:
    """The script that runs rank r inside `namespaces[r]`."""
    cases = "\n".join(f'{r}) exec ip netns exec "{ns}" "$@";;' for r, ns in enumerate(namespaces))
    return _WRAPPER.format(cases=cases)


def mpi_run(c: EmulatedCluster, op: str, size: int, *, tuned: bool, iters: int = 1,
            warmup: int = 0, period: float = 0.0, ready: list[float] | None = None,
            timeout: float = 900, sync: bool = False, namespaces: Sequence[str] | None = None,
            interfaces: str = "eth0") -> dict:
    """One mpirun across the emulated hosts doing `warmup + iters` iterations of
    `op`; returns rank 0's JSON report (every rank's start and end per iteration).

    Rank r runs in `namespaces[r]` (default: host r's, `c.ns(r)`), and mpirun in
    rank 0's. `interfaces` is what the TCP BTL, the out-of-band channel and
    PMIx may use: interface names or subnets, comma-separated (OpenMPI's
    `*_if_include` syntax), such as "eth0,eth1" for two rails or "10.90.0.0/16"
    for routed host addresses."""
    if shutil.which("mpirun") is None:
        raise MPIUnavailable("mpirun not found: run ensure_mpi() first")
    namespaces = [c.ns(i) for i in range(c.hosts)] if namespaces is None else list(namespaces)
    if len(namespaces) < 2:
        raise ValueError(f"mpi_run: needs at least 2 ranks' namespaces; got {namespaces!r}")
    if not isinstance(interfaces, str) or not interfaces:
        raise ValueError(f"mpi_run: interfaces must be a non-empty str; got {interfaces!r}")
    link = {"btl_tcp_if_include": interfaces, "oob_tcp_if_include": interfaces}
    mca = {**TRANSPORT_MCA, **link, **(TUNED_MCA if tuned else {})}
    with tempfile.TemporaryDirectory(prefix="hg-mpi-") as tmp:
        wrapper = os.path.join(tmp, "inns.sh")
        with open(wrapper, "w") as f:
            f.write(_wrapper(namespaces))
        os.chmod(wrapper, stat.S_IRWXU)
        argv = ["ip", "netns", "exec", namespaces[0], "mpirun", "--allow-run-as-root",
                "--oversubscribe", "-np", str(len(namespaces)), "--bind-to", "none"]
        for k, v in mca.items():
            argv += ["--mca", k, v]
        run_id = uuid.uuid4().hex
        argv += [wrapper, PY, "-m", "benchmarks.mpinode", f"--run-id={run_id}", "--op", op,
                 "--size", str(size),
                 "--iters", str(iters), "--warmup", str(warmup), "--period", str(period)]
        if sync:
            argv.append("--sync")
        if ready:
            argv += ["--ready-after", ",".join(f"{x:g}" for x in ready)]
        env = {**os.environ, "PYTHONPATH": ROOT,
               "PMIX_MCA_ptl_tcp_remote_connections": "1", "PMIX_MCA_ptl_tcp_if_include": interfaces,
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "OMPI_MCA_rmaps_base_oversubscribe": "1", "TMPDIR": tmp}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=ROOT)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            _stop(proc, run_id)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"mpirun failed (exit {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    report = json.loads(lines[-1])
    report["mca"] = mca
    return report


def _stop(proc: subprocess.Popen, run_id: str) -> None:
    """If mpirun is still running (timeout, Ctrl-C), let it end its ranks
    (SIGTERM), then kill it and any rank of this run that outlived it (found by
    the run id on its command line)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f"--run-id={run_id}".encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
