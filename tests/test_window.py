"""Sliding-window attention per document (HF's ``sliding_window``): kernels, the all-gather backend under CP, the
dispatcher's backend choice, and HF parity (Mistral, Qwen2 with sliding layers).

References are independent of cp_packing's attention: a dense float64 softmax (``tests/reference.py``) with the
mask ``p - window < k <= p`` inside each segment of a plain-Python segmentation, and HF's own eager model run on each
document alone (HF builds its sliding-window mask itself, so its off-by-one is what is tested, not our reading).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.attention import plan
from cp_packing.attention.allgather import allgather_keys
from cp_packing.attention.dispatch import context_parallel_attention, select_backend
from cp_packing.attention.kernels import varlen_attention, varlen_attention_forward
from cp_packing.testing import run_distributed
from tests.maps import segments_of
from tests.reference import dense_attention

# ------------------------------------------------------------------------------------------------ dense reference


def cu_of(doc_ids: torch.Tensor) -> torch.Tensor:
    """The segment bounds of a doc map from ``tests.maps.segments_of`` (plain Python, not the seed API)."""
    return torch.tensor([0] + [b for _, b in segments_of(doc_ids)])


def qkv(T, H=4, H_kv=2, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, dtype=dtype) for h in (H, H_kv, H_kv, H)]


# ------------------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("window", [1, 3, 7, 100])
def test_reference_kernel_window_matches_dense_mask(window):
    """Forward and backward of the reference kernel, sequences with more keys than queries (bottom-right aligned),
    against the dense float64 softmax of tests/reference.py with the window."""
    lens_q, lens_k = [5, 1, 9, 4], [5, 6, 12, 4]
    q, _, _, _ = qkv(sum(lens_q), seed=window)
    _, k, v, _ = qkv(sum(lens_k), seed=window + 1)
    dout = torch.randn_like(q)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), window=window, kernel="torch")
    (out * dout).sum().backward()
    refs = [x.double().requires_grad_() for x in (q, k, v)]
    ref = dense_attention(*refs, cu_q, cu_k, window=window)
    (ref * dout.double()).sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, refs):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)
    # the window changes the result where a sequence is longer than it (the check can fail)
    full = varlen_attention_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), kernel="torch")[0]
    assert (window >= max(lens_k)) == torch.allclose(full, out.detach(), atol=1e-6)


def test_window_argument_errors():
    q, k, v, _ = qkv(6)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"window must be >= 1, got 0"):
        varlen_attention_forward(q, k, v, cu, cu, 6, 6, window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        varlen_attention_forward(q, k, v, cu, cu, 6, 6, window=2.5)
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        varlen_attention_forward(q, k, v, cu, cu, 6, 6, window=4, causal=False)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.tensor([[1] * 6])), cp_size=1, cp_rank=0)
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        context_parallel_attention(q, k, v, sharded, window=4, causal=False)


# --------------------------------------------------------------------------------------------- backend choice


def test_ring_refuses_a_window_and_auto_never_picks_it(monkeypatch):
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.tensor([[1] * 8])), cp_size=2, cp_rank=0,
                                      layout="contiguous")
    q = torch.zeros(4, 2, 8)
    monkeypatch.setattr(plan, "_auto_wants_ring", lambda *a: True)  # as on CUDA bf16 with ring-flash-attn
    monkeypatch.setattr(plan, "_ring_importable", lambda: True)
    assert select_backend(q, sharded)[0] == "ring_flash_attn"  # the setup would pick ring without a window
    assert select_backend(q, sharded, window=4)[0] in ("allgather", "exchange")  # never ring (nor Ulysses)
    with pytest.raises(NotImplementedError, match=r"window=4.*backend='allgather'"):
        select_backend(q, sharded, backend="ring_flash_attn", window=4)


# ------------------------------------------------------------------------------------------ all-gather under CP

MAPS = {
    # documents longer and shorter than the windows, crossing shard edges (cp 2: 24; cp 3: 16, 32), padding
    "contiguous": torch.tensor([[1] * 17 + [2] * 3 + [0] * 2 + [3] * 4 + [4] * 15 + [5] * 7]),
    # every segment % 12 == 0 (zigzag for cp 2 and 3)
    "zigzag": torch.tensor([[1] * 24 + [2] * 12, [1] * 12 + [0] * 12 + [2] * 12]),
    "balanced": torch.tensor([[1] * 19 + [2] * 5, [1] * 3 + [2] * 14 + [0] * 7]),
}
WINDOWS = (1, 4, 9)


def _dist_window(rank, world_size):
    errs, keys = {}, {}
    for layout, doc in MAPS.items():
        params = packed_seq_params_from_doc_ids(doc)
        sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout=layout)
        q, k, v, dout = qkv(doc.numel(), seed=world_size)
        for window in WINDOWS:
            ref_in = [x.double().requires_grad_() for x in (q, k, v)]
            ref = dense_attention(*ref_in, cu_of(doc), window=window)
            (ref * dout.double()).sum().backward()
            # the all-gather backend, and Ulysses where cp divides the 4 query heads
            for backend in ("allgather", "ulysses") if q.shape[1] % world_size == 0 else ("allgather",):
                local = [sharded.shard(x).detach().requires_grad_() for x in (q, k, v)]
                out = context_parallel_attention(*local, sharded, group=dist.group.WORLD, window=window,
                                                 backend=backend)
                (out * sharded.shard(dout)).sum().backward()
                got = [out] + [x.grad for x in local]
                want = [ref] + [r.grad for r in ref_in]
                key = (layout, window) if backend == "allgather" else (layout, window, backend)
                errs[key] = max(float((g.detach().double() - sharded.shard(w)).abs().max()) for g, w in zip(got, want))
            keys[(layout, window)] = allgather_keys(sharded, window=window).num_keys
        keys[(layout, None)] = allgather_keys(sharded).num_keys
    return errs, keys


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 3])
def test_allgather_window_matches_dense_per_segment(cp_size):
    """Forward and dq/dk/dv of the all-gather backend (and Ulysses at cp 2) with a window equal the dense windowed
    reference, for the contiguous, zigzag and balanced layouts; the key index holds fewer keys under a small window."""
    totals = {}
    for rank, (errs, keys) in enumerate(run_distributed(_dist_window, cp_size)):
        assert (cp_size == 2) == any(len(case) == 3 for case in errs), sorted(errs)  # Ulysses ran where it can
        for case, e in errs.items():
            assert e < 2e-5, f"cp={cp_size} rank {rank} {case}: {e}"
        for layout in MAPS:
            counts = [keys[(layout, w)] for w in WINDOWS] + [keys[(layout, None)]]
            assert counts == sorted(counts), (layout, counts)  # a larger window never selects fewer keys
            totals[layout] = [a + b for a, b in zip(totals.get(layout, [0] * len(counts)), counts)]
    for layout in ("contiguous", "zigzag"):  # these split documents: over the ranks, a small window selects fewer
        assert totals[layout][0] < totals[layout][-1], (layout, totals)  # keys (mid-segment runs stop reaching back)


def test_window_key_index_holds_exactly_the_keys_in_some_window():
    """cp=1, one row [1]*10 + [2]*6: with window 4 and runs [0, 10) and [10, 16) (cp 1: one run per segment) the
    keys start at max(segment start, first query - 3) = the segment start; with cp 2 contiguous, rank 1's run
    [8, 10) reaches back to 5, and [10, 16) to 10."""
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 10 + [2] * 6]))
    one = shard_packed_seq_params(params, cp_size=1, cp_rank=0)
    assert allgather_keys(one, window=4).num_keys == 16
    r1 = shard_packed_seq_params(params, cp_size=2, cp_rank=1, layout="contiguous")
    keys = allgather_keys(r1, window=4)
    assert keys.cu_seqlens_k.tolist() == [0, 5, 11]  # [5, 10) then [10, 16)
    assert keys.key_slice == slice(5, 16) and keys.max_seqlen_k == 6
    assert allgather_keys(r1).cu_seqlens_k.tolist() == [0, 10, 16]  # without a window: from the segment start


# ----------------------------------------------------------------------------------------------------- cost model


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced", "rowzigzag"])
@pytest.mark.parametrize("window", [1, 3, 8, None])
def test_windowed_rank_cost_is_the_sum_of_min_position_plus_one_window(layout, window):
    """layout_cost(window=w).rank_cost == per rank, the sum over its tokens of min(p + 1, w), with p the token's
    position in its segment from the plain-Python segmentation and the rank's tokens from the shard itself."""
    from cp_packing.cost import causal_cost, layout_cost

    cp = 2
    doc = torch.tensor([[1] * 20 + [2] * 4 + [0] * 4 + [3] * 4, [1] * 8 + [2] * 24])  # segments % 4 == 0
    pos = torch.empty(doc.numel(), dtype=torch.int64)
    for a, b in segments_of(doc):
        pos[a:b] = torch.arange(b - a)
    token_cost = pos + 1 if window is None else torch.clamp(pos + 1, max=window)
    got = layout_cost(doc, cp_size=cp, layout=layout, window=window)
    if layout == "rowzigzag":  # the whole-row reference: chunks r and 2cp-1-r of every row (S = 32, chunk 8)
        owner = torch.tensor([0, 1, 1, 0]).repeat_interleave(8).repeat(2)
        want = [int(token_cost[owner == r].sum()) for r in range(cp)]
    else:
        params = packed_seq_params_from_doc_ids(doc)
        want = [int(token_cost[shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout=layout).token_index]
                    .sum()) for r in range(cp)]
    assert got.rank_cost.tolist() == want
    assert got.ideal_cost == float(token_cost.sum()) / cp
    total = causal_cost(packed_seq_params_from_doc_ids(doc).cu_seqlens, torch.tensor([0]), torch.tensor([64]),
                        window=window)
    assert int(total) == int(token_cost.sum())


def test_window_changes_the_cost_and_is_checked():
    from cp_packing.cost import causal_cost, choose_layout, layout_cost

    doc = torch.tensor([[1] * 60 + [2] * 4])
    full = layout_cost(doc, cp_size=2, layout="contiguous")
    windowed = layout_cost(doc, cp_size=2, layout="contiguous", window=4)
    assert windowed.imbalance < full.imbalance  # a long document under a small window is no longer quadratic
    assert choose_layout(packed_seq_params_from_doc_ids(doc), cp_size=2, window=4) in ("contiguous", "zigzag",
                                                                                        "balanced")
    with pytest.raises(ValueError, match="window must be >= 1"):
        causal_cost(torch.tensor([0, 4]), torch.tensor([0]), torch.tensor([4]), window=0)
    with pytest.raises(TypeError, match="window must be an int"):
        layout_cost(doc, cp_size=2, layout="contiguous", window="4")
