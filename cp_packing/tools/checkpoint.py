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

A fault (a full disk, a missing, truncated or corrupt file, a state that is not a step count) is one
:class:`CheckpointError` line naming the file and what is wrong, raised on every rank alike (the ranks agree on it).
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["STATE_FILE", "CheckpointError", "checkpoint_dirs", "find_checkpoint", "load_checkpoint", "read_state",
           "save_checkpoint"]

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"checkpoint-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read: one line naming the file and the fault, the same on every rank
    (the launcher prints it without a traceback and exits 1)."""


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
    """The ``trainer_state.json`` of a checkpoint, checked: a JSON object whose ``step`` (and ``micro_batches``) is
    an int >= 0.

    Raises:
        OSError: the file cannot be read. ValueError: not JSON, or a count that is not an int >= 0 (named).
    """
    path = os.path.join(checkpoint, STATE_FILE)
    with open(path, encoding="utf-8") as f:
        state = json.load(f)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a JSON {type(state).__name__}, not an object of the run's facts; the file "
                         "is corrupt: resume from another checkpoint")
    for key in ("step", "micro_batches"):
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: {key!r} is {value!r}, not a count (an int >= 0); the file was edited or is "
                             "corrupt: resume from another checkpoint, or fix the value")
    return state


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
    """Every rank raises the same :class:`CheckpointError` when any rank failed ``what``: the first failing rank's
    one-line reason (one object all-gather: no rank waits for a dead one)."""
    reason = None if error is None else _one_line(error)
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    failed = [(r, text) for r, text in enumerate(reasons) if text is not None]
    if failed:
        rank, text = failed[0]
        where = f" on rank {rank}" if len(failed) < len(reasons) else ""
        raise CheckpointError(f"{what} failed{where}: {text}") from error


def _one_line(error: BaseException) -> str:
    """``error`` as one line: a full disk says so; a CheckpointError is already one."""
    if isinstance(error, CheckpointError):
        return str(error)
    first = _first_line(error)
    if _no_space(error):
        return f"no space left on the device ({first})"
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s text, without the paragraph of advice torch's zip reader appends."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    advice = first.find(". This is an internal")
    return first[:advice] if advice > 0 else first


def _no_space(error: BaseException) -> bool:
    """An out-of-space write: ``OSError(ENOSPC)``, or torch's zip writer's ``unexpected pos`` / ``file write
    failed`` RuntimeError (what a full disk gives inside ``torch.save``)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("unexpected pos" in text or "file write failed" in text
                                                 or "No space left" in text)


def _writing(path: str, write: Callable[[], Any], room: str, what: str = "") -> Any:
    """``write()``, its error raised as a :class:`CheckpointError` naming ``what`` (default: the file ``path``), and
    on a full disk the directory ``room`` that needs space."""
    try:
        return write()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - OSError, torch's RuntimeError, safetensors' errors, ...
        what = what or path
        if _no_space(exc):
            raise CheckpointError(f"no space left on the device while writing {what} ({_first_line(exc)}): free "
                                  f"space in {room} or pass another --output-dir (the previous checkpoint is kept)"
                                  ) from exc
        raise CheckpointError(f"writing {what} failed: {_one_line(exc)}") from exc


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
        CheckpointError (on every rank, one line): a rank failed to write its part (a full disk named as such); the
        partial directory is removed.
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
        rng = os.path.join(tmp, f"rng-rank{rank}.pt")
        _writing(rng, lambda: torch.save(_rng_state(), rng), out_dir)
        if rank == 0:
            _writing(tmp, lambda: model.save_pretrained(tmp, state_dict=model_sd), out_dir, f"the model into {tmp}")
            if tokenizer is not None:
                _writing(tmp, lambda: tokenizer.save_pretrained(tmp), out_dir, f"the tokenizer into {tmp}")
            optim = os.path.join(tmp, "optimizer.pt")
            _writing(optim, lambda: torch.save({"optimizer": optim_sd, "scheduler": scheduler.state_dict()}, optim),
                     out_dir)
            if before_commit is not None:
                before_commit()
            state_file = os.path.join(tmp, STATE_FILE)
            _writing(state_file, lambda: _write_json(state_file, {**state, "step": step}), out_dir)
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


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)


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
    sharded (FSDP2) and the optimizer built: every rank reads the full optimizer state and keeps its shard.

    Raises:
        CheckpointError (on every rank): a file missing, truncated or corrupt on any rank, named.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    rank, error, saved, rng, state = dist.get_rank(), None, None, None, None
    try:
        saved = _reading(os.path.join(checkpoint, "optimizer.pt"), ("optimizer", "scheduler"))
        rng = _reading(os.path.join(checkpoint, f"rng-rank{rank}.pt"), ("torch", "numpy", "python"))
        try:
            state = read_state(checkpoint)
        except (OSError, ValueError) as exc:
            raise CheckpointError(_one_line(exc)) from exc
    except CheckpointError as exc:
        error = exc
    _agree_ok(error, f"resuming from {checkpoint}")
    set_optimizer_state_dict(model, optimizer, optim_state_dict=saved["optimizer"],
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(saved["scheduler"])
    _set_rng_state(rng)
    return state


def _reading(path: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``torch.load(path)``, a dict holding ``keys``; else a :class:`CheckpointError` naming the file and the
    fault."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete (copied in part?); resume from "
                              "another checkpoint, or copy the file back")
    try:
        value = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - zip, pickle and EOF errors each have their own type
        raise CheckpointError(f"{path} does not load ({_one_line(exc)}): it is truncated or corrupt; resume from "
                              "another checkpoint") from exc
    missing = [k for k in keys if not isinstance(value, dict) or k not in value]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)} (a {type(value).__name__} written by something "
                              "else?); resume from a checkpoint this launcher wrote")
    return value
