"""Run a function on N ranks of a real torch.distributed group, for tests.

- Under plain pytest (also pytest-xdist): forks ``world_size`` processes that join a gloo group through a TCPStore
  that the parent process hosts on a free loopback port (port 0: the OS picks it, so parallel xdist workers never
  race for a port). Each rank's return value comes back to the parent; an exception on any rank fails the test
  with that rank's traceback; a rank that hangs fails it after ``timeout`` seconds.
- Under ``torchrun`` (``WORLD_SIZE`` set): runs ``fn`` in this process on the launched group (NCCL when CUDA is
  present), and skips a test that asks for a different world size.

``fn(rank, world_size, *args)`` must be a module-level function (it is called in a forked child).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist


def _child(fn: Callable, rank: int, world_size: int, port_queue, backend: str, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    try:
        port = port_queue.get()  # the parent starts its store only after every child is forked
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, False, timeout=timedelta(seconds=_STORE_TIMEOUT))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=_STORE_TIMEOUT))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensors by value; the queue's ForkingPickler would share them through file
        # descriptors that vanish with this process once torch.multiprocessing is imported (transformers does).
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))


_STORE_TIMEOUT = 150  # seconds; generous, CI machines are shared and tests run in parallel


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the per-rank results in rank order."""
    if under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            pytest.skip(f"needs world size {world_size}, torchrun launched {os.environ['WORLD_SIZE']}")
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        return [fn(dist.get_rank(), world_size, *args)]

    ctx = mp.get_context("fork")
    queue = ctx.Queue()  # children put results; the parent only reads (no feeder thread here)
    port_queue = ctx.SimpleQueue()  # thread-free
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port_queue, backend, args, queue), daemon=True)
        for r in range(world_size)
    ]
    # Fork every child BEFORE the store's server thread exists: a fork while that thread holds a lock can leave
    # the child deadlocked (seen as a rank that never registers under heavy load).
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, timeout=timedelta(seconds=_STORE_TIMEOUT),
                          wait_for_workers=False)
    for _ in procs:
        port_queue.put(store.port)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except Exception:  # queue.Empty
                break
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                break  # other ranks may now hang in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise AssertionError(f"ranks {missing} of {world_size} did not finish within {timeout}s (hang?)")
    return [results[r] for r in range(world_size)]
