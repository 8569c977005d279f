"""HF integration: a real transformers model running cp_packing attention matches the non-CP model.

References are independent of cp_packing's attention: HF's own eager attention with an explicit block-diagonal
causal 4-D mask and per-segment position ids built here from a plain-Python segmentation (``tests.maps.segments_of``),
and each document run alone through the model (no packing at all).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402

from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params  # noqa: E402
from cp_packing.distributed import distribute_batch  # noqa: E402
from cp_packing.hf import (  # noqa: E402
    CP_ATTENTION_NAME,
    check_transformers_version,
    cp_attention_forward,
    cp_model_inputs,
    register_cp_attention,
)
from cp_packing.loss import next_token_labels, packed_cross_entropy  # noqa: E402
from cp_packing.padding import pad_segments  # noqa: E402
from cp_packing.testing import run_distributed  # noqa: E402
from tests.maps import block_diagonal_causal, segments_of  # noqa: E402

NAME = register_cp_attention()
RTOL, ATOL = 1e-4, 1e-5
KINDS = ("llama", "qwen3")
HAS_PLANNER = importlib.util.find_spec("cp_packing.layouts.balanced") is not None


def make_model(kind: str, attn: str) -> torch.nn.Module:
    """Tiny float32 random-init model, GQA (4 query heads, 2 KV heads); the same weights for the same kind."""
    common = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attention_dropout=0.0)
    cfg = LlamaConfig(**common) if kind == "llama" else Qwen3Config(head_dim=8, **common)
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()


# Rows of 20, B=3 (T=60): cp=2 cuts at 30 (inside row 1's second document), cp=4 at 15/30/45 (inside documents of
# rows 0, 1 and 2). Rows 0 and 1 both start with index 1 (the row-start boundary keeps them apart), row 2 has a
# one-token document and tail padding.
CONTIGUOUS_MAP = torch.tensor([
    [1] * 20,
    [1] * 4 + [2] * 12 + [3] * 4,
    [1] * 9 + [2] * 1 + [3] * 7 + [0] * 3,
])
# Zigzag needs every segment % 2cp == 0: this map is re-laid with pad_segments(map, multiple=2 * cp) first.
ZIGZAG_BASE_MAP = torch.tensor([
    [1] * 11 + [2] * 5,
    [1] * 3 + [2] * 9 + [0] * 4,
])


def make_case(layout: str, cp: int, seed: int = 0) -> dict:
    """A packed batch for ``layout``: doc map, input ids, global labels, real-token mask, and the original layout."""
    base = ZIGZAG_BASE_MAP if layout == "zigzag" else CONTIGUOUS_MAP
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, base.shape, generator=g)
    if layout == "zigzag":
        padded = pad_segments(base, multiple=2 * cp, tensors={"input_ids": ids})
        doc, ids, real = padded.doc_ids, padded.tensors["input_ids"], ~padded.is_pad
    else:
        padded, doc, real = None, base, base != 0
    labels = next_token_labels(ids, doc, token_mask=real)
    return {"layout": layout, "doc": doc, "ids": ids, "labels": labels, "padded": padded, "base": base}


def reference(model: torch.nn.Module, doc: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor):
    """Eager attention with a block-diagonal causal mask over the flat stream: (logits [T, V], loss, grads)."""
    T = doc.numel()
    mask, pos = block_diagonal_causal(doc)  # [1, 1, T, T], [1, T]
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids.reshape(1, T), position_ids=pos, attention_mask=mask, use_cache=False).logits[0]
    loss = packed_cross_entropy(logits, labels.reshape(T))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def alone_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One document run alone (no packing, no mask, positions 0..L-1): logits [L, V]."""
    with torch.no_grad():
        return model(input_ids=ids.reshape(1, -1), use_cache=False).logits[0]


def check_documents(model_eager, case: dict, logits_full: torch.Tensor) -> float:
    """Every document's logits in the packed batch equal its logits alone; returns the max abs difference."""
    base = case["base"]
    if case["padded"] is not None:
        logits_bs = case["padded"].unpad(logits_full.reshape(*case["doc"].shape, -1))  # [B, S, V] original layout
        ids_bs = case["padded"].unpad(case["ids"])
    else:
        logits_bs, ids_bs = logits_full.reshape(*base.shape, -1), case["ids"]
    flat_doc, flat_ids, flat_logits = base.reshape(-1), ids_bs.reshape(-1), logits_bs.reshape(-1, logits_bs.shape[-1])
    worst = 0.0
    for a, b in segments_of(base):
        if int(flat_doc[a]) == 0:
            continue
        alone = alone_logits(model_eager, flat_ids[a:b])
        torch.testing.assert_close(flat_logits[a:b], alone, rtol=RTOL, atol=ATOL)
        worst = max(worst, float((flat_logits[a:b] - alone).abs().max()))
    return worst


def assert_grads_close(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    worst = 0.0
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=RTOL, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
        worst = max(worst, float((got[n] - expected[n]).abs().max()))
    return worst


# ------------------------------------------------------------------------------------------------ single process


def test_register_is_idempotent_and_builds_no_mask_function():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert register_cp_attention() == CP_ATTENTION_NAME == NAME
    assert register_cp_attention(name="cp_packing_other") == "cp_packing_other"
    assert AttentionInterface._global_mapping[NAME] is cp_attention_forward
    assert NAME not in AttentionMaskInterface._global_mapping  # HF builds no mask for it
    model = make_model("llama", NAME)
    assert model.config._attn_implementation == NAME
    model.set_attn_implementation("eager")
    model.set_attn_implementation("cp_packing_other")
    assert model.config._attn_implementation == "cp_packing_other"


def test_register_refuses_builtin_names_and_bad_versions():
    with pytest.raises(ValueError, match="already registered"):
        register_cp_attention(name="sdpa")
    with pytest.raises(ValueError, match="already registered"):
        register_cp_attention(name="eager")
    with pytest.raises(TypeError, match="non-empty str"):
        register_cp_attention(name="")
    with pytest.raises(ImportError, match="supports transformers"):
        check_transformers_version("4.57.1")
    assert check_transformers_version() == transformers.__version__


@pytest.mark.parametrize("kind", KINDS)
def test_cp1_matches_block_diagonal_eager_and_documents_alone(kind):
    """Without CP (a PackedSeqParams, no group): logits, loss and every gradient equal the masked eager model."""
    model, eager = make_model(kind, NAME), make_model(kind, "eager")
    case = make_case("contiguous", 1)
    ref_logits, ref_loss, ref_grads = reference(eager, case["doc"], case["ids"], case["labels"])
    params = packed_seq_params_from_doc_ids(case["doc"])
    logits = model(**cp_model_inputs(case["ids"], params)).logits[0]  # [T, V]
    loss = packed_cross_entropy(logits, case["labels"].reshape(-1))
    loss.backward()
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=RTOL, atol=ATOL)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, ref_grads)
    check_documents(eager, case, logits.detach())
    # The mask-free packed stream is NOT plain causal attention: the reference would catch a cross-document leak.
    leaky = eager(input_ids=case["ids"].reshape(1, -1), use_cache=False).logits[0]
    assert (leaky - ref_logits).abs().max() > 1e-3


def test_hf_drops_a_2d_attention_mask_and_cp_refuses_a_4d_one():
    model = make_model("llama", NAME)
    case = make_case("contiguous", 1)
    inputs = cp_model_inputs(case["ids"], packed_seq_params_from_doc_ids(case["doc"]))
    with torch.no_grad():
        plain = model(**inputs).logits
        # HF builds no mask for an implementation without a mask function: a collator's 2-D mask changes nothing.
        with_2d = model(**inputs, attention_mask=torch.ones_like(inputs["input_ids"])).logits
        torch.testing.assert_close(with_2d, plain, rtol=0, atol=0)
        T = inputs["input_ids"].shape[1]
        with pytest.raises(ValueError, match="attention_mask"):
            model(**inputs, attention_mask=torch.zeros(1, 1, T, T))


def test_is_causal_keyword_overrides_the_module_flag():
    """HF's sdpa path honours an is_causal keyword before module.is_causal; so does the CP attention."""
    model = make_model("llama", NAME)
    case = make_case("contiguous", 1)
    sharded = cp_model_inputs(case["ids"], packed_seq_params_from_doc_ids(case["doc"]))["cp_sharded"]
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(1, 4, 60, 8, generator=g), torch.randn(1, 2, 60, 8, generator=g)
    causal, _ = cp_attention_forward(attn, q, kv, kv, None, cp_sharded=sharded)
    full, _ = cp_attention_forward(attn, q, kv, kv, None, cp_sharded=sharded, is_causal=False)
    again, _ = cp_attention_forward(attn, q, kv, kv, None, cp_sharded=sharded, is_causal=True)
    assert torch.equal(causal, again) and not torch.allclose(causal, full)
    # the last token of each segment sees its whole segment either way
    last = (sharded.cu_seqlens[1:] - 1).long()
    torch.testing.assert_close(causal[0, last], full[0, last])


def test_attention_function_errors():
    model = make_model("llama", NAME)
    case = make_case("contiguous", 1)
    params = packed_seq_params_from_doc_ids(case["doc"])
    inputs = cp_model_inputs(case["ids"], params)
    with torch.no_grad():
        with pytest.raises(ValueError, match="cp_sharded"):
            model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False)
        with pytest.raises(TypeError, match="ShardedPackedSeqParams"):
            model(**{**inputs, "cp_sharded": params})
        with pytest.raises(ValueError, match="batch size 1"):
            model(**{**inputs, "input_ids": case["ids"], "position_ids": inputs["position_ids"].reshape(3, 20)})
        with pytest.raises(ValueError, match="T_local=60"):
            model(**{**inputs, "input_ids": inputs["input_ids"][:, :20], "position_ids": inputs["position_ids"][:, :20]})
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention_dropout = 0.0"):
        model(**inputs)
    model.eval()
    model(**inputs)  # no dropout in eval mode: fine

    sharded = inputs["cp_sharded"].without_plan()  # a step of its own: its first layer checks everything
    q = torch.randn(1, 4, 60, 8)
    kv = torch.randn(1, 2, 60, 8)
    attn = model.model.layers[0].self_attn
    for bad, match in (({"softcap": 0.0}, "softcap must be"), ({"s_aux": torch.zeros(3)}, r"sinks must have shape")):
        with pytest.raises(ValueError, match=match):  # softcap / sinks are supported, but checked
            cp_attention_forward(attn, q, kv, kv, None, cp_sharded=sharded, **bad)
    two = shard_packed_seq_params(packed_seq_params_from_doc_ids(case["doc"]), cp_size=2, cp_rank=0,
                                  layout="contiguous")
    with pytest.raises(ValueError, match="cp_group is None"):
        cp_attention_forward(attn, q[:, :, :30], kv[:, :, :30], kv[:, :, :30], None, cp_sharded=two)


def _inputs_worker(rank: int, world_size: int, case: dict) -> list:
    params = packed_seq_params_from_doc_ids(case["doc"])
    two = shard_packed_seq_params(params, cp_size=2, cp_rank=rank, layout="contiguous")
    local = two.shard(case["ids"])  # [30]
    group = dist.group.WORLD
    out = cp_model_inputs({"input_ids": local.unsqueeze(0), "labels": two.shard(case["labels"])}, two, group=group)
    assert out["input_ids"].shape == (1, 30) and out["position_ids"].shape == (1, 30)
    assert torch.equal(out["position_ids"][0], two.position_ids)
    assert out["use_cache"] is False and "attention_mask" not in out and "labels" not in out
    assert out["cp_sharded"].token_index is two.token_index and out["cp_sharded"].plan is not None  # the step
    assert out["cp_sharded"].plan.num_items == int((case["labels"] != -100).sum())  # counted over the group
    assert torch.equal(cp_model_inputs(local, two, group=group)["input_ids"], out["input_ids"])
    emb = cp_model_inputs({"inputs_embeds": torch.randn(30, 8)}, two, group=group, input_key="inputs_embeds")
    assert emb["inputs_embeds"].shape == (1, 30, 8)
    errors = []
    for call in (lambda: cp_model_inputs(case["ids"], two, group=group),
                 lambda: cp_model_inputs({"ids": local}, two, group=group),
                 lambda: cp_model_inputs(local, two, group=group, input_key="tokens"),
                 lambda: cp_model_inputs(local if rank == 0 else local[:-1], two, group=group)):  # one rank only
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.distributed
def test_cp_model_inputs_shapes_and_errors():
    """The kwargs of a prepared step; every mistake raised on every rank, by the step's agreement."""
    case = make_case("contiguous", 1)
    two = shard_packed_seq_params(packed_seq_params_from_doc_ids(case["doc"]), cp_size=2, cp_rank=1,
                                  layout="contiguous")
    with pytest.raises(TypeError, match="ProcessGroup, a 1-D DeviceMesh or None"):
        cp_model_inputs(two.shard(case["ids"]), two, group=object())
    with pytest.raises(ValueError, match="group is None"):
        cp_model_inputs(two.shard(case["ids"]), two)
    with pytest.raises(TypeError, match="ShardedPackedSeqParams"):
        cp_model_inputs(two.shard(case["ids"]), case["doc"])
    for errors in run_distributed(_inputs_worker, 2, case):
        assert len(errors) == 4, errors
        assert "T_local=30" in errors[0] and "no 'input_ids'" in errors[1] and "input_key" in errors[2]
        assert "raised on CP group rank 1" in errors[3]


# ------------------------------------------------------------------------------------------------ distributed


def _layouts() -> list[str]:
    return ["contiguous", "zigzag"] + (["balanced"] if HAS_PLANNER else [])


def _local_batch(case: dict, group, layout: str):
    """This rank's ``{input_ids, labels, position_ids: [1, T_local]}`` and its ShardedPackedSeqParams."""
    params = packed_seq_params_from_doc_ids(case["doc"])
    return distribute_batch({"input_ids": case["ids"], "labels": case["labels"]}, params, group=group, layout=layout)


def _parity_worker(rank: int, world_size: int, models: dict, cases: list, backend: str = "auto",
                   ulysses_size: int | None = None) -> dict:
    group = dist.group.WORLD
    out = {}
    for kind, layout, case in cases:
        model = models[kind]
        model.zero_grad(set_to_none=True)
        local, sharded = _local_batch(case, group, layout)
        assert sharded.layout == layout and sharded.cp_rank == rank
        inputs = cp_model_inputs(local, sharded, group=group, backend=backend, ulysses_size=ulysses_size)
        logits = model(**inputs).logits[0]  # [T_local, V]
        share = packed_cross_entropy(logits, local["labels"].reshape(-1), group=group)
        share.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
            grads[n] = g
        # Every rank returns every rank's shares and logits (so that a torchrun launch, where this process sees only
        # its own result, checks the same). numpy, not tensors: once torch.multiprocessing is imported
        # (transformers does), tensors cross the result queue as shared-memory handles that die with this process.
        shares = [None] * world_size
        parts = [None] * world_size
        dist.all_gather_object(shares, float(share.detach()), group=group)
        dist.all_gather_object(parts, logits.detach().numpy(), group=group)
        out[(kind, layout)] = {"shares": shares, "logits": parts, "grads": {n: g.numpy() for n, g in grads.items()}}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_model_matches_non_cp_model(cp):
    """For every layout and model: sum of loss shares == cp=1 loss, SUM-reduced grads == cp=1 grads, and each
    document's logits == the document alone. One spawn per cp size (every model and layout in it)."""
    models = {kind: make_model(kind, NAME) for kind in KINDS}
    cases = [(kind, layout, make_case(layout, cp, seed=cp)) for kind in KINDS for layout in _layouts()]
    report = _check_parity(cp, cases, run_distributed(_parity_worker, cp, models, cases))
    print(f"cp={cp} max abs diff (loss, grads, doc logits): {report}")


@pytest.mark.distributed
def test_cp_model_matches_non_cp_model_with_ulysses():
    """``cp_model_inputs(..., backend="ulysses")`` at cp 4 with 4 query and 2 key/value heads (each key/value head
    replicated on two ranks): the same loss, gradients and document logits as the model on the whole batch."""
    cp = 4
    models = {"llama": make_model("llama", NAME)}
    cases = [("llama", layout, make_case(layout, cp, seed=cp + 1)) for layout in _layouts()]
    report = _check_parity(cp, cases, run_distributed(_parity_worker, cp, models, cases, "ulysses"))
    print(f"ulysses cp={cp} max abs diff (loss, grads, doc logits): {report}")


@pytest.mark.distributed
def test_cp_model_matches_non_cp_model_with_hybrid():
    """``backend="hybrid", ulysses_size=2`` at cp 4 (4 query / 2 key-value heads): the same loss, gradients and
    document logits as the model on the whole batch."""
    cp = 4
    models = {"qwen3": make_model("qwen3", NAME)}
    cases = [("qwen3", layout, make_case(layout, cp, seed=cp + 2)) for layout in _layouts()]
    report = _check_parity(cp, cases, run_distributed(_parity_worker, cp, models, cases, "hybrid", 2))
    print(f"hybrid U=2 cp={cp} max abs diff (loss, grads, doc logits): {report}")


def _check_parity(cp: int, cases: list, results: list) -> dict:
    """Rank 0's result (every rank's shares and logits) against the eager model on the whole batch."""
    report = {}
    for kind, layout, case in cases:
        eager = make_model(kind, "eager")
        ref_logits, ref_loss, ref_grads = reference(eager, case["doc"], case["ids"], case["labels"])
        got = results[0][(kind, layout)]  # (under torchrun: this rank's, which holds every rank's shares and logits)
        total = torch.tensor(sum(got["shares"]), dtype=torch.float32)
        torch.testing.assert_close(total, ref_loss, rtol=RTOL, atol=ATOL)
        assert sum(abs(x) > 0 for x in got["shares"]) >= 2  # genuine shares, not the loss on every rank
        sharded = shard_packed_seq_params(packed_seq_params_from_doc_ids(case["doc"]), cp_size=cp, cp_rank=0,
                                          layout=layout)
        parts = [torch.from_numpy(x) for x in got["logits"]]
        logits = sharded.unshard(parts).reshape(-1, ref_logits.shape[-1])  # [T, V] global order
        torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=ATOL)
        g = assert_grads_close({n: torch.from_numpy(x) for n, x in got["grads"].items()}, ref_grads)
        d = check_documents(eager, case, logits)
        report[(kind, layout)] = (float((total - ref_loss).abs()), g, d)
    return report


def test_cp1_runs_under_autocast_like_sdpa():
    """Standard AMP (float32 weights + torch.autocast): HF's RoPE hands over float32 q/k with a bf16 v. The CP
    attention runs in the autocast dtype (forward and backward), as HF's sdpa does, and matches sdpa with a
    block-diagonal causal mask under the same autocast to bf16 rounding."""
    model, sdpa = make_model("llama", NAME), make_model("llama", "sdpa")
    case = make_case("contiguous", 1)
    doc, ids = case["doc"], case["ids"]
    T = doc.numel()
    mask, pos = block_diagonal_causal(doc)  # [1, 1, T, T], [1, T]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(**cp_model_inputs(ids, packed_seq_params_from_doc_ids(doc))).logits[0]  # [T, V]
        with torch.no_grad():
            ref = sdpa(input_ids=ids.reshape(1, T), position_ids=pos, attention_mask=mask,
                       use_cache=False).logits[0]
        fp32 = make_model("llama", "sdpa")
    with torch.no_grad():
        exact = fp32(input_ids=ids.reshape(1, T), position_ids=pos, attention_mask=mask, use_cache=False).logits[0]
    assert logits.dtype == ref.dtype
    scale = float(exact.abs().max())
    err, ref_err = float((logits.float() - ref.float()).abs().max()), float((ref.float() - exact).abs().max())
    assert err <= 2 * ref_err + 1e-2 * scale, (err, ref_err, scale)  # bf16 rounding, as sdpa's own
    packed_cross_entropy(logits, case["labels"].reshape(-1)).backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # Outside autocast, mixed dtypes stay a clear error (no silent cast).
    sharded = cp_model_inputs(ids, packed_seq_params_from_doc_ids(doc))["cp_sharded"]
    q = torch.randn(1, 4, T, 8)
    with pytest.raises(TypeError, match="share one dtype"):
        cp_attention_forward(model.model.layers[0].self_attn, q, q[:, :2], q[:, :2].bfloat16(), None,
                             cp_sharded=sharded)
