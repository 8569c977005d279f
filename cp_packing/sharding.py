"""One context-parallel rank's view of a packed batch: its tokens and exactly the varlen metadata its kernel needs.

``shard_packed_seq_params(params, cp_size=..., cp_rank=..., layout=...)`` is a pure function of the global
``PackedSeqParams`` (no communication): every rank can compute its own shard, or one rank can compute all of them.
The result, ``ShardedPackedSeqParams``, carries

* per-token local tensors ``[T_local]`` (``T_local = B*S // cp_size`` on every rank): ``token_index`` (global flat
  position), ``doc_ids`` (for loss masking) and ``position_ids`` (position inside the segment, for RoPE);
* the local metadata in the convention of the layout's kernel (``cu_seqlens``/``max_seqlen``; and where keys are
  gathered ``cu_seqlens_k``/``max_seqlen_k``/``local_k_slice``), see ``ring_flash_attn_kwargs`` and
  ``to_flash_attention_kwargs``;
* the layout-independent run description used by the built-in all-gather attention: ``run_cu_seqlens`` (local
  runs, each a piece of one segment) and ``run_key_start`` (where each run's keys start: its segment's start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from cp_packing._checks import check_cp
from cp_packing.layouts import check_layout, expand_runs, global_token_order, layout_runs
from cp_packing.packed_seq import PackedSeqParams

__all__ = ["ShardedPackedSeqParams", "shard_packed_seq_params", "ring_flash_attn_kwargs", "transformer_engine_kwargs"]


class _SharedCache:
    """Per-step derived metadata (the all-gather key index, every rank's token order), computed once and reused by
    every layer.

    Deliberately NOT a dict: tree-mapping utilities (FSDP2's ``cast_forward_inputs``, ``_apply_to_tensors``) rebuild
    dicts, lists and dataclasses when they copy a module's inputs, so a dict cache would be emptied in every layer;
    an opaque object is passed through and shared by the copies. Each entry remembers the tensors it was derived
    from and is only returned to a shard holding those very tensors, so a copy made with other metadata
    (``dataclasses.replace(sharded, token_index=...)``) recomputes instead of reading a stale entry."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict = {}

    def lookup(self, owner: "ShardedPackedSeqParams", key, compute):
        sources = owner._cache_sources()
        entry = self._data.get(key)
        if entry is not None and len(entry[0]) == len(sources) and all(a is b for a, b in zip(entry[0], sources)):
            return entry[1]
        value = compute()
        self._data[key] = (sources, value)
        return value

    def __contains__(self, key) -> bool:
        return key in self._data

    def __repr__(self) -> str:
        return f"_SharedCache({list(self._data)})"


@dataclass(frozen=True, eq=False)
class ShardedPackedSeqParams:
    """One CP rank's share of a packed batch (see module docstring).

    Attributes:
        cp_size, cp_rank, layout: the CP group size, this rank, the layout name.
        global_params: the ``PackedSeqParams`` of the whole batch this shard came from.
        token_index: int64 ``[T_local]``, the global flat position of each local token.
        doc_ids: ``[T_local]`` (the map's dtype), this rank's slice of the doc map.
        position_ids: int64 ``[T_local]``, each token's 0-based position inside its segment.
        cu_seqlens: int32, the local query-side metadata of the layout's kernel. ``zigzag``: ``global_cu // cp``
            (ring-flash-attn zigzag varlen, TransformerEngine THD); otherwise the local runs ``[R + 1]``
            (for ``contiguous`` equal to llama3's ``cu_seqlens_q``).
        max_seqlen: int, the longest entry of ``cu_seqlens`` (``zigzag``: ``global_max // cp``).
        cu_seqlens_k: int32 ``[R + 1]`` key-side metadata where keys are gathered (``contiguous``: relative to
            ``local_k_slice`` of the global stream, exactly llama3's; ``balanced``: concatenated key ranges);
            ``None`` for ``zigzag`` (the ring kernel passes keys around itself).
        max_seqlen_k: int or ``None``, the longest key range.
        local_k_slice: ``slice`` of the global stream holding this rank's keys (``contiguous`` only), else ``None``.
        run_cu_seqlens: int32 ``[R + 1]``, local runs: maximal pieces of consecutive global tokens of one segment.
        run_key_start: int64 ``[R]``, global position where each run's keys start (its segment's start).
    """

    cp_size: int
    cp_rank: int
    layout: str
    global_params: PackedSeqParams = field(repr=False)
    token_index: torch.Tensor
    doc_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    cu_seqlens_k: torch.Tensor | None
    max_seqlen_k: int | None
    local_k_slice: slice | None
    run_cu_seqlens: torch.Tensor
    run_key_start: torch.Tensor
    _cache: "_SharedCache" = field(default_factory=lambda: _SharedCache(), repr=False, compare=False)

    @property
    def num_local_tokens(self) -> int:
        """``T_local``."""
        return int(self.token_index.numel())

    @property
    def batch_shape(self) -> tuple[int, int]:
        return tuple(self.global_params.doc_ids.shape)

    def _cache_sources(self) -> tuple:
        return (self.global_params.cu_seqlens, self.token_index, self.run_cu_seqlens, self.run_key_start)

    def cached(self, key, compute):
        """``compute()``, once per ``key`` for this shard's metadata (shared by copies that hold the same tensors)."""
        return self._cache.lookup(self, (key, self.layout, self.cp_size, self.cp_rank), compute)

    def global_token_order(self) -> torch.Tensor:
        """int64 ``[cp_size, T_local]``: every rank's ``token_index`` (cached; the order of an all-gather)."""
        return self.cached(
            "global_token_order",
            lambda: global_token_order(self.global_params.cu_seqlens, cp_size=self.cp_size, layout=self.layout).to(
                self.token_index.device
            ),
        )

    def _flat(self, x: torch.Tensor, name: str, flat: bool | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
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
        """
        flat_x = self._flat(x, "x", flat)
        return flat_x.index_select(0, self.token_index.to(flat_x.device))

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
        stacked = torch.cat(list(parts), 0)
        order = self.global_token_order().reshape(-1).to(stacked.device)
        out = torch.empty_like(stacked)
        out.index_copy_(0, order, stacked)
        B, S = self.batch_shape
        return out.reshape(B, S, *stacked.shape[1:])

    def flash_attention_kwargs(self) -> dict[str, torch.Tensor | int]:
        """HF ``FlashAttentionKwargs`` for the local tokens (key side where this layout gathers keys)."""
        k = self.cu_seqlens if self.cu_seqlens_k is None else self.cu_seqlens_k
        max_k = self.max_seqlen if self.max_seqlen_k is None else self.max_seqlen_k
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": k,
            "max_length_q": self.max_seqlen,
            "max_length_k": max_k,
        }


def shard_packed_seq_params(
    params: PackedSeqParams, *, cp_size: int, cp_rank: int, layout: str = "zigzag"
) -> ShardedPackedSeqParams:
    """This rank's share of a packed batch: local tokens, positions, doc ids and kernel metadata.

    Pure and deterministic (no communication); CPU or CUDA tensors (outputs on ``params.cu_seqlens.device``).
    Costs one host sync for the ``max_seqlen`` ints.

    Args:
        params: the global ``PackedSeqParams`` of the ``[B, S]`` batch.
        cp_size: context-parallel group size; ``B*S`` must be a multiple of it.
        cp_rank: this rank, in ``[0, cp_size)``.
        layout: ``"zigzag"`` (default; every segment a multiple of ``2*cp_size``, see ``pad_segments``),
            ``"contiguous"``, ``"balanced"``, or ``"auto"`` (per batch, the valid layout with the lowest busiest-rank
            cost; the chosen name is in the result's ``layout``).

    Raises:
        TypeError: ``params`` is not ``PackedSeqParams``, or a non-int cp_size / cp_rank.
        ValueError: bad cp_size / cp_rank / layout, ``B*S % cp_size != 0``, or (zigzag) a segment whose length is
            not a multiple of ``2*cp_size`` (the error names the first one).
    """
    if not isinstance(params, PackedSeqParams):
        raise TypeError(
            f"params must be PackedSeqParams, got {type(params).__name__}; build it with "
            "packed_seq_params_from_doc_ids(doc_ids)"
        )
    check_cp(cp_size, cp_rank)
    if layout == "auto":
        from cp_packing.cost import choose_layout  # the cost model picks per batch

        layout = choose_layout(params, cp_size=cp_size)
    check_layout(layout)
    cu = params.cu_seqlens.to(torch.int64)
    total = params.total_tokens
    run_start, run_len = layout_runs(cu, cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    T_local = total // cp_size

    seg = torch.searchsorted(cu, run_start, right=True) - 1
    run_key_start = cu[seg]
    token_index = expand_runs(run_start, run_len, T_local)
    position_ids = expand_runs(run_start - run_key_start, run_len, T_local)
    doc_ids = params.doc_ids.reshape(-1).index_select(0, token_index.to(params.doc_ids.device))

    run_end = run_start + run_len
    run_cu = torch.zeros(run_len.numel() + 1, dtype=torch.int32, device=cu.device)
    run_cu[1:] = torch.cumsum(run_len, 0)
    key_len = run_end - run_key_start

    if layout == "zigzag":
        cu_seqlens = (cu // cp_size).to(torch.int32)
        max_seqlen = params.max_seqlen // cp_size
        cu_k = max_k = k_slice = None
    else:
        cu_seqlens = run_cu
        cu_k = torch.zeros_like(run_cu)
        if layout == "contiguous" and run_len.numel():
            # llama3: keys are one slice of the global stream, from the first run's segment start to the end.
            k_lo = int(run_key_start[0])
            cu_k[1:] = run_end - k_lo
            k_slice = slice(k_lo, (cp_rank + 1) * T_local)
        else:
            cu_k[1:] = torch.cumsum(key_len, 0)
            k_slice = None
        if run_len.numel():
            max_seqlen, max_k = torch.stack([run_len.max(), key_len.max()]).tolist()
        else:
            max_seqlen = max_k = 0

    return ShardedPackedSeqParams(
        cp_size=cp_size,
        cp_rank=cp_rank,
        layout=layout,
        global_params=params,
        token_index=token_index,
        doc_ids=doc_ids,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(max_seqlen),
        cu_seqlens_k=cu_k,
        max_seqlen_k=None if max_k is None else int(max_k),
        local_k_slice=k_slice,
        run_cu_seqlens=run_cu,
        run_key_start=run_key_start,
    )


def ring_flash_attn_kwargs(sharded: ShardedPackedSeqParams) -> dict:
    """Keyword arguments of the ring-flash-attn 0.1.8 varlen function that fits the layout.

    ``zigzag`` -> ``zigzag_ring_flash_attn_varlen_func(q, k, v, causal=True, **kwargs)`` with ``cu_seqlens``,
    ``max_seqlen``; ``contiguous`` -> ``llama3_flash_attn_varlen_func(q, k, v, causal=True, heads_k_stride=..., **kwargs)``
    with ``cu_seqlens_q``, ``cu_seqlens_k``, ``max_seqlen_q``, ``max_seqlen_k``, ``local_k_slice`` (identical to
    ``llama3_flash_attn_prepare_cu_seqlens(global_cu, True, rank, world_size)``).
    """
    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(f"expected ShardedPackedSeqParams, got {type(sharded).__name__}")
    if sharded.layout == "zigzag":
        return {"cu_seqlens": sharded.cu_seqlens, "max_seqlen": sharded.max_seqlen}
    if sharded.layout == "contiguous":
        return {
            "cu_seqlens_q": sharded.cu_seqlens,
            "cu_seqlens_k": sharded.cu_seqlens_k,
            "max_seqlen_q": sharded.max_seqlen,
            "max_seqlen_k": sharded.max_seqlen_k,
            "local_k_slice": sharded.local_k_slice,
        }
    raise ValueError(
        f"ring-flash-attn has no kernel for layout {sharded.layout!r}; use layout 'zigzag' or 'contiguous', or "
        "cp_packing.context_parallel_attention (built-in all-gather backend) for this layout"
    )


def transformer_engine_kwargs(sharded: ShardedPackedSeqParams) -> dict:
    """Keyword arguments for TransformerEngine ``DotProductAttention(qkv_format="thd")`` with context parallelism.

    TE's THD context parallelism uses the zigzag placement (chunks r and 2cp-1-r of every sequence) and takes the
    GLOBAL ``cu_seqlens`` (its THD path computes ``cu_seqlens_q // cp_size`` per step itself) and asserts every
    sequence is a multiple of ``2*cp``. Only ``layout="zigzag"`` matches it. Padding lives inside segments here
    (``pad_segments``), so the ``*_padded`` offsets equal the unpadded ones. q/k/v are this rank's
    ``sharded.shard(...)`` tensors ``[T_local, H, D]``.
    """
    if not isinstance(sharded, ShardedPackedSeqParams):
        raise TypeError(f"expected ShardedPackedSeqParams, got {type(sharded).__name__}")
    if sharded.layout != "zigzag":
        raise ValueError(
            f"TransformerEngine THD context parallelism needs layout='zigzag', got {sharded.layout!r}"
        )
    cu = sharded.global_params.cu_seqlens
    return {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cu,
        "cu_seqlens_kv_padded": cu,
        "max_seqlen_q": sharded.global_params.max_seqlen,
        "max_seqlen_kv": sharded.global_params.max_seqlen,
    }
