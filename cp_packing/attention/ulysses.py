"""Ulysses (DeepSpeed-style) context-parallel attention: all-to-all from a sequence shard to a head shard.

One all-to-all turns each rank's ``T_local`` tokens with all ``H`` heads into ALL ``T`` tokens for ``H / cp`` heads,
permuted into global token order, so the batch's global ``cu_seqlens`` drive the varlen kernel whatever the
layout::

    rank 0: tokens 0..3, heads 0..3           rank 0: tokens 0..7, heads 0..1
    rank 1: tokens 4..7, heads 0..3   ─a2a─▶  rank 1: tokens 0..7, heads 2..3   ─kernel on global cu_seqlens─▶
                                                                               ─a2a back─▶ [T_local, H, D]

``cp`` must divide the query heads; key/value heads are replicated when it does not divide them. GQA, bytes,
memory, window, softcap and sinks: docs/attention.md, "Ulysses".
"""

from __future__ import annotations


import torch

from cp_packing.attention import kernels
from cp_packing.attention.comm import heads_to_seq, seq_to_heads
from cp_packing.attention.wire import is_wire, pack, unpack
from cp_packing.cost import kv_replication_factor
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["backward", "build_tables", "check_ulysses_heads", "fake", "forward", "from_wire", "kv_replication"]


# ------------------------------------------------------------------------------------------------------ heads


def check_ulysses_heads(num_heads: int, cp_size: int, *, name: str = "cp_size") -> None:
    """Raise a ValueError unless ``cp_size`` divides ``num_heads`` (the query heads), naming the alternatives.

    ``name`` is how the message names the Ulysses degree (``"ulysses_size"`` for the hybrid backend).

    >>> check_ulysses_heads(32, 8)
    >>> check_ulysses_heads(12, 8)
    Traceback (most recent call last):
    ...
    ValueError: backend='ulysses' splits the query heads over the CP ranks, but cp_size=8 does not divide the 12 query heads; use backend='allgather' (any head count), or a cp_size that divides 12 (1, 2, 3, 4, 6, 12)
    """
    if num_heads % cp_size != 0:
        sizes = ", ".join(str(d) for d in range(1, num_heads + 1) if num_heads % d == 0)
        raise ValueError(
            f"backend='ulysses' splits the query heads over the CP ranks, but {name}={cp_size} does not divide the "
            f"{num_heads} query heads; use backend='allgather' (any head count), or a {name} that divides "
            f"{num_heads} ({sizes})"
        )


def kv_replication(num_heads: int, num_kv_heads: int, cp_size: int) -> int:
    """How many times each key/value head is replicated so that ``cp_size`` ranks each get whole GQA groups.

    ``cp / gcd(H_kv, cp)``: 1 when cp divides ``H_kv`` (k/v sharded like q); with fewer key/value heads than ranks
    each rank gets one replica. Needs ``H % cp == 0`` and ``H % H_kv == 0`` (then the factor divides ``H / H_kv``).

    >>> kv_replication(32, 8, 4), kv_replication(32, 8, 16), kv_replication(12, 6, 4)
    (1, 2, 2)
    """
    check_ulysses_heads(num_heads, cp_size)
    return kv_replication_factor(num_kv_heads, cp_size)


# ------------------------------------------------------------------------------------------------ collectives


def _global_permutation(sharded: ShardedPackedSeqParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(order, inverse)``: gathered row -> global position and back; ``None`` when they are the identity
    (``contiguous``, or ``cp_size == 1``). One host sync (built once per step, in the step plan)."""
    order = sharded.global_token_order().reshape(-1).to(device)  # [T] gathered row -> global position
    if bool(torch.equal(order, torch.arange(order.numel(), device=device))):  # host sync
        return None
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), dtype=order.dtype, device=device)  # global position -> row
    return order, inverse


def _to_global(xs, perm):
    return xs if perm is None else [x.index_select(0, perm[1]) for x in xs]


def _to_gathered(xs, perm):
    return xs if perm is None else [x.index_select(0, perm[0]) for x in xs]


def replicate_kv(k: torch.Tensor, v: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H_kv, D]`` -> ``[T, H_kv * rep, D]``: head j is key/value head ``j // rep`` (identity for rep 1)."""
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def head_slice(num_heads: int, size: int, rank: int) -> slice:
    """The query heads rank ``rank`` of a ``size``-rank all-to-all holds: ``[rank * H/size, (rank+1) * H/size)``."""
    per = num_heads // size
    return slice(rank * per, (rank + 1) * per)


def sliced_sinks_grad(dout, out, lse, sinks: torch.Tensor | None, heads: slice, needed: bool) -> torch.Tensor | None:
    """``[H]`` gradient of ``sinks`` whose ``heads`` slice is this rank's ``kernels.sink_grad`` (zero elsewhere),
    or ``None`` without sinks or when no gradient is needed."""
    if sinks is None or not needed:
        return None
    grad = torch.zeros_like(sinks)
    grad[heads] = kernels.sink_grad(dout, out, lse, sinks[heads])
    return grad


def sum_replicas(dk: torch.Tensor, dv: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adjoint of ``replicate_kv``: the replicas' gradients summed back into their key/value head."""
    if rep == 1:
        return dk, dv
    return tuple(x.view(x.shape[0], -1, rep, x.shape[2]).sum(2) for x in (dk, dv))


# ------------------------------------------------------------------------------- the attention op's backend


def build_tables(ctx, causal: bool, window: int | None, chunk: int | None = None) -> tuple[torch.Tensor, ...]:
    """The step plan's Ulysses tables (``cp_packing.attention.wire``): the gathered <-> global permutation (empty
    when it is the identity) and the global ``cu_seqlens``; the longest segment on the host."""
    params = ctx.sharded.global_params
    perm = _global_permutation(ctx.sharded, ctx.device)
    empty = torch.zeros(0, dtype=torch.int64, device=ctx.device)
    order, inverse = perm if perm is not None else (empty, empty)
    return pack([int(params.max_seqlen), int(perm is not None)], [order, inverse, params.cu_seqlens], ctx.device)


def from_wire(tables) -> tuple:
    """``(permutation or None, cu_seqlens, max_seqlen)`` of :func:`build_tables`' wire; decoded tables pass
    through."""
    if not is_wire(tables):
        return tables
    (max_seqlen, permuted), (order, inverse, cu_seqlens) = unpack(tables)
    return (order, inverse) if permuted else None, cu_seqlens.to(torch.int32), max_seqlen


def _head_shapes(q, k, cp_size: int) -> tuple[int, int, int]:
    """``(T, query heads, key/value heads)`` of this rank's head shard (fake implementations: head counts may be
    symbolic there, so the replication factor is read as a plain int)."""
    rep = kv_replication_factor(int(k.shape[1]), cp_size)
    return q.shape[0] * cp_size, q.shape[1] // cp_size, k.shape[1] * rep // cp_size


def _head_shard(q, k, v, group, cp_size: int, perm) -> list[torch.Tensor]:
    """``[qh, kh, vh]``: every rank's tokens in global order, this rank's heads (k/v replicated first when ``cp``
    does not divide their heads); the forward and, again, the backward (nothing of it is saved)."""
    k, v = replicate_kv(k, v, kv_replication_factor(k.shape[1], cp_size))  # [T_local, H_kv * rep, D]
    return [x.contiguous() for x in _to_global(seq_to_heads([q, k, v], group, cp_size), perm)]  # [T, h, D]


def forward(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    """The op's forward: ``[out, lse_h]``. Backward sends q, k, v (and out) to the head shard again, so the layer
    saves its local tensors only."""
    perm, cu_seqlens, max_seqlen = from_wire(tables)
    cp_size, group = layer.cp_size, layer.group
    qh, kh, vh = _head_shard(q, k, v, group, cp_size, perm)
    mine = head_slice(q.shape[1], cp_size, layer.cp_rank)
    out_h, lse = kernels.run_forward(layer.kernel, qh, kh, vh, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                     layer.scale, layer.causal, layer.window, layer.softcap,
                                     None if sinks is None else sinks[mine])  # [T, H/cp, D], [H/cp, T]
    del qh, kh, vh
    (out,) = heads_to_seq(_to_gathered([out_h], perm), group, cp_size)
    return [out, lse.contiguous()]


def backward(dout, q, k, v, sinks, saved, tables, layer):
    """The op's backward: ``(dq, dk, dv, dsinks)``."""
    out, lse = saved
    perm, cu_seqlens, max_seqlen = from_wire(tables)
    cp_size, group = layer.cp_size, layer.group
    douth, out_h = (x.contiguous() for x in _to_global(seq_to_heads([dout, out], group, cp_size), perm))
    qh, kh, vh = _head_shard(q, k, v, group, cp_size, perm)
    dqh, dkh, dvh = kernels.run_backward(layer.kernel, douth, qh, kh, vh, out_h, lse, cu_seqlens, cu_seqlens,
                                         max_seqlen, max_seqlen, layer.scale, layer.causal, layer.window,
                                         layer.softcap)
    del qh, kh, vh
    dsinks = sliced_sinks_grad(douth, out_h, lse, sinks, head_slice(q.shape[1], cp_size, layer.cp_rank), True)
    del douth, out_h
    grads = _to_gathered([dqh, dkh, dvh], perm)
    del dqh, dkh, dvh
    dq, dk, dv = heads_to_seq(grads, group, cp_size)
    return (dq, *sum_replicas(dk, dv, kv_replication_factor(k.shape[1], cp_size)), dsinks)


def fake(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    from cp_packing.attention.allgather import lse_like

    T, h, _ = _head_shapes(q, k, layer.cp_size)
    return [torch.empty_like(q), lse_like(q, T, h)]
