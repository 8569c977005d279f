"""The training launcher's checkpoints and lifecycle (cp_packing.tools.train, .checkpoint, .lifecycle): a run stopped by
SIGTERM and resumed ends with the weights of an uninterrupted run; a save killed half-way leaves the previous
checkpoint intact, loadable and resumable; SIGTERM before the first step exits 3 with nothing written (the handler is
in place before anything else); no rank keeps training once its launcher is killed with SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")

from cp_packing.testing import under_torchrun  # noqa: E402
from cp_packing.tools import train  # noqa: E402
from cp_packing.tools.checkpoint import find_checkpoint  # noqa: E402
from tests.test_train import _alive, _children, _env  # noqa: E402

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(under_torchrun(), reason="spawns its own ranks (--nproc, torchrun)")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every state a resume must restore exactly: gradient accumulation, a warmup + cosine schedule, clipping.
TRAINING = ["--nproc", "2", "--seq-len", "32", "--layers", "1", "--log-every", "1", "--grad-accum", "2",
            "--lr-scheduler", "cosine", "--warmup-steps", "1", "--max-grad-norm", "0.5", "--steps", "4"]


def _weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _jsonl(path) -> str:
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(40):
            n = int(torch.randint(3, 30, (1,), generator=g))
            f.write(json.dumps({"input_ids": torch.randint(1, 256, (n,), generator=g).tolist()}) + "\n")
    return str(path)


@pytest.mark.parametrize("data, cp", [("synthetic", "2"), ("jsonl", "1")], ids=["synthetic-cp2", "jsonl-dp2"])
def test_a_run_stopped_by_sigterm_and_resumed_ends_with_the_weights_of_an_uninterrupted_run(data, cp, tmp_path,
                                                                                              capfd):
    """SIGTERM to one rank after step 2 of 4: every rank stops there, the checkpoint holds model, optimizer,
    schedule, step, per-rank RNG and data position; --resume runs steps 3 and 4 and the weights equal those of a run
    that was never stopped, bit for bit (gloo sums in a fixed order), as do the logged losses."""
    opts = [*TRAINING, "--cp", cp] + (["--data", _jsonl(tmp_path / "d.jsonl")] if data == "jsonl" else [])
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert train.main([*opts, "--output-dir", str(whole)]) == 0
    reference = capfd.readouterr().out
    assert train.main([*opts, "--output-dir", str(stopped), "--inject-fault", "sigterm@2"]) == train.EXIT_SIGTERM
    out = capfd.readouterr().out
    assert "SIGTERM: stopped after step 2 of 4" in out and "step    3/4" not in out, out
    assert find_checkpoint(str(stopped)) == str(stopped / "checkpoint-2")
    assert train.main([*opts, "--resume", str(stopped)]) == 0  # --output-dir: the resumed directory
    resumed = capfd.readouterr().out
    assert "resumed from" in resumed and "step    1/4" not in resumed, resumed

    def losses(text, steps):
        return [line.split(" loss ")[1].split()[0] for line in text.splitlines()
                if line.startswith(tuple(f"step {s:>4}/" for s in steps))]

    assert losses(resumed, (3, 4)) == losses(reference, (3, 4)) and len(losses(resumed, (3, 4))) == 2, resumed
    a, b = _weights(whole), _weights(stopped)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_save_killed_midway_keeps_the_previous_checkpoint_loadable_and_resumable(tmp_path, capfd):
    """Rank 0 is SIGKILLed while it writes the second checkpoint (--save-every 1): the partial directory is never
    taken for a checkpoint, checkpoint-1 is intact (from_pretrained loads it), --resume continues from it and the
    next complete save removes the partial one."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    opts = ["--nproc", "2", "--seq-len", "32", "--layers", "1", "--steps", "3", "--save-every", "1"]
    assert train.main([*opts, "--output-dir", str(out), "--inject-fault", "kill-mid-save"]) == 1
    capfd.readouterr()
    assert sorted(os.listdir(out)) == [".checkpoint-2.partial", "checkpoint-1"]
    assert "model.safetensors" in os.listdir(out / ".checkpoint-2.partial")  # killed after writing the model
    assert find_checkpoint(str(out)) == str(out / "checkpoint-1")
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoint-1", local_files_only=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert train.main([*opts, "--resume", str(out)]) == 0
    text = capfd.readouterr().out
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in text and "step    2/3" in text, text
    assert sorted(n for n in os.listdir(out) if "checkpoint" in n) == ["checkpoint-3"]


def test_sigterm_before_the_first_step_exits_3_and_writes_nothing(tmp_path, capfd):
    out = tmp_path / "out"
    code = train.main(["--nproc", "2", "--seq-len", "32", "--layers", "1", "--output-dir", str(out),
                       "--inject-fault", "sigterm@0"])
    assert code == train.EXIT_STOPPED == 3
    assert "SIGTERM before the first step" in capfd.readouterr().out
    assert not [n for n in os.listdir(out) if "checkpoint" in n]


def test_the_sigterm_handler_is_in_place_before_the_data_is_read(tmp_path):
    """A SIGTERM while the launcher still reads and checks its inputs (before any rank started) is a request to
    stop, answered by status 3, not a kill by the default action (-15) mid-setup."""
    script = ("import os, signal, sys\n"
              "from cp_packing.tools import train\n"
              "checks = train.prepare\n"
              "def prepare(*a):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return checks(*a)\n"
              "train.prepare = prepare\n"
              "sys.exit(train.main(['--nproc', '2', '--seq-len', '32', '--layers', '1']))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "SIGTERM before the first step" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("launcher", ["torchrun", "nproc"])
def test_no_rank_keeps_training_after_its_launcher_is_killed_with_sigkill(launcher):
    """``kill -9`` of torchrun (or of the ``--nproc`` parent) while the ranks train: every rank ends within a hard
    timeout (torchrun's workers see their parent gone and stop as on SIGTERM; forked ranks die with their parent)."""
    run = ["--steps", "100000", "--seq-len", "32", "--layers", "1", "--log-every", "1", "--save-timeout", "20"]
    if launcher == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                os.path.join(ROOT, "launch", "train.py"), *run]
    else:
        argv = [sys.executable, "-m", "cp_packing", "train", "--nproc", "2", *run]
    with _sigkilled_at_step_2(argv, _env()) as alive:
        assert not alive, "orphan ranks still training after their launcher died"


@contextlib.contextmanager
def _sigkilled_at_step_2(argv: list[str], env: dict):
    """Start the launcher ``argv``, ``kill -9`` it once its ranks log step 2, wait for its two ranks to end (hard
    timeout: a step, then the stop or the watchdog's os._exit); yields the ranks still alive. Every process is
    killed on the way out."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # the ranks are training
            line = proc.stdout.readline()
            assert line, "the run ended before the kill"
            if line.startswith("step    2/"):
                break
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(_alive(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        yield [r for r in ranks if _alive(r)]
    finally:
        for pid in [proc.pid, *ranks]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_a_rank_that_cannot_write_its_part_fails_the_save_on_every_rank(tmp_path, monkeypatch, capfd):
    """Rank 1 fails to write its RNG file: every rank raises (no rank waits for it), the run exits 1, the partial
    directory is removed and no checkpoint claims to be complete."""
    import cp_packing.tools.checkpoint as checkpoint

    states = checkpoint._rng_state

    def fails_on_rank_1():
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return states()

    monkeypatch.setattr(checkpoint, "_rng_state", fails_on_rank_1)  # the forked ranks inherit it
    out = tmp_path / "out"
    code = train.main(["--nproc", "2", "--seq-len", "32", "--layers", "1", "--steps", "2", "--save-every", "1",
                       "--output-dir", str(out)])
    err = capfd.readouterr().err
    assert code == 1, err
    assert "No space left on device" in err and "failed on rank 1" in err, err  # rank 1's cause, on every rank
    _one_line_on_every_rank(err, "failed on rank 1: no space left on the device while writing")
    assert os.listdir(out) == []


def test_a_sigterm_while_the_torchrun_entry_point_imports_torch_stops_cleanly(tmp_path):
    """launch/train.py (what torchrun and run.sh start on every rank) catches SIGTERM from its first line (a stdlib
    handler while torch and transformers import): a signal during the imports ends the run with status 3, not
    -15. (``python -m cp_packing train`` imports the package, and torch with it, before any line of its own.)"""
    hook = tmp_path / "sitecustomize.py"  # runs before the entry point's imports: signal ourselves once they start
    hook.write_text("import os, signal, threading\n"
                    "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--nproc", "2", "--seq-len",
                           "32", "--layers", "1"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "SIGTERM before the first step" in proc.stdout


# checkpoint faults: one line, the same on every rank, naming the file (issue 26)

SMALL = ["--nproc", "2", "--seq-len", "32", "--layers", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A run's checkpoint after step 1 of 2 (copied by each test before it damages it)."""
    out = tmp_path_factory.mktemp("saved") / "out"
    assert train.main([*SMALL, "--steps", "2", "--save-every", "1", "--output-dir", str(out),
                       "--inject-fault", "sigterm@1"]) == train.EXIT_SIGTERM
    return str(out / "checkpoint-1")


def _copy(saved: str, tmp_path) -> str:
    import shutil

    return str(shutil.copytree(saved, tmp_path / "out" / "checkpoint-1"))


def _one_line_on_every_rank(err: str, message: str) -> None:
    """Each rank printed ``error on rank r of 2: <message...>`` once, the same text, and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("error on rank")]
    assert sorted(line.split(":", 1)[0] for line in lines) == ["error on rank 0 of 2", "error on rank 1 of 2"], err
    assert len({line.split(":", 1)[1] for line in lines}) == 1 and message in lines[0], err
    assert "Traceback" not in err and "Connection closed" not in err, err


@pytest.mark.parametrize("step, shown", [(-3, "-3"), ("four", "'four'"), (True, "True")])
def test_a_step_that_is_not_a_count_in_the_saved_state_is_refused_naming_the_file(saved, tmp_path, capfd, step,
                                                                                 shown):
    """``"step": -3`` trained 9 steps, ``"step": "four"`` was a TypeError traceback: both are one usage line."""
    path = _copy(saved, tmp_path)
    state_file = os.path.join(path, "trainer_state.json")
    with open(state_file) as f:
        state = json.load(f)
    with open(state_file, "w") as f:
        json.dump({**state, "step": step}, f)
    assert train.main([*SMALL, "--steps", "2", "--resume", path]) == 2
    err = capfd.readouterr().err
    assert f"{state_file}: 'step' is {shown}, not a count (an int >= 0)" in err and "Traceback" not in err, err


@pytest.mark.parametrize("damage, message", [
    ("truncate optimizer.pt", "optimizer.pt does not load"),
    ("garble optimizer.pt", "optimizer.pt does not load"),
    ("remove rng-rank1.pt", "rng-rank1.pt is missing: the checkpoint is incomplete"),
    ("truncate rng-rank1.pt", "rng-rank1.pt does not load"),
])
def test_a_damaged_checkpoint_file_is_one_line_on_every_rank_naming_it(saved, tmp_path, capfd, damage, message):
    """A corrupt optimizer.pt was a raw traceback on resume; a missing or truncated RNG file of rank 1 left rank 0 with
    gloo's "Connection closed". Now every rank exits 1 with the same line naming the file."""
    path = _copy(saved, tmp_path)
    action, name = damage.split()
    target = os.path.join(path, name)
    if action == "remove":
        os.remove(target)
    else:
        with open(target, "rb") as f:
            data = f.read()
        with open(target, "wb") as f:
            f.write(data[: len(data) // 2] if action == "truncate" else b"\0" * len(data))
    assert train.main([*SMALL, "--steps", "2", "--resume", path]) == 1
    _one_line_on_every_rank(capfd.readouterr().err, f"resuming from {path} failed")
    capfd.readouterr()


@pytest.mark.parametrize("fault", ["ENOSPC", "unexpected pos"])
def test_a_full_disk_is_named_with_the_directory_on_every_rank(tmp_path, monkeypatch, capfd, fault):
    """A full disk while rank 0 writes optimizer.pt (``OSError(ENOSPC)``, or torch's zip writer's "unexpected pos"):
    every rank exits 1 with one line that names the lack of space and the directory; no checkpoint is left."""
    import errno

    save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            if fault == "ENOSPC":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4544 vs 4432")
        return save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)  # the forked ranks inherit it
    out = tmp_path / "out"
    assert train.main([*SMALL, "--steps", "1", "--save-every", "1", "--output-dir", str(out)]) == 1
    err = capfd.readouterr().err
    _one_line_on_every_rank(err, f"failed on rank 0: no space left on the device while writing {out}")
    assert f"free space in {out} or pass another --output-dir" in err and os.listdir(out) == [], err


def test_a_sigterm_while_the_module_entry_point_imports_torch_stops_cleanly(tmp_path):
    """``python -m cp_packing train`` catches SIGTERM from the package's first line, before torch is imported (it
    was killed by the signal, -15, which a shell shows as 143: the status documented for "after writing a
    checkpoint"): a signal during the imports ends the run with status 3 and says so."""
    hook = tmp_path / "sitecustomize.py"  # runs before the package's imports: signal ourselves once they start
    hook.write_text("import os, signal, threading\n"
                    "threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-m", "cp_packing", "train", "--nproc", "2", "--seq-len", "32",
                           "--layers", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "SIGTERM before the first step" in proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigkilled_torchrun_leaves_a_checkpoint_when_the_ranks_host_the_store(tmp_path):
    """torchrun's agent hosts the c10d store by default: ``kill -9`` of torchrun takes it along, and the ranks die
    on their next store read (DistNetworkError, no checkpoint). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (what
    ``run.sh`` exports) rank 0 hosts it, so the ranks' watchdog stop (after their step) writes a checkpoint that
    ``--resume`` finds."""
    out = tmp_path / "out"
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            os.path.join(ROOT, "launch", "train.py"), "--steps", "100000", "--seq-len", "32", "--layers", "1",
            "--log-every", "1", "--save-timeout", "20", "--output-dir", str(out)]
    with _sigkilled_at_step_2(argv, env) as alive:
        assert not alive, "ranks still running after their launcher died"
        found = find_checkpoint(str(out))
        assert found is not None and os.path.basename(found).startswith("checkpoint-"), os.listdir(out)
        assert {"optimizer.pt", "rng-rank0.pt", "rng-rank1.pt", "trainer_state.json"} <= set(os.listdir(found))
