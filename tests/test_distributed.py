"""cp_packing.distributed on real gloo groups of 2, 3 and 4 processes (also under torchrun --nproc-per-node N).

What a user relies on: the scatter-from-source path gives every rank exactly what local sharding gives (every field
of ShardedPackedSeqParams, every batch tensor, bit for bit), in any CP group of a DP x CP mesh, from any source rank;
each rank receives only its own tokens; and every error is raised on every rank (a rank left waiting in a
collective would hang the job: run_distributed's timeout turns a hang into a failure).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from cp_packing.distributed import (
    HEADER_LEN,
    distribute_batch,
    distribute_packed_seq_params,
    src_message_bytes,
)
from cp_packing.groups import device_for_backend, resolve_group
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids
from cp_packing.sharding import ShardedPackedSeqParams, shard_packed_seq_params
from cp_packing.testing import run_distributed, under_torchrun

pytestmark = pytest.mark.distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------------------------
# Helpers (run inside the ranks; every rank builds the same data from the same seed)


def _doc_map(B: int, S: int, *, multiple: int = 1, seed: int = 0, dtype=torch.int64, pad_row=None) -> torch.Tensor:
    """Seeded ``[B, S]`` map; every run (padding too) has a length that is a multiple of ``multiple``."""
    assert S % multiple == 0
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        pos, doc = 0, 1
        while pos < S:
            length = min(int(torch.randint(1, 4, (), generator=g)) * multiple, S - pos)
            if int(torch.randint(0, 5, (), generator=g)):  # 1 in 5 runs is padding
                out[b, pos : pos + length] = doc
                doc += 1
            pos += length
    if pad_row is not None:
        out[pad_row] = 0
    return out.to(dtype)


def _batch(doc_ids: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Per-token tensors of mixed dtypes and trailing shapes (the scatter packs them into one byte buffer)."""
    g = torch.Generator().manual_seed(1000 + seed)
    B, S = doc_ids.shape
    return {
        "input_ids": torch.randint(0, 32000, (B, S), generator=g),
        "labels": torch.randint(-100, 32000, (B, S), generator=g),
        "embeds": torch.randn(B, S, 3, generator=g),  # float32 [B, S, 3]
        "mask": torch.rand(B, S, generator=g) > 0.5,  # bool
        "half": torch.randn(B, S, 2, 2, generator=g).to(torch.float16),
        "doc_ids": doc_ids,
    }


def _device() -> torch.device:
    return device_for_backend(str(dist.get_backend()))


def _assert_sharded_equal(got: ShardedPackedSeqParams, want: ShardedPackedSeqParams) -> None:
    for f in dataclasses.fields(ShardedPackedSeqParams):
        if f.name == "_cache":
            continue
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), f.name
        elif isinstance(b, PackedSeqParams):
            assert a.max_seqlen == b.max_seqlen
            for name in ("cu_seqlens", "doc_ids"):
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu()), name
        else:
            assert a == b, (f.name, a, b)


def _assert_batch_equal(got: dict, sharded: ShardedPackedSeqParams, batch: dict) -> None:
    want = {k: sharded.shard(v).unsqueeze(0) for k, v in batch.items()}
    if "position_ids" not in want:
        want["position_ids"] = sharded.position_ids.unsqueeze(0)
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].shape[:2] == (1, sharded.num_local_tokens), k
        assert torch.equal(got[k].cpu(), v.cpu()), k


def _cases(world: int):
    """(layout, doc_ids, src): contiguous and zigzag maps, several sources, a padding-only rank."""
    cases = []
    for i, dtype in enumerate((torch.int64, torch.int32, torch.uint8)):
        cases.append(("contiguous", _doc_map(3, 4 * world, seed=i, dtype=dtype), i % world))
        cases.append(("zigzag", _doc_map(2, 6 * world, multiple=2 * world, seed=10 + i, dtype=dtype), (i + 1) % world))
    cases.append(("contiguous", _doc_map(2, 4 * world, seed=5, pad_row=1), world - 1))  # the last ranks: padding only
    cases.append(("zigzag", _doc_map(2, 4 * world, multiple=2 * world, seed=6, pad_row=0), 0))
    return cases


# ----------------------------------------------------------------------------------------------------------------
# Scatter from a source == local sharding


def _scatter_equals_local(rank: int, world: int) -> int:
    checked = 0
    for layout, doc_ids, src in _cases(world):
        params = packed_seq_params_from_doc_ids(doc_ids)
        want = shard_packed_seq_params(params, cp_size=world, cp_rank=rank, layout=layout)
        batch = _batch(doc_ids, checked)

        got = distribute_packed_seq_params(params if rank == src else None, src=src, layout=layout)
        _assert_sharded_equal(got, want)
        assert got.token_index.device == _device()

        local, got = distribute_batch(batch if rank == src else None, src=src, layout=layout)
        _assert_sharded_equal(got, want)
        _assert_batch_equal(local, want, batch)
        assert all(t.device == _device() for t in local.values())

        # params passed explicitly, no doc_ids in the batch: position_ids comes from the shard
        small = {"input_ids": batch["input_ids"]}
        local, got = distribute_batch(small if rank == src else None, params if rank == src else None, src=src,
                                      layout=layout, check_consistent=True)
        _assert_sharded_equal(got, want)
        _assert_batch_equal(local, want, small)
        assert local["position_ids"].dtype == torch.int64

        # every rank holds the batch: local path, with and without the consistency check
        for check in (False, True):
            _assert_sharded_equal(
                distribute_packed_seq_params(params, layout=layout, check_consistent=check), want)
            local, got = distribute_batch(batch, layout=layout, check_consistent=check)
            _assert_sharded_equal(got, want)
            _assert_batch_equal(local, want, batch)
        checked += 1

    # an empty batch dict with explicit params: only the metadata travels
    doc_ids = _doc_map(1, 2 * world, seed=3)
    params = packed_seq_params_from_doc_ids(doc_ids)
    local, got = distribute_batch({} if rank == 0 else None, params if rank == 0 else None, src=0,
                                  layout="contiguous")
    want = shard_packed_seq_params(params, cp_size=world, cp_rank=rank, layout="contiguous")
    _assert_sharded_equal(got, want)
    assert list(local) == ["position_ids"] and torch.equal(local["position_ids"][0].cpu(), want.position_ids)
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_scatter_from_src_equals_local_sharding(world):
    results = run_distributed(_scatter_equals_local, world)
    assert all(n == len(_cases(world)) for n in results)


def _padding_rank(rank: int, world: int) -> list:
    """Rank 1 of 2 holds only padding (contiguous): it joins every collective and gets a valid shard."""
    doc_ids = torch.tensor([[1, 1, 2, 2, 2, 3, 3, 3], [0, 0, 0, 0, 0, 0, 0, 0]])
    batch = {"input_ids": torch.arange(16).view(2, 8), "doc_ids": doc_ids}
    local, sharded = distribute_batch(batch if rank == 0 else None, src=0, layout="contiguous")
    return [sharded.doc_ids.tolist(), local["input_ids"].tolist(), local["position_ids"].tolist(),
            sharded.cu_seqlens.tolist()]


def test_all_padding_rank_gets_its_shard():
    results = run_distributed(_padding_rank, 2)
    expected = [  # worked by hand: contiguous halves of the flat stream
        [[1, 1, 2, 2, 2, 3, 3, 3], [list(range(8))], [[0, 1, 0, 1, 2, 0, 1, 2]], [0, 2, 5, 8]],
        [[0] * 8, [list(range(8, 16))], [list(range(8))], [0, 8]],
    ]
    if under_torchrun():
        expected = [expected[dist.get_rank()]]
    assert results == expected


# ----------------------------------------------------------------------------------------------------------------
# DP x CP mesh: each CP group gets its own batch from its own source


def _mesh(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(_device().type, (2, 2), mesh_dim_names=("dp", "cp"))
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    src = 1 - dp_rank  # group rank 1 in DP group 0 (global 1), group rank 0 in DP group 1 (global 2)
    doc_ids = _doc_map(2, 8, multiple=4, seed=100 + dp_rank)  # each DP group its own batch
    params = packed_seq_params_from_doc_ids(doc_ids)
    batch = _batch(doc_ids, dp_rank)
    want = shard_packed_seq_params(params, cp_size=2, cp_rank=cp_rank, layout="zigzag")

    cp = resolve_group(mesh["cp"])
    assert (cp.rank, cp.size) == (cp_rank, 2)
    assert cp.global_rank(src) == 2 * dp_rank + src

    for group in (mesh["cp"], mesh["cp"].get_group()):
        local, got = distribute_batch(batch if cp_rank == src else None, group=group, src=src,
                                      check_consistent=True)
        _assert_sharded_equal(got, want)
        _assert_batch_equal(local, want, batch)
        got = distribute_packed_seq_params(params, group=group, check_consistent=True)
        _assert_sharded_equal(got, want)

    with pytest.raises(ValueError, match=r"2-D DeviceMesh.*mesh\['cp'\]"):
        distribute_batch(batch, group=mesh)
    # the DP groups hold different batches: a consistency check over the DP group (the wrong group) catches it
    with pytest.raises(ValueError, match=r"group rank\(s\) \[1\]"):
        distribute_packed_seq_params(params, group=mesh["dp"], check_consistent=True)
    return [dp_rank, cp_rank, got.token_index.tolist()]


def test_dp_cp_mesh_each_group_from_its_own_source():
    results = run_distributed(_mesh, 4)
    if not under_torchrun():
        assert [r[:2] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        # within a CP group the two ranks' tokens partition the batch
        for g in (0, 2):
            assert sorted(results[g][2] + results[g + 1][2]) == list(range(16))


# ----------------------------------------------------------------------------------------------------------------
# check_consistent


def _catch(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError) as exc:
        return [type(exc).__name__, str(exc)]
    return None


def _consistency(rank: int, world: int) -> list:
    doc_ids = _doc_map(2, 12, seed=1 if rank != 1 else 2)  # rank 1 loaded another batch
    params = packed_seq_params_from_doc_ids(doc_ids)
    out = [_catch(distribute_packed_seq_params, params, layout="contiguous", check_consistent=True)]
    same = _doc_map(2, 12, seed=1)
    batch = _batch(same, 0)
    if rank == 2:
        batch["labels"] = batch["labels"].clone()
        batch["labels"][1, 3] += 1  # one label differs on rank 2
    out.append(_catch(distribute_batch, batch, layout="contiguous", check_consistent=True))
    # equal batches pass (and the differing tensor was the only problem), whatever each rank's dict key order
    batch["labels"] = _batch(same, 0)["labels"]
    if rank == 2:
        batch = dict(reversed(list(batch.items())))
    out.append(_catch(distribute_batch, batch, layout="contiguous", check_consistent=True))
    # the src path: ranks that disagree on src all raise instead of hanging
    out.append(_catch(distribute_batch, batch, src=0 if rank != 2 else 1, layout="contiguous",
                      check_consistent=True))
    # one rank's own input fails to shard: it raises its error, the others learn that it failed
    bad = {"input_ids": torch.zeros(2, 13 if rank == 0 else 12, dtype=torch.int64)}
    out.append(_catch(distribute_batch, bad, params, layout="contiguous", check_consistent=True))
    return out


def test_check_consistent_names_the_differing_rank_on_every_rank():
    results = run_distributed(_consistency, 3, timeout=120)
    for rank_result in results:
        params_err, batch_err, ok, src_err, shape_err = rank_result
        assert params_err[0] == "ValueError"
        assert "group rank(s) [1]" in params_err[1] and "cu_seqlens / doc_ids checksum" in params_err[1]
        assert batch_err[0] == "ValueError"
        assert "group rank(s) [2]" in batch_err[1] and "batch tensor checksum" in batch_err[1]
        assert "cu_seqlens" not in batch_err[1]
        assert ok is None
        assert src_err[0] == "ValueError" and "group rank(s) [2]" in src_err[1] and "src" in src_err[1]
        assert shape_err[0] == "ValueError"
    if not under_torchrun():
        assert "batch['input_ids'] has shape (2, 13)" in results[0][4][1]
        assert all("group rank(s) [0]" in r[4][1] and "could not shard" in r[4][1] for r in results[1:])


# ----------------------------------------------------------------------------------------------------------------
# Errors: raised on every rank, never a hang


def _errors(rank: int, world: int) -> list:
    doc_ids = _doc_map(2, 8, seed=0)
    params = packed_seq_params_from_doc_ids(doc_ids)
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.int64), "doc_ids": doc_ids}
    mine = rank == 0
    out = [
        _catch(distribute_batch, batch, src=world),  # outside the group
        _catch(distribute_packed_seq_params, params, src=-1),
        _catch(distribute_packed_seq_params, params, src="0"),
        _catch(distribute_packed_seq_params, params, layout="diagonal"),
        _catch(distribute_batch, batch, group="cp"),
        # only the source sees these: shipped in the header, raised everywhere
        _catch(distribute_batch, {**batch, "labels": torch.zeros(2, 9)} if mine else None, src=0),
        _catch(distribute_batch, {"input_ids": batch["input_ids"]} if mine else None, src=0),
        _catch(distribute_packed_seq_params, None, src=0),
        _catch(distribute_packed_seq_params, params if mine else None, src=0, layout="zigzag"),  # odd segments
        _catch(distribute_batch, {"x": torch.zeros(2, 7)} if mine else None, params if mine else None, src=0,
               layout="contiguous"),
    ]
    # ranks that make different calls (no check_consistent): the others raise, the source is not left waiting in
    # its scatter (it returns normally, having no way to know)
    if mine:
        out.append(_catch(distribute_batch, batch, src=0, layout="contiguous"))
        out.append(_catch(distribute_packed_seq_params, params, src=0, layout="contiguous"))
    else:
        out.append(_catch(distribute_packed_seq_params, None, src=0, layout="contiguous"))
        out.append(_catch(distribute_batch, None, src=0, layout="contiguous"))
    # the group is still usable afterwards (no half-finished protocol left behind)
    local, sharded = distribute_batch(batch if mine else None, src=0, layout="contiguous")
    want = shard_packed_seq_params(params, cp_size=world, cp_rank=rank, layout="contiguous")
    _assert_sharded_equal(sharded, want)
    _assert_batch_equal(local, want, batch)
    # a process outside the group it passes
    only_0 = dist.new_group([0])
    out.append(_catch(distribute_packed_seq_params, params, group=only_0) if rank != 0 else None)
    return out


def test_errors_are_raised_on_every_rank():
    results = run_distributed(_errors, 2, timeout=90)
    for rank, r in enumerate(results):
        assert r[0][0] == "ValueError" and "src=2 is outside the CP group" in r[0][1] and "GROUP rank" in r[0][1]
        assert r[1][0] == "ValueError" and "src=-1" in r[1][1]
        assert r[2][0] == "TypeError" and "src must be an int" in r[2][1]
        assert r[3][0] == "ValueError" and "'diagonal'" in r[3][1]
        assert r[4][0] == "TypeError" and "ProcessGroup" in r[4][1]
        assert r[5][0] == "ValueError" and "batch['labels'] has shape (2, 9)" in r[5][1] and "[2, 8, ...]" in r[5][1]
        assert "raised on the source, group rank 0" in r[5][1]
        assert r[6][0] == "ValueError" and "batch['doc_ids']" in r[6][1]
        assert r[7][0] == "TypeError" and "params must be PackedSeqParams" in r[7][1]
        assert r[8][0] == "ValueError" and "not divisible by 2*cp_size=4" in r[8][1]
        assert r[9][0] == "ValueError" and "batch['x'] has shape (2, 7)" in r[9][1]
    assert results[0][10] is None and results[0][11] is None  # the source
    for r in results[1:]:
        assert r[10][0] == "ValueError" and "called distribute_batch while this rank called distribute_packed" in r[10][1]
        assert r[11][0] == "ValueError" and "called distribute_packed_seq_params while this rank called distribute_batch" in r[11][1]
    if not under_torchrun():
        assert results[0][12] is None
        assert results[1][12][0] == "ValueError" and "not a member" in results[1][12][1]
        # the source and the receivers read the same message
        assert results[0][5] == results[1][5] and results[0][8] == results[1][8]


# ----------------------------------------------------------------------------------------------------------------
# Local pieces: device choice, byte accounting, no process group


def test_device_follows_backend():
    assert device_for_backend("gloo") == torch.device("cpu")
    if torch.cuda.is_available():
        assert device_for_backend("nccl").type == "cuda"
        assert device_for_backend("cpu:gloo,cuda:nccl").type == "cuda"
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            device_for_backend("nccl")


@pytest.mark.skipif(under_torchrun(), reason="torchrun initialises the default group")
def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="not initialized"):
        distribute_packed_seq_params(packed_seq_params_from_doc_ids(torch.ones(1, 4, dtype=torch.int64)))


def test_src_message_bytes_counts_only_the_ranks_tokens():
    doc_ids = _doc_map(4, 64, multiple=8, seed=7)
    params = packed_seq_params_from_doc_ids(doc_ids)
    batch = {"input_ids": torch.zeros(4, 64, dtype=torch.int64), "mask": torch.zeros(4, 64, 3, dtype=torch.bool)}
    for cp_size in (2, 4):
        sizes = src_message_bytes(params, batch, cp_size=cp_size, layout="zigzag")
        T_local = 4 * 64 // cp_size
        assert sizes["header"] == 8 * HEADER_LEN
        assert sizes["tokens"] == T_local * (8 + 3)
        assert 8 * (2 * params.num_segments + 1) < sizes["metadata"] <= 8 * (2 * params.num_segments + 1) + 512
        assert sizes["total"] == sizes["header"] + sizes["metadata"] + sizes["tokens"]
    only_params = src_message_bytes(params, None, cp_size=2)
    assert only_params["tokens"] == 0 and only_params["metadata"] == 8 * (2 * params.num_segments + 1)


@pytest.mark.skipif(under_torchrun(), reason="spawns its own process groups")
def test_bench_distribute_quick_runs():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_distribute.py"), "--quick"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scatter" in proc.stdout and "broadcast" in proc.stdout
