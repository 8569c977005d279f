"""``cp_packing.clear_caches()`` empties every per-process cache of the library: each one is filled by ordinary
calls first (functools' own ``cache_info`` and the dicts' sizes are the reference), then cleared."""

from __future__ import annotations

import functools
import sys

import pytest

import cp_packing
from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.attention import hybrid, kernels, ops, plan
from cp_packing.layouts import _cached_plan, choose
from cp_packing.testing import run_distributed, synthetic_doc_ids
from tests.test_allgather_attention import compare

LRU = {"layout plans": _cached_plan, "auto layout choices": choose._cached_choice, "kernel signatures": kernels._parameter_names,
       "resolved kernels": ops._kernel, "layer specs": ops._decode}


def _sizes() -> dict[str, int]:
    out = {name: cached.cache_info().currsize for name, cached in LRU.items()}
    out["hybrid sub-groups"] = len(hybrid._GROUPS)
    out["step traces"] = len(plan._LAST_TRACE)
    return out


def test_every_library_cache_is_an_lru_cache_or_listed():
    """A new ``functools`` cache in the library must be added to ``clear_caches`` (and to ``LRU`` here)."""
    import cp_packing.hf  # noqa: F401  (every module of the library loaded)
    import cp_packing.tools.train  # noqa: F401

    found = {f for name, module in list(sys.modules.items()) if name.startswith("cp_packing")
             for f in vars(module).values() if isinstance(f, functools._lru_cache_wrapper)}
    assert found, "no functools cache found: the search is broken"
    assert found <= set(LRU.values()), sorted(f"{f.__module__}.{f.__qualname__}" for f in found - set(LRU.values()))


def _dist_fill_and_clear(rank, world_size):
    doc_ids = synthetic_doc_ids("lognormal", 2, 12 * world_size, seed=3, median=8, pad=0.1)
    params = packed_seq_params_from_doc_ids(doc_ids)
    for layout in ("contiguous", "balanced", "local", "auto"):
        shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout=layout)
    compare(doc_ids, "balanced", world_size, rank, H=2, H_kv=2, backend="hybrid", ulysses_size=1)
    kernels._parameter_names(compare)  # the flash-attn signature lookup (no flash-attn here)
    filled = _sizes()
    cp_packing.clear_caches()
    return filled, _sizes()


@pytest.mark.distributed
def test_clear_caches_empties_every_cache():
    for rank, result in enumerate(run_distributed(_dist_fill_and_clear, 2, timeout=120)):
        filled, cleared = result
        assert all(filled.values()), f"rank {rank}: a cache the test did not fill: {filled}"
        assert not any(cleared.values()), f"rank {rank}: left after clear_caches(): {cleared}"
