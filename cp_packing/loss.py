"""Loss masking and a context-parallel-exact cross-entropy for packed batches.

Two rules make the CP loss equal the non-CP loss:

1. **Shift labels on the global stream, before sharding** (:func:`next_token_labels`). The label of token ``s`` is
   token ``s + 1``; after sharding, ``s + 1`` may live on another rank (a shard edge, or a zigzag chunk edge where
   the next local token is thousands of positions further on). Shifting a local shard therefore pairs tokens that
   are not neighbours and drops the label at every shard edge: silently wrong, with no error anywhere. Shifted
   globally, a label is just one more per-token tensor that shards like ``input_ids``.
2. **Divide by a global count** (:func:`packed_cross_entropy`). Each CP rank sums the cross-entropy of its own
   tokens and divides by the number of valid labels of the whole (CP, and optionally DP) batch, all-reduced once,
   each token counted once. The per-rank values are *shares*: they sum to the non-CP loss, and their gradients sum
   to the non-CP gradient.

``loss.py`` sits above ``distributed.py`` in the house plan: it calls ``torch.distributed`` collectives, but never
imports transformers, flash_attn or ring_flash_attn.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_packing._checks import INTEGER_DTYPES, check_doc_ids
from cp_packing.groups import resolve_group
from cp_packing.packed_seq import PackedSeqParams

__all__ = ["next_token_labels", "packed_cross_entropy", "reduce_loss_for_logging"]

_REDUCTIONS = ("token", "document")


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
    """Next-token labels of a neat-packed batch, computed on the GLOBAL ``[B, S]`` stream, before sharding.

    ``labels[b, s] = input_ids[b, s + 1]`` when token ``s + 1`` belongs to the same segment as token ``s`` (same row,
    same document index, no boundary between them: segments are runs within a row, as in
    :func:`~cp_packing.packed_seq_params_from_doc_ids`), else ``ignore_index``. So:

    - the last token of every document gets ``ignore_index`` (its "next token" is another document's first token);
    - the last token of every row gets ``ignore_index``, even when the next row starts with the same document index
      (the seed forces a boundary at every row start);
    - padding tokens (document index 0) always get ``ignore_index``, and so does the token before padding.

    Why before sharding: after sharding, a rank's neighbouring local tokens are not neighbours in the global stream
    at its shard edges (contiguous layout) or at every chunk edge (zigzag: chunk ``r`` is followed by chunk
    ``2cp-1-r``), and the true next token of a rank's last token lives on another rank. Shifting a shard pairs the
    wrong tokens and loses those labels, silently. Compute labels here once, then shard them like ``input_ids``
    (``sharded.shard(labels)``).

    Args:
        input_ids: ``[B, S]`` tensor of any integer dtype.
        doc_ids: ``[B, S]`` integer document map (1-based index per token, 0 = padding), or the
            ``PackedSeqParams`` built from it. Same shape and device as ``input_ids``.
        token_mask: optional ``[B, S]`` bool, True for real tokens. A False token (e.g. a pad token that a padding
            helper placed inside its document's segment) gets no label and is nobody's label.
        ignore_index: the value of a masked label (``-100``, PyTorch's and HF's default).

    Returns:
        int64 ``[B, S]`` labels on ``input_ids.device``.

    Raises:
        TypeError: a non-tensor, or a non-integer ``input_ids`` / ``doc_ids``, or a non-bool ``token_mask``.
        ValueError: shapes or devices differ.
    """
    if isinstance(doc_ids, PackedSeqParams):
        doc_ids = doc_ids.doc_ids
    check_doc_ids(doc_ids)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.Tensor [batch, sequence], got {type(input_ids).__name__}; "
            "wrap it with torch.as_tensor(...)"
        )
    if input_ids.dtype not in INTEGER_DTYPES:
        raise TypeError(f"input_ids must have an integer dtype, got {input_ids.dtype}; convert with .long()")
    if input_ids.shape != doc_ids.shape:
        raise ValueError(
            f"input_ids shape {tuple(input_ids.shape)} does not match doc_ids shape {tuple(doc_ids.shape)}; "
            "both must be the same global [B, S] batch (compute labels before sharding)"
        )
    if input_ids.device != doc_ids.device:
        raise ValueError(
            f"input_ids is on {input_ids.device} but doc_ids on {doc_ids.device}; move them to one device"
        )
    if token_mask is not None:
        if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
            got = token_mask.dtype if isinstance(token_mask, torch.Tensor) else type(token_mask).__name__
            raise TypeError(f"token_mask must be a bool tensor [B, S], got {got}; build it with (x != pad)")
        if token_mask.shape != doc_ids.shape:
            raise ValueError(
                f"token_mask shape {tuple(token_mask.shape)} does not match doc_ids shape {tuple(doc_ids.shape)}"
            )
        token_mask = token_mask.to(doc_ids.device)

    labels = torch.full(input_ids.shape, ignore_index, dtype=torch.int64, device=input_ids.device)  # [B, S]
    if input_ids.shape[1] < 2:
        return labels
    # Token s and s+1 of one row are in one segment iff their document indices are equal (runs within a row).
    same_segment = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] != 0)  # [B, S-1]
    if token_mask is not None:
        same_segment &= token_mask[:, 1:] & token_mask[:, :-1]
    labels[:, :-1] = torch.where(same_segment, input_ids[:, 1:].to(torch.int64), labels[:, :-1])
    return labels


# ----------------------------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------------------------


def _resolve_group(group: Any, name: str):
    """``None`` -> None (no communication); a 1-D DeviceMesh or ProcessGroup -> the ProcessGroup (checked usable)."""
    cp = resolve_group(group, name=name, optional=True)
    return None if cp is None else cp.group


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce_sum(t: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


def _flatten_inputs(logits: Any, labels: Any, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(
            f"logits and labels must be torch.Tensors, got {type(logits).__name__} and {type(labels).__name__}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor [T_local, V], got dtype {logits.dtype}")
    if labels.dtype not in INTEGER_DTYPES:
        raise TypeError(
            f"labels must have an integer dtype (class index, {ignore_index} = ignored), got {labels.dtype}; "
            "build them with cp_packing.next_token_labels(...) or convert with labels.long()"
        )
    if logits.dim() < 2 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match labels shape {tuple(labels.shape)}; expected "
            "logits [T_local, V] with labels [T_local] (or [1, T_local, V] with [1, T_local])"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits on {logits.device}; move them to one device")
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(torch.int64)


def _bad_label_slots(labels: torch.Tensor, vocab: int, ignore_index: int, cp_size: int, cp_rank: int):
    """Out-of-range labels (``!= ignore_index`` and outside ``[0, vocab)``): the bool mask ``[T_local]`` and an int64
    ``[cp_size]`` vector holding their count at ``cp_rank``. The vector rides along the loss's count all-reduce (no
    extra collective), so every rank learns that some rank has one, and which CP rank(s), and raises: a rank that
    raised alone would leave the others waiting in that all-reduce."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))  # [T_local] bool
    slots = torch.zeros(cp_size, dtype=torch.int64, device=labels.device)  # [cp_size]
    slots[cp_rank] = bad.sum()
    return bad, slots


def _with_dp_slots(stats: torch.Tensor, dp_group) -> torch.Tensor:
    """Append ``[dp_size]`` slots to ``stats = [x, cp bad slots...]`` (already reduced over the CP group), this
    replica's bad-label total at its DP rank, before the all-reduce over ``dp_group``; unchanged without DP."""
    if dp_group is None:
        return stats
    dp_slots = torch.zeros(dist.get_world_size(dp_group), dtype=torch.int64, device=stats.device)
    dp_slots[dist.get_rank(dp_group)] = stats[1:].sum()
    return torch.cat([stats, dp_slots])


def _raise_bad_labels(
    labels: torch.Tensor, bad: torch.Tensor, slots: torch.Tensor, cp_size: int, vocab: int, ignore_index: int
) -> None:
    """After the all-reduce(s): raise on EVERY rank when any rank of the (CP x DP) groups has an out-of-range label.
    ``slots`` = ``[cp_size]`` counts per CP rank, then (with DP) ``[dp_size]`` counts per DP rank. One host sync.
    The rank that holds the label names the value; the others name the rank(s) that hold one."""
    counts = slots.tolist()
    cp_counts, dp_counts = counts[:cp_size], counts[cp_size:]
    if not any(cp_counts):
        return
    fix = "check the vocabulary size (logits' last dim) or the ignore_index"
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"label {int(labels[pos])} at local position {pos} is outside [0, {vocab}) and is not "
            f"ignore_index={ignore_index}; {fix} (every rank of the loss's groups raises)"
        )
    where = []
    if cp_size > 1:
        where.append(f"CP rank(s) {[r for r, n in enumerate(cp_counts) if n]} (ranks in group)")
    if dp_counts:
        where.append(f"DP rank(s) {[r for r, n in enumerate(dp_counts) if n]} (ranks in dp_group)")
    raise ValueError(
        f"{sum(cp_counts)} label(s) outside [0, {vocab}) that are not ignore_index={ignore_index} on "
        f"{' of '.join(where)}, not on this rank; that rank's error names the value. Raised on every rank so "
        f"that none waits in a collective; {fix}"
    )


def _global_segment_ids(sharded: Any, T_local: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Global segment index of every local token (int64 ``[T_local]``) and the number of global segments."""
    if isinstance(sharded, PackedSeqParams):
        cu = sharded.cu_seqlens
        token_index = torch.arange(sharded.total_tokens, device=device)
        where = "PackedSeqParams (the whole stream)"
    else:
        gp = getattr(sharded, "global_params", None)
        token_index = getattr(sharded, "token_index", None)
        if not isinstance(gp, PackedSeqParams) or not isinstance(token_index, torch.Tensor):
            raise TypeError(
                f"sharded must be a ShardedPackedSeqParams (or the PackedSeqParams of an unsharded batch), got "
                f"{type(sharded).__name__}; build it with cp_packing.shard_packed_seq_params(...)"
            )
        cu = gp.cu_seqlens
        where = f"sharded (cp_rank={getattr(sharded, 'cp_rank', '?')})"
    if token_index.numel() != T_local:
        raise ValueError(
            f"{where} describes {token_index.numel()} local tokens but labels hold {T_local}; pass the metadata "
            "of this rank's shard of this batch"
        )
    cu = cu.to(device=device, dtype=torch.int64)
    token_index = token_index.to(device=device, dtype=torch.int64)
    seg = torch.searchsorted(cu, token_index, right=True) - 1  # [T_local]
    return seg, int(cu.numel()) - 1


def packed_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: Any = None,
    dp_group: Any = None,
    reduction: str = "token",
    sharded: Any = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of this rank's tokens, normalised by GLOBAL counts, so CP (and DP) shares sum to the true loss.

    Contract (every rank of ``group`` and ``dp_group`` must call it, each with its own local tokens):

    - The returned float32 scalar is this rank's **share**: ``sum over CP ranks of the returned values`` equals the
      loss that one process computes on the whole (unsharded) batch. Likewise, after ``loss.backward()`` on every
      rank, the all-reduce SUM of each parameter's gradient over the CP ranks equals the non-CP gradient. (CP
      frameworks do exactly this SUM when they reduce gradients over the CP dimension.)
    - With ``dp_group``: the normaliser also spans the DP replicas (each with its own batch), so the sum of the
      shares over ALL CP x DP ranks is the loss of the union of the batches, and the gradient of that loss is the
      SUM of all ranks' gradients. DDP and FSDP/FSDP2 *average* gradients over their ranks instead: multiply the
      loss by the number of ranks they average over (``dp_size``, or ``dp_size * cp_size`` when CP is folded into
      the FSDP mesh) or set their divide factor to 1. Without ``dp_group`` each DP replica is normalised on its own
      and a DP *mean* of gradients is the right reduction.
    - ``dp_group`` is the group of ranks that hold the same CP position in the other replicas (a DeviceMesh's
      ``"dp"`` dimension); ``group`` is this rank's CP group. ``group=None`` means no CP: the world is never assumed
      to be the CP group.
    - For logging, :func:`reduce_loss_for_logging` sums the shares into the global (detached) value.

    Reductions:

    - ``"token"``: ``sum of CE over this rank's valid labels / N``, with ``N`` the number of valid labels in the
      global batch: the local count is all-reduced once over ``group`` (then over ``dp_group``), so each token is
      counted exactly once (not once per CP rank).
    - ``"document"``: every document (segment with at least one valid label) weighs the same: the global loss is
      the mean over documents of the mean CE over that document's valid labels. Needs each local token's global
      segment id, from ``sharded`` (``searchsorted(global cu_seqlens, token_index, right=True) - 1``), and the
      per-segment valid counts, all-reduced over ``group`` (one ``[num_segments]`` int64 vector); the number of
      documents is summed over ``dp_group`` when given.

    Valid labels are those ``!= ignore_index``. A rank whose labels are all ignored still joins every collective
    (no hang) and returns a zero share; a global count of 0 gives a loss of exactly 0 (not NaN) that is still
    differentiable (zero gradients). The CE is computed in float32 whatever the logits dtype (bf16 logits are
    upcast; that costs a float32 copy of ``[T_local, V]``).

    Args:
        logits: floating ``[T_local, V]`` (or ``[1, T_local, V]``; any leading dims that match ``labels``).
        labels: integer ``[T_local]`` (or ``[1, T_local]``), this rank's shard of :func:`next_token_labels`.
        group: the CP ProcessGroup (or a 1-D DeviceMesh), or None for no CP.
        dp_group: the DP ProcessGroup (or a 1-D DeviceMesh) to normalise over as well, or None.
        reduction: ``"token"`` or ``"document"``.
        sharded: this rank's ``ShardedPackedSeqParams`` (or, without CP, the batch's ``PackedSeqParams``). Needed
            for ``"document"``; when given, also checked against ``group`` (size and rank).
        ignore_index: the label value to ignore.

    Returns:
        float32 scalar tensor on ``logits.device``, this rank's share of the loss.

    Raises:
        TypeError: non-tensor inputs, non-float logits, non-integer labels, a ``sharded`` of the wrong type.
        ValueError: shape/device mismatches, an unknown reduction, a label outside ``[0, V)``, ``"document"``
            without ``sharded``, a ``sharded`` whose ``cp_size``/``cp_rank`` disagree with ``group``.

    Communication: token: one ``[1 + cp_size]`` int64 all-reduce over ``group`` (+ one ``[1 + cp_size + dp_size]``
    over ``dp_group``): the count and one out-of-range-label slot per CP (and DP) rank. document: one
    ``[num_segments + cp_size]`` all-reduce over ``group`` (+ one ``[1 + cp_size + dp_size]`` over ``dp_group``). Host syncs: one, for the label range check, after the
    all-reduce: a label outside ``[0, V)`` on ANY rank raises ``ValueError`` on EVERY rank of the groups (no rank
    is left waiting in a collective); the rank that holds it names the value, the others name its CP rank.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    logits2d, labels1d = _flatten_inputs(logits, labels, ignore_index)  # [T_local, V], [T_local]
    group = _resolve_group(group, "group")
    dp_group = _resolve_group(dp_group, "dp_group")
    cp_size = _group_size(group)

    if sharded is not None and not isinstance(sharded, PackedSeqParams):
        sh_size, sh_rank = getattr(sharded, "cp_size", None), getattr(sharded, "cp_rank", None)
        if sh_size is not None and sh_size != cp_size:
            raise ValueError(
                f"sharded.cp_size={sh_size} but the CP group has {cp_size} rank(s); pass group= the CP process "
                "group that the batch was sharded for"
            )
        if sh_rank is not None and group is not None and sh_rank != dist.get_rank(group):
            raise ValueError(
                f"sharded.cp_rank={sh_rank} but this process is rank {dist.get_rank(group)} of the CP group; "
                "shard with cp_rank=dist.get_rank(group)"
            )
    if reduction == "document" and sharded is None:
        if cp_size > 1:
            raise ValueError(
                f"reduction='document' over a CP group of {cp_size} ranks needs sharded= this rank's "
                "ShardedPackedSeqParams, to find each local token's global document"
            )
        raise ValueError(
            "reduction='document' needs the segment boundaries: pass sharded= the batch's PackedSeqParams "
            "(or this rank's ShardedPackedSeqParams)"
        )

    T_local, vocab = logits2d.shape
    cp_rank = 0 if group is None else dist.get_rank(group)
    bad, bad_slots = _bad_label_slots(labels1d, vocab, ignore_index, cp_size, cp_rank)  # [T_local], [cp_size]
    valid = labels1d != ignore_index  # [T_local] bool
    device = logits2d.device

    def cross_entropy() -> torch.Tensor:
        # float32 CE, only once every label is known to be in range (an out-of-range one would crash in torch or
        # device-assert on CUDA); ignored positions give exactly 0 and keep the graph connected to logits.
        return F.cross_entropy(logits2d.float(), labels1d, ignore_index=ignore_index, reduction="none")  # [T_local]

    if reduction == "token":
        # [1 + cp_size]: this rank's valid labels (each token counted once), then the bad-label slots.
        stats = torch.cat([valid.sum().to(torch.int64).reshape(1), bad_slots])
        _all_reduce_sum(stats, group)
        stats = _with_dp_slots(stats, dp_group)  # [1 + cp_size (+ dp_size)]
        _all_reduce_sum(stats, dp_group)
        _raise_bad_labels(labels1d, bad, stats[1:], cp_size, vocab, ignore_index)
        return cross_entropy().sum() / stats[:1].clamp_min(1).to(torch.float32)[0]

    seg, num_segments = _global_segment_ids(sharded, T_local, device)  # [T_local] int64
    counts = torch.zeros(num_segments + cp_size, dtype=torch.int64, device=device)  # [num_segments + cp_size]
    counts.scatter_add_(0, seg, valid.to(torch.int64))
    counts[num_segments:] = bad_slots
    _all_reduce_sum(counts, group)  # global valid labels per segment (this DP replica's batch), bad-label slots
    counts, bad_slots = counts[:num_segments], counts[num_segments:]
    stats = torch.cat([(counts > 0).sum().to(torch.int64).reshape(1), bad_slots])  # [1 + cp_size]: documents, bad
    stats = _with_dp_slots(stats, dp_group)  # [1 + cp_size (+ dp_size)]
    _all_reduce_sum(stats, dp_group)
    _raise_bad_labels(labels1d, bad, stats[1:], cp_size, vocab, ignore_index)
    num_docs = stats[:1]  # [1]; equal on every CP rank
    # Valid tokens have counts[seg] >= 1; ignored ones have ce == 0, the clamp only avoids 0 * inf.
    weight = 1.0 / counts.gather(0, seg).clamp_min(1).to(torch.float32)  # [T_local]
    return (cross_entropy() * weight).sum() / num_docs.clamp_min(1).to(torch.float32)[0]


def reduce_loss_for_logging(loss: torch.Tensor, *, group: Any = None, dp_group: Any = None) -> torch.Tensor:
    """The global loss value from the per-rank shares of :func:`packed_cross_entropy`, detached, for logging.

    All-reduce SUM of the shares over ``group`` (the CP group) and, when the loss was normalised over DP too (the
    same ``dp_group`` was passed to :func:`packed_cross_entropy`), over ``dp_group``. Every rank of those groups
    must call it; each gets the same float32 scalar. Without ``dp_group`` the result is this DP replica's loss.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss must be a scalar tensor (a share from packed_cross_entropy), got {loss!r}")
    group = _resolve_group(group, "group")
    dp_group = _resolve_group(dp_group, "dp_group")
    out = loss.detach().to(torch.float32).reshape(1).clone()
    _all_reduce_sum(out, group)
    _all_reduce_sum(out, dp_group)
    return out[0]
