"""Gradient accumulation over DP x CP: one count of valid labels for the optimizer step (``num_items_in_batch``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing.loss import count_valid_labels, next_token_labels, packed_cross_entropy, reduce_loss_for_logging
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import run_distributed
from tests.test_loss import IGNORE, V, make_batch, make_model

CP, DP, MICRO = 2, 2, 2
RTOL, ATOL = 1e-5, 1e-6


def _batches():
    """MICRO micro-batches per DP replica, all different (other padding, so other valid counts)."""
    out = []
    for replica in range(DP):
        micro = []
        for m in range(MICRO):
            doc, ids = make_batch(70 + 10 * replica + m, 2, 16, multiple=2 * CP, pad_p=0.1 + 0.3 * m)
            micro.append((doc, ids, next_token_labels(ids, doc)))
        out.append(micro)
    return out


def _reference(batches):
    """One process, one big batch: the token mean over the union of every micro-batch of every replica."""
    model = make_model()
    ids = torch.cat([ids.reshape(-1) for micro in batches for _, ids, _ in micro])
    labels = torch.cat([lab.reshape(-1) for micro in batches for _, _, lab in micro])
    loss = F.cross_entropy(model(ids), labels, ignore_index=IGNORE)
    loss.backward()
    return loss.item(), int((labels != IGNORE).sum()), [p.grad.clone() for p in model.parameters()]


def _raises_everywhere(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def _worker(rank, world_size):
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, cp_rank = divmod(rank, CP)
    cp, dp = cp_groups[replica], dp_groups[cp_rank]
    batches = _batches()
    ref_loss, ref_count, ref_grads = _reference(batches)

    micro = [(shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=CP, cp_rank=cp_rank,
                                      layout="zigzag"), ids, labels) for doc, ids, labels in batches[replica]]
    shard_labels = [sharded.shard(labels) for sharded, _, labels in micro]
    # The two ways to count, one per data path: whole batches over DP only, shards over CP and DP.
    n_whole = count_valid_labels([labels for _, _, labels in micro], dp_group=dp)
    n_shards = count_valid_labels(shard_labels, group=cp, dp_group=dp)
    assert n_whole == n_shards == ref_count, (n_whole, n_shards, ref_count)

    def accumulate(num_items):
        model = make_model()
        total = torch.zeros(())
        for m, ((sharded, ids, _), labels) in enumerate(zip(micro, shard_labels)):
            n = num_items if num_items is None or m == 0 else torch.tensor(num_items)  # an int, then a tensor
            share = packed_cross_entropy(model(sharded.shard(ids)), labels, group=cp, dp_group=dp, sharded=sharded,
                                         num_items_in_batch=n)
            share.backward()  # accumulates into .grad
            total += reduce_loss_for_logging(share, group=cp, dp_group=dp)
        grads = [p.grad.clone() for p in model.parameters()]
        for g in grads:
            dist.all_reduce(g)  # SUM over all DP x CP ranks
        return float(total), grads

    loss, grads = accumulate(n_whole)
    assert loss == pytest.approx(ref_loss, rel=RTOL)
    for g, ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, ref, rtol=RTOL, atol=ATOL)
    # The test can fail: normalising each micro-batch by its own count gives other gradients.
    _, per_micro = accumulate(None)
    assert not all(torch.allclose(g, ref, rtol=1e-3, atol=1e-5) for g, ref in zip(per_micro, ref_grads))

    # Mistakes raise on every rank of both groups, before any number: whole batches counted over CP too (every
    # token twice), one rank with another num_items_in_batch.
    sharded, ids, _ = micro[0]
    logits = make_model()(sharded.shard(ids))
    messages = [
        _raises_everywhere(lambda: count_valid_labels([lab for _, _, lab in micro], group=cp, dp_group=dp)),
        _raises_everywhere(lambda: packed_cross_entropy(logits, shard_labels[0], group=cp, dp_group=dp,
                                                        sharded=sharded, num_items_in_batch=n_whole + (rank == 3))),
    ]
    with pytest.raises(ValueError, match="smaller than this rank's own"):
        packed_cross_entropy(logits, shard_labels[0], group=cp, dp_group=dp, sharded=sharded, num_items_in_batch=1)
    return messages


@pytest.mark.distributed
def test_accumulated_dp_x_cp_gradients_equal_one_big_batch():
    """2 micro-batches x (dp 2 x cp 2) on gloo: the accumulated, SUM-reduced gradients and the summed loss equal the
    one-process gradient and loss of the union of all micro-batches; every counting mistake raises everywhere."""
    per_rank = run_distributed(_worker, CP * DP)
    for rank, (double, differ) in enumerate(per_rank):  # the same error on every rank
        assert double == per_rank[0][0] and differ == per_rank[0][1]
        assert "every CP rank holds the same labels" in double and "group=None" in double, double
        assert "disagree on num_items_in_batch" in differ, differ


def test_count_valid_labels_single_process():
    labels = [torch.tensor([[5, IGNORE, 7]]), torch.tensor([IGNORE, 2, 2, 3])]
    assert count_valid_labels(labels) == 5
    assert count_valid_labels(labels[0]) == 2
    assert count_valid_labels([torch.tensor([[5, -1]])], ignore_index=-1) == 1
    with pytest.raises(TypeError, match="non-empty list"):
        count_valid_labels([])
    with pytest.raises(TypeError, match=r"labels\[1\] must have an integer dtype"):
        count_valid_labels([labels[0], torch.zeros(3)])
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        count_valid_labels(labels, ignore_index=True)


def test_num_items_in_batch_single_process():
    logits = torch.randn(6, V, requires_grad=True)
    labels = torch.tensor([1, 2, IGNORE, 3, 4, IGNORE])
    full = packed_cross_entropy(logits, labels)
    for n in (8, torch.tensor(8), torch.tensor([8], dtype=torch.int32)):
        torch.testing.assert_close(packed_cross_entropy(logits, labels, num_items_in_batch=n), full * 4 / 8)
    assert packed_cross_entropy(logits, torch.full((6,), IGNORE), num_items_in_batch=0).item() == 0.0
    with pytest.raises(TypeError, match="num_items_in_batch must be an int"):
        packed_cross_entropy(logits, labels, num_items_in_batch=8.0)
    with pytest.raises(TypeError, match="integer scalar tensor"):
        packed_cross_entropy(logits, labels, num_items_in_batch=torch.tensor([4.0]))
    with pytest.raises(ValueError, match=r"num_items_in_batch=3 is smaller than this rank's own 4"):
        packed_cross_entropy(logits, labels, num_items_in_batch=3)
    params = packed_seq_params_from_doc_ids(torch.ones(1, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="reduction='token'"):
        packed_cross_entropy(logits, labels, reduction="document", sharded=params, num_items_in_batch=8)
