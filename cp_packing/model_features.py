"""What each decoder layer of an HF causal LM asks of the attention, read from its config alone; and whether a
sequence split over CP ranks can run it at all.

:func:`attention_features` reads, per layer, what HF applies only in its mask or outside the attention function's
kwargs (``window``, ``chunk``, ``causal``, ``query_temperature``, which layers are attention layers, the RoPE length
limit) so that the attention can apply it; :func:`check_cp_supported` refuses the models whose tokens mix outside
the attention function (recurrent, convolution and hybrid layers, attention outside ``AttentionInterface``,
positions from the row), naming the layer type. Pure functions of the config (no weights, no transformers import).
The semantics of each field, the decision tables (:data:`ATTENTION_LAYER_TYPES`, :data:`MIXER_LAYER_TYPES`,
:data:`REFUSED_MODEL_TYPES`, :data:`MASK_ONLY_WINDOW_MODEL_TYPES`) and the sweep over every causal LM of
transformers that checks them: docs/hf.md, "Which model families CP can run".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "ATTENTION_MODEL_TYPES",
    "LAYER_TYPED_MODEL_TYPES",
    "MASK_ONLY_WINDOW_MODEL_TYPES",
    "MIXER_LAYER_TYPES",
    "REFUSED_MODEL_TYPES",
    "LayerFeatures",
    "ModelFeatures",
    "attention_features",
    "check_cp_supported",
]

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``config.layer_types`` values whose layers mix tokens only in the attention function (window and chunk below)."""

_RECURRENT = "a recurrent mixer (an SSM such as Mamba / Mamba-2, or linear attention such as Gated DeltaNet, " \
             "lightning attention or KDA) that carries a state along the sequence"
_HYBRID = "a recurrent (Mamba-style) mixer beside the attention in the same layer"
_INDEXER = "a learned indexer that scores every earlier token and keeps each query's top-k keys, handing the " \
           "attention a mask built outside the attention function"
_COMPRESSED = "keys and values compressed over neighbouring tokens before the attention"

MIXER_LAYER_TYPES: dict[str, str] = {
    "linear_attention": _RECURRENT,  # transformers 5.x names every SSM / linear-attention layer so
    "mamba": _RECURRENT,
    "mamba2": _RECURRENT,
    "recurrent": _RECURRENT,
    "rwkv": _RECURRENT,
    "conv": "a causal convolution along the sequence (a short convolution over the previous tokens)",
    "hybrid": _HYBRID,
    "hybrid_sliding": _HYBRID,
    "indexed_attention": _INDEXER,  # DeepSeek V3.2 sparse attention (DSA), GLM-MoE-DSA, Qwen4-Exp, ...
    "minimax_m3_sparse": _INDEXER,  # MiniMax-M3's block indexer
    "compressed_sparse_attention": _COMPRESSED,  # DeepSeek V4
    "heavily_compressed_attention": _COMPRESSED,
}
"""``config.layer_types`` values whose layers mix tokens outside the attention function -> what that mixer is."""

_NO_INTERFACE = "its attention is computed inside the model, not through transformers' AttentionInterface, so " \
                "cp_packing's attention never runs"
_NO_KWARGS = "its attention layers do not forward the model's keyword arguments (cp_sharded) to the attention " \
             "function"
_ROW_POSITIONS = "its decoder derives its learned positions from the index in the input row and ignores " \
                 "position_ids, so packed documents and CP shards get other positions than a document alone"
_PAD_POSITIONS = "its learned positions start at padding_idx + 1 (RoBERTa's convention), not at the 0 of the " \
                 "position_ids cp_packing passes"

REFUSED_MODEL_TYPES: dict[str, str] = {
    # token mixing that no layer type announces
    "rwkv": "RWKV time mixing (a token shift and a recurrent WKV state along the sequence)",
    "xlstm": "xLSTM's mLSTM / sLSTM recurrences along the sequence",
    "blt": "hash n-gram embeddings of the preceding bytes and entropy-based patching, outside the attention",
    "reformer": "LSH and chunked local self-attention computed inside the model",
    "xlnet": "two-stream relative attention computed inside the model",
    "doge": "a dynamic mask computed from the values and handed to the attention as attention_mask",
    # attention outside AttentionInterface
    **dict.fromkeys(("big_bird", "bloom", "cpmant", "falcon", "git", "gpt_neo", "gpt_neox_japanese", "megatron-bert",
                     "mpt", "mvp", "openai-gpt", "prophetnet", "rembert", "roformer", "trocr", "xglm", "xlm"),
                    _NO_INTERFACE),
    **dict.fromkeys(("nemotron", "stablelm"), _NO_KWARGS),
    # positions that are not position_ids
    **dict.fromkeys(("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "pegasus",
                     "plbart"), _ROW_POSITIONS),
    **dict.fromkeys(("camembert", "data2vec-text", "roberta", "roberta-prelayernorm", "xlm-roberta",
                     "xlm-roberta-xl", "xmod"), _PAD_POSITIONS),
}
"""Model types a sequence split (or cp_packing's attention) cannot run, whatever their layer types -> why."""

MASK_ONLY_WINDOW_MODEL_TYPES = frozenset({"phimoe", "qwen2_moe"})
"""Families whose sliding window HF applies in its mask only: their attention function gets ``sliding_window=None``
(found by ``benchmarks/sweep_hf_models.py``'s probe of what each layer's attention function receives)."""

# Families whose config.sliding_window HF never applies (Moshi builds a plain causal mask and passes no window).
_IGNORED_WINDOW_MODEL_TYPES = frozenset({"moshi"})
# Families whose causality is config.is_decoder (BERT-style encoders used as causal LMs).
_IS_DECODER_CAUSAL = frozenset({"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra",
                                "ernie", "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
                                "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod"})
# Config fields that only models with a non-attention token mixer have (checked for unknown model types).
_MIXER_FIELDS = ("ssm_state_size", "mamba_d_state", "mamba_d_conv", "conv_L_cache", "linear_num_key_heads",
                 "linear_conv_kernel_dim", "lru_width", "block_types", "time_step_rank", "attn_layer_period")


@dataclass(frozen=True)
class LayerFeatures:
    """What one decoder layer asks of the attention (positions inside each document; docs/hf.md has each field).

    Attributes:
        layer_type: ``config.layer_types[i]``, or the type the config implies (``"full_attention"``,
            ``"sliding_attention"``, ``"chunked_attention"``) where it has no ``layer_types``.
        attention: the layer mixes tokens only in the attention function (False: a mixer of
            :data:`MIXER_LAYER_TYPES`).
        causal: keys ``k <= p`` only.
        window: keys ``p - window < k`` (``None``: no window).
        chunk: keys ``k // chunk == p // chunk`` (``None``: no chunking).
        window_in_mask_only: HF applies ``window`` in its mask only; the attention function gets
            ``sliding_window=None`` for this layer.
        query_temperature: ``(floor_scale, attn_scale)`` of Llama 4's temperature tuning, applied by HF to the
            query with the index in the input row (``None``: none).
    """

    layer_type: str
    attention: bool = True
    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    window_in_mask_only: bool = False
    query_temperature: tuple[float, float] | None = None


@dataclass(frozen=True)
class ModelFeatures:
    """The per-layer attention features of a model, and why CP cannot run it (``refusal``; ``None``: it can).

    Attributes:
        model_type: ``config.model_type``.
        architecture: the class name for messages (``config.architectures[0]``, else from the model type).
        layers: one :class:`LayerFeatures` per decoder layer, in order (index = ``module.layer_idx``).
        refusal: the reason :func:`check_cp_supported` raises, naming the layer type or family; ``None``.
        rope_length_limit: the longest document whose RoPE is the same packed as alone (``"longrope"`` /
            ``"dynamic"`` RoPE; ``None``: any length).
    """

    model_type: str
    architecture: str
    layers: tuple[LayerFeatures, ...]
    refusal: str | None = None
    rope_length_limit: int | None = None

    def check_document_length(self, longest: int) -> None:
        """Raise when a document of ``longest`` tokens would get other RoPE frequencies packed than alone.

        Raises:
            ValueError: ``longest > rope_length_limit`` (``"longrope"`` / ``"dynamic"`` RoPE; see the module
                docstring).
        """
        if self.rope_length_limit is not None and longest > self.rope_length_limit:
            raise ValueError(
                f"{self.architecture} picks its RoPE frequencies per forward call from max(position_ids) + 1 "
                f"(longrope / dynamic RoPE, limit {self.rope_length_limit} tokens), and this batch has a document of "
                f"{longest} tokens: packed or CP-sharded with other documents, they would be rotated with other "
                f"frequencies than alone. Keep documents <= {self.rope_length_limit} tokens, or use one document "
                "per row without CP"
            )

    @property
    def supported(self) -> bool:
        return self.refusal is None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window (``None``: none), for ``window=`` of ``distribute_batch`` / ``cost.layout_cost``."""
        return tuple(layer.window for layer in self.layers)

    @property
    def chunks(self) -> tuple[int | None, ...]:
        return tuple(layer.chunk for layer in self.layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose token mixing is all in the attention function."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.attention)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except (TypeError, ValueError):  # older signature, or several text configs (Musicgen): the config itself
            return config
    return config


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _architecture(config: Any, model_type: str) -> str:
    """The class name for messages: ``config.architectures[0]``, else transformers' causal-LM class of the type."""
    names = getattr(config, "architectures", None)
    if names:
        return str(names[0])
    if type(config).__module__.startswith("transformers."):  # transformers is installed: its name for the type
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return f"the {model_type!r} model"


def _layer_types(text: Any, model_type: str) -> tuple[list[str], str]:
    """The per-layer types and where they came from (for messages)."""
    types = getattr(text, "layer_types", None)
    if types:
        return [str(t) for t in types], "config.layer_types"
    n = _positive_int(getattr(text, "num_hidden_layers", None)) or 1
    windowed = getattr(text, "use_sliding_window", True) is not False and model_type not in _IGNORED_WINDOW_MODEL_TYPES
    if windowed and _positive_int(getattr(text, "sliding_window", None)):
        return ["sliding_attention"] * n, "config.sliding_window"
    if _positive_int(getattr(text, "attention_chunk_size", None)):
        return ["chunked_attention"] * n, "config.attention_chunk_size"
    return ["full_attention"] * n, "the config (no layer_types)"


def _temperature(text: Any, i: int) -> tuple[float, float] | None:
    """Llama 4's query temperature on NoPE layers (``no_rope_layers[i] == 0``), else ``None``."""
    no_rope = getattr(text, "no_rope_layers", None)
    if not getattr(text, "attn_temperature_tuning", False) or not no_rope or i >= len(no_rope) or no_rope[i]:
        return None
    return float(text.floor_scale), float(text.attn_scale)


def _layer(text: Any, layer_type: str, i: int, causal: bool, mask_only: bool) -> LayerFeatures:
    window = _positive_int(getattr(text, "sliding_window", None)) if layer_type == "sliding_attention" else None
    chunk = _positive_int(getattr(text, "attention_chunk_size", None)) if layer_type == "chunked_attention" else None
    return LayerFeatures(layer_type, attention=layer_type in ATTENTION_LAYER_TYPES, causal=causal, window=window,
                         chunk=chunk, window_in_mask_only=mask_only and window is not None,
                         query_temperature=_temperature(text, i))


def _refusal(config: Any, text: Any, model_type: str, types: list[str], source: str, arch: str) -> str | None:
    """Why a sequence split cannot run the model (``None``: it can)."""
    fix = ("train it without CP and without cp_packing's packed attention: one document per row, or HF's own "
           "padding-free path where the family supports it (cp_size=1 does not help: packed documents leak "
           "through the same mixer)")
    for i, t in enumerate(types):
        if t in MIXER_LAYER_TYPES:
            return (f"{arch} has {t} layers ({source}[{i}]): {MIXER_LAYER_TYPES[t]}. They mix tokens outside the "
                    f"attention function, so a sequence split over CP ranks is wrong (and packed documents leak "
                    f"into each other); {fix}")
        if t not in ATTENTION_LAYER_TYPES:
            return (f"{arch} has {t!r} layers ({source}[{i}]), a layer type cp_packing does not know: it may mix "
                    f"tokens outside the attention function. Known attention layers: {sorted(ATTENTION_LAYER_TYPES)}")
    for name in (model_type, getattr(text, "model_type", model_type)):
        if name in REFUSED_MODEL_TYPES:
            return f"{arch} ({name}): {REFUSED_MODEL_TYPES[name]}; a CP run would be wrong or fail. {fix}"
    if not _is_known(model_type) and not _is_known(getattr(text, "model_type", model_type)):
        fields = [f for f in _MIXER_FIELDS if getattr(text, f, None) is not None]
        if fields:
            return (f"{arch} ({model_type!r}, not in cp_packing's tables) has config.{fields[0]}, a field of models "
                    f"that mix tokens outside the attention function (state-space, recurrent or convolution "
                    f"layers); refused rather than guessed. {fix}")
    return None


def _rope_length_limit(text: Any) -> int | None:
    """The longest document for which HF's per-call RoPE choice (longrope, dynamic NTK) is the one it makes alone."""
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    per_type = [p for p in params.values() if isinstance(p, dict)]  # Gemma 3 style: one dict per layer type
    limits = []
    for p in per_type or [params]:
        kind = str(p.get("rope_type", p.get("type", "")))
        if kind == "longrope":
            limits.append(p.get("original_max_position_embeddings")
                          or getattr(text, "original_max_position_embeddings", None))
        elif "dynamic" in kind:
            limits.append(getattr(text, "max_position_embeddings", None))
    limits = [x for x in limits if _positive_int(x)]
    return min(limits) if limits else None


def _causal(text: Any, model_type: str) -> bool:
    bidirectional = getattr(text, "use_bidirectional_attention", False)  # Gemma 3: a bool; Gemma 4: "all" / "vision"
    if bidirectional is True or bidirectional == "all":
        return False
    if model_type in _IS_DECODER_CAUSAL:
        return bool(getattr(text, "is_decoder", False))
    return True


def attention_features(config: Any) -> ModelFeatures:
    """What each decoder layer of the model asks of the attention, and why CP cannot run it, from its config.

    Args:
        config: the model's config (``transformers.PretrainedConfig`` or any object with its attributes; a
            composite config's text config is read via ``get_text_config``).

    Returns:
        :class:`ModelFeatures`: one :class:`LayerFeatures` per layer (``window`` includes windows HF applies in
        its mask only, e.g. PhiMoE's ``config.sliding_window``; ``chunk`` is Llama 4's ``attention_chunk_size`` on
        its ``chunked_attention`` layers) and ``refusal`` (``None`` when a sequence split can run it).

    >>> from types import SimpleNamespace as C
    >>> f = attention_features(C(model_type="phimoe", sliding_window=5, num_hidden_layers=2))
    >>> f.windows, f.layers[0].window_in_mask_only, f.supported
    ((5, 5), True, True)
    >>> f = attention_features(C(model_type="llama4_text", attention_chunk_size=8,
    ...                          layer_types=["chunked_attention", "full_attention"]))
    >>> f.chunks, f.windows
    ((8, None), (None, None))
    >>> attention_features(C(model_type="lfm2", layer_types=["conv", "full_attention"])).attention_layers
    (1,)
    """
    model_type = str(getattr(config, "model_type", "") or "")
    text = _text_config(config)
    arch = _architecture(config, model_type)
    types, source = _layer_types(text, model_type)
    causal = _causal(text, str(getattr(text, "model_type", model_type)))
    mask_only = bool({model_type, getattr(text, "model_type", None)} & MASK_ONLY_WINDOW_MODEL_TYPES)
    layers = tuple(_layer(text, t, i, causal, mask_only) for i, t in enumerate(types))
    refusal = _refusal(config, text, model_type, types, source, arch)
    if refusal is None and not causal and any(layer.window for layer in layers):
        refusal = (f"{arch} has bidirectional (use_bidirectional_attention) sliding-window layers: cp_packing's "
                   f"attention windows causal attention only; set config.use_bidirectional_attention=False")
    return ModelFeatures(model_type, arch, layers, refusal, _rope_length_limit(text))


def check_cp_supported(config: Any) -> ModelFeatures:
    """Raise unless a sequence split over CP ranks can run the model; return its :func:`attention_features`.

    Raises:
        ValueError: a layer type that mixes tokens outside the attention function (recurrent / SSM / linear
            attention, convolution, hybrid, indexer, compressed), an unknown layer type, a family of
            :data:`REFUSED_MODEL_TYPES`, an unknown model type with the config fields of such mixers, or
            bidirectional sliding windows. The message names the layer type (and ``config.layer_types[i]``).

    >>> from types import SimpleNamespace as C
    >>> check_cp_supported(C(model_type="llama", num_hidden_layers=2)).attention_layers
    (0, 1)
    >>> check_cp_supported(C(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
    ...                      layer_types=["linear_attention", "full_attention"]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: Qwen3NextForCausalLM has linear_attention layers (config.layer_types[0]): a recurrent mixer ...
    """
    features = attention_features(config)
    if features.refusal is not None:
        raise ValueError(features.refusal)
    return features


def _is_known(model_type: str) -> bool:
    return model_type in ATTENTION_MODEL_TYPES or model_type in LAYER_TYPED_MODEL_TYPES \
        or model_type in REFUSED_MODEL_TYPES


ATTENTION_MODEL_TYPES = frozenset("""
afmoe apertus apertus1p5_text arcee aria_text axk1 beam bert bert-generation biogpt bitnet codegen cohere cohere2
cohere2_moe cohere_compass_text ctrl cwm dbrx deepseek_v2 deepseek_v3 diffllama dory dots1 electra emu3 ernie ernie4_5
ernie4_5_moe exaone exaone4 exaone_moe flex_olmo flint fuyu gemma gemma2 gemma3 gemma3_text gemma3n_text gemma4
gemma4_text gemma4_unified gemma4_unified_text glm glm4 glm4_moe glm4_moe_lite got_ocr2 gpt-sw3 gpt2 gpt_bigcode
gpt_neox gpt_oss gptj granite granite_swa granitemoe granitemoe_swa granitemoeshared helium hrm_text hunyuan_v1_dense
hunyuan_v1_moe hy_v3 hyperclovax internlm3 iquestcoder jais2 jetmoe kolibri1 laguna llama llama4 llama4_text
longcat_flash mellum mimo_v2_flash minicpm3 minimax_m2 ministral ministral3 mistral mixtral mllama modernbert-decoder
moshi moss_transcribe_diarize nanochat olmo olmo2 olmo3 olmoe opt persimmon phi phi3 phi4_multimodal phimoe qwen2
qwen2_moe qwen3 qwen3_moe roc_bert sarvam_mla sarvam_moe seed_oss smollm3 solar_open starcoder2 vaultgemma whisper
youtu
""".split())
"""Model types whose token mixing is all in the attention function: with the attention applying their
:func:`attention_features`, packed and CP runs of their tiny configs equal each document run alone through HF's eager
model (``benchmarks/sweep_hf_models.py``, transformers 5.24)."""

LAYER_TYPED_MODEL_TYPES = frozenset("""
axk2 bailing_hybrid bamba deepseek_v32 deepseek_v4 dots3_note dots3_note_text falcon_h1 falcon_mamba glm_moe_dsa
granitemoehybrid hy_v4 inkling2_loop_text inkling2_text inkling_text jamba kimi_linear lara_mini lfm2 lfm2_moe lfm3
mamba mamba2 minimax minimax_m3_vl_text nemotron_h olmo_hybrid qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text
qwen3_next qwen4_exp qwen4_exp_text recurrent_gemma zamba zamba2 zaya
""".split())
"""Model types whose non-attention layers their ``config.layer_types`` announce (:data:`MIXER_LAYER_TYPES`): refused
layer by layer (a config of only attention layers runs)."""
