"""cp_packing.testing: the one synthetic doc-map generator and the one rank runner (tests, benchmarks, launchers)."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
import torch.distributed as dist

from cp_packing.testing import (
    SYNTHETIC_KINDS,
    RanksFailed,
    run_distributed,
    run_ranks,
    synthetic_doc_ids,
    under_torchrun,
)

spawns = pytest.mark.skipif(under_torchrun(), reason="spawns its own ranks")

# sha256 prefixes of synthetic_doc_ids(kind, 3, 1024, seed=5) as the generator drew them before it gained keyword
# options: benchmarks and the balance tables in docs/ were measured on these maps.
GOLDEN = {
    "lognormal": "c4f6e764bf6484ae",
    "long": "c50bbd21aa775ee9",
    "short": "58293b4ebe30e797",
    "huge": "349ba62d48fd27bb",
    "padded": "ea9f21e6a0186b1a",
}


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_existing_kinds_draw_the_same_maps_as_before(kind):
    doc_ids = synthetic_doc_ids(kind, 3, 1024, seed=5)
    assert hashlib.sha256(doc_ids.numpy().tobytes()).hexdigest()[:16] == GOLDEN[kind]


def _runs(row: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of a row."""
    out: list[tuple[int, int]] = []
    for v in row:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


def test_multiple_pad_and_dtype_options():
    doc_ids = synthetic_doc_ids("lognormal", 4, 256, seed=1, median=20, pad=0.25, multiple=8, dtype=torch.int32)
    assert doc_ids.shape == (4, 256) and doc_ids.dtype == torch.int32
    for row in doc_ids.tolist():
        runs = _runs(row)
        assert all(length % 8 == 0 for _, length in runs), runs  # zigzag-ready for cp <= 4
        n_pad = sum(length for v, length in runs if v == 0)
        assert n_pad <= 64 and 0 not in row[: 256 - n_pad]  # padding only at the tail, at most 25% of the row
        ids = [v for v, _ in runs if v]
        assert ids == list(range(1, len(ids) + 1))  # 1, 2, ... per row
    with pytest.raises(ValueError, match="divisible"):
        synthetic_doc_ids("lognormal", 1, 100, multiple=8)
    with pytest.raises(ValueError, match="pad"):
        synthetic_doc_ids("lognormal", 1, 100, pad=1.0)
    with pytest.raises(TypeError, match="integer dtype"):
        synthetic_doc_ids("lognormal", 1, 100, dtype=torch.float32)


def test_median_sets_the_document_lengths():
    short = synthetic_doc_ids("lognormal", 2, 8192, seed=0, median=16, sigma=0.5)
    long = synthetic_doc_ids("lognormal", 2, 8192, seed=0, median=512, sigma=0.5)
    n_short, n_long = (sum(len(_runs(r)) for r in m.tolist()) for m in (short, long))
    assert 8192 * 2 / n_short < 30 and 8192 * 2 / n_long > 250  # mean length follows the median


def _sum_of_ranks(rank, world_size, offset):
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t}


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise KeyError("no such key on rank 1")
    dist.barrier()  # rank 0 waits for a rank that is gone
    return "unreachable"


def _sleep_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(60)
    return rank


@spawns
@pytest.mark.distributed
def test_results_come_back_in_rank_order_by_value():
    results = run_distributed(_sum_of_ranks, 3, 10)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(torch.equal(r["sum"], torch.tensor([33])) for r in results)


@spawns
@pytest.mark.distributed
def test_an_exception_comes_back_with_its_rank_and_the_waiting_rank_is_released():
    t0 = time.monotonic()
    results = run_ranks(_raise_on_rank_1, 2, timeout=120, grace=10)
    assert time.monotonic() - t0 < 60  # not the 120 s timeout: the failure ends the run
    assert not results[1].ok and isinstance(results[1].exception, KeyError)
    assert "no such key on rank 1" in results[1].error and "Traceback" in results[1].error
    assert not results[0].ok  # it failed in the barrier or was stopped: never reported as a success
    with pytest.raises(RanksFailed, match="rank 1 of 2 failed"):
        run_distributed(_raise_on_rank_1, 2, timeout=120)


@spawns
@pytest.mark.distributed
def test_a_rank_that_hangs_is_killed_at_the_timeout():
    t0 = time.monotonic()
    results = run_ranks(_sleep_on_rank_0, 2, timeout=5)
    assert time.monotonic() - t0 < 30
    assert results[1].ok and results[1].value == 1
    assert not results[0].ok and "did not finish within 5" in results[0].error
