"""Command line: ``python -m cp_packing verify|train|report|show`` (or the ``cp-packing`` console script).

    python -m cp_packing verify --nproc 2          # CP attention == full attention (cp_packing.tools.verify)
    python -m cp_packing train --nproc 2           # a tiny Llama trained with CP (cp_packing.tools.train)
    python -m cp_packing train --nproc 2 --model DIR --data FILE.jsonl --output-dir OUT   # your model and data
    python -m cp_packing train --nproc 2 --model DIR --data FILE.jsonl --resume OUT       # after a preemption
    python -m cp_packing report --cp 8             # load balance of every layout on a map (cp_packing.tools.report)
    python -m cp_packing show --cp 2               # what a map becomes on every rank (cp_packing.tools.show)

``verify`` and ``train`` also run under torchrun (``torchrun --nproc-per-node 4 -m cp_packing verify``, or the thin
``launch/verify.py`` / ``launch/train.py``). ``python -m cp_packing COMMAND --help`` lists a command's options.
Bad input exits with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import sys

RANK_COMMANDS = ("verify", "train")  # commands with their own parser, run on every rank


def build_parser() -> argparse.ArgumentParser:
    from cp_packing.tools import report, show

    parser = argparse.ArgumentParser(prog="python -m cp_packing", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{verify,train,report,show}")
    sub.add_parser("verify", help="check CP attention against full attention on this cluster (--help: options)")
    sub.add_parser("train", help="train a local HF model (or a tiny preset) with context parallelism on local data "
                   "(--help: options)")
    report.add_parser(sub)
    show.add_parser(sub)
    return parser


def main(argv=None) -> int:
    """Entry point of ``python -m cp_packing`` and the ``cp-packing`` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in RANK_COMMANDS:
        if argv[0] == "verify":
            from cp_packing.tools.verify import main as verify

            return verify(argv[1:])
        from cp_packing import STARTUP_SIGTERMS  # SIGTERMs while the package imported torch: requests to stop
        from cp_packing.tools.train import main as train

        return train(argv[1:], early_signals=STARTUP_SIGTERMS)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
