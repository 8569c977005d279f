"""HF ``Trainer`` (and TRL ``SFTTrainer``) with context parallelism: :class:`CPTrainer`, :class:`CPSFTTrainer`.

``CPTrainer(model=..., args=..., train_dataset=..., cp_size=2)`` is a ``transformers.Trainer`` that does the CP
glue (docs/trainer.md has the whole script and what each step does):

* a DP x CP ``DeviceMesh`` ``("dp", "cp")`` from the world (consecutive ranks form a CP group);
* the model runs cp_packing's attention (registered, and set on the model when it runs another implementation),
  guarded by :func:`cp_packing.hf.check_cp_model`;
* a DataLoader whose sampler splits the dataset over the DP replicas only, so every CP rank of a replica collates
  the same packed batch (no scatter); the collator turns the batch into the global ``input_ids`` / ``doc_ids`` /
  ``shift_labels`` (:func:`cp_batch`), padded for the CP layout;
* each step shards that batch locally (``shard_packed_seq_params``), runs the model on this rank's tokens and takes
  the cross-entropy SUM of its labels over ``num_items_in_batch``: the valid labels of the whole optimizer step
  (every micro-batch of gradient accumulation, every DP replica, counted once per replica);
* DDP (which the Trainer / accelerate wraps the model in when the world has more than one rank) AVERAGES gradients
  over the world; the loss is multiplied by the world size, so the reduced gradient is the SUM of every rank's
  share: exactly the gradient of the whole step's mean loss (the factor HF's own ``Trainer.compute_loss`` applies
  with ``average_tokens_across_devices``). FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``:
  accelerate's ``fully_shard`` over the whole world) averages over its mesh the same way and gets the same factor
  (its mesh must span the DP x CP world and keep FSDP2's default divisor; else NotImplementedError). Under FSDP2
  every forward gathers the full parameters, which the CP attention and loss need.

Labels: a batch's ``labels`` are HF's (unshifted: ``labels[t]`` is the token at ``t`` or -100; the shift happens
here, on the global stream, inside each document); ``shift_labels`` are already shifted (cp-packing's
``next_token_labels`` convention, HF's name for it). No labels: every next token inside a document.

Not supported (a clear error): FSDP1, evaluation (``evaluate``/``predict``), an iterable dataset with
more than one DP replica.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from cp_packing._checks import check_choice, check_int
from cp_packing.formats import doc_ids_from_position_ids
from cp_packing.groups import device_for_backend
from cp_packing.hf import (
    check_cp_model,
    check_transformers_version,
    cp_model_inputs,
    model_windows,
    register_cp_attention,
)
from cp_packing.layouts import LAYOUTS
from cp_packing.loss import next_token_labels, packed_cross_entropy
from cp_packing.packed_seq import packed_seq_params_from_doc_ids
from cp_packing.padding import pad_rows, pad_segments
from cp_packing.sharding import shard_packed_seq_params

check_transformers_version()
from transformers import Trainer  # noqa: E402 - after the version check

__all__ = ["CPMesh", "CPTrainer", "CPTrainerMixin", "cp_batch", "cp_mesh_from_world"]

logger = logging.getLogger("cp_packing")

IGNORE_INDEX = -100
_LAYOUT_CHOICES = (*LAYOUTS, "auto")
_BATCH_KEYS = ("input_ids", "doc_ids", "shift_labels")
# Columns a datasets.Dataset keeps for the collator (Trainer drops the columns model.forward does not name).
_DATA_COLUMNS = ("input_ids", "doc_ids", "labels", "shift_labels", "position_ids", "attention_mask", "seq_lengths")


# ------------------------------------------------------------------------------------------------- the batch


def _as_2d(x: Any, name: str) -> torch.Tensor:
    x = torch.as_tensor(x)
    if x.dim() == 1:
        x = x[None]
    if x.dim() != 2:
        raise ValueError(f"batch[{name!r}] has shape {tuple(x.shape)}; expected [B, S] (or [S] for one row)")
    return x


def _doc_map(batch: Mapping[str, Any], input_ids: torch.Tensor) -> torch.Tensor:
    """The ``[B, S]`` doc map from ``doc_ids``, else ``position_ids`` (restarting at 0 per document: TRL padding-free,
    ``DataCollatorWithFlattening``), else ``attention_mask`` (one document per row), else one document per row."""
    mask = batch.get("attention_mask")
    mask = None if mask is None else _as_2d(mask, "attention_mask")
    if batch.get("doc_ids") is not None:
        doc = _as_2d(batch["doc_ids"], "doc_ids")
    elif batch.get("position_ids") is not None:
        doc = doc_ids_from_position_ids(_as_2d(batch["position_ids"], "position_ids"), attention_mask=mask)
    elif mask is not None:
        if mask.dim() != 2 or mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}; "
                             "pass a 2-D padding mask (or doc_ids / position_ids for packed rows)")
        doc = (mask != 0).to(torch.int64)
    else:
        doc = torch.ones_like(input_ids, dtype=torch.int64)
    if doc.shape != input_ids.shape:
        raise ValueError(f"the doc map has shape {tuple(doc.shape)} but input_ids {tuple(input_ids.shape)}; both are "
                         "the global [B, S] batch")
    return doc.to(torch.int64)


def _shifted_labels(batch: Mapping[str, Any], input_ids: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    if batch.get("shift_labels") is not None:
        labels = _as_2d(batch["shift_labels"], "shift_labels").to(torch.int64)
        if labels.shape != input_ids.shape:
            raise ValueError(f"shift_labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
        return labels.masked_fill(doc == 0, IGNORE_INDEX)
    if batch.get("labels") is None:
        return next_token_labels(input_ids, doc)
    labels = _as_2d(batch["labels"], "labels").to(torch.int64)
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
    # HF's unshifted labels are the token itself or -100. Anything else is most likely labels shifted already (e.g.
    # cp_packing.pack_documents' "labels"): shifting them again would train the token after next, silently.
    wrong = (labels != IGNORE_INDEX) & (labels != input_ids) & (doc != 0)
    if bool(wrong.any()):
        b, s = (int(i) for i in wrong.nonzero()[0])
        raise ValueError(
            f"batch['labels'][{b}, {s}] = {int(labels[b, s])} but input_ids[{b}, {s}] = {int(input_ids[b, s])}: "
            "'labels' are HF's UNSHIFTED labels (the token itself or -100; the shift happens in the loss). Labels "
            "already shifted (cp_packing.next_token_labels / pack_documents) go under 'shift_labels'"
        )
    return next_token_labels(labels, doc)  # target at t = labels[t + 1] inside the document, -100 kept


def cp_batch(batch: Mapping[str, Any], *, cp_size: int = 1, layout: str = "auto") -> dict[str, torch.Tensor]:
    """A collated batch in any of HF's packed formats -> the global CP batch ``{input_ids, doc_ids, shift_labels}``.

    Reads the document map from ``doc_ids`` (1-based per row, 0 = padding), else ``position_ids`` restarting at 0
    in every document (TRL's padding-free collator, HF ``DataCollatorWithFlattening``), else a 2-D
    ``attention_mask`` (one document per row), else one document per row. Labels: ``shift_labels`` (already
    shifted), else HF's unshifted ``labels`` (the token or -100, e.g. prompt-masked; shifted here inside each
    document), else every next token of the document. Then pads so the CP layout fits: rows grow at their tail to a
    multiple of ``cp_size`` (doc 0, label -100), or for ``layout="zigzag"`` every segment to a multiple of
    ``2 * cp_size`` (``pad_segments``). The result never carries an attention mask.

    Args:
        batch: a dict with ``input_ids`` ``[B, S]`` (or ``[S]``) and the optional keys above.
        cp_size: the CP group size.
        layout: the CP layout the batch will be sharded with (``"auto"``, ``"contiguous"``, ``"balanced"``,
            ``"zigzag"``).

    Returns:
        int64 ``{"input_ids": [B, S'], "doc_ids": [B, S'], "shift_labels": [B, S']}``.

    Raises:
        ValueError: missing ``input_ids``, shapes that differ, ``labels`` that are not HF's unshifted labels (a
        valid label that is not the token at its position: pass shifted labels as ``shift_labels``), or what the
        doc-map converter refuses.

    >>> out = cp_batch({"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])},
    ...                cp_size=2, layout="contiguous")
    >>> out["doc_ids"].tolist(), out["shift_labels"].tolist()
    ([[1, 1, 1, 2, 2, 0]], [[6, 7, -100, 9, -100, -100]])
    """
    cp_size = check_int(cp_size, "cp_size", min=1)
    layout = check_choice(layout, "layout", _LAYOUT_CHOICES)
    if not isinstance(batch, Mapping) or batch.get("input_ids") is None:
        raise ValueError(f"the batch must be a dict with 'input_ids', got {type(batch).__name__} "
                         f"{sorted(batch) if isinstance(batch, Mapping) else ''}")
    input_ids = _as_2d(batch["input_ids"], "input_ids").to(torch.int64)
    doc = _doc_map(batch, input_ids)
    labels = _shifted_labels(batch, input_ids, doc)
    if layout == "zigzag" and cp_size > 1:
        padded = pad_segments(doc, multiple=2 * cp_size, tensors={"input_ids": input_ids, "shift_labels": labels},
                              label_keys=("shift_labels",))
        return {"input_ids": padded.tensors["input_ids"], "doc_ids": padded.doc_ids.to(torch.int64),
                "shift_labels": padded.tensors["shift_labels"]}
    return pad_rows({"input_ids": input_ids, "doc_ids": doc, "shift_labels": labels}, cp_size,
                    fill={"shift_labels": IGNORE_INDEX})  # the tail: doc 0, input 0, label -100


@dataclass
class _CPCollator:
    """The Trainer's collator, then :func:`cp_batch` (runs in the DataLoader workers; picklable)."""

    inner: Callable[[list], Mapping[str, Any]]
    cp_size: int
    layout: str

    def __call__(self, features: list) -> dict[str, torch.Tensor]:
        return cp_batch(self.inner(features), cp_size=self.cp_size, layout=self.layout)


class _EpochDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches its sampler (the Trainer calls it every epoch)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


# -------------------------------------------------------------------------------------------------- the mesh


@dataclass(frozen=True)
class CPMesh:
    """This process's place in a DP x CP world.

    Attributes:
        cp_size, dp_size: the group sizes (``cp_size * dp_size`` = world size).
        cp_rank, dp_rank: this rank in its CP group / among the DP replicas (global rank = ``dp_rank * cp_size +
            cp_rank``).
        cp_group, dp_group: the ProcessGroups (``None`` in a one-process world).
        mesh: the 2-D ``DeviceMesh`` ``("dp", "cp")`` (``None`` in a one-process world).
    """

    cp_size: int
    dp_size: int
    cp_rank: int
    dp_rank: int
    cp_group: Any = None
    dp_group: Any = None
    mesh: Any = None


def cp_mesh_from_world(cp_size: int) -> CPMesh:
    """The DP x CP mesh of the initialised world (``init_device_mesh``; consecutive global ranks form a CP group).

    Args:
        cp_size: the CP group size; the world size must be a multiple of it.

    Returns:
        :class:`CPMesh`; without an initialised process group, the one-process mesh (``cp_size`` must be 1).

    Raises:
        ValueError: the world size is not a multiple of ``cp_size``, or ``cp_size > 1`` without a process group.
    """
    cp_size = check_int(cp_size, "cp_size", min=1)
    if not (dist.is_available() and dist.is_initialized()):
        if cp_size > 1:
            raise ValueError(f"cp_size={cp_size} needs a process group of a multiple of {cp_size} ranks; launch with "
                             f"torchrun --nproc-per-node {cp_size} (or more)")
        return CPMesh(cp_size=1, dp_size=1, cp_rank=0, dp_rank=0)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp_size:
        raise ValueError(f"the world has {world} ranks, not a multiple of cp_size={cp_size}; pick a cp_size that "
                         f"divides {world}")
    dp_size = world // cp_size
    if world == 1:
        return CPMesh(cp_size=1, dp_size=1, cp_rank=0, dp_rank=0)
    from torch.distributed.device_mesh import init_device_mesh

    device = device_for_backend(str(dist.get_backend()))
    mesh = init_device_mesh(device.type, (dp_size, cp_size), mesh_dim_names=("dp", "cp"))
    return CPMesh(cp_size=cp_size, dp_size=dp_size, cp_rank=rank % cp_size, dp_rank=rank // cp_size,
                  cp_group=mesh["cp"].get_group(), dp_group=mesh["dp"].get_group(), mesh=mesh)


# ----------------------------------------------------------------------------------------------- the trainer


class CPTrainerMixin:
    """The CP part of :class:`CPTrainer`, for any ``transformers.Trainer`` subclass (``class X(CPTrainerMixin,
    SomeTrainer)``): the mesh, the attention, the data split, the loss and the DDP / FSDP2 factor (module docstring)."""

    def __init__(self, *args: Any, cp_size: int = 1, layout: str = "auto", backend: str = "auto",
                 kernel: str = "auto", ulysses_size: int | None = None, **kwargs: Any) -> None:
        self.cp_size = check_int(cp_size, "cp_size", min=1)
        self.cp_layout = check_choice(layout, "layout", _LAYOUT_CHOICES)
        self.cp_backend, self.cp_kernel, self.cp_ulysses_size = backend, kernel, ulysses_size
        super().__init__(*args, **kwargs)  # builds the Accelerator: the process group exists after this
        if getattr(self, "is_fsdp_enabled", False) and not getattr(self.accelerator, "is_fsdp2", False):
            raise NotImplementedError(
                "CPTrainer supports FSDP2 through accelerate, not FSDP1: pass fsdp_config={'version': 2} "
                "(its gradient reduction is compensated here; FSDP1's is not)"
            )
        if getattr(self.args, "fsdp_plugin_args", None) is not None and not getattr(self, "is_fsdp_enabled", False):
            # accelerate (1.15, AcceleratorState.__init__) enables FSDP only for GPU-like distributed types: on
            # MULTI_CPU it drops the plugin and the Trainer wraps the model in DDP (correct, but not sharded)
            logger.warning("CPTrainer: FSDP was requested but accelerate runs %s without it (it enables FSDP on "
                           "accelerators only); training with DDP instead", self.accelerator.distributed_type)
        self.cp_mesh = cp_mesh_from_world(self.cp_size)
        world = self.cp_mesh.cp_size * self.cp_mesh.dp_size
        if self.accelerator.num_processes != world:
            raise ValueError(
                f"the process group has {world} ranks but accelerate runs {self.accelerator.num_processes} "
                f"process(es) ({self.accelerator.distributed_type}), so the Trainer would not wrap the model in DDP "
                "and nothing would reduce the CP ranks' gradients; on a machine without GPUs pass "
                "TrainingArguments(use_cpu=True), and launch with torchrun"
            )
        self._use_cp_attention()
        self.loss_is_scaled_for_ga = True  # compute_loss divides by the whole step's count (num_items_in_batch)
        self.model_accepts_loss_kwargs = True  # so the Trainer counts num_items_in_batch (our override below)
        self.data_collator = _CPCollator(self.data_collator, self.cp_size, self.cp_layout)

    def _use_cp_attention(self) -> None:
        name = register_cp_attention()
        model = self.model
        current = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if current != name:
            logger.warning("CPTrainer: switching the model's attention implementation from %r to %r (models built "
                           "from the same config object switch too: give each model copy.deepcopy(config))",
                           current, name)
            model.set_attn_implementation(name)
        check_cp_model(model)

    # ---- data: every CP rank of a DP replica collates the same batch

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *_DATA_COLUMNS]))

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        dataset, args, mesh = self.train_dataset, self.args, self.cp_mesh
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        if isinstance(dataset, IterableDataset):
            if mesh.dp_size > 1:
                raise NotImplementedError(
                    f"CPTrainer splits a map-style dataset over the {mesh.dp_size} DP replicas; an iterable dataset "
                    "would reach every rank whole. Use a map-style dataset, or one DP replica (world = cp_size)"
                )
            sampler = None
        else:
            seed = args.data_seed if args.data_seed is not None else args.seed
            sampler = DistributedSampler(dataset, num_replicas=mesh.dp_size, rank=mesh.dp_rank, shuffle=True,
                                         seed=seed, drop_last=args.dataloader_drop_last)
        params = {"batch_size": self._train_batch_size, "collate_fn": self.data_collator,
                  "num_workers": args.dataloader_num_workers, "pin_memory": args.dataloader_pin_memory,
                  "persistent_workers": args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
                  "drop_last": args.dataloader_drop_last}
        if args.dataloader_num_workers > 0:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
        return _EpochDataLoader(dataset, sampler=sampler, **params)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        raise NotImplementedError("CPTrainer does not evaluate yet; evaluate with a separate non-CP model or loop")

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        raise NotImplementedError("CPTrainer does not predict yet; predict with a separate non-CP model or loop")

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """The valid labels of the whole optimizer step: every micro-batch, every DP replica (each replica's batch
        counted once, although all its CP ranks hold it)."""
        if not batch_samples:
            return None
        count = sum(int((b["shift_labels"] != IGNORE_INDEX).sum()) for b in batch_samples)
        count = torch.tensor([count], dtype=torch.int64)
        if self.cp_mesh.dp_group is not None and self.cp_mesh.dp_size > 1:
            count = count.to(device_for_backend(str(dist.get_backend(self.cp_mesh.dp_group))))
            dist.all_reduce(count, group=self.cp_mesh.dp_group)
        return count[0].to(device)

    # ---- the step

    def _gradient_average_factor(self, model: torch.nn.Module) -> int:
        """The number of ranks the wrapper averages gradients over (1 without a wrapper in a one-process world):
        DDP's process group, or FSDP2's mesh (``fully_shard`` averages over every rank of its mesh by default)."""
        world = self.cp_mesh.cp_size * self.cp_mesh.dp_size
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return dist.get_world_size(model.process_group)
        if _is_fsdp2(model):
            return _fsdp2_average_factor(model, world)
        if world > 1 and torch.is_grad_enabled():
            raise RuntimeError(
                f"CPTrainer runs on {world} ranks but the model is not wrapped in DistributedDataParallel or FSDP2 "
                f"({type(model).__name__}): nothing would reduce the CP ranks' gradient shares"
            )
        return 1

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """This rank's share of the step's loss: CE SUM of its tokens / ``num_items_in_batch``, times the number of
        ranks DDP / FSDP2 average the gradients over.

        ``inputs`` is the global batch of this DP replica (the same on every CP rank); sharded here, locally.
        """
        factor = self._gradient_average_factor(model)  # checked before any collective
        if any(key not in inputs for key in _BATCH_KEYS):
            inputs = cp_batch(inputs, cp_size=self.cp_size, layout=self.cp_layout)
        mesh = self.cp_mesh
        doc, input_ids, labels = (inputs[key] for key in ("doc_ids", "input_ids", "shift_labels"))
        params = packed_seq_params_from_doc_ids(doc)
        windows = model_windows(model)  # sliding layers: plan the windowed cost
        sharded = shard_packed_seq_params(params, cp_size=mesh.cp_size, cp_rank=mesh.cp_rank, layout=self.cp_layout,
                                          window=windows)
        model_inputs = cp_model_inputs(sharded.shard(input_ids), sharded, group=mesh.cp_group,
                                       backend=self.cp_backend, kernel=self.cp_kernel,
                                       ulysses_size=self.cp_ulysses_size, model=model)
        outputs = model(**model_inputs)
        logits = outputs.logits[0]  # [T_local, V]
        local_labels = sharded.shard(labels).to(logits.device)  # [T_local]
        if num_items_in_batch is None:  # a micro-batch on its own: its count over the DP replicas
            num_items_in_batch = self._get_num_items_in_batch([inputs], logits.device)
        # local CE sum / the step's count; checked, and the same count on every rank (packed_cross_entropy agrees)
        share = packed_cross_entropy(logits, local_labels, group=mesh.cp_group, dp_group=mesh.dp_group,
                                     sharded=sharded, num_items_in_batch=num_items_in_batch)
        loss = share * factor
        return (loss, outputs) if return_outputs else loss


def _is_fsdp2(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an older torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _fsdp2_average_factor(model: torch.nn.Module, world: int) -> int:
    """The number of ranks FSDP2 (``fully_shard``) averages ``model``'s gradients over: its mesh, which must span
    the whole DP x CP world (every CP rank's share summed) and keep FSDP2's default divisor (the mesh size)."""
    from torch.distributed.tensor import DTensor

    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    sizes = {m.size() for m in meshes}
    if sizes != {world}:
        raise NotImplementedError(
            f"CPTrainer needs FSDP2 to shard over the whole DP x CP world ({world} ranks), so that its gradient "
            f"reduction sums every CP rank's share; the model's parameters live on meshes of {sorted(sizes)} ranks "
            "(another parallelism_config, or parameters left out of fully_shard)"
        )
    # a custom divisor (FSDPModule.set_gradient_divide_factor, on any sharded submodule) changes the mean
    # (torch's FSDP2 state is private: read defensively)
    states = [getattr(module, "_get_fsdp_state", None) for module in model.modules() if _is_fsdp2(module)]
    factors = {getattr(group, "gradient_divide_factor", None)
               for state in states if callable(state)
               for group in getattr(state(), "_fsdp_param_groups", ())} - {None}
    if factors - {float(world)}:
        raise NotImplementedError(
            f"CPTrainer compensates FSDP2's default gradient average over {world} ranks; this model has a custom "
            f"gradient divide factor {sorted(factors)} (set_gradient_divide_factor): leave the default"
        )
    return world


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


class CPTrainer(CPTrainerMixin, Trainer):
    """A ``transformers.Trainer`` that trains with context parallelism over a DP x CP world.

    Takes every ``Trainer`` argument, plus:

    Args:
        cp_size: the CP group size (the world size must be a multiple; DP = world / cp_size).
        layout: the CP layout (``"auto"``: per batch, ``cp_packing.choose_layout``; ``"contiguous"``,
            ``"balanced"``, ``"zigzag"``: documents padded to a multiple of ``2 * cp_size``).
        backend, kernel, ulysses_size: passed to ``context_parallel_attention`` (docs/attention.md).

    The train dataset holds packed rows (``input_ids`` with ``doc_ids``, or ``position_ids`` restarting per
    document, optional HF ``labels`` or shifted ``shift_labels``; see :func:`cp_batch`). Loss, gradients and every
    optimizer step equal a one-process ``Trainer`` on the same rows with documents isolated (tests/test_trainer.py).

    Raises:
        ValueError: the world size is not a multiple of ``cp_size``, a bad layout, accelerate not running on the
            whole world (on CPU-only machines pass ``TrainingArguments(use_cpu=True)``).
        NotImplementedError: FSDP1, or FSDP2 over a mesh smaller than the world; ``evaluate`` / ``predict``.
    """


def __getattr__(name: str) -> Any:
    """``CPSFTTrainer``: built on first use (it imports TRL)."""
    if name == "CPSFTTrainer":
        from trl import SFTTrainer

        cls = type("CPSFTTrainer", (CPTrainerMixin, SFTTrainer), {
            "__doc__": "TRL's ``SFTTrainer`` with context parallelism (:class:`CPTrainerMixin`; docs/trainer.md).",
            "__module__": __name__,
        })
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

