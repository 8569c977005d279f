"""The balanced layout: an exact partition with equal token counts, runs inside segments, the minimum run contract,
determinism, an even causal cost on realistic maps (against a plain LPT reference, the oracle), a cache that callers
cannot poison, and correct attention from the local metadata where the planner cuts documents."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_packing.layouts.balanced import MIN_CHUNK, balanced_plan, balanced_runs
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.attention.allgather import allgather_keys
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import SYNTHETIC_KINDS, synthetic_doc_ids
from tests.maps import doc_maps, segments_of
from tests.maps import assert_local_attention_equals_full

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def maps_and_cp(draw):
    """Any map with B*S % cp == 0 (rows padded), cp often larger than the number of segments; some with documents
    long enough to be cut."""
    cp = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    kind = draw(st.sampled_from(["random", "random", "one_segment", "all_padding", "long"]))
    if kind == "random":
        doc_ids = draw(doc_maps(max_b=3, max_s=48, max_doc_len=draw(st.sampled_from([3, 12, 40]))))
    elif kind == "long":  # documents the planner cuts: zigzag (>= 2*cp*MIN_CHUNK tokens) and pieces
        doc_ids = draw(doc_maps(max_b=2, max_s=512, max_doc_len=draw(st.sampled_from([64, 300, 512]))))
    else:
        B = draw(st.integers(1, 3))
        S = draw(st.integers(1, 40))
        doc_ids = torch.full((B, S), 0 if kind == "all_padding" else 1, dtype=torch.int64)
    B, S = doc_ids.shape
    out = torch.zeros(B, math.ceil(S / cp) * cp, dtype=doc_ids.dtype)
    out[:, :S] = doc_ids
    return out, cp


# -- plain references -------------------------------------------------------------------------------------------


def reference_positions(doc_ids):
    """[T] position of every token inside its segment, from the plain-Python segmentation."""
    pos = torch.zeros(doc_ids.numel(), dtype=torch.int64)
    for a, b in segments_of(doc_ids):
        pos[a:b] = torch.arange(b - a)
    return pos


def reference_lpt_costs(cu: list[int], cp: int) -> list[int]:
    """The oracle: per-rank causal cost of plain LPT with capacity. Segments costliest first, each to the
    least-loaded rank that has room for all of it; one that fits nowhere whole is cut: the least-loaded rank with
    room takes what fits (from the segment's start) and the rest goes on."""
    room, load = [cu[-1] // cp] * cp, [0] * cp
    lengths = sorted((b - a for a, b in zip(cu, cu[1:]) if b > a), key=lambda n: -n * (n + 1) // 2)
    for n in lengths:
        pos = 0
        while pos < n:
            open_ranks = [r for r in range(cp) if room[r] > 0]
            fits = [r for r in open_ranks if room[r] >= n - pos]
            r = min(fits or open_ranks, key=lambda r: (load[r], r))
            take = min(room[r], n - pos)
            load[r] += (pos + take) * (pos + take + 1) // 2 - pos * (pos + 1) // 2
            room[r] -= take
            pos += take
    return load


def _all_runs(cu, cp, window=None):
    return [balanced_runs(cu, cp_size=cp, cp_rank=r, window=window) for r in range(cp)]


def reference_token_cost(doc_ids, window=None):
    """[T] work of every token: ``p + 1``, or ``min(p + 1, w)`` summed over the layers of a per-layer window."""
    pos = reference_positions(doc_ids)
    layers = window if isinstance(window, (list, tuple)) else [window]
    return sum(pos + 1 if w is None else torch.clamp(pos + 1, max=w) for w in layers)


def _rank_costs(doc_ids, cp, plan_window=None, cost_window=None):
    """Every rank's cost under ``cost_window`` of the plan made for ``plan_window``, counted token by token."""
    weight = reference_token_cost(doc_ids, cost_window)  # [T] cost of each token
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    return [int(weight[torch.repeat_interleave(s, n) + _offsets(n)].sum()) for s, n in _all_runs(cu, cp, plan_window)]


def _offsets(run_len):
    """0, 1, ... inside every run, runs end to end."""
    return torch.arange(int(run_len.sum())) - torch.repeat_interleave(torch.cumsum(run_len, 0) - run_len, run_len)


def _check_plan(doc_ids, cp, window=None):
    """Every guarantee token by token: T/cp tokens per rank, non-empty runs inside one segment in position order,
    every token exactly once; a run shorter than MIN_CHUNK is a whole segment or one of the pieces the cp - 1 fill
    cuts leave (at most 2 (cp - 1)). ``window``: of a window-aware plan."""
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    T = doc_ids.numel()
    seg_of = torch.zeros(T, dtype=torch.int64)
    seg_len = {}
    for k, (a, b) in enumerate(segments_of(doc_ids)):
        seg_of[a:b] = k
        seg_len[k] = b - a
    covered, short_pieces = [], 0
    for run_start, run_len in _all_runs(cu, cp, window):
        assert run_start.dtype == torch.int64 and run_len.dtype == torch.int64
        assert bool((run_len > 0).all())
        assert int(run_len.sum()) == T // cp  # exactly T / cp tokens on every rank
        for a, n in zip(run_start.tolist(), run_len.tolist()):
            assert seg_of[a] == seg_of[a + n - 1]
            short_pieces += n < MIN_CHUNK and n != seg_len[int(seg_of[a])]
            covered.append(torch.arange(a, a + n))
        assert bool((run_start[1:] > run_start[:-1]).all())
    allidx = torch.cat(covered) if covered else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(allidx.sort().values, torch.arange(T))  # every token exactly once
    assert short_pieces <= 2 * (cp - 1)


@SETTINGS
@given(maps_and_cp())
def test_partition_equal_counts_runs_inside_segments(case):
    _check_plan(*case)


@pytest.mark.parametrize("kind", ["lognormal", "huge", "padded"])
def test_partition_and_minimum_run_on_maps_the_planner_cuts(kind):
    for cp in (2, 8, 16):
        _check_plan(synthetic_doc_ids(kind, 2, 4096, seed=cp), cp)


@SETTINGS
@given(maps_and_cp())
def test_deterministic_whatever_the_dtype_and_cache(case):
    """Every rank computes the same plan on its own: a function of the cu_seqlens values and cp only."""
    doc_ids, cp = case
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    first = _all_runs(cu, cp)
    balanced_plan.cache_clear()
    second = _all_runs(cu.to(torch.int64).clone(), cp)
    for (s1, l1), (s2, l2) in zip(first, second):
        assert torch.equal(s1, s2) and torch.equal(l1, l2)


# the fixed suite of realistic maps: every synthetic distribution, two shapes, two seeds
SUITE = [(kind, shape, seed) for kind in SYNTHETIC_KINDS for shape in [(4, 8192), (8, 32768)] for seed in (0, 1)]


@pytest.mark.parametrize("kind, shape, seed", SUITE)
def test_balanced_cost_is_even_on_realistic_maps(kind, shape, seed):
    """busiest / mean causal cost <= 1.005 at cp 2..16 on the benchmark's shape (<= 1.015 on the small one, where a
    rank holds 512 tokens at cp=16 and pieces are coarse); counted from scratch: positions at token_index."""
    doc_ids = synthetic_doc_ids(kind, *shape, seed=seed)
    bound = 1.005 if shape == (8, 32768) else 1.015
    for cp in (2, 4, 8, 16):
        costs = _rank_costs(doc_ids, cp)
        assert max(costs) / (sum(costs) / cp) <= bound, (kind, shape, seed, cp, costs)


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_at_least_as_even_as_the_plain_lpt_oracle(kind):
    """The planner's busiest rank is within 0.5% of the plain LPT-with-capacity reference's (or better)."""
    doc_ids = synthetic_doc_ids(kind, 4, 8192, seed=7)
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens.tolist()
    for cp in (2, 4, 8, 16):
        costs, ref = _rank_costs(doc_ids, cp), reference_lpt_costs(cu, cp)
        assert sum(costs) == sum(ref)
        assert max(costs) <= 1.005 * max(ref), (kind, cp, max(costs) / max(ref))


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_few_runs(kind):
    """Runs a flash kernel can use: per rank about its share of the segments, plus 2 per segment long enough to be
    cut over all ranks, plus the few fill cuts."""
    doc_ids = synthetic_doc_ids(kind, 4, 16384, seed=3)
    params = packed_seq_params_from_doc_ids(doc_ids)
    lengths = params.seqlens.to(torch.int64)
    n_seg = lengths.numel()
    for cp in (2, 4, 8, 16):
        n_long = int((lengths >= 2 * cp * MIN_CHUNK).sum())
        for run_start, run_len in _all_runs(params.cu_seqlens, cp):
            assert run_len.numel() <= 2 * n_seg / cp + 2 * n_long + cp + 4, (cp, run_len.numel())


def test_one_huge_document_is_cut_in_2cp_chunks_and_short_ones_stay_whole():
    """A document of 3/4 of the batch: 2 runs on every rank (1 on the last: its chunks touch); the short documents
    are cut only by the cp - 1 fill cuts."""
    doc_ids = torch.zeros(1, 4096, dtype=torch.int64)
    doc_ids[0, :3072] = 1
    doc_ids[0, 3072:] = torch.arange(2, 2 + 1024 // 16).repeat_interleave(16)  # 64 documents of 16 tokens
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    cp = 4
    runs = _all_runs(cu, cp)
    assert [int((s < 3072).sum()) for s, _ in runs] == [2, 2, 2, 1]
    assert sum(int((s >= 3072).sum()) for s, _ in runs) <= 64 + cp - 1


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_maps_of_long_documents_only(cp):
    """Every segment long enough for zigzag: no item is left for LPT or the fill."""
    doc_ids = torch.tensor([[1] * 2048 + [2] * 2048, [3] * 4096])
    _check_plan(doc_ids, cp)
    costs = _rank_costs(doc_ids, cp)
    assert max(costs) / (sum(costs) / cp) <= 1.001


def test_all_ranks_cost_one_plan():
    """The plan is computed once per (cu_seqlens values, cp): the other ranks' calls are cache hits."""
    cu = packed_seq_params_from_doc_ids(synthetic_doc_ids("lognormal", 2, 4096, seed=11)).cu_seqlens
    balanced_plan.cache_clear()
    _all_runs(cu, 8)
    _all_runs(cu.clone().to(torch.int64), 8)
    info = balanced_plan.cache_info()
    assert (info.misses, info.hits) == (1, 15)


def test_editing_returned_tensors_never_poisons_the_cache():
    cu = packed_seq_params_from_doc_ids(synthetic_doc_ids("huge", 2, 4096, seed=1)).cu_seqlens
    plan = balanced_plan(cu, cp_size=4)
    want = [t.clone() for t in plan]
    runs = balanced_runs(cu, cp_size=4, cp_rank=2)
    want_runs = [t.clone() for t in runs]
    for t in (*plan, *runs):
        t.zero_()
    assert all(torch.equal(a, b) for a, b in zip(balanced_plan(cu, cp_size=4), want))
    assert all(torch.equal(a, b) for a, b in zip(balanced_runs(cu, cp_size=4, cp_rank=2), want_runs))


def _check_balanced_attention(doc_ids, cp):
    T = doc_ids.numel()
    if T == 0:
        return
    params = packed_seq_params_from_doc_ids(doc_ids)
    shards = [shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout="balanced") for r in range(cp)]
    ref_pos = reference_positions(doc_ids)
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
    """Maps large enough that the planner cuts documents (long ones zigzag-style, heavy ones in pieces, fill cuts):
    attention from the local metadata still equals full attention per segment."""
    doc_ids = synthetic_doc_ids(kind, batch=2, seqlen=1024, seed=cp)
    params = packed_seq_params_from_doc_ids(doc_ids)
    owners = torch.empty(doc_ids.numel(), dtype=torch.int64)
    for r in range(cp):
        owners[shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout="balanced").token_index] = r
    cu = params.cu_seqlens.tolist()
    split = sum(len(set(owners[a:b].tolist())) > 1 for a, b in zip(cu[:-1], cu[1:]))
    assert split > 0, "the map should make the planner cut at least one document across ranks"
    _check_balanced_attention(doc_ids, cp)


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
    with pytest.raises(ValueError, match="could overflow int64; split the batch"):
        balanced_plan(torch.tensor([0, 2**32]), cp_size=1)


def test_small_worked_example():
    """[[1,1,2,2,2,0]] at cp=3 (hand-checked): costs 1+2 | 1+2+3 | 1 per segment, total 10. Every rank gets 2
    tokens; the plan is an exact partition and no rank gets both expensive tokens of document 2."""
    costs = _rank_costs(torch.tensor([[1, 1, 2, 2, 2, 0]]), 3)
    assert sum(costs) == 10 and max(costs) <= 4  # the best split of {1,2,1,2,3,1} in pairs has a busiest of 4


@SETTINGS
@given(maps_and_cp())
def test_balanced_is_never_busier_than_contiguous(case):
    """On any map (tiny ones too, where pieces are coarse) the busiest balanced rank costs at most the busiest
    contiguous rank (counted from scratch)."""
    doc_ids, cp = case
    params = packed_seq_params_from_doc_ids(doc_ids)
    weight = reference_positions(doc_ids) + 1
    if doc_ids.numel() == 0:
        return
    busiest = {
        layout: max(
            int(weight[shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout=layout).token_index].sum())
            for r in range(cp)
        )
        for layout in ("contiguous", "balanced")
    }
    assert busiest["balanced"] <= busiest["contiguous"]


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
        balanced_plan.cache_clear()
        again = balanced_plan(cu.clone(), cp_size=cp)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# -- sliding window: the plan balances sum min(p + 1, w) ------------------------------------------------------------

WINDOWS = st.sampled_from([1, 3, 16, 64, 200, [4, None], [16, 16, None], (64, 8)])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(maps_and_cp(), WINDOWS)
def test_partition_of_window_aware_plans(case, window):
    """Nothing lost under any window: T/cp tokens per rank, runs inside segments, every token exactly once."""
    _check_plan(*case, window=window)


@pytest.mark.parametrize("kind", ["lognormal", "huge", "padded", "long"])
def test_partition_of_window_aware_plans_on_maps_the_planner_cuts(kind):
    for cp, window in ((2, 64), (4, 512), (8, [512, None]), (16, 100)):
        _check_plan(synthetic_doc_ids(kind, 2, 4096, seed=cp), cp, window)


@pytest.mark.parametrize("kind", ["lognormal", "huge", "padded"])
def test_window_plan_balances_the_windowed_cost_where_the_causal_plan_does_not(kind):
    """Documents much longer than the window: planned for the window, busiest/mean of the WINDOWED cost is within
    1%; the causal plan (what ignoring the window gives) is off by more than 2% on the same maps."""
    doc_ids = synthetic_doc_ids(kind, 2, 4096, seed=0)
    for cp in (4, 8):
        with_window = _rank_costs(doc_ids, cp, plan_window=512, cost_window=512)
        without = _rank_costs(doc_ids, cp, plan_window=None, cost_window=512)
        assert sum(with_window) == sum(without)
        assert max(with_window) / (sum(with_window) / cp) <= 1.01, (cp, with_window)
        assert max(without) / (sum(without) / cp) >= 1.02, (cp, without)


@pytest.mark.parametrize("window", [256, [256, None], [256, 1024, None]])
def test_one_long_document_under_a_window_costs_the_same_on_every_rank(window):
    """Cut at the window's kinks (a ramp, then a flat or gentler slope), every zigzag pair costs the same: exact
    balance for one 8192-token document at cp=4, where the plain zigzag pairs leave rank 0 the cheap ramp."""
    doc_ids = torch.ones(1, 8192, dtype=torch.int64)
    costs = _rank_costs(doc_ids, 4, plan_window=window, cost_window=window)
    assert max(costs) - min(costs) <= max(costs) * 1e-4, costs
    if window == 256:
        causal_plan = _rank_costs(doc_ids, 4, plan_window=None, cost_window=window)
        assert min(causal_plan) < min(costs)  # rank 0 got the ramp


def test_a_window_at_least_every_document_plans_exactly_as_no_window():
    """min(p + 1, w) = p + 1 when w >= every segment: the same plan, bit for bit, from the same cache entry; and
    ``[w] * 4`` plans as ``w`` (the cost only scales)."""
    cu = packed_seq_params_from_doc_ids(synthetic_doc_ids("lognormal", 2, 4096, seed=5)).cu_seqlens
    longest = int(torch.diff(cu).max())
    balanced_plan.cache_clear()
    want = balanced_plan(cu, cp_size=8)
    for window in (longest, 10**9, [longest, None], (None, longest + 1, None)):
        assert all(torch.equal(a, b) for a, b in zip(balanced_plan(cu, cp_size=8, window=window), want)), window
    assert balanced_plan.cache_info().misses == 1
    small = balanced_plan(cu, cp_size=8, window=32)
    assert not all(torch.equal(a, b) for a, b in zip(small, want))  # a small window changes the plan ...
    assert all(torch.equal(a, b) for a, b in zip(balanced_plan(cu, cp_size=8, window=[32] * 4), small))
    assert balanced_plan.cache_info().misses == 2  # ... and is its own cache entry; [32] * 4 is a hit


def test_balanced_attention_from_the_local_metadata_of_a_window_plan():
    """The shard keeps the window it was planned for: unshard and the all-gather order follow the same plan."""
    doc_ids = synthetic_doc_ids("huge", batch=1, seqlen=1024, seed=5)
    params = packed_seq_params_from_doc_ids(doc_ids)
    shards = [shard_packed_seq_params(params, cp_size=4, cp_rank=r, layout="balanced", window=[64])
              for r in range(4)]
    assert all(s.plan_window == (64,) for s in shards)
    plain = shard_packed_seq_params(params, cp_size=4, cp_rank=0, layout="balanced")
    assert not torch.equal(shards[0].token_index, plain.token_index)  # the window changed the plan
    assert_local_attention_equals_full(doc_ids, shards)
