"""The benchmarks' --quick modes run (their figures live in docs/benchmarks.md; no timing is asserted here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quick(script: str, *extra: str) -> str:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", *extra], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.distributed
def test_trace_step_quick_counts_calls_and_times_the_layer():
    out = _quick("trace_step.py")
    assert "| forward, layers 2.. |" in out and "| backward |" in out and "later step" in out
    assert "Per-layer Python overhead at cp=1 (do-nothing kernel):" in out


def test_bench_scale_quick_prices_every_layout():
    out = _quick("bench_scale.py", "--layouts", "contiguous", "balanced")
    assert out.count("| contiguous |") == 2 and out.count("| balanced |") == 2 and "token order" in out


def test_bench_planner_quick_times_local_beside_the_metadata_and_the_min_heap():
    out = _quick("bench_planner.py")
    rows = [line for line in out.splitlines() if line.startswith("| lognormal") or line.startswith("| huge")]
    assert len(rows) == 8 and all(len(row.split("|")) == 14 for row in rows), out
