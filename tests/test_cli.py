"""``python -m cp_packing`` (cp_packing.__main__, tools.show, tools.report): the subcommands a pip user has, their
output, and one-line usage errors (exit 2, no traceback) for bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cp_packing.__main__ import main
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.testing import synthetic_doc_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*argv: str, capsys) -> tuple[int, str, str]:
    """Run ``python -m cp_packing ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_module_entry_point_lists_the_four_commands():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "cp_packing", "--help"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("verify", "train", "report", "show"):
        assert command in proc.stdout


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'cp-packing = "cp_packing.__main__:main"' in f.read()


def test_show_prints_a_small_map_token_by_token(capsys):
    code, out, _ = cli("show", "--doc-ids", "[[1,1,2,2,2,0]]", "--cp", "2", capsys=capsys)
    assert code == 0
    assert "cu_seqlens   [0, 2, 5, 6]" in out
    assert "token_index    [0, 1, 2]" in out and "token_index    [3, 4, 5]" in out


def test_show_summarises_a_large_map(tmp_path, capsys):
    doc_ids = synthetic_doc_ids("padded", 4, 1024, seed=3)
    path = str(tmp_path / "map.pt")
    torch.save(doc_ids, path)
    code, out, _ = cli("show", "--doc-ids", path, "--cp", "4", "--layout", "balanced", capsys=capsys)
    assert code == 0
    assert "token_index" not in out and len(out.splitlines()) < 20  # not one entry per token
    params = packed_seq_params_from_doc_ids(doc_ids)
    assert f"{params.num_segments:,} segments" in out
    assert f"max {params.max_seqlen}" in out
    rank_lines = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in "0123"]
    assert [int(r[0]) for r in rank_lines] == [0, 1, 2, 3]
    assert sum(int(r[1].replace(",", "")) for r in rank_lines) == doc_ids.numel()  # tokens per rank add up
    assert sum(int(r[2].replace(",", "")) for r in rank_lines) == int((doc_ids != 0).sum())  # real tokens too
    busiest = float(out.split("busiest / mean causal cost: ")[1].split()[0])
    assert 1.0 <= busiest < 1.1  # balanced


def _corrupt(tmp_path) -> str:
    path = tmp_path / "corrupt.pt"
    path.write_bytes(b"not a tensor file")
    return str(path)


def _not_a_tensor(tmp_path) -> str:
    path = str(tmp_path / "dict.pt")
    torch.save({"doc_ids": torch.ones(1, 4)}, path)
    return path


@pytest.mark.parametrize("command", ["show", "report"])
@pytest.mark.parametrize("make, message", [
    (_corrupt, "is not a readable tensor file"),
    (_not_a_tensor, "holds a dict, not a [B, S] tensor"),
    (lambda tmp_path: str(tmp_path / "missing.pt"), "does not exist"),
])
def test_a_bad_map_file_is_a_one_line_error(command, make, message, tmp_path, capsys):
    code, _, err = cli(command, "--doc-ids", make(tmp_path), "--cp", "2", capsys=capsys)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("command", ["show", "report"])
@pytest.mark.parametrize("cp", ["0", "-2", "two"])
def test_a_cp_size_below_1_is_a_usage_error(command, cp, capsys):
    code, _, err = cli(command, "--cp", cp, capsys=capsys)
    assert code == 2
    assert "argument --cp: must be an integer >= 1" in err and "Traceback" not in err


def test_report_prints_every_layout(capsys):
    code, out, _ = cli("report", "--synthetic", "lognormal", "--batch", "2", "--seqlen", "1024", "--cp", "4",
                       capsys=capsys)
    assert code == 0
    for layout in ("contiguous", "zigzag", "balanced"):
        assert layout in out


def test_report_prints_backend_bytes_for_the_heads(capsys):
    code, out, _ = cli("report", "--synthetic", "lognormal", "--batch", "2", "--seqlen", "1024", "--cp", "8",
                       "--heads", "32", "--kv-heads", "8", capsys=capsys)
    assert code == 0
    assert "T_local=256" in out
    # 256 tokens x 128 x 2 bytes = 64 KiB per head-slice: all-gather 16 x 7, Ulysses 80 x 7/8 of them
    assert out.splitlines()[-1].split() == ["32/8", "8", "7.0", "7.0", "4.4", "5.5", "ulysses"], out


def test_train_through_the_module_entry_point_lists_its_options_and_checks_them(capsys):
    """``python -m cp_packing train --help`` shows the model / data / output options; a --dry-run checks without
    training (exit 0), and a bad option is a one-line usage error (exit 2)."""
    code, out, _ = cli("train", "--help", capsys=capsys)
    assert code == 0
    for option in ("--model", "--data", "--output-dir", "--fsdp", "--dry-run"):
        assert option in out
    code, out, err = cli("train", "--nproc", "2", "--dry-run", "--seq-len", "64", capsys=capsys)
    assert code == 0 and "dry run" in out, err
    code, _, err = cli("train", "--nproc", "2", "--dry-run", "--data", "missing.jsonl", capsys=capsys)
    assert code == 2 and err.strip().count("\n") == 0 and "does not exist" in err, err


def test_report_png_names_the_file_it_writes_and_refuses_a_directory(tmp_path, capsys):
    """``--png DIR`` used to write DIR.png and say it wrote DIR; a directory, another suffix or a missing parent is
    now a one-line usage error before any work, and a .png name is written as given."""
    target = tmp_path / "charts"
    target.mkdir()
    for png, message in ((str(target), "is a directory; give a file name, e.g. --png"),
                         (str(tmp_path / "chart"), "does not end in .png"),
                         (str(tmp_path / "missing" / "chart.png"), "does not exist; create it first")):
        code, _, err = cli("report", "--cp", "2", "--batch", "1", "--seqlen", "64", "--png", png, capsys=capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == ["charts"] and not os.listdir(target)  # nothing written anywhere
    pytest.importorskip("matplotlib")
    path = target / "chart.png"
    code, out, _ = cli("report", "--cp", "2", "--batch", "1", "--seqlen", "64", "--png", str(path), capsys=capsys)
    assert code == 0 and f"wrote {path}" in out and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    (["report", "--cp", "2", "--heads", "3", "--kv-heads", "2"], "--heads 3 must be a multiple of --kv-heads 2"),
    (["report", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["show", "--doc-ids", "[]"], "--doc-ids '[]' is an empty map"),
    (["report", "--doc-ids", "[[]]"], "--doc-ids '[[]]' is an empty map"),
])
def test_obscure_bad_input_is_a_one_line_usage_error(argv, message, capsys):
    code, _, err = cli(*argv, capsys=capsys)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 or err.startswith("usage:"), err


@pytest.mark.parametrize("dtype", [">i4", ">i8", "<i2"])
def test_a_map_saved_in_another_byte_order_is_read(dtype, tmp_path, capsys):
    """A big-endian .npy map (numpy.save of a '>i4' array, as written on such machines or by astype) is read as the
    same numbers, not refused by torch.from_numpy."""
    import numpy as np

    path = str(tmp_path / "map.npy")
    np.save(path, np.array([[1, 1, 2, 2, 2, 0]], dtype=dtype))
    code, out, err = cli("show", "--doc-ids", path, "--cp", "2", capsys=capsys)
    assert code == 0, err
    assert "cu_seqlens   [0, 2, 5, 6]" in out
    from cp_packing.tools import load_doc_ids

    assert load_doc_ids(path).tolist() == [[1, 1, 2, 2, 2, 0]]


@pytest.mark.parametrize("module", ["cp_packing.tools", "cp_packing.tools.data", "cp_packing.tools.checkpoint"])
def test_tool_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0, result
