"""The ``contiguous`` layout: rank r holds the flat tokens ``[r * T/cp, (r + 1) * T/cp)``.

The layout of ring-flash-attn's llama3 all-gather varlen kernel. Cheap (one run per segment it touches, few K/V
bytes to gather) but uneven under causal attention: the late, expensive tokens of a long document land on one
rank. Picture, ``T = 12``, ``cp = 3``, segments ``A`` (7 tokens), ``B`` (3), ``C`` (2)::

    flat    0 1 2 3 4 5 6 | 7 8 9 | 10 11
    segment A A A A A A A   B B B    C  C
    rank    0 0 0 0 1 1 1   1 2 2    2  2
    runs    r0: A[0:4]   r1: A[4:7] B[0:1]   r2: B[1:3] C[0:2]
"""

from __future__ import annotations

import numpy as np

__all__ = ["contiguous_plan"]


def contiguous_plan(cu: np.ndarray, cp_size: int, window: object = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's runs under ``contiguous``: the stream cut at the segment and rank boundaries.

    Args:
        cu: int64 ``[N + 1]`` global cumulative segment lengths, ``T = cu[-1]`` divisible by ``cp_size``.
        cp_size: the CP group size.
        window: ignored (a fixed placement; the plan functions share one signature).

    Returns:
        ``(offsets [cp + 1], run_start [R], run_len [R])`` int64: rank r's runs are ``[offsets[r], offsets[r + 1])``.

    >>> [a.tolist() for a in contiguous_plan(np.array([0, 7, 10, 12]), 3)]
    [[0, 1, 3, 5], [0, 4, 7, 8, 10], [4, 3, 1, 2, 2]]
    """
    total = int(cu[-1])
    t_local = total // cp_size
    bounds = np.arange(cp_size + 1, dtype=np.int64) * t_local
    cuts = np.union1d(cu, bounds)
    run_start, run_len = cuts[:-1], np.diff(cuts)
    keep = run_len > 0
    run_start, run_len = run_start[keep], run_len[keep]
    offsets = np.searchsorted(run_start, bounds, side="left").astype(np.int64)
    offsets[-1] = run_start.size
    return offsets, run_start, run_len

