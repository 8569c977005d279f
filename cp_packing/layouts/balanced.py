"""The ``balanced`` layout: exactly ``T / cp`` tokens on every rank, even causal cost, no padding.

Under causal attention a token at position ``p`` of its segment attends to ``p + 1`` keys, so a rank's work is
``sum(p + 1)`` over its tokens, and a piece ``[a, b)`` of a segment costs ``(b(b+1) - a(a+1)) / 2``. Under a sliding
``window`` ``w`` a token costs ``min(p + 1, w)`` instead (summed over the layers for a per-layer window; closed forms
in ``cp_packing.layouts.work``): a long document is then about linear, and every step below prices pieces that way.
With ``C`` the total cost, ``C / cp`` is the ideal per rank. The plan (every rank's runs at once)::

    1. long    a segment costing > HEAVY * C/cp with >= 2*cp*MIN_CHUNK tokens: cut zigzag-style in 2cp chunks,
               rank r takes chunks r and 2cp-1-r (an early and a late one: the same cost on every rank)
                   [ 0 | 1 | 2 | 3 | 3 | 2 | 1 | 0 ]      cp = 4, one long document
               Under a window the pairs are equal only where the cost per token is linear in p, so the segment is
               first cut at the window(s) (sections of >= 2*cp*MIN_CHUNK tokens) and each section is zigzagged:
                   [0 1 2 3 3 2 1 0|0  1  2  3  3  2  1  0]   ramp [0, w): p + 1 | flat [w, L): w
               and the pairs rotate over the ranks from one segment to the next (a ramp too short to be a section
               of its own is not always rank 0's)
    2. items   every other segment, whole; a heavy one shorter than that in a few pieces of >= MIN_CHUNK tokens
    3. LPT     rho = cost per token of the cheap items (cost <= LPT_FRACTION * C/cp); an item's excess is
               cost - rho * tokens. The items with excess > LPT_FRACTION * C/cp (<= LPT_ROUNDS * cp, 2x under a window),
               largest first, on a heap: each goes whole to the rank with the least excess that has room for it
    4. fill    the other items, sorted by cost per token, in golden-ratio order (j -> j*a mod m, a ~ m/1.618),
               so that every stretch of the stream costs about rho per token; rank r takes the next
               T/cp - (its tokens so far) tokens of it, and each rank's end cuts at most one item
                   stream  [ s  L  m  s  L  m  s  L | m  s  L  m ...]    s/m/L: short/medium/long items
                           |<------- rank 0 ------->|<-- rank 1 ...
    5. check   a rank then costs about its excess + rho * T/cp: even. If the busiest rank is still busier than
               contiguous's busiest (tiny maps, coarse pieces), the plan is contiguous instead.

Runs: every run lies in one segment; a rank's runs are ordered by global position and touching pieces of one
segment on one rank are merged. Pieces cut on purpose (long chunks, mid pieces) have at least ``MIN_CHUNK``
tokens; only the ``cp - 1`` fill cuts of step 4 can leave a shorter piece (and short documents stay whole).

The plan is a function of the ``cu_seqlens`` values, ``cp`` and the window only (integer math, stable sorts, float64
steps that are the same wherever the same NumPy runs), cached per ``(cu_seqlens bytes, cp, window weights)`` in the
one plan cache of ``cp_packing.layouts`` (the weights of ``window_weights(window, max_seqlen=, reduce=True)``: a
window at least as long as every segment plans exactly as no window, and ``[w] * 32`` as ``w``); it runs in NumPy on
the host (a CUDA ``cu_seqlens`` is copied: one host sync per call).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np
import torch

from cp_packing._checks import check_weighted_cost_tokens
from cp_packing.layouts.work import WindowWeights, head_cost, range_cost, window_weights

__all__ = ["balanced_plan", "balanced_plan_arrays", "balanced_runs", "contiguous_plan_arrays", "merge_runs",
           "planned_weights", "MIN_CHUNK", "HEAVY", "LPT_FRACTION", "LPT_ROUNDS"]

#: The smallest piece the planner cuts on purpose. Short runs waste the tiles of a flash kernel.
MIN_CHUNK = 32
#: A segment costing more than this fraction of a rank's ideal cost is cut (zigzag if long, else in pieces).
HEAVY = 0.01
#: Items whose excess over the mean cost per token is above this fraction of a rank's ideal cost are placed one by
#: one (LPT); the rest pour.
LPT_FRACTION = 0.0005
#: At most this many rounds of ``cp`` items go through LPT (the largest excess first; Python time); the rest pour.
#: Twice as many under a window: there, every document longer than the window costs about ``w`` per token, far above
#: the short ones, so more items carry an excess the fill would pour unevenly.
LPT_ROUNDS = 64

_FULL: WindowWeights = ((None, 1),)  # no window: the causal cost


def _sections(start: np.ndarray, length: np.ndarray, cp: int, weights: WindowWeights):
    """Cut the long segments at the windows' kinks: on each section the cost per token is linear in the position
    (a ramp ``p + 1``, a flat ``w``, or a mix over the layers), so a zigzag pair of it costs the same on every rank.
    A kink that would leave a section shorter than ``2 * cp * MIN_CHUNK`` is not cut (its ramp stays in the next
    section). Returns the sections' ``(start, len, pos0, segment)`` (one per segment without a window)."""
    kinks = sorted(w for w, _ in weights if w is not None)
    if not kinks:
        return start, length, np.zeros_like(length), np.arange(length.size, dtype=np.int64)
    least = 2 * cp * MIN_CHUNK
    last = np.zeros_like(length)
    bounds = [last]
    for w in kinks:
        keep = (w - last >= least) & (length - w >= least)
        bounds.append(np.where(keep, w, -1))
        last = np.where(keep, w, last)
    bounds.append(length)
    bounds = np.stack(bounds, axis=1)  # [n, kinks + 2], increasing where >= 0
    owner = np.repeat(np.arange(length.size), (bounds >= 0).sum(axis=1))
    flat = bounds[bounds >= 0]
    same = owner[1:] == owner[:-1]
    pos0, seg = flat[:-1][same], owner[1:][same]
    return start[seg] + pos0, flat[1:][same] - pos0, pos0, seg


def _long_runs(start: np.ndarray, length: np.ndarray, cp: int, weights: WindowWeights):
    """Zigzag pairs of the long segments (under a window, of their sections, see ``_sections``). Rank r's pair
    holds ``L // cp`` or ``L // cp + 1`` tokens (the +1 rotates over the ranks from one segment to the next, so every
    rank gets floor or ceil of their total / cp); its head chunk is at ``r``-th place from the segment's start, its
    tail at ``r``-th place from the end. Under a window the pairs also rotate over the ranks from one segment to the
    next (pair j of segment k on rank ``(j + k) % cp``): a ramp too short to be a section of its own is not always
    rank 0's.
    Returns the runs ``(start, len, rank, pos0)`` and every rank's tokens and cost ``[cp]``."""
    start, length, base, seg = _sections(start, length, cp, weights)
    rem = length % cp
    rot = (np.cumsum(rem) - rem) % cp  # where this segment's +1's start
    ranks = np.arange(cp, dtype=np.int64)
    shift = np.zeros_like(length) if weights == _FULL else seg % cp
    owner = (ranks[None, :] + shift[:, None]) % cp  # [n, cp] the rank of pair j
    pair = length[:, None] // cp + (((owner - rot[:, None]) % cp) < rem[:, None])  # [n, cp]
    head = pair // 2
    tail = pair - head
    head_pos = np.cumsum(head, axis=1) - head  # [n, cp] from the segment's start
    tail_pos = length[:, None] - np.cumsum(tail, axis=1)  # [n, cp] pair j's tail ends where pair j-1's starts
    head_pos += base[:, None]
    tail_pos += base[:, None]
    cost = range_cost(head_pos, head_pos + head, weights) + range_cost(tail_pos, tail_pos + tail, weights)
    pos = np.concatenate([head_pos, tail_pos], axis=1)
    return (
        (pos - base[:, None] + start[:, None]).ravel(),
        np.concatenate([head, tail], axis=1).ravel(),
        np.concatenate([owner, owner], axis=1).ravel(),
        pos.ravel(),
        np.bincount(owner.ravel(), weights=pair.ravel(), minlength=cp).astype(np.int64),
        np.bincount(owner.ravel(), weights=cost.ravel(), minlength=cp),
    )


def _lpt(weight: np.ndarray, length: np.ndarray, load: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Place the items (heaviest first) one by one on the rank with the least load that has room for them.
    Returns every item's rank (-1: no room anywhere)."""
    heap = [(e, r) for r, e in enumerate(load.tolist())]
    heapq.heapify(heap)
    room = room.tolist()
    rank = []
    for w, n in zip(weight.tolist(), length.tolist()):
        full = []
        while heap and room[heap[0][1]] < n:  # ranks without room for it step aside
            full.append(heapq.heappop(heap))
        r = -1
        if heap:
            e, r = heap[0]
            room[r] -= n
            heapq.heapreplace(heap, (e + w, r))
        for entry in full:
            heapq.heappush(heap, entry)
        rank.append(r)
    return np.array(rank, dtype=np.int64)


def _golden(m: int) -> np.ndarray:
    """``j * a % m`` for ``j < m``, ``a`` coprime with ``m`` near ``m / golden ratio``: a low-discrepancy
    permutation (any stretch of it samples all of ``range(m)`` evenly)."""
    a = max(1, round(m * 0.6180339887498949))
    while math.gcd(a, m) != 1:
        a += 1
    out = np.arange(m, dtype=np.int64)
    out *= a
    out %= m
    return out


def _pieces(start: np.ndarray, length: np.ndarray, q: np.ndarray):
    """Cut item k into ``q[k]`` consecutive pieces (piece j of ``[j*L//q, (j+1)*L//q)``). Returns the pieces'
    ``(start, len, pos0)`` in position order."""
    owner = np.repeat(np.arange(length.size), q)
    j = np.arange(owner.size) - (np.cumsum(q) - q)[owner]
    lo, hi = j * length[owner] // q[owner], (j + 1) * length[owner] // q[owner]
    return start[owner] + lo, hi - lo, lo


def _fill(length: np.ndarray, rank: np.ndarray, stream: np.ndarray, need: np.ndarray):
    """Pour the items ``stream`` (in that order) into the ranks, rank r taking the next ``need[r]`` tokens: sets
    ``rank`` of every item (its first token's rank), shortens the items a rank end cuts to their first piece and
    returns the pieces after the cuts ``(item, offset inside it, len, rank)`` (at most ``cp - 1``)."""
    ends = np.cumsum(need)  # rank r's share of the stream is [ends[r] - need[r], ends[r])
    s_len = length[stream]
    s_end = np.cumsum(s_len)
    s_start = s_end - s_len
    first_of = np.searchsorted(s_start, ends, side="left")  # the first item starting at or after each rank end
    rank[stream] = np.repeat(np.arange(need.size + 1), np.diff(first_of, prepend=0, append=stream.size))
    cuts = np.unique(ends[:-1])
    k = np.minimum(np.searchsorted(s_end, cuts, side="right"), stream.size - 1)  # the item holding each cut
    inside = (cuts > s_start[k]) & (cuts < s_end[k])
    cuts, k = cuts[inside], k[inside]
    item, off = stream[k], cuts - s_start[k]
    nxt = np.append(off[1:], 0)
    same = np.append(k[1:] == k[:-1], False)
    x_len = np.where(same, nxt, length[item]) - off
    first = np.ones(k.size, dtype=bool)
    first[1:] = k[1:] != k[:-1]
    length[item[first]] = off[first]
    return item, off, x_len, np.searchsorted(ends, cuts, side="right")


def _plan(cu: np.ndarray, cp: int, weights: WindowWeights = _FULL):
    """Every rank's runs: ``(offsets [cp + 1], run_start [R], run_len [R])``, rank r's runs at
    ``offsets[r]:offsets[r + 1]``, ordered by position, for the cost of ``weights``. See the module docstring."""
    total = int(cu[-1])
    t_local = total // cp
    start, length = cu[:-1], np.diff(cu)
    if length.min() == 0:
        start, length = start[length > 0], length[length > 0]
    if weights == _FULL:
        cost = length + 1  # L (L + 1) / 2, in place
        cost *= length
        cost >>= 1
    else:
        cost = head_cost(length, weights)
    ideal = float(cost.sum()) / cp
    contiguous = _contiguous_busiest(start, cost, t_local, cp, weights)
    tokens, excess = np.zeros(cp, dtype=np.int64), np.zeros(cp)
    extra = []  # runs besides the items: (start, len, rank, pos0)

    # 1. long segments: zigzag over all ranks
    heavy = cost > HEAVY * ideal
    long = heavy & (length >= 2 * cp * MIN_CHUNK)
    if long.any():
        *runs, long_tokens, long_cost = _long_runs(start[long], length[long], cp, weights)
        extra.append(runs)
        tokens += long_tokens
        excess += long_cost
        start, length, cost, heavy = start[~long], length[~long], cost[~long], heavy[~long]
    # 2. items: the other segments, whole; a heavy one in q pieces of >= MIN_CHUNK tokens (the first in its place,
    # the others appended: few)
    pos0 = np.zeros(length.size, dtype=np.int64)
    n_whole = length.size  # items from here on are later pieces of heavy segments (pos0 > 0)
    h = np.flatnonzero(heavy)
    if h.size:
        q = np.clip(np.ceil(cost[h] / (HEAVY * ideal)), 1, np.maximum(length[h] // MIN_CHUNK, 1)).astype(np.int64)
        p_start, p_len, p_pos0 = _pieces(start[h], length[h], q)
        first = np.cumsum(q) - q
        later = np.ones(p_len.size, dtype=bool)
        later[first] = False
        length[h] = p_len[first]
        cost[h] = head_cost(p_len[first], weights)
        start = np.concatenate([start, p_start[later]])
        length = np.concatenate([length, p_len[later]])
        pos0 = np.concatenate([pos0, p_pos0[later]])
        cost = np.concatenate([cost, range_cost(p_pos0[later], p_pos0[later] + p_len[later], weights)])

    # 3. LPT on the items that cost most over the fill's cost per token rho (the rest pour evenly)
    coarse = np.flatnonzero(cost > LPT_FRACTION * ideal)
    rho = float(cost.sum() - cost[coarse].sum()) / max(int(length.sum() - length[coarse].sum()), 1)
    weight = cost[coarse] - rho * length[coarse]  # the excess of an item over rho: what the fill cannot even out
    big = coarse[weight > LPT_FRACTION * ideal]
    weight = weight[weight > LPT_FRACTION * ideal]
    rounds = LPT_ROUNDS if weights == _FULL else 2 * LPT_ROUNDS
    if big.size > rounds * cp:
        keep = np.argpartition(-weight, rounds * cp)[: rounds * cp]
        big, weight = big[keep], weight[keep]
    o = np.lexsort((big, -weight))  # largest excess first, ties by position
    big, weight = big[o], weight[o]
    rank = np.full(length.size, -1, dtype=np.int64)
    rank[big] = _lpt(weight, length[big], excess - rho * tokens, t_local - tokens)
    placed = big[rank[big] >= 0]
    np.add.at(tokens, rank[placed], length[placed])

    # 4. fill: the rest by cost per token (2 * cost / length = 2 * pos0 + length + 1), golden-ratio interleaved
    rest = np.flatnonzero(rank < 0) if placed.size else np.arange(length.size)
    if rest.size:
        stream = rest[np.argsort(_density(rest, length, cost, pos0, n_whole, weights), kind="stable")
                      [_golden(rest.size)]]
        item, off, x_len, x_rank = _fill(length, rank, stream, t_local - tokens)
        cost[item] = range_cost(pos0[item], pos0[item] + length[item], weights)  # a cut item keeps its first piece
        extra.append((start[item] + off, x_len, x_rank, pos0[item] + off))

    # 5. never busier than contiguous
    rank_cost = np.bincount(rank, weights=cost, minlength=cp).astype(np.float64)  # int64 zeros when empty
    for _, x_len, x_rank, x_pos0 in extra:
        rank_cost += np.bincount(x_rank, weights=range_cost(x_pos0, x_pos0 + x_len, weights), minlength=cp)
    if contiguous < rank_cost.max():
        return contiguous_plan_arrays(cu, cp)
    return merge_runs(*(np.concatenate(x) for x in zip((start, length, rank, pos0), *extra)), cp)


def _density(rest, length, cost, pos0, n_whole, weights: WindowWeights) -> np.ndarray:
    """int16 sort key of the fill items ``rest``: their cost per token. Without a window ``2 * cost / length - 1``
    exactly (``length`` for a whole segment, plus ``2 * pos0`` for a later piece); under a window the cost per token
    scaled onto ``[0, 2**15 - 2]``."""
    if weights == _FULL:
        density = length[rest]  # = 2 * cost / length - 1 for a whole segment; pieces (appended) add 2 * pos0
        piece = np.flatnonzero(rest >= n_whole)
        density[piece] += 2 * pos0[rest[piece]]
        return np.minimum(density, 2**15 - 1, out=density).astype(np.int16)
    per_token = cost[rest] / length[rest]  # float64, > 0
    return (per_token * ((2**15 - 2) / per_token.max())).astype(np.int16)


def _contiguous_busiest(start: np.ndarray, cost: np.ndarray, t_local: int, cp: int, weights: WindowWeights) -> int:
    """The busiest rank's cost under contiguous: the prefix cost ``W(t)`` at the rank bounds (non-empty segments)."""
    bounds = np.arange(cp + 1, dtype=np.int64) * t_local
    seg = np.searchsorted(start, bounds, side="right") - 1
    p = bounds - start[seg]
    w = (np.cumsum(cost) - cost)[seg] + head_cost(p, weights)
    return int(np.diff(w).max())


def merge_runs(start, length, rank, pos0, cp):
    """Group the runs by rank in position order and join touching pieces of one segment on one rank (only a run that
    does not start its segment, pos0 > 0, can join the one before: few). The runs come mostly in position order (the
    items, then a few extra pieces), so the sorts are cheap. Returns ``(offsets, start, length)``."""
    o = np.argsort(start, kind="stable")
    o = o[np.argsort(rank[o].astype(np.int16 if cp < 2**15 else np.int32), kind="stable")]
    start, length = start[o], length[o]
    counts = np.bincount(rank, minlength=cp)
    cand = np.flatnonzero(pos0[o] > 0)
    cand = cand[cand > 0]
    joins = cand[(rank[o[cand]] == rank[o[cand - 1]]) & (start[cand] == start[cand - 1] + length[cand - 1])]
    if joins.size:  # chains of joins: every run adds its length to the first run of its chain
        chain = joins - np.arange(joins.size)  # constant along a chain of consecutive joins
        head = np.ones(joins.size, dtype=bool)
        head[1:] = chain[1:] != chain[:-1]
        np.add.at(length, joins[head][np.cumsum(head) - 1] - 1, length[joins])
        start, length = np.delete(start, joins), np.delete(length, joins)
        counts -= np.bincount(rank[o[joins]], minlength=cp)
    offsets = np.zeros(cp + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets, start, length


def contiguous_plan_arrays(cu: np.ndarray, cp: int):
    """The contiguous placement as a plan: every segment cut at the rank boundaries."""
    total = int(cu[-1])
    bounds = np.arange(1, cp, dtype=np.int64) * (total // cp)
    at = np.searchsorted(cu, bounds)
    new = cu[np.minimum(at, cu.size - 1)] != bounds
    cuts = np.insert(cu, at[new], bounds[new])  # cu is sorted: one pass, no hashing
    run_start, run_len = cuts[:-1], np.diff(cuts)
    keep = run_len > 0
    run_start, run_len = run_start[keep], run_len[keep]
    offsets = np.searchsorted(run_start, np.arange(cp + 1, dtype=np.int64) * (total // cp), side="left")
    return offsets.astype(np.int64), run_start, run_len


def planned_weights(cu: np.ndarray, cp_size: int, window: object) -> WindowWeights:
    """The window weights the plan of ``cu`` (int64 NumPy, validated) balances: ``window_weights(window,
    max_seqlen=, reduce=True)`` (a window at least as long as every segment is no window), checked to fit int64."""
    max_seqlen = int(np.diff(cu).max()) if cu.size > 1 else 0
    weights = window_weights(window, max_seqlen=max_seqlen, reduce=True)
    check_weighted_cost_tokens(int(cu[-1]), sum(c for _, c in weights))
    return weights


def balanced_plan_arrays(cu: np.ndarray, cp_size: int, weights: WindowWeights) -> tuple[np.ndarray, ...]:
    """``(offsets, run_start, run_len)`` of a validated, non-empty ``cu`` and ``planned_weights``: pure, not cached
    (``layouts.PLANS["balanced"]``; ``layout_plan`` caches it)."""
    return _plan(cu, cp_size, weights)


def balanced_plan(
    cu_seqlens: torch.Tensor, *, cp_size: int, window: int | Sequence[int | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's runs of the ``balanced`` layout (see the module docstring), planned once per
    ``(cu_seqlens values, cp_size, window)``.

    Args:
        cu_seqlens: int ``[N + 1]`` global cumulative segment lengths (CPU or CUDA); ``T = cu_seqlens[-1]`` must be
            divisible by ``cp_size``.
        cp_size: the context-parallel group size.
        window: the attention's sliding window: ``None`` (full causal), an int, or a per-layer list of
            ``int | None`` (the cost is the sum over the layers). The plan balances ``sum min(p + 1, window)``; a
            window at least as long as every segment gives the plan of ``None``.

    Returns:
        ``(offsets, run_start, run_len)``, CPU int64 tensors ``[cp_size + 1]``, ``[R]``, ``[R]`` (fresh copies:
        editing them never changes a later plan). Rank r's runs are ``run_start[offsets[r]:offsets[r + 1]]``,
        ordered by global position.

    Raises:
        TypeError / ValueError: a bad ``cu_seqlens``, ``cp_size`` or ``window``, or ``T`` not divisible by
        ``cp_size``.

    >>> offsets, run_start, run_len = balanced_plan(torch.tensor([0, 2, 5, 6]), cp_size=3)
    >>> run_len.sum().item(), offsets.tolist()
    (6, [0, 1, 2, 4])
    >>> balanced_plan(torch.tensor([0, 2, 5, 6]), cp_size=3, window=[4, None])[1].tolist()  # 4 >= every segment
    [0, 2, 4, 5]
    """
    from cp_packing.layouts import layout_plan  # the one plan cache (the package imports this module)

    plan = layout_plan(cu_seqlens, cp_size=cp_size, layout="balanced", window=window)
    return tuple(torch.from_numpy(a.copy()) for a in (plan.offsets, plan.run_start, plan.run_len))


def balanced_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, window: int | Sequence[int | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs of global tokens rank ``cp_rank`` holds under ``balanced``: a slice of ``balanced_plan``.

    Args:
        cu_seqlens: int ``[N + 1]`` global cumulative segment lengths (any int dtype, CPU or CUDA).
        cp_size, cp_rank: the context-parallel group size and this rank.
        window: the sliding window(s) the plan balances (as in ``balanced_plan``); every rank must pass the same.

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each on ``cu_seqlens.device``, ordered by global position;
        ``run_len.sum() == T // cp_size``; all ranks' runs together cover every token exactly once.

    >>> balanced_runs(torch.tensor([0, 2, 5, 6]), cp_size=3, cp_rank=1)
    (tensor([2]), tensor([2]))
    """
    from cp_packing.layouts import layout_runs  # the one plan cache (the package imports this module)

    return layout_runs(cu_seqlens, cp_size=cp_size, cp_rank=cp_rank, layout="balanced", window=window)
