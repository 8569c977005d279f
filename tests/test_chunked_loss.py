"""packed_linear_cross_entropy: the chunked linear + cross-entropy equals F.cross_entropy on the full logits (loss
and gradients of hidden, weight and bias), with every feature of packed_cross_entropy, and its CP shares' gradients
sum to the non-CP ones on a real gloo group. Its peak memory is measured in benchmarks/bench_loss.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing.loss import (
    default_chunk_size,
    document_cross_entropy,
    next_token_labels,
    packed_cross_entropy,
    packed_linear_cross_entropy,
)
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.sharding import shard_packed_seq_params
from cp_packing.testing import run_distributed

IGNORE = -100
RTOL = 1e-5


def _inputs(T: int, D: int, V: int, *, seed: int = 0, dtype=torch.float32, bias: bool = False, ignored: float = 0.25):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) / D ** 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < ignored] = IGNORE
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, *, eps=0.0, cap=None):
    """F.cross_entropy on the full [T, V] logits: the token mean over the valid labels."""
    logits = F.linear(hidden, weight, bias).float()  # [T, V]
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, label_smoothing=eps)


def _f(t) -> float:
    return float(t.detach()) if isinstance(t, torch.Tensor) else float(t)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def _assert_close_rel(got, want, rtol=RTOL):
    for g, w in zip(got, want):
        scale = _f(w.abs().max()) or 1.0
        assert _f((g.float() - w.float()).abs().max()) <= rtol * scale, (g, w)


@pytest.mark.parametrize("T, D, V, chunk, bias, eps, cap", [
    (64, 16, 50, 7, False, 0.0, None),     # chunks that do not divide T
    (33, 8, 1000, 4, True, 0.0, None),     # V >> D, with a bias
    (40, 32, 17, 100, False, 0.1, None),   # one chunk larger than T; label smoothing
    (48, 16, 64, 16, True, 0.2, 5.0),      # smoothing and final-logit softcapping together
    (25, 12, 31, None, False, 0.0, 2.0),   # the default chunk size; a tight cap
])
def test_equals_cross_entropy_on_full_logits_fp32(T, D, V, chunk, bias, eps, cap):
    hidden, weight, b, labels = _inputs(T, D, V, bias=bias)
    loss = packed_linear_cross_entropy(hidden, weight, labels, bias=b, label_smoothing=eps,
                                       final_logit_softcapping=cap, chunk_size=chunk)
    ref = _reference(hidden, weight, b, labels, eps=eps, cap=cap)
    assert loss.dtype == torch.float32
    assert abs(_f(loss) - _f(ref)) <= RTOL * abs(_f(ref))
    _assert_close_rel(_grads(loss, [hidden, weight, b]), _grads(ref, [hidden, weight, b]))


def test_gradients_match_finite_differences_float64():
    # An independent check of the hand-written backward (softcap, smoothing, bias and ignored labels at once).
    hidden, weight, b, labels = _inputs(11, 4, 7, seed=3, dtype=torch.float64, bias=True)

    def loss(h, w, bias):
        return packed_linear_cross_entropy(h, w, labels, bias=bias, label_smoothing=0.3, final_logit_softcapping=1.5,
                                           chunk_size=4)

    assert torch.autograd.gradcheck(loss, (hidden, weight, b))


def test_bf16_equals_the_full_logit_path():
    # The full path as HF computes it: bf16 logits from lm_head, CE in float32.
    hidden, weight, _, labels = _inputs(96, 32, 300, seed=5, dtype=torch.bfloat16)
    loss = packed_linear_cross_entropy(hidden, weight, labels, chunk_size=32)
    ref = packed_cross_entropy(F.linear(hidden, weight), labels)
    assert loss.dtype == torch.float32
    assert abs(_f(loss) - _f(ref)) <= 1e-3 * abs(_f(ref))
    _assert_close_rel(_grads(loss, [hidden, weight]), _grads(ref, [hidden, weight]), rtol=2e-2)


def test_same_share_and_count_rules_as_packed_cross_entropy():
    hidden, weight, _, labels = _inputs(30, 8, 20, seed=7)
    logits = F.linear(hidden, weight)
    for kwargs in ({}, {"num_items_in_batch": 41}, {"num_items_in_batch": torch.tensor(41)}, {"label_smoothing": 0.1}):
        got = packed_linear_cross_entropy(hidden, weight, labels, chunk_size=8, **kwargs)
        want = packed_cross_entropy(logits, labels, **kwargs)
        assert abs(_f(got) - _f(want)) <= RTOL * abs(_f(want)), kwargs
    # [1, T_local, ...] as the model returns them; the document mean over a batch's segments.
    doc = torch.tensor([[1] * 10 + [2] * 12 + [0] * 8])
    params = packed_seq_params_from_doc_ids(doc)
    labels = next_token_labels(torch.randint(0, 20, (1, 30)), doc)[0]
    got = packed_linear_cross_entropy(hidden[None], weight, labels[None], sharded=params, reduction="document")
    want = document_cross_entropy(logits, labels, sharded=params)
    assert abs(_f(got) - _f(want)) <= RTOL * abs(_f(want))


def test_all_ignored_is_zero_with_zero_gradients():
    hidden, weight, b, labels = _inputs(12, 4, 9, bias=True)
    loss = packed_linear_cross_entropy(hidden, weight, torch.full_like(labels, IGNORE), bias=b, chunk_size=5)
    assert _f(loss) == 0.0
    assert all(bool((g == 0).all()) for g in _grads(loss, [hidden, weight, b]))


def test_other_ignore_index():
    hidden, weight, _, labels = _inputs(20, 4, 9)
    labels = labels.masked_fill(labels == IGNORE, 9 + 5)  # an out-of-vocabulary marker as ignore_index
    loss = packed_linear_cross_entropy(hidden, weight, labels, ignore_index=14, chunk_size=3)
    ref = F.cross_entropy(F.linear(hidden, weight), labels, ignore_index=14)
    assert abs(_f(loss) - _f(ref)) <= RTOL * abs(_f(ref))


def test_default_chunk_size():
    assert default_chunk_size(32768, 4096, 131072) == 1024  # ceil(32768 / 32): [C, V] as large as [T, D]
    assert default_chunk_size(40000, 4096, 131072) == 2048  # rounded up to a power of two
    assert default_chunk_size(4096, 512, 32768) == 256  # at least 256 rows per matmul
    assert default_chunk_size(10, 8, 5) == 10  # never more than T


@pytest.mark.parametrize("change, error, match", [
    (dict(weight=torch.zeros(9, 5)), ValueError, "does not end in the weight's D"),
    (dict(weight=torch.zeros(9)), ValueError, r"weight must be the output projection \[V, D\]"),
    (dict(weight=torch.zeros(9, 4, dtype=torch.float64)), ValueError, "weight is torch.float64"),
    (dict(hidden=torch.zeros(20, 4, dtype=torch.int64)), TypeError, "floating-point"),
    (dict(labels=torch.zeros(19, dtype=torch.int64)), ValueError, "does not match labels shape"),
    (dict(labels=torch.zeros(20)), TypeError, "integer dtype"),
    (dict(labels=torch.full((20,), 9)), ValueError, r"label 9 at local position 0 is outside \[0, 9\)"),
    (dict(bias=torch.zeros(8)), ValueError, "bias shape"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size=2.5), TypeError, "chunk_size"),
    (dict(final_logit_softcapping=0.0), ValueError, "final_logit_softcapping must be a finite number > 0"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be in"),
    (dict(weight="lm_head"), TypeError, "weight must be a torch.Tensor"),
])
def test_bad_input_raises_clearly(change, error, match):
    args = dict(hidden=torch.zeros(20, 4), weight=torch.zeros(9, 4), labels=torch.zeros(20, dtype=torch.int64))
    args.update(change)
    hidden, weight, labels = args.pop("hidden"), args.pop("weight"), args.pop("labels")
    with pytest.raises(error, match=match):
        packed_linear_cross_entropy(hidden, weight, labels, **args)


# ---------------------------------------------------------------------------------------------- CP and DP on gloo


def _cp_worker(rank, world_size):
    torch.manual_seed(0)  # the same batch and model on every rank
    D, V = 8, 40
    doc = torch.tensor([[1] * 9 + [2] * 7 + [0] * 4, [3] * 12 + [4] * 8])
    ids = torch.randint(0, V, doc.shape)
    labels = next_token_labels(ids, doc)
    embed, head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V)
    params = list(embed.parameters()) + list(head.parameters())
    # The non-CP reference: F.cross_entropy on the full logits of the whole batch.
    ref = _reference(embed(ids.reshape(-1)), head.weight, head.bias, labels.reshape(-1), eps=0.1, cap=4.0)
    ref_grads = torch.autograd.grad(ref, params)
    out = {}
    for name, cp_group, dp_group in (("cp", dist.group.WORLD, None), ("dp", None, dist.group.WORLD)):
        if name == "cp":  # this rank's CP shard of the batch
            sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=world_size,
                                              cp_rank=rank, layout="contiguous")
            local_ids, local_labels = sharded.shard(ids), sharded.shard(labels)
        else:  # DP: each rank one replica's row, the count over both replicas
            sharded, local_ids, local_labels = None, ids[rank], labels[rank]
        share = packed_linear_cross_entropy(embed(local_ids), head.weight, local_labels, bias=head.bias,
                                            group=cp_group, dp_group=dp_group, sharded=sharded, label_smoothing=0.1,
                                            final_logit_softcapping=4.0, chunk_size=3)
        grads = [g.clone() for g in torch.autograd.grad(share, params)]
        for g in grads:
            dist.all_reduce(g)  # the loss contract: SUM the shares' gradients over the ranks
        total = share.detach().clone()
        dist.all_reduce(total)
        assert abs(_f(share) - _f(ref)) > 1e-3  # a genuine share, not the whole loss on every rank
        assert abs(_f(total) - _f(ref)) <= RTOL * abs(_f(ref)), (name, _f(total), _f(ref))
        _assert_close_rel(grads, ref_grads)
        out[name] = _f(total)
    return out


@pytest.mark.distributed
def test_cp_and_dp_shares_sum_to_the_non_cp_loss_and_gradients():
    results = run_distributed(_cp_worker, 2)
    assert results[0] == results[1]


# ------------------------------------------------------------------------------- HF models: hidden states, no logits


def _hf_model(kind: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              "gemma2": lambda: transformers.Gemma2Config(head_dim=8, final_logit_softcapping=2.0, **common),
              "cohere": lambda: transformers.CohereConfig(logit_scale=0.25, **common)}[kind]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


@pytest.mark.parametrize("kind, softcap", [("llama", None), ("gemma2", 2.0)])
def test_hf_model_loss_from_hidden_states_equals_the_loss_on_its_logits(kind, softcap):
    from cp_packing.trainer import forward_hidden, output_projection

    model = _hf_model(kind)
    projection, why = output_projection(model)
    assert why == "" and projection.softcap == softcap
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    labels = next_token_labels(ids, torch.tensor([[1] * 12 + [2] * 8]))[0]
    outputs, hidden = forward_hidden(model, projection, {"input_ids": ids})
    assert outputs.logits.shape == (1, 0, 64) and hidden.shape == (20, 32)  # the model built no logits
    loss = projection.loss(hidden, labels, chunk_size=6)
    ref = packed_cross_entropy(model(input_ids=ids).logits[0], labels)  # the model's own (soft-capped) logits
    assert abs(_f(loss) - _f(ref)) <= RTOL * abs(_f(ref))
    params = list(model.parameters())
    _assert_close_rel(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params), rtol=1e-4)


def test_a_model_that_changes_its_logits_after_the_projection_is_refused():
    from cp_packing.trainer import output_projection

    projection, why = output_projection(_hf_model("cohere"))  # logits * logit_scale
    assert projection is None and "logit_scale" in why and "CohereForCausalLM" in why
    projection, why = output_projection(torch.nn.Linear(4, 4))
    assert projection is None and "no nn.Linear output projection" in why
