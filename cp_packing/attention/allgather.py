"""Built-in all-gather context-parallel attention (the Llama 3 idea), for every layout.

Each CP rank holds ``T_local`` query tokens and the keys/values of the same tokens. The keys a local query needs
are the global tokens of its segment up to itself (causal), and they may live on any rank. This backend

1. all-gathers K and V over the CP group: ``[cp * T_local, H_kv, D]`` each, in rank-major order (rank r's local
   tokens at ``[r * T_local, (r+1) * T_local)``, i.e. the order of ``sharded.global_token_order()``);
2. picks, for every local *run* (``sharded.cu_seqlens``: a maximal piece of consecutive global tokens of one
   segment), the run's keys: global tokens ``[key_start, run_last + 1)`` (the whole segment when
   ``causal=False``), laid end to end by ONE precomputed index into the gathered buffer (``AllGatherKeys``,
   cached on ``sharded`` (``sharded.cached``): it is a per-step constant reused by every layer). When that index is one range
   (the ``contiguous`` layout, and any layout with ``cp_size == 1``) the keys are a slice of the gathered buffer:
   a view, no copy;
3. runs varlen attention of each run's queries against its keys, causal aligned bottom-right
   (``cp_packing.attention.kernels.varlen_attention_forward``), so query ``i`` of a run sees exactly the keys of
   its segment up to its own global position.

Backward re-gathers K and V (only the local ``q, k, v, out, lse`` are saved, as ring-flash-attn's llama3 does:
saved memory per layer is O(T_local), not O(T)), runs the kernel's backward, index-adds the packed keys' dK/dV
back into a zero ``[cp * T_local, H_kv, D]`` buffer (a key that two runs share, as in zigzag, gets both
contributions) and reduce-scatters it (SUM) so each rank receives the gradient of the keys it owns. NCCL (and any
backend other than gloo) uses ``reduce_scatter``; gloo uses ``all_to_all`` + a local sum (the same traffic as a
reduce-scatter; gloo's own reduce-scatter was no faster when measured, and old gloo builds lack it), and a
list all-gather (supported by every gloo build since torch 2.4).

Logit soft-capping (``softcap``) is elementwise on the scores and goes to the kernel. Attention sinks (``sinks``,
one logit per query head) join each LOCAL query's softmax (``kernels.varlen_attention_forward(..., sinks=)``); in
backward each rank returns the sinks' gradient from its own queries (``kernels.sink_grad``), so the per-rank
gradients summed over the CP group (as data-parallel gradient reduction does for a replicated parameter) equal the
gradient of the whole batch.

With ``cp_size == 1`` nothing is communicated (no process group is needed). An all-padding rank runs the same
collectives as every other rank (padding segments are segments), so no rank can hang the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cp_packing._checks import check_softcap, check_window
from cp_packing.attention import kernels
from cp_packing.attention.comm import all_gather_tokens, reduce_scatter_tokens
from cp_packing.groups import GroupLike, as_process_group, backend_config, backend_for_device, check_shard_in_group
from cp_packing.layouts import expand_runs
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["AllGatherKeys", "allgather_keys", "allgather_attention", "check_attention_inputs", "resolve_attention_group"]


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
    """The all-gather backend's key index for this rank (computed once per ``sharded`` and device, then cached).

    Args:
        sharded: this rank's ``ShardedPackedSeqParams`` (any layout).
        causal: ``True``: run ``i``'s keys are global tokens ``[key_start[i], last token of run i]``;
            ``False``: the run's whole segment.
        device: where the index tensors go (default: ``sharded.token_index.device``).
        window: sliding window (``None``: none; needs ``causal=True``): run ``i``'s keys start at
            ``max(key_start[i], first query of run i - window + 1)``, the earliest key any of its queries can see
            (fewer keys gathered and attended; the kernel still masks each query to its own window).

    Returns:
        ``AllGatherKeys``. Costs three host syncs (key count and maxima, the range test) the first time, none after.
    """
    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(f"sharded must be ShardedPackedSeqParams, got {type(sharded).__name__}")
    window = check_window(window, causal)
    device = torch.device(device) if device is not None else sharded.token_index.device
    return sharded.cached(
        ("allgather_keys", bool(causal), str(device), window), lambda: _build_keys(sharded, causal, device, window)
    )


def _build_keys(
    sharded: ShardedPackedSeqParams, causal: bool, device: torch.device, window: int | None = None
) -> AllGatherKeys:
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


# ------------------------------------------------------------------------------------------------ validation


def check_attention_inputs(q: Any, k: Any, v: Any, sharded: Any) -> None:
    """Raise a clear TypeError / ValueError unless q ``[T_local, H, D]``, k/v ``[T_local, H_kv, D]`` (H % H_kv == 0)
    share one floating dtype and device and ``T_local`` is ``sharded``'s."""
    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(
            f"sharded must be ShardedPackedSeqParams, got {type(sharded).__name__}; build it with "
            "cp_packing.shard_packed_seq_params(params, cp_size=..., cp_rank=..., layout=...)"
        )
    kernels.check_qkv(q, k, v, tokens="T_local")  # types, [T_local, H, D] shapes, GQA heads, one dtype
    T_local = sharded.num_local_tokens
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape[0] != T_local:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens (shape {tuple(x.shape)}) but this rank holds T_local={T_local} "
                f"tokens (sharded.num_local_tokens); shard the projections' inputs with sharded.shard(...)"
            )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def resolve_attention_group(group: GroupLike, sharded: ShardedPackedSeqParams, device: torch.device):
    """The process group to communicate over, checked against ``sharded`` (``None`` when ``cp_size == 1``: no
    communication; the default group object when ``group`` is ``None`` and ``cp_size > 1``).

    ``group=None`` means the default (world) group; a 1-D ``DeviceMesh`` means its process group. The group's size must equal ``sharded.cp_size`` and this
    process's rank in it must equal ``sharded.cp_rank``; the group must have a backend for q's device type (a
    ``"cpu:gloo,cuda:nccl"`` group serves CPU tensors with gloo; an NCCL-only group needs CUDA tensors).
    """
    import torch.distributed as dist

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
    config = backend_config(group)  # "cpu:gloo,cuda:nccl": per device type
    if backend_for_device(config, device.type) == "":
        fix = "move q/k/v to CUDA" if "nccl" in config.lower() else "move q/k/v to a device the group serves"
        raise ValueError(
            f"the CP group's backend config {config!r} has no backend for {device.type} tensors, but q is on "
            f"{device}; {fix}, or create the group with a backend for {device.type} (e.g. backend="
            f"'cpu:gloo,cuda:nccl')"
        )
    return dist.group.WORLD if group is None else group


# ------------------------------------------------------------------------------------------------ collectives


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if group is None:
        return k, v
    return all_gather_tokens(k, group, cp_size), all_gather_tokens(v, group, cp_size)


# --------------------------------------------------------------------------------------------------- autograd


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, keys: AllGatherKeys, group, cp_size: int, scale: float, causal: bool,
                kernel: str, window: int | None = None, softcap: float | None = None):
        k_all, v_all = _gather_kv(k, v, group, cp_size)  # [cp * T_local, H_kv, D]
        out, lse = kernels.varlen_attention_forward(
            q, keys.select(k_all), keys.select(v_all), keys.cu_seqlens_q, keys.cu_seqlens_k,
            keys.max_seqlen_q, keys.max_seqlen_k, softmax_scale=scale, causal=causal, kernel=kernel, window=window,
            softcap=softcap, sinks=sinks,
        )  # out [T_local, H, D], lse [H, T_local] (sinks included)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.meta = (keys, group, cp_size, scale, causal, kernel, window, softcap)  # scale: None = 1/sqrt(D)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        keys, group, cp_size, scale, causal, kernel, window, softcap = ctx.meta
        k_all, v_all = _gather_kv(k, v, group, cp_size)  # re-gathered: only local tensors were saved
        dq, dk_keys, dv_keys = kernels.varlen_attention_backward(
            dout, q, keys.select(k_all), keys.select(v_all), out, lse, keys.cu_seqlens_q, keys.cu_seqlens_k,
            keys.max_seqlen_q, keys.max_seqlen_k, softmax_scale=scale, causal=causal, kernel=kernel, window=window,
            softcap=softcap,
        )
        # this rank's queries' share of the sinks' gradient: the shares sum over the CP group to the batch's
        dsinks = kernels.sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        total = k_all.shape[0]
        dk_all = keys.scatter_add(dk_keys, total)  # [cp * T_local, H_kv, D]
        dv_all = keys.scatter_add(dv_keys, total)
        if group is not None:
            dk_all = reduce_scatter_tokens(dk_all, group, cp_size)  # [T_local, H_kv, D]
            dv_all = reduce_scatter_tokens(dv_all, group, cp_size)
        return dq, dk_all, dv_all, dsinks, None, None, None, None, None, None, None, None


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sharded: ShardedPackedSeqParams,
    *,
    group=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    kernel: str = "auto",
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather context-parallel attention for any layout (see module docstring). Differentiable.

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, H_kv, D]`` with ``H % H_kv == 0`` (GQA); this rank's tokens in
            ``sharded``'s local order, one floating dtype, one device.
        sharded: this rank's ``ShardedPackedSeqParams`` (``contiguous``, ``zigzag``, ``balanced``, ...).
        group: the CP ``ProcessGroup`` (``None``: the default group); its size must be ``sharded.cp_size``.
            Not used (and no process group needed) when ``cp_size == 1``.
        causal: causal within each segment (default); ``False``: every token attends its whole segment.
        softmax_scale: default ``1 / sqrt(D)``.
        kernel: the varlen kernel (``"auto"``, ``"torch"``, ``"flash_attn"``, ``"torch_varlen"``; see
            ``cp_packing.attention.kernels``).
        window: sliding window (``None``: none; needs ``causal=True``): a token at in-segment position ``p``
            attends the keys at positions ``p - window < k <= p`` of its segment (HF's ``sliding_window``). Only
            the keys inside some local query's window are selected from the gathered K/V.
        softcap: logit soft-capping (``None``: none; a float > 0): scaled scores ``s`` become
            ``softcap * tanh(s / softcap)`` (HF Gemma 2's ``attn_logit_softcapping``). Any kernel but
            ``"torch_varlen"``.
        sinks: attention sinks (``None``: none): a floating ``[H]`` tensor on q's device, one logit per query head
            in every softmax denominator, no value (HF's ``s_aux``, gpt-oss). Its gradient on each rank is that of
            this rank's queries; summed over the CP group it is the whole batch's.

    Returns:
        ``[T_local, H, D]`` in q's dtype: for each local token, attention over its segment's keys (causal: up to
        itself; with ``window``: the last ``window`` of them), equal to full attention on the global stream,
        sharded.
    """
    check_attention_inputs(q, k, v, sharded)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale must be a float or None (1/sqrt(head_dim)), got {type(softmax_scale).__name__}")
    window = check_window(window, causal)
    softcap = check_softcap(softcap)
    sinks = kernels.check_sinks(sinks, q)
    name = kernels.resolve_kernel(kernel, q, softcap=softcap)
    group = resolve_attention_group(group, sharded, q.device)
    keys = allgather_keys(sharded, causal=causal, device=q.device, window=window)
    return _AllGatherAttention.apply(q, k, v, sinks, keys, group, sharded.cp_size, softmax_scale, causal, name,
                                     window, softcap)
