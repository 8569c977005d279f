"""HF ``Trainer`` (and TRL ``SFTTrainer``) with context parallelism: :class:`CPTrainer`, :class:`CPSFTTrainer`.

``CPTrainer(model=..., args=..., train_dataset=..., cp_size=2)`` is a ``transformers.Trainer`` that does the CP
glue: the DP x CP mesh (:class:`cp_packing.groups.CPMesh`), cp_packing's attention with the model guards, the
Trainer's DataLoader split over the DP replicas only (every CP rank of a replica collates the same rows), each step
sharded locally and its loss this rank's share of the step's mean (local sum over ``num_items_in_batch``), the
library's gradient convention (SUMMED over all DP x CP ranks) under DDP and FSDP2, and ``evaluate`` / ``predict``.
A batch's ``labels`` are HF's (unshifted; shifted here on the global stream), ``shift_labels`` cp-packing's; either
in the other convention is a ``ValueError``. What each step does, the table of every ``TrainingArguments`` /
``SFTConfig`` field that changes the math (honoured or refused at construction) and what is not supported:
docs/trainer.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

from cp_packing._checks import IGNORE_INDEX, check_bool, check_choice, check_int
from cp_packing.formats import doc_ids_from_position_ids
from cp_packing.groups import CPMesh, device_for_backend
from cp_packing.hf import (
    check_cp_model,
    check_transformers_version,
    cp_model_inputs,
    model_windows,
    register_cp_attention,
)
from cp_packing.layouts import LAYOUTS
from cp_packing.labels import valid_label_mask
from cp_packing.loader import pad_for_layout, shard_batch
from cp_packing.loss import (count_valid_labels, next_token_labels, packed_cross_entropy, packed_linear_cross_entropy,
                             reduce_loss_for_logging)
from cp_packing.options import AttentionOptions
from cp_packing.padding import PaddedBatch
from cp_packing.sharding import ShardedPackedSeqParams

check_transformers_version()
from transformers import Trainer  # noqa: E402 - after the version check

__all__ = ["CPMesh", "CPTrainer", "CPTrainerMixin", "OutputProjection", "cp_batch",
           "forward_hidden", "output_projection"]

logger = logging.getLogger("cp_packing")

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
    """The batch's labels shifted on the global stream; a labels tensor in the other convention raises.

    ``shift_labels`` never hold a valid label on the last token of a document (its next token is another document's
    or padding: ``next_token_labels`` puts -100 there); HF's unshifted labels do (the token itself), and so do
    labels shifted across documents. ``labels`` (HF's) hold the token itself or -100; anything else is most likely
    labels shifted already, which a second shift would turn into the token after next.
    """
    key = "shift_labels" if batch.get("shift_labels") is not None else "labels"
    if batch.get(key) is None:
        return next_token_labels(input_ids, doc)
    labels = _as_2d(batch[key], key).to(torch.int64)
    if labels.shape != input_ids.shape:
        raise ValueError(f"{key} has shape {tuple(labels.shape)}, input_ids {tuple(input_ids.shape)}")
    valid = valid_label_mask(labels) & (doc != 0)  # [B, S]
    if key == "shift_labels":
        last = torch.ones_like(valid)
        last[:, :-1] = doc[:, 1:] != doc[:, :-1]  # [B, S]: the last token of its document (or row)
        wrong = valid & last
        what, fix = ("a valid label on the last token of its document, where a shifted label would be the next "
                     "document's first token"), (
            "'shift_labels' are shifted on the global stream (cp_packing.next_token_labels: -100 on the last token "
            "of every document). HF's UNSHIFTED labels (the token itself or -100) go under 'labels', where they are "
            "shifted inside each document")
    else:
        wrong = valid & (labels != input_ids)
        what, fix = "not the token at its position", (
            "'labels' are HF's UNSHIFTED labels (the token itself or -100; the shift happens in the loss). Labels "
            "already shifted (cp_packing.next_token_labels / pack_documents) go under 'shift_labels'")
    if bool(wrong.any()):
        b, s = (int(i) for i in wrong.nonzero()[0])
        raise ValueError(f"batch[{key!r}][{b}, {s}] = {int(labels[b, s])} (input_ids[{b}, {s}] = "
                         f"{int(input_ids[b, s])}) is {what}: {fix}")
    if key == "shift_labels":
        return labels.masked_fill(doc == 0, IGNORE_INDEX)
    return next_token_labels(labels, doc)  # target at t = labels[t + 1] inside the document, -100 kept


@dataclass(frozen=True)
class _GlobalBatch:
    """A collated batch as the CP step takes it, and the way back to the collated layout.

    Attributes:
        tensors: int64 ``{"input_ids", "doc_ids", "shift_labels"}``, each ``[B, S']`` (padded for the layout).
        doc_ids: int64 ``[B, S]``, the collated batch's doc map (0 = padding).
        padded: the zigzag layout's per-document padding (``None``: rows padded at their tail only).
    """

    tensors: dict[str, torch.Tensor]
    doc_ids: torch.Tensor
    padded: PaddedBatch | None

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S', ...]`` of the padded batch -> ``[B, S, ...]`` of the collated one; 0 on padding tokens."""
        if self.padded is not None:
            return self.padded.unpad(x, 0)
        B, S = self.doc_ids.shape
        keep = (self.doc_ids != 0).to(x.device).reshape(B, S, *([1] * (x.dim() - 2)))
        return torch.where(keep, x[:, :S], torch.zeros((), dtype=x.dtype, device=x.device))


def _global_batch(batch: Mapping[str, Any], cp_size: int, layout: str) -> _GlobalBatch:
    if not isinstance(batch, Mapping) or batch.get("input_ids") is None:
        raise ValueError(f"the batch must be a dict with 'input_ids', got {type(batch).__name__} "
                         f"{sorted(batch) if isinstance(batch, Mapping) else ''}")
    input_ids = _as_2d(batch["input_ids"], "input_ids").to(torch.int64)
    doc = _doc_map(batch, input_ids)
    labels = _shifted_labels(batch, input_ids, doc)
    tensors, padded = pad_for_layout({"input_ids": input_ids, "doc_ids": doc, "shift_labels": labels},
                                     cp_size=cp_size, layout=layout, label_keys=("shift_labels",))
    return _GlobalBatch(tensors, doc, padded)


def cp_batch(batch: Mapping[str, Any], *, cp_size: int = 1, layout: str = "auto") -> dict[str, torch.Tensor]:
    """A collated batch in any of HF's packed formats -> the global CP batch ``{input_ids, doc_ids, shift_labels}``.

    Reads the document map from ``doc_ids`` (1-based per row, 0 = padding), else ``position_ids`` restarting at 0
    in every document (TRL's padding-free collator, HF ``DataCollatorWithFlattening``), else a 2-D
    ``attention_mask`` (one document per row), else one document per row. Labels: ``shift_labels`` (already
    shifted), else HF's unshifted ``labels`` (the token or -100, e.g. prompt-masked; shifted here inside each
    document), else every next token of the document. Then pads so the CP layout fits: rows grow at their tail to a
    multiple of ``cp_size`` (doc 0, label -100), or for ``layout="zigzag"`` every segment to a multiple of
    ``2 * cp_size`` (``cp_packing.loader.pad_for_layout``). The result never carries an attention mask.

    Args:
        batch: a dict with ``input_ids`` ``[B, S]`` (or ``[S]``) and the optional keys above.
        cp_size: the CP group size.
        layout: the CP layout the batch will be sharded with (``"auto"``, ``"contiguous"``, ``"balanced"``,
            ``"zigzag"``).

    Returns:
        int64 ``{"input_ids": [B, S'], "doc_ids": [B, S'], "shift_labels": [B, S']}``.

    Raises:
        ValueError: missing ``input_ids``, shapes that differ, labels in the other convention (``labels`` holding a
        valid label that is not the token at its position: shifted already, pass them as ``shift_labels``;
        ``shift_labels`` holding a valid label on the last token of a document: HF's unshifted labels, pass them as
        ``labels``), or what the doc-map converter refuses.

    >>> out = cp_batch({"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])},
    ...                cp_size=2, layout="contiguous")
    >>> out["doc_ids"].tolist(), out["shift_labels"].tolist()
    ([[1, 1, 1, 2, 2, 0]], [[6, 7, -100, 9, -100, -100]])
    """
    cp_size = check_int(cp_size, "cp_size", min=1)
    layout = check_choice(layout, "layout", _LAYOUT_CHOICES)
    return _global_batch(batch, cp_size, layout).tensors


@dataclass
class _CPCollator:
    """The Trainer's collator, then :func:`cp_batch` (runs in the DataLoader workers; picklable). Adds
    ``cp_num_tokens``: int64 ``[2]``, the collated batch's tokens and its non-padding tokens (``doc != 0``)."""

    inner: Callable[[list], Mapping[str, Any]]
    cp_size: int
    layout: str

    def __call__(self, features: list) -> dict[str, torch.Tensor]:
        batch = _global_batch(self.inner(features), self.cp_size, self.layout)
        counts = torch.tensor([batch.doc_ids.numel(), int((batch.doc_ids != 0).sum())], dtype=torch.int64)
        return {**batch.tensors, "cp_num_tokens": counts}


# ------------------------------------------------------------------------------------ the loss without the logits


@dataclass(frozen=True)
class OutputProjection:
    """What :func:`cp_packing.loss.packed_linear_cross_entropy` needs of a causal LM: its decoder (whose output, the
    final hidden states, feeds the projection), the projection ``nn.Linear`` ``[V, D]`` and the final-logit
    soft-capping (Gemma 2's ``final_logit_softcapping``, else ``None``). Its weight is read at each loss call (FSDP2
    swaps the registered parameter)."""

    decoder: torch.nn.Module
    linear: torch.nn.Linear
    softcap: float | None

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """``packed_linear_cross_entropy(hidden [T_local, D], self's weight and bias, labels, **kwargs)``."""
        weight = self.linear.weight
        if type(weight).__name__ == "DTensor":
            raise ValueError("the output projection's weight is a sharded DTensor after the forward (FSDP2 with "
                             "reshard_after_forward=True on the module that holds it): the chunked loss needs it "
                             "whole; keep that module's parameters after forward, or turn the chunked loss off "
                             "(chunked_loss=False / --no-chunked-loss)")
        return packed_linear_cross_entropy(hidden, weight, labels, bias=self.linear.bias,
                                           final_logit_softcapping=self.softcap, **kwargs)


def output_projection(model: torch.nn.Module) -> tuple[OutputProjection | None, str]:
    """``(projection, "")`` when the chunked loss can stand in for ``model``'s logits, else ``(None, why not)``.

    ``model`` (an HF causal LM, unwrapped) must expose an ``nn.Linear`` output projection
    (``get_output_embeddings()``), its decoder (``get_decoder()``) and take ``logits_to_keep``; then one probe: a
    4-token forward (no grad, eval mode, eager attention for the call) whose logits must equal the projection
    (soft-capped by the config's ``final_logit_softcapping``) of the decoder's output. A model that scales or masks
    its logits after the projection (Cohere's ``logit_scale``, Granite's ``logits_scaling``, ...) fails it. The
    probe is a pure function of the weights, so every rank decides alike.
    """
    name = type(model).__name__
    get_out, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    linear = get_out() if callable(get_out) else None
    if not isinstance(linear, torch.nn.Linear):
        return None, f"{name} exposes no nn.Linear output projection (get_output_embeddings())"
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        return None, f"{name} exposes no decoder (get_decoder()) whose output feeds the projection"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None, f"{name}.forward takes no logits_to_keep: it would build the logits anyway"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    projection = OutputProjection(decoder, linear, float(softcap) if softcap else None)
    why = _probe(model, projection)
    return (None, f"{name}: {why}") if why else (projection, "")


@torch.no_grad()
def _probe(model: torch.nn.Module, projection: OutputProjection) -> str | None:
    """Why ``model``'s logits are not its projection of its decoder's output (``None``: they are)."""
    weight = projection.linear.weight
    ids = (torch.arange(4, device=weight.device) % weight.shape[0])[None]  # [1, 4]
    implementation, training = getattr(model.config, "_attn_implementation", None), model.training
    try:
        if implementation not in (None, "eager"):
            model.set_attn_implementation("eager")
        model.eval()
        outputs, hidden = forward_hidden(model, projection, {"input_ids": ids, "use_cache": False}, keep=0)
    except Exception as exc:  # noqa: BLE001 - any model error: the loss then uses the logits
        return f"the probe forward failed ({type(exc).__name__}: {exc})"
    finally:
        model.train(training)
        if implementation not in (None, "eager"):
            model.set_attn_implementation(implementation)
    ours = F.linear(hidden, weight, projection.linear.bias).float()  # [4, V]
    if projection.softcap is not None:
        ours = projection.softcap * torch.tanh(ours / projection.softcap)
    theirs = outputs.logits.reshape(ours.shape).float()
    diff, scale = float((ours - theirs).abs().max()), max(1.0, float(theirs.abs().max()))
    if not diff <= max(8 * torch.finfo(weight.dtype).eps, 1e-4) * scale:
        return (f"its logits are not its output projection of its decoder's output (max difference {diff:.3g}): it "
                "scales or masks them after the projection (e.g. Cohere's logit_scale, Granite's logits_scaling)")
    return None


def forward_hidden(model: torch.nn.Module, projection: OutputProjection, inputs: Mapping[str, Any],
                   keep: int | torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    """Run ``model`` (or its DDP / FSDP2 wrapper) on ``inputs`` without building the logits: ``(outputs, the final
    hidden states [T_local, D])``.

    The hidden states come from a forward hook on the decoder, and ``logits_to_keep`` (default an empty index) keeps
    no position for the projection, so the model returns empty logits ``[1, 0, V]``; the call still goes through the
    wrapper's forward (DDP's gradient hooks, FSDP2's all-gathers) and the model's guards.
    """
    captured: list[Any] = []
    handle = projection.decoder.register_forward_hook(lambda module, args, out: captured.append(out))
    if keep is None:
        keep = torch.empty(0, dtype=torch.int64, device=projection.linear.weight.device)
    try:
        outputs = model(**inputs, logits_to_keep=keep)
    finally:
        handle.remove()
    out = captured[0]
    hidden = getattr(out, "last_hidden_state", None)
    hidden = out[0] if hidden is None else hidden  # [1, T_local, D]
    return outputs, hidden.reshape(-1, hidden.shape[-1])


# ---------------------------------------------------------------------------------------------- the arguments


def _takes_shift_labels(fn: Callable) -> bool:
    try:
        return "shift_labels" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: it cannot say it takes shifted labels
        return False


def _router_aux_loss(trainer: Any) -> bool:
    """Whether the model returns a MoE router auxiliary loss meant to be added to the loss (TRL's flag, else the
    model config's ``output_router_logits``)."""
    enabled = getattr(trainer, "aux_loss_enabled", None)
    if enabled is not None:
        return bool(enabled)
    config = getattr(trainer.model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "output_router_logits", False))


def _refused_arguments(trainer: Any) -> Iterator[tuple[str, Any, str]]:
    """``(field, value, why and fix)`` for every setting that would change the math under CP and cannot be honoured
    (docs/trainer.md has the table of every field, honoured or refused)."""
    args, mesh, acc = trainer.args, trainer.cp_mesh, trainer.accelerator
    optim = str(getattr(args.optim, "value", args.optim))
    if args.torch_compile:
        yield "torch_compile", True, (
            "accelerate would compile the wrapped model, whose CP attention needs each step's plan prepared before "
            "the call; pass torch_compile=False (a compiled CP model: your own loop with torch.compile(model) and "
            "cp_model_inputs(..., model=model), docs/compile.md)")
    if args.neftune_noise_alpha is not None:
        yield "neftune_noise_alpha", args.neftune_noise_alpha, (
            "NEFTune scales its embedding noise by the length of the sequence it sees (this rank's shard [1, "
            "T_local] under CP) and every CP rank draws its own noise; pass neftune_noise_alpha=None")
    if args.use_liger_kernel:
        yield "use_liger_kernel", True, (
            "Liger patches the model's forward and loss (its fused linear cross-entropy computes HF's loss on this "
            "rank's shard); pass use_liger_kernel=False (CPTrainer's own loss never builds the logits either: "
            "chunked_loss=True, the default)")
    if optim in ("lomo", "adalomo") or optim.endswith("layerwise"):
        yield "optim", optim, (
            "it updates each parameter inside backward, from this rank's share of the gradient, before DDP / FSDP2 "
            "sums the CP ranks' shares; pass another optim (e.g. adamw_torch)")
    if args.label_names not in (None, ["labels"]):
        yield "label_names", args.label_names, (
            "the CP loss reads the batch's 'labels' (HF's, unshifted) or 'shift_labels'; pass label_names=None")
    if trainer.is_deepspeed_enabled:
        yield "deepspeed", args.deepspeed, (
            "DeepSpeed reduces the gradients and scales the loss its own way (CPTrainer meets the gradient "
            "convention under DDP and FSDP2); use FSDP2: fsdp=True, fsdp_config={'version': 2}")
    config = args.parallelism_config or getattr(acc, "parallelism_config", None)
    if config is not None:
        yield "parallelism_config", config, (
            "accelerate's own parallelism would shard the sequence without the document boundaries (cp_size) or "
            "change the mesh CPTrainer builds; remove it (CPTrainer builds the DP x CP mesh from cp_size; FSDP2: "
            "fsdp=True, fsdp_config={'version': 2})")
    if acc.dispatch_batches:
        yield "accelerator_config.dispatch_batches", True, (
            "accelerate would load every batch on rank 0 and split it over all ranks, not over the DP replicas; "
            "pass accelerator_config={'dispatch_batches': False}")
    if mesh.dp_size > 1 and not acc.even_batches:
        yield "accelerator_config.even_batches", False, (
            "DP replicas could get different numbers of batches, and one would wait for the others in a "
            "collective; pass accelerator_config={'even_batches': True}")
    if trainer.compute_loss_func is not None and not _takes_shift_labels(trainer.compute_loss_func):
        yield "compute_loss_func", trainer.compute_loss_func, (
            "under CP it gets this rank's logits [1, T_local, V] and labels already shifted on the global stream; a "
            "function that shifts labels itself would pair tokens across every shard edge. Give it a `shift_labels` "
            "parameter: CPTrainer then calls compute_loss_func(outputs, None, num_items_in_batch=N, "
            "shift_labels=labels) and it returns the SUM of its per-token losses / N, e.g. transformers' "
            "ForCausalLMLoss(outputs.logits, labels, vocab_size, num_items_in_batch, shift_labels=shift_labels)")
    if getattr(args, "loss_type", "nll") != "nll":
        yield "loss_type", args.loss_type, (
            "CPSFTTrainer computes the nll loss from this rank's logits; pass loss_type='nll'")
    if _router_aux_loss(trainer):
        yield "router_aux_loss_coef", getattr(args, "router_aux_loss_coef", None), (
            "the model's MoE router auxiliary loss would be left out of the CP loss (computed from the logits); turn "
            "it off: router_aux_loss_coef=0.0 (SFTConfig) or model.config.output_router_logits=False")


def _check_arguments(trainer: Any) -> None:
    """Raise a ValueError naming the first refused setting and its fix (the same on every rank: a pure function of
    the arguments and the mesh sizes)."""
    for field, value, why in _refused_arguments(trainer):
        raise ValueError(f"{type(trainer).__name__}: {field}={value!r} is not supported under context parallelism: "
                         f"{why}")


# ----------------------------------------------------------------------------------------------- the trainer


class CPTrainerMixin:
    """The CP part of :class:`CPTrainer`, for any ``transformers.Trainer`` subclass (``class X(CPTrainerMixin,
    SomeTrainer)``): the mesh, the attention, the data split, the loss, the DDP / FSDP2 factor and the evaluation
    (module docstring)."""

    def __init__(self, *args: Any, cp_size: int = 1, layout: str = "auto", backend: str = "auto",
                 kernel: str = "auto", ulysses_size: int | None = None, chunked_loss: bool = True,
                 **kwargs: Any) -> None:
        self.cp_size = check_int(cp_size, "cp_size", min=1)
        chunked_loss = check_bool(chunked_loss, "chunked_loss")
        self.cp_layout = check_choice(layout, "layout", _LAYOUT_CHOICES)
        self.cp_options = AttentionOptions(backend=backend, kernel=kernel, ulysses_size=ulysses_size)
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
        self.cp_mesh = CPMesh.from_world(self.cp_size)
        if self.accelerator.num_processes != self.cp_mesh.world_size:
            raise ValueError(
                f"the process group has {self.cp_mesh.world_size} ranks but accelerate runs "
                f"{self.accelerator.num_processes} process(es) ({self.accelerator.distributed_type}), so the Trainer "
                "would not wrap the model in DDP and nothing would reduce the CP ranks' gradients; on a machine "
                "without GPUs pass TrainingArguments(use_cpu=True), and launch with torchrun"
            )
        _check_arguments(self)
        self.cp_projection = self._chunked_loss_projection() if chunked_loss else None
        self._use_cp_attention()
        self.loss_is_scaled_for_ga = True  # compute_loss divides by the whole step's count (num_items_in_batch)
        self.model_accepts_loss_kwargs = True  # so the Trainer counts num_items_in_batch (our override below)
        self._cp_eval_collator = self.data_collator  # eval / predict batches stay as collated (converted per step)
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

    def _chunked_loss_projection(self) -> OutputProjection | None:
        """The model's output projection for the chunked loss, or ``None`` (a ``compute_loss_func`` takes the
        logits; a model that fails :func:`output_projection`: logged, the loss then uses the full logits)."""
        if self.compute_loss_func is not None:
            return None
        projection, why = output_projection(self.model)
        if projection is None:
            logger.warning("CPTrainer: the loss uses the full logits (chunked_loss): %s", why)
        return projection

    def get_cp_size(self) -> int:
        """The CP group size: the Trainer's ``dp_world_size = world_size // cp_size`` (batch-size bookkeeping)."""
        return self.cp_size

    # ---- data: the Trainer's sampler, split over the DP replicas (every CP rank of a replica gets the same batches)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *_DATA_COLUMNS]))

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """The Trainer's sampler; ``train_sampling_strategy="batch_rebalance"`` balances over the DP replicas (the
        Trainer's balances over every rank of the world)."""
        from transformers.trainer_pt_utils import BatchRebalanceSampler

        sampler = super()._get_train_sampler(train_dataset)
        mesh = self.cp_mesh
        if isinstance(sampler, BatchRebalanceSampler) and sampler.dp_size != mesh.dp_size:
            sampler = BatchRebalanceSampler(
                sampler.lengths, sampler.effective_batch_size // sampler.dp_size * mesh.dp_size, mesh.dp_size,
                sampler.grad_accum, shuffle=sampler.shuffle, seed=sampler.seed, rank=mesh.dp_rank,
                drop_last=sampler.drop_last)
        return sampler

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Callable | None = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> DataLoader:
        """``Trainer._get_dataloader`` with accelerate's ``prepare_data_loader`` over the DP replicas: batch ``k``
        of replica ``i`` is batch ``k * dp + i`` of the Trainer's sampler, as on ``dp`` plain processes."""
        from accelerate.data_loader import prepare_data_loader
        from transformers.trainer_pt_utils import BatchRebalanceSampler
        from transformers.trainer_utils import seed_worker

        args, mesh, acc = self.args, self.cp_mesh, self.accelerator
        collator = self.data_collator if is_training else self._cp_eval_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        params = {"batch_size": batch_size, "collate_fn": collator, "num_workers": args.dataloader_num_workers,
                  "pin_memory": args.dataloader_pin_memory, "persistent_workers": args.dataloader_persistent_workers,
                  "multiprocessing_context": args.dataloader_multiprocessing_context,
                  "prefetch_factor": args.dataloader_prefetch_factor, "in_order": args.dataloader_in_order}
        rebalanced = False
        if isinstance(dataset, IterableDataset):
            if mesh.dp_size > 1:
                raise NotImplementedError(
                    f"CPTrainer splits a map-style dataset over the {mesh.dp_size} DP replicas; an iterable dataset "
                    "would reach every rank whole. Use a map-style dataset, or one DP replica (world = cp_size)")
        else:
            sampler = sampler_fn(dataset) if sampler_fn is not None else None
            rebalanced = isinstance(sampler, BatchRebalanceSampler)  # a batch sampler that splits over DP itself
            if rebalanced:
                params["batch_sampler"] = sampler
                del params["batch_size"]
            else:
                params.update({"sampler": sampler} if sampler is not None else {}, drop_last=args.dataloader_drop_last)
            if is_training:  # the same worker seeds on the CP ranks of a replica (a random collator agrees)
                params["worker_init_fn"] = functools.partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                             rank=mesh.dp_rank)
        loader = prepare_data_loader(
            DataLoader(dataset, **params), acc.device, num_processes=1 if rebalanced else mesh.dp_size,
            process_index=0 if rebalanced else mesh.dp_rank, split_batches=acc.split_batches,
            put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(), dispatch_batches=False,
            even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader)
        acc._dataloaders.append(loader)  # as accelerator.prepare does
        if dataloader_key is not None and args.dataloader_persistent_workers:
            self._eval_dataloaders = {**getattr(self, "_eval_dataloaders", {}), dataloader_key: loader}
        return loader

    def _dp_sum(self, value: int) -> int:
        """``value`` summed over the DP replicas (each replica's batch counted once, although all its CP ranks hold
        it): the tokens seen; the labels are counted by ``count_valid_labels`` (:meth:`_get_num_items_in_batch`)."""
        mesh = self.cp_mesh
        if mesh.dp_group is None or mesh.dp_size == 1:
            return value
        count = torch.tensor([value], dtype=torch.int64, device=device_for_backend(str(dist.get_backend(
            mesh.dp_group))))
        dist.all_reduce(count, group=mesh.dp_group)
        return int(count[0])

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        """The valid labels of the whole optimizer step: every micro-batch of this replica, summed over the DP
        replicas with ``average_tokens_across_devices`` (the default), else this replica's own: the library's one
        count (``count_valid_labels``; every CP rank of a replica holds its whole batches, so never over CP)."""
        if not batch_samples:
            return None
        dp = self.cp_mesh.dp_group if self.args.average_tokens_across_devices else None
        count = count_valid_labels([b["shift_labels"] for b in batch_samples], dp_group=dp)
        return torch.tensor(count, dtype=torch.int64, device=device)

    def _track_num_input_tokens(self, inputs: Mapping[str, Any]) -> None:
        """``include_num_input_tokens_seen``: the collated batches' tokens (``"all"``) or non-padding tokens
        (``"non_padding"``: ``doc_ids != 0``), each DP replica's counted once."""
        mode = self.args.include_num_input_tokens_seen
        if mode in ("no", False, None):
            return
        counts = inputs.get("cp_num_tokens")
        if counts is None:  # a batch that did not come through the CP collator: count the padded batch
            doc = inputs["doc_ids"]
            counts = torch.tensor([doc.numel(), int((doc != 0).sum())])
        self.state.num_input_tokens_seen += self._dp_sum(int(counts[1 if mode == "non_padding" else 0]))

    # ---- the step

    def _gradient_average_factor(self, model: torch.nn.Module) -> int:
        """The number of ranks the wrapper averages gradients over (1 without a wrapper in a one-process world):
        DDP's process group, or FSDP2's mesh (``fully_shard`` averages over every rank of its mesh by default)."""
        world = self.cp_mesh.world_size
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return dist.get_world_size(model.process_group)
        if _is_fsdp2(model):
            return _fsdp2_average_factor(model, world)
        if world > 1 and torch.is_grad_enabled():
            compiled = " (torch.compile's wrapper: CPTrainer does not train a compiled model)" \
                if hasattr(model, "_orig_mod") else ""
            raise RuntimeError(
                f"CPTrainer runs on {world} ranks but the model is not wrapped in DistributedDataParallel or FSDP2 "
                f"({type(model).__name__}{compiled}): nothing would reduce the CP ranks' gradient shares"
            )
        return 1

    def _cp_forward(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], chunked: bool
                    ) -> tuple[Any, torch.Tensor, torch.Tensor, ShardedPackedSeqParams]:
        """Shard the global batch locally and run the model on this rank's tokens.

        Returns:
            the model's outputs, this rank's logits ``[T_local, V]`` (``chunked``: its final hidden states
            ``[T_local, D]``, the logits never built), its labels ``[T_local]`` and its shard.
        """
        mesh = self.cp_mesh
        local, sharded = shard_batch({key: batch[key] for key in _BATCH_KEYS}, cp_size=mesh.cp_size,
                                     cp_rank=mesh.cp_rank, layout=self.cp_layout,
                                     window=model_windows(model))  # sliding layers: plan the windowed cost
        model_inputs = cp_model_inputs(local["input_ids"][0], sharded, group=mesh.cp_group,
                                       options=self.cp_options, model=model)
        if chunked:
            outputs, scores = forward_hidden(model, self.cp_projection, model_inputs)
        else:
            outputs = model(**model_inputs)
            scores = outputs.logits[0]  # [T_local, V]
        return outputs, scores, local["shift_labels"][0].to(scores.device), sharded

    def _cp_share(self, outputs: Any, scores: torch.Tensor, labels: torch.Tensor, sharded: ShardedPackedSeqParams,
                  num_items_in_batch: torch.Tensor, chunked: bool) -> torch.Tensor:
        """This rank's share of the global loss: the shares of every DP x CP rank sum to it.

        Cross-entropy SUM of this rank's labels / ``num_items_in_batch`` (``packed_cross_entropy`` on the logits, or
        with ``chunked`` ``packed_linear_cross_entropy`` on the hidden states: checked, the same count on every
        rank), label smoothing as HF's ``LabelSmoother`` on the global batch (``(1 - eps) * nll + eps * mean over
        the vocabulary of -log p`` per token, over the same count); or the user's CP-aware ``compute_loss_func``.
        Without ``average_tokens_across_devices`` each replica's loss is its own mean and the global loss their mean
        (HF's meaning on plain DP processes): a further ``/ dp_size``.
        """
        mesh, args = self.cp_mesh, self.args
        if self.compute_loss_func is not None:  # its signature was checked at construction
            share = self.compute_loss_func(outputs, None, num_items_in_batch=num_items_in_batch,
                                           shift_labels=labels[None])
        else:
            kwargs = dict(group=mesh.cp_group, dp_group=mesh.dp_group if args.average_tokens_across_devices else None,
                          sharded=sharded, num_items_in_batch=num_items_in_batch,
                          label_smoothing=float(args.label_smoothing_factor))
            share = self.cp_projection.loss(scores, labels, **kwargs) if chunked else \
                packed_cross_entropy(scores, labels, **kwargs)
        return share if args.average_tokens_across_devices else share / mesh.dp_size

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """This rank's share of the step's loss (:meth:`_cp_share`), times the number of ranks DDP / FSDP2 average
        the gradients over, so that the reduced gradient is the SUM of every rank's share.

        ``inputs`` is the global batch of this DP replica (the same on every CP rank); sharded here, locally. With
        the chunked loss (the default where the model allows it) ``outputs.logits`` are empty (``[1, 0, V]``).
        """
        factor = self._gradient_average_factor(model)  # checked before any collective
        if any(key not in inputs for key in _BATCH_KEYS):
            inputs = cp_batch(inputs, cp_size=self.cp_size, layout=self.cp_layout)
        chunked = self.cp_projection is not None
        outputs, scores, labels, sharded = self._cp_forward(model, inputs, chunked)
        if num_items_in_batch is None:  # a micro-batch on its own: its count over the DP replicas
            num_items_in_batch = self._get_num_items_in_batch([inputs], scores.device)
        loss = self._cp_share(outputs, scores, labels, sharded, num_items_in_batch, chunked) * factor
        return (loss, outputs) if return_outputs else loss

    # ---- evaluation: the same sharded forward; the loss summed over every rank, the logits gathered over CP

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One eval batch (as collated: :func:`cp_batch` runs here): ``(loss, logits, labels)``.

        ``loss``: the batch's global loss (every DP x CP rank's share summed; equal on every rank). ``logits``:
        ``[B, S, V]`` in the collated batch's order (gathered over the CP group and un-padded; 0 on padding tokens),
        ``None`` with ``prediction_loss_only``. ``labels``: the batch's ``labels`` (else ``shift_labels``) as
        collated, like the Trainer's.
        """
        inputs = self._prepare_inputs(inputs)
        batch = _global_batch(inputs, self.cp_size, self.cp_layout)
        mesh = self.cp_mesh
        with torch.no_grad(), self.compute_loss_context_manager():
            num_items = self._get_num_items_in_batch([batch.tensors], self.args.device)
            chunked = self.cp_projection is not None and prediction_loss_only  # predictions need the logits
            outputs, logits, labels, sharded = self._cp_forward(model, batch.tensors, chunked)
            share = self._cp_share(outputs, logits, labels, sharded, num_items, chunked)
            loss = reduce_loss_for_logging(share, group=mesh.cp_group, dp_group=mesh.dp_group)
        if prediction_loss_only:
            return loss, None, None
        parts = [logits]
        if mesh.cp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(mesh.cp_size)]
            dist.all_gather(parts, logits.contiguous(), group=mesh.cp_group)
        full = batch.unpad(sharded.unshard(parts))  # [B, S, V]
        label_ids = inputs.get("labels", inputs.get("shift_labels"))
        return loss, full, label_ids

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loop, with its metric gather over the DP replicas only (the CP ranks of a replica hold the
        same predictions)."""
        self.gather_function = functools.partial(self._gather_over_dp,
                                                 use_gather_object=self.args.eval_use_gather_object)
        return super().evaluation_loop(*args, **kwargs)

    def _gather_over_dp(self, data: Any, use_gather_object: bool = False) -> Any:
        """accelerate's ``gather_for_metrics`` over the DP group: concatenated in replica order, then the samples
        ``even_batches`` repeated in the last batch dropped (its ``gradient_state.remainder``)."""
        from accelerate.utils import recursively_apply

        mesh = self.cp_mesh
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if mesh.dp_size > 1 and use_gather_object:
            parts = [None] * mesh.dp_size
            dist.all_gather_object(parts, data, group=mesh.dp_group)
            data = [x for part in parts for x in part]
        elif mesh.dp_size > 1:
            data = recursively_apply(functools.partial(_all_gather_rows, group=mesh.dp_group), data)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            cut = lambda x: x[: state.remainder]  # noqa: E731
            data = cut(data) if use_gather_object else recursively_apply(cut, data)
        return data


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x`` concatenated along dim 0 in rank order (their dim 0 may differ; the rest must not)."""
    x = x.reshape(1) if x.dim() == 0 else x.contiguous()
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device), group=group)
    sizes = [int(s) for s in sizes]
    if x.shape[0] < max(sizes):
        x = torch.cat([x, x.new_zeros(max(sizes) - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])


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
    """A ``transformers.Trainer`` that trains and evaluates with context parallelism over a DP x CP world.

    Takes every ``Trainer`` argument, plus:

    Args:
        cp_size: the CP group size (the world size must be a multiple; DP = world / cp_size).
        layout: the CP layout (``"auto"``: per batch, ``cp_packing.choose_layout``; ``"contiguous"``,
            ``"balanced"``, ``"zigzag"``: documents padded to a multiple of ``2 * cp_size``).
        backend, kernel, ulysses_size: passed to ``context_parallel_attention`` (docs/attention.md).
        chunked_loss: ``True`` (default): the loss never builds the ``[T_local, V]`` logits
            (``cp_packing.packed_linear_cross_entropy`` on the decoder's hidden states and the output projection)
            where :func:`output_projection` accepts the model and no ``compute_loss_func`` is given; ``False``:
            ``packed_cross_entropy`` on the model's logits.

    The datasets hold packed rows (``input_ids`` with ``doc_ids``, or ``position_ids`` restarting per document,
    optional HF ``labels`` or shifted ``shift_labels``; see :func:`cp_batch`). Loss, gradients, every optimizer step,
    the eval loss and the predictions equal a one-process ``Trainer`` on the same rows with documents isolated
    (tests/test_trainer.py, tests/test_trainer_args.py). ``compute_loss_func`` must take ``shift_labels``
    (docs/trainer.md).

    Raises:
        ValueError: the world size is not a multiple of ``cp_size``, a bad layout, accelerate not running on the
            whole world (on CPU-only machines pass ``TrainingArguments(use_cpu=True)``), a ``TrainingArguments``
            field that cannot be honoured under CP (the message names it and the fix; docs/trainer.md's table).
        NotImplementedError: FSDP1, or FSDP2 over a mesh smaller than the world; an iterable dataset with DP > 1.
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
