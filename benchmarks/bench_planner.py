"""The ``local`` planner at scale: its time next to the metadata build and a MagiAttention-style min-heap dispatch,
its peak memory next to the map's bytes, and the busiest / mean cost and remote keys of both plans, in one run.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/bench_planner.py            (1M, 16M and 64M tokens; cp 8, 32, 128)
      PYTHONPATH=. .venv/bin/python benchmarks/bench_planner.py --quick    (256K and 1M tokens; cp 8, 32)
      ... --planner path/to/local.py    (time another version of cp_packing/layouts/local.py: before / after)
      ... --magi path/to/MagiAttention  (also time MagiAttention's own dispatch from a checkout: magi_dispatch.py)

Scale maps: rows of 8192 tokens of lognormal documents (``synthetic_doc_ids("lognormal", median=60)``, as
``bench_scale.py``). Few-document maps: one row of 8192 * cp tokens, lognormal documents of mean 8k (sigma 1.5, as
``bench_exchange_bytes.py``) and ``huge`` (one document of 3/4 of the stream). Columns:

- ``meta``: ``packed_seq_params_from_doc_ids(doc_ids)``, the step's metadata build (median of ``--repeats``).
- ``local``: the planner from scratch, ``local_plan_arrays(cu, cp, ((None, 1),))`` (what ``local_plan`` runs on a
  plan-cache miss; median of ``--repeats``; ``--planner``: that file's) and its ratio to ``meta``.
- ``min-heap``: ``bench_exchange_bytes.minheap_dispatch``, a re-implementation of MagiAttention's default dispatch
  solver (512-token chunks, each costing its causal mask area, largest first onto the least-loaded rank with room
  for it: a Python min-heap), written from its ``_solve_with_minhp`` (its code is not imported: MagiAttention needs
  its CUDA extensions); timed with the chunk areas it needs.
- ``peak / map``: the planner's peak traced allocation (``tracemalloc``, NumPy's buffers included) over the doc
  map's bytes (int32 ``[T]``).
- ``magi ms`` (with ``--magi``): MagiAttention's own ``make_dispatch_meta_from_qk_ranges`` run from a checkout
  (``magi_dispatch.py``: its chunk areas and pure-Python min-heap solver, for one rank, as each rank runs it), and
  ``magi bal`` / ``magi keys`` its plan's figures.
- ``bal`` busiest / mean causal cost and ``keys`` the busiest rank's remote K/V rows over an all-gather's
  (``(cp - 1) T / cp``), for ``local`` and the min-heap dispatch (``bench_exchange_bytes.exchange_need``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tracemalloc

import numpy as np
import torch

from bench_exchange_bytes import exchange_need, family_map, minheap_dispatch, rank_cost
from bench_scale import median_seconds as _median  # one clock: the median of repeated calls

import cp_packing
import magi_dispatch
from cp_packing.layouts import local
from cp_packing.testing import synthetic_doc_ids

CHUNK = 512
FULL = ((None, 1),)  # no window: the causal cost (layouts.work.WindowWeights)


def plan_figures(cu: np.ndarray, cp: int, rank, start, length) -> tuple[float, float]:
    """A plan's runs ``(rank, start, length)``: busiest / mean causal cost and the busiest rank's remote keys over an
    all-gather's."""
    cost = rank_cost(cu, rank, start, length, cp)
    need = exchange_need(cu, rank, start, length, cp)
    t_local = int(cu[-1]) // cp
    return float(cost.max() / (cost.sum() / cp)), float(need.max() / ((cp - 1) * t_local))


def measure(doc_ids: torch.Tensor, cp: int, planner, repeats: int, magi=None) -> dict:
    """One map, one cp: the columns of the module docstring."""
    meta = _median(lambda: cp_packing.packed_seq_params_from_doc_ids(doc_ids), repeats)
    cu = cp_packing.packed_seq_params_from_doc_ids(doc_ids).cu_seqlens.to(torch.int64).numpy()

    def plan():  # the planner itself, uncached (local_plan would go through the package's plan cache and PLANS)
        return planner.local_plan_arrays(cu, cp, FULL)

    t_local = _median(plan, repeats)
    tracemalloc.start()
    offsets, start, length = plan()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rank = np.repeat(np.arange(cp, dtype=np.int64), np.diff(offsets))
    heap_time = _median(lambda: minheap_dispatch(cu, cp, CHUNK), max(1, repeats // 2))
    out = {"segments": cu.size - 1, "meta": meta, "local": t_local, "min-heap": heap_time,
           "peak / map": peak / (doc_ids.numel() * 4), "local fig": plan_figures(cu, cp, rank, start, length),
           "heap fig": plan_figures(cu, cp, *minheap_dispatch(cu, cp, CHUNK))}
    if magi is not None:
        out["magi"] = _median(lambda: magi(cu, cp), max(1, repeats // 2))
        out["magi fig"] = plan_figures(cu, cp, *magi(cu, cp))
    return out


def _row(name: str, cp: int, m: dict) -> str:
    (lb, lk), (hb, hk) = m["local fig"], m["heap fig"]
    return (f"| {name} | {cp} | {m['segments']:,} | {m['meta'] * 1e3:.1f} | {m['local'] * 1e3:.1f} | "
            f"{m['local'] / m['meta']:.1f} | {m['min-heap'] * 1e3:.1f} | {m['peak / map']:.2f} | "
            f"{lb:.5f} | {lk:.3f} | {hb:.5f} | {hk:.3f} |" + ("" if "magi" not in m else
                                                             f" {m['magi'] * 1e3:.1f} | {m['magi fig'][0]:.5f} | "
                                                             f"{m['magi fig'][1]:.3f} |"))


def load_planner(path: str | None, name: str = "local_under_test"):
    """The module at ``path`` (a version of ``cp_packing/layouts/local.py``) as ``name``; the package's for None."""
    if path is None:
        return local
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass looks its module up while the class is made
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256K and 1M tokens, cp 8 and 32 (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--cp", type=int, nargs="+", default=None)
    ap.add_argument("--planner", help="a file defining local_plan (another version of cp_packing/layouts/local.py)")
    ap.add_argument("--magi", help="a MagiAttention checkout: also time its own dispatch (magi_dispatch.py)")
    args = ap.parse_args(argv)
    sizes = (1 << 18, 1 << 20) if args.quick else (1 << 20, 1 << 24, 1 << 26)
    cps = args.cp or ((8, 32) if args.quick else (8, 32, 128))
    repeats = args.repeats or (3 if args.quick else 5)
    planner = load_planner(args.planner)
    magi = None if args.magi is None else magi_dispatch.load(args.magi)
    torch.set_num_threads(1)
    header = ("| map | cp | segments | meta ms | local ms | local / meta | min-heap ms | peak / map | "
              "local bal | local keys | min-heap bal | min-heap keys |" + (" magi ms | magi bal | magi keys |" if magi
                                                                          else ""))
    print(f"local planner: {args.planner or 'cp_packing.layouts.local'}; median of {repeats} (64M: of "
          f"{max(1, repeats // 2)}), one thread\n")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for tokens in sizes:
        doc_ids = synthetic_doc_ids("lognormal", tokens // 8192, 8192, seed=0, median=60, dtype=torch.int32)
        reps = max(1, repeats // 2) if tokens >= 1 << 26 else repeats
        for cp in cps:
            print(_row(f"lognormal median 60, {tokens >> 20 or tokens / 2**20:g}M", cp,
                       measure(doc_ids, cp, planner, reps, magi)), flush=True)
    for family in ("lognormal 8k", "huge"):
        for cp in cps:
            doc_ids = family_map(family, 8192 * cp, 0).to(torch.int32)
            print(_row(f"{family}, {8192 * cp // 1024}K", cp, measure(doc_ids, cp, planner, repeats, magi)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
