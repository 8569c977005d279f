"""The layouts package: the registry, and the properties every layout promises (an exact partition with T/cp tokens
per rank, runs inside one segment), checked against a plain per-token reference."""

from __future__ import annotations

import doctest
import importlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cp_packing.layouts import (
    LAYOUTS,
    PLANS,
    check_layout,
    check_zigzag_divisible,
    expand_runs,
    global_token_order,
    layout_plan,
    layout_runs,
    layout_token_index,
)
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.padding import pad_segments
from tests.maps import doc_maps, segments_of

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def maps_for_every_layout(draw):
    """A map every layout takes: rows padded to a multiple of cp, every segment a multiple of 2cp."""
    cp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    doc_ids = pad_segments(draw(doc_maps(max_b=3, max_s=40)), multiple=2 * cp).doc_ids
    return doc_ids, cp


def test_registry_names_one_all_ranks_plan_and_its_per_rank_slice_per_layout():
    assert LAYOUTS == ("contiguous", "zigzag", "balanced", "local") == tuple(PLANS)
    assert [fn.__module__ for fn in PLANS.values()] == [f"cp_packing.layouts.{name}" for name in LAYOUTS]
    cu = torch.tensor([0, 8, 16, 24, 32])
    for name in LAYOUTS:  # the per-rank runs are slices of the all-ranks plan
        plan = layout_plan(cu, cp_size=2, layout=name)
        for r in range(2):
            start, length = layout_runs(cu, cp_size=2, cp_rank=r, layout=name)
            assert start.tolist() == plan.runs(r)[0].tolist() and length.tolist() == plan.runs(r)[1].tolist()


@SETTINGS
@given(maps_for_every_layout())
def test_every_layout_is_an_exact_partition_of_runs_inside_segments(case):
    doc_ids, cp = case
    cu = packed_seq_params_from_doc_ids(doc_ids).cu_seqlens
    T = doc_ids.numel()
    seg_of = torch.empty(T, dtype=torch.int64)
    for k, (a, b) in enumerate(segments_of(doc_ids)):
        seg_of[a:b] = k
    for layout in LAYOUTS:
        order = global_token_order(cu, cp_size=cp, layout=layout)
        assert order.shape == (cp, T // cp)
        assert torch.equal(order.reshape(-1).sort().values, torch.arange(T))  # every token on exactly one rank
        for r in range(cp):
            run_start, run_len = layout_runs(cu, cp_size=cp, cp_rank=r, layout=layout)
            assert run_start.dtype == run_len.dtype == torch.int64
            for a, n in zip(run_start.tolist(), run_len.tolist()):
                assert n == 0 or seg_of[a] == seg_of[a + n - 1]  # a run never crosses a segment boundary
            assert torch.equal(expand_runs(run_start, run_len, T // cp), order[r])
            assert torch.equal(layout_token_index(cu, cp_size=cp, cp_rank=r, layout=layout), order[r])


def test_contiguous_and_zigzag_by_hand():
    cu = torch.tensor([0, 8])
    assert global_token_order(cu, cp_size=2, layout="contiguous").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert global_token_order(cu, cp_size=2, layout="zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # the last rank's two chunks touch: one run
    assert [t.tolist() for t in layout_runs(cu, cp_size=2, cp_rank=1, layout="zigzag")] == [[2], [4]]


def test_expand_runs_skips_empty_runs():
    assert expand_runs(torch.tensor([3, 9, 0]), torch.tensor([2, 0, 1]), 3).tolist() == [3, 4, 0]


def test_layout_errors_name_the_value_and_the_fix():
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown layout 'stripe'; choose one of 'contiguous', 'zigzag', 'balanced'"):
        check_layout("stripe")
    with pytest.raises(ValueError, match=r"T = B\*S = 6 tokens, not divisible by cp_size=4"):
        layout_runs(cu, cp_size=4, cp_rank=0, layout="contiguous")
    with pytest.raises(ValueError, match=r"segment 0 \(positions 0\.\.2\) has length 3, not divisible by 2\*cp_size=4"):
        check_zigzag_divisible(cu, 2)
    with pytest.raises(ValueError, match="pad_segments"):
        layout_runs(cu, cp_size=2, cp_rank=0, layout="zigzag")
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        layout_runs([0, 3, 6], cp_size=2, cp_rank=0, layout="contiguous")
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, cp_size=2\)"):
        layout_runs(cu, cp_size=2, cp_rank=2, layout="balanced")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_and_dtype_of_the_runs_follow_cu_seqlens(layout):
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    run_start, run_len = layout_runs(cu, cp_size=2, cp_rank=0, layout=layout)
    assert run_start.device == cu.device and run_start.dtype == torch.int64 and int(run_len.sum()) == 8
    assert math.prod(global_token_order(cu, cp_size=2, layout=layout).shape) == 16


@pytest.mark.parametrize("module", ["layouts", "layouts.contiguous", "layouts.zigzag", "layouts.balanced"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"cp_packing.{module}")
    result = doctest.testmod(mod, extraglobs={"torch": torch})
    assert result.failed == 0 and result.attempted > 0
