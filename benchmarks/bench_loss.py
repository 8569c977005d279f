"""Peak memory and time of the loss, forward + backward: the chunked linear + cross-entropy against the full logits.

Run:  .venv/bin/python benchmarks/bench_loss.py              (CPU: T=4096, V=32768, D=512, fp32 and bf16, ~1 min)
      .venv/bin/python benchmarks/bench_loss.py --quick      (smoke run: tiny, seconds)
      .venv/bin/python benchmarks/bench_loss.py --device cuda --tokens 32768 --vocab 131072 --hidden 4096

Three ways to get the loss and the gradients of the hidden states ``[T, D]`` and the output projection ``[V, D]``
from ``(hidden, weight, labels)``, each measured in the same run:

* **F.cross_entropy**: ``F.cross_entropy(F.linear(hidden, weight).float(), labels)``, the full ``[T, V]`` logits
  (the baseline; HF's own loss does the same);
* **packed_cross_entropy**: ``cp_packing.packed_cross_entropy(F.linear(hidden, weight), labels)``, full logits;
* **packed_linear_cross_entropy**: the chunked loss (default chunk size), no ``[T, V]`` tensor.

Peak: the most bytes live at once during ``loss`` + ``torch.autograd.grad(loss, [hidden, weight])`` above what was
live before (the inputs), the returned gradients included. On CPU, from the allocator's own records: torch.profiler
(``profile_memory=True``) logs every allocation and free of torch's CPU allocator with its size, and the peak is the
maximum of their running sum in time order (tracemalloc cannot see torch's allocations; the RSS counts freed pages).
On CUDA, ``torch.cuda.max_memory_allocated`` minus the bytes allocated before. Time: the median of ``--repeats``
runs without the profiler. The ratios against F.cross_entropy are the figures to read; docs/benchmarks.md holds them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from cp_packing.loss import default_chunk_size, packed_cross_entropy, packed_linear_cross_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def full_logits(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=-100)


def packed(hidden, weight, labels):
    return packed_cross_entropy(F.linear(hidden, weight), labels)


def chunked(hidden, weight, labels):
    return packed_linear_cross_entropy(hidden, weight, labels)


METHODS = {"F.cross_entropy": full_logits, "packed_cross_entropy": packed,
           "packed_linear_cross_entropy": chunked}


def step(fn, hidden, weight, labels):
    loss = fn(hidden, weight, labels)
    return loss.detach(), torch.autograd.grad(loss, [hidden, weight])


def cpu_peak_bytes(fn, *inputs) -> int:
    """The peak of the CPU allocator's live bytes during ``fn(*inputs)``'s step above the start
    (``bench_memory.peak_bytes``: torch.profiler's memory records, summed in time order)."""
    from bench_memory import peak_bytes

    return peak_bytes(lambda: step(fn, *inputs))


def cuda_peak_bytes(fn, *inputs) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = step(fn, *inputs)
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


def seconds(fn, inputs, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(fn, *inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inputs_for(T: int, D: int, V: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, D, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D ** 0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < 0.1] = -100
    return hidden, weight, labels.to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="smoke run: T=512, V=4096, D=64, one repeat")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.vocab, args.hidden, args.repeats = 512, 4096, 64, 1
    device = torch.device(args.device)
    T, D, V = args.tokens, args.hidden, args.vocab
    mib = 2 ** 20
    print(f"T={T} tokens, D={D}, V={V}, device={device}, torch {torch.__version__}; default chunk "
          f"{default_chunk_size(T, D, V)} tokens; one float32 [T, V] = {T * V * 4 / mib:,.0f} MiB, the weight's "
          f"gradient [V, D] in float32 = {V * D * 4 / mib:,.0f} MiB; peak from "
          f"{'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'torch.profiler memory records'}\n")
    print("| loss | dtype | peak MiB | peak / F.cross_entropy | time ms | time / F.cross_entropy | loss |")
    print("|---|---|---|---|---|---|---|")
    for name in args.dtypes:
        inputs = inputs_for(T, D, V, DTYPES[name], device)
        rows = {}
        for method, fn in METHODS.items():
            step(fn, *inputs)  # warm-up
            peak = cuda_peak_bytes(fn, *inputs) if device.type == "cuda" else cpu_peak_bytes(fn, *inputs)
            rows[method] = (peak, seconds(fn, inputs, args.repeats, device), float(step(fn, *inputs)[0]))
        base_peak, base_time, _ = rows["F.cross_entropy"]
        for method, (peak, sec, loss) in rows.items():
            print(f"| {method} | {name} | {peak / mib:,.1f} | {peak / base_peak:.3f} | {sec * 1e3:,.1f} | "
                  f"{sec / base_time:.2f} | {loss:.6f} |")


if __name__ == "__main__":
    main()
