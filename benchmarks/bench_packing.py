"""Packer benchmark: cp_packing.pack_documents vs TRL's pack_dataset(strategy="bfd") vs a greedy first-fit baseline.

For each length distribution (long-tailed SFT chat, long pretraining documents, many short ones) and each packer:

* fill: real tokens / token slots, once the packer's rows are dealt into steps of ``dp`` replicas x ``[rows, seq_len]``
  (the last step ``ceil(left rows / dp)`` rows per replica, as ``pack_documents`` yields it);
* kept: tokens yielded / tokens in the documents (TRL's ``bfd`` truncates documents longer than ``seq_len``);
* DP busiest/mean: per step, the costliest replica's causal attention cost (``sum L(L+1)/2`` over the segments of its
  rows, padding runs included: ``cp_packing.cost``'s model) over the mean replica; mean and worst over the steps.
  TRL and first-fit have no DP balancing: their rows go to replicas round-robin, in order;
* split: documents cut across rows (TRL ``bfd`` truncates instead; first-fit splits like ``pack_documents``;
  it fills the first of its 64 most recent rows with room);
* docs/s: documents packed per second (pack_documents: into the yielded tensors; TRL: ``pack_dataset`` on a prebuilt
  in-memory ``datasets.Dataset``, import and first-call costs excluded; first-fit: lengths only, no tensors).

Run:  PYTHONPATH=. python benchmarks/bench_packing.py            (seq_len 8192, rows 4, dp 8, 20k documents,
                                                                   5k for pretrain_long)
      PYTHONPATH=. python benchmarks/bench_packing.py --quick    (seq_len 2048, rows 2, dp 4, 1500 documents each)
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from cp_packing.packing import pack_documents


def distributions(n: int, seq_len: int, seed: int = 0) -> dict[str, list[int]]:
    """Document lengths: lognormal, the shapes of SFT chat, pretraining and short-document corpora (scaled to
    ``seq_len``)."""
    rng = np.random.default_rng(seed)
    scale = seq_len / 8192

    def lognormal(median, sigma, low, high):
        return np.clip(rng.lognormal(np.log(median * scale), sigma, n), low, high).astype(int).tolist()

    sft = lognormal(600, 1.0, 8, 4 * seq_len)
    pretrain = lognormal(3000, 1.2, 64, 16 * seq_len)[: max(n // 4, 1)]  # a quarter as many: each is long
    short = lognormal(120, 0.6, 4, seq_len)
    return {"sft_long_tail": sft, "pretrain_long": pretrain, "many_short": short}


def seg_cost(x: np.ndarray) -> np.ndarray:
    return x * (x + 1) // 2


def step_figures(row_segments: list[list[int]], *, seq_len: int, rows: int, dp: int) -> tuple[float, float, float]:
    """(fill, mean and worst busiest/mean) of rows (lists of segment lengths) dealt round-robin into steps."""
    tokens = sum(sum(r) for r in row_segments)
    costs = np.array([sum(seg_cost(np.array(r, dtype=np.int64))) + seg_cost(np.int64(seq_len - sum(r)))
                      for r in row_segments], dtype=np.float64)
    step_rows = rows * dp
    ratios = []
    slots = 0
    for start in range(0, len(costs), step_rows):
        chunk = list(costs[start:start + step_rows])
        k = math.ceil(len(chunk) / dp)
        chunk += [float(seg_cost(np.int64(seq_len)))] * (k * dp - len(chunk))  # empty rows: one padding run
        per_replica = [sum(chunk[r::dp]) for r in range(dp)]
        ratios.append(max(per_replica) / (sum(per_replica) / dp))
        slots += k * dp * seq_len
    return tokens / slots, float(np.mean(ratios)), float(np.max(ratios))


def run_ours(lengths, *, seq_len, rows, dp, buffer_size):
    docs = [np.arange(n, dtype=np.int64) % 50_000 for n in lengths]
    t = time.perf_counter()
    packer = pack_documents(docs, seq_len=seq_len, rows=rows, dp_size=dp, buffer_size=buffer_size)
    for _ in packer:
        pass
    dt = time.perf_counter() - t
    s = packer.stats
    imb = np.array(s.step_imbalance)
    return {"fill": s.fill, "kept": s.tokens / sum(lengths), "dp_mean": float(imb.mean()), "dp_worst": float(imb.max()),
            "split": s.split_documents, "docs_per_s": len(lengths) / dt}


def run_trl(lengths, *, seq_len, rows, dp, strategy):
    import datasets
    from trl import pack_dataset

    pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2]]}), seq_len, strategy=strategy)  # first-call costs
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
    datasets.disable_progress_bars()
    t = time.perf_counter()
    packed = pack_dataset(ds, seq_len, strategy=strategy)
    segs = [list(x) for x in packed["seq_lengths"]]
    dt = time.perf_counter() - t
    fill, dp_mean, dp_worst = step_figures(segs, seq_len=seq_len, rows=rows, dp=dp)
    split = sum(n > seq_len for n in lengths) if strategy == "bfd_split" else 0
    return {"fill": fill, "kept": sum(map(sum, segs)) / sum(lengths), "dp_mean": dp_mean, "dp_worst": dp_worst,
            "split": split, "docs_per_s": len(lengths) / dt}


def first_fit(lengths: list[int], seq_len: int, window: int = 64) -> list[list[int]]:
    """Greedy baseline: documents in arrival order (longer ones split into seq_len pieces), each into the first of
    the ``window`` most recently opened rows with room (a streaming first fit; older rows are closed)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for n in lengths:
        pieces = [seq_len] * (n // seq_len) + ([n % seq_len] if n % seq_len else [])
        for p in pieces:
            lo = max(0, len(rows) - window)
            r = next((i for i in range(lo, len(rows)) if room[i] >= p), None)
            if r is None:
                rows.append([])
                room.append(seq_len)
                r = len(rows) - 1
            rows[r].append(p)
            room[r] -= p
    return rows


def run_first_fit(lengths, *, seq_len, rows, dp):
    t = time.perf_counter()
    segs = first_fit(lengths, seq_len)
    dt = time.perf_counter() - t
    fill, dp_mean, dp_worst = step_figures(segs, seq_len=seq_len, rows=rows, dp=dp)
    return {"fill": fill, "kept": 1.0, "dp_mean": dp_mean, "dp_worst": dp_worst,
            "split": sum(n > seq_len for n in lengths), "docs_per_s": len(lengths) / dt}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (the test suite runs this)")
    ap.add_argument("--docs", type=int, default=None, help="documents per distribution (a quarter for pretrain_long)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--rows", type=int, default=None, help="rows per replica per step")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas")
    ap.add_argument("--buffer", type=int, default=None, help="pack_documents buffer_size (documents)")
    args = ap.parse_args(argv)
    quick = dict(docs=1500, seq_len=2048, rows=2, dp=4, buffer=1000)
    full = dict(docs=20_000, seq_len=8192, rows=4, dp=8, buffer=4096)
    cfg = {k: (getattr(args, k) if getattr(args, k) is not None else (quick if args.quick else full)[k])
           for k in full}
    print(f"seq_len={cfg['seq_len']} rows={cfg['rows']} dp={cfg['dp']} docs={cfg['docs']} "
          f"buffer_size={cfg['buffer']}; fill and DP figures per step of dp x [rows, seq_len]\n")
    print("| distribution | packer | fill | kept | DP busiest/mean (mean) | (worst step) | docs split | docs/s |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for name, lengths in distributions(cfg["docs"], cfg["seq_len"]).items():
        runs = {
            "pack_documents": run_ours(lengths, seq_len=cfg["seq_len"], rows=cfg["rows"], dp=cfg["dp"],
                                       buffer_size=cfg["buffer"]),
            "trl_bfd": run_trl(lengths, seq_len=cfg["seq_len"], rows=cfg["rows"], dp=cfg["dp"], strategy="bfd"),
            "trl_bfd_split": run_trl(lengths, seq_len=cfg["seq_len"], rows=cfg["rows"], dp=cfg["dp"],
                                     strategy="bfd_split"),
            "first_fit": run_first_fit(lengths, seq_len=cfg["seq_len"], rows=cfg["rows"], dp=cfg["dp"]),
        }
        for packer, r in runs.items():
            results.append({"distribution": name, "packer": packer, **r})
            print(f"| {name} | {packer} | {r['fill']:.4f} | {r['kept']:.3f} | {r['dp_mean']:.3f} | "
                  f"{r['dp_worst']:.3f} | {r['split']} | {r['docs_per_s']:,.0f} |")
    return results


if __name__ == "__main__":
    main()
