"""Time and memory of the step's index math at scale: every rank's token order, one rank's shard, the exchange's
need, for all ranks at once, linear in the tokens and the segments.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py            (16M and 64M tokens, cp 128)
      PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py --quick    (1M and 4M tokens, cp 32)

A map of ``rows`` rows of 8192 tokens, lognormal documents (``cp_packing.testing.synthetic_doc_ids``, median 600).
For each layout: ``layout_plan`` (every rank's runs; the first call plans, later calls hit the cache),
``global_token_order`` (every rank's token index, one pass over T), ``shard_packed_seq_params`` for one rank, and
``need_tokens`` (what every rank needs from the others). Times are medians of ``--repeats`` in this process; the
ratio column divides by the time at the smaller size, so linear scaling reads as the size ratio (4).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch


def median_seconds(fn, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn()`` (also bench_planner's clock)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(tokens: int, cp: int, layout: str, repeats: int) -> dict:
    import cp_packing
    from cp_packing.layouts import global_token_order, layout_plan
    from cp_packing.layouts.need import need_tokens
    from cp_packing.testing import synthetic_doc_ids

    rows = tokens // 8192
    doc_ids = synthetic_doc_ids("lognormal", rows, 8192, seed=0, median=60, dtype=torch.int32)
    params = cp_packing.packed_seq_params_from_doc_ids(doc_ids)
    cu = params.cu_seqlens
    t0 = time.perf_counter()
    plan = layout_plan(cu, cp_size=cp, layout=layout)  # the first call plans (later ones hit the cache)
    first = time.perf_counter() - t0
    cu64 = cu.to(torch.int64).numpy()
    return {
        "segments": params.num_segments,
        "plan (first)": first,
        "token order": median_seconds(lambda: global_token_order(cu, cp_size=cp, layout=layout), repeats),
        "shard one rank": median_seconds(lambda: cp_packing.shard_packed_seq_params(params, cp_size=cp, cp_rank=cp // 2,
                                                                          layout=layout), repeats),
        "need, all ranks": median_seconds(lambda: need_tokens(plan, cu64), repeats),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cp", type=int, default=128)
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "balanced"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    sizes = (1 << 20, 1 << 22) if args.quick else (1 << 24, 1 << 26)
    cp = 32 if args.quick else args.cp
    print(f"cp={cp}, lognormal documents (median 60), seconds (median of {args.repeats})\n")
    print("| layout | tokens | segments | plan (first) | token order | shard one rank | need, all ranks |")
    print("|---|---|---|---|---|---|---|")
    for layout in args.layouts:
        base = None
        for tokens in sizes:
            r = measure(tokens, cp, layout, args.repeats)
            cells = [r[k] for k in ("plan (first)", "token order", "shard one rank", "need, all ranks")]
            ratio = "" if base is None else " (x" + ", x".join(f"{a / b:.1f}" for a, b in zip(cells, base)) + ")"
            base = base or cells
            print(f"| {layout} | {tokens / 2**20:.0f}M | {r['segments']:,} | "
                  + " | ".join(f"{c:.3f}" for c in cells) + f" |{ratio}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\npeak RSS of this process: {peak:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
