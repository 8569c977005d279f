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


def test_magi_dispatch_imports_a_checkout_without_its_extensions(tmp_path):
    """``bench_planner --magi`` imports a MagiAttention checkout whose package needs CUDA extensions, Triton and
    debugpy at import: the loader must skip the package's ``__init__``, lend stand-ins only while its modules import
    (torch probes for triton later), and turn its chunk partition into runs covering every token once. A fake
    checkout with the same module layout stands in for the real one (which CI cannot fetch)."""
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import magi_dispatch
    finally:
        sys.path.pop(0)
    with pytest.raises(ValueError, match="MagiAttention checkout"):
        magi_dispatch.load(str(tmp_path))
    pkg = tmp_path / "magi_attention"
    for sub in ("", "common", "meta", "meta/solver"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('the CUDA extensions')\n")
    (pkg / "common" / "__init__.py").write_text(
        "import triton, triton.language as tl, debugpy\nfrom triton.language.extra import libdevice\n"
        "@triton.jit\ndef kernel(x):\n    return x\n"
        "class AttnRanges(list):\n    @staticmethod\n    def from_ranges(pairs):\n        return AttnRanges(pairs)\n")
    (pkg / "common" / "enum.py").write_text("class AttnMaskType:\n    CAUSAL = 'causal'\n")
    (pkg / "meta" / "solver" / "dispatch_solver.py").write_text("class DispatchConfig:\n    pass\n")
    (pkg / "meta" / "_make_dispatch_meta.py").write_text(
        "import torch\nfrom types import SimpleNamespace\n"
        "def make_dispatch_meta_from_qk_ranges(q, k, masks, tq, tk, chunk, cp, rank, config, same, qp, kp):\n"
        "    torch.cuda.nvtx.range_push('x'); torch.cuda.nvtx.range_pop()  # a CPU build raises unless stood in\n"
        "    n = tq // chunk\n"
        "    return SimpleNamespace(partitions=[list(range(r, n, cp)) for r in range(cp)]), None\n")
    before = set(sys.modules)
    try:
        dispatch = magi_dispatch.load(str(tmp_path))
        assert "triton" not in sys.modules and "debugpy" not in sys.modules
        cu = np.array([0, 700, 1500, 4096], dtype=np.int64)
        rank, start, length = dispatch(cu, 2)
        with pytest.raises(ValueError, match="divisible by cp"):
            dispatch(np.array([0, 700, 1000], dtype=np.int64), 2)
        with pytest.raises(ValueError, match="already imported"):  # the checkout given must be the one timed
            magi_dispatch.load(str(tmp_path))
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("magi_attention"):
                del sys.modules[name]
    assert int(length.sum()) == 4096 and np.array_equal(start[1:], (start + length)[:-1])  # every token once
    assert np.isin(cu[:-1], start).all()  # runs are cut at the documents
    assert np.array_equal(rank, (start // 512) % 2)  # chunk c went to rank c % 2, as the partition says


def test_compare_planners_quick_finds_a_planner_identical_to_itself():
    out = _quick("compare_planners.py", os.path.join(ROOT, "cp_packing", "layouts", "local.py"))
    assert "identical 12, differ, no worse 0, worse 0" in out, out
