"""cp_packing.tools.train (``python -m cp_packing train``, ``launch/train.py``): runs end to end, learns, its
--check-parity catches a broken gradient reduction, usage errors exit 2, and a signal to the parent ends every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from cp_packing.testing import under_torchrun  # noqa: E402
from cp_packing.tools import train  # noqa: E402

not_under_torchrun = pytest.mark.skipif(under_torchrun(), reason="spawns its own ranks (--nproc)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    """This environment without torchrun's variables, with this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


@not_under_torchrun
@pytest.mark.distributed
def test_train_script_runs_with_parity_pass():
    """The launcher as a user runs it (a subprocess of launch/train.py, no torchrun): exit 0, PASS, a finite loss,
    step time and peak memory on every step line."""
    proc = subprocess.run(
        [sys.executable, TRAIN, "--nproc", "2", "--steps", "2", "--check-parity"],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT,
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
        assert float(line.split(" time ")[1].split()[0].replace(",", "")) > 0, line
        assert float(line.split("peak mem ")[1].split()[0].replace(",", "")) > 10, line  # MiB


@not_under_torchrun
@pytest.mark.distributed
def test_parity_check_fails_without_the_cp_gradient_reduction(capfd):
    """--check-parity is not a rubber stamp: a trainer that skips the CP all-reduce of gradients exits 1 with FAIL."""
    code = train.main(["--nproc", "2", "--steps", "1", "--check-parity", "--layout", "zigzag", "--seq-len", "32",
                       "--inject-fault"])
    out = capfd.readouterr().out
    assert code == 1, out
    assert "FAIL" in out and "MISMATCH" in out, out


def test_usage_errors():
    for argv in (["--heads", "4", "--kv-heads", "3"], ["--steps", "0"], ["--layout", "diagonal"],
                 ["--kernel", "flash_attention_9"], ["--seed", "-1"],
                 ["--attn-backend", "ring_flash_attn", "--layout", "balanced"]):
        with pytest.raises(SystemExit) as exc:
            train.parse_args(argv)
        assert exc.value.code == 2, argv


def test_auto_layout_with_the_ring_backend_picks_a_layout_it_has_kernels_for():
    assert train.parse_args(["--attn-backend", "ring_flash_attn"]).layout in ("contiguous", "zigzag")
    assert train.parse_args([]).layout == "auto"


def test_help_is_printed_by_rank_0_only(monkeypatch, capsys):
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exc:
            train.parse_args(["--help"])
        assert exc.value.code == 0
        assert ("--check-parity" in capsys.readouterr().out) is printed
        with pytest.raises(SystemExit) as exc:
            train.parse_args(["--steps", "0"])
        assert exc.value.code == 2
        assert ("--steps must be >= 1" in capsys.readouterr().err) is printed


@not_under_torchrun
@pytest.mark.distributed
def test_an_error_on_rank_1_is_printed_there_and_exits_1(monkeypatch, capfd):
    """A library error on a rank other than 0 is not a usage error: that rank prints its traceback and the run
    exits 1 (it used to become a silent exit 2, printed on rank 0 only)."""
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
    code = train.main(["--nproc", "2", "--cp", "3", "--steps", "1", "--seq-len", "32"])
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.count("error: --cp 3 does not divide the world size 2") == 1, err  # one line, rank 0 only
    assert "Traceback" not in err, err


def _children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


LONG_RUNS = {
    "train": ["train", "--steps", "100000", "--seq-len", "32", "--layers", "1", "--log-every", "1"],
    "verify": ["verify", "--trials", "100000", "--layouts", "contiguous", "--backends", "allgather"],
}


@not_under_torchrun
@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig, command", [(signal.SIGTERM, "train"), (signal.SIGINT, "verify")],
                         ids=["SIGTERM-train", "SIGINT-verify"])
def test_a_signal_to_the_parent_ends_every_rank(sig, command):
    """``--nproc`` parent killed mid-run (a scheduler's SIGTERM, a Ctrl-C): no rank is left running as an orphan."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cp_packing", *LONG_RUNS[command], "--nproc", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(), cwd=ROOT, start_new_session=True,
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while len(ranks) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "the run ended before the signal"
            time.sleep(0.2)
            ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        time.sleep(2.0)  # the ranks are past their start
        assert all(_alive(r) for r in ranks)
        os.kill(proc.pid, sig)  # the parent only, as `kill PID` does
        assert proc.wait(timeout=30) != 0
        deadline = time.monotonic() + 15
        while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [r for r in ranks if _alive(r)], "orphan ranks still running"
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
