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

``RUNS`` maps each layout name to its pure runs function ``(cu_seqlens, *, cp_size, cp_rank, window=None) ->
(run_start, run_len)``, one module each: ``contiguous`` (``layouts/contiguous.py``), ``zigzag`` (``layouts/zigzag.py``)
and ``balanced`` (``layouts/balanced.py``, the one whose placement depends on the attention's sliding ``window``: it
balances ``sum min(p + 1, window)``; ``layouts/work.py`` has the closed forms). Choosing one per batch
(``layout="auto"``) is the cost model's job (``cp_packing.cost.choose_layout``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from cp_packing._checks import check_choice, check_cp, check_cu_seqlens, check_divisible, check_windows
from cp_packing.layouts.balanced import balanced_runs
from cp_packing.layouts.contiguous import contiguous_runs
from cp_packing.layouts.local import local_runs
from cp_packing.layouts.zigzag import check_zigzag_divisible, zigzag_runs

__all__ = [
    "LAYOUTS",
    "RUNS",
    "check_layout",
    "check_zigzag_divisible",
    "layout_runs",
    "expand_runs",
    "layout_token_index",
    "global_token_order",
]

RunsFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]

#: Layout name -> pure runs function ``(cu_seqlens int64, *, cp_size, cp_rank, window) -> (run_start, run_len)``.
RUNS: dict[str, RunsFn] = {
    "contiguous": contiguous_runs, "zigzag": zigzag_runs, "balanced": balanced_runs, "local": local_runs,
}

#: The layout names, in order of preference on a tie (``choose_layout``).
LAYOUTS = tuple(RUNS)


def check_layout(layout: object) -> str:
    """``layout`` if it names a layout of ``LAYOUTS``; else a ValueError listing them.

    >>> check_layout("zigzag")
    'zigzag'
    """
    return check_choice(layout, "layout", LAYOUTS)


def layout_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, layout: str, window: object = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs of global tokens that rank ``cp_rank`` holds, in local order.

    Args:
        cu_seqlens: int ``[num_segments + 1]`` global cumulative segment lengths (the seed's).
        cp_size, cp_rank: the context-parallel group size and this rank.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"balanced"``.
        window: the attention's sliding window (``None``, an int or a per-layer list of ``int | None``) that
            ``balanced`` plans for; the other layouts do not depend on it. Every rank must pass the same.

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each on ``cu_seqlens.device``: every run lies inside one segment and
        ``run_len.sum() == T // cp_size``.

    Raises:
        TypeError / ValueError: a bad ``cu_seqlens``, ``cp_size``, ``cp_rank``, ``layout`` or ``window``; ``T`` not
        divisible by ``cp_size``; for zigzag, a segment not divisible by ``2 * cp_size``.

    >>> layout_runs(torch.tensor([0, 4, 8]), cp_size=2, cp_rank=0, layout="contiguous")
    (tensor([0]), tensor([4]))
    """
    check_cp(cp_size, cp_rank)
    check_layout(layout)
    window = check_windows(window)
    total = int(check_cu_seqlens(cu_seqlens)[-1])
    check_divisible(total, cp_size)
    return RUNS[layout](cu_seqlens.to(torch.int64), cp_size=cp_size, cp_rank=cp_rank, window=window)


def expand_runs(run_start: torch.Tensor, run_len: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: each run ``i`` laid out as ``run_start[i], run_start[i] + 1, ...`` (``run_len[i]`` values),
    runs end to end. With global run starts this is ``token_index``; with starts relative to the segment, it is
    ``position_ids``.

    CPU: one NumPy ``cumsum`` over a buffer of ones with a jump at each run start (about one pass over the output).
    Other devices: ``arange + repeat_interleave`` (no host sync: ``total`` is given).

    >>> expand_runs(torch.tensor([5, 0]), torch.tensor([2, 3]), 5)
    tensor([5, 6, 0, 1, 2])
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


def layout_token_index(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, layout: str, window: object = None
) -> torch.Tensor:
    """int64 ``[T_local]``: global flat position of each token that rank ``cp_rank`` holds, in local order
    (``window``: as in ``layout_runs``).

    >>> layout_token_index(torch.tensor([0, 8]), cp_size=2, cp_rank=0, layout="zigzag")
    tensor([0, 1, 6, 7])
    """
    run_start, run_len = layout_runs(cu_seqlens, cp_size=cp_size, cp_rank=cp_rank, layout=layout, window=window)
    total = int(cu_seqlens[-1]) // cp_size
    return expand_runs(run_start, run_len, total)


def global_token_order(
    cu_seqlens: torch.Tensor, *, cp_size: int, layout: str, window: object = None
) -> torch.Tensor:
    """int64 ``[cp_size, T_local]``: row r is rank r's ``token_index`` (``window``: as in ``layout_runs``).

    Every global token appears exactly once, so the flattened tensor is a permutation of ``range(T)``: the order of
    an all-gather over the CP group.

    >>> global_token_order(torch.tensor([0, 4]), cp_size=2, layout="zigzag")
    tensor([[0, 3],
            [1, 2]])
    """
    return torch.stack(
        [layout_token_index(cu_seqlens, cp_size=cp_size, cp_rank=r, layout=layout, window=window)
         for r in range(cp_size)]
    )
