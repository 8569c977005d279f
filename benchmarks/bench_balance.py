"""Load balance of the CP layouts on a suite of synthetic doc maps, and the time to plan ``balanced``.

Run:  .venv/bin/python benchmarks/bench_balance.py            (full: [8, 32768] maps, 3 seeds, cp 2/4/8/16; timing
                                                               on [8, 131072])
      .venv/bin/python benchmarks/bench_balance.py --quick    (smoke run: small maps, 1 seed, cp 2/8, 3 repeats)
      .venv/bin/python benchmarks/bench_balance.py --png docs/balance.png   (also draw one map's per-rank costs)
      .venv/bin/python benchmarks/bench_balance.py --window 512 4096,none --no-timing   (sliding-window tables)

Balance table (per distribution and cp): busiest / mean causal cost (``cp_packing.cost``; the WORST over the seeds)
for ``contiguous``, ``rowzigzag`` (every row cut in 2cp chunks, head-tail: the common trainer practice, a reference),
``zigzag`` (per document, after ``pad_segments(multiple=2cp)``: its busiest / ideal counts the added pad tokens' work,
and its padding overhead = added tokens / real tokens), ``balanced`` and ``auto`` (with the layout it picked).

Window tables (``--window W ...``, each an int or a per-layer ``4096,none``): busiest / mean of the WINDOWED cost
(``sum min(p + 1, W)``, summed over the layers) for ``contiguous``, ``rowzigzag``, ``balanced`` planned for the full
causal cost (what it did before it knew the window), ``balanced`` planned for the window, and ``auto`` given the
window; the worst over the seeds.

Timing: ``balanced`` plan from scratch (cache cleared: ``balanced_plan``, the whole plan for all ranks, with the
cu_seqlens copy, the checks and the copies it returns) against ``doc_ids.clone()`` of the same map, int64
and int32, ``torch.set_num_threads(1)``, median of ``--repeats`` after a warm-up, in the same run. Target: the plan
within 5x of a clone. The cached lookup (``balanced_runs`` for one rank once the plan is cached) is shown too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from cp_packing.layouts import balanced
from cp_packing.report import plot_balance
from cp_packing.testing import SYNTHETIC_KINDS, synthetic_doc_ids
from cp_packing.cost import causal_cost, layout_cost
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.tools.report import window_arg


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def balance_tables(shape, seeds, cps) -> list[str]:
    lines = []
    worst_balanced = 0.0
    for kind in SYNTHETIC_KINDS:
        lines.append(f"\n{kind}: [{shape[0]}, {shape[1]}], seeds {list(seeds)} (worst busiest/mean over the seeds)")
        header = (
            f"{'cp':>3} {'contiguous':>10} {'rowzigzag':>9} {'zigzag':>7} {'zz/ideal':>8} {'zz pad':>7} "
            f"{'balanced':>8} {'auto':>30} {'bal runs/rank':>13}"
        )
        lines.append(header)
        for cp in cps:
            worst = {k: 0.0 for k in ("contiguous", "rowzigzag", "zigzag", "zz_ideal", "zz_pad", "balanced", "auto")}
            picks = set()
            runs = 0
            for seed in seeds:
                params = packed_seq_params_from_doc_ids(synthetic_doc_ids(kind, shape[0], shape[1], seed=seed))
                for name in ("contiguous", "rowzigzag", "balanced", "auto"):
                    c = layout_cost(params, cp_size=cp, layout=name)
                    worst[name] = max(worst[name], c.imbalance)
                    if name == "auto":
                        picks.add(c.layout)
                    if name == "balanced":
                        runs = max(runs, int(c.runs_per_rank.max()))
                z = layout_cost(params, cp_size=cp, layout="zigzag")
                worst["zigzag"] = max(worst["zigzag"], z.imbalance)
                worst["zz_ideal"] = max(worst["zz_ideal"], z.busiest_over_ideal)
                worst["zz_pad"] = max(worst["zz_pad"], z.padding_overhead)
            worst_balanced = max(worst_balanced, worst["balanced"])
            auto = f"{worst['auto']:.4f} ({'/'.join(sorted(picks))})"
            lines.append(
                f"{cp:>3} {worst['contiguous']:>10.4f} {worst['rowzigzag']:>9.4f} {worst['zigzag']:>7.4f} "
                f"{worst['zz_ideal']:>8.4f} {100 * worst['zz_pad']:>6.2f}% {worst['balanced']:>8.4f} {auto:>30} "
                f"{runs:>13d}"
            )
    lines.append(f"\nworst balanced busiest/mean over the whole suite: {worst_balanced:.4f}")
    return lines


def _planned_imbalance(cu: torch.Tensor, cp: int, plan_window, cost_window) -> float:
    """busiest / mean of ``cost_window``'s cost for ``balanced`` planned for ``plan_window``."""
    offsets, run_start, run_len = balanced.balanced_plan(cu, cp_size=cp, window=plan_window)
    rank = torch.repeat_interleave(torch.arange(cp), torch.diff(offsets))
    per_rank = torch.zeros(cp, dtype=torch.int64).index_add_(0, rank, causal_cost(cu, run_start, run_len,
                                                                                  window=cost_window))
    return float(per_rank.max()) / (float(per_rank.sum()) / cp)


def window_tables(shape, seeds, cps, windows) -> list[str]:
    lines = []
    for window in windows:
        worst_gain = []
        for kind in SYNTHETIC_KINDS:
            lines.append(f"\nwindow={window}, {kind}: [{shape[0]}, {shape[1]}], seeds {list(seeds)} (worst WINDOWED "
                         "busiest/mean over the seeds)")
            lines.append(f"{'cp':>3} {'contiguous':>10} {'rowzigzag':>9} {'bal (causal plan)':>17} "
                         f"{'bal (window plan)':>17} {'auto':>30}")
            for cp in cps:
                worst = dict.fromkeys(("contiguous", "rowzigzag", "causal", "window", "auto"), 0.0)
                picks = set()
                for seed in seeds:
                    params = packed_seq_params_from_doc_ids(synthetic_doc_ids(kind, shape[0], shape[1], seed=seed))
                    for name in ("contiguous", "rowzigzag", "auto"):
                        c = layout_cost(params, cp_size=cp, layout=name, window=window)
                        worst[name] = max(worst[name], c.imbalance)
                        picks.add(c.layout) if name == "auto" else None
                    worst["causal"] = max(worst["causal"], _planned_imbalance(params.cu_seqlens, cp, None, window))
                    worst["window"] = max(worst["window"], _planned_imbalance(params.cu_seqlens, cp, window, window))
                worst_gain.append((worst["causal"], worst["window"]))
                auto = f"{worst['auto']:.4f} ({'/'.join(sorted(picks))})"
                lines.append(f"{cp:>3} {worst['contiguous']:>10.4f} {worst['rowzigzag']:>9.4f} "
                             f"{worst['causal']:>17.4f} {worst['window']:>17.4f} {auto:>30}")
        lines.append(f"\nwindow={window}: worst balanced over the suite, causal plan "
                     f"{max(a for a, _ in worst_gain):.4f}, window plan {max(b for _, b in worst_gain):.4f}")
    return lines


def timing_table(shape, cps, repeats: int) -> list[str]:
    torch.set_num_threads(1)
    lines = [
        f"\nplanning time, [{shape[0]}, {shape[1]}], 1 thread, median of {repeats} (ms)",
        f"{'map':>10} {'segments':>8} {'cp':>3} {'plan':>8} {'clone64':>8} {'clone32':>8} {'plan/clone64':>12} "
        f"{'plan/clone32':>12} {'cached':>8}",
    ]
    for kind in SYNTHETIC_KINDS:
        doc64 = synthetic_doc_ids(kind, shape[0], shape[1], seed=0)
        doc32 = doc64.to(torch.int32)
        cu = packed_seq_params_from_doc_ids(doc64).cu_seqlens
        clone64 = _median_ms(doc64.clone, repeats)
        clone32 = _median_ms(doc32.clone, repeats)
        for cp in cps:

            def plan():
                balanced.balanced_plan.cache_clear()
                balanced.balanced_plan(cu, cp_size=cp)

            t_plan = _median_ms(plan, repeats)
            balanced.balanced_plan(cu, cp_size=cp)
            t_hit = _median_ms(lambda: balanced.balanced_runs(cu, cp_size=cp, cp_rank=cp - 1), repeats)
            lines.append(
                f"{kind:>10} {cu.numel() - 1:>8d} {cp:>3} {t_plan:>8.3f} {clone64:>8.3f} {clone32:>8.3f} "
                f"{t_plan / clone64:>12.2f} {t_plan / clone32:>12.2f} {t_hit:>8.3f}"
            )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small maps, one seed, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--png", help="write a per-rank cost chart of one map (lognormal, first shape, cp=8)")
    parser.add_argument("--window", nargs="+", type=window_arg, default=[],
                        help="also print the window tables for these windows (each an int or a per-layer 4096,none)")
    parser.add_argument("--no-timing", action="store_true", help="skip the planning-time table")
    parser.add_argument("--no-balance", action="store_true", help="skip the (unwindowed) balance table")
    args = parser.parse_args(argv)
    if args.quick:
        shape, seeds, cps, time_shape, repeats = (2, 8192), (0,), (2, 8), (2, 16384), 3
    else:
        shape, seeds, cps, time_shape, repeats = (8, 32768), (0, 1, 2), (2, 4, 8, 16), (8, 131072), 21
    repeats = args.repeats or repeats
    print(f"torch {torch.__version__}; python {sys.version.split()[0]}")
    if not args.no_balance:
        for line in balance_tables(shape, seeds, cps):
            print(line)
    for line in window_tables(shape, seeds, cps, args.window):
        print(line)
    if not args.no_timing:
        for line in timing_table(time_shape, (8, 16) if not args.quick else (8,), repeats):
            print(line)
    if args.png:
        try:
            plot_balance(synthetic_doc_ids("lognormal", shape[0], shape[1], seed=0), cp_size=8, path=args.png)
            print(f"\nwrote {args.png}")
        except ImportError as exc:
            print(f"\nno plot: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
