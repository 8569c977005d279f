"""What a rank needs from the others: the keys its queries attend that it does not hold. Pure NumPy index math.

Under causal document attention a local run ``[s, s + L)`` of a segment starting at ``g`` attends the keys
``[g, s + L)`` (``[max(g, s - w + 1), s + L)`` under a sliding window ``w``: its first query's window start; later
queries see less far back, the kernel masks them); without causality the whole segment ``[g, e)``. A rank's NEED is
the union of its runs' key ranges minus the tokens it holds, as disjoint ranges of global positions, and each needed
range is held by one other rank (its *owner*) at known local rows::

    global   0 ............................................ T
    rank 1 holds   [====]          [==]           a run at [s, s+L): keys [g, s+L)
    its need  [###]      [#########]              the rest of the key ranges, owned by ranks 0, 2, ...

:func:`exchange_pieces` returns those pieces with their owner and the owner's local row: the send and receive
tables of the exchange backend (``cp_packing.attention.exchange``) and the bytes of the cost model
(``cp_packing.cost``) both come from here. Memory and time O(runs log runs); nothing is per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cp_packing.layouts import LayoutPlan

__all__ = ["ExchangePieces", "chunked_segments", "exchange_pieces", "intersect_ranges", "key_ranges", "need_tokens",
           "split_plan"]


def intersect_ranges(lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """Every non-empty intersection of query ranges ``[lo[i], hi[i])`` with sorted, disjoint ranges ``[starts[k],
    ends[k])``: ``(i, k, p_lo, p_hi)`` int64 ``[P]``, query by query, each in position order. O(P + N log M).

    >>> [a.tolist() for a in intersect_ranges(np.array([1, 6]), np.array([5, 7]), np.array([0, 3, 6]),
    ...                                        np.array([2, 5, 9]))]
    [[0, 0, 1], [0, 1, 2], [1, 3, 6], [2, 5, 7]]
    """
    first = np.searchsorted(ends, lo, side="right")  # the first range ending after lo
    last = np.searchsorted(starts, hi, side="left")  # ranges starting before hi: [first, last)
    count = np.maximum(last - first, 0)
    i = np.repeat(np.arange(lo.size), count)
    k = first[i] + (np.arange(i.size) - np.repeat(np.cumsum(count) - count, count))
    p_lo, p_hi = np.maximum(lo[i], starts[k]), np.minimum(hi[i], ends[k])
    keep = p_hi > p_lo
    return i[keep], k[keep], p_lo[keep], p_hi[keep]


def key_ranges(plan: LayoutPlan, cu: np.ndarray, *, causal: bool = True, window: int | None = None):
    """``(lo, hi)`` int64 ``[R]``: the global key range of every run of ``plan`` (see the module docstring).

    >>> from cp_packing.layouts import layout_plan
    >>> import torch
    >>> plan = layout_plan(torch.tensor([0, 6]), cp_size=2, layout="contiguous")
    >>> [a.tolist() for a in key_ranges(plan, np.array([0, 6]))]
    [[0, 0], [3, 6]]
    """
    s, n = plan.run_start, plan.run_len
    seg = np.searchsorted(cu, s, side="right") - 1
    g = cu[seg]
    if not causal:
        return g.astype(np.int64), cu[seg + 1].astype(np.int64)
    lo = g if window is None else np.maximum(g, s - (window - 1))
    return lo.astype(np.int64), (s + n).astype(np.int64)


def _need_intervals(plan: LayoutPlan, lo: np.ndarray, hi: np.ndarray):
    """Per rank, the union of the key ranges minus the held runs: ``(rank, start, end)`` disjoint, sorted."""
    rank = plan.run_rank()
    # boundaries: key range +1 / -1 (overlapping ranges of one rank add up), held run -BIG / +BIG
    big = np.int64(1) << 40
    pos = np.concatenate([lo, hi, plan.run_start, plan.run_start + plan.run_len])
    delta = np.concatenate([np.ones_like(lo), -np.ones_like(hi), np.full_like(lo, -big), np.full_like(hi, big)])
    owner = np.concatenate([rank, rank, rank, rank])
    o = np.lexsort((pos, owner))
    pos, delta, owner = pos[o], delta[o], owner[o]
    # net change per (rank, position); the level after it is the cumulative sum within the rank
    first = np.ones(pos.size, dtype=bool)
    first[1:] = (pos[1:] != pos[:-1]) | (owner[1:] != owner[:-1])
    idx = np.flatnonzero(first)
    net = np.add.reduceat(delta, idx) if idx.size else delta[:0]
    pos, owner = pos[idx], owner[idx]
    level = np.cumsum(net)  # every rank's deltas sum to 0: each rank's sweep starts at level 0
    needed = level > 0  # covered by some key range and not held (held subtracts BIG)
    keep = needed[:-1] & (owner[1:] == owner[:-1]) & (pos[1:] > pos[:-1])
    return owner[:-1][keep], pos[:-1][keep], pos[1:][keep]


def need_tokens(plan: LayoutPlan, cu: np.ndarray, *, causal: bool = True, window: int | None = None) -> np.ndarray:
    """int64 ``[cp]``: how many keys every rank needs from the other ranks (the exchange's receive count).

    >>> from cp_packing.layouts import layout_plan
    >>> import torch
    >>> need_tokens(layout_plan(torch.tensor([0, 8]), cp_size=2, layout="contiguous"), np.array([0, 8])).tolist()
    [0, 4]
    """
    lo, hi = key_ranges(plan, cu, causal=causal, window=window)
    rank, start, end = _need_intervals(plan, lo, hi)
    return np.bincount(rank, weights=end - start, minlength=plan.cp_size).astype(np.int64)


@dataclass(frozen=True)
class ExchangePieces:
    """The needed key ranges, cut at the owners' runs: what rank ``receiver`` gets from rank ``owner``.

    Attributes:
        receiver, owner: int64 ``[P]`` ranks.
        start, length: int64 ``[P]`` global positions of each piece.
        owner_row: int64 ``[P]`` the piece's first row in the owner's local stream.
        Pieces are sorted by (receiver, owner, start): the order of an all-to-all's splits.
    """

    receiver: np.ndarray
    owner: np.ndarray
    start: np.ndarray
    length: np.ndarray
    owner_row: np.ndarray


def exchange_pieces(plan: LayoutPlan, cu: np.ndarray, *, causal: bool = True,
                    window: int | None = None) -> ExchangePieces:
    """Every rank's need, cut at the runs of its owners (see :class:`ExchangePieces`).

    >>> from cp_packing.layouts import layout_plan
    >>> import torch
    >>> p = exchange_pieces(layout_plan(torch.tensor([0, 8]), cp_size=2, layout="contiguous"), np.array([0, 8]))
    >>> p.receiver.tolist(), p.owner.tolist(), p.start.tolist(), p.length.tolist(), p.owner_row.tolist()
    ([1], [0], [0], [4], [0])
    """
    lo, hi = key_ranges(plan, cu, causal=causal, window=window)
    receiver, start, end = _need_intervals(plan, lo, hi)
    run_rank = plan.run_rank()
    csum = np.concatenate([[0], np.cumsum(plan.run_len)])
    local_start = csum[:-1] - np.repeat(csum[plan.offsets[:-1]], np.diff(plan.offsets))  # row of each run's start
    o = np.argsort(plan.run_start, kind="stable")  # the runs of all ranks partition [0, T)
    r_start, r_end = plan.run_start[o], plan.run_start[o] + plan.run_len[o]
    r_rank, r_row = run_rank[o], local_start[o]
    piece, run, p_start, p_end = intersect_ranges(start, end, r_start, r_end)
    p_recv, p_owner = receiver[piece], r_rank[run]
    p_row = r_row[run] + (p_start - r_start[run])
    o = np.lexsort((p_start, p_owner, p_recv))
    return ExchangePieces(p_recv[o], p_owner[o], p_start[o], (p_end - p_start)[o], p_row[o])


def chunked_segments(cu: np.ndarray, chunk: int) -> np.ndarray:
    """int64 ``[N' + 1]``: ``cu`` with every segment cut into pieces of ``chunk`` tokens from its start (Llama 4's
    chunked attention: a query attends only the keys of its own chunk of its document).

    >>> chunked_segments(np.array([0, 5, 7]), 2).tolist()
    [0, 2, 4, 5, 7]
    """
    start, length = cu[:-1], np.diff(cu)
    cuts = np.maximum((length - 1) // chunk, 0)  # inner cuts per segment
    owner = np.repeat(np.arange(length.size), cuts)
    j = np.arange(owner.size) - np.repeat(np.cumsum(cuts) - cuts, cuts) + 1
    return np.union1d(cu, start[owner] + j * chunk).astype(np.int64)


def split_plan(plan: LayoutPlan, cu: np.ndarray) -> LayoutPlan:
    """``plan`` with every run cut where a (finer) segmentation ``cu`` has a boundary inside it (e.g.
    :func:`chunked_segments`); the placement of every token is unchanged.

    >>> from cp_packing.layouts import layout_plan
    >>> import torch
    >>> plan = split_plan(layout_plan(torch.tensor([0, 8]), cp_size=2, layout="contiguous"), np.array([0, 2, 4, 6, 8]))
    >>> plan.offsets.tolist(), plan.run_start.tolist(), plan.run_len.tolist()
    ([0, 2, 4], [0, 2, 4, 6], [2, 2, 2, 2])
    """
    s, n = plan.run_start, plan.run_len
    first = np.searchsorted(cu, s, side="right")  # the first boundary after each run's start
    last = np.searchsorted(cu, s + n, side="left")  # boundaries strictly inside: [first, last)
    count = last - first + 1
    run = np.repeat(np.arange(s.size), count)
    j = np.arange(run.size) - np.repeat(np.cumsum(count) - count, count)
    inner = first[run] + j - 1  # the boundary before piece j (j > 0)
    p_start = np.where(j == 0, s[run], cu[np.minimum(inner, cu.size - 1)])
    nxt = first[run] + j
    p_end = np.where(j == count[run] - 1, (s + n)[run], cu[np.minimum(nxt, cu.size - 1)])
    per_rank = np.bincount(plan.run_rank()[run], minlength=plan.cp_size)
    offsets = np.zeros(plan.cp_size + 1, dtype=np.int64)
    np.cumsum(per_rank, out=offsets[1:])
    return LayoutPlan(plan.layout, plan.cp_size, offsets, p_start.astype(np.int64), (p_end - p_start).astype(np.int64),
                      plan.total)
