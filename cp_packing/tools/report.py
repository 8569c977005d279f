"""``python -m cp_packing report``: the load-balance table of every layout on a doc map (and a PNG chart).

    python -m cp_packing report --synthetic lognormal --batch 8 --seqlen 4096 --seed 0 --cp 8 [--png out.png]
    python -m cp_packing report --doc-ids batch.pt --cp 8          # a saved [B, S] map (.pt or .npy)
    python -m cp_packing report --cp 8 --heads 32 --kv-heads 8     # + bytes per layer per backend
    python -m cp_packing report --cp 8 --window 512                # costs under a sliding window of 512
    python -m cp_packing report --cp 8 --window 4096,none          # per layer (none = a global layer), summed

The one place the tools use the report module (``balance_report`` / ``plot_balance``).
"""

from __future__ import annotations

import argparse
import os

from cp_packing.tools import load_doc_ids, nonnegative_int, positive_int


def add_parser(sub) -> None:
    from cp_packing.testing import SYNTHETIC_KINDS

    rep = sub.add_parser("report", help="load balance of every layout on a doc map",
                         description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=__doc__.split("\n\n")[1])
    rep.add_argument("--doc-ids", help="a [B, S] doc map: .pt / .npy file or a JSON literal")
    rep.add_argument("--synthetic", default="lognormal", choices=SYNTHETIC_KINDS,
                     help="synthetic map when --doc-ids is not given (default lognormal)")
    rep.add_argument("--batch", type=positive_int, default=8)
    rep.add_argument("--seqlen", type=positive_int, default=4096)
    rep.add_argument("--seed", type=nonnegative_int, default=0, help="synthetic map seed (default 0)")
    rep.add_argument("--cp", type=positive_int, default=8, help="CP group size (default 8)")
    rep.add_argument("--layouts", help="comma-separated subset of contiguous,rowzigzag,zigzag,balanced,auto")
    rep.add_argument("--num-kv-heads", "--kv-heads", dest="num_kv_heads", type=positive_int, default=8,
                     help="key/value heads (default 8)")
    rep.add_argument("--heads", type=positive_int,
                     help="query heads: also print the bytes per layer of every attention backend for these heads")
    rep.add_argument("--head-dim", type=positive_int, default=128)
    rep.add_argument("--dtype-bytes", type=positive_int, default=2)
    rep.add_argument("--window", type=window_arg, default=None,
                     help="the model's sliding window: every cost becomes sum min(p + 1, W) and balanced / auto plan "
                          "for it; an int, or one entry per layer separated by commas (none = a global layer)")
    rep.add_argument("--png", help="also write a bar chart PNG to this file, e.g. balance.png (needs matplotlib: the "
                     "'plot' extra)")
    rep.set_defaults(func=run)


def window_arg(text: str) -> int | tuple[int | None, ...]:
    """``--window``: ``512`` or a per-layer ``4096,none,4096`` (``none`` = a global layer), each window ``>= 1``."""
    parts = [p.strip().lower() for p in text.split(",")]
    try:
        values = [None if p in ("none", "full", "global") else int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--window {text!r}: expected an int or comma-separated ints / 'none' (one per layer)") from None
    if any(v is not None and v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--window {text!r}: every window must be >= 1 (or 'none' for a global layer)")
    if len(values) == 1 and values[0] is not None:
        return values[0]
    return tuple(values)


def check_png_path(path: str) -> str:
    """``--png PATH``, checked before any work: a file name in an existing directory, ending in ``.png``."""
    if os.path.isdir(path):
        raise ValueError(f"--png {path!r} is a directory; give a file name, e.g. --png "
                         f"{os.path.join(path, 'balance.png')}")
    if not path.lower().endswith(".png"):
        raise ValueError(f"--png {path!r} does not end in .png; give a file name such as {path}.png")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"--png {path!r}: the directory {parent!r} does not exist; create it first")
    return path


def run(args) -> int:
    from cp_packing.report import balance_report, plot_balance
    from cp_packing.packed_seq import packed_seq_params_from_doc_ids
    from cp_packing.testing import synthetic_doc_ids

    if args.png:
        check_png_path(args.png)
    if args.heads and args.heads % args.num_kv_heads:
        raise ValueError(f"--heads {args.heads} must be a multiple of --kv-heads {args.num_kv_heads} (GQA groups); "
                         f"pick --kv-heads a divisor of {args.heads}")
    if args.doc_ids:
        doc_ids = load_doc_ids(args.doc_ids)
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
    kwargs = {"layouts": tuple(args.layouts.split(","))} if args.layouts else {}
    print(balance_report(params, cp_size=args.cp, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                         dtype_bytes=args.dtype_bytes, window=args.window, **kwargs))
    if args.heads:
        from cp_packing.report import backend_bytes_table

        T_local = -(-B * S // args.cp)
        print(f"\nforward bytes per layer per rank, T_local={T_local} (B*S / cp), head_dim={args.head_dim}, "
              f"{args.dtype_bytes} bytes per element:")
        print(backend_bytes_table(T_local=T_local, cp_size=args.cp, num_heads=args.heads,
                                  num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype_bytes=args.dtype_bytes))
    if args.png:
        plot_balance(params, cp_size=args.cp, path=args.png, window=args.window, **kwargs)
        print(f"\nwrote {args.png}")
    return 0
