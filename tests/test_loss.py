"""Tests for cp_packing.loss: labels shifted on the global stream, and a CP/DP-exact cross-entropy."""

from __future__ import annotations

import doctest
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_packing.loss
from cp_packing.agreement import AgreementError
from cp_packing.loss import (
    LabelsWarning,
    document_cross_entropy,
    next_token_labels,
    packed_cross_entropy,
    reduce_loss_for_logging,
)
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.testing import run_distributed
from tests.maps import segments_of

IGNORE = -100
V, H = 13, 8  # tiny vocabulary and hidden size
RTOL, ATOL = 1e-5, 1e-7


# ----------------------------------------------------------------------------------------------------------------
# Plain-Python references and fixtures
# ----------------------------------------------------------------------------------------------------------------


def ref_labels(input_ids: list[list[int]], doc_ids: list[list[int]]) -> list[list[int]]:
    out = []
    for ids, docs in zip(input_ids, doc_ids):
        row = []
        for s in range(len(ids)):
            ok = s + 1 < len(ids) and docs[s] != 0 and docs[s + 1] == docs[s]
            row.append(ids[s + 1] if ok else IGNORE)
        out.append(row)
    return out


def ref_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean CE over all valid labels (logits [T, V], labels [T])."""
    valid = labels != IGNORE
    return F.cross_entropy(logits[valid].float(), labels[valid], reduction="sum") / valid.sum()


def ref_doc_terms(logits: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor) -> list[torch.Tensor]:
    """One mean CE per segment that has at least one valid label (loop over segments: the reference)."""
    terms = []
    for a, b in segments_of(doc_ids):
        lab = labels[a:b]
        valid = lab != IGNORE
        if valid.any():
            terms.append(F.cross_entropy(logits[a:b][valid].float(), lab[valid]))
    return terms


def ref_doc_loss(logits, labels, doc_ids):
    terms = ref_doc_terms(logits, labels, doc_ids)
    return torch.stack(terms).mean()


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)  # same init on every rank
    return torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, V))


def make_batch(seed: int, B: int, S: int, *, multiple: int = 1, pad_p: float = 0.25):
    """Random doc map [B, S] (runs of multiples of `multiple`, padding anywhere) and input ids [B, S]."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        pos, next_id = 0, 1
        while pos < S:
            length = min(S - pos, multiple * int(torch.randint(1, 5, (), generator=g)))
            if float(torch.rand((), generator=g)) < pad_p:
                value = 0
            else:
                value, next_id = next_id, next_id + 1
            doc[b, pos : pos + length] = value
            pos += length
    ids = torch.randint(0, V, (B, S), generator=g)
    return doc, ids


def grads_of(loss, model):
    return torch.autograd.grad(loss, list(model.parameters()), allow_unused=False)


# ----------------------------------------------------------------------------------------------------------------
# next_token_labels
# ----------------------------------------------------------------------------------------------------------------


def test_next_token_labels_worked_example():
    # Row 0 ends with doc 2 and row 1 starts with doc 2: different segments (boundary at every row start).
    doc = torch.tensor([[1, 1, 2, 2], [2, 2, 0, 3]])
    ids = torch.tensor([[10, 11, 12, 13], [14, 15, 16, 17]])
    labels = next_token_labels(ids, doc)
    assert labels.dtype == torch.int64
    assert labels.tolist() == [[11, IGNORE, 13, IGNORE], [15, IGNORE, IGNORE, IGNORE]]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda B: st.integers(1, 12).flatmap(
            lambda S: st.tuples(
                st.lists(st.lists(st.integers(0, 3), min_size=S, max_size=S), min_size=B, max_size=B),
                st.lists(st.lists(st.integers(0, 255), min_size=S, max_size=S), min_size=B, max_size=B),
            )
        )
    ),
    st.sampled_from([torch.uint8, torch.int16, torch.int32, torch.int64]),
)
def test_next_token_labels_matches_reference(maps, dtype):
    doc, ids = maps
    labels = next_token_labels(torch.tensor(ids, dtype=dtype), torch.tensor(doc, dtype=torch.int32))
    assert labels.dtype == torch.int64
    assert labels.tolist() == ref_labels(ids, doc)
    # A PackedSeqParams is accepted in place of the map.
    params = packed_seq_params_from_doc_ids(torch.tensor(doc))
    assert torch.equal(next_token_labels(torch.tensor(ids), params), labels)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(1, 12))
def test_next_token_labels_shift_hf_unshifted_labels(seed, B, S):
    """HF's labels[t] = token t or -100 (prompt, separators); the shifted label at t is HF's label at t + 1 inside a
    segment, and -100 at every segment end: the same targets HF's own loss (which shifts) would train."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(0, 3, (B, S), generator=g)
    ids = torch.randint(0, 50, (B, S), generator=g)
    hf = torch.where(torch.rand(B, S, generator=g) < 0.3, IGNORE, ids)  # a random prompt mask
    expected = ref_labels(hf.tolist(), doc.tolist())  # HF's label of the next token, inside the segment
    got = next_token_labels(ids, doc, labels=hf.to(torch.int32))
    assert got.dtype == torch.int64 and got.tolist() == expected
    # Unmasked HF labels are the input ids: the same result as without labels=.
    assert torch.equal(next_token_labels(ids, doc, labels=ids), next_token_labels(ids, doc))


def test_next_token_labels_hf_labels_errors_and_double_shift(monkeypatch):
    monkeypatch.setattr(cp_packing.labels, "_warned", set())
    doc = torch.tensor([[1, 1, 1, 1, 2, 2]])
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    with pytest.raises(ValueError, match=r"labels\[0, 2\] is -5"):
        next_token_labels(ids, doc, labels=torch.tensor([[10, 11, -5, 13, 14, 15]]))
    with pytest.raises(ValueError, match=r"labels shape \(1, 5\) does not match input_ids shape \(1, 6\)"):
        next_token_labels(ids, doc, labels=ids[:, :5])
    with pytest.raises(TypeError, match="labels must have an integer dtype"):
        next_token_labels(ids, doc, labels=ids.float())
    # Already shifted labels given as HF's: shifting again would train the token after next.
    shifted = next_token_labels(ids, doc)
    with pytest.warns(LabelsWarning, match="look already shifted"):
        next_token_labels(ids, doc, labels=shifted)


def test_next_token_labels_custom_ignore_and_token_mask():
    doc = torch.tensor([[1, 1, 1, 1, 2, 2]])
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[True, True, False, False, True, True]])  # two in-segment pad tokens
    assert next_token_labels(ids, doc, token_mask=mask, ignore_index=-1).tolist() == [[2, -1, -1, -1, 6, -1]]


def test_next_token_labels_errors():
    doc = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"\(2, 5\).*\(2, 4\)"):
        next_token_labels(torch.ones(2, 5, dtype=torch.int64), doc)
    with pytest.raises(TypeError, match="float32"):
        next_token_labels(torch.ones(2, 4), doc)
    with pytest.raises(TypeError, match="torch.Tensor"):
        next_token_labels([[1, 2, 3, 4]] * 2, doc)
    with pytest.raises(ValueError, match="2D"):
        next_token_labels(torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="bool"):
        next_token_labels(doc, doc, token_mask=doc)


@pytest.mark.parametrize("ignore_index", [True, False, 1.5, "x", None])
def test_next_token_labels_refuses_a_non_int_ignore_index(ignore_index):
    """Issue 9: ignore_index=True used to turn every masked label into class 1."""
    doc = torch.tensor([[1, 1, 2]])
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        next_token_labels(doc, doc, ignore_index=ignore_index)


def test_next_token_labels_meta_tensors_and_unsigned_maps():
    doc = torch.tensor([[1, 1, 2, 2, 0]])
    with pytest.raises(ValueError, match="input_ids is a meta tensor"):
        next_token_labels(torch.zeros(1, 5, dtype=torch.int64, device="meta"), doc)
    with pytest.raises(ValueError, match="doc_ids is a meta tensor"):
        next_token_labels(doc, doc.to("meta"))
    with pytest.raises(ValueError, match="token_mask is a meta tensor"):
        next_token_labels(doc, doc, token_mask=(doc > 0).to("meta"))
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    expected = [[11, IGNORE, 13, IGNORE, IGNORE]]
    for dtype in [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]:
        assert next_token_labels(ids.to(dtype), doc.to(dtype)).tolist() == expected, dtype


# ----------------------------------------------------------------------------------------------------------------
# packed_cross_entropy, single process
# ----------------------------------------------------------------------------------------------------------------


def _single_batch(seed=0, B=3, S=16):
    doc, ids = make_batch(seed, B, S)
    labels = next_token_labels(ids, doc)
    model = make_model()
    logits = model(ids.reshape(-1))  # [T, V]
    return doc, labels.reshape(-1), logits, model


def test_token_loss_single_process_matches_mean_ce():
    doc, labels, logits, _ = _single_batch()
    expected = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    torch.testing.assert_close(packed_cross_entropy(logits, labels), expected, rtol=RTOL, atol=ATOL)
    # [1, T, V] with [1, T] works too.
    got = packed_cross_entropy(logits.unsqueeze(0), labels.unsqueeze(0))
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_document_loss_single_process_matches_reference():
    doc, labels, logits, _ = _single_batch(seed=3)
    params = packed_seq_params_from_doc_ids(doc)
    got = packed_cross_entropy(logits, labels, reduction="document", sharded=params)
    torch.testing.assert_close(got, ref_doc_loss(logits, labels, doc), rtol=RTOL, atol=ATOL)
    # Documents of different length weigh the same: differs from the token mean on this batch.
    assert abs(float(got.detach()) - float(packed_cross_entropy(logits, labels).detach())) > 1e-4


def test_bf16_logits_accumulate_in_float32():
    _, labels, logits, _ = _single_batch(seed=5)
    lb = logits.detach().to(torch.bfloat16)
    got = packed_cross_entropy(lb, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, F.cross_entropy(lb.float(), labels, ignore_index=IGNORE), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("reduction", ["token", "document"])
def test_all_ignored_gives_zero_and_is_differentiable(reduction):
    doc = torch.zeros(2, 6, dtype=torch.int64)  # all padding
    labels = next_token_labels(torch.ones(2, 6, dtype=torch.int64), doc).reshape(-1)
    logits = torch.randn(12, V, requires_grad=True)
    loss = packed_cross_entropy(logits, labels, reduction=reduction, sharded=packed_seq_params_from_doc_ids(doc))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_loss_errors():
    logits = torch.randn(6, V)
    labels = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(TypeError, match="float32"):
        packed_cross_entropy(logits, labels.float())
    with pytest.raises(TypeError, match="int64"):
        packed_cross_entropy(labels.unsqueeze(-1).expand(6, V), labels)
    with pytest.raises(ValueError, match=r"\(6, 13\).*\(5,\)"):
        packed_cross_entropy(logits, labels[:5])
    with pytest.raises(ValueError, match="reduction"):
        packed_cross_entropy(logits, labels, reduction="mean")
    with pytest.raises(ValueError, match="sharded="):
        packed_cross_entropy(logits, labels, reduction="document")
    with pytest.raises(ValueError, match="label 13 .*outside"):
        packed_cross_entropy(logits, torch.tensor([0, 1, 13, IGNORE, 0, 0]))
    params = packed_seq_params_from_doc_ids(torch.ones(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="4 local tokens but labels hold 6"):
        packed_cross_entropy(logits, labels, reduction="document", sharded=params)
    with pytest.raises(TypeError, match="ProcessGroup, a 1-D DeviceMesh or None"):
        packed_cross_entropy(logits, labels, group=object())
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="not initialized"):
            packed_cross_entropy(logits, labels, group=dist.ProcessGroup(dist.HashStore(), 0, 2))


def test_document_cross_entropy_is_the_document_reduction():
    doc, labels, logits, _ = _single_batch(seed=4)
    params = packed_seq_params_from_doc_ids(doc)
    got = document_cross_entropy(logits, labels, sharded=params)
    torch.testing.assert_close(got, ref_doc_loss(logits, labels, doc), rtol=RTOL, atol=ATOL)
    assert torch.equal(got, packed_cross_entropy(logits, labels, reduction="document", sharded=params))
    with pytest.raises(ValueError, match="needs sharded="):
        document_cross_entropy(logits, labels, sharded=None)
    with pytest.raises(TypeError, match="sharded must be a ShardedPackedSeqParams"):
        document_cross_entropy(logits, labels, sharded=doc)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        packed_cross_entropy(logits, labels, ignore_index=True)
    with pytest.raises(ValueError, match="logits is a meta tensor"):
        packed_cross_entropy(logits.to("meta"), labels)
    with pytest.raises(TypeError, match="loss must be a floating scalar tensor"):
        reduce_loss_for_logging(torch.ones(2))
    with pytest.raises(ValueError, match="loss is a meta tensor"):
        reduce_loss_for_logging(torch.ones((), device="meta"))


def test_docstring_examples_run():
    assert doctest.testmod(cp_packing.loss).failed == 0


def test_sharded_for_cp_without_group_is_an_error():
    from cp_packing.sharding import shard_packed_seq_params

    doc = torch.ones(1, 8, dtype=torch.int64)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=2, cp_rank=0, layout="contiguous")
    with pytest.raises(ValueError, match="cp_size=2.*1 rank"):
        packed_cross_entropy(torch.randn(4, V), torch.zeros(4, dtype=torch.int64), sharded=sharded)


def test_the_loss_on_a_prepared_step_is_local_math_and_refuses_a_step_no_attention_ran():
    """``sharded=`` a prepared step: the loss divides by the step's count (from its agreement) with no
    communication; a step in which no attention layer ran cp_packing's attention (an sdpa model) is refused before
    any gradient."""
    from cp_packing.attention import context_parallel_attention, prepare_attention
    from cp_packing.sharding import shard_packed_seq_params

    doc, ids = make_batch(11, 2, 8, pad_p=0.0)
    labels = next_token_labels(ids, doc)
    params = packed_seq_params_from_doc_ids(doc)
    shard = shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="contiguous")
    step = prepare_attention(shard, labels=shard.shard(labels))
    logits = torch.randn(shard.num_local_tokens, V)
    with pytest.raises(ValueError, match="no attention layer ran cp_packing's attention"):
        packed_cross_entropy(logits, shard.shard(labels), sharded=step)
    q = torch.randn(shard.num_local_tokens, 2, 8)
    context_parallel_attention(q, q, q, step)
    assert step.plan.num_items == int((labels != IGNORE).sum())
    torch.testing.assert_close(packed_cross_entropy(logits, shard.shard(labels), sharded=step),
                               torch.nn.functional.cross_entropy(logits, shard.shard(labels), ignore_index=IGNORE))

def test_unshifted_labels_raise_with_the_fix():
    """The issue-10 trap: HF's unshifted labels straight into the loss train each token to predict itself (4.862 vs
    4.872 there), silently. With sharded= (segment ends) or input_ids= the loss raises, naming the fix; correct
    labels never do, not even on documents of one repeated token (where a shifted reading fits too)."""
    from cp_packing.sharding import shard_packed_seq_params

    doc, ids = make_batch(12, 2, 12, pad_p=0.0)
    hf_labels = ids.clone()
    hf_labels[:, :2] = IGNORE  # a prompt
    params = packed_seq_params_from_doc_ids(doc)
    sharded = shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="contiguous")
    logits = torch.randn(ids.numel(), V)
    good = next_token_labels(ids, doc, labels=hf_labels).reshape(-1)
    packed_cross_entropy(logits, good, sharded=sharded, input_ids=ids.reshape(-1))
    same = torch.full((1, 6), 3)
    constant = next_token_labels(same, torch.ones(1, 6, dtype=torch.int64))[0]  # ambiguous: accepted
    packed_cross_entropy(torch.zeros(6, V), constant, input_ids=same[0])
    with pytest.raises(ValueError, match=r"last token of its segment.*next_token_labels\(input_ids, doc_ids, "
                                         r"labels=hf_labels\)"):
        packed_cross_entropy(logits, hf_labels.reshape(-1), sharded=params)
    with pytest.raises(ValueError, match="equal input_ids at every valid position"):
        packed_cross_entropy(logits, hf_labels.reshape(-1), input_ids=ids.reshape(-1))
    with pytest.raises(ValueError, match="equal input_ids at every valid position"):  # the local-math path too
        packed_cross_entropy(logits, hf_labels.reshape(-1), input_ids=ids.reshape(-1), num_items_in_batch=20)
    with pytest.raises(ValueError, match=r"input_ids shape \(5,\) does not match labels shape \(24,\)"):
        packed_cross_entropy(logits, good, input_ids=ids.reshape(-1)[:5])


def test_hf_collator_labels_through_next_token_labels_match_hf_loss(monkeypatch):
    """HF DataCollatorWithFlattening (prompt-masked labels) -> doc map + shifted labels -> packed_cross_entropy equals
    HF's own causal-LM loss on the same logits; the raw HF labels give another loss and a LabelsWarning."""
    transformers = pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    from cp_packing.formats import doc_ids_from_position_ids

    monkeypatch.setattr(cp_packing.labels, "_warned", set())
    features = [{"input_ids": [1, 2, 3, 4, 5], "labels": [-100, -100, 3, 4, 5]},
                {"input_ids": [6, 7, 8], "labels": [-100, 7, 8]},
                {"input_ids": [9, 10, 11, 12], "labels": [9, 10, 11, 12]}]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    doc = doc_ids_from_position_ids(batch["position_ids"])
    torch.manual_seed(0)
    logits = torch.randn(batch["input_ids"].shape[1], V)
    hf = ForCausalLMLoss(logits[None], batch["labels"], vocab_size=V)
    labels = next_token_labels(batch["input_ids"], doc, labels=batch["labels"])
    torch.testing.assert_close(packed_cross_entropy(logits, labels[0]), hf, rtol=RTOL, atol=1e-6)
    params = packed_seq_params_from_doc_ids(doc)
    assert abs(float(packed_cross_entropy(logits, batch["labels"][0])) - float(hf)) > 1e-3  # the trap: another loss
    with pytest.raises(ValueError, match="look unshifted"):  # caught where the segment ends are known
        packed_cross_entropy(logits, batch["labels"][0], sharded=params)


# ----------------------------------------------------------------------------------------------------------------
# Distributed parity (real gloo groups)
# ----------------------------------------------------------------------------------------------------------------


def _full_reference(doc, ids, labels, model, reduction):
    logits = model(ids.reshape(-1))
    flat = labels.reshape(-1)
    loss = ref_token_loss(logits, flat) if reduction == "token" else ref_doc_loss(logits, flat, doc)
    return loss.detach(), grads_of(loss, model)


def _cp_share(doc, ids, labels, model, reduction, *, group, cp_size, cp_rank, layout, batch_dim=False):
    from cp_packing.sharding import shard_packed_seq_params

    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=cp_size, cp_rank=cp_rank,
                                      layout=layout)
    local_ids, local_labels = sharded.shard(ids), sharded.shard(labels)  # [T_local]
    logits = model(local_ids)  # [T_local, V]
    if batch_dim:
        logits, local_labels = logits.unsqueeze(0), local_labels.unsqueeze(0)
    share = packed_cross_entropy(logits, local_labels, group=group, reduction=reduction, sharded=sharded)
    return share, local_labels


def _assert_grads_close(got, expected):
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)


def _parity_worker(rank, world_size, layout, seed):
    multiple = 2 * world_size if layout == "zigzag" else 1
    S = 2 * world_size * 6
    doc, ids = make_batch(seed, 3, S, multiple=multiple)
    labels = next_token_labels(ids, doc)
    model = make_model()
    group = dist.group.WORLD
    out = {}
    for reduction in ("token", "document"):
        ref_loss, ref_grads = _full_reference(doc, ids, labels, model, reduction)
        share, _ = _cp_share(doc, ids, labels, model, reduction, group=group, cp_size=world_size, cp_rank=rank,
                             layout=layout, batch_dim=(reduction == "document"))
        grads = [g.clone() for g in grads_of(share, model)]
        for g in grads:
            dist.all_reduce(g, group=group)
        total = reduce_loss_for_logging(share, group=group)
        torch.testing.assert_close(total, ref_loss, rtol=RTOL, atol=ATOL)
        _assert_grads_close(grads, ref_grads)
        out[reduction] = (float(share), float(ref_loss))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_cp_loss_and_grads_equal_non_cp(world_size, layout):
    results = run_distributed(_parity_worker, world_size, layout, 100 + world_size)
    for reduction in ("token", "document"):
        shares = [r[reduction][0] for r in results]
        ref = results[0][reduction][1]
        assert sum(shares) == pytest.approx(ref, rel=RTOL)
        # The shares are genuine parts (each rank holds real tokens), not the full loss on every rank.
        assert all(abs(s - ref) > 1e-6 for s in shares)


def _padding_rank_worker(rank, world_size):
    # Contiguous layout; the last row is pure padding, so the last rank holds only padding.
    S = 8
    doc, ids = make_batch(7, world_size, S, pad_p=0.0)
    doc[-1] = 0
    labels = next_token_labels(ids, doc)
    model = make_model()
    group = dist.group.WORLD
    out = {}
    for reduction in ("token", "document"):
        ref_loss, ref_grads = _full_reference(doc, ids, labels, model, reduction)
        share, local_labels = _cp_share(doc, ids, labels, model, reduction, group=group, cp_size=world_size,
                                        cp_rank=rank, layout="contiguous")
        grads = [g.clone() for g in grads_of(share, model)]
        if rank == world_size - 1:
            assert bool((local_labels == IGNORE).all())
            assert float(share) == 0.0  # zero, not NaN
            assert all(bool((g == 0).all()) for g in grads)
        for g in grads:
            dist.all_reduce(g, group=group)
        total = reduce_loss_for_logging(share, group=group)
        # Tokens counted once: not cp times too small (count summed per rank) or too large (count of one rank).
        torch.testing.assert_close(total, ref_loss, rtol=RTOL, atol=ATOL)
        assert abs(float(total) - float(ref_loss) / world_size) > 1e-3
        assert abs(float(total) - float(ref_loss) * world_size) > 1e-3
        _assert_grads_close(grads, ref_grads)
        out[reduction] = float(total)
    # A 1-D DeviceMesh works as the CP group.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    via_group, _ = _cp_share(doc, ids, labels, model, "document", group=group, cp_size=world_size, cp_rank=rank,
                             layout="contiguous")
    via_mesh, _ = _cp_share(doc, ids, labels, model, "document", group=mesh["cp"], cp_size=world_size,
                            cp_rank=rank, layout="contiguous")
    assert float(via_mesh) == float(via_group)
    # reduction="document" over a CP group without the shard metadata is refused (on every rank: no hang).
    with pytest.raises(ValueError, match="needs sharded="):
        packed_cross_entropy(torch.randn(S, V), torch.zeros(S, dtype=torch.int64), group=group, reduction="document")
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_padding_rank_joins_and_count_is_reduced_once(world_size):
    run_distributed(_padding_rank_worker, world_size)


def _zero_count_worker(rank, world_size):
    doc = torch.zeros(2, 8, dtype=torch.int64)
    labels = next_token_labels(torch.ones(2, 8, dtype=torch.int64), doc)
    model = make_model()
    for reduction in ("token", "document"):
        share, _ = _cp_share(doc, doc, labels, model, reduction, group=dist.group.WORLD, cp_size=world_size,
                             cp_rank=rank, layout="zigzag")
        grads = grads_of(share, model)
        assert float(share) == 0.0
        assert float(reduce_loss_for_logging(share, group=dist.group.WORLD)) == 0.0
        assert all(bool((g == 0).all()) for g in grads)
    return True


@pytest.mark.distributed
def test_global_count_zero_gives_zero_loss():
    assert run_distributed(_zero_count_worker, 2) == [True, True]


def _dp_cp_worker(rank, world_size):
    cp_size, dp_size = 2, 2
    # Every rank creates every group, in the same order.
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, cp_rank = divmod(rank, cp_size)
    cp_group, dp_group = cp_groups[replica], dp_groups[cp_rank]
    # Two different batches (different padding, so different valid counts).
    batches = []
    for r, pad_p in ((0, 0.1), (1, 0.5)):
        doc, ids = make_batch(40 + r, 2, 16, multiple=2 * cp_size, pad_p=pad_p)
        batches.append((doc, ids, next_token_labels(ids, doc)))
    model = make_model()
    messages = []
    for reduction in ("token", "document"):
        # Reference on the union of both batches, one process.
        logits = [model(ids.reshape(-1)) for _, ids, _ in batches]
        if reduction == "token":
            ref = ref_token_loss(torch.cat(logits), torch.cat([lab.reshape(-1) for _, _, lab in batches]))
            naive = torch.stack([ref_token_loss(lg, lab.reshape(-1)) for lg, (_, _, lab) in zip(logits, batches)])
        else:
            terms = [ref_doc_terms(lg, lab.reshape(-1), doc) for lg, (doc, _, lab) in zip(logits, batches)]
            ref = torch.stack(terms[0] + terms[1]).mean()
            naive = torch.stack([torch.stack(t).mean() for t in terms])
        # The test can tell the union mean from the mean of per-replica means.
        assert abs(float(naive.mean()) - float(ref)) > 1e-4
        ref_grads = grads_of(ref, model)
        doc, ids, labels = batches[replica]
        from cp_packing.sharding import shard_packed_seq_params

        sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=cp_size, cp_rank=cp_rank,
                                          layout="zigzag")
        local_logits = model(sharded.shard(ids))
        share = packed_cross_entropy(local_logits, sharded.shard(labels), group=cp_group, dp_group=dp_group,
                                     reduction=reduction, sharded=sharded)
        grads = [g.clone() for g in grads_of(share, model)]
        for g in grads:
            dist.all_reduce(g)  # SUM over all CP x DP ranks
        _assert_grads_close(grads, ref_grads)
        total = reduce_loss_for_logging(share, group=cp_group, dp_group=dp_group)
        torch.testing.assert_close(total, ref.detach(), rtol=RTOL, atol=ATOL)
        # An out-of-range label on CP rank 1 of replica 1 only: all four ranks raise the same error, which names it.
        bad_labels = sharded.shard(labels).clone()
        if rank == 3:
            bad_labels[0] = V
        with pytest.raises(ValueError) as info:
            packed_cross_entropy(local_logits, bad_labels, group=cp_group, dp_group=dp_group, reduction=reduction,
                                 sharded=sharded)
        messages.append(str(info.value))
    return messages


@pytest.mark.distributed
def test_dp_x_cp_loss_is_mean_over_union_of_batches():
    per_rank = run_distributed(_dp_cp_worker, 4)
    assert all(messages == per_rank[0] for messages in per_rank)  # the same error on every rank of CP x DP
    for message in per_rank[0]:
        assert f"label {V} at local position 0 is outside [0, {V})" in message, message
        assert "CP group rank 1" in message and "DP group rank 1" in message, message


def _bad_label_on_one_rank_worker(rank, world_size):
    """Only rank 1 holds an out-of-range label. Every rank must raise (a rank that raised alone would leave the
    others waiting in the count all-reduce), and the group must still be in step afterwards."""
    messages = []
    world = dist.group.WORLD
    for reduction, kwargs in (("token", {"group": world}), ("document", {"group": world}),
                              ("token", {"dp_group": world})):  # no CP, DP only: same rule over dp_group
        logits = torch.randn(4, V, requires_grad=True)
        labels = torch.tensor([1, 2, IGNORE, IGNORE])  # IGNORE at segment ends (next_token_labels)
        if rank == 1:
            labels[0] = V  # out of range on this rank only
        if "group" in kwargs:
            from cp_packing.sharding import shard_packed_seq_params

            params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]]))
            kwargs["sharded"] = shard_packed_seq_params(params, cp_size=world_size, cp_rank=rank, layout="contiguous")
        with pytest.raises(ValueError) as info:
            packed_cross_entropy(logits, labels, reduction=reduction, **kwargs)
        messages.append(str(info.value))
        probe = torch.ones(1)
        dist.all_reduce(probe)  # both ranks reach this: nobody is stuck in the loss's collective
        assert float(probe) == world_size
    return messages


@pytest.mark.distributed
def test_bad_label_on_one_rank_raises_on_every_rank():
    per_rank = run_distributed(_bad_label_on_one_rank_worker, 2, timeout=60)
    assert per_rank[0] == per_rank[1]  # the same message on every rank: it names the value and the rank
    for message, group in zip(per_rank[0], ("CP", "CP", "DP")):
        assert f"label {V} at local position 0 is outside [0, {V})" in message, message
        assert f"{group} group rank 1" in message, message


# ----------------------------------------------------------------------------------------------------------------
# Fault injection (issue 9): a mistake on one rank raises the same error on EVERY rank, within seconds
# ----------------------------------------------------------------------------------------------------------------

FAULT_TIMEOUT = 90  # seconds for the whole run; a hang (the old behaviour) fails the test here


def _fault_worker(rank, world_size, fault):
    """Rank 1 makes ``fault``; the others call the loss correctly. Returns (error type, message, seconds)."""
    from cp_packing.sharding import shard_packed_seq_params

    world = dist.group.WORLD
    solo = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    doc, ids = make_batch(11, 2, 4 * world_size, multiple=2 * world_size, pad_p=0.2)
    labels = next_token_labels(ids, doc)
    wrong = rank == 1
    if fault == "other_batch" and wrong:  # another batch of the same shape, with other documents
        doc, ids = make_batch(12, 2, 4 * world_size, multiple=2, pad_p=0.2)
        labels = next_token_labels(ids, doc)
    layout = "zigzag" if fault == "layout" and wrong else "contiguous"
    cp_rank = 0 if fault == "wrong_cp_rank" and wrong else rank  # shard_packed_seq_params(cp_rank=0) on both
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=world_size, cp_rank=cp_rank,
                                      layout=layout)
    vocab = V + 1 if fault == "vocab" and wrong else V
    logits = torch.randn(sharded.num_local_tokens, vocab, requires_grad=True)
    if fault == "dtype" and wrong:
        logits = logits.to(torch.bfloat16)
    local = sharded.shard(labels).clone()
    if fault == "bad_label" and wrong:
        local[0] = V
    if fault == "shape" and wrong:
        local = local[:-1]
    kwargs = {"group": world, "sharded": sharded}
    if fault == "dp_on_one_rank" and wrong:
        kwargs["dp_group"] = solo[rank]
    if fault == "ignore_index" and wrong:
        kwargs["ignore_index"] = True
    document = fault in ("other_batch", "mixed_reduction") and not (fault == "mixed_reduction" and wrong)
    start = time.monotonic()
    try:
        if fault == "logging":
            reduce_loss_for_logging(torch.ones(2) if wrong else torch.ones(()), group=world)
        elif document:
            document_cross_entropy(logits, local, **kwargs)
        else:
            packed_cross_entropy(logits, local, **kwargs)
        outcome = ("no error", "")
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        outcome = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    probe = torch.ones(1)
    dist.all_reduce(probe)  # every rank reaches this: nobody is left in the loss's collectives
    assert float(probe) == world_size
    return (*outcome, elapsed)


FAULTS = {  # fault on rank 1 -> (error type on every rank, words the message must hold)
    "wrong_cp_rank": ("ValueError", "sharded.cp_rank=0 but this process is rank 1 of the CP group"),
    "vocab": ("AgreementError", "disagree on vocab size (ranks 0, 2: 13; rank 1: 14)"),
    "dtype": ("AgreementError", "disagree on logits dtype"),
    "mixed_reduction": ("AgreementError", "disagree on reduction (ranks 0, 2: 'document'; rank 1: 'token')"),
    "bad_label": ("ValueError", f"label {V} at local position 0 is outside [0, {V})"),
    "other_batch": ("AgreementError", "disagree on global"),
    "layout": ("AgreementError", "disagree on layout"),
    "shape": ("ValueError", "does not match labels shape"),
    "dp_on_one_rank": ("AgreementError", "disagree on dp size"),
    "ignore_index": ("TypeError", "ignore_index must be an int"),
    "logging": ("TypeError", "loss must be a floating scalar tensor"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_mistake_on_one_rank_raises_the_same_error_on_every_rank(fault):
    per_rank = run_distributed(_fault_worker, 3, fault, timeout=FAULT_TIMEOUT)
    kind, words = FAULTS[fault]
    assert {(t, m) for t, m, _ in per_rank} == {per_rank[0][:2]}, per_rank  # same type and message everywhere
    assert per_rank[0][0] == kind and words in per_rank[0][1], per_rank[0]
    if kind != "AgreementError":  # a rank's own error names the rank it came from
        assert "raised on CP group rank 1" in per_rank[0][1], per_rank[0]
    assert max(seconds for *_, seconds in per_rank) < 30, per_rank


def _dp_cp_fault_worker(rank, world_size):
    """2 x 2 DP x CP; CP rank 1 of replica 0 (global rank 1) shards with cp_rank=0. Replica 1 passes its CP
    agreement and must still learn the error in the DP agreement instead of waiting for replica 0."""
    from cp_packing.sharding import shard_packed_seq_params

    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replica, cp_rank = divmod(rank, 2)
    doc, ids = make_batch(50 + replica, 2, 8, multiple=4)
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=2,
                                      cp_rank=0 if rank == 1 else cp_rank, layout="contiguous")
    logits = torch.randn(sharded.num_local_tokens, V)
    try:
        packed_cross_entropy(logits, sharded.shard(next_token_labels(ids, doc)), group=cp_groups[replica],
                             dp_group=dp_groups[cp_rank], sharded=sharded)
        return ("no error", "")
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc))


@pytest.mark.distributed
def test_a_mistake_in_one_replica_raises_on_every_rank_of_dp_x_cp():
    per_rank = run_distributed(_dp_cp_fault_worker, 4, timeout=FAULT_TIMEOUT)
    assert len(set(per_rank)) == 1, per_rank
    assert per_rank[0][0] == "ValueError" and "sharded.cp_rank=0 but this process is rank 1" in per_rank[0][1]
    assert issubclass(AgreementError, ValueError)
