"""The balanced layout and layout='auto': an exact partition with equal token counts, runs inside segments,
determinism, an even causal cost on realistic maps, few runs, correct attention from the local metadata, and
choose_layout's picks."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_packing import planner
from cp_packing.testing import SYNTHETIC_KINDS, synthetic_doc_ids
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.planner import balanced_plan, balanced_runs, choose_layout
from cp_packing.attention.allgather import allgather_keys
from cp_packing.sharding import shard_packed_seq_params
from tests.maps import doc_maps, segments_of
from tests.test_sharding import _reference_positions, assert_local_attention_equals_full

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def maps_and_cp(draw):
    """Any map with B*S % cp == 0 (rows padded), cp often larger than the number of segments."""
    cp = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    kind = draw(st.sampled_from(["random", "random", "one_segment", "all_padding"]))
    if kind == "random":
        doc_ids = draw(doc_maps(max_b=3, max_s=48, max_doc_len=draw(st.sampled_from([3, 12, 40]))))
    else:
        B = draw(st.integers(1, 3))
        S = draw(st.integers(1, 40))
        doc_ids = torch.full((B, S), 0 if kind == "all_padding" else 1, dtype=torch.int64)
    B, S = doc_ids.shape
    S2 = math.ceil(S / cp) * cp
    out = torch.zeros(B, S2, dtype=doc_ids.dtype)
    out[:, :S] = doc_ids
    return out, cp


def _all_runs(cu, cp):
    return [balanced_runs(cu, cp_size=cp, cp_rank=r) for r in range(cp)]


def _check_plan(doc_ids, cp):
    params = packed_seq_params_from_doc_ids(doc_ids)
    cu = params.cu_seqlens
    T = doc_ids.numel()
    runs = _all_runs(cu, cp)
    seg_of = torch.zeros(T, dtype=torch.int64)
    for k, (a, b) in enumerate(segments_of(doc_ids)):
        seg_of[a:b] = k
    covered = []
    for run_start, run_len in runs:
        assert run_start.dtype == torch.int64 and run_len.dtype == torch.int64
        assert bool((run_len > 0).all())
        assert int(run_len.sum()) == T // cp  # exactly T / cp tokens on every rank
        # every run inside one segment, runs ordered by global position
        for a, n in zip(run_start.tolist(), run_len.tolist()):
            assert seg_of[a] == seg_of[a + n - 1]
            covered.append(torch.arange(a, a + n))
        assert bool((run_start[1:] > run_start[:-1]).all())
    allidx = torch.cat(covered) if covered else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(allidx.sort().values, torch.arange(T))  # every token exactly once
    return runs


@SETTINGS
@given(maps_and_cp())
def test_partition_equal_counts_runs_inside_segments(case):
    doc_ids, cp = case
    _check_plan(doc_ids, cp)


@SETTINGS
@given(maps_and_cp())
def test_deterministic_whatever_the_dtype_and_cache(case):
    """Every rank computes the same plan on its own: a function of the cu_seqlens values and cp only."""
    doc_ids, cp = case
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    first = _all_runs(cu, cp)
    planner._cached_plan.cache_clear()
    second = _all_runs(cu.to(torch.int64).clone(), cp)
    for (s1, l1), (s2, l2) in zip(first, second):
        assert torch.equal(s1, s2) and torch.equal(l1, l2)


# the fixed suite of realistic maps: every synthetic distribution, two shapes, two seeds
SUITE = [(kind, shape, seed) for kind in SYNTHETIC_KINDS for shape in [(4, 8192), (8, 32768)] for seed in (0, 1)]


@pytest.mark.parametrize("kind, shape, seed", SUITE)
def test_balanced_cost_is_even_on_realistic_maps(kind, shape, seed):
    """busiest / mean causal cost <= 1.05 at cp 2..16 (the cost counted from scratch: positions at token_index)."""
    doc_ids = synthetic_doc_ids(kind, *shape, seed=seed)
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    weight = _reference_positions(doc_ids) + 1  # [T] cost of each token
    for cp in (2, 4, 8, 16):
        costs = []
        for run_start, run_len in _all_runs(cu, cp):
            idx = torch.repeat_interleave(run_start, run_len) + (
                torch.arange(int(run_len.sum())) - torch.repeat_interleave(torch.cumsum(run_len, 0) - run_len, run_len)
            )
            costs.append(int(weight[idx].sum()))
        imbalance = max(costs) / (sum(costs) / cp)
        assert imbalance <= 1.05, (kind, shape, seed, cp, imbalance)


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_few_runs_and_few_single_tokens(kind):
    """Runs a flash kernel can use: per rank at most ~3x its share of segments, plus 2 per segment long enough to
    be cut over all ranks, plus a constant; single-token runs only where a document has one token (plus a few
    cuts)."""
    doc_ids = synthetic_doc_ids(kind, 4, 16384, seed=3)
    params = packed_seq_params_from_doc_ids(doc_ids)
    lengths = params.seqlens.to(torch.int64)
    n_seg = lengths.numel()
    for cp in (2, 4, 8, 16):
        n_long = int((lengths >= 2 * cp * planner.MIN_CHUNK).sum())
        single_docs = int((lengths == 1).sum())
        singles = 0
        for run_start, run_len in _all_runs(params.cu_seqlens, cp):
            assert run_len.numel() <= 3 * n_seg / cp + 2 * n_long + 2 * planner.STRATA + 4, (cp, run_len.numel())
            singles += int((run_len == 1).sum())
        assert singles <= single_docs + cp * (planner.STRATA + 1)


def test_one_huge_document_is_cut_in_2cp_chunks_and_short_ones_stay_whole():
    """A document of 3/4 of the batch: 2 runs on every rank (1 on the last: its chunks touch); no short document is
    cut more than the few cuts of the exact fill."""
    doc_ids = torch.zeros(1, 4096, dtype=torch.int64)
    doc_ids[0, :3072] = 1
    doc_ids[0, 3072:] = torch.arange(2, 2 + 1024 // 16).repeat_interleave(16)  # 64 documents of 16 tokens
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    cp = 4
    runs = _all_runs(cu, cp)
    pieces_of_big = [int((s < 3072).sum()) for s, _ in runs]
    assert pieces_of_big == [2, 2, 2, 1]
    short_pieces = sum(int((s >= 3072).sum()) for s, _ in runs)
    assert short_pieces <= 64 + (planner.STRATA + 1) * cp


def test_all_ranks_cost_one_plan():
    """The plan is computed once per (cu_seqlens content, cp): the other ranks' calls are cache hits."""
    cu = packed_seq_params_from_doc_ids(synthetic_doc_ids("lognormal", 2, 4096, seed=11)).cu_seqlens
    planner._cached_plan.cache_clear()
    _all_runs(cu, 8)
    _all_runs(cu.clone(), 8)
    info = planner._cached_plan.cache_info()
    assert (info.misses, info.hits) == (1, 15)


def _check_balanced_attention(doc_ids, cp):
    T = doc_ids.numel()
    if T == 0:
        return
    params = packed_seq_params_from_doc_ids(doc_ids)
    shards = [shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout="balanced") for r in range(cp)]
    ref_pos = _reference_positions(doc_ids)
    for s in shards:
        assert s.layout == "balanced" and s.num_local_tokens == T // cp
        assert torch.equal(s.position_ids, ref_pos[s.token_index])
        # the concatenated key ranges of cu_seqlens_k are those of the runs
        key_len = torch.diff(allgather_keys(s).cu_seqlens_k.to(torch.int64))
        run_end_all = s.token_index[s.cu_seqlens[1:].long() - 1] + 1
        assert torch.equal(key_len, run_end_all - s.key_start)
    x = torch.randn(T, 3)
    assert torch.equal(shards[0].unshard([s.shard(x) for s in shards]), x.reshape(*doc_ids.shape, 3))
    assert_local_attention_equals_full(doc_ids, shards)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(maps_and_cp())
def test_balanced_sharding_attention_from_local_metadata_equals_full_attention(case):
    """Same check as tests/test_sharding.py for the other layouts: each rank runs causal attention from ITS runs and
    key starts (keys all-gathered): the result equals full attention per segment; shard/unshard is exact."""
    _check_balanced_attention(*case)


@pytest.mark.parametrize("kind", ["lognormal", "huge", "padded"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_attention_with_cut_documents(kind, cp):
    """Maps large enough that the planner cuts documents (long ones zigzag-style, mid ones in pieces, strata
    boundaries): attention from the local metadata still equals full attention per segment."""
    doc_ids = synthetic_doc_ids(kind, batch=2, seqlen=1024, seed=cp)
    params = packed_seq_params_from_doc_ids(doc_ids)
    owners = torch.empty(doc_ids.numel(), dtype=torch.int64)
    for r in range(cp):
        owners[shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout="balanced").token_index] = r
    cu = params.cu_seqlens.tolist()
    split = sum(len(set(owners[a:b].tolist())) > 1 for a, b in zip(cu[:-1], cu[1:]))
    assert split > 0, "the map should make the planner cut at least one document across ranks"
    _check_balanced_attention(doc_ids, cp)


# -- choose_layout ---------------------------------------------------------------------------------------------


def _params(rows):
    return packed_seq_params_from_doc_ids(torch.tensor(rows, dtype=torch.int64))


def test_choose_zigzag_when_every_segment_is_a_multiple_of_2cp():
    """One long document per row, lengths multiples of 2cp: zigzag is exact (and ring kernels take it); balanced
    places it the same way, contiguous is badly off; the tie goes to zigzag."""
    cp = 4
    params = _params([[1] * 64 + [2] * 32, [1] * 96])
    assert choose_layout(params, cp_size=cp) == "zigzag"
    assert shard_packed_seq_params(params, cp_size=cp, cp_rank=1, layout="auto").layout == "zigzag"


def test_choose_contiguous_when_it_is_already_even():
    """Many equal short documents: contiguous is as even as anything and needs the least K/V traffic."""
    params = _params([[d for d in range(1, 33) for _ in range(4)]] * 2)  # 32 docs of 4 tokens per row
    assert choose_layout(params, cp_size=4) == "contiguous"


def test_choose_balanced_on_long_tailed_lengths():
    params = packed_seq_params_from_doc_ids(synthetic_doc_ids("lognormal", 4, 4096, seed=5))
    assert choose_layout(params, cp_size=8) == "balanced"
    s = shard_packed_seq_params(params, cp_size=8, cp_rank=3, layout="auto")
    assert s.layout == "balanced" and s.num_local_tokens == params.total_tokens // 8


def test_choose_layout_logs_its_choice(caplog):
    params = _params([[1] * 64 + [2] * 32, [1] * 96])
    planner._cached_choice.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="cp_packing"):
        name = choose_layout(params, cp_size=4)
    assert any("picks" in r.getMessage() and repr(name) in r.getMessage() for r in caplog.records)


def test_choose_layout_errors():
    with pytest.raises(ValueError, match=r"no CP layout is valid.*T = B\*S = 6 tokens.*cp_size=4"):
        choose_layout(_params([[1, 1, 2, 2, 2, 0]]), cp_size=4)
    with pytest.raises(ValueError, match="no CP layout is valid"):
        shard_packed_seq_params(_params([[1, 1, 2, 2, 2, 0]]), cp_size=4, cp_rank=0, layout="auto")
    with pytest.raises(TypeError, match="PackedSeqParams"):
        choose_layout(torch.ones(2, 4), cp_size=2)
    with pytest.raises(TypeError, match="cp_size must be an int"):
        choose_layout(_params([[1, 1]]), cp_size=2.0)
    with pytest.raises(ValueError, match="rtol"):
        choose_layout(_params([[1, 1]]), cp_size=2, rtol=-1)


def test_balanced_runs_errors():
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"T = B\*S = 6 tokens, not divisible by cp_size=4"):
        balanced_runs(cu, cp_size=4, cp_rank=0)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, cp_size=2\)"):
        balanced_runs(cu, cp_size=2, cp_rank=2)
    with pytest.raises(TypeError, match="cp_rank must be an int"):
        balanced_runs(cu, cp_size=2, cp_rank=True)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        balanced_runs(cu, cp_size=0, cp_rank=0)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        balanced_plan([0, 3, 6], cp_size=2)
    with pytest.raises(TypeError, match="integer tensor"):
        balanced_plan(torch.tensor([0.0, 3.0]), cp_size=1)
    with pytest.raises(ValueError, match="never decrease"):
        balanced_plan(torch.tensor([0, 4, 2, 6]), cp_size=2)
    with pytest.raises(ValueError, match="start at 0"):
        balanced_plan(torch.tensor([1, 4]), cp_size=1)


def test_small_worked_example():
    """[[1,1,2,2,2,0]] at cp=3 (hand-checked): costs 1+2 | 1+2+3 | 1 per segment, total 10. Every rank gets 2
    tokens; the plan is an exact partition and no rank gets both expensive tokens of document 2."""
    params = _params([[1, 1, 2, 2, 2, 0]])
    runs = _all_runs(params.cu_seqlens, 3)
    pos = np.array([0, 1, 0, 1, 2, 0])
    costs = []
    for s, n in runs:
        idx = np.concatenate([np.arange(a, a + b) for a, b in zip(s.tolist(), n.tolist())])
        assert idx.size == 2
        costs.append(int((pos[idx] + 1).sum()))
    assert sum(costs) == 10 and max(costs) <= 4  # the best split of {1,2,1,2,3,1} in pairs has a busiest of 4


@SETTINGS
@given(maps_and_cp())
def test_balanced_is_never_busier_than_contiguous(case):
    """On any map (tiny ones too, where pieces are coarse) the busiest balanced rank costs at most the busiest
    contiguous rank (counted from scratch)."""
    doc_ids, cp = case
    params = packed_seq_params_from_doc_ids(doc_ids)
    weight = _reference_positions(doc_ids) + 1
    T = doc_ids.numel()
    busiest = {}
    for layout in ("contiguous", "balanced"):
        busiest[layout] = max(
            int(weight[shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout=layout).token_index].sum())
            for r in range(cp)
        ) if T else 0
    assert busiest["balanced"] <= busiest["contiguous"]


def test_plan_cache_follows_the_tuning_constants(monkeypatch):
    """A changed knob must never return a plan cached under the old one (ranks would disagree)."""
    cu = packed_seq_params_from_doc_ids(synthetic_doc_ids("lognormal", batch=2, seqlen=4096, seed=3)).cu_seqlens
    before = planner.balanced_plan(cu, cp_size=4)
    monkeypatch.setattr(planner, "SMALL_FRACTION", 0.5)
    after = planner.balanced_plan(cu, cp_size=4)
    fresh = planner._plan_numpy(cu.numpy().astype(np.int64), 4)
    assert torch.equal(after[1], torch.from_numpy(fresh[1])) and torch.equal(after[2], torch.from_numpy(fresh[2]))
    assert not (before[1].numel() == after[1].numel() and torch.equal(before[1], after[1]))


def _check_plan_vectorised(cu: torch.Tensor, cp: int):
    """The guarantees on a big map, without a Python loop over runs: exact T/cp tokens per rank, non-empty runs
    inside one segment, ordered by position, every token exactly once."""
    offsets, run_start, run_len = balanced_plan(cu, cp_size=cp)
    cu64 = cu.to(torch.int64)
    T = int(cu64[-1])
    assert bool((run_len > 0).all())
    per_rank = torch.tensor([int(run_len[offsets[r] : offsets[r + 1]].sum()) for r in range(cp)])
    assert bool((per_rank == T // cp).all())
    seg_first = torch.searchsorted(cu64, run_start, right=True)
    seg_last = torch.searchsorted(cu64, run_start + run_len - 1, right=True)
    assert torch.equal(seg_first, seg_last)  # every run inside one segment
    for r in range(cp):
        s = run_start[offsets[r] : offsets[r + 1]]
        assert bool((s[1:] > s[:-1]).all())
    idx = torch.repeat_interleave(run_start - (torch.cumsum(run_len, 0) - run_len), run_len) + torch.arange(T)
    assert torch.equal(torch.sort(idx).values, torch.arange(T))  # every token exactly once


@pytest.mark.parametrize("kind", ["short", "lognormal"])
def test_exact_partition_on_a_big_many_segment_map(kind):
    """The planning-time benchmark's map ([8, 131072]; 'short' has ~58k segments): the plan is an exact partition
    and the same when planned again from scratch."""
    cu = packed_seq_params_from_doc_ids(synthetic_doc_ids(kind, 8, 131072, seed=0)).cu_seqlens
    for cp in (8, 16):
        _check_plan_vectorised(cu, cp)
        first = balanced_plan(cu, cp_size=cp)
        planner._cached_plan.cache_clear()
        again = balanced_plan(cu.clone(), cp_size=cp)
        assert np.array_equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_golden_order_is_the_integer_permutation():
    """The low-discrepancy order (split tables for big streams, the plain formula for small ones) equals
    lo + (j * a % k) computed directly, for strata of any size, and permutes every stratum."""
    rng = np.random.default_rng(0)
    big = [0, 1, 2, 3, 5, 89, 1000, 65537, 300_001] + rng.integers(1, 50_000, 6).tolist()
    small = [0, 1, 7, 1000, 4000]
    assert sum(big) >= planner._SMALL_STREAM > sum(small)
    for sizes in (big, small):
        bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        got = planner._golden_order(bounds)
        want = np.concatenate(
            [lo + np.arange(k, dtype=np.int64) * planner._golden_multiplier(k) % k if k else np.zeros(0, np.int64)
             for lo, k in zip(bounds[:-1].tolist(), sizes)]
        )
        assert np.array_equal(got, want)
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            assert np.array_equal(np.sort(got[lo:hi]), np.arange(lo, hi))


def test_plan_cache_never_confuses_maps_with_the_same_digest(monkeypatch):
    """The cache key holds a digest of cu_seqlens; maps whose digests collide still get their own plans."""
    monkeypatch.setattr(planner._PlanCache, "_digest", lambda self, cu: 0)
    planner._cached_plan.cache_clear()
    try:
        a = packed_seq_params_from_doc_ids(synthetic_doc_ids("lognormal", 2, 4096, seed=1)).cu_seqlens
        b = packed_seq_params_from_doc_ids(synthetic_doc_ids("long", 2, 4096, seed=2)).cu_seqlens
        for cu in (a, b, a, b):
            plan = balanced_plan(cu, cp_size=4)
            fresh = planner._plan_numpy(cu.numpy().astype(np.int64), 4)
            assert torch.equal(plan[1], torch.from_numpy(fresh[1])) and torch.equal(plan[2], torch.from_numpy(fresh[2]))
    finally:
        planner._cached_plan.cache_clear()
