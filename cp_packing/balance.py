"""Load-balance report: per-layout cost tables, a bar chart, and seeded synthetic doc maps to try them on.

``balance_report(doc_ids, cp_size=8)`` prints, per layout, the figures of ``cp_packing.cost.layout_cost``: busiest /
mean causal cost, busiest / ideal (padding work included), padding overhead, runs per rank and K/V bytes per layer,
plus which layout ``layout="auto"`` picks. ``plot_balance`` draws every rank's cost per layout (matplotlib, the
``plot`` extra). ``synthetic_doc_ids`` makes the doc maps of the benchmark suite (``benchmarks/bench_balance.py``).
The command line is ``python -m cp_packing report ...`` (see ``cp_packing.__main__``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from cp_packing.cost import LayoutCost, layout_cost

__all__ = [
    "SYNTHETIC_KINDS",
    "REPORT_LAYOUTS",
    "synthetic_doc_ids",
    "balance_costs",
    "balance_report",
    "plot_balance",
]

#: Document-length distributions of ``synthetic_doc_ids`` (median length, log-normal sigma):
#: ``lognormal`` (60, 1.5: long-tailed), ``long`` (2000, 1.0), ``short`` (16, 0.5: many short documents),
#: ``huge`` (one document of 3/4 of row 0 among documents of median 60), ``padded`` (200, 1.2, then 0 to 50% of
#: each row padding).
SYNTHETIC_KINDS = ("lognormal", "long", "short", "huge", "padded")

_KIND_PARAMS = {
    "lognormal": (60, 1.5),
    "long": (2000, 1.0),
    "short": (16, 0.5),
    "huge": (60, 1.0),
    "padded": (200, 1.2),
}

#: Layouts of the report, in order: ours, and ``rowzigzag`` (whole-row head-tail) as the usual trainer reference.
REPORT_LAYOUTS = ("contiguous", "rowzigzag", "zigzag", "balanced", "auto")


def _row_lengths(rng: np.random.Generator, fill: int, median: float, sigma: float) -> np.ndarray:
    """Log-normal document lengths (>= 1) that fill exactly ``fill`` tokens (the last one cut)."""
    parts, total = [], 0
    while total < fill:
        draw = np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, size=int(2 * fill / median) + 16)))
        parts.append(draw.astype(np.int64))
        total += int(parts[-1].sum())
    lengths = np.concatenate(parts)
    ends = np.cumsum(lengths)
    n = int(np.searchsorted(ends, fill)) + 1
    lengths = lengths[:n].copy()
    lengths[-1] -= int(ends[n - 1]) - fill
    return lengths


def synthetic_doc_ids(kind: str = "lognormal", batch: int = 8, seqlen: int = 4096, *, seed: int = 0) -> torch.Tensor:
    """A seeded int64 ``[batch, seqlen]`` neat-packing doc map (ids 1, 2, ... per row, 0 = padding).

    Args:
        kind: one of ``SYNTHETIC_KINDS`` (see there).
        batch, seqlen: the map's shape (``>= 1``).
        seed: NumPy generator seed; the same arguments always give the same map.
    """
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r}; choose one of {', '.join(SYNTHETIC_KINDS)}")
    for value, name in ((batch, "batch"), (seqlen, "seqlen"), (seed, "seed")):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if batch < 1 or seqlen < 1:
        raise ValueError(f"batch and seqlen must be >= 1, got batch={batch}, seqlen={seqlen}")
    median, sigma = _KIND_PARAMS[kind]
    rng = np.random.default_rng(seed)
    rows = np.zeros((batch, seqlen), dtype=np.int64)
    for b in range(batch):  # a loop over rows; each row is vectorised
        fill = seqlen - int(rng.integers(0, seqlen // 2 + 1)) if kind == "padded" else seqlen
        head = [int(0.75 * seqlen)] if (kind == "huge" and b == 0) else []
        rest = fill - sum(head)
        tail = _row_lengths(rng, rest, median, sigma) if rest > 0 else np.zeros(0, dtype=np.int64)
        lengths = np.concatenate([np.array(head, dtype=np.int64), tail])
        rows[b, :fill] = np.repeat(np.arange(1, lengths.size + 1, dtype=np.int64), lengths)
    return torch.from_numpy(rows)


def balance_costs(
    doc_ids,
    *,
    cp_size: int,
    layouts: Sequence[str] = REPORT_LAYOUTS,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype_bytes: int = 2,
) -> dict[str, LayoutCost]:
    """``{layout name: LayoutCost}`` for every layout of ``layouts`` that applies to this map.

    ``contiguous`` / ``balanced`` / ``auto`` need ``B*S % cp_size == 0`` and are left out otherwise; ``zigzag`` is
    measured after ``pad_segments`` when the map needs it; ``rowzigzag`` always applies. The ``auto`` entry is
    keyed ``"auto"`` (its ``layout`` attribute names the pick).
    """
    from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids

    params = doc_ids if isinstance(doc_ids, PackedSeqParams) else packed_seq_params_from_doc_ids(doc_ids)
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
        )
    return out


def balance_report(
    doc_ids,
    *,
    cp_size: int,
    layouts: Sequence[str] = REPORT_LAYOUTS,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype_bytes: int = 2,
) -> str:
    """A plain-text table, one line per layout: busiest / mean, busiest / ideal, padding %, tokens and runs per rank
    (max), K/V MiB per layer received by the busiest receiver (all-gather: the keys it needs; ring: a full pass);
    then the layout ``auto`` picks.

    Args:
        doc_ids: ``[B, S]`` doc map or ``PackedSeqParams``.
        cp_size: the CP group size.
        layouts: names from ``cp_packing.cost.COST_LAYOUTS``.
        num_kv_heads, head_dim, dtype_bytes: the K/V shape for the byte columns.
    """
    from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids

    params = doc_ids if isinstance(doc_ids, PackedSeqParams) else packed_seq_params_from_doc_ids(doc_ids)
    costs = balance_costs(
        params, cp_size=cp_size, layouts=layouts, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes
    )
    header = (
        f"{'layout':<22} {'busiest/mean':>12} {'busiest/ideal':>13} {'padding':>8} {'tokens/rank':>11} "
        f"{'runs/rank':>9} {'KV all-gather MiB':>17} {'KV ring MiB':>11}"
    )
    lines = [header, "-" * len(header)]
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


def plot_balance(doc_ids, cp_size: int, path, *, layouts: Sequence[str] = REPORT_LAYOUTS) -> None:
    """Write a PNG bar chart of every rank's causal cost (relative to the ideal ``C / cp``) for each layout.

    Needs matplotlib (``pip install 'cp-packing[plot]'``); imported here, with the Agg backend (no display).

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
    costs = balance_costs(doc_ids, cp_size=cp_size, layouts=layouts)
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
    ax.set_title(f"per-rank causal attention cost, cp={cp_size}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
