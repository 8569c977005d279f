"""Built-in all-gather context-parallel attention (the Llama 3 idea), for every layout.

K and V are all-gathered over the CP group (``[cp * T_local, H_kv, D]``, rank-major: the order of
``sharded.global_token_order()``); every local run (a piece of one segment) attends its keys, global tokens
``[key_start, run_last + 1)``, picked by ONE key index per step (``AllGatherKeys``, in the step plan; a view of the
gathered buffer when the index is one range: ``contiguous``, ``cp_size == 1``). Backward re-gathers K/V (saved
memory O(T_local) per layer) and reduce-scatters (SUM) dK/dV; gloo uses an all-to-all and a local sum. How it
works, its memory and its collectives: docs/attention.md, "How the all-gather backend works".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cp_packing._checks import check_window
from cp_packing.attention import kernels
from cp_packing.attention.comm import all_gather_tokens, reduce_scatter_tokens
from cp_packing.attention.wire import is_wire, pack, unpack
from cp_packing.layouts import expand_runs, layout_plan
from cp_packing.layouts.need import chunked_segments, split_plan
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["AllGatherKeys", "allgather_keys", "backward", "backward_impl", "build_key_index",
           "build_tables", "fake", "forward", "forward_impl", "from_wire", "gather_keys", "lse_like", "scatter_keys",
           "to_wire"]


# -------------------------------------------------------------------------------------------------- key index


@dataclass(frozen=True)
class AllGatherKeys:
    """Where each local run's keys are in the all-gathered ``[cp * T_local, ...]`` K/V buffer.

    Attributes:
        key_index: int64 ``[N_k]``, gathered-buffer row of every key, runs laid end to end; ``None`` when the
            keys are one range (then ``key_slice`` is set and the keys are a view of the buffer).
        key_slice: ``slice`` of the gathered buffer holding all keys in order, or ``None``.
        cu_seqlens_q: int32 ``[R + 1]``, the local runs (``sharded.cu_seqlens``) on the tensors' device.
        cu_seqlens_k: int32 ``[R + 1]``, run ``i``'s keys are rows ``[cu_seqlens_k[i], cu_seqlens_k[i+1])`` of the
            selected keys.
        max_seqlen_q, max_seqlen_k: ints, the longest run / key range.
        num_keys: ``N_k``, the number of selected keys (for zigzag ``(1 + 1/(2*cp))`` of the segment tokens, since
            the two chunks of a rank both reach back to the segment start; ``(cp+1)/(2*cp)`` on the last rank, whose
            two chunks touch and form one run).
    """

    key_index: torch.Tensor | None
    key_slice: slice | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    num_keys: int

    def select(self, gathered: torch.Tensor) -> torch.Tensor:
        """``[cp * T_local, ...]`` -> ``[N_k, ...]``: a view when the keys are one range, else an index_select."""
        if self.key_slice is not None:
            return gathered[self.key_slice]
        return gathered.index_select(0, self.key_index)

    def scatter_add(self, grad_keys: torch.Tensor, total: int) -> torch.Tensor:
        """Adjoint of ``select``: ``[N_k, ...]`` -> zero ``[total, ...]`` buffer with the key gradients added in."""
        if self.key_slice is not None and self.key_slice.start == 0 and self.key_slice.stop == total:
            return grad_keys.contiguous()
        out = grad_keys.new_zeros((total, *grad_keys.shape[1:]))
        if self.key_slice is not None:
            out[self.key_slice] = grad_keys
        else:
            out.index_add_(0, self.key_index, grad_keys)
        return out


def allgather_keys(
    sharded: ShardedPackedSeqParams,
    *,
    causal: bool = True,
    device: torch.device | str | None = None,
    window: int | None = None,
) -> AllGatherKeys:
    """The all-gather backend's key index for this rank (a step plan builds it once per step and keeps it).

    Args:
        sharded: this rank's ``ShardedPackedSeqParams`` (any layout).
        causal: ``True``: run ``i``'s keys are global tokens ``[key_start[i], last token of run i]``;
            ``False``: the run's whole segment.
        device: where the index tensors go (default: ``sharded.token_index.device``).
        window: sliding window (``None``: none; needs ``causal=True``): run ``i``'s keys start at
            ``max(key_start[i], first query of run i - window + 1)``, the earliest key any of its queries can see
            (fewer keys gathered and attended; the kernel still masks each query to its own window).

    Returns:
        ``AllGatherKeys``. Costs three host syncs (key count and maxima, the range test).
    """
    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(f"sharded must be ShardedPackedSeqParams, got {type(sharded).__name__}")
    window = check_window(window, causal)
    device = torch.device(device) if device is not None else sharded.token_index.device
    return build_key_index(sharded.token_index, sharded.cu_seqlens, sharded.key_start,
                           sharded.global_token_order().reshape(-1), sharded.global_params.cu_seqlens, causal, device,
                           window=window)


def build_key_index(
    token_index: torch.Tensor, run_cu: torch.Tensor, key_start: torch.Tensor, order: torch.Tensor,
    global_cu: torch.Tensor, causal: bool, device: torch.device, *, window: int | None = None,
) -> AllGatherKeys:
    """``AllGatherKeys`` for query tokens ``token_index`` ``[N]`` (global positions) in runs ``run_cu`` ``[R + 1]``
    whose keys start at ``key_start`` ``[R]``, against a gathered buffer whose row i holds global position
    ``order[i]`` (``[T]``). ``allgather_keys`` calls it with one rank's shard; the hybrid backend with the tokens of
    a Ulysses group. With a ``window``, a run's keys start no earlier than its first query - window + 1."""
    token_index = token_index.to(device)  # [N] int64
    run_cu = run_cu.to(device=device, dtype=torch.int64)  # [R + 1]
    key_start = key_start.to(device=device, dtype=torch.int64)  # [R]
    run_len = run_cu[1:] - run_cu[:-1]  # [R]
    if run_len.numel() == 0:  # an empty batch: no runs, no keys
        empty_cu = torch.zeros(1, dtype=torch.int32, device=device)
        return AllGatherKeys(None, slice(0, 0), empty_cu, empty_cu, 0, 0, 0)
    if causal:
        key_end = token_index[run_cu[1:] - 1] + 1  # [R] one past each run's last global token
        if window is not None:  # the run's first query sees back to itself - window + 1, later queries less far
            key_start = torch.maximum(key_start, token_index[run_cu[:-1]] - (window - 1))
    else:
        cu = global_cu.to(device=device, dtype=torch.int64)  # [S + 1]
        seg = torch.searchsorted(cu, key_start, right=True)  # index of each run's segment end in cu
        key_end = cu[seg]
    key_len = key_end - key_start  # [R] > 0
    num_keys, max_k, max_q = torch.stack([key_len.sum(), key_len.max(), run_len.max()]).tolist()  # host sync

    key_pos = expand_runs(key_start, key_len, num_keys)  # [N_k] global positions of the keys
    order = order.to(device)  # [T] gathered row -> global position
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), dtype=order.dtype, device=device)  # global position -> row
    key_index = inverse[key_pos]  # [N_k]
    first = int(key_index[0])
    is_range = bool(torch.equal(key_index, torch.arange(first, first + num_keys, device=device)))  # host sync

    cu_k = torch.zeros(key_len.numel() + 1, dtype=torch.int32, device=device)
    cu_k[1:] = torch.cumsum(key_len, 0)
    keys = AllGatherKeys(
        key_index=None if is_range else key_index,
        key_slice=slice(first, first + num_keys) if is_range else None,
        cu_seqlens_q=run_cu.to(torch.int32),
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(max_q),
        max_seqlen_k=int(max_k),
        num_keys=int(num_keys),
    )
    return keys


# ------------------------------------------------------------------------------------------------ the math
# One forward and one backward, run by the attention op (ops.py) and by the hybrid backend.


def gather_keys(x: torch.Tensor, keys: AllGatherKeys, group, cp_size: int) -> torch.Tensor:
    """``x`` ``[T_local, H_kv, D]`` all-gathered and its keys selected: ``[N_k, H_kv, D]`` (the gathered buffer is
    freed on return unless the keys are a view of it). K and V go one after the other, so at most one gathered
    buffer is live beside the selected keys."""
    return keys.select(x if group is None else all_gather_tokens(x, group, cp_size))


def forward_impl(q, k, v, sinks, keys: AllGatherKeys, group, cp_size: int, scale: float | None, causal: bool,
                 kernel: str, window: int | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather K/V, select each run's keys, the kernel: ``out [T_local, H, D]``, ``lse [H, T_local]`` (sinks in)."""
    k_keys = gather_keys(k, keys, group, cp_size)  # [N_k, H_kv, D]
    v_keys = gather_keys(v, keys, group, cp_size)
    return kernels.run_forward(kernel, q, k_keys, v_keys, keys.cu_seqlens_q, keys.cu_seqlens_k, keys.max_seqlen_q,
                               keys.max_seqlen_k, scale, causal, window, softcap, sinks)


def backward_impl(dout, q, k, v, sinks, out, lse, keys: AllGatherKeys, group, cp_size: int, scale: float | None,
                  causal: bool, kernel: str, window: int | None, softcap: float | None):
    """Re-gather K/V, the kernel's backward from the saved ``out``/``lse``, reduce-scatter dK/dV:
    ``(dq, dk, dv, dsinks)`` (``dsinks`` None without sinks). Each gathered or full-size buffer is freed once
    used (K's before V's is gathered; dK reduce-scattered before dV's full-size buffer is made)."""
    k_keys = gather_keys(k, keys, group, cp_size)  # re-gathered: only local tensors were saved
    v_keys = gather_keys(v, keys, group, cp_size)
    dq, dk_keys, dv_keys = kernels.run_backward_per_kv_head(kernel, dout, q, k_keys, v_keys, out, lse, keys.cu_seqlens_q,
                                                keys.cu_seqlens_k, keys.max_seqlen_q, keys.max_seqlen_k, scale,
                                                causal, window, softcap)
    del k_keys, v_keys
    # this rank's queries' share of the sinks' gradient: the shares sum over the CP group to the batch's
    dsinks = kernels.sink_grad(dout, out, lse, sinks) if sinks is not None else None
    total = cp_size * k.shape[0]
    dk = scatter_keys(dk_keys, keys, total, group, cp_size)  # [T_local, H_kv, D]
    del dk_keys
    dv = scatter_keys(dv_keys, keys, total, group, cp_size)
    return dq, dk, dv, dsinks


def scatter_keys(grad_keys, keys: AllGatherKeys, total: int, group, cp_size: int) -> torch.Tensor:
    """Adjoint of :func:`gather_keys`: ``[N_k, ...]`` onto the gathered rows, reduce-scattered (SUM)."""
    full = keys.scatter_add(grad_keys, total)  # [cp * T_local, H_kv, D]
    return full if group is None else reduce_scatter_tokens(full, group, cp_size)


# --------------------------------------------------------------------------------- the step plan's tables


def to_wire(keys: AllGatherKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """``keys`` as the attention op takes them (``cp_packing.attention.wire``): the key index (empty when the keys
    are one range), ``cu_seqlens_q`` and ``cu_seqlens_k``; the longest run and key range, the first gathered row of
    a one-range index (else -1) and the key count on the host."""
    first = keys.key_slice.start if keys.key_slice is not None else -1
    index = keys.key_index if keys.key_index is not None else keys.cu_seqlens_q.new_zeros(0, dtype=torch.int64)
    return pack([keys.max_seqlen_q, keys.max_seqlen_k, first, keys.num_keys],
                [index, keys.cu_seqlens_q, keys.cu_seqlens_k], keys.cu_seqlens_q.device)


def from_wire(tables) -> AllGatherKeys:
    """Inverse of :func:`to_wire` (inside the op: the numbers are on the CPU, no device sync); decoded tables pass
    through."""
    if not is_wire(tables):
        return tables
    (max_q, max_k, first, n), (key_index, cu_q, cu_k) = unpack(tables)
    return AllGatherKeys(key_index=None if first >= 0 else key_index,
                         key_slice=slice(first, first + n) if first >= 0 else None,
                         cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32), max_seqlen_q=max_q,
                         max_seqlen_k=max_k, num_keys=n)


def build_tables(ctx, causal: bool, window: int | None, chunk: int | None = None) -> tuple[torch.Tensor, ...]:
    """The step plan's tables for one ``(causal, window, chunk)``: the key index (``allgather_keys``; with a
    ``chunk``, every local run cut at its document's chunk boundaries, its keys from its chunk's start)."""
    sharded = ctx.sharded
    if chunk is None:
        return to_wire(allgather_keys(sharded, causal=causal, device=ctx.device, window=window))
    cu = chunked_segments(sharded.global_params.cu_seqlens.to("cpu", torch.int64).numpy(), chunk)
    local_plan = layout_plan(sharded.global_params.cu_seqlens, cp_size=sharded.cp_size, layout=sharded.layout,
                             window=sharded.plan_window)
    run_start, run_len = split_plan(local_plan, cu).runs(sharded.cp_rank)
    run_cu = torch.zeros(run_len.size + 1, dtype=torch.int64)
    run_cu[1:] = torch.from_numpy(np.cumsum(run_len))
    key_start = torch.from_numpy(cu[np.searchsorted(cu, run_start, side="right") - 1].copy())
    return to_wire(build_key_index(sharded.token_index, run_cu, key_start, sharded.global_token_order().reshape(-1),
                                   torch.from_numpy(cu), causal, ctx.device, window=window))


# ------------------------------------------------------------------------------- the attention op's backend


def lse_like(q: torch.Tensor, tokens: int | None = None, heads: int | None = None) -> torch.Tensor:
    """An empty ``lse`` ``[H, T]`` for q (float32; float64 for float64 q): the fake implementations' outputs."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((q.shape[1] if heads is None else heads, q.shape[0] if tokens is None else tokens), dtype=dtype)


def forward(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    """The op's forward: ``[out, lse]`` (backward re-gathers K/V: only local tensors are saved)."""
    out, lse = forward_impl(q, k, v, sinks, from_wire(tables), layer.group, layer.cp_size, layer.scale, layer.causal,
                            layer.kernel, layer.window, layer.softcap)
    return [out, lse.contiguous()]


def backward(dout, q, k, v, sinks, saved, tables, layer):
    """The op's backward: ``(dq, dk, dv, dsinks)``."""
    out, lse = saved
    return backward_impl(dout, q, k, v, sinks, out, lse, from_wire(tables), layer.group, layer.cp_size, layer.scale,
                         layer.causal, layer.kernel, layer.window, layer.softcap)


def fake(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    return [torch.empty_like(q), lse_like(q)]
