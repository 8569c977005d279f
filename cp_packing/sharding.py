"""One context-parallel rank's view of a packed batch: its tokens and the layout-independent metadata of its runs.

``shard_packed_seq_params(params, cp_size=..., cp_rank=..., layout=...)`` is a pure function of the global
``PackedSeqParams`` (no communication): every rank can compute its own shard, or one rank can compute all of them.
A rank's tokens form *runs*: maximal pieces of consecutive global tokens of one segment, in local order. The fields
of ``ShardedPackedSeqParams`` mean the same thing whatever the layout; what a kernel convention needs
(ring-flash-attn's zigzag ``global_cu // cp``, llama3's key slice, TransformerEngine's THD kwargs) comes from its
adapter in ``cp_packing.adapters``. A prepared step's plan rides on the shard (``with_plan``; the ``plan`` field),
so every layer reads the same one. ``take_rows`` indexes rows of any dtype (unsigned ones bit for bit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from cp_packing._checks import as_signed, check_bool, check_cp, check_tensor, check_windows
from cp_packing.layouts import Local, check_layout, expand_runs, global_token_order, layout_plan
from cp_packing.layouts.choose import choose_layout_of_cu
from cp_packing.packed_seq import PackedSeqParams, check_params

__all__ = ["ShardedPackedSeqParams", "shard_packed_seq_params", "take_rows"]


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` for every dtype (unsigned ones through ``as_signed``, bit for bit)."""
    signed = as_signed(x)
    taken = signed.index_select(0, index.to(x.device))
    return taken if signed is x else taken.view(x.dtype)  # view(dtype) would drop autograd


@dataclass(frozen=True, eq=False)
class ShardedPackedSeqParams:
    """One CP rank's share of a packed batch; every field means the same thing in every layout.

    Attributes:
        cp_size, cp_rank, layout: the CP group size, this rank, the layout name (``"auto"`` resolved) or the layout
            object given (``Local(tolerance=)``).
        global_params: the ``PackedSeqParams`` of the whole batch this shard came from.
        token_index: int64 ``[T_local]``, the global flat position of each local token.
        doc_ids: ``[T_local]`` (the map's dtype), this rank's slice of the doc map (for loss masking).
        position_ids: int64 ``[T_local]``, each token's 0-based position inside its segment (for RoPE).
        cu_seqlens: int32 ``[R + 1]``, the local runs: run ``i`` is local tokens ``[cu_seqlens[i], cu_seqlens[i+1])``,
            consecutive global tokens of one segment.
        max_seqlen: int, the longest local run.
        key_start: int64 ``[R]``, the global position where run ``i``'s causal keys start (its segment's start).
        plan_window: the sliding window(s) the layout was planned for (``None``, an int, or a per-layer tuple of
            ``int | None``; only ``balanced`` depends on it). Not the window the attention runs with: HF passes that
            per layer.
        plan: this step's attention plan (``cp_packing.attention.prepare_attention`` attaches it; ``None`` until
            then): every copy of the shard shares it.
    """

    cp_size: int
    cp_rank: int
    layout: str | Local
    global_params: PackedSeqParams = field(repr=False)
    token_index: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    key_start: torch.Tensor
    plan_window: int | tuple[int | None, ...] | None = None
    plan: Any = field(default=None, repr=False)

    def with_plan(self, plan: Any) -> "ShardedPackedSeqParams":
        """A copy of this shard carrying ``plan`` (the step plan of ``prepare_attention``)."""
        return dataclasses.replace(self, plan=plan)

    def without_plan(self) -> "ShardedPackedSeqParams":
        """This shard without a step plan (itself when it has none)."""
        return self if self.plan is None else dataclasses.replace(self, plan=None)

    @property
    def num_local_tokens(self) -> int:
        """``T_local``."""
        return int(self.token_index.numel())

    @property
    def batch_shape(self) -> tuple[int, int]:
        """``(B, S)`` of the global batch."""
        return tuple(self.global_params.doc_ids.shape)

    def global_token_order(self) -> torch.Tensor:
        """int64 ``[cp_size, T_local]``: every rank's ``token_index`` (the order of an all-gather; the layout's plan
        is cached, the order is one pass over ``T``)."""
        return global_token_order(self.global_params.cu_seqlens, cp_size=self.cp_size, layout=self.layout,
                                  window=self.plan_window).to(self.token_index.device)

    def _flat(self, x: torch.Tensor, name: str, flat: bool | None = None) -> torch.Tensor:
        check_tensor(x, name, "[B, S, ...] or [B*S, ...]")
        B, S = self.batch_shape
        T = B * S
        batch_shaped = x.dim() >= 2 and tuple(x.shape[:2]) == (B, S)
        if flat is not True and batch_shaped:
            return x.reshape(T, *x.shape[2:])
        if flat is not False and x.dim() >= 1 and x.shape[0] == T:
            return x
        want = {None: f"[B, S, ...] = [{B}, {S}, ...] or flat [B*S, ...] = [{T}, ...]",
                True: f"flat [B*S, ...] = [{T}, ...]", False: f"[B, S, ...] = [{B}, {S}, ...]"}[flat]
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {want} to match the doc map")

    def shard(self, x: torch.Tensor, *, flat: bool | None = None) -> torch.Tensor:
        """Map a ``[B, S, ...]`` (or flat ``[B*S, ...]``) tensor to this rank's ``[T_local, ...]`` (a copy).

        ``flat=None`` reads ``x`` as ``[B, S, ...]`` when its first two dims are ``(B, S)``, else as flat. With
        ``S == 1`` a flat ``[T, 1, ...]`` tensor (e.g. q with one head) looks like ``[B, S, ...]``: pass ``flat=True``.
        Differentiable; every dtype (unsigned included).
        """
        if flat is not None:
            check_bool(flat, "flat")
        return take_rows(self._flat(x, "x", flat), self.token_index)

    def unshard(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``shard``: every rank's ``[T_local, ...]`` tensor, in rank order -> ``[B, S, ...]``."""
        if not isinstance(parts, (list, tuple)) or len(parts) != self.cp_size:
            got = len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__
            raise ValueError(f"unshard needs a list of cp_size={self.cp_size} tensors (one per rank), got {got}")
        T_local = self.num_local_tokens
        for r, p in enumerate(parts):
            if not isinstance(p, torch.Tensor) or p.dim() < 1 or p.shape[0] != T_local:
                shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise ValueError(f"unshard: part {r} has shape {shape}; expected [T_local={T_local}, ...]")
            if p.shape[1:] != parts[0].shape[1:] or p.dtype != parts[0].dtype or p.device != parts[0].device:
                raise ValueError(
                    f"unshard: part {r} is {tuple(p.shape)} {p.dtype} on {p.device} but part 0 is "
                    f"{tuple(parts[0].shape)} {parts[0].dtype} on {parts[0].device}; pass every rank's shard of ONE "
                    "tensor (same trailing shape, dtype and device)")
        stacked = torch.cat(list(parts), 0)
        order = self.global_token_order().reshape(-1).to(stacked.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
        B, S = self.batch_shape
        return take_rows(stacked, inverse).reshape(B, S, *stacked.shape[1:])


def shard_packed_seq_params(
    params: PackedSeqParams, *, cp_size: int, cp_rank: int, layout: str | Local = "auto",
    window: int | Sequence[int | None] | None = None,
) -> ShardedPackedSeqParams:
    """This rank's share of a packed batch: local tokens, positions, doc ids and runs.

    Pure and deterministic (no communication); CPU or CUDA tensors (outputs on ``params.cu_seqlens.device``).
    Costs one host sync for ``max_seqlen``.

    Args:
        params: the global ``PackedSeqParams`` of the ``[B, S]`` batch (validated: see ``check_params``).
        cp_size: context-parallel group size; ``B*S`` must be divisible by it.
        cp_rank: this rank, in ``[0, cp_size)``.
        layout: ``"auto"`` (default: per batch, the valid layout with the lowest busiest-rank cost; the chosen name
            is in the result's ``layout``), ``"contiguous"``, ``"zigzag"`` (every segment a multiple of
            ``2*cp_size``, see ``pad_segments``), ``"balanced"`` or ``"local"``, or a layout object that carries
            its parameters (``cp_packing.layouts.Local(tolerance=)``). See docs/layouts.md.
        window: the model's sliding window, so that the work is balanced as the model does it: ``None`` (full
            causal), an int, or a per-layer list of ``int | None`` (``None`` = a global layer; the cost is the sum
            over the layers). A token at position ``p`` costs ``min(p + 1, window)``: ``balanced`` is planned for
            that cost and ``auto`` picks by it. Every rank must pass the same (kept as ``plan_window``).

    Returns:
        ``ShardedPackedSeqParams``.

    >>> import torch, cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 0]]))
    >>> shard_packed_seq_params(params, cp_size=2, cp_rank=1, layout="contiguous").token_index.tolist()
    [3, 4, 5]
    >>> shard_packed_seq_params(params, cp_size=2, cp_rank=1, layout="balanced", window=[2, None]).plan_window
    (2, None)
    """
    check_params(params)
    check_cp(cp_size, cp_rank)
    window = check_windows(window)
    if layout == "auto":
        layout = choose_layout_of_cu(params.cu_seqlens, cp_size=cp_size, window=window)
    check_layout(layout)
    cu = params.cu_seqlens.to(torch.int64)
    plan_start, plan_len = layout_plan(cu, cp_size=cp_size, layout=layout, window=window).runs(cp_rank)
    run_start = torch.from_numpy(plan_start.copy()).to(cu.device)
    run_len = torch.from_numpy(plan_len.copy()).to(cu.device)
    T_local = params.total_tokens // cp_size

    seg = torch.searchsorted(cu, run_start, right=True) - 1
    key_start = cu[seg]
    token_index = expand_runs(run_start, run_len, T_local)
    position_ids = expand_runs(run_start - key_start, run_len, T_local)
    doc_ids = take_rows(params.doc_ids.reshape(-1), token_index)

    run_cu = torch.zeros(run_len.numel() + 1, dtype=torch.int32, device=cu.device)
    run_cu[1:] = torch.cumsum(run_len, 0)
    return ShardedPackedSeqParams(
        cp_size=cp_size,
        cp_rank=cp_rank,
        layout=layout,
        global_params=params,
        token_index=token_index,
        doc_ids=doc_ids,
        position_ids=position_ids,
        cu_seqlens=run_cu,
        max_seqlen=int(run_len.max()) if run_len.numel() else 0,
        key_start=key_start,
        plan_window=window,
    )
