"""Reports: per-layout load-balance tables, a bar chart of every rank's cost, and a table of bytes per backend.

>>> print(balance_report(torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]), cp_size=2).splitlines()[-1])
layout='auto' picks 'contiguous'


``balance_report(doc_ids, cp_size=8)`` prints, per layout, the figures of ``cp_packing.cost.layout_cost``: busiest /
mean causal cost, busiest / ideal (padding work included), padding overhead, runs per rank and K/V bytes per layer,
plus which layout ``layout="auto"`` picks. ``plot_balance`` draws every rank's cost per layout (matplotlib, the
``plot`` extra). With ``window=`` (the model's sliding window: an int or a per-layer list of ``int | None``) every
cost is the windowed one, ``sum min(p + 1, window)``, ``balanced`` is planned for it and ``auto`` picks by it.
``backend_bytes_table`` gives the forward K/V bytes per layer and rank of each attention backend for a head
configuration (``cp_packing.cost.backend_bytes``), and which of all-gather and Ulysses moves fewer.
The command line is ``python -m cp_packing report ...`` (see ``cp_packing.__main__``).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from cp_packing._checks import check_int, check_weighted_cost_tokens, check_windows
from cp_packing.cost import COST_LAYOUTS, LayoutCost, backend_bytes, choose_backend_by_bytes, layout_cost
from cp_packing.layouts.work import window_weights
from cp_packing.packed_seq import PackedSeqParams, check_params, packed_seq_params_from_doc_ids

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
    if isinstance(doc_ids, PackedSeqParams):
        return check_params(doc_ids, "doc_ids")  # O(segments): the row boundaries the row-zigzag pricing relies on
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a [B, S] doc map tensor or PackedSeqParams, got {type(doc_ids).__name__}; "
                        "build the params with packed_seq_params_from_doc_ids(doc_ids)")
    return packed_seq_params_from_doc_ids(doc_ids)


def _layouts(layouts: object) -> tuple[str, ...]:
    """``layouts`` as a tuple of known names: one string is one layout (``"contiguous"``, not its letters)."""
    names = (layouts,) if isinstance(layouts, str) else layouts
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"layouts must be a layout name or a non-empty list of them (from {', '.join(REPORT_LAYOUTS)})"
                        f", got {layouts!r}")
    unknown = [n for n in names if n not in COST_LAYOUTS]
    if unknown:
        raise ValueError(f"unknown layout {unknown[0]!r} in layouts={layouts!r}; choose among "
                         f"{', '.join(REPORT_LAYOUTS)}")
    return tuple(names)


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
        cp_size: the CP group size (an int >= 1).
        layouts: names from ``cp_packing.cost.COST_LAYOUTS`` (one name alone is one layout).
        num_kv_heads, head_dim, dtype_bytes: the K/V shape for the byte figures.
        window: the attention's sliding window (``None``, an int or a per-layer list; see ``layout_cost``).

    Returns:
        ``{layout name: LayoutCost}``, in the order of ``layouts``.

    Raises:
        TypeError / ValueError: a ``cp_size`` that is not an int >= 1, an unknown layout name, a map or params that
        are not one (``packed_seq.check_params``), and whatever ``layout_cost`` refuses.

    >>> list(balance_costs(torch.tensor([[1, 1, 2, 2, 2, 0]]), cp_size=4))
    ['rowzigzag', 'zigzag']
    """
    cp_size = check_int(cp_size, "cp_size", min=1, hint="the CP group size, e.g. cp_size=8")
    layouts = _layouts(layouts)
    params = _params(doc_ids)
    out: dict[str, LayoutCost] = {}
    kv = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes, window=window)
    for name in layouts:
        if name in ("contiguous", "balanced", "auto") and params.total_tokens % cp_size:
            continue
        if name == "rowzigzag":
            out[name] = _rowzigzag_cost(params, cp_size=cp_size, **kv)
        else:
            out[name] = layout_cost(params, cp_size=cp_size, layout=name, **kv)
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
        The table as one string (print it). In memory linear in the segments (zigzag's padding and the row-zigzag
        reference are priced in closed form).
    """
    cp_size = check_int(cp_size, "cp_size", min=1, hint="the CP group size, e.g. cp_size=8")
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


# ------------------------------------------------------------------------------------------------ rowzigzag
# The row-zigzag reference cuts EVERY row at the same in-row bounds, so each figure is a sum over rows of a function
# of the in-row offsets: it is priced from the segments' in-row [lo, end) sorted once (O(segments log segments)),
# never from the B x 2cp ranges (cp_packing.cost prices those: O(B * cp) memory, GBs at cp 128 on a [1M x 16] map).


_INT64_SAFE = 2**62  # running sums above this are taken in exact Python ints (object arrays), slower but exact


def _running(values: np.ndarray, dtype: object) -> np.ndarray:
    """``[0, v0, v0 + v1, ...]`` in ``dtype`` (int64, or object: exact Python ints where int64 could overflow)."""
    out = np.zeros(values.size + 1, dtype=dtype)
    np.cumsum(values.astype(dtype), out=out[1:])
    return out


def _offset_cost(lo: np.ndarray, end: np.ndarray, weights, offsets: np.ndarray, dtype: object) -> np.ndarray:
    """``G(o)`` for every ``o`` of ``offsets``: the cost, over ALL rows, of the tokens at in-row offsets ``[0, o)``.

    The token at offset ``x`` of a segment ``[lo, end)`` costs ``sum_w count * min(x - lo + 1, w)``, linear in ``x``
    between ``lo``, ``lo + w`` and ``end``. Each change is an event ``(q, c1, c0)`` that adds ``c1 x + c0`` for
    ``x >= q``, so adds ``c1 (T(o) - T(q)) + c0 (o - q)`` to ``G(o)`` with ``T(x) = x (x - 1) / 2``: four running
    sums over the events sorted by ``q``."""
    q, c1, c0 = [], [], []
    for w, count in weights:
        cut = np.zeros(lo.size, dtype=bool) if w is None else w < end - lo  # the window closes inside the segment
        w = 0 if w is None else w
        base = count * (1 - lo)  # c0 of the linear part: count * (x - lo + 1)
        q += [lo, lo[cut] + w, end[cut], end[~cut]]
        c1 += [np.full(lo.size, count), np.full(int(cut.sum()), -count), np.zeros(int(cut.sum()), np.int64),
               np.full(int((~cut).sum()), -count)]
        c0 += [base, count * w - base[cut], np.full(int(cut.sum()), -count * w), -base[~cut]]
    q = np.concatenate(q)
    order = np.argsort(q, kind="stable")
    q, c1, c0 = q[order], np.concatenate(c1)[order].astype(dtype), np.concatenate(c0)[order].astype(dtype)
    n = np.searchsorted(q, offsets, side="left")  # the events with q < o
    tq = (q * (q - 1) // 2).astype(dtype)
    a1, b1, a0, b0 = (_running(v, dtype)[n] for v in (c1, c1 * tq, c0, c0 * q.astype(dtype)))
    o = offsets.astype(dtype)
    return (o * (o - 1) // 2) * a1 - b1 + o * a0 - b0


def _key_reach(lo_sorted, lo_sum, end_sorted, end_sum, len_sum, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Over all rows, ``sum (min(end, y) - lo)`` over the segments that meet ``[x, y)``: the keys a rank holding
    ``[x, y)`` of every row needs, from each of those segments' start to its last token there. The segments meeting
    it are those with ``lo < y`` less those with ``end <= x`` (segments tile a row)."""
    n_lo = np.searchsorted(lo_sorted, y, side="left")
    n_end = np.searchsorted(end_sorted, y, side="right")
    return end_sum[n_end] + y * (n_lo - n_end) - lo_sum[n_lo] - len_sum[np.searchsorted(end_sorted, x, side="right")]


def _rowzigzag_runs_and_keys(lo: np.ndarray, end: np.ndarray, B: int, bounds: np.ndarray, cp: int, dtype: object):
    """Per rank ``(runs, keys needed)`` under the row zigzag: rank r holds ``[x1, y1) = chunk r`` and ``[x2, y2) =
    chunk 2cp-1-r`` of every row (one interval where they touch). A nonempty interval holds ``B`` runs plus one per
    segment start inside it. A segment met by both intervals (``lo < y1`` and ``end > x2``) counts its keys once,
    to its end in the second: since ``y1`` grows and ``x2`` shrinks with r, it is met by both for every rank from
    ``max(first r with y1 > lo, first r with x2 < end)`` on."""
    r = np.arange(cp)
    x1, y1, x2, y2 = bounds[r], bounds[r + 1], bounds[2 * cp - 1 - r], bounds[2 * cp - r]
    has1, has2 = y1 > x1, y2 > x2
    touch = has1 & has2 & (y1 == x2)
    lo_sorted, end_order = np.sort(lo), np.argsort(end, kind="stable")
    end_sorted = end[end_order]
    sums = [_running(v, dtype) for v in (lo_sorted, end_sorted, (end - lo)[end_order])]

    def runs(x, y):
        inside = np.searchsorted(lo_sorted, y, side="left") - np.searchsorted(lo_sorted, x, side="right")
        return np.where(y > x, B + inside, 0)

    def keys(x, y):
        return np.where(y > x, _key_reach(lo_sorted, sums[0], end_sorted, sums[1], sums[2], x, y), 0)

    first = np.maximum(np.searchsorted(y1, lo, side="right"), cp - np.searchsorted(bounds[cp:2 * cp], end, "left"))
    both = np.bincount(first, minlength=cp + 1)[:cp].astype(dtype)  # segments met by both intervals, from rank r on
    both_lo = np.zeros(cp + 1, dtype=dtype)
    np.add.at(both_lo, first, lo.astype(dtype))
    twice = y1.astype(dtype) * np.cumsum(both) - np.cumsum(both_lo[:cp])  # their keys counted up to y1 as well
    split = has1 & has2 & ~touch
    run = np.where(touch, runs(x1, y2), runs(x1, y1) + runs(x2, y2))
    need = np.where(touch, keys(x1, y2), keys(x1, y1) + keys(x2, y2) - np.where(split, twice, 0))
    return run.astype(np.int64), need.astype(np.int64)


def _rowzigzag_cost(params: PackedSeqParams, *, cp_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                    window: object) -> LayoutCost:
    """``layout_cost(params, layout="rowzigzag", ...)`` in closed form over the segments (the same figures)."""
    for value, name in ((num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"), (dtype_bytes, "dtype_bytes")):
        check_int(value, name, min=1)
    window = check_windows(window)
    weights = window_weights(window)
    B, S = params.doc_ids.shape
    cp = cp_size
    layers = sum(c for _, c in weights)
    check_weighted_cost_tokens(B * S, layers)
    cu = params.cu_seqlens.to("cpu", torch.int64).numpy()
    lo = cu[:-1] % S  # in-row offsets: a segment never crosses a row (check_params)
    end = lo + np.diff(cu)
    magnitude = 8 * (3 * lo.size * len(weights) + 1) * layers * (S + 1) ** 2  # bounds the running sums
    dtype = object if magnitude >= _INT64_SAFE else np.int64
    bounds = (np.arange(2 * cp + 1, dtype=np.int64) * S) // (2 * cp)  # chunk bounds inside a row
    chunk_cost = np.diff(_offset_cost(lo, end, weights, bounds, dtype))  # [2cp], over all rows
    chunk_tokens = B * np.diff(bounds)
    r = np.arange(cp)
    rank_cost = (chunk_cost[r] + chunk_cost[2 * cp - 1 - r]).astype(np.int64)
    tokens = (chunk_tokens[r] + chunk_tokens[2 * cp - 1 - r]).astype(np.int64)
    runs, needed = _rowzigzag_runs_and_keys(lo, end, B, bounds, cp, dtype)
    mean = rank_cost.sum() / cp
    per_token = 2 * num_kv_heads * head_dim * dtype_bytes  # K and V of one token, one layer
    return LayoutCost(
        layout="rowzigzag", cp_size=cp, rank_cost=torch.from_numpy(rank_cost), tokens_per_rank=torch.from_numpy(tokens),
        runs_per_rank=torch.from_numpy(runs), imbalance=float(rank_cost.max() / mean) if mean > 0 else 1.0,
        ideal_cost=float(int(rank_cost.sum())) / cp, padding_overhead=0.0,
        kv_bytes_allgather=torch.from_numpy((needed - tokens) * per_token),
        kv_bytes_ring=(cp - 1) * int(tokens.max()) * per_token, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype_bytes=dtype_bytes,
    )


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
    and which of all-gather and Ulysses moves fewer bytes (``cost.choose_backend_by_bytes``). ``-``: the backend
    cannot run there (the Ulysses degree does not divide the query heads).

    The last column is not ``backend="auto"``'s pick: auto uses the step-time model (``cost.choose_backend``), which
    needs a batch's shard (the exchange's need, the compute per rank), not just a token count.

    Args:
        T_local: tokens per rank.
        cp_size: one CP size or several (one row each).
        num_heads, num_kv_heads: one head configuration or several, zipped (``num_heads=(32, 32, 64),
            num_kv_heads=(8, 32, 8)``).
        head_dim, dtype_bytes: the head size and the bytes per element.

    >>> print(backend_bytes_table(T_local=4096, cp_size=8, num_heads=32, num_kv_heads=8))  # doctest: +NORMALIZE_WHITESPACE
    heads (H/H_kv)   cp  all-gather MiB  ring MiB  ulysses MiB  hybrid U=2 MiB  fewer bytes
    -------------------------------------------------------------------------------------------
    32/8              8           112.0     112.0         70.0            88.0  ulysses
    """
    cps, hs, kvs = _ints(cp_size, "cp_size"), _ints(num_heads, "num_heads"), _ints(num_kv_heads, "num_kv_heads")
    if len(hs) != len(kvs):
        raise ValueError(f"num_heads ({len(hs)} values) and num_kv_heads ({len(kvs)} values) are zipped: give "
                         "them the same length")
    header = (f"{'heads (H/H_kv)':<15} {'cp':>3} {'all-gather MiB':>15} {'ring MiB':>9} {'ulysses MiB':>12} "
              f"{'hybrid U=2 MiB':>15}  fewer bytes")
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
            fewer = choose_backend_by_bytes(**kw)[0]
            lines.append(f"{f'{H}/{H_kv}':<15} {cp:>3} {cells[0]:>15} {cells[1]:>9} {cells[2]:>12} {cells[3]:>15}  "
                         f"{fewer}")
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
        path: the file to write (exactly this name, PNG data whatever its suffix).
        layouts: names from ``cp_packing.cost.COST_LAYOUTS``.
        window: the attention's sliding window: the costs drawn are the windowed ones.

    Raises:
        ImportError: matplotlib is not installed (the message names the ``plot`` extra).
        ValueError: ``path`` is a directory.
    """
    if os.path.isdir(path):
        raise ValueError(f"path {os.fspath(path)!r} is a directory; give a file name, e.g. "
                         f"{os.path.join(path, 'balance.png')!r}")
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
    fig.savefig(path, dpi=100, format="png")  # exactly ``path``: matplotlib would add ".png" to a bare name
    plt.close(fig)
