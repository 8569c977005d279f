"""The ``zigzag`` layout: every segment is cut into ``2 * cp`` equal chunks; rank r holds chunks ``r`` and
``2cp - 1 - r`` of EVERY segment, segment after segment.

An early chunk and a late chunk cost the same on every rank (exactly: ``c (L + 1)`` for chunk length ``c``), so the
causal work is even; the price is that every segment length must be a multiple of ``2 * cp``
(``cp_packing.pad_segments`` pads documents). The layout of ring-flash-attn's zigzag varlen kernel and of
TransformerEngine's THD context parallelism. Picture, one segment of 8 tokens, ``cp = 2`` (chunks of 2)::

    position  0 1 | 2 3 | 4 5 | 6 7
    chunk       0     1     2     3
    rank        0     1     1     0      rank 0: chunks 0 and 3 (2 runs); rank 1: chunks 1 and 2 (they touch: 1 run)
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["zigzag_plan", "check_zigzag_divisible"]


def check_zigzag_divisible(cu_seqlens: torch.Tensor, cp_size: int) -> None:
    """Raise a ValueError naming the first segment whose length is not a multiple of ``2 * cp_size``.

    >>> check_zigzag_divisible(torch.tensor([0, 4, 8]), 2)  # both segments are multiples of 4: passes
    """
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    bad = torch.nonzero(lengths % (2 * cp_size)).view(-1)
    if bad.numel():
        k = int(bad[0])
        start, end = int(cu[k]), int(cu[k + 1])
        raise ValueError(
            f"layout 'zigzag': segment {k} (positions {start}..{end - 1}) has length {end - start}, not divisible by "
            f"2*cp_size={2 * cp_size} ({bad.numel()} segment(s) are off); pad every document with "
            f"cp_packing.pad_segments(doc_ids, multiple={2 * cp_size}, ...) or use layout='contiguous'"
        )


def zigzag_plan(cu: np.ndarray, cp_size: int, window: object = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's runs under ``zigzag``: chunks ``r`` and ``2cp-1-r`` of every segment, segment after segment
    (one run per segment on the last rank, whose two chunks touch).

    Args:
        cu: int64 ``[N + 1]``; every segment length a multiple of ``2 * cp_size`` (checked by the caller,
            ``check_zigzag_divisible``).
        cp_size: the CP group size.
        window: ignored (a fixed placement; the plan functions share one signature).

    Returns:
        ``(offsets [cp + 1], run_start [R], run_len [R])`` int64. Memory O(T / 2): a segment has >= 2cp tokens.

    >>> [a.tolist() for a in zigzag_plan(np.array([0, 8]), 2)]
    [[0, 2, 3], [0, 6, 2], [2, 2, 4]]
    """
    seg_start = cu[:-1][np.diff(cu) > 0]
    chunk = np.diff(cu)[np.diff(cu) > 0] // (2 * cp_size)  # [N]
    ranks = np.arange(cp_size, dtype=np.int64)
    head = seg_start[None, :] + ranks[:, None] * chunk[None, :]  # [cp, N]
    tail = seg_start[None, :] + (2 * cp_size - 1 - ranks)[:, None] * chunk[None, :]
    pair_start = np.stack([head, tail], axis=2)  # [cp, N, 2]
    pair_len = np.broadcast_to(chunk[None, :, None], pair_start.shape).copy()
    pair_len[-1, :, 0] *= 2  # the last rank's two chunks touch: one run
    keep = np.ones(pair_start.shape, dtype=bool)
    keep[-1, :, 1] = False
    keep &= pair_len > 0
    counts = keep.reshape(cp_size, -1).sum(axis=1)
    offsets = np.zeros(cp_size + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets, pair_start[keep], pair_len[keep]

