"""Attention work per token, with or without a sliding window: the closed forms the ``balanced`` planner and the cost
model (``cp_packing.cost``) share. Pure NumPy int64.

Under causal attention a token at position ``p`` of its segment attends ``p + 1`` keys; under a sliding window ``w``
(HF's ``sliding_window``: keys ``p - w < k <= p``) it attends ``min(p + 1, w)``. Its work is that count, so the
positions ``0 .. p-1`` of a segment cost the *head* ``sum_{i<p} min(i + 1, w)`` = ``m(m+1)/2 + (p - m) w`` with
``m = min(p, w)`` (``p(p+1)/2`` without a window)::

    cost per token     full causal   /|          window w   ___________
                                    / |                    /
                                   /  |                   /
                    position  0 ------ L           0 --- w ---------- L

A model that mixes sliding and global layers (Gemma 2, Qwen2 with ``max_window_layers``) does the sum over its
layers: a per-layer window is kept as its *weights*, every distinct window with the number of layers that use it,
``((w, count), ...)``, ``None`` for global layers. A window at least as long as every segment is no window at all
(``min(p + 1, w) = p + 1``) and is merged into ``None``.
"""

from __future__ import annotations

import math

import numpy as np

from cp_packing._checks import check_windows

__all__ = ["WindowWeights", "window_weights", "head_cost", "range_cost"]

#: ``((window or None, number of layers), ...)``: distinct windows, sorted (``None`` last), counts ``>= 1``.
WindowWeights = tuple[tuple["int | None", int], ...]


def window_weights(window: object, *, max_seqlen: int | None = None, reduce: bool = False) -> WindowWeights:
    """The distinct windows of ``window`` (``None``, an int or a per-layer list, see ``check_windows``) with the number
    of layers that use each: a hashable key for caches and the weights of ``head_cost``.

    Args:
        window: ``None``, an int ``>= 1`` or a per-layer list/tuple of ``int | None``.
        max_seqlen: the longest segment: a window ``>= max_seqlen`` is merged into ``None`` (it changes no cost).
        reduce: divide the counts by their gcd (the costs scale by a constant: plans and choices do not change), so
            ``[w] * 32`` and ``w``, or ``[w, None] * 13`` and ``[None, w]``, give one key.

    Returns:
        ``((w, count), ...)`` sorted by window, ``None`` last.

    >>> window_weights([4096, None, 4096]), window_weights(8, max_seqlen=6), window_weights([4, None] * 3, reduce=True)
    (((4096, 2), (None, 1)), ((None, 1),), ((4, 1), (None, 1)))
    """
    window = check_windows(window)
    layers = window if isinstance(window, tuple) else (window,)
    counts: dict[int | None, int] = {}
    for w in layers:
        if w is not None and max_seqlen is not None and w >= max_seqlen:
            w = None
        counts[w] = counts.get(w, 0) + 1
    if reduce:
        g = math.gcd(*counts.values())
        counts = {w: c // g for w, c in counts.items()}
    return tuple(sorted(counts.items(), key=lambda wc: (wc[0] is None, wc[0] or 0)))


def head_cost(p: np.ndarray, weights: WindowWeights) -> np.ndarray:
    """int64 cost of the positions ``0 .. p-1`` of a segment, summed over the layers of ``weights``: per layer
    ``p(p+1)/2`` without a window, ``m(m+1)/2 + (p - m) w`` with ``m = min(p, w)`` under a window ``w``.

    Args:
        p: int64 array (any shape), ``p >= 0``.
        weights: from ``window_weights``.

    >>> head_cost(np.array([0, 1, 4, 6]), ((None, 1),)).tolist(), head_cost(np.array([4, 6]), ((2, 1),)).tolist()
    ([0, 1, 10, 21], [7, 11])
    """
    out = None
    for w, count in weights:
        if w is None:
            part = p * (p + 1) // 2
        else:
            m = np.minimum(p, w)
            part = m * (m + 1) // 2 + (p - m) * w
        part = part * count if count != 1 else part
        out = part if out is None else out + part
    return out


def range_cost(a: np.ndarray, b: np.ndarray, weights: WindowWeights) -> np.ndarray:
    """int64 cost of positions ``a .. b-1`` of a segment: ``head_cost(b) - head_cost(a)``.

    >>> a, b = np.array([2]), np.array([5])
    >>> range_cost(a, b, ((None, 1),)).tolist(), range_cost(a, b, ((2, 1),)).tolist()
    ([12], [6])
    """
    return head_cost(b, weights) - head_cost(a, weights)
