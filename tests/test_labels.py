"""Labels compared as int64 values everywhere (cp_packing.labels.valid_label_mask): a label dtype that cannot hold
``ignore_index`` (``-100`` wraps to ``156`` in ``uint8``) never makes a count differ from what the loss trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_packing import count_valid_labels, packed_cross_entropy, packed_seq_params_from_doc_ids
from cp_packing.labels import check_labels_shifted, valid_label_mask

V = 256


def test_count_valid_labels_counts_what_the_loss_trains_for_uint8_labels():
    """Issue 26: micro-batches [156, 1] and [1, 1, 1, 1] in uint8 (V=256) were counted 5 (the count compared in
    uint8, where -100 is 156) while the loss trains 6 labels; the accumulated loss was 6.654 instead of 5.545."""
    micro = [torch.tensor([156, 1], dtype=torch.uint8), torch.tensor([1, 1, 1, 1], dtype=torch.uint8)]
    n = count_valid_labels(micro)
    assert n == sum(int((x.long() != -100).sum()) for x in micro) == 6
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(x.numel(), V, generator=g) for x in micro]
    accumulated = sum(packed_cross_entropy(lg, x, num_items_in_batch=n) for lg, x in zip(logits, micro))
    reference = F.cross_entropy(torch.cat(logits), torch.cat(micro).long())  # the one big batch, int64 labels
    torch.testing.assert_close(accumulated, reference)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_valid_label_mask_equals_the_int64_comparison(dtype):
    info = torch.iinfo(dtype)
    values = torch.tensor([0, 1, 100, 156, 200, 255, -100, -1, 2**31 - 1], dtype=torch.int64)
    labels = values.clamp(info.min, info.max).to(dtype)
    for ignore_index in (-100, 0, 156, 2**40):
        assert valid_label_mask(labels, ignore_index).tolist() == (labels.long() != ignore_index).tolist()


def test_uint8_labels_on_a_segment_end_are_refused_naming_the_dtype():
    """uint8 labels cannot hold -100: the 156 on a document's last token is a real class there, refused with the
    dtype named (it passed as "ignored" when compared in uint8)."""
    labels = torch.tensor([1, 156], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"torch.uint8 labels cannot hold ignore_index=-100.*labels.long\(\)"):
        check_labels_shifted(labels, segment_end=torch.tensor([False, True]))
    check_labels_shifted(labels.long().masked_fill(labels == 156, -100), segment_end=torch.tensor([False, True]))


def test_a_prepared_step_refuses_uint8_labels_instead_of_counting_fewer():
    """``prepare_attention(labels=)`` counted uint8 labels in their own dtype (156 as ignored): the prepared step's
    count differed from the loss's. Now preparing the step raises (on every rank, by its agreement), naming the
    dtype."""
    from cp_packing.attention import prepare_attention
    from cp_packing.sharding import shard_packed_seq_params

    doc = torch.tensor([[1, 1, 1, 2, 2, 2]])
    labels = torch.tensor([[5, 6, -100, 7, 8, -100]]).to(torch.uint8)  # -100 wraps to 156
    shard = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=1, cp_rank=0, layout="contiguous")
    with pytest.raises(ValueError, match="uint8 labels cannot hold ignore_index=-100"):
        prepare_attention(shard, labels=shard.shard(labels))


def _count_worker(rank: int, world_size: int) -> tuple[int, int]:
    import torch.distributed as dist

    from cp_packing.attention import prepare_attention
    from cp_packing.sharding import shard_packed_seq_params

    doc = torch.ones(1, 8, dtype=torch.long)  # one document: rank 0 of 2 holds tokens 0-3, none a segment end
    labels = torch.tensor([[156, 1, 2, 3, 4, 5, 6, -100]])
    shard = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=2, cp_rank=rank, layout="contiguous")
    local = shard.shard(labels)
    step = prepare_attention(shard, group=dist.group.WORLD, labels=local.to(torch.uint8) if rank == 0 else local)
    return step.plan.local_items, step.plan.num_items


@pytest.mark.distributed
def test_a_prepared_step_counts_a_shard_without_segment_ends_as_the_loss_does():
    """A rank whose shard holds no segment end (the middle of a long document) has nothing for the shifted-labels
    check to refuse: its uint8 label 156 is a real class to the loss (int64), so the step's count must include it
    (it counted 3 of 4: the loss then divides by too few, or raises "num_items_in_batch ... smaller")."""
    from cp_packing.testing import run_distributed

    (mine, total), (theirs, total1) = run_distributed(_count_worker, 2)
    assert mine == 4 and theirs == 3 and total == total1 == 7
