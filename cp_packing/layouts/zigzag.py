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

import torch

__all__ = ["zigzag_runs", "check_zigzag_divisible"]


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


def zigzag_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, window: object = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``cp_rank``'s runs under ``zigzag``: chunks ``r`` and ``2cp-1-r`` of every segment (one run on the last
    rank, whose two chunks touch).

    Args:
        cu_seqlens: int64 ``[N + 1]``; every segment length must be a multiple of ``2 * cp_size`` (else a ValueError
            naming the first segment that is not).
        cp_size, cp_rank: the CP group size and this rank.
        window: ignored: a fixed placement, whatever the cost (the runs functions share one signature).

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each, segment after segment.

    >>> zigzag_runs(torch.tensor([0, 8]), cp_size=2, cp_rank=0)
    (tensor([0, 6]), tensor([2, 2]))
    """
    check_zigzag_divisible(cu_seqlens, cp_size)
    cu = cu_seqlens
    seg_start = cu[:-1]
    chunk = (cu[1:] - seg_start) // (2 * cp_size)
    head = seg_start + cp_rank * chunk
    if cp_rank == cp_size - 1:  # chunks cp-1 and cp touch: one run per segment (runs are maximal pieces)
        return head, 2 * chunk
    tail = seg_start + (2 * cp_size - 1 - cp_rank) * chunk
    run_start = torch.stack([head, tail], dim=1).reshape(-1)
    run_len = torch.stack([chunk, chunk], dim=1).reshape(-1)
    return run_start, run_len
