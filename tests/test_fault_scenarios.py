"""Fault scenarios: "a mistake on one rank is raised on every rank, never a hang, never a gloo abort", case by case.

The project's issue listed these mistakes (hangs, gloo aborts, silently wrong answers), tried on real gloo groups of
2, 3 and 4 ranks. One parametrized test per family:

* ``hangs``: a rank whose group argument differs from its peers' (twin groups with the same ranks included), that
  leaves a call out, or that reaches a step after its peer gave up on it;
* ``aborts``: a rank whose calls differ from its peers' inside a step (an extra layer, a missing backward, another
  head count), which made collectives of different sizes meet and gloo abort ("Received data size doesn't match");
* ``silent_wrong``: metadata that is wrong but looks right.

Every case runs ``cp_packing.testing.run_ranks`` with a hard timeout, each rank with the agreement timeout at 5 s
(``agreement.set_agreement_timeout``; the late-rank case sets 2 s), so a rank that never arrives is resolved by the bounded wait in seconds. A
case passes when every rank that takes part raises a Python exception of the expected class whose message names
the problem (the call, the ranks or groups, the field), and every bystander (a rank of another CP group) finishes;
a rank killed by a signal (a gloo abort) or past the hard timeout comes back in ``RankResult.error`` and fails it.
An ``AgreementTimeout`` expected on a rank means "resolved by the bounded wait", an ``AgreementError`` "found
within seconds". A few cases expect ``ok``: the mistake of the issue is no longer one (the rank asserts its output
against a dense reference). Where the library cannot meet the promise today the case is a strict xfail whose
reason says what happens. docs/troubleshooting.md ("One rank's mistake") shows the tally and every strict xfail with
its reason, generated from ``CASES`` (``python tests/test_fault_scenarios.py --write``) and checked by a test here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from cp_packing import (PackedSeqParams, agreement, distribute_batch, distribute_packed_seq_params, next_token_labels,
                        packed_seq_params_from_doc_ids, shard_packed_seq_params)
from cp_packing.attention import context_parallel_attention, prepare_attention
from cp_packing.loss import count_valid_labels, packed_cross_entropy, reduce_loss_for_logging
from cp_packing.options import CHECKED_STEPS
from cp_packing.testing import run_ranks, under_torchrun

pytestmark = [
    pytest.mark.distributed,
    # a case that hangs or aborts gloo would take a launched job down (and torchrun gives one world size)
    pytest.mark.skipif(under_torchrun(), reason="fault scenarios fork their own ranks (2 to 4) with a hard timeout"),
]

AGREEMENT_TIMEOUT = 5.0  # seconds a rank waits for its peers in one agreement (the library's default is 120)
HARD_TIMEOUT = 40.0  # seconds for a whole case: far above what a case that passes needs
XFAIL_TIMEOUT = AGREEMENT_TIMEOUT + 3  # an xfail case (it may hang): killed past the bounded wait, so it costs little
GRACE = 5.0  # seconds the runner waits for the other ranks after one died (a gloo abort)

# [2, 24]: T = 48 splits over 2, 3 and 4 ranks; padding at the end of row 1
_DOC_IDS = torch.tensor([[1] * 5 + [2] * 11 + [3] * 8, [1] * 13 + [2] * 7 + [0] * 4])
VOCAB = 16  # the loss's logits are an attention output [T_local, 2 heads, 8] flattened to [T_local, 16]
HEADS, HEAD_DIM = 2, 8

# What the messages must say
_CROSSED = r"\[0, 1, 2, 3\].*the ranks passed different groups"  # crossed-group detection, naming both groups


def _timeout_in(call: str, missing: str) -> str:
    """The bounded wait's message: the call and the ranks that did not arrive."""
    return rf"{call}: {missing} .*did not arrive within 5 s"


def _calls(rank0: str, rank1: str) -> str:
    return rf"made different calls \(rank 0 in {rank0}; rank 1 in {rank1}\)"


# ------------------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """One scenario: what every rank runs, and what each rank must raise.

    Attributes:
        family: ``"hangs"``, ``"aborts"`` or ``"silent_wrong"``.
        name: the readable id.
        world: the number of ranks.
        fn: ``fn(rank, world)``, run on every rank (it raises, or returns).
        expect: per rank, ``(exception class name, regex its message must match)``, or ``("ok", None)``: the rank
            returns (a bystander, or a case whose mistake is no longer one). Ranks not listed: ``("ok", None)``.
        xfail: why the library cannot meet ``expect`` today (a strict xfail), or None.
        model: the case builds an HF model (transformers is imported before the ranks fork).
    """

    family: str
    name: str
    world: int
    fn: Callable
    expect: dict
    xfail: str | None = None
    model: bool = False


CASES: dict[str, Case] = {}


def case(family: str, world: int, expect: dict, xfail: str | None = None, model: bool = False):
    """Register the decorated rank function as a scenario of ``family``."""
    def register(fn):
        CASES[fn.__name__] = Case(family, fn.__name__, world, fn, expect, xfail, model)
        return fn
    return register


# ------------------------------------------------------------------------------------------------ building blocks


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, tuple(_DOC_IDS.shape), generator=g)
    return {"input_ids": input_ids, "labels": next_token_labels(input_ids, _DOC_IDS), "doc_ids": _DOC_IDS.clone()}


def _shard(cp_size: int, cp_rank: int):
    return shard_packed_seq_params(packed_seq_params_from_doc_ids(_DOC_IDS), cp_size=cp_size, cp_rank=cp_rank,
                                   layout="contiguous")


def _qkv(T: int, heads: int = HEADS):
    """Global q, k, v ``[T, heads, HEAD_DIM]`` (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(T, heads, HEAD_DIM, generator=g) for _ in range(3))


def _local_qkv(sharded, heads: int = HEADS):
    """This rank's q, k, v ``[T_local, heads, HEAD_DIM]``, leaves that require grad."""
    return tuple(sharded.shard(x).requires_grad_() for x in _qkv(sharded.global_params.total_tokens, heads))


def _step(sharded, group):
    """The step prepared with this rank's labels (the loss on it is local math over the agreed count)."""
    return prepare_attention(sharded, group=group, backend="allgather", labels=sharded.shard(_batch()["labels"]))


def _layers(step, q, k, v, n: int):
    """``n`` attention layers chained through their output (so a backward runs through all of them)."""
    x = q
    for _ in range(n):
        x = context_parallel_attention(x, k, v, step)
    return x  # [T_local, H, D]


def _loss(step, out, **kw):
    labels = step.shard(_batch()["labels"])
    return packed_cross_entropy(out.reshape(out.shape[0], -1), labels, sharded=step, **kw)


def _warm_up(rank: int, world: int, group) -> None:
    """Run the CHECKED_STEPS steps whose layers are checked, so the next step of the group checks none."""
    for _ in range(CHECKED_STEPS):
        step = _step(_shard(world, rank), group)
        _layers(step, *_local_qkv(step), 2)


def _mesh(rank: int):
    """DP 2 x CP 2 on 4 ranks: CP groups {0, 1}, {2, 3}; DP groups {0, 2}, {1, 3}. Returns (cp, dp)."""
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}  # all, in order
    return groups[(0, 1) if rank < 2 else (2, 3)], groups[(0, 2) if rank % 2 == 0 else (1, 3)]


def _reference(q, k, v, params: PackedSeqParams) -> torch.Tensor:
    """Dense causal attention within each segment of the global stream: ``[T, H, D]``."""
    T = q.shape[0]
    segment = torch.searchsorted(params.cu_seqlens.long(), torch.arange(T), right=True)  # [T]
    pos = torch.arange(T)
    mask = (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]: query i, key j
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hij,jhd->ihd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def _assert_matches_reference(out, sharded, layers: int) -> None:
    q, k, v = _qkv(sharded.global_params.total_tokens)
    for _ in range(layers):
        q = _reference(q, k, v, sharded.global_params)
    torch.testing.assert_close(out.detach(), sharded.shard(q), atol=1e-5, rtol=1e-5)


def _tiny_llama(layers: int = 2):
    import transformers

    from cp_packing.hf import register_cp_attention

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=register_cp_attention())
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _hf_step(rank: int, world: int, model, group, **options):
    """This rank's model inputs (the step prepared, guards installed) and its labels ``[1, T_local]``."""
    from cp_packing.hf import cp_model_inputs
    from cp_packing.options import AttentionOptions

    sharded = _shard(world, rank)
    local = {key: sharded.shard(x)[None] for key, x in _batch().items()}
    options = AttentionOptions(backend="allgather", **options)
    inputs = cp_model_inputs(local, sharded, group=group, model=model, options=options)
    return inputs, local["labels"]


def _hf_train_step(rank: int, world: int, model, group, **options) -> None:
    inputs, labels = _hf_step(rank, world, model, group, **options)
    logits = model(**inputs).logits[0]  # [T_local, vocab]
    packed_cross_entropy(logits, labels[0], sharded=inputs["cp_sharded"]).backward()


# ------------------------------------------------------------------------------------------------ hangs
# A rank whose group argument differs from its peers', or that leaves a call out.


@case("hangs", 2, {0: ("ValueError", r"cp_size=1.* 2 ranks"),
                   1: ("AgreementTimeout", _timeout_in("context_parallel_attention", r"rank 0 of the CP group"))},
      xfail="a cp_size=1 shard with group=None communicates nothing by design (no CP: group=None means the default "
            "group only where cp_size > 1), so rank 0 cannot know that its peer shards for cp 2: it returns its "
            "single-rank attention; rank 1 raises AgreementTimeout after the bounded wait")
def cp1_shard_with_default_group(rank, world):
    sharded = _shard(1, 0) if rank == 0 else _shard(world, rank)
    context_parallel_attention(*_local_qkv(sharded), sharded, backend="allgather")


@case("hangs", 4, {0: ("AgreementError", _CROSSED), 1: ("AgreementError", _CROSSED)})
def dp_x_cp_world_as_cp_group_in_attention(rank, world):
    cp, _ = _mesh(rank)
    sharded = _shard(2, rank % 2)
    context_parallel_attention(*_local_qkv(sharded), sharded, group=None if rank == 0 else cp, backend="allgather")


@case("hangs", 4, {0: ("AgreementTimeout", _timeout_in("context_parallel_attention", r"rank 1 .*\(global 2\)")),
                   1: ("AgreementTimeout", _timeout_in("context_parallel_attention", r"rank 0 .*\(global 0\)"))})
def dp_x_cp_dp_group_as_cp_group_in_attention(rank, world):
    cp, dp = _mesh(rank)
    sharded = _shard(2, rank % 2)
    context_parallel_attention(*_local_qkv(sharded), sharded, group=dp if rank == 0 else cp, backend="allgather")


@case("hangs", 4, {0: ("AgreementError", _CROSSED), 1: ("AgreementError", _CROSSED)})
def dp_x_cp_world_as_cp_group_in_distribute_batch(rank, world):
    cp, _ = _mesh(rank)
    distribute_batch(_batch(), group=None if rank == 0 else cp, layout="contiguous")


@case("hangs", 4, {0: ("AgreementTimeout", _timeout_in("distribute_batch", r"rank 1 .*\(global 2\)")),
                   1: ("AgreementTimeout", _timeout_in("distribute_batch", r"rank 0 .*\(global 0\)"))})
def dp_x_cp_dp_group_as_cp_group_in_distribute_batch(rank, world):
    cp, dp = _mesh(rank)
    distribute_batch(_batch(), group=dp if rank == 0 else cp, layout="contiguous")


def _on_rank_0(group):
    """``group`` on rank 0, ``None`` on the others (the mistake of the cases below)."""
    return group if dist.get_rank() == 0 else None


def _loss_with_group_on_rank_0(rank: int, world: int, with_shard: bool) -> None:
    sharded = _shard(world, rank)
    logits = torch.randn(sharded.num_local_tokens, VOCAB)
    packed_cross_entropy(logits, sharded.shard(_batch()["labels"]), group=_on_rank_0(dist.group.WORLD),
                         sharded=sharded if with_shard else None)


def _rank_0_waits(call: str, group_name: str = "CP group", fix: str = r"group") -> dict:
    """Rank 0 waits for rank 1 (the bounded wait); rank 1 should raise an error naming ``fix``."""
    return {0: ("AgreementTimeout", _timeout_in(call, rf"rank 1 of the {group_name}")), 1: ("ValueError", fix)}


@case("hangs", 2, _rank_0_waits("packed_cross_entropy", fix=r"sharded.cp_size=2 but the CP group has 1 ranks"))
def packed_cross_entropy_group_on_one_rank(rank, world):
    _loss_with_group_on_rank_0(rank, world, with_shard=True)


@case("hangs", 2, _rank_0_waits("packed_cross_entropy"),
      xfail="without sharded= nothing on rank 1 says its labels are a CP shard (documented: group=None means no "
            "CP), so it returns its share over its local count; rank 0 raises AgreementTimeout after the bounded "
            "wait")
def packed_cross_entropy_group_on_one_rank_without_shard(rank, world):
    _loss_with_group_on_rank_0(rank, world, with_shard=False)


@case("hangs", 2, _rank_0_waits("count_valid_labels"),
      xfail="rank 1 (group=None) counts its shard as a whole batch, alone (documented: shards counted without their "
            "group cannot be told from whole batches) and returns; rank 0 raises AgreementTimeout after the "
            "bounded wait")
def count_valid_labels_group_on_one_rank(rank, world):
    sharded = _shard(world, rank)
    count_valid_labels(sharded.shard(_batch()["labels"]), group=_on_rank_0(dist.group.WORLD))


@case("hangs", 2, _rank_0_waits("reduce_loss_for_logging"),
      xfail="a scalar share carries no CP information: rank 1 (group=None) returns it unreduced; rank 0 raises "
            "AgreementTimeout after the bounded wait")
def reduce_loss_for_logging_group_on_one_rank(rank, world):
    reduce_loss_for_logging(torch.tensor(1.5), group=_on_rank_0(dist.group.WORLD))


@case("hangs", 2, _rank_0_waits("num_items_in_batch", "DP group", fix=r"dp_group"),
      xfail="rank 1 (dp_group=None) is one replica by definition and returns its own count; rank 0 raises "
            "AgreementTimeout after the bounded wait")
def num_items_in_batch_dp_group_on_one_rank(rank, world):
    from cp_packing.loader import make_cp_batch, num_items_in_batch

    item = make_cp_batch(_batch(), cp_size=1, cp_rank=0, layout="contiguous", step=0)
    num_items_in_batch([item], dp_group=_on_rank_0(dist.group.WORLD))


_DP_SIZE = r"disagree on dp size"


@case("hangs", 4, {0: ("ValueError", _DP_SIZE),
                   1: ("AgreementTimeout", _timeout_in("packed_cross_entropy", r"rank 1 of the DP group \(global 3\)")),
                   2: ("ValueError", _DP_SIZE), 3: ("AgreementError", _DP_SIZE)})
def loss_dp_group_omitted_on_rank_3(rank, world):
    cp, dp = _mesh(rank)
    sharded = _shard(2, rank % 2)
    logits = torch.randn(sharded.num_local_tokens, VOCAB)
    packed_cross_entropy(logits, sharded.shard(_batch()["labels"]), group=cp, dp_group=None if rank == 3 else dp,
                         sharded=sharded)


@case("hangs", 2, {0: ("ValueError", r"called with labels= and cp_sharded"),
                   1: ("AgreementTimeout", _timeout_in("attention layer", r"rank 0 of the CP group"))},
      model=True)
def hf_labels_guard_on_rank_0_only(rank, world):
    model = _tiny_llama()
    inputs, labels = _hf_step(rank, world, model, dist.group.WORLD)
    model(**inputs, labels=labels) if rank == 0 else model(**inputs)


@case("hangs", 3, {0: ("RuntimeError", r"user code failed on rank 0"),
                   1: ("AgreementTimeout", _timeout_in("context_parallel_attention", r"rank 0 of the CP group")),
                   2: ("AgreementTimeout", _timeout_in("context_parallel_attention", r"rank 0 of the CP group"))})
def user_exception_between_two_calls_cp3(rank, world):
    _, sharded = distribute_batch(_batch(), group=dist.group.WORLD, layout="contiguous")
    if rank == 0:
        raise RuntimeError("user code failed on rank 0 between two cp-packing calls")
    _layers(_step(sharded, dist.group.WORLD), *_local_qkv(sharded), 2)


# Two group objects with the same ranks (dist.new_group called twice): the agreement's channel is the process group
# (torch's group name, the same on all its ranks), so rank 0 in one and rank 1 in the other find the crossing.
_TWINS = r"passed different groups.*same ranks \(dist.new_group called twice\) are two different groups"


def _twin_groups(rank: int):
    """``a = new_group([0, 1]); b = new_group([0, 1])`` on every rank; rank 0's is a, rank 1's is b."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    return a if rank == 0 else b


@case("hangs", 2, {r: ("AgreementError", _TWINS) for r in (0, 1)})
def twin_groups_in_attention(rank, world):
    sharded = _shard(world, rank)
    context_parallel_attention(*_local_qkv(sharded), sharded, group=_twin_groups(rank), backend="allgather")


@case("hangs", 2, {r: ("AgreementError", _TWINS) for r in (0, 1)})
def twin_groups_in_the_loss(rank, world):
    sharded = _shard(world, rank)
    logits = torch.randn(sharded.num_local_tokens, VOCAB)
    packed_cross_entropy(logits, sharded.shard(_batch()["labels"]), group=_twin_groups(rank), sharded=sharded)


# A rank that reaches a step after its peer gave up on it: the step was abandoned (marked in the store), so it raises
# at once, naming the peer and how long ago, instead of passing the agreement into an all-gather nobody joins.
_LATE_TIMEOUT, _LATE_DELAY = 2.0, 3.0


@case("hangs", 2, {0: ("AgreementTimeout", r"context_parallel_attention: rank 1 of the CP group \(global 1\) did not "
                                           r"arrive within 2 s"),
                   1: ("AgreementTimeout", r"context_parallel_attention: this rank \(global rank 1\) arrived too late: "
                                           r"global rank 0 of its CP group gave up waiting for it in "
                                           r"context_parallel_attention \d+\.\d s ago, after 2 s")})
def late_rank_reaches_a_step_its_peer_gave_up_on(rank, world):
    import time

    agreement.set_agreement_timeout(_LATE_TIMEOUT)
    sharded = _shard(world, rank)
    if rank == 1:
        time.sleep(_LATE_DELAY)  # e.g. a long save on this rank only, past the agreement timeout
    context_parallel_attention(*_local_qkv(sharded), sharded, group=dist.group.WORLD, backend="allgather")


# ------------------------------------------------------------------------------------------------ aborts
# A rank whose calls differ from its peers' inside a step. Inside the checked steps (the first CHECKED_STEPS of a
# group, check_layers=None) every layer and every backward call is agreed: the desync is raised on every rank.

_EXTRA = r"attention layer"


@case("aborts", 2, {r: ("AgreementError", _calls(_EXTRA, "attention backward")) for r in (0, 1)})
def extra_attention_call_then_loss(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    out = _layers(step, *_local_qkv(step), 3 if rank == 0 else 2)
    _loss(step, out).backward()  # the loss on the prepared step is local math: its backward meets rank 0's layer 3


@case("aborts", 2, {r: ("AgreementError", _calls(_EXTRA, "packed_cross_entropy")) for r in (0, 1)})
def extra_attention_call_then_loss_with_group(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    out = _layers(step, *_local_qkv(step), 3 if rank == 0 else 2)
    _loss(step, out, group=dist.group.WORLD)


@case("aborts", 2, {r: ("AgreementError", _calls(_EXTRA, "context_parallel_attention")) for r in (0, 1)})
def extra_attention_call_then_next_step(rank, world):
    for _ in range(2):
        step = _step(_shard(world, rank), dist.group.WORLD)
        _layers(step, *_local_qkv(step), 3 if rank == 0 else 2)


@case("aborts", 2, {r: ("AgreementError", _calls(_EXTRA, "distribute_batch")) for r in (0, 1)})
def extra_attention_call_then_distribute_batch(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    _layers(step, *_local_qkv(step), 3 if rank == 0 else 2)
    distribute_batch(_batch(), group=dist.group.WORLD, layout="contiguous")


@case("aborts", 2, {r: ("AgreementError", _calls(_EXTRA, "reduce_loss_for_logging")) for r in (0, 1)})
def extra_attention_call_then_reduce_loss_for_logging(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    out = _layers(step, *_local_qkv(step), 3 if rank == 0 else 2)
    reduce_loss_for_logging(_loss(step, out), group=dist.group.WORLD)


_LAYER_COUNT = r"context_parallel_attention: the ranks of the CP group disagree on attention layers"


@case("aborts", 2, {r: ("AgreementError", _LAYER_COUNT) for r in (0, 1)}, model=True)
def model_with_one_decoder_layer_fewer(rank, world):
    _hf_train_step(rank, world, _tiny_llama(2 if rank == 0 else 1), dist.group.WORLD)


@case("aborts", 2, {r: ("AgreementError", _calls("attention backward", "reduce_loss_for_logging")) for r in (0, 1)})
def backward_on_one_rank_only(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    loss = _loss(step, _layers(step, *_local_qkv(step), 2))
    if rank == 0:
        loss.backward()
    reduce_loss_for_logging(loss, group=dist.group.WORLD)


@case("aborts", 2, {0: ("ok", None), 1: ("ok", None)})
def shard_rebuilt_between_layers(rank, world):
    """The issue's case: unprepared shards (every call is its own step), rank 0 rebuilds its shard (same values)."""
    sharded = _shard(world, rank)
    q, k, v = _local_qkv(sharded)
    x = context_parallel_attention(q, k, v, sharded, backend="allgather")
    if rank == 0:
        sharded = _shard(world, rank)
    x = context_parallel_attention(x, k, v, sharded, backend="allgather")
    _assert_matches_reference(x, sharded, layers=2)


@case("aborts", 2, {r: ("AgreementError", _calls("context_parallel_attention", _EXTRA)) for r in (0, 1)})
def shard_rebuilt_between_layers_of_a_prepared_step(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    q, k, v = _local_qkv(step)
    x = context_parallel_attention(q, k, v, step)
    context_parallel_attention(x, k, v, _shard(world, rank) if rank == 0 else step, backend="allgather")


@case("aborts", 3, {0: ("ok", None), 1: ("ok", None), 2: ("ok", None)})
def one_shard_with_group_01_then_02(rank, world):
    g01, g02 = dist.new_group([0, 1]), dist.new_group([0, 2])
    sharded = _shard(2, 0 if rank == 0 else 1)
    q, k, v = _local_qkv(sharded)
    if rank == 0:
        step = prepare_attention(sharded, group=g01, backend="allgather")
        _assert_matches_reference(context_parallel_attention(q, k, v, step), sharded, layers=1)
        out = context_parallel_attention(q, k, v, step, group=g02, backend="allgather")  # another group: own step
    else:
        out = context_parallel_attention(q, k, v, sharded, group=g01 if rank == 1 else g02, backend="allgather")
    _assert_matches_reference(out, sharded, layers=1)


@case("aborts", 2, {r: ("AgreementError", r"attention layer: the ranks of the CP group disagree on q") for r in (0, 1)})
def head_count_differs_in_layer_2(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    q, k, v = _local_qkv(step)
    x = context_parallel_attention(q, k, v, step)
    if rank == 0:
        x, k, v = (t.repeat_interleave(2, dim=1) for t in (x, k, v))  # 4 heads in layer 2
    context_parallel_attention(x, k, v, step)


@case("aborts", 2, {r: ("AgreementError", r"attention layer: the ranks of the CP group disagree on causal")
                    for r in (0, 1)})
def causal_differs_in_layer_2(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    q, k, v = _local_qkv(step)
    x = context_parallel_attention(q, k, v, step)
    context_parallel_attention(x, k, v, step, causal=rank == 0)


# After the checked steps (step CHECKED_STEPS + 1 of the group on) no layer is agreed: the same desyncs.

_AFTER = "after the checked steps no layer or backward call is agreed (check_layers is off from step 3 by default): "


@case("aborts", 2, {r: ("AgreementError", _calls(_EXTRA, "context_parallel_attention")) for r in (0, 1)},
      xfail=_AFTER + "rank 0's extra layer waits in its K/V all-gather; rank 1 raises AgreementTimeout in the next "
            "step's agreement after the bounded wait, and rank 0 is freed only when rank 1's process exits (gloo's "
            "RuntimeError 'Connection closed by peer', naming nothing)")
def extra_attention_call_then_next_step_after_checked_steps(rank, world):
    _warm_up(rank, world, dist.group.WORLD)
    extra_attention_call_then_next_step(rank, world)


@case("aborts", 2, {r: ("AgreementError", _calls(_EXTRA, "attention backward")) for r in (0, 1)},
      xfail=_AFTER + "rank 0's extra layer all-gathers K/V with rank 1's backward re-gather (the same sizes), then "
            "their next collectives wait for each other: both ranks hang in gloo (killed at the hard timeout)")
def extra_attention_call_then_loss_after_checked_steps(rank, world):
    _warm_up(rank, world, dist.group.WORLD)
    extra_attention_call_then_loss(rank, world)


@case("aborts", 2, {r: ("AgreementError", _LAYER_COUNT) for r in (0, 1)}, model=True)  # the step's agreement
def model_with_one_decoder_layer_fewer_check_layers_off(rank, world):
    _hf_train_step(rank, world, _tiny_llama(2 if rank == 0 else 1), dist.group.WORLD, check_layers=False)


@case("aborts", 2, {r: ("AgreementError", _calls("attention backward", "reduce_loss_for_logging")) for r in (0, 1)},
      xfail=_AFTER + "rank 0's backward waits in its K/V re-gather; rank 1 raises AgreementTimeout in "
            "reduce_loss_for_logging after the bounded wait, and rank 0 gets gloo's 'Connection closed by peer' "
            "when rank 1 exits")
def backward_on_one_rank_only_after_checked_steps(rank, world):
    _warm_up(rank, world, dist.group.WORLD)
    backward_on_one_rank_only(rank, world)


@case("aborts", 2, {r: ("AgreementError", _calls("context_parallel_attention", _EXTRA)) for r in (0, 1)},
      xfail=_AFTER + "rank 1's layer 2 waits in the all-gather while rank 0's rebuilt shard (no plan: its own step) "
            "waits in a step agreement: rank 0 raises AgreementTimeout after the bounded wait, and rank 1 gets "
            "gloo's 'Connection closed by peer' when rank 0 exits")
def shard_rebuilt_between_layers_of_a_prepared_step_after_checked_steps(rank, world):
    _warm_up(rank, world, dist.group.WORLD)
    shard_rebuilt_between_layers_of_a_prepared_step(rank, world)


@case("aborts", 2, {r: ("AgreementError", r"disagree on q") for r in (0, 1)},
      xfail=_AFTER + "layer 2's K/V all-gathers differ in size (4 heads against 2): gloo aborts one rank (SIGABRT, "
            "'Received data size doesn't match'), the other gets 'Connection reset by peer'")
def head_count_differs_in_layer_2_after_checked_steps(rank, world):
    _warm_up(rank, world, dist.group.WORLD)
    head_count_differs_in_layer_2(rank, world)


# ------------------------------------------------------------------------------------------------ silent wrong

_MIXED_SEGMENT = (r"cu_seqlens does not match (params\.)?doc_ids( at flat position \d+: a document boundary|: a segment "
                  r"holds more than one document)")


def _two_documents_in_one_segment() -> PackedSeqParams:
    """The issue's hand-built params: ONE segment [0, 8) over documents 1 and 2."""
    return PackedSeqParams(torch.tensor([0, 8], dtype=torch.int32), 8, torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]))



@case("silent_wrong", 2, {r: ("ValueError", _MIXED_SEGMENT) for r in (0, 1)})
def hand_built_mixed_segment_in_shard_packed_seq_params(rank, world):
    shard_packed_seq_params(_two_documents_in_one_segment(), cp_size=world, cp_rank=rank, layout="contiguous")


@case("silent_wrong", 2, {r: ("ValueError", _MIXED_SEGMENT) for r in (0, 1)})
def hand_built_mixed_segment_in_attention(rank, world):
    sharded = shard_packed_seq_params(_two_documents_in_one_segment(), cp_size=world, cp_rank=rank,
                                      layout="contiguous")
    q, k, v = (sharded.shard(x) for x in _qkv(8))
    context_parallel_attention(q, k, v, sharded, group=dist.group.WORLD, backend="allgather")


@case("silent_wrong", 2, {r: ("ValueError", _MIXED_SEGMENT) for r in (0, 1)})
def hand_built_mixed_segment_in_distribute_src_none(rank, world):
    distribute_packed_seq_params(_two_documents_in_one_segment(), group=dist.group.WORLD, layout="contiguous")


@case("silent_wrong", 2, {r: ("ValueError", _MIXED_SEGMENT) for r in (0, 1)})
def hand_built_mixed_segment_in_distribute_from_src(rank, world):
    params = _two_documents_in_one_segment() if rank == 0 else None
    distribute_packed_seq_params(params, group=dist.group.WORLD, src=0, layout="contiguous")


@case("silent_wrong", 2, {r: ("ValueError", _MIXED_SEGMENT) for r in (0, 1)})
def doc_ids_edited_in_place(rank, world):
    doc_ids = torch.ones(1, 8, dtype=torch.int64)
    params = packed_seq_params_from_doc_ids(doc_ids)
    doc_ids[0, 4:] = 2
    sharded = shard_packed_seq_params(params, cp_size=world, cp_rank=rank, layout="contiguous")
    q, k, v = (sharded.shard(x) for x in _qkv(8))
    context_parallel_attention(q, k, v, sharded, group=dist.group.WORLD, backend="allgather")


_CHANGED = r"changed in place after its step was prepared"


@case("silent_wrong", 2, {r: ("ValueError", _CHANGED) for r in (0, 1)})
def shard_key_start_edited_before_the_first_layer(rank, world):
    step = _step(_shard(world, rank), dist.group.WORLD)
    if rank == 0:
        step.key_start[-1] += 1
    context_parallel_attention(*_local_qkv(step), step)



def _edit_between_layers(rank: int, world: int, field: str) -> None:
    """Layer 1 (global), an in-place edit of ``field`` on rank 0, layer 2 with a sliding window (new tables)."""
    step = _step(_shard(world, rank), dist.group.WORLD)
    q, k, v = _local_qkv(step)
    x = context_parallel_attention(q, k, v, step)
    if rank == 0:
        getattr(step, field)[1 if field == "cu_seqlens" else -1] += 1  # a local run / the last run's keys shift
    context_parallel_attention(x, k, v, step, window=4)


@case("silent_wrong", 2, {r: ("ValueError", r"changed in place") for r in (0, 1)})
def shard_cu_seqlens_edited_between_layers(rank, world):
    _edit_between_layers(rank, world, "cu_seqlens")


@case("silent_wrong", 2, {r: ("ValueError", r"changed in place") for r in (0, 1)})
def shard_key_start_edited_between_layers(rank, world):
    _edit_between_layers(rank, world, "key_start")


@case("silent_wrong", 2, {r: ("AgreementError", r"disagree on causal") for r in (0, 1)},
      xfail=_AFTER + "the all-gather moves the same bytes whatever causal is: rank 1 runs layer 2 non-causally and "
            "every rank returns from this step; the NEXT step's agreement compares the layers' argument digests and "
            "raises on every rank (tests/test_layer_arguments.py), so the wrong step is named, not repeated")
def causal_differs_in_layer_2_after_checked_steps(rank, world):
    _warm_up(rank, world, dist.group.WORLD)
    causal_differs_in_layer_2(rank, world)


# ------------------------------------------------------------------------------------------------ running a case


def _rank(rank: int, world: int, name: str):
    """One rank of a case: ``("ok", value)`` or ``(exception class name, message)``."""
    agreement.set_agreement_timeout(AGREEMENT_TIMEOUT)
    try:
        return "ok", CASES[name].fn(rank, world)
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)


def _run(name: str) -> None:
    spec = CASES[name]
    if spec.model:
        pytest.importorskip("transformers")  # imported here, before the ranks fork: they inherit it
    results = run_ranks(_rank, spec.world, name, timeout=XFAIL_TIMEOUT if spec.xfail else HARD_TIMEOUT, grace=GRACE)
    dead = [f"rank {r.rank}: {r.error}" for r in results if not r.ok]  # a gloo abort, a hang past the timeout
    assert not dead, "\n".join(dead)
    said = {r.rank: r.value for r in results}
    for rank in range(spec.world):
        kind, pattern = spec.expect.get(rank, ("ok", None))
        got, message = said[rank]
        assert got == kind, f"rank {rank}: expected {kind}, got {got}: {message}\nall ranks: {said}"
        if pattern is not None:
            assert re.search(pattern, message), f"rank {rank}: {message!r} does not match {pattern!r}"


def _params(family: str):
    return [pytest.param(name, id=name, marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
            for name, c in CASES.items() if c.family == family]


@pytest.mark.parametrize("name", _params("hangs"))
def test_hangs_group_mismatch(name):
    """A rank whose group argument differs from its peers', or that leaves a call out: every rank raises."""
    _run(name)


@pytest.mark.parametrize("name", _params("aborts"))
def test_aborts_call_desync(name):
    """A rank whose calls differ inside a step: every rank raises (or, where it is no mistake any more, runs right)."""
    _run(name)


@pytest.mark.parametrize("name", _params("silent_wrong"))
def test_silent_wrong_metadata(name):
    """Metadata that is wrong but looks right: refused on every rank."""
    _run(name)


# ------------------------------------------------------------------------------------------------ the docs' tally

_FAMILIES = {"hangs": "hangs (group mismatch, a missing call, a late rank)",
             "aborts": "aborts (a call desync in a step)",
             "silent_wrong": "silent wrong (well-formed, wrong metadata)"}
_TALLY_BEGIN = "<!-- fault-tally:begin (generated: python tests/test_fault_scenarios.py --write) -->\n"
_TALLY_END = "\n<!-- fault-tally:end -->"
_DOCS = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"


def _how(spec: Case) -> str:
    """How a passing case ends: every rank runs right, raises within seconds, or some rank waits out the bound."""
    kinds = {spec.expect.get(r, ("ok", None))[0] for r in range(spec.world)}
    if kinds == {"ok"}:
        return "runs right"
    return "through the bounded wait on some rank" if "AgreementTimeout" in kinds else "raised within seconds"


def tally_markdown() -> str:
    """docs/troubleshooting.md's tally of these cases and the list of the strict xfails, from ``CASES``."""
    lines = [f"**Tally of `tests/test_fault_scenarios.py`** ({len(CASES)} cases; gloo, 2 to 4 ranks, agreement timeout "
             f"{AGREEMENT_TIMEOUT:g} s):", "", "| family | cases | pass | strict xfail |", "|---|---|---|---|"]
    for family, title in _FAMILIES.items():
        cases = [c for c in CASES.values() if c.family == family]
        passing = [c for c in cases if c.xfail is None]
        hows: dict[str, int] = {}
        for c in passing:
            hows[_how(c)] = hows.get(_how(c), 0) + 1
        detail = ", ".join(f"{n} {how}" for how, n in sorted(hows.items(), key=lambda kv: -kv[1]))
        if len(hows) == 1:
            detail = f"all {next(iter(hows))}"
        lines.append(f"| {title} | {len(cases)} | {len(passing)}{': ' + detail if detail else ''} | "
                     f"{len(cases) - len(passing)} |")
    lines += ["", "The strict xfails (what happens instead, and why the library cannot catch it):", ""]
    lines += [f"- `{c.name}` ({c.family}, {c.world} ranks): {c.xfail}" for c in CASES.values() if c.xfail]
    return "\n".join(lines)


def _tally_in_docs(text: str) -> tuple[int, int]:
    begin, end = text.find(_TALLY_BEGIN), text.find(_TALLY_END)
    assert begin >= 0 and end > begin, f"{_DOCS} lacks the markers {_TALLY_BEGIN.strip()} ... {_TALLY_END.strip()}"
    return begin + len(_TALLY_BEGIN), end


def test_the_troubleshooting_tally_is_generated_from_the_cases():
    """docs/troubleshooting.md's tally (counts, and every strict xfail with its reason) is these cases' own."""
    text = _DOCS.read_text()
    begin, end = _tally_in_docs(text)
    assert text[begin:end] == tally_markdown(), (
        "docs/troubleshooting.md's fault tally is out of date: run PYTHONPATH=. python tests/test_fault_scenarios.py "
        "--write")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_fault_scenarios.py --write  (regenerates docs/troubleshooting.md's tally)")
    text = _DOCS.read_text()
    begin, end = _tally_in_docs(text)
    _DOCS.write_text(text[:begin] + tally_markdown() + text[end:])
    print(f"wrote the tally of {len(CASES)} cases to {_DOCS}")
