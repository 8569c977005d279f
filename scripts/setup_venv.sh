#!/usr/bin/env bash
# Create (or reuse) the project venv and install cp-packing with its test extras.
# torch 2.13.0 goes in first where no torch is present, so a CPU machine gets the CPU build rather than a
# multi-GB CUDA one. ring-flash-attn is installed with --no-deps: it declares flash-attn, which only builds on
# GPU machines; cp-packing runs it on CPU through a pure-torch stand-in kernel in its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Skip the installs when this venv was already set up from the same pyproject.toml and this script.
STAMP="$VENV/.cp-packing-setup"
WANT=$(cat pyproject.toml scripts/setup_venv.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && "$PY" -c "import cp_packing" >/dev/null 2>&1; then
    exit 0
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q --no-deps "ring-flash-attn==0.1.8"
echo "$WANT" > "$STAMP"
