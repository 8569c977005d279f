"""Converters from the packing formats users already have to cp-packing's doc map (docs/formats.md).

Every converter returns an int64 ``[B, S]`` doc map on the input's device: the 1-based index of each token's
document, counting 1, 2, 3, ... from the start of every row, 0 for padding; ``packed_seq_params_from_doc_ids``
takes it as it is. Every converter checks its input first and raises a TypeError / ValueError that names the
value, where it is, and the fix; none loops over tokens in Python.

==========================================================  ==========================================
what the pipeline gives                                     converter
==========================================================  ==========================================
``position_ids`` restarting at 0 per document               :func:`doc_ids_from_position_ids`
(HF ``DataCollatorWithFlattening``, TRL ``padding_free``)
``cu_seq_lens_q`` (HF flash-attention kwargs)               :func:`doc_ids_from_cu_seqlens`
0-based ``seq_idx`` (HF ``return_seq_idx=True``, mamba)     :func:`doc_ids_from_seq_idx`
``seq_lens`` / ``seq_lens_padded`` (NeMo/Megatron THD,      :func:`doc_ids_from_seq_lens`
TRL ``pack_dataset`` ``seq_lengths``)
LLaMA-Factory ``neat_packing`` ``attention_mask``           none: it already is the doc map
==========================================================  ==========================================

The trap: a 0-based ``seq_idx`` passed as ``doc_ids`` is a valid doc map whose first document is padding.
:func:`warn_if_zero_based` warns (once per process) when a map looks like that.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import torch

from cp_packing._checks import (
    INT32_MAX,
    INTEGER_DTYPES,
    as_signed,
    check_cu_seqlens,
    check_doc_ids,
    check_int,
    check_tensor,
    is_int,
)

__all__ = [
    "ZeroBasedDocIdsWarning",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_position_ids",
    "doc_ids_from_seq_idx",
    "doc_ids_from_seq_lens",
    "warn_if_zero_based",
]


# ----------------------------------------------------------------------------------------------------------------
# Shared checks (private)
# ----------------------------------------------------------------------------------------------------------------


def _as_rows(x: Any, name: str, shape: str = "[B, S] (or [T] for one flattened row)",
             fix: str = "pass the per-token tensor the collator returned") -> torch.Tensor:
    """``x`` as an int64 ``[B, S]`` tensor: a ``[T]`` tensor is one row ``[1, T]``."""
    check_tensor(x, name, shape)
    if x.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}; convert with {name}.long()")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    elif x.dim() != 2:
        raise ValueError(f"{name} must be {shape}, got shape {tuple(x.shape)}; {fix}")
    _check_fits_int64(x, name)
    return x.to(torch.int64)


def _check_fits_int64(x: torch.Tensor, name: str) -> None:
    """A uint64 tensor's values >= 2**63 would wrap to negative int64, silently: refuse them."""
    if x.dtype == getattr(torch, "uint64", None):
        wrapped = x.view(torch.int64).reshape(-1) < 0
        hit = wrapped.nonzero()
        if hit.numel():
            t = int(hit[0, 0])
            raise ValueError(
                f"{name} holds {int(x.reshape(-1).view(torch.int64)[t]) + 2**64} (flat position {t}), more than "
                "int64 holds; no position, index or length is that large: check how the tensor was built"
            )


def _first(bad: torch.Tensor) -> tuple[int, int] | None:
    """``(b, s)`` of the first True of a ``[B, S]`` bool tensor, or ``None`` when there is none (one host sync)."""
    hit = bad.reshape(-1).nonzero()
    return None if hit.numel() == 0 else divmod(int(hit[0, 0]), bad.shape[1])


def _real_tokens(attention_mask: Any, like: torch.Tensor, name: str) -> torch.Tensor:
    """bool ``[B, S]``: True for a real token, from a 0/1 ``attention_mask`` (``None``: every token is real)."""
    if attention_mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    check_tensor(attention_mask, "attention_mask", "[B, S] of 0/1")
    if attention_mask.dtype != torch.bool and attention_mask.dtype not in INTEGER_DTYPES:
        raise TypeError(
            f"attention_mask must be bool or integer (1 = real token, 0 = padding), got {attention_mask.dtype}; "
            "convert with attention_mask.long()"
        )
    mask = attention_mask.unsqueeze(0) if attention_mask.dim() == 1 else attention_mask
    if tuple(mask.shape) != tuple(like.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but {name} has {tuple(like.shape)}; pass the "
            "2-D 0/1 padding mask of the same batch (not a 4-D attention mask)"
        )
    if mask.device != like.device:
        raise ValueError(f"attention_mask is on {mask.device} but {name} on {like.device}; move one of them")
    if mask.dtype == torch.bool:
        return mask
    outside = (mask != 0) & (mask != 1)
    if (at := _first(outside)) is not None:
        b, s = at
        value = int(mask[b, s])
        hint = (
            "it looks like a neat-packing doc map (LLaMA-Factory neat_packing puts the 1-based doc map in "
            "attention_mask): that is already cp-packing's doc_ids, pass it to packed_seq_params_from_doc_ids as is"
            if value > 1
            else "pass a 0/1 mask (1 = real token, 0 = padding)"
        )
        raise ValueError(f"attention_mask[{b}, {s}] is {value}, not 0 or 1; {hint}")
    return mask != 0


def _shifted(x: torch.Tensor, fill: int | bool) -> torch.Tensor:
    """``x`` shifted right by one token within each row: ``out[:, s] = x[:, s - 1]``, ``fill`` at ``s = 0``."""
    out = torch.full_like(x, fill)
    out[:, 1:] = x[:, :-1]
    return out


def _check_no_negative(x: torch.Tensor, real: torch.Tensor, name: str, what: str) -> None:
    negative = real & (x < 0)
    if (at := _first(negative)) is not None:
        b, s = at
        raise ValueError(
            f"{name}[{b}, {s}] is {int(x[b, s])}; {what}. If this token is padding, mark it 0 in attention_mask"
        )


def _check_total(B: int, S: int, name: str) -> None:
    if B * S > INT32_MAX:
        raise ValueError(
            f"{name} describes B*S = {B}*{S} = {B * S} tokens, more than int32 cu_seqlens can index ({INT32_MAX}); "
            "split the batch"
        )


# ----------------------------------------------------------------------------------------------------------------
# Converters
# ----------------------------------------------------------------------------------------------------------------


def _check_not_multimodal(position_ids: Any) -> None:
    """Refuse the 3-D position ids of multimodal RoPE (Qwen2-VL ``[3, B, S]``, or ``[4, B, S]`` with the text
    positions first), naming the plane to pass instead."""
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        k, B, S = position_ids.shape
        plane = ("its first plane holds the text positions HF prepends for packing" if k == 4 else
                 "for text tokens the planes are equal and restart at 0 per document")
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}: 3-D multimodal RoPE position ids (Qwen2-VL mRoPE "
            f"[3, B, S], or [4, B, S] with the text positions first), not one [B, S] plane; pass position_ids[0] "
            f"({plane}). If position_ids[0] does not restart at 0 per document (image tokens share one temporal "
            "position), convert the collator's cu_seq_lens or seq_idx instead"
        )


def doc_ids_from_position_ids(
    position_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Doc map from ``position_ids`` that restart at 0 at every document (HF ``DataCollatorWithFlattening``, TRL).

    A new document starts wherever the position is 0, at every row start, and at the first real token after
    padding (padding cannot sit inside a document of a doc map). These two may have any position: a row may start
    with a document continued from the previous row, and left-padded rows may count positions through the padding.
    Inside a run of real tokens every position is either 0 (a new document) or the previous one plus 1 (the same
    document); anything else is an error.

    Args:
        position_ids: integer ``[B, S]`` (usually a flattened ``[1, T]``) or ``[T]`` (read as ``[1, T]``).
        attention_mask: optional bool or 0/1 integer tensor of the same shape; 0 marks padding, whose positions
            are ignored. Without it every token is real: a padding token with position 0 (TRL pads
            ``position_ids`` with 0) becomes a one-token document, so pass the mask when the batch is padded.

    Returns:
        int64 ``[B, S]`` doc map (1-based per row, 0 = padding) on ``position_ids.device``.

    Raises:
        TypeError: not a tensor, or not an integer dtype; a float mask.
        ValueError: not 1-D or 2-D (3-D multimodal RoPE ids: the message says to pass ``position_ids[0]``); a
            negative position; a position that neither restarts at 0 nor increases by 1 (the message gives
            ``[b, s]``); a mask of another shape or with values other than 0/1.

    >>> doc_ids_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
    [[1, 1, 1, 2, 2, 3]]
    >>> doc_ids_from_position_ids(torch.tensor([[0, 1, 0, 1, 0, 0]]),
    ...                           attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]])).tolist()
    [[1, 1, 2, 2, 0, 0]]
    """
    _check_not_multimodal(position_ids)
    pos = _as_rows(position_ids, "position_ids")
    real = _real_tokens(attention_mask, pos, "position_ids")
    _check_no_negative(pos, real, "position_ids", "positions count 0, 1, 2, ... from each document's start")
    prev_real = _shifted(real, False)
    prev_pos = _shifted(pos, -1)
    start = real & (~prev_real | (pos == 0))
    bad = real & ~start & (pos != prev_pos + 1)
    if (at := _first(bad)) is not None:
        b, s = at
        raise ValueError(
            f"position_ids[{b}, {s}] is {int(pos[b, s])} after {int(prev_pos[b, s])} at [{b}, {s - 1}]: a position "
            "must restart at 0 (a new document) or increase by 1 (the same document). If your positions restart at "
            "another value k (HF DataCollatorWithFlattening(position_ids_start=k)), pass position_ids - k; if these "
            "tokens are padding, pass attention_mask with 0 on them"
        )
    return torch.cumsum(start, dim=1).masked_fill_(~real, 0)


def doc_ids_from_seq_idx(seq_idx: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Doc map from a 0-based ``seq_idx`` (HF ``DataCollatorWithFlattening(return_seq_idx=True)``, mamba kernels).

    ``seq_idx`` numbers the documents of the flattened batch 0, 1, 2, ...; passed as ``doc_ids`` as it is, its
    document 0 would be read as padding, silently. Each run of one value inside a row becomes a document, numbered
    1, 2, ... from the start of every row (a row may start at any value, e.g. when ``seq_idx`` counts across rows).
    Between neighbouring real tokens the index stays or steps up by 1; a decrease or a jump is an error.

    Args:
        seq_idx: non-negative integer ``[B, S]`` (usually ``[1, T]``) or ``[T]`` (read as ``[1, T]``).
        attention_mask: optional bool or 0/1 integer tensor of the same shape; 0 marks padding.

    Returns:
        int64 ``[B, S]`` doc map (1-based per row, 0 = padding) on ``seq_idx.device``.

    Raises:
        TypeError: not a tensor, or not an integer dtype; a float mask.
        ValueError: not 1-D or 2-D; a negative index; an index that decreases (position ids? use
            :func:`doc_ids_from_position_ids`) or jumps by more than 1 between neighbours; a bad mask.

    >>> doc_ids_from_seq_idx(torch.tensor([[0, 0, 1, 1, 1, 2]])).tolist()
    [[1, 1, 2, 2, 2, 3]]
    """
    seq = _as_rows(seq_idx, "seq_idx")
    real = _real_tokens(attention_mask, seq, "seq_idx")
    _check_no_negative(seq, real, "seq_idx", "seq_idx numbers documents 0, 1, 2, ...")
    prev_real = _shifted(real, False)
    step = seq - _shifted(seq, 0)
    neighbours = real & prev_real
    bad = neighbours & ((step < 0) | (step > 1))
    if (at := _first(bad)) is not None:
        b, s = at
        now, before = int(seq[b, s]), int(seq[b, s - 1])
        hint = (
            "values that go back look like position_ids: convert those with doc_ids_from_position_ids"
            if now < before
            else "a jump skips a document number: pass the seq_idx the collator returned, with attention_mask 0 on "
            "padding"
        )
        raise ValueError(
            f"seq_idx[{b}, {s}] is {now} after {before} at [{b}, {s - 1}]: seq_idx numbers documents in order, so "
            f"it stays or steps up by 1 between neighbouring tokens; {hint}"
        )
    start = real & (~prev_real | (step != 0))
    return torch.cumsum(start, dim=1).masked_fill_(~real, 0)


def _batch_shape(batch_shape: Any) -> tuple[int, int]:
    """``(B, S)`` from ``(B, S)``, or from ``(T,)`` read as ``(1, T)``."""
    if not isinstance(batch_shape, (tuple, list, torch.Size)) or len(batch_shape) not in (1, 2):
        raise TypeError(
            f"batch_shape must be (B, S) or (T,), e.g. input_ids.shape, got {batch_shape!r}"
        )
    dims = [check_int(d, "every entry of batch_shape", min=0, hint="pass input_ids.shape") for d in batch_shape]
    return (1, dims[0]) if len(dims) == 1 else (dims[0], dims[1])


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, *, batch_shape: Sequence[int]) -> torch.Tensor:
    """Doc map from cumulative sequence lengths (HF flash-attention kwargs ``cu_seq_lens_q`` / ``cu_seq_lens_k``).

    Segment ``k`` covers flat positions ``[cu_seqlens[k], cu_seqlens[k + 1])`` of the batch flattened to
    ``T = B * S`` tokens; the tokens from ``cu_seqlens[-1]`` to ``T`` are padding. Empty segments (a repeated
    value) hold no token and get no number. With ``B > 1`` every segment must lie inside one row.

    Args:
        cu_seqlens: integer ``[N + 1]`` (HF gives int32), starting at 0, never decreasing, ending at most at ``T``.
        batch_shape: ``(B, S)`` of the batch (e.g. ``input_ids.shape``: ``(1, T)`` for HF's flattened batch), or
            ``(T,)``, read as ``(1, T)``.

    Returns:
        int64 ``[B, S]`` doc map (1-based per row, 0 = padding) on ``cu_seqlens.device``.

    Raises:
        TypeError: not a tensor, or not an integer dtype; ``batch_shape`` not a shape.
        ValueError: not 1-D and non-empty, not starting at 0, decreasing, ending past ``B * S``; a segment that
            crosses a row start; more than ``2**31 - 1`` tokens.

    >>> doc_ids_from_cu_seqlens(torch.tensor([0, 3, 5], dtype=torch.int32), batch_shape=(1, 7)).tolist()
    [[1, 1, 1, 2, 2, 0, 0]]
    >>> doc_ids_from_cu_seqlens(torch.tensor([0, 2, 4, 5]), batch_shape=(2, 4)).tolist()
    [[1, 1, 2, 2], [1, 0, 0, 0]]
    """
    if isinstance(cu_seqlens, torch.Tensor):
        _check_fits_int64(cu_seqlens, "cu_seqlens")
    cu = check_cu_seqlens(cu_seqlens, "cu_seqlens")
    B, S = _batch_shape(batch_shape)
    _check_total(B, S, "batch_shape")
    T = B * S
    end = int(cu[-1])
    if end > T:
        raise ValueError(
            f"cu_seqlens ends at {end} but batch_shape {tuple(batch_shape)} holds only {T} tokens; pass the shape "
            "of the batch these cu_seqlens describe (input_ids.shape)"
        )
    lengths = np.diff(cu)
    kept = np.flatnonzero(lengths > 0)  # original segment numbers of the non-empty segments
    starts, ends, lengths = cu[:-1][kept], cu[1:][kept], lengths[kept]
    numbers = np.empty(0, dtype=np.int64)
    if kept.size:
        rows = starts // S  # S > 0 here: a non-empty segment needs T > 0
        crossing = ends - 1 >= (rows + 1) * S  # the segment's last token lies in a later row than its first
        if crossing.any():
            k = int(np.flatnonzero(crossing)[0])
            row = int(rows[k]) + 1
            raise ValueError(
                f"segment {int(kept[k])} of cu_seqlens spans flat positions [{int(starts[k])}, {int(ends[k])}) and "
                f"crosses the start of row {row} (flat position {row * S}) of batch_shape ({B}, {S}): a document "
                f"cannot run across two rows; pass batch_shape=(1, {T}) for a flattened batch, or cu_seqlens with a "
                f"boundary at every multiple of {S}"
            )
        first = np.searchsorted(rows, rows, side="left")  # rows never decrease: the row's first segment
        numbers = np.arange(kept.size, dtype=np.int64) - first + 1
    flat = np.zeros(T, dtype=np.int64)
    flat[:end] = np.repeat(numbers, lengths)
    return torch.from_numpy(flat).view(B, S).to(cu_seqlens.device)


#: The value NeMo AutoModel's ``packed_sequence_thd_collater`` pads ``seq_lens`` / ``seq_lens_padded`` rows with
#: (to the batch's largest number of sequences): a padding entry at the end of a row, not a length.
NEMO_PAD = -1000


def _length_error(name: str, b: int, k: int, value: int) -> ValueError:
    if value > INT32_MAX:
        return ValueError(
            f"{name}[{b}][{k}] is {value}, more than int32 cu_seqlens can index ({INT32_MAX}): no sequence of a "
            "batch is that long; check how the lengths were built (an uninitialised or overflowed tensor?)"
        )
    return ValueError(
        f"{name}[{b}][{k}] is {value}; a length is >= 0, -1 or 0 marks an empty sequence slot, and {NEMO_PAD} "
        "(NeMo's padding entry) may only pad the end of a row"
    )


def _python_table(x: Sequence[Any], name: str) -> torch.Tensor:
    """int64 ``[B, N]`` from a list of rows (each a list of ints or a 1-D integer tensor), short rows padded with -1;
    every value checked as a Python int first (``torch.tensor`` would fail on one past int64)."""
    rows = [x] if x and all(is_int(v) for v in x) else list(x)
    for b, row in enumerate(rows):
        if isinstance(row, torch.Tensor) and row.dim() == 1 and row.dtype in INTEGER_DTYPES:
            rows[b] = row = _as_rows(row, f"{name}[{b}]")[0].tolist()  # a list of per-row 1-D tensors
        if not isinstance(row, (list, tuple)):
            raise TypeError(
                f"{name}[{b}] must be a list of ints (the lengths of row {b}'s sequences), got "
                f"{type(row).__name__}; pass a list of lists or a [B, N] tensor"
            )
        for k, v in enumerate(row):
            if not is_int(v):
                raise TypeError(f"{name}[{b}][{k}] must be an int (a length), got {v!r} ({type(v).__name__})")
            if v > INT32_MAX or (v < -1 and v != NEMO_PAD):
                raise _length_error(name, b, k, int(v))
    n = max((len(r) for r in rows), default=0)
    return torch.tensor([[int(v) for v in r] + [-1] * (n - len(r)) for r in rows], dtype=torch.int64).view(len(rows), n)


def _lens_table(x: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lengths, nemo_pad)``: int64 ``[B, N]`` lengths in ``[-1, 2**31 - 1]`` (-1 for an empty slot, NeMo's
    trailing ``-1000`` entries included) and bool ``[B, N]``, True on those ``-1000`` entries."""
    if isinstance(x, torch.Tensor):
        table = _as_rows(x, name, "[B, N] (per row, the length of each sequence, -1 or 0 for none, -1000 as NeMo "
                         "pads) or [N] for one row", "pass one row of lengths per batch row")
    elif isinstance(x, (list, tuple)):
        table = _python_table(x, name)
    else:
        raise TypeError(
            f"{name} must be a [B, N] integer tensor or a list of lists of ints, got {type(x).__name__}; "
            "wrap a NumPy array with torch.as_tensor"
        )
    nemo_pad = table == NEMO_PAD
    if (at := _first(((table < -1) & ~nemo_pad) | (table > INT32_MAX))) is not None:
        raise _length_error(name, at[0], at[1], int(table[at]))
    if (at := _first(nemo_pad[:, :-1] & ~nemo_pad[:, 1:])) is not None:
        b, k = at
        raise ValueError(
            f"{name}[{b}][{k}] is {NEMO_PAD} (NeMo's padding entry) but {name}[{b}][{k + 1}] is "
            f"{int(table[b, k + 1])}: {NEMO_PAD} only pads the end of a row (NeMo's packed_sequence_thd_collater "
            "pads every row to the batch's largest number of sequences); use -1 or 0 for an empty slot inside a row"
        )
    return table.masked_fill(nemo_pad, -1), nemo_pad


def _padded_lengths(seq_lens_padded: Any, real: torch.Tensor, real_pad: torch.Tensor) -> torch.Tensor:
    """The padded length ``P`` of every slot (``>= L``), checked against the real lengths' layout."""
    padded, padded_pad = _lens_table(seq_lens_padded, "seq_lens_padded")
    if padded.shape != real.shape:
        raise ValueError(
            f"seq_lens_padded has {tuple(padded.shape)} (rows, slots) but seq_lens has {tuple(real.shape)}; "
            "give one padded length per sequence, in the same layout"
        )
    padded, padded_pad = padded.to(real.device), padded_pad.to(real.device)
    if (at := _first(padded_pad != real_pad)) is not None:
        shown = [NEMO_PAD if m[at] else int(t[at]) for t, m in ((real, real_pad), (padded, padded_pad))]
        raise ValueError(
            f"seq_lens[{at[0]}][{at[1]}] is {shown[0]} but seq_lens_padded[{at[0]}][{at[1]}] is {shown[1]}: NeMo pads "
            f"both with {NEMO_PAD} in the same slots; pass the seq_lens and seq_lens_padded of one batch"
        )
    L, P = real.clamp(min=0), padded.clamp(min=0)
    if (at := _first(P < L)) is not None:  # a padded length holds the real tokens plus padding
        raise ValueError(
            f"seq_lens_padded[{at[0]}][{at[1]}] is {int(padded[at])} but seq_lens[{at[0]}][{at[1]}] is "
            f"{int(real[at])}: the padded length must be >= the real length; check the argument order "
            "(seq_lens = real lengths, seq_lens_padded = padded lengths)"
        )
    return P


def doc_ids_from_seq_lens(
    seq_lens: torch.Tensor | Sequence[Sequence[int]],
    *,
    seq_lens_padded: torch.Tensor | Sequence[Sequence[int]] | None = None,
    seq_len: int | None = None,
) -> torch.Tensor:
    """Doc map from per-row sequence lengths (NeMo/Megatron THD ``seq_lens`` / ``seq_lens_padded``, TRL BFD).

    Row ``b`` holds its sequences one after the other: sequence ``k`` takes ``seq_lens_padded[b][k]`` tokens (its
    ``seq_lens[b][k]`` real tokens first, then its padded tail), and the row ends with padding up to ``seq_len``.
    The padded tail of a sequence belongs to its slot in Megatron's THD layout (``cu_seqlens_padded``) but holds no
    real token: it maps to 0 (padding), never to the sequence's document, so no real token attends to it and no
    label counts it. A slot of length -1 or 0 holds no sequence and gets no number (a slot with 0 real tokens and
    a positive padded length is padding only). NeMo AutoModel's ``packed_sequence_thd_collater`` pads every row to
    the batch's largest number of sequences with ``-1000``: trailing ``-1000`` entries are read as empty slots.

    Args:
        seq_lens: the real length of every sequence of every row: an integer ``[B, N]`` tensor (or ``[N]`` for one
            row) with -1 or 0 in unused slots (``-1000`` at the end of a row, as NeMo pads), or a list of rows, each
            a list of ints or a 1-D integer tensor (a list of ints is one row).
        seq_lens_padded: optional, the same layout (``-1000`` in the same slots): each sequence's padded length
            (``>= seq_lens``). Megatron's ``cu_seqlens_q_padded.diff()``. Default: no padding inside rows.
        seq_len: ``S``, the row length; default the longest row (sum of its padded lengths).

    Returns:
        int64 ``[B, S]`` doc map (1-based per row, 0 = padding) on ``seq_lens``' device (CPU for lists).

    Raises:
        TypeError: not a tensor or list of lists of ints; a float tensor; ``seq_len`` not an int.
        ValueError: a length below -1 (other than a trailing -1000) or above ``2**31 - 1``; ``seq_lens_padded`` of
            another layout, with ``-1000`` in other slots, or shorter than ``seq_lens`` somewhere; a row longer than
            ``seq_len``; more than ``2**31 - 1`` tokens. Checked before anything of the output's size is allocated.

    >>> doc_ids_from_seq_lens([[3, 2], [4]], seq_len=6).tolist()
    [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    >>> doc_ids_from_seq_lens([[3, 1]], seq_lens_padded=[[4, 2]]).tolist()
    [[1, 1, 1, 0, 2, 0]]
    >>> doc_ids_from_seq_lens(torch.tensor([[3, 2], [6, -1000]]), seq_lens_padded=torch.tensor([[4, 2], [6, -1000]])
    ...                       ).tolist()  # NeMo's collated THD batch
    [[1, 1, 1, 0, 2, 2], [1, 1, 1, 1, 1, 1]]
    """
    real, real_pad = _lens_table(seq_lens, "seq_lens")
    L = real.clamp(min=0)
    P = L if seq_lens_padded is None else _padded_lengths(seq_lens_padded, real, real_pad)
    B, N = L.shape
    row_total = P.sum(dim=1)  # every entry is <= 2**31 - 1: no int64 sum of N < 2**32 of them wraps
    longest = int(row_total.max()) if B else 0
    if seq_len is None:
        S = longest
    else:
        S = check_int(seq_len, "seq_len", min=0, hint="the row length of the batch")
        if longest > S:
            b = int(torch.argmax(row_total))
            raise ValueError(
                f"row {b} of seq_lens holds {longest} tokens (padded lengths included) but seq_len is {S}; pass "
                f"seq_len >= {longest}, or leave it out (default: the longest row)"
            )
    _check_total(B, S, "seq_lens")
    has = L > 0
    number = torch.cumsum(has, dim=1).masked_fill_(~has, 0)
    zeros = torch.zeros_like(number)
    values = torch.cat([torch.stack([number, zeros], dim=2).view(B, 2 * N), number.new_zeros(B, 1)], dim=1)
    counts = torch.cat([torch.stack([L, P - L], dim=2).view(B, 2 * N), (S - row_total).view(B, 1)], dim=1)
    return torch.repeat_interleave(values.view(-1), counts.view(-1), output_size=B * S).view(B, S)


# ----------------------------------------------------------------------------------------------------------------
# The 0-based trap
# ----------------------------------------------------------------------------------------------------------------


class ZeroBasedDocIdsWarning(UserWarning):
    """A doc map looks like a 0-based index (``seq_idx``): its first document would be read as padding."""


_zero_based_warned = False


def _zero_based_rows(doc_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: the row starts with padding and its second segment starts in the same row with document 1.
    From the segments: O(B log segments) values read, not the map (NumPy on CPU: no per-op torch overhead)."""
    B, S = doc_ids.shape
    flat = doc_ids.reshape(-1)
    flat = as_signed(flat)  # bit for bit; 0 and 1 kept
    cpu = flat.device.type == "cpu"
    lib = np if cpu else torch
    flat = flat.numpy() if cpu else flat
    cu = cu_seqlens.numpy().astype(np.int64) if cpu else cu_seqlens.to(device=flat.device, dtype=torch.int64)
    row_start = lib.arange(B) * S if cpu else torch.arange(B, device=flat.device) * S  # [B]
    nxt = cu[lib.searchsorted(cu, row_start) + 1]  # [B]: where the segment after each row's first one starts
    looks = (flat[row_start] == 0) & (nxt < row_start + S) & (flat[lib.minimum(nxt, row_start + S - 1)] == 1)
    return torch.from_numpy(looks) if cpu else looks


def warn_if_zero_based(doc_ids: torch.Tensor, *, stacklevel: int = 2, cu_seqlens: torch.Tensor | None = None) -> bool:
    """True (and a warning, once per process) when a doc map looks 0-based: a row starts with padding, then 1.

    A 0-based ``seq_idx`` (``[0, 0, 1, 1, 2]``) is a valid doc map whose first document is padding: its tokens
    get no label and attend only to each other, silently. A row whose first token is 0, and whose first non-zero
    value is 1, looks like that; so does a left-padded row, which is why this warns instead of raising. The
    warning (:class:`ZeroBasedDocIdsWarning`) names :func:`doc_ids_from_seq_idx`; it is given once per process,
    and the return value says for every call whether the map looks 0-based.

    Args:
        doc_ids: ``[B, S]`` integer doc map.
        stacklevel: passed to ``warnings.warn``: 2 points the warning at the caller; a library function that calls
            this on its caller's behalf passes 3.
        cu_seqlens: optional, the map's own ``cu_seqlens`` as ``packed_seq_params_from_doc_ids`` builds them (a
            boundary at every row start): the check then reads only the rows' first segments, O(B log segments),
            instead of the whole map.

    Returns:
        ``True`` when some row looks 0-based, else ``False``. One host sync on a device tensor.

    >>> warn_if_zero_based(torch.tensor([[1, 1, 2, 0]]))
    False
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", ZeroBasedDocIdsWarning)
    ...     warn_if_zero_based(torch.tensor([[0, 0, 1, 1, 2]]))
    True
    """
    global _zero_based_warned
    check_doc_ids(doc_ids)
    stacklevel = check_int(stacklevel, "stacklevel", min=1)
    B, S = doc_ids.shape
    if B == 0 or S == 0:
        return False
    if cu_seqlens is not None:
        looks = _zero_based_rows(doc_ids, cu_seqlens)
    else:
        padded = doc_ids[:, 0] == 0  # [B]: only a row that starts with padding can look 0-based
        if not bool(padded.any()):  # the common case costs O(B)
            return False
        one = doc_ids == 1
        # the first non-zero token of the row is a 1 (argmax of a bool mask: its first True; no gather, which some
        # unsigned dtypes lack)
        first_nonzero = torch.argmax((doc_ids != 0).to(torch.uint8), dim=1)
        first_one = torch.argmax(one.to(torch.uint8), dim=1)
        looks = padded & one.any(dim=1) & (first_one == first_nonzero)
    if not bool(looks.any()):
        return False
    if not _zero_based_warned:
        _zero_based_warned = True
        row = int(torch.argmax(looks.to(torch.uint8)))
        warnings.warn(
            f"doc_ids row {row} starts with padding (0) followed by document 1: it looks like a 0-based index "
            "(seq_idx), whose first document would be read as padding (no labels, no attention to the rest). "
            "Convert a 0-based seq_idx with cp_packing.formats.doc_ids_from_seq_idx(seq_idx); ignore this if the "
            "row is really left-padded (warned once per process)",
            ZeroBasedDocIdsWarning,
            stacklevel=stacklevel,
        )
    return True
