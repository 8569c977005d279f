"""Load-balance report: per-layout cost tables and a bar chart.

>>> print(balance_report(torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]), cp_size=2).splitlines()[-1])
layout='auto' picks 'contiguous'


``balance_report(doc_ids, cp_size=8)`` prints, per layout, the figures of ``cp_packing.cost.layout_cost``: busiest /
mean causal cost, busiest / ideal (padding work included), padding overhead, runs per rank and K/V bytes per layer,
plus which layout ``layout="auto"`` picks. ``plot_balance`` draws every rank's cost per layout (matplotlib, the
``plot`` extra). With ``window=`` (the model's sliding window: an int or a per-layer list of ``int | None``) every
cost is the windowed one, ``sum min(p + 1, window)``, ``balanced`` is planned for it and ``auto`` picks by it.
The command line is ``python -m cp_packing report ...`` (see ``cp_packing.__main__``).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from cp_packing._checks import check_windows
from cp_packing.cost import LayoutCost, backend_bytes, choose_backend_by_bytes, layout_cost
from cp_packing.layouts.work import window_weights
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids

__all__ = [
    "REPORT_LAYOUTS",
    "backend_bytes_table",
    "balance_costs",
    "balance_report",
    "plot_balance",
]

#: Layouts of the report, in order: ours, and ``rowzigzag`` (whole-row head-tail) as the usual trainer reference.
REPORT_LAYOUTS = ("contiguous", "rowzigzag", "zigzag", "balanced", "auto")


def _params(doc_ids: torch.Tensor | PackedSeqParams) -> PackedSeqParams:
    return doc_ids if isinstance(doc_ids, PackedSeqParams) else packed_seq_params_from_doc_ids(doc_ids)


def balance_costs(
    doc_ids: torch.Tensor | PackedSeqParams,
    *,
    cp_size: int,
    layouts: Sequence[str] = REPORT_LAYOUTS,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype_bytes: int = 2,
    window: int | Sequence[int | None] | None = None,
) -> dict[str, LayoutCost]:
    """``{layout name: LayoutCost}`` for every layout of ``layouts`` that applies to this map.

    ``contiguous`` / ``balanced`` / ``auto`` need ``B*S % cp_size == 0`` and are left out otherwise; ``zigzag`` is
    measured after ``pad_segments`` when the map needs it; ``rowzigzag`` always applies. The ``auto`` entry is
    keyed ``"auto"`` (its ``layout`` attribute names the pick).

    Args:
        doc_ids: ``[B, S]`` doc map or ``PackedSeqParams``.
        cp_size: the CP group size.
        layouts: names from ``cp_packing.cost.COST_LAYOUTS``.
        num_kv_heads, head_dim, dtype_bytes: the K/V shape for the byte figures.
        window: the attention's sliding window (``None``, an int or a per-layer list; see ``layout_cost``).

    Returns:
        ``{layout name: LayoutCost}``, in the order of ``layouts``.

    >>> list(balance_costs(torch.tensor([[1, 1, 2, 2, 2, 0]]), cp_size=4))
    ['rowzigzag', 'zigzag']
    """
    params = _params(doc_ids)
    out: dict[str, LayoutCost] = {}
    for name in layouts:
        if name in ("contiguous", "balanced", "auto") and params.total_tokens % cp_size:
            continue
        out[name] = layout_cost(
            params,
            cp_size=cp_size,
            layout=name,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype_bytes=dtype_bytes,
            window=window,
        )
    return out


def balance_report(
    doc_ids: torch.Tensor | PackedSeqParams, *, cp_size: int, layouts: Sequence[str] = REPORT_LAYOUTS,
    num_kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int = 2,
    window: int | Sequence[int | None] | None = None,
) -> str:
    """A plain-text table, one line per layout: busiest / mean, busiest / ideal, padding %, tokens and runs per rank
    (max), K/V MiB per layer received by the busiest receiver (all-gather: the keys it needs; ring: a full pass);
    then the layout ``auto`` picks. With ``window`` the costs are the windowed ones (a first line names the window).

    Args: as in ``balance_costs``.

    Returns:
        The table as one string (print it). In memory linear in the segments (zigzag's padding is priced in closed
        form).
    """
    params = _params(doc_ids)
    window = check_windows(window)
    costs = balance_costs(
        params, cp_size=cp_size, layouts=layouts, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype_bytes=dtype_bytes, window=window,
    )
    header = (
        f"{'layout':<22} {'busiest/mean':>12} {'busiest/ideal':>13} {'padding':>8} {'tokens/rank':>11} "
        f"{'runs/rank':>9} {'KV all-gather MiB':>17} {'KV ring MiB':>11}"
    )
    lines = [header, "-" * len(header)]
    if window is not None:
        lines.insert(0, f"costs under window={_window_text(window)}: a token at position p costs min(p + 1, window)"
                        f"{', summed over the layers' if isinstance(window, tuple) else ''}")
    mib = float(2**20)
    for name, c in costs.items():
        label = f"auto -> {c.layout}" if name == "auto" else name
        if name == "zigzag" and c.padding_overhead > 0:
            label = "zigzag (padded)"
        lines.append(
            f"{label:<22} {c.imbalance:>12.4f} {c.busiest_over_ideal:>13.4f} {100 * c.padding_overhead:>7.2f}% "
            f"{int(c.tokens_per_rank.max()):>11d} {int(c.runs_per_rank.max()):>9d} "
            f"{int(c.kv_bytes_allgather.max()) / mib:>17.1f} {c.kv_bytes_ring / mib:>11.1f}"
        )
    if "auto" in costs:
        lines.append(f"layout='auto' picks {costs['auto'].layout!r}")
    if params.total_tokens % cp_size:
        lines.append(
            f"B*S = {params.total_tokens} is not divisible by cp_size={cp_size}: contiguous, balanced and auto do not "
            "apply (pad the rows)"
        )
    return "\n".join(lines)


def _window_text(window: int | tuple[int | None, ...]) -> str:
    """A window for a title: ``4096``, or a per-layer list by its distinct windows (``[4096 x 13, None x 13]``)."""
    if not isinstance(window, tuple):
        return str(window)
    return "[" + ", ".join(f"{w} x {c}" for w, c in window_weights(window)) + "]"


def _ints(value, name: str) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be an int or a non-empty sequence of ints, got {value!r}")
    return values


def backend_bytes_table(
    *, T_local: int, cp_size: int | Sequence[int], num_heads: int | Sequence[int], num_kv_heads: int | Sequence[int],
    head_dim: int = 128, dtype_bytes: int = 2,
) -> str:
    """A plain-text table of the forward bytes per layer one rank sends (= receives), in MiB, per backend
    (``cp_packing.cost.backend_bytes``): all-gather, ring (a full pass), Ulysses, hybrid with ``ulysses_size=2``,
    and what ``backend="auto"`` picks between all-gather and Ulysses (``choose_backend_by_bytes``; ring-flash-attn
    aside). ``-``: the backend cannot run there (the Ulysses degree does not divide the query heads).

    Args:
        T_local: tokens per rank.
        cp_size: one CP size or several (one row each).
        num_heads, num_kv_heads: one head configuration or several, zipped (``num_heads=(32, 32, 64),
            num_kv_heads=(8, 32, 8)``).
        head_dim, dtype_bytes: the head size and the bytes per element.

    >>> print(backend_bytes_table(T_local=4096, cp_size=8, num_heads=32, num_kv_heads=8))  # doctest: +NORMALIZE_WHITESPACE
    heads (H/H_kv)   cp  all-gather MiB  ring MiB  ulysses MiB  hybrid U=2 MiB  auto
    ------------------------------------------------------------------------------------
    32/8              8           112.0     112.0         70.0            88.0  ulysses
    """
    cps, hs, kvs = _ints(cp_size, "cp_size"), _ints(num_heads, "num_heads"), _ints(num_kv_heads, "num_kv_heads")
    if len(hs) != len(kvs):
        raise ValueError(f"num_heads ({len(hs)} values) and num_kv_heads ({len(kvs)} values) are zipped: give "
                         "them the same length")
    header = (f"{'heads (H/H_kv)':<15} {'cp':>3} {'all-gather MiB':>15} {'ring MiB':>9} {'ulysses MiB':>12} "
              f"{'hybrid U=2 MiB':>15}  auto")
    lines = [header, "-" * (len(header) + 4)]
    mib = float(2**20)
    for H, H_kv in zip(hs, kvs):
        for cp in cps:
            kw = dict(T_local=T_local, cp_size=cp, num_heads=H, num_kv_heads=H_kv, head_dim=head_dim,
                      dtype_bytes=dtype_bytes)
            cells = []
            for backend, extra in (("allgather", {}), ("ring_flash_attn", {}), ("ulysses", {}),
                                   ("hybrid", {"ulysses_size": 2})):
                try:
                    cells.append(f"{backend_bytes(backend, **kw, **extra) / mib:.1f}")
                except ValueError:
                    cells.append("-")
            auto = choose_backend_by_bytes(**kw)[0]
            lines.append(f"{f'{H}/{H_kv}':<15} {cp:>3} {cells[0]:>15} {cells[1]:>9} {cells[2]:>12} {cells[3]:>15}  "
                         f"{auto}")
    return "\n".join(lines)


def plot_balance(
    doc_ids: torch.Tensor | PackedSeqParams,
    *,
    cp_size: int,
    path: str | os.PathLike[str],
    layouts: Sequence[str] = REPORT_LAYOUTS,
    window: int | Sequence[int | None] | None = None,
) -> None:
    """Write a PNG bar chart of every rank's causal cost (relative to the ideal ``C / cp``) for each layout.

    Needs matplotlib (``pip install 'cp-packing[plot]'``); imported here, with the Agg backend (no display).

    Args:
        doc_ids: ``[B, S]`` doc map or ``PackedSeqParams``.
        cp_size: the CP group size.
        path: where to write the PNG.
        layouts: names from ``cp_packing.cost.COST_LAYOUTS``.
        window: the attention's sliding window: the costs drawn are the windowed ones.

    Raises:
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_balance needs matplotlib: pip install 'cp-packing[plot]' (or pip install matplotlib)"
        ) from exc
    window = check_windows(window)
    costs = balance_costs(doc_ids, cp_size=cp_size, layouts=layouts, window=window)
    names = list(costs)
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * cp_size * len(names) / 2), 4.0))
    ranks = np.arange(cp_size)
    for i, name in enumerate(names):
        c = costs[name]
        rel = c.rank_cost.double().numpy() / c.ideal_cost if c.ideal_cost > 0 else np.ones(cp_size)
        label = {"auto": f"auto -> {c.layout}", "zigzag": "zigzag (padded)" if c.padding_overhead else "zigzag"}
        label = f"{label.get(name, name)} (max {rel.max():.3f})"
        ax.bar(ranks + (i - (len(names) - 1) / 2) * width, rel, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("CP rank")
    ax.set_ylabel("causal cost / ideal (C / cp)")
    ax.set_xticks(ranks)
    under = "" if window is None else f", window={_window_text(window)}"
    ax.set_title(f"per-rank causal attention cost, cp={cp_size}{under}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
