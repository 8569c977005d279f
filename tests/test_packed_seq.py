"""Tests for cp_packing.packed_seq: doc map -> cu_seqlens / max_seqlen, input checks, FlashAttention kwargs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cp_packing._checks import check_doc_ids
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cp_packing.packed_seq import (
    PackedSeqParams,
    _from_doc_ids_numpy,
    _from_doc_ids_torch,
    packed_seq_params_from_doc_ids,
    to_flash_attention_kwargs,
)

REPO = Path(__file__).resolve().parents[1]

INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
INT_DTYPES += [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]
SIGNED_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64]

PROPERTY = settings(max_examples=80, deadline=None)


# ----------------------------------------------------------------------------------------------------------------
# reference and strategies


def reference(rows: list[list[int]]) -> tuple[list[int], int]:
    """Plain per-row loop: a segment starts at every row start and wherever a token's id differs from the previous
    token's id in the same row. Returns (cu_seqlens, max_seqlen) over the flattened stream."""
    starts = []
    flat_pos = 0
    for row in rows:
        for j, value in enumerate(row):
            if j == 0 or value != row[j - 1]:
                starts.append(flat_pos)
            flat_pos += 1
    cu = starts + [flat_pos]
    max_seqlen = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
    return cu, max_seqlen


@st.composite
def doc_rows(draw, max_b: int = 5, max_s: int = 40, max_value: int = 127) -> list[list[int]]:
    """Rows of runs: random run lengths, ids drawn from a small alphabet (so ids repeat, come back later in a row,
    and the same id often ends one row and starts the next), 0 = padding anywhere."""
    B = draw(st.integers(1, max_b))
    S = draw(st.integers(1, max_s))
    hi = draw(st.sampled_from([2, 4, max_value]))
    rows = []
    for _ in range(B):
        row: list[int] = []
        while len(row) < S:
            value = draw(st.integers(0, hi))
            length = draw(st.integers(1, S))
            row.extend([value] * length)
        rows.append(row[:S])
    return rows


@st.composite
def doc_maps(draw, dtypes=INT_DTYPES) -> tuple[list[list[int]], torch.Tensor]:
    dtype = draw(st.sampled_from(dtypes))
    max_value = min(torch.iinfo(dtype).max, 2**62)
    rows = draw(doc_rows(max_value=max_value))
    largest = max(max(row) for row in rows)
    if draw(st.booleans()) and largest <= 4 and max_value > 1000:  # large ids too, not only small ones
        rows = [[v * (max_value // 4) for v in row] for row in rows]
    return rows, torch.tensor(rows, dtype=torch.int64).to(dtype)


def non_contiguous_views(x: torch.Tensor) -> list[torch.Tensor]:
    """Views equal to ``x`` that are not contiguous: every other column of a wider map, and a transposed store."""
    B, S = x.shape
    wide = torch.zeros(B, 2 * S, dtype=x.dtype)
    wide[:, ::2] = x
    sliced = wide[:, ::2]
    transposed = x.t().contiguous().t()
    views = [sliced, transposed]
    for v in views:
        assert torch.equal(v, x)
    return [v for v in views if not v.is_contiguous()]


# ----------------------------------------------------------------------------------------------------------------
# worked examples (checked by hand)


def test_worked_example_single_row():
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    assert params.cu_seqlens.tolist() == [0, 2, 5, 6]
    assert params.max_seqlen == 3
    assert params.num_segments == 3
    assert params.total_tokens == 6
    assert params.seqlens.tolist() == [2, 3, 1]


def test_boundary_at_every_row_start_even_when_the_id_continues():
    # Row 0 ends with doc 1 and row 1 starts with doc 1: two segments, not one of length 6.
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 1], [1, 1, 2, 2]]))
    assert params.cu_seqlens.tolist() == [0, 4, 6, 8]
    assert params.max_seqlen == 4


def test_an_id_that_comes_back_later_in_a_row_makes_a_new_segment():
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 1]]))
    assert params.cu_seqlens.tolist() == [0, 2, 3, 4]
    assert params.max_seqlen == 2


def test_padding_runs_are_segments_of_their_own():
    params = packed_seq_params_from_doc_ids(torch.tensor([[0, 0, 1, 1, 0, 0, 0]]))
    assert params.cu_seqlens.tolist() == [0, 2, 4, 7]
    assert params.max_seqlen == 3


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8])
def test_empty_map(shape, dtype):
    doc_ids = torch.zeros(shape, dtype=dtype)
    params = packed_seq_params_from_doc_ids(doc_ids)
    assert params.cu_seqlens.tolist() == [0]
    assert params.cu_seqlens.dtype == torch.int32
    assert params.max_seqlen == 0
    assert params.num_segments == 0
    assert params.doc_ids is doc_ids


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_output_types_and_doc_ids_unchanged(dtype):
    doc_ids = torch.tensor([[1, 1, 2, 2, 2, 0], [3, 3, 3, 0, 0, 0]], dtype=dtype)
    before = doc_ids.clone()
    params = packed_seq_params_from_doc_ids(doc_ids)
    assert isinstance(params, PackedSeqParams)
    assert params.cu_seqlens.dtype == torch.int32
    assert params.cu_seqlens.device == doc_ids.device
    assert type(params.max_seqlen) is int
    assert params.doc_ids is doc_ids  # the same object, not a copy
    assert torch.equal(doc_ids, before)
    assert params.cu_seqlens.tolist() == [0, 2, 5, 6, 9, 12]
    assert params.max_seqlen == 3


def test_params_are_frozen():
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 0]]))
    with pytest.raises(AttributeError):
        params.max_seqlen = 7  # type: ignore[misc]


def test_cu_seqlens_does_not_alias_doc_ids():
    doc_ids = torch.tensor([[1, 1, 2, 2]], dtype=torch.int32)
    params = packed_seq_params_from_doc_ids(doc_ids)
    doc_ids.fill_(5)
    assert params.cu_seqlens.tolist() == [0, 2, 4]


# ----------------------------------------------------------------------------------------------------------------
# bad input


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match=r"got list.*torch\.as_tensor"):
        packed_seq_params_from_doc_ids([[1, 1, 2]])
    with pytest.raises(TypeError, match=r"got ndarray"):
        packed_seq_params_from_doc_ids(np.array([[1, 1, 2]]))


def test_sparse_tensor_is_a_type_error():
    with pytest.raises(TypeError, match=r"layout torch\.sparse_coo.*to_dense\(\)"):
        packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 0]]).to_sparse())


@pytest.mark.parametrize("shape", [(6,), (1, 2, 3), ()])
def test_not_2d_is_a_value_error(shape):
    doc_ids = torch.ones(shape, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(f"got shape {tuple(shape)}") + r".*unsqueeze\(0\)"):
        packed_seq_params_from_doc_ids(doc_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool,
                                   torch.complex64])
def test_non_integer_dtype_is_a_type_error(dtype):
    doc_ids = torch.ones(2, 3, dtype=dtype)
    with pytest.raises(TypeError, match=rf"got {dtype}.*doc_ids\.to\(torch\.int32\)"):
        packed_seq_params_from_doc_ids(doc_ids)


@pytest.mark.parametrize("dtype", SIGNED_DTYPES)
@pytest.mark.parametrize("path", ["public", "torch"])
def test_negative_index_is_a_value_error(dtype, path):
    doc_ids = torch.tensor([[1, 1, 2, 2], [1, -3, -3, 0]], dtype=dtype)
    fn = packed_seq_params_from_doc_ids if path == "public" else _from_doc_ids_torch
    with pytest.raises(ValueError, match=r"negative document index \(-3\).*1-based with 0 for padding"):
        fn(doc_ids)


@PROPERTY
@given(maps=doc_maps(dtypes=SIGNED_DTYPES), data=st.data())
def test_a_negative_value_anywhere_is_found(maps, data):
    """The sign check must see every token, including the last one, one inside a run, and a row start."""
    rows, x = maps
    B, S = x.shape
    b = data.draw(st.integers(0, B - 1))
    j = data.draw(st.integers(0, S - 1))
    neg = data.draw(st.integers(max(torch.iinfo(x.dtype).min, -(2**62)), -1))
    x[b, j] = neg
    expected_min = min(min(r) for r in x.tolist())
    for fn in (packed_seq_params_from_doc_ids, _from_doc_ids_torch):
        with pytest.raises(ValueError, match=rf"\({expected_min}\)"):
            fn(x)
    for view in non_contiguous_views(x):
        with pytest.raises(ValueError, match=rf"\({expected_min}\)"):
            packed_seq_params_from_doc_ids(view)


def test_more_tokens_than_int32_can_index_is_a_value_error():
    # 2**16 * (2**15 + 1) = 2**31 + 2**16 tokens, as a broadcast view over ONE byte: no 2 GiB allocation.
    doc_ids = torch.zeros(1, 1, dtype=torch.int8).expand(2**16, 2**15 + 1)
    assert doc_ids.numel() > 2**31 - 1
    with pytest.raises(ValueError, match=rf"{doc_ids.numel()} tokens.*\(2147483647\).*split the batch"):
        packed_seq_params_from_doc_ids(doc_ids)


def test_exactly_int32_max_tokens_passes_the_size_check():
    # The limit is inclusive: cu_seqlens[-1] == T == 2**31 - 1 still fits int32 (checked on a view, not computed).
    check_doc_ids(torch.zeros(1, 1, dtype=torch.int8).expand(1, 2**31 - 1))


def test_to_flash_attention_kwargs_rejects_other_types():
    doc_ids = torch.tensor([[1, 1, 0]])
    for bad in (doc_ids, {"cu_seqlens": doc_ids}, None):
        with pytest.raises(TypeError, match=r"expects PackedSeqParams.*packed_seq_params_from_doc_ids"):
            to_flash_attention_kwargs(bad)


# ----------------------------------------------------------------------------------------------------------------
# properties against the reference


@PROPERTY
@given(maps=doc_maps())
def test_numpy_and_torch_paths_equal_the_reference(maps):
    rows, x = maps
    cu_ref, max_ref = reference(rows)
    params = packed_seq_params_from_doc_ids(x)
    assert params.cu_seqlens.dtype == torch.int32
    assert params.cu_seqlens.tolist() == cu_ref
    assert params.max_seqlen == max_ref
    assert params.doc_ids is x
    # invariants a consumer relies on: starts at 0, strictly increasing, ends at B*S, max is the longest segment
    cu = params.cu_seqlens
    assert cu[0] == 0 and cu[-1] == x.numel()
    assert bool((cu[1:] > cu[:-1]).all())
    assert params.max_seqlen == int(params.seqlens.max())
    for fn in (_from_doc_ids_numpy, _from_doc_ids_torch):
        cu_path, max_path = fn(x)
        assert cu_path.dtype == torch.int32
        assert cu_path.tolist() == cu_ref, fn.__name__
        assert max_path == max_ref and type(max_path) is int, fn.__name__


@PROPERTY
@given(maps=doc_maps())
def test_non_contiguous_inputs_equal_the_reference(maps):
    rows, x = maps
    cu_ref, max_ref = reference(rows)
    for view in non_contiguous_views(x):
        before = view.clone()
        params = packed_seq_params_from_doc_ids(view)
        assert params.cu_seqlens.tolist() == cu_ref
        assert params.max_seqlen == max_ref
        assert params.doc_ids is view
        assert torch.equal(view, before)
        cu_t, max_t = _from_doc_ids_torch(view)
        assert cu_t.tolist() == cu_ref and max_t == max_ref


@PROPERTY
@given(maps=doc_maps())
def test_flash_attention_kwargs(maps):
    _, x = maps
    params = packed_seq_params_from_doc_ids(x)
    kwargs = to_flash_attention_kwargs(params)
    assert set(kwargs) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert kwargs["cu_seq_lens_q"] is params.cu_seqlens
    assert kwargs["cu_seq_lens_k"] is params.cu_seqlens
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == params.max_seqlen
    assert type(kwargs["max_length_q"]) is int


# ----------------------------------------------------------------------------------------------------------------
# attention: per-segment causal attention from cu_seqlens == full attention under the doc-map mask


def doc_map_mask(rows: list[list[int]]) -> torch.Tensor:
    """bool [T, T], built from the doc map only: token i may attend j iff same row, j <= i, and every token from j
    to i has the same id (no segment boundary between them)."""
    B, S = len(rows), len(rows[0])
    T = B * S
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for b, row in enumerate(rows):
        for i in range(S):
            j = i
            while j >= 0 and row[j] == row[i]:
                allowed[b * S + i, b * S + j] = True
                j -= 1
    return allowed


def cu_seqlens_mask(cu: list[int], T: int) -> torch.Tensor:
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for a, b in zip(cu[:-1], cu[1:]):
        allowed[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return allowed


@settings(max_examples=60, deadline=None)
@given(rows=doc_rows(max_b=4, max_s=16, max_value=3), seed=st.integers(0, 2**31 - 1))
@example(rows=[[1, 1, 2, 2], [2, 2, 1, 1]], seed=0)  # doc 2 ends row 0 and starts row 1
@example(rows=[[1, 1, 1, 1], [1, 1, 2, 2]], seed=1)
@example(rows=[[0, 0, 0], [0, 0, 0]], seed=2)  # padding rows only
def test_segment_attention_equals_masked_full_attention(rows, seed):
    B, S = len(rows), len(rows[0])
    T, H, D = B * S, 2, 8
    params = packed_seq_params_from_doc_ids(torch.tensor(rows, dtype=torch.int32))
    cu = params.cu_seqlens.tolist()

    mask = doc_map_mask(rows)
    assert torch.equal(cu_seqlens_mask(cu, T), mask)  # the segments are exactly the attention blocks

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, H, T, D, dtype=torch.float64, generator=gen) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [1, H, T, D]

    per_segment = torch.empty_like(full)
    for a, b in zip(cu[:-1], cu[1:]):
        assert b - a <= params.max_seqlen
        per_segment[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                                is_causal=True)
    torch.testing.assert_close(per_segment, full, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------------------
# packaging and the benchmark script


def test_import_pulls_no_optional_dependency():
    code = (
        "import cp_packing, sys; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'transformers', 'flash_attn', 'ring_flash_attn'}); "
        "assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr


def test_benchmark_script_runs():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_packed_seq.py"), "--quick"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "base/ours" in result.stdout


def test_hand_built_params_are_checked_against_their_map_everywhere():
    """A segment spanning two documents (or cut inside one), or params edited in place, were accepted by the
    sharding, the cost model and the seed's kwargs: documents attended across each other (issue 21)."""
    import pytest

    from cp_packing import PackedSeqParams, layout_cost, shard_packed_seq_params, to_flash_attention_kwargs

    spans = PackedSeqParams(torch.tensor([0, 8], dtype=torch.int32), 8, torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]))
    cut = PackedSeqParams(torch.tensor([0, 2, 8], dtype=torch.int32), 6, torch.ones(1, 8, dtype=torch.int64))
    short = PackedSeqParams(torch.tensor([0, 3], dtype=torch.int32), 99, torch.ones(1, 8, dtype=torch.int64))
    decreasing = PackedSeqParams(torch.tensor([0, 6, 4, 8], dtype=torch.int32), 6, torch.ones(1, 8, dtype=torch.int64))
    calls = (lambda p: shard_packed_seq_params(p, cp_size=2, cp_rank=0, layout="contiguous"),
             to_flash_attention_kwargs, lambda p: layout_cost(p, cp_size=2, layout="contiguous"))
    for params, words in ((spans, "a document boundary of the map"), (cut, "a boundary inside one document"),
                          (short, "ends at 3 but the doc map has B\\*S = 8"), (decreasing, "never decrease")):
        for call in calls:
            with pytest.raises(ValueError, match=words):
                call(params)
    edited = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1]]))
    edited.doc_ids[0, 4:] = 2  # in place, after the params were built
    with pytest.raises(ValueError, match="rebuild them after editing doc_ids"):
        shard_packed_seq_params(edited, cp_size=2, cp_rank=0, layout="contiguous")


def test_obscure_inputs_get_a_clear_error():
    import pytest

    from cp_packing import packed_cross_entropy, shard_packed_seq_params
    from cp_packing.options import AttentionOptions

    with pytest.raises(ValueError, match="softcap must be a number, got nan|softcap must be a finite number"):
        AttentionOptions(softcap=float("nan"))
    with pytest.raises(ValueError, match="vocabulary of 0 classes"):
        packed_cross_entropy(torch.zeros(4, 0), torch.zeros(4, dtype=torch.int64))
    s = shard_packed_seq_params(packed_seq_params_from_doc_ids(torch.ones(1, 8, dtype=torch.int64)), cp_size=2,
                                cp_rank=0, layout="contiguous")
    with pytest.raises(ValueError, match="same trailing shape"):
        s.unshard([torch.zeros(4, 3), torch.zeros(4, 2)])
