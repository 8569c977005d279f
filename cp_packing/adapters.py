"""Kernel conventions: the keyword arguments each external CP attention kernel expects for one rank's shard.

``ShardedPackedSeqParams`` describes a shard the same way in every layout (local runs, their key starts). Kernels
want their own conventions; each gets one adapter here, a pure function of the shard:

* ring-flash-attn 0.1.8 ``zigzag_ring_flash_attn_varlen_func``: ``cu_seqlens = global_cu // cp`` (zigzag only);
* ring-flash-attn 0.1.8 ``llama3_flash_attn_varlen_func``: ``llama3_flash_attn_prepare_cu_seqlens`` (contiguous);
* TransformerEngine ``DotProductAttention(qkv_format="thd")`` with CP: the GLOBAL ``cu_seqlens`` (zigzag only).
"""

from __future__ import annotations

from typing import TypedDict

import torch

from cp_packing.sharding import ShardedPackedSeqParams

__all__ = [
    "Llama3Kwargs",
    "TransformerEngineKwargs",
    "ZigzagKwargs",
    "llama3_kwargs",
    "zigzag_kwargs",
    "ring_flash_attn_kwargs",
    "transformer_engine_kwargs",
]


class ZigzagKwargs(TypedDict):
    """``zigzag_ring_flash_attn_varlen_func(q, k, v, causal=True, **kwargs)``."""

    cu_seqlens: torch.Tensor
    max_seqlen: int


class Llama3Kwargs(TypedDict):
    """``llama3_flash_attn_varlen_func(q, k, v, causal=True, heads_k_stride=..., **kwargs)``."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    local_k_slice: slice


class TransformerEngineKwargs(TypedDict):
    """``DotProductAttention(qkv_format="thd", attn_mask_type="padding_causal")`` forward kwargs."""

    qkv_format: str
    attn_mask_type: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int


def _check_shard(sharded: ShardedPackedSeqParams) -> None:
    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(
            f"expected ShardedPackedSeqParams, got {type(sharded).__name__}; build it with "
            "cp_packing.shard_packed_seq_params(params, cp_size=..., cp_rank=...)"
        )


def _needs(sharded: ShardedPackedSeqParams, layout: str, who: str) -> None:
    if sharded.layout != layout:
        raise ValueError(
            f"{who} needs layout={layout!r}, but the shard has layout={sharded.layout!r}; shard with "
            f"layout={layout!r} (cp_packing.shard_packed_seq_params(..., layout={layout!r})), or use "
            "cp_packing.context_parallel_attention (built-in all-gather backend, any layout)"
        )


def zigzag_kwargs(sharded: ShardedPackedSeqParams) -> ZigzagKwargs:
    """ring-flash-attn's zigzag varlen metadata: every segment's length and the longest, divided by ``cp_size``.

    >>> import torch, cp_packing
    >>> p = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1] * 4 + [2] * 8]))
    >>> zigzag_kwargs(cp_packing.shard_packed_seq_params(p, cp_size=2, cp_rank=0, layout="zigzag"))["cu_seqlens"]
    tensor([0, 2, 6], dtype=torch.int32)
    """
    _check_shard(sharded)
    _needs(sharded, "zigzag", "ring-flash-attn's zigzag kernel")
    gp = sharded.global_params
    return ZigzagKwargs(cu_seqlens=(gp.cu_seqlens // sharded.cp_size).to(torch.int32),
                        max_seqlen=gp.max_seqlen // sharded.cp_size)


def llama3_kwargs(sharded: ShardedPackedSeqParams) -> Llama3Kwargs:
    """ring-flash-attn's llama3 varlen metadata (equal to ``llama3_flash_attn_prepare_cu_seqlens(global_cu, True,
    rank, world_size)``): the local runs as queries; keys are ONE slice of the global stream, from the first run's
    segment start to this rank's last token, with ``cu_seqlens_k`` relative to that slice.

    >>> import torch, cp_packing
    >>> p = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1] * 7 + [2] * 7 + [3] * 2]))
    >>> kw = llama3_kwargs(cp_packing.shard_packed_seq_params(p, cp_size=4, cp_rank=1, layout="contiguous"))
    >>> kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist(), kw["local_k_slice"]
    ([0, 3, 4], [0, 7, 8], slice(0, 8, None))
    """
    _check_shard(sharded)
    _needs(sharded, "contiguous", "ring-flash-attn's llama3 kernel")
    T_local = sharded.num_local_tokens
    run_cu = sharded.cu_seqlens.to(torch.int64)
    cu_k = torch.zeros_like(sharded.cu_seqlens)
    if run_cu.numel() < 2:
        return Llama3Kwargs(cu_seqlens_q=sharded.cu_seqlens, cu_seqlens_k=cu_k, max_seqlen_q=0, max_seqlen_k=0,
                            local_k_slice=slice(0, 0))
    run_end = sharded.token_index[run_cu[1:] - 1] + 1  # [R] one past each run's last global token
    k_lo = int(sharded.key_start[0])
    cu_k[1:] = (run_end - k_lo).to(cu_k.dtype)
    max_k = int((run_end - sharded.key_start).max())
    return Llama3Kwargs(cu_seqlens_q=sharded.cu_seqlens, cu_seqlens_k=cu_k, max_seqlen_q=sharded.max_seqlen,
                        max_seqlen_k=max_k, local_k_slice=slice(k_lo, (sharded.cp_rank + 1) * T_local))


def ring_flash_attn_kwargs(sharded: ShardedPackedSeqParams) -> ZigzagKwargs | Llama3Kwargs:
    """Keyword arguments of the ring-flash-attn 0.1.8 varlen function that fits the shard's layout:
    ``zigzag`` -> ``zigzag_kwargs``, ``contiguous`` -> ``llama3_kwargs``; other layouts are refused."""
    _check_shard(sharded)
    if sharded.layout == "zigzag":
        return zigzag_kwargs(sharded)
    if sharded.layout == "contiguous":
        return llama3_kwargs(sharded)
    raise ValueError(
        f"ring-flash-attn has no kernel for layout {sharded.layout!r}; use layout 'zigzag' or 'contiguous', or "
        "cp_packing.context_parallel_attention (built-in all-gather backend) for this layout"
    )


def transformer_engine_kwargs(sharded: ShardedPackedSeqParams) -> TransformerEngineKwargs:
    """Keyword arguments for TransformerEngine ``DotProductAttention(qkv_format="thd")`` with context parallelism.

    TE's THD context parallelism uses the zigzag placement and takes the GLOBAL ``cu_seqlens`` (it divides by
    ``cp_size`` itself) and asserts every sequence is a multiple of ``2*cp``. Padding lives inside segments here
    (``pad_segments``), so the ``*_padded`` offsets equal the unpadded ones. q/k/v are ``sharded.shard(...)``.
    """
    _check_shard(sharded)
    _needs(sharded, "zigzag", "TransformerEngine THD context parallelism")
    cu = sharded.global_params.cu_seqlens
    longest = sharded.global_params.max_seqlen
    return TransformerEngineKwargs(qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
                                   cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                                   max_seqlen_q=longest, max_seqlen_kv=longest)
