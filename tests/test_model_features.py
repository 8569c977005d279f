"""cp_packing.model_features on real transformers configs: per-layer windows, chunks and causality as HF's own masks
apply them to packed documents, and refusals that name the layer type; plus benchmarks/sweep_hf_models.py --quick.

The references are transformers' own: ``masking_utils``' chunked and sliding-window masks built for a packed row
(position ids restarting at every document), and HF's eager models run on each document alone (in the sweep)."""

from __future__ import annotations

import doctest
import importlib.util
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma3TextConfig,
    JambaConfig,
    Lfm2Config,
    LlamaConfig,
    Llama4TextConfig,
    MistralConfig,
    Phi3Config,
    PhimoeConfig,
    Qwen2Config,
    Qwen3NextConfig,
)
from transformers.masking_utils import create_chunked_causal_mask, create_sliding_window_causal_mask  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from cp_packing import model_features as mf  # noqa: E402
from cp_packing.model_features import attention_features, check_cp_supported  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8)
# A packed row of three documents (5, 7 and 3 tokens): positions restart at 0 in each, as cp_packing passes them.
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])


def _allowed(layer: mf.LayerFeatures, positions: torch.Tensor) -> torch.Tensor:
    """[T, T] keys each query may see under ``layer``'s features: same document, positions inside it."""
    pos = positions[0]
    doc = torch.cumsum((pos == 0).long(), 0)
    q, k = pos[:, None], pos[None, :]
    allowed = doc[:, None] == doc[None, :]
    if layer.causal:
        allowed &= k <= q
    if layer.window:
        allowed &= k > q - layer.window
    if layer.chunk:
        allowed &= k // layer.chunk == q // layer.chunk
    return allowed


def _hf_mask(build, config, positions: torch.Tensor) -> torch.Tensor:
    """HF's own boolean mask [T, T] (sdpa flavour) for the packed row ``positions``."""
    config._attn_implementation = "sdpa"
    T = positions.shape[1]
    mask = build(config=config, inputs_embeds=torch.zeros(1, T, 8), attention_mask=None, cache=None,
                 position_ids=positions)
    return mask[0, 0]


def test_llama4_chunks_restart_in_every_packed_document_as_hf_masks_them():
    """Llama 4: ``chunked_attention`` layers (the RoPE ones) get ``attention_chunk_size``; the NoPE layer none but
    the query temperature. HF's chunked mask for a packed row puts chunk boundaries at multiples of the chunk of the
    position INSIDE each document (here documents start at 0, 5 and 12: absolute multiples of 3 would cut at 3, 6,
    9, 12), which is what the features say."""
    cfg = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=3, intermediate_size_mlp=64, **SMALL)
    f = check_cp_supported(cfg)
    assert f.chunks == (3, 3, 3, None) and f.windows == (None,) * 4
    assert [layer.layer_type for layer in f.layers] == ["chunked_attention"] * 3 + ["full_attention"]
    assert f.layers[3].query_temperature == (cfg.floor_scale, cfg.attn_scale) and f.layers[0].query_temperature is None
    hf = _hf_mask(create_chunked_causal_mask, cfg, POSITIONS)
    assert torch.equal(hf, _allowed(f.layers[0], POSITIONS))
    index = torch.arange(POSITIONS.shape[1])
    absolute_chunks = index[:, None] // 3 == index[None, :] // 3  # what chunks of the row index would give
    assert not torch.equal(hf, _allowed(f.layers[3], POSITIONS) & absolute_chunks)


def test_phimoe_window_is_in_hf_mask_only_and_in_the_features():
    """PhiMoE: no layer_types, ``config.sliding_window`` on every layer, applied by HF in its mask only (its
    attention function gets ``sliding_window=None``); the window counts positions inside each document."""
    cfg = PhimoeConfig(num_hidden_layers=2, sliding_window=3, num_local_experts=4, **SMALL)
    f = check_cp_supported(cfg)
    assert f.windows == (3, 3) and all(layer.window_in_mask_only for layer in f.layers)
    assert torch.equal(_hf_mask(create_sliding_window_causal_mask, cfg, POSITIONS), _allowed(f.layers[0], POSITIONS))
    mistral = attention_features(MistralConfig(num_hidden_layers=2, sliding_window=3, **SMALL))
    assert mistral.windows == (3, 3) and not any(layer.window_in_mask_only for layer in mistral.layers)


def test_layer_types_give_per_layer_windows():
    """Gemma 2 / 3 and Qwen2 list their layers: ``sliding_attention`` layers get ``config.sliding_window``, the
    others none."""
    g2 = attention_features(Gemma2Config(num_hidden_layers=2, sliding_window=4, layer_types=["sliding_attention",
                                                                                             "full_attention"]))
    assert g2.windows == (4, None) and g2.supported
    g3 = attention_features(Gemma3TextConfig(num_hidden_layers=6, sliding_window=5, **SMALL))
    assert g3.windows == (5, 5, 5, 5, 5, None)  # Gemma 3's default 5:1 pattern
    q2 = attention_features(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=6,
                                        max_window_layers=2, **SMALL))
    assert q2.windows == (None, None, 6)  # layers from max_window_layers on slide
    assert attention_features(Qwen2Config(num_hidden_layers=2, **SMALL)).windows == (None, None)  # window off
    assert attention_features(LlamaConfig(num_hidden_layers=2, **SMALL)).attention_layers == (0, 1)


@pytest.mark.parametrize("build, layer_type, index", [
    (lambda: Qwen3NextConfig(num_hidden_layers=4, **SMALL), "linear_attention", 0),
    (lambda: Lfm2Config(num_hidden_layers=3, full_attn_idxs=[2], **SMALL), "conv", 0),
    (lambda: JambaConfig(num_hidden_layers=8, **SMALL), "linear_attention", 0),
])
def test_token_mixers_outside_attention_are_refused_naming_the_layer(build, layer_type, index):
    """Qwen3-Next's Gated DeltaNet, LFM2's convolutions and Jamba's Mamba layers: a ValueError that names the class,
    the layer type and where the config says so; the attention layers are still listed."""
    cfg = build()
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]
    with pytest.raises(ValueError, match=rf"^{arch} has {layer_type} layers \(config\.layer_types\[{index}\]\).*"
                                         r"outside the attention function, so a sequence split over CP ranks"):
        check_cp_supported(cfg)
    f = attention_features(cfg)
    assert not f.supported and f.attention_layers == tuple(
        i for i, t in enumerate(cfg.layer_types) if t in mf.ATTENTION_LAYER_TYPES)
    assert f.attention_layers  # each of them has attention layers too


def test_refusals_by_model_type_and_unknown_families():
    """A family of the deny table is refused whatever its layers; an unknown model type with the config fields of a
    state-space / convolution mixer is refused rather than guessed; an unknown attention-only type is not."""
    with pytest.raises(ValueError, match=r"BartForCausalLM \(bart\): .*ignores position_ids"):
        check_cp_supported(CONFIG_MAPPING["bart"]())
    from types import SimpleNamespace as C

    with pytest.raises(ValueError, match=r"'my_ssm', not in cp_packing's tables\) has config\.ssm_state_size"):
        check_cp_supported(C(model_type="my_ssm", ssm_state_size=16, num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"'mystery_attention' layers .*a layer type cp_packing does not know"):
        check_cp_supported(C(model_type="llama", layer_types=["full_attention", "mystery_attention"]))
    assert check_cp_supported(C(model_type="my_llama", num_hidden_layers=3)).attention_layers == (0, 1, 2)


def test_bidirectional_sliding_windows_are_refused_and_vision_only_bidirectional_is_causal():
    cfg = Gemma3TextConfig(num_hidden_layers=2, sliding_window=4, use_bidirectional_attention=True, **SMALL)
    f = attention_features(cfg)
    assert not any(layer.causal for layer in f.layers)
    with pytest.raises(ValueError, match="bidirectional"):
        check_cp_supported(cfg)
    vision = attention_features(CONFIG_MAPPING["gemma4_unified_text"](num_hidden_layers=2))
    assert all(layer.causal for layer in vision.layers)  # "vision": bidirectional among image tokens only


def test_longrope_and_dynamic_rope_limit_the_document_length():
    """RoPE chosen per forward call from max(position_ids) + 1: exact for documents up to the original length."""
    short, long_ = [1.0] * 4, [2.0] * 4
    phi = Phi3Config(num_hidden_layers=2, original_max_position_embeddings=4096, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short,
                                      "long_factor": long_, "original_max_position_embeddings": 4096}, **SMALL)
    f = check_cp_supported(phi)
    assert f.rope_length_limit == 4096
    f.check_document_length(4096)
    with pytest.raises(ValueError, match="document of 4097 tokens"):
        f.check_document_length(4097)
    dyn = LlamaConfig(num_hidden_layers=2, max_position_embeddings=2048,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, **SMALL)
    assert attention_features(dyn).rope_length_limit == 2048
    assert attention_features(LlamaConfig(num_hidden_layers=2, **SMALL)).rope_length_limit is None


def test_tables_cover_every_causal_lm_of_this_transformers_once():
    """Each causal-LM model type is in at most one table; those the sweep could not build are the only ones in
    none; a verified attention-only family's default config has no non-attention layer type."""
    tables = [mf.ATTENTION_MODEL_TYPES, mf.LAYER_TYPED_MODEL_TYPES, set(mf.REFUSED_MODEL_TYPES)]
    for i, a in enumerate(tables):
        for b in tables[i + 1:]:
            assert not set(a) & set(b), set(a) & set(b)
    known = set().union(*tables)
    missing = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - known
    assert missing <= {"gemma3n", "gemma4_assistant", "gemma4_unified_assistant", "musicgen", "musicgen_melody"}, \
        missing
    for model_type in sorted(mf.ATTENTION_MODEL_TYPES):
        types = set(getattr(mf._text_config(CONFIG_MAPPING[model_type]()), "layer_types", None) or [])
        assert not types & set(mf.MIXER_LAYER_TYPES), (model_type, types)


def test_docstring_examples_run():
    result = doctest.testmod(mf)
    assert result.attempted > 0 and result.failed == 0, result


def _sweep_module():
    spec = importlib.util.spec_from_file_location("sweep_hf_models", os.path.join(ROOT, "benchmarks",
                                                                                  "sweep_hf_models.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
def test_sweep_quick_matches_refuses_and_probes():
    """``sweep_hf_models.py --quick`` at cp 2 on real gloo ranks: Llama and Qwen2 (a sliding and a full layer)
    match their documents run alone; LFM2 (a convolution layer) is refused at construction, and a run forced past
    that check is refused again by the attention itself (its first layer reads the model's features); PhiMoE's
    window, which HF keeps in its mask, is applied by the attention: it matches."""
    sweep = _sweep_module()
    assert attention_features(sweep.tiny_config("qwen2")).windows == (None, sweep.WINDOW)
    rows = {r.model_type: r for r in sweep.sweep(list(sweep.QUICK), cp_size=2, timeout=120)}
    assert set(rows) == set(sweep.QUICK)
    for name in ("llama", "qwen2"):
        assert rows[name].status == "match", rows[name]
        assert rows[name].loss_diff < 1e-5 and rows[name].grad_rel < 1e-4, rows[name]
    lfm2 = rows["lfm2"]
    assert lfm2.status.startswith("refused (check_cp_supported); forced run: raises (ValueError: Lfm2ForCausalLM "
                                  "has conv layers"), lfm2
    assert "conv layers (config.layer_types[0])" in lfm2.note
    phimoe = rows["phimoe"]
    assert phimoe.features.startswith("match") and "window only in HF's mask" in phimoe.note, phimoe
    assert phimoe.status == "match", phimoe  # the attention applies the mask-only window
    table = sweep.markdown(list(rows.values()), 2)
    assert table.count("\n") == len(rows) + 1 and "| lfm2 | Lfm2ForCausalLM |" in table


@pytest.mark.distributed
def test_features_the_attention_cannot_see_from_hf_are_applied_under_cp():
    """Llama 4 (chunked layers, and the query temperature HF computes from the row index on its NoPE layers) and
    Qwen2-MoE (a window HF applies only in its mask) were silently wrong under CP: the attention now applies them
    from the layer's features, and both match their documents run alone at cp 2."""
    sweep = _sweep_module()
    rows = {r.model_type: r for r in sweep.sweep(["llama4_text", "qwen2_moe"], cp_size=2, timeout=120)}
    for name, row in rows.items():
        assert row.status == "match", row
        assert row.loss_diff < 1e-5 and row.grad_rel < 1e-4, row
