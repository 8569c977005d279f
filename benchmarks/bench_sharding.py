"""Time to build one rank's ShardedPackedSeqParams and to shard one [B, S] tensor, against a clone of the map.

    python benchmarks/bench_sharding.py            # [8, 131072], cp in {2, 8, 16}, 1 thread
    python benchmarks/bench_sharding.py --quick    # small smoke run

The map (``cp_packing.testing.synthetic_doc_ids``) has lognormal document lengths (median 600, sigma 1.2) in units
of 32 tokens (so zigzag is valid up to cp=16) and up to S/8 padding at each row's tail. Ratios are medians over
repeats, measured in the same process as the clone baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.testing import synthetic_doc_ids


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(fn, baseline, repeats: int) -> tuple[float, float]:
    """Median time of ``fn`` and median of the per-pair ratio fn/baseline, the two timed back to back in each
    repeat, so that drift in the machine's load (these machines are shared) cancels out of the ratio."""
    fn(), baseline()
    times, ratios = [], []
    for _ in range(repeats):
        b = _once(baseline)
        t = _once(fn)
        times.append(t)
        ratios.append(t / b)
    return statistics.median(times), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "balanced"])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small map, few repeats (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seqlen, args.repeats, args.cp = 2, 4096, 3, [2, 4]
    torch.set_num_threads(args.threads)

    doc_ids = synthetic_doc_ids("lognormal", args.batch, args.seqlen, seed=0, median=600.0, sigma=1.2, pad=1 / 8,
                                multiple=32, dtype=torch.int32)
    params = packed_seq_params_from_doc_ids(doc_ids)
    x = torch.randint(0, 32000, doc_ids.shape, dtype=torch.int64)  # e.g. input_ids
    clone_map = lambda: doc_ids.clone()  # noqa: E731
    clone_x = lambda: x.clone()  # noqa: E731
    t_clone, _ = paired(clone_map, clone_map, args.repeats)
    print(f"map [{args.batch}, {args.seqlen}] int32, {params.num_segments} segments, threads={args.threads}")
    print(f"clone of the map: {t_clone * 1e3:.3f} ms (median). Ratios: median over repeats of (ours / a clone "
          f"timed right before it); shard is compared with a clone of the [B,S] int64 tensor it shards")
    print(f"{'layout':<11} {'cp':>3} {'build ms':>9} {'build/clone':>12} {'shard ms':>9} {'shard/clone':>12}")
    for layout in args.layouts:
        for cp in args.cp:
            try:
                shard_packed_seq_params(params, cp_size=cp, cp_rank=0, layout=layout)
            except (ValueError, ImportError) as err:
                print(f"{layout:<11} {cp:>3} skipped: {str(err)[:60]}")
                continue
            rank = cp // 2  # a middle rank
            t_build, r_build = paired(
                lambda: shard_packed_seq_params(params, cp_size=cp, cp_rank=rank, layout=layout), clone_map, args.repeats
            )
            sharded = shard_packed_seq_params(params, cp_size=cp, cp_rank=rank, layout=layout)
            t_shard, r_shard = paired(lambda: sharded.shard(x), clone_x, args.repeats)
            print(f"{layout:<11} {cp:>3} {t_build * 1e3:>9.3f} {r_build:>11.2f}x {t_shard * 1e3:>9.3f} {r_shard:>11.2f}x")


if __name__ == "__main__":
    main()
