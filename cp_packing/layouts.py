"""Which global token lives on which context-parallel rank: pure index math, no communication.

A layout maps the global stream (the ``[B, S]`` batch flattened to ``T = B * S`` tokens, cut into segments by
``cu_seqlens``) onto ``cp_size`` ranks, ``T_local = T // cp_size`` tokens each. Every layout is described the same
way, as data: for one rank, a list of *runs* in local order, each run a piece of consecutive global tokens that
lies inside ONE segment::

    run_start  int64 [R]   global flat position of the run's first token
    run_len    int64 [R]   its length (> 0)

``token_index`` (the global position of every local token) is the runs expanded. Because a run never crosses a
segment boundary, a run's keys under causal attention are the global tokens from its segment's start up to the
run's last token, which is what the all-gather attention backend uses for every layout.

Layouts:

* ``contiguous``: rank r holds flat tokens ``[r*T/cp, (r+1)*T/cp)`` (ring-flash-attn's llama3 all-gather varlen).
* ``zigzag``: every segment (padding segments too) is cut into ``2*cp`` equal chunks; rank r holds chunks ``r``
  and ``2*cp-1-r`` of every segment, segment after segment (ring-flash-attn's zigzag varlen, TransformerEngine THD
  context parallelism). Needs every segment length to be a multiple of ``2*cp`` (see ``cp_packing.pad_segments``).
* ``balanced``: see ``cp_packing.planner``; any placement with equal token counts that evens out causal cost.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_packing._checks import check_choice, check_cp, check_cu_seqlens, check_divisible

__all__ = ["LAYOUTS", "layout_runs", "expand_runs", "layout_token_index", "global_token_order"]

LAYOUTS = ("contiguous", "zigzag", "balanced")


def check_layout(layout) -> str:
    return check_choice(layout, "layout", LAYOUTS)


def check_zigzag_divisible(cu_seqlens: torch.Tensor, cp_size: int) -> None:
    """Raise a ValueError naming the first segment whose length is not a multiple of ``2 * cp_size``."""
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


def _contiguous_runs(cu: torch.Tensor, total: int, cp_size: int, cp_rank: int):
    t_local = total // cp_size
    lo, hi = cp_rank * t_local, (cp_rank + 1) * t_local
    if t_local == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=cu.device)
        return empty, empty
    bounds = torch.tensor([lo, hi - 1], dtype=torch.int64, device=cu.device)
    first, last = (torch.searchsorted(cu, bounds, right=True) - 1).tolist()
    seg_lo = cu[first : last + 1]
    seg_hi = cu[first + 1 : last + 2]
    run_start = seg_lo.clamp(min=lo)
    run_len = seg_hi.clamp(max=hi) - run_start
    return run_start, run_len


def _zigzag_runs(cu: torch.Tensor, cp_size: int, cp_rank: int):
    check_zigzag_divisible(cu, cp_size)
    seg_start = cu[:-1]
    chunk = (cu[1:] - seg_start) // (2 * cp_size)
    head = seg_start + cp_rank * chunk
    if cp_rank == cp_size - 1:  # chunks cp-1 and cp touch: one run per segment (runs are maximal pieces)
        return head, 2 * chunk
    tail = seg_start + (2 * cp_size - 1 - cp_rank) * chunk
    run_start = torch.stack([head, tail], dim=1).reshape(-1)
    run_len = torch.stack([chunk, chunk], dim=1).reshape(-1)
    return run_start, run_len


def layout_runs(cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, layout: str):
    """The runs of global tokens that rank ``cp_rank`` holds, in local order.

    Args:
        cu_seqlens: int ``[num_segments + 1]`` global cumulative segment lengths (the seed's).
        cp_size, cp_rank: the context-parallel group size and this rank.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each: every run lies inside one segment, runs are non-empty and
        ``run_len.sum() == T // cp_size``.
    """
    check_cp(cp_size, cp_rank)
    check_layout(layout)
    total = int(check_cu_seqlens(cu_seqlens)[-1])
    cu = cu_seqlens.to(torch.int64)
    check_divisible(total, cp_size)
    if layout == "contiguous":
        return _contiguous_runs(cu, total, cp_size, cp_rank)
    if layout == "zigzag":
        return _zigzag_runs(cu, cp_size, cp_rank)
    from cp_packing.planner import balanced_runs  # pure index math; imported lazily (it is the larger module)

    return balanced_runs(cu, cp_size=cp_size, cp_rank=cp_rank)


def expand_runs(run_start: torch.Tensor, run_len: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: each run ``i`` laid out as ``run_start[i], run_start[i] + 1, ...`` (``run_len[i]`` values),
    runs end to end. With global run starts this is ``token_index``; with starts relative to the segment, it is
    ``position_ids``.

    CPU: one NumPy ``cumsum`` over a buffer of ones with a jump at each run start (about one pass over the output).
    Other devices: ``arange + repeat_interleave`` (no host sync: ``total`` is given).
    """
    if run_start.device.type != "cpu":
        local_start = torch.cumsum(run_len, 0) - run_len
        offsets = run_start - local_start
        return torch.arange(total, dtype=torch.int64, device=run_start.device) + torch.repeat_interleave(
            offsets, run_len, output_size=total
        )
    starts = run_start.numpy().astype(np.int64, copy=False)
    lens = run_len.numpy().astype(np.int64, copy=False)
    if lens.size and lens.min() <= 0:  # empty runs would collide at one output position
        keep = lens > 0
        starts, lens = starts[keep], lens[keep]
    result = torch.empty(total, dtype=torch.int64)  # torch's allocator reuses warm memory; np.ones page-faults
    out = result.numpy()
    out.fill(1)
    if lens.size:
        local_start = np.cumsum(lens) - lens
        out[local_start[0]] = starts[0]
        # the jump from the previous run's last value to this run's first value
        out[local_start[1:]] = starts[1:] - (starts[:-1] + lens[:-1] - 1)
        np.cumsum(out, out=out)
    return result


def layout_token_index(cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, layout: str) -> torch.Tensor:
    """int64 ``[T_local]``: global flat position of each token that rank ``cp_rank`` holds, in local order."""
    run_start, run_len = layout_runs(cu_seqlens, cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    total = int(cu_seqlens[-1]) // cp_size if cu_seqlens.numel() else 0
    return expand_runs(run_start, run_len, total)


def global_token_order(cu_seqlens: torch.Tensor, *, cp_size: int, layout: str) -> torch.Tensor:
    """int64 ``[cp_size, T_local]``: row r is rank r's ``token_index``. Every global token appears exactly once,
    so the flattened tensor is a permutation of ``range(T)``: the order of an all-gather over the CP group."""
    return torch.stack(
        [layout_token_index(cu_seqlens, cp_size=cp_size, cp_rank=r, layout=layout) for r in range(cp_size)]
    )
