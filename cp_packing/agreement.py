"""One agreement across a process group before its collectives: fail together, never hang, never abort.

A collective that one rank skips (it raised on its own) leaves the others waiting until the process group times out;
collectives whose sizes differ between ranks abort gloo (``EnforceNotMet``) or, when the byte counts happen to match,
return garbage. So every cp-packing call that communicates starts with ``agree``: ONE ``all_gather_object`` of a
small record per rank (which call, the fields every rank must share, and this rank's own error if its local checks
failed). Every rank compares all records and raises the same error, naming the ranks and the field, before the
first real collective. ``all_gather_object`` exchanges sizes first, so records of different sizes (even two different
calls that meet, one rank in ``distribute_batch`` and another in attention) pair up safely.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["AgreementError", "Record", "agree", "digest"]

# Error classes a record may carry; anything else travels as RuntimeError (every rank must be able to build it).
_ERROR_TYPES = {cls.__name__: cls for cls in (ValueError, TypeError, RuntimeError, NotImplementedError, IndexError,
                                              KeyError, OverflowError, ZeroDivisionError, MemoryError,
                                              ImportError)}


class AgreementError(ValueError):
    """The ranks of a group made different calls, or the same call with arguments that must match but do not."""


@dataclass
class Record:
    """What one rank contributes to ``agree``.

    Attributes:
        call: the call this rank is in, e.g. ``"context_parallel_attention"``.
        fields: values every rank must share (compared with ``==``; keep them small: ints, strings, digests).
        error: ``(class name, message)`` of this rank's local failure, or ``None``.
        payload: anything else this rank sends (not compared), e.g. the source rank's metadata.
    """

    call: str
    fields: dict[str, Any]
    error: tuple[str, str] | None = None
    payload: Any = field(default=None, repr=False)


def digest(*parts: Any) -> str:
    """A collision-resistant hex digest (BLAKE2b, 128 bits) of tensors (dtype, shape and bytes), numbers and strings.

    >>> digest(torch.tensor([0, 2, 5], dtype=torch.int32)) == digest(torch.tensor([0, 2, 5], dtype=torch.int32))
    True
    """
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, torch.Tensor):
            t = part.detach()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                t = t.to("cpu").contiguous()
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool
                         else t.numpy().tobytes())
        else:
            h.update(f"{type(part).__name__}:{part!r};".encode())
    return h.hexdigest()


def _error_of(exc: BaseException | None) -> tuple[str, str] | None:
    if exc is None:
        return None
    name = type(exc).__name__ if type(exc).__name__ in _ERROR_TYPES else "RuntimeError"
    for cls in type(exc).__mro__:  # a subclass of ValueError travels as ValueError
        if cls.__name__ in _ERROR_TYPES and _ERROR_TYPES[cls.__name__] is cls:
            name = cls.__name__
            break
    return name, str(exc)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _raise_disagreement(records: list[Record], group_name: str) -> None:
    calls = [r.call for r in records]
    if len(set(calls)) > 1:
        by_call: dict[str, list[int]] = {}
        for rank, call in enumerate(calls):
            by_call.setdefault(call, []).append(rank)
        said = "; ".join(f"{_ranks(r)} in {c}" for c, r in by_call.items())
        raise AgreementError(
            f"the ranks of the {group_name} made different calls ({said}); every rank of the group must make the "
            "same cp-packing calls in the same order (a rank that skipped or added a call, e.g. a data-dependent "
            "branch, check_consistent or src set on some ranks only)"
        )
    keys = list(records[0].fields)
    if any(list(r.fields) != keys for r in records):
        raise AgreementError(f"the ranks of the {group_name} sent different fields to {calls[0]}")
    for key in keys:
        values = [r.fields[key] for r in records]
        if any(v != values[0] for v in values[1:]):
            groups: dict[str, list[int]] = {}
            for rank, v in enumerate(values):
                groups.setdefault(_short(v), []).append(rank)
            said = "; ".join(f"{_ranks(r)}: {v}" for v, r in groups.items())
            raise AgreementError(
                f"{calls[0]}: the ranks of the {group_name} disagree on {key} ({said}); every rank must pass the "
                f"same {key} (same batch, same layout, same shapes and dtypes on every rank of the group)"
            )


def agree(
    group: dist.ProcessGroup | None,
    call: str,
    fields: Mapping[str, Any],
    *,
    error: BaseException | None = None,
    payload: Any = None,
    group_name: str = "CP group",
) -> list[Record]:
    """Exchange one ``Record`` per rank and raise the same error on every rank unless all agree.

    Args:
        group: the process group (``None`` or a one-rank group: no communication, ``error`` is raised as is).
        call: the name of the call every rank must be in.
        fields: the values every rank must share.
        error: this rank's own failure from its local checks (it is raised on EVERY rank, with the rank named).
        payload: anything else to send (not compared); returned in the records.
        group_name: how messages name the group.

    Returns:
        Every rank's record, in group-rank order.

    Raises:
        The class of the lowest failing rank's error (ValueError, TypeError, ...; other classes as RuntimeError) on
        every rank, or ``AgreementError`` (a ValueError) when the ranks differ in ``call`` or in a field.
    """
    mine = Record(call=call, fields=dict(fields), error=_error_of(error), payload=payload)
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return [mine]
    records: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(records, mine, group=group)
    failed = [rank for rank, r in enumerate(records) if r.error is not None]
    if failed:
        name, message = records[failed[0]].error
        also = f"; {_ranks(failed[1:])} failed too" if len(failed) > 1 else ""
        text = f"{message} [raised on {group_name} rank {failed[0]}{also}; every rank of the group raises this]"
        exc = _ERROR_TYPES[name](text)
        raise exc from error
    _raise_disagreement(records, group_name)
    return records
