"""The step plan: one step's CP attention, prepared and agreed BEFORE the model runs, frozen, read by every layer.

:func:`prepare_attention` (called by ``cp_packing.hf.cp_model_inputs``, the trainers and the launcher) builds the
whole step at once:

* the :class:`~cp_packing.options.AttentionOptions`, the CP group, the backend and kernel;
* ONE agreement over the group (``cp_packing.agreement``): every rank-local check (the shard, the options, the
  shapes, the labels) runs inside it, so a mistake on one rank raises on every rank before any collective;
* every table each layer of the model will ask for: one per distinct ``(causal, window, chunk)`` the model's layers
  use (read from its :class:`~cp_packing.model_features.ModelFeatures`, or from ``options.window`` / ``causal``),
  and the per-step constants (Llama 4's query temperature);
* the count of valid labels over the group when labels are given (the loss divides by it).

The result is a frozen :class:`StepPlan` on the shard (``sharded.plan``). A layer (:meth:`StepPlan.attend`) only
reads it: a table lookup, cheap shape checks, and ONE ``torch.library`` custom op (``cp_packing::attention_fwd``,
``cp_packing.attention.ops``) that runs the backend's collectives and kernel, the same code eager and under
``torch.compile``. Two things are written per layer, both outside the plan's frozen fields: ``plan.trace`` (an int64
CPU tensor: attention calls and a digest of their arguments, which the next step's agreement compares and the loss's
guard reads), and, in the first :data:`~cp_packing.options.CHECKED_STEPS` steps of a group (eager only,
``check_layers``), a small per-layer agreement so a per-layer desync raises on every rank instead of aborting gloo.
"""

from __future__ import annotations

import logging
import warnings
import zlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from cp_packing._checks import (HALF_DTYPES, IGNORE_INDEX, INTEGER_DTYPES, check_bool, check_int, check_softcap,
                                check_softmax_scale, check_window)
from cp_packing._imports import try_import
from cp_packing.agreement import AgreementError, digest, fail_together, next_step, ranks_by_value
from cp_packing.capabilities import backend_refusal
from cp_packing.groups import (GroupLike, as_process_group, backend_config, backend_for_device, check_shard_in_group,
                                peek_group)
from cp_packing.options import CHECKED_STEPS, AttentionOptions
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["AttentionShapes", "StepPlan", "check_attention_inputs", "check_layer_args", "prepare_attention",
           "resolve_attention_group", "select_backend"]

_RING_LAYOUTS = ("zigzag", "contiguous")

logger = logging.getLogger("cp_packing")


class AttentionShapes(NamedTuple):
    """What a step's layers look like: query heads, key/value heads, head dim, dtype (``None``: unknown)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype | None = None


DEFAULT_SHAPES = AttentionShapes(32, 8, 128, torch.bfloat16)
"""The shapes ``backend="auto"`` prices with when a step is prepared without them (a Llama-3-8B layer)."""


# ------------------------------------------------------------------------------------------------- local checks


def check_attention_inputs(q: Any, k: Any, v: Any, sharded: Any) -> None:
    """Raise a clear TypeError / ValueError unless q ``[T_local, H, D]``, k/v ``[T_local, H_kv, D]`` (H % H_kv == 0)
    share one floating dtype and device and ``T_local`` is ``sharded``'s."""
    from cp_packing.attention import kernels

    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(
            f"sharded must be ShardedPackedSeqParams, got {type(sharded).__name__}; build it with "
            "cp_packing.shard_packed_seq_params(params, cp_size=..., cp_rank=..., layout=...)"
        )
    kernels.check_qkv(q, k, v, tokens="T_local")  # types, [T_local, H, D] shapes, GQA heads, one dtype and device
    T_local = sharded.num_local_tokens
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[0] != T_local:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens (shape {tuple(x.shape)}) but this rank holds T_local={T_local} "
                f"tokens (sharded.num_local_tokens); shard the projections' inputs with sharded.shard(...)"
            )
        if x.device.type == "meta" or x.layout != torch.strided:
            raise ValueError(f"{name} must be a dense tensor with data, got a {x.device.type} {x.layout} tensor")


def resolve_attention_group(group: GroupLike, sharded: ShardedPackedSeqParams, device: torch.device):
    """The process group to communicate over, checked against ``sharded`` (``None`` when ``cp_size == 1``: no
    communication; the default group object when ``group`` is ``None`` and ``cp_size > 1``).

    The group's size must equal ``sharded.cp_size`` and this process's rank in it ``sharded.cp_rank``; the group must
    have a backend for ``device``'s type (a ``"cpu:gloo,cuda:nccl"`` group serves CPU tensors with gloo).
    """
    group = as_process_group(group)
    initialized = dist.is_available() and dist.is_initialized()
    if sharded.cp_size == 1:
        if group is not None and initialized and dist.get_world_size(group) != 1:
            raise ValueError(
                f"sharded.cp_size=1 but the given group has {dist.get_world_size(group)} ranks; shard with "
                f"cp_size={dist.get_world_size(group)}, or pass the context-parallel group (or group=None)"
            )
        return None
    if not initialized:
        raise ValueError(
            f"sharded.cp_size={sharded.cp_size} needs a torch.distributed process group, but none is initialised; "
            "call torch.distributed.init_process_group(...) (torchrun) and pass the CP group as group="
        )
    which = "the default (world) group" if group is None else "the given group"
    check_shard_in_group(sharded.cp_size, sharded.cp_rank, dist.get_world_size(group), dist.get_rank(group),
                         which=which)
    config = backend_config(group)
    if backend_for_device(config, device.type) == "":
        fix = "move q/k/v to CUDA" if "nccl" in config.lower() else "move q/k/v to a device the group serves"
        raise ValueError(
            f"the CP group's backend config {config!r} has no backend for {device.type} tensors, but q is on "
            f"{device}; {fix}, or create the group with a backend for {device.type} (e.g. backend="
            f"'cpu:gloo,cuda:nccl')"
        )
    return dist.group.WORLD if group is None else group


# ---------------------------------------------------------------------------------------------- backend choice


def _ring_importable() -> bool:
    from cp_packing.attention.ring import import_ring_flash_attn

    return try_import("ring_flash_attn", import_ring_flash_attn) is not None


def _auto_wants_ring(device_type: str, dtype: torch.dtype | None, layout: str, cp_size: int, causal: bool,
                     kernel: str) -> bool:
    """``backend="auto"``'s ring rule, before the import check: ring-flash-attn only where it is fast AND right
    (CUDA fp16/bf16: its float32 zigzag backward is wrong), where it has a kernel (zigzag/contiguous, causal), where
    there is something to communicate (cp_size > 1) and where the caller did not ask for another kernel."""
    return (causal and kernel in ("auto", "flash_attn") and layout in _RING_LAYOUTS and cp_size > 1
            and device_type == "cuda" and dtype in HALF_DTYPES)


def _raise_refusal(refusal) -> None:
    if refusal is not None:
        cls, message = refusal
        raise cls(message)


def _choose_backend(sharded: ShardedPackedSeqParams, options: AttentionOptions, shapes: AttentionShapes,
                    device_type: str, *, causal: bool, window: int | None, softcap: float | None, sinks: bool,
                    chunk: bool = False) -> str:
    """The backend a step runs (docs/attention.md, "auto"); an explicit one checked against the capabilities."""
    from cp_packing.attention.hybrid import check_ulysses_size
    from cp_packing.attention.ulysses import check_ulysses_heads

    backend, layout, cp_size = options.backend, sharded.layout, sharded.cp_size
    if backend == "auto":
        if (window is None and softcap is None and not sinks and not chunk and _auto_wants_ring(
                device_type, shapes.dtype, layout, cp_size, causal, options.kernel) and _ring_importable()):
            return "ring_flash_attn"
        from cp_packing.cost import choose_backend

        size = (shapes.dtype or DEFAULT_SHAPES.dtype).itemsize
        chosen = choose_backend(sharded, num_heads=shapes.num_heads, num_kv_heads=shapes.num_kv_heads,
                                head_dim=shapes.head_dim, dtype_bytes=size, causal=causal, window=window,
                                overlap=options.overlap, memory_budget=options.memory_budget,
                                **({} if options.hardware is None else {"hardware": options.hardware}))
        return "allgather" if chunk and chosen not in ("allgather", "exchange") else chosen
    _raise_refusal(backend_refusal(backend, layout=layout, causal=causal, window=window, softcap=softcap,
                                   sinks=sinks, kernel=options.kernel))
    if chunk and backend not in ("allgather", "exchange"):
        raise NotImplementedError(
            f"backend={backend!r} cannot run chunked attention (Llama 4's chunked layers); use backend='allgather' or "
            "'exchange' (or 'auto')")
    if backend == "ulysses":
        check_ulysses_heads(shapes.num_heads, cp_size)
    if backend == "hybrid":
        check_ulysses_size(options.ulysses_size, shapes.num_heads, cp_size)
    if backend == "ring_flash_attn":
        from cp_packing.attention.ring import import_ring_flash_attn

        dtype = shapes.dtype
        if dtype is not None and dtype not in HALF_DTYPES and layout == "zigzag":  # before the import
            _raise_refusal(backend_refusal(backend, layout=layout, dtype=dtype))
        import_ring_flash_attn()  # ImportError that says what to install
        if dtype is not None:
            _raise_refusal(backend_refusal(backend, layout=layout, dtype=dtype))
    return backend


def select_backend(
    q: torch.Tensor, sharded: ShardedPackedSeqParams, *, causal: bool = True, backend: str = "auto",
    kernel: str = "auto", ulysses_size: int | None = None, window: int | None = None, num_kv_heads: int | None = None,
    softcap: float | None = None, sinks: bool = False, hardware: Any = None, overlap: bool = True,
) -> tuple[str, str]:
    """The ``(backend, kernel)`` pair a step prepared for q's shapes runs (docs/attention.md, "auto"): a query, not
    an entry point (the options reach a step through ``AttentionOptions``).

    ``backend="auto"``: ring-flash-attn where it is importable and fast AND right (CUDA fp16/bf16, zigzag or
    contiguous, causal, no window / softcap / sinks, ``cp_size > 1``, kernel auto or flash_attn); else the backend
    the step-time model of ``cp_packing.cost.choose_backend`` prices lowest among all-gather, exchange and Ulysses.
    An explicit backend is checked against ``cp_packing.capabilities`` and the head counts.

    Raises:
        ValueError / NotImplementedError / TypeError / ImportError: a backend or kernel that cannot serve these
            arguments (the message names the fix).
    """
    from cp_packing.attention import kernels

    options = AttentionOptions(backend=backend, kernel=kernel, ulysses_size=ulysses_size, hardware=hardware,
                               overlap=overlap)
    shapes = AttentionShapes(q.shape[1], q.shape[1] if num_kv_heads is None else num_kv_heads, q.shape[2], q.dtype)
    chosen = _choose_backend(sharded, options, shapes, q.device.type, causal=causal, window=window, softcap=softcap,
                             sinks=bool(sinks))
    if chosen == "ring_flash_attn":
        return chosen, "flash_attn"
    return chosen, kernels.resolve_kernel(kernel, q, softcap=softcap)


def _check_heads_k_stride(stride: int | None, num_kv_heads: int) -> None:
    if stride is not None and num_kv_heads % stride:
        raise ValueError(f"heads_k_stride={stride!r} must be a positive int dividing the {num_kv_heads} k/v heads")


# --------------------------------------------------------------------------------------------------- the plan


class TableContext(NamedTuple):
    """What a backend's table builder reads: the shard, the options, the tables' device."""

    sharded: ShardedPackedSeqParams
    options: AttentionOptions
    device: torch.device


LayerKey = tuple  # (causal, window, chunk): one table set of a step

_LAST_TRACE: dict[str, torch.Tensor] = {}  # CP group name -> the trace of its last prepared step (this process)


_PLAN_FIELDS = ("sharded", "options", "group", "group_arg", "backend", "kernel", "device", "step", "check_layers",
                "num_items", "local_items", "features", "shapes", "tables", "constants", "group_names", "digest",
                "trace")


class StepPlan:
    """One step's CP attention, prepared and agreed (module docstring). Built by :func:`prepare_attention`.

    Frozen (no attribute can be set after the agreement) and opaque to tree-mapping utilities: a plain object, not
    a dataclass, so FSDP2's input casting and ``torch.compile`` pass it through and every copy of the shard shares
    it (its tables are never cast or copied).

    Attributes:
        sharded: the shard (without its plan). options: the :class:`AttentionOptions`. group: the CP ProcessGroup,
            or None without communication; group_arg: the ``group=`` the step was prepared with.
        backend, kernel: the backend and the kernel option (``"auto"`` resolves per dtype inside the op).
        device: where the tables live. step: this group's step number (1, 2, ...).
        check_layers: whether every layer (eager) makes its own small agreement this step.
        num_items: valid labels over the CP group (when prepared with labels), else None; local_items: this rank's.
        features: the model's ``ModelFeatures`` (or None). shapes: the :class:`AttentionShapes` agreed (or None).
        tables: ``(causal, window, chunk)`` -> the backend's tables, for every kind of layer the step runs.
        constants: per-step tensors the layers read (Llama 4's query temperature factors).
        group_names: the op's groups by name (CP group, and the hybrid backend's two sub-groups).
        digest: the shard's digest when the step was agreed (an edited shard is refused in checked steps).
        trace: int64 CPU ``[2]``: attention calls this step and a digest of their arguments (written per layer).
    """

    __slots__ = (*_PLAN_FIELDS, "__weakref__")

    def __init__(self, **fields: Any):
        if set(fields) != set(_PLAN_FIELDS):
            raise TypeError(f"StepPlan takes exactly {_PLAN_FIELDS}, got {sorted(fields)}")
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"StepPlan is frozen: {name!r} cannot change after the step's agreement; prepare a new "
                             "step (cp_packing.prepare_attention) instead")

    def replace(self, **changes: Any) -> "StepPlan":
        """A copy with ``changes`` (tests and tools; a real step comes from :func:`prepare_attention`)."""
        return StepPlan(**({name: getattr(self, name) for name in _PLAN_FIELDS} | changes))

    def __repr__(self) -> str:
        return (f"StepPlan(cp_size={self.sharded.cp_size}, cp_rank={self.sharded.cp_rank}, layout="
                f"{self.sharded.layout!r}, backend={self.backend!r}, kernel={self.kernel!r}, step={self.step}, "
                f"layers={sorted(self.tables, key=repr)})")

    @property
    def layer_calls(self) -> int:
        """Attention calls (forward) this step so far."""
        return int(self.trace[0])

    # ------------------------------------------------------------------------------------------------ a layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | None = None,
               window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
               scale: float | None = None, error: BaseException | None = None,
               chunk: int | None = None) -> torch.Tensor:
        """One attention layer: ``q [T_local, H, D]``, k/v ``[T_local, H_kv, D]`` -> ``[T_local, H, D]``; the same
        code eager and compiled.

        ``None`` arguments take the options' defaults. ``chunk``: chunked attention (Llama 4: a query attends the
        keys of its own ``chunk``-token piece of its document). ``error``: the caller's own refusal on this rank
        (raised on every rank by the layer's agreement in checked steps, else here)."""
        from cp_packing.attention import ops

        options = self.options
        causal = options.causal if causal is None else causal
        softcap = options.softcap if softcap is None else softcap
        scale = options.scale if scale is None else scale
        key = (causal, window, chunk)
        check = 0
        compiling = torch.compiler.is_compiling()
        if not compiling and self.check_layers:
            check = self.layer_calls + 1
            self._check_layer(check, q, k, v, key, softcap, sinks, scale, error)
        elif error is not None:
            raise error
        # what the layer's checks read, and what the ranks must share (no device index: it differs between ranks)
        sinks_meta = None if sinks is None else (tuple(sinks.shape), sinks.dtype, sinks.device == q.device)
        arguments = (key, softcap, sinks_meta, scale, q.dtype, q.device.type, q.shape[1], k.shape[1], q.shape[2])
        if compiling or arguments not in _CODES:  # a new kind of layer (when compiled: while tracing, once)
            check_layer_args(q, causal, window, softcap, sinks, scale)
        _check_shapes(self, q, k, v)
        tables = self._tables_for(key)
        code = _layer_code(*arguments)
        if compiling:
            self.trace.add_(self.trace.new_tensor([1, code]))  # an input mutation of the graph
        else:
            counts = self.trace.numpy()  # the CPU tensor's memory: no tensor op per layer
            counts[0] += 1
            counts[1] += code
        return ops.run_layer(self, tables, q, k, v, sinks, causal=causal, window=window, softcap=softcap,
                             scale=scale, check=check)

    def _tables_for(self, key: LayerKey):
        tables = self.tables.get(key)
        if tables is not None:
            return tables
        causal, window, chunk = key
        fix = ("prepare the step with the model (cp_packing.hf.cp_model_inputs(..., model=model)) or with the "
               "layers' windows (AttentionOptions(window=...)), so that its tables are built before the model runs")
        if torch.compiler.is_compiling():
            raise ValueError(f"this step was prepared for the layers {sorted(self.tables, key=repr)} (causal, "
                             f"window, chunk), but a layer asks for {key} under torch.compile; {fix}")
        _warn_late_table(key, fix)
        self.tables[key] = _build(self, key)  # eager only: built once, then read like the others
        return self.tables[key]

    def _check_layer(self, number: int, q, k, v, key: LayerKey, softcap, sinks, scale, error) -> None:
        """A per-layer agreement (``check_layers``): every argument that changes the result, on every rank."""
        causal, window, chunk = key
        with fail_together("attention layer", (self.group, "CP group")) as agreement:
            if error is not None:
                raise error
            if _shard_digest(self.sharded) != self.digest:
                raise ValueError(_EDITED)
            check_attention_inputs(q, k, v, self.sharded)
            check_layer_args(q, causal, window, softcap, sinks, scale)
            agreement.fields = {
                "layer": number, "q": (tuple(q.shape), str(q.dtype)), "k": tuple(k.shape), "causal": causal,
                "window": window, "chunk": chunk, "softcap": softcap, "softmax_scale": scale,
                "sinks": None if sinks is None else tuple(sinks.shape)}

    def check_ran(self) -> None:
        """Raise unless this step's model ran cp_packing's attention in all its attention layers (the guard the loss
        runs before any gradient: a model switched to ``"sdpa"`` would attend across documents and shards)."""
        fix = ("the model runs another attention implementation (attn_implementation='sdpa' or 'eager', or a config "
               "shared with another model that switched it: build each model from copy.deepcopy(config) and "
               "set model.set_attn_implementation(cp_packing.hf.register_cp_attention()))")
        calls = self.layer_calls
        if not calls:
            raise ValueError(f"no attention layer ran cp_packing's attention in this step: {fix}; its output is "
                             "wrong (documents and shards attend across each other)")
        expected = len(self.features.attention_layers) if self.features is not None else 0
        if expected and calls % expected:
            raise ValueError(f"{calls} attention calls ran cp_packing's attention in this step, not a multiple of "
                             f"the model's {expected} attention layers: some layers run another attention; {fix}")

    def constant(self, key: tuple) -> torch.Tensor | None:
        """A per-step constant the step was prepared with (e.g. ``("query temperature", floor, scale)``)."""
        return self.constants.get(key)


_EDITED = ("the shard's metadata (token_index, cu_seqlens, key_start or the global cu_seqlens) changed in place after "
           "its step was prepared; build a new shard (and prepare it) instead of editing one")


def _shard_digest(sharded: ShardedPackedSeqParams) -> str:
    return digest(sharded.global_params.cu_seqlens, sharded.token_index, sharded.cu_seqlens, sharded.key_start)


def check_layer_args(q, causal, window, softcap, sinks, scale) -> None:
    """Raise a clear TypeError / ValueError unless a layer's ``causal``, ``window``, ``softcap``, ``sinks`` and softmax
    ``scale`` are valid for q (what a step checks once per kind of layer)."""
    from cp_packing.attention import kernels

    check_bool(causal, "causal")
    check_softmax_scale(scale)
    check_window(window, causal)
    if softcap is not None:
        check_softcap(softcap)
    kernels.check_sinks(sinks, q)


def _check_shapes(plan: StepPlan, q, k, v) -> None:
    """Cheap checks of q/k/v against the step: shapes only (no host sync; under ``torch.compile`` they are evaluated
    while tracing, on static or symbolic sizes)."""
    T_local = plan.sharded.num_local_tokens
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(f"q, k, v must share one dtype (a floating one), got {q.dtype}, {k.dtype}, {v.dtype}; cast them "
                        "first")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[0] != T_local:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but this rank holds T_local={T_local} tokens "
                             "(sharded.num_local_tokens): pass [T_local, heads, head_dim] of this step's shard")
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must have one shape "
                         "[T_local, H_kv, D] and q [T_local, H, D] with H a multiple of H_kv (an MLA model with "
                         "another value head dim: pad v to q's head dim)")
    shapes = plan.shapes
    if shapes is not None and (q.shape[1], k.shape[1], q.shape[2]) != shapes[:3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not have the heads the step was prepared for "
                         f"({shapes.num_heads} query / {shapes.num_kv_heads} key-value heads of {shapes.head_dim}); "
                         "prepare the step with this model's shapes")


_CODES: dict[tuple, int] = {}  # a layer's checked arguments -> their code (few distinct kinds of layer per model)


@torch._dynamo.assume_constant_result
def _layer_code(*arguments) -> int:
    """A deterministic 31-bit code of a layer's arguments (summed into ``plan.trace``; a constant when compiled)."""
    code = _CODES.get(arguments)
    if code is None:
        if len(_CODES) > 4096:
            _CODES.clear()
        code = _CODES[arguments] = zlib.crc32(repr(arguments).encode()) & 0x7FFFFFFF
    return code  # (an argument tuple in _CODES was checked by check_layer_args: the layer checks a new one)


_WARNED: set = set()


def _warn_late_table(key: LayerKey, fix: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"a layer asks for attention tables {key} (causal, window, chunk) that its step was not "
                      f"prepared for: built at the layer (eager only; torch.compile refuses it); {fix}",
                      stacklevel=4)


# ------------------------------------------------------------------------------------------------- preparing


def _count_labels(labels: Any, sharded: ShardedPackedSeqParams, ignore_index: int) -> int:
    """This rank's valid labels, checked: integer, one per local token, shifted on the global stream (a valid label
    on the last token of a segment is HF's unshifted convention: ``cp_packing.labels.check_labels_shifted``).
    Counted by the step's one count's local part (``labels.local_label_count``, int64 values as the loss)."""
    from cp_packing.labels import check_labels_shifted, local_label_count, segment_ends

    if not isinstance(labels, torch.Tensor) or labels.dtype not in INTEGER_DTYPES:
        raise TypeError(f"labels must be an integer tensor (this rank's shifted labels), got "
                        f"{type(labels).__name__ if not isinstance(labels, torch.Tensor) else labels.dtype}")
    flat = labels.reshape(-1)
    if flat.numel() != sharded.num_local_tokens:
        raise ValueError(f"labels hold {flat.numel()} tokens but this rank holds T_local={sharded.num_local_tokens}; "
                         "pass this rank's shard of the labels")
    segment_end = segment_ends(sharded.global_params.cu_seqlens, sharded.token_index.to(flat.device))
    check_labels_shifted(flat, segment_end=segment_end, ignore_index=ignore_index)
    return int(local_label_count([flat], ignore_index))


def _layer_keys(options: AttentionOptions, features: Any) -> tuple[LayerKey, ...]:
    """Every ``(causal, window, chunk)`` the step's layers ask for: the model's attention layers, else the options'
    windows (the layer's own ``sliding_window`` is HF's; a mask-only window is the features')."""
    if features is not None:
        keys = [(layer.causal, layer.window, layer.chunk) for i, layer in enumerate(features.layers)
                if i in set(features.attention_layers)]
        if keys:
            return tuple(dict.fromkeys(keys))
    return tuple(dict.fromkeys((options.causal, window, None) for window in options.windows))


def _check_shapes_arg(shapes: AttentionShapes | None) -> AttentionShapes | None:
    if shapes is None:
        return None
    H, H_kv, D, dtype = shapes
    check_int(H, "num_heads", min=1)
    check_int(H_kv, "num_kv_heads", min=1)
    check_int(D, "head_dim", min=1)
    if H % H_kv:
        raise ValueError(f"num_heads={H} must be a multiple of num_kv_heads={H_kv} (GQA)")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return shapes


def _build(plan_or_ctx, key: LayerKey):
    from cp_packing.attention.ops import BACKEND_TABLE
    from cp_packing.attention.wire import Wire

    causal, window, chunk = key
    ctx = TableContext(plan_or_ctx.sharded, plan_or_ctx.options, plan_or_ctx.device)
    backend = BACKEND_TABLE[plan_or_ctx.backend]
    tables = backend.build(ctx, causal, window, chunk)
    if backend.decode is None:  # ring-flash-attn: its own call, eager only
        return tables
    blob, sizes = tables  # the blob's length changes with every batch's documents: a new step does not recompile
    torch._dynamo.maybe_mark_dynamic(blob, 0)
    return Wire(blob, sizes, backend.decode([blob, sizes]))


def _temperature_constants(features: Any, sharded: ShardedPackedSeqParams, device: torch.device) -> dict:
    """Llama 4's query-temperature factors, one float32 ``[T_local, 1, 1]`` per distinct setting: scale(p) / scale(i)
    undoes HF's temperature computed from the row index ``i`` (``cp_packing.model_features``)."""
    constants = {}
    for layer in () if features is None else features.layers:
        if layer.query_temperature is None or ("query temperature", *layer.query_temperature) in constants:
            continue
        floor_scale, attn_scale = layer.query_temperature
        p = sharded.position_ids.to(device, torch.float32)
        i = torch.arange(p.numel(), device=device, dtype=torch.float32)

        def scale(x):
            return torch.log1p(torch.floor((x + 1) / floor_scale)) * attn_scale + 1

        constants[("query temperature", floor_scale, attn_scale)] = (scale(p) / scale(i))[:, None, None]
    return constants


def _group_names(group, backend: str, options: AttentionOptions, cp_size: int) -> str:
    """The op's ``groups`` argument: the CP group's name, and the hybrid backend's two sub-groups' ("" for none)."""
    if group is None:
        return ""
    if backend != "hybrid":
        return group.group_name
    from cp_packing.attention.hybrid import hybrid_groups

    ugroup, agroup = hybrid_groups(group, cp_size, options.ulysses_size)
    return ",".join(("" if g is None else g.group_name) for g in (group, ugroup, agroup))


def _previous_trace(group) -> tuple[int, int] | None:
    if group is None:
        return None
    trace = _LAST_TRACE.get(group.group_name)
    return None if trace is None else tuple(int(x) for x in trace.tolist())


def _check_previous_traces(records: list) -> None:
    """Raise (on every rank: every rank reads the same records) when the ranks' previous steps ran different
    attention calls: a later-layer difference after the checked steps becomes an error at the next step."""
    traces = [r.payload[1] for r in records]
    if any(t is None for t in traces) or len(set(traces)) == 1:
        return
    listed = "; ".join(f"rank {rank}: {calls} calls, digest {code}" for rank, (calls, code) in enumerate(traces))
    raise AgreementError(
        f"context_parallel_attention: the ranks of the CP group ran different attention layers in the previous step "
        f"({listed}): a layer's arguments (softmax scale, window, softcap, causal, chunk, dtype, heads) or the number "
        "of layers differ between ranks, so that step's results are not trustworthy; run with "
        "AttentionOptions(check_layers=True) to find the layer")


def _check_shapes_agree(records: list) -> None:
    """Raise (on every rank) when ranks that know the step's shapes know different ones (a rank prepared without
    shapes, e.g. ``prepare_attention(sharded)`` beside a per-call step, is not compared)."""
    known = {rank: r.payload[3] for rank, r in enumerate(records) if r.payload[3] is not None}
    if len(set(known.values())) > 1:
        listed = "; ".join(f"rank {rank}: {value}" for rank, value in known.items())
        raise AgreementError(
            f"context_parallel_attention: the ranks of the CP group disagree on shapes ({listed}); every rank must "
            "pass the same shapes (query heads, key/value heads, head dim, dtype) on every rank of the group")


def _check_weights(records: list) -> None:
    """Raise (on every rank: every rank reads the same records) when the CP ranks' weights differ."""
    digests = [r.payload[2] for r in records]
    if any(d is None for d in digests) or len(set(digests)) == 1:
        return
    listed = "; ".join(f"ranks {ranks}: {d[:12]}" for d, ranks in ranks_by_value(digests).items())
    raise AgreementError(
        f"context_parallel_attention: the model's weights differ between the ranks of the CP group ({listed}): every "
        "CP rank must hold the same weights. The gradients were not summed over the CP group after backward (call "
        "cp_packing.sum_gradients(model, cp_group) - or the DP x CP mesh - before the optimizer step), or were "
        "summed over another group, or the ranks loaded different checkpoints")


def prepare_attention(
    sharded: ShardedPackedSeqParams,
    *,
    group: GroupLike = None,
    options: AttentionOptions | None = None,
    labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    features: Any = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    error: BaseException | None = None,
    weights_digest: Any = None,
    model_shapes: AttentionShapes | None = None,
    **option_kwargs: Any,
) -> ShardedPackedSeqParams:
    """This step's shard with its frozen :class:`StepPlan` attached (``result.plan``), agreed over the group.

    Prepare once per step, before the model runs; then every attention layer
    (``context_parallel_attention(q, k, v, result)``, or the HF attention function) only reads the plan.

    Args:
        sharded: this rank's ``ShardedPackedSeqParams`` of the step.
        group: the CP ProcessGroup (or 1-D DeviceMesh); ``None``: the default group where ``cp_size > 1``.
        options: the :class:`~cp_packing.options.AttentionOptions` (default: all defaults), or its fields as
            keyword arguments (``backend="exchange"``).
        labels: this rank's shifted labels (optional): their valid count, summed over the group in the agreement,
            becomes ``plan.num_items``, the divisor ``packed_cross_entropy(..., sharded=result)`` uses.
        ignore_index: the label value to ignore.
        features: the model's ``cp_packing.model_features.ModelFeatures`` (``cp_model_inputs(model=)`` passes
            them): the tables of every kind of layer it has, its query temperature, its layer count.
        num_heads, num_kv_heads, head_dim, dtype: the layers' shapes (all or none): the agreement compares them,
            every layer is checked against them, ``backend="auto"`` prices with them (default
            :data:`DEFAULT_SHAPES`) and ``dtype`` decides whether auto may pick ring-flash-attn.
        device: where the tables go (default ``sharded.token_index``'s device).
        error: the caller's own failure on this rank (raised on every rank by the agreement).
        model_shapes: shapes read from a model's config (``cp_model_inputs(model=)``): what ``backend="auto"``
            prices with, never checked against a layer (configs do not always say what the layers see).
        weights_digest: a callable returning a digest of the model's weights (``cp_packing.param_digest``;
            ``cp_model_inputs(model=)`` passes it): in the checked steps the ranks compare it, so weights that drifted
            apart (gradients not summed over the CP group) raise on every rank, naming the fix.

    Returns:
        A copy of ``sharded`` whose ``plan`` is this step's. Costs one agreement over the group (none at
        ``cp_size == 1``) and the tables' host-side planning.

    Raises:
        TypeError / ValueError / NotImplementedError / ImportError on EVERY rank of the group: a malformed shard,
        options, shapes or labels, a group that does not match the shard, a backend or kernel that cannot run the
        step's layers, ranks that differ.

    >>> import torch, cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 0]]))
    >>> step = prepare_attention(cp_packing.shard_packed_seq_params(params, cp_size=1, cp_rank=0), backend="allgather")
    >>> q = k = v = torch.randn(6, 2, 8)
    >>> cp_packing.context_parallel_attention(q, k, v, step).shape, step.plan.backend
    (torch.Size([6, 2, 8]), 'allgather')
    """
    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(f"sharded must be ShardedPackedSeqParams, got {type(sharded).__name__}; build it with "
                        "cp_packing.shard_packed_seq_params(...) or cp_packing.distribute_batch(...)")
    sharded = sharded.without_plan()
    pg = peek_group(group, sharded.cp_size)
    with fail_together("context_parallel_attention", (pg, "CP group")) as agreement:
        if error is not None:
            raise error
        if options is None:
            options = AttentionOptions(**option_kwargs)
        elif not isinstance(options, AttentionOptions):
            raise TypeError(f"options must be cp_packing.AttentionOptions, got {type(options).__name__}")
        elif option_kwargs:
            options = options.replace(**option_kwargs)
        given = (num_heads, num_kv_heads, head_dim)
        if any(x is not None for x in given) and not all(x is not None for x in given):
            raise ValueError(f"num_heads, num_kv_heads and head_dim go together (got {given}); give all or none")
        shapes = _check_shapes_arg(None if num_heads is None else AttentionShapes(num_heads, num_kv_heads, head_dim,
                                                                                 dtype))
        local_items = None if labels is None else _count_labels(labels, sharded, ignore_index)
        device = torch.device(device) if device is not None else sharded.token_index.device
        keys = _layer_keys(options, features)
        backend = _choose_for_layers(sharded, options, shapes or model_shapes, device, keys)
        resolved = resolve_attention_group(group, sharded, device)
        if shapes is not None:
            _check_heads_k_stride(options.heads_k_stride, shapes.num_kv_heads)
            if options.kernel != "auto" and backend != "ring_flash_attn" and shapes.dtype is not None:
                from cp_packing.attention import kernels

                kernels.resolve_kernel(options.kernel, torch.empty(0, dtype=shapes.dtype, device=device),
                                       softcap=options.softcap)
        step = next_step(resolved)
        check = options.check_layers
        # without peers no layer can desync: nothing to check
        check_layers = resolved is not None and ((step <= CHECKED_STEPS) if check is None else check)
        agreement.fields = {
            "cp_size": sharded.cp_size, "layout": sharded.layout,
            "plan": digest(sharded.global_params.cu_seqlens, sharded.layout, sharded.cp_size, sharded.plan_window),
            "T_local": sharded.num_local_tokens, "ulysses_size": options.ulysses_size, "backend": backend,
            "causal": options.causal, "options": options, "layers": keys,
            "device": device.type,
            "check_layers": check_layers, "labels counted": local_items is not None,
            "attention layers": None if features is None else len(features.attention_layers),
        }
        weights = weights_digest() if weights_digest is not None and check_layers else None
        agreement.payload = (local_items, _previous_trace(resolved), weights,
                             None if shapes is None else (*shapes[:3], str(shapes.dtype)))
    records = agreement.records.get("CP group", [])
    num_items = local_items
    if len(records) > 1:
        _check_shapes_agree(records)
        _check_previous_traces(records)
        _check_weights(records)
        if local_items is not None:
            num_items = sum(r.payload[0] for r in records)
    plan = StepPlan(
        sharded=sharded, options=options, group=resolved, group_arg=group, backend=backend,
        kernel="flash_attn" if backend == "ring_flash_attn" else options.kernel, device=device, step=step,
        check_layers=check_layers, num_items=num_items, local_items=local_items, features=features, shapes=shapes,
        tables={}, constants=_temperature_constants(features, sharded, device),
        group_names=_group_names(resolved, backend, options, sharded.cp_size), digest=_shard_digest(sharded),
        trace=torch.zeros(2, dtype=torch.int64))
    for key in keys:
        plan.tables[key] = _build(plan, key)
    if resolved is not None:
        _LAST_TRACE[resolved.group_name] = plan.trace
    _log_choice(plan, shapes or model_shapes)
    return sharded.with_plan(plan)


def _choose_for_layers(sharded, options: AttentionOptions, shapes, device, keys) -> str:
    """One backend for every kind of layer of the step: ``auto`` prices the step's tightest layer (a global one if
    any); an explicit backend must run every one."""
    sinks = options.sinks
    if options.backend != "auto":
        for causal, window, chunk in keys:
            backend = _choose_backend(sharded, options, shapes or DEFAULT_SHAPES, device.type, causal=causal,
                                      window=window, softcap=options.softcap, sinks=sinks, chunk=chunk is not None)
        return backend
    causal = all(k[0] for k in keys)
    windows = [k[1] for k in keys]
    window = None if None in windows else max(windows)
    return _choose_backend(sharded, options, shapes or DEFAULT_SHAPES, device.type, causal=causal, window=window,
                           softcap=options.softcap, sinks=sinks, chunk=any(k[2] is not None for k in keys))


_LOGGED: set[tuple[str, str]] = set()  # (backend, kernel) choices logged (once per process, INFO)


def _log_choice(plan: StepPlan, shapes: AttentionShapes | None) -> None:
    if (plan.backend, plan.kernel) in _LOGGED or not logger.isEnabledFor(logging.INFO):
        return
    _LOGGED.add((plan.backend, plan.kernel))
    why = ""
    if plan.options.backend == "auto" and plan.backend != "ring_flash_attn" and plan.sharded.cp_size > 1:
        from cp_packing.cost import backend_times

        s = shapes or DEFAULT_SHAPES
        times = backend_times(plan.sharded, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                              dtype_bytes=(s.dtype or DEFAULT_SHAPES.dtype).itemsize)
        why = "; auto by the modelled busiest-rank time per layer: " + ", ".join(
            f"{name} {1e6 * t:.1f} us" for name, t in times.items())
    kernel = plan.kernel
    if kernel == "auto" and shapes is not None and shapes.dtype is not None:
        from cp_packing.attention.kernels import select_kernel

        kernel = select_kernel(plan.device, shapes.dtype, softcap=plan.options.softcap is not None)
    logger.info("context_parallel_attention: backend=%s kernel=%s (layout=%s, cp_size=%d)%s", plan.backend, kernel,
                plan.sharded.layout, plan.sharded.cp_size, why)


def clear_caches() -> None:
    """Forget the per-process state of the step plans: the last trace of each group, the logged choices, the
    warned layer keys (tests; a re-initialised world)."""
    _LAST_TRACE.clear()
    _LOGGED.clear()
    _WARNED.clear()
    _CODES.clear()
