"""Cross-entropy losses whose CP shares sum to the non-CP loss: a local sum over a global count (docs/loss.md).

Each rank returns its share, the sum of its tokens' cross-entropy over ``N``, the valid labels of the whole step, by
one rule: ``num_items_in_batch`` (from :func:`count_valid_labels`, the library's one count), else the prepared step's
count, else one all-reduce over the groups given; a collective (one agreement per group, so a mistake on one rank
raises on every rank) runs iff ``group`` or ``dp_group`` is given. Labels are shifted on the global stream by
``cp_packing.labels.next_token_labels``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing._checks import (INTEGER_DTYPES, check_choice, check_ignore_index, check_int, check_number,
                               check_tensor, is_int)
from cp_packing.agreement import digest, fail_together
from cp_packing.groups import CPGroup, GroupLike, check_shard_in_group, resolve_group
from cp_packing.packed_seq import PackedSeqParams
from cp_packing.labels import (LabelsWarning, check_same_batch, check_labels_shifted, local_label_count,
                               next_token_labels, segment_ends)
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = [
    "LabelsWarning",
    "count_step",
    "count_valid_labels",
    "document_cross_entropy",
    "next_token_labels",
    "default_chunk_size",
    "packed_cross_entropy",
    "packed_linear_cross_entropy",
    "reduce_loss_for_logging",
]

_CALL = "packed_cross_entropy"  # one call name for both reductions: a mix is reported as a `reduction` mismatch
_REDUCTIONS = ("token", "document")


# ----------------------------------------------------------------------------------------------------------------
# Local checks, then one agreement per group
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Scores:
    """What scores this rank's tokens: dense logits, or the final hidden states and the output projection (chunked,
    :class:`_LinearCrossEntropy`). ``ce(labels, ignore_index)`` is the float32 CE per token ``[T_local]``, exactly 0
    at ignored positions (still connected to the inputs)."""

    vocab: int
    dtype: torch.dtype  # the logits' dtype (the hidden states' for the chunked loss)
    device: torch.device
    ce: Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class _Local:
    """This rank's checked inputs."""

    scores: _Scores
    labels: torch.Tensor  # int64 [T_local], each ignore_index or in [0, V)
    segment: torch.Tensor | None  # int64 [T_local], global segment of each local token (document reduction)
    num_segments: int
    num_items: int | None  # num_items_in_batch, read on the host


def _check_labels(labels: object, ignore_index: int, tokens: torch.Tensor, what: str) -> torch.Tensor:
    """Integer ``labels`` with one entry per row of ``tokens`` (``[T_local, ...]`` or ``[1, T_local, ...]``), on its
    device; returns them flat int64 ``[T_local]``."""
    check_tensor(labels, "labels", "[T_local]")
    if labels.dtype not in INTEGER_DTYPES:
        raise TypeError(f"labels must have an integer dtype (class index, {ignore_index} = ignored), got "
                        f"{labels.dtype}; build them with cp_packing.next_token_labels(...) or use labels.long()")
    if tokens.dim() < 2 or tuple(labels.shape) != tuple(tokens.shape[:-1]):
        raise ValueError(f"{what} shape {tuple(tokens.shape)} does not match labels shape {tuple(labels.shape)}; "
                         f"expected {what} [T_local, {'V' if what == 'logits' else 'D'}] with labels [T_local] (or "
                         f"[1, T_local, ...] with [1, T_local])")
    if labels.device != tokens.device:
        raise ValueError(f"labels are on {labels.device} but {what} on {tokens.device}; move them to one device")
    return labels.reshape(-1).to(torch.int64)


def _check_label_smoothing(label_smoothing: object) -> float:
    eps = check_number(label_smoothing, "label_smoothing", min=0.0)
    if eps > 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1] (HF's label_smoothing_factor), got {label_smoothing!r}")
    return eps


def _check_logits_and_labels(logits: object, labels: object, ignore_index: int,
                             label_smoothing: object = 0.0) -> tuple[_Scores, torch.Tensor]:
    """Dtypes, shapes, device and ``label_smoothing`` (the label values are checked by :func:`_inspect`)."""
    check_tensor(logits, "logits", "[T_local, V]")
    eps = _check_label_smoothing(label_smoothing)
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor [T_local, V], got dtype {logits.dtype}")
    if logits.dim() >= 1 and logits.shape[-1] == 0:
        raise ValueError(f"logits have a vocabulary of 0 classes (shape {tuple(logits.shape)}); pass the model's "
                         "logits [T_local, V] with V >= 1")
    labels1d = _check_labels(labels, ignore_index, logits, "logits")
    logits2d = logits.reshape(-1, logits.shape[-1])  # [T_local, V]

    def ce(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        return F.cross_entropy(logits2d.float(), labels, ignore_index=ignore_index, reduction="none",
                               label_smoothing=eps)

    return _Scores(int(logits2d.shape[-1]), logits2d.dtype, logits2d.device, ce), labels1d


def _check_linear_and_labels(hidden: object, weight: object, bias: object, labels: object, ignore_index: int,
                             label_smoothing: object, softcap: object, chunk_size: object
                             ) -> tuple[_Scores, torch.Tensor]:
    """The chunked loss's inputs: ``hidden`` ``[T_local, D]``, ``weight`` ``[V, D]``, ``bias`` ``[V]`` or ``None``, one
    floating dtype and device; the options."""
    check_tensor(hidden, "hidden", "[T_local, D] (the final hidden states)")
    check_tensor(weight, "weight", "[V, D] (the output projection, e.g. model.lm_head.weight)")
    eps = _check_label_smoothing(label_smoothing)
    cap = None if softcap is None else check_number(softcap, "final_logit_softcapping")
    if cap is not None and not 0.0 < cap < float("inf"):
        raise ValueError(f"final_logit_softcapping must be a finite number > 0 (logits become cap * tanh(logits / "
                         f"cap)), got {softcap!r}; pass the model config's final_logit_softcapping, or None")
    chunk = None if chunk_size is None else check_int(chunk_size, "chunk_size", min=1,
                                                      hint="tokens per chunk, or None for the default")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be floating-point tensors, got {hidden.dtype} and {weight.dtype}")
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight must be the output projection [V, D] with V >= 1, got shape {tuple(weight.shape)}; "
                         "pass model.get_output_embeddings().weight")
    if hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden shape {tuple(hidden.shape)} does not end in the weight's D = {weight.shape[1]} "
                         f"(weight [V, D] = {tuple(weight.shape)}); pass the final hidden states [T_local, D] (after "
                         "the final norm) and the output projection [V, D]")
    if bias is not None:
        check_tensor(bias, "bias", "[V]")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match the weight's V = {weight.shape[0]}")
    others = [("weight", weight)] + ([] if bias is None else [("bias", bias)])
    for name, x in others:
        if x.dtype != hidden.dtype or x.device != hidden.device:
            raise ValueError(f"{name} is {x.dtype} on {x.device} but hidden {hidden.dtype} on {hidden.device}; the "
                             "output projection runs in one dtype on one device (cast hidden, as the model's lm_head "
                             "would see it)")
    labels1d = _check_labels(labels, ignore_index, hidden, "hidden")
    hidden2d = hidden.reshape(-1, hidden.shape[-1])  # [T_local, D]

    def ce(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        return _LinearCrossEntropy.apply(hidden2d, weight, bias, labels, ignore_index, eps, cap, chunk)

    return _Scores(int(weight.shape[0]), hidden2d.dtype, hidden2d.device, ce), labels1d


def default_chunk_size(num_tokens: int, hidden_size: int, vocab: int) -> int:
    """The chunked loss's default tokens per chunk: a power of two near ``T * D / V``, so one chunk's logits
    ``[C, V]`` hold about as many numbers as the hidden states ``[T, D]`` (Liger-Kernel's rule), but at least 256
    (every chunk reads the whole weight again: fewer rows make its matmuls memory-bound), at most ``T``.

    >>> default_chunk_size(4096, 512, 32768), default_chunk_size(32768, 4096, 131072)
    (256, 1024)
    """
    chunk = -(-num_tokens // -(-vocab // max(hidden_size, 1)))  # ceil(T / ceil(V / D))
    return max(1, min(num_tokens, max(256, 1 << max(chunk - 1, 0).bit_length())))


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token CE ``[T]`` of ``logits = cap * tanh((hidden @ weight.T + bias) / cap)`` without ``[T, V]``: chunks of
    tokens, each chunk's logits in float32; backward recomputes each chunk's logits from the saved inputs and the
    float32 log-sum-exp ``[T]`` (docs/loss.md, "A loss without the logits")."""

    @staticmethod
    def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                cap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 ``[C, V]`` logits of one chunk (the projection in the weight's dtype, as the model's lm_head), and
        with ``cap`` the tanh ``[C, V]`` (for the gradient)."""
        z = F.linear(h, weight, bias).to(torch.promote_types(h.dtype, torch.float32))  # [C, V]
        if cap is None:
            return z, None
        t = z.div_(cap).tanh_()
        return t * cap, t

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, eps, cap, chunk):
        T, V = hidden.shape[0], weight.shape[0]
        chunk = chunk or default_chunk_size(T, hidden.shape[1], V)
        valid = labels != ignore_index  # [T]
        target = torch.where(valid, labels, 0)  # [T]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32 (float64 stays float64)
        lse = torch.empty(T, dtype=acc, device=hidden.device)  # [T]
        ce = torch.empty(T, dtype=acc, device=hidden.device)  # [T]
        for s in range(0, T, chunk):
            z, _ = _LinearCrossEntropy._logits(hidden[s:s + chunk], weight, bias, cap)  # [C, V]
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            loss = lse[s:s + chunk] - z.gather(1, target[s:s + chunk, None])[:, 0]  # nll, [C]
            if eps:
                loss = (1 - eps) * loss + eps * (lse[s:s + chunk] - z.mean(dim=-1))  # mean over v of -log p_v
            ce[s:s + chunk] = loss
        ce.masked_fill_(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, bias, target, valid, lse)
        ctx.options = (eps, cap, chunk)
        return ce

    @staticmethod
    def backward(ctx, grad_ce):
        hidden, weight, bias, target, valid, lse = ctx.saved_tensors
        eps, cap, chunk = ctx.options
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g = grad_ce.to(lse.dtype) * valid  # [T]
        grad_h = torch.empty_like(hidden) if need_h else None  # rows are disjoint per chunk
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device) \
            if need_b and bias is not None else None
        V = weight.shape[0]
        for s in range(0, hidden.shape[0], chunk):
            h, gs = hidden[s:s + chunk], g[s:s + chunk, None]  # [C, D], [C, 1]
            z, t = _LinearCrossEntropy._logits(h, weight, bias, cap)  # [C, V]
            dz = z.sub_(lse[s:s + chunk, None]).exp_().mul_(gs)  # softmax * g, in place
            dz.scatter_add_(1, target[s:s + chunk, None], -(1 - eps) * gs)
            if eps:
                dz.sub_(gs * (eps / V))
            if t is not None:
                dz.mul_(t.square_().neg_().add_(1))  # d(cap * tanh(u / cap)) / du = 1 - tanh^2
            if grad_h is not None:
                grad_h[s:s + chunk] = dz.to(weight.dtype) @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h.to(dz.dtype))
            if grad_b is not None:
                grad_b += dz.sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _check_num_items(num_items: object, reduction: str) -> torch.Tensor | int | None:
    if num_items is None:
        return None
    if reduction != "token":
        raise ValueError("num_items_in_batch is the token count of reduction='token'; the document reduction "
                         "normalises by documents (call document_cross_entropy without it)")
    if isinstance(num_items, torch.Tensor):
        check_tensor(num_items, "num_items_in_batch", "(an integer scalar)")
        if num_items.numel() != 1 or num_items.dtype not in INTEGER_DTYPES:
            raise TypeError(f"num_items_in_batch must be an int or an integer scalar tensor (the number of valid "
                            f"labels of the optimizer step), got a {num_items.dtype} tensor of shape "
                            f"{tuple(num_items.shape)}; build it with cp_packing.count_valid_labels(...)")
        return num_items
    if not is_int(num_items):
        raise TypeError(f"num_items_in_batch must be an int or an integer scalar tensor, got {num_items!r} "
                        f"({type(num_items).__name__}); build it with cp_packing.count_valid_labels(...)")
    return int(num_items)


def _check_shard(sharded: object, cp: CPGroup | None, labels: torch.Tensor, num_labels: int,
                 reduction: str) -> tuple[torch.Tensor, ...]:
    """``sharded`` against the group (size, rank) and the labels (count); returns the global ``cu_seqlens`` and the
    local ``token_index`` (empty tuple without ``sharded``)."""
    cp_size, cp_rank = (1, 0) if cp is None else (cp.size, cp.rank)
    if sharded is None:
        if reduction == "document":
            over = f" over a CP group of {cp_size} ranks" if cp_size > 1 else ""
            raise ValueError(f"reduction='document'{over} needs sharded= this rank's ShardedPackedSeqParams (or, "
                             "without CP, the batch's PackedSeqParams): the segment boundaries of each local token")
        return ()
    if isinstance(sharded, ShardedPackedSeqParams):
        if cp is None and sharded.cp_size > 1:
            counted = sharded.plan is not None and sharded.plan.num_items is not None
            raise ValueError(
                f"sharded.cp_size={sharded.cp_size} but the CP group has 1 ranks (cp_rank={sharded.cp_rank}): "
                f"group=None, which always means no CP (the loss never borrows a prepared step's group); pass "
                f"group=the CP group" + (" (a step's count covers its CP group only: with dp_group= the count is "
                "all-reduced over both)" if counted else ", or prepare the step with labels= (cp_model_inputs of a "
                "dict with 'labels') so that its count divides without communication"))
        check_shard_in_group(sharded.cp_size, sharded.cp_rank, cp_size, cp_rank)
        cu, token_index, where = sharded.global_params.cu_seqlens, sharded.token_index, f"sharded (cp_rank={cp_rank})"
    elif isinstance(sharded, PackedSeqParams):
        if cp_size > 1:
            raise ValueError(f"sharded is the PackedSeqParams of a whole batch, but the CP group has {cp_size} "
                             "ranks; pass this rank's ShardedPackedSeqParams")
        cu, where = sharded.cu_seqlens, "PackedSeqParams (the whole stream)"
        token_index = torch.arange(sharded.total_tokens, device=cu.device)
    else:
        raise TypeError(f"sharded must be a ShardedPackedSeqParams (or the PackedSeqParams of an unsharded batch), "
                        f"got {type(sharded).__name__}; build it with cp_packing.shard_packed_seq_params(...)")
    if token_index.numel() != num_labels:
        raise ValueError(f"{where} describes {token_index.numel()} local tokens but labels hold {num_labels}; pass "
                         "the metadata of this rank's shard of this batch")
    return cu, token_index


def _inspect(labels: torch.Tensor, vocab: int, ignore_index: int,
             num_items: torch.Tensor | int | None) -> int | None:
    """Label values and ``num_items_in_batch``, read back in ONE host sync.

    Raises on a label outside ``[0, V)`` (it would crash inside torch, or device-assert on CUDA) or a
    ``num_items_in_batch`` below this rank's own count. Returns ``num_items_in_batch`` as an int (``None`` when not
    given).
    """
    valid = labels != ignore_index  # [T_local]
    bad = valid & ((labels < 0) | (labels >= vocab))
    zero = torch.zeros((), dtype=torch.int64, device=labels.device)
    bad_at = torch.argmax(bad.to(torch.uint8)) if bad.numel() else zero
    n = num_items.reshape(()).to(device=labels.device, dtype=torch.int64) if isinstance(num_items, torch.Tensor) \
        else zero
    has_bad, bad_at, count, n = torch.stack([x.to(torch.int64) for x in (bad.any(), bad_at, valid.sum(), n)]).tolist()
    if has_bad:
        raise ValueError(f"label {int(labels[bad_at])} at local position {bad_at} is outside [0, {vocab}) and is not "
                         f"ignore_index={ignore_index}; check the vocabulary size (logits' last dim) or ignore_index")
    if num_items is not None:
        n = num_items if isinstance(num_items, int) else n
        if n < count:
            raise ValueError(
                f"num_items_in_batch={n} is smaller than this rank's own {count} valid labels: it must count the "
                "valid labels of every micro-batch of the optimizer step on every CP x DP rank (each once); build "
                "it with cp_packing.count_valid_labels(micro_batch_labels, group=..., dp_group=...)")
    return None if num_items is None else n


_Read = Callable[[int], tuple[_Scores, torch.Tensor]]  # ignore_index -> (scores, labels [T_local]), checked


def _check_local(read: _Read, labels: object, sharded: object, cp: CPGroup | None, dp: CPGroup | None,
                 reduction: object, ignore_index: object, input_ids: object = None,
                 num_items: object = None) -> tuple[_Local, dict[str, object]]:
    """Every rank-local check (no communication); returns the inputs and the fields every rank must share."""
    reduction = check_choice(reduction, "reduction", _REDUCTIONS)
    ignore_index = check_ignore_index(ignore_index)
    scores, labels1d = read(ignore_index)
    num_items = _check_num_items(num_items, reduction)
    ids = None
    if input_ids is not None:
        ids = check_same_batch(input_ids, "input_ids", labels, "labels", "[T_local] (this rank's input ids)")
        ids = ids.reshape(-1).to(torch.int64)
    shard = _check_shard(sharded, cp, labels, labels1d.numel(), reduction)
    segment, num_segments, segment_end, next_known = None, 0, None, None
    if shard:
        cu, token_index = (t.to(device=scores.device, dtype=torch.int64) for t in shard)
        segment = torch.searchsorted(cu, token_index, right=True) - 1  # [T_local]
        num_segments = int(cu.numel()) - 1
        segment_end = segment_ends(cu, token_index)  # [T_local]: the last token of its global segment
        next_known = token_index[1:] == token_index[:-1] + 1  # [T_local - 1]: local neighbours are global ones
    elif ids is not None:  # no metadata: the labels are the whole stream without CP, unknown order with CP
        next_known = torch.full((max(labels1d.numel() - 1, 0),), cp is None or cp.size == 1, device=ids.device)
    num_items = _inspect(labels1d, scores.vocab, ignore_index, num_items)
    if segment_end is not None or ids is not None:
        check_labels_shifted(labels1d, input_ids=ids, segment_end=segment_end, next_known=next_known,
                             ignore_index=ignore_index)
    fields: dict[str, object] = {
        "reduction": reduction, "vocab size": scores.vocab, "logits dtype": str(scores.dtype),
        "ignore_index": ignore_index, "cp size": 1 if cp is None else cp.size,
        "dp size": None if dp is None else dp.size, "num_items_in_batch": num_items,
        "layout": getattr(sharded, "layout", None), "global segments": len(shard[0]) - 1 if shard else None,
        "global cu_seqlens (digest)": digest(shard[0]) if shard else None,
    }
    return _Local(scores, labels1d, segment if reduction == "document" else None, num_segments, num_items), fields


_DP_FIELDS = ("reduction", "vocab size", "logits dtype", "ignore_index", "cp size", "num_items_in_batch")


def _groups(cp: CPGroup | None, dp: CPGroup | None) -> tuple:
    """The ``fail_together`` groups of a loss call: the CP group, then the DP group (which learns a CP group's
    failure too, so no DP peer waits for a replica that raised)."""
    return (None if cp is None else cp.group, "CP group"), (None if dp is None else dp.group, "DP group")


def _checked(read: _Read, labels: object, *, group: GroupLike, dp_group: GroupLike, sharded: object,
             reduction: object, ignore_index: object, input_ids: object = None,
             num_items: object = None) -> tuple[_Local, CPGroup | None, CPGroup | None]:
    cp = resolve_group(group, name="group", optional=True)
    dp = resolve_group(dp_group, name="dp_group", optional=True)
    with fail_together(_CALL, *_groups(cp, dp)) as agreement:
        local, fields = _check_local(read, labels, sharded, cp, dp, reduction, ignore_index, input_ids, num_items)
        agreement.fields = fields
        agreement.group_fields["DP group"] = {k: fields[k] for k in _DP_FIELDS if k in fields}
    return local, cp, dp


def _all_reduce_sum(t: torch.Tensor, group: CPGroup | None) -> torch.Tensor:
    if group is not None and group.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group.group)
    return t


def _cross_entropy(local: _Local, ignore_index: int) -> torch.Tensor:
    """float32 CE per local token ``[T_local]``; exactly 0 at ignored positions (still connected to the inputs)."""
    return local.scores.ce(local.labels, ignore_index)


# ----------------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------------


def packed_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: GroupLike = None,
    dp_group: GroupLike = None,
    sharded: ShardedPackedSeqParams | PackedSeqParams | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "token",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Token-mean cross-entropy of this rank's tokens over the GLOBAL count of valid labels: this rank's share.

    ``share = sum of CE over local valid labels / N``. The one rule for ``N`` (docs/loss.md, section 2):
    ``num_items_in_batch`` when given (the optimizer step's count, :func:`count_valid_labels`); else the prepared
    step's count (``sharded=`` a step prepared with labels, and no ``dp_group``); else this call's valid labels
    all-reduced over ``group``, then ``dp_group``. A collective (the agreement, and in the last case the count
    all-reduce) runs iff ``group`` or ``dp_group`` is given; without them the call is local math. ``group=None``
    always means no CP: a prepared step never lends its group. The shares sum to the non-CP loss and their gradients
    to the non-CP gradient (docs/loss.md: the contract, DP, FSDP and gradient accumulation). Every rank of ``group``
    and ``dp_group`` must call it.

    Args:
        logits: floating ``[T_local, V]`` (or ``[1, T_local, V]``); the CE is computed in float32.
        labels: integer ``[T_local]`` (or ``[1, T_local]``), this rank's shard of :func:`next_token_labels` (shifted
            on the global stream; HF's unshifted labels go through ``next_token_labels(..., labels=)`` first).
        group: the CP ProcessGroup or 1-D DeviceMesh; ``None``: no CP (the world, or a prepared step's group, is
            never assumed). A CP shard (``sharded`` of ``cp_size > 1``) needs it unless ``N`` is given (the step's
            count or ``num_items_in_batch``).
        dp_group: the DP group to normalise over as well, or ``None``.
        sharded: this rank's ``ShardedPackedSeqParams`` (optional): checked against ``group`` (size, rank) and the
            labels, and its batch and layout against the other ranks'; it also lets the loss see segment ends.
        num_items_in_batch: optional int or integer scalar tensor (HF's name): the number of valid labels over all
            micro-batches of the optimizer step and all CP x DP ranks. Wins over the step's count and the all-reduce:
            the share is ``local sum / num_items_in_batch``; every rank must pass the same value, at least its own
            count (compared across ``group`` / ``dp_group`` when given; without them nothing is compared).
        input_ids: optional integer, the shape of ``labels``: this rank's input ids, used only to warn when the
            labels equal them (unshifted labels).
        ignore_index: the label value to ignore.
        reduction: ``"token"``; ``"document"`` is :func:`document_cross_entropy` (kept: the chunked loss's only way
            to the per-document mean; never takes ``num_items_in_batch`` or the step's count).
        label_smoothing: ``eps`` in ``[0, 1]``, ``F.cross_entropy``'s (and HF's ``label_smoothing_factor``): each
            token's CE is ``(1 - eps) * nll + eps * mean over the vocabulary of -log p``.

    Returns:
        float32 scalar on ``logits.device``; 0 (not NaN, still differentiable) when no label is valid.

    Raises:
        TypeError / ValueError: on EVERY rank of both groups when any rank's inputs are wrong or differ (vocabulary,
        dtype, reduction, batch, ``num_items_in_batch``, a label outside ``[0, V)``, shard labels without their
        group). Communication: one ``agree`` per group, and one int64 all-reduce per group unless
        ``num_items_in_batch`` is given. Host syncs: one (the label check; ``num_items_in_batch`` is read in it), and
        a digest of ``cu_seqlens`` with ``sharded``.

    Warns:
        LabelsWarning (once per process): labels that look unshifted (equal to ``input_ids`` at every valid
        position, or, with ``sharded``, a valid label on the last token of a segment).

    >>> round(float(packed_cross_entropy(torch.zeros(4, 3), torch.tensor([0, 2, -100, 1]))), 4)  # ln 3
    1.0986
    >>> round(float(packed_cross_entropy(torch.zeros(4, 3), torch.tensor([0, 2, -100, 1]), num_items_in_batch=6)), 4)
    0.5493
    """
    read = functools.partial(_check_logits_and_labels, logits, labels, label_smoothing=label_smoothing)
    return _loss(read, labels, group=group, dp_group=dp_group, sharded=sharded, num_items=num_items_in_batch,
                 input_ids=input_ids, ignore_index=ignore_index, reduction=reduction)


def packed_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    group: GroupLike = None,
    dp_group: GroupLike = None,
    sharded: ShardedPackedSeqParams | PackedSeqParams | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "token",
    label_smoothing: float = 0.0,
    final_logit_softcapping: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """:func:`packed_cross_entropy` of ``logits = hidden @ weight.T (+ bias)`` without building the ``[T, V]`` logits.

    The output projection and the cross-entropy run over chunks of ``chunk_size`` tokens (a custom autograd
    function: each chunk's logits are made in the weight's dtype, as the model's ``lm_head`` does, and scored in
    float32; backward recomputes them chunk by chunk from the saved log-sum-exp), so the loss holds one chunk's
    ``[C, V]`` at a time. Same share, count rules, checks and agreement as :func:`packed_cross_entropy`
    (docs/loss.md, "A loss without the logits"). Pure torch: it runs on CPU and any GPU.

    Args:
        hidden: floating ``[T_local, D]`` (or ``[1, T_local, D]``): the final hidden states (after the final norm),
            this rank's tokens.
        weight: the output projection ``[V, D]`` (``model.get_output_embeddings().weight``), ``hidden``'s dtype.
        labels, group, dp_group, sharded, num_items_in_batch, input_ids, ignore_index, reduction, label_smoothing:
            as :func:`packed_cross_entropy`.
        bias: the projection's bias ``[V]``, or ``None``.
        final_logit_softcapping: ``cap`` > 0 (Gemma 2's config value): the logits become ``cap * tanh(logits /
            cap)``, per chunk; ``None``: none.
        chunk_size: tokens per chunk; ``None``: :func:`default_chunk_size` (one chunk's logits about the size of
            ``hidden``).

    Returns:
        float32 scalar on ``hidden.device``: this rank's share (0, still differentiable, when no label is valid).

    Raises:
        TypeError / ValueError (on every rank of the groups, as :func:`packed_cross_entropy`): also a weight that is
        not ``[V, D]`` with ``hidden``'s ``D``, dtype and device, a label outside ``[0, V)``, ``chunk_size < 1``.

    >>> hidden, weight = torch.zeros(4, 2), torch.zeros(3, 2)  # every logit 0
    >>> round(float(packed_linear_cross_entropy(hidden, weight, torch.tensor([0, 2, -100, 1]))), 4)  # ln 3
    1.0986
    """
    read = functools.partial(_check_linear_and_labels, hidden, weight, bias, labels, label_smoothing=label_smoothing,
                             softcap=final_logit_softcapping, chunk_size=chunk_size)
    return _loss(read, labels, group=group, dp_group=dp_group, sharded=sharded, num_items=num_items_in_batch,
                 input_ids=input_ids, ignore_index=ignore_index, reduction=reduction)


def _loss(read: _Read, labels: object, *, group: GroupLike, dp_group: GroupLike, sharded: object, num_items: object,
          input_ids: object, ignore_index: object, reduction: object) -> torch.Tensor:
    """The token (or document) loss of ``read``'s scores, by the one rule of :func:`packed_cross_entropy`: the
    denominator is ``num_items_in_batch``, else the prepared step's count (without ``dp_group``), else the count
    all-reduced over ``group`` / ``dp_group``; a collective runs iff ``group`` or ``dp_group`` is given."""
    plan = sharded.plan if isinstance(sharded, ShardedPackedSeqParams) else None
    if plan is not None:
        plan.check_ran()
        if num_items is None and reduction == "token" and dp_group is None and plan.num_items is not None:
            num_items = plan.num_items  # the prepared step's count (its CP group's labels, summed in its agreement)
    if reduction == "token" and group is None and dp_group is None and num_items is not None:
        return _local_loss(read, labels, num_items, input_ids, ignore_index, sharded)
    if reduction == "document":
        return _document_cross_entropy(read, labels, group=group, dp_group=dp_group, sharded=sharded,
                                       ignore_index=ignore_index, input_ids=input_ids, num_items=num_items)
    local, cp, dp = _checked(read, labels, group=group, dp_group=dp_group, sharded=sharded, reduction=reduction,
                             ignore_index=ignore_index, input_ids=input_ids, num_items=num_items)
    if local.num_items is None:
        count = local_label_count([local.labels], ignore_index).reshape(1)  # this rank's tokens, counted once
        denominator = _all_reduce_sum(_all_reduce_sum(count, cp), dp).clamp_min(1).to(torch.float32)[0]
    else:
        denominator = torch.tensor(float(max(local.num_items, 1)), dtype=torch.float32, device=local.scores.device)
    return _cross_entropy(local, ignore_index).sum() / denominator


def _local_loss(read, labels, num_items, input_ids, ignore_index, sharded) -> torch.Tensor:
    """The loss as local math: this rank's CE sum over the step's count (no communication, no agreement)."""
    ignore_index = check_ignore_index(ignore_index)
    scores, labels1d = read(ignore_index)
    n = _check_num_items(num_items, "token")
    if labels1d.device.type == "cpu":  # free on the host; on a GPU the kernel's device assert names a bad label
        _inspect(labels1d, scores.vocab, ignore_index, n)
    if input_ids is not None:
        ids = check_same_batch(input_ids, "input_ids", labels, "labels", "[T_local] (this rank's input ids)")
        segment_end = None
        if isinstance(sharded, ShardedPackedSeqParams):
            segment_end = segment_ends(sharded.global_params.cu_seqlens, sharded.token_index.to(labels1d.device))
        check_labels_shifted(labels1d, input_ids=ids, segment_end=segment_end, ignore_index=ignore_index,
                             next_known=None if sharded is None else (sharded.token_index[1:] ==
                                                                       sharded.token_index[:-1] + 1).to(ids.device))
    total = scores.ce(labels1d, ignore_index).sum()
    if isinstance(n, torch.Tensor):
        return total / n.to(device=total.device, dtype=torch.float32).clamp_min(1).reshape(())
    return total / float(max(int(n), 1))


def document_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    sharded: ShardedPackedSeqParams | PackedSeqParams,
    group: GroupLike = None,
    dp_group: GroupLike = None,
    input_ids: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-document mean cross-entropy (every document weighs the same), as this rank's share of the global value.

    ``loss = mean over documents d of (mean CE over d's valid labels)``; a document is a segment with a valid
    label. Each local token's global segment comes from ``sharded``; the per-segment counts are all-reduced over
    ``group``, the number of documents over ``dp_group`` (docs/loss.md).

    Args:
        logits, labels, group, dp_group, input_ids, ignore_index: as :func:`packed_cross_entropy`.
        sharded: this rank's ``ShardedPackedSeqParams``; without CP, the batch's ``PackedSeqParams``.

    Returns:
        float32 scalar on ``logits.device``; 0 (not NaN, still differentiable) when no label is valid.

    Raises:
        As :func:`packed_cross_entropy`; every rank must hold a shard of the same batch (its ``cu_seqlens`` are
        compared by digest). Communication: one ``agree`` per group, one ``[num_segments]`` int64 all-reduce over
        ``group`` and one scalar over ``dp_group``.

    >>> from cp_packing.packed_seq import packed_seq_params_from_doc_ids
    >>> params = packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2]]))
    >>> logits = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [9.0, 0.0], [0.0, 0.0]])
    >>> round(float(document_cross_entropy(logits, torch.tensor([0, 1, -100, 0, -100]), sharded=params)), 4)
    0.3466
    """
    read = functools.partial(_check_logits_and_labels, logits, labels)
    return _document_cross_entropy(read, labels, group=group, dp_group=dp_group, sharded=sharded,
                                   ignore_index=ignore_index, input_ids=input_ids, num_items=None)


def _document_cross_entropy(read: _Read, labels: object, *, group: GroupLike, dp_group: GroupLike,
                            sharded: object, ignore_index: object, input_ids: object,
                            num_items: object) -> torch.Tensor:
    local, cp, dp = _checked(read, labels, group=group, dp_group=dp_group, sharded=sharded, reduction="document",
                             ignore_index=ignore_index, input_ids=input_ids, num_items=num_items)
    valid = (local.labels != ignore_index).to(torch.int64)  # [T_local]
    counts = torch.zeros(local.num_segments, dtype=torch.int64, device=valid.device)  # [num_segments]
    _all_reduce_sum(counts.scatter_add_(0, local.segment, valid), cp)  # valid labels per global segment
    num_docs = _all_reduce_sum((counts > 0).sum().to(torch.int64).reshape(1), dp)  # [1]
    weight = 1.0 / counts.gather(0, local.segment).clamp_min(1).to(torch.float32)  # [T_local]; ignored: CE == 0
    return (_cross_entropy(local, ignore_index) * weight).sum() / num_docs.clamp_min(1).to(torch.float32)[0]


def reduce_loss_for_logging(loss: torch.Tensor, *, group: GroupLike = None,
                            dp_group: GroupLike = None) -> torch.Tensor:
    """The global loss from the per-rank shares of :func:`packed_cross_entropy`, detached, for logging.

    All-reduce SUM of the shares over ``group`` and (when the loss was normalised over DP too) ``dp_group``; every
    rank of those groups must call it and gets the same float32 scalar. Starts with one ``agree`` per group.

    >>> reduce_loss_for_logging(torch.tensor(2.5, requires_grad=True))  # no group: the share is the loss
    tensor(2.5000)
    """
    cp = resolve_group(group, name="group", optional=True)
    dp = resolve_group(dp_group, name="dp_group", optional=True)
    with fail_together("reduce_loss_for_logging", *_groups(cp, dp)) as agreement:
        agreement.fields = {"dp size": None if dp is None else dp.size}
        check_tensor(loss, "loss", "(a scalar share from packed_cross_entropy)")
        if loss.numel() != 1 or not loss.is_floating_point():
            raise TypeError(f"loss must be a floating scalar tensor (a share from packed_cross_entropy), got {loss!r}")
    out = loss.detach().to(torch.float32).reshape(1).clone()
    return _all_reduce_sum(_all_reduce_sum(out, cp), dp)[0]


# ----------------------------------------------------------------------------------------------------------------
# Gradient accumulation: one count for the whole optimizer step
# ----------------------------------------------------------------------------------------------------------------


def _micro_batches(labels: object) -> list[torch.Tensor]:
    items = [labels] if isinstance(labels, torch.Tensor) else labels
    if not isinstance(items, (list, tuple)) or not items:
        raise TypeError(f"labels must be a tensor or a non-empty list of tensors (the labels of every micro-batch of "
                        f"the optimizer step), got {type(labels).__name__}")
    for i, x in enumerate(items):
        check_tensor(x, f"labels[{i}]", "(integer labels of one micro-batch)")
        if x.dtype not in INTEGER_DTYPES:
            raise TypeError(f"labels[{i}] must have an integer dtype, got {x.dtype}; pass the labels, not the logits")
    return list(items)


def count_valid_labels(
    labels: torch.Tensor | Sequence[torch.Tensor],
    *,
    ignore_index: int = -100,
    group: GroupLike = None,
    dp_group: GroupLike = None,
) -> int:
    """The number of valid labels of an optimizer step: THE count (HF's ``num_items_in_batch``) of cp-packing.

    Sum over the micro-batches ``labels`` of the valid labels (compared as int64 values:
    ``labels.local_label_count``), on the labels' device, all-reduced over ``group`` and then ``dp_group``. The step
    plan (its local part), the loader's ``num_items_in_batch``, the trainers and the launcher all count with it. Pass it to every micro-batch's ``packed_cross_entropy(..., num_items_in_batch=n)``: each share is
    ``local sum / n``, so the gradients accumulated over the micro-batches and SUMMED over all ranks equal the
    gradient of the one big batch (docs/loss.md, section "Gradient accumulation"). Call it once per optimizer step,
    before the first micro-batch's forward, on every rank of both groups.

    Which group depends on what a rank holds (counting a token twice halves its weight, silently):

    - every CP rank of a replica holds the replica's WHOLE batches (the same labels on every CP rank, e.g. from a
      DP x CP loader): count them and reduce over DP only, ``group=None, dp_group=mesh["dp"]``;
    - each rank holds its CP shards (``sharded.shard(labels)``, ``distribute_batch``): reduce over both,
      ``group=mesh["cp"], dp_group=mesh["dp"]``.

    Whole batches counted with ``group`` raise on every rank (every CP rank holds equal labels: compared by
    digest). The inputs are explicit: with ``group`` the labels are this rank's shards, without it whole batches;
    shards counted without their group cannot be told from whole batches (count them with ``group=``, or use the
    step plan's count: ``prepare_attention(..., labels=)`` / ``cp_model_inputs``).

    Args:
        labels: one tensor or a list of integer tensors, any shape: every micro-batch of this optimizer step
            (shifted labels, from :func:`next_token_labels`, or their shards).
        ignore_index: the label value to ignore.
        group: the CP group, when ``labels`` are shards; else ``None``.
        dp_group: the DP group, or ``None`` without data parallelism.

    Returns:
        int, equal on every rank of both groups.

    Raises:
        TypeError / ValueError on every rank of both groups (one ``agree`` per group first): labels that are not
        integer tensors, a group that does not fit what the labels are, ranks that disagree on ``ignore_index`` or
        the number of micro-batches. Communication: the agreements and one int64 all-reduce per group; one host sync
        (the result), plus with ``group`` one more and, for whole batches, a digest of the labels (copied to the host).

    >>> count_valid_labels([torch.tensor([[5, -100, 7]]), torch.tensor([[-100, 2, 2]])])
    4
    """
    cp = resolve_group(group, name="group", optional=True)
    dp = resolve_group(dp_group, name="dp_group", optional=True)
    return int(count_step(labels, ignore_index=ignore_index, cp=cp, dp=dp)[0])


def count_step(labels: object, *, ignore_index: object, cp: CPGroup | None, dp: CPGroup | None,
                     call: str = "count_valid_labels", error: BaseException | None = None,
                     dp_fields: dict | None = None) -> torch.Tensor:
    """:func:`count_valid_labels` as an int64 ``[1]`` tensor on the groups' device (the one count; the loader's
    ``num_items_in_batch`` calls it with its own ``call`` name, an ``error`` of its own inputs to raise on every rank,
    and ``dp_fields`` its DP peers must share)."""
    fields, local = {}, None
    try:  # the CP group first: its checks, then whether its ranks hold the same labels (whole batches)
        with fail_together(call, _groups(cp, None)[0]) as agreement:
            if error is not None:
                raise error
            ignore_index = check_ignore_index(ignore_index)
            items = _micro_batches(labels)
            shards = cp is not None and cp.size > 1  # with a CP group the labels are this rank's shards
            fields = {"ignore_index": ignore_index, "micro-batches": len(items), "labels are CP shards": shards,
                      "cp size": 1 if cp is None else cp.size, "dp size": None if dp is None else dp.size,
                      **(dp_fields or {})}
            local = local_label_count(items, ignore_index)  # int64 scalar on the labels' device, no host sync
            agreement.fields = fields
            if shards and int(local) > 0:  # equal on every CP rank: whole batches, not shards (one host sync)
                agreement.payload = digest(*items)
        records = agreement.records.get("CP group", [])
        if agreement.payload is not None and len(records) > 1 and all(r.payload == agreement.payload
                                                                       for r in records):
            raise ValueError(
                f"{call} got group= (a CP group of {cp.size} ranks) but every CP rank holds the same "
                "labels: whole batches, whose count the CP all-reduce would multiply by "
                f"{cp.size}. Count whole batches with group=None, dp_group=the DP group; pass group= only for "
                "each rank's shards")
        error = None
    except Exception as exc:  # noqa: BLE001 - the DP group must learn it
        error = exc
    with fail_together(call, _groups(None, dp)[1]) as agreement:  # then the DP group, which learns any CP error
        shared = ("ignore_index", "labels are CP shards", "cp size", "dp size", *(dp_fields or {}))
        agreement.fields = {k: fields[k] for k in shared if k in fields}  # not the micro-batch count
        if error is not None:
            raise error
    device = cp.device if cp is not None else dp.device if dp is not None else local.device
    return _all_reduce_sum(_all_reduce_sum(local.reshape(1).to(device), cp), dp)
