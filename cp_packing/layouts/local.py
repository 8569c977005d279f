"""The ``local`` layout: exactly ``T / cp`` tokens per rank, an even causal cost, and few keys from other ranks.

An exchange backend moves to each rank the keys its queries need that other ranks hold: for every run, the keys of
its segment from the segment's start up to the run's last token, minus the rank's own tokens. ``balanced`` cuts
nearly every long document over all ranks (each rank then needs nearly all of it); ``contiguous`` keeps documents
together but is uneven. ``local`` lays the segments end to end as one stream ``S``, shortest first, and gives rank
``r`` the ``r``-th interval from each end of ``S`` (rank ``cp - 1`` the middle one)::

    S   [ a b c d e f  g g  h h h  i i i i  j j j j j j  k k k k k k k k k k ]   segments by length, short first
          |-- 0 --|-- 1 --|--- 2 ---|---- 3 ----|--- 2 ---|--- 1 ---|-- 0 --|   the rank of each interval, cp = 4
          cheap tokens (short segments)                   dense tokens (long segments, late positions)

From the outside in, rank ``r`` takes ``a`` tokens from the low end of what is left and ``T/cp - a`` from the high
end: every split ``a`` is priced at once (the cost of ``S`` up to any point is a closed form of the segments), and
the one nearest the mean cost of the ranks still to place wins; the last rank takes the middle. One more low token
and one less high token costs less, so while the cost along ``S`` rises a split within one token's cost of the mean
exists. A second freedom makes it exact: the segment the high bound cuts gives the rank its outside, the end of
what is left of it and a head of ``h`` tokens from its start (by default none of a straight segment, half for a folded
one, see below), and ``h`` is free. One token moved from that end to the head costs less by the width of what is
left; traded for one more token from the low end, the cost moves by that cheap token's cost: fine steps. Of the
splits within ``1e-6`` of the target, the one with the least shifted head wins (busiest / mean ``~1 + 1e-5``).

Short segments stay whole and only the ``2cp - 2`` interval bounds cut segments: a low bound cuts a short segment
(its second piece needs few keys); a high bound cuts a long one, where a late piece needs its segment's prefix, but
only as far as the cost needs. A long segment laid straight puts its cheap head next to the dense tail of the one
before it, and a rank that reaches it can find no split near the mean. Such a segment is *folded*: laid out from
the middle outwards, so that every two tokens of it cost ``L + 1`` together (a flat cost along ``S``); an interval
of a folded segment is its middle or a ring around it, at most two runs, and the ring ``[0, a) + [L - a, L)`` needs
``L - 2a`` keys (``zigzag``'s pair, over as few ranks as the cost needs)::

    positions  0 1 2 3 4 5 6 7      S order, folded: 3 4 2 5 1 6 0 7
    split at 4 tokens: the low side gets the middle [2, 6), the high side the ring [0, 2) + [6, 8)

The knob, ``TOLERANCE`` (a rank's distance from its target cost, as a fraction of ``C / cp``): nothing is folded at
first; whenever a rank ends farther than that from its target, the longest straight segment at the end of ``S``
where it got stuck is folded and the plan redone. A larger tolerance folds fewer segments (fewer remote keys, a
less even cost). The candidates are that plan from nothing folded and from every segment of at least
``FOLD_LADDER`` x ``T / cp`` tokens folded, and ``contiguous``; the plan is the one within the tolerance (busiest
over mean cost ``<= 1 + tolerance``) with the fewest remote keys at the busiest rank (then in total, then the lower
busiest cost); where none is within it, the one with the lowest busiest cost.

Runs: every run lies in one segment; a rank's runs are ordered by global position and touching pieces of one
segment are merged. Under a sliding ``window`` every cost is ``sum min(p + 1, window)`` (``layouts/work.py``); the
plan is the same construction. The plan is a function of the ``cu_seqlens`` values, ``cp``, the window and the
tolerance only (integer costs, stable sorts), cached like ``balanced``'s with ``functools.lru_cache``. It runs in
NumPy on the host, a pass over the ranks per candidate (and per fold), each pass linear in ``T`` (every rank prices
its ``T/cp + 1`` splits); a CUDA ``cu_seqlens`` is copied (one host sync per call).
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from cp_packing._checks import check_cp, check_number
from cp_packing.layouts.balanced import contiguous_plan_arrays, merge_runs, plan_key
from cp_packing.layouts.work import WindowWeights, range_cost

__all__ = ["local_plan", "local_plan_arrays", "local_runs", "TOLERANCE", "FOLD_LADDER", "MAX_FOLDS"]

#: The knob: how far (a fraction of the ideal ``C / cp``) a rank may end from its target cost before a segment is
#: folded to get it closer, and the busiest / mean a candidate may have (``1 + TOLERANCE``) to be chosen for fewer
#: remote keys. Smaller: more even, more remote keys; larger: fewer (docs/balance.md has the trade, measured).
TOLERANCE = 0.01
#: Candidate plans start with every segment of at least this many ``T / cp`` folded (``None``: none).
FOLD_LADDER = (None, 2.0, 1.0, 0.5)
#: At most this many segments folded on demand per candidate (each fold redoes one pass over the ranks).
MAX_FOLDS = 32
#: A rank's cost this close to its target (a fraction of ``C / cp``) is exact: the split then takes the least
#: shifted head. The splits ``a`` first tried with a free head: this many either side of the best one.
_EXACT, _WINDOW = 1e-6, 64

_CACHE_SIZE = 16

_FULL: WindowWeights = ((None, 1),)  # no window: the causal cost


class _Stream:
    """The segments in ``S`` order (by length, then position): global starts, lengths, their stretches of ``S`` and
    the cost of the whole segments before each."""

    def __init__(self, cu: np.ndarray, weights: WindowWeights):
        start, length = cu[:-1], np.diff(cu)
        keep = length > 0
        start, length = start[keep], length[keep]
        order = np.lexsort((start, length))
        self.start, self.length, self.weights = start[order], length[order], weights
        self.end = np.cumsum(self.length)
        self.beg = self.end - self.length
        self.total = int(self.end[-1])
        self.base = np.zeros(self.length.size + 1, dtype=np.int64)
        np.cumsum(range_cost(np.zeros_like(self.length), self.length, weights), out=self.base[1:])
        self.ideal = int(self.base[-1])


class _Split:
    """One pass over the ranks: every segment's state and the runs placed so far (see ``_solve``).

    What is left of a segment is a *frame* ``[c, c + w)`` of positions laid on the first ``w`` tokens of its stretch
    of ``S``: straight (S offset ``u`` is position ``c + u``) or folded (its first ``u`` tokens are
    ``[c + m(u), c + m(u) + u)``, ``m(u) = (w - u) // 2``). A cut from the high end of ``S`` takes the outside of the
    frame, a head of ``h`` tokens and the rest from its tail, and leaves the frame ``[c + h, c + h + v)``; a segment
    cut otherwise (from the low end, or where the low end may reach it) keeps its frame from then on (``frozen``)."""

    def __init__(self, stream: _Stream, fold: np.ndarray):
        self.s, self.fold = stream, fold
        self.c = np.zeros_like(stream.length)
        self.w = stream.length.copy()
        self.frozen = np.zeros(stream.length.size, dtype=bool)
        self.runs: list[tuple[np.ndarray, ...]] = []  # (segment, pos0, len, rank) of the runs placed

    def prefix(self, x: np.ndarray) -> np.ndarray:
        """int64, shape of ``x``: the cost of ``S`` before ``x`` in the current frames (``x`` in what is left)."""
        s = self.s
        k = np.minimum(np.searchsorted(s.end, x, side="right"), s.length.size - 1)
        u = x - s.beg[k]
        head = self.c[k] + np.where(self.fold[k], (self.w[k] - u) // 2, 0)
        return s.base[k] + range_cost(head, head + u, s.weights)

    def head_cost(self, k: np.ndarray, v: np.ndarray, h: np.ndarray) -> np.ndarray:
        """Cost of the frame ``[c + h, c + h + v)`` a high cut with head ``h`` leaves of segments ``k``."""
        return range_cost(self.c[k] + h, self.c[k] + h + v, self.s.weights)

    def place(self, a: int, b: int, rank: int) -> None:
        """Give ``rank`` the stretch ``[a, b)`` of ``S`` in the current frames; a segment it cuts is frozen."""
        if b <= a:
            return
        s = self.s
        k = np.arange(np.searchsorted(s.end, a, side="right"), np.searchsorted(s.end, b - 1, side="right") + 1)
        u0, u1 = np.maximum(a - s.beg[k], 0), np.minimum(b - s.beg[k], self.w[k])
        self.frozen[k] |= (u0 > 0) | (u1 < self.w[k])
        c, w, folded = self.c[k], self.w[k], self.fold[k]
        whole = (u0 == 0) & (u1 == w)  # the whole frame: one run
        m0, m1 = np.where(folded & ~whole, (w - u0) // 2, 0), np.where(folded & ~whole, (w - u1) // 2, 0)
        left0, left1 = np.where(folded & ~whole, c + m1, c + u0), np.where(folded & ~whole, c + m0, c + u1)
        right0 = c + m0 + u0
        right1 = np.where(folded & ~whole, c + m1 + u1, right0)  # a straight piece has no right run
        self._add(np.concatenate([k, k]), np.concatenate([left0, right0]),
                  np.concatenate([left1 - left0, right1 - right0]), rank)

    def cut(self, k: int, v: int, h: int, rank: int) -> None:
        """Give ``rank`` the outside of segment ``k``'s frame, keeping ``[c + h, c + h + v)`` as its new frame."""
        c, w = int(self.c[k]), int(self.w[k])
        self._add(np.array([k, k]), np.array([c, c + h + v]), np.array([h, w - h - v]), rank)
        self.c[k], self.w[k] = c + h, v

    def _add(self, seg: np.ndarray, pos0: np.ndarray, length: np.ndarray, rank: int) -> None:
        keep = length > 0
        self.runs.append((seg[keep], pos0[keep], length[keep], np.full(int(keep.sum()), rank, dtype=np.int64)))


def _solve(split: _Split, cp: int, t: int, tol: float):
    """Split ``S`` from the outside in: rank r takes ``a`` tokens from the low end of what is left and ``t - a``
    from the high end, ``a`` and the head ``h`` of the segment the high bound cuts chosen so the cost is nearest the
    mean of the ranks still to place (``_choose``). Returns ``(lo, hi)``: what was left of ``S`` when a rank first
    ended farther than ``tol * C / cp`` from its target (``None`` if none did); the runs are in ``split``."""
    total_cost = split.s.ideal
    lo, hi, used, stuck = 0, split.s.total, 0, None
    for r in range(cp - 1):
        target = (total_cost - used) // (cp - r)  # the mean of the ranks still to place
        a, k, v, h, cost = _choose(split, lo, hi, t, target, _EXACT * total_cost / cp)
        if stuck is None and abs(cost - target) > tol * total_cost / cp:
            stuck = (lo, hi)
        used += cost
        y = hi - (t - a)
        split.place(lo, lo + a, r)
        if k >= 0:
            split.place(int(split.s.end[k]), hi, r)
            split.cut(k, v, h, r)
        else:
            split.place(y, hi, r)
        lo, hi = lo + a, y
    split.place(lo, hi, cp - 1)
    return stuck


def _choose(split: _Split, lo: int, hi: int, t: int, target: int, exact: float):
    """Rank's split of what is left, ``[lo, hi)``: ``(a, k, v, h, cost)``. Every ``a`` is priced at once; the
    segment ``k`` the high bound cuts, where it may take a free head (not frozen, out of the low end's reach), is
    given the head ``h`` that brings the cost nearest the target, its new frame keeping ``v`` tokens. Of the splits
    within ``exact`` of the target the one with the least shifted head wins (then the ``a`` nearest the best one
    without heads), else the nearest; ``k = -1`` where no free head is used. Heads are tried for the ``a`` within
    ``_WINDOW`` of the best one, without a window 8 times further each time none is exact (a head for a token from
    the low end moves the cost by that token's cost: fine steps, but maybe far from the best ``a``)."""
    a = np.arange(t + 1, dtype=np.int64)
    ends = split.prefix(np.array([lo, hi], dtype=np.int64))
    cost = split.prefix(lo + a) - ends[0] + ends[1] - split.prefix(hi - t + a)  # [t + 1]
    a0 = int(np.argmin(np.abs(cost - target)))
    span = _WINDOW
    while True:
        a, k, v, h, h0, free, off = _with_heads(split, lo, hi, t, np.arange(max(a0 - span, 0), min(a0 + span, t) + 1),
                                                cost, target)
        close = np.flatnonzero(np.abs(off) <= exact)
        if close.size or span >= t or split.s.weights != _FULL:
            break
        span *= 8
    if close.size:  # the least shifted head, then the a nearest a0 (|a - a0| <= t: one key)
        best = close[np.argmin(np.abs(h - h0)[close] * (t + 2) + np.abs(a - a0)[close])]
    else:
        best = int(np.argmin(np.abs(off)))
    return int(a[best]), int(k[best]) if free[best] else -1, int(v[best]), int(h[best]), int(off[best]) + target


def _with_heads(split: _Split, lo: int, hi: int, t: int, a: np.ndarray, cost: np.ndarray, target: int):
    """The splits ``a`` with the best free heads (the largest whose cost is >= the target and the next one):
    ``(a, k, v, h, h0, free, off)``, two entries per ``a``, ``off`` the cost minus the target (``h0``: the head
    without freedom)."""
    s = split.s
    y = hi - t + a
    k = np.minimum(np.searchsorted(s.end, y, side="right"), s.length.size - 1)
    v, w = y - s.beg[k], split.w[k]
    free = (v > 0) & ~split.frozen[k] & (s.beg[k] >= lo + a)
    h0 = np.where(split.fold[k], (w - v) // 2, 0)
    wanted = cost[a] + split.head_cost(k, v, h0) - target  # the new frame's cost that would hit the target
    h_lo = _heads(split, k, v, np.where(free, w - v, 0), wanted)
    h = np.concatenate([np.where(free, h_lo, h0), np.where(free, np.minimum(h_lo + 1, w - v), h0)])
    a, k, v, free, h0, wanted = (np.concatenate([x, x]) for x in (a, k, v, free, h0, wanted))
    return a, k, v, h, h0, free, wanted - split.head_cost(k, v, h)


def _heads(split: _Split, k: np.ndarray, v: np.ndarray, h_max: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """The largest head ``h`` in ``[0, h_max]`` whose new frame ``[c + h, c + h + v)`` of segments ``k`` costs at
    most ``wanted`` (0 if none does): a frame costs more the further right it is. Without a window in closed form,
    ``v (c + h) + v (v + 1) / 2``; else by bisection."""
    c = split.c[k]
    if split.s.weights == _FULL:
        h = np.floor_divide(wanted - v * (v + 1) // 2, np.maximum(v, 1)) - c
        return np.clip(h, 0, h_max)
    h_lo, h_hi = np.zeros_like(h_max), h_max.copy()
    while np.any(h_lo < h_hi):
        mid = (h_lo + h_hi + 1) // 2
        ok = split.head_cost(k, v, mid) <= wanted
        h_lo, h_hi = np.where(ok, mid, h_lo), np.where(ok, h_hi, mid - 1)
    return h_lo


def _culprit(stream: _Stream, fold: np.ndarray, lo: int, hi: int, t: int) -> int:
    """The segment to fold where the split got stuck: the longest straight one (>= 3 tokens: folding a shorter one
    changes nothing) overlapping the last ``t`` tokens left of ``S``, else the first ``t``; -1 if there is none.
    ``S`` is sorted by length, so the longest is the last eligible one."""
    for a, b in ((hi - t, hi), (lo, lo + t)):
        first, last = np.searchsorted(stream.end, [a, b - 1], side="right")
        k = np.arange(first, min(last + 1, fold.size))
        k = k[~fold[k] & (stream.length[k] >= 3)]
        if k.size:
            return int(k[-1])
    return -1


def _split(stream: _Stream, fold: np.ndarray, cp: int, t: int, tol: float):
    """Solve the split with ``fold`` folded, folding one more segment where a rank got stuck (``_culprit``) until no
    rank is, there is nothing left to fold there, or ``MAX_FOLDS`` are folded. Returns the runs
    ``(start, len, rank, pos0, segment)`` (segment: its index in ``S``)."""
    fold = fold.copy()
    for folds in range(MAX_FOLDS + 1):
        split = _Split(stream, fold)
        stuck = _solve(split, cp, t, tol)
        k = -1 if stuck is None or folds == MAX_FOLDS else _culprit(stream, fold, *stuck, t)
        if k < 0:
            break
        fold[k] = True
    seg, pos0, length, rank = (np.concatenate(x) for x in zip(*split.runs))
    return stream.start[seg] + pos0, length, rank, pos0, seg


def _figures(rank, seg, pos0, length, cp: int, t: int, weights: WindowWeights) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's cost and remote keys (``[cp]`` int64 each) from its runs: the keys of a segment up to the
    furthest token the rank holds there, summed over its segments, minus its ``t`` tokens."""
    cost = np.zeros(cp, dtype=np.int64)
    np.add.at(cost, rank, range_cost(pos0, pos0 + length, weights))
    key = rank * (int(seg.max()) + 1) + seg
    order = np.argsort(key, kind="stable")
    key, reach = key[order], (pos0 + length)[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    need = np.zeros(cp, dtype=np.int64)
    np.add.at(need, key[first] // (int(seg.max()) + 1), np.maximum.reduceat(reach, first))
    return cost, need - t


def _plan(cu: np.ndarray, cp: int, weights: WindowWeights, tol: float):
    """Every rank's runs ``(offsets [cp + 1], run_start [R], run_len [R])``: the best candidate (module docstring)."""
    t = int(cu[-1]) // cp
    stream = _Stream(cu, weights)
    candidates, seen = [], set()
    for ladder in FOLD_LADDER:
        fold = np.zeros(stream.length.size, dtype=bool) if ladder is None else stream.length >= ladder * t
        if fold.tobytes() in seen:
            continue
        seen.add(fold.tobytes())
        start, length, rank, pos0, seg = _split(stream, fold, cp, t, tol)
        candidates.append(((start, length, rank, pos0), _figures(rank, seg, pos0, length, cp, t, weights)))
    offsets, start, length = contiguous_plan_arrays(cu, cp)
    rank = np.repeat(np.arange(cp, dtype=np.int64), np.diff(offsets))
    seg = np.searchsorted(cu, start, side="right") - 1
    pos0 = start - cu[seg]
    candidates.append(((start, length, rank, pos0), _figures(rank, seg, pos0, length, cp, t, weights)))
    limit = (1.0 + tol) * stream.ideal / cp

    def score(candidate):
        cost, need = candidate[1]
        busiest, within = int(cost.max()), cost.max() <= limit
        return (0, int(need.max()), int(need.sum()), busiest) if within else (1, busiest, int(need.max()), 0)

    best = min(range(len(candidates)), key=lambda i: (score(candidates[i]), i))
    (start, length, rank, pos0), _ = candidates[best]
    return merge_runs(start, length, rank, pos0, cp)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cached_plan(cu_bytes: bytes, cp: int, weights: WindowWeights, tol: float):
    """The plan of ``_plan``, read-only (every caller shares it and gets copies); no runs for an empty stream."""
    cu = np.frombuffer(cu_bytes, dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)
    plan = _plan(cu, cp, weights, tol) if cu[-1] > 0 else (np.zeros(cp + 1, dtype=np.int64), none, none)
    for a in plan:
        a.flags.writeable = False
    return plan


def local_plan(
    cu_seqlens: torch.Tensor, *, cp_size: int, window: int | Sequence[int | None] | None = None,
    tolerance: float = TOLERANCE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's runs of the ``local`` layout (see the module docstring), planned once per
    ``(cu_seqlens values, cp_size, window, tolerance)``.

    Args:
        cu_seqlens: int ``[N + 1]`` global cumulative segment lengths (CPU or CUDA); ``T = cu_seqlens[-1]`` must be
            divisible by ``cp_size``.
        cp_size: the context-parallel group size.
        window: the attention's sliding window: ``None`` (full causal), an int, or a per-layer list of
            ``int | None`` (the cost summed over the layers), as for ``balanced_plan``.
        tolerance: the knob, ``>= 0``: how far from even (a fraction of the ideal cost per rank) the plan may be to
            need fewer remote keys (``TOLERANCE`` by default, the one ``layout="local"`` uses).

    Returns:
        ``(offsets, run_start, run_len)``, CPU int64 tensors ``[cp_size + 1]``, ``[R]``, ``[R]`` (fresh copies).
        Rank r's runs are ``run_start[offsets[r]:offsets[r + 1]]``, ordered by global position.

    Raises:
        TypeError / ValueError: a bad ``cu_seqlens``, ``cp_size``, ``window`` or ``tolerance``, or ``T`` not
        divisible by ``cp_size``.

    >>> offsets, run_start, run_len = local_plan(torch.tensor([0, 16, 18, 20, 22, 24]), cp_size=2)
    >>> offsets.tolist(), run_start.tolist(), run_len.tolist()  # rank 0: the ring [0, 4) + [12, 16) of the long one
    ([0, 4, 7], [0, 12, 16, 18, 4, 20, 22], [4, 4, 2, 2, 8, 2, 2])
    """
    cu, weights = plan_key(cu_seqlens, cp_size, window)
    tol = check_number(tolerance, "tolerance", min=0.0)
    return tuple(torch.from_numpy(a.copy()) for a in _cached_plan(cu.tobytes(), cp_size, weights, tol))


def local_plan_arrays(cu: np.ndarray, cp_size: int, weights: WindowWeights) -> tuple[np.ndarray, ...]:
    """``(offsets, run_start, run_len)`` (read-only NumPy, cached) of a validated ``cu`` and
    ``balanced.planned_weights``, at the default :data:`TOLERANCE`: ``layouts.PLANS["local"]``."""
    return _cached_plan(np.ascontiguousarray(cu, dtype=np.int64).tobytes(), cp_size, weights, TOLERANCE)


def local_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, window: int | Sequence[int | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``cp_rank``'s runs under ``local``, the ``RUNS`` contract of ``cp_packing.layouts``: its slice of
    ``local_plan`` at ``TOLERANCE``, int64 ``(run_start, run_len)`` on ``cu_seqlens.device``, ordered by global
    position, ``T // cp_size`` tokens (``window``: as in ``local_plan``; every rank must pass the same).

    >>> local_runs(torch.tensor([0, 16, 18, 20, 22, 24]), cp_size=2, cp_rank=1)  # the long one's middle, two short
    (tensor([ 4, 20, 22]), tensor([8, 2, 2]))
    """
    check_cp(cp_size, cp_rank)
    cu, weights = plan_key(cu_seqlens, cp_size, window)
    offsets, run_start, run_len = _cached_plan(cu.tobytes(), cp_size, weights, TOLERANCE)
    mine = slice(int(offsets[cp_rank]), int(offsets[cp_rank + 1]))
    return tuple(torch.from_numpy(a[mine].copy()).to(cu_seqlens.device) for a in (run_start, run_len))


local_plan.cache_info = _cached_plan.cache_info  # type: ignore[attr-defined]  # functools' own hit/miss counts
local_plan.cache_clear = _cached_plan.cache_clear  # type: ignore[attr-defined]
