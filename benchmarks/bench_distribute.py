"""Benchmark the source-rank path of ``distribute_batch`` (RLE metadata + one scatter) against broadcasting the batch.

Run:  .venv/bin/python benchmarks/bench_distribute.py            (full: B=4, S=16384, cp in {2, 4}, 20 repeats)
      .venv/bin/python benchmarks/bench_distribute.py --quick    (smoke run: S=2048, 3 repeats)

Setup: ``cp`` processes forked on this machine join a gloo group (TCPStore on a free loopback port), one intra-op
thread each. Group rank 0 is the source. The batch is ``input_ids``, ``labels``, ``position_ids`` (int64 ``[B, S]``)
and an int32 doc map with lognormal document lengths (median ~665 tokens) rounded up to multiples of 8, so that
``layout="zigzag"`` is valid for cp 2 and 4.

Methods (each ends with every rank holding its ``[1, T_local]`` tensors and its ``ShardedPackedSeqParams``):
- ``scatter``: ``distribute_batch(batch, params, src=0, layout="zigzag")``; the source builds ``params`` from the doc
  map inside the timed region. Two broadcasts (header, RLE doc map + key JSON) and one ``dist.scatter``.
- ``broadcast``: the source ``dist.broadcast``s the full doc map and the three full tensors; every rank then builds
  ``params`` and shards locally (``shard_packed_seq_params`` + ``index_select``).
- ``local``: every rank already holds the batch (``distribute_batch(..., src=None)``); no communication, reference.

Bytes received per non-source rank are counted analytically from the tensors each collective moves (numel x
element size): ``scatter`` = header (``HEADER_LEN`` int64) + metadata (``2*num_segments+1`` int64 + JSON words) +
this rank's row of the scatter (``T_local x 24`` bytes), from ``cp_packing.distributed.src_message_bytes``;
``broadcast`` = ``B*S*(4 + 3*8)`` bytes. Times: every repeat is bracketed by ``dist.barrier()`` on both sides and
timed on rank 0 (so it covers the slowest rank), median over ``--repeats`` after one warm-up; the three methods take
turns within every repeat (so a change in machine load hits them alike). The scatter and
broadcast results are checked equal before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from cp_packing.distributed import distribute_batch, src_message_bytes
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import RanksFailed, run_distributed, synthetic_doc_ids

KEYS = ("input_ids", "labels", "position_ids")


def make_batch(B: int, S: int, *, multiple: int = 8, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """int32 doc map ``[B, S]`` (``synthetic_doc_ids``: lognormal lengths, median ~665, sigma 1.0, in units of
    ``multiple``) and the three int64 per-token tensors."""
    doc = synthetic_doc_ids("lognormal", B, S, seed=seed, median=float(np.exp(6.5)), sigma=1.0, multiple=multiple,
                            dtype=torch.int32)
    cu = packed_seq_params_from_doc_ids(doc).cu_seqlens.to(torch.int64)
    t = torch.arange(B * S)
    pos_ids = t - cu[torch.searchsorted(cu, t, right=True) - 1]  # position inside the segment
    g = torch.Generator().manual_seed(seed)
    batch = {
        "input_ids": torch.randint(0, 128000, (B, S), generator=g),
        "labels": torch.randint(0, 128000, (B, S), generator=g),
        "position_ids": pos_ids.view(B, S),
    }
    return doc, batch


def _scatter(rank, doc_ids, batch):
    if rank == 0:
        return distribute_batch(batch, packed_seq_params_from_doc_ids(doc_ids), src=0, layout="zigzag")
    return distribute_batch(None, src=0, layout="zigzag")


def _broadcast(rank, world, doc_ids, batch, B, S):
    doc = doc_ids if rank == 0 else torch.empty(B, S, dtype=torch.int32)
    dist.broadcast(doc, src=0)
    full = {}
    for k in KEYS:
        t = batch[k] if rank == 0 else torch.empty(B, S, dtype=torch.int64)
        dist.broadcast(t, src=0)
        full[k] = t
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=world, cp_rank=rank,
                                      layout="zigzag")
    return {k: sharded.shard(v).unsqueeze(0) for k, v in full.items()}, sharded


def _local(rank, doc_ids, batch):
    return distribute_batch(batch, packed_seq_params_from_doc_ids(doc_ids), layout="zigzag")


def _timed(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms per method; the methods take turns within every repeat, so load drift hits them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def _rank_main(rank, world, B, S, repeats):
    doc_ids, batch = make_batch(B, S)  # every rank builds it (only rank 0's is read, except by `local`)
    a_local, a_sh = _scatter(rank, doc_ids, batch)
    b_local, b_sh = _broadcast(rank, world, doc_ids, batch, B, S)
    for k in KEYS:
        if not torch.equal(a_local[k], b_local[k]):
            raise AssertionError(f"rank {rank}: scatter and broadcast disagree on {k}")
    if not torch.equal(a_sh.token_index, b_sh.token_index):
        raise AssertionError(f"rank {rank}: scatter and broadcast disagree on token_index")
    return _timed({
        "scatter": lambda: _scatter(rank, doc_ids, batch),
        "broadcast": lambda: _broadcast(rank, world, doc_ids, batch, B, S),
        "local": lambda: _local(rank, doc_ids, batch),
    }, repeats)


def run_cp(world: int, B: int, S: int, repeats: int, timeout: float = 300.0) -> dict[str, float]:
    """Rank 0's median ms per method, on ``world`` forked gloo ranks (``cp_packing.testing.run_distributed``)."""
    try:
        return run_distributed(_rank_main, world, B, S, repeats, timeout=timeout)[0]
    except RanksFailed as exc:
        raise RuntimeError(f"cp={world}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: S=2048, 3 repeats")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=None, help="S (default 16384, quick 2048); a multiple of 8")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 20, quick 3)")
    parser.add_argument("--cps", default="2,4", help="comma-separated CP sizes (default 2,4)")
    args = parser.parse_args(argv)
    B = args.batch
    S = args.seq if args.seq is not None else (2048 if args.quick else 16384)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 20)
    cps = [int(c) for c in args.cps.split(",")]
    if S % 8 or B < 1 or repeats < 1 or any(c not in (1, 2, 4, 8) for c in cps):
        parser.error("need S % 8 == 0, B >= 1, repeats >= 1 and cp sizes in {1, 2, 4, 8}")

    doc_ids, batch = make_batch(B, S)
    params = packed_seq_params_from_doc_ids(doc_ids)
    full_bytes = doc_ids.numel() * doc_ids.element_size() + sum(batch[k].numel() * 8 for k in KEYS)
    print(f"torch {torch.__version__}, gloo, B={B}, S={S}, {params.num_segments} segments, keys {', '.join(KEYS)} "
          f"(int64) + int32 doc map; median of {repeats} repeats, 1 thread per rank")
    header = (f"| {'cp':>2} | {'method':>9} | {'bytes recv / rank':>17} | {'of broadcast':>12} | {'ms (median)':>11} | "
              f"{'time / broadcast':>16} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for cp in cps:
        t = run_cp(cp, B, S, repeats)
        sizes = src_message_bytes(params, batch, cp_size=cp, layout="zigzag")
        got = {"scatter": sizes["total"], "broadcast": full_bytes, "local": 0}
        for method in ("scatter", "broadcast", "local"):
            print(f"| {cp:>2} | {method:>9} | {got[method]:>17,} | {got[method] / full_bytes:>11.1%} | "
                  f"{t[method]:>11.3f} | {t[method] / t['broadcast']:>15.2f}x |")
        print(f"|    | (scatter: header {sizes['header']} B + metadata {sizes['metadata']:,} B + tokens "
              f"{sizes['tokens']:,} B) | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
