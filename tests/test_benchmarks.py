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


@pytest.mark.distributed
def test_bench_gradients_quick_times_the_sum_and_the_digest():
    out = _quick("bench_gradients.py")
    assert "| per-parameter loop |" in out and "| sum_gradients |" in out and "param_digest" in out


@pytest.mark.distributed
def test_bench_compile_quick_compiles_without_graph_breaks():
    out = _quick("bench_compile.py")
    assert "| allgather |" in out and "| exchange |" in out  # its exit status says: no graph break


def test_bench_loss_quick_measures_every_loss():
    out = _quick("bench_loss.py")
    for name in ("F.cross_entropy", "packed_cross_entropy", "packed_linear_cross_entropy"):
        assert out.count(f"| {name} |") == 2, out  # fp32 and bf16


def test_bench_planner_quick_times_local_beside_the_metadata_and_the_min_heap():
    out = _quick("bench_planner.py")
    rows = [line for line in out.splitlines() if line.startswith("| lognormal") or line.startswith("| huge")]
    assert len(rows) == 8 and all(len(row.split("|")) == 14 for row in rows), out


@pytest.mark.distributed
def test_bench_memory_quick_measures_every_backend_and_layout():
    out = _quick("bench_memory.py")
    for backend in ("allgather", "exchange", "ulysses", "hybrid"):
        for layout in ("contiguous", "zigzag", "balanced", "local"):
            assert f"| {backend} | {layout} |" in out
    assert "| cp 2, busiest rank |" in out and "one process (cp 1)" in out


def test_device_check_script_steps_parse(tmp_path):
    """scripts/device_check.sh is what a lent GPU machine runs first (its minutes are few): every step's command
    must at least parse here (--dry runs each step's --help), and without CUDA it refuses with exit 2."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    script = os.path.join(ROOT, "scripts", "device_check.sh")
    r = subprocess.run(["bash", script, "--dry"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "every step passed" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("\n== ") + r.stdout.startswith("== ") >= 6, r.stdout
    r = subprocess.run(["bash", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "no CUDA device here" in r.stdout, r.stdout + r.stderr
