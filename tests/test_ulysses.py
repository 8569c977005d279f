"""The Ulysses backend (``backend="ulysses"``) equals full causal attention per segment, forward and backward.

The reference is ``tests/test_allgather_attention.compare``: dense masked attention on the GLOBAL stream in plain
torch (float64), independent of the varlen kernels; every rank shards it and compares its CP out and dq/dk/dv.
Head layouts: GQA with ``H_kv == cp``, ``H_kv < cp`` (replicated key/value heads: their gradients must be summed
back), ``H_kv > cp``, ``cp`` not dividing ``H_kv``, and MHA.
"""

from __future__ import annotations

import pytest
import torch

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.attention import context_parallel_attention, select_backend
from cp_packing.padding import pad_segments
from cp_packing.testing import run_distributed, synthetic_doc_ids
from tests.test_allgather_attention import D, compare, seeded_qkv

TIMEOUT = 90.0  # seconds for a whole scenario: a hang fails the test instead of waiting for the store timeout
TOL = 2e-5


def _zigzag_map(cp_size: int, seed: int) -> torch.Tensor:
    """A lognormal map padded per document (``pad_segments``) so that the zigzag layout accepts it."""
    doc_ids = synthetic_doc_ids("lognormal", 2, 10 * cp_size, seed=seed, median=6, pad=0.1)
    return pad_segments(doc_ids, multiple=2 * cp_size).doc_ids


def _head_cases(cp_size: int) -> dict[str, tuple[int, int]]:
    """name -> (H, H_kv)."""
    return {
        "H_kv == cp": (2 * cp_size, cp_size),
        "H_kv < cp (replicated)": (cp_size, 1),
        "H_kv > cp": (4 * cp_size, 2 * cp_size),
        "MHA": (cp_size, cp_size),
    } | ({"cp does not divide H_kv": (12, 6)} if cp_size == 4 else {})


def _dist_ulysses(rank, world_size):
    contiguous = synthetic_doc_ids("lognormal", 2, 12 * world_size, seed=world_size, median=8, pad=0.1)
    zigzag = _zigzag_map(world_size, seed=world_size)
    balanced = synthetic_doc_ids("lognormal", 2, 12 * world_size, seed=7, median=20, pad=0.1)
    errs = {}
    for layout, doc_ids in (("contiguous", contiguous), ("zigzag", zigzag), ("balanced", balanced)):
        for i, (name, (H, H_kv)) in enumerate(_head_cases(world_size).items()):
            errs[f"{layout} {name}"] = compare(doc_ids, layout, world_size, rank, H=H, H_kv=H_kv, seed=i,
                                               backend="ulysses")
    errs["zigzag causal=False"] = compare(zigzag, "zigzag", world_size, rank, H=2 * world_size, H_kv=1,
                                          causal=False, backend="ulysses")
    # the last rank(s) hold only padding: they join both all-to-alls like every other rank
    padding_rank = torch.tensor([[1] * 5 + [2] * 3 + [0] * (8 * world_size - 8)])
    errs["contiguous padding rank"] = compare(padding_rank, "contiguous", world_size, rank, H=world_size, H_kv=1,
                                              backend="ulysses")
    return errs


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_ulysses_matches_full_attention(cp_size):
    """out, dq, dk, dv equal full attention per segment for every layout and GQA ratio, float32."""
    per_rank = run_distributed(_dist_ulysses, cp_size, timeout=TIMEOUT)
    for rank, errs in enumerate(per_rank):
        assert len(errs) == 3 * len(_head_cases(cp_size)) + 2
        for name, e in errs.items():
            assert max(e.values()) < TOL, f"cp={cp_size} rank {rank} {name}: {e}"


def test_ulysses_cp1_needs_no_process_group():
    import torch.distributed as dist

    was_initialized = dist.is_initialized()
    errs = compare(_zigzag_map(1, seed=3), "contiguous", 1, 0, H=3, H_kv=1, backend="ulysses")
    assert max(errs.values()) < TOL, errs
    assert dist.is_initialized() == was_initialized


# ------------------------------------------------------------------------------------------------------ bytes


def _dist_bytes(rank, world_size, H, H_kv):
    import torch.distributed as dist

    sent = []
    real = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        sent.append(input.numel())
        return real(output, input, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        errs = compare(synthetic_doc_ids("lognormal", 2, 8 * world_size, seed=1, median=8, pad=0.1), "balanced",
                       world_size, rank, H=H, H_kv=H_kv, backend="ulysses")
    finally:
        dist.all_to_all_single = real
    return errs, sent


@pytest.mark.distributed
def test_ulysses_all_to_all_moves_the_expected_elements():
    """Forward: one all-to-all of q, k, v ((H + 2 H_kv rep) head-slices of T_local tokens) and one of the output
    (H); backward (nothing of the head shard is saved): dout and out (2 H), q, k, v again and dq, dk, dv
    (H + 2 H_kv rep each). With H_kv=1 < cp=4 each key/value head goes out 4 times."""
    cp, H, H_kv, rep = 4, 8, 1, 4
    T_local = 2 * 8 * cp // cp
    for errs, sent in run_distributed(_dist_bytes, cp, H, H_kv, timeout=TIMEOUT):
        assert max(errs.values()) < TOL, errs
        qkv = (H + 2 * H_kv * rep) * T_local * D
        assert sent == [qkv, H * T_local * D, 2 * H * T_local * D, qkv, qkv], sent


def _dist_forward_bytes(rank, world_size, cases):
    """Forward bytes each rank receives from OTHER ranks per backend, counted at the collectives: an
    ``all_to_all_single`` over n ranks brings ``(n-1)/n`` of its input from others, an ``all_gather`` ``(n-1)`` times
    its input. The first call of a step runs the agreement (its own collectives); the counted call is the second."""
    import torch.distributed as dist

    doc_ids = synthetic_doc_ids("lognormal", 2, 8 * world_size, seed=2, median=8, pad=0.1)
    params = packed_seq_params_from_doc_ids(doc_ids)
    received = {}
    real_a2a, real_ag = dist.all_to_all_single, dist.all_gather

    def a2a(output, input, *args, group=None, **kwargs):
        n = dist.get_world_size(group)
        counted.append(input.numel() * input.element_size() * (n - 1) // n)
        return real_a2a(output, input, *args, group=group, **kwargs)

    def ag(tensor_list, tensor, *args, group=None, **kwargs):
        counted.append(tensor.numel() * tensor.element_size() * (dist.get_world_size(group) - 1))
        return real_ag(tensor_list, tensor, *args, group=group, **kwargs)

    for name, (backend, H, H_kv, extra) in cases.items():
        sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout="balanced")
        q, k, v = (sharded.shard(x) for x in seeded_qkv(params.total_tokens, H, H_kv, torch.float32, 0)[:3])
        context_parallel_attention(q, k, v, sharded, backend=backend, **extra)  # agreement and warm-up
        counted = []
        dist.all_to_all_single, dist.all_gather = a2a, ag
        try:
            with torch.no_grad():
                context_parallel_attention(q, k, v, sharded, backend=backend, **extra)
        finally:
            dist.all_to_all_single, dist.all_gather = real_a2a, real_ag
        received[name] = (sum(counted), sharded.num_local_tokens)
    return received


@pytest.mark.distributed
def test_backend_bytes_equals_what_the_backends_move():
    """``cp_packing.cost.backend_bytes`` equals the forward bytes counted at the collectives, cp 4, float32."""
    from cp_packing.cost import backend_bytes

    cp = 4
    cases = {
        "allgather GQA": ("allgather", 8, 2, {}, {}),
        "ulysses H_kv == cp": ("ulysses", 8, 4, {}, {}),
        "ulysses H_kv < cp (replicated)": ("ulysses", 8, 1, {}, {}),
        "ulysses MHA": ("ulysses", 4, 4, {}, {}),
        "hybrid U=2": ("hybrid", 4, 1, {"ulysses_size": 2}, {"ulysses_size": 2}),
    }
    run_cases = {name: (b, H, H_kv, extra) for name, (b, H, H_kv, extra, _) in cases.items()}
    for received in run_distributed(_dist_forward_bytes, cp, run_cases, timeout=TIMEOUT):
        for name, (backend, H, H_kv, _, bytes_kw) in cases.items():
            measured, T_local = received[name]
            expected = backend_bytes(backend, T_local=T_local, cp_size=cp, num_heads=H, num_kv_heads=H_kv, head_dim=D,
                                     dtype_bytes=4, **bytes_kw)
            assert measured == expected > 0, (name, measured, expected)


# ------------------------------------------------------------------------------------------------------ errors


def _dist_heads(rank, world_size, heads_per_rank):
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 5 + [2] * 7 + [3] * 4]))
    sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout="contiguous")
    H = heads_per_rank[rank]
    q = torch.randn(sharded.num_local_tokens, H, D)
    k = torch.randn(sharded.num_local_tokens, 1, D)
    try:
        out = context_parallel_attention(q, k, k, sharded, backend="ulysses")
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return "ok", tuple(out.shape)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "heads_per_rank, kind, words",
    [
        ((3, 3), "ValueError", "cp_size=2 does not divide the 3 query heads; use backend='allgather'"),
        # a one-rank mistake: rank 0's check fails before any collective, and every rank raises it
        ((3, 2), "ValueError", "cp_size=2 does not divide the 3 query heads; use backend='allgather'"),
        ((2, 3), "ValueError", "cp_size=2 does not divide the 3 query heads"),
        # both divisible, but the ranks disagree: the agreement names the field
        ((4, 2), "AgreementError", "disagree on shapes"),
    ],
)
def test_indivisible_heads_are_refused_on_every_rank(heads_per_rank, kind, words):
    results = run_distributed(_dist_heads, 2, heads_per_rank, timeout=TIMEOUT)
    assert [r[0] for r in results] == [kind, kind], results
    assert all(words in r[1] for r in results), results


def test_select_backend_checks_heads_and_auto_picks_by_the_step_time_model():
    from cp_packing.cost import TIMED_BACKENDS, backend_times

    def modelled(q, s, **kw):
        times = backend_times(s, num_heads=q.shape[1], num_kv_heads=kw.get("num_kv_heads", q.shape[1]),
                              head_dim=D, dtype_bytes=q.element_size(), window=kw.get("window"))
        best = min(times.values())
        return next(n for n in TIMED_BACKENDS if n in times and times[n] <= best * 1.01)

    blocks = packed_seq_params_from_doc_ids(torch.tensor([[1] * 8 + [2] * 8]))  # one document per rank at cp 2
    dense = packed_seq_params_from_doc_ids(torch.tensor([[1] * 16]))
    s2 = shard_packed_seq_params(blocks, cp_size=2, cp_rank=0, layout="contiguous")
    q = torch.zeros(8, 4, D)
    assert select_backend(q, s2, backend="ulysses") == ("ulysses", "torch")
    assert select_backend(q, s2) == ("exchange", "torch")  # no rank needs a remote key: the exchange moves nothing
    d2 = shard_packed_seq_params(dense, cp_size=2, cp_rank=0, layout="zigzag")
    assert select_backend(q, d2, num_kv_heads=1)[0] == "allgather"  # one document, balanced: the need is everything
    cases = [(q, d2, {}), (q, s2, {}), (torch.zeros(4, 4, D), shard_packed_seq_params(dense, cp_size=4, cp_rank=0,
                                                                                      layout="contiguous"), {}),
             (torch.zeros(4, 4, D), shard_packed_seq_params(dense, cp_size=4, cp_rank=0, layout="contiguous"),
              {"window": 2})]
    for qq, s, kw in cases:  # auto is the model's argmin (a tie to the first of TIMED_BACKENDS)
        assert select_backend(qq, s, **kw)[0] == modelled(qq, s, **kw), (s.layout, s.cp_size, kw)
    assert select_backend(*cases[3][:2], window=2)[0] != "ulysses"  # auto keeps Ulysses out of windowed layers
    with pytest.raises(ValueError, match=r"cp_size=2 does not divide the 3 query heads.*'allgather'.*\(1, 3\)"):
        select_backend(torch.zeros(8, 3, D), s2, backend="ulysses")


def test_kv_replication():
    from cp_packing.attention.ulysses import kv_replication

    assert [kv_replication(32, 8, cp) for cp in (1, 2, 4, 8, 16, 32)] == [1, 1, 1, 1, 2, 4]
    assert kv_replication(12, 6, 4) == 2 and kv_replication(12, 3, 4) == 4
    from cp_packing.cost import kv_replication_factor  # the one formula, shared with the cost model

    for H, H_kv, cp in ((32, 8, 16), (12, 6, 4), (12, 3, 4), (8, 8, 4), (64, 8, 32)):
        assert kv_replication(H, H_kv, cp) == kv_replication_factor(H_kv, cp)
    with pytest.raises(ValueError, match="cp_size=8 does not divide the 12 query heads"):
        kv_replication(12, 4, 8)


def test_auto_logs_its_bytes_choice_once(caplog):
    import logging

    from cp_packing.attention import dispatch, plan

    plan._LOGGED.clear()
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 8 + [2] * 8]))
    s = shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="contiguous")
    q = torch.randn(16, 2, D)
    with caplog.at_level(logging.INFO, logger="cp_packing"):
        for _ in range(2):
            dispatch.context_parallel_attention(q, q, q, s)
    lines = [r.getMessage() for r in caplog.records if "context_parallel_attention" in r.getMessage()]
    assert len(lines) == 1 and "backend=allgather" in lines[0], lines  # cp 1: nothing to communicate, no model
    plan._LOGGED.clear()
    s2 = [shard_packed_seq_params(params, cp_size=2, cp_rank=r, layout="contiguous") for r in range(2)]
    from cp_packing.attention.plan import AttentionShapes, _log_choice, prepare_attention

    step = prepare_attention(s).plan.replace(sharded=s2[0], backend="exchange", kernel="torch")
    with caplog.at_level(logging.INFO, logger="cp_packing"):
        _log_choice(step, AttentionShapes(2, 2, D, torch.float32))
    line = caplog.records[-1].getMessage()
    assert "auto by the modelled busiest-rank time per layer: allgather" in line and "exchange" in line, line


def test_a_window_runs_on_ulysses_and_is_refused_by_hybrid():
    """The sliding window runs on the all-gather and Ulysses backends (equal results); hybrid refuses it instead of
    ignoring it."""
    from cp_packing import context_parallel_attention, packed_seq_params_from_doc_ids, shard_packed_seq_params

    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 0]])),
                                      cp_size=1, cp_rank=0)
    q = torch.randn(6, 2, 8)
    with pytest.raises(NotImplementedError, match="backend='hybrid' cannot run window=3"):
        context_parallel_attention(q, q, q, sharded, backend="hybrid", window=3, ulysses_size=1)
    out = context_parallel_attention(q, q, q, sharded, window=2)  # auto: the all-gather backend
    ulysses = context_parallel_attention(q, q, q, sharded, window=2, backend="ulysses")
    full = context_parallel_attention(q, q, q, sharded, backend="ulysses")
    torch.testing.assert_close(ulysses, out)
    assert not torch.allclose(ulysses, full)  # the window reached the kernel (document 1 is 3 tokens: token 2)


@pytest.mark.slow
def test_backends_benchmark_quick_runs():
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "bench_attention_backends.py"), "--quick"],
                       cwd=repo, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()
            if line.startswith(("  allgather", "  exchange", "  ulysses"))]
    # 8/2 heads x 64, fp32, 256 tokens per rank at cp 2: all-gather 2*2*64*4*256 B, Ulysses (16 + 4)*64*4*256/2 B;
    # the exchange moves rank 0's need, at most the all-gather's
    assert [row[0] for row in rows] == ["allgather", "exchange", "ulysses"], r.stdout
    assert rows[0][1] == "0.250" and rows[2][1] == "0.625" and float(rows[1][1]) <= 0.25, r.stdout
    assert sum(row[-2:] == ["<-", "auto"] for row in rows) == 1 and all(float(row[3]) > 0 for row in rows), r.stdout
