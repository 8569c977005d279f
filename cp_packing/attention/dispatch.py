"""One entry point for context-parallel attention over a packed batch: ``context_parallel_attention``.

It takes this rank's ``q [T_local, H, D]``, ``k``/``v [T_local, H_kv, D]`` and its ``ShardedPackedSeqParams`` and
returns ``[T_local, H, D]``: attention over the keys of each token's segment, equal to full attention on the global
stream, sharded. It runs the step plan of the shard (``cp_packing.attention.plan``); a shard without one is
prepared here for q's shapes (this call is its own step: one agreement). The backends, ``"auto"``'s rule and what
each runs: docs/attention.md.
"""

from __future__ import annotations

import torch

from cp_packing.attention.plan import prepare_attention, select_backend
from cp_packing.capabilities import BACKENDS as _BACKENDS
from cp_packing.groups import GroupLike
from cp_packing.options import AttentionOptions
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["BACKENDS", "allgather_attention", "context_parallel_attention", "hybrid_attention", "ring_attention",
           "select_backend", "ulysses_attention"]

BACKENDS = ("auto", *_BACKENDS)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sharded: ShardedPackedSeqParams,
    *,
    group: GroupLike = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    kernel: str = "auto",
    ulysses_size: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention of this CP rank's tokens over their whole segments, for any layout. Differentiable.

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, H_kv, D]`` with ``H % H_kv == 0`` (GQA): this rank's tokens in
            ``sharded``'s local order (``sharded.shard(x)``), one floating dtype, one device.
        sharded: this rank's ``ShardedPackedSeqParams``: a prepared step (``prepare_attention``) or a plain shard.
        group: the CP ``ProcessGroup`` or a 1-D ``DeviceMesh`` (``None``: the step's, else the default group);
            no communication and no group needed with ``cp_size == 1``.
        causal: causal within each segment (default); ``False``: every token attends its whole segment.
        softmax_scale: default ``1 / sqrt(D)``.
        backend, kernel, ulysses_size: for a shard without a plan: the ``AttentionOptions`` of this call's step
            (a prepared step has its own).
        window: sliding window per segment (``None``: none; needs ``causal=True``): a token at in-segment position
            ``p`` attends keys ``p - window < k <= p`` (HF's ``sliding_window``).
        softcap: logit soft-capping (``None`` or a float > 0): scaled scores ``s`` become ``softcap * tanh(s /
            softcap)`` (HF Gemma 2's ``attn_logit_softcapping``).
        sinks: attention sinks (``None`` or a floating ``[H]`` tensor on q's device, HF's ``s_aux``): one logit per
            query head in every softmax denominator; its gradient on each rank is this rank's part.
        chunk: chunked attention (Llama 4): a query attends only the keys of its own ``chunk``-token piece of its
            document.

    Returns:
        ``[T_local, H, D]`` in q's dtype.

    Raises:
        TypeError / ValueError / NotImplementedError / ImportError, on every rank (the step's agreement): malformed
        inputs, a group that does not match ``sharded``, a backend or kernel that cannot run these arguments (the
        message names the fix; which runs what: ``cp_packing.capabilities``).

    >>> import torch, cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 0]]))
    >>> sharded = cp_packing.shard_packed_seq_params(params, cp_size=1, cp_rank=0)  # no CP: no group needed
    >>> q = k = v = torch.randn(6, 2, 8)
    >>> context_parallel_attention(q, k, v, sharded).shape
    torch.Size([6, 2, 8])
    """
    if not isinstance(sharded, ShardedPackedSeqParams):
        from cp_packing.attention.plan import check_attention_inputs

        check_attention_inputs(q, k, v, sharded)  # the TypeError naming the fix (every rank passes the same type)
    plan = sharded.plan
    if plan is None or (group is not None and group is not plan.group_arg):
        plan = _prepare_call(q, k, v, sharded, group, backend, kernel, ulysses_size, causal, window, softcap, sinks,
                             softmax_scale, chunk)
    return plan.attend(q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks, scale=softmax_scale,
                       chunk=chunk)


def _prepare_call(q, k, v, sharded, group, backend, kernel, ulysses_size, causal, window, softcap, sinks, scale,
                  chunk):
    """A step for this one call, prepared for q's shapes and this call's arguments (one agreement)."""
    from cp_packing.attention.plan import check_layer_args, check_attention_inputs
    from cp_packing.model_features import LayerFeatures, ModelFeatures

    options, error = AttentionOptions(), None
    try:
        options = AttentionOptions(backend=backend, kernel=kernel, ulysses_size=ulysses_size, causal=causal,
                                   softcap=softcap, sinks=isinstance(sinks, torch.Tensor), scale=scale, window=window)
        check_attention_inputs(q, k, v, sharded)
        check_layer_args(q, causal, window, softcap, sinks, scale)
    except (TypeError, ValueError) as exc:  # raised on every rank, through the call's agreement
        error = exc
    features = None
    if chunk is not None and error is None:
        layer = LayerFeatures("chunked_attention", causal=causal, window=window, chunk=chunk)
        features = ModelFeatures("", "", (layer,))
    shaped = error is None
    step = prepare_attention(sharded, group=group, options=options, features=features, error=error,
                             num_heads=q.shape[1] if shaped else None, num_kv_heads=k.shape[1] if shaped else None,
                             head_dim=q.shape[2] if shaped else None, dtype=q.dtype if shaped else None,
                             device=q.device if isinstance(q, torch.Tensor) else None)
    return step.plan


# ------------------------------------------------------------------------------------ one backend, by name


def allgather_attention(q, k, v, sharded: ShardedPackedSeqParams, *, group=None, causal: bool = True,
                        softmax_scale: float | None = None, kernel: str = "auto", window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather context-parallel attention for any layout (module docstring): ``context_parallel_attention``
    with ``backend="allgather"``. Differentiable; a one-rank mistake raises on every rank."""
    return context_parallel_attention(q, k, v, sharded, group=group, causal=causal, softmax_scale=softmax_scale,
                                      backend="allgather", kernel=kernel, window=window, softcap=softcap, sinks=sinks)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharded: ShardedPackedSeqParams, *,
    group: GroupLike = None, causal: bool = True, softmax_scale: float | None = None, kernel: str = "auto",
    softcap: float | None = None, sinks: torch.Tensor | None = None, window: int | None = None,
) -> torch.Tensor:
    """Ulysses context-parallel attention for any layout (module docstring): ``context_parallel_attention`` with
    ``backend="ulysses"``. Differentiable; a one-rank mistake raises on every rank.

    Raises:
        ValueError: ``cp_size`` does not divide the query heads (use ``backend="allgather"``), and the checks of
            ``context_parallel_attention``.

    >>> import torch, cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 0]]))
    >>> sharded = cp_packing.shard_packed_seq_params(params, cp_size=1, cp_rank=0)  # no CP: no group needed
    >>> q, kv = torch.randn(6, 4, 8), torch.randn(6, 1, 8)  # GQA: 4 query heads, 1 key/value head
    >>> ulysses_attention(q, kv, kv, sharded).shape
    torch.Size([6, 4, 8])
    """
    return context_parallel_attention(q, k, v, sharded, group=group, causal=causal, softmax_scale=softmax_scale,
                                      backend="ulysses", kernel=kernel, softcap=softcap, sinks=sinks, window=window)


def hybrid_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sharded: ShardedPackedSeqParams, *, ulysses_size: int,
    group: GroupLike = None, causal: bool = True, softmax_scale: float | None = None, kernel: str = "auto",
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ulysses within groups of ``ulysses_size`` consecutive CP ranks, all-gather across them (module docstring):
    ``context_parallel_attention`` with ``backend="hybrid"``. Differentiable; a one-rank mistake raises on every
    rank."""
    return context_parallel_attention(q, k, v, sharded, group=group, causal=causal, softmax_scale=softmax_scale,
                                      backend="hybrid", kernel=kernel, ulysses_size=ulysses_size, softcap=softcap,
                                      sinks=sinks)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sharded: ShardedPackedSeqParams,
    *,
    group: GroupLike,
    softmax_scale: float | None = None,
    heads_k_stride: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of this rank's tokens over the whole packed batch, with ring-flash-attn:
    ``context_parallel_attention(..., backend="ring_flash_attn")`` (``heads_k_stride``, llama3 only: key/value heads
    all-gathered per step, a divisor of ``H_kv``; default all of them).

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, H_kv, D]``: fp16/bf16 (float32 with the contiguous layout only on
            the pure-torch test stand-in of flash_attn); zigzag -> ``zigzag_ring_flash_attn_varlen_func``,
            contiguous -> ``llama3_flash_attn_varlen_func``.

    Raises:
        TypeError: a dtype the ring refuses (``ring_dtype_refusal``). ValueError: shapes that do not match the
            shard, an unknown layout, a group that is not the shard's. ImportError: ring-flash-attn / flash_attn /
            transformers missing (see ``import_ring_flash_attn``).
    """
    from cp_packing.attention.plan import check_attention_inputs

    error, shapes = None, {}
    try:
        check_attention_inputs(q, k, v, sharded)
        shapes = {"num_heads": q.shape[1], "num_kv_heads": k.shape[1], "head_dim": q.shape[2], "dtype": q.dtype,
                  "device": q.device}
    except (TypeError, ValueError) as exc:  # raised on every rank by the step's agreement
        if not isinstance(sharded, ShardedPackedSeqParams):
            raise
        error = exc
    step = prepare_attention(sharded, group=group, backend="ring_flash_attn", heads_k_stride=heads_k_stride,
                             error=error, **shapes)
    return step.plan.attend(q, k, v, scale=softmax_scale)
