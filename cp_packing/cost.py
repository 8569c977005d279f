"""Cost model of a CP layout and step-time model of the backends. Pure (no communication).

A rank's work is ``sum over its tokens of min(p + 1, w)`` (``p``: the position inside its segment, padding segments
included; ``w``: the sliding window, ``None`` for none; a per-layer window sums over the layers), in closed form per
run (``cp_packing.layouts.work``), exact in int64 up to ``MAX_COST_TOKENS`` tokens. :func:`layout_cost` gives a
layout's figures (:class:`LayoutCost`), :func:`choose_layout` is ``layout="auto"``; :func:`backend_bytes` (forward
bytes), :func:`backend_times` (the step-time model), :func:`backend_memory` (saved and peak bytes) price the attention
backends, and :func:`choose_backend` is ``backend="auto"`` (the lowest modelled time, within a memory budget when
one is given). :func:`choose_backend_by_bytes` is the older bytes-only rule, kept for the report's bytes table. The model and its figures:
docs/balance.md ("Cost model"); the backends: docs/attention.md.
"""

from __future__ import annotations

import math
import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cp_packing._checks import (check_cu_seqlens, check_int, check_number,
                                check_weighted_cost_tokens, check_windows)
from cp_packing.layouts import LAYOUTS, WINDOWED_LAYOUTS, layout_plan
from cp_packing.layouts.choose import choose_layout_of_cu, plan_rank_cost
from cp_packing.layouts.need import exchange_pieces, intersect_ranges, key_ranges, need_tokens
from cp_packing.layouts.work import head_cost, window_weights
from cp_packing.packed_seq import PackedSeqParams, check_params, packed_seq_params_from_doc_ids

__all__ = ["AUTO_LAYOUTS", "BYTES_BACKENDS", "COST_LAYOUTS", "DEFAULT_HARDWARE", "Hardware", "LayoutCost",
           "MEMORY_BACKENDS", "TIMED_BACKENDS", "backend_bytes", "backend_memory", "backend_times", "causal_cost",
           "choose_backend", "choose_backend_by_bytes", "choose_layout", "kv_replication_factor", "layout_cost"]

logger = logging.getLogger("cp_packing")

#: Layouts ``choose_layout`` considers, in order of preference on a tie of cost and communication.
AUTO_LAYOUTS = LAYOUTS

#: Layouts ``layout_cost`` knows: ours (``auto`` resolves through ``choose_layout``) plus the ``rowzigzag`` reference.
COST_LAYOUTS = (*LAYOUTS, "auto", "rowzigzag")


@dataclass(frozen=True)
class LayoutCost:
    """The cost figures of one layout on one batch (their definitions: docs/balance.md, "Cost model").

    Attributes:
        layout: the layout measured (``auto`` resolved to the name it picked).
        cp_size: the CP group size.
        rank_cost: int64 ``[cp]``, causal cost ``sum(p + 1)`` of every rank's tokens.
        tokens_per_rank: int64 ``[cp]``, tokens every rank holds (padding tokens and pad tokens added included).
        runs_per_rank: int64 ``[cp]``, pieces of consecutive tokens of one segment (varlen sequences) per rank.
        imbalance: ``max(rank_cost) / mean(rank_cost)`` (1.0 with no work).
        ideal_cost: ``C / cp`` for the ORIGINAL map's total cost ``C``.
        padding_overhead: tokens added inside documents / real (non-padding) tokens; 0.0 but for a padded zigzag.
        kv_bytes_allgather: int64 ``[cp]``, K/V bytes per layer every rank needs from other ranks (all-gather).
        kv_bytes_ring: K/V bytes per layer every rank receives in a ring pass.
        num_kv_heads, head_dim, dtype_bytes: the K/V shape used for the bytes.
    """

    layout: str
    cp_size: int
    rank_cost: torch.Tensor
    tokens_per_rank: torch.Tensor
    runs_per_rank: torch.Tensor
    imbalance: float
    ideal_cost: float
    padding_overhead: float
    kv_bytes_allgather: torch.Tensor
    kv_bytes_ring: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def busiest_cost(self) -> int:
        """The largest per-rank cost (the step time follows it)."""
        return int(self.rank_cost.max()) if self.rank_cost.numel() else 0

    @property
    def busiest_over_ideal(self) -> float:
        """``busiest_cost / ideal_cost`` (1.0 with no work): imbalance and padding work together."""
        return self.busiest_cost / self.ideal_cost if self.ideal_cost > 0 else 1.0


# ----------------------------------------------------------------------------------------------------------------
# closed forms (NumPy int64 inside; exact up to MAX_COST_TOKENS tokens)




Window = "int | tuple[int | None, ...] | None"  # as check_windows returns it


def _head_cost(p: np.ndarray, window: Window) -> np.ndarray:
    """Cost of positions ``0 .. p-1`` of one segment: ``sum min(i + 1, window)`` summed over the layers
    (``cp_packing.layouts.work.head_cost``)."""
    return head_cost(p, window_weights(window))


def _check_tokens(total: int, window: Window, name: str = "cu_seqlens") -> int:
    """``total`` if its cost (summed over the layers of a per-layer ``window``) fits int64; else a ValueError."""
    return check_weighted_cost_tokens(total, len(window) if isinstance(window, tuple) else 1, name)


def _prefix_cost(cu: np.ndarray, t: np.ndarray, window: Window = None) -> np.ndarray:
    """``W(t)``: causal cost of the global stream ``[0, t)`` (``t`` int64, any shape, ``0 <= t <= T``); under a
    sliding ``window`` a token at position ``p`` costs ``min(p + 1, window)``."""
    lengths = cu[1:] - cu[:-1]
    before = np.zeros(cu.size, dtype=np.int64)
    np.cumsum(_head_cost(lengths, window), out=before[1:])
    seg = np.searchsorted(cu, t, side="right") - 1  # the segment holding t (index N for t == T)
    p = t - cu[seg]
    return before[seg] + _head_cost(p, window)


def causal_cost(
    cu_seqlens: torch.Tensor, start: torch.Tensor, length: torch.Tensor, *,
    window: int | Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Causal cost ``sum(p + 1)`` of each range ``[start, start + length)`` of the global stream.

    Args:
        cu_seqlens: int ``[N + 1]`` global cumulative segment lengths.
        start, length: int ``[R]``, ranges of global positions (a range may cross segments; each token counts with
            its position inside its own segment).
        window: sliding window (``None``: none): a token at position ``p`` then attends ``min(p + 1, window)``
            keys and costs that (``sum min(p + 1, window)``); a per-layer list of ``int | None`` sums its layers.

    Returns:
        int64 ``[R]`` (CPU). Closed form, vectorised: ``W(start + length) - W(start)``.

    Raises:
        ValueError: a range outside the stream, or more than ``MAX_COST_TOKENS`` tokens (int64 could overflow).

    >>> causal_cost(torch.tensor([0, 4, 6]), torch.tensor([0, 2]), torch.tensor([4, 3]))
    tensor([10,  8])
    >>> causal_cost(torch.tensor([0, 4, 6]), torch.tensor([0, 2]), torch.tensor([4, 3]), window=2)
    tensor([7, 5])
    >>> causal_cost(torch.tensor([0, 4, 6]), torch.tensor([0, 2]), torch.tensor([4, 3]), window=[2, None])
    tensor([17, 13])
    """
    window = check_windows(window)
    cu = check_cu_seqlens(cu_seqlens)
    _check_tokens(int(cu[-1]), window)
    s = _np64(start, "start")
    n = _np64(length, "length")
    if s.shape != n.shape:
        raise ValueError(f"start and length must have the same shape, got {s.shape} and {n.shape}")
    total = int(cu[-1])
    if s.size and (s.min() < 0 or n.min() < 0 or (s + n).max() > total):
        raise ValueError(f"ranges must lie inside the global stream [0, {total}) with length >= 0")
    return torch.from_numpy(_prefix_cost(cu, s + n, window) - _prefix_cost(cu, s, window))


def _np64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
        return x.detach().to("cpu", torch.int64).numpy().reshape(-1)
    raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _split_at_segments(cu: np.ndarray, rank: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Cut ranges ``[start, end)`` (non-empty) at segment boundaries. Returns ``(rank, seg, start, end)`` pieces."""
    owner, seg, p_start, p_end = intersect_ranges(start, end, cu[:-1], cu[1:])  # skips empty segments
    return rank[owner], seg, p_start, p_end


def _figures(cu: np.ndarray, cp: int, rank: np.ndarray, start: np.ndarray, length: np.ndarray,
             window: Window = None):
    """Per-rank cost, tokens, runs and K/V tokens needed from other ranks, for ranges owned by ranks."""
    nz = length > 0
    rank, start, length = rank[nz], start[nz], length[nz]
    end = start + length
    rank_cost = np.zeros(cp, dtype=np.int64)
    np.add.at(rank_cost, rank, _prefix_cost(cu, end, window) - _prefix_cost(cu, start, window))  # exact int64
    tokens = np.zeros(cp, dtype=np.int64)
    np.add.at(tokens, rank, length)
    p_rank, p_seg, p_start, p_end = _split_at_segments(cu, rank, start, end)
    # runs: pieces of one segment, touching pieces of one rank merged
    o = np.lexsort((p_start, p_rank))
    pr, ps, pe, pg = p_rank[o], p_start[o], p_end[o], p_seg[o]
    new_run = np.ones(pr.size, dtype=bool)
    new_run[1:] = (pr[1:] != pr[:-1]) | (pg[1:] != pg[:-1]) | (ps[1:] != pe[:-1])
    runs = np.bincount(pr[new_run], minlength=cp).astype(np.int64)
    # keys needed: per (rank, segment), from the segment's start to the furthest token held there
    o = np.lexsort((pe, pg, pr))
    pr, pg, pe = pr[o], pg[o], pe[o]
    last = np.ones(pr.size, dtype=bool)
    last[:-1] = (pr[1:] != pr[:-1]) | (pg[1:] != pg[:-1])
    needed = np.zeros(cp, dtype=np.int64)
    np.add.at(needed, pr[last], pe[last] - cu[pg[last]])
    return rank_cost, tokens, runs, needed - tokens


def _rowzigzag_ranges(cu: np.ndarray, cp: int, rows: tuple[int, int]):
    """``(rank, start, length)`` ranges of the whole-row reference (they may cross segments)."""
    ranks = np.arange(cp, dtype=np.int64)
    B, S = rows
    bounds = (np.arange(2 * cp + 1, dtype=np.int64) * S) // (2 * cp)  # chunk bounds inside a row
    chunk = np.stack([ranks, 2 * cp - 1 - ranks], axis=1)  # [cp, 2]
    lo = bounds[chunk][None] + (np.arange(B, dtype=np.int64) * S)[:, None, None]  # [B, cp, 2]
    hi = bounds[chunk + 1][None] + (np.arange(B, dtype=np.int64) * S)[:, None, None]
    rank = np.broadcast_to(ranks[None, :, None], lo.shape)
    return rank.reshape(-1), lo.reshape(-1), (hi - lo).reshape(-1)


def _plan_figures(cu: np.ndarray, cp: int, layout: str, window: Window = None):
    """Per-rank cost, tokens, runs and keys needed from other ranks, priced on the layout's plan."""
    plan = layout_plan(torch.from_numpy(cu.copy()), cp_size=cp, layout=layout,
                       window=window if layout in WINDOWED_LAYOUTS else None)
    run_rank = plan.run_rank()
    tokens = np.bincount(run_rank, weights=plan.run_len, minlength=cp).astype(np.int64)
    runs = np.bincount(run_rank, minlength=cp).astype(np.int64)
    return plan_rank_cost(plan, cu, window), tokens, runs, need_tokens(plan, cu)


def _zigzag_figures(lengths: np.ndarray, cp: int, window: Window = None):
    """Per-rank cost, tokens, runs and K/V tokens needed from other ranks under zigzag, in closed form from the
    segment lengths (every one a multiple of ``2 * cp``): O(segments + cp) memory, no per-rank run list.

    With ``c = L / 2cp``, rank r holds chunks ``r`` and ``2cp-1-r`` of a segment: ``2c`` tokens costing
    ``c(2rc + c + 1)/2 + c((4cp - 2r - 1)c + 1)/2 = c (L + 1)`` whatever r; two runs (one on rank ``cp - 1``, whose
    chunks touch); it needs the keys up to its tail's end ``(2cp - r) c``, of which it holds ``2c``. Under a sliding
    ``window`` the cost depends on r: each chunk is priced with ``_head_cost`` (one pass per rank, O(segments))."""
    lengths = lengths[lengths > 0]
    c = lengths // (2 * cp)
    n, c_sum = lengths.size, int(c.sum())
    ranks = np.arange(cp, dtype=np.int64)
    if window is None:
        rank_cost = np.full(cp, int((c * (lengths + 1)).sum()), dtype=np.int64)
    else:
        weights = window_weights(window)
        rank_cost = np.array([
            int((head_cost((r + 1) * c, weights) - head_cost(r * c, weights)
                 + head_cost((2 * cp - r) * c, weights) - head_cost((2 * cp - 1 - r) * c, weights)).sum())
            for r in range(cp)
        ], dtype=np.int64)
    tokens = np.full(cp, 2 * c_sum, dtype=np.int64)
    runs = np.where(ranks == cp - 1, n, 2 * n).astype(np.int64)
    return rank_cost, tokens, runs, (2 * cp - ranks - 2) * c_sum


def _padded_lengths(cu: np.ndarray, doc_ids: torch.Tensor, multiple: int) -> tuple[np.ndarray, int, int]:
    """The segment lengths of ``pad_segments(doc_ids, multiple=multiple)`` (its default row length), from the
    segments alone (no padded map is built). Returns ``(lengths, tokens added inside documents, real tokens)``.

    As ``pad_segments`` lays a row: every document segment rounded up to a multiple; padding runs dropped, but one
    between two runs of the same index kept as ``multiple`` tokens; every row padded at its end to the longest."""
    B, S = doc_ids.shape
    starts, lengths = cu[:-1], np.diff(cu)
    seg_doc = doc_ids.reshape(-1)[torch.from_numpy(starts).to(doc_ids.device)].cpu().numpy()  # [N] (a host sync)
    is_doc = seg_doc != 0
    row = starts // max(S, 1)
    separator = np.zeros(lengths.size, dtype=bool)
    if lengths.size >= 3:
        same_row = (row[:-2] == row[1:-1]) & (row[2:] == row[1:-1])
        separator[1:-1] = ~is_doc[1:-1] & same_row & (seg_doc[:-2] == seg_doc[2:])
    rounded = -(-lengths // multiple) * multiple
    new_len = np.where(is_doc, rounded, np.where(separator, multiple, 0))
    content = np.zeros(B, dtype=np.int64)
    np.add.at(content, row, new_len)
    row_end = content.max() - content if B else content
    padded = np.concatenate([new_len[new_len > 0], row_end[row_end > 0]])
    real = int(lengths[is_doc].sum())
    return padded, int((rounded - lengths)[is_doc].sum()), real


def _params(params_or_doc_ids: object) -> PackedSeqParams:
    if isinstance(params_or_doc_ids, PackedSeqParams):
        return check_params(params_or_doc_ids)  # a hand-built one: its cu_seqlens against its map
    if isinstance(params_or_doc_ids, torch.Tensor):
        return packed_seq_params_from_doc_ids(params_or_doc_ids)  # validates the map
    raise TypeError(
        f"expected PackedSeqParams or a [B, S] doc map tensor, got {type(params_or_doc_ids).__name__}; build the "
        "params with packed_seq_params_from_doc_ids(doc_ids)"
    )


def _rank_figures(cu: np.ndarray, cp: int, layout: str, doc_ids: torch.Tensor, window: Window = None):
    """``(rank_cost, tokens, runs, kv_tokens, padding overhead)`` of one layout (zigzag padded where it must be;
    ``balanced`` planned for ``window``)."""
    if layout == "zigzag":
        lengths = np.diff(cu)
        overhead = 0.0
        if np.any(lengths % (2 * cp)):
            lengths, added, real = _padded_lengths(cu, doc_ids, 2 * cp)
            overhead = added / real if real else 0.0
        return (*_zigzag_figures(lengths, cp, window), overhead)
    if layout == "rowzigzag":
        rank, start, length = _rowzigzag_ranges(cu, cp, tuple(doc_ids.shape))
        return (*_figures(cu, cp, rank, start, length, window), 0.0)
    return (*_plan_figures(cu, cp, layout, window), 0.0)


def layout_cost(
    params_or_doc_ids: PackedSeqParams | torch.Tensor,
    *,
    cp_size: int,
    layout: str,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype_bytes: int = 2,
    window: int | Sequence[int | None] | None = None,
) -> LayoutCost:
    """Cost figures of one layout on one batch (docs/balance.md, "Cost model").

    Args:
        params_or_doc_ids: ``PackedSeqParams`` or the ``[B, S]`` integer doc map (1-based document index, 0 =
            padding).
        cp_size: the CP group size.
        layout: ``"contiguous"``, ``"zigzag"`` (on a map whose segments are not all multiples of ``2 * cp_size``:
            priced as after ``pad_segments(doc_ids, multiple=2 * cp_size)``, with its ``padding_overhead``),
            ``"balanced"``, ``"local"``, ``"auto"`` (the layout ``choose_layout`` picks; ``layout`` of the result is
            that name)
            or ``"rowzigzag"`` (the whole-row reference; needs nothing).
        num_kv_heads, head_dim, dtype_bytes: the K/V shape for the byte counts (defaults: 8 x 128, bf16).
        window: sliding window of the attention (``None``: full causal; an int; or a per-layer list of
            ``int | None``, summed over the layers): every cost (``rank_cost``, ``imbalance``, ``ideal_cost``) counts
            ``min(p + 1, window)`` per token, ``balanced`` / ``local`` are planned for it (as
            ``shard_packed_seq_params(..., window=window)`` plans them) and ``auto`` compares the candidates under it.
            ``kv_bytes_allgather`` stays the unwindowed key range (an upper bound under a window).

    Returns:
        ``LayoutCost``.

    Raises:
        TypeError: a bad input type. ValueError: unknown layout, ``cp_size < 1``, ``B*S`` not divisible by
        ``cp_size`` for a layout that needs it (``contiguous``, ``balanced``, ``auto``), more than ``MAX_COST_TOKENS``.

    >>> layout_cost(torch.tensor([[1, 1, 1, 1]]), cp_size=2, layout="contiguous").rank_cost
    tensor([3, 7])
    """
    cp = check_int(cp_size, "cp_size", min=1)
    window = check_windows(window)
    for value, name in ((num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"), (dtype_bytes, "dtype_bytes")):
        check_int(value, name, min=1)
    if layout not in COST_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(COST_LAYOUTS)}")
    params = _params(params_or_doc_ids)
    cu = _np64(params.cu_seqlens, "cu_seqlens")
    total = _check_tokens(int(cu[-1]), window)
    ideal = float(_prefix_cost(cu, np.array([total]), window)[0]) / cp
    if layout == "auto":
        layout = choose_layout(params, cp_size=cp, window=window)
    if layout not in ("zigzag", "rowzigzag") and total % cp:
        raise ValueError(
            f"layout {layout!r} needs B*S % cp_size == 0, got B*S = {total} and cp_size={cp}, not divisible; pad "
            f"the rows to a multiple of {cp}"
        )
    rank_cost, tokens, runs, kv_tokens, overhead = _rank_figures(cu, cp, layout, params.doc_ids, window)
    mean = rank_cost.sum() / cp
    per_token = 2 * num_kv_heads * head_dim * dtype_bytes  # K and V of one token, one layer
    t_local = int(tokens.max()) if tokens.size else 0
    return LayoutCost(
        layout=layout,
        cp_size=cp,
        rank_cost=torch.from_numpy(rank_cost),
        tokens_per_rank=torch.from_numpy(tokens),
        runs_per_rank=torch.from_numpy(runs),
        imbalance=float(rank_cost.max() / mean) if mean > 0 else 1.0,
        ideal_cost=ideal,
        padding_overhead=float(overhead),
        kv_bytes_allgather=torch.from_numpy(kv_tokens * per_token),
        kv_bytes_ring=(cp - 1) * t_local * per_token,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
    )


# ----------------------------------------------------------------------------------------------------------------
# layout="auto"


def choose_layout(
    params: PackedSeqParams, *, cp_size: int, rtol: float = 0.01, window: int | Sequence[int | None] | None = None
) -> str:
    """The layout ``shard_packed_seq_params(layout="auto")`` uses for this batch: the lowest busiest-rank cost
    (within ``rtol``), then the fewest keys needed from other ranks (``cp_packing.layouts.choose``); deterministic,
    cached, logged at DEBUG on the ``"cp_packing"`` logger.

    Args:
        params: ``PackedSeqParams`` of the ``[B, S]`` batch.
        cp_size: the context-parallel group size.
        rtol: relative tolerance of a cost tie, ``>= 0``.
        window: price the candidates under this sliding window (``None``: full causal; an int or a per-layer list,
            see ``layout_cost``); the ``balanced`` candidate is planned for it too.

    Returns:
        One of ``cp_packing.layouts.LAYOUTS`` (``zigzag`` only where every segment is a multiple of ``2 * cp_size``).

    Raises:
        TypeError: ``params`` is not ``PackedSeqParams``, or a non-int ``cp_size``.
        ValueError: ``T`` not divisible by ``cp_size`` (no layout is valid), or a negative ``rtol``.

    >>> choose_layout(packed_seq_params_from_doc_ids(torch.tensor([[1] * 8])), cp_size=2)
    'zigzag'
    """
    if not isinstance(params, PackedSeqParams):
        raise TypeError(
            f"params must be PackedSeqParams, got {type(params).__name__}; build it with "
            "packed_seq_params_from_doc_ids(doc_ids)"
        )
    return choose_layout_of_cu(params.cu_seqlens, cp_size=cp_size, rtol=rtol, window=window)


# -------------------------------------------------------------------------------------- bytes per backend

#: Backends ``backend_bytes`` prices (``hybrid`` needs ``ulysses_size``).
BYTES_BACKENDS = ("allgather", "ring_flash_attn", "ulysses", "hybrid")


def kv_replication_factor(num_kv_heads: int, ulysses_size: int) -> int:
    """How many times the Ulysses backends replicate each key/value head: ``U / gcd(H_kv, U)`` for a Ulysses
    degree ``U`` (1 when ``U`` divides ``H_kv``). The one formula ``cp_packing.attention.ulysses.kv_replication``
    uses (after checking the query heads).

    >>> kv_replication_factor(8, 4), kv_replication_factor(8, 16), kv_replication_factor(6, 4)
    (1, 2, 2)
    """
    check_int(num_kv_heads, "num_kv_heads", min=1)
    check_int(ulysses_size, "ulysses_size", min=1)
    return ulysses_size // math.gcd(num_kv_heads, ulysses_size)


def backend_bytes(
    backend: str, *, T_local: int, cp_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype_bytes: int = 2, ulysses_size: int | None = None,
) -> int:
    """Bytes one rank sends (and, the same count, receives) per layer in the FORWARD pass of ``backend``.

    With ``s = head_dim * dtype_bytes * T_local`` (one head-slice of the rank's tokens), ``H = num_heads``,
    ``H_kv = num_kv_heads`` and ``H_kv' = H_kv * kv_replication_factor(H_kv, U)``:

    * ``allgather``: k and v of every other rank, ``2 H_kv s (cp - 1)`` (a plain ``all_gather``, whatever the layout).
    * ``ring_flash_attn``: a full ring pass of k and v, the same ``2 H_kv s (cp - 1)``.
    * ``ulysses`` (``U = cp``): q, k, v out and the output back through all-to-alls, of which ``(cp - 1) / cp``
      leaves the rank: ``(2 H + 2 H_kv') s (cp - 1) / cp``.
    * ``hybrid`` (``ulysses_size=U``, ``A = cp / U``): Ulysses inside the group, ``(2 H + 2 H_kv') s (U - 1) / U``,
      plus the all-gather of the head-sharded k/v across the ``A`` groups, ``2 H_kv' s (A - 1)``.

    Backward moves about twice the forward for the all-gather and ring (the gradients go back), and three times
    for Ulysses and hybrid, whose backward sends q, k, v and the output to the head shard again (nothing of it is
    saved). ``backend="auto"`` decides on time, not bytes (:func:`choose_backend`).

    Raises:
        ValueError: an unknown backend, ``ulysses_size`` missing for / given to a backend other than ``hybrid``, a
            Ulysses degree that does not divide ``num_heads`` (or ``ulysses_size`` that does not divide ``cp_size``),
            or ``num_kv_heads`` not dividing ``num_heads``.

    >>> kw = dict(T_local=4096, num_heads=32, num_kv_heads=8, head_dim=128)
    >>> backend_bytes("allgather", cp_size=8, **kw) // 2**20, backend_bytes("ulysses", cp_size=8, **kw) // 2**20
    (112, 70)
    """
    if backend not in BYTES_BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for backend_bytes; choose one of {', '.join(map(repr, BYTES_BACKENDS))}")
    for value, name in ((T_local, "T_local"), (cp_size, "cp_size"), (num_heads, "num_heads"),
                        (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"), (dtype_bytes, "dtype_bytes")):
        check_int(value, name, min=0 if name == "T_local" else 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (GQA groups)")
    if (backend == "hybrid") != (ulysses_size is not None):
        raise ValueError(f"ulysses_size={ulysses_size!r} with backend={backend!r}: pass ulysses_size with "
                         "backend='hybrid' and only with it")
    slice_bytes = head_dim * dtype_bytes * T_local
    if backend in ("allgather", "ring_flash_attn"):
        return 2 * num_kv_heads * slice_bytes * (cp_size - 1)
    U = cp_size if backend == "ulysses" else ulysses_size
    check_int(U, "ulysses_size", min=1)
    if cp_size % U:
        raise ValueError(f"ulysses_size={U} must divide cp_size={cp_size}; use a divisor of {cp_size}")
    if num_heads % U:
        raise ValueError(f"backend={backend!r} needs its Ulysses degree {U} to divide num_heads={num_heads}; use "
                         "backend='allgather' or a degree that divides the query heads")
    kv_eff = num_kv_heads * kv_replication_factor(num_kv_heads, U)
    a2a = (2 * num_heads + 2 * kv_eff) * slice_bytes * (U - 1) // U
    return a2a + 2 * kv_eff * slice_bytes * (cp_size // U - 1)


def choose_backend_by_bytes(
    *, T_local: int, cp_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2,
    window: int | None = None,
) -> tuple[str, int, int | None]:
    """``(backend, allgather bytes, ulysses bytes)``: ``"ulysses"`` when ``cp_size`` divides ``num_heads``, there
    is no ``window`` and Ulysses moves FEWER forward bytes per layer than the all-gather (``backend_bytes``);
    else ``"allgather"`` (ties included). The Ulysses figure is ``None`` where Ulysses cannot run.
    The bytes-only rule (``cp_packing.report``'s bytes table); ``backend="auto"`` uses :func:`choose_backend`.

    Ulysses is cheaper exactly when ``H + H_kv' < cp * H_kv``: for 32/8 heads at cp 8, not at cp 4; for MHA at any
    cp above 2.

    >>> choose_backend_by_bytes(T_local=1, cp_size=8, num_heads=32, num_kv_heads=8, head_dim=1, dtype_bytes=1)
    ('ulysses', 112, 70)
    >>> choose_backend_by_bytes(T_local=1, cp_size=4, num_heads=32, num_kv_heads=8, head_dim=1, dtype_bytes=1)
    ('allgather', 48, 60)
    """
    kw = dict(T_local=T_local, cp_size=cp_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
              dtype_bytes=dtype_bytes)
    allgather = backend_bytes("allgather", **kw)
    if window is not None or num_heads % cp_size:
        return "allgather", allgather, None
    ulysses = backend_bytes("ulysses", **kw)
    return ("ulysses" if ulysses < allgather else "allgather"), allgather, ulysses


# ------------------------------------------------------------------------------------------- the step-time model


@dataclass(frozen=True)
class Hardware:
    """The rates of the step-time model (per GPU). Defaults: an H100-class GPU in an 8-GPU NVLink node with
    InfiniBand between nodes (docs/attention.md, "How auto chooses").

    Attributes:
        flops: attention FLOP/s one GPU sustains (bf16 varlen flash attention): 400e12.
        intra_node_bytes: bytes/s a GPU moves to its node's GPUs (NVLink, achieved all-to-all): 150e9.
        inter_node_bytes: bytes/s a GPU moves to other nodes (400 Gb/s InfiniBand per GPU, achieved): 40e9.
        gpus_per_node: a CP group larger than this crosses nodes and runs at ``inter_node_bytes``: 8.
    """

    flops: float = 400e12
    intra_node_bytes: float = 150e9
    inter_node_bytes: float = 40e9
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("flops", "intra_node_bytes", "inter_node_bytes"):
            value = check_number(getattr(self, name), name, min=0.0)
            if not 0 < value < float("inf"):
                raise ValueError(f"Hardware.{name} must be a finite rate > 0, got {value}")
        check_int(self.gpus_per_node, "gpus_per_node", min=1)

    def bandwidth(self, cp_size: int) -> float:
        """The bytes/s a CP group of ``cp_size`` ranks communicates at (its slowest link)."""
        return self.intra_node_bytes if cp_size <= self.gpus_per_node else self.inter_node_bytes


DEFAULT_HARDWARE = Hardware()

#: Backends the step-time model prices, in order of preference on a tie.
TIMED_BACKENDS = ("allgather", "exchange", "ulysses")


def _plan_times(plan, cu: np.ndarray, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                causal: bool, window: int | None, hardware: "Hardware", overlap: bool = True) -> dict[str, float]:
    """:func:`backend_times` on a layout's plan (every rank's runs) and the stream's ``cu`` (int64)."""
    cp = plan.cp_size
    per_row = 2 * num_kv_heads * head_dim * dtype_bytes
    rate = hardware.bandwidth(cp)
    pairs = plan_rank_cost(plan, cu, window).astype(np.float64)
    if not causal:
        lengths = np.diff(cu)
        pairs = np.full(cp, float((lengths * lengths).sum()) / cp)
    compute = 4.0 * pairs * num_heads * head_dim / hardware.flops
    t_local = plan.t_local
    times = {"allgather": float((compute + (cp - 1) * t_local * per_row / rate).max()) if cp > 1 else
             float(compute.max())}
    need = need_tokens(plan, cu, causal=causal, window=window).astype(np.float64) * per_row / rate
    hidden = window is None and overlap  # the exchange overlaps its transfer with the local part (not under windows)
    times["exchange"] = float((np.maximum(compute, need) if hidden else compute + need).max())
    if window is None and num_heads % cp == 0 and num_heads % num_kv_heads == 0:
        a2a = backend_bytes("ulysses", T_local=t_local, cp_size=cp, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, dtype_bytes=dtype_bytes) / rate
        times["ulysses"] = float(compute.sum() / cp + a2a)
    return times


def backend_times(sharded, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2,
                  causal: bool = True, window: int | None = None, hardware: Hardware = DEFAULT_HARDWARE,
                  overlap: bool = True) -> dict[str, float]:
    """Modelled forward seconds of one attention layer at the busiest rank, per backend that can run.

    Compute: ``4 * pairs * H * D / flops`` per rank, ``pairs`` its causal cost (``layout_cost``'s ``rank_cost``;
    the whole stream over ``cp`` for Ulysses, whose ranks see every token for ``H / cp`` heads). Bytes: the
    all-gather's ``(cp - 1) * T_local`` K/V rows; the exchange's need (``cp_packing.layouts.need``), its transfer
    hidden behind the compute (``max``; without overlap under a window: their sum); Ulysses' all-to-alls
    (``backend_bytes``). Bytes move at ``hardware.bandwidth(cp)``.

    Args:
        sharded: a ``ShardedPackedSeqParams`` of the step (every rank's figures come from its layout's plan).
        num_heads, num_kv_heads, head_dim, dtype_bytes: the layer's q/k shapes.
        causal, window: the layer's mask.
        hardware: the rates (:class:`Hardware`).
        overlap: whether the exchange hides its transfer (``AttentionOptions.overlap``; never under a window).

    Returns:
        ``{backend: seconds}`` for ``allgather``, ``exchange`` and (where ``cp`` divides the query heads and there
        is no window) ``ulysses``.
    """
    plan = layout_plan(sharded.global_params.cu_seqlens, cp_size=sharded.cp_size, layout=sharded.layout,
                       window=sharded.plan_window)
    return _plan_times(plan, _np64(sharded.global_params.cu_seqlens, "cu_seqlens"), num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, causal=causal,
                       window=window, hardware=hardware, overlap=overlap)


# ----------------------------------------------------------------------------------------- the memory column

#: Backends :func:`backend_memory` models (those ``backend="auto"`` chooses among).
MEMORY_BACKENDS = TIMED_BACKENDS


def _kernel_backward_bytes(Tq: int, Tk: int, h: int, h_kv: int, head_dim: int, dtype_bytes: int) -> int:
    """A flash-attn 2 backward's buffers: a float32 dq accumulator and row sums, dq/dk/dv, and under GQA dK/dV
    expanded to the query heads. With more keys than queries under GQA it runs one key/value head at a time
    (``kernels.run_backward_per_kv_head``): the outputs at full size, then per head its slices of dout/q/out/k/v and
    the kernel's buffers over ``h / h_kv`` query heads."""
    D, b = head_dim, dtype_bytes
    if h == h_kv or Tk <= Tq:
        expanded = 0 if h == h_kv else 2 * Tk * h * D * b
        return Tq * h * (4 * D + 4 + D * b) + 2 * Tk * h_kv * D * b + expanded
    rep = h // h_kv
    outputs = Tq * h * D * b + 2 * Tk * h_kv * D * b
    slices = 3 * Tq * rep * D * b + 2 * Tk * D * b
    kernel = Tq * rep * (4 * D + 4 + D * b) + 2 * Tk * rep * D * b + 2 * Tk * D * b
    return outputs + slices + kernel


def _attended_keys(plan, cu: np.ndarray, causal: bool, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``[cp]`` twice: the keys every rank's runs attend, counted once per run (what an all-gather's key
    index selects), and of those the ones the rank holds itself (the exchange's local part)."""
    lo, hi = key_ranges(plan, cu, causal=causal, window=window)
    attended = np.bincount(plan.run_rank(), weights=hi - lo, minlength=plan.cp_size).astype(np.int64)
    held = np.zeros(plan.cp_size, dtype=np.int64)
    for r in range(plan.cp_size):
        a, b = int(plan.offsets[r]), int(plan.offsets[r + 1])
        s, n = plan.run_start[a:b], plan.run_len[a:b]
        _, _, p_lo, p_hi = intersect_ranges(lo[a:b], hi[a:b], s, s + n)
        held[r] = int((p_hi - p_lo).sum())
    return attended, held


def _group_keys(plan, cu: np.ndarray, first: int, end: int, causal: bool) -> int:
    """The keys the runs of ranks ``[first, end)`` attend together (hybrid's Ulysses group: their tokens end to
    end, rank after rank), counted once per run after merging consecutive runs that continue each other inside one
    segment."""
    a, b = int(plan.offsets[first]), int(plan.offsets[end])
    start, length = plan.run_start[a:b], plan.run_len[a:b]
    seg = np.searchsorted(cu, start, side="right") - 1
    new = np.ones(start.size, dtype=bool)
    new[1:] = (start[1:] != start[:-1] + length[:-1]) | (seg[1:] != seg[:-1])
    group = np.cumsum(new) - 1
    end_of = np.zeros(int(new.sum()), dtype=np.int64)
    np.maximum.at(end_of, group, start + length)
    first_seg = seg[new]
    lo = cu[first_seg]
    hi = end_of if causal else cu[first_seg + 1]
    return int((hi - lo).sum())


def _allgather_peak(Tq: int, keys: int, total: int, h: int, h_kv: int, D: int, b: int, gathers: bool = True) -> int:
    """The all-gather's backward above the saved output: the kernel over its selected keys (the gathered buffer
    freed), or gathering V (K's selected keys, the gathered buffer and gloo's copy of it, V's), or scattering dK/dV
    (dq, both keys' gradients, the full-size buffer, the rank's chunk). ``gathers=False``: a one-rank all-gather
    group (hybrid with ``U = cp``) selects from its own rows and keeps the full-size buffer as its result."""
    row = h_kv * D * b
    kernel = 2 * keys * row + _kernel_backward_bytes(Tq, keys, h, h_kv, D, b)
    if not gathers:
        return max(kernel, Tq * h * D * b + 2 * keys * row + total * row)
    gather = 2 * keys * row + 2 * total * row
    scatter = Tq * h * D * b + 2 * keys * row + total * row + Tq * row
    return max(kernel, gather, scatter)


def _plan_memory(plan, cu: np.ndarray, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                 causal: bool, window: int | None, ulysses_size: int | None = None) -> dict[str, tuple[int, int]]:
    """:func:`backend_memory` on a layout's plan (every rank's runs) and the stream's ``cu`` (int64)."""
    cp, Tl, H, H_kv, D, b = plan.cp_size, plan.t_local, num_heads, num_kv_heads, head_dim, dtype_bytes
    row_q, row_kv = H * D * b, H_kv * D * b
    saved = Tl * (2 * row_q + 2 * row_kv + 4 * H)  # q, k, v, out, lse: every backend saves its local tensors only
    out = Tl * (row_q + 4 * H)  # the output and lse, live through backward
    if cp == 1:
        peak = out + _kernel_backward_bytes(Tl, Tl, H, H_kv, D, b)
        result = {name: (saved, peak) for name in MEMORY_BACKENDS}
        if ulysses_size is not None:
            result["hybrid"] = (saved, peak)
        return result
    need = need_tokens(plan, cu, causal=causal, window=window)  # every rank's received keys
    pieces = exchange_pieces(plan, cu, causal=causal, window=window)
    sent = np.bincount(pieces.owner, weights=pieces.length, minlength=cp).astype(np.int64)
    attended, held = _attended_keys(plan, cu, causal, window)
    allgather = exchange = 0
    for r in range(cp):
        n = int(attended[r])
        allgather = max(allgather, out + _allgather_peak(Tl, n, cp * Tl, H, H_kv, D, b))
        # exchange: the local part's backward while the keys fly (the received and the send buffers live), then
        # the remote part's, both in pieces of at most ~T_local keys (exchange.num_pieces), the remote one beside
        # the received keys, their dK/dV, dq and the held keys' dK/dV
        received, local, remote = int(need[r]), max(1, int(held[r])), n - int(held[r])
        # a piece of k of a part's n keys has about k / n of the rows (at least a few runs' worth)
        kernel = 2 * local * row_kv + _kernel_backward_bytes(Tl, local, H, H_kv, D, b)
        if received and local > Tl:  # overlapped: the local part in pieces of whole runs, into one dq made after
            rest = min(Tl, local - Tl)  # the first piece's kernel
            kernel = max(2 * Tl * row_kv + _kernel_backward_bytes(max(Tl * Tl // local, Tl // 4), Tl, H, H_kv, D, b),
                         Tl * row_q + 2 * rest * row_kv
                         + _kernel_backward_bytes(max(Tl * rest // local, Tl // 4), rest, H, H_kv, D, b))
        local_part = 2 * (received + int(sent[r])) * row_kv + kernel + 2 * Tl * row_kv
        piece = min(remote, Tl)
        rows = max(Tl * piece // max(remote, 1), Tl // 4)
        remote_part = (Tl * row_q + 2 * Tl * row_kv + 4 * received * row_kv + 2 * piece * row_kv
                       + _kernel_backward_bytes(rows, piece, H, H_kv, D, b)) if received else 0
        forward = Tl * (row_q + 4 * H) + 2 * remote * row_kv + Tl * H * D * 4  # the merge's float32 output
        exchange = max(exchange, out + max(local_part, remote_part, forward))
    result = {"allgather": (saved, allgather), "exchange": (saved, exchange)}
    if H % cp == 0 and window is None:
        rep = kv_replication_factor(H_kv, cp)
        shard = Tl * (H + 2 * H_kv * rep) * D * b  # this rank's head shard of q, k, v (every rank's tokens)
        # backward: the head shard of q/k/v and of dout/out around the kernel; then the gradients' shard, sent back
        in_kernel = shard + 2 * Tl * row_q + _kernel_backward_bytes(cp * Tl, cp * Tl, H // cp, H_kv * rep // cp, D, b)
        result["ulysses"] = (saved, out + max(in_kernel, 3 * shard))
    if ulysses_size is not None:
        U = ulysses_size
        rep = kv_replication_factor(H_kv, U)
        h, h_kv = H // U, H_kv * rep // U
        shard = Tl * (H + 2 * H_kv * rep) * D * b  # q, k, v of the Ulysses group's tokens, this rank's heads
        hybrid = 0
        for g in range(cp // U):  # a Ulysses group attends the keys of its ranks' runs, adjacent ones merged
            keys = _group_keys(plan, cu, g * U, (g + 1) * U, causal)
            hybrid = max(hybrid, out + shard + 2 * Tl * row_q
                         + _allgather_peak(U * Tl, keys, cp * Tl, h, h_kv, D, b, gathers=U < cp))
        result["hybrid"] = (saved, hybrid)
    return result


def backend_memory(sharded, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2,
                   causal: bool = True, window: int | None = None,
                   ulysses_size: int | None = None) -> dict[str, tuple[int, int]]:
    """Modelled ``(saved, peak)`` bytes of one attention layer at the busiest rank, per backend that can run.

    ``saved``: what autograd keeps for backward: q, k, v, the output and the float32 ``lse``, the rank's share of
    the one-process figure for every backend (each sends or gathers again in backward). ``peak``: the most the
    layer allocates above its inputs, forward or backward (its output and gradients included) with flash-attn 2's
    own buffers (run one key/value head at a time where a rank attends more keys than it has queries): the
    all-gather's selected keys (counted once per run that attends them) beside the gathered buffer or the
    full-size dK/dV buffer; the exchange's received and sent keys (``cp_packing.layouts.need``) beside its local
    part's pieces, then its remote part's pieces (at most about ``T_local`` keys each); Ulysses' head shard; hybrid's head shard
    beside the all-gather over its Ulysses group's keys. Every rank is priced, the busiest returned. Measured
    against this: ``benchmarks/bench_memory.py`` (docs/benchmarks.md, "Memory per backend"; within about 10% of
    the all-gather and the exchange there). Pure host arithmetic on the layout's plan.

    Args:
        sharded: a ``ShardedPackedSeqParams`` of the step.
        num_heads, num_kv_heads, head_dim, dtype_bytes: the layer's q/k shapes.
        causal, window: the layer's mask.
        ulysses_size: also price ``hybrid`` with this Ulysses degree (``None``: not priced; needs no window).

    Returns:
        ``{backend: (saved, peak)}`` for ``allgather``, ``exchange``, (where ``cp`` divides the query heads and
        there is no window) ``ulysses``, and ``hybrid`` when ``ulysses_size`` is given.

    Raises:
        ValueError: ``ulysses_size`` that does not divide ``cp_size`` and ``num_heads``, or given with a window.

    >>> import cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1] * 8 + [2] * 8]))
    >>> s = cp_packing.shard_packed_seq_params(params, cp_size=2, cp_rank=0, layout="contiguous")
    >>> {name: saved for name, (saved, peak) in backend_memory(s, num_heads=4, num_kv_heads=2, head_dim=8).items()}
    {'allgather': 1664, 'exchange': 1664, 'ulysses': 1664}
    """
    for value, name in ((num_heads, "num_heads"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"),
                        (dtype_bytes, "dtype_bytes")):
        check_int(value, name, min=1)
    if ulysses_size is not None:
        check_int(ulysses_size, "ulysses_size", min=1)
        if sharded.cp_size % ulysses_size or num_heads % ulysses_size:
            raise ValueError(f"ulysses_size={ulysses_size} must divide cp_size={sharded.cp_size} and "
                             f"num_heads={num_heads} to price hybrid; pass a common divisor or ulysses_size=None")
        if window is not None:
            raise ValueError(f"hybrid runs no sliding window (window={window}); pass ulysses_size=None")
    plan = layout_plan(sharded.global_params.cu_seqlens, cp_size=sharded.cp_size, layout=sharded.layout,
                       window=sharded.plan_window)
    return _plan_memory(plan, _np64(sharded.global_params.cu_seqlens, "cu_seqlens"), num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, causal=causal,
                        window=window, ulysses_size=ulysses_size)


def choose_backend(sharded, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2,
                   causal: bool = True, window: int | None = None, hardware: Hardware = DEFAULT_HARDWARE,
                   overlap: bool = True, memory_budget: int | None = None) -> str:
    """``backend="auto"``'s choice among ``TIMED_BACKENDS``: the lowest modelled busiest-rank time
    (:func:`backend_times`); within 1% a tie, which goes to the first of ``TIMED_BACKENDS``. With ``cp_size ==
    1`` the all-gather backend (nothing to communicate). ``memory_budget`` (bytes, ``AttentionOptions``): only the
    backends whose modelled peak per layer (:func:`backend_memory`) fits; a ValueError when none does.

    >>> import cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1] * 4 + [2] * 4 + [3] * 8]))
    >>> s = cp_packing.shard_packed_seq_params(params, cp_size=2, cp_rank=0, layout="contiguous")
    >>> choose_backend(s, num_heads=4, num_kv_heads=4, head_dim=8)  # only rank 1 needs keys, and few
    'exchange'
    """
    shapes = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
                  causal=causal, window=window)
    fits = None
    if memory_budget is not None:
        check_int(memory_budget, "memory_budget", min=1)
        peaks = {name: peak for name, (_, peak) in backend_memory(sharded, **shapes).items()}
        fits = {name for name, peak in peaks.items() if peak <= memory_budget}
        if not fits:
            best_name = min(peaks, key=peaks.get)
            raise ValueError(
                f"memory_budget={memory_budget} bytes fits no backend: the smallest modelled peak per attention layer "
                f"is {peaks[best_name]} bytes ({best_name!r}; {', '.join(f'{n}={p}' for n, p in peaks.items())}); "
                "raise the budget, use more CP ranks (fewer tokens per rank), or memory_budget=None")
    if sharded.cp_size == 1:
        return "allgather"
    times = backend_times(sharded, hardware=hardware, overlap=overlap, **shapes)
    if fits is not None:
        times = {name: t for name, t in times.items() if name in fits}
    best = min(times.values())
    return next(name for name in TIMED_BACKENDS if name in times and times[name] <= best * 1.01)
