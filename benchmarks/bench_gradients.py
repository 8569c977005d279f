"""Benchmark ``cp_packing.sum_gradients`` against a per-parameter all-reduce loop, and ``param_digest``'s cost.

Run:  .venv/bin/python benchmarks/bench_gradients.py            (full: 11.0M parameters in 122 tensors, 2 ranks)
      .venv/bin/python benchmarks/bench_gradients.py --quick    (smoke run: ~0.7M parameters, 2 repeats)

The model is a stack of ``--blocks`` blocks (LayerNorm, Linear(h, 4h), Linear(4h, h): 6 tensors each, plus an
embedding and a head), float32 on CPU, its gradients set once (random, the same shapes on every rank). On ``--world``
forked gloo ranks (``cp_packing.testing.run_distributed``, one intra-op thread each; one CP group of all ranks), each
repeat is bracketed by ``dist.barrier()``; the time is the slowest rank's, the median over ``--repeats``:

- ``per-parameter loop``: ``for p in model.parameters(): dist.all_reduce(p.grad)``, what the docs told users to write;
- ``sum_gradients``: ``cp_packing.sum_gradients(model, group)``: one agreement, then one flat all-reduce per bucket
  (default 25 MiB: 2 buckets here); ``4 MiB`` and ``256 MiB`` (one bucket) buckets show the bucket size's effect;
- ``param_digest``: ``cp_packing.param_digest(model)`` (no communication), against ``sum_gradients``.

A second case, ``--small`` parameters of 1024 elements each (norms and biases: the latency-bound case), runs the same
calls.

Ratios are against the per-parameter loop measured in the same run (the digest's against ``sum_gradients``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _model(blocks: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(4 * hidden, hidden)]
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)]
    layers.append(torch.nn.Linear(hidden, 4 * hidden, bias=False))
    model = torch.nn.Sequential(*layers)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def _small_tensors(count: int, size: int) -> list[torch.Tensor]:
    """``count`` parameters of ``size`` elements (norms, biases: the latency-bound case), their gradients set."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _timed(fn, repeats: int) -> float:
    """The median over ``repeats`` of the slowest rank's seconds for ``fn()`` (one untimed call first)."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    return statistics.median(times)


def _sums(model, repeats: int, bucket_sizes: tuple[float, ...]) -> dict:
    import cp_packing

    group = dist.group.WORLD
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else model

    def loop():
        for p in params:
            dist.all_reduce(p.grad, group=group)

    out = {"params": sum(p.numel() for p in params), "tensors": len(params)}
    out["per-parameter loop"] = _timed(loop, repeats)
    out["sum_gradients"] = _timed(lambda: cp_packing.sum_gradients(model, group), repeats)
    for mb in bucket_sizes:
        out[f"sum_gradients, {mb:g} MiB buckets"] = _timed(
            lambda: cp_packing.sum_gradients(model, group, bucket_mb=mb), repeats)
    out["param_digest"] = _timed(lambda: cp_packing.param_digest(model), repeats)
    return out


def _worker(rank: int, world: int, blocks: int, hidden: int, small: int, repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    return [_sums(_model(blocks, hidden), repeats, (4, 256)), _sums(_small_tensors(small, 1024), repeats, ())]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="smoke run: --blocks 4 --hidden 128 --small 100 --repeats 2")
    p.add_argument("--blocks", type=int, default=None, help="blocks of 6 tensors (default 20; quick 4)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size h (default 256; quick 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; quick 2)")
    p.add_argument("--small", type=int, default=None, help="tensors of 1024 elements in the second case "
                   "(default 1000; quick 100)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    a = p.parse_args(argv)
    blocks = a.blocks if a.blocks is not None else (4 if a.quick else 20)
    hidden = a.hidden if a.hidden is not None else (128 if a.quick else 256)
    repeats = a.repeats if a.repeats is not None else (2 if a.quick else 5)
    small = a.small if a.small is not None else (100 if a.quick else 1000)
    for name, value in (("--blocks", blocks), ("--hidden", hidden), ("--repeats", repeats), ("--small", small)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if a.world < 2:
        p.error(f"--world must be >= 2 (one rank sums nothing), got {a.world}")

    from cp_packing.testing import run_distributed

    results = run_distributed(_worker, a.world, blocks, hidden, small, repeats)[0]
    print(f"{a.world} gloo ranks, float32, median of {repeats} (slowest rank)\n")
    print("| parameters | call | ms | vs per-parameter loop |")
    print("|---|---|---:|---:|")
    for r in results:
        what = f"{r['params'] / 1e6:.2f}M in {r['tensors']} tensors"
        for name in [k for k in r if k not in ("params", "tensors", "param_digest")]:
            print(f"| {what} | {name} | {r[name] * 1e3:.1f} | {r[name] / r['per-parameter loop']:.2f} |")
    for r in results:
        print(f"\nparam_digest, {r['params'] / 1e6:.2f}M in {r['tensors']} tensors: {r['param_digest'] * 1e3:.2f} ms "
              f"= {r['param_digest'] / r['sum_gradients']:.3f} x sum_gradients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
