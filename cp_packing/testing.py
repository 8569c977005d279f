"""Test and benchmark scaffolding that ships with the package: seeded synthetic doc maps.

Tests, benchmarks and the launchers (``python -m cp_packing train|verify|report``) all draw their doc maps here, so
one generator defines what "a lognormal batch" means everywhere.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_packing._checks import check_choice, check_int

__all__ = ["SYNTHETIC_KINDS", "synthetic_doc_ids"]

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
    check_choice(kind, "synthetic kind", SYNTHETIC_KINDS)
    batch, seqlen = check_int(batch, "batch", min=1), check_int(seqlen, "seqlen", min=1)
    seed = check_int(seed, "seed")
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
