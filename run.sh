#!/usr/bin/env bash
# Set up (fresh venv or reuse) and run the main job: a tiny Llama trained with context parallelism on synthetic
# neat-packed documents, 2 CP ranks (gloo on CPU, NCCL on GPUs). Extra arguments go to launch/train.py
# (`python -m cp_packing train --help`), e.g. `bash run.sh --layout balanced --steps 20 --check-parity`.
# `bash run.sh --nproc 4` (or NPROC=4 bash run.sh) runs 4 ranks.
set -euo pipefail
cd "$(dirname "$0")"
NPROC=${NPROC:-2}
ARGS=()
while [ $# -gt 0 ]; do  # --nproc sets torchrun's --nproc-per-node here (torchrun itself would call it ambiguous)
    case "$1" in
        --nproc) [ $# -ge 2 ] || { echo "error: --nproc needs a number" >&2; exit 2; }; NPROC=$2; shift 2 ;;
        --nproc=*) NPROC=${1#--nproc=}; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
case "$NPROC" in ''|*[!0-9]*|0) echo "error: --nproc must be a positive integer, got '$NPROC'" >&2; exit 2 ;; esac
bash scripts/setup_venv.sh
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" launch/train.py ${ARGS[@]+"${ARGS[@]}"}
