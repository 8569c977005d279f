"""Resumable checkpoints of the training launcher, written atomically.

A checkpoint is a directory ``OUT/checkpoint-<step>`` that ``from_pretrained`` loads like any model directory (the
model and tokenizer, ``save_pretrained``), plus what resuming needs::

    optimizer.pt          the optimizer (full state dict, keyed by parameter name) and the LR scheduler
    rng-rank<r>.pt        rank r's RNG states: torch (and CUDA), numpy, python
    trainer_state.json    the step, the data position and the run's shape (world, cp, batch, ...), written LAST

It is written into ``OUT/.checkpoint-<step>.partial``, every file flushed to disk (fsync), then renamed to its name:
a checkpoint directory either is complete or does not exist, and the previous checkpoint is deleted only after the
new one is in place. A save killed half-way (even by SIGKILL) leaves the partial directory, which nothing reads,
and the previous checkpoint intact. Collectives: every rank calls ``save_checkpoint`` / ``load_checkpoint``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["STATE_FILE", "checkpoint_dirs", "find_checkpoint", "load_checkpoint", "read_state", "save_checkpoint"]

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"checkpoint-(\d+)$")


def checkpoint_dirs(out_dir: str) -> list[tuple[int, str]]:
    """``[(step, path)]`` of the complete checkpoints in ``out_dir``, oldest first (none when it does not exist)."""
    if not os.path.isdir(out_dir):
        return []
    found = []
    for name in os.listdir(out_dir):
        match = _NAME.match(name)
        path = os.path.join(out_dir, name)
        if match and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_checkpoint(path: str) -> str | None:
    """``path`` itself when it is a checkpoint, else its newest complete ``checkpoint-<step>``; ``None``: none.

    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> for name in ("checkpoint-2", "checkpoint-10", ".checkpoint-12.partial"):
    ...     os.makedirs(os.path.join(out, name))
    >>> for name in ("checkpoint-2", "checkpoint-10"):
    ...     _ = open(os.path.join(out, name, STATE_FILE), "w").write("{}")
    >>> os.path.basename(find_checkpoint(out))  # the newest COMPLETE one: 10, not the partial 12, not 2
    'checkpoint-10'
    """
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    found = checkpoint_dirs(path)
    return found[-1][1] if found else None


def read_state(checkpoint: str) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint."""
    with open(os.path.join(checkpoint, STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def _full_state_dicts(model, optimizer) -> tuple[dict | None, dict]:
    """``(model state dict or None, optimizer state dict)``, full and on the CPU of rank 0 (empty elsewhere) under
    FSDP2; ``None`` model state: ``save_pretrained`` reads the (unsharded) model itself. A collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
    model_sd = get_model_state_dict(model, options=options) if sharded else None
    return model_sd, get_optimizer_state_dict(model, optimizer, options=options)


def _agree_ok(error: BaseException | None, what: str) -> None:
    """Every rank raises when any rank failed ``what`` (one MIN all-reduce: no rank waits for a dead one)."""
    failed = torch.tensor([0 if error is None else 1 + dist.get_rank()], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        failed = failed.cuda()
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    bad = int(failed.item())
    if error is not None:
        raise error
    if bad:
        raise RuntimeError(f"{what} failed on rank {bad - 1} (its error is printed there)")


def save_checkpoint(out_dir: str, step: int, *, model, optimizer, scheduler, tokenizer, state: dict[str, Any],
                    before_commit: Callable[[], None] | None = None) -> str:
    """Write ``OUT/checkpoint-<step>`` atomically (module docstring) on every rank; returns its path.

    Args:
        out_dir: the run's output directory.
        step: optimizer steps done.
        model, optimizer, scheduler: the training state (FSDP2 sharded or not).
        tokenizer: saved with the model when not ``None``.
        state: JSON-able facts for ``trainer_state.json`` (``step`` is added).
        before_commit: called on rank 0 once the model is written, before the state file and the rename (tests
            kill the process there).

    Raises:
        RuntimeError (on every rank): a rank failed to write its part; the partial directory is removed.
    """
    rank = dist.get_rank()
    final = os.path.join(out_dir, f"checkpoint-{step}")
    tmp = os.path.join(out_dir, f".checkpoint-{step}.partial")
    error = None
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
    except OSError as exc:
        error = exc
    _agree_ok(error, f"creating {tmp}")
    model_sd, optim_sd = _full_state_dicts(model, optimizer)
    try:
        torch.save(_rng_state(), os.path.join(tmp, f"rng-rank{rank}.pt"))
        if rank == 0:
            model.save_pretrained(tmp, state_dict=model_sd)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            torch.save({"optimizer": optim_sd, "scheduler": scheduler.state_dict()}, os.path.join(tmp, "optimizer.pt"))
            if before_commit is not None:
                before_commit()
            with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump({**state, "step": step}, f, indent=1)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by _agree_ok
        error = exc
    try:
        _agree_ok(error, f"writing checkpoint {final}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        if rank == 0:
            _commit(tmp, final, out_dir)
    except OSError as exc:
        error = exc
    _agree_ok(error, f"renaming {tmp} to {final}")
    return final


def _commit(tmp: str, final: str, out_dir: str) -> None:
    """fsync ``tmp``, rename it to ``final``, then delete every other checkpoint and partial save of ``out_dir``."""
    _fsync_tree(tmp)
    if os.path.exists(final):  # the same step saved again: keep the old one until the new one is in place
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync(out_dir)
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if path != final and (_NAME.match(name) or (name.startswith(".checkpoint-") and name.endswith(".partial"))):
            shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(checkpoint: str, *, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore the optimizer, the scheduler and this rank's RNG states from ``checkpoint`` (the model's weights come
    from ``from_pretrained(checkpoint)``); returns its ``trainer_state.json``. On every rank, after the model is
    sharded (FSDP2) and the optimizer built: every rank reads the full optimizer state and keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), map_location="cpu", weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=saved["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(torch.load(os.path.join(checkpoint, f"rng-rank{dist.get_rank()}.pt"), weights_only=False))
    return read_state(checkpoint)
