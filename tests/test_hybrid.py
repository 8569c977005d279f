"""The hybrid backend (Ulysses inside groups of ``ulysses_size`` ranks, all-gather across them) equals full causal
attention per segment, forward and backward (``tests/test_allgather_attention.compare``: a dense float64 reference
on the global stream, independent of the kernels)."""

from __future__ import annotations

import pytest
import torch

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.attention import context_parallel_attention
from cp_packing.testing import run_distributed, synthetic_doc_ids
from tests.test_allgather_attention import D, compare
from tests.test_ulysses import TIMEOUT, TOL, _zigzag_map


def _dist_hybrid(rank, world_size):
    maps = {
        "contiguous": synthetic_doc_ids("lognormal", 2, 12 * world_size, seed=3, median=8, pad=0.1),
        "zigzag": _zigzag_map(world_size, seed=3),
        "balanced": synthetic_doc_ids("lognormal", 2, 12 * world_size, seed=8, median=20, pad=0.1),
    }
    heads = {"H_kv == U": (4, 2), "H_kv < U (replicated)": (4, 1), "H_kv > U": (8, 4)}
    errs = {}
    for layout, doc_ids in maps.items():
        for i, (name, (H, H_kv)) in enumerate(heads.items()):
            errs[f"U=2 {layout} {name}"] = compare(doc_ids, layout, world_size, rank, H=H, H_kv=H_kv, seed=i,
                                                   backend="hybrid", ulysses_size=2)
    for U in {1, world_size}:  # the two ends: all-gather only, Ulysses only
        errs[f"U={U} zigzag"] = compare(maps["zigzag"], "zigzag", world_size, rank, H=4, H_kv=1, backend="hybrid",
                                        ulysses_size=U)
    errs["U=2 zigzag causal=False"] = compare(maps["zigzag"], "zigzag", world_size, rank, H=2, H_kv=2,
                                              causal=False, backend="hybrid", ulysses_size=2)
    return errs


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_hybrid_matches_full_attention(cp_size):
    for rank, errs in enumerate(run_distributed(_dist_hybrid, cp_size, timeout=TIMEOUT)):
        for name, e in errs.items():
            assert max(e.values()) < TOL, f"cp={cp_size} rank {rank} {name}: {e}"


def _dist_bad_size(rank, world_size, sizes, heads):
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 5 + [2] * 7 + [3] * 4]))
    sharded = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout="contiguous")
    q = torch.randn(sharded.num_local_tokens, heads, D)
    kv = torch.randn(sharded.num_local_tokens, 1, D)
    try:
        out = context_parallel_attention(q, kv, kv, sharded, backend="hybrid", ulysses_size=sizes[rank])
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return "ok", tuple(out.shape)


@pytest.mark.distributed
@pytest.mark.parametrize("sizes, heads, kind, words", [
    ((3, 3, 3, 3), 4, "ValueError", "ulysses_size=3 must divide cp_size=4"),
    ((3, 2, 2, 2), 4, "ValueError", "ulysses_size=3 must divide cp_size=4"),  # one rank's mistake, raised everywhere
    ((2, 4, 2, 2), 4, "AgreementError", "disagree on ulysses_size"),
    ((2, 2, 2, 2), 3, "ValueError", "ulysses_size=2 does not divide the 3 query heads; use backend='allgather'"),
])
def test_bad_ulysses_size_is_refused_on_every_rank(sizes, heads, kind, words):
    results = run_distributed(_dist_bad_size, 4, sizes, heads, timeout=TIMEOUT)
    assert [r[0] for r in results] == [kind] * 4, results
    assert all(words in r[1] for r in results), results


def test_ulysses_size_goes_with_backend_hybrid_only():
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 8 + [2] * 8]))
    s = shard_packed_seq_params(params, cp_size=1, cp_rank=0)
    q = torch.randn(16, 2, D)
    with pytest.raises(ValueError, match="goes with backend='hybrid'"):
        context_parallel_attention(q, q, q, s, backend="ulysses", ulysses_size=1)
    with pytest.raises(ValueError, match="goes with backend='hybrid'"):
        context_parallel_attention(q, q, q, s, backend="hybrid")


def _dist_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp_rank = mesh.get_local_rank("cp")
    doc_ids = synthetic_doc_ids("lognormal", 2, 24, seed=5 + mesh.get_local_rank("dp"), median=8, pad=0.1)
    return {U: compare(doc_ids, "balanced", 2, cp_rank, H=4, H_kv=1, group=mesh["cp"], backend="hybrid",
                       ulysses_size=U)
            for U in (1, 2)}


@pytest.mark.distributed
def test_hybrid_on_the_cp_dimension_of_a_dp_x_cp_mesh():
    """The sub-groups are built from the CP group's own ranks (global ranks 2 and 3 form the second CP group)."""
    for rank, errs in enumerate(run_distributed(_dist_mesh, 4, timeout=TIMEOUT)):
        for U, e in errs.items():
            assert max(e.values()) < TOL, f"rank {rank} U={U}: {e}"
