#!/usr/bin/env bash
# One prepared check for a CUDA machine (H200, torch 2.11, triton 3.6 preinstalled, no internet;
# the repository arrives as a copy of the working tree), the most informative steps first:
# end to end on CUDA (benchmarks/gpu_e2e.py: the test GPT and an HF GPT-2 analysed on the
# device, bit-identical outputs, the map against the CPU's, the analysed/eager ratios; the
# arithmetic level; backward=True; monitored training steps; the samples' compute under
# inductor), then the GPU kernel tests (compiled Triton vs the torch reference, bit-exact) and
# the fused/unfused ablation at sizes inside the budget. Each step has its own timeout and log;
# logs, JSON and plots go to the output folder ($1, else $OUT, else results/gpu), and
# summary.txt says, for each step, pass/fail with its figures. Budget: < 9 minutes in total
# (step limits sum to 540 s: tests/test_gpu_check.py adds them up); the exit status reports
# failures.
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run [DIR]
#       every step's Python on CPU tensors at tiny sizes (no CUDA, no install, Triton under the
#       interpreter if TRITON_INTERPRET=1): what `make test` runs so the script cannot rot.
set -uo pipefail

cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
if [ $DRY -eq 1 ]; then
    OUTDIR="${1:-${OUT:-results/gpu-dry-run}}"
else
    OUTDIR="${1:-${OUT:-results/gpu}}"
fi
mkdir -p "$OUTDIR"
: >"$OUTDIR/summary.txt"
PY="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $DRY -eq 0 ]; then
    unset TRITON_INTERPRET  # compiled kernels, not the interpreter
fi
export TRITON_DEFAULT_FP_FUSION=1  # silence triton 3.9's notice; 3.6 fuses by default too
status=0
t0=$(date +%s)

step() {  # step NAME TIMEOUT_S CMD... : run with a timeout, log to $OUTDIR/NAME.log
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*" >>"$OUTDIR/steps.txt"
    local s=$(date +%s)
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
    local rc=$?
    local verdict=pass
    [ $rc -eq 0 ] || { verdict="FAIL (rc=$rc$([ $rc -eq 124 ] && echo ', timed out'))"; status=1; }
    echo "$name: $verdict, $(( $(date +%s) - s ))s" | tee -a "$OUTDIR/summary.txt"
    tail -n 12 "$OUTDIR/$name.log"
}

if [ $DRY -eq 0 ]; then
    # The package: editable install without dependencies when pip can, else PYTHONPATH (set
    # above) plus a link so that `fxstab.kernels` resolves to triton_kernels/.
    if ! "$PY" -m pip install --no-deps --no-build-isolation -q -e . >"$OUTDIR/install.log" 2>&1; then
        echo "pip install failed (see install.log); using PYTHONPATH" | tee -a "$OUTDIR/summary.txt"
        [ -e fxstab/kernels ] || ln -s ../triton_kernels fxstab/kernels
    fi
    # Hugging Face's transformers for the GPT-2 cases, from a wheelhouse carried with the tree
    # (the device has no network; docs/gpu.md says how to prepare it); without it those cases
    # are reported as skipped
    if [ -d "${WHEELS:-wheels}" ]; then
        "$PY" -m pip install -q --no-index --find-links "${WHEELS:-wheels}" transformers \
            >"$OUTDIR/wheels.log" 2>&1 || echo "transformers from ${WHEELS:-wheels} failed (wheels.log)" | tee -a "$OUTDIR/summary.txt"
    fi
    step env 30 "$PY" -c "import torch, triton, fxstab.kernels as k; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), k.__file__)"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv >"$OUTDIR/nvidia-smi.csv" 2>&1 || true
    E2E=()
else
    step env 30 "$PY" -c "import torch, fxstab.kernels as k; print(torch.__version__, 'cpu (dry run)', k.__file__)"
    E2E=(--dry-run)
fi

# End to end, most informative first (benchmarks/gpu_e2e.py; each step writes e2e_<step>.json)
step e2e_op 115 "$PY" benchmarks/gpu_e2e.py --step op --out "$OUTDIR" "${E2E[@]}"
# the Llama-shaped bf16 model at 4 layers (issue 46): ratios, peak memory, the samples' GEMMs
# in bf16 kernels (lowp_gemm) against fp32
step e2e_scale 50 "$PY" benchmarks/gpu_e2e.py --step scale --out "$OUTDIR" "${E2E[@]}"
step e2e_aten 60 "$PY" benchmarks/gpu_e2e.py --step aten --out "$OUTDIR" "${E2E[@]}"
step e2e_backward 45 "$PY" benchmarks/gpu_e2e.py --step backward --out "$OUTDIR" "${E2E[@]}"
step e2e_monitor 45 "$PY" benchmarks/gpu_e2e.py --step monitor --out "$OUTDIR" "${E2E[@]}"
step e2e_inductor 50 "$PY" benchmarks/gpu_e2e.py --step inductor --out "$OUTDIR" "${E2E[@]}"
# the GEMM accumulator's Triton kernel: bit for bit the CPU reference (the aligned fp8 presets
# on nvfp4/mxfp4/mxfp6/mxfp8 operands too), GB/s against torch.matmul
step e2e_accumulate 30 "$PY" benchmarks/gpu_e2e.py --step accumulate --out "$OUTDIR" "${E2E[@]}"

if [ $DRY -eq 0 ]; then
    # GPU tests: compiled kernels against the references on CUDA tensors, plus the
    # device-agnostic kernel tests. Fixed kernel config (FXSTAB_AUTOTUNE=0): one compile per
    # variant instead of six.
    step tests 70 env FXSTAB_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not interpreter" \
        tests/kernels --junitxml="$OUTDIR/tests.xml" -W ignore::DeprecationWarning
    # The ablation, N = 2, 3, 5: fused (autotuned Triton) vs unfused torch.
    step bench_fused 45 "$PY" benchmarks/bench_kernels.py --sizes 1e6,1e7,1e8 --n 3,2,5 \
        --format bf16 --mode random --paths fused,unfused --unfused-max-numel 1e8 --out "$OUTDIR"
else
    # the kernels' benchmark at a tiny size on the CPU (fused: Triton under the interpreter)
    step bench_fused 60 "$PY" benchmarks/bench_kernels.py --sizes 4096 --n 3 --format bf16 \
        --mode random --paths fused,unfused --device cpu --out "$OUTDIR"
fi

{
    echo "-- end to end (benchmarks/gpu_e2e.py; ratio_nN: analysed call / eager call with N samples;"
    echo "   max_map_difference_vs_cpu: the largest difference of any statistic between the map on"
    echo "   the device and the CPU's, same seed)"
    "$PY" benchmarks/gpu_e2e.py --summary --out "$OUTDIR"
    echo "total $(( $(date +%s) - t0 ))s, status $status"
} | tee -a "$OUTDIR/summary.txt"
exit $status
