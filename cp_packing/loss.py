"""Labels shifted on the global stream, and cross-entropy losses normalised by global counts (docs/loss.md).

Two rules make the context-parallel loss equal the non-CP loss:

1. shift labels on the GLOBAL stream, before sharding (:func:`next_token_labels`): shifting a shard pairs tokens
   that are not neighbours at every shard or zigzag chunk edge, silently;
2. divide each rank's SUM of cross-entropy by a GLOBAL count, all-reduced once (:func:`packed_cross_entropy`: valid
   tokens; :func:`document_cross_entropy`: valid tokens per document, and documents). Each rank returns its share:
   the shares sum to the non-CP loss and their gradients to the non-CP gradient.

Fail together: every rank-local check runs first and its failure goes into ONE ``agreement.agree`` per group
before any all-reduce, so a mistake on one rank (a wrong ``cp_rank``, another vocabulary, dtype, reduction or
batch, a bad label) raises the same error on every rank instead of leaving the others in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing._checks import INTEGER_DTYPES, check_choice, check_doc_ids, check_int, check_tensor
from cp_packing.agreement import agree, digest
from cp_packing.groups import CPGroup, GroupLike, check_shard_in_group, resolve_group
from cp_packing.packed_seq import PackedSeqParams
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["document_cross_entropy", "next_token_labels", "packed_cross_entropy", "reduce_loss_for_logging"]

_CALL = "packed_cross_entropy"  # one call name for both reductions: a mix is reported as a `reduction` mismatch
_REDUCTIONS = ("token", "document")
_INT64 = {"min": -(2**63), "max": 2**63 - 1}


# ----------------------------------------------------------------------------------------------------------------
# Labels on the global stream
# ----------------------------------------------------------------------------------------------------------------


def next_token_labels(
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor | PackedSeqParams,
    *,
    token_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token labels of a neat-packed batch, on the GLOBAL ``[B, S]`` stream, before sharding.

    ``labels[b, s] = input_ids[b, s + 1]`` when token ``s + 1`` is in token ``s``'s segment (same row, same
    document index: the seed's segments), else ``ignore_index``: the last token of every document and of every row,
    and every padding token, get ``ignore_index``. Why before sharding: see docs/loss.md.

    Args:
        input_ids: ``[B, S]``, any integer dtype.
        doc_ids: ``[B, S]`` integer document map (0 = padding), or its ``PackedSeqParams``. Same shape and device.
        token_mask: optional bool ``[B, S]``, False for tokens that get no label and are nobody's label (e.g. pad
            tokens that ``pad_segments`` placed inside a document).
        ignore_index: the int value of a masked label.

    Returns:
        int64 ``[B, S]`` labels on ``input_ids.device``.

    >>> next_token_labels(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1, 1, 2, 2]])).tolist()
    [[11, -100, 13, -100]]
    """
    if isinstance(doc_ids, PackedSeqParams):
        doc_ids = doc_ids.doc_ids
    check_doc_ids(doc_ids)
    check_tensor(input_ids, "input_ids", "[batch, sequence]")
    ignore_index = check_int(ignore_index, "ignore_index", **_INT64, hint="the label value to ignore, e.g. -100")
    if input_ids.dtype not in INTEGER_DTYPES:
        raise TypeError(f"input_ids must have an integer dtype, got {input_ids.dtype}; convert with .long()")
    if input_ids.shape != doc_ids.shape:
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} does not match doc_ids shape "
                         f"{tuple(doc_ids.shape)}; both must be the same global [B, S] batch (label before sharding)")
    if input_ids.device != doc_ids.device:
        raise ValueError(f"input_ids is on {input_ids.device} but doc_ids on {doc_ids.device}; use one device")
    if token_mask is not None:
        check_tensor(token_mask, "token_mask", "(bool [B, S])")
        if token_mask.dtype != torch.bool:
            raise TypeError(f"token_mask must be a bool tensor [B, S], got {token_mask.dtype}; build it with x != pad")
        if token_mask.shape != doc_ids.shape:
            raise ValueError(f"token_mask shape {tuple(token_mask.shape)} does not match doc_ids shape "
                             f"{tuple(doc_ids.shape)}")
        token_mask = token_mask.to(doc_ids.device)

    labels = torch.full(input_ids.shape, ignore_index, dtype=torch.int64, device=input_ids.device)  # [B, S]
    if input_ids.shape[1] < 2:
        return labels
    same_segment = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] != 0)  # [B, S-1]: runs within a row
    if token_mask is not None:
        same_segment &= token_mask[:, 1:] & token_mask[:, :-1]
    labels[:, :-1] = torch.where(same_segment, input_ids[:, 1:].to(torch.int64), labels[:, :-1])
    return labels


# ----------------------------------------------------------------------------------------------------------------
# Local checks, then one agreement per group
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Local:
    """This rank's checked inputs."""

    logits: torch.Tensor  # [T_local, V] floating
    labels: torch.Tensor  # int64 [T_local], each ignore_index or in [0, V)
    segment: torch.Tensor | None  # int64 [T_local], global segment of each local token (document reduction)
    num_segments: int


def _check_logits_and_labels(logits: object, labels: object, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The one label check: dtypes, shapes, device, and every label ``ignore_index`` or in ``[0, V)`` (a host
    sync: an out-of-range label would crash inside torch, or device-assert on CUDA)."""
    check_tensor(logits, "logits", "[T_local, V]")
    check_tensor(labels, "labels", "[T_local]")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor [T_local, V], got dtype {logits.dtype}")
    if labels.dtype not in INTEGER_DTYPES:
        raise TypeError(f"labels must have an integer dtype (class index, {ignore_index} = ignored), got "
                        f"{labels.dtype}; build them with cp_packing.next_token_labels(...) or use labels.long()")
    if logits.dim() < 2 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match labels shape {tuple(labels.shape)}; "
                         "expected logits [T_local, V] with labels [T_local] (or [1, T_local, V] with [1, T_local])")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}; move them to one device")
    vocab = logits.shape[-1]
    flat = labels.reshape(-1).to(torch.int64)  # [T_local]
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(f"label {int(flat[pos])} at local position {pos} is outside [0, {vocab}) and is not "
                         f"ignore_index={ignore_index}; check the vocabulary size (logits' last dim) or ignore_index")
    return logits.reshape(-1, vocab), flat


def _check_shard(sharded: object, cp: CPGroup | None, num_labels: int, reduction: str) -> tuple[torch.Tensor, ...]:
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


def _check_local(logits: object, labels: object, sharded: object, cp: CPGroup | None, dp: CPGroup | None,
                 reduction: object, ignore_index: object) -> tuple[_Local, dict[str, object]]:
    """Every rank-local check (no communication); returns the inputs and the fields every rank must share."""
    reduction = check_choice(reduction, "reduction", _REDUCTIONS)
    ignore_index = check_int(ignore_index, "ignore_index", **_INT64, hint="the label value to ignore, e.g. -100")
    logits2d, labels1d = _check_logits_and_labels(logits, labels, ignore_index)
    shard = _check_shard(sharded, cp, labels1d.numel(), reduction)
    segment, num_segments = None, 0
    if shard and reduction == "document":
        cu, token_index = (t.to(device=logits2d.device, dtype=torch.int64) for t in shard)
        segment = torch.searchsorted(cu, token_index, right=True) - 1  # [T_local]
        num_segments = int(cu.numel()) - 1
    fields: dict[str, object] = {
        "reduction": reduction, "vocab size": int(logits2d.shape[-1]), "logits dtype": str(logits2d.dtype),
        "ignore_index": ignore_index, "cp size": 1 if cp is None else cp.size,
        "dp size": None if dp is None else dp.size,
        "layout": getattr(sharded, "layout", None), "global segments": len(shard[0]) - 1 if shard else None,
        "global cu_seqlens (digest)": digest(shard[0]) if shard else None,
    }
    return _Local(logits2d, labels1d, segment, num_segments), fields


_DP_FIELDS = ("reduction", "vocab size", "logits dtype", "ignore_index", "cp size")


def _agree(call: str, cp: CPGroup | None, dp: CPGroup | None, fields: dict[str, object],
           error: Exception | None) -> None:
    """One agreement over the CP group, then one over the DP group (which learns a CP group's failure too, so no
    DP peer waits for a replica that raised). Raises the same error on every rank of both groups."""
    if cp is not None:
        try:
            agree(cp.group, call, fields, error=error, group_name="CP group")
        except Exception as exc:  # noqa: BLE001 - every rank of this CP group holds it; the DP group must learn it
            if dp is None:
                raise
            error = exc
    if dp is not None:
        agree(dp.group, call, {k: fields[k] for k in _DP_FIELDS if k in fields}, error=error, group_name="DP group")
    elif error is not None:
        raise error


def _checked(logits: object, labels: object, *, group: GroupLike, dp_group: GroupLike, sharded: object,
             reduction: object, ignore_index: object) -> tuple[_Local, CPGroup | None, CPGroup | None]:
    cp = resolve_group(group, name="group", optional=True)
    dp = resolve_group(dp_group, name="dp_group", optional=True)
    local, fields, error = None, {}, None
    try:
        local, fields = _check_local(logits, labels, sharded, cp, dp, reduction, ignore_index)
    except Exception as exc:  # noqa: BLE001 - goes into the agreement: raised on every rank
        error = exc
    _agree(_CALL, cp, dp, fields, error)
    return local, cp, dp


def _all_reduce_sum(t: torch.Tensor, group: CPGroup | None) -> torch.Tensor:
    if group is not None and group.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group.group)
    return t


def _cross_entropy(local: _Local, ignore_index: int) -> torch.Tensor:
    """float32 CE per local token ``[T_local]``; exactly 0 at ignored positions (still connected to the logits)."""
    return F.cross_entropy(local.logits.float(), local.labels, ignore_index=ignore_index, reduction="none")


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
    ignore_index: int = -100,
    reduction: str = "token",
) -> torch.Tensor:
    """Token-mean cross-entropy of this rank's tokens over the GLOBAL count of valid labels: this rank's share.

    ``share = sum of CE over local valid labels / N``, ``N`` the valid labels of the whole batch (all-reduced over
    ``group``, then ``dp_group``): the shares sum to the non-CP loss and their gradients to the non-CP gradient
    (docs/loss.md: the contract, DP and FSDP). Every rank of ``group`` and ``dp_group`` must call it.

    Args:
        logits: floating ``[T_local, V]`` (or ``[1, T_local, V]``); the CE is computed in float32.
        labels: integer ``[T_local]`` (or ``[1, T_local]``), this rank's shard of :func:`next_token_labels`.
        group: the CP ProcessGroup or 1-D DeviceMesh; ``None``: no CP (the world is never assumed).
        dp_group: the DP group to normalise over as well, or ``None``.
        sharded: this rank's ``ShardedPackedSeqParams`` (optional): checked against ``group`` (size, rank) and the
            labels, and its batch and layout against the other ranks'.
        ignore_index: the label value to ignore.
        reduction: ``"token"``; ``"document"`` is :func:`document_cross_entropy` (kept for compatibility).

    Returns:
        float32 scalar on ``logits.device``; 0 (not NaN, still differentiable) when no label is valid.

    Raises:
        TypeError / ValueError: on EVERY rank of both groups when any rank's inputs are wrong or differ (vocabulary,
        dtype, reduction, batch, a label outside ``[0, V)``). Communication: one ``agree`` and one int64 all-reduce
        per group. Host syncs: the label check (and a digest of ``cu_seqlens`` with ``sharded``).

    >>> round(float(packed_cross_entropy(torch.zeros(4, 3), torch.tensor([0, 2, -100, 1]))), 4)  # ln 3
    1.0986
    """
    if reduction == "document":
        return document_cross_entropy(logits, labels, group=group, dp_group=dp_group, sharded=sharded,
                                      ignore_index=ignore_index)
    local, cp, dp = _checked(logits, labels, group=group, dp_group=dp_group, sharded=sharded, reduction=reduction,
                             ignore_index=ignore_index)
    count = (local.labels != ignore_index).sum().to(torch.int64).reshape(1)  # this rank's tokens, counted once
    _all_reduce_sum(_all_reduce_sum(count, cp), dp)
    return _cross_entropy(local, ignore_index).sum() / count.clamp_min(1).to(torch.float32)[0]


def document_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    sharded: ShardedPackedSeqParams | PackedSeqParams,
    group: GroupLike = None,
    dp_group: GroupLike = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-document mean cross-entropy (every document weighs the same), as this rank's share of the global value.

    ``loss = mean over documents d of (mean CE over d's valid labels)``; a document is a segment with a valid
    label. Each local token's global segment comes from ``sharded``; the per-segment counts are all-reduced over
    ``group``, the number of documents over ``dp_group`` (docs/loss.md).

    Args:
        logits, labels, group, dp_group, ignore_index: as :func:`packed_cross_entropy`.
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
    local, cp, dp = _checked(logits, labels, group=group, dp_group=dp_group, sharded=sharded, reduction="document",
                             ignore_index=ignore_index)
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
    error = None
    try:
        check_tensor(loss, "loss", "(a scalar share from packed_cross_entropy)")
        if loss.numel() != 1 or not loss.is_floating_point():
            raise TypeError(f"loss must be a floating scalar tensor (a share from packed_cross_entropy), got {loss!r}")
    except (TypeError, ValueError) as exc:
        error = exc
    _agree("reduce_loss_for_logging", cp, dp, {"dp size": None if dp is None else dp.size}, error)
    out = loss.detach().to(torch.float32).reshape(1).clone()
    return _all_reduce_sum(_all_reduce_sum(out, cp), dp)[0]
