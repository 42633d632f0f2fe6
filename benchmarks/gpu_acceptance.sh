#!/usr/bin/env bash
# The GPU acceptance run in one command, on a machine with a CUDA GPU:
#   bash benchmarks/gpu_acceptance.sh [LOGDIR]
# 1. installs the project (editable, no dependencies) into the current Python,
#    plus any wheels found in .whl/ (for machines with no package index);
# 2. prints the GPU, driver and package versions, and `hoplite-gpu info`;
# 3. runs every gpu-marked test (kernels, values, device objects and early
#    reduce steps on the device, over TCP and UCX);
# 4. runs the device benchmark (python -m benchmarks.device) and the put/get
#    profile (python -m benchmarks.device_profile), and with MODES="thread ..."
#    the UCX transfer again under those ucxx progress modes.
# Every step's output goes to LOGDIR (default benchmarks/results/gpu-DATE) too.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG=${1:-benchmarks/results/gpu-$(date +%Y-%m-%d)}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
step() { echo; echo "== $*"; }

step install
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3
fi
if ! $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3 \
        || ! $PY -c "import hoplite_gpu.kernels, hoplite_gpu.transports" 2>/dev/null; then
    # No editable install possible: make the source tree importable as it stands.
    echo "editable install failed: linking kernels/ and transports/ into hoplite_gpu/"
    ln -sfn ../kernels hoplite_gpu/kernels && ln -sfn ../transports hoplite_gpu/transports
fi

step environment
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("numpy", "cupy", "torch", "ucxx", "msgpack", "pynvml"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(name, "NOT importable:", type(exc).__name__, exc)
EOF
    $PY -m hoplite_gpu info
} 2>&1 | tee "$LOG/environment.txt"

step "gpu-marked tests"
timeout ${TESTS_TIMEOUT:-300} $PY -m pytest -q -m gpu -p no:cacheprovider --timeout 90 --continue-on-collection-errors tests 2>&1 \
    | tee "$LOG/tests.txt"
tests_rc=${PIPESTATUS[0]}

step "device benchmark"
timeout ${BENCH_TIMEOUT:-240} $PY -m benchmarks.device --sizes ${SIZES:-64 256} --chunks ${CHUNKS:-16 64 256} --save "$LOG/device.json" 2>&1 \
    | tee "$LOG/device.txt"
bench_rc=${PIPESTATUS[0]}

step "device put and get, profiled (get asked with the put, then 0.3 s after it)"
for when in "" late; do
    timeout 120 $PY -m benchmarks.device_profile 256 ucx reuse $when 2>&1 \
        | grep -v "UCXPY  WARNING" >"$LOG/profile${when:+-$when}.txt"
    head -4 "$LOG/profile${when:+-$when}.txt"
done

# The UCX transfer again under ucxx's other progress modes (blocking is the default).
for mode in ${MODES:-}; do
    step "UCX transfer, progress mode $mode"
    UCXPY_PROGRESS_MODE=$mode timeout 120 $PY -m benchmarks.device --parts ucx --sizes 64 256 \
        --save "$LOG/device-ucx-$mode.json" 2>&1 | tail -6 | tee "$LOG/device-ucx-$mode.txt"
done

echo "tests exit $tests_rc, benchmark exit $bench_rc; logs in $LOG"
exit $(( tests_rc || bench_rc ))
