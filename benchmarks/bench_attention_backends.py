"""Bytes per layer and measured time per CP attention backend (all-gather, exchange, Ulysses, hybrid), and the fraction
of ideal.

Run:  .venv/bin/python benchmarks/bench_attention_backends.py            (CPU gloo: cp 2 and 4, 4096 tokens)
      .venv/bin/python benchmarks/bench_attention_backends.py --quick    (smoke run: cp 2, 512 tokens, 2 steps)
      torchrun --nproc-per-node 8 benchmarks/bench_attention_backends.py --cps 8 --seq 65536 --dtype bf16
                                                                          (a GPU node: NCCL, this rank's GPU)

One attention layer, forward + backward, on one row of ``--seq`` tokens of lognormal documents (up to 10% padding),
``balanced`` layout, ``--heads`` / ``--kv-heads`` / ``--head-dim``. For every backend that can run (Ulysses: cp
divides the query heads; hybrid: ``ulysses_size=2`` at cp >= 4) it prints the forward bytes per layer and rank
(``cp_packing.cost.backend_bytes``), the median step time over ``--steps`` (after ``--warmup``; every step bracketed
by ``dist.barrier()``, rank 0's time, which covers the slowest rank), and the fraction of the ideal: the time of the
same layer on ONE device over the whole stream (cp 1, measured on rank 0 in the same run) divided by cp, over the
measured time (1.0 = perfect scaling; CPU gloo ranks share one machine's cores, so there it is a smoke figure). The
backend ``backend="auto"`` picks (by bytes) is marked.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time(fn, steps: int, warmup: int, device: torch.device, barrier: bool) -> float:
    times = []
    for i in range(warmup + steps):
        if barrier:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if barrier:
            dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world_size: int, cfg: dict):
    from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
    from cp_packing.attention import context_parallel_attention, select_backend
    from cp_packing.cost import backend_bytes
    from cp_packing.testing import synthetic_doc_ids

    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = DTYPES[cfg["dtype"]]
    H, H_kv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    doc_ids = synthetic_doc_ids("lognormal", 1, cfg["seq"], seed=0, pad=0.1)
    params = packed_seq_params_from_doc_ids(doc_ids)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(params.total_tokens, h, D, generator=g).to(device, dtype) for h in (H, H_kv, H_kv)]

    def step(sharded, tensors, **kw):
        def run():
            q, k, v = (x.detach().requires_grad_() for x in tensors)
            out = context_parallel_attention(q, k, v, sharded, **kw)
            out.backward(torch.ones_like(out))
        return run

    single = None
    if rank == 0:  # the one-device reference: the whole stream on this rank, no communication
        one = shard_packed_seq_params(params, cp_size=1, cp_rank=0)
        single = _time(step(one, full, backend="allgather"), cfg["steps"], cfg["warmup"], device, barrier=False)
    dist.barrier()
    sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout="balanced")
    local = [sharded.shard(x) for x in full]
    auto = select_backend(local[0], sharded, num_kv_heads=H_kv)[0]
    rows = []
    candidates = [("allgather", {}), ("exchange", {}), ("ulysses", {})] + (
        [("hybrid", {"ulysses_size": 2})] if world_size >= 4 else [])
    for backend, extra in candidates:
        if backend in ("ulysses", "hybrid") and H % extra.get("ulysses_size", world_size):
            continue
        if backend == "exchange":  # what this rank receives: the keys its queries need (the step plan's tables)
            from cp_packing.attention.exchange import exchange_tables

            nbytes = exchange_tables(sharded).num_received * 2 * H_kv * D * local[0].element_size()
        else:
            nbytes = backend_bytes(backend, T_local=sharded.num_local_tokens, cp_size=world_size, num_heads=H,
                                   num_kv_heads=H_kv, head_dim=D, dtype_bytes=local[0].element_size(), **extra)
        seconds = _time(step(sharded, local, backend=backend, group=dist.group.WORLD, **extra), cfg["steps"],
                        cfg["warmup"], device, barrier=True)
        rows.append((backend + (f" U={extra['ulysses_size']}" if extra else ""), backend == auto, nbytes, seconds))
    return {"single": single, "rows": rows, "device": device.type, "T_local": sharded.num_local_tokens}


def main(argv=None) -> int:
    from cp_packing.testing import run_distributed, under_torchrun

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: cp 2, 512 tokens, 2 steps")
    ap.add_argument("--cps", default="2,4", help="comma-separated CP sizes (forked gloo ranks; under torchrun: its size)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.cps, args.seq, args.steps, args.warmup = "2", 512, 2, 1
    cfg = dict(seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
               steps=args.steps, warmup=args.warmup)
    cps = [None] if under_torchrun() else [int(c) for c in args.cps.split(",")]
    for cp in cps:
        results = run_distributed(_worker, cp, cfg, timeout=1800.0)
        if under_torchrun() and dist.get_rank() != 0:
            continue
        r0 = results[0]
        cp = cp or dist.get_world_size()
        print(f"cp={cp} ({r0['device']}), {args.seq} tokens (T_local={r0['T_local']}), heads {args.heads}/"
              f"{args.kv_heads} x {args.head_dim}, {args.dtype}; one device: {1e3 * r0['single']:.2f} ms")
        print(f"  {'backend':<14} {'fwd MiB/layer':>13} {'fwd+bwd ms':>11} {'fraction of ideal':>17}")
        for name, picked, nbytes, seconds in r0["rows"]:
            frac = r0["single"] / cp / seconds
            print(f"  {name:<14} {nbytes / 2**20:>13.3f} {1e3 * seconds:>11.2f} {frac:>17.3f}"
                  f"{'   <- auto' if picked else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
