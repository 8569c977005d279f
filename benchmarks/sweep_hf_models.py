"""Sweep every causal-LM architecture transformers ships: is its CP run right, refused, or silently wrong?

For each ``model_type`` of ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and the
``VARIANTS`` rows: a family with an option that matters, e.g. Phi-3's long-context RoPE):

1. build a tiny random config (2 layers, hidden 32, 4 query / 2 key-value heads, vocab 128, 4 experts, windows and
   chunks of 4 where the config has them, both kinds of layer where the family's ``layer_types`` mixes them;
   ``FIXES`` holds the per-family exceptions) and the model on the CPU, float32, eval mode; a family that cannot be
   built tiny is ``skipped`` with the reason (``SKIPS``);
2. ask ``cp_packing.model_features.attention_features(config)`` / ``check_cp_supported``: a refusal names the layer
   type or family (the runs below still happen, without the model guard, to show what CP would give if forced);
3. run the same weights with ``attn_implementation=cp_packing.hf.register_cp_attention()`` on a packed batch at cp 1
   (one process) and cp 2 (``cp_packing.testing.run_ranks``, gloo, all families in one set of ranks), inputs from
   ``cp_packing.hf.cp_model_inputs(..., model=model)`` (its guards on), loss from ``packed_cross_entropy``,
   gradients SUM-reduced over CP;
4. the features probe: the packed batch at cp 1 through a dense reference attention that applies the layer's
   ``ModelFeatures`` (document, causal, window, chunk, query temperature; positions inside each document) instead
   of HF's kwargs, and a record of the ``sliding_window`` HF passes to each layer: does attention that applies the
   features reproduce HF? (the lead's target for the families HF masks only);
5. compare each with the reference: every document ALONE through the eager model (``attn_implementation="eager"``,
   HF's own masks and positions), loss and every gradient.

Status: ``match`` (loss within 1e-5 relative; every parameter's gradient within 1e-3 of its largest entry, or of
1e-4 of the model's largest gradient for gradients that are 0 up to rounding), ``MISMATCH (silently wrong)``,
``refused (check_cp_supported)``, ``refused at construction`` (HF would not build it with the implementation),
``refused at run`` (a ValueError / TypeError from cp_packing's own code: the model guard or the attention),
``error`` (another exception: loud, but not a clear refusal), ``skipped``.

Run:  PYTHONPATH=. python benchmarks/sweep_hf_models.py              (every family; a few minutes on 2 cores)
      PYTHONPATH=. python benchmarks/sweep_hf_models.py --quick      (llama, qwen2 with a window, lfm2, phimoe: seconds)
      PYTHONPATH=. python benchmarks/sweep_hf_models.py --types phimoe llama4_text
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

QUICK = ("llama", "qwen2", "lfm2", "phimoe")
WINDOW = CHUNK = 4  # shorter than the 12- and 9-token documents below, longer than the 3- and 2-token ones
MATCH_LOSS_RTOL, MATCH_GRAD_RTOL = 1e-5, 1e-3
BUILD_SECONDS = 60  # a family that takes longer to build and run once is skipped
MAX_PARAMS = 20_000_000

# Rows of 12 (B=3, T=36): documents of 12, 3, 9, 2 and 7 tokens, 3 padding tokens; cp 2 cuts at token 18, inside
# the 9-token document. Windows and chunks of 4 cut the 12-, 9- and 7-token documents.
DOC_MAP = torch.tensor([
    [1] * 12,
    [1] * 3 + [2] * 9,
    [1] * 2 + [2] * 7 + [0] * 3,
])

# Tiny values, passed to a config only for the fields its class has (dataclass fields or attribute_map names).
TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    initializer_range=0.1, tie_word_embeddings=False,
    # dropout off everywhere (eval mode too)
    attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, activation_dropout=0.0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, embed_dropout=0.0,
    # encoder-decoder style decoders, GPT-2 style names
    d_model=32, decoder_layers=2, encoder_layers=2, decoder_ffn_dim=64, encoder_ffn_dim=64, ffn_dim=64,
    decoder_attention_heads=4, encoder_attention_heads=4, n_inner=64, num_decoder_layers=2, num_encoder_layers=2,
    is_decoder=True, add_cross_attention=False,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2, moe_topk=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=1, router_jitter_noise=0.0, input_jitter_noise=0.0,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    # sparse attention indexers
    index_n_heads=2, index_head_dim=8, index_topk=4,
    # linear attention / SSM / convolution mixers
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4,
    ssm_state_size=8, state_size=8, expand=2, conv_kernel=4, n_groups=1, time_step_rank=4,
    # mask-only features
    sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1, attention_chunk_size=CHUNK,
    floor_scale=CHUNK,  # Llama 4's query temperature grows from the 4th token of a row (8192 in its configs)
    index_block_size=2, index_topk_blocks=2, index_local_blocks=1,  # MiniMax-M3's block indexer
)

# Per-family exceptions to TINY (config kwargs; "<type>.<sub_config>" for a sub-config of a composite config).
FIXES: dict[str, dict[str, Any]] = {
    "codegen": dict(rotary_dim=4), "gptj": dict(rotary_dim=4),
    "bamba": dict(attn_layer_indices=[1]),  # one Mamba-2 layer, one attention layer
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0,
                                                                  "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
    "dots3_note_text": dict(num_key_value_heads=4), "dots3_note.text_config": dict(num_key_value_heads=4),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8),
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,
                         laurel_rank=4),
    "gemma4_text": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8),
    "gemma4_unified_text": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8),
    "gemma4_assistant.text_config": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=128),
    "gemma4_unified_assistant.text_config": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=128),
    "gemma4.text_config": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8),
    "gemma4_unified.text_config": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=8),
    "minimax_m3_vl_text": dict(layer_types=["minimax_m3_sparse", "full_attention"]),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "longcat_flash": dict(num_layers=1, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32,
                          head_dim=4, qk_head_dim=8),
    "mamba2": dict(num_heads=8),
    "llama4_text": dict(no_rope_layers=[1, 0]), "llama4.text_config": dict(no_rope_layers=[1, 0]),  # a NoPE layer
    "mpt.attn_config": dict(attn_pdrop=0),
    "xlnet": dict(n_head=4, d_head=8),
    "zaya": dict(num_experts_per_tok=1),
}

# Extra rows: a family with a config option that changes what packing / CP must do (row name -> family, kwargs).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Phi-3 long-context RoPE: long factors when max(position_ids) + 1 > original_max_position_embeddings (8 here)
    "phi3+longrope": ("phi3", dict(original_max_position_embeddings=8, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
        "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": [1.0, 2.0, 4.0, 8.0]})),
    # dynamic NTK RoPE: rescaled when max(position_ids) + 1 > max_position_embeddings (8 here)
    "llama+dynamic": ("llama", dict(max_position_embeddings=8, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})),
}

# Families not built here, and why.
SKIPS: dict[str, str] = {
    "blt": "byte latent transformer: its hash n-gram embeddings have millions of rows even in a tiny config",
    "gemma3n": "its vision tower needs timm (not installed here); its text decoder is swept as gemma3n_text",
    "gemma4_assistant": "a draft model: its forward needs the main model's shared key/value states",
    "gemma4_unified_assistant": "a draft model: its forward needs the main model's shared key/value states",
    "musicgen": "an audio-codebook decoder: its input is num_codebooks token streams, not one packed row",
    "musicgen_melody": "an audio-codebook decoder: its input is num_codebooks token streams, not one packed row",
}


class Skip(Exception):
    """A family that cannot be built tiny on the CPU here (the message says why)."""


@dataclass
class Row:
    model_type: str
    architecture: str
    status: str
    loss_diff: float | None = None
    grad_rel: float | None = None
    cp1: str = ""
    features: str = ""
    note: str = ""
    compiled: str = ""


# ---------------------------------------------------------------------------------------------------- configs


def _config_fields(cls: type) -> set[str]:
    """The settable names of a config class: its dataclass fields and the aliases of fields (attribute_map)."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | {alias for alias, name in getattr(cls, "attribute_map", {}).items() if name in names}


def _two_layer_types(types: list[str]) -> list[str]:
    """Two layers that cover up to two kinds of the default pattern (e.g. [sliding, full], [linear, full])."""
    first = types[0]
    other = next((t for t in types if t != first), first)
    return [first, other]


def _tiny_kwargs(cls: type) -> dict[str, Any]:
    fields = _config_fields(cls)
    kwargs = {k: v for k, v in TINY.items() if k in fields}
    if "kv_lora_rank" in fields:  # multi-head latent attention: as many key/value heads as query heads, and
        kwargs["num_key_value_heads"] = TINY["num_attention_heads"]  # q/k heads (nope + rope) as wide as v heads
        kwargs.pop("head_dim", None)
    if "layer_types" in fields:  # the family's own pattern at its default depth, cut to two layers
        try:
            types = cls(**{k: v for k, v in kwargs.items() if k != "num_hidden_layers"}).layer_types
        except Exception:  # noqa: BLE001 - the family's own layer_types logic decides
            types = None
        if types:
            kwargs["layer_types"] = _two_layer_types(list(types))
    return kwargs


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (sub-configs of composite models made tiny too); raises ``Skip``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type in SKIPS:
        raise Skip(SKIPS[model_type])
    extra: dict[str, Any] = {}
    if model_type in VARIANTS:
        model_type, extra = VARIANTS[model_type]
    cls = CONFIG_MAPPING[model_type]
    kwargs = _tiny_kwargs(cls)
    subs = getattr(cls, "sub_configs", {})
    default = cls() if subs else None
    for name in subs:  # each sub-config (text, vision, audio) tiny too, of the class the default config picks
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[name] = type(sub)(**(_tiny_kwargs(type(sub)) | FIXES.get(f"{model_type}.{name}", {})))
    kwargs |= FIXES.get(model_type, {}) | extra
    return cls(**kwargs)


def build(config, attn: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn)
    if hasattr(model, "set_default_language"):  # X-MOD
        model.set_default_language(next(iter(config.languages)))
    return model.float().eval()


def _param_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- the runs


def make_case(vocab: int, seed: int = 7) -> dict:
    from cp_packing.loss import next_token_labels

    ids = torch.randint(3, vocab, DOC_MAP.shape, generator=torch.Generator().manual_seed(seed))
    return {"doc": DOC_MAP, "ids": ids, "labels": next_token_labels(ids, DOC_MAP, token_mask=DOC_MAP != 0)}


def _segments(doc: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, doc index) of every run of one document index in each row, in flat order."""
    out, S = [], doc.shape[1]
    for b, row in enumerate(doc.tolist()):
        start = 0
        for s in range(1, S + 1):
            if s == S or row[s] != row[start]:
                out.append((b * S + start, b * S + s, row[start]))
                start = s
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def documents_alone(model: torch.nn.Module, case: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """Each document alone through ``model`` (HF's own masks and positions 0..L-1): (loss, gradients)."""
    from cp_packing.loss import packed_cross_entropy

    model.zero_grad(set_to_none=True)
    flat_ids = case["ids"].reshape(-1)
    rows = []
    for a, b, d in _segments(case["doc"]):
        if d == 0:
            rows.append(torch.zeros(b - a, model.config.get_text_config().vocab_size))
        else:
            rows.append(model(input_ids=flat_ids[a:b].reshape(1, -1), use_cache=False).logits[0].float())
    loss = packed_cross_entropy(torch.cat(rows), case["labels"].reshape(-1))
    loss.backward()
    return float(loss), _grads(model)


def cp_step(model: torch.nn.Module, case: dict, *, group, cp_size: int, cp_rank: int, layout: str,
            guard: bool, compiled: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """One CP rank's forward/backward: (this rank's loss share, its local gradients); ``compiled``: the model under
    ``torch.compile`` (aot_eager: dynamo and AOT autograd, no code generation), prepared with ``model=``."""
    from cp_packing import packed_seq_params_from_doc_ids, shard_packed_seq_params
    from cp_packing.hf import cp_model_inputs
    from cp_packing.loss import packed_cross_entropy

    model.zero_grad(set_to_none=True)
    params = packed_seq_params_from_doc_ids(case["doc"])
    sharded = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    inputs = cp_model_inputs(sharded.shard(case["ids"]), sharded, group=group,
                             model=model if guard or compiled else None)
    call = model
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(model, backend="aot_eager")
    logits = call(**inputs).logits[0].float()  # [T_local, V]
    # the step was prepared without labels: the count is all-reduced over the CP group, named explicitly
    share = packed_cross_entropy(logits, sharded.shard(case["labels"]), sharded=inputs["cp_sharded"], group=group)
    share.backward()
    return float(share), _grads(model)


def _describe(exc: BaseException) -> tuple[str, str]:
    """("refused at run", text) for a ValueError / TypeError / NotImplementedError raised by cp_packing's own code
    (a clear refusal), else ("error", text)."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        where, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    own = "/cp_packing/" in where.replace("\\", "/") and "/benchmarks/" not in where
    loud = own and isinstance(exc, (ValueError, TypeError, NotImplementedError))
    return ("refused at run" if loud else "error"), _short(exc)


def _cp_worker(rank: int, world_size: int, jobs: list, layout: str, compiled: bool = False) -> dict:
    """Every job's loss and SUM-reduced gradients at cp ``world_size`` (rank 0 returns them), or its error."""
    group = dist.group.WORLD
    out = {}
    for name, model, case, guard in jobs:
        try:
            share, grads = cp_step(model, case, group=group, cp_size=world_size, cp_rank=rank, layout=layout,
                                   guard=guard, compiled=compiled)
            flat = torch.cat([torch.tensor([share])] + [g.reshape(-1) for g in grads.values()])
            dist.all_reduce(flat, group=group)  # one collective: the loss shares and every gradient
            loss, offset, summed = float(flat[0]), 1, {}
            for n, g in grads.items():
                summed[n] = flat[offset:offset + g.numel()].reshape(g.shape).clone()
                offset += g.numel()
            out[name] = ("ok", (loss, summed) if rank == 0 else None)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            out[name] = _describe(exc)
    return out


# ---------------------------------------------------------------------------------------------------- the probe

PROBE_NAME = "cp_packing_features_probe"


def _temperature(index: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    return torch.log1p(torch.floor((index.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _probe_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, probe=None,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """Dense attention over the whole packed stream (cp 1) that applies ``ModelFeatures`` of the layer, not HF's
    kwargs: documents, ``causal``, ``window``, ``chunk`` and ``query_temperature`` (positions inside each document),
    plus HF's ``scaling``, ``softcap`` and sinks. Records the ``sliding_window`` HF passed."""
    i = module.layer_idx
    layer = probe["features"].layers[i]
    probe["seen"][i] = sliding_window
    seg, pos = probe["segment"], probe["position"]  # [T]: segment index, position inside it
    q, k, v = query[0], key[0], value[0]  # [H, T, D], [H_kv, T, D]
    k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], 0) for x in (k, v))
    if layer.query_temperature is not None:  # undo HF's row-index scale, apply the in-document one
        index = torch.arange(q.shape[1])
        q = q * (_temperature(pos, *layer.query_temperature) / _temperature(index, *layer.query_temperature))[:, None]
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scaling is None else scaling)  # [H, T, T]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qp, kp = pos[:, None], pos[None, :]
    allowed = seg[:, None] == seg[None, :]
    if layer.causal:
        allowed &= kp <= qp
    if layer.window:
        allowed &= kp > qp - layer.window
    if layer.chunk:
        allowed &= kp // layer.chunk == qp // layer.chunk
    scores = scores.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:  # gpt-oss sinks: one more logit per head in every softmax
        scores = torch.cat([scores, s_aux.reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)[..., : v.shape[1]]
    return (probs @ v).transpose(0, 1).contiguous().unsqueeze(0), None  # [1, T, H, D]


def _register_probe() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)


def features_step(model: torch.nn.Module, case: dict, features) -> tuple[float, dict, list]:
    """The packed batch at cp 1 through ``_probe_attention`` (model built with ``PROBE_NAME``): (loss, gradients,
    the ``sliding_window`` HF passed to each layer)."""
    from cp_packing.loss import packed_cross_entropy

    model.zero_grad(set_to_none=True)
    segments = _segments(case["doc"])
    segment = torch.cat([torch.full((b - a,), j) for j, (a, b, _) in enumerate(segments)])
    position = torch.cat([torch.arange(b - a) for a, b, _ in segments])
    probe = {"features": features, "segment": segment, "position": position,
             "seen": [None] * len(features.layers)}
    logits = model(input_ids=case["ids"].reshape(1, -1), position_ids=position[None], use_cache=False,
                   probe=probe).logits[0].float()
    loss = packed_cross_entropy(logits, case["labels"].reshape(-1))
    loss.backward()
    return float(loss), _grads(model), probe["seen"]


def compare(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> tuple[float, float, bool]:
    """(|loss - ref|, max over parameters of max|g - g_ref| / max|g_ref|, match?)."""
    loss_diff = abs(loss - ref_loss)
    scale = max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=0.0)
    worst = 0.0
    for n, g_ref in ref_grads.items():
        if not g_ref.numel():
            continue
        denom = max(float(g_ref.abs().max()), 1e-4 * scale, 1e-30)  # gradients that are 0 up to rounding
        worst = max(worst, float((grads[n] - g_ref).abs().max()) / denom)
    ok = loss_diff <= MATCH_LOSS_RTOL * max(1.0, abs(ref_loss)) and worst <= MATCH_GRAD_RTOL and math.isfinite(loss)
    return loss_diff, worst, ok


# ---------------------------------------------------------------------------------------------------- the sweep


def refusal_note(features) -> str:
    """The table's note for a refused family: the refusal without the class name, cut to about 110 characters."""
    text = features.refusal
    if text.startswith(features.architecture):
        text = text[len(features.architecture):].lstrip(" :")
    return text if len(text) <= 110 else text[:107] + "..."


def _short(exc: BaseException, n: int = 140) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= n else text[: n - 3] + "..."


class _Alarm(Exception):
    pass


def _alarm(signum, frame):
    raise _Alarm()


def _build_family(config) -> torch.nn.Module:
    """The eager model of a tiny config; raises ``Skip`` with the reason."""
    try:
        n = _param_count(config)
        if n > MAX_PARAMS:
            raise Skip(f"{n / 1e6:.0f}M parameters even with the tiny config")
        return build(config, "eager")
    except (Skip, _Alarm):
        raise
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"cannot build tiny: {_short(exc)}") from exc


def _same_weights(config, attn: str, eager: torch.nn.Module) -> torch.nn.Module:
    model = build(config, attn)
    model.load_state_dict(eager.state_dict())
    return model


def _probe(row: Row, config, eager, case: dict, ref: tuple, features) -> None:
    """``row.features``: does attention that applies ``features`` (cp 1, dense) match? And where does HF's
    ``sliding_window`` kwarg differ from ``features.windows`` (a window only in HF's mask)?"""
    try:
        loss, grads, seen = features_step(_same_weights(config, PROBE_NAME, eager), case, features)
    except Exception as exc:  # noqa: BLE001 - e.g. attention modules without layer_idx
        row.features = f"n/a ({_short(exc, 60)})"
        return
    d_loss, d_grad, ok = compare(loss, grads, *ref)
    row.features = ("match" if ok else "MISMATCH") + f" ({d_loss:.1e}, {d_grad:.1e})"
    mask_only = [i for i, (w, got) in enumerate(zip(features.windows, seen)) if w and got is None]
    other = [(i, w, got) for i, (w, got) in enumerate(zip(features.windows, seen)) if got is not None and got != w]
    if mask_only:
        row.note = (row.note + "; " if row.note else "") + f"window only in HF's mask on layers {mask_only}"
    if other:
        row.note = (row.note + "; " if row.note else "") + f"HF passes other windows (layer, ours, HF's): {other}"
    chunked = [i for i, c in enumerate(features.chunks) if c]
    if chunked:
        row.note = (row.note + "; " if row.note else "") + f"chunk {features.chunks[chunked[0]]} on layers {chunked}"
    if features.rope_length_limit is not None:
        longest = max(b - a for a, b, d in _segments(case["doc"]) if d)
        row.note = (row.note + "; " if row.note else "") + (
            f"RoPE chosen per call: exact only for documents <= {features.rope_length_limit} tokens (here {longest})")
    tuned = [i for i, layer in enumerate(features.layers) if layer.query_temperature]
    if tuned:
        row.note = (row.note + "; " if row.note else "") + f"query temperature on layers {tuned}"


def _prepare(row: Row, model_type: str, attn: str, layout: str) -> dict | None:
    from cp_packing.model_features import attention_features

    try:
        config = tiny_config(model_type)
    except Skip:
        raise
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"cannot build tiny: {_short(exc)}") from exc
    features = attention_features(config)
    guard = features.supported
    if not guard:  # the run below is evidence only: what CP would give if the refusal were ignored
        row.status, row.note = "refused (check_cp_supported)", refusal_note(features)
    try:
        eager = _build_family(config)
        model = _same_weights(config, attn, eager)
    except Skip as exc:
        if guard:
            raise
        row.status += f"; no forced run: {str(exc)[:80]}"
        return None
    except Exception as exc:  # noqa: BLE001
        row.status = row.status + "; forced run: raises at construction" if row.status else "refused at construction"
        row.note = row.note or _short(exc)
        return None
    case = make_case(config.get_text_config().vocab_size)
    try:
        ref = documents_alone(eager, case)
    except Exception as exc:  # noqa: BLE001
        if guard:
            raise Skip(f"the eager reference fails: {_short(exc)}") from exc
        row.status += f"; no forced run: the eager reference fails ({_short(exc, 60)})"
        return None
    if guard:
        _probe(row, config, eager, case, ref, features)
    try:
        loss, grads = cp_step(model, case, group=None, cp_size=1, cp_rank=0, layout=layout, guard=guard)
    except Exception as exc:  # noqa: BLE001 - the cp run would raise the same
        kind, text = _describe(exc)
        if guard:
            row.status, row.note = kind, text
        else:
            row.status += f"; forced run: raises ({text[:60]})"
        return None
    d_loss, d_grad, ok = compare(loss, grads, *ref)
    row.cp1 = ("match" if ok else "MISMATCH") + f" ({d_loss:.1e}, {d_grad:.1e})"
    return {"model": model, "case": case, "ref": ref, "guard": guard}


def prepare(model_type: str, attn: str, cp_size: int, layout: str) -> tuple[Row, dict | None]:
    """Build the family, run the reference, the features probe and cp 1 here; return its row and its cp job
    (``None``: no cp run). At most ``BUILD_SECONDS`` per family."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    row = Row(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[VARIANTS.get(model_type, (model_type,))[0]], "")
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(BUILD_SECONDS)
    try:
        return row, _prepare(row, model_type, attn, layout)
    except Skip as exc:
        row.status = f"skipped ({exc})"
    except _Alarm:
        row.status = f"skipped (build and first runs over {BUILD_SECONDS} s)"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return row, None


def _finish(row: Row, job: dict, result: tuple) -> None:
    kind, value = result
    if kind != "ok":
        if job["guard"]:
            row.status, row.note = kind, value
        else:
            row.status += f"; forced run: raises ({value[:60]})"
        return
    loss, grads = value
    row.loss_diff, row.grad_rel, ok = compare(loss, grads, *job["ref"])
    verdict = "match" if ok else "MISMATCH (silently wrong)"
    row.status = f"{row.status}; forced run: {verdict}" if row.status else verdict


def run_cp(jobs: dict[str, dict], cp_size: int, layout: str, timeout: float,
           compiled: bool = False) -> dict[str, tuple]:
    """The cp runs of ``jobs`` in one set of ranks; on a failure of the ranks themselves, one set per family."""
    from cp_packing.testing import run_ranks

    items = [(name, j["model"], j["case"], j["guard"]) for name, j in jobs.items()]
    results = run_ranks(_cp_worker, cp_size, items, layout, compiled, timeout=timeout)
    if all(r.ok for r in results):
        return results[0].value
    if len(items) == 1:
        text = next(r.error for r in results if not r.ok).strip().splitlines()[-1]
        return {items[0][0]: ("error", f"the ranks failed: {text[:120]}")}
    out = {}
    for name in jobs:
        out |= run_cp({name: jobs[name]}, cp_size, layout, timeout=min(timeout, 120), compiled=compiled)
    return out


def sweep(types: list[str], *, cp_size: int = 2, layout: str = "contiguous", timeout: float = 600.0,
          log=None, compiled: bool = False) -> list[Row]:
    """Rows of the sweep over ``types`` (model types of the causal-LM mapping); ``compiled``: the families run
    eagerly also run under ``torch.compile`` (the ``compiled`` column, against the same documents-alone reference)."""
    from cp_packing.hf import register_cp_attention

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    attn = register_cp_attention()
    _register_probe()
    rows, jobs = {}, {}
    for model_type in types:
        t0 = time.monotonic()
        row, job = prepare(model_type, attn, cp_size, layout)
        rows[model_type] = row
        if job is not None:
            jobs[model_type] = job
        if log:
            print(f"  {model_type}: {row.status or 'cp ' + str(cp_size) + ' pending'} {row.cp1} "
                  f"({time.monotonic() - t0:.1f} s)", file=log, flush=True)
    if jobs:
        for name, result in run_cp(jobs, cp_size, layout, timeout).items():
            _finish(rows[name], jobs[name], result)
        runnable = {name: job for name, job in jobs.items() if job["guard"]}
        if compiled and runnable:
            for name, (kind, value) in run_cp(runnable, cp_size, layout, timeout, compiled=True).items():
                if kind != "ok":
                    rows[name].compiled = f"{kind}: {value[:80]}"
                    continue
                d_loss, d_grad, ok = compare(*value, *runnable[name]["ref"])
                rows[name].compiled = ("match" if ok else "MISMATCH (silently wrong)") + f" ({d_loss:.1e}, {d_grad:.1e})"
    return [rows[t] for t in types]


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.1e}"


def markdown(rows: list[Row], cp_size: int) -> str:
    lines = [
        f"| model type | class | status at cp {cp_size} | loss diff | max grad rel diff | cp 1 (loss, grad) "
        "| features probe, cp 1 | compiled (loss, grad) | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.note.replace("|", "/")
        lines.append(f"| {r.model_type} | {r.architecture} | {r.status} | {_fmt(r.loss_diff)} | {_fmt(r.grad_rel)} "
                     f"| {r.cp1} | {r.features} | {r.compiled.replace('|', '/')} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--types", nargs="+", help="these model types only")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "balanced"))
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--compiled", action="store_true", help="also run every runnable family under torch.compile")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    types = list(QUICK) if a.quick else (a.types or [*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *VARIANTS])
    unknown = sorted(set(types) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(VARIANTS))
    if unknown:
        p.error(f"not causal-LM model types of this transformers: {unknown}")
    t0 = time.monotonic()
    rows = sweep(types, cp_size=a.cp, layout=a.layout, log=sys.stderr, compiled=a.compiled)
    print(markdown(rows, a.cp))
    counts: dict[str, int] = {}
    for r in rows:
        key = r.status.split(" (")[0].split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    print(f"\n{len(rows)} families in {time.monotonic() - t0:.0f} s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
