"""Forward and backward TFLOP/s per GPU of every CP attention backend, in MagiAttention's published setting.

Run (a GPU cluster: torchrun + NCCL, each rank on its LOCAL_RANK GPU; the whole world is the CP group):
      torchrun --nnodes N --nproc-per-node 8 ... benchmarks/bench_cp_attention_gpu.py      (cp = 8 N: 8 to 64)
      .venv/bin/python benchmarks/bench_cp_attention_gpu.py --quick     (CPU smoke run: 2 gloo ranks, tiny, seconds)
      .venv/bin/python benchmarks/bench_cp_attention_gpu.py --model-only   (no run: the step-time model's forward
                                                                            times and auto's pick, cp 8 to 64)

Setting (MagiAttention's blog benchmark of distributed attention): 8K tokens per device (``--tokens``), 64 query
heads over 8 key/value heads (GQA), head dim 128, bf16, varlen causal maps of one row of ``8192 * cp`` tokens with
lognormal document lengths (sigma 1.5) of mean 2k and 8k (``--means``; ``cp_packing.testing.synthetic_doc_ids``,
every document a multiple of ``2 cp`` tokens so that one map serves every layout, zigzag included; no padding).

Backends, each with the layout it is built for: ``allgather`` on ``balanced``, ``exchange`` on ``local`` (its
communication-aware layout), ``ulysses`` on ``balanced`` (its work does not depend on the layout), ``hybrid`` with
``ulysses_size=8`` (``--ulysses-size``; Ulysses inside a node, all-gather across nodes) on ``balanced`` where 8
divides cp and is smaller than it, and ``ring_flash_attn`` on ``zigzag`` where ring-flash-attn imports (and the
dtype is fp16/bf16). A backend that cannot run is listed as skipped with the reason.

FLOP convention (the document-causal area, as MagiAttention and flash-attn count causal attention): forward
``4 * sum_d L_d (L_d + 1) / 2 * H * D`` (two matmuls of 2 FLOPs per multiply-add over the causal pairs of every
document ``d``, the diagonal included), backward ``2.5x`` the forward (five matmuls to the forward's two).
TFLOP/s per GPU = FLOP / cp / seconds / 1e12, seconds the median over ``--steps`` (after ``--warmup``) of rank 0's
clock with every forward and every backward bracketed by ``dist.barrier()`` and a CUDA synchronize (so the slowest
rank sets it). One plan per backend and map, prepared once (``prepare_attention``), every timed call one more layer
of that step (tables built once, as a model's layers read them). Beside every measured forward, the forward time
that ``backend="auto"``'s step-time model predicts (``cp_packing.cost.backend_times`` with the default
``cost.Hardware``; all-gather, exchange and Ulysses only), so a GPU run also checks the model.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIGMA = 1.5
#: backend -> (layout, extra options)
BACKENDS = {
    "allgather": ("balanced", {}),
    "exchange": ("local", {}),
    "ulysses": ("balanced", {}),
    "hybrid": ("balanced", {"ulysses_size": 8}),
    "ring_flash_attn": ("zigzag", {}),
}


def causal_flops(cu_seqlens: torch.Tensor, heads: int, head_dim: int) -> tuple[float, float]:
    """``(forward, backward)`` FLOP of causal attention within every segment (module docstring's convention).

    >>> causal_flops(torch.tensor([0, 2, 5]), 1, 1)  # 3 + 6 causal pairs
    (36.0, 90.0)
    """
    lengths = torch.diff(cu_seqlens.to(torch.float64))
    forward = 4.0 * float((lengths * (lengths + 1) / 2).sum()) * heads * head_dim
    return forward, 2.5 * forward


def _doc_ids(cfg: dict, cp: int, mean: float) -> torch.Tensor:
    from cp_packing.testing import synthetic_doc_ids

    return synthetic_doc_ids("lognormal", 1, cfg["tokens"] * cp, seed=cfg["seed"],
                             median=mean / math.exp(SIGMA**2 / 2), sigma=SIGMA, multiple=2 * cp)


def _refusal(backend: str, extra: dict, q, sharded, H_kv: int, kernel: str) -> str | None:
    """Why ``backend`` cannot run here (a local check, the same on every rank), or None."""
    from cp_packing.attention import select_backend

    if backend == "hybrid" and (sharded.cp_size % extra["ulysses_size"] or sharded.cp_size <= extra["ulysses_size"]):
        return f"ulysses_size={extra['ulysses_size']} must divide cp={sharded.cp_size} and be smaller"
    try:
        select_backend(q, sharded, backend=backend, kernel="auto" if backend == "ring_flash_attn" else kernel,
                       num_kv_heads=H_kv, **extra)
    except (ImportError, TypeError, ValueError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return None


def _time_backend(sharded, extra: dict, tensors, cfg: dict, device: torch.device, kernel: str) -> tuple[float, float]:
    """Median ``(forward, backward)`` seconds of one layer on this step's plan."""
    from cp_packing.attention import context_parallel_attention, prepare_attention

    q, k, v, dout = tensors
    step = prepare_attention(sharded, group=dist.group.WORLD, kernel=kernel, check_layers=False, **extra)
    fwd, bwd = [], []

    def clock():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        return time.perf_counter()

    for i in range(cfg["warmup"] + cfg["steps"]):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        t0 = clock()
        out = context_parallel_attention(*leaves, step)
        t1 = clock()
        out.backward(dout)
        t2 = clock()
        if i >= cfg["warmup"]:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        del out, leaves
    return statistics.median(fwd), statistics.median(bwd)


def _modelled(sharded, backend: str, cfg: dict) -> float | None:
    """The step-time model's forward seconds of ``backend`` on this shard (None where it does not price it)."""
    from cp_packing.cost import backend_times

    times = backend_times(sharded, num_heads=cfg["heads"], num_kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                          dtype_bytes=DTYPES[cfg["dtype"]].itemsize)
    return times.get(backend)


def model_table(cfg: dict, cps: list[int]) -> list[str]:
    """The model's forward ms per backend and auto's pick, for the layouts of the all-gather and the exchange."""
    from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
    from cp_packing.cost import choose_backend

    lines = ["| cp | mean doc | layout | allgather ms | exchange ms | ulysses ms | auto |",
             "|---|---|---|---|---|---|---|"]
    for cp in cps:
        for mean in cfg["means"]:
            params = packed_seq_params_from_doc_ids(_doc_ids(cfg, cp, mean))
            for layout in ("balanced", "local"):
                sharded = shard_packed_seq_params(params, cp_size=cp, cp_rank=0, layout=layout)
                cells = [_modelled(sharded, b, cfg) for b in ("allgather", "exchange", "ulysses")]
                auto = choose_backend(sharded, num_heads=cfg["heads"], num_kv_heads=cfg["kv_heads"],
                                      head_dim=cfg["head_dim"], dtype_bytes=DTYPES[cfg["dtype"]].itemsize)
                lines.append(f"| {cp} | {mean:g} | {layout} | " + " | ".join(
                    "-" if c is None else f"{1e3 * c:.2f}" for c in cells) + f" | {auto} |")
    return lines


def _worker(rank: int, world_size: int, cfg: dict) -> dict:
    from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
    from cp_packing.testing import rank_device

    device, dtype = rank_device(), DTYPES[cfg["dtype"]]
    if device.type == "cpu":
        torch.set_num_threads(1)
    H, H_kv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    kernel = cfg["kernel"]
    rows, skipped = [], []
    for mean in cfg["means"]:
        params = packed_seq_params_from_doc_ids(_doc_ids(cfg, world_size, mean))
        flops = causal_flops(params.cu_seqlens, H, D)
        for backend in cfg["backends"]:
            layout, extra = BACKENDS[backend]
            if backend == "hybrid":
                extra = {"ulysses_size": cfg["ulysses_size"]}
            sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout=layout)
            g = torch.Generator().manual_seed(rank)
            tensors = [torch.randn(sharded.num_local_tokens, h, D, generator=g).to(device, dtype)
                       for h in (H, H_kv, H_kv, H)]
            why = _refusal(backend, extra, tensors[0], sharded, H_kv, kernel)
            if why is not None:
                skipped.append((mean, backend, why))
                continue
            options = {"backend": backend, **extra}
            run_kernel = "auto" if backend == "ring_flash_attn" else kernel
            fwd, bwd = _time_backend(sharded, options, tensors, cfg, device, run_kernel)
            rows.append((mean, backend, layout, _modelled(sharded, backend, cfg), fwd,
                         flops[0] / world_size / fwd / 1e12, bwd, flops[1] / world_size / bwd / 1e12))
            del tensors
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows, "skipped": skipped, "device": device.type}


def _print(cp: int, cfg: dict, r0: dict) -> None:
    print(f"cp={cp} ({r0['device']}): {cfg['tokens']} tokens per rank, heads {cfg['heads']}/{cfg['kv_heads']} x "
          f"{cfg['head_dim']}, {cfg['dtype']}, kernel {cfg['kernel']}; median of {cfg['steps']} steps")
    print("| cp | mean doc | backend | layout | model fwd ms | fwd ms | fwd TFLOP/s/GPU | bwd ms | bwd TFLOP/s/GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mean, backend, layout, model, fwd, fwd_tf, bwd, bwd_tf in r0["rows"]:
        modelled = "-" if model is None else f"{1e3 * model:.3g}"
        print(f"| {cp} | {mean:g} | {backend} | {layout} | {modelled} | {1e3 * fwd:.2f} | {fwd_tf:.4g} | "
              f"{1e3 * bwd:.2f} | {bwd_tf:.4g} |")
    for mean, backend, why in r0["skipped"]:
        print(f"skipped: {backend} (mean doc {mean:g}): {why}")


def main(argv=None) -> int:
    from cp_packing.testing import run_distributed, under_torchrun

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke run: 2 gloo ranks, 128 tokens per rank, 4/2 heads x 8, fp32, the 'torch' kernel")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--means", default="2048,8192", help="comma-separated mean document lengths")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--kernel", default="auto", help="the varlen kernel of the built-in backends")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--ulysses-size", type=int, default=8, help="ranks per Ulysses group of the hybrid backend")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-only", action="store_true", help="print the step-time model's table for --cps, no run")
    ap.add_argument("--cps", default="8,16,32,64", help="CP sizes of --model-only")
    args = ap.parse_args(argv)
    if args.quick:
        if under_torchrun():
            ap.error("--quick forks its own 2 gloo ranks; run it without torchrun")
        args.tokens, args.means, args.heads, args.kv_heads, args.head_dim = 128, "32,128", 4, 2, 8
        args.dtype, args.kernel, args.steps, args.warmup = "fp32", "torch", 2, 1
    elif not under_torchrun() and not args.model_only:
        ap.error("run it under torchrun on GPUs (see the module docstring), or with --quick for a CPU smoke run")
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; choose among {', '.join(BACKENDS)}")
    cfg = dict(tokens=args.tokens, means=[float(m) for m in args.means.split(",")], heads=args.heads,
               kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, kernel=args.kernel,
               backends=args.backends.split(","), ulysses_size=args.ulysses_size, steps=args.steps,
               warmup=args.warmup, seed=args.seed)
    if args.model_only:
        print(f"step-time model (cost.Hardware defaults), forward of one layer at the busiest rank: {cfg['tokens']} "
              f"tokens per rank, heads {cfg['heads']}/{cfg['kv_heads']} x {cfg['head_dim']}, {cfg['dtype']}")
        print("\n".join(model_table(cfg, [int(c) for c in args.cps.split(",")])))
        return 0
    results = run_distributed(_worker, 2 if args.quick else None, cfg, timeout=3600.0)
    cp = 2 if args.quick else dist.get_world_size()
    if under_torchrun():
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    _print(cp, cfg, results[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
