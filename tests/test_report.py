"""Balance report and plot (cp_packing.report), the synthetic maps they are shown on, the command line (show, report)
and the balance benchmark's smoke run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from cp_packing.__main__ import main
from cp_packing.report import balance_costs, balance_report, plot_balance
from cp_packing.testing import SYNTHETIC_KINDS, synthetic_doc_ids
from cp_packing.cost import layout_cost
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from tests.maps import segments_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ}
    )


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_synthetic_maps_are_seeded_and_shaped(kind):
    a = synthetic_doc_ids(kind, 3, 2048, seed=7)
    assert a.shape == (3, 2048) and a.dtype == torch.int64
    assert torch.equal(a, synthetic_doc_ids(kind, 3, 2048, seed=7))
    assert not torch.equal(a, synthetic_doc_ids(kind, 3, 2048, seed=8))
    assert bool((a[:, 0] == 1).all())  # ids restart at 1 in every row
    lengths = [b - s for s, b in segments_of(a)]
    if kind == "huge":
        assert max(lengths) >= 0.75 * 2048
    if kind == "padded":
        assert bool((a == 0).any())
    else:
        assert not bool((a == 0).any())


def test_synthetic_errors():
    with pytest.raises(ValueError, match="unknown synthetic kind 'zipf'"):
        synthetic_doc_ids("zipf")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        synthetic_doc_ids("short", 0, 16)


def test_report_lists_every_layout_with_the_cost_figures():
    doc_ids = synthetic_doc_ids("lognormal", 2, 4096, seed=1)
    text = balance_report(doc_ids, cp_size=4)
    costs = balance_costs(doc_ids, cp_size=4)
    assert list(costs) == ["contiguous", "rowzigzag", "zigzag", "balanced", "auto"]
    for name, c in costs.items():
        label = {"auto": f"auto -> {c.layout}", "zigzag": "zigzag (padded)"}.get(name, name)
        line = next(l for l in text.splitlines() if l.startswith(label))
        assert f"{c.imbalance:.4f}" in line and f"{c.busiest_over_ideal:.4f}" in line
    assert f"layout='auto' picks {costs['auto'].layout!r}" in text
    # the balanced figure is the cost module's
    assert costs["balanced"].rank_cost.tolist() == layout_cost(doc_ids, cp_size=4, layout="balanced").rank_cost.tolist()


def test_report_without_divisible_tokens_keeps_what_applies():
    doc_ids = torch.tensor([[1, 1, 2, 2, 2, 0]])
    text = balance_report(doc_ids, cp_size=4)
    assert "rowzigzag" in text and "zigzag (padded)" in text and "\nbalanced" not in text
    assert "is not divisible by cp_size=4" in text


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"cp-packing\[plot\]"):
        plot_balance(torch.tensor([[1, 1, 2, 2]]), cp_size=2, path=tmp_path / "x.png")


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the 'plot' extra) is not installed")
def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "balance.png"
    plot_balance(synthetic_doc_ids("huge", 2, 2048, seed=0), cp_size=4, path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_report_runs_in_a_subprocess():
    r = _run("-m", "cp_packing", "report", "--synthetic", "lognormal", "--cp", "4")
    assert r.returncode == 0, r.stderr
    assert "balanced" in r.stdout and "layout='auto' picks" in r.stdout


def test_cli_show_runs_in_a_subprocess():
    r = _run("-m", "cp_packing", "show")
    assert r.returncode == 0, r.stderr
    assert "cu_seqlens   [0, 2, 5, 6]" in r.stdout and "max_seqlen   3" in r.stdout
    assert "rank 1:" in r.stdout and "key_start      [2, 5]" in r.stdout


def test_cli_show_and_report_in_process(capsys, tmp_path):
    assert main(["show", "--doc-ids", "[[1,1,1,1,2,2,2,2]]", "--cp", "2", "--layout", "zigzag"]) == 0
    out = capsys.readouterr().out
    assert "rank 0:" in out and "token_index    [0, 3, 4, 7]" in out
    assert main(["show", "--cp", "3", "--layout", "balanced"]) == 0
    assert main(["show", "--layout", "auto"]) == 0
    assert "auto picked" in capsys.readouterr().out
    path = tmp_path / "map.pt"
    torch.save(synthetic_doc_ids("short", 2, 512, seed=0), path)
    assert main(["report", "--doc-ids", str(path), "--cp", "2", "--layouts", "contiguous,balanced"]) == 0
    out = capsys.readouterr().out
    assert "contiguous" in out and "balanced" in out and "rowzigzag" not in out


def test_cli_bad_input_exits_2_with_a_message(capsys):
    assert main(["show", "--layout", "zigzag"]) == 2  # the example's segments are not multiples of 4
    assert "pad_segments" in capsys.readouterr().err
    assert main(["show", "--doc-ids", "[[1, 1], [2"]) == 2
    assert "JSON" in capsys.readouterr().err
    assert main(["report", "--doc-ids", "missing.npy"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the 'plot' extra) is not installed")
def test_cli_png(tmp_path):
    path = tmp_path / "out.png"
    r = _run("-m", "cp_packing", "report", "--synthetic", "short", "--batch", "2", "--seqlen", "1024", "--cp", "2",
             "--png", str(path))
    assert r.returncode == 0, r.stderr
    assert path.exists() and path.stat().st_size > 0


def test_benchmark_quick_runs():
    r = _run(os.path.join("benchmarks", "bench_balance.py"), "--quick", timeout=600)
    assert r.returncode == 0, r.stderr
    assert "worst balanced busiest/mean" in r.stdout and "planning time" in r.stdout


def test_balanced_report_matches_the_shards():
    """The report's balanced tokens per rank are the shards' (what a trainer would get)."""
    from cp_packing.sharding import shard_packed_seq_params

    params = packed_seq_params_from_doc_ids(synthetic_doc_ids("padded", 2, 2048, seed=4))
    c = balance_costs(params, cp_size=4, layouts=("balanced",))["balanced"]
    assert c.tokens_per_rank.tolist() == [
        shard_packed_seq_params(params, cp_size=4, cp_rank=r, layout="balanced").num_local_tokens for r in range(4)
    ]


def test_plot_balance_options_are_keyword_only(tmp_path):
    with pytest.raises(TypeError):
        plot_balance(torch.tensor([[1, 1, 2, 2]]), 2, tmp_path / "x.png")  # noqa: the positional form is gone


def test_docstring_examples_run():
    import doctest

    import cp_packing.report

    result = doctest.testmod(cp_packing.report, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted > 0


def test_backend_bytes_table_rows_and_picks():
    from cp_packing.report import backend_bytes_table

    table = backend_bytes_table(T_local=4096, cp_size=(2, 4, 8), num_heads=(32, 12), num_kv_heads=(8, 4))
    rows = [line.split() for line in table.splitlines()[2:]]
    assert len(rows) == 6
    assert rows[0] == ["32/8", "2", "16.0", "16.0", "40.0", "40.0", "allgather"]
    assert rows[1] == ["32/8", "4", "48.0", "48.0", "60.0", "56.0", "allgather"]
    assert rows[2] == ["32/8", "8", "112.0", "112.0", "70.0", "88.0", "ulysses"]
    assert rows[5][:2] == ["12/4", "8"] and rows[5][4] == "-" and rows[5][6] == "allgather"  # 8 does not divide 12
    with pytest.raises(ValueError, match="same length"):
        backend_bytes_table(T_local=1, cp_size=2, num_heads=(32, 64), num_kv_heads=8)


def test_the_bytes_table_in_the_docs_is_current():
    from cp_packing.report import backend_bytes_table

    table = backend_bytes_table(T_local=4096, cp_size=(2, 4, 8), num_heads=(32, 32, 64), num_kv_heads=(8, 32, 8))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert table in open(os.path.join(root, "docs", "attention.md")).read(), "docs/attention.md: regenerate the table"


def test_report_under_a_window_shows_the_windowed_figures(capsys):
    """balance_report(window=) and ``report --window``: the table names the window and every figure is the windowed
    layout_cost, balanced planned for the window."""
    doc_ids = synthetic_doc_ids("lognormal", 2, 4096, seed=0)
    text = balance_report(doc_ids, cp_size=8, window=64)
    assert text.splitlines()[0].startswith("costs under window=64")
    for name in ("contiguous", "balanced"):
        windowed = layout_cost(doc_ids, cp_size=8, layout=name, window=64).imbalance
        line = next(row for row in text.splitlines() if row.startswith(name))
        assert float(line.split()[1]) == round(windowed, 4)
        assert round(windowed, 4) != round(layout_cost(doc_ids, cp_size=8, layout=name).imbalance, 4)
    assert balance_report(doc_ids, cp_size=8, window=[64, None, 64]).splitlines()[0].startswith(
        "costs under window=[64 x 2, None x 1]")
    assert main(["report", "--batch", "2", "--seqlen", "4096", "--cp", "8", "--window", "64"]) == 0
    assert text in capsys.readouterr().out
    assert main(["report", "--cp", "2", "--window", "64,none,64"]) == 0
    assert "costs under window=[64 x 2, None x 1]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["report", "--window", "0"])
    assert "every window must be >= 1" in capsys.readouterr().err


def _same_cost(got, ref) -> None:
    for field in ("rank_cost", "tokens_per_rank", "runs_per_rank", "kv_bytes_allgather"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), (field, getattr(got, field), getattr(ref, field))
    for field in ("layout", "cp_size", "imbalance", "ideal_cost", "padding_overhead", "kv_bytes_ring"):
        assert getattr(got, field) == getattr(ref, field), field


@pytest.mark.parametrize("exact_ints", [False, True], ids=["int64", "python-ints"])
def test_the_report_prices_rowzigzag_in_closed_form_with_the_cost_modules_figures(exact_ints, monkeypatch):
    """The report's row-zigzag column (closed form over the segments, O(segments)) gives exactly the figures of
    cost.layout_cost's range-by-range pricing (O(rows x cp)), on maps with rows shorter and longer than 2cp, padding,
    a huge document, windows and per-layer windows; also on the exact-Python-int path taken near int64's limit."""
    import numpy as np

    import cp_packing.cost as cost
    import cp_packing.report as report

    if exact_ints:
        monkeypatch.setattr(report, "_INT64_SAFE", 0)
    def no_row_ranges(cu, cp, rows):
        raise AssertionError("the report built the B x 2cp row-zigzag ranges (O(rows x cp) memory)")

    for seed in range(12 if exact_ints else 40):
        rng = np.random.default_rng(seed)
        B, S = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        doc_ids = synthetic_doc_ids(SYNTHETIC_KINDS[seed % len(SYNTHETIC_KINDS)], B, S, seed=seed,
                                    median=float(rng.integers(1, 12)))
        params = packed_seq_params_from_doc_ids(doc_ids)
        for cp in (1, 2, 3, 7, 16):
            for window in (None, 1, 3, [2, None, 5]):
                ref = layout_cost(params, cp_size=cp, layout="rowzigzag", window=window)
                with monkeypatch.context() as patch:
                    patch.setattr(cost, "_rowzigzag_ranges", no_row_ranges)
                    got = balance_costs(params, cp_size=cp, layouts="rowzigzag", window=window)["rowzigzag"]
                _same_cost(got, ref)


def test_balance_report_and_costs_check_their_inputs():
    doc_ids = torch.tensor([[1, 1, 2, 2]])
    for bad, error in ((0, ValueError), ("2", TypeError), (None, TypeError), (2.0, TypeError)):
        for fn in (balance_costs, balance_report):
            with pytest.raises(error, match="cp_size"):
                fn(doc_ids, cp_size=bad)
    assert list(balance_costs(doc_ids, cp_size=2, layouts="contiguous")) == ["contiguous"]  # one name, one layout
    assert "contiguous" in balance_report(doc_ids, cp_size=2, layouts="contiguous")
    with pytest.raises(ValueError, match="unknown layout 'zigzg'.*choose among contiguous, rowzigzag"):
        balance_costs(doc_ids, cp_size=2, layouts=("contiguous", "zigzg"))
    with pytest.raises(TypeError, match="layouts must be a layout name or a non-empty list"):
        balance_report(doc_ids, cp_size=2, layouts=[])
    with pytest.raises(TypeError, match="doc_ids must be a"):
        balance_costs([[1, 1, 2, 2]], cp_size=2)
    import dataclasses

    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1], [1, 1]]))
    merged = dataclasses.replace(params, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), max_seqlen=4)
    with pytest.raises(ValueError, match="no boundary at the start of row 1"):
        balance_costs(merged, cp_size=2, layouts="rowzigzag")  # a segment across rows: refused, not mispriced
