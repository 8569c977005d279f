"""torch.compile sees through cp-packing's CP attention: no graph break, the same loss and gradients, no recompile.

A tiny random Qwen2 (layer 0 full attention, layer 1 a sliding window of 6; GQA 4/2 heads, float32) under CP at
cp 2 on gloo, with the inputs of ``cp_model_inputs(..., compiled=True)``. The reference is the same model called
eagerly with the same inputs (the eager all-gather backend, itself tested against HF's own attention in
tests/test_hf.py and tests/test_hf_window.py). The gradient check compiles with ``backend="aot_eager"`` (the real
AOT autograd trace with the ops' fake implementations); inductor's CPU code generation (a C++ compile per fused
kernel, minutes cold on the CI machines) is exercised on the attention ops alone, where inductor emits no C++.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from cp_packing import context_parallel_attention, packed_seq_params_from_doc_ids, shard_packed_seq_params  # noqa: E402
from cp_packing.attention.ops import (  # noqa: E402
    CompiledAttentionPlan,
    compiled_allgather_attention,
    prepare_compiled_attention,
)
from cp_packing.distributed import distribute_batch  # noqa: E402
from cp_packing.hf import cp_model_inputs, register_cp_attention  # noqa: E402
from cp_packing.loss import next_token_labels, packed_cross_entropy  # noqa: E402
from cp_packing.testing import run_distributed  # noqa: E402

NAME = register_cp_attention()
RTOL, ATOL = 1e-5, 1e-6  # float32 rounding: the compiled graph may fuse and reorder pointwise ops
WINDOW = 6

# Two steps with the same T = 32 tokens (T_local = 16 at cp 2) and different documents: step 1 contiguous (its keys
# are one range of the gathered K/V), step 2 zigzag (every segment a multiple of 2 * cp = 4; keys by index).
# Documents longer and shorter than the window; padding in both.
STEP_MAPS = (
    ("contiguous", torch.tensor([[1] * 3 + [2] * 11 + [0] * 2, [1] * 9 + [2] * 7])),
    ("zigzag", torch.tensor([[1] * 8 + [2] * 4 + [3] * 4, [1] * 12 + [0] * 4])),
)


def make_model() -> torch.nn.Module:
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0,
                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(99)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).float()


def _step(model, inputs: dict, labels: torch.Tensor, group, call=None) -> tuple[torch.Tensor, dict]:
    """This rank's loss share and its LOCAL parameter gradients (not reduced: eager and compiled must match rank by
    rank); ``call``: the compiled model (default: ``model`` itself)."""
    model.zero_grad(set_to_none=True)
    logits = (model if call is None else call)(**inputs).logits[0]  # [T_local, V]
    share = packed_cross_entropy(logits, labels.reshape(-1), group=group)
    share.backward()
    return share.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _cp_break_reasons(explanation) -> list[str]:
    """The graph breaks whose reason or user stack points into cp_packing."""
    found = []
    for b in explanation.break_reasons:
        where = [f"{f.filename}:{f.lineno}" for f in (b.user_stack or [])]
        if "cp_packing" in b.reason or any("cp_packing" in w for w in where):
            found.append(f"{b.reason.splitlines()[0]} at {where[-1:] or '?'}")
    return found


def _compile_worker(rank: int, world_size: int) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend

    group = dist.group.WORLD
    model = make_model()
    steps = []
    for layout, doc in STEP_MAPS:
        ids = torch.randint(0, 64, doc.shape, generator=torch.Generator().manual_seed(len(steps)))
        labels = next_token_labels(ids, doc)
        local, sharded = distribute_batch({"input_ids": ids, "labels": labels}, packed_seq_params_from_doc_ids(doc),
                                          group=group, layout=layout)
        inputs = cp_model_inputs(local, sharded, group=group, compiled=True, model=model)  # with the guards
        assert isinstance(inputs["cp_plan"], CompiledAttentionPlan) and inputs["cp_sharded"].plan.options.backend == "allgather"
        steps.append((inputs, local["labels"], _step(model, inputs, local["labels"], group)))  # eager reference

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(**steps[0][0])
    result = {"graphs": explanation.graph_count, "breaks": explanation.graph_break_count,
              "cp_breaks": _cp_break_reasons(explanation)}

    torch._dynamo.reset()  # explain's entries out of the code cache
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    for i, (inputs, labels, (ref_loss, ref_grads)) in enumerate(steps):
        loss, grads = _step(model, inputs, labels, group, compiled)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
        result[f"frames_after_step_{i + 1}"] = counter.frame_count
    result["nonzero_share"] = float(steps[0][2][0]) != 0.0
    sharded = steps[0][0]["cp_sharded"]
    try:  # a mistake on rank 1 only (a batch without input_ids) is raised on both ranks, before any collective hangs
        cp_model_inputs({} if rank == 1 else steps[0][0], sharded, group=group, compiled=True)
    except ValueError as exc:
        result["one_rank_error"] = str(exc)
    result["inductor"] = _inductor_attention(rank, steps[1][0])
    return result


def _inductor_attention(rank: int, inputs: dict) -> float:
    """The attention ops alone (zigzag plan, window, GQA) compiled by inductor: out and grads equal the eager
    all-gather backend. Returns the largest difference."""
    sharded, plan = inputs["cp_sharded"], inputs["cp_plan"]
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(16, h, 8, generator=g) for h in (4, 2, 2))

    def attend(fn, *args, **kwargs):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, *args, window=WINDOW, **kwargs)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    got = attend(torch.compile(compiled_allgather_attention, backend="inductor"), plan)
    want = attend(context_parallel_attention, sharded, group=dist.group.WORLD, backend="allgather")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


@pytest.mark.distributed
def test_compiled_model_has_no_cp_graph_break_and_matches_eager():
    """cp 2: ``torch._dynamo.explain`` finds no graph break in cp_packing (the total is printed); the
    compiled model's loss share and local gradients equal eager on two steps (contiguous, then zigzag documents
    with the same token count) without a recompile; inductor runs the ops with the eager backend's numbers; a
    one-rank mistake in ``cp_model_inputs(compiled=True)`` is raised on every rank."""
    results = run_distributed(_compile_worker, 2)
    for rank, r in enumerate(results):
        print(f"rank {rank}: graphs {r['graphs']}, graph breaks {r['breaks']} (in cp_packing: {len(r['cp_breaks'])}); "
              f"compiled frames after steps 1, 2: {r['frames_after_step_1']}, {r['frames_after_step_2']}; "
              f"inductor ops max abs diff {r['inductor']:.2e}")
        assert r["cp_breaks"] == [], r["cp_breaks"]  # (with transformers 5.24: no break at all, one graph)
        assert r["frames_after_step_2"] == r["frames_after_step_1"]  # new documents, same T_local: no recompile
        assert "has no 'input_ids'" in r["one_rank_error"] and "raised on CP group rank 1" in r["one_rank_error"]
    assert any(r["nonzero_share"] for r in results)


# ------------------------------------------------------------------------------------------------ one process


def _plan(doc: torch.Tensor, **kwargs) -> tuple:
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=1, cp_rank=0)
    return sharded, prepare_compiled_attention(sharded, **kwargs)


def test_ops_pass_torch_library_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch (forward op), schema and fake
    implementation (backward op), with a window; cp 1 (no group)."""
    sharded, plan = _plan(torch.tensor([[1] * 5 + [2] * 7 + [0] * 4]))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, h, 8, generator=g) for h in (4, 2, 2))
    meta = (plan.key_index, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.sizes)
    options = ("", 1, 0.3, True, "torch", 3, None)  # group (none), cp 1, scale, causal, kernel, window 3, softcap
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.cp_packing.allgather_attention_fwd, (*leaves, *meta, None, *options))
    out, lse = torch.ops.cp_packing.allgather_attention_fwd(q, k, v, *meta, None, *options)
    dout = torch.randn(out.shape, generator=g)
    torch.library.opcheck(torch.ops.cp_packing.allgather_attention_bwd,
                          (dout, q, k, v, out, lse, *meta, None, *options),
                          test_utils=("test_schema", "test_faketensor"))  # no autograd of its own: it IS the backward


def test_compiled_attention_equals_the_eager_backend_with_window_and_gqa():
    sharded, plan = _plan(torch.tensor([[1] * 9 + [2] * 5 + [0] * 2, [1] * 16]))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(32, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    for window in (None, 4):
        got = compiled_allgather_attention(q, k, v, plan, softmax_scale=0.5, window=window)
        want = context_parallel_attention(q, k, v, sharded, softmax_scale=0.5, backend="allgather", window=window)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same kernel on the same keys
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        grads_eager = torch.autograd.grad(want.square().sum(), (q, k, v))
        for a, b in zip(grads, grads_eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_inputs_and_errors():
    doc = torch.tensor([[1] * 5 + [2] * 3])
    params = packed_seq_params_from_doc_ids(doc)
    ids = torch.randint(0, 64, doc.shape)
    inputs = cp_model_inputs(ids, params, compiled=True)
    plan = inputs["cp_plan"]
    assert plan.group_name == "" and plan.cp_size == 1 and plan.sizes.device.type == "cpu"
    assert plan.sizes.tolist() == [8, 5, 5, 0]  # T_local, longest run, longest key range, keys from gathered row 0
    assert "cp_plan" not in cp_model_inputs(ids, params)  # eager inputs unchanged
    with pytest.raises(ValueError, match="backend='ulysses' has no compiled path"):
        cp_model_inputs(ids, params, backend="ulysses", compiled=True)
    with pytest.raises(TypeError, match="compiled must be a bool"):
        cp_model_inputs(ids, params, compiled="yes")
    with pytest.raises(ValueError, match="T_local"):  # a plan of another batch: refused when the op runs
        six = packed_seq_params_from_doc_ids(torch.ones(1, 6, dtype=torch.long))
        other = cp_model_inputs(torch.randint(0, 64, (1, 6)), six, compiled=True)["cp_plan"]
        q = torch.randn(8, 2, 4)
        compiled_allgather_attention(q, q, q, other)
    with pytest.raises(TypeError, match="CompiledAttentionPlan"):
        compiled_allgather_attention(torch.randn(8, 2, 4), torch.randn(8, 2, 4), torch.randn(8, 2, 4), {"plan": 1})


def test_softcap_and_sinks_reach_the_kernels_with_the_sinks_gradient():
    """``softcap`` and ``sinks`` go through the ops to the kernels; out and the q/k/v/sinks gradients equal the
    kernels' own differentiable ``varlen_attention`` on the same runs (cp 1: a run's keys are its segment)."""
    from cp_packing.attention import kernels

    if not {"softcap", "sinks"} <= set(inspect.signature(kernels.varlen_attention_forward).parameters):
        pytest.skip("these kernels take no softcap=/sinks= yet")
    sharded, plan = _plan(torch.tensor([[1] * 9 + [2] * 5 + [0] * 2]))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(16, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    cu, longest = sharded.cu_seqlens, sharded.max_seqlen
    for window in (None, 3):
        got = compiled_allgather_attention(q, k, v, plan, window=window, softcap=2.0, sinks=sinks)
        want = kernels.varlen_attention(q, k, v, cu, cu, longest, longest, window=window, softcap=2.0, sinks=sinks)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        weights = torch.randn(got.shape, generator=g)
        grads = torch.autograd.grad((got * weights).sum(), (q, k, v, sinks))
        grads_want = torch.autograd.grad((want * weights).sum(), (q, k, v, sinks))
        for a, b in zip(grads, grads_want):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
