"""The ``balanced`` layout (equal token counts, even causal cost, no padding) and ``layout="auto"``. Pure index math.

Why: under causal attention a token at position ``p`` of its segment attends to ``p + 1`` keys, so the work of a
rank is ``sum(p + 1)`` over its tokens (``cp_packing.cost``). ``contiguous`` gives the late, expensive tokens of a
long document to one rank (busiest / mean 1.2-2.8 on long-tailed lengths); per-document ``zigzag`` evens it out
but needs every segment padded to a multiple of ``2*cp`` (up to ``2cp - 1`` pad tokens per short document). The
planner gets the busiest rank within about 1% of the mean on realistic maps without adding a token.

The plan, for ``cu_seqlens`` with ``T % cp == 0`` (exactly ``T_local = T / cp`` tokens on every rank):

1. Cost of a piece ``[a, b)`` of a segment (positions ``a .. b-1``): ``sum (p + 1) = (b(b+1) - a(a+1)) / 2``; a
   whole segment of length ``L`` costs ``L (L + 1) / 2``; ``C`` the total, ``C / cp`` the ideal per rank. Padding
   segments count like documents: the kernel attends them too (padding attends to padding).
2. A segment is *heavy* when it costs more than ``SMALL_FRACTION * C / cp``. A heavy segment of at least
   ``2 * cp * MIN_CHUNK`` tokens is *long*: it is cut zigzag-style into ``2*cp`` chunks and rank ``r`` gets chunks
   ``r`` and ``2cp-1-r`` (an early and a late one: the same cost on every rank). When ``L % cp != 0`` a rank's pair
   holds ``L // cp`` or ``L // cp + 1`` tokens (the ``+1`` rotates over the ranks from one long segment to the next,
   so together they give every rank ``floor`` or ``ceil`` of their tokens / cp); the head chunk gets half, the tail
   the rest. Rank ``cp-1``'s two chunks touch: one run. A shorter heavy segment is *mid*: it is cut into ``q``
   consecutive pieces (``q`` as needed for ``SMALL_FRACTION``, each piece at least ``MIN_CHUNK`` tokens) that are
   placed like short segments.
3. Short segments (and mid pieces), the *items*, stay whole where possible (see ``_place_items``): the costliest
   go first, a round of ``cp`` at a time, each to the rank with the most cost still to fill (LPT); the rest is shared
   by *tilted strata*: sorted by cost per token and cut into ``STRATA`` strata, every rank takes one contiguous
   range of every stratum, sized so that its token count is exact and its cost meets its need (a rank that got a
   costly item takes more of the light strata). A range end splits at most one item, so there are at most
   ``STRATA * cp`` extra runs in all.

Result, per rank: its runs ordered by global position, each inside one segment: ``2`` per long segment (``1`` on rank
``cp - 1``), plus about ``num_items / cp + STRATA + 1``. Measured on the suite of ``benchmarks/bench_balance.py``
(see ``docs/balance.md``).

The whole plan (every rank's runs) is computed once per ``(cu_seqlens content, cp_size)`` and cached (a small LRU),
so the ``cp`` calls of ``balanced_runs`` (one per rank, or all ranks for an all-gather order) cost one plan. It runs
in NumPy on the host: a CUDA ``cu_seqlens`` is copied to the host (one host sync per call). Determinism: the plan is
a function of the ``cu_seqlens`` values and ``cp`` (integer math, stable/radix sorts, and a few float64 steps whose
results are identical wherever the same NumPy runs); ranks on mixed software stacks should compute it on one rank
and ship it (``ShardedPackedSeqParams.global_token_order()``).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import OrderedDict, namedtuple

import numpy as np
import torch

from cp_packing._checks import check_cp, check_cu_seqlens, check_divisible

__all__ = ["balanced_runs", "balanced_plan", "choose_layout", "AUTO_LAYOUTS"]

logger = logging.getLogger("cp_packing")

#: A segment costing more than this fraction of one rank's ideal cost is cut (long: over all ranks; mid: into
#: pieces); cheaper ones are placed whole. Smaller: finer balance, more runs.
SMALL_FRACTION = 0.01
#: The smallest piece the planner cuts on purpose (a long segment has at least ``2 * cp * MIN_CHUNK`` tokens).
#: Short runs waste the tiles of a flash kernel.
MIN_CHUNK = 32
#: At most this many rounds of ``cp`` items are placed greedily (LPT) before the tilted strata.
TOP_ROUNDS = 8
#: ... and only while the costliest item left costs more than this fraction of a rank's ideal cost.
TOP_FRACTION = 0.001
#: Number of cost-per-token strata shared out by the tilted allocation.
STRATA = 4

#: Layouts ``choose_layout`` considers, in order of preference on a tie of cost and communication.
AUTO_LAYOUTS = ("contiguous", "zigzag", "balanced")

_CACHE_SIZE = 16


# ----------------------------------------------------------------------------------------------------------------
# input checks


def _check_cp_size(cp_size) -> int:
    check_cp(cp_size)
    return cp_size


_cu_numpy = check_cu_seqlens


# ----------------------------------------------------------------------------------------------------------------
# the plan


def _piece_cost(a, b):
    """Causal cost of the positions ``a .. b-1`` of a segment: ``sum_{p=a}^{b-1} (p + 1) = (b(b+1) - a(a+1)) / 2``."""
    return (b * (b + 1) - a * (a + 1)) // 2


def _long_runs(seg_start: np.ndarray, lengths: np.ndarray, cp: int):
    """Zigzag pairs of the long segments over all ranks. Returns the runs ``(start, len, rank)`` (``2cp - 1`` per
    segment, in position order) and every rank's tokens and cost ``[cp]``."""
    base = lengths // cp
    rem = lengths % cp
    off = (np.cumsum(rem) - rem) % cp  # where this segment's +1's start: rotates over the long segments
    ranks = np.arange(cp, dtype=np.int64)
    extra = ((ranks[None, :] - off[:, None]) % cp) < rem[:, None]  # [nl, cp]
    pair = base[:, None] + extra  # [nl, cp] tokens of rank r's two chunks
    head = pair // 2
    tail = pair - head
    head_pos = np.cumsum(head, axis=1) - head  # [nl, cp] heads of ranks 0..cp-1 from the segment's start
    tail_pos = lengths[:, None] - np.cumsum(tail, axis=1)  # [nl, cp] then the tails of ranks cp-1..0
    cost = _piece_cost(head_pos, head_pos + head) + _piece_cost(tail_pos, tail_pos + tail)  # [nl, cp]
    head[:, cp - 1] += tail[:, cp - 1]  # rank cp-1: its head and tail touch, one run
    # position order inside a segment: heads of ranks 0..cp-1, then tails of ranks cp-2..0
    start = np.concatenate([head_pos, tail_pos[:, cp - 2 :: -1]], axis=1) + seg_start[:, None]  # [nl, 2cp-1]
    length = np.concatenate([head, tail[:, cp - 2 :: -1]], axis=1)
    rank = np.concatenate([ranks, ranks[cp - 2 :: -1]])
    return (
        start.ravel(),
        length.ravel(),
        np.tile(rank, lengths.size),
        pair.sum(axis=0),
        cost.sum(axis=0),
    )


def _split_pieces(lengths: np.ndarray, q: np.ndarray):
    """Cut segment k (of length ``lengths[k]``) into ``q[k] >= 1`` consecutive pieces of ``floor``/``ceil`` equal
    size. Returns every piece's first position inside its segment ``a``, length, cost, segment index (into the given
    arrays) and index inside its segment ``j`` (int64 ``[sum(q)]`` each)."""
    n = int(q.sum())
    owner = np.repeat(np.arange(lengths.size), q)  # [n]
    j = np.arange(n, dtype=np.int64) - (np.cumsum(q) - q)[owner]  # index of the piece inside its segment
    L, qo = lengths[owner], q[owner]
    a = j * L // qo
    b = (j + 1) * L // qo
    return a, b - a, _piece_cost(a, b), owner, j


def _rank_dtype(cp: int):
    """The smallest signed int holding a rank and the sentinel ``cp`` (a stable argsort of it is a radix sort)."""
    return np.int16 if cp < 2**15 - 1 else np.int32


def _tilted_allocation(N, K, T_g, C_g, T_f):
    """int64 ``[cp, G]``: tokens of stratum g for rank r. Rows sum to ``N`` and columns to ``T_g`` exactly; tilted
    towards dense or light strata so that rank r's cost is close to ``K[r]``. ``None`` if rounding cannot keep every
    share >= 0 (tiny maps)."""
    G = T_g.size
    rho_g = np.divide(C_g, T_g, out=np.zeros(G), where=T_g > 0)
    rho = C_g.sum() / T_f
    dev = np.where(T_g > 0, rho_g - rho, 0.0)  # [G]
    V = float((T_g * dev * dev).sum())
    lam = (K - N * rho) / V if V > 0 else np.zeros(N.size)  # [cp], sums to 0
    base = N[:, None] / T_f  # [cp, 1]
    tilt = lam[:, None] * dev[None, :]  # [cp, G]
    over = (tilt < 0) & (base + tilt < 0)
    if over.any():  # shrink all tilts by one common factor (keeps the columns exact) so that no share is < 0
        tilt = tilt * float((np.broadcast_to(base, tilt.shape)[over] / -tilt[over]).min())
    frac = T_g[None, :] * (base + tilt)  # [cp, G] >= 0, columns sum to T_g
    col = np.rint(np.cumsum(frac, axis=0))
    col = np.minimum(np.maximum.accumulate(np.maximum(col, 0.0), axis=0), T_g[None, :]).astype(np.int64)
    col[-1] = T_g.astype(np.int64)
    alloc = col.copy()
    alloc[1:] -= col[:-1]  # [cp, G] >= 0, columns exact
    g_star = int(np.argmax(T_g))  # the biggest stratum absorbs the rounding of the rows
    alloc[:, g_star] = N - (alloc.sum(axis=1) - alloc[:, g_star])
    return None if alloc.min() < 0 else alloc


def _top_items(cost: np.ndarray, k: int, threshold: float) -> np.ndarray:
    """Indices of the (at most) ``k`` costliest items costing more than ``threshold``, costliest first, ties by
    index. O(n) (a partition, then a sort of ``k`` items); the same result for any correct partition algorithm."""
    cand = np.flatnonzero(cost > threshold)  # one pass; the rest works on the candidates
    n = cand.size
    k = min(k, n)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    c = cost[cand]
    v = np.partition(c, n - k)[n - k]  # the k-th largest cost
    above = cand[c > v]
    at_v = cand[c == v][: k - above.size]
    top = np.concatenate([above, at_v])
    return top[np.lexsort((top, -cost[top]))]


#: Cap of the cost-per-token sort key (an int16).
_KEY_CAP = 2**15 - 1


def _density_order(length: np.ndarray, pos0: np.ndarray, piece_idx: np.ndarray, skip: np.ndarray):
    """The items by cost per token, the ``skip``-ped ones left out: int64 ``[n - skip.size]``.

    The key is ``2 * cost // length``, which is exactly ``2 * pos0 + length + 1`` (a piece ``[a, b)`` costs
    ``(b - a)(a + b + 1) / 2``), capped at ``_KEY_CAP``; ``pos0`` is 0 except at ``piece_idx``. A stable radix sort
    of an int16 (O(n), ties by index; one pass when every key is below 256); the skipped items get the key 0 (every
    other key is >= 2) and are cut off the front.
    """
    key = np.empty(length.size, dtype=np.int16)
    np.minimum(length, _KEY_CAP - 1, out=key, casting="unsafe")  # in range: an exact cast
    key += 1
    if piece_idx.size:
        key[piece_idx] = np.minimum(length[piece_idx] + 1 + 2 * pos0[piece_idx], _KEY_CAP)
    if skip.size:
        key[skip] = 0
    return np.argsort(key, kind="stable")[skip.size :]


def _strata_bounds(tok: np.ndarray, lo: np.ndarray, n_strata: int) -> np.ndarray:
    """int64 ``[n_strata + 1]``: stratum g starts at the first item whose middle lies at or past ``g / n_strata`` of
    the tokens (``tok`` the cumulative tokens of the sorted items ``[m]``, ``lo`` their lengths).

    The first item with ``2 * tok >= x2`` (x2 = twice the point) holds the point; the answer is that item or, if its
    middle ``2 * tok - lo`` lies before the point, the next one (every later middle lies past it)."""
    m = tok.size
    x2 = (2 * int(tok[-1]) * np.arange(1, n_strata, dtype=np.int64)) // n_strata
    i1 = np.searchsorted(tok, (x2 + 1) // 2, side="left")
    i1 = i1 + (2 * tok[i1] - lo[i1] < x2)
    return np.concatenate([[0], i1, [m]]).astype(np.int64)


def _golden_multiplier(n: int) -> int:
    """A multiplier ``a`` coprime with ``n``, close to ``n / golden ratio``: ``j -> j * a % n`` is a permutation of
    ``range(n)`` that visits it in a low-discrepancy order (consecutive steps jump by ~0.618 of the range)."""
    a = max(1, int(round(n * 0.6180339887498949)))
    while math.gcd(a, n) != 1:
        a += 1
    return a


#: Below this many items, ``_golden_order`` uses the plain integer formula (fewer calls, slower per item).
_SMALL_STREAM = 16384


def _golden_order(bounds: np.ndarray) -> np.ndarray:
    """int64 ``[bounds[-1]]``: inside every slice ``[lo, hi)`` of ``bounds``, ``lo + (j * a % k)`` for ``j`` in
    ``range(k)``, ``k = hi - lo``, ``a = _golden_multiplier(k)``.

    Without an int64 remainder over the stratum (slow): with ``j = u * B + v`` (``B = ceil(sqrt(k))``),
    ``j * a % k = (U[u] + V[v]) % k`` where ``U[u] = u * B * a % k`` and ``V[v] = v * a % k`` are two small tables,
    and their sum is below ``2k``: one broadcast add and one conditional subtraction."""
    m = int(bounds[-1])
    lo_l, hi_l = bounds[:-1].tolist(), bounds[1:].tolist()
    if m < _SMALL_STREAM:  # few items: the plain formula for all strata at once, fewer NumPy calls
        k = np.diff(bounds)
        a = np.array([_golden_multiplier(hi - lo) if hi > lo else 1 for lo, hi in zip(lo_l, hi_l)], dtype=np.int64)
        lo_of, k_of, a_of = (np.repeat(x, k) for x in (bounds[:-1], k, a))
        return (np.arange(m, dtype=np.int64) - lo_of) * a_of % k_of + lo_of
    out = np.empty(m, dtype=np.int64)
    for lo, hi in zip(lo_l, hi_l):  # a few strata
        k = hi - lo
        if k == 0:
            continue
        a = _golden_multiplier(k)
        B = math.isqrt(k - 1) + 1  # B * B >= k
        V = np.arange(B, dtype=np.int64) * a % k
        U = np.arange((k + B - 1) // B, dtype=np.int64) * (B * a % k) % k
        y = (U[:, None] + V[None, :]).reshape(-1)[:k]  # [k] in [0, 2k)
        z = y - k  # y % k is y - k where that is >= 0, else y: the smaller of the two as unsigned (branch-free)
        np.minimum(y.view(np.uint64), z.view(np.uint64), out=z.view(np.uint64))
        np.add(z, lo, out=out[lo:hi])
    return out


def _place_items(length, cost, pos0, piece_idx, need_tokens, need_cost, ideal, cp):
    """Place items (pieces of segments, in position order: ``length``, ``cost``, ``pos0`` the position of the first
    token inside its segment, int64 ``[n]``; ``piece_idx`` the items with ``pos0 > 0``) so that rank r gets exactly
    ``need_tokens[r]`` tokens and about ``need_cost[r]`` cost.

    1. Top rounds (LPT): the costliest items, ``cp`` at a time, the round's costliest to the rank with the most cost
       still to fill; whole. At most ``TOP_ROUNDS`` rounds, only items above ``TOP_FRACTION * ideal``, and never
       more than half of a rank's tokens (the rest keeps room to even out).
    2. The rest, by tilted strata: ``STRATA`` bands of cost per token (stratum g: ``T_g`` tokens at ``rho_g`` cost
       per token; ``rho`` the mean). Rank r takes ``a[r, g] = T_g * (N_r / T_f + lam_r * (rho_g - rho))`` tokens of
       stratum g: ``N_r`` tokens in all at a cost of ``N_r * rho + lam_r * V`` (``V = sum_g T_g (rho_g - rho)^2``),
       so ``lam_r`` meets the rank's cost need, and the strata are shared out exactly because the ``lam_r`` sum to
       0. Inside a stratum the items are in a low-discrepancy order (by cost per token) and every rank takes one
       contiguous range of that stream (a range end splits at most one item); a range costs about ``rho_g`` times
       its tokens.

    Returns ``(item_rank, x_item, x_off, x_rank, rank_cost)``: the rank of every item's first piece (``[n]``, of
    ``_rank_dtype(cp)``); the extra pieces of the items a range end cut (item, offset of the piece inside the item,
    rank; in stream order, so the offsets of one item increase); the items' cost on every rank (float64 ``[cp]``).
    """
    n = length.size
    z = np.zeros(0, dtype=np.int64)
    item_rank = np.zeros(n, dtype=_rank_dtype(cp))
    rank_cost = np.zeros(cp)  # cost placed so far
    if n == 0:
        return item_rank, z, z, z, rank_cost
    top = _top_items(cost, TOP_ROUNDS * cp, TOP_FRACTION * ideal)
    # at most TOP_ROUNDS rounds of cp items on cp ranks: plain Python on small lists (float64 like NumPy's, the same
    # stable order), cheaper than a dozen NumPy calls per round
    r_cost, r_tok = [0.0] * cp, [0] * cp
    need_c, half = need_cost.tolist(), (need_tokens // 2).tolist()
    t_len, t_cost = length[top].tolist(), cost[top].tolist()
    placed: list[int] = []  # rank of every placed top item, in order
    for j in range(0, top.size, cp):
        room = [r_cost[r] - need_c[r] for r in range(cp)]
        by_room = sorted(range(cp), key=room.__getitem__)[: min(cp, top.size - j)]  # most cost still to fill first
        if any(r_tok[r] + t_len[j + i] > half[r] for i, r in enumerate(by_room)):
            break
        for i, r in enumerate(by_room):
            r_cost[r] += t_cost[j + i]
            r_tok[r] += t_len[j + i]
        placed.extend(by_room)
    n_top = len(placed)
    top = top[:n_top]
    rank_cost = np.array(r_cost)
    rank_tokens = np.array(r_tok, dtype=np.int64)
    if n_top:
        item_rank[top] = placed
    m = n - n_top
    if m == 0:
        return item_rank, z, z, z, rank_cost

    N = need_tokens - rank_tokens  # [cp] >= need / 2 >= 0; sums to the tokens of the rest
    K = need_cost - rank_cost  # [cp] cost still needed
    order = _density_order(length, pos0, piece_idx, top)  # [m] the rest by cost per token
    lo = length[order]
    tok = np.cumsum(lo)
    bounds = _strata_bounds(tok, lo, STRATA)
    tok_b = np.where(bounds > 0, tok[np.maximum(bounds - 1, 0)], 0)
    T_g = np.diff(tok_b).astype(np.float64)
    # the stream: stratum after stratum, each in a low-discrepancy order of its items by cost per token, so that any
    # range of it samples the whole stratum; rank r's range of stratum g is [ends[g*cp + r - 1], ends[g*cp + r])
    stream = order[_golden_order(bounds)]
    item_cost = cost[stream]
    prefix = np.cumsum(item_cost)  # the stream's cost up to and with every item
    del item_cost
    C_g = np.diff(np.where(bounds > 0, prefix[np.maximum(bounds - 1, 0)], 0)).astype(np.float64)
    alloc = _tilted_allocation(N, K, T_g, C_g, int(tok[-1]))
    if alloc is None:  # no tilt fits: one stratum, exact token counts only
        bounds = np.array([0, m])
        alloc = N[:, None]
        stream = order[_golden_order(bounds)]
        prefix = np.cumsum(cost[stream])
    item_end = np.cumsum(length[stream])  # the stream's tokens up to and with every item
    ends = np.cumsum(alloc.T.reshape(-1))  # [n_ranges]
    range_start = np.concatenate([[0], ends[:-1]])
    range_rank = np.arange(ends.size, dtype=np.int64) % cp
    # every item's first piece: the range its first token falls in. The first item starting at or after s > 0 is
    # the one after the first item ending at or after s.
    first = np.searchsorted(item_end, range_start, side="left") + 1
    first[range_start == 0] = 0
    item_rank[stream] = np.repeat(range_rank.astype(item_rank.dtype), np.diff(np.append(first, m)))
    # a range that starts strictly inside an item cuts it: an extra piece from there on (of empty ranges starting at
    # the same place, only the last one, which holds the tokens)
    cut, cut_rank = range_start[1:], range_rank[1:]
    last = np.ones(cut.size, dtype=bool)
    last[:-1] = cut[:-1] != cut[1:]
    cut, cut_rank = cut[last], cut_rank[last]
    idx = np.minimum(np.searchsorted(item_end, cut, side="right"), m - 1)  # the item holding each cut
    idx_start = item_end[idx] - length[stream[idx]]
    inside = (cut > idx_start) & (cut < item_end[idx])
    x_item = stream[idx[inside]]
    x_off = cut[inside] - idx_start[inside]
    x_rank = cut_rank[inside]
    # cost of every range: the stream's prefix cost at the range bounds (closed form inside a cut item)
    e = np.append(range_start, ends[-1])
    k = np.minimum(np.searchsorted(item_end, e, side="right"), m - 1)  # the item holding each bound (or the last)
    sk = stream[k]
    p0 = pos0[sk]
    # prefix[k] includes item k: take it off, add the part of it before the bound
    at_bound = (prefix[k] - cost[sk]) + _piece_cost(p0, p0 + (e - (item_end[k] - length[sk])))
    rank_cost += np.bincount(range_rank, weights=np.diff(at_bound).astype(np.float64), minlength=cp)
    return item_rank, x_item, x_off, x_rank, rank_cost


def _contiguous_plan(seg_start: np.ndarray, lengths: np.ndarray, total: int, cp: int):
    """The contiguous placement (rank r holds ``[r T/cp, (r+1) T/cp)``) as a plan: every segment cut at the rank
    boundaries."""
    bounds = np.arange(1, cp, dtype=np.int64) * (total // cp)
    cuts = np.union1d(np.append(seg_start, total), bounds)  # every run boundary, sorted
    run_start, run_len = cuts[:-1], np.diff(cuts)
    offsets = np.searchsorted(run_start, np.append(np.concatenate([[0], bounds]), total), side="left")
    return offsets.astype(np.int64), run_start, run_len


def _merge_sorted(base, extra, at):
    """Arrays ``base[i]`` ``[n]`` with the sorted ``extra[i]`` ``[k]`` inserted before ``base[i][at]`` (``at``
    non-decreasing ``[k]``). Returns the merged arrays and the positions of the extras in them ``[k]``."""
    n, k = base[0].size, at.size
    dest = at + np.arange(k, dtype=np.int64)
    is_base = np.ones(n + k, dtype=bool)
    is_base[dest] = False
    out = []
    for b, x in zip(base, extra):
        merged = np.empty(n + k, dtype=b.dtype)
        merged[is_base] = b
        merged[dest] = x
        out.append(merged)
    return out, dest


def _plan_numpy(cu: np.ndarray, cp: int):
    """Every rank's runs. Returns ``(offsets int64 [cp + 1], run_start int64 [R], run_len int64 [R])``: rank r's
    runs are ``[offsets[r], offsets[r + 1])``, ordered by global position, touching runs of a segment merged.

    Cost: a few passes over the per-segment arrays (two radix sorts of int16 keys, a handful of gathers and cumulative
    sums), plus small work on the few heavy segments and cut pieces."""
    total = int(cu[-1])
    lengths = np.diff(cu)  # [N]
    seg_start = cu[:-1]
    if lengths.size and lengths.min() == 0:  # an empty segment holds no token
        nonempty = lengths > 0
        seg_start, lengths = seg_start[nonempty], lengths[nonempty]
    if total == 0:
        z = np.zeros(0, dtype=np.int64)
        return np.zeros(cp + 1, dtype=np.int64), z, z
    if cp == 1:
        return np.array([0, lengths.size], dtype=np.int64), seg_start.copy(), lengths.copy()
    t_local = total // cp
    n_seg = lengths.size

    cost = lengths + 1  # [N] int64: L (L + 1) / 2, in place
    cost *= lengths
    cost >>= 1
    ideal = float(cost.sum()) / cp
    heavy = np.flatnonzero(cost > SMALL_FRACTION * ideal)  # few
    heavy_len = lengths[heavy]
    heavy_long = heavy_len >= 2 * cp * MIN_CHUNK
    li = heavy[heavy_long]  # long segments
    mid_seg = heavy[~heavy_long & (heavy_len >= 2 * MIN_CHUNK)]  # mid segments
    if li.size:
        l_start, l_len, l_rank, long_tokens, long_cost = _long_runs(seg_start[li], lengths[li], cp)
        keep = np.ones(n_seg, dtype=bool)
        keep[li] = False
        ii = np.flatnonzero(keep)  # the segments that are items (or cut into items)
        mid = np.searchsorted(ii, mid_seg)
    else:
        long_tokens, long_cost = np.zeros(cp, dtype=np.int64), np.zeros(cp, dtype=np.int64)
        ii, mid = None, mid_seg

    # items: short segments whole, mid segments in q pieces of at least MIN_CHUNK tokens and about
    # SMALL_FRACTION * ideal cost each; in position order
    if mid.size:
        ml = lengths[mid_seg]
        q = np.ceil(cost[mid_seg] / (SMALL_FRACTION * ideal)).astype(np.int64)
        q = np.maximum(np.minimum(q, ml // MIN_CHUNK), 1)
        n_items = n_seg if ii is None else ii.size
        q_all = np.ones(n_items, dtype=np.int64)
        q_all[mid] = q
        i_seg = np.repeat(np.arange(n_seg, dtype=np.int64) if ii is None else ii, q_all)  # segment of every item
        i_start, i_len, i_cost = seg_start[i_seg], lengths[i_seg], cost[i_seg]
        m_a, m_len, m_cost, m_owner, m_j = _split_pieces(ml, q)
        slot = (mid + np.cumsum(q - 1) - (q - 1))[m_owner] + m_j  # item index of every mid piece
        i_start[slot] = seg_start[mid_seg][m_owner] + m_a
        i_len[slot], i_cost[slot] = m_len, m_cost
        i_pos0 = np.zeros(i_len.size, dtype=np.int64)
        i_pos0[slot] = m_a
        piece_idx = slot[m_a > 0]  # the items that do not start their segment
    else:
        if ii is None:
            i_start, i_len, i_cost = seg_start, lengths, cost
        else:
            i_start, i_len, i_cost = seg_start[ii], lengths[ii], cost[ii]
        i_pos0 = np.zeros(i_len.size, dtype=np.int64)
        piece_idx = np.zeros(0, dtype=np.int64)
    item_rank, x_item, x_off, x_rank, item_cost = _place_items(
        i_len,
        i_cost,
        i_pos0,
        piece_idx,
        t_local - long_tokens,  # >= 0: long_tokens are floor / ceil of (long total) / cp <= T_local
        ideal - long_cost,
        ideal,
        cp,
    )

    # safety net for tiny maps, where pieces are coarse: never worse than contiguous (also a valid plan)
    bounds = np.arange(cp + 1, dtype=np.int64) * t_local
    k = np.searchsorted(seg_start, bounds, side="right") - 1  # segment holding each rank boundary
    p = bounds - seg_start[k]
    between = np.add.reduceat(cost, k)[:-1]  # cost of the segments k[r] .. k[r+1] - 1 (where k[r] < k[r+1])
    contiguous = np.where(k[1:] > k[:-1], between, 0) + (p * (p + 1) // 2)[1:] - (p * (p + 1) // 2)[:-1]
    if contiguous.max() < (long_cost + item_cost).max():
        return _contiguous_plan(seg_start, lengths, total, cp)

    # the extra runs, each list sorted by position: the pieces cut off items (few: at most STRATA * cp), the long
    # runs; merged into the items (in position order) in one step
    rdt = item_rank.dtype
    e_start, e_len, e_rank = [], [], []
    if x_item.size:
        o = np.lexsort((x_off, x_item))  # by position (few)
        x_item, x_off, x_rank = x_item[o], x_off[o], x_rank[o]
        same_next = np.append(x_item[1:] == x_item[:-1], False)  # the cuts of one item are consecutive
        x_len = np.where(same_next, np.append(x_off[1:], 0), i_len[x_item]) - x_off
        x_start = i_start[x_item] + x_off
        first_cut = np.append(True, x_item[1:] != x_item[:-1])
        if i_len is lengths or i_len is cu:  # never write into the caller's arrays
            i_len = i_len.copy()
        i_len[x_item[first_cut]] = x_off[first_cut]  # the item's first piece ends at its first cut
        e_start.append(x_start), e_len.append(x_len), e_rank.append(x_rank.astype(rdt))
    n_x = x_item.size
    if li.size:
        keep = l_len > 0
        e_start.append(l_start[keep]), e_len.append(l_len[keep]), e_rank.append(l_rank[keep].astype(rdt))
    run_start, run_len, run_rank = i_start, i_len, item_rank
    if e_start:
        es, el, er = (np.concatenate(a) for a in (e_start, e_len, e_rank))
        if len(e_start) > 1:
            o = np.argsort(es, kind="stable")  # two sorted lists: a linear merge
            es, el, er = es[o], el[o], er[o]
            x_at = np.flatnonzero(o < n_x)  # where the cut pieces went
        else:
            x_at = np.arange(n_x)
        at = np.searchsorted(i_start, es, side="right")
        (run_start, run_len, run_rank), dest = _merge_sorted((i_start, i_len, item_rank), (es, el, er), at)
        # a run can join the run before it (same rank, touching) only if it does not start its segment: a cut piece
        # or a mid piece
        cand = np.concatenate([dest[x_at], piece_idx + np.searchsorted(at, piece_idx, side="right")])
    else:
        cand = piece_idx
    cand = cand[cand > 0]
    if cand.size:
        cand.sort()
        joins = cand[
            (run_start[cand - 1] + run_len[cand - 1] == run_start[cand]) & (run_rank[cand - 1] == run_rank[cand])
        ]
        if joins.size:  # chains of joins: every run adds its length to the first run of its chain
            if run_len is i_len and (i_len is lengths or i_len is cu):
                run_len = run_len.copy()
            if run_rank is item_rank:
                run_rank = run_rank.copy()
            chain = joins - np.arange(joins.size)  # constant along a chain of consecutive joins
            head = np.concatenate([[True], chain[1:] != chain[:-1]])
            head_of = joins[head][np.cumsum(head) - 1] - 1
            np.add.at(run_len, head_of, run_len[joins])
            run_rank[joins] = cp  # dropped: sorted past the last rank
    # group by rank, keeping position order inside a rank (a stable radix sort of an int16: O(R))
    o = np.argsort(run_rank, kind="stable")
    offsets = np.zeros(cp + 1, dtype=np.int64)
    np.cumsum(np.bincount(run_rank, minlength=cp + 1)[:cp], out=offsets[1:])
    o = o[: offsets[-1]]
    return offsets, run_start[o], run_len[o]


def _tuning() -> tuple:
    """The module's tuning constants: part of every cache key, so a changed knob never returns an old plan."""
    return (SMALL_FRACTION, MIN_CHUNK, TOP_ROUNDS, TOP_FRACTION, STRATA)


_CacheInfo = namedtuple("CacheInfo", ["hits", "misses", "maxsize", "currsize"])


class _PlanCache:
    """LRU of plans keyed on ``(cu_seqlens content, cp, tuning)``, like ``functools.lru_cache`` (with its
    ``cache_clear`` / ``cache_info``) but without turning ``cu_seqlens`` into ``bytes`` and hashing them (SipHash,
    slower than planning a small map): the key holds a vectorised digest (one pass) and a hit compares the whole
    content, so a digest collision is a miss, never a wrong plan."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: OrderedDict = OrderedDict()  # key -> (cu copy, plan)
        self._weights = np.zeros(0, dtype=np.uint64)
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def _digest(self, cu: np.ndarray) -> int:
        if self._weights.size < cu.size:  # fixed odd pseudo-random weights, grown as needed (deterministic)
            n = max(cu.size, 2 * self._weights.size)
            self._weights = np.random.default_rng(0x5EED).integers(0, 2**63, n, dtype=np.uint64) * 2 + 1
        return int(np.dot(cu.view(np.uint64), self._weights[: cu.size]))  # wraps mod 2**64

    def __call__(self, cu: np.ndarray, cp: int, tuning: tuple):
        with self._lock:
            key = (cu.size, self._digest(cu), cp, tuning)
            entry = self._entries.get(key)
            if entry is not None and np.array_equal(entry[0], cu):
                self._entries.move_to_end(key)
                self.hits += 1
                return entry[1]
            self.misses += 1
        offsets, run_start, run_len = _plan_numpy(cu, cp)  # outside the lock: concurrent misses both plan
        plan = (offsets, torch.from_numpy(run_start), torch.from_numpy(run_len))
        with self._lock:
            self._entries[key] = (cu.copy(), plan)
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return plan

    def cache_info(self):
        return _CacheInfo(self.hits, self.misses, self.maxsize, len(self._entries))

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0


_cached_plan = _PlanCache(_CACHE_SIZE)


def balanced_plan(cu_seqlens: torch.Tensor, *, cp_size: int):
    """Every rank's runs of the ``balanced`` layout, cached per ``(cu_seqlens content, cp_size)``.

    Args:
        cu_seqlens: int ``[N + 1]`` global cumulative segment lengths (CPU or CUDA); ``T = cu_seqlens[-1]`` must be a
            multiple of ``cp_size``.
        cp_size: the context-parallel group size.

    Returns:
        ``(offsets, run_start, run_len)``: ``offsets`` NumPy int64 ``[cp_size + 1]``; ``run_start``, ``run_len`` CPU
        int64 tensors ``[R_total]``, shared with the cache (do not modify); rank r's runs are
        ``run_start[offsets[r]:offsets[r + 1]]``, ordered by global position.

    Raises:
        TypeError / ValueError: a bad ``cu_seqlens`` or ``cp_size``, or ``T % cp_size != 0``.
    """
    cp = _check_cp_size(cp_size)
    cu = _cu_numpy(cu_seqlens)
    check_divisible(int(cu[-1]), cp)
    return _cached_plan(cu, cp, _tuning())


def balanced_runs(cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int):
    """The runs of global tokens rank ``cp_rank`` holds under the ``balanced`` layout (see the module docstring).

    Args:
        cu_seqlens: int ``[N + 1]`` global cumulative segment lengths (the seed's ``cu_seqlens``; any int dtype, CPU
            or CUDA); ``T = cu_seqlens[-1]`` must be a multiple of ``cp_size``.
        cp_size, cp_rank: the context-parallel group size and this rank.

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each on ``cu_seqlens.device``, ordered by global position: runs are
        non-empty, each inside one segment, ``run_len.sum() == T // cp_size`` on every rank, and all ranks' runs
        together cover every token exactly once. Deterministic: a function of the ``cu_seqlens`` values and
        ``cp_size`` only, so every rank computes the same plan on its own.

    Cost: vectorised NumPy over segments (a few sorts), once per distinct ``(cu_seqlens, cp_size)`` (cached); each
    call copies ``cu_seqlens`` to the host to look the plan up (a host sync for a device tensor).
    """
    cp = _check_cp_size(cp_size)
    if not isinstance(cp_rank, int) or isinstance(cp_rank, bool):
        raise TypeError(f"cp_rank must be an int, got {cp_rank!r} ({type(cp_rank).__name__})")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp}), got {cp_rank}")
    offsets, run_start, run_len = balanced_plan(cu_seqlens, cp_size=cp)
    lo, hi = int(offsets[cp_rank]), int(offsets[cp_rank + 1])
    device = cu_seqlens.device
    return run_start[lo:hi].to(device, copy=True), run_len[lo:hi].to(device, copy=True)


# ----------------------------------------------------------------------------------------------------------------
# layout="auto"


def choose_layout(params, *, cp_size: int, rtol: float = 0.01) -> str:
    """The layout ``shard_packed_seq_params(layout="auto")`` uses for this batch.

    Candidates: ``contiguous`` and ``balanced`` (need ``T % cp_size == 0``), ``zigzag`` (needs every segment
    ``% (2 * cp_size) == 0``; this function never pads). The winner has the lowest busiest-rank causal cost
    (``cp_packing.cost``); costs within ``rtol`` of the lowest count as a tie (the model ignores kernel tile
    effects, so a 1% difference is noise), and a tie goes to the layout whose ranks receive fewer K/V bytes under
    the all-gather backend (``LayoutCost.kv_bytes_allgather``, summed over ranks), then to the first in
    ``AUTO_LAYOUTS``. Deterministic (every rank picks the same), cached per ``(cu_seqlens, cp_size, rtol)``, and
    logged at DEBUG level on the ``"cp_packing"`` logger.

    Args:
        params: ``PackedSeqParams`` of the ``[B, S]`` batch.
        cp_size: the context-parallel group size.
        rtol: relative tolerance of a cost tie, ``>= 0``.

    Returns:
        ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.

    Raises:
        TypeError: ``params`` is not ``PackedSeqParams``, or a non-int ``cp_size``.
        ValueError: ``T % cp_size != 0`` (no layout is valid), or a negative ``rtol``.
    """
    from cp_packing.packed_seq import PackedSeqParams

    if not isinstance(params, PackedSeqParams):
        raise TypeError(
            f"params must be PackedSeqParams, got {type(params).__name__}; build it with "
            "packed_seq_params_from_doc_ids(doc_ids)"
        )
    cp = _check_cp_size(cp_size)
    if not isinstance(rtol, (int, float)) or isinstance(rtol, bool) or not rtol >= 0:
        raise ValueError(f"rtol must be a number >= 0, got {rtol!r}")
    cu = _cu_numpy(params.cu_seqlens)
    total = int(cu[-1])
    if total % cp:
        raise ValueError(
            f"no CP layout is valid: the batch has T = B*S = {total} tokens, not a multiple of cp_size={cp} (every "
            f"layout gives each rank T / cp_size tokens); pad the rows to a multiple of {cp} (or of {2 * cp} for "
            f"zigzag: cp_packing.pad_segments(doc_ids, multiple={2 * cp}))"
        )
    name, table = _cached_choice(cu.tobytes(), cp, float(rtol), _tuning())
    if logger.isEnabledFor(logging.DEBUG):
        rows = ", ".join(f"{k}: busiest/mean {im:.4f}, kv {kv / 2**20:.1f} MiB" for k, _, im, kv in table)
        logger.debug("layout='auto' with cp_size=%d picks %r (%s)", cp, name, rows)
    return name


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _cached_choice(cu_bytes: bytes, cp: int, rtol: float, tuning: tuple):
    from cp_packing.cost import _runs_cost_summary

    cu = torch.from_numpy(np.frombuffer(cu_bytes, dtype=np.int64).copy())
    lengths = cu[1:] - cu[:-1]
    candidates = ["contiguous"]
    if bool((lengths % (2 * cp) == 0).all()):
        candidates.append("zigzag")
    candidates.append("balanced")
    table = []  # (name, busiest cost, busiest / mean, kv bytes received under all-gather, summed over ranks)
    for name in candidates:
        busiest, imbalance, kv = _runs_cost_summary(cu, cp, name)
        table.append((name, busiest, imbalance, kv))
    lowest = min(busiest for _, busiest, _, _ in table)
    tied = [row for row in table if row[1] <= lowest * (1.0 + rtol)]
    best = min(tied, key=lambda row: (row[3], AUTO_LAYOUTS.index(row[0])))
    return best[0], tuple(table)
