"""The command-line tools that ship in the package (``python -m cp_packing verify|train|report|show``, or the
``cp-packing`` script); ``launch/train.py`` and ``launch/verify.py`` are thin torchrun entry points over
``train`` and ``verify``.

Shared here: ``launch`` runs a tool's per-rank function under torchrun or on ranks it forks itself (``--nproc``),
``rank0_parser`` makes a parser print its help and usage errors once under torchrun, not once per rank,
``load_doc_ids`` reads a map from a file or a JSON literal, and ``positive_int`` / ``nonnegative_int`` /
``finite_float`` are the argparse types of sizes, seeds and real numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable

import torch

__all__ = ["finite_float", "launch", "load_doc_ids", "nonnegative_int", "positive_int", "rank0_parser"]


def int_at_least(minimum: int) -> Callable[[str], int]:
    """The argparse type of an integer ``>= minimum`` (a usage error naming the option, exit 2, otherwise).

    >>> int_at_least(0)("3")
    3
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
"""argparse type of a size: an integer >= 1."""
nonnegative_int = int_at_least(0)
"""argparse type of a seed or a count that may be 0: an integer >= 0."""


def finite_float(minimum: float, *, strict: bool = False) -> Callable[[str], float]:
    """The argparse type of a finite real number ``>= minimum`` (``> minimum`` with ``strict``): ``inf`` and ``nan``
    are refused like any other bad value (a usage error naming the option).

    >>> finite_float(0.0, strict=True)("3e-3")
    0.003
    >>> finite_float(0.0, strict=True)("inf")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: must be a finite number > 0, got 'inf'
    """
    bound = f"{'>' if strict else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    return parse


def load_doc_ids(arg: str) -> torch.Tensor:
    """A ``[B, S]`` int64 doc map from a ``.pt`` / ``.pth`` / ``.npy`` file or a JSON literal such as
    ``"[[1,1,2,0]]"`` (a 1-D map is one row).

    Raises:
        ValueError: a missing, unreadable or corrupt file, a file that holds something other than a tensor, or a
            map that is not integers.
    """
    if arg.endswith((".pt", ".pth", ".npy")):
        if not os.path.exists(arg):
            raise ValueError(f"--doc-ids file {arg!r} does not exist")
        try:
            if arg.endswith(".npy"):
                import numpy as np

                array = np.load(arg, allow_pickle=False)
                if array.dtype.byteorder not in "=|":  # big-endian (or explicit little-endian) data: torch wants native
                    array = array.astype(array.dtype.newbyteorder("="))
                value = torch.from_numpy(array)
            else:
                value = torch.load(arg, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - pickle, zip and numpy each raise their own type on a corrupt file
            raise ValueError(f"--doc-ids file {arg!r} is not a readable tensor file (corrupt, truncated or not a "
                             f"plain tensor: {type(exc).__name__}); save the map with torch.save(doc_ids, path) or "
                             "numpy.save(path, doc_ids)") from None
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"--doc-ids file {arg!r} holds a {type(value).__name__}, not a [B, S] tensor; save the "
                             "map itself with torch.save(doc_ids, path)")
    else:
        try:
            value = torch.tensor(json.loads(arg))
        except (json.JSONDecodeError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(
                f"--doc-ids {arg!r} is neither a .pt/.npy file nor a JSON list of lists such as \"[[1,1,2,0]]\""
            ) from exc
    if value.numel() == 0:
        raise ValueError(f"--doc-ids {arg!r} is an empty map (shape {tuple(value.shape)}); give at least one token, "
                         'e.g. "[[1,1,2,0]]"')
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2:
        raise ValueError(f"--doc-ids must be a 2D [B, S] map (or one 1-D row), got shape {tuple(value.shape)}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"--doc-ids must hold integers (1-based document index, 0 = padding), got {value.dtype}")
    return value.to(torch.int64)


def rank0_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Under torchrun, only rank 0 prints ``--help`` and usage errors; every rank still exits with the same status
    (0 after ``--help``, 2 on a usage error)."""
    if os.environ.get("RANK", "0") != "0":
        parser.print_help = lambda file=None: None  # type: ignore[method-assign]
        parser.print_usage = lambda file=None: None  # type: ignore[method-assign]
        parser.exit = lambda status=0, message=None: sys.exit(status)  # type: ignore[method-assign]
    return parser


def launch(rank_fn: Callable[[int, int], int], nproc: int | None, *, signal_grace: float = 5.0) -> int:
    """Run ``rank_fn(rank, world_size) -> exit status`` on every rank; return the worst status.

    Under torchrun: on the launched group (``nproc`` must be None: torchrun sets the world size), which is torn down
    afterwards. Otherwise on ``nproc`` (default 2) forked CPU ranks in a gloo group (``cp_packing.testing.run_ranks``,
    no time limit). SIGTERM to this process reaches every rank, which then has ``signal_grace`` seconds to finish
    (``cp_packing.tools.lifecycle.forward_signals_to_ranks``); SIGINT ends them within 5 s. A rank whose parent dies
    is killed (Linux). A rank that raised prints its traceback and counts as status 1.
    """
    import functools

    import torch.distributed as dist

    from cp_packing.testing import run_ranks, under_torchrun
    from cp_packing.tools.lifecycle import forward_signals_to_ranks

    if under_torchrun() and nproc is not None:
        if os.environ.get("RANK", "0") == "0":
            print("error: --nproc is for runs without torchrun; torchrun sets the world size (--nproc-per-node)",
                  file=sys.stderr)
        return 2
    run = functools.partial(run_ranks, rank_fn, nproc, timeout=None)
    try:
        results = run() if under_torchrun() else forward_signals_to_ranks(run, signal_grace)
    finally:
        if under_torchrun() and dist.is_initialized():
            dist.destroy_process_group()
    codes = []
    for r in results:
        if not r.ok:
            print(f"error on rank {r.rank}:\n{r.error}", file=sys.stderr, flush=True)
        codes.append(r.value if r.ok and isinstance(r.value, int) else 1)
    return max(codes)
