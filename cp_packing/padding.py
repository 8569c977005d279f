"""Re-lay a packed batch so that every segment's length is a multiple of a given number.

Why: the zigzag context-parallel layout cuts every segment (padding segments too) into ``2 * cp_size`` equal chunks.
ring-flash-attn's ``zigzag_ring_flash_attn_varlen_func`` does not check this and silently computes wrong numbers
when a length is not divisible; TransformerEngine's THD + CP path asserts it. Megatron therefore pads every sequence
to a multiple of ``2 * cp_size`` in its dataset. ``pad_segments(doc_ids, 2 * cp_size, tensors)`` does the same for a
neat-packing doc map and every per-token tensor that goes with it, without touching what real tokens compute.

Layout of one output row (``m = multiple``)::

    [doc a + pad to m] [doc b + pad to m] ... [doc z + pad to m] [row padding (index 0) up to S']

* Each document segment of length ``L`` gets ``ceil(L / m) * m - L`` pad tokens right AFTER its last real token,
  INSIDE the segment (same doc index). Causal attention of a real token only sees earlier tokens of its segment,
  so it is unchanged; pad tokens get label ``ignore_index``, so the loss is unchanged.
* Original padding runs (index 0) are dropped, wherever they are, and every row is re-padded at its end to one
  common length ``S'`` (a multiple of ``m``), so the padding that was already there absorbs the added pad tokens
  (with ``row_length=S`` the shape usually does not change at all). One exception: a padding run between two runs
  of the SAME document index (``[1, 1, 0, 1]``) is replaced by exactly ``m`` padding tokens, because dropping it
  would merge the two runs into one segment and let the second attend to the first.
* Runs, not ids, make segments (as in the seed): a reused index is a new segment and is padded on its own. Rows stay
  rows (a boundary at every row start), in order; real tokens keep their row and their order.

Every output segment has a length that is a multiple of ``m``: document segments by construction, a separator has
length ``m``, and the row-end padding run has length ``S' - content`` (both multiples of ``m``; a row whose content
fills ``S'`` has no padding run at all).

The result, ``PaddedBatch``, maps back: ``index`` gives the new flat position of every original token (``-1`` for
dropped padding), ``unpad`` maps model outputs ``[B, S', ...]`` back to ``[B, S, ...]`` and ``pad_tensor`` re-lays
one more per-token tensor later.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from cp_packing.packed_seq import packed_seq_params_from_doc_ids

__all__ = ["PaddedBatch", "pad_segments"]


@dataclass(frozen=True)
class PaddedBatch:
    """A batch re-laid by ``pad_segments`` so that every segment length is a multiple of ``multiple``.

    Attributes:
        doc_ids: ``[B, S']`` (the input's dtype), the new doc map. ``S' % multiple == 0`` and every segment of
            ``packed_seq_params_from_doc_ids(doc_ids)`` has a length that is a multiple of ``multiple``.
        tensors: ``name -> [B, S', ...]`` re-laid per-token tensors (same dtype and device as given).
        index: int64 ``[B, S]``, for every original token its flat position in the new ``[B * S']`` stream, ``-1``
            for original padding tokens (index 0), which are dropped. Strictly increasing along a row over real
            tokens; ``new.reshape(B * S', ...)[index[real]] == original[real]`` where ``real = index >= 0``.
        is_pad: bool ``[B, S']``, True for every token that is not an original real token (pad tokens inside
            documents, separators, row-end padding). ``(~is_pad).sum() == num_real_tokens``.
        multiple: the ``m`` every segment length is a multiple of.
        num_real_tokens: original tokens with a non-zero doc index (each appears exactly once in the output).
        num_added_tokens: pad tokens placed INSIDE document segments (``sum ceil(L/m)*m - L`` over document
            segments). These take part in attention and are the real cost of the padding.
        num_separator_tokens: padding tokens kept between two runs of one document index (``m`` per such gap).
        num_dropped_tokens: original padding tokens (index 0) that were dropped.
    """

    doc_ids: torch.Tensor
    tensors: dict[str, torch.Tensor]
    index: torch.Tensor
    is_pad: torch.Tensor
    multiple: int
    num_real_tokens: int
    num_added_tokens: int
    num_separator_tokens: int
    num_dropped_tokens: int

    @property
    def original_shape(self) -> tuple[int, int]:
        """``(B, S)`` of the input doc map."""
        return (int(self.index.shape[0]), int(self.index.shape[1]))

    @property
    def padded_length(self) -> int:
        """``S'``, the new row length (a multiple of ``multiple``)."""
        return int(self.doc_ids.shape[1])

    @property
    def overhead(self) -> float:
        """``num_added_tokens / num_real_tokens`` (0.0 without real tokens): the extra attention tokens per real
        token. Each document adds 0 to ``m - 1`` tokens, so this is about ``(m - 1) / (2 * mean document length)``:
        small for long documents, up to ``m - 1`` for one-token documents."""
        return self.num_added_tokens / self.num_real_tokens if self.num_real_tokens else 0.0

    def pad_tensor(self, x: torch.Tensor, fill_value: float | int | bool = 0) -> torch.Tensor:
        """Re-lay one more per-token tensor ``[B, S, ...]`` -> ``[B, S', ...]``; every token that is not an original
        real token gets ``fill_value`` (for labels pass ``-100``; position ids continuing the document need
        ``pad_segments(..., tensors={"position_ids": ...})``)."""
        B, S = self.original_shape
        x = _check_per_token("x", x, B, S, self.index.device)
        src, dst = _real_pairs(self.index.reshape(-1), self.num_real_tokens)
        Sp = self.padded_length
        return _scatter_real(x.reshape(B * S, *x.shape[2:]), src, dst, B * Sp, fill_value).view(B, Sp, *x.shape[2:])

    def unpad(self, x: torch.Tensor, fill_value: float | int | bool = 0) -> torch.Tensor:
        """Map a tensor of the padded stream back to the original layout.

        Args:
            x: ``[B, S', ...]``, ``[B * S', ...]`` or ``[1, B * S', ...]`` (e.g. logits of the padded batch).
            fill_value: value of the original padding tokens (index 0), which have no place in the padded stream.

        Returns:
            ``[B, S, ...]``: real tokens get their value from ``x``, original padding tokens ``fill_value``.
            A gather (differentiable, no host sync).
        """
        B, S = self.original_shape
        Sp = self.padded_length
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"unpad expects a torch.Tensor, got {type(x).__name__}")
        if x.dim() >= 2 and tuple(x.shape[:2]) == (B, Sp):
            rest = tuple(x.shape[2:])
        elif x.dim() >= 1 and x.shape[0] == B * Sp:
            rest = tuple(x.shape[1:])
        elif x.dim() >= 2 and tuple(x.shape[:2]) == (1, B * Sp):
            rest = tuple(x.shape[2:])
        else:
            raise ValueError(
                f"unpad expects a tensor of shape [B, S', ...] = [{B}, {Sp}, ...], [B*S', ...] = [{B * Sp}, ...] or "
                f"[1, B*S', ...], got shape {tuple(x.shape)}; pass an output of the padded batch"
            )
        flat = x.reshape(B * Sp, *rest)
        real = (self.index >= 0).reshape(B * S, *([1] * len(rest)))
        if flat.shape[0] == 0:  # nothing in the padded stream: every original token was padding
            return x.new_full((B, S, *rest), fill_value)
        gathered = flat.index_select(0, self.index.reshape(-1).clamp(min=0))  # [B*S, ...]
        fill = torch.full((), fill_value, dtype=x.dtype, device=x.device)
        return torch.where(real, gathered, fill).view(B, S, *rest)


def _real_pairs(index: torch.Tensor, num_real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From ``index`` ``[T]`` (``-1`` = dropped): int64 ``src`` ``[R]`` (original flat positions of the real tokens)
    and ``dst`` ``[R]`` (their new flat positions). ``nonzero_static``: no host sync, no duplicate targets."""
    src = torch.nonzero_static(index >= 0, size=num_real).view(-1)
    return src, index.index_select(0, src)


def _scatter_real(x_flat: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, size: int, fill: Any) -> torch.Tensor:
    """``[T, ...]`` -> ``[size, ...]``: real token ``src[i]`` goes to ``dst[i]``, everything else is ``fill``."""
    out = x_flat.new_full((size, *x_flat.shape[1:]), fill)
    return out.index_copy_(0, dst, x_flat.index_select(0, src))


def _continue_positions(
    out: torch.Tensor,  # [T', ...] real tokens already in place
    x_flat: torch.Tensor,  # [T, ...] original positions
    new_doc: torch.Tensor,  # [T']
    pad_run_pos: torch.Tensor,  # int64 [T'] position inside its padding run (where new_doc == 0)
    cu: torch.Tensor,  # int64 [N + 1] original segments
    new_start: torch.Tensor,  # int64 [N]
    lengths: torch.Tensor,  # int64 [N]
    num_pad: torch.Tensor,  # int64 [N] pad tokens added to each segment (0 for padding runs)
    total_pad: int,
) -> torch.Tensor:
    """Pad tokens of a document continue its count (last real value + 1, + 2, ...); padding tokens (index 0) get
    their 0-based position inside their padding run."""
    device = out.device
    bshape = (-1, *([1] * (out.dim() - 1)))
    pad_excl = torch.cumsum(num_pad, 0) - num_pad  # [N]
    ar = torch.arange(total_pad, device=device)
    pad_pos = ar + torch.repeat_interleave(new_start + lengths - pad_excl, num_pad, output_size=total_pad)  # [P]
    past_last = ar - torch.repeat_interleave(pad_excl, num_pad, output_size=total_pad) + 1  # [P] 1, 2, ...
    last_real = torch.repeat_interleave(cu[1:] - 1, num_pad, output_size=total_pad)  # [P]
    out.index_copy_(0, pad_pos, x_flat.index_select(0, last_real) + past_last.to(out.dtype).view(bshape))
    in_run = pad_run_pos.to(out.dtype).view(bshape)
    return torch.where((new_doc == 0).view(bshape), in_run, out)


def _position_in_padding_runs(
    content: torch.Tensor,  # int64 [B] covered tokens per row; the row-end padding run starts there
    Sp: int,
    new_start: torch.Tensor,  # int64 [N]
    separator: torch.Tensor,  # bool [N]
    m: int,
    total_sep: int,
) -> torch.Tensor:
    """int64 ``[B * S']``: 0-based position of each token inside its padding run; meaningful where the new doc
    index is 0 (the row-end run and the separators), arbitrary elsewhere."""
    device = content.device
    in_run = (torch.arange(Sp, device=device)[None, :] - content[:, None]).reshape(-1)  # row-end run
    sep_len = separator.to(torch.int64) * m  # [N]
    sep_excl = torch.cumsum(sep_len, 0) - sep_len
    ar = torch.arange(total_sep, device=device)
    sep_pos = ar + torch.repeat_interleave(new_start - sep_excl, sep_len, output_size=total_sep)
    return in_run.index_copy_(0, sep_pos, ar - torch.repeat_interleave(sep_excl, sep_len, output_size=total_sep))


def _check_fill_fits(name: str, fill: Any, dtype: torch.dtype) -> None:
    """A pad value must be exactly representable: torch silently wraps ``-100`` to ``156`` in ``uint8`` (a real
    class id that the loss would then count)."""
    problem = None
    if dtype == torch.bool:
        if fill not in (0, 1, True, False):
            problem = "bool tensors take only 0/1/True/False"
    elif not (dtype.is_floating_point or dtype.is_complex):
        if isinstance(fill, float) and not float(fill).is_integer():
            problem = "an integer tensor cannot hold a fractional value"
        else:
            info = torch.iinfo(dtype)
            try:
                value = int(fill)
            except (TypeError, ValueError):
                problem = "not a number"
            else:
                if not info.min <= value <= info.max:
                    problem = f"{dtype} holds [{info.min}, {info.max}]"
    else:
        try:
            torch.full((), fill, dtype=dtype)
        except (RuntimeError, TypeError) as exc:
            problem = str(exc)
    if problem:
        raise ValueError(
            f"the pad value {fill!r} for tensors[{name!r}] does not fit its dtype {dtype} ({problem}); pass a "
            f"representable value in pad_values[{name!r}] or convert the tensor (labels: a signed dtype for -100)"
        )


def _check_multiple(multiple: Any) -> int:
    if isinstance(multiple, bool) or not hasattr(multiple, "__index__"):
        raise TypeError(
            f"multiple must be a positive int (e.g. 2 * cp_size for the zigzag layout), got {multiple!r} of type "
            f"{type(multiple).__name__}"
        )
    m = operator.index(multiple)
    if m < 1:
        raise ValueError(f"multiple must be a positive int (e.g. 2 * cp_size for the zigzag layout), got {m}")
    return m


def _check_per_token(name: str, x: Any, B: int, S: int, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tensors[{name!r}] must be a torch.Tensor of shape [B, S, ...], got {type(x).__name__}")
    if x.dim() < 2 or tuple(x.shape[:2]) != (B, S):
        raise ValueError(
            f"tensors[{name!r}] has shape {tuple(x.shape)}, but per-token tensors must be [B, S, ...] = "
            f"[{B}, {S}, ...] like doc_ids; add the batch dimension or transpose it"
        )
    if x.device != device:
        raise ValueError(
            f"tensors[{name!r}] is on {x.device} but doc_ids is on {device}; move it with .to(doc_ids.device)"
        )
    return x


def _check_keys(keys: Any, what: str) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise TypeError(f"{what} must be a sequence of tensor names, got the string {keys!r}; write ({keys!r},)")
    keys = tuple(keys)
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"{what} must hold tensor names (str), got {k!r}")
    return keys


def pad_segments(
    doc_ids: torch.Tensor,
    multiple: int,
    tensors: Mapping[str, torch.Tensor] | None = None,
    *,
    pad_values: Mapping[str, float | int | bool] | None = None,
    ignore_index: int = -100,
    label_keys: Sequence[str] = ("labels",),
    position_keys: Sequence[str] = ("position_ids",),
    row_length: int | None = None,
) -> PaddedBatch:
    """Re-lay a doc map (and its per-token tensors) so that every segment's length is a multiple of ``multiple``.

    See the module docstring for the layout. For the zigzag CP layout (ring-flash-attn zigzag varlen,
    TransformerEngine THD) pass ``multiple=2 * cp_size``.

    Args:
        doc_ids: integer ``[B, S]``, 1-based document index per token, 0 = padding (checked as by
            ``packed_seq_params_from_doc_ids``). CPU or CUDA.
        multiple: positive int ``m``.
        tensors: ``name -> [B, S, ...]`` per-token tensors on ``doc_ids``' device (input_ids, labels,
            position_ids, ...). Labels must be already shifted (``labels[i]`` is token i's target, ``-100`` where it
            would cross a document boundary): each label moves with its token. Labels of original padding tokens
            must be ``ignore_index`` (they are dropped; anything else would change the loss).
        pad_values: ``name -> value`` for the tokens added to that tensor; overrides the defaults below.
        ignore_index: the value added tokens get in tensors named in ``label_keys``.
        label_keys: names of label tensors (added tokens get ``ignore_index``).
        position_keys: names of position-id tensors. Pad tokens inside a document continue its count (last real
            token's value + 1, + 2, ...; so real tokens' RoPE positions are unchanged); padding tokens (index 0)
            get their 0-based position inside their padding run.
        row_length: the output row length ``S'``, exactly. Must be a multiple of ``multiple`` and at least the
            longest padded row. Default: the longest padded row (so ``S'`` may differ from ``S``).

    Other tensors get 0 on added tokens unless ``pad_values`` names them.

    Returns:
        ``PaddedBatch`` (see its docstring): the new ``doc_ids`` ``[B, S']``, re-laid ``tensors``, ``index``
        ``[B, S]``, ``is_pad`` ``[B, S']`` and token counts.

    Raises:
        TypeError: ``multiple`` not an int; a non-tensor; bad key types.
        ValueError: ``multiple < 1``; a tensor whose shape is not ``[B, S, ...]`` or on another device; a
            ``row_length`` too small or not a multiple; a label of a padding token that is not ``ignore_index``;
            ``pad_values`` naming an unknown tensor; invalid ``doc_ids``.

    Cost: vectorised (cumsum / repeat_interleave / scatter over tokens and segments, no Python loop). One host sync
    (``S'`` and the counts are read back together) on top of ``packed_seq_params_from_doc_ids``.
    """
    m = _check_multiple(multiple)
    params = packed_seq_params_from_doc_ids(doc_ids)  # validates doc_ids
    B, S = doc_ids.shape
    T = B * S
    device = doc_ids.device
    tensors = {} if tensors is None else tensors
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict name -> [B, S, ...] tensor, got {type(tensors).__name__}")
    for name, x in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensors keys must be str names, got {name!r}")
        _check_per_token(name, x, B, S, device)
    pad_values = {} if pad_values is None else dict(pad_values)
    unknown = sorted(set(pad_values) - set(tensors))
    if unknown:
        raise ValueError(
            f"pad_values names {unknown}, which are not in tensors ({sorted(tensors)}); fix the name or drop it"
        )
    label_keys = _check_keys(label_keys, "label_keys")
    position_keys = _check_keys(position_keys, "position_keys")
    both = sorted(set(label_keys) & set(position_keys))
    if both:
        raise ValueError(f"{both} are in both label_keys and position_keys; a tensor is one or the other")
    if isinstance(ignore_index, bool) or not hasattr(ignore_index, "__index__"):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if row_length is not None:
        if isinstance(row_length, bool) or not hasattr(row_length, "__index__"):
            raise TypeError(f"row_length must be an int or None, got {row_length!r}")
        row_length = operator.index(row_length)
        if row_length < 0 or row_length % m:
            raise ValueError(
                f"row_length={row_length} is not a non-negative multiple of multiple={m}; "
                f"pass {(max(row_length, 0) + m - 1) // m * m} or None"
            )

    # ---- segments of the input (the seed's), and their new lengths ----
    cu = params.cu_seqlens.to(torch.int64)  # [N + 1]
    starts = cu[:-1]  # [N]
    lengths = cu[1:] - starts  # [N]
    N = int(starts.numel())
    flat = doc_ids.reshape(-1)  # [T]
    seg_doc = flat[starts]  # [N] doc index of each segment
    seg_row = starts // max(S, 1)  # [N]
    is_doc = seg_doc != 0  # [N]
    padded_len = (lengths + m - 1) // m * m  # [N]
    # A padding run between two runs of the same index in one row is kept as m tokens (else the runs would merge).
    separator = torch.zeros(N, dtype=torch.bool, device=device)
    if N >= 3:
        separator[1:-1] = (
            ~is_doc[1:-1]
            & (seg_row[:-2] == seg_row[1:-1])
            & (seg_row[2:] == seg_row[1:-1])
            & (seg_doc[:-2] == seg_doc[2:])
        )
    zero = torch.zeros_like(lengths)
    new_len = torch.where(is_doc, padded_len, torch.where(separator, torch.full_like(lengths, m), zero))  # [N]
    content = torch.zeros(B, dtype=torch.int64, device=device).index_add_(0, seg_row, new_len)  # [B]

    # ---- the one host sync: S', counts, and the padding-label check ----
    real_tok = flat != 0  # [T]
    checks = []
    check_names = []
    for name in label_keys:
        if name in tensors and T > 0:
            lab = tensors[name].reshape(T, -1)
            checks.append(((lab != ignore_index) & ~real_tok[:, None]).sum())
            check_names.append(name)
    zero0 = torch.zeros((), dtype=torch.int64, device=device)
    stats = torch.stack(
        [
            content.max() if B > 0 else zero0,
            new_len.sum(),
            torch.where(is_doc, lengths, zero).sum(),
            torch.where(is_doc, padded_len - lengths, zero).sum(),  # = num_pad.sum()
            separator.sum().to(torch.int64) * m,
            *[c.to(torch.int64) for c in checks],
        ]
    ).tolist()
    longest, covered, num_real, num_added, num_sep = stats[:5]
    for name, bad in zip(check_names, stats[5:]):
        if bad:
            raise ValueError(
                f"tensors[{name!r}] has {bad} label(s) other than ignore_index={ignore_index} on padding tokens "
                f"(doc index 0); those tokens are dropped, which would change the loss. Set labels to "
                f"{ignore_index} where doc_ids == 0, or leave {name!r} out of label_keys if it is not a label"
            )
    if row_length is None:
        Sp = int(longest)
    elif row_length < longest:
        raise ValueError(
            f"row_length={row_length} is too small: the longest row needs {longest} tokens after padding every "
            f"segment to a multiple of {m}; pass row_length >= {longest} (a multiple of {m}) or None"
        )
    else:
        Sp = row_length
    Tp = B * Sp

    # ---- new segment starts ----
    excl = torch.cumsum(new_len, 0) - new_len  # [N] exclusive cumsum over the whole batch
    row_base = torch.cumsum(content, 0) - content  # [B] covered tokens before each row
    new_start = seg_row * Sp + (excl - row_base[seg_row])  # [N] flat start in the new stream

    # ---- original tokens -> new positions: each segment moves by one shift ----
    shift = new_start - starts  # [N]
    tok_shift = torch.repeat_interleave(shift, lengths, output_size=T)  # [T]
    index = torch.where(real_tok, torch.arange(T, device=device) + tok_shift, torch.full_like(tok_shift, -1))  # [T]
    src, dst = _real_pairs(index, int(num_real))  # [R], [R]: original and new flat position of each real token

    # ---- covered new tokens (documents with their pads, separators), then the row-end padding stays 0 ----
    C = int(covered)
    cov_pos = torch.arange(C, device=device) + torch.repeat_interleave(new_start - excl, new_len, output_size=C)
    new_doc = torch.zeros(Tp, dtype=doc_ids.dtype, device=device)
    new_doc.index_copy_(0, cov_pos, torch.repeat_interleave(seg_doc, new_len, output_size=C))
    is_pad = torch.ones(Tp, dtype=torch.bool, device=device).index_fill_(0, dst, False)

    num_pad = torch.where(is_doc, padded_len - lengths, zero)  # [N] pad tokens added inside each segment
    new_tensors: dict[str, torch.Tensor] = {}
    pad_run_pos = None
    for name, x in tensors.items():
        rest = tuple(x.shape[2:])
        x_flat = x.reshape(T, *rest)
        if name in pad_values:
            fill = pad_values[name]
        elif name in label_keys:
            fill = ignore_index
        else:
            fill = 0
        _check_fill_fits(name, fill, x.dtype)
        out = _scatter_real(x_flat, src, dst, Tp, fill)
        if name in position_keys and name not in pad_values:
            if pad_run_pos is None:
                pad_run_pos = _position_in_padding_runs(content, Sp, new_start, separator, m, int(num_sep))
            out = _continue_positions(
                out, x_flat, new_doc, pad_run_pos, cu, new_start, lengths, num_pad, int(num_added)
            )
        new_tensors[name] = out.view(B, Sp, *rest)

    return PaddedBatch(
        doc_ids=new_doc.view(B, Sp),
        tensors=new_tensors,
        index=index.view(B, S),
        is_pad=is_pad.view(B, Sp),
        multiple=m,
        num_real_tokens=int(num_real),
        num_added_tokens=int(num_added),
        num_separator_tokens=int(num_sep),
        num_dropped_tokens=T - int(num_real),
    )
