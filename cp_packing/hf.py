"""HuggingFace transformers integration: context-parallel attention as a registered attention implementation.

:func:`register_cp_attention` registers :func:`cp_attention_forward` with ``transformers.AttentionInterface`` (the
supported extension point: no monkey-patching); :func:`cp_model_inputs` prepares a step and builds the call
(``model(**inputs)``: ``input_ids`` and ``position_ids`` ``[1, T_local]``, ``use_cache=False``, ``cp_sharded`` with its
step plan and ``cp_group``; never an ``attention_mask``); :func:`check_cp_model` checks a model and installs its
guards. Eager and ``torch.compile`` run the same attention function on the same prepared plan. Why no mask, what the attention refuses, the model families and the supported transformers: docs/hf.md.
Neither ``import cp_packing`` nor ``import cp_packing.hf`` imports transformers.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from cp_packing.groups import GroupLike, as_process_group
from cp_packing.packed_seq import PackedSeqParams
from cp_packing.sharding import ShardedPackedSeqParams, shard_packed_seq_params

__all__ = [
    "CP_ATTENTION_NAME",
    "SUPPORTED_TRANSFORMERS",
    "CPTrainer",
    "check_cp_model",
    "check_transformers_version",
    "cp_attention_forward",
    "cp_model_inputs",
    "register_cp_attention",
]

CP_ATTENTION_NAME = "cp_packing"
"""The default name under which :func:`register_cp_attention` registers the CP attention function."""

SUPPORTED_TRANSFORMERS = ">=5.0,<6"
"""The transformers versions this module supports (tested: 5.24)."""

_MIN_MAJOR, _MAX_MAJOR_EXCLUSIVE = 5, 6
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes autocast casts (never float64)


def _import_transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the test environment has it
        raise ImportError(
            "cp_packing.hf needs HuggingFace transformers " + SUPPORTED_TRANSFORMERS
            + "; install it with pip install 'cp-packing[hf]'"
        ) from e
    return transformers


def check_transformers_version(version: str | None = None) -> str:
    """Return the installed (or given) transformers version; raise if it is outside :data:`SUPPORTED_TRANSFORMERS`.

    Raises:
        ImportError: transformers is not installed, or its major version is not 5.
    """
    if version is None:
        version = _import_transformers().__version__
    try:
        major = int(str(version).split(".")[0])
    except ValueError:
        raise ImportError(f"cannot parse the transformers version {version!r}") from None
    if not _MIN_MAJOR <= major < _MAX_MAJOR_EXCLUSIVE:
        raise ImportError(
            f"cp_packing.hf supports transformers {SUPPORTED_TRANSFORMERS}, found {version}; install a supported "
            f"version with pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
        )
    return str(version)


def register_cp_attention(*, name: str = CP_ATTENTION_NAME) -> str:
    """Register :func:`cp_attention_forward` with ``transformers.AttentionInterface`` under ``name``; return ``name``.

    Idempotent. Afterwards ``from_config(cfg, attn_implementation=name)`` or ``model.set_attn_implementation(name)``
    runs context-parallel attention in every attention layer. No mask function is registered, on purpose: HF then
    builds no attention mask for this implementation (docs/hf.md, "The attention_mask pitfall").

    Raises:
        TypeError: ``name`` is not a non-empty str.
        ValueError: ``name`` is one of HF's built-in implementations (``"sdpa"``, ``"eager"``, ...) or already has a
            mask function registered (HF would build a mask and hand it to the attention function).
        ImportError: transformers missing or outside :data:`SUPPORTED_TRANSFORMERS`.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    check_transformers_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    builtin = AttentionInterface().get(name)  # a fresh interface holds the global mapping (public Mapping API)
    if name == "eager" or (builtin is not None and builtin is not cp_attention_forward):
        raise ValueError(
            f"attention implementation {name!r} is already registered with transformers "
            f"({getattr(builtin, '__qualname__', 'eager')}); pick another name, e.g. {CP_ATTENTION_NAME!r}"
        )
    if name in AttentionMaskInterface():
        raise ValueError(
            f"{name!r} has a mask function registered with transformers.AttentionMaskInterface, so HF would build "
            "an attention mask for it; CP attention takes its document boundaries from cp_sharded only. Pick a "
            f"name without a mask function, e.g. {CP_ATTENTION_NAME!r}"
        )
    AttentionInterface.register(name, cp_attention_forward)
    return name


def _is_causal(module: Any, kwargs: Mapping[str, Any]) -> bool:
    flag = kwargs.get("is_causal")
    if flag is None:
        flag = getattr(module, "is_causal", True)
    return bool(flag)


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    cp_sharded: ShardedPackedSeqParams | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with HF: context-parallel varlen attention over this rank's tokens.

    The same code eager and under ``torch.compile``: it reads the step's prepared plan (``cp_model_inputs``), checks
    shapes, and runs the plan's one attention op (docs/compile.md).

    Args:
        module: the HF attention module (``module.is_causal`` selects causal attention, default True; an
            ``is_causal`` keyword, which HF's sdpa path also honours first, overrides it; ``module.layer_idx`` picks
            the layer's features from the plan, ``cp_packing.model_features``).
        query: ``[1, H, T_local, D]``; key / value ``[1, H_kv, T_local, D]`` (RoPE already applied by the model).
        attention_mask: must be ``None`` (HF builds none for this implementation; docs/hf.md).
        dropout: must be 0 (set ``config.attention_dropout = 0.0``).
        scaling: softmax scale (``module.scaling``; ``None`` = ``D ** -0.5``).
        cp_sharded: this rank's ``ShardedPackedSeqParams`` of the step, with its plan (``cp_model_inputs``).
        **kwargs: ``cp_group`` (the CP group, passed by ``cp_model_inputs``) and, for a ``cp_sharded`` WITHOUT a plan
            (hand-built kwargs, eager only), ``cp_backend`` / ``cp_kernel`` / ``cp_ulysses_size``: the options of an
            ad-hoc step (one agreement per call); the rest of HF's kwargs (``position_ids``, ...), ignored.
        sliding_window: the layer's window (HF passes it; ``None`` = full attention; a window HF applies only in
            its mask, PhiMoE's, comes from the layer's features): within each document a token at position ``p``
            attends positions ``p - sliding_window < k <= p``.
        softcap: the layer's logit soft-capping (HF passes ``attn_logit_softcapping``; ``None`` = none).
        s_aux: the layer's attention sinks (gpt-oss passes ``module.sinks``, ``[H]``; ``None`` = none); its gradient
            on each rank is this rank's tokens' share.

    Returns:
        ``(out [1, T_local, H, D], None)``: no attention weights.

    Raises:
        ValueError / TypeError: a missing ``cp_sharded``, batch size != 1, a token count that does not match
        ``cp_sharded``, a non-None ``attention_mask``, ``dropout > 0``, a model feature the attention cannot express
        (on every rank in the checked steps, through the layer's agreement), and the checks of the step's plan.

    Under ``torch.autocast`` q/k/v are cast to the autocast dtype first (docs/hf.md).
    """
    if not isinstance(cp_sharded, ShardedPackedSeqParams):
        raise _missing_shard(cp_sharded)  # every rank of a step passes the same kind of object
    plan = cp_sharded.plan
    if plan is None:
        plan = _ad_hoc_plan(module, query, key, cp_sharded, kwargs.get("cp_group"), kwargs.get("cp_backend", "auto"),
                            kwargs.get("cp_kernel", "auto"), kwargs.get("cp_ulysses_size"))
    error = _wrapper_error(query, key, value, attention_mask, dropout, cp_sharded)
    try:
        features = _layer_features(module, plan)
    except ValueError as exc:  # a family CP cannot run (a step prepared without model=): raised like the others
        features, error = None, error or exc
    if sliding_window is None and features is not None:
        sliding_window = features.window  # a window HF applies only in its mask (PhiMoE, Qwen2-MoE)
    # HF builds q/k/v as [1, T, H, D] views transposed to [1, H, T, D]: contiguous again after this transpose (the
    # kernels take any strides with a unit last one; the collectives make their own contiguous copies)
    if error is None:
        q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T_local, H(_kv), D]
    else:
        q = k = v = query.new_empty(0)
    if features is not None and features.query_temperature is not None and error is None:
        q = q * _temperature_fix(plan, features.query_temperature, q)
    causal = _is_causal(module, kwargs)
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        # Standard AMP (float32 weights + torch.autocast): the projections come out in the autocast dtype but HF's
        # RoPE returns float32 q/k. Cast what autocast would cast (float32/fp16/bf16, not float64) to its dtype,
        # as HF's sdpa path does; the op runs with autocast off, so forward and backward use that one dtype.
        amp_dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (x.to(amp_dtype) if x.dtype in _AUTOCAST_ELIGIBLE else x for x in (q, k, v))
    value_dim = v.shape[-1]
    if error is None and value_dim < q.shape[-1] == k.shape[-1]:
        # MLA (DeepSeek-V2/V3): values have a smaller head dim than queries and keys. Zero-padded value dims give
        # zero output dims (the weights do not depend on v), cut off below: exact, as HF's flash path does it.
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - value_dim))
    out = plan.attend(q, k, v, causal=causal, window=sliding_window, softcap=softcap, sinks=s_aux, scale=scaling,
                      error=error, chunk=None if features is None else features.chunk)
    return out[..., :value_dim].unsqueeze(0), None  # [1, T_local, H, D_v]


def _missing_shard(cp_sharded: Any) -> Exception:
    if cp_sharded is None:
        return ValueError(
            "cp_packing attention needs the batch's varlen metadata: call the model with cp_sharded=<this rank's "
            "ShardedPackedSeqParams> and cp_group=<the CP group>, e.g. model(**cp_packing.hf.cp_model_inputs("
            "local_batch, sharded, group=group)); without context parallelism use cp_model_inputs(input_ids, "
            "packed_seq_params)"
        )
    return TypeError(
        f"cp_sharded must be a cp_packing.ShardedPackedSeqParams, got {type(cp_sharded).__name__}; build it "
        "with cp_packing.shard_packed_seq_params(...) or cp_packing.distribute_batch(...)"
    )


def _wrapper_error(query, key, value, attention_mask, dropout, sharded) -> Exception | None:
    """The HF wrapper's own refusals on this rank, as an exception (raised on every rank by the agreement)."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
            and query.dim() == key.dim() == value.dim() == 4):
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in (query, key, value)]
        return ValueError(f"expected HF attention inputs query [B, H, S, D], key/value [B, H_kv, S, D]; got query "
                          f"{shapes[0]}, key {shapes[1]}, value {shapes[2]}")
    if query.shape[0] != 1:
        return ValueError(
            f"cp_packing attention needs batch size 1 (the packed [B, S] batch is one flattened stream, sharded "
            f"to [1, T_local]); got query of shape {tuple(query.shape)}. Pass input_ids of shape [1, T_local] "
            "(cp_model_inputs does)"
        )
    T_local = sharded.num_local_tokens
    if query.shape[2] != T_local or key.shape[2] != T_local:
        return ValueError(
            f"query has {query.shape[2]} tokens and key {key.shape[2]}, but cp_sharded describes T_local={T_local} "
            f"local tokens (cp_rank={sharded.cp_rank}); pass this rank's shard of this batch (and no KV cache: "
            "use_cache=False)"
        )
    if attention_mask is not None:
        return ValueError(
            f"cp_packing attention does not support attention_mask=<{type(attention_mask).__name__} "
            f"{tuple(getattr(attention_mask, 'shape', ()))}>; document boundaries come from cp_sharded; call the "
            "model without attention_mask")
    if dropout:
        return ValueError(f"cp_packing attention does not support dropout={dropout!r}; set config.attention_dropout "
                          "= 0.0 (the CP kernels have no attention dropout)")
    return None


def _ad_hoc_plan(module, query, key, sharded, group, backend, kernel, ulysses_size):
    """A step for hand-built kwargs (a shard without a plan, eager only): this call is its own step, prepared for
    this layer's config and shapes."""
    from cp_packing.attention.plan import prepare_attention
    from cp_packing.options import AttentionOptions

    if torch.compiler.is_compiling():
        raise ValueError("under torch.compile the step must be prepared before the model runs: call the model with "
                         "cp_packing.hf.cp_model_inputs(local, sharded, group=..., model=model)")
    if sharded.cp_size > 1 and group is None:
        raise ValueError(
            f"cp_sharded is one of cp_size={sharded.cp_size} shards but cp_group is None; pass the CP process "
            "group as cp_group=... (the world is never assumed to be the CP group), or prepare the step with "
            "cp_packing.hf.cp_model_inputs(local, sharded, group=...)"
        )
    error, features, options = None, None, AttentionOptions()
    try:
        options = AttentionOptions(backend=backend, kernel=kernel, ulysses_size=ulysses_size)
        config = getattr(module, "config", None)
        if config is not None:
            features = _features_of(config)
            features.check_document_length(_longest_document(sharded))  # longrope / dynamic RoPE
    except (TypeError, ValueError) as exc:  # raised on every rank by the step's agreement
        error = exc
    shaped = all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (query, key))
    shapes = {"num_heads": query.shape[1], "num_kv_heads": key.shape[1], "head_dim": query.shape[3],
              "dtype": query.dtype, "device": query.device} if shaped and error is None else {}
    return prepare_attention(sharded, group=group, options=options, features=features, error=error, **shapes).plan


def _features_of(config: Any):
    """The model's per-layer attention features, or a ValueError naming what a sequence split cannot express."""
    from cp_packing.model_features import check_cp_supported

    return check_cp_supported(config)


def _layer_features(module: Any, plan) -> Any:
    """This layer's ``LayerFeatures``: from the plan (prepared with ``model=``), else, eagerly, from the layer's
    config (a step prepared without the model; under ``torch.compile`` that is refused: it would drop a mask-only
    window, chunking or query temperature silently)."""
    features = plan.features
    if features is None:
        config = getattr(module, "config", None)
        if config is None:
            return None
        if torch.compiler.is_compiling():
            raise ValueError("under torch.compile the step must be prepared with the model, so that its layers' "
                             "features (windows, chunks, query temperature) are in the plan: "
                             "cp_packing.hf.cp_model_inputs(local, sharded, group=..., model=model)")
        features = _config_features(config)
        features.check_document_length(_longest_document(plan.sharded))  # longrope / dynamic RoPE
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or not 0 <= index < len(features.layers):
        return None
    return features.layers[index]


_CONFIG_FEATURES: dict[int, tuple[Any, Any]] = {}  # id(config) -> (config, its features): steps without model=


def _config_features(config: Any) -> Any:
    entry = _CONFIG_FEATURES.get(id(config))
    if entry is None or entry[0] is not config:
        if len(_CONFIG_FEATURES) >= 16:
            _CONFIG_FEATURES.clear()
        entry = _CONFIG_FEATURES[id(config)] = (config, _features_of(config))
    return entry[1]


def _temperature_fix(plan, temperature: tuple[float, float], q: torch.Tensor) -> torch.Tensor:
    """``[T_local, 1, 1]``: scale(p) / scale(i), undoing HF's query temperature computed from the row index ``i``
    (Llama 4 NoPE layers; ``cp_packing.model_features``): a per-step constant the plan was prepared with."""
    factor = plan.constant(("query temperature", *temperature))
    if factor is None:
        raise ValueError("this layer has Llama 4's query temperature but its step was not prepared with the model; "
                         "call cp_packing.hf.cp_model_inputs(..., model=model)")
    return factor.to(q.dtype)


def model_windows(config: Any) -> int | tuple[int | None, ...] | None:
    """The sliding windows of a model's attention layers, for window-aware planning (``window=`` of
    ``distribute_batch`` / ``shard_packed_seq_params`` / ``cost.layout_cost``).

    ``config`` is the model's config, or the model itself (DDP / FSDP wrappers included).

    Reads ``config.sliding_window`` and, where the config lists them, ``config.layer_types`` (``"sliding_attention"``
    layers get the window, the others ``None``: Gemma 2/3, Qwen2, gpt-oss); a config without ``layer_types`` (Mistral,
    Phi-3) uses its window on every layer unless ``use_sliding_window`` is False. Only load balance depends on it:
    the attention itself takes each layer's window from the model, so a wrong guess here never changes a result.

    Returns:
        ``None`` (no window), an int (the same window on every layer) or a per-layer tuple.

    >>> from types import SimpleNamespace as C
    >>> model_windows(C(sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
    (4, None)
    >>> model_windows(C(sliding_window=None)) is None
    True
    """
    if isinstance(config, torch.nn.Module):
        config = getattr(_unwrapped(config), "config", None)
    if getattr(config, "model_type", None) is not None:  # a real HF config: the layers' features (mask-only windows)
        from cp_packing.model_features import attention_features

        windows = attention_features(config).windows
        if windows and any(w is not None for w in windows):
            return windows[0] if len(set(windows)) == 1 else tuple(windows)
        return None
    window = getattr(config, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    types = getattr(config, "layer_types", None)
    if types:
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        return None if all(w is None for w in windows) else windows
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window


def cp_model_inputs(
    local_batch: Mapping[str, torch.Tensor] | torch.Tensor,
    sharded: ShardedPackedSeqParams | PackedSeqParams,
    *,
    group: GroupLike = None,
    backend: str = "auto",
    kernel: str = "auto",
    ulysses_size: int | None = None,
    input_key: str = "input_ids",
    compiled: bool = False,
    model: torch.nn.Module | None = None,
    options: Any = None,
    labels_key: str = "labels",
) -> dict[str, Any]:
    """The keyword arguments of ``model(**kwargs)`` for one CP rank's step, with the step prepared and agreed.

    Prepares the step before the model runs (``cp_packing.attention.prepare_attention``): the returned
    ``cp_sharded`` carries the frozen step plan that every attention layer only reads, eager or under
    ``torch.compile`` alike (docs/compile.md). The guard is always on: a step whose model ran no cp_packing
    attention layer (an ``"sdpa"`` model, a config another model switched) is refused by
    ``packed_cross_entropy(..., sharded=inputs["cp_sharded"])`` before any gradient, and, with ``model=``, by the
    model's own hooks.

    Args:
        local_batch: this rank's batch as returned by ``cp_packing.distribute_batch`` (a dict of ``[1, T_local, ...]``
            or ``[T_local, ...]`` tensors: ``local_batch[input_key]``, and ``local_batch[labels_key]`` when there, whose
            valid count over the CP group the loss divides by), or the input tensor itself. With a
            ``PackedSeqParams`` (no CP), the global ``[B, S]`` input ids.
        sharded: this rank's ``ShardedPackedSeqParams``; or, without CP, the batch's ``PackedSeqParams`` (sharded
            here with ``cp_size=1``).
        group: the CP ProcessGroup (or a 1-D DeviceMesh); ``None`` only when ``sharded.cp_size == 1``.
        backend, kernel, ulysses_size: the attention options (or ``options=`` an ``AttentionOptions``).
        input_key: ``"input_ids"`` (default) or ``"inputs_embeds"`` (``[..., T_local, hidden]``).
        compiled: deprecated, ignored (0.2: one path for eager and compiled models; removed in the next release).
        model: the model (recommended; needed under ``torch.compile``): :func:`check_cp_model` checks its
            attention implementation and its layers' features and installs the guards; the step is prepared for
            its layers (every window, chunk and query temperature) and shapes (heads, head dim, dtype).
        options: a ``cp_packing.AttentionOptions`` (instead of ``backend`` / ``kernel`` / ``ulysses_size``).
        labels_key: the key of this rank's shifted labels in ``local_batch``.

    Returns:
        ``{input_key: [1, T_local(, hidden)], "position_ids": int64 [1, T_local], "use_cache": False,
        "cp_sharded": the step's shard (with its plan), "cp_group": group}``. No ``attention_mask`` (never pass
        one) and no ``labels``: compute the loss from the logits with ``cp_packing.packed_cross_entropy(logits,
        local_labels, sharded=inputs["cp_sharded"])``.

    Raises:
        TypeError / ValueError, on every rank of the group (the step's agreement): wrong types, a missing key, a
        token count that does not match ``sharded``, a missing group with ``cp_size > 1``, options a backend cannot
        run, ranks that differ; with ``model``, a model whose attention is not cp_packing's or whose layers mix
        tokens outside attention (raised at once, before any communication).
    """
    from cp_packing.attention.plan import prepare_attention
    from cp_packing.options import AttentionOptions

    if not isinstance(compiled, bool):
        raise TypeError(f"compiled must be a bool, got {type(compiled).__name__}")
    features, shapes = None, {}
    if model is not None:
        features = check_cp_model(model)
    error = None
    try:
        if options is None:
            options = AttentionOptions(backend=backend, kernel=kernel, ulysses_size=ulysses_size)
        elif not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be cp_packing.AttentionOptions, got {type(options).__name__}")
        inputs = _model_inputs(local_batch, sharded, group=group, input_key=input_key)
        if model is not None:
            features.check_document_length(_longest_document(inputs["cp_sharded"]))
            options, shapes = _model_step_options(model, options, inputs[input_key].device)
    except (TypeError, ValueError) as exc:
        if not isinstance(sharded, ShardedPackedSeqParams):
            raise
        error = exc
    if error is not None:
        prepare_attention(sharded, group=group, error=error)  # raises on every rank of the group
        raise error  # pragma: no cover - prepare_attention raised
    labels = local_batch.get(labels_key) if isinstance(local_batch, Mapping) else None
    step = prepare_attention(inputs["cp_sharded"], group=inputs["cp_group"], options=options, features=features,
                             labels=labels if isinstance(labels, torch.Tensor) else None,
                             device=inputs[input_key].device, weights_digest=_weights_digest(model), **shapes)
    return inputs | {"cp_sharded": step}


def _weights_digest(model: torch.nn.Module | None):
    """The weights' digest the checked steps compare across the CP ranks (``None``: no model, or FSDP2 DTensors,
    whose CP ranks hold different shards)."""
    if model is None or any(hasattr(p, "to_local") for p in model.parameters()):
        return None
    from cp_packing.gradients import param_digest

    return lambda: param_digest(model)


def _model_step_options(model: torch.nn.Module, options: Any, device: torch.device) -> tuple[Any, dict]:
    """The options a step of ``model`` is prepared with (what ``backend="auto"`` must know of its layers: sinks,
    soft-capping), and the attention shapes its config states (heads, head dim, the dtype its layers attend in), for
    ``auto`` to price with (never checked against a layer)."""
    from cp_packing.attention.plan import AttentionShapes

    model = _unwrapped(model)
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    softcap = getattr(text, "attn_logit_softcapping", None)
    if options.softcap is None and isinstance(softcap, (int, float)) and softcap > 0:
        options = options.replace(softcap=float(softcap))  # every layer passes it; auto must not pick the ring
    if not options.sinks and any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        options = options.replace(sinks=True)
    try:  # a pricing hint only: configs do not always say what every layer sees (per-layer head dims, MLA, ...)
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if isinstance(getattr(text, "qk_nope_head_dim", None), int):  # MLA (DeepSeek): q/k carry the RoPE part
            head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
        else:
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        param = next(iter(model.parameters()), None)
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else (
            param.dtype if param is not None and param.is_floating_point() else None)
        shapes = AttentionShapes(int(heads), int(kv_heads), int(head_dim), dtype)
    except Exception:  # noqa: BLE001 - no usable shapes: auto prices with its defaults
        return options, {}
    if min(shapes[:3]) <= 0 or shapes.num_heads % shapes.num_kv_heads:
        return options, {}
    return options, {"model_shapes": shapes}


def _longest_document(sharded: ShardedPackedSeqParams) -> int:
    return int(sharded.global_params.max_seqlen)


def _model_inputs(local_batch, sharded, *, group, input_key) -> dict[str, Any]:
    """``cp_model_inputs`` before the step is prepared: checks, then the kwargs."""
    if isinstance(sharded, PackedSeqParams):
        sharded = shard_packed_seq_params(sharded, cp_size=1, cp_rank=0, layout="contiguous")
    elif not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(
            f"sharded must be ShardedPackedSeqParams (or the PackedSeqParams of an unsharded batch), got "
            f"{type(sharded).__name__}"
        )
    if input_key not in ("input_ids", "inputs_embeds"):
        raise ValueError(f"input_key must be 'input_ids' or 'inputs_embeds', got {input_key!r}")
    if isinstance(local_batch, Mapping):
        if input_key not in local_batch:
            raise ValueError(
                f"local_batch has no {input_key!r} (keys: {sorted(local_batch)}); pass input_key= the name of the "
                "model input"
            )
        x = local_batch[input_key]
    else:
        x = local_batch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{input_key} must be a torch.Tensor, got {type(x).__name__}")
    T_local = sharded.num_local_tokens
    given_shape = tuple(x.shape)
    n_tail = 0 if input_key == "input_ids" else 1  # inputs_embeds carry a hidden dim
    if sharded.cp_size == 1 and x.dim() == 2 + n_tail and tuple(x.shape[:2]) == tuple(sharded.batch_shape):
        x = sharded.shard(x)  # without CP: the whole [B, S, ...] batch -> the flat stream [T, ...]
    if x.dim() == 2 + n_tail and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1 + n_tail or x.shape[0] != T_local:
        want = f"{T_local}, hidden" if n_tail else f"{T_local}"
        raise ValueError(
            f"{input_key} has shape {given_shape}, "
            f"but this rank holds T_local={T_local} tokens (cp_rank={sharded.cp_rank} of {sharded.cp_size}); "
            f"expected [1, {want}] or [{want}] (this rank's shard)"
        )
    group = as_process_group(group, name="group")
    if sharded.cp_size > 1 and group is None:
        raise ValueError(
            f"sharded is one of cp_size={sharded.cp_size} shards but group is None; pass the CP process group"
        )
    x = x.unsqueeze(0)  # [1, T_local(, hidden)]
    position_ids = sharded.position_ids.to(device=x.device, dtype=torch.int64).reshape(1, T_local)
    return {input_key: x, "position_ids": position_ids, "use_cache": False, "cp_sharded": sharded, "cp_group": group}


# ------------------------------------------------------------------------------------------------------ model guards

_GUARDED = "_cp_packing_guard_handles"  # attribute of a guarded module: its two hook handles
_SHARED_CONFIG_FIX = (
    "transformers shares the config object between models built from it, so building another model from the same "
    "config with attn_implementation='sdpa' (e.g. a reference model) switches this one too: give each model its own "
    "copy, from_config(copy.deepcopy(config), ...), and set model.set_attn_implementation("
    "cp_packing.hf.register_cp_attention())"
)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside DDP / FSDP-style wrappers (``.module``)."""
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _attention_implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _runs_cp_attention(name: object) -> bool:
    if not isinstance(name, str):
        return False
    from transformers import AttentionInterface

    return AttentionInterface().get(name) is cp_attention_forward


def _check_implementation(model: torch.nn.Module) -> None:
    name = _attention_implementation(model)
    if not _runs_cp_attention(name):
        raise ValueError(
            f"{type(model).__name__} runs attention implementation {name!r}, not cp_packing's: a call with "
            f"cp_sharded would attend across documents and shards, silently. {_SHARED_CONFIG_FIX}"
        )


def _guard_pre_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    sharded = kwargs.get("cp_sharded")
    if sharded is None or torch.compiler.is_compiling():
        # Under torch.compile the hooks are skipped (no Python state in the graph); cp_model_inputs(model=...)
        # still checks the implementation before every call.
        return
    if kwargs.get("labels") is not None:
        raise ValueError(
            "the model was called with labels= and cp_sharded: HF's built-in loss shifts the labels on this rank's "
            "LOCAL shard (wrong at every shard and document edge) and divides by a local count. Call the model "
            "without labels and compute the loss from the logits: cp_packing.packed_cross_entropy(logits, "
            "local_labels, group=cp_group) on labels from cp_packing.next_token_labels (shifted on the global stream)"
        )
    _check_implementation(module)


def _guard_post_forward(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    sharded = kwargs.get("cp_sharded")
    if torch.compiler.is_compiling():
        return
    plan = getattr(sharded, "plan", None)
    if plan is not None and not plan.layer_calls:
        raise ValueError(
            f"{type(module).__name__} was called with cp_sharded but none of its attention layers ran cp_packing's "
            f"attention (implementation now {_attention_implementation(module)!r}); its output is wrong. "
            f"{_SHARED_CONFIG_FIX}"
        )


def check_cp_model(model: torch.nn.Module) -> Any:
    """Check that ``model`` runs cp_packing's attention on layers a sequence split can express, and guard its calls;
    idempotent, no communication. Returns its per-layer features (``cp_packing.model_features.ModelFeatures``).

    Raises now on another attention implementation or on layers that mix tokens outside the attention function
    (``cp_packing.model_features.check_cp_supported`` names the layer); the two forward hooks it installs raise, for a
    later call with ``cp_sharded``, before the forward on ``labels=`` (HF's loss shifts the local shard) or a switched
    implementation, and after it when no attention layer ran cp_packing's attention (docs/trainer.md, "Guards").

    Args:
        model: an HF model, or a DDP / FSDP wrapper of one (``.module``).

    Raises:
        TypeError: not a ``torch.nn.Module``. ValueError: its attention implementation is not cp_packing's.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (an HF model), got {type(model).__name__}")
    model = _unwrapped(model)
    features = _features_of(model.config)  # the family first: Falcon cannot switch to any registered attention
    _check_implementation(model)
    if getattr(model, _GUARDED, None) is None:
        handles = (
            model.register_forward_pre_hook(_guard_pre_forward, with_kwargs=True),
            model.register_forward_hook(_guard_post_forward, with_kwargs=True),
        )
        object.__setattr__(model, _GUARDED, handles)
    return features


def __getattr__(name: str) -> Any:
    """``cp_packing.hf.CPTrainer`` (and ``CPSFTTrainer``), imported on first use: they import transformers (and TRL)."""
    if name in ("CPTrainer", "CPSFTTrainer", "CPTrainerMixin"):
        from cp_packing import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
