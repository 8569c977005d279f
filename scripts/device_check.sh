#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (one GPU, no network; its image has torch and transformers, no
# flash-attn): what CPU CI cannot check, each step bounded, everything logged under $OUT (default ./device_out).
#
#   bash scripts/device_check.sh            # on the GPU machine, from the repository root
#   bash scripts/device_check.sh --dry      # anywhere: print the steps and check that every command parses
#
# Steps: the environment; the verifier on the GPU (cp 1 under torchrun + NCCL: every backend's path with torch's
# varlen kernel against the float32 reference, bf16 and fp32); the tests that use CUDA where it is present; the
# attention benchmark at cp 1 (the kernels' TFLOP/s in MagiAttention's setting); the chunked loss's peak and time
# next to F.cross_entropy on the GPU. One GPU: NCCL refuses two ranks on one device, so nothing here runs CP > 1
# over NCCL; that stays unverified until a multi-GPU machine is lent (docs/benchmarks.md says so).
set -u
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-device_out}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
FAILED=0

step() {  # step NAME HELP-COMMAND -- COMMAND...: in --dry mode run the help command only
    local name=$1 help=$2
    shift 3
    echo "== $name: $*" | tee -a "$LOG"
    if [ "$DRY" = 1 ]; then
        if ! bash -c "$help" >/dev/null 2>>"$LOG"; then
            echo "   DRY FAIL: $help" | tee -a "$LOG"
            FAILED=1
        fi
        return
    fi
    local start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$rc" = 0 ] || FAILED=1
}

if [ "$DRY" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device here: run with --dry to check the steps, or on the GPU machine" | tee -a "$LOG"
    exit 2
fi

step "environment" "$PY -c 'import torch, transformers'" -- \
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
step "verify, cp 1, NCCL + CUDA" "$PY -m cp_packing verify --help" -- \
    torchrun --standalone --nproc-per-node 1 -m cp_packing verify --dtype bfloat16 float32 --trials 2
step "tests that use CUDA where present" "$PY -c 'import pytest'" -- \
    "$PY" -m pytest -q -p no:cacheprovider -x tests/test_kernels.py tests/test_padding.py tests/test_distributed.py \
    tests/test_compile.py
step "attention benchmark, cp 1" "$PY benchmarks/bench_cp_attention_gpu.py --help" -- \
    torchrun --standalone --nproc-per-node 1 benchmarks/bench_cp_attention_gpu.py --steps 5
step "chunked loss on the GPU" "$PY benchmarks/bench_loss.py --help" -- \
    "$PY" benchmarks/bench_loss.py --device cuda --tokens 32768 --vocab 131072 --hidden 4096
echo "== done: $([ "$FAILED" = 0 ] && echo every step passed || echo a step failed, see $LOG)" | tee -a "$LOG"
exit "$FAILED"
