"""The exchange backend: every rank receives exactly the keys/values its queries need, overlapped with local work.

With packed documents most of an all-gather is never read: a local run ``[s, s + L)`` of a document starting at
``g`` attends the keys ``[g, s + L)`` (``[max(g, s - w + 1), s + L)`` under a window ``w``), and a rank's NEED is the
union of those ranges minus the tokens it holds (``cp_packing.layouts.need``). Per layer this backend

1. sends every needed key/value to the rank that needs it, with ONE uneven all-to-all (K and V together; the send
   and receive tables are computed once per step, from the layout's plan, in the step plan);
2. while it is in flight, attends every local run against the keys the rank holds itself (the *local* part: the
   run itself, causally, and the earlier local pieces of its document);
3. when it lands, attends every run against its received keys (the *remote* part: all of them precede the run, so
   no mask), and merges the two partial results by their log-sum-exp (exact: the softmax over the union);

Backward runs the remote part's kernel backward first, starts the reverse all-to-all that returns each received key's
dK/dV to its owner, runs the local part's backward while it is in flight, and adds the returned gradients in.::

    forward   [a2a K/V (async) ...............]                     backward  [remote bwd][a2a dK/dV (async) ....]
              [local attention][wait][remote attention][merge]                            [local bwd ][wait][add]

Under a sliding window the parts would need a position-aware mask, so the layer waits for the keys and runs ONE
kernel call over each run's contiguous key range (the transfer still shrinks to the window); so does
``options.overlap=False``. With ``cp_size == 1``, or a step in which no rank needs a remote key, nothing is
communicated and only the local kernel runs. Memory: the transient buffer holds the received keys only (the need),
not ``cp * T_local`` rows; backward keeps them (saved for backward) instead of exchanging again.

Every layout, causal or not, sliding windows, softcap, sinks (applied after the merge), GQA, every kernel of the
all-gather backend. Call it as ``context_parallel_attention(..., backend="exchange")`` (or let ``"auto"`` pick it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from cp_packing.attention import kernels
from cp_packing.layouts import expand_runs, layout_plan
from cp_packing.layouts.need import chunked_segments, exchange_pieces, intersect_ranges, split_plan

__all__ = ["ExchangeTables", "build_tables", "exchange_tables", "layer"]


@dataclass(frozen=True, eq=False)
class _Keys:
    """One varlen call's keys: for every local run, rows of a K/V buffer laid end to end."""

    index: torch.Tensor  # int64 [N_k] rows of the buffer
    cu_seqlens_k: torch.Tensor  # int32 [R + 1]
    max_seqlen_k: int


@dataclass(frozen=True, eq=False)
class ExchangeTables:
    """One step's exchange for one ``(causal, window)`` (the step plan keeps it; every layer reads it).

    Attributes:
        send_index: int64 ``[S]``: the local rows this rank sends, destination after destination.
        send_splits, recv_splits: ``[cp]`` row counts to / from every rank (all-to-all splits).
        communicate: whether any rank sends anything this step (else no collective runs on any rank).
        cu_seqlens_q: int32 ``[R + 1]`` the local runs; max_seqlen_q: the longest.
        local: the local part's keys (rows of this rank's k/v); remote: the remote part's (rows of the received
            buffer), ``None`` when this rank receives nothing; joint: one call's keys over ``cat(local, received)``
            in each run's global order (windows, ``overlap=False``).
        causal: the mask of the local / joint call (the remote part has none).
    """

    send_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    communicate: bool
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    local: _Keys
    remote: _Keys | None
    joint: _Keys
    causal: bool

    @property
    def num_received(self) -> int:
        """Rows this rank receives per layer (the bytes moved are ``2 * H_kv * D * dtype size`` per row)."""
        return sum(self.recv_splits)


def _keys(lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
          device: torch.device) -> _Keys:
    """A call's keys: for run i, the positions of ``[lo[i], hi[i])`` that the ranges hold, in position order."""
    run, k, p_lo, p_hi = intersect_ranges(lo, hi, starts, starts + lengths)
    piece_rows = rows[k] + (p_lo - starts[k])
    per_run = np.bincount(run, weights=p_hi - p_lo, minlength=lo.size).astype(np.int64)
    total = int(per_run.sum())
    index = expand_runs(torch.from_numpy(piece_rows), torch.from_numpy(p_hi - p_lo), total)
    cu = np.zeros(lo.size + 1, dtype=np.int64)
    np.cumsum(per_run, out=cu[1:])
    return _Keys(index.to(device), torch.from_numpy(cu).to(device=device, dtype=torch.int32),
                 int(per_run.max()) if per_run.size else 0)


def exchange_tables(sharded, *, causal: bool = True, window: int | None = None, device: torch.device | None = None,
                    chunk: int | None = None) -> ExchangeTables:
    """The exchange of this rank's shard for one ``(causal, window)`` (module docstring): O(runs) planning on the
    host from the layout's plan (every rank computes every rank's pieces, so no table travels), then O(keys)
    index tensors for this rank. A host sync for a CUDA ``cu_seqlens``.

    >>> import torch, cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1] * 8]))
    >>> t = exchange_tables(cp_packing.shard_packed_seq_params(params, cp_size=2, cp_rank=1, layout="contiguous"))
    >>> t.recv_splits, t.send_splits, t.local.index.tolist(), t.remote.index.tolist()
    ([4, 0], [0, 0], [0, 1, 2, 3], [0, 1, 2, 3])
    """
    device = torch.device(device) if device is not None else sharded.token_index.device
    cu = sharded.global_params.cu_seqlens.to("cpu", torch.int64).numpy()
    plan = layout_plan(sharded.global_params.cu_seqlens, cp_size=sharded.cp_size, layout=sharded.layout,
                       window=sharded.plan_window)
    if chunk is not None:  # chunked attention: every document cut into chunks, the placement unchanged
        cu = chunked_segments(cu, chunk)
        plan = split_plan(plan, cu)
    me, cp = sharded.cp_rank, sharded.cp_size
    pieces = exchange_pieces(plan, cu, causal=causal, window=window)
    mine_out = pieces.owner == me  # what I send, by receiver then position
    mine_in = pieces.receiver == me  # what I receive, by owner then position: the receive buffer's order
    send_splits = np.bincount(pieces.receiver[mine_out], weights=pieces.length[mine_out], minlength=cp)
    recv_splits = np.bincount(pieces.owner[mine_in], weights=pieces.length[mine_in], minlength=cp)
    send_index = expand_runs(torch.from_numpy(pieces.owner_row[mine_out].copy()),
                             torch.from_numpy(pieces.length[mine_out].copy()), int(send_splits.sum()))

    run_start, run_len = (a.astype(np.int64) for a in plan.runs(me))
    seg = np.searchsorted(cu, run_start, side="right") - 1
    lo = cu[seg] if window is None or not causal else np.maximum(cu[seg], run_start - (window - 1))
    hi = run_start + run_len if causal else cu[seg + 1]
    local_rows = np.cumsum(run_len) - run_len
    held = np.argsort(run_start, kind="stable")
    h_start, h_rows, h_len = run_start[held], local_rows[held], run_len[held]
    r_start, r_len = pieces.start[mine_in], pieces.length[mine_in]
    r_rows = np.cumsum(r_len) - r_len
    o = np.argsort(r_start, kind="stable")
    r_start, r_rows, r_len = r_start[o], r_rows[o], r_len[o]
    # joint: one call over cat(local, received), every run's keys in global order
    j_start = np.concatenate([h_start, r_start])
    j_rows = np.concatenate([h_rows, r_rows + int(run_len.sum())])
    j_len = np.concatenate([h_len, r_len])
    o = np.argsort(j_start, kind="stable")
    run_cu = np.zeros(run_len.size + 1, dtype=np.int64)
    np.cumsum(run_len, out=run_cu[1:])
    return ExchangeTables(
        send_index=send_index.to(device),
        send_splits=[int(x) for x in send_splits],
        recv_splits=[int(x) for x in recv_splits],
        communicate=bool(pieces.length.size),
        cu_seqlens_q=torch.from_numpy(run_cu).to(device=device, dtype=torch.int32),
        max_seqlen_q=int(run_len.max()) if run_len.size else 0,
        local=_keys(lo, hi, h_start, h_rows, h_len, device),
        remote=_keys(lo, hi, r_start, r_rows, r_len, device) if r_len.size else None,
        joint=_keys(lo, hi, j_start[o], j_rows[o], j_len[o], device),
        causal=causal,
    )


# ------------------------------------------------------------------------------------------------ the math


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions over disjoint keys -> the attention over their union (exact, by log-sum-exp)."""
    lse = torch.logaddexp(lse_a, lse_b)  # [H, T]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe).T.unsqueeze(-1)  # [T, H, 1]; 0 where a part attends nothing (lse -inf)
    w_b = torch.exp(lse_b - safe).T.unsqueeze(-1)
    out = out_a.to(lse.dtype) * w_a + out_b.to(lse.dtype) * w_b
    return out.to(out_a.dtype), lse


def _a2a(buffer: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    received = buffer.new_empty((sum(out_splits), *buffer.shape[1:]))
    work = dist.all_to_all_single(received, buffer.contiguous(), out_splits, in_splits, group=group, async_op=True)
    return received, work


def _call(kernel, q, k_buf, v_buf, t: ExchangeTables, keys: _Keys, causal, meta):
    scale, window, softcap = meta
    return kernels.run_forward(kernel, q, k_buf.index_select(0, keys.index), v_buf.index_select(0, keys.index),
                               t.cu_seqlens_q, keys.cu_seqlens_k, t.max_seqlen_q, keys.max_seqlen_k, scale, causal,
                               window, softcap)


def _call_backward(kernel, dout, q, k_buf, v_buf, out, lse, t: ExchangeTables, keys: _Keys, causal, meta):
    """``(dq, dk, dv)`` of one call, dk/dv scattered back onto the buffer's rows."""
    scale, window, softcap = meta
    dq, dk_keys, dv_keys = kernels.run_backward(
        kernel, dout, q, k_buf.index_select(0, keys.index), v_buf.index_select(0, keys.index), out, lse,
        t.cu_seqlens_q, keys.cu_seqlens_k, t.max_seqlen_q, keys.max_seqlen_k, scale, causal, window, softcap)
    dk = torch.zeros_like(k_buf).index_add_(0, keys.index, dk_keys)
    dv = torch.zeros_like(v_buf).index_add_(0, keys.index, dv_keys)
    return dq, dk, dv


def _forward(plan, t: ExchangeTables, q, k, v, sinks, meta, overlap: bool):
    """``(out, lse, received kv or None)``: the exchange, the local and remote parts (or one joint call)."""
    kernel = plan.kernel
    work, recv = None, None
    if t.communicate:
        recv, work = _a2a(torch.stack([k.index_select(0, t.send_index), v.index_select(0, t.send_index)], 1),
                          t.recv_splits, t.send_splits, plan.group)  # [R, 2, H_kv, D]
    if t.remote is None or not overlap:
        if work is not None:
            work.wait()
        if t.remote is None:
            out, lse = _call(kernel, q, k, v, t, t.local, t.causal, meta)
        else:
            k_buf, v_buf = torch.cat([k, recv[:, 0]]), torch.cat([v, recv[:, 1]])
            out, lse = _call(kernel, q, k_buf, v_buf, t, t.joint, t.causal, meta)
    else:
        out_a, lse_a = _call(kernel, q, k, v, t, t.local, t.causal, meta)  # while the keys are in flight
        work.wait()
        out_b, lse_b = _call(kernel, q, recv[:, 0], recv[:, 1], t, t.remote, False, meta)
        out, lse = _merge(out_a, lse_a, out_b, lse_b)
    if sinks is not None:
        out, lse = kernels.add_sinks(out, lse, sinks)
    return out, lse, recv


def _backward(plan, t: ExchangeTables, dout, q, k, v, recv, out, lse, meta, overlap: bool):
    kernel = plan.kernel
    T_local = k.shape[0]
    returned = work = None
    if t.remote is None or not overlap:
        if t.remote is None:
            dq, dk, dv = _call_backward(kernel, dout, q, k, v, out, lse, t, t.local, t.causal, meta)
            grad_recv = None
        else:
            k_buf, v_buf = torch.cat([k, recv[:, 0]]), torch.cat([v, recv[:, 1]])
            dq, dk_buf, dv_buf = _call_backward(kernel, dout, q, k_buf, v_buf, out, lse, t, t.joint, t.causal, meta)
            dk, dv = dk_buf[:T_local], dv_buf[:T_local]
            grad_recv = torch.stack([dk_buf[T_local:], dv_buf[T_local:]], 1)
        if t.communicate:
            send = grad_recv if grad_recv is not None else k.new_zeros((0, 2, *k.shape[1:]))
            returned, work = _a2a(send, t.send_splits, t.recv_splits, plan.group)
    else:
        dq_b, dk_r, dv_r = _call_backward(kernel, dout, q, recv[:, 0], recv[:, 1], out, lse, t, t.remote, False, meta)
        returned, work = _a2a(torch.stack([dk_r, dv_r], 1), t.send_splits, t.recv_splits, plan.group)
        dq, dk, dv = _call_backward(kernel, dout, q, k, v, out, lse, t, t.local, t.causal, meta)  # overlapped
        dq = dq + dq_b
    if work is not None:
        work.wait()
        dk = dk.index_add(0, t.send_index, returned[:, 0])  # every received key's gradient, back at its owner
        dv = dv.index_add(0, t.send_index, returned[:, 1])
    return dq, dk, dv


class _ExchangeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan, tables, meta, overlap):
        out, lse, recv = _forward(plan, tables, q, k, v, sinks, meta, overlap)
        ctx.save_for_backward(q, k, v, sinks, out, lse, recv)
        ctx.plan, ctx.tables, ctx.meta, ctx.overlap, ctx.layer = plan, tables, meta, overlap, plan.layer_calls
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse, recv = ctx.saved_tensors
        ctx.plan.backward_check(ctx.layer)
        dout = dout.contiguous()
        dq, dk, dv = _backward(ctx.plan, ctx.tables, dout, q, k, v, recv, out, lse, ctx.meta, ctx.overlap)
        dsinks = kernels.sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None


def build_tables(plan, causal: bool, window: int | None, chunk: int | None = None) -> ExchangeTables:
    """The step plan's exchange tables for one ``(causal, window, chunk)``."""
    return exchange_tables(plan.sharded, causal=causal, window=window, device=plan.device, chunk=chunk)


def layer(plan, tables: ExchangeTables, q, k, v, sinks, *, causal: bool, window: int | None,
          softcap: float | None, scale: float | None) -> torch.Tensor:
    """One exchange attention layer on the step plan: ``[T_local, H, D]``."""
    overlap = plan.options.overlap and window is None
    return _ExchangeAttention.apply(q, k, v, sinks, plan, tables, (scale, window, softcap), overlap)


from cp_packing.attention.plan import register_backend  # noqa: E402  (plan imports no backend)

register_backend("exchange", build_tables, layer)
