"""Sharding: every token on exactly one rank, exact shard/unshard, metadata in the consumers' conventions, and
causal attention from each rank's local metadata equal to full per-segment attention."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_packing.packed_seq import packed_seq_params_from_doc_ids, to_flash_attention_kwargs
from cp_packing.adapters import ring_flash_attn_kwargs, transformer_engine_kwargs
from cp_packing.sharding import ShardedPackedSeqParams, shard_packed_seq_params
from cp_packing.testing import synthetic_doc_ids
from tests.maps import assert_local_attention_equals_full, doc_maps, segments_of

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CP_SIZES = [1, 2, 3, 4, 8]


def _maps_for(layout: str):
    """(doc map, cp) pairs valid for the layout."""

    @st.composite
    def strat(draw):
        cp = draw(st.sampled_from(CP_SIZES))
        if layout == "zigzag":
            return draw(doc_maps(multiple=2 * cp, max_s=8 * 2 * cp)), cp
        doc_ids = draw(doc_maps(max_s=40))
        B, S = doc_ids.shape
        S2 = math.ceil(S / cp) * cp  # make B*S a multiple of cp by padding rows
        out = torch.zeros(B, S2, dtype=doc_ids.dtype)
        out[:, :S] = doc_ids
        return out, cp

    return strat()


def _shards(doc_ids, cp, layout):
    params = packed_seq_params_from_doc_ids(doc_ids)
    return params, [shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout=layout) for r in range(cp)]


def _reference_positions(doc_ids):
    pos = torch.zeros(doc_ids.numel(), dtype=torch.int64)
    for start, end in segments_of(doc_ids):
        pos[start:end] = torch.arange(end - start)
    return pos


def _reference_zigzag_index(doc_ids, cp, rank):
    out = []
    for start, end in segments_of(doc_ids):
        c = (end - start) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out += range(start + chunk * c, start + (chunk + 1) * c)
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_partition_and_roundtrip(layout):
    @SETTINGS
    @given(_maps_for(layout))
    def check(case):
        doc_ids, cp = case
        params, shards = _shards(doc_ids, cp, layout)
        T = doc_ids.numel()
        # every global token on exactly one rank, the same count everywhere
        assert all(s.num_local_tokens == T // cp for s in shards)
        allidx = torch.cat([s.token_index for s in shards])
        assert torch.equal(allidx.sort().values, torch.arange(T))
        # local doc ids and positions are the global ones at token_index
        ref_pos = _reference_positions(doc_ids)
        for s in shards:
            assert torch.equal(s.doc_ids, doc_ids.reshape(-1)[s.token_index])
            assert torch.equal(s.position_ids, ref_pos[s.token_index])
        # shard -> unshard is the identity, for [B, S] and [B, S, ...] and flat inputs
        x = torch.randn(*doc_ids.shape, 3)
        assert torch.equal(shards[0].unshard([s.shard(x) for s in shards]), x)
        assert torch.equal(shards[0].unshard([s.shard(doc_ids.reshape(-1)) for s in shards]), doc_ids)

    check()


@SETTINGS
@given(_maps_for("zigzag"))
def test_zigzag_placement_and_metadata(case):
    doc_ids, cp = case
    params, shards = _shards(doc_ids, cp, "zigzag")
    for r, s in enumerate(shards):
        assert torch.equal(s.token_index, _reference_zigzag_index(doc_ids, cp, r))
        # runs are maximal: two per segment, one on the last rank (its chunks cp-1 and cp touch)
        assert s.cu_seqlens.numel() - 1 == params.num_segments * (1 if r == cp - 1 else 2)
        assert s.cu_seqlens.dtype == torch.int32 and int(s.cu_seqlens[-1]) == s.num_local_tokens
        # ring-flash-attn zigzag varlen / TE THD convention, from the adapters
        kw = ring_flash_attn_kwargs(s)
        assert set(kw) == {"cu_seqlens", "max_seqlen"} and kw["cu_seqlens"].dtype == torch.int32
        assert torch.equal(kw["cu_seqlens"], params.cu_seqlens // cp)
        assert kw["max_seqlen"] == params.max_seqlen // cp
        with pytest.raises(TypeError, match="context-parallel shard"):
            to_flash_attention_kwargs(s)  # the local tokens alone would attend to the wrong keys
        te = transformer_engine_kwargs(s)
        assert te["cu_seqlens_q"] is params.cu_seqlens


@SETTINGS
@given(_maps_for("contiguous"))
def test_contiguous_placement_and_metadata(case):
    doc_ids, cp = case
    params, shards = _shards(doc_ids, cp, "contiguous")
    T_local = doc_ids.numel() // cp
    for r, s in enumerate(shards):
        assert torch.equal(s.token_index, torch.arange(r * T_local, (r + 1) * T_local))
        kw = ring_flash_attn_kwargs(s)
        assert s.cu_seqlens.dtype == torch.int32 and kw["cu_seqlens_k"].dtype == torch.int32
        assert int(s.cu_seqlens[-1]) == T_local and kw["cu_seqlens_q"] is s.cu_seqlens
        assert kw["local_k_slice"].stop == (r + 1) * T_local
        assert int(kw["cu_seqlens_k"][-1]) == kw["local_k_slice"].stop - kw["local_k_slice"].start


def test_contiguous_matches_llama3_worked_example():
    """DESIGN.md: llama3_flash_attn_prepare_cu_seqlens([0,7,14,16], True, rank=1, world_size=4)."""
    doc_ids = torch.tensor([[1] * 7 + [2] * 7 + [3] * 2])
    s = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc_ids), cp_size=4, cp_rank=1, layout="contiguous")
    kw = ring_flash_attn_kwargs(s)
    assert kw["cu_seqlens_q"].tolist() == [0, 3, 4]
    assert kw["cu_seqlens_k"].tolist() == [0, 7, 8]
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (3, 7)
    assert kw["local_k_slice"] == slice(0, 8)


def test_contiguous_equals_real_llama3_prepare(ring_flash_attn):
    """The metadata equals what ring-flash-attn's own llama3_flash_attn_prepare_cu_seqlens returns."""
    prepare = ring_flash_attn.llama3_flash_attn_prepare_cu_seqlens

    @SETTINGS
    @given(_maps_for("contiguous"))
    def check(case):
        doc_ids, cp = case
        params, shards = _shards(doc_ids, cp, "contiguous")
        for r, s in enumerate(shards):
            cu_q, cu_k, max_q, max_k, k_slice = prepare(params.cu_seqlens.clone(), True, r, cp)
            kw = ring_flash_attn_kwargs(s)
            assert kw["cu_seqlens_q"].tolist() == cu_q.tolist()
            assert kw["cu_seqlens_k"].tolist() == cu_k.tolist()
            assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (max_q, max_k)
            assert kw["local_k_slice"] == k_slice

    check()


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_local_metadata_attention_equals_full_attention(layout):
    """Causal attention from each rank's local metadata equals full attention per segment, so no token attends
    across a document or a shard edge."""

    @SETTINGS
    @given(_maps_for(layout))
    def check(case):
        doc_ids, cp = case
        assert_local_attention_equals_full(doc_ids, _shards(doc_ids, cp, layout)[1])

    check()


def test_zigzag_rejects_indivisible_segment_with_named_segment():
    doc_ids = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0]])  # segment 1: positions 4..6, length 3
    params = packed_seq_params_from_doc_ids(doc_ids)
    with pytest.raises(ValueError, match=r"segment 1 \(positions 4\.\.6\) has length 3.*2\*cp_size=4.*pad_segments"):
        shard_packed_seq_params(params, cp_size=2, cp_rank=0, layout="zigzag")


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"cp_size": 0, "cp_rank": 0}, ValueError, "cp_size must be >= 1"),
        ({"cp_size": 2.0, "cp_rank": 0}, TypeError, "cp_size must be an int"),
        ({"cp_size": 2, "cp_rank": 2}, ValueError, r"cp_rank must be in \[0, cp_size=2\)"),
        ({"cp_size": 2, "cp_rank": -1}, ValueError, "cp_rank must be in"),
        ({"cp_size": 2, "cp_rank": True}, TypeError, "cp_rank must be an int"),
        ({"cp_size": 2, "cp_rank": 0, "layout": "stripe"}, ValueError, "unknown layout 'stripe'"),
        ({"cp_size": 3, "cp_rank": 0, "layout": "contiguous"}, ValueError, "T = B\\*S = 8 tokens, not divisible by cp_size=3"),
    ],
)
def test_bad_arguments(kwargs, exc, pattern):
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2], [1, 1, 1, 1]]))
    with pytest.raises(exc, match=pattern):
        shard_packed_seq_params(params, **kwargs)


def test_bad_params_and_tensors():
    with pytest.raises(TypeError, match="PackedSeqParams"):
        shard_packed_seq_params(torch.ones(2, 4), cp_size=2, cp_rank=0)
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2], [1, 1, 1, 1]]))
    s = shard_packed_seq_params(params, cp_size=2, cp_rank=0, layout="contiguous")
    with pytest.raises(ValueError, match=r"shape \(3, 4\).*\[2, 4, \.\.\.\]"):
        s.shard(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="cp_size=2 tensors"):
        s.unshard([torch.zeros(4)])
    with pytest.raises(ValueError, match=r"part 1 has shape \(3,\)"):
        s.unshard([torch.zeros(4), torch.zeros(3)])
    with pytest.raises(ValueError, match="no kernel for layout"):
        ring_flash_attn_kwargs(_fake_layout(s, "balanced"))
    with pytest.raises(ValueError, match="needs layout='zigzag'"):
        transformer_engine_kwargs(s)


def _fake_layout(s: ShardedPackedSeqParams, layout: str) -> ShardedPackedSeqParams:
    import dataclasses

    return dataclasses.replace(s, layout=layout)


def test_sharded_is_frozen_and_deterministic():
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]))
    a = shard_packed_seq_params(params, cp_size=2, cp_rank=1, layout="zigzag")
    b = shard_packed_seq_params(params, cp_size=2, cp_rank=1, layout="zigzag")
    assert torch.equal(a.token_index, b.token_index) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    with pytest.raises(Exception):
        a.cp_rank = 0  # frozen


def test_step_plan_survives_input_tree_mapping():
    """FSDP2 (cast_forward_inputs) and similar utilities rebuild dataclasses and dicts when they copy a module's
    inputs; the step plan (agreement, key tables) is one object that every copy shares, or every layer (an FSDP
    unit each) would prepare and agree again."""
    from torch.distributed.utils import _apply_to_tensors

    from cp_packing.attention import prepare_attention

    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2, 2, 2, 0, 0]]))
    s = prepare_attention(shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="contiguous"))
    # what FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) applies to every tensor among the inputs
    copy = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, {"cp_sharded": s})
    assert copy["cp_sharded"] is not s and copy["cp_sharded"].plan is s.plan
    assert torch.equal(copy["cp_sharded"].global_token_order(), s.global_token_order())


def test_cache_is_not_reused_by_a_copy_with_other_metadata():
    """dataclasses.replace shares the cache object; a copy holding another batch's metadata must not read the
    original's cached token order (unshard would put tokens in the wrong places)."""
    import dataclasses

    a = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]))
    b = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1]]))
    sa = shard_packed_seq_params(a, cp_size=2, cp_rank=0, layout="zigzag")
    sb = [shard_packed_seq_params(b, cp_size=2, cp_rank=r, layout="zigzag") for r in range(2)]
    sa.global_token_order()
    fields = {f: getattr(sb[0], f) for f in ("global_params", "token_index", "doc_ids", "position_ids", "cu_seqlens",
                                              "max_seqlen", "key_start")}
    sc = dataclasses.replace(sa, **fields)
    assert torch.equal(sc.global_token_order(), sb[0].global_token_order())
    x = torch.arange(8)
    assert torch.equal(sc.unshard([s.shard(x) for s in sb]).reshape(-1), x)


def test_flat_input_with_one_token_rows():
    """With S == 1 a flat [T, 1, D] tensor (one head) looks like [B, S, D]: flat=True says which it is."""
    params = packed_seq_params_from_doc_ids(torch.tensor([[1], [2], [3], [4]]))
    s = shard_packed_seq_params(params, cp_size=2, cp_rank=1, layout="contiguous")
    q = torch.randn(4, 1, 5)
    assert s.shard(q, flat=True).shape == (2, 1, 5)
    assert torch.equal(s.shard(q, flat=True), q[2:])
    assert s.shard(q).shape == (2, 5)  # the default reads [B, S, ...] when the first dims match
    with pytest.raises(ValueError, match=r"expected flat \[B\*S, \.\.\.\] = \[4, \.\.\.\]"):
        s.shard(torch.randn(3, 5), flat=True)
    with pytest.raises(ValueError, match=r"expected \[B, S, \.\.\.\] = \[4, 1, \.\.\.\]"):
        s.shard(torch.randn(4, 5), flat=False)


def test_metadata_objects_compare_by_identity():
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2]]))
    assert params == params and params != packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2]]))
    s = shard_packed_seq_params(params, cp_size=2, cp_rank=0, layout="contiguous")
    assert s == s and s in [s]


@pytest.mark.parametrize(
    "cu, exc, pattern",
    [
        ([0, 4], TypeError, "must be a torch.Tensor"),
        (torch.tensor([0.0, 4.0]), TypeError, "integer tensor"),
        (torch.tensor([[0, 4]]), ValueError, "1-D"),
        (torch.tensor([0, 6, 2, 8]), ValueError, "never decrease"),
        (torch.tensor([1, 8]), ValueError, "start at 0"),
    ],
)
def test_layout_runs_rejects_bad_cu_seqlens(cu, exc, pattern):
    from cp_packing.layouts import layout_runs

    with pytest.raises(exc, match=pattern):
        layout_runs(cu, cp_size=2, cp_rank=0, layout="contiguous")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int16])
def test_unsigned_doc_maps_shard_and_unshard(dtype):
    """Every integer dtype the seed accepts shards: doc_ids keep the map's dtype and the values, bit for bit."""
    doc_ids = torch.tensor([[1, 1, 2, 2, 2, 2, 3, 0], [1, 1, 1, 1, 2, 2, 0, 0]]).to(dtype)
    params = packed_seq_params_from_doc_ids(doc_ids)
    for layout in ("contiguous", "balanced", "auto"):
        shards = [shard_packed_seq_params(params, cp_size=2, cp_rank=r, layout=layout) for r in range(2)]
        for s in shards:
            assert s.doc_ids.dtype == dtype
            assert torch.equal(s.doc_ids.long(), doc_ids.reshape(-1).long()[s.token_index])
        assert torch.equal(shards[0].unshard([s.shard(doc_ids) for s in shards]), doc_ids)


def test_hand_built_params_are_validated_where_they_enter():
    """A PackedSeqParams built by hand is checked: a cu_seqlens that stops short would give shards that share a
    token and lose another, silently."""
    import dataclasses

    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]])
    good = packed_seq_params_from_doc_ids(doc_ids)
    short = dataclasses.replace(good, cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32), max_seqlen=3)
    with pytest.raises(ValueError, match="ends at 6 but the doc map has B\\*S = 8 tokens"):
        shard_packed_seq_params(short, cp_size=2, cp_rank=0, layout="contiguous")
    wrong_max = dataclasses.replace(good, max_seqlen=4)
    with pytest.raises(ValueError, match="max_seqlen is 4 but the longest segment .* has 5 tokens"):
        shard_packed_seq_params(wrong_max, cp_size=2, cp_rank=0)
    two_rows = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]]))
    merged = dataclasses.replace(two_rows, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), max_seqlen=8)
    with pytest.raises(ValueError, match="no boundary at the start of row 1"):
        shard_packed_seq_params(merged, cp_size=2, cp_rank=0)
    decreasing = dataclasses.replace(good, cu_seqlens=torch.tensor([0, 5, 3, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="never decrease"):
        shard_packed_seq_params(decreasing, cp_size=2, cp_rank=0)
    with pytest.raises(TypeError, match="params must be PackedSeqParams"):
        shard_packed_seq_params(doc_ids, cp_size=2, cp_rank=0)


def test_default_layout_works_on_any_batch():
    """The library default ('auto') works on an unpadded batch, where zigzag would refuse."""
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 3, 3, 3]]))
    shards = [shard_packed_seq_params(params, cp_size=2, cp_rank=r) for r in range(2)]
    assert shards[0].layout in ("contiguous", "balanced")
    assert sorted(torch.cat([s.token_index for s in shards]).tolist()) == list(range(8))


def test_cp_rank_none_is_a_clear_type_error():
    """cp_rank=None used to reach the index math ('unsupported operand type(s) for *')."""
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2]]))
    for layout in ("contiguous", "zigzag", "balanced", "auto"):
        with pytest.raises(TypeError, match="cp_rank must be an int in \\[0, cp_size=2\\), got None"):
            shard_packed_seq_params(params, cp_size=2, cp_rank=None, layout=layout)


def test_the_window_a_shard_was_planned_for_follows_it():
    """shard_packed_seq_params(window=) plans balanced for the window and keeps it (``plan_window``): every rank's
    order (``global_token_order``, used by unshard and the all-gather) is that plan's; a list and a tuple of the same
    windows give the same shard; contiguous and zigzag do not depend on the window."""
    from cp_packing.layouts import layout_token_index

    doc_ids = synthetic_doc_ids("huge", 1, 2048, seed=2)
    params = packed_seq_params_from_doc_ids(doc_ids)
    cu = params.cu_seqlens
    shards = [shard_packed_seq_params(params, cp_size=4, cp_rank=r, layout="balanced", window=[64, None])
              for r in range(4)]
    want = torch.stack([layout_token_index(cu, cp_size=4, cp_rank=r, layout="balanced", window=(64, None))
                        for r in range(4)])
    assert torch.equal(torch.stack([s.token_index for s in shards]), want)
    assert torch.equal(shards[0].global_token_order(), want)
    assert not torch.equal(want[0], layout_token_index(cu, cp_size=4, cp_rank=0, layout="balanced"))
    x = torch.randn(doc_ids.numel(), 2)
    assert torch.equal(shards[0].unshard([s.shard(x) for s in shards]), x.reshape(1, 2048, 2))
    for layout in ("contiguous", "balanced"):
        a = shard_packed_seq_params(params, cp_size=4, cp_rank=1, layout=layout, window=[64, None])
        b = shard_packed_seq_params(params, cp_size=4, cp_rank=1, layout=layout, window=(64, None))
        assert a.plan_window == b.plan_window == (64, None) and torch.equal(a.token_index, b.token_index)
    for layout in ("contiguous", "zigzag"):
        padded = packed_seq_params_from_doc_ids(torch.tensor([[1] * 24 + [2] * 8]))  # segments % 8 == 0
        plain = shard_packed_seq_params(padded, cp_size=4, cp_rank=1, layout=layout)
        windowed = shard_packed_seq_params(padded, cp_size=4, cp_rank=1, layout=layout, window=8)
        assert plain.plan_window is None and windowed.plan_window == 8
        assert torch.equal(plain.token_index, windowed.token_index)
