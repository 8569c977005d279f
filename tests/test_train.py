"""cp_packing.tools.train (``python -m cp_packing train``, ``launch/train.py``) and cp_packing.tools.data: trains a
saved local model on local jsonl (text) and parquet (token ids, FSDP2) data and saves a model that loads and has
learned; its --check-parity passes and catches a broken gradient reduction; SIGTERM saves; every usage error exits 2
before the first step, printed once; help once; no option collides with torchrun's; --layout auto keeps to the
layouts of the attention backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import argparse
import json
import shutil

import pytest
import torch

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
def test_parity_check_fails_without_the_cp_gradient_reduction(capfd):
    """--check-parity is not a rubber stamp: a trainer that skips the CP all-reduce of gradients exits 1 with FAIL."""
    code = train.main(["--nproc", "2", "--steps", "1", "--check-parity", "--layout", "zigzag", "--seq-len", "32",
                       "--inject-fault", "grad-reduction"])
    out = capfd.readouterr().out
    assert code == 1, out
    assert "FAIL" in out and "MISMATCH" in out, out


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
        assert ("argument --steps: must be an integer >= 1" in capsys.readouterr().err) is printed


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
    code = train.main(["--nproc", "2", "--steps", "1", "--seq-len", "32", "--layers", "1", "--no-chunked-loss"])
    err = capfd.readouterr().err
    assert code == 1, err
    assert "rank 1" in err and "ValueError: label 300 at local position 5 is outside [0, 256)" in err, err
    assert "Traceback" in err, err


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


# ------------------------------------------------------------------------------------- local model, local data


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A saved tiny Llama + word-level tokenizer (launch/tiny_checkpoint.py), a jsonl of text and a parquet of token
    ids with prompt-masked labels: everything on disk, nothing downloaded."""
    from launch.tiny_checkpoint import write_model, write_text_jsonl, write_tokenizer

    d = tmp_path_factory.mktemp("local")
    model = d / "model"
    write_model(str(model))
    write_tokenizer(str(model))
    write_text_jsonl(str(d / "text.jsonl"), documents=40)
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(24):
        n = int(torch.randint(3, 40, (1,), generator=g))
        ids = torch.randint(3, 64, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})  # a masked "prompt"
    pq.write_table(pa.Table.from_pylist(rows), str(d / "ids.parquet"))
    return {"model": str(model), "text": str(d / "text.jsonl"), "ids": str(d / "ids.parquet"), "dir": d}


def assert_trained(out_dir: str, in_dir: str) -> None:
    """The saved model loads with from_pretrained (a fresh class, default attention) and every weight moved."""
    from transformers import AutoModelForCausalLM

    after = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True).state_dict()
    before = AutoModelForCausalLM.from_pretrained(in_dir, local_files_only=True).state_dict()
    assert after.keys() == before.keys()
    for name, w in before.items():
        assert after[name].shape == w.shape and torch.isfinite(after[name]).all(), name
        assert not torch.equal(after[name].float(), w.float()), f"{name} did not change"


def _step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step ")]


@not_under_torchrun
@pytest.mark.distributed
def test_trains_a_saved_local_model_on_a_local_jsonl(local, tmp_path):
    """The documented command (launch/train.py as a user runs it): text tokenized with the model directory's
    tokenizer, 2 ranks, parity PASS, a plain progress line per step, the trained model and tokenizer saved."""
    out = tmp_path / "trained"
    proc = subprocess.run(
        [sys.executable, TRAIN, "--nproc", "2", "--model", local["model"], "--data", local["text"], "--seq-len", "64",
         "--steps", "3", "--log-every", "1", "--check-parity", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "PASS" in proc.stdout and "FAIL" not in proc.stdout, text
    assert "from 'text'" in proc.stdout, text  # the documents came from the text column
    assert "\r" not in proc.stdout and "it/s" not in text, text  # plain lines, no tqdm bar (a log file reads the same)
    lines = _step_lines(proc.stdout)
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], text
    for line in lines:
        assert 0.0 < float(line.split(" loss ")[1].split()[0]) < 10.0, line  # ln(64) = 4.2 at init
        assert float(line.split(" time ")[1].split()[0].replace(",", "")) > 0, line
        assert float(line.split(" tok/s ")[1].split()[0].replace(",", "")) > 0, line
        assert float(line.split(" imbalance ")[1].split()[0]) >= 1.0, line
        assert float(line.split(" peak mem ")[1].split()[0].replace(",", "")) > 10, line  # MiB
    assert_trained(str(out), local["model"])
    from transformers import AutoTokenizer

    saved, original = (AutoTokenizer.from_pretrained(p, local_files_only=True) for p in (out, local["model"]))
    assert saved("w1 w7 w60")["input_ids"] == original("w1 w7 w60")["input_ids"]


@not_under_torchrun
@pytest.mark.distributed
def test_trains_on_parquet_token_ids_with_fsdp2(local, tmp_path, capfd):
    """Token ids with prompt-masked labels from parquet, FSDP2 over the 2 ranks (the full state dict gathered to
    rank 0 for save_pretrained): parity with the non-CP model holds, and the saved model has moved."""
    out = tmp_path / "trained"
    code = train.main(["--nproc", "2", "--model", local["model"], "--data", local["ids"], "--seq-len", "32",
                       "--steps", "2", "--fsdp", "--check-parity", "--output-dir", str(out)])
    text = "".join(capfd.readouterr())
    assert code == 0, text
    assert "fsdp=on" in text and "from 'input_ids'" in text and "PASS" in text, text
    assert "loss=chunked" in text, text  # the default: the loss never built the logits, and parity holds
    assert_trained(str(out), local["model"])


@not_under_torchrun
@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_finishes_the_step_checkpoints_exits_143_and_resumes_under_fsdp2(local, tmp_path):
    """A scheduler's SIGTERM to the ranks mid-run (FSDP2): they stop after the same step, the full state is gathered
    into a checkpoint that loads with from_pretrained (model and tokenizer), and --resume continues it under FSDP2."""
    out = tmp_path / "trained"
    common = ["--nproc", "2", "--model", local["model"], "--data", local["text"], "--seq-len", "64", "--fsdp",
              "--log-every", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cp_packing", "train", *common, "--steps", "100000", "--output-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT, start_new_session=True,
    )
    lines: list[str] = []
    try:
        while not any(line.startswith("step    2/") for line in lines):  # past the first step
            line = proc.stdout.readline()
            assert line, "".join(lines)  # the run ended before the signal
            lines.append(line)
        ranks = _children(proc.pid)
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    text = "".join(lines) + rest
    assert proc.returncode == train.EXIT_SIGTERM == 143, text
    assert "SIGTERM: stopped after step" in text and "Traceback" not in text, text
    step = int(text.split("SIGTERM: stopped after step ")[1].split()[0])
    checkpoint = out / f"checkpoint-{step}"
    assert f"saved checkpoint {checkpoint}" in text, text
    assert_trained(str(checkpoint), local["model"])
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(checkpoint, local_files_only=True)("w1 w2")["input_ids"]
    assert train.main([*common, "--steps", str(step + 1), "--resume", str(out)]) == 0
    assert_trained(str(out), local["model"])


# ------------------------------------------------------------------------------------------------ usage errors


def _jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_every_usage_error_exits_2_before_training_printed_once_under_torchrun(local, tmp_path, monkeypatch,
                                                                                capsys):
    """Under torchrun (its environment, world 2): each mistake is one line on rank 0, none on rank 1, exit 2 on
    both, before any process group or step (model, data, columns, sizes against the world; with --dry-run also the
    device checks: kernel, backend)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(open(os.path.join(local["model"], "config.json")).read())
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    corrupt = tmp_path / "corrupt_weights"
    corrupt.mkdir()
    for name in os.listdir(local["model"]):
        data = open(os.path.join(local["model"], name), "rb").read()
        (corrupt / name).write_bytes(data[: len(data) // 2] if name == "model.safetensors" else data)  # truncated
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"text": "w1 caf\u00e9"}\n'.encode("latin-1"))
    earlier = tmp_path / "earlier"  # an --output-dir holding a checkpoint of another run
    (earlier / "checkpoint-3").mkdir(parents=True)
    (earlier / "checkpoint-3" / "trainer_state.json").write_text('{"step": 3}')
    other = tmp_path / "other_run" / "checkpoint-2"  # a checkpoint of a run with other options
    shutil.copytree(local["model"], other)
    (other / "trainer_state.json").write_text(json.dumps({"step": 2, "model": local["model"], "batch": 9}))
    m = ["--model", local["model"]]
    cases = [
        (["--model", str(tmp_path / "missing")], "is neither a preset (llama, qwen3) nor a local directory"),
        (["--model", str(empty)], "no config.json"),
        (["--model", str(no_weights)], "no weights"),
        ([*m, "--hidden", "64"], "--hidden size a preset model"),
        ([*m, "--seq-len", "2048"], "exceeds the model's max_position_embeddings 1024"),
        ([*m, "--data", str(tmp_path / "missing.jsonl")], "does not exist"),
        ([*m, "--data", str(a_file)], "unknown format"),
        ([*m, "--data", _jsonl(tmp_path / "cols.jsonl", [{"body": "w1"}])], "rows need a 'text' column"),
        ([*m, "--data", _jsonl(tmp_path / "big.jsonl", [{"input_ids": [1, 64]}])], "outside the model's vocabulary"),
        ([*m, "--data", _jsonl(tmp_path / "lab.jsonl", [{"input_ids": [1, 2], "labels": [2]}])], "must match"),
        ([*m, "--data", _jsonl(tmp_path / "lab2.jsonl", [{"input_ids": [1, 2], "labels": [1, 5]}])],
         "labels[1] = 5 is neither -100 nor input_ids[1] = 2"),
        ([*m, "--data", _jsonl(tmp_path / "few.jsonl", [{"input_ids": [1, 2]}]), "--batch", "4"],
         "does not fill one step"),
        (["--data", local["text"]], "there is no tokenizer"),  # a preset has none
        (["--seq-len", "33", "--batch", "1"], "not a multiple of cp=2"),
        (["--cp", "3"], "--cp 3 does not divide the world size 2"),
        (["--nproc", "2"], "--nproc is for runs without torchrun"),
        (["--output-dir", str(a_file)], "is a file"),
        (["--dry-run", "--output-dir", str(a_file / "out")], f"--output-dir {str(a_file / 'out')!r} is not writable"),
        (["--dry-run", "--output-dir", "/proc/cp-packing-out"], "is not writable"),  # root passes os.access here
        (["--dry-run", "--model", str(corrupt)], "the weights file model.safetensors does not load"),
        ([*m, "--data", str(latin1)], f"--data {str(latin1)!r} line 1 is not UTF-8"),
        ([*m, "--eval-data", str(latin1)], f"--eval-data {str(latin1)!r} line 1 is not UTF-8"),
        (["--output-dir", str(earlier)], "holds checkpoint-3 of an earlier run"),
        (["--resume", str(tmp_path / "none")], "is not a directory"),
        (["--resume", str(empty)], "holds no complete checkpoint"),
        ([*m, "--resume", str(other.parent)], "batch=9 (now 2)"),
        ([*m, "--resume", str(other), "--check-parity"], "--check-parity trains a reference model"),
        (["--lr-scheduler", "constant", "--warmup-steps", "2"], "use --lr-scheduler constant_with_warmup"),
        (["--dry-run", "--kernel", "torch_varlen"], "--kernel torch_varlen is not available on cpu"),
        (["--dry-run", "--attn-backend", "ulysses", "--heads", "3", "--kv-heads", "1", "--hidden", "48"],
         "does not divide the 3 query heads"),
    ]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv, message in cases:
        for rank in ("0", "1"):
            monkeypatch.setenv("RANK", rank)
            assert train.main(argv) == 2, argv
            out, err = capsys.readouterr()
            if rank == "0":
                assert err.count("error: ") == 1 and message in err and "Traceback" not in err, (argv, err)
            else:
                assert err == "", (argv, err)
    monkeypatch.setenv("RANK", "0")
    assert train.main([*m, "--data", local["text"], "--seq-len", "64", "--dry-run"]) == 0
    assert "dry run" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got 'inf'"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--doc-len-sigma", "nan"], "argument --doc-len-sigma: must be a finite number >= 0, got 'nan'"),
    (["--doc-len-sigma", "-1"], "argument --doc-len-sigma: must be a finite number >= 0, got '-1'"),
    (["--mean-doc-len", "inf"], "argument --mean-doc-len: must be a finite number > 0"),
    (["--max-grad-norm", "0"], "argument --max-grad-norm: must be a finite number > 0"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["--grad-accum", "0"], "argument --grad-accum: must be an integer >= 1"),
    (["--lr-scheduler", "cosine_with_min_lr"], "argument --lr-scheduler: invalid choice"),
])
def test_a_bad_number_is_a_one_line_usage_error_naming_the_option(argv, message, capsys):
    """inf / nan / out-of-range values are refused by the parser, naming the option (not accepted, not a
    traceback later)."""
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err


def test_no_option_collides_with_torchrun_and_no_abbreviation_is_accepted(capsys):
    from torch.distributed.run import get_args_parser

    ours = {s for a in train.build_parser()._actions for s in a.option_strings}
    theirs = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert ours & theirs == {"-h", "--help"}
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--seq", "64"])  # not silently --seq-len
    assert exc.value.code == 2


# ------------------------------------------------------------------------------------ layouts per backend


def test_auto_keeps_to_the_layouts_of_the_backend(ring_flash_attn):
    """allgather runs every layout; ring-flash-attn zigzag and contiguous (float32: contiguous only, its float32
    zigzag backward is wrong upstream), and never balanced, which made `auto` crash in the first forward."""
    from cp_packing.layouts import LAYOUTS

    heads = (4, 2, 8)
    cpu = torch.device("cpu")
    assert train.backend_layouts("allgather", "auto", 2, cpu, torch.float32, heads) == LAYOUTS
    assert train.backend_layouts("ring_flash_attn", "auto", 2, cpu, torch.bfloat16, heads) == ("contiguous", "zigzag")
    assert train.backend_layouts("ring_flash_attn", "auto", 2, cpu, torch.float32, heads) == ("contiguous",)
    with pytest.raises(train.UsageError, match="runs flash-attn kernels only"):
        train.backend_layouts("ring_flash_attn", "torch", 2, cpu, torch.bfloat16, heads)

    args = argparse.Namespace(layout="auto", layouts=("contiguous", "zigzag"))
    one_doc = torch.ones(1, 128, dtype=torch.int32)  # contiguous: rank 1 holds the costly end of the document
    ids = torch.arange(128).view(1, 128) % 64
    batch = {"doc_ids": one_doc, "input_ids": ids, "labels": ids}
    laid, layout = train.lay_out(batch, args, cp=2)
    assert layout == "zigzag" and laid["doc_ids"].shape == (1, 128)
    tiny_docs = torch.arange(1, 129, dtype=torch.int32).view(1, 128)  # one-token documents: zigzag pads each to 4
    laid, layout = train.lay_out({**batch, "doc_ids": tiny_docs}, args, cp=2)
    assert layout == "contiguous" and torch.equal(laid["input_ids"], ids)
    laid, layout = train.lay_out({**batch, "doc_ids": tiny_docs}, argparse.Namespace(layout="zigzag"), cp=2)
    assert laid["doc_ids"].shape[1] == 4 * 128 and int(laid["real"].sum()) == 128  # padded; pads are not real
    assert int((laid["labels"] != -100).sum()) <= 128


# ------------------------------------------------------------------------------------------------ data files


def test_load_documents_reads_text_ids_and_labels(local, tmp_path):
    from transformers import AutoTokenizer

    from cp_packing.tools.data import load_documents

    tok = AutoTokenizer.from_pretrained(local["model"], local_files_only=True)
    path = _jsonl(tmp_path / "t.jsonl", [{"text": "w1 w2"}, {"text": ""}, {"text": "w3 bogus"}])
    docs = load_documents(path, tokenizer=tok, vocab_size=64)
    w = {t: tok.convert_tokens_to_ids(t) for t in ("w1", "w2", "w3", "[UNK]")}
    assert docs.documents == [[w["w1"], w["w2"], tok.eos_token_id], [w["w3"], w["[UNK]"], tok.eos_token_id]]
    assert docs.skipped == 1 and docs.tokens == 6 and docs.column == "text"
    parquet = load_documents(local["ids"], vocab_size=64)
    assert parquet.column == "input_ids" and len(parquet.documents) == 24
    first = parquet.documents[0]
    assert first["labels"][len(first["input_ids"]) // 3:] == first["input_ids"][len(first["input_ids"]) // 3:]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1]}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_documents(str(bad))


# ------------------------------------------------------------------------------------------ training options, eval


def _lines(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


@not_under_torchrun
@pytest.mark.distributed
@pytest.mark.parametrize("cp, loss", [("2", "chunked"), ("1", "logits")], ids=["cp2", "dp2-logits"])
def test_accumulation_clipping_and_schedule_keep_parity_and_follow_transformers(cp, loss, capfd):
    """--grad-accum 2 (each micro-batch over the step's global count), --max-grad-norm (the global norm, after the
    CP / DP sums: a rank clipping its own partial gradient would break parity from step 2), a linear warmup
    schedule: the gradients equal those of one process on the union of every micro-batch of every replica for 3
    steps, and the learning rate of each step is transformers.get_scheduler's. cp 2 with the chunked loss (the
    default), dp 2 with the loss on the logits (--no-chunked-loss)."""
    from transformers import get_scheduler

    code = train.main(["--nproc", "2", "--cp", cp, "--steps", "3", "--seq-len", "32", "--layers", "1",
                       "--log-every", "1", "--grad-accum", "2", "--max-grad-norm", "0.05", "--lr-scheduler", "linear",
                       "--warmup-steps", "1", "--lr", "0.01", "--check-parity", "--parity-steps", "3"]
                      + (["--no-chunked-loss"] if loss == "logits" else []))
    out = capfd.readouterr().out
    assert code == 0 and "PASS" in out, out
    assert f"loss={loss}" in out, out
    assert len(_lines(out, "parity step ")) == 3 and "MISMATCH" not in out, out
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched = get_scheduler("linear", opt, num_warmup_steps=1, num_training_steps=3)
    want = []
    for _ in range(3):
        want.append(f"{opt.param_groups[0]['lr']:.3g}")
        opt.step()
        sched.step()
    lines = _lines(out, "step ")
    assert [line.split(" lr ")[1].split()[0] for line in lines] == want, out
    assert all(float(line.split(" grad norm ")[1].split()[0]) > 0.05 for line in lines), out  # clipping was active
    assert "batch=2x32x2" in out, out


@not_under_torchrun
@pytest.mark.distributed
@pytest.mark.parametrize("source", ["synthetic", "file"])
def test_the_eval_loss_under_cp_equals_the_loss_of_one_process(source, local, tmp_path, capfd):
    """--eval-every at cp 2 (no grad, eval mode): the printed eval loss equals the loss of the saved model on the
    same eval batches in one process without CP (HF sdpa, block-diagonal mask), on a synthetic eval stream and on
    --eval-data."""
    from transformers import AutoModelForCausalLM

    from cp_packing.tools.data import eval_batches

    out = tmp_path / "out"
    argv = ["--nproc", "2", "--steps", "2", "--seq-len", "32", "--eval-every", "2", "--eval-steps", "3",
            "--output-dir", str(out)]
    argv += ["--model", local["model"], "--eval-data", local["text"]] if source == "file" else ["--layers", "1"]
    assert train.main(argv) == 0
    text = capfd.readouterr().out
    evals = _lines(text, "eval after step 2: loss ")
    assert len(evals) == 1, text
    cp_loss = float(evals[0].split(" loss ")[1].split()[0])
    args = train.parse_args(argv)
    setup = train.prepare(args, 2)
    batches = [b for step in eval_batches(args, setup.eval_data, 1) for b in step]
    assert len(batches) == 3
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ref = float(train.reference_loss(model, batches))
    assert abs(cp_loss - ref) <= 1e-5 * max(1.0, abs(ref)) + 1e-6, (cp_loss, ref)
