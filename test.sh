#!/usr/bin/env bash
# Set up (fresh venv or reuse) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" -q "$@"
