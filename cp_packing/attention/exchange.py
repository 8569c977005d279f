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

Backward exchanges the keys again (nothing received is kept for backward: the layer saves only its local
tensors), runs the local part's backward while they are in flight, then the remote part's, and returns each
received key's dK/dV to its owner with the reverse all-to-all.::

    forward   [a2a K/V (async) ...............]                     backward  [a2a K/V (async) ....]
              [local attention][wait][remote attention][merge]                [local bwd ][wait][remote bwd][a2a dK/dV][add]

Under a sliding window the parts would need a position-aware mask, so the layer waits for the keys and runs ONE
kernel call over each run's contiguous key range (the transfer still shrinks to the window); so does
``options.overlap=False``. With ``cp_size == 1``, or a step in which no rank needs a remote key, nothing is
communicated and only the local kernel runs. Memory: the transient buffer holds the received keys only (the need),
not ``cp * T_local`` rows, and is freed after the layer (docs/attention.md, "Memory").

Every layout, causal or not, sliding windows, softcap, sinks (applied after the merge), GQA, every kernel of the
all-gather backend. Call it as ``context_parallel_attention(..., backend="exchange")`` (or let ``"auto"`` pick it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from cp_packing.attention import kernels
from cp_packing.attention.wire import is_wire, pack, unpack
from cp_packing.layouts import expand_runs, layout_plan
from cp_packing.layouts.need import chunked_segments, exchange_pieces, intersect_ranges, split_plan

__all__ = ["ExchangeTables", "backward", "build_tables", "exchange_tables", "fake", "forward", "from_wire", "to_wire"]


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


# ------------------------------------------------------------------------------------------- the op's tables


def to_wire(t: ExchangeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as the attention op takes it (``cp_packing.attention.wire``): the send index, ``cu_seqlens_q`` and the
    three calls' keys; the splits, the flags and the maxima on the host."""
    remote = t.remote if t.remote is not None else _Keys(t.local.index[:0], t.local.cu_seqlens_k[:0], -1)
    header = [*t.send_splits, *t.recv_splits, int(t.communicate), t.max_seqlen_q, t.local.max_seqlen_k,
              remote.max_seqlen_k, t.joint.max_seqlen_k, int(t.causal)]
    return pack(header, [t.send_index, t.cu_seqlens_q, t.local.index, t.local.cu_seqlens_k, remote.index,
                         remote.cu_seqlens_k, t.joint.index, t.joint.cu_seqlens_k], t.cu_seqlens_q.device)


def from_wire(tables) -> ExchangeTables:
    """Inverse of :func:`to_wire` (inside the op: the numbers are on the CPU, no device sync); decoded tables pass
    through."""
    if not is_wire(tables):
        return tables
    header, (send_index, cu_q, l_index, l_cu, r_index, r_cu, j_index, j_cu) = unpack(tables)
    cp = (len(header) - 6) // 2
    communicate, max_q, l_max, r_max, j_max, causal = header[2 * cp:]
    i32 = torch.int32
    return ExchangeTables(
        send_index=send_index, send_splits=header[:cp], recv_splits=header[cp:2 * cp], communicate=bool(communicate),
        cu_seqlens_q=cu_q.to(i32), max_seqlen_q=max_q, local=_Keys(l_index, l_cu.to(i32), l_max),
        remote=None if r_max < 0 else _Keys(r_index, r_cu.to(i32), r_max), joint=_Keys(j_index, j_cu.to(i32), j_max),
        causal=bool(causal))


def build_tables(ctx, causal: bool, window: int | None, chunk: int | None = None) -> tuple[torch.Tensor, ...]:
    """The step plan's exchange tables for one ``(causal, window, chunk)``."""
    return to_wire(exchange_tables(ctx.sharded, causal=causal, window=window, device=ctx.device, chunk=chunk))


# ------------------------------------------------------------------------------------------------ the math


def _merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions over disjoint keys -> the attention over their union (exact, by log-sum-exp), with
    one float32 accumulator ``[T, H, D]`` (the two parts are scaled into it in place)."""
    lse = torch.logaddexp(lse_a, lse_b)  # [H, T]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = out_a.to(lse.dtype, copy=True).mul_(torch.exp(lse_a - safe).T.unsqueeze(-1))  # 0 where a part is empty
    del out_a
    out.addcmul_(out_b, torch.exp(lse_b - safe).T.unsqueeze(-1))  # out_b promoted element by element, no copy
    return out.to(out_b.dtype), lse


def _a2a(buffer: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    received = buffer.new_empty((sum(out_splits), *buffer.shape[1:]))
    work = dist.all_to_all_single(received, buffer.contiguous(), out_splits, in_splits, group=group, async_op=True)
    return received, work


def _send_kv(t: ExchangeTables, k, v, group):
    """Start the K/V exchange: ``(received [R, 2, H_kv, D], work)``, or ``(None, None)`` when nothing moves."""
    if not t.communicate:
        return None, None
    return _a2a(torch.stack([k, v], 1).index_select(0, t.send_index), t.recv_splits, t.send_splits, group)


def _select(k_buf, v_buf, keys: _Keys):
    return k_buf.index_select(0, keys.index), v_buf.index_select(0, keys.index)


def _call(layer, q, k_keys, v_keys, t: ExchangeTables, keys: _Keys, causal):
    """One kernel call on selected keys (``_select``)."""
    return kernels.run_forward(layer.kernel, q, k_keys, v_keys, t.cu_seqlens_q, keys.cu_seqlens_k, t.max_seqlen_q,
                               keys.max_seqlen_k, layer.scale, causal, layer.window, layer.softcap)


def _call_backward(layer, dout, q, kv: list, out, lse, t: ExchangeTables, keys: _Keys, causal, rows: int):
    """``(dq, grad)`` of one call on selected keys ``kv = [k_keys, v_keys]`` (emptied here, so they are freed once
    used): ``grad`` ``[rows, 2, H_kv, D]``, their dK/dV added onto the buffer's rows (made after the kernel, so it
    is not live beside the kernel's own buffers)."""
    k_keys, v_keys = kv
    kv.clear()
    dq, dk_keys, dv_keys = kernels.run_backward_per_kv_head(
        layer.kernel, dout, q, k_keys, v_keys, out, lse, t.cu_seqlens_q, keys.cu_seqlens_k, t.max_seqlen_q,
        keys.max_seqlen_k, layer.scale, causal, layer.window, layer.softcap)
    del k_keys, v_keys
    grad = dk_keys.new_zeros((rows, 2, *dk_keys.shape[1:]))
    grad[:, 0].index_add_(0, keys.index, dk_keys)
    del dk_keys
    grad[:, 1].index_add_(0, keys.index, dv_keys)
    return dq, grad


def _overlapped(t: ExchangeTables, layer) -> bool:
    """The local part runs while the keys are in flight (else one joint call after they land)."""
    return t.remote is not None and layer.overlap and layer.window is None


def forward(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    """The op's forward: ``[out, lse]``: the exchange, the local and remote parts (or one joint call)."""
    t = from_wire(tables)
    recv, work = _send_kv(t, k, v, layer.group)  # [R, 2, H_kv, D] in flight
    if not _overlapped(t, layer):
        if work is not None:
            work.wait()
        if t.remote is None:
            out, lse = _call(layer, q, *_select(k, v, t.local), t, t.local, t.causal)
        else:
            selected = _select(torch.cat([k, recv[:, 0]]), torch.cat([v, recv[:, 1]]), t.joint)
            del recv
            out, lse = _call(layer, q, *selected, t, t.joint, t.causal)
    else:
        out_a, lse_a = _call(layer, q, *_select(k, v, t.local), t, t.local, t.causal)  # while the keys fly
        work.wait()
        selected = _select(recv[:, 0], recv[:, 1], t.remote)
        del recv
        out_b, lse_b = _call(layer, q, *selected, t, t.remote, False)
        del selected
        out, lse = _merge(out_a, lse_a, out_b, lse_b)
    if sinks is not None:
        out, lse = kernels.add_sinks(out, lse, sinks)
    return [out, lse.contiguous()]


def backward(dout, q, k, v, sinks, saved, tables, layer):
    """The op's backward: the keys are exchanged AGAIN (nothing received is kept for backward: saved memory is the
    layer's local tensors only), the local part's backward runs while they are in flight, then the remote part's,
    and the reverse all-to-all returns every received key's dK/dV to its owner: ``(dq, dk, dv, dsinks)``.
    dK/dV build up in place: one ``[T_local, 2, H_kv, D]`` buffer for the held keys, one ``[R, 2, H_kv, D]`` for
    the received ones (what the reverse all-to-all sends)."""
    out, lse = saved
    t = from_wire(tables)
    T_local = k.shape[0]
    recv, work = _send_kv(t, k, v, layer.group)
    received = 0 if recv is None else recv.shape[0]
    grad_recv = k.new_zeros((0, 2, *k.shape[1:]))  # dK/dV of the received keys (none received)
    if not _overlapped(t, layer):
        if work is not None:
            work.wait()
        if t.remote is None:
            dq, grad_local = _call_backward(layer, dout, q, [*_select(k, v, t.local)], out, lse, t, t.local,
                                            t.causal, T_local)
        else:
            selected = [*_select(torch.cat([k, recv[:, 0]]), torch.cat([v, recv[:, 1]]), t.joint)]
            del recv
            dq, grad = _call_backward(layer, dout, q, selected, out, lse, t, t.joint, t.causal, T_local + received)
            grad_local, grad_recv = grad[:T_local], grad[T_local:]
    else:
        dq, grad_local = _call_backward(layer, dout, q, [*_select(k, v, t.local)], out, lse, t, t.local, t.causal,
                                        T_local)  # while the keys are in flight
        work.wait()
        selected = [*_select(recv[:, 0], recv[:, 1], t.remote)]
        del recv
        dq_b, grad_recv = _call_backward(layer, dout, q, selected, out, lse, t, t.remote, False, received)
        dq.add_(dq_b)
        del dq_b
    if t.communicate:
        returned, work = _a2a(grad_recv, t.send_splits, t.recv_splits, layer.group)
        del grad_recv
        work.wait()
        grad_local.index_add_(0, t.send_index, returned)  # every received key's gradient, back at its owner
        del returned
    dsinks = kernels.sink_grad(dout, out, lse, sinks) if sinks is not None else None
    return dq, grad_local[:, 0].contiguous(), grad_local[:, 1].contiguous(), dsinks


def fake(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    from cp_packing.attention.allgather import lse_like

    return [torch.empty_like(q), lse_like(q)]
