#!/usr/bin/env bash
# Set up (fresh venv or reuse) and run the main job: a tiny Llama trained with context parallelism on synthetic
# neat-packed documents, 2 CP ranks (gloo on CPU, NCCL on GPUs). Extra arguments go to launch/train.py
# (`python -m cp_packing train --help`, docs/launcher.md), e.g. `bash run.sh --layout balanced --steps 20
# --check-parity`, or your own model and data: `bash run.sh --model ./my-model --data ./train.jsonl --output-dir out`.
# `bash run.sh --nproc 4` (or NPROC=4 bash run.sh) runs 4 ranks. `--save-timeout S` (default 120) is also torchrun's
# --shutdown-timeout: the seconds the ranks get after a SIGTERM to finish their step and write a checkpoint.
# Exit status: 0 ok, 1 error or parity FAIL, 2 usage error (checked here once, before torchrun starts any rank);
# torchrun reports a rank stopped by SIGTERM (143 after a checkpoint, 3 without) as its own failure.
set -euo pipefail
cd "$(dirname "$0")"
NPROC=${NPROC:-2}
SAVE_TIMEOUT=120
ARGS=()
HELP=0
while [ $# -gt 0 ]; do  # --nproc sets torchrun's --nproc-per-node here (torchrun itself would call it ambiguous)
    case "$1" in
        --nproc) [ $# -ge 2 ] || { echo "error: --nproc needs a number" >&2; exit 2; }; NPROC=$2; shift 2 ;;
        --nproc=*) NPROC=${1#--nproc=}; shift ;;
        --save-timeout) [ $# -ge 2 ] || { echo "error: --save-timeout needs a number of seconds" >&2; exit 2; }
            SAVE_TIMEOUT=$2; ARGS+=("$1" "$2"); shift 2 ;;
        --save-timeout=*) SAVE_TIMEOUT=${1#--save-timeout=}; ARGS+=("$1"); shift ;;
        -h|--help) HELP=1; ARGS+=("$1"); shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
case "$NPROC" in ''|*[!0-9]*|0) echo "error: --nproc must be a positive integer, got '$NPROC'" >&2; exit 2 ;; esac
case "$SAVE_TIMEOUT" in
    ''|*[!0-9]*|0) echo "error: --save-timeout must be a whole number of seconds >= 1 here, got '$SAVE_TIMEOUT'" >&2
        exit 2 ;;
esac
bash scripts/setup_venv.sh
if [ "$HELP" = 1 ]; then  # the options, printed once, without starting any rank
    exec .venv/bin/python launch/train.py ${ARGS[@]+"${ARGS[@]}"}
fi
# Every option, the model directory, the data and the output directory checked once, as rank 0 of a world of NPROC
# would: a usage error is one line and exit 2 here (torchrun reports any failed rank as its own exit 1).
WORLD_SIZE=$NPROC RANK=0 LOCAL_RANK=0 .venv/bin/python launch/train.py --dry-run ${ARGS[@]+"${ARGS[@]}"} >/dev/null
# Rank 0 hosts the c10d store, not torchrun's agent: a SIGKILLed torchrun then leaves the ranks their store, and
# they stop after their step with a checkpoint (docs/launcher.md, "SIGTERM and orphans").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" --shutdown-timeout "$SAVE_TIMEOUT" \
    launch/train.py ${ARGS[@]+"${ARGS[@]}"}
