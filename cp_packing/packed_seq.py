"""Typed packed-sequence metadata for neat sequence packing (the seed API).

A neat-packing doc map ``[B, S]`` (the 1-based document index of each token, 0 = padding, e.g.
``[1, 1, 2, 2, 2, 0]``) becomes :class:`PackedSeqParams` and HF's varlen ``FlashAttentionKwargs``
(``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k``). ``cu_seqlens`` spans the whole
flattened batch, padding runs included, with a boundary at every row start; runs, not ids, make segments (why:
docs/index.md, "Why cu_seqlens spans padding"). Empty maps give ``cu_seqlens == [0]`` and ``max_seqlen == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import numpy as np
import torch

from cp_packing._checks import check_cu_seqlens, check_doc_ids, is_int
from cp_packing.formats import warn_if_zero_based

__all__ = [
    "FlashAttentionKwargs",
    "PackedSeqParams",
    "check_params",
    "packed_seq_params_from_doc_ids",
    "to_flash_attention_kwargs",
]

@dataclass(frozen=True, eq=False)
class PackedSeqParams:
    """Packed-sequence metadata derived from a neat-packing document map.

    Compared by identity (``eq=False``): tensor fields have no single truth value.

    Attributes:
        cu_seqlens: int32 ``[num_segments + 1]``. Cumulative token counts over the flattened ``[B * S]`` axis,
            padding runs included, so ``cu_seqlens[-1] == B * S``. Segment k spans flat positions
            ``[cu_seqlens[k], cu_seqlens[k + 1])``. Same device as ``doc_ids``.
        max_seqlen: length of the longest segment (padding runs count), sized for the varlen kernel.
        doc_ids: ``[B, S]`` integer tensor, the 1-based document index per token (0 = padding), preserved unchanged
            for loss functions and context-parallel consumers.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    doc_ids: torch.Tensor

    @property
    def num_segments(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def total_tokens(self) -> int:
        """``T = B * S``, the length of the flattened stream."""
        return int(self.doc_ids.numel())

    @property
    def seqlens(self) -> torch.Tensor:
        """int32 ``[num_segments]``: the length of every segment."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]


def _raise_negative(min_value: int) -> None:
    raise ValueError(
        f"doc_ids holds a negative document index ({min_value}); indices are 1-based with 0 for padding"
    )


def _from_doc_ids_numpy(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """CPU path: zero-copy NumPy view (a copy only for a non-contiguous map); two passes over the map.

    ``not_equal`` of neighbours and ``flatnonzero`` run near memory bandwidth. The sign check costs no extra pass:
    every segment is a run of one value, so the smallest index in the map is the smallest index found at a segment
    start.
    """
    B, S = doc_ids.shape
    T = B * S
    flat = doc_ids.contiguous().view(-1).numpy()  # [T]
    change = np.not_equal(flat[1:], flat[:-1])  # [T-1] bool; change[i] marks a boundary at flat position i + 1
    change[S - 1 :: S] = True  # a boundary at every row start (flat positions S, 2S, ...)
    starts = np.flatnonzero(change)  # int64 [num_segments - 1]
    cu = np.empty(starts.size + 2, dtype=np.int32)  # [num_segments + 1]
    cu[0] = 0
    np.add(starts, 1, out=cu[1:-1], casting="unsafe")  # exact: every value <= T <= 2**31 - 1
    cu[-1] = T
    if flat.dtype.kind == "i":
        lo = int(flat[cu[:-1]].min())  # the value at every segment start (= every value in the map)
        if lo < 0:
            _raise_negative(lo)
    cu_t = torch.from_numpy(cu)
    if np.count_nonzero(flat[::S]) != B:  # a row starts with padding: the 0-based check reads the rows' segments
        warn_if_zero_based(doc_ids, stacklevel=4, cu_seqlens=cu_t)
    max_seqlen = int(np.diff(cu).max())
    return cu_t, max_seqlen


def _from_doc_ids_torch(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Device path (CUDA and others): sync-free up to a single host sync.

    ``max_seqlen`` (an int the kernel needs), the segment count (the size of ``cu_seqlens``) and the sign check
    are read back together in ONE ``.tolist()``; ``nonzero_static`` then builds ``cu_seqlens`` without a second sync.
    """
    B, S = doc_ids.shape
    T = B * S
    device = doc_ids.device
    flat = doc_ids.reshape(-1)
    is_start = torch.empty(T, dtype=torch.bool, device=device)
    is_start[0] = True
    torch.ne(flat[1:], flat[:-1], out=is_start[1:])
    is_start[::S] = True
    pos = torch.arange(T, device=device, dtype=torch.int64)
    # Start of the run that holds each token, then the run length so far: its max is the longest segment.
    run_start = torch.where(is_start, pos, torch.zeros_like(pos)).cummax(0).values
    longest = (pos - run_start).max() + 1
    lo = flat.min().to(torch.int64) if flat.dtype.is_signed else torch.zeros((), dtype=torch.int64, device=device)
    padded_row = (flat[::S] == 0).any()  # a row starts with padding (the 0-based check, below)
    num_segments, max_seqlen, min_value, padded_row = torch.stack(
        [is_start.sum(), longest, lo, padded_row.to(torch.int64)]).tolist()  # the one host sync
    if min_value < 0:
        _raise_negative(min_value)
    starts = torch.nonzero_static(is_start, size=num_segments).view(-1)
    cu = torch.empty(num_segments + 1, dtype=torch.int32, device=device)
    cu[:-1] = starts
    cu[-1] = T
    if padded_row:
        warn_if_zero_based(doc_ids, stacklevel=4, cu_seqlens=cu)
    return cu, int(max_seqlen)


def packed_seq_params_from_doc_ids(doc_ids: torch.Tensor) -> PackedSeqParams:
    """Build packed-sequence metadata from a neat-packing document map.

    Segments are maximal runs of an identical document index within a row, plus a forced boundary at every row
    start. Padding runs (index 0) become their own segments so ``cu_seqlens`` covers the full flattened
    ``[B * S]`` axis that the varlen flash-attention path consumes without unpadding.

    Args:
        doc_ids: integer tensor ``[B, S]`` (any integer dtype, CPU or CUDA): the 1-based document index per token,
            0 for padding.

    Returns:
        ``PackedSeqParams`` with int32 ``cu_seqlens`` ``[num_segments + 1]`` on ``doc_ids.device``, the int
        ``max_seqlen``, and ``doc_ids`` itself (unchanged, not copied).

    Raises:
        TypeError: ``doc_ids`` is not a dense tensor, or has a float / bool dtype.
        ValueError: not 2D, a negative index, or more than ``2**31 - 1`` tokens.

    Warns (``cp_packing.formats.ZeroBasedDocIdsWarning``, once per process) when a row starts with padding
    immediately followed by document 1: the shape of a 0-based ``seq_idx`` passed as ``doc_ids`` (convert it with
    ``cp_packing.formats.doc_ids_from_seq_idx``). The result is the same either way.

    Cost: on CPU one pass over the map (NumPy view, a copy first only if it is not contiguous) and one over a
    ``[B * S]`` bool mask of boundaries; the sign check reads only segment starts, the 0-based check only the first
    token of each row (and, when a row starts with padding, those rows). On CUDA exactly one host sync
    (``max_seqlen``, the segment count, the smallest index and whether a row starts with padding are read back
    together); a map with a row that starts with padding costs the 0-based check's syncs too.

    >>> params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2, 2, 0]]))
    >>> params.cu_seqlens.tolist(), params.max_seqlen
    ([0, 2, 5, 6], 3)
    """
    check_doc_ids(doc_ids)
    B, S = doc_ids.shape
    if B == 0 or S == 0:
        return PackedSeqParams(torch.zeros(1, dtype=torch.int32, device=doc_ids.device), 0, doc_ids)
    if doc_ids.device.type == "cpu":
        cu, max_seqlen = _from_doc_ids_numpy(doc_ids)
    else:
        cu, max_seqlen = _from_doc_ids_torch(doc_ids)
    return PackedSeqParams(cu_seqlens=cu, max_seqlen=max_seqlen, doc_ids=doc_ids)


def check_params(params: PackedSeqParams, name: str = "params") -> PackedSeqParams:
    """``params`` if it is a consistent ``PackedSeqParams``; else a TypeError / ValueError naming the field.

    ``packed_seq_params_from_doc_ids`` always builds consistent params; a hand-built one (or one edited with
    ``dataclasses.replace``) is checked where it enters the sharding and distribution functions: ``cu_seqlens``
    starts at 0, never decreases, ends at ``B*S`` and has a boundary at every row start, and ``max_seqlen`` is its
    longest segment. Costs a copy of ``cu_seqlens`` to the host (O(segments)), nothing proportional to ``B*S``.
    """
    if not isinstance(params, PackedSeqParams):
        raise TypeError(
            f"{name} must be PackedSeqParams, got {type(params).__name__}; build it with "
            "packed_seq_params_from_doc_ids(doc_ids)"
        )
    check_doc_ids(params.doc_ids, f"{name}.doc_ids")
    B, S = params.doc_ids.shape
    cu = check_cu_seqlens(params.cu_seqlens, f"{name}.cu_seqlens", total=B * S)
    longest = int(np.diff(cu).max()) if cu.size > 1 else 0
    if not is_int(params.max_seqlen) or int(params.max_seqlen) != longest:
        raise ValueError(
            f"{name}.max_seqlen is {params.max_seqlen!r} but the longest segment of {name}.cu_seqlens has {longest} "
            "tokens; build the params with packed_seq_params_from_doc_ids(doc_ids)"
        )
    if S and B > 1:
        missing = np.setdiff1d(np.arange(S, B * S, S), cu, assume_unique=True)
        if missing.size:
            raise ValueError(
                f"{name}.cu_seqlens has no boundary at the start of row {int(missing[0]) // S} (flat position "
                f"{int(missing[0])}): a segment would run across two rows; build the params with "
                "packed_seq_params_from_doc_ids(doc_ids)"
            )
    _check_segments_match_map(params.doc_ids, cu, name)
    return params


def _check_segments_match_map(doc_ids: torch.Tensor, cu: np.ndarray, name: str) -> None:
    """Raise unless ``cu``'s boundaries are exactly the map's own segment starts (runs of one index per row): a
    vectorised O(B*S) comparison on the map's device (one host sync for a device map)."""
    B, S = doc_ids.shape
    T = B * S
    if T == 0:
        return
    flat = doc_ids.reshape(-1)
    starts = torch.ones(T, dtype=torch.bool, device=flat.device)
    torch.ne(flat[1:], flat[:-1], out=starts[1:])
    starts[::S] = True
    given = torch.zeros(T, dtype=torch.bool, device=flat.device)
    given[torch.from_numpy(cu[:-1][cu[:-1] < T]).to(flat.device)] = True
    if torch.equal(starts, given):
        return
    at = int(torch.nonzero(starts != given)[0])
    mine = starts[at:at + 1].cpu().numpy()
    at_mine = bool(mine[0])
    what = ("a document boundary of the map (doc_ids changes there) that cu_seqlens lacks: two documents would "
            "attend across each other" if at_mine else "a boundary inside one document's run: its tokens would not "
            "see the earlier tokens of their document")
    raise ValueError(
        f"{name}.cu_seqlens does not match {name}.doc_ids at flat position {at}: {what}; build the params with "
        "packed_seq_params_from_doc_ids(doc_ids) (and rebuild them after editing doc_ids)"
    )


class FlashAttentionKwargs(TypedDict):
    """HuggingFace's varlen flash-attention keyword arguments (``transformers.modeling_flash_attention_utils``)."""

    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_q: int
    max_length_k: int


def to_flash_attention_kwargs(params: PackedSeqParams) -> FlashAttentionKwargs:
    """Convert packed-sequence params to HuggingFace ``FlashAttentionKwargs``.

    For ``PackedSeqParams`` (the whole batch, no context parallelism) query and key share one layout
    (self-attention), so the q and k entries are equal: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` are the same int32
    ``cu_seqlens`` tensor and ``max_length_q`` / ``max_length_k`` the same int.

    A context-parallel shard is refused: its queries need keys that live on other ranks, so no kwargs of the
    local tokens alone are right (use ``cp_packing.context_parallel_attention``, or the adapters in
    ``cp_packing.adapters`` for ring-flash-attn and TransformerEngine).

    >>> to_flash_attention_kwargs(packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 0]])))["max_length_q"]
    2
    """
    if isinstance(params, PackedSeqParams):
        check_params(params)  # a hand-built or edited one: cu_seqlens against the map, max_seqlen
        return FlashAttentionKwargs(
            cu_seq_lens_q=params.cu_seqlens,
            cu_seq_lens_k=params.cu_seqlens,
            max_length_q=params.max_seqlen,
            max_length_k=params.max_seqlen,
        )
    if hasattr(params, "global_params") and hasattr(params, "cp_size"):
        raise TypeError(
            "to_flash_attention_kwargs got a context-parallel shard (ShardedPackedSeqParams): its queries attend to "
            "keys on other ranks, so HF's flash_attention_2 on the local tokens alone would be wrong; run "
            "cp_packing.context_parallel_attention (or the cp_packing HF attention), or pass "
            "to_flash_attention_kwargs(sharded.global_params) for the whole, unsharded batch"
        )
    raise TypeError(
        f"to_flash_attention_kwargs expects PackedSeqParams, got {type(params).__name__}; "
        "build one with packed_seq_params_from_doc_ids(doc_ids)"
    )
