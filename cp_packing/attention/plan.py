"""The step plan: one step's CP attention, prepared once, agreed once, read by every layer.

A training step makes its metadata in one place (``cp_packing.hf.cp_model_inputs``, the loader, or
:func:`prepare_attention`); that place attaches a :class:`StepPlan` to the step's shard (``sharded.plan``, a field:
copies of the shard share it, FSDP2's input casting passes it through). The plan holds:

* the :class:`~cp_packing.options.AttentionOptions` and the CP group;
* the agreement: the FIRST attention call of the step runs every rank-local check (q/k/v against the shard, the
  options, the group, the HF wrapper's own refusals passed in as this rank's error), picks the backend and kernel,
  and makes ONE agreement over the group (``cp_packing.agreement``): a mistake on one rank raises on every rank;
* the tables every backend reads (the all-gather key index, the exchange's send/receive tables, Ulysses'
  permutation, ring-flash-attn's kwargs), built once per step and per distinct ``(causal, window)``;
* the count of valid labels over the group when the step was prepared with labels (the loss divides by it).

Later layers only read the plan: a dictionary lookup and the backend. Where ``check_layers`` is on (the first
:data:`~cp_packing.options.CHECKED_STEPS` steps of a group by default) every layer also makes a small agreement of
its call number and shapes, so a per-layer desync (an extra or missing layer, another head count) raises on every
rank instead of aborting gloo.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from cp_packing._checks import (HALF_DTYPES, IGNORE_INDEX, check_bool, check_number, check_softcap, check_window,
                                INTEGER_DTYPES)
from cp_packing._imports import try_import
from cp_packing.agreement import digest, fail_together, next_step
from cp_packing.capabilities import backend_refusal
from cp_packing.groups import (GroupLike, as_process_group, backend_config, backend_for_device, check_shard_in_group,
                                peek_group)
from cp_packing.options import CHECKED_STEPS, AttentionOptions
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["StepPlan", "check_attention_inputs", "prepare_attention", "resolve_attention_group", "select_backend"]

_RING_LAYOUTS = ("zigzag", "contiguous")

logger = logging.getLogger("cp_packing")


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


def _auto_wants_ring(device_type: str, dtype: torch.dtype, layout: str, cp_size: int, causal: bool, kernel: str) -> bool:
    """``backend="auto"``'s ring rule, before the import check: ring-flash-attn only where it is fast AND right
    (CUDA fp16/bf16: its float32 zigzag backward is wrong), where it has a kernel (zigzag/contiguous, causal), where
    there is something to communicate (cp_size > 1) and where the caller did not ask for another kernel."""
    return (causal and kernel in ("auto", "flash_attn") and layout in _RING_LAYOUTS and cp_size > 1
            and device_type == "cuda" and dtype in HALF_DTYPES)


_LOGGED: set[tuple[str, str]] = set()  # (backend, kernel) choices logged (once per process, INFO)


def _log_choice(plan: "StepPlan", q: torch.Tensor, k: torch.Tensor, causal: bool, window: int | None) -> None:
    if (plan.backend, plan.kernel) in _LOGGED:
        return
    _LOGGED.add((plan.backend, plan.kernel))
    why = ""
    if plan.options.backend == "auto" and plan.backend != "ring_flash_attn" and plan.sharded.cp_size > 1:
        from cp_packing.cost import backend_times

        times = backend_times(plan.sharded, num_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                              dtype_bytes=q.element_size(), causal=causal, window=window)
        why = "; auto by the modelled busiest-rank time per layer: " + ", ".join(
            f"{name} {1e6 * t:.1f} us" for name, t in times.items())
    logger.info("context_parallel_attention: backend=%s kernel=%s (layout=%s, cp_size=%d, %s on %s)%s", plan.backend,
                plan.kernel, plan.sharded.layout, plan.sharded.cp_size, str(q.dtype).replace("torch.", ""),
                q.device.type, why)


def _raise_refusal(refusal) -> None:
    if refusal is not None:
        cls, message = refusal
        raise cls(message)


def select_backend(
    q: torch.Tensor, sharded: ShardedPackedSeqParams, *, causal: bool = True, backend: str = "auto",
    kernel: str = "auto", ulysses_size: int | None = None, window: int | None = None, num_kv_heads: int | None = None,
    softcap: float | None = None, sinks: bool = False, hardware: Any = None, overlap: bool = True,
) -> tuple[str, str]:
    """The ``(backend, kernel)`` pair the attention runs for these arguments (docs/attention.md, "auto").

    ``backend="auto"``: ring-flash-attn where it is importable and fast AND right (CUDA fp16/bf16, zigzag or
    contiguous, causal, no window / softcap / sinks, ``cp_size > 1``, kernel auto or flash_attn); else the backend
    the step-time model of ``cp_packing.cost.choose_backend`` prices lowest among all-gather, exchange and Ulysses.
    An explicit backend is checked against ``cp_packing.capabilities`` and the head counts.

    Raises:
        ValueError / NotImplementedError / TypeError / ImportError: a backend or kernel that cannot serve these
            arguments (the message names the fix).
    """
    from cp_packing.attention import kernels
    from cp_packing.attention.hybrid import check_ulysses_size
    from cp_packing.attention.ulysses import check_ulysses_heads

    AttentionOptions(backend=backend, kernel=kernel, ulysses_size=ulysses_size)  # names and pairing, today's texts
    layout, cp_size = sharded.layout, sharded.cp_size
    if backend == "auto":
        if (window is None and softcap is None and not sinks
                and _auto_wants_ring(q.device.type, q.dtype, layout, cp_size, causal, kernel) and _ring_importable()):
            return "ring_flash_attn", "flash_attn"
        from cp_packing.cost import choose_backend

        H_kv = q.shape[1] if num_kv_heads is None else num_kv_heads
        chosen = choose_backend(sharded, num_heads=q.shape[1], num_kv_heads=H_kv, head_dim=q.shape[2],
                                dtype_bytes=q.element_size(), causal=causal, window=window, overlap=overlap,
                                **({} if hardware is None else {"hardware": hardware}))
        return chosen, kernels.resolve_kernel(kernel, q, softcap=softcap)
    _raise_refusal(backend_refusal(backend, layout=layout, causal=causal, window=window, softcap=softcap,
                                   sinks=sinks, kernel=kernel))
    if backend == "ulysses":
        check_ulysses_heads(q.shape[1], cp_size)
    if backend == "hybrid":
        check_ulysses_size(ulysses_size, q.shape[1], cp_size)
    if backend != "ring_flash_attn":
        return backend, kernels.resolve_kernel(kernel, q, softcap=softcap)
    from cp_packing.attention.ring import import_ring_flash_attn

    _raise_refusal(backend_refusal(backend, layout=layout, dtype=q.dtype) if q.dtype not in HALF_DTYPES
                   and layout == "zigzag" else None)  # independent of which flash_attn: before the import
    import_ring_flash_attn()  # ImportError that says what to install
    _raise_refusal(backend_refusal(backend, layout=layout, dtype=q.dtype))
    return "ring_flash_attn", "flash_attn"


def _check_heads_k_stride(stride: int | None, num_kv_heads: int) -> None:
    if stride is not None and num_kv_heads % stride:
        raise ValueError(f"heads_k_stride={stride!r} must be a positive int dividing the {num_kv_heads} k/v heads")


# --------------------------------------------------------------------------------------------------- the plan


class StepPlan:
    """One step's CP attention (see the module docstring). Built by :func:`prepare_attention`; read by the layers.

    A plain object (not a dataclass): tree-mapping utilities (FSDP2's input casting) pass it through unchanged, so
    every copy of the shard shares one plan and its state.

    Attributes:
        sharded: the shard (without its plan). group: the CP ProcessGroup, or None without communication (resolved
            at the agreement); group_arg: the ``group=`` the step was prepared with.
        options: the :class:`AttentionOptions`. device: where the tables live (q's device).
        backend, kernel: chosen at the first attention call (``None`` before).
        agreed: whether the step's agreement ran. step: this group's step number (1, 2, ...).
        check_layers: whether every layer makes its own small agreement this step.
        layer_calls: attention calls (forward) so far this step; expected_layers: how many the model has (read from
            the first layer's module config), or None.
        num_items: valid labels over the CP group (when prepared with labels), known after the agreement.
    """

    __slots__ = ("sharded", "group", "options", "device", "backend", "kernel", "agreed", "step", "check_layers",
                 "layer_calls", "backward_calls", "expected_layers", "num_items", "local_items", "digest", "_tables",
                 "group_arg", "features", "compiled", "pending", "__weakref__")

    def __init__(self, sharded: ShardedPackedSeqParams, group: GroupLike, options: AttentionOptions,
                 device: torch.device | None = None, local_items: int | None = None):
        self.sharded = sharded
        self.group_arg = group
        self.group = None
        self.options = options
        self.device = device
        self.backend = self.kernel = None
        self.agreed = False
        self.step = 0
        self.check_layers = False
        self.layer_calls = self.backward_calls = 0
        self.expected_layers = None
        self.local_items = local_items
        self.num_items = local_items if sharded.cp_size == 1 else None
        self.digest = _shard_digest(sharded)
        self.features = None  # the model's per-layer attention features (cp_packing.model_features), HF only
        self.compiled = False  # prepared for torch.compile (cp_model_inputs(compiled=True)): layers run custom ops
        self.pending = None  # a mistake found while preparing: raised on every rank by the step's agreement
        self._tables: dict = {}

    def __repr__(self) -> str:
        return (f"StepPlan(cp_size={self.sharded.cp_size}, cp_rank={self.sharded.cp_rank}, layout="
                f"{self.sharded.layout!r}, backend={self.backend!r}, kernel={self.kernel!r}, step={self.step})")

    # ------------------------------------------------------------------------------------------ the agreement

    def agree(self, q, k, v, *, causal, window, softcap, sinks, scale, error: BaseException | None = None) -> None:
        """The step's ONE agreement, at its first attention call: local checks (``error``: the caller's own
        refusal on this rank), the backend choice, then every rank compares (module docstring)."""
        sharded, options = self.sharded, self.options
        pg = peek_group(self.group_arg, sharded.cp_size)
        with fail_together("context_parallel_attention", (pg, "CP group")) as agreement:
            if error is not None:
                raise error
            if self.pending is not None:
                raise self.pending
            check_attention_inputs(q, k, v, sharded)
            if self.digest != _shard_digest(sharded):
                raise ValueError(_EDITED)
            self._check_layer_args(q, causal, window, softcap, sinks, scale)
            self.backend, self.kernel = select_backend(
                q, sharded, causal=causal, backend=options.backend, kernel=options.kernel,
                ulysses_size=options.ulysses_size, window=window, num_kv_heads=k.shape[1], softcap=softcap,
                sinks=sinks is not None or options.sinks, hardware=options.hardware, overlap=options.overlap)
            self.group = resolve_attention_group(self.group_arg, sharded, q.device)
            _check_heads_k_stride(options.heads_k_stride, k.shape[1])
            self.step = next_step(self.group)
            check = options.check_layers
            # without peers no layer can desync: nothing to check
            self.check_layers = self.group is not None and ((self.step <= CHECKED_STEPS) if check is None else check)
            agreement.fields = {
                "cp_size": sharded.cp_size, "layout": sharded.layout,
                "plan": digest(sharded.global_params.cu_seqlens, sharded.layout, sharded.cp_size,
                               sharded.plan_window),
                "T_local": sharded.num_local_tokens, "ulysses_size": options.ulysses_size,
                "q": (tuple(q.shape[1:]), str(q.dtype), q.device.type),
                "k": tuple(k.shape[1:]), "backend": self.backend, "kernel": self.kernel, "causal": causal,
                "softmax_scale": scale, "window": window, "softcap": softcap, "options": options,
                "sinks": None if sinks is None else tuple(sinks.shape), "check_layers": self.check_layers,
                "labels counted": self.local_items is not None,
                "attention layers": None if self.features is None else len(self.features.attention_layers),
            }
            agreement.payload = self.local_items
        records = agreement.records.get("CP group", [])
        if self.local_items is not None and len(records) > 1:
            self.num_items = sum(r.payload for r in records)
        self.device = q.device
        self.agreed = True
        _log_choice(self, q, k, causal, window)

    def _check_layer_args(self, q, causal, window, softcap, sinks, scale) -> None:
        from cp_packing.attention import kernels

        check_bool(causal, "causal")
        check_number(scale, "softmax_scale", allow_none=True)
        check_window(window, causal)
        if softcap is not None:
            check_softcap(softcap)
        kernels.check_sinks(sinks, q)

    def check_layer(self, call: str, fields: dict, error: BaseException | None = None,
                    layer_args: tuple | None = None) -> None:
        """A per-layer agreement (``check_layers``): the layer's call number, shapes and arguments on every rank."""
        with fail_together(call, (self.group, "CP group")) as agreement:
            if error is not None:
                raise error
            if layer_args is not None:
                self._check_layer_args(*layer_args)
            agreement.fields = fields

    # ------------------------------------------------------------------------------------------------ a layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | None = None,
               window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
               scale: float | None = None, error: BaseException | None = None,
               chunk: int | None = None) -> torch.Tensor:
        """One attention layer: ``q [T_local, H, D]``, k/v ``[T_local, H_kv, D]`` -> ``[T_local, H, D]``.

        ``None`` arguments take the options' defaults. ``chunk``: chunked attention (Llama 4: a query attends the
        keys of its own ``chunk``-token piece of its document). ``error``: the caller's own refusal on this rank
        (raised on every rank through the step's or the layer's agreement)."""
        options = self.options
        causal = options.causal if causal is None else causal
        softcap = options.softcap if softcap is None else softcap
        scale = options.scale if scale is None else scale
        if not self.agreed:
            self.agree(q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks, scale=scale, error=error)
        elif self.check_layers:
            if error is None and _shard_digest(self.sharded) != self.digest:
                error = ValueError(_EDITED)
            self.check_layer("attention layer", {
                "layer": self.layer_calls + 1, "q": (tuple(q.shape), str(q.dtype)), "k": tuple(k.shape),
                "causal": causal, "window": window, "softcap": softcap,
                "sinks": None if sinks is None else tuple(sinks.shape)}, error, (q, causal, window, softcap, sinks,
                                                                               scale))
        elif error is not None:
            raise error
        self.layer_calls += 1
        tables = self._tables.get((causal, window, chunk))
        if tables is None:
            tables = self.tables(causal, window, chunk)
        return _LAYER[self.backend](self, tables, q, k, v, sinks, causal=causal, window=window, softcap=softcap,
                                    scale=scale)

    def check_ran(self) -> None:
        """Raise unless this step's model ran cp_packing's attention in all its attention layers (the guard the loss
        runs before any gradient: a model switched to ``"sdpa"`` would attend across documents and shards)."""
        if self.compiled:
            return  # the compiled layers run custom ops: nothing counts them (the model guard checks the implementation)
        fix = ("the model runs another attention implementation (attn_implementation='sdpa' or 'eager', or a config "
               "shared with another model that switched it: build each model from copy.deepcopy(config) and "
               "set model.set_attn_implementation(cp_packing.hf.register_cp_attention()))")
        if not self.layer_calls:
            raise ValueError(f"no attention layer ran cp_packing's attention in this step: {fix}; its output is "
                             "wrong (documents and shards attend across each other)")
        expected = len(self.features.attention_layers) if self.features is not None else 0
        if expected and self.layer_calls % expected:
            raise ValueError(f"{self.layer_calls} attention calls ran cp_packing's attention in this step, not a "
                             f"multiple of the model's {expected} attention layers: some layers run another "
                             f"attention; {fix}")

    def backward_check(self, layer: int) -> None:
        """Called by the backends' backward: the per-layer agreement of a backward call (``check_layers``)."""
        self.backward_calls += 1
        if self.check_layers:
            self.check_layer("attention backward", {"layer": layer})

    def constant(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, once per step for ``key`` (a per-step constant a layer needs, e.g. a per-token factor on q's
        device): later layers read it, no host-to-device copy per layer."""
        value = self._tables.get(("constant", *key))
        if value is None:
            value = self._tables[("constant", *key)] = build()
        return value

    def tables(self, causal: bool = True, window: int | None = None, chunk: int | None = None):
        """The backend's tables for ``(causal, window, chunk)`` (built on first use in the step)."""
        key = (causal, window, chunk)
        if key not in self._tables:
            if self.agreed and _shard_digest(self.sharded) != self.digest:
                raise ValueError(_EDITED)
            if chunk is None:
                self._tables[key] = _BUILD[self.backend](self, causal, window)
            elif self.backend in ("allgather", "exchange"):
                self._tables[key] = _BUILD[self.backend](self, causal, window, chunk)
            else:
                raise NotImplementedError(
                    f"backend={self.backend!r} cannot run chunked attention (chunk={chunk}, Llama 4's chunked "
                    "layers); use backend='allgather' or 'exchange' (or 'auto')")
        return self._tables[key]


_EDITED = ("the shard's metadata (token_index, cu_seqlens, key_start or the global cu_seqlens) changed in place after "
           "its step was prepared; build a new shard (and prepare it) instead of editing one")


def _shard_digest(sharded: ShardedPackedSeqParams) -> str:
    return digest(sharded.global_params.cu_seqlens, sharded.token_index, sharded.cu_seqlens, sharded.key_start)


# Backend name -> (tables builder, layer function); filled by the backend modules' register() at import.
_BUILD: dict[str, Callable] = {}
_LAYER: dict[str, Callable] = {}


def register_backend(name: str, build: Callable, layer: Callable) -> None:
    """Register a backend: ``build(plan, causal, window) -> tables`` (once per step and key) and
    ``layer(plan, tables, q, k, v, sinks, *, causal, window, softcap, scale) -> out``."""
    _BUILD[name] = build
    _LAYER[name] = layer


def _count_labels(labels: Any, sharded: ShardedPackedSeqParams, ignore_index: int) -> int:
    """This rank's valid labels, checked: integer, one per local token, shifted on the global stream (a valid label
    on the last token of a segment is HF's unshifted convention: ``cp_packing.labels.check_labels_shifted``)."""
    from cp_packing.labels import check_labels_shifted, segment_ends

    if not isinstance(labels, torch.Tensor) or labels.dtype not in INTEGER_DTYPES:
        raise TypeError(f"labels must be an integer tensor (this rank's shifted labels), got "
                        f"{type(labels).__name__ if not isinstance(labels, torch.Tensor) else labels.dtype}")
    flat = labels.reshape(-1)
    if flat.numel() != sharded.num_local_tokens:
        raise ValueError(f"labels hold {flat.numel()} tokens but this rank holds T_local={sharded.num_local_tokens}; "
                         "pass this rank's shard of the labels")
    segment_end = segment_ends(sharded.global_params.cu_seqlens, sharded.token_index.to(flat.device))
    check_labels_shifted(flat, segment_end=segment_end, ignore_index=ignore_index)
    return int((flat != ignore_index).sum())


def prepare_attention(
    sharded: ShardedPackedSeqParams,
    *,
    group: GroupLike = None,
    options: AttentionOptions | None = None,
    labels: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    **option_kwargs: Any,
) -> ShardedPackedSeqParams:
    """This step's shard with its :class:`StepPlan` attached (``result.plan``): prepare once per step, then every
    attention layer (``context_parallel_attention(q, k, v, result)``) only reads the plan. No communication here:
    the step's one agreement runs at its first attention call.

    Args:
        sharded: this rank's ``ShardedPackedSeqParams`` of the step.
        group: the CP ProcessGroup (or 1-D DeviceMesh); ``None``: the default group where ``cp_size > 1``.
        options: the :class:`~cp_packing.options.AttentionOptions` (default: all defaults), or its fields as
            keyword arguments (``backend="exchange"``).
        labels: this rank's shifted labels (optional): their valid count, summed over the group in the agreement,
            becomes ``plan.num_items``, the divisor ``packed_cross_entropy(..., sharded=result)`` uses.
        ignore_index: the label value to ignore.

    Returns:
        A copy of ``sharded`` whose ``plan`` is this step's.

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
    if options is None:
        options = AttentionOptions(**option_kwargs)
    elif option_kwargs:
        options = options.replace(**option_kwargs)
    elif not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be cp_packing.AttentionOptions, got {type(options).__name__}")
    local_items, pending = None, None
    if labels is not None:
        try:
            local_items = _count_labels(labels, sharded, ignore_index)
        except (TypeError, ValueError) as exc:  # raised on every rank, by the step's agreement
            local_items, pending = 0, exc
    plan = StepPlan(sharded.without_plan(), group, options, local_items=local_items)
    plan.pending = pending
    return sharded.with_plan(plan)
