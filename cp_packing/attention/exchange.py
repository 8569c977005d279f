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
not ``cp * T_local`` rows, and is freed after the layer; the local and remote parts' backward run in pieces of at
most about ``T_local`` keys (``num_pieces(cp)`` kernel calls each), so the kernel's working set does not grow with
the need (docs/attention.md, "Memory").

Every layout, causal or not, sliding windows, softcap, sinks (applied after the merge), GQA, every kernel of the
all-gather backend. Call it as ``context_parallel_attention(..., backend="exchange")`` (or let ``"auto"`` pick it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from cp_packing.attention import kernels
from cp_packing.attention.wire import is_wire, pack, unpack
from cp_packing.layouts import expand_runs, layout_plan
from cp_packing.layouts.need import chunked_segments, exchange_pieces, intersect_ranges, split_plan

__all__ = ["ExchangeTables", "backward", "build_tables", "exchange_tables", "fake", "forward", "from_wire", "num_pieces",
           "to_wire"]


@dataclass(frozen=True, eq=False)
class _Keys:
    """One varlen call's keys: for every local run, rows of a K/V buffer laid end to end."""

    index: torch.Tensor  # int64 [N_k] rows of the buffer
    cu_seqlens_k: torch.Tensor  # int32 [R + 1]
    max_seqlen_k: int


@dataclass(frozen=True, eq=False)
class _Piece:
    """One kernel call of the remote part's backward: the local runs whose query rows are ``[q0, q1)`` against the
    received keys ``remote.index[k0:k1]`` (a contiguous stretch of the remote part's keys: whole runs, or a share
    of one run's keys when that run alone holds more than a piece's budget)."""

    q0: int
    q1: int
    k0: int
    k1: int
    cu_seqlens_q: torch.Tensor  # int32 [n + 1], rows relative to q0
    max_seqlen_q: int
    cu_seqlens_k: torch.Tensor  # int32 [n + 1], keys relative to k0
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
        pieces: the remote part's backward in at most ``num_pieces(cp)`` kernel calls (the op's tables pad them
            to that count, so their sizes do not change from step to step; the padding is dropped when decoded),
            each over at most about ``T_local`` received keys (:func:`_cut_pieces`), so that the kernel's working
            set over the received keys (their dK/dV, expanded to the query heads under GQA) stays that of
            ``T_local`` keys.
        local_pieces: the local part's backward (overlapped) the same way, whole runs only (its calls are causal):
            a run with more held keys than ``T_local`` is a piece of its own.
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
    pieces: tuple[_Piece, ...] = ()
    local_pieces: tuple[_Piece, ...] = ()

    @property
    def num_received(self) -> int:
        """Rows this rank receives per layer (the bytes moved are ``2 * H_kv * D * dtype size`` per row)."""
        return sum(self.recv_splits)


def _keys(lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
          device: torch.device) -> tuple[_Keys, np.ndarray]:
    """A call's keys: for run i, the positions of ``[lo[i], hi[i])`` that the ranges hold, in position order; and
    their ``cu_seqlens_k`` on the host (int64)."""
    run, k, p_lo, p_hi = intersect_ranges(lo, hi, starts, starts + lengths)
    piece_rows = rows[k] + (p_lo - starts[k])
    per_run = np.bincount(run, weights=p_hi - p_lo, minlength=lo.size).astype(np.int64)
    total = int(per_run.sum())
    index = expand_runs(torch.from_numpy(piece_rows), torch.from_numpy(p_hi - p_lo), total)
    cu = np.zeros(lo.size + 1, dtype=np.int64)
    np.cumsum(per_run, out=cu[1:])
    return _Keys(index.to(device), torch.from_numpy(cu).to(device=device, dtype=torch.int32),
                 int(per_run.max()) if per_run.size else 0), cu


#: Keys of one backward piece per local token (``T_local`` keys: the kernel's working set over them is about that of
#: one process's kernel over the rank's share).
PIECE_KEYS_PER_TOKEN = 1.0


def num_pieces(cp_size: int) -> int:
    """How many kernel calls each part's backward is cut into at most (a function of ``cp_size`` only, so the op's
    table sizes do not change from step to step: no recompile). The received keys of a rank are at most about
    ``(cp - 1) * T_local``, counted once per run that attends them."""
    return 2 * cp_size


def _cut_pieces(cu_k: np.ndarray, budget: int, count: int, split: bool = True) -> list[tuple[int, int, int, int]]:
    """A call (its runs' ``cu_seqlens_k``, host int64) cut into at most ``count`` pieces ``(r0, r1, k0, k1)``: runs
    ``[r0, r1)`` against the keys ``[k0, k1)`` of the call's key list (run after run). Whole runs are packed in
    order while a piece holds at most ``budget`` keys; a run with more keys than that is cut into equal shares of its
    keys, one piece each (its queries' dq then sums the shares), or with ``split=False`` (a causal call) is one
    piece. Runs without keys at a piece's ends are left out. The budget grows until ``count`` pieces suffice."""
    total = int(cu_k[-1])
    if total == 0:
        return []
    run_keys = np.diff(cu_k)
    budget = max(1, budget, -(-total // count))
    while True:
        pieces: list[tuple[int, int, int, int]] = []
        r0 = None  # the open piece's first run
        for r, n in enumerate(run_keys.tolist()):
            if n == 0:
                continue
            if n > budget:
                if r0 is not None:
                    pieces.append((r0, r_last + 1, int(cu_k[r0]), int(cu_k[r_last + 1])))
                    r0 = None
                shares = -(-n // budget) if split else 1
                cuts = [int(cu_k[r]) + (n * i) // shares for i in range(shares + 1)]
                pieces.extend((r, r + 1, a, b) for a, b in zip(cuts[:-1], cuts[1:]))
                continue
            if r0 is not None and int(cu_k[r + 1] - cu_k[r0]) > budget:
                pieces.append((r0, r_last + 1, int(cu_k[r0]), int(cu_k[r_last + 1])))
                r0 = None
            if r0 is None:
                r0 = r
            r_last = r
        if r0 is not None:
            pieces.append((r0, r_last + 1, int(cu_k[r0]), int(cu_k[r_last + 1])))
        if len(pieces) <= count:
            return pieces
        budget = -(-budget * 3 // 2)


def _pieces(cu_q: np.ndarray, cu_k: np.ndarray | None, cp: int, device: torch.device,
            split: bool = True) -> tuple[_Piece, ...]:
    """A part's backward pieces (at most ``num_pieces(cp)``; none without keys, ``cu_k`` None), from the local
    runs' ``cu_q`` and the part's ``cu_k`` (host int64)."""
    if cu_k is None:
        return ()
    cut = _cut_pieces(cu_k, int(PIECE_KEYS_PER_TOKEN * int(cu_q[-1])), num_pieces(cp), split)
    out = []
    for r0, r1, k0, k1 in cut:
        q = cu_q[r0:r1 + 1] - cu_q[r0]
        k = np.clip(cu_k[r0:r1 + 1], k0, k1) - k0
        out.append(_Piece(int(cu_q[r0]), int(cu_q[r1]), k0, k1,
                          torch.from_numpy(q).to(device=device, dtype=torch.int32), int(np.diff(q).max()),
                          torch.from_numpy(k).to(device=device, dtype=torch.int32), int(np.diff(k).max())))
    return tuple(out)


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
    remote, remote_cu = _keys(lo, hi, r_start, r_rows, r_len, device) if r_len.size else (None, None)
    local, local_cu = _keys(lo, hi, h_start, h_rows, h_len, device)
    return ExchangeTables(
        send_index=send_index.to(device),
        send_splits=[int(x) for x in send_splits],
        recv_splits=[int(x) for x in recv_splits],
        communicate=bool(pieces.length.size),
        cu_seqlens_q=torch.from_numpy(run_cu).to(device=device, dtype=torch.int32),
        max_seqlen_q=int(run_len.max()) if run_len.size else 0,
        local=local,
        remote=remote,
        joint=_keys(lo, hi, j_start[o], j_rows[o], j_len[o], device)[0],
        causal=causal,
        pieces=_pieces(run_cu, remote_cu, cp, device),
        # the local part runs in pieces only where it overlaps the transfer (a remote part exists)
        local_pieces=_pieces(run_cu, local_cu if remote is not None else None, cp, device, split=False),
    )


# ------------------------------------------------------------------------------------------- the op's tables


def to_wire(t: ExchangeTables) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as the attention op takes it (``cp_packing.attention.wire``): the send index, ``cu_seqlens_q``, the
    three calls' keys and the remote pieces' ``cu_seqlens``; the splits, the flags, the maxima and the pieces'
    bounds on the host (a header whose length depends on ``cp`` only)."""
    remote = t.remote if t.remote is not None else _Keys(t.local.index[:0], t.local.cu_seqlens_k[:0], -1)
    cp = len(t.send_splits)
    header = [cp, *t.send_splits, *t.recv_splits, int(t.communicate), t.max_seqlen_q, t.local.max_seqlen_k,
              remote.max_seqlen_k, t.joint.max_seqlen_k, int(t.causal)]
    device = t.cu_seqlens_q.device
    empty = torch.zeros(1, dtype=torch.int32, device=device)
    unused = _Piece(0, 0, 0, 0, empty, 0, empty, 0)  # padding: num_pieces(cp) of each part, whatever the step
    pieces = tuple(itertools.chain.from_iterable(
        (*part, *[unused] * (num_pieces(cp) - len(part))) for part in (t.pieces, t.local_pieces)))
    for p in pieces:
        header += [p.q0, p.q1, p.k0, p.k1, p.cu_seqlens_q.numel() - 1, p.max_seqlen_q, p.max_seqlen_k]
    cu_q = torch.cat([p.cu_seqlens_q.to(device) for p in pieces]) if pieces else t.cu_seqlens_q[:0]
    cu_k = torch.cat([p.cu_seqlens_k.to(device) for p in pieces]) if pieces else t.cu_seqlens_q[:0]
    return pack(header, [t.send_index, t.cu_seqlens_q, t.local.index, t.local.cu_seqlens_k, remote.index,
                         remote.cu_seqlens_k, t.joint.index, t.joint.cu_seqlens_k, cu_q, cu_k], device)


def from_wire(tables) -> ExchangeTables:
    """Inverse of :func:`to_wire` (inside the op: the numbers are on the CPU, no device sync); decoded tables pass
    through."""
    if not is_wire(tables):
        return tables
    header, (send_index, cu_q, l_index, l_cu, r_index, r_cu, j_index, j_cu, p_cu_q, p_cu_k) = unpack(tables)
    cp = header[0]
    communicate, max_q, l_max, r_max, j_max, causal = header[1 + 2 * cp:7 + 2 * cp]
    i32 = torch.int32
    pieces, at = [], 0
    bounds = header[7 + 2 * cp:]
    for i in range(0, len(bounds), 7):
        q0, q1, k0, k1, n, p_max_q, p_max_k = bounds[i:i + 7]
        pieces.append(None if k1 == k0 else _Piece(q0, q1, k0, k1, p_cu_q[at:at + n + 1].to(i32), p_max_q,
                                                   p_cu_k[at:at + n + 1].to(i32), p_max_k))  # None: padding
        at += n + 1
    half = len(pieces) // 2
    return ExchangeTables(
        send_index=send_index, send_splits=header[1:1 + cp], recv_splits=header[1 + cp:1 + 2 * cp],
        communicate=bool(communicate), cu_seqlens_q=cu_q.to(i32), max_seqlen_q=max_q,
        local=_Keys(l_index, l_cu.to(i32), l_max), remote=None if r_max < 0 else _Keys(r_index, r_cu.to(i32), r_max),
        joint=_Keys(j_index, j_cu.to(i32), j_max), causal=bool(causal),
        pieces=tuple(p for p in pieces[:half] if p is not None),
        local_pieces=tuple(p for p in pieces[half:] if p is not None))


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


class _Grads:
    """dK/dV buffers made on first use, after the kernel call that first fills them (so they are not live beside
    that call's own buffers): ``rows`` ``[n, 2, H_kv, D]`` zeros, or separate ``dk`` / ``dv`` like ``k`` with
    ``like=``; ``dk`` / ``dv`` are views of ``rows`` in the first case."""

    __slots__ = ("shape", "like", "rows", "dk", "dv")

    def __init__(self, shape: tuple | None = None, like: torch.Tensor | None = None):
        self.shape, self.like, self.rows, self.dk, self.dv = shape, like, None, None, None

    def make(self) -> "_Grads":
        if self.dk is None:
            if self.shape is None:
                self.dk, self.dv = torch.zeros_like(self.like), torch.zeros_like(self.like)
            else:
                self.rows = self.like.new_zeros(self.shape)
                self.dk, self.dv = self.rows[:, 0], self.rows[:, 1]
        return self


def _backward_into(layer, dout, q, kv: list, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                   max_seqlen_k: int, causal, index: torch.Tensor, grads: _Grads):
    """``dq`` of one kernel call on selected keys ``kv = [k_keys, v_keys]`` (emptied here, so they are freed once
    used); their dK/dV are added onto the rows ``index`` of ``grads`` (in place: no buffer of the call's size
    outlives it), made after the kernel."""
    k_keys, v_keys = kv
    kv.clear()
    dq, dk_keys, dv_keys = kernels.run_backward_per_kv_head(
        layer.kernel, dout, q, k_keys, v_keys, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        layer.scale, causal, layer.window, layer.softcap)
    del k_keys, v_keys
    grads.make().dk.index_add_(0, index, dk_keys)
    del dk_keys
    grads.dv.index_add_(0, index, dv_keys)
    return dq


def _call_backward(layer, dout, q, kv: list, out, lse, t: ExchangeTables, keys: _Keys, causal, grads: _Grads):
    """:func:`_backward_into` for one whole call (all local runs) on ``keys``."""
    return _backward_into(layer, dout, q, kv, out, lse, t.cu_seqlens_q, keys.cu_seqlens_k, t.max_seqlen_q,
                          keys.max_seqlen_k, causal, keys.index, grads)


def _pieces_backward(layer, dout, q, source: list, index: torch.Tensor, pieces, causal, out, lse, dq: list,
                     grads: _Grads) -> None:
    """A part's backward, piece by piece (each a few runs against at most about ``T_local`` keys, rows ``index`` of
    the ``source = [k_buf, v_buf]`` buffers): each piece's dq is added onto the rows of ``dq[0]`` (made after the
    first kernel unless given, or the first piece's own when it covers every row), its keys' dK/dV onto
    ``grads``. Only one piece's selected keys and kernel buffers are live at a time; ``source`` is emptied (so
    a buffer only it holds is freed) once the last piece's keys are selected."""
    k_buf, v_buf = source
    source.clear()
    last = len(pieces) - 1
    for i, p in enumerate(pieces):
        rows = slice(p.q0, p.q1)
        at = index[p.k0:p.k1]
        selected = [k_buf.index_select(0, at), v_buf.index_select(0, at)]
        if i == last:
            del k_buf, v_buf
        dq_p = _backward_into(layer, dout[rows], q[rows], selected, out[rows], lse[:, rows].contiguous(),
                              p.cu_seqlens_q, p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, causal, at, grads)
        if not dq and p.q0 == 0 and p.q1 == q.shape[0]:
            dq.append(dq_p)
            continue
        if not dq:
            dq.append(torch.zeros_like(q))
        dq[0][rows].add_(dq_p)
        del dq_p


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
    layer's local tensors only), the local part's backward runs while they are in flight, then the remote part's
    in pieces (``t.pieces``), and the reverse all-to-all returns every received key's dK/dV to its owner:
    ``(dq, dk, dv, dsinks)``. dq and dK/dV build up in place: dK and dV ``[T_local, H_kv, D]`` for the held keys
    (returned as they are), one ``[R, 2, H_kv, D]`` for the received ones (what the reverse all-to-all sends)."""
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
            local = _Grads(like=k)
            dq = _call_backward(layer, dout, q, [*_select(k, v, t.local)], out, lse, t, t.local, t.causal, local)
            dk, dv = local.make().dk, local.dv
        else:
            selected = [*_select(torch.cat([k, recv[:, 0]]), torch.cat([v, recv[:, 1]]), t.joint)]
            del recv
            joint = _Grads((T_local + received, 2, *k.shape[1:]), like=k)
            dq = _call_backward(layer, dout, q, selected, out, lse, t, t.joint, t.causal, joint)
            rows = joint.make().rows
            del joint
            dk, dv, grad_recv = rows[:T_local, 0], rows[:T_local, 1], rows[T_local:]
    else:
        local = _Grads(like=k)
        dq: list = []
        _pieces_backward(layer, dout, q, [k, v], t.local.index, t.local_pieces, t.causal, out, lse, dq,
                         local)  # while the keys are in flight
        if not dq:  # no local key at all (cannot happen: every run attends itself)
            dq.append(torch.zeros_like(q))
        dk, dv = local.make().dk, local.dv
        del local
        work.wait()
        received_grad = _Grads(tuple(recv.shape), like=recv)
        holder = [recv[:, 0], recv[:, 1]]
        del recv
        _pieces_backward(layer, dout, q, holder, t.remote.index, t.pieces, False, out, lse, dq, received_grad)
        grad_recv = received_grad.make().rows
        del received_grad
        dq = dq[0]
    if t.communicate:
        returned, work = _a2a(grad_recv, t.send_splits, t.recv_splits, layer.group)
        del grad_recv
        work.wait()
        dk.index_add_(0, t.send_index, returned[:, 0])  # every received key's gradient, back at its owner
        dv.index_add_(0, t.send_index, returned[:, 1])
        del returned
    dsinks = kernels.sink_grad(dout, out, lse, sinks) if sinks is not None else None
    return dq, dk.contiguous(), dv.contiguous(), dsinks


def fake(q, k, v, sinks, tables, layer) -> list[torch.Tensor]:
    from cp_packing.attention.allgather import lse_like

    return [torch.empty_like(q), lse_like(q)]
