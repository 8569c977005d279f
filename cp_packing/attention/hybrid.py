"""Hybrid context-parallel attention: Ulysses inside groups of ``U`` ranks, the all-gather backend across them.

A CP group of ``cp = U * A`` ranks is cut two ways (the sub-groups are made once per (CP group, U) and cached)::

    Ulysses groups (all-to-all, intra-node): {0 .. U-1}, {U .. 2U-1}, ...          a = cp_rank // U
    all-gather groups (K/V, across nodes):   {u, U+u, 2U+u, ...} for u in [0, U)     u = cp_rank %  U

``U = cp`` is Ulysses, ``U = 1`` the all-gather backend. Bytes, sinks and gradients: docs/attention.md, "Hybrid".
"""

from __future__ import annotations

import torch

from cp_packing.attention import kernels
from cp_packing.attention.allgather import (
    AllGatherKeys,
    build_key_index,
    from_wire,
    gather_keys,
    lse_like,
    scatter_keys,
    to_wire,
)
from cp_packing.attention.comm import heads_to_seq, seq_to_heads
from cp_packing.attention.ulysses import (
    check_ulysses_heads,
    head_slice,
    kv_replication,
    replicate_kv,
    sliced_sinks_grad,
    sum_replicas,
)
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["backward", "build_tables", "check_ulysses_size", "fake", "forward", "hybrid_groups"]

# (CP group's name, U) -> (the world it was made in, Ulysses group, all-gather group): creating groups is a
# collective over their ranks and costly, so they are made once per CP group and Ulysses degree; an entry made in
# an earlier (destroyed and re-initialised) world is dropped, never reused.
_GROUPS: dict = {}


def check_ulysses_size(ulysses_size, num_heads: int, cp_size: int) -> None:
    """Raise unless ``ulysses_size`` is an int that divides ``cp_size`` and the query heads.

    >>> check_ulysses_size(2, 32, 8)
    >>> check_ulysses_size(3, 32, 8)
    Traceback (most recent call last):
    ...
    ValueError: ulysses_size=3 must divide cp_size=8 (Ulysses groups of 3 consecutive ranks); use one of 1, 2, 4, 8
    """
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int):
        raise TypeError(f"ulysses_size must be an int (ranks per Ulysses group), got {type(ulysses_size).__name__}")
    if ulysses_size < 1 or cp_size % ulysses_size:
        sizes = ", ".join(str(d) for d in range(1, cp_size + 1) if cp_size % d == 0)
        raise ValueError(
            f"ulysses_size={ulysses_size} must divide cp_size={cp_size} (Ulysses groups of {ulysses_size} "
            f"consecutive ranks); use one of {sizes}"
        )
    check_ulysses_heads(num_heads, ulysses_size, name="ulysses_size")


def hybrid_groups(group, cp_size: int, ulysses_size: int):
    """``(ulysses_group, allgather_group)`` of this rank (``None`` for a one-rank group), created once per CP group
    and ``ulysses_size``. Every rank of the CP group must call it (the first call creates the groups)."""
    import torch.distributed as dist

    if group is None:
        return None, None
    world = dist.distributed_c10d._get_default_group()
    for stale in [key for key, entry in _GROUPS.items() if entry[0] is not world]:
        del _GROUPS[stale]
    ranks = dist.get_process_group_ranks(group)  # global ranks, in CP-rank order
    key = (group.group_name, ulysses_size)
    if key not in _GROUPS:
        cp_rank = dist.get_rank(group)
        a, u = divmod(cp_rank, ulysses_size)
        U, A = ulysses_size, cp_size // ulysses_size
        mine_u = [ranks[a * U + i] for i in range(U)]
        mine_a = [ranks[j * U + u] for j in range(A)]
        ug = dist.new_group(mine_u, use_local_synchronization=True) if U > 1 else None
        ag = dist.new_group(mine_a, use_local_synchronization=True) if A > 1 else None
        _GROUPS[key] = (world, ug, ag)
    return _GROUPS[key][1:]


def _group_keys(sharded: ShardedPackedSeqParams, ulysses_size: int, causal: bool, device) -> AllGatherKeys:
    """The key index of this rank's Ulysses group's tokens against the gathered ``[T]`` buffer."""
    order = sharded.global_token_order().to(device)  # [cp, T_local]
    a = sharded.cp_rank // ulysses_size
    token_index = order[a * ulysses_size : (a + 1) * ulysses_size].reshape(-1)  # [U * T_local]
    cu = sharded.global_params.cu_seqlens.to(device=device, dtype=torch.int64)
    seg = torch.searchsorted(cu, token_index, right=True) - 1
    new_run = torch.ones_like(token_index, dtype=torch.bool)
    new_run[1:] = (token_index[1:] != token_index[:-1] + 1) | (seg[1:] != seg[:-1])
    starts = torch.nonzero(new_run).reshape(-1)
    run_cu = torch.cat([starts, torch.tensor([token_index.numel()], device=device)])
    return build_key_index(token_index, run_cu, cu[seg[starts]], order.reshape(-1), cu, causal, device)


def build_tables(ctx, causal: bool, window: int | None, chunk: int | None = None) -> tuple[torch.Tensor, ...]:
    """The step plan's hybrid tables: the Ulysses group's key index (``allgather.to_wire``). The two sub-groups are
    made by :func:`hybrid_groups` when the step is prepared and reach the op by name."""
    return to_wire(_group_keys(ctx.sharded, ctx.options.ulysses_size, causal, ctx.device))


def _head_shard(q, k, v, ugroup, U: int) -> list[torch.Tensor]:
    """``[qh, kh, vh]``: the Ulysses group's tokens, this rank's heads (sent again in backward: nothing is saved)."""
    k, v = replicate_kv(k, v, kv_replication(q.shape[1], k.shape[1], U))
    return [x.contiguous() for x in seq_to_heads([q, k, v], ugroup, U)]  # [U * T_local, h, D]


def forward(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    """The op's forward: ``[out, lse_h]`` (backward sends and gathers again: the layer saves its local tensors)."""
    ugroup, agroup = layer.subgroups
    U = layer.ulysses_size
    A = layer.cp_size // U
    keys = from_wire(tables)
    qh, kh, vh = _head_shard(q, k, v, ugroup, U)
    k_keys = gather_keys(kh, keys, agroup, A)
    del kh
    v_keys = gather_keys(vh, keys, agroup, A)
    del vh
    mine = head_slice(q.shape[1], U, layer.cp_rank % U)
    out_h, lse = kernels.run_forward(layer.kernel, qh, k_keys, v_keys, keys.cu_seqlens_q, keys.cu_seqlens_k,
                                     keys.max_seqlen_q, keys.max_seqlen_k, layer.scale, layer.causal, None,
                                     layer.softcap, None if sinks is None else sinks[mine])
    del qh, k_keys, v_keys
    (out,) = heads_to_seq([out_h], ugroup, U)
    return [out, lse.contiguous()]


def backward(dout, q, k, v, sinks, saved, tables, layer):
    """The op's backward (q/k/v sent to the head shard and K/V gathered again): ``(dq, dk, dv, dsinks)``."""
    out, lse = saved
    ugroup, agroup = layer.subgroups
    U = layer.ulysses_size
    A = layer.cp_size // U
    keys = from_wire(tables)
    douth, out_h = (x.contiguous() for x in seq_to_heads([dout, out], ugroup, U))
    qh, kh, vh = _head_shard(q, k, v, ugroup, U)
    total = kh.shape[0] * A  # rows of the gathered buffer
    k_keys = gather_keys(kh, keys, agroup, A)
    del kh
    v_keys = gather_keys(vh, keys, agroup, A)
    del vh
    dqh, dk_keys, dv_keys = kernels.run_backward_per_kv_head(layer.kernel, douth, qh, k_keys, v_keys, out_h, lse,
                                                 keys.cu_seqlens_q, keys.cu_seqlens_k, keys.max_seqlen_q,
                                                 keys.max_seqlen_k, layer.scale, layer.causal, None, layer.softcap)
    del qh, k_keys, v_keys
    dsinks = sliced_sinks_grad(douth, out_h, lse, sinks, head_slice(q.shape[1], U, layer.cp_rank % U), True)
    del douth, out_h
    dkh = scatter_keys(dk_keys, keys, total, agroup, A)  # [U * T_local, h_kv, D]
    del dk_keys
    dvh = scatter_keys(dv_keys, keys, total, agroup, A)
    del dv_keys
    dq, dk, dv = heads_to_seq([dqh, dkh, dvh], ugroup, U)
    return (dq, *sum_replicas(dk, dv, kv_replication(q.shape[1], k.shape[1], U)), dsinks)


def fake(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    U = layer.ulysses_size
    T, h = q.shape[0] * U, q.shape[1] // U
    return [torch.empty_like(q), lse_like(q, T, h)]
