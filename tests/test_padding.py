"""Tests for cp_packing.padding: every segment becomes a multiple of m, real tokens compute the same thing."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.padding import PaddedBatch, pad_segments
from tests.maps import runs_of_row

SETTINGS = settings(max_examples=60, deadline=None)


# ---------------------------------------------------------------- strategies and plain-Python references


@st.composite
def doc_maps(draw, max_b: int = 4, max_s: int = 14):
    """``[B, S]`` maps built from runs of ids 0..3: padding anywhere, ids reused, B and S down to 1."""
    B = draw(st.integers(1, max_b))
    S = draw(st.integers(1, max_s))
    rows = []
    for _ in range(B):
        row: list[int] = []
        while len(row) < S:
            value = draw(st.integers(0, 3))
            row += [value] * draw(st.integers(1, 6))
        rows.append(row[:S])
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.uint8]))
    return torch.tensor(rows, dtype=dtype)


def reference_layout(doc_ids: torch.Tensor, m: int):
    """Independent per-row loop: the documented layout. Returns (rows of new doc ids, index rows, added, sep)."""
    new_rows, index_rows, added, sep = [], [], 0, 0
    for row in doc_ids.tolist():
        runs = runs_of_row(row)
        new, idx = [], [-1] * len(row)
        for k, (value, start, end) in enumerate(runs):
            if value != 0:
                for s in range(start, end):
                    idx[s] = len(new)
                    new.append(value)
                pad = math.ceil((end - start) / m) * m - (end - start)
                new += [value] * pad
                added += pad
            elif 0 < k < len(runs) - 1 and runs[k - 1][0] == runs[k + 1][0]:
                new += [0] * m
                sep += m
        new_rows.append(new)
        index_rows.append(idx)
    return new_rows, index_rows, added, sep


def seglens(doc_ids: torch.Tensor) -> list[int]:
    return packed_seq_params_from_doc_ids(doc_ids).seqlens.tolist()


def causal_attention_per_segment(q, k, v, cu):
    """Reference: causal softmax attention inside each ``[cu[i], cu[i+1])`` segment. q/k/v ``[T, H, D]``."""
    out = torch.zeros_like(q)
    cu = cu.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) / math.sqrt(q.shape[-1])
        mask = torch.ones(b - a, b - a, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v[a:b])
    return out


def relay_with_random_pads(batch: PaddedBatch, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Re-lay ``x`` ``[B, S, ...]`` with RANDOM values on every added token (pads must not matter)."""
    Sp = batch.padded_length
    B = x.shape[0]
    noise = torch.randn(B, Sp, *x.shape[2:], generator=gen, dtype=x.dtype)
    return torch.where(batch.is_pad.view(B, Sp, *([1] * (x.dim() - 2))), noise, batch.pad_tensor(x))


def row_length_choice(draw, doc_ids, m):
    """None, or a legal exact row length (the minimum or more)."""
    new_rows, *_ = reference_layout(doc_ids, m)
    need = max(len(r) for r in new_rows)
    extra = draw(st.sampled_from([None, 0, 1, 2]))
    return need, None if extra is None else need + extra * m


# ---------------------------------------------------------------- properties


@SETTINGS
@given(doc_maps(), st.integers(1, 6), st.data())
def test_every_segment_is_a_multiple_and_layout_matches_reference(doc_ids, m, data):
    need, row_length = row_length_choice(data.draw, doc_ids, m)
    out = pad_segments(doc_ids, multiple=m, row_length=row_length)
    B, S = doc_ids.shape
    Sp = out.padded_length
    assert Sp % m == 0
    assert Sp == (need if row_length is None else row_length)
    assert all(L % m == 0 for L in seglens(out.doc_ids)), out.doc_ids
    assert out.doc_ids.dtype == doc_ids.dtype and out.doc_ids.shape == (B, Sp)
    # exactly the documented layout (independent loop), row-end padding up to S'
    new_rows, index_rows, added, sep = reference_layout(doc_ids, m)
    expected = torch.tensor([r + [0] * (Sp - len(r)) for r in new_rows], dtype=doc_ids.dtype).view(B, Sp)
    assert torch.equal(out.doc_ids, expected)
    expected_index = torch.tensor(
        [[-1 if i < 0 else b * Sp + i for i in row] for b, row in enumerate(index_rows)], dtype=torch.int64
    ).view(B, S)
    assert torch.equal(out.index, expected_index)
    # counts
    real = int((doc_ids != 0).sum())
    assert out.num_real_tokens == real
    assert out.num_added_tokens == added
    assert out.num_separator_tokens == sep
    assert out.num_dropped_tokens == B * S - real
    assert int((~out.is_pad).sum()) == real
    assert out.overhead == (added / real if real else 0.0)
    # segments of real tokens: no real token shares a segment with a token of another original segment
    orig_seg = torch.repeat_interleave(
        torch.arange(len(seglens(doc_ids))), torch.tensor(seglens(doc_ids), dtype=torch.int64)
    )
    new_seg = torch.repeat_interleave(
        torch.arange(len(seglens(out.doc_ids))), torch.tensor(seglens(out.doc_ids), dtype=torch.int64)
    )
    real_mask = out.index.view(-1) >= 0
    pairs = set(zip(orig_seg[real_mask].tolist(), new_seg[out.index.view(-1)[real_mask]].tolist()))
    assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs)  # a bijection of segments


@SETTINGS
@given(doc_maps(), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_real_tokens_keep_order_and_content(doc_ids, m, seed):
    g = torch.Generator().manual_seed(seed)
    B, S = doc_ids.shape
    pad = doc_ids == 0
    tensors = {
        "input_ids": torch.randint(1, 1000, (B, S), generator=g),
        "labels": torch.randint(0, 1000, (B, S), generator=g).masked_fill(pad, -100),
        "features": torch.randn(B, S, 2, 3, generator=g),
        "mask": torch.rand(B, S, generator=g) > 0.5,
    }
    out = pad_segments(doc_ids, multiple=m, tensors=tensors)
    real = ~pad
    for name, x in tensors.items():
        y = out.tensors[name]
        assert y.shape == (B, out.padded_length, *x.shape[2:]) and y.dtype == x.dtype
        back = out.unpad(y)
        assert torch.equal(back[real], x[real]), name
        assert not back[pad].any(), name  # original padding comes back as fill_value (0)
        # added tokens: labels ignore_index, others 0
        added = y[out.is_pad]
        assert torch.equal(added, torch.full_like(added, -100 if name == "labels" else 0)), name
    # doc map restricted to real tokens equals the original's real tokens, row by row, in order
    for b in range(B):
        assert torch.equal(out.doc_ids[b][~out.is_pad[b]], doc_ids[b][real[b]])
        idx = out.index[b][real[b]]
        assert torch.all(idx[1:] > idx[:-1])
        assert torch.all(idx // out.padded_length == b)
    # the flat [B*S'] and [1, B*S'] forms unpad the same way
    ids = out.tensors["input_ids"]
    assert torch.equal(out.unpad(ids.reshape(-1)), out.unpad(ids))
    assert torch.equal(out.unpad(ids.reshape(1, -1), fill_value=-1)[real], tensors["input_ids"][real])


@settings(max_examples=40, deadline=None)
@given(doc_maps(max_b=3, max_s=12), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_causal_attention_of_real_tokens_unchanged(doc_ids, m, seed):
    g = torch.Generator().manual_seed(seed)
    B, S = doc_ids.shape
    H, D = 2, 4
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    out = pad_segments(doc_ids, multiple=m)
    qp, kp, vp = (relay_with_random_pads(out, x, g) for x in (q, k, v))
    Sp = out.padded_length
    ref = causal_attention_per_segment(
        q.view(B * S, H, D),
        k.view(B * S, H, D),
        v.view(B * S, H, D),
        packed_seq_params_from_doc_ids(doc_ids).cu_seqlens,
    )
    got = causal_attention_per_segment(
        qp.view(B * Sp, H, D),
        kp.view(B * Sp, H, D),
        vp.view(B * Sp, H, D),
        packed_seq_params_from_doc_ids(out.doc_ids).cu_seqlens,
    )
    real = (doc_ids != 0).view(-1)
    back = out.unpad(got.view(B, Sp, H, D)).view(B * S, H, D)
    torch.testing.assert_close(back[real], ref[real], atol=1e-5, rtol=0)


@SETTINGS
@given(doc_maps(), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_loss_unchanged(doc_ids, m, seed):
    g = torch.Generator().manual_seed(seed)
    B, S = doc_ids.shape
    V = 7
    pad = doc_ids == 0
    labels = torch.randint(0, V, (B, S), generator=g)
    labels = labels.masked_fill(pad | (torch.rand(B, S, generator=g) < 0.2), -100)
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    out = pad_segments(doc_ids, multiple=m, tensors={"labels": labels})
    logits_p = relay_with_random_pads(out, logits, g)
    labels_p = out.tensors["labels"]
    assert int((labels_p != -100).sum()) == int((labels != -100).sum())
    if int((labels != -100).sum()) == 0:
        return
    before = torch.nn.functional.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
    after = torch.nn.functional.cross_entropy(logits_p.view(-1, V), labels_p.view(-1), ignore_index=-100)
    torch.testing.assert_close(after, before, atol=1e-12, rtol=0)


@SETTINGS
@given(doc_maps(), st.integers(1, 5), st.integers(0, 50))
def test_position_ids_continue_inside_documents(doc_ids, m, offset):
    B, S = doc_ids.shape
    # 0-based position inside each run, plus an offset (a document continued from an earlier row, say)
    pos = torch.zeros(B, S, dtype=torch.int64)
    for b, row in enumerate(doc_ids.tolist()):
        for _, start, end in runs_of_row(row):
            pos[b, start:end] = torch.arange(end - start) + offset
    out = pad_segments(doc_ids, multiple=m, tensors={"position_ids": pos.to(torch.int32)})
    got = out.tensors["position_ids"]
    assert got.dtype == torch.int32
    assert torch.equal(out.unpad(got)[doc_ids != 0], pos.to(torch.int32)[doc_ids != 0])
    # every output segment: a document counts on without a gap through its pads, padding counts from 0
    for b, row in enumerate(out.doc_ids.tolist()):
        for value, start, end in runs_of_row(row):
            seg = got[b, start:end].to(torch.int64)
            first = offset if value != 0 else 0
            assert torch.equal(seg, torch.arange(end - start) + first), (row, got[b])


@SETTINGS
@given(doc_maps(), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_labels_shift_then_pad_equals_pad_then_shift(doc_ids, m, seed):
    loss = pytest.importorskip("cp_packing.loss")
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 1000, doc_ids.shape, generator=g)
    labels = loss.next_token_labels(input_ids, doc_ids)
    out = pad_segments(doc_ids, multiple=m, tensors={"input_ids": input_ids, "labels": labels})
    relabeled = loss.next_token_labels(out.tensors["input_ids"], out.doc_ids, token_mask=~out.is_pad)
    assert torch.equal(relabeled, out.tensors["labels"])


def test_worked_example_by_hand():
    # row 0: doc 1 (3 tokens), doc 2 (2 tokens), 3 padding; row 1: doc 1 (2), padding (1), doc 1 again (1), doc 2 (4)
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2]])
    labels = torch.tensor([[11, 12, -100, 21, -100, -100, -100, -100], [13, -100, -100, -100, 22, 23, 24, -100]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 1, 2, 3]])
    out = pad_segments(doc_ids, multiple=4, tensors={"labels": labels, "position_ids": position_ids})
    # m = 4: 3 -> 4 (+1), 2 -> 4 (+2); 2 -> 4 (+2), the 0 between two runs of doc 1 -> 4 separator tokens,
    # 1 -> 4 (+3), 4 -> 4 (+0). Row contents 8 and 16, so S' = 16.
    assert out.doc_ids.tolist() == [
        [1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2],
    ]
    assert out.tensors["labels"].tolist() == [
        [11, 12, -100, -100, 21, -100, -100, -100] + [-100] * 8,
        [13, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, -100, 22, 23, 24, -100],
    ]
    assert out.tensors["position_ids"].tolist() == [
        [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3],
    ]
    assert out.index.tolist() == [[0, 1, 2, 4, 5, -1, -1, -1], [16, 17, -1, 24, 28, 29, 30, 31]]
    assert out.num_real_tokens == 12  # 5 + 7
    assert out.num_added_tokens == 1 + 2 + 2 + 3 + 0 == 8
    assert out.num_separator_tokens == 4
    assert out.num_dropped_tokens == 4
    assert out.overhead == 8 / 12
    assert int(out.is_pad.sum()) == 2 * 16 - 12
    # with row_length the shape is fixed
    assert pad_segments(doc_ids, multiple=4, row_length=24).doc_ids.shape == (2, 24)


def test_full_row_has_no_trailing_padding_and_all_padding_rows():
    doc_ids = torch.tensor([[1, 1, 2, 2], [0, 0, 0, 0]])
    out = pad_segments(doc_ids, multiple=2)
    assert out.doc_ids.tolist() == [[1, 1, 2, 2], [0, 0, 0, 0]]
    assert seglens(out.doc_ids) == [2, 2, 4]
    # all padding: nothing to keep, S' = 0 unless row_length says otherwise
    empty = pad_segments(torch.zeros(2, 5, dtype=torch.int64), multiple=4, tensors={"labels": torch.full((2, 5), -100)})
    assert empty.doc_ids.shape == (2, 0) and empty.tensors["labels"].shape == (2, 0)
    assert empty.overhead == 0.0 and empty.num_dropped_tokens == 10
    assert torch.equal(empty.unpad(empty.tensors["labels"], fill_value=-100), torch.full((2, 5), -100))
    fixed = pad_segments(torch.zeros(2, 5, dtype=torch.int64), multiple=4, tensors={"position_ids": torch.zeros(2, 5)},
                         row_length=8)
    assert fixed.doc_ids.tolist() == [[0] * 8] * 2
    assert fixed.tensors["position_ids"].tolist() == [list(map(float, range(8)))] * 2


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_empty_maps(shape):
    doc_ids = torch.zeros(shape, dtype=torch.int64)
    x = torch.zeros(*shape, 2)
    out = pad_segments(doc_ids, multiple=4, tensors={"x": x, "labels": torch.zeros(shape, dtype=torch.int64) - 100})
    assert out.doc_ids.shape == (shape[0], 0)
    assert out.index.shape == shape
    assert out.unpad(out.tensors["x"]).shape == (*shape, 2)
    assert pad_segments(doc_ids, multiple=4, row_length=4).doc_ids.shape == (shape[0], 4)


def test_pad_values_and_pad_tensor_and_gradients():
    doc_ids = torch.tensor([[1, 1, 1, 0]])
    ids = torch.tensor([[5, 6, 7, 0]])
    out = pad_segments(doc_ids, multiple=2, tensors={"input_ids": ids}, pad_values={"input_ids": 99})
    assert out.tensors["input_ids"].tolist() == [[5, 6, 7, 99]]
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    laid = out.pad_tensor(w, fill_value=-1.0)
    assert laid.tolist() == [[1.0, 2.0, 3.0, -1.0]]
    back = out.unpad(laid * 2)
    back.sum().backward()
    assert w.grad.tolist() == [[2.0, 2.0, 2.0, 0.0]]  # gradients flow to real tokens only


def test_output_works_with_zigzag_sharding():
    sharding = pytest.importorskip("cp_packing.sharding")
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 3, 0, 0], [1] * 5 + [0] * 6])
    cp = 2
    out = pad_segments(doc_ids, multiple=2 * cp)
    params = packed_seq_params_from_doc_ids(out.doc_ids)
    parts = [
        sharding.shard_packed_seq_params(params, cp_size=cp, cp_rank=r, layout="zigzag").token_index
        for r in range(cp)
    ]
    assert sorted(torch.cat(parts).tolist()) == list(range(out.doc_ids.numel()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2]])
    tensors = {"labels": doc_ids.masked_fill(doc_ids == 0, -100), "position_ids": torch.arange(8).repeat(2, 1)}
    cpu = pad_segments(doc_ids, multiple=4, tensors=tensors)
    gpu = pad_segments(doc_ids.cuda(), multiple=4, tensors={k: v.cuda() for k, v in tensors.items()})
    assert torch.equal(gpu.doc_ids.cpu(), cpu.doc_ids) and torch.equal(gpu.index.cpu(), cpu.index)
    for k in tensors:
        assert torch.equal(gpu.tensors[k].cpu(), cpu.tensors[k])
    assert gpu.num_added_tokens == cpu.num_added_tokens


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("multiple", [2.0, "4", None, True])
def test_multiple_type_error(multiple):
    with pytest.raises(TypeError, match=f"multiple must be an int, got {multiple!r}"):
        pad_segments(torch.ones(1, 4, dtype=torch.int64), multiple=multiple)


@pytest.mark.parametrize("multiple", [0, -2])
def test_multiple_value_error(multiple):
    with pytest.raises(ValueError, match=f"multiple must be >= 1, got {multiple}"):
        pad_segments(torch.ones(1, 4, dtype=torch.int64), multiple=multiple)


def test_bad_inputs():
    doc_ids = torch.tensor([[1, 1, 2, 0]])
    with pytest.raises(ValueError, match=r"tensors\['labels'\] has shape \(1, 3\).*\[1, 4, \.\.\.\]"):
        pad_segments(doc_ids, multiple=2, tensors={"labels": torch.zeros(1, 3, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"tensors\['x'\] has shape \(4,\)"):
        pad_segments(doc_ids, multiple=2, tensors={"x": torch.zeros(4)})
    with pytest.raises(TypeError, match=r"tensors\['x'\] must be a torch.Tensor"):
        pad_segments(doc_ids, multiple=2, tensors={"x": [[1, 2, 3, 4]]})
    with pytest.raises(ValueError, match=r"tensors\['x'\] is a meta tensor"):
        pad_segments(doc_ids, multiple=2, tensors={"x": torch.zeros(1, 4, device="meta")})
    with pytest.raises(ValueError, match=r"row_length=2 is too small.*needs 4"):
        pad_segments(doc_ids, multiple=2, row_length=2)
    with pytest.raises(ValueError, match=r"row_length=6 is not a non-negative multiple of multiple=4; pass 8"):
        pad_segments(doc_ids, multiple=4, row_length=6)
    with pytest.raises(ValueError, match=r"pad_values names \['lables'\]"):
        pad_segments(doc_ids, multiple=2, tensors={"labels": torch.zeros(1, 4)}, pad_values={"lables": -100})
    with pytest.raises(ValueError, match=r"tensors\['labels'\] has 1 label\(s\) other than ignore_index=-100"):
        pad_segments(doc_ids, multiple=2, tensors={"labels": torch.tensor([[1, 2, 3, 4]])})
    with pytest.raises(ValueError, match=r"pad value 300 for tensors\['ids'\] does not fit its dtype torch.uint8"):
        pad_segments(doc_ids, multiple=2, tensors={"ids": torch.ones(1, 4, dtype=torch.uint8)}, pad_values={"ids": 300})
    with pytest.raises(TypeError, match="pad_values must be a dict name -> value, got int"):
        pad_segments(doc_ids, multiple=2, tensors={"labels": torch.zeros(1, 4)}, pad_values=5)
    with pytest.raises(ValueError, match="doc_ids is a meta tensor"):
        pad_segments(doc_ids.to("meta"), multiple=2)
    with pytest.raises(ValueError, match="doc_ids must be 2D"):
        pad_segments(doc_ids[0], multiple=2)
    with pytest.raises(TypeError, match="label_keys must be a sequence of tensor names"):
        pad_segments(doc_ids, multiple=2, label_keys="labels")
    with pytest.raises(ValueError, match="both label_keys and position_keys"):
        pad_segments(doc_ids, multiple=2, label_keys=("x",), position_keys=("x",))
    with pytest.raises(TypeError, match="doc_ids must have an integer dtype"):  # the seed's check
        pad_segments(doc_ids.float(), multiple=2)
    with pytest.raises(ValueError, match="negative document index"):
        pad_segments(torch.tensor([[1, -1]]), multiple=2)
    with pytest.raises(ValueError, match=r"unpad expects a tensor of shape \[B, S', \.\.\.\] = \[1, 4"):
        pad_segments(doc_ids, multiple=2).unpad(torch.zeros(1, 3))


def test_pad_value_that_does_not_fit_the_dtype_is_refused():
    """torch wraps -100 to 156 in uint8: a real class id the loss would count."""
    doc_ids = torch.tensor([[1, 1, 1, 2]])
    with pytest.raises(ValueError, match=r"-100 for tensors\['labels'\] does not fit its dtype torch.uint8"):
        pad_segments(doc_ids, multiple=4, tensors={"labels": torch.ones(1, 4, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="bool"):
        pad_segments(doc_ids, multiple=4, tensors={"mask": torch.ones(1, 4, dtype=torch.bool)}, pad_values={"mask": 2})
    with pytest.raises(ValueError, match="fractional"):
        pad_segments(doc_ids, multiple=4, tensors={"ids": torch.ones(1, 4, dtype=torch.int32)}, pad_values={"ids": 0.5})
    out = pad_segments(doc_ids, multiple=4, tensors={"labels": torch.ones(1, 4, dtype=torch.int16)})
    assert int((out.tensors["labels"] == -100).sum()) == out.doc_ids.numel() - 4


def test_options_are_keyword_only():
    with pytest.raises(TypeError, match="positional"):
        pad_segments(torch.ones(1, 4, dtype=torch.int64), 2)  # type: ignore[misc]


def test_output_beyond_the_bound_is_refused_before_allocating():
    """Issue 9: ``multiple=2**40`` on a one-token map used to try 8 TB; the padded batch must fit int32 cu_seqlens."""
    one = torch.tensor([[1]])
    with pytest.raises(ValueError, match=r"multiple must be <= 2147483647, got 1099511627776"):
        pad_segments(one, multiple=2**40)
    # 4 rows of 2**30 tokens each: 2**32 tokens, more than int32 cu_seqlens can index (would be 32 GB of int64)
    with pytest.raises(ValueError, match=r"would hold B\*S' = 4\*1073741824 = 4294967296 tokens, more than "
                                         r"max_tokens=2147483647.*nothing was allocated"):
        pad_segments(torch.ones(4, 1, dtype=torch.int64), multiple=2**30)
    with pytest.raises(ValueError, match=r"would hold B\*S' = 1\*4294967296 = 4294967296 tokens"):
        pad_segments(one, multiple=1, row_length=2**32)
    doc_ids = torch.tensor([[1, 1, 1, 2, 0, 0]])  # needs S' = 8 with m = 4
    with pytest.raises(ValueError, match="more than max_tokens=7"):
        pad_segments(doc_ids, multiple=4, max_tokens=7)
    assert pad_segments(doc_ids, multiple=4, max_tokens=8).doc_ids.shape == (1, 8)
    with pytest.raises(ValueError, match="max_tokens must be <= 2147483647"):
        pad_segments(doc_ids, multiple=4, max_tokens=2**31)


def test_fill_values_that_do_not_fit_are_refused_in_pad_tensor_and_unpad():
    """Issue 9: ``unpad`` wrapped -100 to 156 in uint8, silently."""
    out = pad_segments(torch.tensor([[1, 1, 1, 0]]), multiple=2)
    ids = torch.tensor([[5, 6, 7, 0]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"fill_value=-100 does not fit its dtype torch.uint8"):
        out.unpad(out.pad_tensor(ids), fill_value=-100)
    with pytest.raises(ValueError, match=r"pad value -100 for tensors\['x'\] does not fit its dtype torch.uint8"):
        out.pad_tensor(ids, -100)
    assert out.unpad(out.pad_tensor(ids, 255), fill_value=255).tolist() == [[5, 6, 7, 255]]


UNSIGNED = [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]


@pytest.mark.parametrize("dtype", UNSIGNED)
def test_unsigned_maps_and_tensors_work_and_keep_their_dtype(dtype):
    """Issue 9: torch has no index_select for UInt16/32/64; the result must equal the int64 one, in the user's dtype."""
    doc64 = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2]])
    ids64 = torch.arange(16).view(2, 8) + 1000
    labels = doc64.masked_fill(doc64 == 0, -100)
    ref = pad_segments(doc64, multiple=4, tensors={"input_ids": ids64, "labels": labels,
                                                  "position_ids": torch.arange(8).repeat(2, 1)})
    got = pad_segments(doc64.to(dtype), multiple=4, tensors={"input_ids": ids64.to(dtype), "labels": labels,
                                                             "position_ids": torch.arange(8).repeat(2, 1).to(dtype)})
    assert got.doc_ids.dtype == dtype and got.tensors["input_ids"].dtype == dtype
    assert torch.equal(got.doc_ids.to(torch.int64), ref.doc_ids)
    assert torch.equal(got.index, ref.index) and torch.equal(got.is_pad, ref.is_pad)
    for key in ("input_ids", "position_ids"):
        assert torch.equal(got.tensors[key].to(torch.int64), ref.tensors[key]), key
    assert torch.equal(got.tensors["labels"], ref.tensors["labels"])
    back = got.unpad(got.tensors["input_ids"], fill_value=torch.iinfo(dtype).max)
    assert back.dtype == dtype
    real = doc64 != 0
    assert back.to(torch.int64)[real].tolist() == ids64[real].tolist()
    top = torch.tensor(torch.iinfo(dtype).max, dtype=dtype).to(torch.int64)  # the same bits, compared as int64
    assert bool((back.to(torch.int64)[~real] == top).all()) and not bool((back.to(torch.int64)[real] == top).any())


def test_docstring_examples_run():
    import cp_packing.padding

    assert doctest.testmod(cp_packing.padding).failed == 0


def test_pad_positions_is_what_pad_segments_does_for_position_keys():
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 1, 2, 3]])
    out = pad_segments(doc_ids, multiple=4, tensors={"position_ids": pos})
    assert torch.equal(out.pad_positions(pos), out.tensors["position_ids"])
    with pytest.raises(TypeError, match="position ids and cannot be bool"):
        out.pad_positions(pos > 0)


def test_pad_rows_pads_the_tail_of_every_row_with_each_keys_fill():
    """``pad_rows`` (the loader's and CPTrainer's row padding): the original tokens unchanged, the tail filled per key,
    ``S`` a multiple afterwards; tensors already a multiple come back as they are; a bad multiple is refused."""
    from cp_packing.padding import pad_rows

    doc = torch.tensor([[1, 1, 2, 2, 2], [1, 1, 1, 0, 0]])
    labels = torch.tensor([[7, -100, 8, 9, -100], [3, 4, -100, -100, -100]])
    feats = torch.arange(20.0).view(2, 5, 2)
    out = pad_rows({"doc_ids": doc, "labels": labels, "feats": feats}, 4, fill={"labels": -100, "feats": 0.5})
    assert out["doc_ids"].shape == (2, 8) and out["feats"].shape == (2, 8, 2)
    assert torch.equal(out["doc_ids"][:, :5], doc) and torch.equal(out["labels"][:, :5], labels)
    assert torch.equal(out["feats"][:, :5], feats)
    assert (out["doc_ids"][:, 5:] == 0).all() and (out["labels"][:, 5:] == -100).all()
    assert (out["feats"][:, 5:] == 0.5).all() and out["labels"].dtype == labels.dtype
    same = pad_rows({"doc_ids": doc}, 5)
    assert same["doc_ids"] is doc
    with pytest.raises(ValueError, match="multiple"):
        pad_rows({"doc_ids": doc}, 0)


def test_memory_budget_is_a_byte_count_refused_before_allocating_with_its_name_and_fix():
    """Issue: the only bound was 2**31 - 1 output tokens (~40 GB at ~20 bytes a token). The budget is now bytes:
    48 per output token for the map, plus 3x each tensor's bytes per token (6x for position ids)."""
    doc_ids = torch.tensor([[1, 1, 1, 2, 0, 0]])  # S' = 8 with m = 4
    ids = torch.arange(6).view(1, 6)
    assert pad_segments(doc_ids, multiple=4, max_bytes=8 * 48).doc_ids.shape == (1, 8)
    with pytest.raises(ValueError, match=r"\(384 bytes: .*more than max_bytes=383"):
        pad_segments(doc_ids, multiple=4, max_bytes=383)
    need = 8 * (48 + 3 * 8 + 6 * 8)  # the map, int64 input_ids, int64 position_ids
    assert pad_segments(doc_ids, multiple=4, tensors={"input_ids": ids, "position_ids": ids},
                        max_bytes=need).doc_ids.shape == (1, 8)
    with pytest.raises(ValueError, match=rf"\({need} bytes: B\*S' = 1\*8 = 8 output tokens x {need // 8} bytes per "
                                         rf"token.*more than max_bytes={need - 1} \(default 4294967296, 4 GiB\); "
                                         r"nothing was allocated. Pass max_bytes="):
        pad_segments(doc_ids, multiple=4, tensors={"input_ids": ids, "position_ids": ids}, max_bytes=need - 1)
    # the default budget: one token padded to 2**27 would need 6 GiB for the map alone
    with pytest.raises(ValueError, match=r"about 6.00 GiB .*more than max_bytes=4294967296"):
        pad_segments(torch.tensor([[1]]), multiple=2**27)
    with pytest.raises(TypeError, match="max_bytes must be an int"):
        pad_segments(doc_ids, multiple=4, max_bytes=1e9)


@pytest.mark.parametrize("cp_size,exc,match", [
    (0, ValueError, "multiple must be >= 1, got 0"),
    ("2", TypeError, r"multiple must be an int, got '2' \(str\)"),
    (None, TypeError, "multiple must be an int, got None"),
    (2.0, TypeError, "multiple must be an int, got 2.0"),
])
def test_pad_rows_refuses_a_bad_multiple(cp_size, exc, match):
    from cp_packing.padding import pad_rows

    with pytest.raises(exc, match=match):
        pad_rows({"doc_ids": torch.tensor([[1, 1, 2]])}, cp_size)


def test_pad_rows_refuses_unsigned_labels_that_cannot_hold_minus_100_and_bad_tensors():
    """-100 in uint8 is 156: a real class id the loss would count (it used to be padded in, silently)."""
    from cp_packing.padding import pad_rows

    doc = torch.tensor([[1, 1, 2]])
    with pytest.raises(ValueError, match=r"pad value -100 for tensors\['labels'\] does not fit its dtype torch.uint8.*"
                                         r"\.long\(\).*156"):
        pad_rows({"doc_ids": doc, "labels": torch.tensor([[5, 6, 7]], dtype=torch.uint8)}, 2, fill={"labels": -100})
    with pytest.raises(TypeError, match="tensors must be a dict"):
        pad_rows([doc], 2)
    with pytest.raises(TypeError, match=r"tensors\['x'\] must be a torch.Tensor"):
        pad_rows({"doc_ids": doc, "x": [[1, 2, 3]]}, 2)
    with pytest.raises(ValueError, match=r"tensors\['doc_ids'\] has shape \(3,\); every tensor must be \[B, S, ...\]"):
        pad_rows({"doc_ids": doc[0]}, 2)
    with pytest.raises(ValueError, match=r"tensors\['labels'\] has shape \(1, 2\); every tensor must be \[1, 3, ...\]"):
        pad_rows({"doc_ids": doc, "labels": doc[:, :2]}, 2)
    with pytest.raises(ValueError, match=r"fill names \['label'\], which are not in tensors"):
        pad_rows({"doc_ids": doc, "labels": doc}, 2, fill={"label": -100})
    with pytest.raises(TypeError, match="fill must be a dict"):
        pad_rows({"doc_ids": doc}, 2, fill=-100)
    with pytest.raises(ValueError, match=r"B\*S' = 4\*2147483647 tokens, more than int32 cu_seqlens can "
                                         r"index.*nothing"):
        pad_rows({"doc_ids": torch.ones(4, 1, dtype=torch.int64)}, 2**31 - 1)
