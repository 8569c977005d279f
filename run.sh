#!/usr/bin/env bash
# Set up (fresh venv or reuse) and run the main job: a tiny Llama trained with context parallelism on synthetic
# neat-packed documents, 2 CP ranks (gloo on CPU, NCCL on GPUs). Extra arguments go to launch/train.py,
# e.g. `bash run.sh --layout balanced --steps 20 --check-parity`. NPROC=4 bash run.sh for 4 ranks.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_venv.sh
exec .venv/bin/torchrun --standalone --nproc-per-node "${NPROC:-2}" launch/train.py "$@"
