"""cp_packing.tools.verify (``python -m cp_packing verify``, ``launch/verify.py``), the cluster correctness check,
run the way CI can: ``--nproc N`` (a gloo group on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.tools import verify as V

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERIFY = os.path.join(ROOT, "launch", "verify.py")


def run_verify(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, VERIFY, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def table_rows(stdout: str) -> dict[tuple[str, str, str], str]:
    """(layout, backend, kernel) -> result column, for the rows that ran."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 7 and parts[0] in V.LAYOUTS and parts[6] in ("PASS", "FAIL"):
            rows[tuple(parts[:3])] = parts[6]
    return rows


@pytest.mark.distributed
def test_verify_passes_on_a_correct_build():
    proc = run_verify("--nproc", "2", "--trials", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    for layout in ("contiguous", "zigzag", "balanced", "local"):
        for backend in ("allgather", "exchange", "ulysses"):  # every backend auto picks among, every layout
            assert rows.get((layout, backend, "torch")) == "PASS", proc.stdout
    assert "FAIL" not in set(rows.values())
    assert "\n0 FAIL, " in proc.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 3])
def test_verify_fails_on_wrong_metadata_in_every_layout(nproc, capfd):
    """A deliberately wrong key_start (hidden --inject-fault) turns EVERY layout's row into FAIL and the exit
    code non-zero: the verifier can fail (the contiguous row used to pass at cp=2, its shards being whole rows)."""
    code = V.main(["--nproc", str(nproc), "--trials", "1", "--backends", "allgather", "--inject-fault"])
    out = capfd.readouterr().out
    assert code == 1, out
    rows = table_rows(out)
    for layout in ("contiguous", "zigzag", "balanced", "local"):
        assert rows[(layout, "allgather", "torch")] == "FAIL", out


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_trial_maps_split_documents_across_ranks_in_every_layout(cp, batch):
    """Why the fault is caught: in every layout some rank holds a run whose keys start on another rank's tokens
    (a run that does not begin at its segment's start), so wrong key metadata changes that rank's output."""
    for layout in ("contiguous", "zigzag", "balanced"):
        doc_ids = V.trial_doc_ids(layout, cp, batch, 16 * cp, seed=batch)
        params = packed_seq_params_from_doc_ids(doc_ids)
        split = False
        for rank in range(cp):
            s = shard_packed_seq_params(params, cp_size=cp, cp_rank=rank, layout=layout)
            first = s.token_index[s.cu_seqlens[:-1].long()]
            split |= bool((s.key_start < first).any())
        assert split, (layout, cp, batch)
        assert V.splits_a_document(doc_ids, cp, layout)


@pytest.mark.parametrize("argv, message", [
    (["--heads", "3", "--kv-heads", "2"], "--heads 3 must be a multiple of --kv-heads 2"),
    (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
    (["--head-dim", "0"], "--head-dim must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--trials", "0"], "--trials must be >= 1, got 0"),
    (["--heads", "-4"], "--heads must be >= 1, got -4"),
])
def test_verify_refuses_sizes_that_test_nothing(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        V.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_verify_rejects_bad_arguments_as_a_script():
    proc = run_verify("--seq-len", "0")
    assert proc.returncode == 2
    assert "--seq-len must be >= 1, got 0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_fault_injection_on_one_rank_is_a_usage_error(capfd):
    """With one rank every document is whole: --inject-fault could not fail, so it is refused (exit 2)."""
    code = V.main(["--nproc", "1", "--inject-fault", "--trials", "1"])
    assert code == 2
    assert "--inject-fault needs at least 2 ranks" in capfd.readouterr().err


def _nan_in_output(orig):
    def attention(*args, **kwargs):
        out = orig(*args, **kwargs)
        return out * torch.where(torch.arange(out.shape[0]) == 1, float("nan"), 1.0)[:, None, None]
    return attention


def _nan_in_gradients(orig):
    def attention(*args, **kwargs):
        out = orig(*args, **kwargs)
        out.register_hook(lambda g: g * torch.where(torch.arange(g.shape[0]) == 1, float("nan"), 1.0)[:, None, None])
        return out
    return attention


@pytest.mark.distributed
@pytest.mark.parametrize("fault", [_nan_in_output, _nan_in_gradients], ids=["output", "gradients"])
def test_verify_fails_on_nan(monkeypatch, capfd, fault):
    """A NaN in the CP output or in one gradient is a FAIL with a non-zero exit, never a PASS (max(0, nan) == 0)."""
    monkeypatch.setattr(V, "context_parallel_attention", fault(V.context_parallel_attention))
    code = V.main(["--nproc", "1", "--layouts", "contiguous", "--backends", "allgather", "--dtype", "float32",
                   "--trials", "1", "--seq-len", "32"])
    out = capfd.readouterr().out
    assert code == 1, out
    assert table_rows(out)[("contiguous", "allgather", "torch")] == "FAIL", out
    assert "PASS" not in table_rows(out).values(), out


def test_verify_skips_what_the_real_flash_attn_refuses(ring_flash_attn, monkeypatch):
    """On a CUDA box with the real flash-attn (fp16/bf16 only), the default dtypes (bf16 + float32) plan the
    ring/contiguous/float32 row as SKIP with the reason, not as a row that would FAIL inside flash-attn."""
    import flash_attn

    monkeypatch.setattr(flash_attn, "IS_CP_PACKING_STUB", False)  # pretend: the real flash-attn
    rows = V.plan_rows(["contiguous", "zigzag"], ["ring_flash_attn"], [torch.bfloat16, torch.float32],
                       torch.device("cuda"))
    skips = {(r.layout, r.dtype): r.skip for r in rows}
    assert skips[("contiguous", torch.bfloat16)] is None and skips[("zigzag", torch.bfloat16)] is None
    assert "torch.float16 / torch.bfloat16 only" in skips[("contiguous", torch.float32)]
    assert skips[("zigzag", torch.float32)] is not None
    monkeypatch.setattr(flash_attn, "IS_CP_PACKING_STUB", True)  # the test stand-in runs float32 contiguous
    rows = V.plan_rows(["contiguous"], ["ring_flash_attn"], [torch.float32], torch.device("cpu"))
    assert rows[0].skip is None


def test_verify_skips_ulysses_when_cp_does_not_divide_the_heads():
    rows = V.plan_rows(["contiguous"], ["ulysses"], [torch.float32], torch.device("cpu"), cp_size=3, heads=4)
    torch_row = next(r for r in rows if r.kernel == "torch")
    assert "cp_size=3 to divide --heads 4" in torch_row.skip
    rows = V.plan_rows(["contiguous"], ["ulysses"], [torch.float32], torch.device("cpu"), cp_size=2, heads=4)
    assert next(r for r in rows if r.kernel == "torch").skip is None


@pytest.mark.distributed
def test_verify_runs_hybrid_and_the_exchange_at_cp_4(capfd):
    """Hybrid needs cp >= 4 (Ulysses inside groups of 2, the all-gather across them): at 4 ranks its rows and the
    exchange's run and pass in every layout."""
    code = V.main(["--nproc", "4", "--trials", "1", "--backends", "exchange", "hybrid"])
    out = capfd.readouterr().out
    assert code == 0, out
    rows = table_rows(out)
    for layout in V.LAYOUTS:
        for backend in ("exchange", "hybrid"):
            assert rows.get((layout, backend, "torch")) == "PASS", out


def test_verify_runs_hybrid_where_a_ulysses_size_fits():
    assert [V.hybrid_size(cp, 4) for cp in (1, 2, 3, 4, 6, 8)] == [None, None, None, 2, 2, 2]
    assert V.hybrid_size(6, 3) == 3 and V.hybrid_size(8, 1) is None
    rows = V.plan_rows(["local"], ["hybrid"], [torch.float32], torch.device("cpu"), cp_size=2, heads=4)
    assert "hybrid needs a ulysses_size in 2..cp-1" in next(r for r in rows if r.kernel == "torch").skip
