"""``layout="auto"``: the layout with the least busiest-rank work, priced on every layout's plan. Pure NumPy.

A rank's work is the causal cost of its runs (``cp_packing.layouts.work``: ``sum min(p + 1, w)`` per layer); a
tie (within ``rtol``) goes to the layout whose ranks need fewer keys from the others (``cp_packing.layouts.need``),
then to the first of ``LAYOUTS``. ``zigzag`` is a candidate only where every segment is a multiple of ``2 * cp``
(this never pads).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

from cp_packing._checks import check_cp, check_cu_seqlens, check_divisible, check_number, check_windows
from cp_packing.layouts import LAYOUTS, WINDOWED_LAYOUTS, LayoutPlan, layout_plan
from cp_packing.layouts.balanced import planned_weights
from cp_packing.layouts.need import need_tokens
from cp_packing.layouts.work import range_cost, window_weights

__all__ = ["choose_layout_of_cu", "plan_rank_cost"]

logger = logging.getLogger("cp_packing")


def plan_rank_cost(plan: LayoutPlan, cu: np.ndarray, window: object = None) -> np.ndarray:
    """int64 ``[cp]``: the causal cost of every rank's runs (summed over the layers of a per-layer ``window``).

    >>> plan = layout_plan(torch.tensor([0, 4]), cp_size=2, layout="contiguous")
    >>> plan_rank_cost(plan, np.array([0, 4])).tolist()
    [3, 7]
    """
    seg = np.searchsorted(cu, plan.run_start, side="right") - 1
    pos0 = plan.run_start - cu[seg]
    cost = range_cost(pos0, pos0 + plan.run_len, window_weights(window))
    return np.bincount(plan.run_rank(), weights=cost, minlength=plan.cp_size).astype(np.int64)


@functools.lru_cache(maxsize=16)
def _cached_choice(cu_bytes: bytes, cp: int, rtol: float, window: object) -> tuple[str, tuple]:
    cu = np.frombuffer(cu_bytes, dtype=np.int64)
    cu_t = torch.from_numpy(cu.copy())
    table = []  # (name, busiest cost, busiest / mean, keys needed from other ranks, summed over ranks)
    for name in LAYOUTS:
        if name == "zigzag" and np.any(np.diff(cu) % (2 * cp)):
            continue
        plan = layout_plan(cu_t, cp_size=cp, layout=name, window=window if name in WINDOWED_LAYOUTS else None)
        rank_cost = plan_rank_cost(plan, cu, window)
        mean = rank_cost.sum() / cp
        busiest = int(rank_cost.max()) if rank_cost.size else 0
        table.append((name, busiest, busiest / mean if mean > 0 else 1.0, int(need_tokens(plan, cu).sum())))
    lowest = min(row[1] for row in table)
    tied = [row for row in table if row[1] <= lowest * (1.0 + rtol)]
    best = min(tied, key=lambda row: (row[3], LAYOUTS.index(row[0])))
    return best[0], tuple(table)


def choose_layout_of_cu(cu_seqlens: torch.Tensor, *, cp_size: int, rtol: float = 0.01, window: object = None) -> str:
    """The layout ``layout="auto"`` picks for a batch's ``cu_seqlens`` (module docstring); deterministic, cached.

    >>> choose_layout_of_cu(torch.tensor([0, 8]), cp_size=2)
    'zigzag'
    """
    check_cp(cp_size)
    rtol = check_number(rtol, "rtol", min=0.0)
    window = check_windows(window)
    cu = check_cu_seqlens(cu_seqlens)
    if int(cu[-1]) % cp_size:
        raise ValueError(
            f"no CP layout is valid: the batch has T = B*S = {int(cu[-1])} tokens, not divisible by cp_size={cp_size} "
            f"(every layout gives each rank T / cp_size tokens); pad the rows to a multiple of {cp_size} (or of "
            f"{2 * cp_size} for zigzag: cp_packing.pad_segments(doc_ids, multiple={2 * cp_size}))"
        )
    check_divisible(int(cu[-1]), cp_size)
    planned_weights(cu, cp_size, window)  # the int64 bound of the windowed cost
    name, table = _cached_choice(cu.tobytes(), cp_size, rtol, window)
    if logger.isEnabledFor(logging.DEBUG):
        rows = ", ".join(f"{k}: busiest/mean {im:.4f}, keys needed {kv}" for k, _, im, kv in table)
        logger.debug("layout='auto' with cp_size=%d picks %r (%s)", cp_size, name, rows)
    return name
