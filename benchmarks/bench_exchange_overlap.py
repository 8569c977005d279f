"""How much of the exchange backend's transfer the overlap hides: one layer, serialized against overlapped.

Run:  .venv/bin/python benchmarks/bench_exchange_overlap.py            (CPU gloo: cp 2 and 4, ~1.5 min)
      .venv/bin/python benchmarks/bench_exchange_overlap.py --quick    (smoke run: cp 2, tiny, seconds)
      torchrun --nproc-per-node 8 benchmarks/bench_exchange_overlap.py --tokens 8192 --heads 32 --kv-heads 8 \\
          --head-dim 128 --dtype bf16                                   (a GPU node: NCCL, this rank's GPU)

One attention layer, forward + backward, ``backend="exchange"``, on one row of ``--tokens * cp`` tokens of
lognormal documents (``--layout``, default ``contiguous``: documents stay whole, so the exchange moves a real share
of the stream but not all of it). Five things are timed in the same run, interleaved step by step (median over
``--steps`` after ``--warmup``; every step bracketed by ``dist.barrier()``, rank 0's clock, which covers the
slowest rank):

* **serialized**: ``prepare_attention(..., overlap=False)``: wait for the keys, then one kernel call per run;
* **overlapped**: ``overlap=True``: the local part's kernel runs while the all-to-all is in flight, the remote part
  after it lands, merged by log-sum-exp; backward the mirror image;
* **transfer**: the two all-to-alls of one layer alone (forward K/V, backward dK/dV), with this step's splits and
  row shape, nothing else;
* both paths again **without a transfer** (the exchange's all-to-all replaced by a buffer of zeros of the received
  shape): their kernels alone. The paths differ in kernel calls (one joint call per run against a local and a
  remote call plus a merge), and that difference is in ``serialized - overlapped`` too.

``hidden = (serialized - overlapped) / transfer``, clipped to [0, 1]: the fraction of the transfer the overlap
takes off the step; ``corrected`` subtracts the kernels-only difference first. On CPU gloo the ranks share one
machine's cores (one intra-op thread each, gloo's transfer thread competes with the kernel) and the transfer is a
few percent of a slow reference kernel: the figures are a smoke test of the mechanism, not a prediction for GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIGMA = 1.5


def _clock(device: torch.device) -> float:
    """Seconds, once every rank got here with its device idle."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter()


def _timed(fn, device: torch.device) -> float:
    t0 = _clock(device)
    fn()
    return _clock(device) - t0


class _Done:
    """A finished work handle."""

    def wait(self):
        return True


@contextlib.contextmanager
def _no_transfer():
    """The exchange's all-to-all replaced by a zero buffer of the received shape: its kernels alone."""
    from cp_packing.attention import exchange

    saved = exchange._a2a

    def local(buffer, out_splits, in_splits, group):
        return buffer.new_zeros((sum(out_splits), *buffer.shape[1:])), _Done()

    exchange._a2a = local
    try:
        yield
    finally:
        exchange._a2a = saved


def _worker(rank: int, world_size: int, cfg: dict) -> dict:
    from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
    from cp_packing.attention import context_parallel_attention, prepare_attention
    from cp_packing.attention.exchange import exchange_tables
    from cp_packing.testing import rank_device, synthetic_doc_ids

    torch.set_num_threads(cfg["threads"])
    device, dtype = rank_device(), DTYPES[cfg["dtype"]]
    H, H_kv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    doc_ids = synthetic_doc_ids("lognormal", 1, cfg["tokens"] * world_size, seed=cfg["seed"],
                                median=cfg["mean"] / math.exp(SIGMA**2 / 2), sigma=SIGMA)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc_ids), cp_size=world_size, cp_rank=rank,
                                      layout=cfg["layout"])
    T_local = sharded.num_local_tokens
    g = torch.Generator().manual_seed(rank)
    q, k, v, dout = (torch.randn(T_local, h, D, generator=g).to(device, dtype) for h in (H, H_kv, H_kv, H))
    tables = exchange_tables(sharded, device=device)
    steps = {overlap: prepare_attention(sharded, group=dist.group.WORLD, backend="exchange", kernel=cfg["kernel"],
                                        overlap=overlap, check_layers=False) for overlap in (False, True)}

    def layer(overlap: bool, transfer: bool = True):
        def run():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            with contextlib.nullcontext() if transfer else _no_transfer():
                context_parallel_attention(*leaves, steps[overlap]).backward(dout)  # one more layer of the step
        return run

    send = k.new_zeros((sum(tables.send_splits), 2, H_kv, D))
    recv = k.new_zeros((sum(tables.recv_splits), 2, H_kv, D))

    def transfer():  # the layer's two all-to-alls: K/V out, dK/dV back
        dist.all_to_all_single(recv, send, tables.recv_splits, tables.send_splits)
        dist.all_to_all_single(send, recv, tables.send_splits, tables.recv_splits)

    runs = {"serialized": layer(False), "overlapped": layer(True), "transfer": transfer,
            "serialized kernels": layer(False, transfer=False), "overlapped kernels": layer(True, transfer=False)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(cfg["warmup"] + cfg["steps"]):
        for name, fn in runs.items():
            seconds = _timed(fn, device)
            if i >= cfg["warmup"]:
                times[name].append(seconds)
    received = torch.tensor([sum(tables.recv_splits)], device=device)
    dist.all_reduce(received, op=dist.ReduceOp.MAX)
    return {"times": {name: statistics.median(t) for name, t in times.items()}, "T_local": T_local,
            "busiest": int(received), "device": device.type}


COLUMNS = ("cp", "layout", "T_local", "recv rows", "of allgather", "kernels ser ms", "kernels ovl ms",
           "serialized ms", "overlapped ms", "transfer ms", "corrected", "hidden")


def _width(header: str) -> int:
    return 10 if header == "layout" else max(6, len(header))


def _clip(x: float) -> float:
    return min(1.0, max(0.0, x))


def _row(cp: int, layout: str, r: dict) -> str:
    t = r["times"]
    saved = t["serialized"] - t["overlapped"]
    kernels = t["serialized kernels"] - t["overlapped kernels"]
    share = r["busiest"] / ((cp - 1) * r["T_local"])
    cells = [f"cp={cp}", layout, str(r["T_local"]), str(r["busiest"]), f"{share:.3f}"]
    cells += [f"{1e3 * t[name]:.2f}" for name in ("serialized kernels", "overlapped kernels", "serialized",
                                                  "overlapped", "transfer")]
    cells += [f"{_clip((saved - kernels) / t['transfer']):.3f}", f"{_clip(saved / t['transfer']):.3f}"]
    return " ".join(f"{c:>{_width(h)}}" for c, h in zip(cells, COLUMNS))


def main(argv=None) -> int:
    from cp_packing.testing import run_distributed, under_torchrun

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: cp 2, 256 tokens per rank, 3 steps")
    ap.add_argument("--cps", default="2,4", help="CP sizes, comma-separated (forked gloo ranks; torchrun: its size)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--mean", type=float, default=1024.0, help="mean document length (lognormal, sigma 1.5)")
    ap.add_argument("--layout", default="contiguous")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    ap.add_argument("--kernel", default=None, help="default: 'torch' on CPU, 'auto' under torchrun")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.cps, args.tokens, args.mean, args.steps, args.warmup = "2", 256, 256.0, 3, 1
    cfg = dict(tokens=args.tokens, mean=args.mean, layout=args.layout, heads=args.heads, kv_heads=args.kv_heads,
               head_dim=args.head_dim, dtype=args.dtype, threads=args.threads, steps=args.steps, warmup=args.warmup,
               seed=args.seed, kernel=args.kernel or ("auto" if under_torchrun() else "torch"))
    sizes = [int(os.environ["WORLD_SIZE"])] if under_torchrun() else [int(c) for c in args.cps.split(",")]
    done = [(cp, run_distributed(_worker, cp, cfg, timeout=1800.0)[0]) for cp in sizes]
    if under_torchrun():
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    print(f"exchange overlap ({done[0][1]['device']}): {args.tokens} tokens per rank, lognormal mean {args.mean:g}, "
          f"heads {args.heads}/{args.kv_heads} x {args.head_dim}, {args.dtype}, kernel {cfg['kernel']}; "
          f"median of {args.steps} one-layer fwd+bwd steps")
    print(" ".join(f"{h:>{_width(h)}}" for h in COLUMNS))
    for cp, r0 in done:
        print(_row(cp, args.layout, r0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
