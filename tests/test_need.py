"""What a rank needs from the others (cp_packing.layouts.need): the exact key set, against a per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_packing import packed_seq_params_from_doc_ids, pad_segments
from cp_packing.layouts import layout_plan
from cp_packing.layouts.need import exchange_pieces, need_tokens
from cp_packing.testing import synthetic_doc_ids


def _reference(plan, cu, causal, window):
    """Per token: every (receiver, global position) a rank's queries attend and it does not hold."""
    order = plan.token_order()
    owner = np.empty(plan.total, dtype=np.int64)
    for r in range(plan.cp_size):
        owner[order[r]] = r
    want = set()
    for r in range(plan.cp_size):
        for s, n in zip(*plan.runs(r)):
            seg = np.searchsorted(cu, s, side="right") - 1
            lo, hi = (cu[seg], s + n) if causal else (cu[seg], cu[seg + 1])
            if causal and window is not None:
                lo = max(lo, s - window + 1)
            want |= {(r, t) for t in range(lo, hi) if owner[t] != r}
    return want, owner, order


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("kind", ["lognormal", "short", "huge", "padded"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_pieces_are_exactly_the_keys_each_rank_needs_and_name_their_owner_rows(layout, kind, cp):
    doc_ids = synthetic_doc_ids(kind, batch=2, seqlen=48 * cp, seed=cp)
    if layout == "zigzag":
        doc_ids = pad_segments(doc_ids, multiple=2 * cp).doc_ids
    params = packed_seq_params_from_doc_ids(doc_ids)
    cu = params.cu_seqlens.long().numpy()
    plan = layout_plan(params.cu_seqlens, cp_size=cp, layout=layout)
    for causal, window in ((True, None), (True, 5), (False, None)):
        want, owner, order = _reference(plan, cu, causal, window)
        pieces = exchange_pieces(plan, cu, causal=causal, window=window)
        got = set()
        for recv, own, start, length, row in zip(pieces.receiver, pieces.owner, pieces.start, pieces.length,
                                                 pieces.owner_row):
            assert own != recv and length > 0
            assert (owner[start:start + length] == own).all()
            assert (order[own][row:row + length] == np.arange(start, start + length)).all()  # the owner's rows
            got |= {(recv, t) for t in range(start, start + length)}
        assert got == want
        counts = need_tokens(plan, cu, causal=causal, window=window)
        assert counts.tolist() == [sum(1 for r, _ in want if r == rank) for rank in range(cp)]
    keys = np.stack([pieces.receiver, pieces.owner, pieces.start])
    assert (np.lexsort(keys[::-1]) == np.arange(keys.shape[1])).all()  # sorted for the all-to-all's splits


def test_one_rank_needs_nothing_and_a_window_shrinks_the_need():
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 64]))
    cu = params.cu_seqlens.long().numpy()
    plan = layout_plan(params.cu_seqlens, cp_size=1, layout="contiguous")
    assert need_tokens(plan, cu).tolist() == [0]
    plan = layout_plan(params.cu_seqlens, cp_size=4, layout="contiguous")
    assert need_tokens(plan, cu).tolist() == [0, 16, 32, 48]
    assert need_tokens(plan, cu, window=5).tolist() == [0, 4, 4, 4]
