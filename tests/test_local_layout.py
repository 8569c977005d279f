"""The ``local`` layout: an exact partition with T/cp tokens per rank and runs inside segments, determinism, an even
causal cost (under windows too), fewer remote keys than ``balanced`` on long-document maps, exact shard/unshard and
attention from the local metadata, and the exchange benchmark's smoke run. Every figure is counted token by token
from a plain NumPy segmentation of the doc map, not from the library's metadata."""

from __future__ import annotations

import doctest
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_packing.cost import layout_cost
from cp_packing.layouts import PLANS, global_token_order, layout_runs
from cp_packing.layouts import local as local_module
from cp_packing.layouts.balanced import balanced_runs
from cp_packing.layouts.local import TOLERANCE, local_plan, local_plan_arrays, local_runs
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import synthetic_doc_ids
from tests.maps import assert_local_attention_equals_full, doc_maps

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOWS = [None, 1, 3, 16, (4, None)]


@st.composite
def maps_and_cp(draw):
    """Any map with B*S % cp == 0 (rows padded), cp often larger than the number of segments; some with documents
    much longer than T/cp (the ones the planner cuts and folds); a window the plan is made for."""
    cp = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    kind = draw(st.sampled_from(["random", "random", "long", "one_segment", "all_padding"]))
    if kind == "random":
        doc_ids = draw(doc_maps(max_b=3, max_s=48, max_doc_len=draw(st.sampled_from([3, 12, 40]))))
    elif kind == "long":
        doc_ids = draw(doc_maps(max_b=2, max_s=512, max_doc_len=draw(st.sampled_from([64, 300, 512]))))
    else:
        doc_ids = torch.full((draw(st.integers(1, 3)), draw(st.integers(1, 40))), int(kind == "one_segment"))
    B, S = doc_ids.shape
    out = torch.zeros(B, math.ceil(S / cp) * cp, dtype=torch.int64)
    out[:, :S] = doc_ids
    return out, cp, draw(st.sampled_from(WINDOWS))


# -- plain references ----------------------------------------------------------------------------------------------


def reference_segments(doc_ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(segment, position)`` of every flat token: a new segment at every row start and every change of value."""
    B, S = doc_ids.shape
    flat = doc_ids.reshape(-1).numpy()
    new = np.ones(flat.size, dtype=bool)
    new[1:] = flat[1:] != flat[:-1]
    new[::S] = True
    seg = np.cumsum(new) - 1
    return seg, np.arange(flat.size) - np.flatnonzero(new)[seg]


def expand(run_start: torch.Tensor, run_len: torch.Tensor) -> np.ndarray:
    """The global positions of a rank's runs, run after run (plain NumPy)."""
    parts = [np.arange(a, a + n) for a, n in zip(run_start.tolist(), run_len.tolist())]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def reference_figures(doc_ids, token_index, window=None) -> tuple[list[int], list[int]]:
    """Every rank's cost (``sum min(p + 1, w)`` over the layers of ``window``) and remote keys (per segment it holds,
    the keys up to its furthest token there, minus its own tokens), token by token."""
    seg, pos = reference_segments(doc_ids)
    layers = window if isinstance(window, tuple) else (window,)
    weight = sum(pos + 1 if w is None else np.minimum(pos + 1, w) for w in layers)
    costs, needs = [], []
    for idx in token_index:
        costs.append(int(weight[idx].sum()))
        reach = np.zeros(int(seg.max()) + 1 if seg.size else 0, dtype=np.int64)
        np.maximum.at(reach, seg[idx], pos[idx] + 1)
        needs.append(int(reach.sum()) - idx.size)
    return costs, needs


def _all_runs(doc_ids, cp, window=None, runs_fn=local_runs):
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    return [runs_fn(cu, cp_size=cp, cp_rank=r, window=window) for r in range(cp)]


def _figures(doc_ids, cp, window=None, runs_fn=local_runs, cost_window="plan"):
    runs = _all_runs(doc_ids, cp, window, runs_fn)
    return reference_figures(doc_ids, [expand(*r) for r in runs], window if cost_window == "plan" else cost_window)


def lognormal(mean: int, cp: int, seed: int, t_local: int = 8192) -> torch.Tensor:
    """One row of ``t_local * cp`` tokens, log-normal document lengths of ``mean`` (sigma 1.5), as the benchmark."""
    return synthetic_doc_ids("lognormal", 1, t_local * cp, seed=seed, median=mean / math.exp(1.125), sigma=1.5)


# -- the partition ---------------------------------------------------------------------------------------------------


def _check_partition(doc_ids, cp, window=None):
    """T/cp tokens per rank; runs non-empty, inside one segment, strictly ordered by position, never touching a run of
    the same segment on the same rank (merged); every token exactly once; at most 2 (cp - 1) cuts: the segments a
    rank does not hold whole add at most one extra holder per interval bound."""
    T = doc_ids.numel()
    seg, _ = reference_segments(doc_ids)
    covered, holders = [], {}
    for r, (run_start, run_len) in enumerate(_all_runs(doc_ids, cp, window)):
        assert run_start.dtype == run_len.dtype == torch.int64
        assert int(run_len.sum()) == T // cp and bool((run_len > 0).all())
        starts, ends = run_start.tolist(), (run_start + run_len).tolist()
        for a, b in zip(starts, ends):
            assert seg[a] == seg[b - 1]
            holders.setdefault(int(seg[a]), set()).add(r)
        for (a0, b0), a1 in zip(zip(starts, ends), starts[1:]):
            assert b0 <= a1 and not (b0 == a1 and seg[b0 - 1] == seg[a1])
        covered.append(expand(run_start, run_len))
    allidx = np.concatenate(covered) if covered else np.zeros(0, dtype=np.int64)
    assert np.array_equal(np.sort(allidx), np.arange(T))
    assert sum(len(h) - 1 for h in holders.values()) <= 2 * (cp - 1)


@SETTINGS
@given(maps_and_cp())
def test_partition_equal_counts_runs_inside_segments(case):
    _check_partition(*case)


@pytest.mark.parametrize("kind", ["lognormal", "huge", "padded", "long"])
@pytest.mark.parametrize("window", [None, 512])
def test_partition_on_maps_the_planner_cuts_and_folds(kind, window):
    for cp in (2, 8, 16):
        _check_partition(synthetic_doc_ids(kind, 2, 4096, seed=cp), cp, window)


@SETTINGS
@given(maps_and_cp())
def test_deterministic_whatever_the_dtype_and_cache(case):
    """Every rank computes the same plan on its own: a function of the cu_seqlens values, cp and window only."""
    doc_ids, cp, window = case
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    first = [local_runs(cu, cp_size=cp, cp_rank=r, window=window) for r in range(cp)]
    local_plan.cache_clear()
    second = [local_runs(cu.to(torch.int64).clone(), cp_size=cp, cp_rank=r, window=window) for r in range(cp)]
    for (s1, l1), (s2, l2) in zip(first, second):
        assert torch.equal(s1, s2) and torch.equal(l1, l2)


def test_all_ranks_cost_one_plan_and_edits_never_poison_the_cache():
    cu = packed_seq_params_from_doc_ids(lognormal(2048, 4, 0, t_local=1024)).cu_seqlens
    local_plan.cache_clear()
    runs = [local_runs(cu, cp_size=4, cp_rank=r) for r in range(4)]
    assert (local_plan.cache_info().misses, local_plan.cache_info().hits) == (1, 3)
    want = [t.clone() for pair in runs for t in pair]
    for pair in runs:
        for t in pair:
            t.zero_()
    plan = local_plan(cu, cp_size=4)
    for t in plan:
        t.zero_()
    again = [t for r in range(4) for t in local_runs(cu, cp_size=4, cp_rank=r)]
    assert all(torch.equal(a, b) for a, b in zip(again, want))


# -- balance and remote keys -------------------------------------------------------------------------------------------

# maps the benchmark measures (one row of 2048 * cp tokens: a quarter of its size), and the synthetic kinds
REALISTIC = [("lognormal", mean, cp, seed) for mean in (2048, 8192) for cp in (4, 8, 16) for seed in (0, 1)]


@pytest.mark.parametrize("kind, mean, cp, seed", REALISTIC)
def test_even_cost_and_fewer_remote_keys_than_balanced_on_lognormal_maps(kind, mean, cp, seed):
    """busiest / mean <= 1.001 (the split is exact to about 1e-5 here), and the busiest rank needs no more remote
    keys than balanced's busiest: counted token by token."""
    doc_ids = lognormal(mean, cp, seed, t_local=2048)
    costs, needs = _figures(doc_ids, cp)
    _, balanced_needs = _figures(doc_ids, cp, runs_fn=balanced_runs)
    assert max(costs) / (sum(costs) / cp) <= 1.001, costs
    assert max(needs) <= max(balanced_needs), (needs, balanced_needs)


@pytest.mark.parametrize("kind", ["lognormal", "long", "short", "huge", "padded"])
def test_even_cost_on_the_synthetic_kinds(kind):
    doc_ids = synthetic_doc_ids(kind, 4, 8192, seed=3)
    for cp in (2, 4, 8, 16):
        costs, _ = _figures(doc_ids, cp)
        assert max(costs) / (sum(costs) / cp) <= 1.01, (cp, costs)


@pytest.mark.parametrize("window", [512, 4096, (512, None)])
def test_a_window_plan_balances_the_windowed_cost(window):
    doc_ids = lognormal(4096, 8, 1, t_local=2048)
    costs, _ = _figures(doc_ids, 8, window)
    assert max(costs) / (sum(costs) / 8) <= 1.01, costs


def test_the_reference_need_is_the_cost_models():
    """The test's token-by-token need equals cost.layout_cost's kv_bytes_allgather (which the benchmark also uses)
    on the layouts the cost model knows."""
    doc_ids = lognormal(2048, 8, 2, t_local=1024)
    params = packed_seq_params_from_doc_ids(doc_ids)
    for name in ("contiguous", "balanced"):
        order = global_token_order(params.cu_seqlens, cp_size=8, layout=name).numpy()
        _, needs = reference_figures(doc_ids, list(order))
        per_token = 2 * 8 * 128 * 2
        assert needs == (layout_cost(params, cp_size=8, layout=name).kv_bytes_allgather // per_token).tolist()


def test_short_documents_stay_whole_and_a_long_one_is_folded_into_rings():
    """One document of 3/4 of the stream among 64 of 16 tokens, cp 4: the long one spans every rank; some rank
    holds its head and its tail (a ring ``[0, a) + [L - a, L)``), and the short ones are cut at most 2 (cp - 1)
    times in all."""
    doc_ids = torch.zeros(1, 4096, dtype=torch.int64)
    doc_ids[0, :3072] = 1
    doc_ids[0, 3072:] = torch.arange(2, 2 + 1024 // 16).repeat_interleave(16)
    runs = _all_runs(doc_ids, 4)
    _check_partition(doc_ids, 4)
    rings = [r for r, (s, n) in enumerate(runs) if 0 in s.tolist() and 3072 in (s + n).tolist()]
    assert rings and all(int((s < 3072).sum()) >= 1 for s, _ in runs)
    costs, _ = _figures(doc_ids, 4)
    assert max(costs) / (sum(costs) / 4) <= 1.001


def test_the_tolerance_is_the_knob():
    """A plan for any tolerance is an exact partition as even as the tolerance asks (tolerance 0 folds wherever a
    rank is off, within 1e-3 on this 8-document map); bad tolerances are refused."""
    doc_ids = lognormal(8192, 8, 0, t_local=1024)
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    for tol in (0.0, 0.01, 0.5):
        offsets, run_start, run_len = local_plan(cu, cp_size=8, tolerance=tol)
        idx = [expand(run_start[offsets[r]:offsets[r + 1]], run_len[offsets[r]:offsets[r + 1]]) for r in range(8)]
        assert np.array_equal(np.sort(np.concatenate(idx)), np.arange(doc_ids.numel()))
        costs, _ = reference_figures(doc_ids, idx)
        assert max(costs) / (sum(costs) / 8) <= 1 + max(tol, 1e-3), (tol, costs)
    with pytest.raises(ValueError, match=r"tolerance must be >= 0\.0"):
        local_plan(cu, cp_size=8, tolerance=-0.1)
    with pytest.raises(TypeError, match="tolerance must be a number"):
        local_plan(cu, cp_size=8, tolerance="0.01")


# -- registry, sharding, attention -------------------------------------------------------------------------------------


def test_registered_as_a_layout_name():
    cu = packed_seq_params_from_doc_ids(lognormal(2048, 4, 1, t_local=512)).cu_seqlens
    assert PLANS["local"] is local_plan_arrays
    offsets, run_start, run_len = local_plan(cu, cp_size=4, tolerance=TOLERANCE)  # what layout="local" uses
    for r in range(4):
        want = run_start[offsets[r] : offsets[r + 1]], run_len[offsets[r] : offsets[r + 1]]
        got = layout_runs(cu.to(torch.int32), cp_size=4, cp_rank=r, layout="local")
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _check_shards(doc_ids, cp, window=None):
    """shard -> unshard is the identity; every rank's token_index, positions and keys follow its runs; attention from
    the local metadata equals full attention per segment."""
    T = doc_ids.numel()
    params = packed_seq_params_from_doc_ids(doc_ids)
    shards = [shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout="local", window=window)
              for r in range(cp)]
    _, pos = reference_segments(doc_ids)
    for r, s in enumerate(shards):
        assert s.layout == "local" and s.num_local_tokens == T // cp
        assert np.array_equal(s.token_index.numpy(), expand(*local_runs(params.cu_seqlens, cp_size=cp, cp_rank=r,
                                                                        window=window)))
        assert np.array_equal(s.position_ids.numpy(), pos[s.token_index.numpy()])
    x = torch.randn(T, 3)
    parts = [s.shard(x) for s in shards]
    assert all(torch.equal(part, x[s.token_index]) for part, s in zip(parts, shards))
    assert torch.equal(shards[0].unshard(parts).reshape(T, 3), x)  # the inverse over all ranks' parts
    assert_local_attention_equals_full(doc_ids, shards)


@given(maps_and_cp())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_shard_unshard_and_attention_from_local_metadata(case):
    if case[0].numel():
        _check_shards(*case)


@pytest.mark.parametrize("kind", ["huge", "lognormal"])
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_with_folded_documents(kind, cp):
    """Maps where documents are cut (a folded one gives ring runs that start mid-document)."""
    doc_ids = synthetic_doc_ids(kind, 1, 1024, seed=cp, median=200)
    _, pos = reference_segments(doc_ids)
    assert any(pos[s] > 0 for run_start, _ in _all_runs(doc_ids, cp) for s in run_start.tolist()), "no cut"
    _check_shards(doc_ids, cp)


CU = torch.tensor([0, 3, 6], dtype=torch.int32)


@pytest.mark.parametrize("call, error, match", [
    (lambda: local_runs(CU, cp_size=4, cp_rank=0), ValueError, r"T = B\*S = 6 tokens, not divisible by cp_size=4"),
    (lambda: local_runs(CU, cp_size=2, cp_rank=2), ValueError, r"cp_rank must be in \[0, cp_size=2\)"),
    (lambda: local_plan([0, 3, 6], cp_size=2), TypeError, "cu_seqlens must be a torch.Tensor"),
    (lambda: local_plan(torch.tensor([0, 4, 2, 6]), cp_size=2), ValueError, "never decrease"),
])
def test_errors_name_the_value_and_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_docstring_examples_run():
    result = doctest.testmod(local_module, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted > 0


def test_bench_exchange_bytes_quick_runs():
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_exchange_bytes.py"), "--quick"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    for line in ("lognormal 8k:", "min-heap+exchange", "targets:", "local's tolerance", "planning time"):
        assert line in r.stdout


def test_a_layout_object_carries_its_tolerance():
    """``Local(tolerance=)`` is accepted wherever a layout name is: its plan is the pure planner's at that tolerance
    (not a cached plan of another tolerance), ``Local()`` is ``"local"``, and the shard and the agreement's plan
    digest carry the tolerance."""
    from cp_packing.agreement import digest
    from cp_packing.layouts import Local, layout_plan
    from cp_packing.layouts.balanced import planned_weights

    doc_ids = lognormal(8192, 8, 0, t_local=1024)
    params = packed_seq_params_from_doc_ids(doc_ids)
    cu = params.cu_seqlens
    cu_np = cu.to(torch.int64).numpy()
    local_plan.cache_clear()
    plans = {}
    for tol in (0.0, 0.5, TOLERANCE):
        plan = layout_plan(cu, cp_size=8, layout=Local(tolerance=tol))
        want = local_plan_arrays(cu_np, 8, planned_weights(cu_np, 8, None), tolerance=tol)  # uncached
        assert all(np.array_equal(a, b) for a, b in zip((plan.offsets, plan.run_start, plan.run_len), want)), tol
        plans[tol] = plan.run_start.tolist(), plan.run_len.tolist()
    assert plans[0.0] != plans[TOLERANCE]  # the map tells the tolerances apart, so the cache key must too
    assert layout_plan(cu, cp_size=8, layout="local") is layout_plan(cu, cp_size=8, layout=Local())
    assert local_plan.cache_info().misses == 3
    sharded = shard_packed_seq_params(params, cp_size=8, cp_rank=3, layout=Local(tolerance=0.0))
    plan = layout_plan(cu, cp_size=8, layout=Local(tolerance=0.0))
    assert sharded.layout == Local(tolerance=0.0)
    assert np.array_equal(sharded.token_index.numpy(), expand(*plan.runs(3)))
    assert torch.equal(sharded.global_token_order()[3], sharded.token_index)
    # the step agreement's "plan" digest hashes the layout's repr, which names the tolerance
    assert repr(Local(tolerance=0)) == "Local(tolerance=0.0)"
    assert digest(cu, Local(tolerance=0.0), 8, None) != digest(cu, Local(), 8, None) != digest(cu, "local", 8, None)
    with pytest.raises(ValueError, match=r"tolerance must be >= 0\.0"):
        Local(tolerance=-0.1)
    with pytest.raises(TypeError, match="tolerance must be a number"):
        layout_plan(cu, cp_size=8, layout=Local(tolerance="0.01"))


@pytest.mark.parametrize("kind", ["huge", "lognormal"])
def test_the_planner_stays_within_the_doc_maps_bytes(kind):
    """Planning a map of few long documents (the wide windows' pricing is the largest work there) allocates at most
    about the doc map's own bytes (int32 [T]); it was 3.4-6.6x before the pricing went in blocks."""
    import tracemalloc

    tokens, cp = 1 << 16, 8
    doc = synthetic_doc_ids("huge", 1, tokens, seed=0) if kind == "huge" else \
        synthetic_doc_ids("lognormal", 1, tokens, seed=0, median=8192 / math.exp(0.5), sigma=1.0)
    cu = packed_seq_params_from_doc_ids(doc).cu_seqlens.to(torch.int64).numpy()
    local_plan_arrays(cu, cp, ((None, 1),))  # a first call imports modules lazily (numpy.ma): not the planner's memory
    tracemalloc.start()
    try:
        offsets, run_start, run_len = local_plan_arrays(cu, cp, ((None, 1),))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.diff(offsets).size == cp and int(run_len.sum()) == tokens  # a whole plan
    assert peak <= 1.1 * tokens * 4, peak / (tokens * 4)


def test_the_crossing_search_lands_on_a_sign_change_in_every_bracket():
    """``_crossing`` (the split nearest a boundary's target, to the token) interpolates where the cost is linear and
    halves where it is not: on linear, curved, jagged and step pieces alike every bracket must end one token wide
    with a sign change (the plan takes the nearer of its two ends), and on a monotone piece at the only one."""
    rng = np.random.default_rng(0)
    n = 400
    p_lo = rng.integers(0, 1000, n)
    width = rng.integers(1, 5000, n)
    p_hi = p_lo + width
    root = p_lo + (rng.random(n) * width).astype(np.int64)
    kind = np.arange(n) % 4  # linear, curved (cubic), jagged (a fold's floors), steps (a window's flat stretch)

    def f(x, j):
        d = (x - root[j]).astype(np.float64)
        jagged = 5 * d + 3 * ((x % 3) - 1)
        out = np.where(kind[j] == 0, 7 * d, np.where(kind[j] == 1, d ** 3 + d, np.where(kind[j] == 2, jagged,
                                                                                        np.floor(d / 97))))
        return np.where(np.arange(n)[j] % 2, -out, out) - 0.5  # both directions; never exactly 0

    lo, hi = local_module._crossing(p_lo, p_hi, f(p_lo, np.arange(n)), f(p_hi, np.arange(n)), f)
    idx = np.arange(n)
    ok = (f(p_lo, idx) < 0) != (f(p_hi, idx) < 0)
    assert ok.sum() > n // 2  # most brackets do hold a crossing
    assert np.all(hi[ok] - lo[ok] == 1) and np.all((p_lo <= lo) & (hi <= p_hi))
    assert np.all((f(lo, idx)[ok] < 0) != (f(hi, idx)[ok] < 0))
    mono = ok & (kind != 2)
    for j in np.flatnonzero(mono):  # a monotone piece crosses once: the bisection's token
        xs = np.arange(p_lo[j], p_hi[j] + 1)
        s = f(xs, np.full(xs.size, j)) < 0
        assert lo[j] == xs[np.flatnonzero(s[1:] != s[:-1])[0]]


@pytest.mark.parametrize("kind,cp", [("huge", 8), ("huge", 16), ("lognormal", 8), ("lognormal", 16)])
def test_the_lean_chain_step_plans_no_worse_than_the_general_search(kind, cp, monkeypatch):
    """Boundaries cutting the segment the one before cut are solved by ``_chain_step`` (a lean search) before
    ``_solve``'s general one: on maps of few long documents (where every plan has such chains) the plan with it must
    be as even and move as few keys at the busiest rank as the plan without it, and it must actually be used."""
    tokens = 8192 * cp
    doc = synthetic_doc_ids("huge", 1, tokens, seed=1) if kind == "huge" else \
        synthetic_doc_ids("lognormal", 1, tokens, seed=1, median=8192 / math.exp(1.125), sigma=1.5)
    cu = packed_seq_params_from_doc_ids(doc).cu_seqlens.to(torch.int64).numpy()

    def figures(offsets, run_start, run_len):
        rank = np.repeat(np.arange(cp), np.diff(offsets))
        seg = np.searchsorted(cu, run_start, side="right") - 1
        pos0 = run_start - cu[seg]
        cost = np.bincount(rank, weights=(pos0 + run_len) * (pos0 + run_len + 1) / 2 - pos0 * (pos0 + 1) / 2,
                           minlength=cp)
        key = rank * cu.size + seg  # per rank and segment: keys up to the furthest token held, minus those held
        reach = np.zeros(cp * cu.size)
        np.maximum.at(reach, key, pos0 + run_len)
        need = reach.reshape(cp, cu.size).sum(axis=1) - np.bincount(rank, weights=run_len, minlength=cp)
        return cost.max() / cost.mean(), need.max() / ((cp - 1) * tokens / cp)

    calls = []
    real = local_module._chain_step

    def counted(*args):
        out, ok = real(*args)
        calls.append(int(ok.sum()))
        return out, ok

    monkeypatch.setattr(local_module, "_chain_step", counted)
    lean = figures(*local_plan_arrays(cu, cp, ((None, 1),)))
    assert sum(calls) > 0  # the lean step solved boundaries on this map
    monkeypatch.setattr(local_module, "_chain_step", lambda s, fold, cp_, t, r, target, prev: (
        [np.zeros_like(r)] * 6 + [np.zeros(r.size)], np.zeros(r.size, dtype=bool)))
    general = figures(*local_plan_arrays(cu, cp, ((None, 1),)))
    assert lean[0] <= general[0] + 1e-6 and lean[1] <= general[1] + 1e-9, (lean, general)


@pytest.mark.parametrize("weights", [((None, 1),), ((4, 1),), ((2, 1), (None, 1))], ids=["causal", "window",
                                                                                        "mixed"])
def test_tiny_maps_every_token_on_one_rank(weights):
    """Maps of a few tokens per rank (1-7), one document, documents shorter than cp, a document per token: the
    planner's searches (chains of boundaries in one document, windows clipped at every bound) still give every token
    to exactly one rank and ``T / cp`` to each (found by fuzzing the chain step; the benchmark maps are all large)."""
    rng = np.random.default_rng(7)
    for cp in (2, 3, 4, 8):
        for t in (1, 2, 3, 7):
            total = cp * t
            for n in sorted({1, min(cp - 1, total) or 1, total, int(rng.integers(1, total + 1))}):
                cuts = np.sort(rng.choice(np.arange(1, total), size=n - 1, replace=False)) if n > 1 else []
                cu = np.r_[0, cuts, total].astype(np.int64)
                offsets, run_start, run_len = local_plan_arrays(cu, cp, weights)
                assert offsets.size == cp + 1 and offsets[0] == 0 and offsets[-1] == run_start.size, (cp, cu)
                assert np.all(run_len > 0)
                covered = np.zeros(total, dtype=np.int64)
                for start, length in zip(run_start.tolist(), run_len.tolist()):
                    covered[start:start + length] += 1
                assert np.all(covered == 1), (cp, cu.tolist())
                per_rank = np.add.reduceat(run_len, offsets[:-1]) if run_len.size else np.zeros(cp)
                assert np.all(per_rank == t), (cp, cu.tolist(), per_rank)
                doc = np.searchsorted(cu, run_start, side="right") - 1  # every run inside one document
                assert np.all(run_start + run_len <= cu[doc + 1]), (cp, cu.tolist())
