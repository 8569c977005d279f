"""The ``local`` layout: exactly ``T / cp`` tokens per rank, an even causal cost, and few keys from other ranks.

An exchange backend moves to each rank the keys its queries need that other ranks hold: for every run, the keys of
its segment from the segment's start up to the run's last token, minus the rank's own tokens. ``balanced`` cuts
nearly every long document over all ranks (each rank then needs nearly all of it); ``contiguous`` keeps documents
together but is uneven. ``local`` lays the segments end to end as one stream ``S``, shortest first, and gives rank
``r`` the ``r``-th interval from each end of ``S`` (rank ``cp - 1`` the middle one)::

    S   [ a b c d e f  g g  h h h  i i i i  j j j j j j  k k k k k k k k k k ]   segments by length, short first
          |-- 0 --|-- 1 --|--- 2 ---|---- 3 ----|--- 2 ---|--- 1 ---|-- 0 --|   the rank of each interval, cp = 4
          cheap tokens (short segments)                   dense tokens (long segments, late positions)

The outer set of boundary ``r`` (what ranks ``< r`` hold) is ``S[0, a)`` and ``S[a + T - r t, T)``
(``t = T / cp``): every boundary is solved on its own, all ``cp - 1`` at once, for a cost of ``r C / cp``, and rank
``r`` holds what lies between boundaries ``r`` and ``r + 1``. The cost of a split ``a`` is a closed form (the cost
of ``S`` up to any point, from the segments' prefix sums); it is piecewise linear in ``a`` between the points where
a bound crosses a segment start, so a bisection gives a bracket and the pieces in it give the split nearest the
target (``_nearest``). A second freedom makes it exact: the segment the high bound cuts gives the outside its tail
and a head of ``h`` tokens from its start (by default none of a straight segment, half for a folded one, see below),
and ``h`` is free; the splits within ``_WINDOW`` of the nearest one are priced with their best heads, and of those
within ``1e-6`` of the target the one with the least shifted head wins (wider windows, filtered by what a head can
make exact, where none is). Heads of one segment must nest (the inside a boundary leaves is the frame the next one
cuts in), so the boundaries cutting one segment go in rounds, all segments at once; a boundary that does not nest
with the one before (the cost along ``S`` is not monotone near the middle) is solved again within its bounds. What
inexact boundaries still miss is spread over the ranks between them (their targets moved, solved again).

Short segments stay whole and only the ``2cp - 2`` interval bounds cut segments: a low bound cuts a short segment
(its second piece needs few keys); a high bound cuts a long one, where a late piece needs its segment's prefix, but
only as far as the cost needs. A long segment laid straight puts its cheap head next to the dense tail of the one
before it, where no split may come near the target. Such a segment is *folded*: laid out from the middle outwards,
so that every two tokens of it cost ``L + 1`` together (a flat cost along ``S``); an interval of a folded segment is
its middle or a ring around it, at most two runs, and the ring ``[0, a) + [L - a, L)`` needs ``L - 2a`` keys
(``zigzag``'s pair, over as few ranks as the cost needs)::

    positions  0 1 2 3 4 5 6 7      S order, folded: 3 4 2 5 1 6 0 7
    split at 4 tokens: the low side gets the middle [2, 6), the high side the ring [0, 2) + [6, 8)

The knob, ``TOLERANCE`` (a fraction of the ideal ``C / cp``): nothing is folded at first; where a rank ends
farther than ``TOLERANCE / 20`` from its share, the longest straight segment near the boundary that missed is folded
and the boundaries solved again (``FOLD_ROUNDS`` rounds at most). The candidates are that plan from nothing folded
and from every segment of at least ``FOLD_LADDER`` x ``T / cp`` tokens folded, and ``contiguous``; the plan is the
one within the tolerance (busiest over mean cost ``<= 1 + tolerance``) with the fewest remote keys at the busiest
rank (then in total, then the lower busiest cost); where none is within it, the one with the lowest busiest cost.
A larger tolerance lets an uneven candidate win for fewer remote keys.

Runs: every run lies in one segment; a rank's runs are ordered by global position and touching pieces of one
segment are merged. Under a sliding ``window`` every cost is ``sum min(p + 1, window)`` (``layouts/work.py``); the
plan is the same construction (heads by bisection). The plan is a function of the ``cu_seqlens`` values, ``cp``, the
window and the tolerance only (integer costs, stable sorts), cached like ``balanced``'s in the one plan cache of
``cp_packing.layouts``. It runs in NumPy on the host: per candidate, a few passes over the segments and vectorised
work per boundary (no loop over the ranks of ``T / cp`` pricing each: time near-linear in the segments, about flat
in ``cp``; a Python loop over boundaries only where they do not nest, and one round per boundary cutting the same
segment, each a lean search of a few vectorised passes where the head is free, ``_chain_step``); memory a few
arrays of the segments' size, the wide windows priced in blocks of rows and columns so that the peak stays within
the doc map's bytes. A CUDA ``cu_seqlens`` is copied (one host sync per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import torch

from cp_packing._checks import check_number
from cp_packing.layouts.balanced import contiguous_plan_arrays, merge_runs
from cp_packing.layouts.work import WindowWeights, head_cost, range_cost

__all__ = ["Local", "local_plan", "local_plan_arrays", "local_runs", "TOLERANCE", "FOLD_LADDER", "FOLD_ROUNDS"]

#: The knob: the busiest / mean a candidate may have (``1 + TOLERANCE``) to be chosen for fewer remote keys, and
#: (over ``_STUCK``) how far a rank may end from its share before a segment is folded to get it closer. Smaller: more
#: even, more remote keys; larger: fewer (docs/balance.md has the trade, measured).
TOLERANCE = 0.01
#: Candidate plans start with every segment of at least this many ``T / cp`` folded (``None``: none).
FOLD_LADDER = (None, 2.0, 1.0, 0.5)
#: Rounds of on-demand folds per candidate: the culprits of every rank still off its share are folded at once.
FOLD_ROUNDS = 3
#: A boundary's cost this close to its target (a fraction of ``C / cp``) is exact: the split then takes the least
#: shifted head. The splits ``a`` tried with their best heads: ``_WINDOW`` either side of the nearest one, then
#: 8x wider up to ``_WIDEST`` times that where none is exact. A rank off its share by more than ``TOLERANCE /
#: _STUCK`` folds a segment; inexact boundaries off by more than ``_SPREAD`` have their misses spread.
_EXACT, _WINDOW, _WIDEST, _STUCK, _SPREAD = 1e-6, 64, 64, 20, 1e-5
#: Elements per array of ``_pick``'s pricing (rows x splits), at most ``T / 64`` (a few tens of such arrays live at
#: once): the planner's memory stays within the map's size but where one row's window is larger.
_BLOCK = 1 << 15
#: The k-ary search of ``_chain_step``: points per pass (a pass narrows the bracket ``_GRID`` times).
_GRID = 128


_FULL: WindowWeights = ((None, 1),)  # no window: the causal cost


class _Stream:
    """The segments in ``S`` order (by length, then position): global starts, lengths, their stretches of ``S``,
    their costs and the cost of the whole segments before each."""

    def __init__(self, cu: np.ndarray, weights: WindowWeights):
        start, length = cu[:-1], np.diff(cu)
        keep = length > 0
        start, length = start[keep], length[keep]
        order = np.lexsort((start, length))
        self.start, self.length, self.weights = start[order], length[order], weights
        self.end = np.cumsum(self.length)
        self.beg = self.end - self.length
        self.total = int(self.end[-1])
        self.cost = head_cost(self.length, weights)
        self.base = np.zeros(self.length.size + 1, dtype=np.int64)
        np.cumsum(self.cost, out=self.base[1:])
        self.ideal = int(self.base[-1])

    def seg(self, x: np.ndarray) -> np.ndarray:
        """The segment holding S offset ``x`` (the last one for ``x = T``)."""
        return np.minimum(np.searchsorted(self.end, x, side="right"), self.length.size - 1)

    def prefix(self, x: np.ndarray, fold: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
        """int64, shape of ``x``: the cost of ``S[0, x)``, a folded segment's first ``u`` tokens its middle (``k``:
        ``seg(x)`` where the caller has it)."""
        k = self.seg(x) if k is None else k
        u = x - self.beg[k]
        m = np.where(fold[k], (self.length[k] - u) // 2, 0)
        return self.base[k] + range_cost(m, m + u, self.weights)


def _bisect(s: _Stream, fold: np.ndarray, r: np.ndarray, t: int, target: np.ndarray, lo: np.ndarray,
            hi: np.ndarray) -> np.ndarray:
    """For every boundary ``r``, the largest ``a`` in ``[lo, hi]`` whose outer set ``S[0, a) + S[a + T - r t, T)``
    costs at least ``target`` (``lo`` if none): the cost falls, mostly, as ``a`` grows (a cheap low token for a
    dense high one), so a bisection over ``a``, all boundaries at once, finds where it crosses the target."""
    shift = s.total - r * t
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi + 1) // 2
        ok = s.prefix(mid, fold) + s.ideal - s.prefix(mid + shift, fold) >= target
        lo, hi = np.where(ok & open_, mid, lo), np.where(ok | ~open_, hi, mid - 1)


def _split_cost(s: _Stream, fold: np.ndarray, shift: np.ndarray, a: np.ndarray, frame) -> np.ndarray:
    """Cost of the outer sets ``S[0, a) + S[a + shift, T)``, the segment the high bound cuts laid out by its
    layout's head kept in ``frame`` (``(k, c, w)`` per element, the frame the boundary before left; ``k = -1``:
    none)."""
    y = a + shift
    k = s.seg(y)
    cost = s.prefix(a, fold) + s.ideal - s.prefix(y, fold, k)
    fk, fc, fw = frame
    u = y - s.beg[k]
    on = (k == fk) & (a <= s.beg[k]) & (u <= fw)
    if on.any():
        k, u, fc, fw = k[on], u[on], fc[on], fw[on]
        h_pre = _first(s, fold, k, 0, s.length[k], u)
        h = np.clip(h_pre, fc, fc + fw - u)
        cost[on] += range_cost(h_pre, h_pre + u, s.weights) - range_cost(h, h + u, s.weights)
    return cost


def _nearest(s: _Stream, fold: np.ndarray, r: np.ndarray, t: int, target: np.ndarray, lo: np.ndarray,
             hi: np.ndarray, frame) -> np.ndarray:
    """For every boundary ``r``, the ``a`` in ``[lo, hi]`` whose outer set ``S[0, a) + S[a + T - r t, T)`` costs
    nearest ``target`` (the smallest on a tie). The cost is piecewise linear in ``a`` between the points where the
    low or the high bound crosses a segment start (about linear in a folded or windowed one), so it is evaluated at
    those points and every piece that crosses the target is bisected to the token: linear in the segments in the
    range."""
    shift = s.total - r * t
    parts = [(np.arange(r.size), lo), (np.arange(r.size), hi)]
    for off in (np.zeros_like(shift), shift):  # segment starts crossed by the low, then the high bound
        first = np.searchsorted(s.beg, lo + off, side="right")
        count = np.maximum(np.searchsorted(s.beg, hi + off, side="left") - first, 0)
        row = np.repeat(np.arange(r.size), count)
        idx = np.arange(row.size) - np.repeat(np.cumsum(count) - count, count) + first[row]
        parts.append((row, s.beg[idx] - off[row]))
    row = np.concatenate([p[0] for p in parts])
    a = np.concatenate([p[1] for p in parts])
    o = np.lexsort((a, row))
    row, a = row[o], a[o]
    g = _split_cost(s, fold, shift[row], a, tuple(x[row] for x in frame)) - target[row]
    cross = (row[1:] == row[:-1]) & ((g[1:] < 0) != (g[:-1] < 0))
    i = np.flatnonzero(cross)
    e_row = row[i]
    p_lo, p_hi = _crossing(a[i], a[i + 1], g[i].astype(np.float64), g[i + 1].astype(np.float64),
                           lambda x, j: _split_cost(s, fold, shift[e_row[j]], x, tuple(f[e_row[j]] for f in frame))
                           - target[e_row[j]])
    extra = np.stack([p_lo, p_hi], axis=1).ravel()
    e_row = np.repeat(e_row, 2)
    row, a = np.concatenate([row, e_row]), np.concatenate([a, extra])
    g = np.concatenate([g, _split_cost(s, fold, shift[e_row], extra, tuple(x[e_row] for x in frame))
                        - target[e_row]])
    o = np.lexsort((a, np.abs(g), row))
    firsts = np.flatnonzero(np.r_[True, row[o][1:] != row[o][:-1]])
    return a[o][firsts]


def _crossing(p_lo: np.ndarray, p_hi: np.ndarray, g_lo: np.ndarray, g_hi: np.ndarray, g) -> tuple:
    """Brackets ``p_lo < p_hi`` whose values ``g_lo``, ``g_hi`` have opposite signs (``< 0`` or not), narrowed to
    one token each: ``g(x, j)`` is the value at ``x`` of bracket ``j``. The cost is piecewise linear in the split
    (exactly linear between kinks where both bounds lie in straight segments), so every try is the interpolated
    crossing and the token after it (one try closes a linear piece); every other try halves the bracket instead,
    so that a curved or jagged piece (a fold's floors, a window's kink) still takes at most twice a bisection."""
    p_lo, p_hi, g_lo, g_hi = p_lo.copy(), p_hi.copy(), g_lo.copy(), g_hi.copy()
    neg = g_lo < 0
    for step in range(128):
        j = np.flatnonzero(p_hi - p_lo > 1)
        if not j.size:
            break
        lo, hi, gl, gh = p_lo[j], p_hi[j], g_lo[j], g_hi[j]
        if step % 2:
            m = (lo + hi) // 2
        else:
            m = lo + np.floor((hi - lo) * (gl / (gl - gh))).astype(np.int64)
        m = np.clip(m, lo + 1, hi - 2).clip(lo, hi - 1)  # m, m + 1 inside the bracket; m = lo for a 2-token one
        vals = g(np.concatenate([m, m + 1]), np.concatenate([j, j])).astype(np.float64)
        g1, g2 = vals[:j.size], vals[j.size:]
        s1, s2, sn = g1 < 0, g2 < 0, neg[j]
        left = s1 != sn  # the crossing is in [lo, m]
        mid = ~left & (s2 != sn)  # in [m, m + 1]
        new_lo = np.where(left, lo, np.where(mid, m, m + 1))
        new_hi = np.where(left, m, np.where(mid, m + 1, hi))
        g_lo[j] = np.where(left, gl, np.where(mid, g1, g2))
        g_hi[j] = np.where(left, g1, np.where(mid, g2, gh))
        p_lo[j], p_hi[j] = new_lo, new_hi
    return p_lo, p_hi


def _inner_cost(s: _Stream, k: np.ndarray, u: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Cost of positions ``[h, h + u)`` of segments ``k``: what a high cut with head ``h`` leaves inside."""
    return range_cost(h, h + u, s.weights)


def _heads(s: _Stream, k: np.ndarray, u: np.ndarray, c: np.ndarray, h_max: np.ndarray,
           wanted: np.ndarray) -> np.ndarray:
    """The largest ``h`` in ``[0, h_max]`` whose inside ``[c + h, c + h + u)`` costs at most ``wanted`` (0 if none
    does): it costs more the further right it is. Without a window in closed form, ``u (c + h) + u (u + 1) / 2``;
    else by bisection."""
    if s.weights == _FULL:
        h = np.floor_divide(wanted - u * (u + 1) // 2, np.maximum(u, 1)) - c
        return np.clip(h, 0, h_max)
    h_lo, h_hi = np.zeros_like(h_max), h_max.copy()
    while np.any(h_lo < h_hi):
        mid = (h_lo + h_hi + 1) // 2
        ok = _inner_cost(s, k, u, c + mid) <= wanted
        h_lo, h_hi = np.where(ok, mid, h_lo), np.where(ok, h_hi, mid - 1)
    return h_lo


def _first(s: _Stream, fold: np.ndarray, k: np.ndarray, c: np.ndarray, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Where the first ``x`` S tokens of segment ``k``'s frame ``[c, c + w)`` start: ``c`` straight, ``c + (w - x) // 2``
    folded (the frame's middle)."""
    return c + np.where(fold[k], (w - x) // 2, 0)


def _with_heads(s: _Stream, fold: np.ndarray, r: np.ndarray, t: int, a: np.ndarray, target: np.ndarray, prev):
    """Every boundary's splits ``a`` (``[B, m]``) with their best heads: ``(a, k, u, h, c, w, pref, off)``,
    ``[B, 2m]``. ``k`` is the segment the high bound cuts, ``u`` its S tokens left inside, ``[c, c + w)`` its frame
    (what the previous boundary cutting it left inside, ``prev``: that boundary's ``(a, k, u, h, c, w)`` per row,
    ``k = -1`` for none; else the whole segment). A cut the low bound does not reach is *free*: the outside takes
    ``[0, h) + [h + u, L)``, ``h`` anywhere in ``[c, c + w - u]``: the largest whose cost is >= the target and the
    next one (the new frame is ``[h, h + u)``). Where the low bound reaches the segment too, the frame is kept and
    the inside is S offsets ``[v, u)`` of it. ``pref`` is the layout's head kept in the frame, ``off`` the cost
    minus the target (``inf`` where the split would not nest with ``prev``)."""
    y = a + (s.total - r * t)[:, None]
    k = s.seg(y)
    u, length, beg = y - s.beg[k], s.length[k], s.beg[k]
    pa, pk, pu, ph, pc, pw = (x[:, None] for x in prev)
    framed = (k == pk) & (pu < s.length[np.maximum(pk, 0)])
    c, w = np.where(framed, pc, 0), np.where(framed, pw, length)
    bad = (pk >= 0) & ((a < pa) | (a > pa + t) | (k > pk) | (framed & (u > w)))
    low = a > beg  # the low bound reaches the segment: its frame is kept
    free = (u > 0) & (u < length) & ~low & ~bad
    h_pre = _first(s, fold, k, 0, length, u)  # the layout's head (what the prefix costs assume)
    pref = np.where(free, np.clip(h_pre, c, c + np.maximum(w - u, 0)), h_pre)
    cost = s.prefix(a, fold) + s.ideal - s.prefix(y, fold, k)
    # the frame kept: inside = S offsets [v, u) of it, where the prefix costs counted those of the whole segment
    v = np.where(low, a - beg, 0)
    uu = np.minimum(u, w)
    f_u, f_v = _first(s, fold, k, c, w, uu), _first(s, fold, k, c, w, v)
    d_v = _first(s, fold, k, 0, length, v)
    kept = (range_cost(d_v, d_v + v, s.weights) - range_cost(h_pre, h_pre + u, s.weights)
            - range_cost(f_v, f_v + v, s.weights) + range_cost(f_u, f_u + uu, s.weights))
    cost = np.where(low, cost - kept, cost)
    wanted = _inner_cost(s, k, u, h_pre) + cost - target[:, None]  # the inside that would hit the target
    h_lo = c + _heads(s, k, u, c, np.where(free, w - u, 0), wanted)
    h = np.concatenate([np.where(free, h_lo, pref), np.where(free, np.minimum(h_lo + 1, c + w - u), pref)], axis=1)
    a, k, u, c, w, pref, wanted, bad, free, cost = (np.concatenate([x, x], axis=1)
                                                    for x in (a, k, u, c, w, pref, wanted, bad, free, cost))
    off = np.where(free, wanted - _inner_cost(s, k, u, h), cost - target[:, None]).astype(np.float64)
    off[bad] = np.inf
    return a, k, u, h, np.where(free, h, c), np.where(free, u, w), pref, off


def _near_exact(s: _Stream, fold: np.ndarray, cp: int, t: int, r, target, lo, hi, a0, span: int) -> np.ndarray:
    """``[B, 2 _WINDOW]``: of every boundary's splits within ``span`` of ``a0`` (in ``[lo, hi]``), the ``2 _WINDOW``
    nearest ``a0`` that a head can make exact (without a window: a head moves the cost in steps of ``u``), ``a0``
    where there are fewer. Priced in blocks of columns of at most ``min(_BLOCK, T / 64)`` elements, the nearest kept
    as it goes (ties: the lower offset first), so that all rows go at once in memory within the map's size."""
    keep, limit = 2 * _WINDOW, 2 * s.total
    shift = (s.total - r * t)[:, None]
    rest0 = (s.ideal - target)[:, None]
    best_far = np.zeros((r.size, 0), dtype=np.int64)
    best_a = best_far
    step = max(keep, _block(s) // max(r.size, 1))
    for j in range(-span, span + 1, step):
        a = np.clip(a0[:, None] + np.arange(j, min(j + step, span + 1)), lo[:, None], hi[:, None])
        y = a + shift
        k = s.seg(y)
        u = np.maximum(y - s.beg[k], 1)
        rest = (s.prefix(a, fold) - s.prefix(y, fold, k) + rest0) % u
        near = np.minimum(rest, u - rest) <= _EXACT * s.ideal / cp
        far = np.concatenate([best_far, np.where(near, np.abs(a - a0[:, None]), limit)], axis=1)
        a = np.concatenate([best_a, a], axis=1)
        if far.shape[1] > keep:
            order = np.argsort(far, axis=1, kind="stable")[:, :keep]
            far, a = np.take_along_axis(far, order, axis=1), np.take_along_axis(a, order, axis=1)
        best_far, best_a = far, a
    return np.where(best_far < limit, best_a, a0[:, None])


def _pick(s: _Stream, fold: np.ndarray, cp: int, t: int, r, target, prev, lo, hi, a0, span: int):
    """The split of every boundary ``r`` within ``span`` of ``a0`` (in ``[lo, hi]``) with the best head
    (``_with_heads``): of those within ``_EXACT`` of the target ``r C / cp`` the least shifted head, then the ``a``
    nearest ``a0``; else the nearest to the target. Past ``_WINDOW`` (no window) only the splits ``_near_exact``
    keeps are priced. Returns ``(a, k, u, h, c, w, off)`` and whether it is exact."""
    if _wide(s, span):
        a = _near_exact(s, fold, cp, t, r, target, lo, hi, a0, span)
    else:
        a = np.clip(a0[:, None] + np.arange(-span, span + 1), lo[:, None], hi[:, None])
    a, k, u, h, c, w, pref, off = _with_heads(s, fold, r, t, a, target, prev)
    close = np.abs(off) <= _EXACT * s.ideal / cp
    key = np.where(close, np.abs(h - pref) * (2 * s.total + 2) + np.abs(a - a0[:, None]), np.iinfo(np.int64).max)
    exact = close.any(axis=1)
    best = np.where(exact, np.argmin(key, axis=1), np.argmin(np.abs(off), axis=1))
    pick = (np.arange(r.size), best)
    return [x[pick] for x in (a, k, u, h, c, w, off)], exact


def _wide(s: _Stream, span: int) -> bool:
    """Whether ``_pick`` prices only the splits ``_near_exact`` keeps (past ``_WINDOW``, no window)."""
    return span > _WINDOW and s.weights == _FULL


def _block(s: _Stream) -> int:
    """Elements per array of ``_pick``'s pricing: ``min(_BLOCK, T / 64)``, at least 1024 (maps under 64K tokens:
    a few hundred KB whatever their size, not a call per row)."""
    return max(1024, min(_BLOCK, s.total >> 6))


def _in_row_blocks(block: int, solve, r: np.ndarray, target: np.ndarray, prev, *rest):
    """``solve(r, target, prev, *rest) -> ((a, k, u, h, c, w, off), flags)`` on at most ``block`` boundaries at a
    time (rows of ``r``, ``target``, ``prev`` and ``rest``), the results joined: the same per boundary, in memory
    bounded by the block."""
    if r.size <= block:
        return solve(r, target, prev, *rest)
    parts = [solve(r[i:i + block], target[i:i + block], tuple(x[i:i + block] for x in prev),
                   *(x[i:i + block] for x in rest)) for i in range(0, r.size, block)]
    return [np.concatenate([p[0][j] for p in parts]) for j in range(7)], np.concatenate([p[1] for p in parts])


def _pick_rows(s: _Stream, fold: np.ndarray, cp: int, t: int, r, target, prev, lo, hi, a0, span: int):
    """``_pick`` in blocks of rows, so that the splits it prices with their two heads each (``[rows, 4 _WINDOW]``
    wide, ``[rows, 4 span + 2]`` else) hold at most ``min(_BLOCK, T / 64)`` elements per array (one row at least):
    the same picks, in memory within the map's size."""
    block = max(1, _block(s) // (4 * _WINDOW if _wide(s, span) else 4 * span + 2))  # x 2: a head and the next
    return _in_row_blocks(block, lambda *x: _pick(s, fold, cp, t, *x, span), r, target, prev, lo, hi, a0)


def _solve(s: _Stream, fold: np.ndarray, cp: int, t: int, r: np.ndarray, target: np.ndarray, prev, lo: np.ndarray,
           hi: np.ndarray, a0: np.ndarray):
    """Boundaries ``r`` (``target`` their costs; ``prev``: the boundaries before them, for ``_with_heads``; ``a0``:
    the nearest split): the best split near ``a0`` (``_pick``), in windows 8x wider up to ``_WIDEST`` x ``_WINDOW``
    where none is exact. Returns ``(a, k, u, h, c, w, off)`` per boundary."""
    has = prev[1] >= 0  # nest with the boundary before: a grows by 0 .. t
    lo, hi = np.where(has, np.maximum(lo, prev[0]), lo), np.where(has, np.minimum(hi, prev[0] + t), hi)
    a0 = np.clip(a0, lo, hi)
    out, exact = _pick_rows(s, fold, cp, t, r, target, prev, lo, hi, a0, _WINDOW)
    rows, span = np.flatnonzero(~exact), 8 * _WINDOW
    sub = tuple(x[rows] for x in prev)
    while rows.size and s.weights == _FULL and span <= _WIDEST * _WINDOW:
        again, exact = _pick_rows(s, fold, cp, t, r[rows], target[rows], sub, lo[rows], hi[rows], a0[rows], span)
        better = exact | (np.abs(again[-1]) < np.abs(out[-1][rows]))  # the wide window keeps exact-able splits
        for o, x in zip(out, again):
            o[rows[better]] = x[better]
        rows, sub, span = rows[~exact], tuple(x[~exact] for x in sub), span * 8
    return out


def _framed(s: _Stream, fold: np.ndarray, shift: np.ndarray, target: np.ndarray, k: np.ndarray, c: np.ndarray,
            w: np.ndarray, a: np.ndarray):
    """Splits ``a`` (``[B, n]``) whose high bound cuts segment ``k`` inside its frame ``[c, c + w)`` and whose low
    bound stays short of it (``_with_heads``' free cut, per row ``k, c, w``): ``(u, pref, wanted)``: the S tokens
    left inside, the layout's head kept in the frame, and the inside's cost that would hit the target."""
    y = a + shift[:, None]
    kk = np.broadcast_to(k[:, None], y.shape)
    u = y - s.beg[kk]
    h_pre = _first(s, fold, kk, 0, s.length[kk], u)  # the layout's head (what the prefix costs assume)
    pref = np.clip(h_pre, c[:, None], c[:, None] + w[:, None] - u)
    cost = s.prefix(a, fold) + s.ideal - s.prefix(y, fold, kk)
    return u, pref, _inner_cost(s, kk, u, h_pre) + cost - target[:, None]


def _chain_step(s: _Stream, fold: np.ndarray, cp: int, t: int, r: np.ndarray, target: np.ndarray, prev):
    """Boundaries ``r`` whose high bound cuts the segment the boundary before cut (``prev``, its ``(a, k, u, h, c,
    w)``), without a window: their splits as ``_solve`` would choose them, in a few vectorised passes instead of its
    general search (these rounds are the sequential part of a plan: one per boundary cutting one long segment). The
    split stays in that segment's frame with the low bound short of it (a free head): the crossing of the cost with
    the layout's head kept in the frame is searched ``_GRID``-ary to 64 tokens, then every split within ``_WINDOW``
    of it (8x wider up to ``_WIDEST`` times where none is exact) is priced with its best heads, and of the exact ones
    the least shifted head wins, then the nearest the crossing. Returns ``(a, k, u, h, c, w, off)`` and which rows
    it solved; the others (no such split, or none exact) go to ``_solve``."""
    pa, pk, _, _, pc, pw = prev
    shift = s.total - r * t
    beg, length = s.beg[pk], s.length[pk]
    # nest (a grows by 0 .. t), at least one token inside, the low bound short of the segment, u <= w and u < L
    lo = np.maximum(pa, beg - shift + 1)
    hi = np.minimum.reduce([pa + t, r * t, beg, beg + np.minimum(pw, length - 1) - shift])
    ok = lo <= hi
    rows = np.flatnonzero(ok)
    out = [np.zeros_like(r) for _ in range(6)] + [np.zeros(r.size)]
    if not rows.size:
        return out, ok
    sh, tg, k, c, w = shift[rows], target[rows], pk[rows], pc[rows], pw[rows]
    b_lo, b_hi, x_lo, x_hi = lo[rows], hi[rows], lo[rows].copy(), hi[rows].copy()
    grid = np.arange(_GRID + 1)
    while np.any(x_hi - x_lo > 64):  # the last split whose cost (with the layout's head) is >= the target
        a = x_lo[:, None] + (x_hi - x_lo)[:, None] * grid // _GRID
        u, pref, wanted = _framed(s, fold, sh, tg, k, c, w, a)
        up = wanted - _inner_cost(s, k[:, None], u, pref) >= 0
        j = np.clip(up.sum(axis=1) - 1, 0, _GRID - 1)  # the cost falls as a grows: the crossing is in [a_j, a_j+1]
        x_lo, x_hi = np.take_along_axis(a, j[:, None], 1)[:, 0], np.take_along_axis(a, j[:, None] + 1, 1)[:, 0]
    a = np.minimum(x_lo[:, None] + np.arange(65), x_hi[:, None])  # the split nearest the target (smallest on a tie)
    u, pref, wanted = _framed(s, fold, sh, tg, k, c, w, a)
    near = np.take_along_axis(a, np.argmin(np.abs(wanted - _inner_cost(s, k[:, None], u, pref)), axis=1)[:, None],
                              1)[:, 0]
    eps, top = _EXACT * s.ideal / cp, np.iinfo(np.int64).max
    pending = np.arange(rows.size)
    for span in (_WINDOW, 8 * _WINDOW, _WIDEST * _WINDOW):
        if not pending.size:
            break
        i = pending
        best = [np.full(i.size, top)] + [np.zeros(i.size, dtype=np.int64) for _ in range(3)] + [np.zeros(i.size)]
        step = max(2 * _WINDOW + 1, _block(s) // (2 * i.size))
        for j in range(-span, span + 1, step):  # in blocks of columns: memory within the map's size
            a = np.clip(near[i, None] + np.arange(j, min(j + step, span + 1)), b_lo[i, None], b_hi[i, None])
            u, pref, wanted = _framed(s, fold, sh[i], tg[i], k[i], c[i], w[i], a)
            h1 = c[i, None] + _heads(s, k[i, None], u, c[i, None], w[i, None] - u, wanted)  # in the frame
            h = np.concatenate([h1, np.minimum(h1 + 1, c[i, None] + w[i, None] - u)], axis=1)
            a, u, pref, wanted = (np.concatenate([x, x], axis=1) for x in (a, u, pref, wanted))
            off = (wanted - _inner_cost(s, k[i, None], u, h)).astype(np.float64)
            dist = 2 * np.abs(a - near[i, None]) + (a > near[i, None])  # a tie to the lower split: blocks can't matter
            key = np.where(np.abs(off) <= eps, np.abs(h - pref) * (4 * s.total + 4) + dist, top)
            pick = np.argmin(key, axis=1)
            sel = (np.arange(i.size), pick)
            better = key[sel] < best[0]
            for o, x in zip(best, (key[sel], a[sel], u[sel], h[sel], off[sel])):
                o[better] = x[better]
        got = best[0] < top
        for o, x in zip(out, (best[1], k[i], best[2], best[3], best[3], best[2], best[4])):
            o[rows[i[got]]] = x[got]
        more = (near[i] - span > b_lo[i]) | (near[i] + span < b_hi[i])  # splits left to try in a wider window
        ok[rows[i[~got & ~more]]] = False
        pending = i[~got & more]
    ok[rows[pending]] = False
    return out, ok


def _boundaries(s: _Stream, fold: np.ndarray, cp: int, t: int, target: np.ndarray):
    """Every boundary ``r = 1 .. cp - 1``: the outer set ``O_r`` (what ranks ``< r`` hold) is ``S[0, a)`` and
    ``S[y, T)``, ``y = a + T - r t``, the segment the high bound cuts laid out by its head (``_with_heads``).
    Boundaries are solved all at once (``_solve``) but for the heads of one segment, which must nest: those go in
    rounds, the ``d``-th boundary cutting a segment in round ``d``, each a lean search where it can be
    (``_chain_step``). A boundary that still does not nest with the one
    before (``a`` must grow by ``0 .. t``; the cost along ``S`` is not monotone everywhere, mostly near the middle)
    is solved again within those bounds, one after the other. Returns ``(a, k, u, h, c, w, off)`` ``[cp - 1]``
    each (``off``: cost minus target)."""
    r = np.arange(1, cp, dtype=np.int64)
    none = np.full(r.size, -1, dtype=np.int64)
    a0 = _bisect(s, fold, r, t, target, np.zeros_like(r), r * t)  # a first guess: where the costs cross
    lo0 = np.r_[0, a0[:-1]]
    a0 = _nearest(s, fold, r, t, target, lo0, np.minimum(lo0 + t, r * t), (none, none, none))
    y0 = a0 + s.total - r * t
    k0 = s.seg(y0)
    inside = (y0 > s.beg[k0]) & (y0 < s.end[k0])
    chain = np.r_[False, (k0[1:] == k0[:-1]) & inside[1:] & inside[:-1]]
    first = np.flatnonzero(~chain)
    depth = np.arange(r.size) - first[np.cumsum(~chain) - 1]
    out = [np.zeros_like(r) for _ in range(6)] + [np.zeros(r.size)]
    for d in range(int(depth.max(initial=-1)) + 1):
        rows = np.flatnonzero(depth == d)
        prev = tuple(x[rows - 1] if d else none[rows] for x in out[:6])
        if d and s.weights == _FULL:  # a free head in the frame the boundary before left: the lean search, in
            # blocks of rows whose [rows, 2 (2 _WINDOW + 1)] arrays stay within _block elements
            lean, solved = _in_row_blocks(max(1, _block(s) // (4 * _WINDOW + 2)),
                                          lambda *x: _chain_step(s, fold, cp, t, *x), r[rows], target[rows], prev)
            for o, x in zip(out, lean):
                o[rows[solved]] = x[solved]
            rows, prev = rows[~solved], tuple(x[~solved] for x in prev)
            if not rows.size:
                continue
        lo, hi = np.zeros_like(rows), r[rows] * t
        if d:  # nearest the target with the frame the boundary before left
            lo, hi = prev[0], np.minimum(prev[0] + t, hi)
            a0[rows] = _nearest(s, fold, r[rows], t, target[rows], lo, hi, (prev[1], prev[4], prev[5]))
        for o, x in zip(out, _solve(s, fold, cp, t, r[rows], target[rows], prev, lo, hi, a0[rows])):
            o[rows] = x
    a, k, c, w = out[0], out[1], out[4], out[5]
    redo = False
    for i in range(1, r.size):
        framed = k[i] == k[i - 1]
        if (redo and framed or not a[i - 1] <= a[i] <= a[i - 1] + t
                or framed and not c[i - 1] <= c[i] <= c[i] + w[i] <= c[i - 1] + w[i - 1]):
            one = np.array([i])
            prev = tuple(x[one - 1] for x in out[:6])
            lo, hi = a[one - 1], np.minimum(a[one - 1] + t, r[one] * t)
            a1 = _nearest(s, fold, r[one], t, target[one], lo, hi, (prev[1], prev[4], prev[5]))
            for o, x in zip(out, _solve(s, fold, cp, t, r[one], target[one], prev, lo, hi, a1)):
                o[i] = x[0]
            redo = True
        else:
            redo = False
    return out


def _pieces(s: _Stream, fold: np.ndarray, cp: int, t: int, a, k, u, h, c, w):
    """The plan from the boundaries: every rank's whole segments (``whole`` ``[N]``: the rank, -1 for a cut one) and
    the pieces of the cut segments ``(segment, pos0, len, rank)``, or None where the outer sets do not nest. A
    token's rank is the number of outer sets ``O_1 .. O_{cp-1}`` it is not in; a segment no bound cuts lies in one
    stretch of ``S`` (rank ``r``: the ``r``-th from each end, ``cp - 1`` the middle)."""
    y = a + s.total - np.arange(1, cp, dtype=np.int64) * t
    if np.any(np.diff(a) < 0) or np.any(np.diff(a) > t):
        return None
    points = np.concatenate([[0], a, y[::-1], [s.total]])
    ranks = np.concatenate([np.arange(cp - 1), [cp - 1], np.arange(cp - 2, -1, -1)])
    i = np.searchsorted(points, s.beg, side="right") - 1
    whole = np.where(s.end <= points[np.minimum(i + 1, points.size - 1)], ranks[np.minimum(i, ranks.size - 1)], -1)
    # the outer sets' pieces of the cut segments, disjoint per boundary
    length = s.length[k]
    high = (u > 0) & (u < length)
    j = s.seg(a)
    v = a - s.beg[j]
    low = (v > 0) & (v < s.length[j])
    kept = low & (j == k)  # both bounds in one segment: its frame [c, c + w) is kept
    free = high & ~kept
    lo_only = low & ~kept
    z = np.zeros_like(a)
    d0 = _first(s, fold, j, z, s.length[j], v)  # a low cut of a segment the high bound does not reach
    f_v = _first(s, fold, k, c, w, np.where(kept, v, 0))
    uu = np.minimum(u, w)
    f_u = _first(s, fold, k, c, w, uu)
    parts = [(j, d0, d0 + v, lo_only), (k, z, h, free), (k, h + u, length, free),  # [0, h) + [h + u, L)
             (k, z, c, kept), (k, c + w, length, kept), (k, f_v, f_v + v, kept),  # outside, low part of the frame
             (k, c, f_u, kept), (k, f_u + uu, c + w, kept)]  # the frame outside its first u tokens
    seg = np.concatenate([p[0][p[3]] for p in parts])
    p0 = np.concatenate([p[1][p[3]] for p in parts])
    p1 = np.concatenate([p[2][p[3]] for p in parts])
    cut = np.flatnonzero(whole < 0)
    # per cut segment: the boundaries whose outer set misses it (O_r empty there) and those that cut it
    n_low = np.searchsorted(a, s.beg[cut], side="right")  # a_r <= beg
    n_high = np.searchsorted(-y, -s.end[cut], side="right")  # y_r >= end
    n_cut = np.bincount(np.searchsorted(cut, np.concatenate([j[lo_only], k[high | kept]])), minlength=cut.size)
    base = np.minimum(n_low, n_high) + n_cut
    # sweep every cut segment's positions: +1 where an outer piece starts, -1 where it ends
    keep = p1 > p0
    cs = np.searchsorted(cut, seg[keep])
    n = int(keep.sum())
    ev_c = np.concatenate([cs, cs, np.arange(cut.size), np.arange(cut.size)])
    ev_p = np.concatenate([p0[keep], p1[keep], np.zeros(cut.size, dtype=np.int64), s.length[cut]])
    ev_d = np.concatenate([np.ones(n, dtype=np.int64), -np.ones(n, dtype=np.int64), np.zeros(2 * cut.size,
                                                                                           dtype=np.int64)])
    o = np.lexsort((ev_p, ev_c))
    ev_c, ev_p, covered = ev_c[o], ev_p[o], np.cumsum(ev_d[o])
    piece = (ev_c[:-1] == ev_c[1:]) & (ev_p[1:] > ev_p[:-1])
    pc = ev_c[:-1][piece]
    return whole, (cut[pc], ev_p[:-1][piece], (ev_p[1:] - ev_p[:-1])[piece], base[pc] - covered[:-1][piece])


def _culprits(s: _Stream, fold: np.ndarray, t: int, a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The segments to fold where boundaries are stuck (``a``, ``y`` their bounds): the longest straight one
    (>= 3 tokens: folding a shorter one changes nothing) within ``t`` of the high bound, else of the low bound."""
    idx = np.arange(fold.size)
    last_ok = np.maximum.accumulate(np.where(~fold & (s.length >= 3), idx, -1))
    out = np.full(a.size, -1, dtype=np.int64)
    for x in (a, y)[::-1]:
        first, last = s.seg(np.maximum(x - t, 0)), s.seg(np.minimum(x + t, s.total - 1))
        hit = last_ok[last]
        out = np.where((out < 0) & (hit >= first), hit, out)
    return np.unique(out[out >= 0])


def _figures(s: _Stream, cp: int, t: int, whole: np.ndarray, pieces) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's cost and remote keys (``[cp]`` int64 each): the cost of its whole segments and pieces; per cut
    segment, the keys up to the furthest token it holds there minus its tokens there (a whole segment needs none)."""
    seg, pos0, length, rank = pieces
    ok = whole >= 0
    cost = np.bincount(whole[ok], weights=s.cost[ok], minlength=cp).astype(np.int64)
    cost += np.bincount(rank, weights=range_cost(pos0, pos0 + length, s.weights), minlength=cp).astype(np.int64)
    key = rank * (s.length.size + 1) + seg
    order = np.argsort(key, kind="stable")
    key, reach = key[order], (pos0 + length)[order]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else key
    need = np.bincount(key[first] // (s.length.size + 1), weights=np.maximum.reduceat(reach, first) if key.size
                       else None, minlength=cp).astype(np.int64)
    need -= np.bincount(rank, weights=length, minlength=cp).astype(np.int64)
    return cost, need


def _candidate(s: _Stream, fold: np.ndarray, cp: int, t: int, tol: float, memo: dict):
    """One plan for the fold set ``fold``, folding the culprits of the ranks still off their share by more than
    ``tolerance / _STUCK`` (``FOLD_ROUNDS`` times at most; ``memo``: the boundaries of every fold set solved so far).
    Returns ``(whole, pieces)`` or None where the boundaries do not make a partition."""
    fold = fold.copy()
    r = np.arange(1, cp, dtype=np.int64)
    target = r * s.ideal // cp
    for rounds in range(FOLD_ROUNDS + 1):
        key = fold.tobytes()
        if key not in memo:
            memo[key] = _boundaries(s, fold, cp, t, target)
        a, k, u, h, c, w, off = memo[key]
        err = np.r_[0, off, 0]  # every boundary's cost minus r C / cp
        missed = np.abs(off) > _EXACT * s.ideal / cp
        if np.abs(np.diff(err)).max() > _SPREAD * s.ideal / cp:  # spread what inexact boundaries miss over the ranks
            # between them
            err = np.interp(np.arange(cp + 1), np.r_[0, r[missed], cp], np.r_[0, off[missed], 0])
            again = _boundaries(s, fold, cp, t, target + np.round(err[1:-1]).astype(np.int64))
            err2 = np.r_[0, again[-1] + np.round(err[1:-1]), 0]
            if np.abs(np.diff(err2)).max() < np.abs(np.diff(np.r_[0, off, 0])).max():
                (a, k, u, h, c, w, _), err = again, err2
            else:
                err = np.r_[0, off, 0]
        bad = np.abs(np.diff(err)) > max(tol / _STUCK, _EXACT) * s.ideal / cp  # ranks off their share
        stuck = bad[:-1] | bad[1:]
        culprits = _culprits(s, fold, t, a[stuck], (a + s.total - r * t)[stuck]) \
            if stuck.any() and rounds < FOLD_ROUNDS else np.zeros(0, dtype=np.int64)
        if not culprits.size:
            break
        fold[culprits] = True
    plan = _pieces(s, fold, cp, t, a, k, u, h, c, w)
    if plan is None:
        return None
    whole, (_, _, length, rank) = plan
    if rank.size and (rank.min() < 0 or rank.max() >= cp):
        return None
    tokens = np.bincount(np.concatenate([whole[whole >= 0], rank]),
                         weights=np.concatenate([s.length[whole >= 0], length]), minlength=cp)
    return plan if np.all(tokens == t) else None


def _plan(cu: np.ndarray, cp: int, weights: WindowWeights, tol: float):
    """Every rank's runs ``(offsets [cp + 1], run_start [R], run_len [R])``: the best candidate (module docstring)."""
    if cp == 1:
        return contiguous_plan_arrays(cu, cp)
    t = int(cu[-1]) // cp
    s = _Stream(cu, weights)
    candidates, seen, memo = [], set(), {}
    for ladder in FOLD_LADDER:
        fold = np.zeros(s.length.size, dtype=bool) if ladder is None else s.length >= ladder * t
        if fold.tobytes() in seen:
            continue
        seen.add(fold.tobytes())
        plan = _candidate(s, fold, cp, t, tol, memo)
        if plan is not None:
            candidates.append((plan, _figures(s, cp, t, *plan)))
    first, last = s.start // t, (s.start + s.length - 1) // t  # contiguous: rank r holds [r t, (r + 1) t)
    whole = np.where(first == last, first, -1)
    cut = np.flatnonzero(whole < 0)
    n = last[cut] - first[cut] + 1
    seg = np.repeat(cut, n)
    rank = np.arange(seg.size) - np.repeat(np.cumsum(n) - n, n) + first[seg]
    lo, hi = np.maximum(rank * t, s.start[seg]), np.minimum((rank + 1) * t, s.start[seg] + s.length[seg])
    pieces = (seg, lo - s.start[seg], hi - lo, rank)
    candidates.append(((whole, pieces), _figures(s, cp, t, whole, pieces)))
    limit = (1.0 + tol) * s.ideal / cp

    def score(candidate):
        cost, need = candidate[1]
        busiest, within = int(cost.max()), cost.max() <= limit
        return (0, int(need.max()), int(need.sum()), busiest) if within else (1, busiest, int(need.max()), 0)

    best = min(range(len(candidates)), key=lambda i: (score(candidates[i]), i))
    (whole, (seg, pos0, length, rank)), _ = candidates[best]
    ok = np.flatnonzero(whole >= 0)
    return merge_runs(np.concatenate([s.start[ok], s.start[seg] + pos0]), np.concatenate([s.length[ok], length]),
                      np.concatenate([whole[ok], rank]), np.concatenate([np.zeros(ok.size, dtype=np.int64), pos0]), cp)


@dataclass(frozen=True)
class Local:
    """The ``local`` layout with its knob, accepted wherever a layout name is: ``layout=Local(tolerance=0.05)``
    (``"local"`` is ``Local()``). Its repr names the tolerance, so the step agreement's plan digest covers it.

    >>> Local(tolerance=0)
    Local(tolerance=0.0)
    """

    tolerance: float = TOLERANCE
    name: ClassVar[str] = "local"

    def __post_init__(self) -> None:
        object.__setattr__(self, "tolerance", check_number(self.tolerance, "tolerance", min=0.0))

    def options(self) -> tuple:
        """The plan's parameters past the defaults, ``(name, value)`` pairs (part of the plan cache's key)."""
        return () if self.tolerance == TOLERANCE else (("tolerance", self.tolerance),)


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
    from cp_packing.layouts import layout_plan  # the one plan cache (the package imports this module)

    plan = layout_plan(cu_seqlens, cp_size=cp_size, layout=Local(tolerance=tolerance), window=window)
    return tuple(torch.from_numpy(a.copy()) for a in (plan.offsets, plan.run_start, plan.run_len))


def local_plan_arrays(cu: np.ndarray, cp_size: int, weights: WindowWeights,
                      tolerance: float = TOLERANCE) -> tuple[np.ndarray, ...]:
    """``(offsets, run_start, run_len)`` of a validated, non-empty ``cu`` and ``balanced.planned_weights``: pure, not
    cached (``layouts.PLANS["local"]``; ``layout_plan`` caches it)."""
    return _plan(cu, cp_size, weights, tolerance)


def local_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, window: int | Sequence[int | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``cp_rank``'s runs under ``local`` (``layout_runs(..., layout="local")``): its slice of
    ``local_plan`` at ``TOLERANCE``, int64 ``(run_start, run_len)`` on ``cu_seqlens.device``, ordered by global
    position, ``T // cp_size`` tokens (``window``: as in ``local_plan``; every rank must pass the same).

    >>> local_runs(torch.tensor([0, 16, 18, 20, 22, 24]), cp_size=2, cp_rank=1)  # the long one's middle, two short
    (tensor([ 4, 20, 22]), tensor([8, 2, 2]))
    """
    from cp_packing.layouts import layout_runs  # the one plan cache (the package imports this module)

    return layout_runs(cu_seqlens, cp_size=cp_size, cp_rank=cp_rank, layout="local", window=window)
