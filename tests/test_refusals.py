"""Nonsense that was accepted, and errors that named neither the value nor the fix (issue 26): each is refused at
the call with a one-line TypeError / ValueError naming the value and what to pass instead."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cp_packing import AttentionOptions, choose_layout, layout_cost, packed_seq_params_from_doc_ids
from cp_packing._checks import MAX_SOFTMAX_SCALE, check_softmax_scale, check_window
from cp_packing.layouts import expand_runs


@pytest.mark.parametrize("scale", [math.inf, -math.inf, 1e300, 0.0, -0.125, 10 * MAX_SOFTMAX_SCALE])
def test_a_softmax_scale_that_overflows_the_scores_is_refused(scale):
    """``softmax_scale=inf`` or ``1e300`` gave NaN outputs silently: refused, naming the value and the default."""
    with pytest.raises(ValueError, match=_scale_refused(scale)):
        check_softmax_scale(scale)


def _scale_refused(scale: float) -> str:
    return (rf"softmax_scale must be a finite number in \(0, 1e\+06\].*got {re.escape(repr(scale))}; .*or None for "
            r"1/sqrt\(head_dim\)")


@pytest.mark.xfail(strict=True, reason="the lead wires check_softmax_scale into attention/plan.py and options.py")
@pytest.mark.parametrize("where", ["call", "options"])
def test_attention_refuses_an_infinite_softmax_scale_on_the_call_and_in_the_options(where):
    from cp_packing.attention import context_parallel_attention, prepare_attention
    from cp_packing.sharding import shard_packed_seq_params

    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2]]))
    shard = shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="contiguous")
    q = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match=_scale_refused(math.inf)):
        if where == "options":
            AttentionOptions(scale=math.inf)
        else:
            context_parallel_attention(q, q, q, prepare_attention(shard), softmax_scale=math.inf)


def test_a_real_softmax_scale_passes_and_overflows_nothing():
    """What passes is a float, and the largest passing scale times unit-sized bf16 q.k stays finite in float32
    (the reference: torch's own softmax)."""
    assert check_softmax_scale(None) is None and check_softmax_scale(1) == 1.0
    assert check_softmax_scale(1 / math.sqrt(128)) == 1 / math.sqrt(128)
    q = torch.ones(4, 64, dtype=torch.bfloat16)
    scores = check_softmax_scale(MAX_SOFTMAX_SCALE) * (q.float() @ q.float().T)
    assert torch.isfinite(torch.softmax(scores, -1)).all()
    with pytest.raises(TypeError, match="softmax_scale must be a number, got 'x'"):
        check_softmax_scale("x")


def test_a_window_beyond_int32_is_refused_at_every_entry():
    """``window=2**70`` gave ``OverflowError: Python int too large to convert to C long`` deep in the cost model;
    refused in ``check_window`` (every entry reads it), naming the value and None."""
    params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 2, 2]]))
    calls = [lambda: check_window(2**70),
             lambda: layout_cost(params, cp_size=2, layout="contiguous", window=2**70),
             lambda: layout_cost(params, cp_size=2, layout="contiguous", window=[2**70, None]),
             lambda: choose_layout(params, cp_size=2, window=2**70),
             lambda: AttentionOptions(window=2**70)]
    for call in calls:
        with pytest.raises(ValueError, match=r"window(\[0\])? must be <= 2147483647, got 1180591620717411303424;"
                                             r".*or None for full attention"):
            call()
    assert check_window(2**31 - 1) == 2**31 - 1  # int32 cu_seqlens index at most this many tokens


@pytest.mark.parametrize("starts,lens,total,got", [([0, 10], [3, 3], 4, 6), ([0, 10], [3, 3], 7, 6),
                                                   ([0, 10], [3, -1], 2, 2)])
def test_expand_runs_refuses_runs_that_do_not_tile_the_output(starts, lens, total, got):
    """``expand_runs([0, 10], [3, 3], total=4)`` returned ``[0, 1, 2, 10]`` (the second run cut short, silently)."""
    with pytest.raises(ValueError, match=rf"must be >= 0 and sum to total={total} .* got sum {got}; pass "
                                         r"total=int\(run_len.sum\(\)\)"):
        expand_runs(torch.tensor(starts), torch.tensor(lens), total)


def test_expand_runs_still_lays_out_runs_that_tile_the_output():
    starts, lens = torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3])
    reference = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])
    assert expand_runs(starts, lens, int(lens.sum())).tolist() == reference.tolist() == [5, 6, 9, 10, 11]
