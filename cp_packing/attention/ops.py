"""The all-gather CP attention as ``torch.library`` custom ops, so that ``torch.compile`` sees through it.

:func:`prepare_compiled_attention` (``cp_packing.hf.cp_model_inputs(..., compiled=True)``) runs the step's checks
and agreement before the model call and builds its :class:`CompiledAttentionPlan` (the key index and run metadata
as tensors, the host-side sizes in one CPU tensor, the group by name); in the model,
:func:`compiled_allgather_attention` calls the custom ops ``cp_packing::allgather_attention_fwd`` /
``cp_packing::allgather_attention_bwd`` (tied by ``register_autograd``, with fake implementations), which run the
all-gather backend's own steps. Why, what is covered and what recompiles: docs/compile.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cp_packing.agreement import digest, fail_together
from cp_packing.attention import kernels
from cp_packing.attention.allgather import AllGatherKeys, allgather_keys, backward_impl, forward_impl
from cp_packing.attention.plan import resolve_attention_group
from cp_packing.capabilities import COMPILED_BACKENDS
from cp_packing.groups import GroupLike, peek_group
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["COMPILED_BACKENDS", "CompiledAttentionPlan", "compiled_allgather_attention", "prepare_compiled_attention"]

_SIZES = ("T_local", "max_seqlen_q", "max_seqlen_k", "key_first")  # the rows of CompiledAttentionPlan.sizes


@dataclass(frozen=True)
class CompiledAttentionPlan:
    """One step's all-gather attention metadata, prepared before the model call (tensors, ints and strs only).

    Attributes:
        key_index: int64 ``[N_k]`` on the tensors' device: the gathered-buffer row of every selected key, runs laid
            end to end (``AllGatherKeys.key_index``; a range written out when the keys are one range).
        cu_seqlens_q: int32 ``[R + 1]``, the local runs; cu_seqlens_k: int32 ``[R + 1]``, each run's keys.
        sizes: int64 ``[4]`` on the CPU: ``T_local``, the longest query run, the longest key run, and the first
            gathered row when the keys are one range (then selected as a view, no copy), else -1. A tensor, not
            Python ints, so a new step's values do not recompile the model.
        group_name: the CP process group's ``group_name`` (resolved inside the ops); ``""`` without communication.
        cp_size: the CP group size.
        kernel: the varlen kernel name (``"auto"`` is resolved inside the op, per dtype and device).
    """

    key_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    sizes: torch.Tensor
    group_name: str
    cp_size: int
    kernel: str


def prepare_compiled_attention(
    sharded: ShardedPackedSeqParams,
    *,
    group: GroupLike = None,
    backend: str = "auto",
    kernel: str = "auto",
    device: torch.device | str | None = None,
    error: BaseException | None = None,
) -> CompiledAttentionPlan:
    """Check this step on every rank, agree over the CP group once, and build its :class:`CompiledAttentionPlan`.

    Args:
        sharded: this rank's ``ShardedPackedSeqParams``.
        group: the CP process group (``None``: the default group; no communication when ``sharded.cp_size == 1``).
        backend: ``"auto"`` or ``"allgather"`` (:data:`COMPILED_BACKENDS`; both run the all-gather backend).
        kernel: ``"auto"``, ``"torch"``, ``"flash_attn"`` or ``"torch_varlen"`` (checked when the op runs).
        device: where the metadata tensors go (the model's device; default ``sharded.token_index``'s).
        error: a failure of the caller's own checks on this rank: raised on every rank through the agreement.

    Returns:
        The plan; costs one agreement over the group (none with ``cp_size == 1``) and the key index's host syncs.

    Raises:
        ValueError: a backend without a compiled path, a group that does not match ``sharded``, or ranks that
            disagree (same batch plan, ``T_local``, backend and kernel on every rank); any rank's ``error``.
    """
    device = torch.device(device) if device is not None else sharded.token_index.device
    pg = None
    with fail_together("cp_model_inputs(compiled=True)", (peek_group(group, sharded.cp_size), "CP group")) as agreement:
        if error is not None:
            raise error
        if backend not in ("auto", "allgather"):
            raise ValueError(
                f"backend={backend!r} has no compiled path: compiled=True runs the all-gather backend as "
                "torch.library custom ops; use backend='allgather' (or 'auto'), or prepare the inputs without "
                "compiled=True (then torch.compile breaks the graph in every attention layer)"
            )
        if not isinstance(kernel, str):
            raise TypeError(f"kernel must be a str, got {type(kernel).__name__}")
        pg = resolve_attention_group(group, sharded, device)
        agreement.fields = {
            "cp_size": sharded.cp_size, "layout": sharded.layout,
            "plan": digest(sharded.global_params.cu_seqlens, sharded.layout, sharded.cp_size, sharded.plan_window),
            "T_local": sharded.num_local_tokens, "backend": backend, "kernel": kernel,
        }
    keys = allgather_keys(sharded, causal=True, device=device)
    first = keys.key_slice.start if keys.key_slice is not None else -1
    key_index = keys.key_index if keys.key_index is not None else torch.arange(
        first, first + keys.num_keys, dtype=torch.int64, device=device)
    sizes = torch.tensor([sharded.num_local_tokens, keys.max_seqlen_q, keys.max_seqlen_k, first], dtype=torch.int64)
    for x in (key_index, keys.cu_seqlens_q, keys.cu_seqlens_k):  # their lengths change with every batch's documents
        torch._dynamo.maybe_mark_dynamic(x, 0)  # so a new step does not recompile (a hint, never an error)
    return CompiledAttentionPlan(
        key_index=key_index,
        cu_seqlens_q=keys.cu_seqlens_q,
        cu_seqlens_k=keys.cu_seqlens_k,
        sizes=sizes,
        group_name="" if pg is None else pg.group_name,
        cp_size=sharded.cp_size,
        kernel=kernel,
    )


# ------------------------------------------------------------------------------------------------- op bodies


def _group(group_name: str):
    return None if not group_name else dist.distributed_c10d._resolve_process_group(group_name)


def _keys(key_index: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, sizes: torch.Tensor,
          Tq: int) -> AllGatherKeys:
    T_local, max_q, max_k, first = sizes.tolist()  # a CPU tensor: no device sync
    if Tq != T_local:
        raise ValueError(
            f"q has {Tq} tokens but the compiled attention plan was prepared for T_local={T_local}; pass this "
            "step's cp_model_inputs(..., compiled=True) with this step's batch"
        )
    n = key_index.numel()
    return AllGatherKeys(key_index=None if first >= 0 else key_index, key_slice=slice(first, first + n) if first >= 0
                         else None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                         num_keys=n)


@torch.library.custom_op("cp_packing::allgather_attention_fwd", mutates_args=())
def _fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_index: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, sizes: torch.Tensor, sinks: torch.Tensor | None, group_name: str, cp_size: int,
    softmax_scale: float | None, causal: bool, kernel: str, window: int | None, softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather K/V, select each run's keys, varlen forward: ``out [T_local, H, D]``, ``lse [H, T_local]``."""
    keys = _keys(key_index, cu_seqlens_q, cu_seqlens_k, sizes, q.shape[0])
    kernel = kernels.resolve_kernel(kernel, q, softcap=softcap)
    with torch.autocast(q.device.type, enabled=False):  # the caller cast q/k/v; the kernel runs in their dtype
        out, lse = forward_impl(q, k, v, sinks, keys, _group(group_name), cp_size, softmax_scale, causal, kernel,
                                window, softcap)
    return out, lse.contiguous()


@_fwd.register_fake
def _(q, k, v, key_index, cu_seqlens_q, cu_seqlens_k, sizes, sinks, group_name, cp_size, softmax_scale, causal,
      kernel, window, softcap):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


@torch.library.custom_op("cp_packing::allgather_attention_bwd", mutates_args=())
def _bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    key_index: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, sizes: torch.Tensor,
    sinks: torch.Tensor | None, group_name: str, cp_size: int, softmax_scale: float | None, causal: bool, kernel: str,
    window: int | None, softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-gather K/V, varlen backward from the saved ``out``/``lse``, reduce-scatter dK/dV: ``dq, dk, dv, dsinks``
    (``dsinks`` is ``[0]`` without sinks)."""
    keys = _keys(key_index, cu_seqlens_q, cu_seqlens_k, sizes, q.shape[0])
    kernel = kernels.resolve_kernel(kernel, q, softcap=softcap)
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv, dsinks = backward_impl(dout.contiguous(), q, k, v, sinks, out, lse, keys, _group(group_name),
                                           cp_size, softmax_scale, causal, kernel, window, softcap)
    return dq, dk, dv, q.new_empty(0) if dsinks is None else dsinks


@_bwd.register_fake
def _(dout, q, k, v, out, lse, key_index, cu_seqlens_q, cu_seqlens_k, sizes, sinks, group_name, cp_size,
      softmax_scale, causal, kernel, window, softcap):
    dsinks = q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


_TENSOR_ARGS = ("q", "k", "v", "key_index", "cu_seqlens_q", "cu_seqlens_k", "sizes", "sinks")


def _setup_context(ctx, inputs, output):
    q, k, v, key_index, cu_q, cu_k, sizes, sinks, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_index, cu_q, cu_k, sizes, sinks)
    ctx.options = tuple(options)  # group_name, cp_size, softmax_scale, causal, kernel, window, softcap
    ctx.has_sinks = sinks is not None


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, key_index, cu_q, cu_k, sizes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.cp_packing.allgather_attention_bwd(
        dout, q, k, v, out, lse, key_index, cu_q, cu_k, sizes, sinks, *ctx.options
    )
    return dq, dk, dv, None, None, None, None, dsinks if ctx.has_sinks else None, *([None] * len(ctx.options))


_fwd.register_autograd(_backward, setup_context=_setup_context)


def compiled_allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: CompiledAttentionPlan,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather CP attention through the custom ops: ``out [T_local, H, D]``. Differentiable; traceable.

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, H_kv, D]`` (``H % H_kv == 0``), this rank's tokens, one dtype.
        plan: this step's :class:`CompiledAttentionPlan` (``prepare_compiled_attention``).
        softmax_scale: default ``1 / sqrt(D)``.
        window: sliding window per segment (``None``: none): keys ``p - window < k <= p``. The plan's causal key
            index covers every window; the kernel masks each query to its own.
        softcap, sinks: logit soft-capping and attention sinks ``[H]``, passed to the kernels (which must take them).

    Returns:
        ``[T_local, H, D]`` in q's dtype, equal to ``context_parallel_attention(..., backend="allgather")``.

    Raises:
        TypeError: ``plan`` is not a ``CompiledAttentionPlan``. ValueError: ``causal=False``; the kernel's own
            checks (run inside the op).

    >>> import torch, cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 0]]))
    >>> sharded = cp_packing.shard_packed_seq_params(params, cp_size=1, cp_rank=0)
    >>> plan = prepare_compiled_attention(sharded)
    >>> q = k = v = torch.randn(6, 2, 8)
    >>> out = compiled_allgather_attention(q, k, v, plan)
    >>> torch.allclose(out, cp_packing.context_parallel_attention(q, k, v, sharded))
    True
    """
    if not isinstance(plan, CompiledAttentionPlan):
        raise TypeError(f"plan must be a CompiledAttentionPlan (prepare_compiled_attention), got {type(plan).__name__}")
    out, _ = torch.ops.cp_packing.allgather_attention_fwd(
        q, k, v, plan.key_index, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.sizes, sinks, plan.group_name,
        plan.cp_size, None if softmax_scale is None else float(softmax_scale), True, plan.kernel, window,
        None if softcap is None else float(softcap),
    )
    return out
