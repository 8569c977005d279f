"""Benchmark ``packed_seq_params_from_doc_ids`` (CPU) against a straightforward torch formulation and a clone.

Run:  .venv/bin/python benchmarks/bench_packed_seq.py            (full: [1,4096], [8,131072], [4,1048576])
      .venv/bin/python benchmarks/bench_packed_seq.py --quick    (smoke run, small maps, 2 repeats)

Every timing uses ONE torch/intra-op thread (``torch.set_num_threads(1)``) and is the median over 3 rounds of
``--repeats`` samples (each round times every candidate in turn, after a warm-up call); a sample loops a tiny case
until it lasts >= 0.2 ms, and stays well inside one scheduler time slice. The doc maps are int32 ``[B, S]`` with
long-tailed (lognormal) document lengths (median ~665, sigma 1.5) and up to S/32 padding at the end of each row
(``cp_packing.testing.synthetic_doc_ids``), seeded (``--seed``).

Columns:
- ``ours``: ``packed_seq_params_from_doc_ids`` (the NumPy CPU path, input checks included).
- ``baseline``: the straightforward torch formulation (compare neighbours, mark row starts with
  ``torch.arange(T) % S == 0``, ``nonzero``, ``cat``; no input checks).
- ``clone``: ``doc_ids.clone()`` (allocate + copy the map; a fresh allocation pays its page faults).
- ``copy``: ``buf.copy_(doc_ids)`` into a preallocated buffer (memory bandwidth only; a harder reference).
- ``torch path``: ``_from_doc_ids_torch`` on CPU, the device path, for information only.
Ratios: ``base/ours`` (speed-up; target >= 20x at the two large sizes), ``ours/clone`` (target <= 3x) and
``ours/copy`` for information.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from cp_packing.packed_seq import _from_doc_ids_torch, packed_seq_params_from_doc_ids
from cp_packing.testing import synthetic_doc_ids

FULL_SHAPES = [(1, 4096), (8, 131072), (4, 1048576)]
QUICK_SHAPES = [(1, 4096), (2, 16384)]


def straightforward(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The obvious torch formulation (no input checks): the baseline to beat."""
    B, S = doc_ids.shape
    T = B * S
    flat = doc_ids.reshape(-1)
    change = torch.cat([torch.ones(1, dtype=torch.bool), flat[1:] != flat[:-1]])
    change |= torch.arange(T) % S == 0
    starts = change.nonzero().view(-1)
    cu = torch.cat([starts, torch.tensor([T])]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    return cu, max_seqlen


def _loops(fn: Callable[[], object], min_seconds: float = 2e-4) -> int:
    """Calls per timed sample so that one sample lasts >= min_seconds (timer noise, tiny maps); also a warm-up."""
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(10_000, int(min_seconds / once) + 1))


def time_ms(fns: dict[str, Callable[[], object]], repeats: int, stat: str, rounds: int = 3) -> dict[str, float]:
    """Milliseconds per call of every fn: the median (or min) over ``rounds * repeats`` samples.

    Each round times every fn in turn, ``repeats`` consecutive samples after a warm-up call (so each is measured
    in its own steady state: warm caches, warm allocator), and the rounds spread each fn over time, so that bursts
    of load from other processes hit all of them alike.
    """
    loops = {name: _loops(fn) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            n = loops[name]
            fn()
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                samples[name].append((time.perf_counter() - t0) / n)
    reduce = statistics.median if stat == "median" else min
    return {name: reduce(times) * 1e3 for name, times in samples.items()}


def bench_shape(
    batch: int, seq_len: int, *, repeats: int, rounds: int, seed: int, torch_path: bool, stat: str
) -> dict[str, float]:
    doc_ids = synthetic_doc_ids("lognormal", batch, seq_len, seed=seed, median=float(np.exp(6.5)), sigma=1.5,
                                pad=1 / 32, dtype=torch.int32)
    params = packed_seq_params_from_doc_ids(doc_ids)
    cu_ref, max_ref = straightforward(doc_ids)
    if not (torch.equal(params.cu_seqlens, cu_ref) and params.max_seqlen == max_ref):
        raise AssertionError(f"[{batch},{seq_len}]: packed_seq_params_from_doc_ids disagrees with the baseline")
    cu_t, max_t = _from_doc_ids_torch(doc_ids)
    if not (torch.equal(cu_t, cu_ref) and max_t == max_ref):
        raise AssertionError(f"[{batch},{seq_len}]: _from_doc_ids_torch disagrees with the baseline")
    buf = torch.empty_like(doc_ids)
    fns: dict[str, Callable[[], object]] = {
        "ours": lambda: packed_seq_params_from_doc_ids(doc_ids),
        "baseline": lambda: straightforward(doc_ids),
        "clone": lambda: doc_ids.clone(),
        "copy": lambda: buf.copy_(doc_ids),
    }
    if torch_path:
        fns["torch path"] = lambda: _from_doc_ids_torch(doc_ids)
    row = {"segments": params.num_segments, "max_seqlen": params.max_seqlen, "torch path": float("nan")}
    row.update(time_ms(fns, repeats, stat, rounds))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small maps, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed samples per candidate and round (3 rounds; default 11; --quick: 2, one round)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stat", choices=["median", "min"], default="median",
                        help="statistic over the samples (min is the robust figure on a loaded machine)")
    parser.add_argument("--no-torch-path", action="store_true", help="skip timing _from_doc_ids_torch")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 11)
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    rounds = 1 if args.quick else 3

    torch.set_num_threads(1)
    load = ", load average %.2f" % os.getloadavg()[0] if hasattr(os, "getloadavg") else ""
    print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} cpus, "
          f"threads {torch.get_num_threads()}{load}, {args.stat} of {rounds}x{repeats} samples, times in ms")
    header = (f"| {'shape':>12} | {'segments':>8} | {'max_seqlen':>10} | {'ours':>8} | {'baseline':>8} | "
              f"{'clone':>8} | {'copy':>8} | {'torch path':>10} | {'base/ours':>9} | {'ours/clone':>10} | "
              f"{'ours/copy':>9} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for batch, seq_len in shapes:
        r = bench_shape(batch, seq_len, repeats=repeats, rounds=rounds, seed=args.seed,
                        torch_path=not args.no_torch_path, stat=args.stat)
        shape = f"[{batch},{seq_len}]"
        print(f"| {shape:>12} | {r['segments']:>8} | {r['max_seqlen']:>10} | {r['ours']:>8.3f} | "
              f"{r['baseline']:>8.3f} | {r['clone']:>8.3f} | {r['copy']:>8.3f} | {r['torch path']:>10.3f} | "
              f"{r['baseline'] / r['ours']:>8.1f}x | {r['ours'] / r['clone']:>9.2f}x | "
              f"{r['ours'] / r['copy']:>8.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
