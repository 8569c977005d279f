"""Re-lay a packed batch so that every segment's length is a multiple of a given number (docs/padding.md).

Why: the zigzag CP layout cuts every segment into ``2 * cp_size`` equal chunks; ring-flash-attn's zigzag varlen
kernel computes wrong numbers, silently, on other lengths, and TransformerEngine's THD + CP path asserts them.
Megatron pads every sequence to a multiple of ``2 * cp_size`` in its dataset; this module does it for a neat-packing
doc map, in two steps:

1. the doc map: each document gets pad tokens (same doc index) right after its last real token, original padding is
   dropped (kept as an ``m``-token separator between two runs of one index), rows are re-padded at the end. This
   gives a ``PaddedBatch`` with the new map, ``index`` and ``is_pad``;
2. each per-token tensor: ``PaddedBatch.pad_tensor`` (a fill value the caller chooses) or ``pad_positions``
   (position ids that continue the document's count).

``pad_segments(doc_ids, multiple=2 * cp_size, tensors={...})`` does both. ``pad_rows`` is the simpler padding
that layouts needing only ``S % cp == 0`` (contiguous, balanced) take: one more padding run at the end of every row.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from cp_packing._checks import (INT32_MAX, as_signed, check_doc_ids, check_fits_dtype, check_int, check_tensor,
                                signed_dtype)
from cp_packing.packed_seq import packed_seq_params_from_doc_ids

__all__ = ["MAX_BYTES", "PaddedBatch", "pad_rows", "pad_segments"]

MAX_BYTES = 4 * 2**30
"""``pad_segments``' default memory budget (4 GiB): it refuses, before allocating, an output whose estimated peak
memory (``_bytes_per_token`` per output token) is larger; pass ``max_bytes=`` to change it."""

_MAP_BYTES = 48  # peak bytes per output token of the doc-map step (measured: 43-48 for int32/int64 maps)

def _restore(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Undo ``as_signed`` (``Tensor.view(dtype)`` is not differentiable: only called when the dtype differs)."""
    return x if x.dtype == dtype else x.view(dtype)


def _bits(fill: float | int | bool, dtype: torch.dtype) -> float | int | bool:
    """``fill`` as the value of ``as_signed``'s view of a ``dtype`` tensor (two's complement)."""
    if signed_dtype(dtype) == dtype:
        return fill
    width = torch.iinfo(dtype).bits
    value = int(fill)
    return value - (1 << width) if value >= 1 << (width - 1) else value


@dataclass(frozen=True)
class PaddedBatch:
    """A batch re-laid by ``pad_segments`` so that every segment length is a multiple of ``multiple``.

    Attributes:
        doc_ids: ``[B, S']`` (the input's dtype), the new doc map; every segment length and ``S'`` are multiples of
            ``multiple``.
        tensors: ``name -> [B, S', ...]`` re-laid per-token tensors (same dtype and device as given).
        index: int64 ``[B, S]``, for every original token its flat position in the new ``[B * S']`` stream, ``-1``
            for original padding (dropped): ``new.reshape(B * S', ...)[index[real]] == original[real]``.
        is_pad: bool ``[B, S']``, True for every token that is not an original real token.
        multiple: the ``m`` every segment length is a multiple of.
        num_real_tokens: original tokens with a non-zero doc index (each appears exactly once in the output).
        num_added_tokens: pad tokens placed INSIDE document segments (they take part in attention: the real cost).
        num_separator_tokens: padding tokens kept between two runs of one document index (``m`` per such gap).
        num_dropped_tokens: original padding tokens (index 0), dropped.
    """

    doc_ids: torch.Tensor
    tensors: dict[str, torch.Tensor]
    index: torch.Tensor
    is_pad: torch.Tensor
    multiple: int
    num_real_tokens: int
    num_added_tokens: int
    num_separator_tokens: int
    num_dropped_tokens: int

    @property
    def original_shape(self) -> tuple[int, int]:
        """``(B, S)`` of the input doc map."""
        return (int(self.index.shape[0]), int(self.index.shape[1]))

    @property
    def padded_length(self) -> int:
        """``S'``, the new row length (a multiple of ``multiple``)."""
        return int(self.doc_ids.shape[1])

    @property
    def overhead(self) -> float:
        """``num_added_tokens / num_real_tokens`` (0.0 without real tokens), about ``(m - 1) / (2 * mean doc
        length)``: small for long documents, up to ``m - 1`` for one-token documents."""
        return self.num_added_tokens / self.num_real_tokens if self.num_real_tokens else 0.0

    def pad_tensor(self, x: torch.Tensor, fill_value: float | int | bool = 0, *, name: str = "x") -> torch.Tensor:
        """Re-lay a per-token tensor ``[B, S, ...]`` -> ``[B, S', ...]``; every added token gets ``fill_value``.

        Args:
            x: ``[B, S, ...]`` on the doc map's device, any dtype.
            fill_value: the value of every token that is not an original real token (labels: ``-100``); it must
                fit ``x``'s dtype (torch would wrap ``-100`` to ``156`` in uint8).
            name: how error messages name ``x``.

        Returns:
            ``[B, S', ...]``, same dtype and device; differentiable with respect to ``x``.

        >>> batch = pad_segments(torch.tensor([[1, 1, 1, 0]]), multiple=2)
        >>> batch.pad_tensor(torch.tensor([[5, 6, 7, 0]]), -100).tolist()
        [[5, 6, 7, -100]]
        """
        B, S = self.original_shape
        x = _check_per_token(name, x, B, S, self.index.device)
        check_fits_dtype(fill_value, x.dtype, f"the pad value {fill_value!r} for tensors[{name!r}]",
                         fix=f"pass a representable value for {name!r} or convert the tensor (labels: a signed dtype)")
        rest = tuple(x.shape[2:])
        src = torch.nonzero_static(self.index.reshape(-1) >= 0, size=self.num_real_tokens).view(-1)  # [R]
        dst = self.index.reshape(-1).index_select(0, src)  # [R]: no duplicates, no host sync
        flat = as_signed(x.reshape(B * S, *rest))
        out = flat.new_full((B * self.padded_length, *rest), _bits(fill_value, x.dtype))
        out = out.index_copy(0, dst, flat.index_select(0, src))
        return _restore(out, x.dtype).view(B, self.padded_length, *rest)

    def pad_positions(self, x: torch.Tensor, *, name: str = "position_ids") -> torch.Tensor:
        """Re-lay position ids ``[B, S, ...]``: a pad token inside a document continues its count (last real value
        + 1, + 2, ...: real tokens' RoPE positions are unchanged); a padding token (index 0) gets its 0-based
        position inside its padding run.

        >>> batch = pad_segments(torch.tensor([[1, 1, 1, 0]]), multiple=2)
        >>> batch.pad_positions(torch.tensor([[0, 1, 2, 0]])).tolist()
        [[0, 1, 2, 3]]
        """
        out = self.pad_tensor(x, 0, name=name)
        if out.dtype == torch.bool:
            raise TypeError(f"tensors[{name!r}] holds position ids and cannot be bool; convert it to an integer dtype")
        B, Sp = out.shape[:2]
        if B * Sp == 0:
            return out
        bshape = (-1, *([1] * (out.dim() - 2)))
        flat = as_signed(out.reshape(B * Sp, *out.shape[2:]))  # [T', ...]
        new = as_signed(self.doc_ids).reshape(-1)  # [T']
        ar = torch.arange(B * Sp, device=new.device)
        real = ~self.is_pad.reshape(-1)
        last_real = torch.cummax(torch.where(real, ar, -1), 0).values  # [T']; in a document: its last real token
        changed = torch.cat([real[:1], new[1:] != new[:-1]])  # [T'] (first entry: irrelevant, a row start)
        seg_start = (ar % Sp == 0) | changed  # [T']: the seed's segment starts
        run_pos = ar - torch.cummax(torch.where(seg_start, ar, 0), 0).values  # [T'] position inside the segment
        count_on = flat.index_select(0, last_real.clamp(min=0)) + (ar - last_real).to(flat.dtype).view(bshape)
        out = torch.where((new == 0).view(bshape), run_pos.to(flat.dtype).view(bshape),
                          torch.where(real.view(bshape), flat, count_on))
        return _restore(out, x.dtype).view(B, Sp, *x.shape[2:])

    def unpad(self, x: torch.Tensor, fill_value: float | int | bool = 0) -> torch.Tensor:
        """Map a tensor of the padded stream back to the original layout.

        Args:
            x: ``[B, S', ...]``, ``[B * S', ...]`` or ``[1, B * S', ...]`` (e.g. logits of the padded batch).
            fill_value: value of the original padding tokens (index 0); it must fit ``x``'s dtype.

        Returns:
            ``[B, S, ...]``: real tokens get their value from ``x``, original padding tokens ``fill_value``.
            A gather (differentiable, no host sync).
        """
        B, S = self.original_shape
        Sp = self.padded_length
        check_tensor(x, "x", "of shape [B, S', ...]")
        if x.dim() >= 2 and tuple(x.shape[:2]) in ((B, Sp), (1, B * Sp)):
            rest = tuple(x.shape[2:])
        elif x.dim() >= 1 and x.shape[0] == B * Sp:
            rest = tuple(x.shape[1:])
        else:
            raise ValueError(
                f"unpad expects a tensor of shape [B, S', ...] = [{B}, {Sp}, ...], [B*S', ...] = [{B * Sp}, ...] or "
                f"[1, B*S', ...], got shape {tuple(x.shape)}; pass an output of the padded batch"
            )
        check_fits_dtype(fill_value, x.dtype, f"unpad's fill_value={fill_value!r}",
                         fix="pass a value the tensor can hold")
        fill = torch.full((), _bits(fill_value, x.dtype), dtype=as_signed(x).dtype, device=x.device)
        if B * Sp == 0:  # nothing in the padded stream: every original token was padding
            return _restore(fill.expand(B, S, *rest).clone(), x.dtype)
        flat = as_signed(x.reshape(B * Sp, *rest))
        real = (self.index >= 0).reshape(B * S, *([1] * len(rest)))
        gathered = flat.index_select(0, self.index.reshape(-1).clamp(min=0))  # [B*S, ...]
        return _restore(torch.where(real, gathered, fill), x.dtype).view(B, S, *rest)


def _check_per_token(name: str, x: object, B: int, S: int, device: torch.device) -> torch.Tensor:
    check_tensor(x, f"tensors[{name!r}]", "of shape [B, S, ...]")
    if x.dim() < 2 or tuple(x.shape[:2]) != (B, S):
        raise ValueError(
            f"tensors[{name!r}] has shape {tuple(x.shape)}, but per-token tensors must be [B, S, ...] = "
            f"[{B}, {S}, ...] like doc_ids; add the batch dimension or transpose it"
        )
    if x.device != device:
        raise ValueError(f"tensors[{name!r}] is on {x.device} but doc_ids is on {device}; move it with .to(...)")
    return x


def _new_segment_lengths(doc: torch.Tensor, cu: torch.Tensor, m: int) -> tuple[torch.Tensor, ...]:
    """Per input segment (int64 ``cu`` ``[N + 1]``): its row, length, whether it is a document, and its new length
    (documents rounded up to ``m``, a padding run between two runs of one index ``m``, other padding 0)."""
    S = doc.shape[1]
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]  # [N]
    seg_doc = as_signed(doc).reshape(-1)[starts]  # [N] doc index of each segment
    seg_row = starts // max(S, 1)  # [N]
    is_doc = seg_doc != 0
    separator = torch.zeros_like(is_doc)
    if starts.numel() >= 3:  # dropping it would merge the two runs into one segment
        separator[1:-1] = (~is_doc[1:-1] & (seg_row[:-2] == seg_row[1:-1]) & (seg_row[2:] == seg_row[1:-1])
                           & (seg_doc[:-2] == seg_doc[2:]))
    zero = torch.zeros_like(lengths)
    new_len = torch.where(is_doc, (lengths + m - 1) // m * m, torch.where(separator, zero + m, zero))  # [N]
    return seg_doc, seg_row, lengths, is_doc, new_len


def _bytes_per_token(tensors: Mapping[str, torch.Tensor], position_keys: Sequence[str]) -> int:
    """Estimated peak bytes per OUTPUT token of ``pad_segments``: the doc-map step (the new map, ``index``,
    ``is_pad`` and their temporaries), plus 3x each tensor's bytes per token (its output, the gathered real tokens,
    the filled copy), 6x for position tensors (their count runs). An upper bound of what was measured (docs/padding.md).
    """
    total = _MAP_BYTES
    for name, x in tensors.items():
        per_token = x.element_size() * math.prod(x.shape[2:])
        total += (6 if name in position_keys else 3) * per_token
    return total


def _pad_doc_map(doc_ids: torch.Tensor, m: int, row_length: int | None, max_tokens: int,
                 budget: tuple[int, int] = (_MAP_BYTES, MAX_BYTES)) -> PaddedBatch:
    """Step 1: the new doc map, ``index`` and ``is_pad`` (``tensors`` empty). One host sync; refuses an output of
    more than ``max_tokens`` tokens, or of more than ``budget = (bytes per output token, max_bytes)``, before
    allocating it."""
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens.to(torch.int64)  # validates doc_ids
    B, S = doc_ids.shape
    device = doc_ids.device
    seg_doc, seg_row, lengths, is_doc, new_len = _new_segment_lengths(doc_ids, cu, m)
    content = torch.zeros(B, dtype=torch.int64, device=device).index_add_(0, seg_row, new_len)  # [B]
    zero = torch.zeros((), dtype=torch.int64, device=device)
    longest, covered, num_real, num_added, num_sep = torch.stack([  # the one host sync
        content.max() if B > 0 else zero, new_len.sum(), torch.where(is_doc, lengths, 0).sum(),
        torch.where(is_doc, new_len - lengths, 0).sum(), torch.where(is_doc, 0, new_len).sum()]).tolist()
    if row_length is not None and row_length < longest:
        raise ValueError(
            f"row_length={row_length} is too small: the longest row needs {longest} tokens after padding every "
            f"segment to a multiple of {m}; pass row_length >= {longest} (a multiple of {m}) or None"
        )
    Sp = longest if row_length is None else row_length
    _check_bound(B, Sp, m, max_tokens, *budget)

    # New segment starts; every original token moves with its segment (original padding: -1).
    excl = torch.cumsum(new_len, 0) - new_len  # [N] covered tokens before each segment, whole batch
    new_start = seg_row * Sp + excl - (torch.cumsum(content, 0) - content)[seg_row]  # [N] flat start in [B * S']
    real = doc_ids.reshape(-1) != 0  # [T]
    moved = torch.arange(B * S, device=device) + torch.repeat_interleave(new_start - cu[:-1], lengths,
                                                                        output_size=B * S)
    index = torch.where(real, moved, -1)  # [T]
    cov_pos = torch.arange(covered, device=device) + torch.repeat_interleave(new_start - excl, new_len,
                                                                             output_size=covered)
    new_doc = torch.zeros(B * Sp, dtype=seg_doc.dtype, device=device)  # [T']; row-end padding stays 0
    new_doc.index_copy_(0, cov_pos, torch.repeat_interleave(seg_doc, new_len, output_size=covered))
    dst = index.index_select(0, torch.nonzero_static(real, size=num_real).view(-1))  # [R], no host sync
    is_pad = torch.ones(B * Sp, dtype=torch.bool, device=device).index_fill_(0, dst, False)
    return PaddedBatch(doc_ids=_restore(new_doc, doc_ids.dtype).view(B, Sp), tensors={}, index=index.view(B, S),
                       is_pad=is_pad.view(B, Sp), multiple=m, num_real_tokens=num_real, num_added_tokens=num_added,
                       num_separator_tokens=num_sep, num_dropped_tokens=B * S - num_real)


def _check_bound(B: int, Sp: int, m: int, max_tokens: int, per_token: int = _MAP_BYTES,
                 max_bytes: int = MAX_BYTES) -> None:
    """Python ints throughout: nothing here can wrap."""
    if B * Sp > max_tokens:
        raise ValueError(
            f"the padded batch would hold B*S' = {B}*{Sp} = {B * Sp} tokens, more than max_tokens={max_tokens} "
            f"(default {INT32_MAX}, what int32 cu_seqlens can index); nothing was allocated. Use a smaller "
            f"multiple (got {m}) or row_length, split the batch, or raise max_tokens"
        )
    need = B * Sp * per_token
    if need > max_bytes:
        raise ValueError(
            f"pad_segments would need about {need / 2**30:.2f} GiB ({need} bytes: B*S' = {B}*{Sp} = {B * Sp} output "
            f"tokens x {per_token} bytes per token for the doc map, its index and every tensor), more than "
            f"max_bytes={max_bytes} (default {MAX_BYTES}, 4 GiB); nothing was allocated. Pass max_bytes= a larger "
            f"budget if the machine has it, or use a smaller multiple (got {m}) or row_length, or split the batch"
        )


def _check_keys(keys: object, what: str) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise TypeError(f"{what} must be a sequence of tensor names, got the string {keys!r}; write ({keys!r},)")
    try:
        keys = tuple(keys)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of tensor names, got {keys!r}") from None
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"{what} must hold tensor names (str), got {k!r}")
    return tuple(keys)


def _check_label_padding(tensors: Mapping[str, torch.Tensor], doc_ids: torch.Tensor, label_keys: tuple[str, ...],
                         ignore_index: int) -> None:
    """Labels of original padding tokens must be ``ignore_index``: those tokens are dropped. One host sync."""
    names = [k for k in label_keys if k in tensors and doc_ids.numel() > 0]
    if not names:
        return
    pad = (doc_ids == 0).reshape(doc_ids.numel(), 1)
    bad = torch.stack([((as_signed(tensors[k]).reshape(doc_ids.numel(), -1) != _bits(ignore_index, tensors[k].dtype))
                        & pad).sum() for k in names]).tolist()
    for name, count in zip(names, bad):
        if count:
            raise ValueError(
                f"tensors[{name!r}] has {count} label(s) other than ignore_index={ignore_index} on padding tokens "
                f"(doc index 0); those tokens are dropped, which would change the loss. Set labels to "
                f"{ignore_index} where doc_ids == 0, or leave {name!r} out of label_keys if it is not a label"
            )


def pad_segments(
    doc_ids: torch.Tensor,
    *,
    multiple: int,
    tensors: Mapping[str, torch.Tensor] | None = None,
    pad_values: Mapping[str, float | int | bool] | None = None,
    ignore_index: int = -100,
    label_keys: Sequence[str] = ("labels",),
    position_keys: Sequence[str] = ("position_ids",),
    row_length: int | None = None,
    max_tokens: int | None = None,
    max_bytes: int = MAX_BYTES,
) -> PaddedBatch:
    """Re-lay a doc map and its per-token tensors so that every segment's length is a multiple of ``multiple``.

    Pad tokens go inside each document, after its last real token, so real tokens compute exactly what they did
    (docs/padding.md has the layout). For the zigzag CP layout pass ``multiple=2 * cp_size``.

    Args:
        doc_ids: integer ``[B, S]`` (unsigned too), 1-based document index per token, 0 = padding. CPU or CUDA.
        multiple: ``m`` in ``[1, 2**31 - 1]``.
        tensors: ``name -> [B, S, ...]`` on ``doc_ids``' device. Labels must be shifted already (each label moves
            with its token) and be ``ignore_index`` on padding tokens (which are dropped).
        pad_values: ``name -> value`` for the added tokens of that tensor (overrides the two rules below; else 0).
        ignore_index: what added tokens get in ``label_keys`` tensors.
        label_keys: names of label tensors.
        position_keys: names of position-id tensors (``PaddedBatch.pad_positions``: the document's count goes on).
        row_length: the output row length ``S'`` exactly (a multiple of ``m``, at least the longest padded row).
            Default: the longest padded row.
        max_tokens: refuse (``ValueError``, before allocating) an output of more than this many tokens ``B * S'``.
            Default and upper limit: ``2**31 - 1``, what int32 ``cu_seqlens`` can index.
        max_bytes: the memory budget: refuse (``ValueError``, before allocating) an output whose estimated peak
            memory, ``B * S'`` times the bytes per output token (48 for the doc map, plus 3x each tensor's bytes per
            token, 6x for position tensors), is larger. Default :data:`MAX_BYTES` (4 GiB).

    Returns:
        ``PaddedBatch``: the new ``doc_ids`` ``[B, S']``, re-laid ``tensors``, ``index`` ``[B, S]``, ``is_pad``.

    Cost: vectorised, no Python loop over tokens or segments. Host syncs: one for the layout, one for the labels.

    >>> out = pad_segments(torch.tensor([[1, 1, 1, 2, 0, 0]]), multiple=2)
    >>> out.doc_ids.tolist(), out.index.tolist()
    ([[1, 1, 1, 1, 2, 2]], [[0, 1, 2, 4, -1, -1]])
    """
    m = check_int(multiple, "multiple", min=1, max=INT32_MAX, hint="e.g. 2 * cp_size for the zigzag layout")
    limit = INT32_MAX if max_tokens is None else check_int(max_tokens, "max_tokens", min=0, max=INT32_MAX)
    max_bytes = check_int(max_bytes, "max_bytes", min=0, hint=f"a memory budget in bytes (default {MAX_BYTES}, 4 GiB)")
    if row_length is not None:
        row_length = check_int(row_length, "row_length", min=0, hint="or None")
        if row_length % m:
            raise ValueError(f"row_length={row_length} is not a non-negative multiple of multiple={m}; "
                             f"pass {(row_length + m - 1) // m * m} or None")
    ignore_index = check_int(ignore_index, "ignore_index")
    tensors = {} if tensors is None else tensors
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict name -> [B, S, ...] tensor, got {type(tensors).__name__}")
    if any(not isinstance(name, str) for name in tensors):
        raise TypeError(f"tensors keys must be str names, got {list(tensors)}")
    if pad_values is not None and not isinstance(pad_values, Mapping):
        raise TypeError(f"pad_values must be a dict name -> value, got {type(pad_values).__name__}")
    pad_values = {} if pad_values is None else dict(pad_values)
    unknown = sorted(set(pad_values) - set(tensors))
    if unknown:
        raise ValueError(f"pad_values names {unknown}, which are not in tensors ({sorted(tensors)}); fix the name")
    label_keys = _check_keys(label_keys, "label_keys")
    position_keys = _check_keys(position_keys, "position_keys")
    if set(label_keys) & set(position_keys):
        raise ValueError(f"{sorted(set(label_keys) & set(position_keys))} are in both label_keys and "
                         "position_keys; a tensor is one or the other")
    check_doc_ids(doc_ids)
    for name, x in tensors.items():
        _check_per_token(name, x, doc_ids.shape[0], doc_ids.shape[1], doc_ids.device)
    batch = _pad_doc_map(doc_ids, m, row_length, limit, (_bytes_per_token(tensors, position_keys), max_bytes))
    _check_label_padding(tensors, doc_ids, label_keys, ignore_index)
    out: dict[str, torch.Tensor] = {}
    for name, x in tensors.items():
        if name in position_keys and name not in pad_values:
            out[name] = batch.pad_positions(x, name=name)
        else:
            out[name] = batch.pad_tensor(x, pad_values.get(name, ignore_index if name in label_keys else 0), name=name)
    return dataclasses.replace(batch, tensors=out)


def _check_rows(tensors: object, fill: object) -> tuple[int, int]:
    """``(B, S)`` shared by every ``[B, S, ...]`` tensor of ``tensors``; every fill value must fit its tensor."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict name -> [B, S, ...] tensor, got {type(tensors).__name__}")
    if not isinstance(fill, Mapping):
        raise TypeError(f"fill must be a dict name -> pad value, got {type(fill).__name__}; e.g. "
                        "fill={'labels': -100}")
    unknown = sorted(set(fill) - set(tensors), key=str)
    if unknown:
        raise ValueError(f"fill names {unknown}, which are not in tensors ({sorted(tensors, key=str)}); fix the name")
    shape = None
    for key, x in tensors.items():
        check_tensor(x, f"tensors[{key!r}]", "of shape [B, S, ...]")
        if x.dim() < 2 or (shape is not None and tuple(x.shape[:2]) != shape):
            want = "[B, S, ...]" if shape is None else f"[{shape[0]}, {shape[1]}, ...] like the others"
            raise ValueError(f"tensors[{key!r}] has shape {tuple(x.shape)}; every tensor must be {want} (add the "
                             "batch dimension with x.unsqueeze(0) for one row)")
        shape = tuple(x.shape[:2])
        value = fill.get(key, 0)
        check_fits_dtype(value, x.dtype, f"the pad value {value!r} for tensors[{key!r}]",
                         fix=f"convert tensors[{key!r}] to a dtype that holds it first (labels: .long(); -100 in "
                             "uint8 would become 156, a class the loss counts)")
    return shape if shape is not None else (0, 0)


def pad_rows(tensors: Mapping[str, torch.Tensor], multiple: int, *,
             fill: Mapping[str, int | float] | None = None) -> dict[str, torch.Tensor]:
    """Every ``[B, S, ...]`` tensor padded at the END of its rows to the next multiple of ``multiple`` tokens.

    The simple padding for layouts that need ``S % cp == 0`` (contiguous, balanced): the tail is one more padding
    segment of every row, so give the doc map fill 0 and labels ``-100``. ``fill`` maps a key to its pad value
    (default 0). The tensors are returned as they are (no copy) when ``S`` is already a multiple.

    Raises:
        TypeError: ``tensors`` / ``fill`` not dicts, a value that is not a tensor, ``multiple`` not an int.
        ValueError: ``multiple < 1``; tensors that are not ``[B, S, ...]`` of one ``(B, S)``; a fill key that is not
            in ``tensors``; a fill value its tensor's dtype cannot hold (``-100`` in uint8 labels); an output of
            more than ``2**31 - 1`` tokens (checked before allocating).

    >>> out = pad_rows({"doc_ids": torch.tensor([[1, 1, 2]]), "labels": torch.tensor([[5, -100, -100]])}, 2,
    ...                fill={"labels": -100})
    >>> out["doc_ids"].tolist(), out["labels"].tolist()
    ([[1, 1, 2, 0]], [[5, -100, -100, -100]])
    """
    multiple = check_int(multiple, "multiple", min=1, hint="every row is padded to a multiple of it, e.g. cp_size")
    fill = {} if fill is None else fill
    B, S = _check_rows(tensors, fill)
    extra = -S % multiple
    if B * (S + extra) > INT32_MAX:
        raise ValueError(f"padding rows of {S} tokens to a multiple of {multiple} gives B*S' = {B}*{S + extra} tokens, "
                         f"more than int32 cu_seqlens can index ({INT32_MAX}); nothing was allocated. Pass the "
                         "multiple the layout needs (cp_size)")
    out = {}
    for key, x in tensors.items():
        if extra == 0:
            out[key] = x
            continue
        tail = x.new_full((x.shape[0], extra, *x.shape[2:]), fill.get(key, 0))
        out[key] = torch.cat([x, tail], dim=1)
    return out
