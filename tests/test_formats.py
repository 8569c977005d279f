"""cp_packing.formats: every converter against a plain-Python reference (random doc maps -> the format, built here
by loops -> back), every error path, and the 0-based warning."""

from __future__ import annotations

import doctest
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cp_packing.formats as formats
from cp_packing._checks import INTEGER_DTYPES
from cp_packing import packed_seq_params_from_doc_ids
from cp_packing.formats import (
    ZeroBasedDocIdsWarning,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    doc_ids_from_seq_idx,
    doc_ids_from_seq_lens,
    warn_if_zero_based,
)
from tests.maps import doc_maps, runs_of_row

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------------------------
# Plain-Python references
# ----------------------------------------------------------------------------------------------------------------


def canonical(doc_ids: torch.Tensor) -> list[list[int]]:
    """The doc map every converter should return: real runs numbered 1, 2, ... per row, padding 0."""
    out = []
    for row in doc_ids.tolist():
        new, n = [0] * len(row), 0
        for value, a, b in runs_of_row(row):
            if value:
                n += 1
                new[a:b] = [n] * (b - a)
        out.append(new)
    return out


def assert_same_segmentation(got: torch.Tensor, doc_ids: torch.Tensor) -> None:
    """What the library sees: the same segments (``cu_seqlens``) and the same padding."""
    assert got.dtype == torch.int64 and got.shape == doc_ids.shape
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    assert torch.equal(packed_seq_params_from_doc_ids(got).cu_seqlens, cu)
    assert torch.equal(got == 0, doc_ids == 0)
    assert got.tolist() == canonical(doc_ids)


def position_ids_of(doc_ids: torch.Tensor, pad_value: int) -> list[list[int]]:
    out = []
    for row in doc_ids.tolist():
        pos = []
        for value, a, b in runs_of_row(row):
            pos += list(range(b - a)) if value else [pad_value] * (b - a)
        out.append(pos)
    return out


def seq_idx_of(doc_ids: torch.Tensor, *, per_row: bool) -> list[list[int]]:
    """0-based, counting real runs over the flattened batch (or restarting per row); padding gets 0."""
    out, n = [], 0
    for row in doc_ids.tolist():
        if per_row:
            n = 0
        idx = []
        for value, a, b in runs_of_row(row):
            if value:
                idx += [n] * (b - a)
                n += 1
            else:
                idx += [0] * (b - a)
        out.append(idx)
    return out


def cu_seqlens_of(doc_ids: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """cu_seqlens of every run (row starts included) up to the last real token of the flattened batch, and the doc
    map they describe: every run before that token is a document (cu_seqlens cannot hold padding inside)."""
    B, S = doc_ids.shape
    flat = doc_ids.reshape(-1).tolist()
    end = max((t + 1 for t, v in enumerate(flat) if v), default=0)
    cu, expected = [0], []
    for b, row in enumerate(doc_ids.tolist()):
        new, n = [0] * S, 0
        for _, a, e in runs_of_row(row):
            if b * S + a < end:
                n += 1
                stop = min(e, end - b * S)
                new[a:stop] = [n] * (stop - a)
                cu.append(b * S + stop)
        expected.append(new)
    return cu, expected


def seq_lens_of(doc_ids: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """THD slots per row: a real run opens a slot, the padding run after it is that slot's padded tail, padding at
    the row start is a slot with no real token; padding at the row end is left to ``seq_len``."""
    real, padded = [], []
    for row in doc_ids.tolist():
        r, p = [], []
        row_runs = runs_of_row(row)
        if row_runs and row_runs[-1][0] == 0:
            row_runs = row_runs[:-1]
        for value, a, b in row_runs:
            if value:
                r.append(b - a)
                p.append(b - a)
            elif r:
                p[-1] += b - a
            else:
                r.append(0)
                p.append(b - a)
        real.append(r)
        padded.append(p)
    return real, padded


def as_table(rows: list[list[int]], fill: int) -> torch.Tensor:
    n = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [fill] * (n - len(r)) for r in rows], dtype=torch.int64).view(len(rows), n)


# ----------------------------------------------------------------------------------------------------------------
# Round trips
# ----------------------------------------------------------------------------------------------------------------


@FAST
@given(doc_maps(), st.sampled_from([0, 7, -5]))
def test_position_ids_round_trip(doc_ids, pad_value):
    pos = torch.tensor(position_ids_of(doc_ids, pad_value))
    got = doc_ids_from_position_ids(pos, attention_mask=(doc_ids != 0).long())
    assert_same_segmentation(got, doc_ids)
    got_bool = doc_ids_from_position_ids(pos.int(), attention_mask=doc_ids != 0)
    assert torch.equal(got, got_bool)


@FAST
@given(doc_maps())
def test_position_ids_without_mask_every_token_is_real(doc_ids):
    doc_ids = torch.tensor(canonical(doc_ids)) + (doc_ids == 0).long() * 1000  # padding runs become documents
    pos = torch.tensor(position_ids_of(doc_ids, 0))
    assert_same_segmentation(doc_ids_from_position_ids(pos), doc_ids)


def test_position_ids_flattened_hf_batch_and_1d():
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3])  # DataCollatorWithFlattening: three documents
    assert doc_ids_from_position_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3]]
    assert doc_ids_from_position_ids(pos.view(1, -1)).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3]]


def test_position_ids_row_start_and_after_padding_start_a_document_at_any_position():
    # row 1 continues a document from row 0; row 2 is left-padded with positions counted through the padding
    pos = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1], [0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    assert doc_ids_from_position_ids(pos, attention_mask=mask).tolist() == [[1, 1, 1, 1], [1, 1, 2, 2], [0, 0, 1, 1]]


def test_position_ids_repeated_zero_is_one_token_documents():
    assert doc_ids_from_position_ids(torch.tensor([[0, 0, 0, 1]])).tolist() == [[1, 2, 3, 3]]


@FAST
@given(doc_maps(), st.booleans())
def test_seq_idx_round_trip(doc_ids, per_row):
    seq = torch.tensor(seq_idx_of(doc_ids, per_row=per_row), dtype=torch.int32)
    assert_same_segmentation(doc_ids_from_seq_idx(seq, attention_mask=doc_ids != 0), doc_ids)


def test_seq_idx_hf_flattened_batch():
    seq = torch.tensor([[0, 0, 0, 1, 1, 2]], dtype=torch.int32)  # DataCollatorWithFlattening(return_seq_idx=True)
    got = doc_ids_from_seq_idx(seq)
    assert got.tolist() == [[1, 1, 1, 2, 2, 3]] and got.dtype == torch.int64
    assert doc_ids_from_seq_idx(seq.view(-1)).tolist() == [[1, 1, 1, 2, 2, 3]]


@FAST
@given(doc_maps())
def test_cu_seqlens_round_trip(doc_ids):
    B, S = doc_ids.shape
    cu, expected = cu_seqlens_of(doc_ids)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = doc_ids_from_cu_seqlens(cu_t, batch_shape=(B, S))
    assert got.dtype == torch.int64 and got.tolist() == expected
    assert_same_segmentation(got, torch.tensor(expected))
    # the same stream read as one flattened row: the same segments, numbered over the row
    flat = doc_ids_from_cu_seqlens(cu_t, batch_shape=(B * S,))
    assert flat.shape == (1, B * S)
    assert torch.equal(flat == 0, got.view(1, -1) == 0)
    assert torch.equal(packed_seq_params_from_doc_ids(flat).cu_seqlens[1:],
                       torch.tensor([c for c in cu[1:]] + ([B * S] if cu[-1] < B * S else []), dtype=torch.int32))


def test_cu_seqlens_hf_flash_kwargs_and_empty_segments():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)  # an empty segment holds no token and gets no number
    assert doc_ids_from_cu_seqlens(cu, batch_shape=torch.Size([1, 6])).tolist() == [[1, 1, 1, 2, 2, 0]]
    assert doc_ids_from_cu_seqlens(torch.tensor([0]), batch_shape=(0, 4)).shape == (0, 4)
    assert doc_ids_from_cu_seqlens(torch.tensor([0]), batch_shape=(2, 3)).tolist() == [[0, 0, 0], [0, 0, 0]]


@FAST
@given(doc_maps(), st.sampled_from(["list", "tensor-1", "tensor-0", "tensor-nemo"]))
def test_seq_lens_round_trip(doc_ids, kind):
    B, S = doc_ids.shape
    real, padded = seq_lens_of(doc_ids)
    if kind != "list":
        fill = {"tensor-1": -1, "tensor-0": 0, "tensor-nemo": -1000}[kind]  # NeMo's collate pads rows with -1000
        real, padded = as_table(real, fill), as_table(padded, fill)
    got = doc_ids_from_seq_lens(real, seq_lens_padded=padded, seq_len=S)
    assert_same_segmentation(got, doc_ids)


@FAST
@given(doc_maps())
def test_seq_lens_without_padded_lengths(doc_ids):
    # the same documents, padding moved to the end of each row (no padded tails)
    compact = [[v for v in row if v] for row in doc_ids.tolist()]
    S = doc_ids.shape[1]
    doc_ids = torch.tensor([row + [0] * (S - len(row)) for row in compact])
    real = [[b - a for v, a, b in runs_of_row(row) if v] for row in doc_ids.tolist()]
    assert_same_segmentation(doc_ids_from_seq_lens(real, seq_len=S), doc_ids)


def test_seq_lens_default_length_one_row_and_empty_slots():
    assert doc_ids_from_seq_lens([2, 1]).tolist() == [[1, 1, 2]]
    assert doc_ids_from_seq_lens(torch.tensor([[2, -1], [1, 1]])).tolist() == [[1, 1], [1, 2]]
    assert doc_ids_from_seq_lens([[2, 0, 1]]).tolist() == [[1, 1, 2]]  # 0: no sequence, no number
    assert doc_ids_from_seq_lens([[0, 2]], seq_lens_padded=[[2, 2]]).tolist() == [[0, 0, 1, 1]]
    assert doc_ids_from_seq_lens([[3, 1]], seq_lens_padded=[[4, 4]], seq_len=10).tolist() == [
        [1, 1, 1, 0, 2, 0, 0, 0, 0, 0]
    ]
    assert doc_ids_from_seq_lens([torch.tensor([2, 1]), torch.tensor([3])]).tolist() == [[1, 1, 2], [1, 1, 1]]
    assert doc_ids_from_seq_lens([]).shape == (0, 0)
    assert doc_ids_from_seq_lens([[]], seq_len=3).tolist() == [[0, 0, 0]]


def test_every_output_is_accepted_and_narrow_dtypes_are_read():
    outs = [
        doc_ids_from_position_ids(torch.tensor([[0, 0, 1]], dtype=torch.uint8)),
        doc_ids_from_seq_idx(torch.tensor([[0, 1, 1]], dtype=torch.int16)),
        doc_ids_from_cu_seqlens(torch.tensor([0, 1, 3], dtype=torch.int64), batch_shape=[1, 3]),
        doc_ids_from_seq_lens(torch.tensor([[1, 2]], dtype=torch.int8)),
    ]
    for out in outs:
        assert out.dtype == torch.int64 and out.tolist() == [[1, 2, 2]]
        assert packed_seq_params_from_doc_ids(out).cu_seqlens.tolist() == [0, 1, 3]


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("convert", [doc_ids_from_position_ids, doc_ids_from_seq_idx])
def test_per_token_converters_refuse_bad_tensors_and_masks(convert):
    ok = torch.tensor([[0, 0, 1]])
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        convert([[0, 1]])
    with pytest.raises(TypeError, match=r"integer dtype.*\.long\(\)"):
        convert(ok.float())
    with pytest.raises(ValueError, match=r"\[B, S\].*shape \(2, 3, 1, 3\)"):
        convert(ok.expand(2, 3, 1, 3))
    with pytest.raises(TypeError, match="attention_mask must be bool or integer"):
        convert(ok, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 1, 3, 3\).*not a 4-D"):
        convert(ok, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"attention_mask\[0, 2\] is 2.*LLaMA-Factory neat_packing.*as is"):
        convert(ok, attention_mask=torch.tensor([[1, 1, 2]]))
    with pytest.raises(ValueError, match=r"attention_mask\[0, 0\] is -1, not 0 or 1; pass a 0/1 mask"):
        convert(ok, attention_mask=torch.tensor([[-1, 1, 1]]))
    with pytest.raises(ValueError, match=r"\[0, 1\] is -3.*mark it 0 in attention_mask"):
        convert(torch.tensor([[0, -3, 0]]))
    # a negative value on padding is ignored
    assert convert(torch.tensor([[0, -3, 0]]), attention_mask=torch.tensor([[1, 0, 1]])).tolist() == [[1, 0, 2]]


def test_position_ids_that_neither_restart_nor_count_up_are_refused_with_their_place():
    with pytest.raises(ValueError, match=r"position_ids\[1, 2\] is 3 after 1 at \[1, 1\].*restart at 0"):
        doc_ids_from_position_ids(torch.tensor([[0, 1, 2, 3], [0, 1, 3, 4]]))
    # HF position_ids_start=2: positions restart at 2; the message says to subtract it
    with pytest.raises(ValueError, match=r"is 2 after 4.*position_ids_start=k.*position_ids - k"):
        doc_ids_from_position_ids(torch.tensor([[2, 3, 4, 2, 3]]))
    assert doc_ids_from_position_ids(torch.tensor([[2, 3, 4, 2, 3]]) - 2).tolist() == [[1, 1, 1, 2, 2]]


def test_seq_idx_that_goes_back_or_jumps_is_refused():
    with pytest.raises(ValueError, match=r"seq_idx\[0, 3\] is 0 after 2.*look like position_ids.*from_position_ids"):
        doc_ids_from_seq_idx(torch.tensor([[0, 1, 2, 0, 1]]))
    with pytest.raises(ValueError, match=r"seq_idx\[0, 2\] is 3 after 1.*skips a document"):
        doc_ids_from_seq_idx(torch.tensor([[1, 1, 3]]))
    # across padding and row starts any value is fine
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    assert doc_ids_from_seq_idx(torch.tensor([[5, 0, 2], [9, 9, 10]]), attention_mask=mask).tolist() == [
        [1, 0, 2],
        [1, 1, 2],
    ]


def test_cu_seqlens_errors():
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        doc_ids_from_cu_seqlens([0, 2, 4], batch_shape=(1, 4))
    with pytest.raises(TypeError, match="integer tensor"):
        doc_ids_from_cu_seqlens(cu.float(), batch_shape=(1, 4))
    with pytest.raises(ValueError, match="start at 0 and never decrease"):
        doc_ids_from_cu_seqlens(torch.tensor([1, 2, 4]), batch_shape=(1, 4))
    with pytest.raises(ValueError, match="start at 0 and never decrease"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 3, 2]), batch_shape=(1, 4))
    with pytest.raises(ValueError, match=r"ends at 4 but batch_shape \(1, 3\) holds only 3 tokens"):
        doc_ids_from_cu_seqlens(cu, batch_shape=(1, 3))
    crossing = r"segment 1 .* \[2, 5\) and crosses the start of row 1 .*batch_shape=\(1, 6\)"
    with pytest.raises(ValueError, match=crossing):
        doc_ids_from_cu_seqlens(torch.tensor([0, 2, 5, 6]), batch_shape=(2, 3))
    for bad in ("1x4", 4, (1, 2, 3), None):
        with pytest.raises(TypeError, match=r"batch_shape must be \(B, S\) or \(T,\)"):
            doc_ids_from_cu_seqlens(cu, batch_shape=bad)
    with pytest.raises(TypeError, match="every entry of batch_shape must be an int"):
        doc_ids_from_cu_seqlens(cu, batch_shape=(True, 4))
    with pytest.raises(ValueError, match="every entry of batch_shape must be >= 0"):
        doc_ids_from_cu_seqlens(cu, batch_shape=(-1, 4))
    with pytest.raises(ValueError, match="more than int32 cu_seqlens can index"):
        doc_ids_from_cu_seqlens(cu, batch_shape=(2**16, 2**16))


def test_seq_lens_errors():
    with pytest.raises(TypeError, match="list of lists of ints, got str"):
        doc_ids_from_seq_lens("3,2")
    with pytest.raises(TypeError, match=r"seq_lens\[1\] must be a list of ints.*got int"):
        doc_ids_from_seq_lens([[3], 2])
    with pytest.raises(TypeError, match=r"seq_lens\[0\]\[1\] must be an int.*2.0"):
        doc_ids_from_seq_lens([[3, 2.0]])
    with pytest.raises(TypeError, match="integer dtype"):
        doc_ids_from_seq_lens(torch.tensor([[3.0]]))
    with pytest.raises(ValueError, match=r"\[B, N\].*shape \(1, 1, 1\)"):
        doc_ids_from_seq_lens(torch.tensor([[[3]]]))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]\[1\] is -2; a length is >= 0"):
        doc_ids_from_seq_lens([[3, -2]])
    with pytest.raises(ValueError, match=r"seq_lens_padded has \(1, 1\) .* seq_lens has \(1, 2\)"):
        doc_ids_from_seq_lens([[3, 2]], seq_lens_padded=[[6]])
    with pytest.raises(ValueError, match=r"seq_lens_padded\[0\]\[0\] is 2 but seq_lens\[0\]\[0\] is 3.*argument order"):
        doc_ids_from_seq_lens([[3, 2]], seq_lens_padded=[[2, 4]])
    with pytest.raises(ValueError, match=r"seq_lens_padded\[0\]\[1\] is -1 but seq_lens\[0\]\[1\] is 2"):
        doc_ids_from_seq_lens([[3, 2]], seq_lens_padded=[[4, -1]])
    with pytest.raises(ValueError, match=r"row 1 of seq_lens holds 7 tokens .* seq_len is 6.*seq_len >= 7"):
        doc_ids_from_seq_lens([[3], [4, 3]], seq_len=6)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        doc_ids_from_seq_lens([[3]], seq_len=3.0)


def test_seq_lens_reads_nemo_thd_batches_padded_with_minus_1000():
    """NeMo AutoModel's packed_sequence_thd_collater pads seq_lens / seq_lens_padded rows with -1000 (its own
    example: two rows, the second with one sequence); trailing -1000 entries are padding slots, not errors."""
    seq_lens = torch.tensor([[3, 2], [6, -1000]])
    seq_lens_padded = torch.tensor([[4, 2], [6, -1000]])
    doc_ids = doc_ids_from_seq_lens(seq_lens, seq_lens_padded=seq_lens_padded)
    assert doc_ids.tolist() == [[1, 1, 1, 0, 2, 2], [1, 1, 1, 1, 1, 1]]
    # NeMo's cu_seqlens (from seq_lens_padded) put a boundary at 4: the padded tail is a segment of its own here
    assert packed_seq_params_from_doc_ids(doc_ids).cu_seqlens.tolist() == [0, 3, 4, 6, 12]
    assert doc_ids_from_seq_lens([[3, -1000, -1000]], seq_len=4).tolist() == [[1, 1, 1, 0]]
    with pytest.raises(ValueError, match=r"seq_lens\[0\]\[0\] is -1000 \(NeMo's padding entry\) but "
                                         r"seq_lens\[0\]\[1\] is 3: -1000 only pads the end of a row"):
        doc_ids_from_seq_lens(torch.tensor([[-1000, 3]]))
    with pytest.raises(ValueError, match=r"seq_lens\[1\]\[1\] is -1000 but seq_lens_padded\[1\]\[1\] is 4: "
                                         r"NeMo pads both"):
        doc_ids_from_seq_lens(seq_lens, seq_lens_padded=torch.tensor([[4, 2], [6, 4]]))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]\[1\] is -999; a length is >= 0"):
        doc_ids_from_seq_lens([[3, -999]])


@pytest.mark.parametrize("kwargs", [
    {"seq_lens": [[2**62] * 4], "seq_len": 4},  # the int64 sum wraps to 0: used to pass the check and crash
    {"seq_lens": [[1, 1]], "seq_lens_padded": [[2**62, 2**62]], "seq_len": 8},
    {"seq_lens": torch.tensor([[2**62] * 4]), "seq_len": 4},
    {"seq_lens": torch.tensor([[1, 1]]), "seq_lens_padded": torch.tensor([[2**62, 2**62]])},
    {"seq_lens": [[2**70]]},  # past int64: torch.tensor itself would fail
    {"seq_lens": [[2**31]]},
])
def test_seq_lens_that_would_wrap_int64_are_refused_before_allocating(kwargs):
    name = "seq_lens_padded" if "seq_lens_padded" in kwargs else "seq_lens"
    with pytest.raises(ValueError, match=rf"{name}\[0\]\[0\] is \d+, more than int32 cu_seqlens can index"):
        doc_ids_from_seq_lens(**kwargs)


@pytest.mark.skipif(not hasattr(torch, "uint64"), reason="no torch.uint64")
def test_uint64_values_past_int64_are_refused_not_wrapped():
    big = torch.tensor([[0, 2**63 + 5]], dtype=torch.uint64)
    for convert in (doc_ids_from_position_ids, doc_ids_from_seq_idx):
        with pytest.raises(ValueError, match=r"holds 9223372036854775813 \(flat position 1\), more than int64"):
            convert(big)
    with pytest.raises(ValueError, match=r"holds 9223372036854775813 .*more than int64"):
        doc_ids_from_cu_seqlens(big[0], batch_shape=(1, 4))
    with pytest.raises(ValueError, match=r"seq_lens holds 9223372036854775813"):
        doc_ids_from_seq_lens(big)


@pytest.mark.parametrize("planes", [3, 4])
def test_multimodal_rope_position_ids_are_refused_naming_position_ids_0(planes):
    """Qwen2-VL mRoPE position ids are [3, B, S] (HF prepends the text positions for packing: [4, B, S])."""
    text = torch.tensor([[0, 1, 2, 0, 1]])
    mrope = text.unsqueeze(0).expand(planes, 1, 5)
    with pytest.raises(ValueError, match=rf"position_ids has shape \({planes}, 1, 5\): 3-D multimodal RoPE.*"
                                         r"pass position_ids\[0\]"):
        doc_ids_from_position_ids(mrope)
    assert doc_ids_from_position_ids(mrope[0]).tolist() == [[1, 1, 1, 2, 2]]


# ----------------------------------------------------------------------------------------------------------------
# The 0-based trap
# ----------------------------------------------------------------------------------------------------------------


def test_zero_based_map_warns_once_and_names_the_converter(monkeypatch):
    monkeypatch.setattr(formats, "_zero_based_warned", False)
    seq_idx = torch.tensor([[5, 5, 6, 6], [0, 0, 1, 2]])  # row 1: a 0-based seq_idx passed as doc_ids
    with pytest.warns(ZeroBasedDocIdsWarning, match=r"row 1 starts with padding.*doc_ids_from_seq_idx"):
        assert warn_if_zero_based(seq_idx) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_zero_based(seq_idx) is True  # still detected, not warned again
        assert warn_if_zero_based(torch.tensor([[0, 0, 1]])) is True
    assert issubclass(ZeroBasedDocIdsWarning, UserWarning)


@pytest.mark.parametrize("dtype", sorted(INTEGER_DTYPES, key=str))
def test_zero_based_check_reads_every_integer_dtype_and_warns_at_the_caller(dtype, monkeypatch):
    monkeypatch.setattr(formats, "_zero_based_warned", False)
    with pytest.warns(ZeroBasedDocIdsWarning) as record:
        assert warn_if_zero_based(torch.tensor([[0, 0, 1, 1, 2]], dtype=dtype)) is True
    assert record[0].filename == __file__
    assert warn_if_zero_based(torch.tensor([[0, 0, 2, 1]], dtype=dtype)) is False
    with pytest.raises(ValueError, match="stacklevel must be >= 1"):
        warn_if_zero_based(torch.tensor([[1]], dtype=dtype), stacklevel=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, getattr(torch, "uint32", torch.int16)])
def test_packed_seq_params_from_doc_ids_warns_on_a_zero_based_map(dtype, monkeypatch):
    """Issue 10: a 0-based seq_idx passed to the seed as doc_ids (its document 0 read as padding) warns once, at the
    caller, naming doc_ids_from_seq_idx; the params are the same as without the warning. Both paths (CPU NumPy, and
    the device path run on CPU)."""
    from cp_packing.packed_seq import _from_doc_ids_torch

    seq_idx = torch.tensor([[1, 1, 2, 2, 2, 3], [0, 0, 0, 1, 1, 2]], dtype=dtype)  # row 1: 0-based
    for build in (packed_seq_params_from_doc_ids, _from_doc_ids_torch):
        monkeypatch.setattr(formats, "_zero_based_warned", False)
        with pytest.warns(ZeroBasedDocIdsWarning, match=r"row 1 starts with padding.*doc_ids_from_seq_idx") as rec:
            out = build(seq_idx)
        if build is packed_seq_params_from_doc_ids:
            assert rec[0].filename == __file__  # points at the caller, not inside cp-packing
        cu = out.cu_seqlens if build is packed_seq_params_from_doc_ids else out[0]
        assert cu.tolist() == [0, 2, 5, 6, 9, 11, 12]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            build(seq_idx)
    monkeypatch.setattr(formats, "_zero_based_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 1-based maps, right- or left-padded before another document: silent
        for one_based in ([[1, 1, 2, 0], [1, 0, 0, 0]], [[0, 0, 2, 2], [1, 1, 1, 1]], [[0, 0, 0, 0], [3, 3, 0, 0]]):
            for build in (packed_seq_params_from_doc_ids, _from_doc_ids_torch):
                build(torch.tensor(one_based, dtype=dtype))
        packed_seq_params_from_doc_ids(doc_ids_from_seq_idx(seq_idx))


@settings(max_examples=60, deadline=None)
@given(doc_maps(pad_p=0.4), st.booleans())
def test_zero_based_check_from_segments_equals_the_full_check(doc_ids, zero_based):
    """The seed's hook reads only the rows' first segments (cu_seqlens); it must agree with the full-map check."""
    if zero_based:  # turn some rows into a 0-based index: padding, then 1
        doc_ids = torch.where(doc_ids > 0, doc_ids - 1, doc_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZeroBasedDocIdsWarning)
        cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
        assert warn_if_zero_based(doc_ids, cu_seqlens=cu) == warn_if_zero_based(doc_ids)


@pytest.mark.parametrize(
    "doc_ids",
    [
        [[1, 1, 2, 0]],  # a neat-packing map: starts with document 1
        [[0, 0, 2, 2]],  # padding first, but not followed by document 1
        [[0, 0, 0, 0]],  # all padding
        [[1, 2], [3, 3]],
    ],
)
def test_one_based_maps_do_not_warn(doc_ids, monkeypatch):
    monkeypatch.setattr(formats, "_zero_based_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_zero_based(torch.tensor(doc_ids)) is False
        assert warn_if_zero_based(torch.zeros(0, 3, dtype=torch.long)) is False


def test_converted_seq_idx_does_not_warn_and_checks_its_argument(monkeypatch):
    monkeypatch.setattr(formats, "_zero_based_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_zero_based(doc_ids_from_seq_idx(torch.tensor([[0, 0, 1, 2]]))) is False
    with pytest.raises(ValueError, match="must be 2D"):
        warn_if_zero_based(torch.tensor([0, 1]))


def test_docstring_examples_run(monkeypatch):
    monkeypatch.setattr(formats, "_zero_based_warned", False)
    result = doctest.testmod(formats, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted >= 8


# ----------------------------------------------------------------------------------------------------------------
# Real producers and the docs
# ----------------------------------------------------------------------------------------------------------------


def test_hf_data_collator_with_flattening_gives_one_map_by_every_route():
    transformers = pytest.importorskip("transformers")
    lengths = [3, 1, 5, 2]
    features = [{"input_ids": list(range(10, 10 + n))} for n in lengths]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True,
                                                       return_tensors="pt")
    batch = collator(features)
    expected = [[k + 1 for k, n in enumerate(lengths) for _ in range(n)]]
    by_position = doc_ids_from_position_ids(batch["position_ids"])
    by_cu = doc_ids_from_cu_seqlens(batch["cu_seq_lens_q"], batch_shape=batch["input_ids"].shape)
    by_seq_idx = doc_ids_from_seq_idx(batch["seq_idx"])
    by_lens = doc_ids_from_seq_lens([lengths])
    for got in (by_position, by_cu, by_seq_idx, by_lens):
        assert got.tolist() == expected
    assert warn_if_zero_based(by_seq_idx) is False
    with warnings.catch_warnings(record=True):
        assert warn_if_zero_based(batch["seq_idx"]) is True  # the trap the converter avoids


def test_docs_examples_run(monkeypatch):
    import os
    import re

    monkeypatch.setattr(formats, "_zero_based_warned", False)
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "formats.md")
    blocks = re.findall(r"```python\n(.*?)```", open(path).read(), re.S)
    assert len(blocks) >= 7
    namespace: dict = {}
    for block in blocks:
        exec(block, namespace)  # noqa: S102 - our own docs
