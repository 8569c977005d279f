"""The agreement at its edges: the rank that hosts the c10d store raises and exits at once; a late rank (3 ranks).

``cp_packing.testing.run_ranks`` hosts the store in the test process, so a rank's exit never takes the store with it.
Here rank 0 hosts it, as in a plain ``init_process_group`` (``tcp://`` or ``env://``): each rank reports what it
raised and leaves with ``os._exit`` right away (no ``destroy_process_group``, no waiting for its peers), like a
training script that dies on an uncaught exception. Every rank must report the same error, naming the cause; a rank
killed at the hard timeout (a hang) fails the test.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue as queue_module
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cp_packing import agreement, distribute_batch, next_token_labels
from cp_packing.agreement import agree
from cp_packing.testing import run_ranks, under_torchrun

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(under_torchrun(), reason="these cases fork their own ranks, rank 0 hosting the store"),
]

HARD_TIMEOUT = 60.0  # seconds for a whole case; far above what a case that passes needs
AGREEMENT_TIMEOUT = 20.0  # the bounded wait: a rank that waits it out would show as AgreementTimeout, not the cause

_DOC_IDS = torch.tensor([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])  # [2, 12]: T = 24 splits over 2 and 3 ranks


def _batch() -> dict[str, torch.Tensor]:
    input_ids = torch.arange(_DOC_IDS.numel()).reshape(_DOC_IDS.shape) % 7
    return {"input_ids": input_ids, "labels": next_token_labels(input_ids, _DOC_IDS), "doc_ids": _DOC_IDS.clone()}


def _layout_differs_on_rank_0(rank: int, world: int) -> None:
    """The library's agreement fails (another layout on rank 0): every rank raises, rank 0 exits at once."""
    distribute_batch(_batch(), group=dist.group.WORLD, layout="balanced" if rank == 0 else "contiguous")


def _error_on_rank_0(rank: int, world: int) -> None:
    """Rank 0's own check fails inside the agreement: every rank raises rank 0's error."""
    agree(dist.group.WORLD, "packed_cross_entropy", {"vocab size": 16},
          error=ValueError("label 99 is outside [0, 16)") if rank == 0 else None)


def _host_raises_before_the_call(rank: int, world: int) -> None:
    """Rank 0 raises in user code and exits while its peers wait in an agreement: they lose the store. (Every rank
    first finishes joining the group, and rank 0 raises a moment later, so that the peers lose the store in the
    agreement, not in init_process_group's own start-up: that is torch's, before any cp-packing call.)"""
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)
        raise RuntimeError("user code failed on rank 0")
    agree(dist.group.WORLD, "context_parallel_attention", {"layout": "contiguous"})


SCENARIOS = {f.__name__: f for f in (_layout_differs_on_rank_0, _error_on_rank_0, _host_raises_before_the_call)}


class _SlowReads:
    """A store whose reads come 0.5 s late: a peer descheduled between seeing every record and reading them (under
    load); it makes the race with the host's exit certain rather than likely."""

    def __init__(self, store):
        self._store = store

    def multi_get(self, keys):
        time.sleep(0.5)
        return self._store.multi_get(keys)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _child(rank: int, world: int, name: str, ports, results) -> None:
    torch.set_num_threads(1)
    try:
        if rank == 0:  # this rank hosts the store, as in a plain init_process_group
            store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=HARD_TIMEOUT),
                                  wait_for_workers=False)
            for _ in range(world - 1):
                ports.put(store.port)
        else:
            store = dist.TCPStore("127.0.0.1", ports.get(), world, False, timeout=timedelta(seconds=HARD_TIMEOUT))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=HARD_TIMEOUT))
        agreement.set_agreement_timeout(AGREEMENT_TIMEOUT)
        if rank > 0:
            channel = agreement._channel(dist.group.WORLD)  # the world's channel (kept): its reads come late
            channel.store = _SlowReads(channel.store)
        SCENARIOS[name](rank, world)
        result = ("ok", None)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        result = (type(exc).__name__, str(exc))
    results.put((rank, result))
    results.close()
    results.join_thread()  # the report is in the pipe: now leave at once, store and all
    os._exit(0)


def _run_with_rank_0_hosting(name: str, world: int) -> dict[int, tuple[str, str | None]]:
    ctx = mp.get_context("fork")
    ports, results = ctx.SimpleQueue(), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, name, ports, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    said: dict[int, tuple[str, str | None]] = {}
    deadline = time.monotonic() + HARD_TIMEOUT
    try:
        while len(said) < world and time.monotonic() < deadline:
            try:
                rank, result = results.get(timeout=1.0)
            except queue_module.Empty:
                continue
            said[rank] = result
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    missing = sorted(set(range(world)) - set(said))
    assert not missing, f"ranks {missing} did not report within {HARD_TIMEOUT} s (a hang?); the others: {said}"
    return said


@pytest.mark.parametrize("world", [2, 3])
def test_the_store_host_exits_right_after_a_failed_agreement(world):
    """Every peer reads the verdict before the host may leave: the same AgreementError, not 'Connection closed'."""
    said = _run_with_rank_0_hosting("_layout_differs_on_rank_0", world)
    assert said[0][0] == "AgreementError" and "disagree on layout" in said[0][1], said
    assert all(said[r] == said[0] for r in range(world)), said


@pytest.mark.parametrize("world", [2, 3])
def test_the_store_host_exits_right_after_its_own_error(world):
    said = _run_with_rank_0_hosting("_error_on_rank_0", world)
    assert said[0][0] == "ValueError" and "label 99 is outside [0, 16)" in said[0][1], said
    assert "raised on CP group rank 0" in said[0][1], said
    assert all(said[r] == said[0] for r in range(world)), said


def test_a_peer_that_loses_the_store_says_so():
    """Rank 0 dies before the call: its peers' transport error becomes an AgreementError pointing at its error."""
    said = _run_with_rank_0_hosting("_host_raises_before_the_call", 3)
    assert said[0] == ("RuntimeError", "user code failed on rank 0"), said
    for rank in (1, 2):
        kind, message = said[rank]
        assert kind == "AgreementError", said
        assert "context_parallel_attention" in message and "the store host exited after raising: see its error" \
            in message, said


class _PeerDeletesAfterCheck:
    """A real store where a peer deletes the key right after this rank's ``check`` saw it (a crossed-group peer
    leaving its ``waiting/`` key as it raises); a ``get`` of the missing key would wait for the store's timeout."""

    def __init__(self, store):
        self.store, self.blocking_gets = store, []

    def check(self, keys):
        found = self.store.check(keys)
        for key in keys:
            self.store.delete_key(key)
        return found

    def get(self, key):
        if not self.store.check([key]):
            self.blocking_gets.append(key)  # a TCPStore would block here for its whole timeout (30 min by default)
        return self.store.get(key)

    def compare_set(self, key, expected, desired):
        answer = self.store.compare_set(key, expected, desired)
        self.store.delete_key(key)
        return answer


def test_reading_a_key_a_peer_deletes_meanwhile_never_waits():
    """The twin-groups hang: rank 1 read rank 0's ``waiting/0`` while rank 0 raised and deleted it; reading must be
    one atomic round trip that answers None for a key gone, never a ``get`` that waits for it to come back."""
    import pickle

    store = _PeerDeletesAfterCheck(dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=2)))
    store.store.set("waiting/0", pickle.dumps(("a channel", 1)))
    assert agreement._read(store, "waiting/0") == ("a channel", 1)
    assert agreement._read(store, "waiting/0") is None  # deleted by the "peer": absent, at once
    assert store.blocking_gets == [] and not store.store.check(["waiting/0"])  # and reading created nothing


# ------------------------------------------------------------------------------------------------ a late rank of 3


def _late_rank_2(rank: int, world: int):
    agreement.set_agreement_timeout(2.0)
    if rank == 2:
        time.sleep(3.0)  # past its peers' bounded wait
    try:
        agree(dist.group.WORLD, "distribute_batch", {"layout": "contiguous"})
        return ("ok", None)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)


def test_a_late_rank_of_three_raises_at_once_naming_who_gave_up():
    """Ranks 0 and 1 wait for rank 2; one gives up and marks the agreement; rank 2 then raises instead of passing."""
    results = run_ranks(_late_rank_2, 3, timeout=HARD_TIMEOUT)
    assert all(r.ok for r in results), [r.error for r in results]
    said = {r.rank: r.value for r in results}
    for rank in (0, 1):
        kind, message = said[rank]
        assert kind == "AgreementTimeout" and "rank 2 of the CP group (global 2) did not arrive" in message, said
    kind, message = said[2]
    assert kind == "AgreementTimeout", said
    assert "arrived too late: global rank" in message and "gave up waiting for it in distribute_batch" in message
    assert " s ago, after 2 s" in message, said


# ------------------------------------------------------------------------------------------------ num_items_in_batch


def _num_items_differ(rank: int, world: int, group_given: bool):
    from cp_packing.loss import packed_cross_entropy

    labels = torch.tensor([1, 2, -100, 3])
    try:
        loss = packed_cross_entropy(torch.zeros(4, 5), labels, num_items_in_batch=6 + rank,
                                    group=dist.group.WORLD if group_given else None)
        return "ok", float(loss)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)


def test_num_items_in_batch_is_compared_across_the_group_given():
    """packed_cross_entropy's docstring: the value is compared across ``group`` when given (else local math)."""
    with_group = [r.value for r in run_ranks(_num_items_differ, 2, True, timeout=HARD_TIMEOUT)]
    assert all(kind == "AgreementError" and "disagree on num_items_in_batch" in msg for kind, msg in with_group), \
        with_group
    alone = [r.value for r in run_ranks(_num_items_differ, 2, False, timeout=HARD_TIMEOUT)]
    assert [round(v, 6) for _, v in alone] == [round(3 * math.log(5) / n, 6) for n in (6, 7)], alone  # ln 5 per label


# ------------------------------------------------------------------------------------------------ a second world


def _two_worlds_one_rank_reusing_the_id(rank: int, world: int):
    """Two worlds one after the other in one process (init, destroy, init). On rank 0, ``id()`` answers the same
    for the new world's default group (CPython reuses a freed object's address; it may happen on one rank only)."""
    agreement.set_agreement_timeout(5.0)
    if rank == 0:
        agreement.id = lambda obj: 1  # the freed world's address, handed to the new one
    store = dist.distributed_c10d._get_default_store()
    seen = []
    for world_number in range(2):
        if world_number:
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.PrefixStore("second world/", store), rank=rank,
                                    world_size=world)
        agree(dist.group.WORLD, "distribute_batch", {"layout": "contiguous"})
        seen.append(agreement.next_step(dist.group.WORLD))
    return seen


def test_a_second_world_starts_new_agreements_on_every_rank():
    """A new world (init_process_group again) counts its agreements and steps from the start on every rank, even
    where the new default group reuses the old one's ``id()``: no rank continues the old world's sequence."""
    results = run_ranks(_two_worlds_one_rank_reusing_the_id, 2, timeout=60)
    assert [r.value for r in results] == [[1, 1], [1, 1]], [r.error for r in results]
