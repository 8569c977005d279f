"""Test and benchmark scaffolding that ships with the package: seeded synthetic doc maps and the rank runner.

Tests, benchmarks and the launchers (``python -m cp_packing train|verify|report``) all draw their doc maps here, so
one generator defines what "a lognormal batch" means everywhere, and all run their ranks with ``run_ranks``: forked
gloo ranks on a free loopback port, or the group torchrun launched.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import threading
import time
import traceback
import unittest
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from cp_packing._checks import check_choice, check_int, check_number

__all__ = [
    "SYNTHETIC_KINDS",
    "RankResult",
    "RanksFailed",
    "rank_device",
    "run_distributed",
    "run_ranks",
    "synthetic_doc_ids",
    "under_torchrun",
]

#: Document-length distributions of ``synthetic_doc_ids`` (median length, log-normal sigma):
#: ``lognormal`` (60, 1.5: long-tailed), ``long`` (2000, 1.0), ``short`` (16, 0.5: many short documents),
#: ``huge`` (one document of 3/4 of row 0 among documents of median 60), ``padded`` (200, 1.2, then 0 to 50% of
#: each row padding).
SYNTHETIC_KINDS = ("lognormal", "long", "short", "huge", "padded")

_KIND_PARAMS = {
    "lognormal": (60, 1.5),
    "long": (2000, 1.0),
    "short": (16, 0.5),
    "huge": (60, 1.0),
    "padded": (200, 1.2),
}

def _row_lengths(rng: np.random.Generator, fill: int, median: float, sigma: float) -> np.ndarray:
    """Log-normal document lengths (>= 1) that fill exactly ``fill`` tokens (the last one cut)."""
    parts, total = [], 0
    while total < fill:
        draw = np.maximum(1, np.rint(rng.lognormal(np.log(median), sigma, size=int(2 * fill / median) + 16)))
        parts.append(draw.astype(np.int64))
        total += int(parts[-1].sum())
    lengths = np.concatenate(parts)
    ends = np.cumsum(lengths)
    n = int(np.searchsorted(ends, fill)) + 1
    lengths = lengths[:n].copy()
    lengths[-1] -= int(ends[n - 1]) - fill
    return lengths


def synthetic_doc_ids(
    kind: str = "lognormal",
    batch: int = 8,
    seqlen: int = 4096,
    *,
    seed: int = 0,
    median: float | None = None,
    sigma: float | None = None,
    pad: float | None = None,
    multiple: int = 1,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """A seeded ``[batch, seqlen]`` neat-packing doc map (ids 1, 2, ... per row, 0 = padding at a row's tail).

    Args:
        kind: one of ``SYNTHETIC_KINDS`` (see there): the median and sigma of the log-normal document lengths.
        batch, seqlen: the map's shape (``>= 1``).
        seed: NumPy generator seed; the same arguments always give the same map.
        median, sigma: override the kind's median document length and log-normal sigma.
        pad: the largest fraction of a row left as padding (each row draws ``0 .. pad * seqlen`` pad tokens at its
            tail); default 0.5 for ``padded``, else 0.
        multiple: every document and padding length is a multiple of it (``seqlen`` must be too), e.g. ``2 * cp``
            for zigzag; the map is then made of units of ``multiple`` tokens.
        dtype: an integer dtype of the result (int64 by default).

    Returns:
        ``[batch, seqlen]`` tensor of ``dtype``.

    >>> synthetic_doc_ids("short", 1, 8, seed=0).tolist()
    [[1, 1, 1, 1, 1, 1, 1, 1]]
    >>> synthetic_doc_ids("lognormal", 2, 64, median=8, multiple=4, dtype=torch.int32).unique_consecutive().numel() > 2
    True
    """
    check_choice(kind, "synthetic kind", SYNTHETIC_KINDS)
    batch, seqlen = check_int(batch, "batch", min=1), check_int(seqlen, "seqlen", min=1)
    seed = check_int(seed, "seed")
    multiple = check_int(multiple, "multiple", min=1)
    if seqlen % multiple:
        raise ValueError(f"seqlen {seqlen} is not divisible by multiple {multiple}; pick a seqlen that is")
    kind_median, kind_sigma = _KIND_PARAMS[kind]
    median = check_number(kind_median if median is None else median, "median")
    sigma = check_number(kind_sigma if sigma is None else sigma, "sigma", min=0.0)
    if median <= 0:
        raise ValueError(f"median {median} must be > 0 (a median document length in tokens)")
    pad = check_number((0.5 if kind == "padded" else 0.0) if pad is None else pad, "pad", min=0.0)
    if pad >= 1:
        raise ValueError(f"pad {pad} must be < 1 (the largest fraction of a row left as padding)")
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"dtype {dtype} is not an integer dtype; use e.g. torch.int64 or torch.int32")
    rng = np.random.default_rng(seed)
    units = seqlen // multiple
    rows = np.zeros((batch, units), dtype=np.int64)
    for b in range(batch):  # a loop over rows; each row is vectorised
        fill = units - int(rng.integers(0, int(seqlen * pad) // multiple + 1)) if pad > 0 else units
        head = [min(fill, int(0.75 * seqlen) // multiple)] if (kind == "huge" and b == 0) else []
        rest = fill - sum(head)
        tail = _row_lengths(rng, rest, median / multiple, sigma) if rest > 0 else np.zeros(0, dtype=np.int64)
        lengths = np.concatenate([np.array(head, dtype=np.int64), tail])
        rows[b, :fill] = np.repeat(np.arange(1, lengths.size + 1, dtype=np.int64), lengths)
    out = torch.from_numpy(np.repeat(rows, multiple, axis=1) if multiple > 1 else rows)
    return out.to(dtype)


# ------------------------------------------------------------------------------------------------ the rank runner


def under_torchrun() -> bool:
    """True in a process that torchrun (or any launcher setting ``WORLD_SIZE`` and ``RANK``) started."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def rank_device() -> torch.device:
    """This rank's device: its CUDA device under an initialised NCCL group, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class RankResult:
    """What one rank of ``run_ranks`` gave back.

    Attributes:
        rank: the rank (``0 .. world_size - 1``).
        value: ``fn``'s return value (``None`` when it raised or did not finish).
        error: the traceback text when ``fn`` raised, or why no result came back (a timeout, a dead process).
        exception: the exception ``fn`` raised, when it could be pickled back; else ``None``.
        seconds: when it returned or raised, in seconds after the start (``None``: it never did); the earliest
            failure is usually the cause, later ones its echo in the other ranks' collectives.
    """

    rank: int
    value: Any = None
    error: str | None = None
    exception: BaseException | None = None
    seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class RanksFailed(AssertionError):
    """``run_distributed``: a rank raised or did not finish (an AssertionError, so pytest shows it as a failure)."""


_STORE_TIMEOUT = 150  # seconds for the rendezvous and each collective; generous: CI machines are shared


def _set_parent_death_signal() -> None:
    """Linux: this (forked) rank gets SIGKILL when its parent dies, even by SIGKILL: never an orphan rank."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's signal handler still forwards SIGTERM / SIGINT
        pass


def _child(fn: Callable, rank: int, world_size: int, port_queue, backend: str, args: tuple, queue) -> None:
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C stops a rank without a KeyboardInterrupt traceback
    torch.set_num_threads(1)
    when = None
    try:
        port = port_queue.get()  # the parent starts its store only after every child is forked
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, False, timeout=timedelta(seconds=_STORE_TIMEOUT))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=_STORE_TIMEOUT))
        try:
            result = fn(rank, world_size, *args)
        except BaseException:
            when = time.time()  # when it raised, before the teardown below echoes it into the other ranks
            raise
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensors by value; the queue's ForkingPickler would share them through file
        # descriptors that vanish with this process once torch.multiprocessing is imported (transformers does).
        queue.put((rank, pickle.dumps(result), None, None, time.time()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        when = time.time() if when is None else when  # orders the cause before its echoes in other ranks
        try:
            exc_bytes = pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an exception that does not pickle comes back as text only
            exc_bytes = None
        queue.put((rank, None, traceback.format_exc(), exc_bytes, when))


def _on_torchrun(fn: Callable, world_size: int | None, args: tuple) -> list[RankResult]:
    if world_size is not None and int(os.environ["WORLD_SIZE"]) != world_size:
        raise unittest.SkipTest(f"needs world size {world_size}, torchrun launched {os.environ['WORLD_SIZE']}")
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank()
    t0 = time.monotonic()
    try:
        return [RankResult(rank, fn(rank, dist.get_world_size(), *args), seconds=time.monotonic() - t0)]
    except Exception as exc:  # noqa: BLE001 - returned like a spawned rank's
        return [RankResult(rank, error=traceback.format_exc(), exception=exc, seconds=time.monotonic() - t0)]


@contextlib.contextmanager
def _forward_signals(procs: list) -> Iterator[None]:
    """While the ranks run, SIGTERM / SIGINT to this process go to every rank too, then end this process.
    (Only from the main thread, where Python allows handlers.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_ranks(fn: Callable, world_size: int | None, *args: Any, backend: str = "gloo", timeout: float | None = 300.0,
              grace: float = 15.0) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on every rank of a real process group; one ``RankResult`` per rank.

    - Under torchrun (``WORLD_SIZE`` set): runs ``fn`` here on the launched group (initialised if needed: NCCL on
      this rank's ``LOCAL_RANK`` GPU when CUDA is present, else gloo) and returns this rank's result only. A
      ``world_size`` that differs from torchrun's raises ``unittest.SkipTest`` (pytest skips the test); ``None``
      accepts any.
    - Otherwise: forks ``world_size`` ranks (default 2 when ``None``) that join a ``backend`` group through a
      TCPStore this process hosts on a free 127.0.0.1 port (the OS picks it, so pytest-xdist workers never race
      for one), and returns every rank's result in rank order.

    Every rank's return value or exception comes back (tensors by value). A rank that has not finished ``timeout``
    seconds after the start (``None``: no limit), or ``grace`` seconds after another rank failed (it is
    probably waiting in a collective), is killed and reported. SIGTERM / SIGINT to this process reach every rank;
    a rank whose parent dies is killed (Linux). ``fn`` must be picklable or module-level (forked, not spawned).

    >>> def square(rank, world_size):
    ...     return rank * rank
    >>> [r.value for r in run_ranks(square, 2)]  # doctest: +SKIP
    [0, 1]
    """
    if under_torchrun():
        return _on_torchrun(fn, world_size, args)
    world_size = 2 if world_size is None else check_int(world_size, "world_size", min=1)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()  # children put results; the parent only reads (no feeder thread here)
    port_queue = ctx.SimpleQueue()  # thread-free
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port_queue, backend, args, queue), daemon=True)
             for r in range(world_size)]
    results: dict[int, RankResult] = {}
    with _forward_signals(procs):
        # Fork every child BEFORE the store's server thread exists: a fork while that thread holds a lock can
        # leave the child deadlocked (seen as a rank that never registers under heavy load).
        for p in procs:
            p.start()
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, timeout=timedelta(seconds=_STORE_TIMEOUT),
                              wait_for_workers=False)
        for _ in procs:
            port_queue.put(store.port)
        t0, t0_wall = time.monotonic(), time.time()
        deadline = None if timeout is None else t0 + timeout
        try:
            while len(results) < world_size:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    break
                try:
                    rank, value, error, exc_bytes, when = queue.get(timeout=1.0 if wait is None else min(wait, 1.0))
                except queue_module.Empty:
                    if any(not p.is_alive() and r not in results for r, p in enumerate(procs)):
                        limit = time.monotonic() + grace  # a rank died without a word (killed): the rest may hang
                        deadline = limit if deadline is None else min(deadline, limit)
                    continue
                try:
                    exc = pickle.loads(exc_bytes) if exc_bytes is not None else None
                except Exception:  # noqa: BLE001 - an exception class that cannot be rebuilt: its traceback text stays
                    exc = None
                results[rank] = RankResult(rank, pickle.loads(value) if error is None else None, error, exc,
                                           when - t0_wall)
                if error is not None:
                    limit = time.monotonic() + grace
                    deadline = limit if deadline is None else min(deadline, limit)
        finally:
            for p in procs:
                p.join(timeout=5 if all(r.ok for r in results.values()) and len(results) == world_size else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = sorted(r.rank for r in results.values() if not r.ok)
    for r, p in enumerate(procs):
        if r not in results:
            if p.exitcode not in (None, -signal.SIGKILL):
                why = f"exited with status {p.exitcode} without a result"
            elif failed:
                why = f"was stopped {grace}s after rank {failed[0]} failed (probably waiting in a collective)"
            else:
                why = f"did not finish within {timeout}s (a hang?)"
            results[r] = RankResult(r, error=f"rank {r} of {world_size} {why}")
    return [results[r] for r in range(world_size)]


def run_distributed(fn: Callable, world_size: int, *args: Any, backend: str = "gloo",
                    timeout: float = 300.0) -> list:
    """``run_ranks`` for tests: the per-rank return values in rank order (only this rank's under torchrun).

    Raises:
        RanksFailed: a rank raised (the traceback of the first one that did is in the message) or did not finish
            within ``timeout``.
    """
    results = run_ranks(fn, world_size, *args, backend=backend, timeout=timeout)
    failed = [r for r in results if not r.ok]
    if failed:
        first = min(failed, key=lambda r: (r.seconds is None, r.seconds or 0.0, r.rank))
        raise RanksFailed(f"rank {first.rank} of {world_size} failed:\n{first.error}")
    return [r.value for r in results]
