"""Run a per-rank function under torchrun, or on ranks this process spawns itself (CPU, gloo): shared by the
``launch/`` entry points so that ``python launch/X.py --nproc N`` works without torchrun (tests, laptops)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

RankFn = Callable[[int, int, torch.device], int]
"""``fn(rank, world_size, device) -> exit code``."""


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _spawned_rank(fn: RankFn, rank: int, world: int, store_path: str, results) -> None:
    torch.set_num_threads(1)
    code = 1
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
        try:
            code = fn(rank, world, torch.device("cpu"))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported; the exit status says it failed
        traceback.print_exc()
    results[rank] = code


def run_ranks(fn: RankFn, nproc: int | None) -> int:
    """Run ``fn`` on every rank and return the worst exit code.

    Under torchrun (``WORLD_SIZE``/``RANK`` set): join the launched group (NCCL on this rank's ``LOCAL_RANK`` GPU when
    CUDA is present, gloo on CPU otherwise) and run ``fn`` here; ``nproc`` must be None. Otherwise fork ``nproc``
    (default 2) CPU ranks joined in a gloo group through a FileStore.
    """
    if under_torchrun():
        if nproc is not None:
            print("--nproc is for runs without torchrun; torchrun sets the world size", file=sys.stderr)
            return 2
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl")
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo")
        try:
            return fn(dist.get_rank(), dist.get_world_size(), device)
        finally:
            dist.destroy_process_group()
    nproc = nproc or 2
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_spawned_rank, args=(fn, r, nproc, os.path.join(tmp, "store"), results))
                 for r in range(nproc)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        codes = [results.get(r, 1) if proc.exitcode == 0 else 1 for r, proc in enumerate(procs)]
    return max(codes)
