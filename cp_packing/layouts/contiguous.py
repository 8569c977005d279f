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

import torch

__all__ = ["contiguous_runs"]


def contiguous_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, window: object = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``cp_rank``'s runs under ``contiguous``: its flat range cut at the segment boundaries.

    Args:
        cu_seqlens: int64 ``[N + 1]`` global cumulative segment lengths, ``T = cu_seqlens[-1]`` divisible by
            ``cp_size`` (checked by ``cp_packing.layouts.layout_runs``).
        cp_size, cp_rank: the CP group size and this rank.
        window: ignored: a fixed placement, whatever the cost (the runs functions share one signature).

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each, in local order (= global order).

    >>> contiguous_runs(torch.tensor([0, 7, 10, 12]), cp_size=3, cp_rank=1)
    (tensor([4, 7]), tensor([3, 1]))
    """
    cu = cu_seqlens
    t_local = int(cu[-1]) // cp_size
    if t_local == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=cu.device)
        return empty, empty
    lo, hi = cp_rank * t_local, (cp_rank + 1) * t_local
    bounds = torch.tensor([lo, hi - 1], dtype=torch.int64, device=cu.device)
    first, last = (torch.searchsorted(cu, bounds, right=True) - 1).tolist()  # segments holding the first/last token
    run_start = cu[first : last + 1].clamp(min=lo)
    run_len = cu[first + 1 : last + 2].clamp(max=hi) - run_start
    return run_start, run_len
