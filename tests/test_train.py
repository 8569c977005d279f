"""The training launcher: runs end to end, learns, and its --check-parity catches a broken gradient reduction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.dist_utils import under_torchrun  # noqa: E402

not_under_torchrun = pytest.mark.skipif(under_torchrun(), reason="spawns its own ranks (--nproc)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")


@not_under_torchrun
@pytest.mark.distributed
def test_train_script_runs_with_parity_pass():
    """The README's command, as a user runs it (a subprocess, no torchrun): exit 0, PASS, a finite loss per step."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, TRAIN, "--nproc", "2", "--steps", "2", "--check-parity"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "PASS" in proc.stdout, out
    assert "FAIL" not in proc.stdout, out
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, out
    for line in steps:
        loss = float(line.split("loss")[1].split()[0])
        assert 0.0 < loss < 10.0, line  # ln(256) = 5.5 at init


@not_under_torchrun
@pytest.mark.distributed
def test_parity_check_fails_without_the_cp_gradient_reduction(capfd):
    """--check-parity is not a rubber stamp: a trainer that skips the CP all-reduce of gradients exits 1 with FAIL."""
    from launch import train
    code = train.main(["--nproc", "2", "--steps", "1", "--check-parity", "--layout", "zigzag", "--seq-len", "32",
                       "--inject-fault"])
    out = capfd.readouterr().out
    assert code == 1, out
    assert "FAIL" in out and "MISMATCH" in out, out


def test_usage_errors():
    from launch import train
    with pytest.raises(SystemExit):
        train.parse_args(["--heads", "4", "--kv-heads", "3"])
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        train.parse_args(["--layout", "diagonal"])


@not_under_torchrun
@pytest.mark.distributed
def test_an_error_on_rank_1_is_printed_there_and_exits_1(monkeypatch, capfd):
    """A library error on a rank other than 0 is not a usage error: that rank prints its traceback and the run
    exits 1 (it used to become a silent exit 2, printed on rank 0 only)."""
    from launch import train

    original = train.packed_cross_entropy

    def loss_that_fails_on_rank_1(logits, labels, **kwargs):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("label 300 at local position 5 is outside [0, 256)")
        return original(logits, labels, **kwargs)

    monkeypatch.setattr(train, "packed_cross_entropy", loss_that_fails_on_rank_1)
    code = train.main(["--nproc", "2", "--steps", "1", "--seq-len", "32", "--layers", "1"])
    err = capfd.readouterr().err
    assert code == 1, err
    assert "rank 1" in err and "ValueError: label 300 at local position 5 is outside [0, 256)" in err, err
    assert "Traceback" in err, err


@not_under_torchrun
@pytest.mark.distributed
def test_a_config_that_does_not_fit_the_world_is_a_usage_error(capfd):
    from launch import train

    code = train.main(["--nproc", "2", "--cp", "3", "--steps", "1", "--seq-len", "32"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.count("error: --cp 3 does not divide the world size 2") == 1, err  # one line, rank 0 only
    assert "Traceback" not in err, err
