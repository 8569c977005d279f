"""Benchmark ``distribute_batch``: bytes each rank receives and time, against local sharding and a full broadcast.

Run:  .venv/bin/python benchmarks/bench_distribute.py            (full: B=4, S=16384, cp in {2, 4}, 20 repeats)
      .venv/bin/python benchmarks/bench_distribute.py --quick    (smoke run: S=2048, 3 repeats)

Setup: ``cp`` processes forked on this machine join a gloo group (TCPStore on a free loopback port), one intra-op
thread each. Group rank 0 is the source. The batch is ``input_ids``, ``labels``, ``position_ids`` (int64 ``[B, S]``)
and an int32 doc map with lognormal document lengths (median ~665 tokens) rounded up to multiples of 8, so that
``layout="zigzag"`` is valid for cp 2 and 4.

Methods (each ends with every rank holding its ``[1, T_local]`` tensors and its ``ShardedPackedSeqParams``):
- ``shard``: local sharding without cp-packing's distributed layer (``packed_seq_params_from_doc_ids`` +
  ``shard_packed_seq_params`` + ``sharded.shard`` per key); the floor every other row is divided by.
- ``local``: ``distribute_batch(batch, params, src=None)``: every rank holds the batch.
- ``local+check``: the same with ``check_consistent=True`` (digests of the doc map, ``cu_seqlens`` and every tensor).
- ``scatter``: ``distribute_batch(batch, params, src=0)``; the source builds ``params`` inside the timed region.
- ``broadcast``: the source ``dist.broadcast``s the full doc map and the three tensors; every rank shards locally.
- ``agree``: one ``cp_packing.agreement.agree`` call with the fields ``distribute_batch`` sends (its fixed cost);
  also timed back to back (``4 x repeats`` calls, no barrier in between) next to ``shard``: the per-call cost.

Bytes received: MEASURED, not computed: ``count_received_bytes`` wraps ``torch.distributed``'s ``broadcast``,
``all_gather`` and ``scatter`` (the object collectives call them too) and adds up the bytes that land in this rank's
buffers from other ranks (broadcast: the tensor unless this rank is the source; scatter: the output tensor unless
this rank is the source; all_gather: every other rank's slot). Reported for group rank 1 (a non-source rank), split
by collective. The run fails if a non-source rank of ``scatter`` receives more than its own token bytes plus
``32 B x segments + 4 KiB x cp``. Times: every repeat is bracketed by ``dist.barrier()`` on both sides and timed on
rank 0 (so it covers the slowest rank), median over ``--repeats`` after one warm-up; the methods take turns within
every repeat (so a change in machine load hits them alike). The scatter and broadcast results are checked equal to
local sharding before timing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from cp_packing.agreement import agree
from cp_packing.distributed import distribute_batch
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import RanksFailed, run_distributed, synthetic_doc_ids

KEYS = ("input_ids", "labels", "position_ids")
METHODS = ("shard", "local", "local+check", "scatter", "broadcast", "agree")


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


# ----------------------------------------------------------------------------------------------------------------
# Measuring bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_source(args: tuple, kwargs: dict, src_pos: int) -> bool:
    """Whether this process is the source of a broadcast / scatter call (``src``: global rank at position
    ``src_pos``; ``group_src``: group rank)."""
    if kwargs.get("group_src") is not None:
        return dist.get_rank(kwargs.get("group", args[src_pos + 1] if len(args) > src_pos + 1 else None)) == \
            kwargs["group_src"]
    return dist.get_rank() == kwargs.get("src", args[src_pos] if len(args) > src_pos else None)


@contextlib.contextmanager
def count_received_bytes() -> Iterator[Counter]:
    """Count the bytes that reach this rank from other ranks, per collective, while the block runs.

    Wraps ``broadcast``, ``all_gather`` and ``scatter`` in ``torch.distributed`` (and in ``distributed_c10d``, where
    ``all_gather_object`` and ``broadcast_object_list`` find them); restores them on exit.
    """
    counts: Counter = Counter()
    c10d = dist.distributed_c10d
    originals = {name: getattr(c10d, name) for name in ("broadcast", "all_gather", "scatter")}

    def broadcast(*args, **kwargs):
        if not _is_source(args, kwargs, 1):
            counts["broadcast"] += _nbytes(args[0] if args else kwargs["tensor"])
        return originals["broadcast"](*args, **kwargs)

    def scatter(*args, **kwargs):
        if not _is_source(args, kwargs, 2):
            counts["scatter"] += _nbytes(args[0] if args else kwargs["tensor"])
        return originals["scatter"](*args, **kwargs)

    def all_gather(*args, **kwargs):
        out = args[0] if args else kwargs["tensor_list"]
        mine = dist.get_rank(kwargs.get("group", args[2] if len(args) > 2 else None))
        counts["all_gather"] += sum(_nbytes(t) for r, t in enumerate(out) if r != mine)
        return originals["all_gather"](*args, **kwargs)

    wrappers = {"broadcast": broadcast, "scatter": scatter, "all_gather": all_gather}
    try:
        for name, fn in wrappers.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


# ----------------------------------------------------------------------------------------------------------------
# Methods


def _shard(rank, world, doc_ids, batch):
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc_ids), cp_size=world, cp_rank=rank,
                                      layout="zigzag")
    return {k: sharded.shard(v).unsqueeze(0) for k, v in batch.items()}, sharded


def _local(doc_ids, batch, check):
    return distribute_batch(batch, packed_seq_params_from_doc_ids(doc_ids), layout="zigzag", check_consistent=check)


def _scatter(rank, doc_ids, batch):
    if rank == 0:
        return distribute_batch(batch, packed_seq_params_from_doc_ids(doc_ids), src=0, layout="zigzag")
    return distribute_batch(None, src=0, layout="zigzag")


def _broadcast(rank, world, doc_ids, batch):
    B, S = doc_ids.shape
    doc = doc_ids if rank == 0 else torch.empty(B, S, dtype=torch.int32)
    dist.broadcast(doc, src=0)
    full = {}
    for k in KEYS:
        t = batch[k] if rank == 0 else torch.empty(B, S, dtype=torch.int64)
        dist.broadcast(t, src=0)
        full[k] = t
    return _shard(rank, world, doc, full)


def _agree():
    return agree(dist.group.WORLD, "distribute_batch", {"src": None, "check_consistent": False, "layout": "zigzag",
                                                       "doc map": None, "cu_seqlens": None, "batch": None})


def _timed(fns: dict[str, Callable], repeats: int) -> dict[str, float]:
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
    doc_ids, batch = make_batch(B, S)  # every rank builds it (only rank 0's is read by scatter and broadcast)
    fns = {
        "shard": lambda: _shard(rank, world, doc_ids, batch),
        "local": lambda: _local(doc_ids, batch, False),
        "local+check": lambda: _local(doc_ids, batch, True),
        "scatter": lambda: _scatter(rank, doc_ids, batch),
        "broadcast": lambda: _broadcast(rank, world, doc_ids, batch),
        "agree": _agree,
    }
    want, want_sh = fns["shard"]()
    received = {}
    for name, fn in fns.items():
        with count_received_bytes() as counts:
            out = fn()
        received[name] = dict(counts)
        if name != "agree":
            for k in KEYS:
                if not torch.equal(out[0][k], want[k]):
                    raise AssertionError(f"rank {rank}: {name} differs from local sharding on {k}")
            if not torch.equal(out[1].token_index, want_sh.token_index):
                raise AssertionError(f"rank {rank}: {name} differs from local sharding on token_index")
    row = _timed(fns, repeats)
    for name in ("agree", "shard"):  # back to back, no barrier in between: the per-call cost
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(4 * repeats):
            fns[name]()
        dist.barrier()
        row[f"{name} back to back"] = (time.perf_counter() - t0) / (4 * repeats) * 1e3
    return row, received


def run_cp(world: int, B: int, S: int, repeats: int, timeout: float = 300.0) -> tuple[dict, dict]:
    """``(ms per method on rank 0, bytes received per method and collective on group rank 1)``, on ``world``
    forked gloo ranks (``cp_packing.testing.run_distributed``)."""
    try:
        rows = run_distributed(_rank_main, world, B, S, repeats, timeout=timeout)
    except RanksFailed as exc:
        raise RuntimeError(f"cp={world}: {exc}") from None
    return rows[0][0], rows[min(1, world - 1)][1]


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
    if S % 8 or B < 1 or repeats < 1 or any(c not in (2, 4, 8) for c in cps):
        parser.error("need S % 8 == 0, B >= 1, repeats >= 1 and cp sizes in {2, 4, 8}")

    doc_ids, batch = make_batch(B, S)
    segments = packed_seq_params_from_doc_ids(doc_ids).num_segments
    full_bytes = doc_ids.numel() * doc_ids.element_size() + sum(batch[k].numel() * 8 for k in KEYS)
    print(f"torch {torch.__version__}, gloo, B={B}, S={S}, {segments} segments, keys {', '.join(KEYS)} (int64) + "
          f"int32 doc map ({full_bytes:,} B); median of {repeats} repeats, 1 thread per rank; bytes measured on "
          "group rank 1 (all_gather + broadcast + scatter)")
    header = (f"| {'cp':>2} | {'method':>11} | {'bytes recv / rank':>17} | {'all_gather':>10} | {'broadcast':>9} | "
              f"{'scatter':>9} | {'ms (median)':>11} | {'time / shard':>12} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    failures = []
    for cp in cps:
        times, received = run_cp(cp, B, S, repeats)
        for method in METHODS:
            got = received[method]
            total = sum(got.values())
            print(f"| {cp:>2} | {method:>11} | {total:>17,} | {got.get('all_gather', 0):>10,} | "
                  f"{got.get('broadcast', 0):>9,} | {got.get('scatter', 0):>9,} | {times[method]:>11.3f} | "
                  f"{times[method] / times['shard']:>11.2f}x |")
        print(f"|    | (back to back, {4 * repeats} calls: agree {times['agree back to back']:.3f} ms per call, local "
              f"sharding {times['shard back to back']:.3f} ms per call) | | | | | | |")
        token_bytes = B * S // cp * 8 * len(KEYS)
        bound = token_bytes + 32 * segments + 4096 * cp
        if sum(received["scatter"].values()) > bound:
            failures.append(f"cp={cp}: scatter received {sum(received['scatter'].values()):,} B > {bound:,} B")
    for failure in failures:
        print(f"FAIL: {failure} (own tokens + 32 B x segments + 4 KiB x cp)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
