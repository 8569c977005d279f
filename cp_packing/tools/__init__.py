"""The command-line tools that ship in the package (``python -m cp_packing verify|train|report|show``, or the
``cp-packing`` script); ``launch/train.py`` and ``launch/verify.py`` are thin torchrun entry points over
``train`` and ``verify``.

Shared here: ``launch`` runs a tool's per-rank function under torchrun or on ranks it forks itself (``--nproc``),
and ``rank0_parser`` makes a parser print its help and usage errors once under torchrun, not once per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

__all__ = ["launch", "rank0_parser"]


def rank0_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Under torchrun, only rank 0 prints ``--help`` and usage errors; every rank still exits with the same status
    (0 after ``--help``, 2 on a usage error)."""
    if os.environ.get("RANK", "0") != "0":
        parser.print_help = lambda file=None: None  # type: ignore[method-assign]
        parser.print_usage = lambda file=None: None  # type: ignore[method-assign]
        parser.exit = lambda status=0, message=None: sys.exit(status)  # type: ignore[method-assign]
    return parser


def launch(rank_fn: Callable[[int, int], int], nproc: int | None) -> int:
    """Run ``rank_fn(rank, world_size) -> exit status`` on every rank; return the worst status.

    Under torchrun: on the launched group (``nproc`` must be None: torchrun sets the world size), which is torn down
    afterwards. Otherwise on ``nproc`` (default 2) forked CPU ranks in a gloo group (``cp_packing.testing.run_ranks``,
    no time limit; SIGTERM / SIGINT to this process reach every rank). A rank that raised prints its traceback and
    counts as status 1.
    """
    import torch.distributed as dist

    from cp_packing.testing import run_ranks, under_torchrun

    if under_torchrun() and nproc is not None:
        if os.environ.get("RANK", "0") == "0":
            print("error: --nproc is for runs without torchrun; torchrun sets the world size (--nproc-per-node)",
                  file=sys.stderr)
        return 2
    try:
        results = run_ranks(rank_fn, nproc, timeout=None)
    finally:
        if under_torchrun() and dist.is_initialized():
            dist.destroy_process_group()
    codes = []
    for r in results:
        if not r.ok:
            print(f"error on rank {r.rank}:\n{r.error}", file=sys.stderr, flush=True)
        codes.append(r.value if r.ok and isinstance(r.value, int) else 1)
    return max(codes)
