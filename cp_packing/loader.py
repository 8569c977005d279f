"""A DP x CP data loader: every CP rank of a data-parallel replica gets the same packed batch, with no scatter.

The rule (docs/data.md): every rank runs the SAME deterministic packer over the SAME document stream and keeps its
replica's share of each step; each DataLoader worker does the same and keeps the steps ``k`` with
``k % num_workers == worker_id``, so the steps are a function of (documents, packer arguments, seed, epoch) only,
whatever ``num_workers`` is. The DataLoader returns the workers' items round-robin in step order, so every rank sees
step 0, 1, 2, ... and every document of the epoch lands in exactly one replica's batch, once.

The metadata is computed in the workers, off the training step: each item is a :class:`CPBatch` holding the
replica's whole packed batch, its ``PackedSeqParams``, this rank's ``ShardedPackedSeqParams`` (the ``balanced``
plan by default) and this rank's local ``[1, T_local]`` tensors; the step only moves them to the device
(:meth:`CPBatch.to`). For rows that are already packed, :class:`ReplicaBatchSampler` gives each replica its rows
and :class:`CPCollator` builds the same :class:`CPBatch` in the workers.

::

    loader = cp_dataloader(dataset, seq_len=4096, rows=2, mesh=mesh, num_workers=2)   # mesh: ("dp", "cp")
    for item in loader:
        item = item.to(device)
        logits = model(**cp_model_inputs(item.local, item.sharded, group=mesh["cp"])).logits[0]
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from cp_packing._checks import IGNORE_INDEX, INTEGER_DTYPES, check_bool, check_int, check_tensor, is_int
from cp_packing.formats import doc_ids_from_position_ids
from cp_packing.groups import CPMesh, GroupLike, resolve_group
from cp_packing.layouts import check_layout
from cp_packing.labels import local_label_count, next_token_labels, valid_label_mask
from cp_packing.loss import count_step
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids
from cp_packing.padding import PaddedBatch, pad_rows, pad_segments
from cp_packing.sharding import ShardedPackedSeqParams, shard_packed_seq_params

__all__ = [
    "CPBatch",
    "CPCollator",
    "CPDataLoader",
    "CPPackedDataset",
    "ReplicaBatchSampler",
    "ReplicaRank",
    "cp_dataloader",
    "make_cp_batch",
    "num_items_in_batch",
    "pad_for_layout",
    "replica_rank",
    "shard_batch",
]

_CHUNK = 256  # documents read at a time
_STATE_VERSION = 1


# ------------------------------------------------------------------------------------------------ where this rank is


ReplicaRank = CPMesh
"""Compatibility alias: where this process sits in the DP x CP grid is the library's one mesh type,
:class:`cp_packing.groups.CPMesh` (plain ints travel to DataLoader workers; it pickles without its groups)."""


def _check_placement(placement: Any) -> CPMesh:
    if not isinstance(placement, CPMesh):
        raise TypeError(f"placement must be a cp_packing.groups.CPMesh (ReplicaRank), e.g. replica_rank(mesh) or "
                        f"CPMesh.from_ints(...), got {type(placement).__name__}")
    return placement


def replica_rank(
    mesh: Any = None,
    *,
    dp_group: GroupLike = None,
    cp_group: GroupLike = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    cp_rank: int | None = None,
    cp_size: int | None = None,
    dim_names: tuple[str, str] = ("dp", "cp"),
) -> CPMesh:
    """This process's place in the DP x CP grid, from ONE of: a DeviceMesh (or a CPMesh), process groups, or ints.

    Args:
        mesh: a 2-D ``DeviceMesh`` with dims ``dim_names`` (``("dp", "cp")``), a 1-D mesh named ``"cp"`` (one
            replica), or a :class:`~cp_packing.groups.CPMesh` (returned as it is).
        dp_group, cp_group: the data-parallel and context-parallel process groups (or 1-D meshes); ``dp_group=None``
            with a ``cp_group`` means one replica.
        dp_rank, dp_size, cp_rank, cp_size: explicit ints (no torch.distributed needed); ``dp_rank``/``dp_size``
            default to 0/1.
        dim_names: the names of the mesh's data-parallel and context-parallel dims.

    Returns:
        :class:`~cp_packing.groups.CPMesh` (``ReplicaRank`` is an alias of it).

    Raises:
        TypeError: more than one way given, or none; a mesh that is neither a DeviceMesh nor a CPMesh.
        ValueError: a mesh without those dims, ranks out of range.

    >>> replica_rank(dp_rank=1, dp_size=2, cp_rank=0, cp_size=2).global_rank
    2
    """
    ints = (dp_rank, dp_size, cp_rank, cp_size)
    ways = [mesh is not None, dp_group is not None or cp_group is not None, any(x is not None for x in ints)]
    if sum(ways) != 1:
        raise TypeError(
            "replica_rank needs exactly one of: mesh= (a 2-D DeviceMesh ('dp', 'cp')), cp_group= (and dp_group=), "
            f"or cp_rank=/cp_size= (and dp_rank=/dp_size=); got {'none' if not any(ways) else 'several'}"
        )
    if mesh is not None:
        if isinstance(mesh, CPMesh):
            return mesh
        if not (hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "get_local_rank")):
            raise TypeError(f"mesh must be a torch DeviceMesh (dims {dim_names}) or a cp_packing.groups.CPMesh, got "
                            f"{type(mesh).__name__}")
        return CPMesh.from_device_mesh(mesh, dim_names)
    if ways[1]:
        if cp_group is None:
            raise TypeError("dp_group= needs cp_group= too (the CP group of this replica)")
        return CPMesh.from_groups(cp_group, dp_group)
    if cp_rank is None or cp_size is None:
        raise TypeError("explicit ranks need cp_rank= and cp_size= (dp_rank=/dp_size= default to 0/1)")
    return CPMesh.from_ints(dp_rank=0 if dp_rank is None else dp_rank, dp_size=1 if dp_size is None else dp_size,
                            cp_rank=cp_rank, cp_size=cp_size)


# ------------------------------------------------------------------------------------------------ the one CP batch


def pad_for_layout(batch: Mapping[str, torch.Tensor], *, cp_size: int, layout: str,
                   pad_values: Mapping[str, int | float] | None = None,
                   label_keys: Sequence[str] = ("labels",)) -> tuple[dict[str, torch.Tensor], PaddedBatch | None]:
    """A global batch padded so that ``layout`` can shard it over ``cp_size`` ranks (pure; docs/data.md).

    ``"zigzag"`` (``cp_size > 1``): every segment to a multiple of ``2 * cp_size`` (``pad_segments``: the pad tokens
    join their document after its last token); any other layout: every row at its end to a multiple of ``cp_size``
    (``pad_rows``: doc id 0, a segment of its own). Added tokens get ``pad_values[key]``, ``-100`` in ``label_keys``,
    else 0; dtypes are kept.

    Returns:
        ``(padded batch, the zigzag PaddedBatch to undo it, or None)``.

    >>> batch = {"input_ids": torch.arange(5)[None], "doc_ids": torch.tensor([[1, 1, 1, 2, 2]]),
    ...          "labels": torch.tensor([[1, 2, -100, 4, -100]])}
    >>> pad_for_layout(batch, cp_size=2, layout="contiguous")[0]["labels"].tolist()
    [[1, 2, -100, 4, -100, -100]]
    """
    fill = {k: IGNORE_INDEX for k in label_keys if k in batch}
    fill.update({k: v for k, v in (pad_values or {}).items() if k in batch})
    if layout == "zigzag" and cp_size > 1:
        others = {k: v for k, v in batch.items() if k != "doc_ids"}
        padded = pad_segments(batch["doc_ids"], multiple=2 * cp_size, tensors=others, pad_values=fill,
                              label_keys=tuple(k for k in label_keys if k in batch))
        out = {k: padded.doc_ids.to(v.dtype) if k == "doc_ids" else padded.tensors[k] for k, v in batch.items()}
        return out, padded
    return pad_rows(batch, cp_size, fill=fill), None


def shard_batch(batch: Mapping[str, torch.Tensor], params: PackedSeqParams | None = None, *, cp_size: int,
                cp_rank: int, layout: str = "auto", window: Any = None
                ) -> tuple[dict[str, torch.Tensor], ShardedPackedSeqParams]:
    """This rank's local batch and shard of a global batch: the library's one CP batch builder (pure, no
    communication). ``distribute_batch`` (local path), ``make_cp_batch`` / the loader and the trainers call it.

    Args:
        batch: ``name -> [B, S, ...]`` tensors of any dtype (labels shifted on the GLOBAL stream; pad first with
            :func:`pad_for_layout` where the layout needs it).
        params: the batch's ``PackedSeqParams``; ``None``: built from ``batch["doc_ids"]``.
        cp_size, cp_rank, layout, window: as ``shard_packed_seq_params``.

    Returns:
        ``(local, sharded)``: ``local[name] = sharded.shard(batch[name])[None]`` (``[1, T_local, ...]``, same dtype,
        autograd kept) for every key, plus ``"position_ids"`` (int64 ``[1, T_local]``) when the batch has none.

    >>> local, sharded = shard_batch({"input_ids": torch.arange(8)[None], "doc_ids": torch.ones(1, 8, dtype=torch.long)},
    ...                              cp_size=2, cp_rank=1, layout="contiguous")
    >>> local["input_ids"].tolist(), local["position_ids"].tolist()
    ([[4, 5, 6, 7]], [[4, 5, 6, 7]])
    """
    if params is None:
        params = packed_seq_params_from_doc_ids(batch["doc_ids"])
    sharded = shard_packed_seq_params(params, cp_size=cp_size, cp_rank=cp_rank, layout=layout, window=window)
    local = {key: sharded.shard(value).unsqueeze(0) for key, value in batch.items()}  # [1, T_local, ...]
    local.setdefault("position_ids", sharded.position_ids.unsqueeze(0))
    return local, sharded


# ------------------------------------------------------------------------------------------------ one item


@dataclass(frozen=True, eq=False)
class CPBatch:
    """One step's packed batch for one rank: the replica's whole batch and this rank's shard, metadata included.

    Every CP rank of a replica holds the same ``batch`` (so counts over it are per replica, never per rank).

    Attributes:
        step: the step index in the epoch (the same on every rank), or ``None`` from :class:`CPCollator`.
        batch: the replica's ``{"input_ids", "labels", "doc_ids"}``, each ``[rows, seq_len]``; ``labels`` are
            shifted on the global stream (``next_token_labels``), ``doc_ids`` 1-based per row, 0 = padding.
        params: ``packed_seq_params_from_doc_ids(batch["doc_ids"])``.
        sharded: this rank's ``shard_packed_seq_params(params, cp_size=, cp_rank=, layout=)``.
        local: this rank's ``[1, T_local]`` tensors, ``sharded.shard(batch[k])[None]`` for every key, plus
            ``"position_ids"`` (as ``distribute_batch`` returns): ready for ``cp_model_inputs`` and the loss.
        num_valid_labels: the valid (``!= -100``) labels of the replica's batch.
    """

    step: int | None
    batch: dict[str, torch.Tensor]
    params: PackedSeqParams
    sharded: ShardedPackedSeqParams
    local: dict[str, torch.Tensor]
    num_valid_labels: int

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> CPBatch:
        memo: dict[int, torch.Tensor] = {}  # a tensor shared by two fields stays shared

        def f(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in memo:
                memo[id(t)] = fn(t)
            return memo[id(t)]

        def tensors_of(obj: Any, **extra: Any) -> Any:  # a dataclass with every tensor field mapped
            moved = {fl.name: f(getattr(obj, fl.name)) for fl in dataclasses.fields(obj)
                     if isinstance(getattr(obj, fl.name), torch.Tensor)}
            return dataclasses.replace(obj, **moved, **extra)

        params = tensors_of(self.params)
        return CPBatch(self.step, {k: f(v) for k, v in self.batch.items()}, params,
                       tensors_of(self.sharded, global_params=params), {k: f(v) for k, v in self.local.items()},
                       self.num_valid_labels)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> CPBatch:
        """A copy with every tensor on ``device`` (one copy per tensor; a tensor shared by two fields stays
        shared)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> CPBatch:
        """A copy in pinned memory (``DataLoader(pin_memory=True)`` calls it in its pinning thread)."""
        return self._map(lambda t: t.pin_memory())


def _as_batch(batch: Any) -> dict[str, torch.Tensor]:
    if not isinstance(batch, Mapping):
        raise TypeError(f"a packed batch must be a dict with 'input_ids' and 'doc_ids' [rows, seq_len] tensors "
                        f"(what pack_documents yields per replica), got {type(batch).__name__}")
    for key in ("input_ids", "doc_ids"):
        if key not in batch:
            raise ValueError(f"the packed batch has no {key!r} (keys: {sorted(batch)}); pass the dict "
                             "pack_documents yields per replica: input_ids, labels, doc_ids")
    doc_ids = check_tensor(batch["doc_ids"], "batch['doc_ids']", "[rows, seq_len]")
    if doc_ids.dim() != 2:
        raise ValueError(f"batch['doc_ids'] has shape {tuple(doc_ids.shape)}; a packed batch is [rows, seq_len] (one "
                         "flattened row: x.view(1, -1))")
    out = {}
    for key, value in batch.items():
        check_tensor(value, f"batch[{key!r}]", "[rows, seq_len]")
        if value.dtype not in INTEGER_DTYPES:
            raise TypeError(f"batch[{key!r}] must have an integer dtype, got {value.dtype}")
        if tuple(value.shape) != tuple(batch["doc_ids"].shape):
            raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)} but batch['doc_ids'] has "
                             f"{tuple(batch['doc_ids'].shape)}; every tensor of a packed batch is [rows, seq_len]")
        out[key] = value
    return out


def _check_shifted_labels(batch: Mapping[str, torch.Tensor]) -> None:
    """``batch["labels"]`` must be cp-packing's SHIFTED labels: a signed dtype (-100 must fit) and -100 at every
    document's last token and on padding. HF's unshifted labels (a label at every document's last token) are named
    as such. One host sync."""
    labels = batch["labels"]
    if not labels.dtype.is_signed:
        raise TypeError(
            f"batch['labels'] has dtype {labels.dtype}, which cannot hold -100 (the ignored label: it would become "
            f"{IGNORE_INDEX % 2 ** (8 * labels.element_size())}, a class the loss counts); convert with "
            "labels.long() (shifted labels are -100 at every document's last token)"
        )
    doc = batch["doc_ids"].to(torch.int64)  # every integer dtype compares after this (equality is kept)
    nxt = torch.cat([doc[:, 1:], torch.full_like(doc[:, :1], -1)], dim=1)
    ends = (doc == 0) | (doc != nxt)  # padding, and the last token of every segment (row ends included)
    valid = valid_label_mask(labels)  # int64 values, as the loss compares them
    wrong = valid & ends
    hit = wrong.reshape(-1).nonzero()
    if hit.numel() == 0:
        return
    b, t = divmod(int(hit[0, 0]), doc.shape[1])
    where = "on padding (doc id 0)" if int(doc[b, t]) == 0 else "at the last token of its document"
    valid = valid & (doc != 0)
    ids = batch["input_ids"].to(torch.int64)
    if bool(valid.any()) and bool((labels.to(torch.int64)[valid] == ids[valid]).all()):
        raise ValueError(
            f"batch['labels'] look like HF-style UNSHIFTED labels: equal to input_ids at every labelled position, and "
            f"labels[{b}, {t}] = {int(labels[b, t])} is {where}, where shifted labels are -100. cp-packing takes "
            "labels shifted on the global stream: convert them with cp_packing.next_token_labels(input_ids, doc_ids, "
            "labels=hf_labels) (prompt masks kept), or leave 'labels' out to have them built"
        )
    raise ValueError(
        f"batch['labels'][{b}, {t}] is {int(labels[b, t])} {where}; shifted labels are -100 there (a label there "
        "would be a target across a document boundary, or on padding). Build them with "
        "cp_packing.next_token_labels(input_ids, doc_ids, labels=...), or leave 'labels' out to have them built"
    )


def make_cp_batch(batch: Mapping[str, torch.Tensor], *, cp_size: int, cp_rank: int, layout: str = "balanced",
                  step: int | None = None, pad_token_id: int = 0) -> CPBatch:
    """Everything one rank needs for a step, from one replica's packed batch (pure, no communication).

    What the DataLoader workers run; call it yourself on batches from your own pipeline (a collator's flattened
    ``[1, T]`` batch and a doc map from ``cp_packing.formats``: docs/data.md).

    Args:
        batch: ``{"input_ids", "doc_ids"}`` (and ``"labels"``, SHIFTED on the global stream as ``pack_documents``
            yields them; built with ``next_token_labels`` when absent), integer ``[rows, seq_len]`` tensors.
        cp_size, cp_rank: the CP group size and this rank.
        layout: the sharding layout (``"balanced"`` by default; see ``shard_packed_seq_params``).
        step: the step index to record.
        pad_token_id: the input id of the padding added when ``seq_len`` is not a multiple of ``cp_size``.

    Returns:
        :class:`CPBatch`, built by :func:`pad_for_layout` then :func:`shard_batch`. When ``seq_len`` is not a
        multiple of ``cp_size`` every row is first padded at its end to the next multiple (input id
        ``pad_token_id``, doc id 0, label -100; other keys 0): padding is a segment of its own, so no real token
        attends to it and no label counts it; with ``layout="zigzag"`` every document is padded to a multiple of
        ``2 * cp_size`` instead (as CPTrainer does). ``CPBatch.batch`` holds the padded rows.

    Raises:
        TypeError / ValueError: not a dict of integer tensors of one ``[rows, seq_len]`` shape, a missing key; labels
        of an unsigned dtype (-100 does not fit), labels that are not shifted (a label at a document's last token or
        on padding: HF-style unshifted labels are named, with ``cp_packing.next_token_labels`` as the fix); or what
        ``packed_seq_params_from_doc_ids`` / ``shard_packed_seq_params`` raise.

    >>> item = make_cp_batch({"input_ids": torch.arange(8).view(1, 8), "doc_ids": torch.tensor([[1] * 5 + [2] * 3])},
    ...                      cp_size=2, cp_rank=1, layout="contiguous")
    >>> item.local["input_ids"].tolist(), item.num_valid_labels
    ([[4, 5, 6, 7]], 6)
    """
    batch = _as_batch(batch)
    check_int(cp_size, "cp_size", min=1)
    if "labels" not in batch:
        batch["labels"] = next_token_labels(batch["input_ids"], batch["doc_ids"])
    else:
        _check_shifted_labels(batch)
    pad_id = check_int(pad_token_id, "pad_token_id", min=0)
    batch, _ = pad_for_layout(batch, cp_size=cp_size, layout=layout, pad_values={"input_ids": pad_id})
    local, sharded = shard_batch(batch, cp_size=cp_size, cp_rank=cp_rank, layout=layout)
    params = sharded.global_params
    num_valid = int(local_label_count([batch["labels"]]))  # the one count's local part
    return CPBatch(step, batch, params, sharded, local, num_valid)


# ------------------------------------------------------------------------------------------------ documents -> steps


def _is_hf_iterable(source: Any) -> bool:
    return type(source).__module__.startswith("datasets") and hasattr(source, "iter") and hasattr(source, "set_epoch")


def _documents(source: Any, *, shuffle: bool, seed: int, epoch: int) -> Iterator[Any]:
    """The whole document stream of one epoch, the same in every process and worker."""
    if _is_hf_iterable(source):
        # ``iter(batch_size=...)``, not ``iter(source)``: inside a DataLoader worker HF's ``__iter__`` hands each
        # worker only some of the shards, and here every worker must see every document.
        source.set_epoch(epoch)
        for chunk in source.iter(batch_size=_CHUNK):
            columns = list(chunk.values())
            for i in range(len(columns[0]) if columns else 0):
                yield {key: column[i] for key, column in zip(chunk, columns)}
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(source, Mapping):
        n = len(source)
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        many = getattr(source, "__getitems__", None)  # torch's batched-read convention (HF datasets: ~3x faster)
        for start in range(0, n, _CHUNK):
            indices = order[start:start + _CHUNK].tolist()
            yield from (many(indices) if many is not None else (source[i] for i in indices))
    else:
        yield from source


def _document(doc: Any) -> Any:
    """A dict document keeps only what the packer reads (``input_ids`` and, when present, unshifted ``labels``)."""
    if not isinstance(doc, Mapping):
        return doc
    if "input_ids" not in doc:
        raise ValueError(f"a document dict needs 'input_ids' (keys: {sorted(doc)}); tokenize first: the loader "
                         "takes token ids, not text")
    return {key: doc[key] for key in ("input_ids", "labels") if key in doc}


def _default_packer() -> Callable[..., Iterable[Sequence[Mapping[str, torch.Tensor]]]]:
    from cp_packing.packing import pack_documents

    return pack_documents


class CPPackedDataset(IterableDataset):
    """An iterable of :class:`CPBatch`: the documents packed into steps, this replica's batch of each step.

    Every process (and every DataLoader worker) runs the same deterministic packer over the whole document
    stream; replica ``dp_rank`` keeps ``step[dp_rank]``, and worker ``w`` of ``W`` builds the items of the steps
    ``k % W == w`` (the DataLoader interleaves them back in step order: keep ``in_order=True``, its default).

    Args:
        documents: a map-style dataset (HF ``datasets.Dataset``, a list, any ``__len__`` + ``__getitem__``), an HF
            ``datasets.IterableDataset``, or any re-iterable; items are token-id sequences or dicts with
            ``input_ids`` (and optional unshifted, prompt-masked HF ``labels``). Every rank passes the WHOLE
            dataset: not ``split_dataset_by_node``, not a per-worker shard.
        seq_len, rows: each replica's batch is ``[rows, seq_len]`` (the last step may have fewer rows: see the
            packer); ``seq_len`` must be divisible by ``cp_size``.
        placement: this process's :class:`~cp_packing.groups.CPMesh` (``replica_rank(mesh)``).
        layout: the CP layout (``"balanced"`` default).
        shuffle, seed: a map-style dataset is read in a permutation seeded by ``(seed, epoch)`` (else in order);
            an HF ``IterableDataset`` gets ``set_epoch(epoch)`` (its own ``.shuffle(seed=...)`` then reshuffles).
        packer: ``pack_documents``-like callable (default ``cp_packing.packing.pack_documents``), called as
            ``packer(documents, seq_len=, rows=, dp_size=, **pack_kwargs)``; must be deterministic.
        **pack_kwargs: passed to the packer (``long_documents=``, ``buffer_tokens=``, ``seed=``, ...), checked here.
    """

    def __init__(self, documents: Any, *, seq_len: int, rows: int, placement: CPMesh,
                 layout: str = "balanced", shuffle: bool = False, seed: int = 0,
                 packer: Callable[..., Iterable[Sequence[Mapping[str, torch.Tensor]]]] | None = None,
                 **pack_kwargs: Any) -> None:
        _check_placement(placement)
        if isinstance(documents, Iterator):
            raise TypeError("documents is a one-shot iterator (a generator?): every rank and worker must read the "
                            "whole stream, every epoch; pass a list, a datasets.Dataset / IterableDataset, or an "
                            "object whose __iter__ starts over")
        if getattr(documents, "_distributed", None) is not None:  # datasets.distributed.split_dataset_by_node
            raise ValueError("documents was split by node (datasets.distributed.split_dataset_by_node): the loader "
                             "gives each DP replica its share itself, so every rank must read the whole dataset; "
                             "pass the dataset before splitting")
        self.documents = documents
        self.seq_len = check_int(seq_len, "seq_len", min=1)
        self.rows = check_int(rows, "rows", min=1)
        if self.seq_len % placement.cp_size:  # the last step may have fewer rows: every row must divide
            raise ValueError(f"seq_len={self.seq_len} is not divisible by cp_size={placement.cp_size}: each CP rank "
                             "holds 1/cp_size of every step's tokens; pick a seq_len that is a multiple of cp_size")
        self.placement = placement
        self.layout = layout
        self.shuffle = check_bool(shuffle, "shuffle")
        self.seed = check_int(seed, "seed", min=0)
        if layout != "auto":
            check_layout(layout)
        self.packer = packer
        self.pack_kwargs = pack_kwargs
        _check_packer(packer, seq_len=self.seq_len, rows=self.rows, dp_size=placement.dp_size, **pack_kwargs)
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # seen by persistent workers too
        self._start = 0  # the step the next iteration starts at (load_state_dict), consumed by __iter__
        self._next = 0  # what state_dict reports: the start that resumes after the last step this copy yielded

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (a new document order where ``shuffle`` or the dataset shuffles); call it on every rank.
        A new epoch starts at step 0 (the same epoch keeps a loaded state's step)."""
        epoch = check_int(epoch, "epoch", min=0)
        if epoch != self.epoch:
            self._start = self._next = 0
        self._epoch.fill_(epoch)

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def _config(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "rows": self.rows, "dp_size": self.placement.dp_size,
                "shuffle": self.shuffle, "seed": self.seed, "pack_kwargs": repr(sorted(self.pack_kwargs.items())),
                "packer": getattr(self.packer, "__qualname__", repr(self.packer))}

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "next_step", ...}``: where the next iteration starts (torchdata's ``Stateful`` protocol).

        In a ``torchdata.stateful_dataloader.StatefulDataLoader`` worker it is that worker's own position; in the
        main process (``num_workers=0``) the step after the last one yielded. ``cp_dataloader``'s loader keeps its
        own (:meth:`CPDataLoader.state_dict`)."""
        return {"version": _STATE_VERSION, "epoch": self.epoch, "next_step": self._next, "config": self._config()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: set the epoch; the next iteration starts at ``state["next_step"]``
        (each worker re-packs the steps before it without building their tensors). Raises a ValueError when the
        state was saved by a loader with other packing arguments."""
        if not isinstance(state, Mapping) or "next_step" not in state:
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state has version {state.get('version')!r}; this loader reads version {_STATE_VERSION}")
        mine, theirs = self._config(), dict(state.get("config", {}))
        diff = sorted(k for k in mine if theirs.get(k) != mine[k])
        if diff:
            shown = ", ".join(f"{k}={theirs.get(k)!r} (this loader: {mine[k]!r})" for k in diff)
            raise ValueError(f"state was saved by a loader with {shown}; build the loader with the arguments of the "
                             "run you resume")
        self._epoch.fill_(check_int(state["epoch"], "state['epoch']", min=0))
        self._start = self._next = check_int(state["next_step"], "state['next_step']", min=0)

    def steps(self) -> Iterator[Sequence[Mapping[str, torch.Tensor]]]:
        """The packer's steps of this epoch (every replica's batch), identical in every process."""
        packer = self.packer or _default_packer()
        documents = map(_document, _documents(self.documents, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch))
        with warnings.catch_warnings():  # a deprecation was shown once, when the loader was built
            warnings.simplefilter("ignore", FutureWarning)
            return iter(packer(documents, seq_len=self.seq_len, rows=self.rows, dp_size=self.placement.dp_size,
                               **self.pack_kwargs))

    def __iter__(self) -> Iterator[CPBatch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        start, self._start = self._start, 0  # read now (not at the first next()): a resumed start is used once
        self._next = start
        return self._items(start + worker, workers, worker)

    def _items(self, first: int, stride: int, worker: int) -> Iterator[CPBatch]:
        """This copy's items: steps ``first, first + stride, ...``; the other steps are skipped (the default packer
        does not build their tensors)."""
        p = self.placement
        for step, replicas in _every(self.steps(), first, stride):
            if len(replicas) != p.dp_size:
                raise ValueError(f"the packer gave step {step} {len(replicas)} replica batches; expected dp_size="
                                 f"{p.dp_size}")
            item = make_cp_batch(replicas[p.dp_rank], cp_size=p.cp_size, cp_rank=p.cp_rank, layout=self.layout,
                                 step=step)
            self._next = step + stride - worker
            yield item


def _every(steps: Iterator[Any], first: int, stride: int) -> Iterator[tuple[int, Any]]:
    """``(k, steps[k])`` for ``k = first, first + stride, ...``; ``DocumentPacker.skip`` passes over the others."""
    skip = getattr(steps, "skip", None)
    if skip is None:
        for k, step in enumerate(steps):
            if k >= first and (k - first) % stride == 0:
                yield k, step
        return
    k = first
    if skip(first) < first:
        return
    for step in steps:
        yield k, step
        k += stride
        if skip(stride - 1) < stride - 1:
            return


def _check_packer(packer: Any, **arguments: Any) -> None:
    """The packer's arguments checked in the main process, when the loader is built (not at the first batch inside
    a worker): the default packer is built over no documents (it reads nothing), another is bound to them."""
    try:
        if packer is None:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", FutureWarning)
                _default_packer()((), **arguments)
            for w in caught:  # shown once, pointing at the caller of cp_dataloader / CPPackedDataset
                warnings.warn(w.message, w.category, stacklevel=4)
            return
        if not callable(packer):
            raise TypeError(f"packer must be a callable like cp_packing.pack_documents, got {type(packer).__name__}")
        try:
            signature = inspect.signature(packer)
        except (TypeError, ValueError):  # no signature to check (a builtin)
            return
        signature.bind((), **arguments)
    except (TypeError, ValueError) as exc:
        extra = sorted(set(arguments) - {"seq_len", "rows", "dp_size"})
        raise type(exc)(f"the packer's arguments (seq_len, rows, dp_size and cp_dataloader's extra keyword arguments "
                        f"{extra}) are refused: {exc}") from None


class CPDataLoader(DataLoader):
    """The ``DataLoader`` :func:`cp_dataloader` returns: items are :class:`CPBatch` in step order, and it is
    resumable (torchdata's ``Stateful`` protocol, also for ``torch.distributed.checkpoint``): :meth:`state_dict`
    after ``k`` steps, then :meth:`load_state_dict` on a new loader built with the same arguments, gives the steps
    the uninterrupted run would have given, whatever ``num_workers`` is (docs/data.md)."""

    def __init__(self, dataset: CPPackedDataset, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=None, in_order=True, **kwargs)
        self._position: tuple[int, int] | None = None  # (epoch, next step) of the steps handed out

    def __iter__(self) -> Iterator[CPBatch]:
        epoch, start = self.dataset.epoch, self.dataset._start
        self._position = (epoch, start)
        items = super().__iter__()  # workers copy the dataset (and its start) now
        self.dataset._start = 0
        return self._track(items, epoch)

    def _track(self, items: Iterator[CPBatch], epoch: int) -> Iterator[CPBatch]:
        for item in items:
            self._position = (epoch, item.step + 1)
            yield item

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "next_step", ...}``: the epoch and the step after the last one this loader handed out (step 0
        of the dataset's epoch once ``set_epoch`` moved on). Small: no tokens, no packer state."""
        state = self.dataset.state_dict()
        epoch, step = self._position if self._position is not None else (state["epoch"], self.dataset._start)
        if epoch != self.dataset.epoch:
            epoch, step = self.dataset.epoch, 0
        return {**state, "epoch": epoch, "next_step": step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where :meth:`state_dict` was taken: the next iteration starts at its step of its epoch (call it
        before iterating; ``set_epoch`` with the same epoch keeps it). Persistent workers are restarted."""
        self.dataset.load_state_dict(state)
        self._position = (self.dataset.epoch, self.dataset._start)
        self._iterator = None  # persistent workers hold the old start: new ones copy the dataset again


def cp_dataloader(
    documents: Any,
    *,
    seq_len: int,
    rows: int,
    mesh: Any = None,
    dp_group: GroupLike = None,
    cp_group: GroupLike = None,
    placement: CPMesh | None = None,
    layout: str = "balanced",
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    packer: Callable[..., Iterable[Sequence[Mapping[str, torch.Tensor]]]] | None = None,
    **pack_kwargs: Any,
) -> CPDataLoader:
    """A resumable ``DataLoader`` of :class:`CPBatch` for this rank of a DP x CP grid (see :class:`CPPackedDataset`).

    Every argument is checked here, in the main process (the packer's too: a misspelled keyword is a TypeError now,
    not at the first batch inside a worker).

    Args:
        documents, seq_len, rows, layout, shuffle, seed, packer, pack_kwargs: as :class:`CPPackedDataset`.
        mesh, dp_group, cp_group, placement: where this rank is (one of them; see :func:`replica_rank`; ``mesh`` may
            be a :class:`~cp_packing.groups.CPMesh`).
        num_workers, pin_memory, prefetch_factor, persistent_workers: as ``torch.utils.data.DataLoader``; the
            metadata is computed in the workers when ``num_workers > 0``.

    Returns:
        :class:`CPDataLoader` (``batch_size=None``: each item is one step's :class:`CPBatch`);
        ``loader.dataset.set_epoch(e)`` before each epoch; ``state_dict()`` / ``load_state_dict()`` to resume.
    """
    if placement is None:
        placement = replica_rank(mesh, dp_group=dp_group, cp_group=cp_group)
    elif mesh is not None or dp_group is not None or cp_group is not None:
        raise TypeError("pass placement= or mesh= / groups, not both")
    dataset = CPPackedDataset(documents, seq_len=seq_len, rows=rows, placement=placement, layout=layout,
                              shuffle=shuffle, seed=seed, packer=packer, **pack_kwargs)
    num_workers = check_int(num_workers, "num_workers", min=0)
    extra = {} if num_workers == 0 else {"prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers}
    return CPDataLoader(dataset, num_workers=num_workers, pin_memory=pin_memory, **extra)


# ------------------------------------------------------------------------------------------------ pre-packed rows


def _num_rows(num_rows: Any) -> int:
    """The dataset's length: an int (NumPy ints too), or ``len`` of a dataset."""
    if is_int(num_rows):
        return int(num_rows)
    if isinstance(num_rows, (str, bytes, float, bool)) or num_rows is None or not hasattr(num_rows, "__len__"):
        raise TypeError(f"num_rows must be the number of packed rows (an int) or the dataset itself, got {num_rows!r} "
                        f"({type(num_rows).__name__}); pass len(dataset)")
    return len(num_rows)


class ReplicaBatchSampler(Sampler):
    """The row indices of this replica's batch at every step, for a map-style dataset of already-packed rows.

    Step ``k`` takes rows ``k * rows * dp_size ...`` of the order (a ``(seed, epoch)`` permutation with
    ``shuffle``) and splits them among the replicas in rank order; the last step's remainder is split as evenly as
    possible, so a replica may get fewer rows, or none (then :class:`CPCollator` gives it one all-padding row):
    every row is used exactly once per epoch and every replica runs the same number of steps. The CP ranks of a
    replica get the same indices (they depend on ``dp_rank``, ``seed`` and the epoch only).

    Args:
        num_rows: the dataset's length (an int, NumPy ints too) or the dataset itself.
        rows: rows per replica per step.
        placement: this process's :class:`~cp_packing.groups.CPMesh`.
        shuffle, seed: a seeded permutation per epoch (``set_epoch``) instead of the dataset's order.
    """

    def __init__(self, num_rows: Any, *, rows: int, placement: CPMesh, shuffle: bool = False,
                 seed: int = 0) -> None:
        self.num_rows = check_int(_num_rows(num_rows), "num_rows", min=0)
        self.rows = check_int(rows, "rows", min=1)
        _check_placement(placement)
        self.placement = placement
        self.shuffle = check_bool(shuffle, "shuffle")
        self.seed = check_int(seed, "seed", min=0)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_int(epoch, "epoch", min=0)

    def __len__(self) -> int:
        return math.ceil(self.num_rows / (self.rows * self.placement.dp_size))

    def __iter__(self) -> Iterator[list[int]]:
        n, per_step = self.num_rows, self.rows * self.placement.dp_size
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle else np.arange(n)
        for start in range(0, n, per_step):
            share = np.array_split(order[start:start + per_step], self.placement.dp_size)[self.placement.dp_rank]
            yield share.tolist()


def _row_tensor(row: Mapping[str, Any], key: str, i: int) -> torch.Tensor:
    """``row[key]`` as an int64 ``[seq_len]`` tensor, or a TypeError / ValueError naming row ``i`` and ``key``."""
    value = row[key]
    if isinstance(value, (str, bytes)):
        raise TypeError(f"row {i}[{key!r}] is a string ({value[:20]!r}...); packed rows hold token ids: tokenize first")
    try:
        x = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"row {i}[{key!r}] is not a flat sequence of ints ({type(value).__name__}: ragged, nested or "
                         f"not numbers; torch says: {exc}); every key of a packed row is one [seq_len] sequence"
                         ) from None
    if x.dim() != 1 or (x.numel() and x.dtype not in INTEGER_DTYPES and x.dtype != torch.bool):
        raise ValueError(f"row {i}[{key!r}] must be a 1-D integer sequence [seq_len], got {x.dtype} "
                         f"{tuple(x.shape)}")
    if key == "labels" and not x.dtype.is_signed and x.dtype != torch.bool:
        raise TypeError(f"row {i}['labels'] has dtype {x.dtype}, which cannot hold -100 (the ignored label); store "
                        "labels in a signed dtype (int64)")
    return x.to(torch.int64)


class CPCollator:
    """``collate_fn`` for already-packed rows: a list of rows -> this rank's :class:`CPBatch` (in the workers).

    A row is a dict with ``input_ids`` ``[seq_len]`` and the document structure as ``doc_ids`` (1-based per row,
    0 = padding) or ``position_ids`` restarting at 0 per document (with an optional 0/1 ``attention_mask``; see
    ``doc_ids_from_position_ids``); optional ``labels`` are cp-packing's SHIFTED labels (built with
    ``next_token_labels`` when absent). An empty list (a replica with no row left at the end of an epoch, see
    :class:`ReplicaBatchSampler`) gives one all-padding row, so every replica still runs the step.

    Args:
        placement: this process's :class:`~cp_packing.groups.CPMesh`.
        seq_len: the row length (checked; needed for the all-padding row).
        layout: the CP layout.
        pad_token_id: the input id of the all-padding row.
    """

    def __init__(self, placement: CPMesh, *, seq_len: int, layout: str = "balanced", pad_token_id: int = 0):
        _check_placement(placement)
        self.placement = placement
        self.seq_len = check_int(seq_len, "seq_len", min=1)
        self.layout = layout
        self.pad_token_id = check_int(pad_token_id, "pad_token_id", min=0)

    @staticmethod
    def _keys(rows: Sequence[Mapping[str, Any]]) -> list[str]:
        """The keys the collator reads, the same in every row (or a TypeError / ValueError naming the row)."""
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise TypeError(f"row {i} must be a dict with 'input_ids' and 'doc_ids' (or 'position_ids'), got "
                                f"{type(row).__name__}" + ("; tokenize first" if isinstance(row, (str, bytes)) else ""))
            if "input_ids" not in row or not ("doc_ids" in row or "position_ids" in row):
                raise ValueError(f"row {i} must be a dict with 'input_ids' and 'doc_ids' (or 'position_ids'), got "
                                 f"{sorted(row, key=str)}")
        keys = ["input_ids", "doc_ids" if "doc_ids" in rows[0] else "position_ids"]
        keys += [k for k in ("labels", "attention_mask") if k in rows[0]]
        wanted = set(keys)
        for i, row in enumerate(rows):
            read = {k for k in ("input_ids", "doc_ids", "position_ids", "labels", "attention_mask") if k in row}
            if not wanted <= read or (read - wanted) & {"labels", "attention_mask"}:
                missing, extra = sorted(wanted - read), sorted((read - wanted) & {"labels", "attention_mask"})
                raise ValueError(f"row {i} has keys {sorted(read)} but row 0 has {sorted(wanted)} (missing "
                                 f"{missing or 'none'}, extra {extra or 'none'}); every row of a batch needs the "
                                 "same keys")
        return keys

    def _rows(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
            raise TypeError(f"CPCollator takes a list of rows (dicts), got {type(rows).__name__}; use it as the "
                            "DataLoader's collate_fn with a batch_sampler (ReplicaBatchSampler)")
        if len(rows) == 0:
            shape = (1, self.seq_len)
            return {"input_ids": torch.full(shape, self.pad_token_id, dtype=torch.int64),
                    "doc_ids": torch.zeros(shape, dtype=torch.int64),
                    "labels": torch.full(shape, IGNORE_INDEX, dtype=torch.int64)}
        keys = self._keys(rows)
        out = {}
        for key in keys:
            parts = [_row_tensor(row, key, i) for i, row in enumerate(rows)]
            for i, x in enumerate(parts):
                if x.numel() != self.seq_len:
                    raise ValueError(f"row {i}[{key!r}] has {x.numel()} tokens; every packed row must have seq_len="
                                     f"{self.seq_len}")
            out[key] = torch.stack(parts)
        if "doc_ids" not in out:
            positions = out.pop("position_ids")
            out["doc_ids"] = doc_ids_from_position_ids(positions, attention_mask=out.get("attention_mask"))
        out.pop("attention_mask", None)
        return out

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> CPBatch:
        p = self.placement
        return make_cp_batch(self._rows(rows), cp_size=p.cp_size, cp_rank=p.cp_rank, layout=self.layout)


# ------------------------------------------------------------------------------------------------ gradient accumulation


def num_items_in_batch(batches: Sequence[CPBatch], *, dp_group: GroupLike = None) -> int:
    """The valid labels of one optimizer step: over its micro-batches and every DP replica (HF's
    ``num_items_in_batch``), for ``packed_cross_entropy(..., num_items_in_batch=N)``.

    ``cp_packing.count_valid_labels`` (the one count) of the items' ``batch["labels"]``: every CP rank of a replica
    holds the replica's whole batch, so the count is all-reduced over ``dp_group`` only: never over the CP group,
    which would count each label ``cp_size`` times. Every rank of ``dp_group`` must call it (CP peers may too: each
    reduces over its own DP group). Starts with one ``agree`` over ``dp_group``: every replica must be at the same
    steps (a ``DataLoader(in_order=False)`` would mix them up).

    Args:
        batches: this rank's :class:`CPBatch` of every micro-batch of the step.
        dp_group: the data-parallel group (``mesh["dp"]``); ``None``: one replica, no communication.

    Returns:
        int, the same on every rank.

    >>> item = make_cp_batch({"input_ids": torch.arange(6).view(1, 6), "doc_ids": torch.tensor([[1, 1, 1, 2, 2, 0]])},
    ...                      cp_size=1, cp_rank=0)
    >>> num_items_in_batch([item, item])
    6
    """
    dp = resolve_group(dp_group, name="dp_group", optional=True)
    error, labels, steps = None, None, None
    if not isinstance(batches, (list, tuple)) or not batches or not all(isinstance(b, CPBatch) for b in batches):
        error = TypeError("batches must be a non-empty list of CPBatch (the loader's items of the step's "
                          "micro-batches)")
    else:
        labels, steps = [b.batch["labels"] for b in batches], [b.step for b in batches]
    # whole batches on every CP rank: counted over DP only; the same steps on every replica (a DataLoader with
    # in_order=False would mix them up)
    return int(count_step(labels, ignore_index=IGNORE_INDEX, cp=None, dp=dp, call="num_items_in_batch", error=error,
                           dp_fields={"steps of the micro-batches": steps})[0])
