"""Command line: ``python -m cp_packing`` (or the ``cp-packing`` console script).

``show``: the seed metadata (``cu_seqlens``, ``max_seqlen``) of a doc map and every CP rank's shard metadata::

    python -m cp_packing show                                   # the example map [[1, 1, 2, 2, 2, 0]], cp=2
    python -m cp_packing show --doc-ids "[[1,1,1,1,2,2,2,2]]" --cp 2 --layout zigzag

``report``: the load-balance table of every layout (``cp_packing.report.balance_report``)::

    python -m cp_packing report --synthetic lognormal --batch 8 --seqlen 4096 --seed 0 --cp 8 [--png out.png]
    python -m cp_packing report --doc-ids batch.pt --cp 8          # a saved [B, S] map (.pt or .npy)

Bad input exits with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

EXAMPLE_DOC_IDS = [[1, 1, 2, 2, 2, 0]]


def _load_doc_ids(arg: str) -> torch.Tensor:
    """A ``[B, S]`` int64 doc map from a ``.pt`` / ``.npy`` file or a JSON literal such as ``"[[1,1,2,0]]"``."""
    if arg.endswith((".pt", ".pth", ".npy")):
        if not os.path.exists(arg):
            raise ValueError(f"--doc-ids file {arg!r} does not exist")
        if arg.endswith(".npy"):
            value = torch.from_numpy(np.load(arg, allow_pickle=False))
        else:
            value = torch.load(arg, map_location="cpu", weights_only=True)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"--doc-ids file {arg!r} holds a {type(value).__name__}, not a [B, S] tensor")
    else:
        try:
            value = torch.tensor(json.loads(arg))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"--doc-ids {arg!r} is neither a .pt/.npy file nor a JSON list of lists such as \"[[1,1,2,0]]\""
            ) from exc
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"--doc-ids must hold integers (1-based document index, 0 = padding), got {value.dtype}")
    return value.to(torch.int64)


def _fmt(x) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.tolist())
    return str(x)


def _cmd_show(args) -> int:
    from cp_packing.packed_seq import packed_seq_params_from_doc_ids
    from cp_packing.sharding import shard_packed_seq_params

    doc_ids = _load_doc_ids(args.doc_ids) if args.doc_ids else torch.tensor(EXAMPLE_DOC_IDS)
    params = packed_seq_params_from_doc_ids(doc_ids)
    print(f"doc_ids      {_fmt(doc_ids)}   # [B={doc_ids.shape[0]}, S={doc_ids.shape[1]}]")
    print(f"cu_seqlens   {_fmt(params.cu_seqlens)}   # int32, padding runs included, a boundary at every row start")
    print(f"max_seqlen   {params.max_seqlen}")
    print(f"\ncp_size={args.cp}, layout={args.layout!r}")
    for rank in range(args.cp):
        s = shard_packed_seq_params(params, cp_size=args.cp, cp_rank=rank, layout=args.layout)
        if rank == 0 and args.layout == "auto":
            print(f"auto picked {s.layout!r}")
        print(f"rank {rank}:")
        print(f"  token_index    {_fmt(s.token_index)}")
        print(f"  doc_ids        {_fmt(s.doc_ids)}")
        print(f"  position_ids   {_fmt(s.position_ids)}")
        print(f"  cu_seqlens     {_fmt(s.cu_seqlens)}   max_seqlen {s.max_seqlen}")
        if s.cu_seqlens_k is not None:
            print(f"  cu_seqlens_k   {_fmt(s.cu_seqlens_k)}   max_seqlen_k {s.max_seqlen_k}")
        if s.local_k_slice is not None:
            print(f"  local_k_slice  {s.local_k_slice}")
        print(f"  run_cu_seqlens {_fmt(s.run_cu_seqlens)}   run_key_start {_fmt(s.run_key_start)}")
    return 0


def _cmd_report(args) -> int:
    from cp_packing.report import balance_report, plot_balance
    from cp_packing.testing import synthetic_doc_ids
    from cp_packing.packed_seq import packed_seq_params_from_doc_ids

    if args.doc_ids:
        doc_ids = _load_doc_ids(args.doc_ids)
        source = args.doc_ids
    else:
        doc_ids = synthetic_doc_ids(args.synthetic, args.batch, args.seqlen, seed=args.seed)
        source = f"synthetic {args.synthetic} (batch={args.batch}, seqlen={args.seqlen}, seed={args.seed})"
    params = packed_seq_params_from_doc_ids(doc_ids)
    B, S = doc_ids.shape
    n_pad = int((doc_ids == 0).sum())
    print(f"map: {source}: [B={B}, S={S}], {params.num_segments} segments, longest {params.max_seqlen}, "
          f"{n_pad} padding tokens ({100 * n_pad / max(1, B * S):.1f}%)")
    print(f"cp_size={args.cp}; K/V per token per layer: 2 x {args.num_kv_heads} heads x {args.head_dim} x "
          f"{args.dtype_bytes} bytes\n")
    layouts = tuple(args.layouts.split(",")) if args.layouts else None
    kwargs = {"layouts": layouts} if layouts else {}
    print(balance_report(params, cp_size=args.cp, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                         dtype_bytes=args.dtype_bytes, **kwargs))
    if args.png:
        plot_balance(params, cp_size=args.cp, path=args.png, **kwargs)
        print(f"\nwrote {args.png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from cp_packing.testing import SYNTHETIC_KINDS

    parser = argparse.ArgumentParser(prog="python -m cp_packing", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    show = sub.add_parser("show", help="seed metadata and every rank's shard metadata of a doc map")
    show.add_argument("--doc-ids", help='a JSON map such as "[[1,1,2,2,2,0]]", or a .pt / .npy file '
                      f"(default: {EXAMPLE_DOC_IDS})")
    show.add_argument("--cp", type=int, default=2, help="CP group size (default 2)")
    show.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag", "balanced", "auto"])
    show.set_defaults(func=_cmd_show)

    rep = sub.add_parser("report", help="load balance of every layout on a doc map")
    rep.add_argument("--doc-ids", help="a [B, S] doc map: .pt / .npy file or a JSON literal")
    rep.add_argument("--synthetic", default="lognormal", choices=SYNTHETIC_KINDS,
                     help="synthetic map when --doc-ids is not given (default lognormal)")
    rep.add_argument("--batch", type=int, default=8)
    rep.add_argument("--seqlen", type=int, default=4096)
    rep.add_argument("--seed", type=int, default=0)
    rep.add_argument("--cp", type=int, default=8, help="CP group size (default 8)")
    rep.add_argument("--layouts", help="comma-separated subset of contiguous,rowzigzag,zigzag,balanced,auto")
    rep.add_argument("--num-kv-heads", type=int, default=8)
    rep.add_argument("--head-dim", type=int, default=128)
    rep.add_argument("--dtype-bytes", type=int, default=2)
    rep.add_argument("--png", help="also write a bar chart PNG (needs matplotlib: the 'plot' extra)")
    rep.set_defaults(func=_cmd_report)
    return parser


def main(argv=None) -> int:
    """Entry point of ``python -m cp_packing`` and the ``cp-packing`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
