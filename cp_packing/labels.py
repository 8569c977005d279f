"""Labels shifted on the global stream, and the one check that labels are shifted (docs/loss.md).

``next_token_labels`` shifts on the GLOBAL ``[B, S]`` stream, before sharding: shifting a shard pairs tokens that are
not neighbours at every shard or zigzag chunk edge, silently. HF's convention is the other one (``labels[t]`` is
token ``t``; HF shifts inside its loss), so labels of the wrong convention are the classic silent mistake: the loss,
``make_cp_batch`` and the trainers raise on them (:func:`check_labels_shifted`); ``next_token_labels(labels=...)``
warns on labels that look shifted already (it may be given either, so it cannot know).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from cp_packing._checks import IGNORE_INDEX, INTEGER_DTYPES, check_doc_ids, check_ignore_index, check_tensor
from cp_packing.packed_seq import PackedSeqParams

__all__ = ["LabelsWarning", "UNSHIFTED_FIX", "check_labels_shifted", "local_label_count", "next_token_labels",
           "segment_ends", "valid_label_mask"]


UNSHIFTED_FIX = ("HF's labels are UNSHIFTED (labels[t] = token t; HF shifts inside its loss), cp-packing's are shifted "
                 "on the global stream: convert them before sharding with cp_packing.next_token_labels(input_ids, "
                 "doc_ids, labels=hf_labels)")


class LabelsWarning(UserWarning):
    """Labels that look like the wrong convention: HF's unshifted labels given to the loss, or already shifted labels
    given to ``next_token_labels(labels=...)`` (each warned once per process; docs/loss.md)."""


_warned: set[str] = set()  # which LabelsWarning kinds this process has given


def _warn_once(kind: str, message: str, stacklevel: int) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"{message} (warned once per process)", LabelsWarning, stacklevel=stacklevel + 1)


def valid_label_mask(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """bool like ``labels``: the labels that are not ``ignore_index``, compared as int64 values, as the loss does.

    Why: ``labels != -100`` in the labels' own dtype wraps, e.g. ``-100`` is ``156`` in ``uint8``, so a real class
    156 would be ignored by the count but trained by the loss. A dtype that cannot hold ``ignore_index`` has no
    ignored label.

    >>> valid_label_mask(torch.tensor([156, 1], dtype=torch.uint8)).tolist()
    [True, True]
    >>> valid_label_mask(torch.tensor([5, -100])).tolist()
    [True, False]
    """
    if not _holds(labels.dtype, ignore_index):  # e.g. -100 in an unsigned dtype: never equal
        return torch.ones_like(labels, dtype=torch.bool)
    return labels != ignore_index


def local_label_count(labels: Sequence[torch.Tensor], ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """int64 scalar on the first tensor's device: the valid labels of ``labels`` (this rank's micro-batches), no host
    sync. The local part of the step's one count, ``cp_packing.count_valid_labels``, which sums it over the groups.

    >>> int(local_label_count([torch.tensor([5, -100]), torch.tensor([[1, 2]], dtype=torch.uint8)]))
    3
    """
    total = torch.zeros((), dtype=torch.int64, device=labels[0].device)
    for x in labels:
        total += valid_label_mask(x, ignore_index).sum().to(total.device)
    return total


def _holds(dtype: torch.dtype, value: int) -> bool:
    """Whether an integer ``dtype`` holds ``value`` (float and bool dtypes: True, compared as they are)."""
    if dtype.is_floating_point or dtype == torch.bool:
        return True
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


def check_same_batch(x: object, name: str, like: torch.Tensor, like_name: str, shape: str) -> torch.Tensor:
    check_tensor(x, name, shape)
    if x.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must have an integer dtype, got {x.dtype}; convert with {name}.long()")
    if x.shape != like.shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} does not match {like_name} shape {tuple(like.shape)}; "
                         f"pass the {name} of the same batch")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but {like_name} on {like.device}; use one device")
    return x


def next_token_labels(
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor | PackedSeqParams,
    *,
    labels: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Next-token labels of a neat-packed batch, on the GLOBAL ``[B, S]`` stream, before sharding.

    ``out[b, s] = target[b, s + 1]`` when token ``s + 1`` is in token ``s``'s segment (same row, same document
    index: the seed's segments), else ``ignore_index``: the last token of every document and of every row, and every
    padding token, get ``ignore_index``. ``target`` is ``input_ids`` (pretraining), or ``labels``: HF's UNSHIFTED,
    prompt-masked labels (``labels[t]`` is token ``t`` or ``ignore_index``; HF shifts inside its loss), whose masked
    positions stay masked after the shift. Why before sharding: see docs/loss.md.

    Args:
        input_ids: ``[B, S]``, any integer dtype.
        doc_ids: ``[B, S]`` integer document map (0 = padding), or its ``PackedSeqParams``. Same shape and device.
        labels: optional integer ``[B, S]``, HF's unshifted labels (``batch["labels"]`` of ``DataCollatorWith
            Flattening``, TRL's collators, a tokenizer's ``labels = input_ids`` with the prompt set to -100). Labels
            that look already shifted (equal to the NEXT input id wherever valid) give a :class:`LabelsWarning`.
        token_mask: optional bool ``[B, S]``, False for tokens that get no label and are nobody's label (e.g. pad
            tokens that ``pad_segments`` placed inside a document).
        ignore_index: the int value of a masked label (in ``labels`` and in the result).

    Returns:
        int64 ``[B, S]`` labels on ``input_ids.device``: what :func:`packed_cross_entropy` takes (after sharding).

    Raises:
        TypeError / ValueError: a non-integer tensor, another shape or device, a negative label other than
        ``ignore_index``, a non-int ``ignore_index``.

    >>> next_token_labels(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1, 1, 2, 2]])).tolist()
    [[11, -100, 13, -100]]
    >>> hf_labels = torch.tensor([[-100, 11, 12, 13]])  # token 10 is the prompt: masked
    >>> next_token_labels(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1, 1, 1, 1]]), labels=hf_labels).tolist()
    [[11, 12, 13, -100]]
    """
    if isinstance(doc_ids, PackedSeqParams):
        doc_ids = doc_ids.doc_ids
    check_doc_ids(doc_ids)
    # the same global [B, S] batch as doc_ids: label BEFORE sharding
    check_same_batch(input_ids, "input_ids", doc_ids, "doc_ids (the global map: label before sharding)",
                      "[batch, sequence]")
    ignore_index = check_ignore_index(ignore_index)
    if token_mask is not None:
        check_tensor(token_mask, "token_mask", "(bool [B, S])")
        if token_mask.dtype != torch.bool:
            raise TypeError(f"token_mask must be a bool tensor [B, S], got {token_mask.dtype}; build it with x != pad")
        if token_mask.shape != doc_ids.shape:
            raise ValueError(f"token_mask shape {tuple(token_mask.shape)} does not match doc_ids shape "
                             f"{tuple(doc_ids.shape)}")
        token_mask = token_mask.to(doc_ids.device)
    ids = input_ids.to(torch.int64)
    target = ids if labels is None else _hf_labels(labels, ids, ignore_index)

    out = torch.full(input_ids.shape, ignore_index, dtype=torch.int64, device=input_ids.device)  # [B, S]
    if input_ids.shape[1] < 2:
        return out
    same_segment = (doc_ids[:, 1:] == doc_ids[:, :-1]) & (doc_ids[:, :-1] != 0)  # [B, S-1]: runs within a row
    if token_mask is not None:
        same_segment &= token_mask[:, 1:] & token_mask[:, :-1]
    out[:, :-1] = torch.where(same_segment, target[:, 1:], out[:, :-1])
    return out


def _hf_labels(labels: object, ids: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """HF's unshifted labels as int64, checked; warns when they look already shifted (one host sync)."""
    labels = check_same_batch(labels, "labels", ids, "input_ids", "(HF's unshifted labels [B, S])").to(torch.int64)
    valid = labels != ignore_index  # [B, S]
    negative = valid & (labels < 0)
    unshifted = (valid & (labels != ids)).any()  # HF's convention: every valid label is its own token
    # shifted: every valid label (but one in the last column) is the NEXT token, and some is not its own token
    shifted = (valid[:, :-1] & (labels[:, :-1] != ids[:, 1:])).any() | valid[:, -1:].any()
    has_negative, not_own, not_next = torch.stack([negative.any(), unshifted, shifted]).tolist()
    if has_negative:
        b, s = (int(i) for i in negative.nonzero()[0])
        raise ValueError(f"labels[{b}, {s}] is {int(labels[b, s])}: a label is a token id (>= 0) or "
                         f"ignore_index={ignore_index}; pass ignore_index= the value your pipeline masks with")
    if not_own and not not_next:
        _warn_once("shifted", "next_token_labels(labels=...) got labels that look already shifted (each valid label "
                   "is the NEXT input id, not its own): shifting them again trains the token after next. Pass HF's "
                   "unshifted labels (labels[t] = input_ids[t] or -100), or use already shifted labels as they are",
                   stacklevel=3)
    return labels




def check_labels_shifted(labels: torch.Tensor, *, input_ids: torch.Tensor | None = None,
                         segment_end: torch.Tensor | None = None, next_known: torch.Tensor | None = None,
                         ignore_index: int = IGNORE_INDEX) -> None:
    """Raise a ValueError when ``labels`` look UNSHIFTED (HF's convention) instead of shifted on the global stream.

    Two signals (one host sync): a valid label on the last token of its segment (``segment_end``, bool like
    ``labels``: ``next_token_labels`` never puts one there), or, with ``input_ids``, labels equal to the input ids at
    every valid position where a shifted reading does not also fit (``next_known``: which neighbours ``[i, i+1]`` are
    global neighbours; ``None``: all).

    >>> check_labels_shifted(torch.tensor([11, 12, -100]), input_ids=torch.tensor([10, 11, 12]))
    >>> check_labels_shifted(torch.tensor([10, 11, 12]), input_ids=torch.tensor([10, 11, 12]))
    Traceback (most recent call last):
    ...
    ValueError: the labels equal input_ids at every valid position: they look unshifted, and would train each token to predict itself. HF's labels are UNSHIFTED (labels[t] = token t; HF shifts inside its loss), cp-packing's are shifted on the global stream: convert them before sharding with cp_packing.next_token_labels(input_ids, doc_ids, labels=hf_labels)
    """
    labels = labels.reshape(-1)
    valid = valid_label_mask(labels, ignore_index)
    zero = torch.zeros((), dtype=torch.bool, device=labels.device)
    end = valid & segment_end.reshape(-1) if segment_end is not None else None
    stats = [zero, torch.zeros((), dtype=torch.int64, device=labels.device)] if end is None else \
        [end.any(), torch.argmax(end.to(torch.uint8)) if end.numel() else zero.long()]
    if input_ids is not None and labels.numel():
        ids = input_ids.reshape(-1).to(labels.device, torch.int64)
        own = (labels == ids) | ~valid
        pairs = valid[:-1] if next_known is None else valid[:-1] & next_known
        is_next = (labels[:-1] == ids[1:]) | ~pairs  # a shifted reading fits as well (ambiguous: no error)
        stats.append(valid.any() & own.all() & ~(pairs.any() & is_next.all()))
    else:
        stats.append(zero)
    has_end, end_at, looks_unshifted = torch.stack([x.to(torch.int64) for x in stats]).tolist()
    if looks_unshifted:
        raise ValueError(f"the labels equal input_ids at every valid position: they look unshifted, and would train "
                         f"each token to predict itself. {UNSHIFTED_FIX}")
    if has_end and not _holds(labels.dtype, ignore_index):
        raise ValueError(f"label {int(labels[end_at])} at local position {end_at} sits on the last token of its "
                         f"segment, and {labels.dtype} labels cannot hold ignore_index={ignore_index} (converting "
                         f"wrapped it to another value, a real class); keep the labels int64 (labels.long()), as "
                         f"next_token_labels returns them")
    if has_end:
        raise ValueError(f"label {int(labels[end_at])} at local position {end_at} sits on the last token of its "
                         f"segment, where next_token_labels always puts ignore_index={ignore_index} (the next token "
                         f"belongs to another document or row): the labels look unshifted, or shifted across "
                         f"document boundaries. {UNSHIFTED_FIX}")


def segment_ends(cu_seqlens: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: whether each token (global positions ``token_index``, on its device) is the last of its segment
    of ``cu_seqlens``, where ``next_token_labels`` always puts the ignore index.

    >>> segment_ends(torch.tensor([0, 2, 5]), torch.tensor([1, 2, 4])).tolist()
    [True, False, True]
    """
    cu = cu_seqlens.to(token_index.device, torch.int64)
    return token_index == cu[torch.searchsorted(cu, token_index, right=True)] - 1
