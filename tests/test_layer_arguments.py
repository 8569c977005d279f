"""Every argument that changes a layer's result is compared across the CP ranks: per layer in the checked steps, and,
after them, as a digest of the step's layers at the next step's agreement (issue 26, item 4).

A rank whose later layer passes another softmax scale, window or soft-capping than its peers computes a different
attention silently unless something compares it. Both ways raise on every rank, naming what differs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cp_packing import context_parallel_attention, packed_seq_params_from_doc_ids, shard_packed_seq_params
from cp_packing.attention import prepare_attention
from cp_packing.testing import run_distributed

DOC = torch.tensor([[1] * 6 + [2] * 6 + [3] * 4])


def _layers(step, rank: int, differ: dict) -> None:
    """Three layers; the second one on rank 1 with ``differ`` (e.g. another scale)."""
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(step.num_local_tokens, h, 8, generator=g) for h in (2, 2, 2))
    for layer in range(3):
        kwargs = {"softmax_scale": 0.25, "window": 4}
        if layer == 1 and rank == 1:
            kwargs |= differ
        q = context_parallel_attention(q, k, v, step, **kwargs)


def _worker(rank: int, world_size: int, differ: dict, checked: bool) -> str:
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(DOC), cp_size=2, cp_rank=rank,
                                      layout="contiguous")
    try:
        for _ in range(2):  # the second step's agreement compares the first step's layers
            step = prepare_attention(sharded, group=dist.group.WORLD, backend="exchange", window=[4, 3],
                                     check_layers=checked)
            _layers(step, rank, differ)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.distributed
@pytest.mark.parametrize("differ, field", [({"softmax_scale": 0.5}, "softmax_scale"), ({"window": 3}, "window")])
def test_a_checked_step_compares_every_layer_argument(differ, field):
    for message in run_distributed(_worker, 2, differ, True):
        assert message.startswith("AgreementError") and f"disagree on {field}" in message, message


@pytest.mark.distributed
@pytest.mark.parametrize("differ", [{"softmax_scale": 0.5}, {"window": 3}])
def test_after_the_checked_steps_the_next_step_raises_on_every_rank(differ):
    """check_layers=False (the steps after the first two): the layer runs, and the next step's agreement finds that
    the ranks' layers differed, on every rank, naming the arguments to look at."""
    for message in run_distributed(_worker, 2, differ, False):
        assert message.startswith("AgreementError") and "different attention layers in the previous step" in message
        assert "softmax scale, window" in message, message


@pytest.mark.distributed
def test_equal_layers_pass_both_ways():
    assert run_distributed(_worker, 2, {}, False) == ["ok", "ok"]
