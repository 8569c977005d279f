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

``PLANS``, the one registry, maps each layout name to its pure all-ranks plan function (one module each:
``contiguous``, ``zigzag``, ``balanced``, ``local``; ``balanced`` and ``local`` depend on the attention's sliding
``window``, ``layouts/work.py`` has the closed forms). A layout is a name or a small frozen object that carries its
parameters (``Local(tolerance=)``). :func:`layout_plan` validates a plan and caches it (the one plan cache); a rank's
runs are its slice (``layout_plan(...).runs(rank)``, :func:`layout_runs`). ``layout="auto"`` is
``layouts/choose.py`` (docs/layouts.md, docs/balance.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from cp_packing._checks import check_choice, check_cp, check_cu_seqlens, check_divisible, check_windows
from cp_packing.layouts.balanced import balanced_plan, balanced_plan_arrays, planned_weights
from cp_packing.layouts.contiguous import contiguous_plan
from cp_packing.layouts.local import Local, local_plan, local_plan_arrays
from cp_packing.layouts.zigzag import check_zigzag_divisible, zigzag_plan

__all__ = [
    "LAYOUTS",
    "Local",
    "PLANS",
    "LayoutPlan",
    "check_layout",
    "check_zigzag_divisible",
    "expand_runs",
    "global_token_order",
    "layout_plan",
    "layout_runs",
    "layout_token_index",
]

PlanFn = Callable[..., "tuple[np.ndarray, np.ndarray, np.ndarray]"]

#: Layout name -> pure all-ranks plan function ``(cu int64 [N + 1] NumPy, cp_size, weights, **options) ->
#: (offsets [cp + 1], run_start [R], run_len [R])``: rank r's runs are ``[offsets[r], offsets[r + 1])``, ordered by
#: position. ``weights`` is ``balanced.planned_weights(cu, cp_size, window)`` for the layouts of ``WINDOWED_LAYOUTS``,
#: else None. Not cached: ``layout_plan`` holds the one plan cache.
PLANS: dict[str, PlanFn] = {"contiguous": contiguous_plan, "zigzag": zigzag_plan, "balanced": balanced_plan_arrays,
                           "local": local_plan_arrays}

#: The layout names, in order of preference on a tie (``choose_layout``).
LAYOUTS = tuple(PLANS)

#: Layouts whose placement depends on the sliding window.
WINDOWED_LAYOUTS = ("balanced", "local")


def check_layout(layout: object) -> str | Local:
    """``layout`` if it names a layout of ``LAYOUTS`` or is a layout object (:class:`Local`); else a ValueError
    listing them.

    >>> check_layout("zigzag")
    'zigzag'
    """
    return layout if isinstance(layout, Local) else check_choice(layout, "layout", LAYOUTS)


@dataclass(frozen=True, eq=False)
class LayoutPlan:
    """Every rank's runs of one layout on one batch (read-only NumPy int64; shared: hand out copies).

    Attributes:
        layout, cp_size: the layout's name and the CP group size.
        offsets: ``[cp + 1]``: rank r's runs are ``[offsets[r], offsets[r + 1])``.
        run_start, run_len: ``[R]``: global start and length of every run, each inside one segment, ranks in order,
            a rank's runs ordered by position.
        total: ``T``, the stream's length.
    """

    layout: str
    cp_size: int
    offsets: np.ndarray
    run_start: np.ndarray
    run_len: np.ndarray
    total: int

    @property
    def t_local(self) -> int:
        """Tokens per rank, ``T // cp_size``."""
        return self.total // self.cp_size

    def runs(self, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank ``cp_rank``'s ``(run_start, run_len)`` (read-only views)."""
        lo, hi = int(self.offsets[cp_rank]), int(self.offsets[cp_rank + 1])
        return self.run_start[lo:hi], self.run_len[lo:hi]

    def run_rank(self) -> np.ndarray:
        """int64 ``[R]``: the rank of every run."""
        return np.repeat(np.arange(self.cp_size, dtype=np.int64), np.diff(self.offsets))

    def token_order(self) -> np.ndarray:
        """int64 ``[cp, T_local]``: row r is rank r's ``token_index`` (one pass over T, all ranks at once)."""
        out = expand_runs(torch.from_numpy(self.run_start.copy()), torch.from_numpy(self.run_len.copy()), self.total)
        return out.numpy().reshape(self.cp_size, self.t_local)


@functools.lru_cache(maxsize=16)
def _cached_plan(cu_bytes: bytes, cp_size: int, layout: str, weights: object, options: tuple = ()) -> LayoutPlan:
    """The one plan cache of the library (``options``: the layout's parameters, ``(name, value)`` pairs)."""
    cu = np.frombuffer(cu_bytes, dtype=np.int64)
    if int(cu[-1]) == 0:
        z = np.zeros(0, dtype=np.int64)
        offsets, run_start, run_len = np.zeros(cp_size + 1, dtype=np.int64), z, z
    else:
        offsets, run_start, run_len = PLANS[layout](cu, cp_size, weights, **dict(options))
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (offsets, run_start, run_len)]
    for a in arrays:
        a.flags.writeable = False
    return LayoutPlan(layout, cp_size, *arrays, int(cu[-1]))


for _fn in (balanced_plan, local_plan):  # functools' hit/miss counts of the one cache, under the old names
    _fn.cache_info, _fn.cache_clear = _cached_plan.cache_info, _cached_plan.cache_clear  # type: ignore[attr-defined]


def layout_plan(cu_seqlens: torch.Tensor, *, cp_size: int, layout: str | Local, window: object = None) -> LayoutPlan:
    """Every rank's runs of ``layout`` on this batch: validated once, planned once per ``(cu_seqlens values,
    cp_size, layout and its parameters, window)`` (cached), a host copy of ``cu_seqlens`` per call.

    Args:
        cu_seqlens: int ``[num_segments + 1]`` global cumulative segment lengths (the seed's; CPU or CUDA).
        cp_size: the context-parallel group size.
        layout: one of :data:`LAYOUTS` (``"contiguous"``, ``"zigzag"``, ``"balanced"``, ``"local"``), or a layout
            object that carries its parameters (``Local(tolerance=)``).
        window: the attention's sliding window(s) that window-aware layouts (``balanced``, ``local``) plan for
            (``None``, an int or a per-layer list of ``int | None``); the others do not depend on it.

    Returns:
        :class:`LayoutPlan`.

    Raises:
        TypeError / ValueError: a bad ``cu_seqlens``, ``cp_size``, ``layout`` or ``window``; ``T`` not divisible by
        ``cp_size``; for zigzag, a segment not divisible by ``2 * cp_size``.

    >>> plan = layout_plan(torch.tensor([0, 4, 8]), cp_size=2, layout="zigzag")
    >>> plan.offsets.tolist(), plan.run_start.tolist(), plan.run_len.tolist()
    ([0, 4, 6], [0, 3, 4, 7, 1, 5], [1, 1, 1, 1, 2, 2])
    """
    check_cp(cp_size)
    check_layout(layout)
    name, options = (layout.name, layout.options()) if isinstance(layout, Local) else (layout, ())
    window = check_windows(window)
    cu = check_cu_seqlens(cu_seqlens)
    check_divisible(int(cu[-1]), cp_size)
    if name == "zigzag":
        check_zigzag_divisible(torch.from_numpy(cu), cp_size)
    weights = planned_weights(cu, cp_size, window) if name in WINDOWED_LAYOUTS else None
    return _cached_plan(cu.tobytes(), cp_size, name, weights, options)


def layout_runs(
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, layout: str | Local, window: object = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs of global tokens that rank ``cp_rank`` holds, in local order: a slice of :func:`layout_plan`.

    Returns:
        ``(run_start, run_len)``, int64 ``[R]`` each on ``cu_seqlens.device``: every run lies inside one segment and
        ``run_len.sum() == T // cp_size``.

    >>> layout_runs(torch.tensor([0, 4, 8]), cp_size=2, cp_rank=0, layout="contiguous")
    (tensor([0]), tensor([4]))
    """
    check_cp(cp_size, cp_rank)
    plan = layout_plan(cu_seqlens, cp_size=cp_size, layout=layout, window=window)
    run_start, run_len = plan.runs(cp_rank)
    device = cu_seqlens.device
    return torch.from_numpy(run_start.copy()).to(device), torch.from_numpy(run_len.copy()).to(device)


def expand_runs(run_start: torch.Tensor, run_len: torch.Tensor, total: int) -> torch.Tensor:
    """int64 ``[total]``: each run ``i`` laid out as ``run_start[i], run_start[i] + 1, ...`` (``run_len[i]`` values),
    runs end to end. With global run starts this is ``token_index``; with starts relative to the segment, it is
    ``position_ids``.

    CPU: one NumPy ``cumsum`` over a buffer of ones with a jump at each run start (about one pass over the output).
    Other devices: ``arange + repeat_interleave`` (no host sync: ``total`` is given, and trusted).

    Raises:
        ValueError (CPU): a negative run length, or lengths that do not sum to ``total``.

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
    if (lens.size and lens.min() < 0) or int(lens.sum()) != total:  # runs must tile [0, total) end to end
        raise ValueError(f"expand_runs: the run lengths {lens[:8].tolist()}{'...' if lens.size > 8 else ''} must be "
                         f">= 0 and sum to total={total} (each output position in exactly one run), got sum "
                         f"{int(lens.sum())}; pass total=int(run_len.sum())")
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
    cu_seqlens: torch.Tensor, *, cp_size: int, cp_rank: int, layout: str | Local, window: object = None
) -> torch.Tensor:
    """int64 ``[T_local]``: global flat position of each token that rank ``cp_rank`` holds, in local order
    (``window``: as in ``layout_plan``).

    >>> layout_token_index(torch.tensor([0, 8]), cp_size=2, cp_rank=0, layout="zigzag")
    tensor([0, 1, 6, 7])
    """
    run_start, run_len = layout_runs(cu_seqlens, cp_size=cp_size, cp_rank=cp_rank, layout=layout, window=window)
    total = int(cu_seqlens[-1]) // cp_size
    return expand_runs(run_start, run_len, total)


def global_token_order(
    cu_seqlens: torch.Tensor, *, cp_size: int, layout: str | Local, window: object = None
) -> torch.Tensor:
    """int64 ``[cp_size, T_local]`` on ``cu_seqlens.device``: row r is rank r's ``token_index`` (``window``: as in
    ``layout_plan``). One plan and one pass over T for all ranks.

    Every global token appears exactly once, so the flattened tensor is a permutation of ``range(T)``: the order of
    an all-gather over the CP group.

    >>> global_token_order(torch.tensor([0, 4]), cp_size=2, layout="zigzag")
    tensor([[0, 3],
            [1, 2]])
    """
    plan = layout_plan(cu_seqlens, cp_size=cp_size, layout=layout, window=window)
    return torch.from_numpy(plan.token_order()).to(cu_seqlens.device)
