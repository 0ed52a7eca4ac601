#!/usr/bin/env bash
# One prepared check for a CUDA machine (H200, torch 2.11, triton 3.6 preinstalled, no internet;
# the repository arrives as a copy of the working tree). Runs the GPU kernel tests (compiled
# Triton vs the torch reference on CUDA tensors, bit-exact) and the fused/unfused ablation at
# large sizes, writing logs, JSON and plots to the output folder ($1, else $OUT, else
# results/gpu). Budget: < 8 minutes in total (step limits sum to 7.5 min); each step has its own timeout so that a slow or
# failing benchmark still leaves the test logs, and the script's exit status reports failures.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine, from the repository root
set -uo pipefail

cd "$(dirname "$0")/.."
OUTDIR="${1:-${OUT:-results/gpu}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
export TRITON_DEFAULT_FP_FUSION=1  # silence triton 3.9's notice; 3.6 fuses by default too
status=0
t0=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD... : run with a timeout, log to $OUTDIR/NAME.log
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUTDIR/summary.txt"
    local s=$(date +%s)
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc, $(( $(date +%s) - s ))s" | tee -a "$OUTDIR/summary.txt"
    tail -n 25 "$OUTDIR/$name.log"
    [ $rc -eq 0 ] || status=1
}

# The package: editable install without dependencies when pip can, else PYTHONPATH (set above)
# plus a link so that `fxstab.kernels` resolves to triton_kernels/.
if ! "$PY" -m pip install --no-deps --no-build-isolation -q -e . >"$OUTDIR/install.log" 2>&1; then
    echo "pip install failed (see install.log); using PYTHONPATH" | tee -a "$OUTDIR/summary.txt"
    [ -e fxstab/kernels ] || ln -s ../triton_kernels fxstab/kernels
fi
step env 60 "$PY" -c "import torch, triton, fxstab.kernels as k; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), k.__file__)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv >"$OUTDIR/nvidia-smi.csv" 2>&1 || true

# GPU tests: compiled kernels against the references on CUDA tensors, plus the device-agnostic
# kernel tests (dispatch, custom ops under torch.compile, validation). Fixed kernel config
# (FXSTAB_AUTOTUNE=0): one compile per variant instead of six.
step tests 150 env FXSTAB_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not interpreter" \
    tests/kernels --junitxml="$OUTDIR/tests.xml" -W ignore::DeprecationWarning

# The ablation at large sizes, N = 2, 3, 5: fused (autotuned Triton) vs unfused torch. Rows print
# as they are measured; on timeout the script still saves what it has.
step bench_fused 150 "$PY" benchmarks/bench_kernels.py --sizes 1e6,1e7,1e8,1e9 --n 3,2,5 \
    --format bf16 --mode random --paths fused,unfused --unfused-max-numel 1e8 --out "$OUTDIR"
# The torch.compile'd reference (inductor) at moderate sizes, N=3, in its own step because its
# compilation time is the unknown here.
step bench_compiled 90 "$PY" benchmarks/bench_kernels.py --sizes 1e6,1e7 --n 3 --format bf16 \
    --mode random --paths fused,unfused,compiled --out "$OUTDIR" --tag _compiled
# Secondary: stochastic rounding in fp16 (the general exponent path), N=3.
step bench_stochastic 45 "$PY" benchmarks/bench_kernels.py --sizes 1e8 --n 3 --format fp16 \
    --mode stochastic --paths fused,unfused --out "$OUTDIR"

echo "total $(( $(date +%s) - t0 ))s, status $status" | tee -a "$OUTDIR/summary.txt"
exit $status
