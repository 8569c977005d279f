"""torch.compile runs the same CP attention as eager mode: no graph break, the same loss and gradients, no recompile.

One path: ``cp_model_inputs(..., model=model)`` prepares and agrees the step before the model runs, and every layer,
eager or compiled, runs the plan's one ``torch.library`` op (``cp_packing::attention_fwd``). The gradient checks
compile with ``backend="aot_eager"`` (dynamo and the real AOT autograd trace with the op's fake implementation);
inductor's CPU code generation (a C++ compile per fused kernel, minutes cold on the CI machines) is exercised on the
attention alone, where inductor emits no C++. The families whose features HF does not pass per layer (Llama 4's
chunks and query temperature, PhiMoE's and Qwen2-MoE's mask-only windows, Gemma 2's soft-capping, gpt-oss's sinks)
run compiled against their documents run alone, through the HF sweep's ``compiled`` mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from cp_packing import context_parallel_attention, packed_seq_params_from_doc_ids, shard_packed_seq_params  # noqa: E402
from cp_packing.attention import prepare_attention  # noqa: E402
from cp_packing.distributed import distribute_batch  # noqa: E402
from cp_packing.hf import cp_model_inputs, register_cp_attention  # noqa: E402
from cp_packing.loss import next_token_labels, packed_cross_entropy  # noqa: E402
from cp_packing.testing import run_distributed  # noqa: E402
from tests.test_model_features import _sweep_module  # noqa: E402

NAME = register_cp_attention()
RTOL, ATOL = 1e-5, 1e-6  # float32 rounding: the compiled graph may fuse and reorder pointwise ops
BACKENDS = ("allgather", "exchange", "ulysses", "hybrid")

# Two steps with the same T = 32 tokens and different documents (padding in both): a new map of the same shape
# must not recompile.
STEP_MAPS = (
    torch.tensor([[1] * 3 + [2] * 11 + [0] * 2, [1] * 9 + [2] * 7]),
    torch.tensor([[1] * 6 + [2] * 5 + [3] * 5, [1] * 12 + [0] * 4]),
)


def make_model() -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0)
    torch.manual_seed(99)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).float()


def _step(model, inputs: dict, labels: torch.Tensor, call=None) -> tuple[torch.Tensor, dict]:
    """This rank's loss share and its LOCAL parameter gradients (eager and compiled must match rank by rank)."""
    model.zero_grad(set_to_none=True)
    logits = (model if call is None else call)(**inputs).logits[0]  # [T_local, V]
    share = packed_cross_entropy(logits, labels.reshape(-1), sharded=inputs["cp_sharded"])
    share.backward()
    return share.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compile_worker(rank: int, world_size: int, backends: tuple[str, ...], layout: str) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    group, model, out = dist.group.WORLD, make_model(), {}
    for backend in backends:
        steps = []
        for i, doc in enumerate(STEP_MAPS):
            ids = torch.randint(0, 64, doc.shape, generator=torch.Generator().manual_seed(i))
            local, sharded = distribute_batch({"input_ids": ids, "labels": next_token_labels(ids, doc)},
                                              packed_seq_params_from_doc_ids(doc), group=group, layout=layout)
            options = {"backend": backend} | ({"ulysses_size": 2} if backend == "hybrid" else {})
            inputs = cp_model_inputs(local, sharded, group=group, model=model, **options)
            assert inputs["cp_sharded"].plan.backend == backend
            steps.append((inputs, local["labels"], _step(model, inputs, local["labels"])))  # eager reference
        torch._dynamo.reset()
        counters.clear()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter)
        frames = []
        for inputs, labels, (ref_loss, ref_grads) in steps:
            loss, grads = _step(model, inputs, labels, compiled)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
            for n in ref_grads:
                torch.testing.assert_close(grads[n], ref_grads[n], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, n=n: f"{backend} {n}: {m}")
            frames.append(counter.frame_count)
        out[backend] = {"frames": frames, "graph_breaks": dict(counters["graph_break"]),
                        "calls": steps[-1][0]["cp_sharded"].plan.layer_calls, "nonzero": float(steps[0][2][0]) != 0}
    return out


@pytest.mark.distributed
def test_every_backend_compiles_without_graph_break_and_matches_eager():
    """cp 2, a tiny Llama: for the all-gather, exchange, Ulysses and hybrid backends the compiled model's loss share
    and local gradients equal eager on two steps of different documents and one shape, with no graph break at all
    and no recompile for the second map; the layers counted themselves in both modes (the loss's guard)."""
    for rank, result in enumerate(run_distributed(_compile_worker, 2, BACKENDS, "contiguous")):
        for backend, r in result.items():
            assert r["graph_breaks"] == {}, (rank, backend, r["graph_breaks"])
            assert r["frames"][0] == r["frames"][1] >= 1, (rank, backend, r["frames"])  # no recompile
            assert r["calls"] == 2 * 2, (rank, backend, r["calls"])  # 2 layers, eager then compiled
        assert any(r["nonzero"] for r in result.values())


@pytest.mark.distributed
def test_the_exchange_compiles_at_cp4_on_a_balanced_layout():
    for rank, result in enumerate(run_distributed(_compile_worker, 4, ("exchange",), "balanced")):
        assert result["exchange"]["graph_breaks"] == {} and len(set(result["exchange"]["frames"])) == 1, result


@pytest.mark.distributed
def test_families_run_compiled_equal_their_documents_alone():
    """The families whose features HF does not pass to the attention per layer (Llama 4: chunks and the query
    temperature; PhiMoE, Qwen2-MoE: windows in HF's mask only) and those HF passes them for (Gemma 2: soft-capping;
    gpt-oss: sinks and windows) match their documents run alone at cp 2, eager AND compiled (the plan carries the
    features into the compiled layers: before, compiled Llama 4 / PhiMoE / Qwen2-MoE were silently wrong)."""
    sweep = _sweep_module()
    rows = sweep.sweep(["llama4_text", "phimoe", "qwen2_moe", "gemma2", "gpt_oss"], cp_size=2, timeout=300,
                       compiled=True)
    for row in rows:
        assert row.status == "match", row
        assert row.compiled.startswith("match ("), row
        loss, grad = (float(x) for x in row.compiled[len("match ("):-1].split(", "))
        assert loss < 1e-5 and grad < 1e-4, row


# --------------------------------------------------------------------------------------- attention alone


def _inductor_worker(rank: int, world_size: int) -> float:
    """The exchange backend's attention alone (zigzag, window, GQA) compiled by inductor equals eager."""
    doc = torch.tensor([[1] * 8 + [2] * 4 + [3] * 4, [1] * 12 + [0] * 4])
    sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(doc), cp_size=2, cp_rank=rank, layout="zigzag")
    step = prepare_attention(sharded, group=dist.group.WORLD, backend="exchange", window=6)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(16, h, 8, generator=g) for h in (4, 2, 2))

    def attend(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        return [out.detach()] + [x.grad for x in leaves]

    def layer(q, k, v):
        return context_parallel_attention(q, k, v, step, window=6)

    got, want = attend(torch.compile(layer, backend="inductor", fullgraph=True)), attend(layer)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


@pytest.mark.distributed
def test_inductor_runs_the_attention_op_with_the_eager_numbers():
    assert all(d < 1e-5 for d in run_distributed(_inductor_worker, 2))


def _cp1_step(**options):
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 5 + [2] * 7 + [0] * 4]))
    return prepare_attention(shard_packed_seq_params(params, cp_size=1, cp_rank=0), **options)


@pytest.mark.parametrize("backend", ["allgather", "exchange", "ulysses"])
def test_the_op_passes_torch_library_opcheck(backend):
    """Schema, fake implementation, autograd registration and AOT dispatch of the forward op; schema and fake
    implementation of the backward op (cp 1, a window)."""
    step = _cp1_step(backend=backend, window=3)
    plan = step.plan
    from cp_packing.attention.ops import layer_spec

    wire = plan.tables[(True, 3, None)]
    tables = [wire.blob, wire.sizes]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, h, 8, generator=g) for h in (4, 2, 2))
    spec = layer_spec(backend, plan.group_names, 1, 0, "torch", 0.3, True, 3, None, True, 0, 0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.library.opcheck(torch.ops.cp_packing.attention_fwd, (*leaves, None, tables, spec))
    outs = torch.ops.cp_packing.attention_fwd(q, k, v, None, tables, spec)
    dout = torch.randn(outs[0].shape, generator=g)
    torch.library.opcheck(torch.ops.cp_packing.attention_bwd, (dout, q, k, v, None, outs, tables, spec),
                          test_utils=("test_schema", "test_faketensor"))  # no autograd of its own: it IS the backward
    eager = context_parallel_attention(q, k, v, step, window=3, softmax_scale=0.3)  # the same implementation
    torch.testing.assert_close(eager, outs[0], rtol=0, atol=0)


def test_compiled_layers_read_only_what_the_step_prepared():
    """Under torch.compile a layer that asks for tables the step was not prepared for is refused with the fix
    (eager builds them, with a warning); ring-flash-attn (its own autograd) is refused under compile; the plan
    cannot be changed after its agreement."""
    step = _cp1_step(backend="exchange")
    q = torch.randn(16, 2, 8)
    with pytest.raises(Exception, match="prepare the step with the model"):  # dynamo wraps the ValueError
        torch.compile(lambda q: context_parallel_attention(q, q, q, step, window=4), backend="aot_eager",
                      fullgraph=True)(q)
    with pytest.warns(UserWarning, match="not prepared for"):
        eager = context_parallel_attention(q, q, q, step, window=5)
    assert eager.shape == q.shape and (True, 5, None) in step.plan.tables
    with pytest.raises(AttributeError, match="frozen"):
        step.plan.backend = "allgather"


def test_ring_flash_attn_is_refused_under_compile_with_the_fix(ring_flash_attn):
    params = packed_seq_params_from_doc_ids(torch.tensor([[1] * 4 + [2] * 4]))
    sharded = shard_packed_seq_params(params, cp_size=1, cp_rank=0, layout="contiguous")
    step = prepare_attention(sharded, backend="ring_flash_attn", num_heads=2, num_kv_heads=2, head_dim=8,
                             dtype=torch.float32)
    q = torch.randn(8, 2, 8)
    with pytest.raises(Exception, match="use backend=.exchange. or .allgather."):  # dynamo wraps it
        torch.compile(lambda q: context_parallel_attention(q, q, q, step), backend="aot_eager", fullgraph=True)(q)


def test_compiled_keyword_is_a_no_op_and_kept_one_release():
    doc = torch.tensor([[1] * 5 + [2] * 3])
    ids = torch.randint(0, 64, doc.shape)
    a = cp_model_inputs(ids, packed_seq_params_from_doc_ids(doc), compiled=True)
    b = cp_model_inputs(ids, packed_seq_params_from_doc_ids(doc))
    assert set(a) == set(b) and "cp_plan" not in a
    with pytest.raises(TypeError, match="compiled must be a bool"):
        cp_model_inputs(ids, packed_seq_params_from_doc_ids(doc), compiled="yes")
