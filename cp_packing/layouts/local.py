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
end, with ``a`` the split whose cost is nearest the mean cost of the ranks still to place (every split is priced at
once from the prefix cost of ``S``). One more low token and one less high token costs less, so a split within one
token of the mean exists while the cost along ``S`` rises; the last rank takes the middle. Short segments stay whole
and only the ``2cp - 2`` interval bounds cut segments: a low bound cuts a short segment (its second piece needs few
keys); a high bound cuts a long one, where a late piece needs its segment's prefix, but it is cut only as far as the
cost needs.

A long segment laid straight puts its cheap head next to the dense tail of the segment before it, and a rank that
reaches it can find no split near the mean. Such a segment is *folded*: laid out from the middle outwards, so that
every two tokens of it cost ``L + 1`` together (a flat cost along ``S``); an interval of a folded segment is then
its middle ``[m, m + u)`` or a ring ``[a, m) + [m + u, b)``, at most two runs, and the ring ``[0, a) + [L - a, L)``
needs ``L - 2a`` keys (``zigzag``'s pair, over as few ranks as the cost needs)::

    positions  0 1 2 3 4 5 6 7      S order, folded: 3 4 2 5 1 6 0 7      rank 0 | rank 1: [0 1 | 2 3 4 5 | 6 7]

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
tolerance only (integer costs, stable sorts), cached like ``balanced``'s with ``functools.lru_cache``; it runs in
NumPy on the host in time and memory linear in ``T`` (a CUDA ``cu_seqlens`` is copied: one host sync per call).
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch

from cp_packing._checks import check_cp, check_number
from cp_packing.layouts.balanced import _contiguous, _merge, _plan_key
from cp_packing.layouts.work import WindowWeights, range_cost

__all__ = ["local_plan", "local_runs", "TOLERANCE", "FOLD_LADDER", "MAX_FOLDS"]

#: The knob: how far (a fraction of the ideal ``C / cp``) a rank may end from its target cost before a segment is
#: folded to get it closer, and the busiest / mean a plan may have (``1 + TOLERANCE``) to count as balanced.
#: Smaller: more even, more remote keys; larger: fewer remote keys (docs/balance.md has the trade, measured).
TOLERANCE = 0.001
#: Candidate plans start with every segment of at least this many ``T / cp`` folded (``None``: none).
FOLD_LADDER = (None, 2.0, 1.0, 0.5)
#: At most this many segments folded on demand per candidate (each fold redoes one pass over the ranks).
MAX_FOLDS = 32

_CACHE_SIZE = 16


class _Stream:
    """The segments in ``S`` order (by length, then position) and the prefix cost of ``S``, token by token."""

    def __init__(self, cu: np.ndarray, weights: WindowWeights):
        start, length = cu[:-1], np.diff(cu)
        keep = length > 0
        start, length = start[keep], length[keep]
        order = np.lexsort((start, length))
        self.start, self.length, self.weights = start[order], length[order], weights
        self.end = np.cumsum(self.length)
        self.beg = self.end - self.length
        self.total = int(self.end[-1])
        pos = np.arange(self.total, dtype=np.int64)
        pos -= np.repeat(self.beg, self.length)  # position of every S token in its segment (straight)
        self.straight = np.zeros(self.total + 1, dtype=np.int64)
        np.cumsum(range_cost(pos, pos + 1, weights), out=self.straight[1:])

    def prefix(self, fold: np.ndarray) -> np.ndarray:
        """int64 ``[T + 1]``: cost of the first ``x`` tokens of ``S`` with the segments ``fold`` folded."""
        fs = self.straight.copy()
        for k in np.flatnonzero(fold).tolist():
            self.refold(fs, k)
        return fs

    def refold(self, fs: np.ndarray, k: int) -> None:
        """Rewrite the prefix cost ``fs`` inside segment ``k`` for its folded order (its total does not change)."""
        b, n = int(self.beg[k]), int(self.length[k])
        pos = _folded_positions(n)
        np.cumsum(range_cost(pos, pos + 1, self.weights), out=fs[b + 1 : b + n + 1])
        fs[b + 1 : b + n + 1] += fs[b]


def _folded_positions(n: int) -> np.ndarray:
    """int64 ``[n]``: the positions of a folded segment of ``n`` tokens in ``S`` order, middle out: its first ``u``
    tokens are ``[m(u), m(u) + u)`` with ``m(u) = (n - u) // 2`` (``n = 8``: ``3 4 2 5 1 6 0 7``)."""
    u = np.arange(n, dtype=np.int64)
    m_now, m_next = (n - u) // 2, (n - u - 1) // 2
    return np.where(m_next < m_now, m_next, m_now + u)


def _solve(fs: np.ndarray, cp: int, t: int, tol: float):
    """Split ``S`` from the outside in. Returns ``(x, rank_cost, stuck)``: ``x`` int64 ``[cp]`` the low bounds
    (rank r holds ``[x_r, x_{r+1})`` and ``[y_{r+1}, y_r)`` with ``y_r = T - r t + x_r``; rank ``cp - 1`` holds
    ``[x_{cp-1}, x_{cp-1} + t)``), every rank's cost, and ``(lo, hi)``: what was left of ``S`` when a rank first ended
    farther than ``tol * C / cp`` from its target (``None`` if none did)."""
    total_cost = int(fs[-1])
    slack = tol * total_cost / cp
    x = np.zeros(cp, dtype=np.int64)
    rank_cost = np.zeros(cp, dtype=np.int64)
    lo, hi, used, stuck = 0, fs.size - 1, 0, None
    for r in range(cp - 1):
        target = (total_cost - used) // (cp - r)  # the mean of the ranks still to place
        cost = fs[lo : lo + t + 1] - fs[lo]  # [t + 1]: a tokens from the low end ...
        cost += fs[hi] - target
        cost -= fs[hi - t : hi + 1]  # ... and t - a from the high end, minus the target
        a = int(np.argmin(np.abs(cost)))
        if stuck is None and abs(int(cost[a])) > slack:
            stuck = (lo, hi)
        rank_cost[r] = int(cost[a]) + target
        used += int(rank_cost[r])
        lo, hi = lo + a, hi - (t - a)
        x[r + 1] = lo
    rank_cost[cp - 1] = total_cost - used
    return x, rank_cost, stuck


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


def _split(stream: _Stream, fold: np.ndarray, cp: int, t: int, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Solve the split with ``fold`` folded, folding one more segment where a rank got stuck (``_culprit``) until no
    rank is, there is nothing left to fold there, or ``MAX_FOLDS`` are folded. Returns ``(x, fold)``."""
    fold = fold.copy()
    fs = stream.prefix(fold)
    for folds in range(MAX_FOLDS + 1):
        x, _, stuck = _solve(fs, cp, t, tol)
        k = -1 if stuck is None or folds == MAX_FOLDS else _culprit(stream, fold, *stuck, t)
        if k < 0:
            return x, fold
        fold[k] = True
        stream.refold(fs, k)
    raise AssertionError("unreachable")


def _split_runs(stream: _Stream, fold: np.ndarray, x: np.ndarray, cp: int, t: int):
    """The runs of a split: ``(start, len, rank, pos0, segment)``, every run non-empty (segment: its index in
    ``S``). A piece ``[u, v)`` of segment k's stretch of ``S`` is positions ``[u, v)`` if it is straight, else
    ``[m(v), m(u))`` and ``[m(u) + u, m(v) + v)`` with ``m(u) = (L - u) // 2``."""
    ranks = np.arange(cp, dtype=np.int64)
    edges = np.concatenate([x, (stream.total - ranks * t + x)[::-1]])  # [2cp] interval bounds, in S order
    edge_rank = np.concatenate([ranks, ranks[-2::-1]])  # [2cp - 1] the rank of each interval
    cuts = np.union1d(edges, stream.end)
    p, q = cuts[:-1], cuts[1:]
    k = np.searchsorted(stream.end, p, side="right")
    rank = edge_rank[np.searchsorted(edges, p, side="right") - 1]
    u, v, n, folded = p - stream.beg[k], q - stream.beg[k], stream.length[k], fold[k]
    m_u, m_v = (n - u) // 2, (n - v) // 2
    left0, left1 = np.where(folded, m_v, u), np.where(folded, m_u, v)
    right0 = m_u + u
    right1 = np.where(folded, m_v + v, right0)  # a straight piece has no right run
    pos0 = np.concatenate([left0, right0])
    length = np.concatenate([left1 - left0, right1 - right0])
    seg, rank = np.concatenate([k, k]), np.concatenate([rank, rank])
    keep = length > 0
    pos0, length, seg, rank = pos0[keep], length[keep], seg[keep], rank[keep]
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
        x, fold = _split(stream, fold, cp, t, tol)
        start, length, rank, pos0, seg = _split_runs(stream, fold, x, cp, t)
        candidates.append(((start, length, rank, pos0), _figures(rank, seg, pos0, length, cp, t, weights)))
    offsets, start, length = _contiguous(cu, cp)
    rank = np.repeat(np.arange(cp, dtype=np.int64), np.diff(offsets))
    seg = np.searchsorted(cu, start, side="right") - 1
    pos0 = start - cu[seg]
    candidates.append(((start, length, rank, pos0), _figures(rank, seg, pos0, length, cp, t, weights)))
    limit = (1.0 + tol) * float(stream.straight[-1]) / cp

    def score(candidate):
        cost, need = candidate[1]
        busiest, within = int(cost.max()), cost.max() <= limit
        return (0, int(need.max()), int(need.sum()), busiest) if within else (1, busiest, int(need.max()), 0)

    best = min(range(len(candidates)), key=lambda i: (score(candidates[i]), i))
    (start, length, rank, pos0), _ = candidates[best]
    return _merge(start, length, rank, pos0, cp)


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cached_plan(cu_bytes: bytes, cp: int, weights: WindowWeights, tol: float):
    cu = np.frombuffer(cu_bytes, dtype=np.int64)
    if int(cu[-1]) == 0:
        z = np.zeros(0, dtype=np.int64)
        plan = (np.zeros(cp + 1, dtype=np.int64), z, z)
    else:
        plan = _plan(cu, cp, weights, tol)
    for a in plan:
        a.flags.writeable = False  # shared by every caller: hand out copies only
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
    cu, weights = _plan_key(cu_seqlens, cp_size, window)
    tol = check_number(tolerance, "tolerance", min=0.0)
    return tuple(torch.from_numpy(a.copy()) for a in _cached_plan(cu.tobytes(), cp_size, weights, tol))


def local_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, window: int | Sequence[int | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs of global tokens rank ``cp_rank`` holds under ``local``: a slice of ``local_plan``.

    Args:
        cu_seqlens: int ``[N + 1]`` global cumulative segment lengths (any int dtype, CPU or CUDA).
        cp_size, cp_rank: the context-parallel group size and this rank.
        window: the sliding window(s) the plan balances (as in ``local_plan``); every rank must pass the same.

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each on ``cu_seqlens.device``, ordered by global position;
        ``run_len.sum() == T // cp_size``; all ranks' runs together cover every token exactly once.

    >>> local_runs(torch.tensor([0, 16, 18, 20, 22, 24]), cp_size=2, cp_rank=1)  # the long one's middle, two short
    (tensor([ 4, 20, 22]), tensor([8, 2, 2]))
    """
    check_cp(cp_size, cp_rank)
    cu, weights = _plan_key(cu_seqlens, cp_size, window)
    offsets, run_start, run_len = _cached_plan(cu.tobytes(), cp_size, weights, TOLERANCE)
    lo, hi = int(offsets[cp_rank]), int(offsets[cp_rank + 1])
    device = cu_seqlens.device
    return (
        torch.from_numpy(run_start[lo:hi].copy()).to(device),
        torch.from_numpy(run_len[lo:hi].copy()).to(device),
    )


local_plan.cache_info = _cached_plan.cache_info  # type: ignore[attr-defined]  # functools' own hit/miss counts
local_plan.cache_clear = _cached_plan.cache_clear  # type: ignore[attr-defined]
