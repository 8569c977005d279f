"""launch/verify.py, the cluster correctness check, run the way CI can: ``--nproc 2`` (a gloo group on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERIFY = os.path.join(ROOT, "launch", "verify.py")


def run_verify(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, VERIFY, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def table_rows(stdout: str) -> dict[tuple[str, str, str], str]:
    """(layout, backend, kernel) -> result column, for the rows that ran."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 7 and parts[0] in ("contiguous", "zigzag", "balanced") and parts[6] in ("PASS", "FAIL"):
            rows[tuple(parts[:3])] = parts[6]
    return rows


@pytest.mark.distributed
def test_verify_passes_on_a_correct_build():
    proc = run_verify("--nproc", "2", "--trials", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    for layout in ("contiguous", "zigzag", "balanced"):
        assert rows.get((layout, "allgather", "torch")) == "PASS", proc.stdout
    assert "FAIL" not in set(rows.values())
    assert "\n0 FAIL, " in proc.stdout


@pytest.mark.distributed
def test_verify_fails_on_wrong_metadata():
    """A deliberately wrong run_key_start (hidden --inject-fault) must turn rows into FAIL and the exit code
    non-zero: the verifier can fail."""
    proc = run_verify("--nproc", "2", "--trials", "1", "--layouts", "zigzag", "contiguous", "--inject-fault")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    assert rows[("zigzag", "allgather", "torch")] == "FAIL", proc.stdout


def test_verify_rejects_bad_arguments():
    proc = run_verify("--heads", "3", "--kv-heads", "2")
    assert proc.returncode == 2
    assert "--heads 3 must be a multiple of --kv-heads 2" in proc.stderr
