"""The one count (``count_valid_labels``): every entry point of a step gives the same number, equal to a hand count
over micro-batches x CP x DP; and the loss's one denominator rule (``group=None`` never borrows a plan's group)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from cp_packing.loss import count_valid_labels, next_token_labels, packed_cross_entropy
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import run_distributed
from tests.test_loss import IGNORE, V, make_batch

CP, DP, MICRO = 2, 2, 2


def _hand_count(tensors) -> int:
    """Valid labels counted in plain Python ints (no tensor dtype can wrap -100)."""
    return sum(1 for t in tensors for v in t.reshape(-1).tolist() if v != IGNORE)


def _step(replica: int, dtype: torch.dtype) -> list[dict]:
    """This replica's MICRO micro-batches (other padding, other counts), labels in ``dtype``."""
    out = []
    for m in range(MICRO):
        doc, ids = make_batch(40 + 10 * replica + m, 2, 12, multiple=2 * CP, pad_p=0.1 + 0.3 * m)
        labels = next_token_labels(ids, doc)
        labels[0, 0] = IGNORE if m else labels[0, 0]  # a prompt mask on one micro-batch
        out.append({"input_ids": ids, "doc_ids": doc, "labels": labels.to(dtype)})
    return out


def _worker(rank: int, world_size: int) -> dict:
    from cp_packing.attention import context_parallel_attention, prepare_attention
    from cp_packing.groups import CPMesh
    from cp_packing.loader import make_cp_batch, num_items_in_batch
    from cp_packing.tools.train import step_num_items
    from cp_packing.trainer import CPTrainerMixin, cp_batch

    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, cp_rank = divmod(rank, CP)
    cp, dp = cp_groups[replica], dp_groups[cp_rank]
    mesh = CPMesh.from_groups(cp, dp)
    out = {}
    for dtype in (torch.int64, torch.int32):
        hand = _hand_count(b["labels"] for r in range(DP) for b in _step(r, dtype))  # every replica's step
        micro = _step(replica, dtype)
        shards = [shard_packed_seq_params(packed_seq_params_from_doc_ids(b["doc_ids"]), cp_size=CP, cp_rank=cp_rank,
                                          layout="zigzag") for b in micro]
        counts = {
            "whole batches over DP": count_valid_labels([b["labels"] for b in micro], dp_group=dp),
            "shards over CP x DP": count_valid_labels([s.shard(b["labels"]) for s, b in zip(shards, micro)],
                                                      group=cp, dp_group=dp),
            "loader": num_items_in_batch([make_cp_batch(b, cp_size=CP, cp_rank=cp_rank, layout="contiguous", step=i)
                                          for i, b in enumerate(micro)], dp_group=dp),
            "launcher": step_num_items([(b, "contiguous") for b in micro], mesh),
        }
        trainer = types.SimpleNamespace(cp_mesh=mesh, args=types.SimpleNamespace(average_tokens_across_devices=True))
        hf = [cp_batch({"input_ids": b["input_ids"], "doc_ids": b["doc_ids"], "shift_labels": b["labels"]},
                       cp_size=CP, layout="zigzag") for b in micro]
        counts["trainer"] = int(CPTrainerMixin._get_num_items_in_batch(trainer, hf, torch.device("cpu")))
        # the plan counts one micro-batch over its CP group; summed over the micro-batches and DP
        plan_total = torch.zeros(1, dtype=torch.int64)
        for s, b in zip(shards, micro):
            step = prepare_attention(s, group=cp, backend="allgather", labels=s.shard(b["labels"]))
            plan_total += step.plan.num_items
        dist.all_reduce(plan_total, group=dp)
        counts["plan"] = int(plan_total)
        out[str(dtype)] = (hand, counts)
    out["uint8"] = count_valid_labels([torch.tensor([156, 3], dtype=torch.uint8)] * (rank + 1),
                                      dp_group=dp)  # 156 is a class, not -100 wrapped
    out["rule"] = _denominator_rule(cp, dp, cp_rank, prepare_attention, context_parallel_attention)
    return out


def _denominator_rule(cp, dp, cp_rank, prepare_attention, context_parallel_attention) -> dict:
    """``group=None`` means no CP even on a prepared step: a step without a count needs ``group=``; a step's count
    needs ``group=`` too once ``dp_group`` asks for the DP sum (it covers its CP group only)."""
    doc, ids = make_batch(5, 1, 8 * CP, multiple=2 * CP, pad_p=0.0)
    labels = next_token_labels(ids, doc)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=CP, cp_rank=cp_rank,
                                      layout="contiguous")
    local = sharded.shard(labels)
    logits = torch.randn(sharded.num_local_tokens, V, generator=torch.Generator().manual_seed(cp_rank))
    q = torch.randn(sharded.num_local_tokens, 2, 8)
    out = {}
    uncounted = prepare_attention(sharded, group=cp, backend="allgather")
    context_parallel_attention(q, q, q, uncounted)
    with pytest.raises(ValueError, match="group=None, which always means no CP.*prepare the step with labels=") as info:
        packed_cross_entropy(logits, local, sharded=uncounted)  # no group: no CP, and a CP shard: refused
    out["no group, no count"] = str(info.value)
    via_group = packed_cross_entropy(logits, local, sharded=uncounted, group=cp)
    counted = prepare_attention(sharded, group=cp, backend="allgather", labels=local)
    context_parallel_attention(q, q, q, counted)
    local_math = packed_cross_entropy(logits, local, sharded=counted)
    with pytest.raises(ValueError, match="group=None, which always means no CP.*covers its CP group only"):
        packed_cross_entropy(logits, local, sharded=counted, dp_group=dp)  # DP sum asked, CP group not given
    hand = _hand_count([labels])
    ce = torch.nn.functional.cross_entropy(logits, local, ignore_index=IGNORE, reduction="sum") / hand
    out["shares"] = (float(via_group), float(local_math), float(ce))
    return out


@pytest.mark.distributed
def test_every_entry_point_counts_the_same_step_as_a_hand_count():
    """2 DP x 2 CP on gloo, 2 micro-batches, int64 and int32 labels: count_valid_labels (whole batches over DP, and
    shards over CP x DP), the loader's num_items_in_batch, the trainer's _get_num_items_in_batch, the launcher's
    step_num_items and the step plans' counts summed over micro-batches and DP all equal a plain-Python count of every
    label of the step; uint8 labels hold no -100 (156 is a class)."""
    per_rank = run_distributed(_worker, CP * DP)
    for rank, out in enumerate(per_rank):
        for dtype in ("torch.int64", "torch.int32"):
            hand, counts = out[dtype]
            assert hand > 0 and counts == {k: hand for k in counts}, (rank, dtype, hand, counts)
        assert out["uint8"] == sum(2 * (r + 1) for r in (rank % 2, rank % 2 + 2))  # DP groups {0, 2}, {1, 3}
        assert f"cp_rank={rank % 2}" in out["rule"]["no group, no count"]
        via_group, local_math, ce = out["rule"]["shares"]
        assert via_group == pytest.approx(ce, rel=1e-6) and local_math == pytest.approx(ce, rel=1e-6)
