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
import time

import pytest
import torch
import torch.distributed as dist

from cp_packing.agreement import AgreementError
from cp_packing.distributed import distribute_batch, distribute_packed_seq_params
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
    cases.append(("balanced", _doc_map(2, 8 * world, seed=7), world - 1))
    cases.append(("auto", _doc_map(2, 6 * world, multiple=2 * world, seed=8), 0))  # resolved once, on the source
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

        if layout == "auto":  # the default layout: works on any batch, and every path resolves it alike
            _assert_sharded_equal(distribute_packed_seq_params(params), want)
            _assert_sharded_equal(distribute_packed_seq_params(params if rank == src else None, src=src), want)
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
        local, got = distribute_batch(batch if cp_rank == src else None, group=group, src=src, layout="zigzag",
                                      check_consistent=True)
        _assert_sharded_equal(got, want)
        _assert_batch_equal(local, want, batch)
        got = distribute_packed_seq_params(params, group=group, layout="zigzag", check_consistent=True)
        _assert_sharded_equal(got, want)

    with pytest.raises(ValueError, match=r"2-D DeviceMesh.*mesh\['cp'\]"):
        distribute_batch(batch, group=mesh)
    # the DP groups hold different batches: a consistency check over the DP group (the wrong group) catches it
    with pytest.raises(AgreementError, match=r"disagree on doc map .*rank 1"):
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
    # the same rows in another order, and a +1/-2/+1 change: a linear checksum misses both, the digest does not
    swapped = same.flip(0) if rank == 1 else same
    out.append(_catch(distribute_packed_seq_params, packed_seq_params_from_doc_ids(swapped), layout="contiguous",
                      check_consistent=True))
    ids = batch["input_ids"].clone()
    if rank == 1:
        ids[0, :3] += torch.tensor([1, -2, 1])
    out.append(_catch(distribute_batch, {**batch, "input_ids": ids}, layout="contiguous", check_consistent=True))
    # one rank's own input fails to shard: every rank raises its error, naming it
    bad = {"input_ids": torch.zeros(2, 13 if rank == 0 else 12, dtype=torch.int64)}
    out.append(_catch(distribute_batch, bad, params, layout="contiguous", check_consistent=True))
    return out


def test_check_consistent_names_the_difference_on_every_rank():
    results = run_distributed(_consistency, 3, timeout=120)
    for params_err, batch_err, ok, swapped_err, linear_err, shape_err in results:
        assert params_err[0] == "AgreementError" and "disagree on doc map" in params_err[1]
        assert "rank 1:" in params_err[1] and "ranks 0, 2:" in params_err[1]
        assert batch_err[0] == "AgreementError" and "batch['labels'] differs" in batch_err[1]
        assert "rank(s) [2]" in batch_err[1] and "doc map" not in batch_err[1]
        assert ok is None
        assert swapped_err[0] == "AgreementError" and "doc map" in swapped_err[1]
        assert linear_err[0] == "AgreementError" and "batch['input_ids'] differs" in linear_err[1]
        assert shape_err[0] == "ValueError" and "batch['input_ids'] has shape (2, 13)" in shape_err[1]
        assert "CP group rank 0" in shape_err[1]
    assert all(r == results[0] for r in results)  # every rank raised the very same errors


def _window_plans(rank: int, world: int) -> list:
    """The window reaches the plan on both paths (a list on one rank, a tuple on another: the same windows), and
    ranks that pass different windows, or a bad one, fail together."""
    doc_ids = _doc_map(2, 96 * world, seed=3)
    params = packed_seq_params_from_doc_ids(doc_ids)
    window = [4, None] if rank == 0 else (4, None)
    want = shard_packed_seq_params(params, cp_size=world, cp_rank=rank, layout="balanced", window=window)
    assert want.plan_window == (4, None)
    _assert_sharded_equal(distribute_packed_seq_params(params, layout="balanced", window=window), want)
    local, got = distribute_batch(_batch(doc_ids, 0) if rank == 0 else None, src=0, layout="balanced", window=window)
    _assert_sharded_equal(got, want)
    _assert_batch_equal(local, want, _batch(doc_ids, 0))
    return [_catch(distribute_packed_seq_params, params, layout="balanced", window=8 if rank == 1 else 4),
            _catch(distribute_batch, _batch(doc_ids, 0), layout="auto", window=0 if rank == 1 else 4)]


def test_window_is_planned_alike_and_agreed_on_every_rank():
    for disagree, bad in run_distributed(_window_plans, 2, timeout=120):
        assert disagree[0] == "AgreementError" and "disagree on window" in disagree[1]
        assert bad[0] == "ValueError" and "window must be >= 1, got 0" in bad[1] and "CP group rank 1" in bad[1]


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
        # only the source sees these: raised on every rank through the agreement
        _catch(distribute_batch, {**batch, "labels": torch.zeros(2, 9)} if mine else None, src=0),
        _catch(distribute_batch, {"input_ids": batch["input_ids"]} if mine else None, src=0),
        _catch(distribute_packed_seq_params, None, src=0),
        _catch(distribute_packed_seq_params, params if mine else None, src=0, layout="zigzag"),  # odd segments
        _catch(distribute_batch, {"x": torch.zeros(2, 7)} if mine else None, params if mine else None, src=0,
               layout="contiguous"),
        _catch(distribute_packed_seq_params, None, check_consistent=1),
    ]
    # ranks that make different calls: every rank raises (the source too), none waits in a scatter
    if mine:
        out.append(_catch(distribute_batch, batch, src=0, layout="contiguous"))
    else:
        out.append(_catch(distribute_packed_seq_params, None, src=0, layout="contiguous"))
    # the group is still usable afterwards (no half-finished exchange left behind)
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
        assert "raised on CP group rank 0" in r[5][1]
        assert r[6][0] == "ValueError" and "batch['doc_ids']" in r[6][1]
        assert r[7][0] == "TypeError" and "params must be PackedSeqParams" in r[7][1]
        assert r[8][0] == "ValueError" and "not divisible by 2*cp_size=4" in r[8][1]
        assert r[9][0] == "ValueError" and "batch['x'] has shape (2, 7)" in r[9][1]
        assert r[10][0] == "TypeError" and "check_consistent must be True or False" in r[10][1]
        assert r[11][0] == "AgreementError" and "different calls" in r[11][1]
        assert "distribute_batch" in r[11][1] and "distribute_packed_seq_params" in r[11][1]
    if not under_torchrun():
        assert results[0][12] is None
        assert results[1][12][0] == "ValueError" and "not a member" in results[1][12][1]
        assert results[0][:12] == results[1][:12]  # the source and the others read the same messages


# ----------------------------------------------------------------------------------------------------------------
# Unsigned doc maps, autograd


def _unsigned(rank: int, world: int) -> list:
    checked = []
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        for layout, doc64 in (("contiguous", _doc_map(2, 4 * world, seed=20)),
                              ("zigzag", _doc_map(2, 4 * world, multiple=2 * world, seed=21))):
            want = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc64), cp_size=world, cp_rank=rank,
                                           layout=layout)  # the int64 map: the reference
            doc_ids = doc64.to(dtype)
            batch = {"doc_ids": doc_ids, "input_ids": doc64 * 7}
            local_l, got_l = distribute_batch(batch, layout=layout, check_consistent=True)
            local_s, got_s = distribute_batch(batch if rank == 0 else None, src=0, layout=layout)
            params_s = distribute_packed_seq_params(packed_seq_params_from_doc_ids(doc_ids) if rank == 0 else None,
                                                    src=0, layout=layout)
            _assert_sharded_equal(got_s, got_l)  # bit for bit, the global params' unsigned map included
            _assert_sharded_equal(params_s, got_l)
            for got, local in ((got_l, local_l), (got_s, local_s)):
                assert got.doc_ids.dtype == dtype and local["doc_ids"].dtype == dtype
                assert got.global_params.doc_ids.dtype == dtype
                assert torch.equal(got.token_index.cpu(), want.token_index)
                assert got.doc_ids.cpu().to(torch.int64).tolist() == want.doc_ids.tolist()
                assert local["doc_ids"][0].cpu().to(torch.int64).tolist() == want.doc_ids.tolist()
                assert torch.equal(local["input_ids"][0].cpu(), want.doc_ids * 7)
            checked.append(str(dtype))
    return checked


def test_unsigned_doc_maps_keep_their_dtype_on_both_paths():
    results = run_distributed(_unsigned, 2, timeout=120)
    assert all(len(r) == 8 for r in results)


def _autograd(rank: int, world: int) -> list:
    doc_ids = _doc_map(2, 4 * world, seed=30)
    embeds = torch.randn(2, 4 * world, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    local, sharded = distribute_batch({"doc_ids": doc_ids, "embeds": embeds}, layout="contiguous")
    local["embeds"].sum().backward()  # the local path keeps autograd: grad 1 exactly at this rank's tokens
    grad_ok = embeds.grad.reshape(-1, 3)[sharded.token_index].eq(1).all().item() and \
        embeds.grad.sum().item() == 3 * sharded.num_local_tokens
    err = _catch(distribute_batch, {"doc_ids": doc_ids, "embeds": embeds} if rank == 0 else None, src=0,
                 layout="contiguous")
    detached = distribute_batch({"doc_ids": doc_ids, "embeds": embeds.detach()} if rank == 0 else None, src=0,
                                layout="contiguous")[0]
    return [grad_ok, err, torch.equal(detached["embeds"], local["embeds"].detach())]


def test_autograd_kept_locally_refused_with_src():
    for grad_ok, err, same in run_distributed(_autograd, 2, timeout=90):
        assert grad_ok and same
        assert err[0] == "ValueError" and "batch['embeds'] requires grad" in err[1] and ".detach()" in err[1]


# ----------------------------------------------------------------------------------------------------------------
# Fault injection: each distributed mistake raises the same error type on EVERY rank, within the runner's timeout


def _faults(rank: int, world: int) -> dict:
    doc_ids = _doc_map(2, 6 * world, multiple=2 * world, seed=40)
    batch = _batch(doc_ids, 40)
    src_batch = batch if rank == 0 else None
    params = packed_seq_params_from_doc_ids(doc_ids)
    other = _batch(doc_ids, 41)  # another sample of the same shape
    holey = PackedSeqParams(params.cu_seqlens[:-1].clone(), params.max_seqlen, doc_ids)  # drops the last segment
    scenarios = {
        "src on one rank only": lambda: distribute_batch(batch, src=0 if rank == 0 else None),
        "src on one rank only, the others pass None": lambda: distribute_batch(src_batch, src=0 if rank == 0 else None),
        "different src values": lambda: distribute_batch(src_batch, src=0 if rank < 2 else 1),
        "check_consistent on one rank only": lambda: distribute_batch(batch, check_consistent=rank == 1),
        "check_consistent on one rank only, src path": lambda: distribute_batch(src_batch, src=0,
                                                                               check_consistent=rank == 1),
        "different layout on one rank": lambda: distribute_batch(batch, layout="zigzag" if rank else "contiguous"),
        "different layout on one rank, src path": lambda: distribute_batch(src_batch, src=0,
                                                                          layout="balanced" if rank == 2 else "auto"),
        "different batches with check_consistent": lambda: distribute_batch(other if rank == 2 else batch,
                                                                            check_consistent=True),
        "source-only: indivisible map": lambda: distribute_batch(
            {"doc_ids": torch.ones(1, 3 * world + 1, dtype=torch.int64)} if rank == 0 else None, src=0,
            layout="contiguous"),
        "source-only: float doc map": lambda: distribute_batch(
            {"doc_ids": doc_ids.float()} if rank == 0 else None, src=0),
        "source-only: tensor requires grad": lambda: distribute_batch(
            {**batch, "embeds": batch["embeds"].clone().requires_grad_()} if rank == 0 else None, src=0),
        "source-only: cu_seqlens miss tokens": lambda: distribute_packed_seq_params(holey if rank == 0 else None,
                                                                                    src=0),
        "distribute_batch vs distribute_packed_seq_params": lambda: (
            distribute_batch(src_batch, src=0) if rank != 1 else distribute_packed_seq_params(None, src=0)),
        "bad argument on one rank only": lambda: distribute_batch(batch, layout="diagonal" if rank == 1 else "auto"),
    }
    out = {}
    for name, fn in scenarios.items():
        t0 = time.perf_counter()
        err = _catch(fn)
        out[name] = (err, time.perf_counter() - t0)
    local, sharded = distribute_batch(src_batch, src=0)  # the group still works after every failure
    _assert_batch_equal(local, sharded, batch)
    return out


FAULTS = {  # scenario -> (error type on every rank, a phrase of its message)
    "src on one rank only": ("AgreementError", "disagree on src"),
    "src on one rank only, the others pass None": ("TypeError", "batch must be a dict"),
    "different src values": ("AgreementError", "disagree on src"),
    "check_consistent on one rank only": ("AgreementError", "disagree on check_consistent"),
    "check_consistent on one rank only, src path": ("AgreementError", "disagree on check_consistent"),
    "different layout on one rank": ("AgreementError", "disagree on layout"),
    "different layout on one rank, src path": ("AgreementError", "disagree on layout"),
    "different batches with check_consistent": ("AgreementError", "batch['embeds'] differs"),
    "source-only: indivisible map": ("ValueError", "divisible"),
    "source-only: float doc map": ("TypeError", "integer dtype"),
    "source-only: tensor requires grad": ("ValueError", "requires grad"),
    "source-only: cu_seqlens miss tokens": ("ValueError", "params.cu_seqlens ends at"),
    "distribute_batch vs distribute_packed_seq_params": ("AgreementError", "different calls"),
    "bad argument on one rank only": ("ValueError", "unknown layout 'diagonal'"),
}


@pytest.mark.skipif(under_torchrun(), reason="compares every rank's error in one process")
def test_fault_injection_every_rank_raises_the_same_error():
    results = run_distributed(_faults, 3, timeout=180)
    assert set(results[0]) == set(FAULTS)
    for name, (kind, phrase) in FAULTS.items():
        errors = [r[name][0] for r in results]
        assert all(e is not None for e in errors), (name, errors)
        assert {e[0] for e in errors} == {kind}, (name, errors)
        assert all(phrase in e[1] for e in errors), (name, errors)
        assert all(r[name][1] < 60 for r in results), (name, [r[name][1] for r in results])


# ----------------------------------------------------------------------------------------------------------------
# Bytes received per rank, device choice, no process group


def _bytes(rank: int, world: int) -> dict:
    from benchmarks.bench_distribute import count_received_bytes

    doc_ids = _doc_map(4, 16 * world, multiple=2 * world, seed=7)
    batch = {"input_ids": torch.zeros(4, 16 * world, dtype=torch.int64),
             "mask": torch.zeros(4, 16 * world, 3, dtype=torch.bool), "doc_ids": doc_ids}
    out = {"segments": packed_seq_params_from_doc_ids(doc_ids).num_segments}
    with count_received_bytes() as out["scatter"]:
        distribute_batch(batch if rank == 0 else None, src=0, layout="zigzag")
    with count_received_bytes() as out["local"]:
        distribute_batch(batch, layout="zigzag")
    return {k: v if isinstance(v, int) else dict(v) for k, v in out.items()}


def test_a_rank_receives_its_tokens_plus_small_metadata():
    world = 3
    results = run_distributed(_bytes, world, timeout=90)
    if under_torchrun():
        return
    T_local = 4 * 16
    for rank, r in enumerate(results):
        token_bytes = T_local * (8 + 3 + 8)  # input_ids int64, mask bool [3], doc_ids int64
        assert r["scatter"].get("scatter", 0) == (0 if rank == 0 else token_bytes)
        assert r["scatter"].get("broadcast", 0) <= (0 if rank == 0 else 32 * r["segments"] + 2048)
        assert "all_gather" not in r["scatter"]  # the agreement goes through the store, not the group
        assert r["local"] == {}  # every rank shards locally: no collective at all


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


@pytest.mark.skipif(under_torchrun(), reason="spawns its own process groups")
def test_bench_distribute_quick_runs():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_distribute.py"), "--quick", "--cps", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scatter" in proc.stdout and "broadcast" in proc.stdout and "local+check" in proc.stdout


def _different_tokens(rank, world):
    doc = torch.tensor([[1] * 8 + [2] * 8])
    ids = torch.arange(16)[None] + 100 * rank  # the same map, another batch on each rank: a DP x CP loader mistake
    try:
        distribute_batch({"input_ids": ids, "doc_ids": doc}, group=dist.group.WORLD, layout="contiguous")
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.distributed
def test_different_batches_on_one_cp_group_raise_by_default():
    results = run_distributed(_different_tokens, 2, timeout=90)
    assert all(kind == "AgreementError" and "batch['input_ids'] differs" in message for kind, message in results)
