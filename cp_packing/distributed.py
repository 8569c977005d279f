"""Ship a packed batch and its context-parallel metadata to every rank of a CP group over ``torch.distributed``.

Two ways a batch reaches the group (docs/distributed.md has the whole story, the costs and the error table):

* ``src=None``, every rank loaded the same batch: each rank shards it locally (``cp_packing.loader.shard_batch``, the
  one CP batch builder).
* ``src=r``, group rank r loaded it: r validates it and resolves the layout; every rank rebuilds the global
  ``PackedSeqParams`` from the small run-length metadata (one ``broadcast_object_list``) and shards it itself; each
  key's tokens travel with ONE ``dist.scatter`` of raw bytes, so a rank receives only its own ``T_local`` tokens.

Every call first makes one ``agree`` (``cp_packing.agreement``) over the call, ``src``, ``check_consistent``,
``layout`` and ``window`` (plus digests of the batch with ``check_consistent=True``), carrying any rank's local error
(a bad argument, or a batch that only the source sees and cannot ship): mismatched calls raise the same error on every
rank instead of hanging or aborting gloo.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from cp_packing._checks import check_bool, check_choice, check_windows, is_int
from cp_packing.agreement import AgreementError, digest, fail_together
from cp_packing.groups import CPGroup, GroupLike, resolve_group
from cp_packing.layouts import LAYOUTS
from cp_packing.loader import shard_batch
from cp_packing.packed_seq import PackedSeqParams, check_params, packed_seq_params_from_doc_ids
from cp_packing.sharding import ShardedPackedSeqParams, as_signed, shard_packed_seq_params

__all__ = ["DOC_IDS_KEY", "distribute_batch", "distribute_packed_seq_params"]

DOC_IDS_KEY = "doc_ids"
"""The batch key ``distribute_batch`` builds ``PackedSeqParams`` from when ``params`` is not given."""

_Batch = dict[str, torch.Tensor]
_Prepare = Callable[[str], tuple[PackedSeqParams, "_Batch | None"]]


@dataclasses.dataclass(frozen=True)
class _Metadata:
    """What the source broadcasts: enough to rebuild the global params bit for bit, O(segments) bytes."""

    shape: tuple[int, int]  # (B, S)
    cu_seqlens: torch.Tensor  # [num_segments + 1], the source's dtype, CPU
    max_seqlen: int
    segment_doc: torch.Tensor  # [num_segments] doc index of every segment (a signed view of the map's dtype), CPU
    doc_dtype: torch.dtype
    layout: str  # resolved on the source (set after sharding there)
    keys: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...] | None  # (name, dtype, trailing shape) per key


def _check_args(cp: CPGroup, src: object, layout: object, check_consistent: object) -> None:
    check_bool(check_consistent, "check_consistent")
    check_choice(layout, "layout", (*LAYOUTS, "auto"))
    if src is None:
        return
    if not is_int(src):
        raise TypeError(f"src must be an int (a rank of the CP group) or None, got {src!r} ({type(src).__name__})")
    if not 0 <= src < cp.size:
        raise ValueError(
            f"src={src} is outside the CP group: src is a GROUP rank in [0, {cp.size}) (the group has {cp.size} "
            "ranks), not a global rank; convert a global rank with torch.distributed.get_group_rank(group, rank)"
        )


def _prepare_params(params: object, where: str) -> tuple[PackedSeqParams, None]:
    if not isinstance(params, PackedSeqParams):
        raise TypeError(
            f"params must be PackedSeqParams, got {type(params).__name__} ({where}); build it with "
            "packed_seq_params_from_doc_ids(doc_ids)"
        )
    return params, None


def _prepare_batch(batch: object, params: object, where: str) -> tuple[PackedSeqParams, _Batch]:
    """Validate a batch dict (and build params from ``batch[DOC_IDS_KEY]`` when None). Local, no communication."""
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"batch must be a dict of per-token tensors [B, S, ...] (input_ids, labels, ...), got "
            f"{type(batch).__name__} ({where})"
        )
    for key, value in batch.items():
        if not isinstance(key, str):
            raise TypeError(f"batch keys must be str, got {key!r} ({type(key).__name__})")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"batch[{key!r}] must be a torch.Tensor [B, S, ...], got {type(value).__name__}")
    if params is None:
        if DOC_IDS_KEY not in batch:
            raise ValueError(
                f"distribute_batch needs the doc map: pass params=packed_seq_params_from_doc_ids(doc_ids) or put the "
                f"[B, S] doc map in batch[{DOC_IDS_KEY!r}] (keys given: {sorted(batch)})"
            )
        params = packed_seq_params_from_doc_ids(batch[DOC_IDS_KEY])
    params, _ = _prepare_params(params, where)
    B, S = params.doc_ids.shape
    for key, value in batch.items():
        if value.dim() < 2 or tuple(value.shape[:2]) != (B, S):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}; every per-token tensor must be [B, S, ...] = "
                f"[{B}, {S}, ...] like the doc map (unflatten a flat tensor with x.view({B}, {S}, ...), drop or "
                "broadcast per-row tensors before calling)"
            )
    return params, dict(batch)


def _metadata(params: PackedSeqParams, batch: _Batch | None) -> _Metadata:
    """The source's metadata, after checking that it rebuilds ``params`` exactly (a hand-built ``PackedSeqParams``
    whose segments are not runs of one document would otherwise shard differently on the other ranks)."""
    doc_ids = check_params(params).doc_ids  # the seed's validation: cu_seqlens covers B*S, row starts, max_seqlen
    B, S = doc_ids.shape
    flat = as_signed(doc_ids.reshape(-1))
    cu = params.cu_seqlens.to(device=flat.device, dtype=torch.int64)
    segment_doc = flat.index_select(0, cu[:-1])
    if not torch.equal(torch.repeat_interleave(segment_doc, cu[1:] - cu[:-1], output_size=B * S), flat):
        raise ValueError(
            "params.cu_seqlens does not match params.doc_ids: a segment holds more than one document index; build "
            "the params with packed_seq_params_from_doc_ids(doc_ids)"
        )
    keys = None
    if batch is not None:
        for key, x in batch.items():
            if x.requires_grad:
                raise ValueError(
                    f"batch[{key!r}] requires grad, but src= ships tensors as bytes: no gradient can flow back to "
                    f"the source; pass batch[{key!r}].detach(), or load the batch on every rank and use src=None "
                    "(the local path keeps autograd)"
                )
        keys = tuple((key, x.dtype, tuple(x.shape[2:])) for key, x in batch.items())
    return _Metadata((B, S), params.cu_seqlens.cpu(), int(params.max_seqlen), segment_doc.cpu(), doc_ids.dtype,
                     "auto", keys)


def _rebuild(meta: _Metadata, device: torch.device) -> PackedSeqParams:
    """The global params from the source's metadata: the doc map is its segments' indices, run-length decoded."""
    cu = meta.cu_seqlens.to(device)
    lengths = cu[1:].to(torch.int64) - cu[:-1]
    B, S = meta.shape
    doc_ids = torch.repeat_interleave(meta.segment_doc.to(device), lengths, output_size=B * S)  # [B*S]
    return PackedSeqParams(cu, meta.max_seqlen, doc_ids.view(meta.doc_dtype).reshape(B, S))


def _scatter_tokens(cp: CPGroup, src: int, sharded: ShardedPackedSeqParams, meta: _Metadata,
                    batch: _Batch | None) -> _Batch:
    """One ``dist.scatter`` per key: rank r receives the bytes of its ``T_local`` tokens (``batch``: the source's)."""
    T_local = sharded.num_local_tokens
    order = sharded.global_token_order().reshape(-1) if cp.rank == src else None  # [cp * T_local]
    local = {}
    for name, dtype, trailing in meta.keys:
        features = math.prod(trailing)
        received = torch.empty(T_local * features * dtype.itemsize, dtype=torch.uint8, device=cp.device)
        if received.numel():  # every rank knows the size from the metadata: all skip together
            rows = None
            if cp.rank == src:
                x = batch[name].detach()
                x = as_signed(x).reshape(-1, *([features] if features > 1 else []))
                picked = x.index_select(0, order.to(x.device))  # [cp * T_local(, F)], contiguous
                rows = list(picked.view(torch.uint8).to(cp.device).reshape(cp.size, -1).unbind(0))
            dist.scatter(received, rows, src=cp.global_rank(src), group=cp.group)
        out = received.view(dtype).reshape(1, T_local, *trailing)  # [1, T_local, ...]
        local[name] = out
    return local


def _consistency_fields(params: PackedSeqParams,
                        batch: _Batch | None) -> tuple[dict[str, str | None], dict[str, str]]:
    """Fields every rank must share with ``check_consistent`` (BLAKE2b digests), and per-key digests."""
    per_key = {} if batch is None else {k: digest(v) for k, v in sorted(batch.items())}
    keys = None if batch is None else digest(*[(k, str(v.dtype), tuple(v.shape)) for k, v in sorted(batch.items())])
    return {"doc map": digest(params.doc_ids),
            "cu_seqlens": digest(params.cu_seqlens, int(params.max_seqlen)),
            "batch keys, dtypes and shapes": keys}, per_key


def _raise_if_tensors_differ(call: str, per_rank: list[dict[str, str]]) -> None:
    """Every rank sees every rank's per-key digests (the same records): all raise the same error, or none."""
    for key in per_rank[0]:
        differ = [r for r, d in enumerate(per_rank) if d[key] != per_rank[0][key]]
        if differ:
            raise AgreementError(
                f"{call}: check_consistent: batch[{key!r}] differs between the ranks of the CP group (rank(s) "
                f"{differ} differ from rank 0); every rank must pass the same batch (seed the data loader per DP "
                "replica, not per CP rank), or load it on one rank and pass src="
            )


def _distribute(call: str, group: GroupLike, src: int | None, layout: str, check_consistent: bool,
                prepare: _Prepare, window: object = None) -> tuple[ShardedPackedSeqParams, _Batch | None]:
    """Both paths: local work, ONE agreement (arguments, errors, digests), then the source path's collectives.
    Returns the shard and this rank's local batch (``None`` without a batch)."""
    cp = resolve_group(group)
    sharded = batch = meta = local = None
    args = {"src": src, "check_consistent": check_consistent, "layout": layout, "window": window}
    checked, per_key = {"doc map": None, "cu_seqlens": None, "batch keys, dtypes and shapes": None}, {}
    with fail_together(call, (cp.group, "CP group")) as agreement:
        agreement.fields = {name: repr(value) for name, value in args.items()}  # an invalid value may not pickle
        _check_args(cp, src, layout, check_consistent)
        window = args["window"] = check_windows(window)  # a list and a tuple of the same windows agree
        if src is None:
            params, batch = prepare("src=None: every rank passes the same batch, or set src= on every rank")
            if check_consistent:
                checked, per_key = _consistency_fields(params, batch)
            if batch is None:
                sharded = shard_packed_seq_params(params, cp_size=cp.size, cp_rank=cp.rank, layout=layout,
                                                  window=window)
            else:  # the one CP batch builder: this rank's tokens of its own batch (autograd kept)
                local, sharded = shard_batch(batch, params, cp_size=cp.size, cp_rank=cp.rank, layout=layout,
                                             window=window)
        elif cp.rank == src:
            params, batch = prepare(f"this rank is the source, src={src}: it passes the batch, the others None")
            meta = _metadata(params, batch)  # validates params before they are sharded
            params = PackedSeqParams(params.cu_seqlens.to(cp.device), params.max_seqlen, params.doc_ids.to(cp.device))
            sharded = shard_packed_seq_params(params, cp_size=cp.size, cp_rank=cp.rank, layout=layout, window=window)
            meta = dataclasses.replace(meta, layout=sharded.layout)
        agreement.fields, agreement.payload = {**args, **checked}, per_key or None
    records = agreement.records["CP group"]
    if src is None:
        if check_consistent and len(records) > 1:
            _raise_if_tensors_differ(call, [r.payload or {} for r in records])
        return sharded, local
    shipped = [meta]
    dist.broadcast_object_list(shipped, src=cp.global_rank(src), group=cp.group)
    meta = shipped[0]
    if cp.rank != src:
        params = _rebuild(meta, cp.device)
        sharded = shard_packed_seq_params(params, cp_size=cp.size, cp_rank=cp.rank, layout=meta.layout,
                                          window=window)
    return sharded, None if meta.keys is None else _scatter_tokens(cp, src, sharded, meta, batch)


def distribute_packed_seq_params(
    params: PackedSeqParams | None,
    *,
    group: GroupLike = None,
    src: int | None = None,
    layout: str = "auto",
    check_consistent: bool = True,
    window: int | Sequence[int | None] | None = None,
) -> ShardedPackedSeqParams:
    """This rank's ``ShardedPackedSeqParams`` in a CP group, sharded locally or shipped from one source rank.

    Args:
        params: the global ``PackedSeqParams`` of the ``[B, S]`` batch. ``src=None``: every rank passes the same.
            ``src`` set: only the source's is read; the other ranks pass ``None``.
        group: the CP group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (``mesh["cp"]``) or ``None`` (default group).
        src: ``None`` (shard locally) or the GROUP rank that holds ``params``.
        layout: ``"auto"`` (default: the best valid layout for this batch, chosen once) or one of
            ``cp_packing.layouts.LAYOUTS``; the result's ``layout`` names the one used.
        check_consistent: with ``src=None`` (default True), also compare BLAKE2b digests of every rank's doc map
            and ``cu_seqlens`` (catches a data loader seeded per CP rank); its cost is in docs/benchmarks.md.
        window: the model's sliding window (``None``, an int, or a per-layer list of ``int | None``) that
            ``balanced`` and ``auto`` plan for (see ``shard_packed_seq_params``); agreed like ``layout``.

    Returns:
        ``ShardedPackedSeqParams`` equal, field for field, to ``shard_packed_seq_params(params, cp_size=...,
        cp_rank=..., layout=...)``. ``src`` path: its tensors live on the group's device (CUDA for NCCL, CPU for
        gloo) on every rank.

    Raises:
        ValueError / TypeError, on EVERY rank of the group (a rank's own error is raised everywhere, naming it):
        a bad argument, ranks that disagree on the call, ``src``, ``layout``, ``window`` or ``check_consistent``
        (``AgreementError``), an invalid or indivisible ``params`` on the source, or (``check_consistent``)
        ranks holding different batches.

    Communication: the agreement (a small record per rank through the c10d store; none in a one-rank group), plus
    with ``src`` one ``broadcast_object_list`` of ``cu_seqlens`` and the segments' doc indices.

    Example (on every rank of ``mesh["cp"]``; ``docs/distributed.md``)::

        params = packed_seq_params_from_doc_ids(doc_ids) if cp_rank == 0 else None
        sharded = distribute_packed_seq_params(params, group=mesh["cp"], src=0)
    """
    return _distribute("distribute_packed_seq_params", group, src, layout, check_consistent,
                       lambda where: _prepare_params(params, where), window)[0]


def distribute_batch(
    batch: Mapping[str, torch.Tensor] | None,
    params: PackedSeqParams | None = None,
    *,
    group: GroupLike = None,
    src: int | None = None,
    layout: str = "auto",
    check_consistent: bool = True,
    window: int | Sequence[int | None] | None = None,
) -> tuple[dict[str, torch.Tensor], ShardedPackedSeqParams]:
    """Shard (``src=None``) or scatter from ``src`` a dict of per-token tensors together with its CP metadata.

    Args:
        batch: ``name -> [B, S, ...]`` tensors (``input_ids``, ``labels`` shifted on the GLOBAL stream, masks,
            embeddings; any dtype). With ``src`` set only the source's is read; the other ranks pass ``None``.
            With ``src`` set no tensor may require grad (its tokens travel as bytes; the local path keeps autograd).
        params: the batch's global ``PackedSeqParams``; ``None``: built from ``batch["doc_ids"]`` (``DOC_IDS_KEY``).
        group, src, layout, check_consistent, window: as in ``distribute_packed_seq_params``; ``check_consistent`` also
            digests every batch tensor (names, dtypes, shapes and bytes) and names a key that differs.

    Returns:
        ``(local_batch, sharded)``: ``local_batch[name]`` is this rank's ``[1, T_local, ...]`` (one packed row, the
        HF convention) for every key (``doc_ids`` too when present), same dtypes, plus ``"position_ids"`` =
        ``sharded.position_ids[None]`` (int64) when the batch has none. Equal to ``sharded.shard(batch[name])[None]``
        bit for bit. Devices: local path, each tensor's own; ``src`` path, the group's device.

    Raises:
        As ``distribute_packed_seq_params``, plus TypeError / ValueError (on every rank) for a batch that is not a
        dict of ``[B, S, ...]`` tensors, a missing doc map, or a tensor that requires grad with ``src`` set.

    Communication: the agreement, and with ``src`` the metadata broadcast and one ``dist.scatter`` per key: a rank
    receives ``T_local * bytes per token`` of tokens, never the whole batch.

    Example (on every rank of ``mesh["cp"]``; ``docs/distributed.md``)::

        local, sharded = distribute_batch(batch if cp_rank == 0 else None, group=mesh["cp"], src=0)
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], ...)
    """
    sharded, local = _distribute("distribute_batch", group, src, layout, check_consistent,
                                 lambda where: _prepare_batch(batch, params, where), window)
    if "position_ids" not in local:  # the src path (the local path's shard_batch adds them)
        local["position_ids"] = sharded.position_ids.unsqueeze(0)  # int64 [1, T_local]
    return local, sharded
