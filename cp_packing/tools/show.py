"""``python -m cp_packing show``: what a doc map becomes: its seed metadata and every CP rank's shard.

    python -m cp_packing show                                   # the example map [[1, 1, 2, 2, 2, 0]], cp=2
    python -m cp_packing show --doc-ids "[[1,1,1,1,2,2,2,2]]" --cp 2 --layout zigzag
    python -m cp_packing show --doc-ids batch.pt --cp 8 --layout balanced       # a large map: a summary

A map of at most 64 tokens (or any map with ``--full``) is printed token by token: ``cu_seqlens``, ``max_seqlen``
and every rank's shard metadata. A larger one is summarised: segment count and length statistics, then one line
per rank (tokens, real tokens, runs, longest run, causal attention cost and its ratio to the mean).
"""

from __future__ import annotations

import argparse

import torch

from cp_packing.tools import load_doc_ids, positive_int

EXAMPLE_DOC_IDS = [[1, 1, 2, 2, 2, 0]]
FULL_MAX_TOKENS = 64  # larger maps are summarised unless --full


def add_parser(sub) -> None:
    show = sub.add_parser("show", help="seed metadata and every rank's shard of a doc map (a summary if large)",
                          description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=__doc__.split("\n\n", 1)[1])
    show.add_argument("--doc-ids", help='a JSON map such as "[[1,1,2,2,2,0]]", or a .pt / .npy file '
                      f"(default: {EXAMPLE_DOC_IDS})")
    show.add_argument("--cp", type=positive_int, default=2, help="CP group size (default 2)")
    show.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag", "balanced", "auto"])
    show.add_argument("--full", action="store_true",
                      help=f"print every token even for a map of more than {FULL_MAX_TOKENS} tokens")
    show.set_defaults(func=run)


def _fmt(x) -> str:
    return str(x.tolist()) if isinstance(x, torch.Tensor) else str(x)


def _run_cost(sharded) -> int:
    """Causal attention cost of one rank: sum over its tokens of (position in segment + 1)."""
    from cp_packing.cost import causal_cost

    run_cu = sharded.cu_seqlens.to(torch.int64)
    run_start = sharded.token_index.index_select(0, run_cu[:-1])
    return int(causal_cost(sharded.global_params.cu_seqlens, run_start, run_cu[1:] - run_cu[:-1]).sum())


def _print_full(doc_ids, params, shards, layout: str) -> None:
    print(f"doc_ids      {_fmt(doc_ids)}   # [B={doc_ids.shape[0]}, S={doc_ids.shape[1]}]")
    print(f"cu_seqlens   {_fmt(params.cu_seqlens)}   # int32, padding runs included, a boundary at every row start")
    print(f"max_seqlen   {params.max_seqlen}")
    print(f"\ncp_size={len(shards)}, layout={layout!r}")
    if layout == "auto":
        print(f"auto picked {shards[0].layout!r}")
    for rank, s in enumerate(shards):
        print(f"rank {rank}:")
        print(f"  token_index    {_fmt(s.token_index)}")
        print(f"  doc_ids        {_fmt(s.doc_ids)}")
        print(f"  position_ids   {_fmt(s.position_ids)}")
        print(f"  cu_seqlens     {_fmt(s.cu_seqlens)}   max_seqlen {s.max_seqlen}")
        print(f"  key_start      {_fmt(s.key_start)}")


def _print_summary(doc_ids, params, shards, layout: str) -> None:
    B, S = doc_ids.shape
    flat = doc_ids.reshape(-1)
    cu = params.cu_seqlens.to(torch.int64)
    lengths = (cu[1:] - cu[:-1]).double()
    pad_runs = int((flat[cu[:-1]] == 0).sum())
    n_pad = int((flat == 0).sum())
    print(f"doc_ids      [B={B}, S={S}], {B * S:,} tokens: {params.num_segments - pad_runs:,} documents, "
          f"{params.num_segments:,} segments ({pad_runs:,} padding runs), {n_pad:,} padding tokens "
          f"({100 * n_pad / max(1, B * S):.1f}%)")
    print(f"segment lengths  min {int(lengths.min())}  median {int(lengths.median())}  mean {float(lengths.mean()):.1f}"
          f"  max {params.max_seqlen}   (cu_seqlens int32 [{cu.numel()}])")
    print(f"\ncp_size={len(shards)}, layout={layout!r}" + (f", auto picked {shards[0].layout!r}" if layout == "auto"
                                                         else ""))
    costs = [_run_cost(s) for s in shards]
    mean = sum(costs) / len(costs)
    print(f"{'rank':>4}  {'tokens':>9}  {'real':>9}  {'runs':>6}  {'longest run':>11}  {'causal cost':>14}  "
          "cost/mean")
    for rank, (s, cost) in enumerate(zip(shards, costs)):
        run_lengths = s.cu_seqlens[1:] - s.cu_seqlens[:-1]
        longest = int(run_lengths.max()) if run_lengths.numel() else 0
        print(f"{rank:>4}  {s.num_local_tokens:>9,}  {int((s.doc_ids != 0).sum()):>9,}  {run_lengths.numel():>6,}  "
              f"{longest:>11,}  {cost:>14,}  {cost / mean if mean else 1.0:>9.3f}")
    print(f"busiest / mean causal cost: {max(costs) / mean if mean else 1.0:.3f}")


def run(args) -> int:
    from cp_packing.packed_seq import packed_seq_params_from_doc_ids
    from cp_packing.sharding import shard_packed_seq_params

    doc_ids = load_doc_ids(args.doc_ids) if args.doc_ids else torch.tensor(EXAMPLE_DOC_IDS)
    params = packed_seq_params_from_doc_ids(doc_ids)
    shards = [shard_packed_seq_params(params, cp_size=args.cp, cp_rank=r, layout=args.layout) for r in range(args.cp)]
    if args.full or doc_ids.numel() <= FULL_MAX_TOKENS:
        _print_full(doc_ids, params, shards, args.layout)
    else:
        _print_summary(doc_ids, params, shards, args.layout)
    return 0
