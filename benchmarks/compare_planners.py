"""Two versions of the ``local`` planner, plan by plan: identical, or their figures (docs/benchmarks.md).

Run:  PYTHONPATH=. .venv/bin/python benchmarks/compare_planners.py OLD.py [NEW.py]     (NEW: the package's local.py)
      ... --quick            (the exchange benchmark's families at cp 4 and 8, seed 0: a smoke run, seconds)
      ... --tolerance 0      (another value of the knob; default: the module's TOLERANCE)

``OLD.py`` / ``NEW.py``: files defining ``local_plan_arrays`` (versions of ``cp_packing/layouts/local.py``, e.g.
``git show REV:cp_packing/layouts/local.py > /tmp/old.py``). Maps: the 72 of ``bench_exchange_bytes.py`` (its six
families, one row of ``8192 * cp`` tokens, cp 4-32, seeds 0-2) without a window and under ``(512, None)``, and the
planner benchmark's (1M tokens of median-60 documents at cp 8 / 32 / 128; ``lognormal 8k`` and ``huge`` at
``8192 * cp`` tokens, cp 8 / 32 / 128) without one. Per map where the plans differ: the busiest / mean causal cost
and the busiest rank's remote keys over an all-gather's, old -> new, ``worse`` where either grew. Then the counts and
each version's total planning time (both run alternately in one process, one thread).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from bench_exchange_bytes import FAMILIES, family_map
from bench_planner import load_planner, plan_figures

import cp_packing
from cp_packing.testing import synthetic_doc_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cu(doc_ids: torch.Tensor) -> np.ndarray:
    return cp_packing.packed_seq_params_from_doc_ids(doc_ids).cu_seqlens.to(torch.int64).numpy()


def maps(quick: bool):
    """``(name, cp, cu, weights)`` of every comparison map."""
    full, windowed = ((None, 1),), ((512, 1), (None, 1))
    cps, seeds = ((4, 8), (0,)) if quick else ((4, 8, 16, 32), (0, 1, 2))
    for family in FAMILIES:
        for cp in cps:
            for seed in seeds:
                cu = _cu(family_map(family, 8192 * cp, seed))
                for weights in (full,) if quick else (full, windowed):
                    yield f"{family} seed {seed}", cp, cu, weights
    if quick:
        return
    big = _cu(synthetic_doc_ids("lognormal", 128, 8192, seed=0, median=60, dtype=torch.int32))
    for cp in (8, 32, 128):
        yield "lognormal median 60, 1M", cp, big, full
    for family in ("lognormal 8k", "huge"):
        for cp in (8, 32, 128):
            yield f"{family}, {8192 * cp // 1024}K", cp, _cu(family_map(family, 8192 * cp, 0)), full


def figures(cu: np.ndarray, cp: int, plan) -> tuple[float, float]:
    """``bench_planner.plan_figures`` of a plan ``(offsets, run_start, run_len)``."""
    offsets, start, length = plan
    return plan_figures(cu, cp, np.repeat(np.arange(cp), np.diff(offsets)), start, length)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=os.path.join(ROOT, "cp_packing", "layouts", "local.py"))
    ap.add_argument("--quick", action="store_true", help="the six families at cp 4 and 8, seed 0")
    ap.add_argument("--tolerance", type=float, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    old, new = load_planner(args.old, "planner_old"), load_planner(args.new, "planner_new")
    tol = new.TOLERANCE if args.tolerance is None else args.tolerance
    counts, seconds = {"identical": 0, "differ, no worse": 0, "worse": 0}, [0.0, 0.0]
    for name, cp, cu, weights in maps(args.quick):
        plans = []
        for i, module in enumerate((old, new)):
            t0 = time.perf_counter()
            plans.append(module.local_plan_arrays(cu, cp, weights, tol))
            seconds[i] += time.perf_counter() - t0
        if all(np.array_equal(a, b) for a, b in zip(*plans)):
            counts["identical"] += 1
            continue
        (bal0, keys0), (bal1, keys1) = figures(cu, cp, plans[0]), figures(cu, cp, plans[1])
        worse = bal1 > bal0 + 1e-12 or keys1 > keys0 + 1e-12
        counts["worse" if worse else "differ, no worse"] += 1
        window = "" if weights == ((None, 1),) else f", window {weights[0][0]}"
        print(f"{'worse' if worse else 'differ'}: {name}, cp {cp}{window}: busiest/mean {bal0:.9f} -> {bal1:.9f}, "
              f"keys {keys0:.6f} -> {keys1:.6f}", flush=True)
    print(f"tolerance {tol}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f"; planning time old {seconds[0]:.2f} s, new {seconds[1]:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
