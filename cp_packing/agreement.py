"""The fail-together protocol: one agreement across a group before its collectives; never a hang, never an abort.

A collective that one rank skips (it raised on its own) leaves the others waiting until the process group times out;
collectives whose sizes differ between ranks abort gloo (``EnforceNotMet``) or, when the byte counts happen to match,
return garbage. So every cp-packing call that communicates starts with ``agree``: each rank posts a small record (which
call, the fields every rank must share, this rank's own error if its local checks failed) and reads everyone's; every
rank compares them and raises the same error, naming the ranks and the field, before the first real collective.

The records travel through the job's c10d key-value store (the TCPStore torchrun or ``init_process_group`` set up),
not through the group's collectives, so:

* records of any size and of two different calls pair up safely (one rank in ``distribute_batch``, another in the
  attention of a layer it added), and an NCCL group needs no device sync for them;
* every group (by torch's name of the process group, the same on all its ranks: two groups with the same ranks are two
  groups) keeps a sequence number of its agreements: the k-th agreement of a rank meets the k-th of its peers, so an
  extra or a missing call is an error naming both calls, never a hang;
* a peer that never arrives (it raised in its own code, died, or took another branch) is a bounded wait: after
  :func:`agreement_timeout` seconds (default 120, ``CP_PACKING_TIMEOUT``) every waiting rank raises
  :class:`AgreementTimeout` naming the call and the ranks that did not arrive, and marks their places in that
  agreement as abandoned (atomically, ``compare_set``): a rank that arrives later raises at once, naming the peer
  that gave up and how long ago, instead of passing into collectives nobody joins;
* a rank that passed another group (``None`` on one rank, the DP group for the CP group) is found while waiting: a
  waiting rank announces where it waits, and two ranks that wait for each other in different groups both raise,
  naming the groups, within seconds;
* an agreement that fails is left only when every rank has read the verdict (an acknowledgement per rank), so the
  rank that hosts the store may raise and exit at once; a rank that still loses the store raises an
  ``AgreementError`` that says so (its own carried error where it has one), never a bare transport error.

:func:`fail_together` is the one way call sites use it: local checks inside the ``with`` block, one agreement per
group on exit, whatever the exception class.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "Agreement",
    "AgreementError",
    "AgreementTimeout",
    "Record",
    "agree",
    "agreement_timeout",
    "digest",
    "fail_together",
    "next_step",
    "ranks_by_value",
    "set_agreement_timeout",
]

TIMEOUT_ENV = "CP_PACKING_TIMEOUT"
"""The environment variable that sets :func:`agreement_timeout` (seconds)."""

DEFAULT_TIMEOUT = 120.0
"""How long (seconds) a rank waits for its peers in one agreement before it raises :class:`AgreementTimeout`."""

_timeout: float | None = None  # set_agreement_timeout's value; None: the environment or the default

# Error classes a record may carry; anything else travels as RuntimeError (every rank must be able to build it).
_ERROR_TYPES = {cls.__name__: cls for cls in (ValueError, TypeError, RuntimeError, NotImplementedError, IndexError,
                                              KeyError, OverflowError, ZeroDivisionError, MemoryError,
                                              ImportError)}


class AgreementError(ValueError):
    """The ranks of a group made different calls, or the same call with arguments that must match but do not."""


class AgreementTimeout(RuntimeError):
    """Some ranks of a group did not reach an agreement within :func:`agreement_timeout` seconds."""


def agreement_timeout() -> float:
    """The bounded wait of an agreement, in seconds: :func:`set_agreement_timeout`'s value, else
    ``CP_PACKING_TIMEOUT``, else :data:`DEFAULT_TIMEOUT` (120).

    >>> agreement_timeout() > 0
    True
    """
    if _timeout is not None:
        return _timeout
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"{TIMEOUT_ENV}={text!r} must be a number of seconds > 0, e.g. {TIMEOUT_ENV}=300")
    return value


def set_agreement_timeout(seconds: float | None) -> None:
    """Set how long an agreement waits for the other ranks (``None``: back to ``CP_PACKING_TIMEOUT`` / 120 s).
    Every rank should set the same value."""
    global _timeout
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ValueError(f"the agreement timeout must be a number of seconds > 0, got {seconds!r}")
        seconds = float(seconds)
    _timeout = seconds


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


def ranks_by_value(values: Sequence[Any]) -> dict[Any, list[int]]:
    """``{value: the ranks (indices) that sent it}``, in first-seen order: how a disagreement names its sides.

    >>> ranks_by_value(["a", "b", "a"])
    {'a': [0, 2], 'b': [1]}
    """
    out: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        out.setdefault(value, []).append(rank)
    return out


def _raise_disagreement(records: list[Record], group_name: str) -> None:
    calls = [r.call for r in records]
    if len(set(calls)) > 1:
        by_call = ranks_by_value(calls)
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


class _Channel:
    """One group's agreements in the store: its key prefix, its global ranks and its sequence number."""

    def __init__(self, pg_name: str, ranks: tuple[int, ...], store: Any):
        self.pg_name = pg_name  # torch's name of the process group: the same on every rank of it
        self.ranks = ranks
        self.name = _channel_name(pg_name, ranks)
        self.store = store
        self.seq = 0
        self.steps = 0
        self.me = ranks.index(dist.get_rank())

    def describe(self, group_name: str) -> str:
        return f"its {group_name} of global ranks {list(self.ranks)} (process group {self.pg_name!r})"


def _channel_name(pg_name: str, ranks: tuple[int, ...]) -> str:
    return hashlib.blake2b(f"{pg_name}:{ranks}".encode(), digest_size=8).hexdigest()


# One per process group (torch's name for it) of the current world: the sequence numbers live here, as torch keeps
# its own per process group. A new world (init_process_group again) starts new channels: it is told apart by a weak
# reference to its default group, not by ``id()``, which a new world's group may reuse once the old one is freed
# (on one rank and not on another: their sequence numbers would part and every agreement time out).
_CHANNELS: dict[str, _Channel] = {}
_WORLD: list = [None]  # a weakref.ref to the default process group the channels belong to


def _channel(group: dist.ProcessGroup) -> _Channel:
    pg_name = dist.distributed_c10d._get_process_group_name(group)  # "0" for the world, "1", ... (or a hash)
    if pg_name == "None":  # not registered with torch (a hand-made group): its ranks are all there is
        pg_name = "ranks " + repr(tuple(dist.get_process_group_ranks(group)))
    world = dist.group.WORLD
    if _WORLD[0] is None or _WORLD[0]() is not world:
        _CHANNELS.clear()
        _WORLD[0] = weakref.ref(world)
    channel = _CHANNELS.get(pg_name)
    if channel is None:
        store = dist.PrefixStore("cp_packing/", dist.distributed_c10d._get_default_store())
        channel = _CHANNELS[pg_name] = _Channel(pg_name, tuple(dist.get_process_group_ranks(group)), store)
    return channel


def next_step(group: dist.ProcessGroup | None) -> int:
    """This group's next step number (1, 2, ...), counted alike on every rank (a step plan calls it in its
    agreement); 0 without communication."""
    if group is None or dist.get_world_size(group) == 1:
        return 0
    channel = _channel(group)
    channel.steps += 1
    return channel.steps


def _key(name: str, seq: int, rank: int) -> str:
    return f"{name}/{seq}/{rank}"


# Never a value of the store (records and marks are pickles or start with _GAVE_UP): what compare_set answers for an
# absent key when asked to replace this by itself.
_ABSENT = b"cp_packing:absent\n"


def _read(store: Any, key: str) -> Any:
    """The unpickled value of ``key``, or None when it is absent; one atomic, non-blocking round trip.

    Not ``check`` then ``get``: a peer deletes its ``waiting/`` key when it leaves, and a ``get`` of a key deleted
    between the two waits for the store's whole timeout (30 min by default) instead of failing."""
    value = store.compare_set(key, _ABSENT, _ABSENT)  # absent: answers _ABSENT, creates nothing; else its value
    return None if value == _ABSENT else pickle.loads(value)


# A rank that gave up waiting writes this (then a pickled (global rank, wall time, call, seconds waited)) into each
# missing peer's place of that agreement; records are pickles (they start with b"\x80"), so the two never mix.
_GAVE_UP = b"cp_packing:gave-up\n"


def _gave_up(value: bytes) -> tuple[int, float, str, float] | None:
    return pickle.loads(value[len(_GAVE_UP):]) if value.startswith(_GAVE_UP) else None


def _timeout_error(channel: _Channel, call: str, group_name: str, missing: list[int], timeout: float,
                   gave_up: tuple[int, float, str, float] | None = None) -> AgreementTimeout:
    gone = ", ".join(str(channel.ranks[r]) for r in missing)
    who = "" if gave_up is None else f" (global rank {gave_up[0]} gave up waiting for them {_ago(gave_up[1])})"
    return AgreementTimeout(
        f"{call}: {_ranks(missing)} of the {group_name} (global {gone}) did not arrive within {timeout:g} s{who}; "
        "they raised in their own code, died, or took another branch (every rank of the group must make the same "
        f"cp-packing calls). Set {TIMEOUT_ENV}=<seconds> (or cp_packing.agreement.set_agreement_timeout) where a "
        "rank may legitimately lag longer, e.g. a long save"
    )


def _ago(when: float) -> str:
    return f"{max(time.time() - when, 0.0):.1f} s ago"


def _late_error(channel: _Channel, call: str, group_name: str, gave_up: tuple[int, float, str, float]) -> \
        AgreementTimeout:
    rank, when, their_call, waited = gave_up
    return AgreementTimeout(
        f"{call}: this rank (global rank {channel.ranks[channel.me]}) arrived too late: global rank {rank} of its "
        f"{group_name} gave up waiting for it in {their_call} {_ago(when)}, after {waited:g} s (it raised "
        "AgreementTimeout), so this agreement can never complete. Find why this rank lagged (see the other rank's "
        f"error), or set {TIMEOUT_ENV}=<seconds> higher on every rank where a rank may legitimately lag that long"
    )


def _store_lost(call: str, group_name: str, exc: BaseException) -> AgreementError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return AgreementError(
        f"{call}: this rank lost the c10d store that carries the {group_name}'s agreement ({type(exc).__name__}: "
        f"{first}): the store host exited after raising: see its error (global rank 0 hosts the store in a plain "
        "init_process_group; under torchrun, the agent)"
    )


def _waiting_for_me(channel: _Channel, missing: list[int]) -> tuple[int, str, bool] | None:
    """``(global rank, description, same ranks)`` of a missing peer that waits for this rank in ANOTHER group (one
    with the same ranks too: a twin), or None."""
    me_global = channel.ranks[channel.me]
    for r in missing:
        found = _read(channel.store, f"waiting/{channel.ranks[r]}")
        if found is None:
            continue
        name, pg_name, ranks, seq, call, group_name = found
        if name == channel.name or me_global not in ranks:
            continue
        if channel.store.check([_key(name, seq, ranks.index(me_global))]):
            continue  # this rank has posted there: the peer waits for someone else
        return channel.ranks[r], (f"global rank {channel.ranks[r]} waits in {call} over its {group_name} of global "
                                  f"ranks {list(ranks)} (process group {pg_name!r})"), ranks == channel.ranks
    return None


def _crossed_error(channel: _Channel, call: str, group_name: str, other: str, twins: bool) -> AgreementError:
    return AgreementError(
        f"{call}: this rank (global rank {channel.ranks[channel.me]}) waits over {channel.describe(group_name)}, but "
        f"{other}: the ranks passed different groups. Every rank must pass the same group (the CP group, e.g. "
        "mesh['cp'], on every rank; not None or the DP group on some)"
        + ("; two groups with the same ranks (dist.new_group called twice) are two different groups" if twins else "")
    )


def _missing(channel: _Channel, seq: int) -> list[int]:
    return [r for r in range(len(channel.ranks)) if not channel.store.check([_key(channel.name, seq, r)])]


def _give_up(channel: _Channel, seq: int, missing: list[int], call: str, timeout: float) -> list[int]:
    """Mark the missing ranks' places in agreement ``seq`` as abandoned; return those still missing (a rank whose
    record landed first arrived in time after all). Atomic: a late rank's own ``compare_set`` finds the mark."""
    mark = _GAVE_UP + pickle.dumps((channel.ranks[channel.me], time.time(), call, timeout))
    gone = []
    for r in missing:
        value = channel.store.compare_set(_key(channel.name, seq, r), b"", mark)
        if value == mark or value.startswith(_GAVE_UP):  # marked now, or by another rank that gave up first
            gone.append(r)
    return gone


def _exchange(channel: _Channel, data: bytes, call: str, group_name: str) -> list[bytes]:
    """Post this rank's record for the group's next agreement and return every rank's, in group-rank order."""
    channel.seq += 1
    seq, store = channel.seq, channel.store
    keys = [_key(channel.name, seq, r) for r in range(len(channel.ranks))]
    posted = store.compare_set(keys[channel.me], b"", data)  # one round trip, as a set; never over a peer's mark
    if posted != data:
        gave_up = _gave_up(posted)
        if gave_up is not None:
            raise _late_error(channel, call, group_name, gave_up)
        store.set(keys[channel.me], data)  # a stale record of an earlier world on the same store
    timeout = agreement_timeout()
    deadline = time.monotonic() + timeout
    wait, announced = 1.0, None
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                store.wait(keys, timedelta(seconds=max(min(wait, left), 0.001)))
                break
            except dist.DistStoreError:
                pass
            if announced is None:  # the slow path: say where this rank waits, for a peer in another group
                announced = f"waiting/{channel.ranks[channel.me]}"
                store.set(announced, pickle.dumps((channel.name, channel.pg_name, channel.ranks, seq, call,
                                                   group_name)))
            told = _read(store, f"crossed/{channel.ranks[channel.me]}")  # a peer found the crossing first
            if told is not None:
                store.delete_key(f"crossed/{channel.ranks[channel.me]}")
                raise _crossed_error(channel, call, group_name, *told)
            missing = _missing(channel, seq)
            if not missing:
                continue
            crossed = _waiting_for_me(channel, missing)
            if crossed is not None:
                peer, other, twins = crossed
                here = (f"global rank {channel.ranks[channel.me]} waits in {call} over its {group_name} of global "
                        f"ranks {list(channel.ranks)} (process group {channel.pg_name!r})")
                store.set(f"crossed/{peer}", pickle.dumps((here, twins)))  # the peer raises too, naming this group
                raise _crossed_error(channel, call, group_name, other, twins)
            if time.monotonic() >= deadline:
                gone = _give_up(channel, seq, missing, call, timeout)
                if gone:
                    raise _timeout_error(channel, call, group_name, gone, timeout)
            wait = min(2 * wait, 10.0)
        values = store.multi_get(keys)
    finally:
        if announced is not None:
            with contextlib.suppress(dist.DistError):
                store.delete_key(announced)
    marks = [(r, _gave_up(v)) for r, v in enumerate(values) if v.startswith(_GAVE_UP)]
    if marks:  # a peer gave up on a rank while this one waited: the agreement is abandoned on every rank
        raise _timeout_error(channel, call, group_name, [r for r, _ in marks], timeout, marks[0][1])
    if seq > 1:
        store.delete_key(_key(channel.name, seq - 1, channel.me))  # every peer has read it: they posted seq
    return values


def _acknowledge(channel: _Channel) -> None:
    """After a failed agreement: say this rank read the verdict, and wait (within the bound) until every rank has,
    so that the rank hosting the store may exit right after raising without cutting a peer off mid-read."""
    keys = [f"{channel.name}/{channel.seq}/read/{r}" for r in range(len(channel.ranks))]
    with contextlib.suppress(dist.DistError):  # the store may go first: this rank has its verdict already
        channel.store.set(keys[channel.me], b"1")
        channel.store.wait(keys, timedelta(seconds=agreement_timeout()))


def _verdict(records: list[Record], group_name: str, error: BaseException | None) -> None:
    """Raise the agreement's error (the lowest failing rank's, else a disagreement), or return."""
    failed = [rank for rank, r in enumerate(records) if r.error is not None]
    if failed:
        name, message = records[failed[0]].error
        also = f"; {_ranks(failed[1:])} failed too" if len(failed) > 1 else ""
        text = f"{message} [raised on {group_name} rank {failed[0]}{also}; every rank of the group raises this]"
        exc = _ERROR_TYPES[name](text)
        raise exc from error
    _raise_disagreement(records, group_name)


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
        payload: anything else to send (not compared; picklable); returned in the records.
        group_name: how messages name the group.

    Returns:
        Every rank's record, in group-rank order.

    Raises:
        The class of the lowest failing rank's error (ValueError, TypeError, ...; other classes as RuntimeError) on
        every rank; ``AgreementError`` (a ValueError) when the ranks differ in ``call`` or in a field, or passed
        different groups, or the store is lost (this rank's own ``error`` then, where it has one);
        ``AgreementTimeout`` (a RuntimeError) when a rank does not arrive in time, or arrives after a peer gave up.

    >>> agree(None, "my_call", {"layout": "zigzag"})[0].fields
    {'layout': 'zigzag'}
    """
    mine = Record(call=call, fields=dict(fields), error=_error_of(error), payload=payload)
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return [mine]
    try:
        data = pickle.dumps(mine)
    except Exception:  # noqa: BLE001 - an unpicklable error argument: send its text
        mine = Record(call=call, fields={k: repr(v) for k, v in mine.fields.items()}, error=mine.error)
        data = pickle.dumps(mine)
    channel = _channel(group)
    try:
        values = _exchange(channel, data, call, group_name)
    except dist.DistNetworkError as exc:  # the store's host exited (it raised, or was killed)
        if error is not None:
            raise error  # what this rank carries from an earlier group is the verdict every rank raises
        raise _store_lost(call, group_name, exc) from exc
    try:
        records = [pickle.loads(v) for v in values]
        _verdict(records, group_name, error)
    except Exception:
        _acknowledge(channel)
        raise
    return records


@dataclass
class Agreement:
    """What a :func:`fail_together` block sends, and (after the block) what every rank sent.

    Attributes:
        fields: the values every rank of every group must share (set inside the block).
        payload: anything else this rank sends (not compared).
        group_fields: per group name, fields sent to that group INSTEAD of ``fields`` (e.g. a DP group that must not
            compare a per-replica value).
        records: after the block, per group name, every rank's ``Record``.
    """

    fields: dict[str, Any] = field(default_factory=dict)
    payload: Any = None
    group_fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: dict[str, list[Record]] = field(default_factory=dict)


@contextlib.contextmanager
def fail_together(call: str, *groups: tuple[dist.ProcessGroup | None, str]) -> Iterator[Agreement]:
    """Run a call's local checks inside the block, then ONE agreement per group: every rank raises any rank's error.

    Args:
        call: the call's name (every rank of a group must be in the same call).
        groups: ``(process group or None, name)`` pairs, in the order to agree over (e.g. CP, then DP); a failure
            in one group's agreement travels into the next one, so every rank of every group raises it.

    Yields:
        An :class:`Agreement`: set its ``fields`` / ``payload`` inside the block; its ``records`` are filled after.

    Any ``Exception`` raised in the block is sent as this rank's error (and raised on every rank); a
    ``BaseException`` (KeyboardInterrupt) is not caught: the peers then raise :class:`AgreementTimeout`.

    >>> with fail_together("my_call", (None, "CP group")) as agreement:
    ...     agreement.fields["layout"] = "zigzag"
    >>> agreement.records["CP group"][0].fields
    {'layout': 'zigzag'}
    """
    agreement = Agreement()
    error: Exception | None = None
    try:
        yield agreement
    except Exception as exc:  # noqa: BLE001 - every class travels through the agreement
        error = exc
    for group, name in groups:
        try:
            agreement.records[name] = agree(group, call, agreement.group_fields.get(name, agreement.fields),
                                            error=error, payload=agreement.payload, group_name=name)
        except Exception as exc:  # noqa: BLE001 - the next group must learn it
            error = exc
    if error is not None:
        raise error
