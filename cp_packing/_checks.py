"""The shared argument-check primitives (ints, choices, tensors, doc maps, ``cu_seqlens``, windows) and dtype helpers.

Public functions validate their arguments before any work or communication, so a mistake gets a ``TypeError``
(wrong kind of value) or ``ValueError`` (right kind, wrong value) that names the argument, the value and the fix.
The checks used by more than one module live here; a check of one module's own concept lives beside it
(``packed_seq.check_params``, ``labels``' shifted-labels check, the layouts', the backends' and the model guards).
This module imports torch and numpy only; every other module may import it.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import numpy as np
import torch

__all__ = [
    "HALF_DTYPES",
    "IGNORE_INDEX",
    "INTEGER_DTYPES",
    "INT32_MAX",
    "MAX_SOFTMAX_SCALE",
    "as_signed",
    "check_bool",
    "check_weighted_cost_tokens",
    "check_windows",
    "check_choice",
    "check_cp",
    "check_cu_seqlens",
    "check_divisible",
    "check_doc_ids",
    "check_ignore_index",
    "check_int",
    "check_number",
    "check_softmax_scale",
    "check_tensor",
    "is_int",
    "signed_dtype",
]

IGNORE_INDEX = -100
"""The label value every cp-packing loss, packer, loader and trainer ignores (PyTorch's and HF's default)."""

INT32_MAX = 2**31 - 1
"""The largest flat position an int32 ``cu_seqlens`` can hold."""

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes flash-attn kernels take."""

INTEGER_DTYPES = frozenset(
    [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
    + [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]
)
"""Every integer dtype a doc map may have (unsigned ones included)."""

_SIGNED_OF = {
    getattr(torch, u): getattr(torch, s)
    for u, s in (("uint16", "int16"), ("uint32", "int32"), ("uint64", "int64"))
    if hasattr(torch, u)
}


def signed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype of the same width for uint16/32/64, else ``dtype`` itself (see :func:`as_signed`)."""
    return _SIGNED_OF.get(dtype, dtype)


def as_signed(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed bit for bit as the signed integer type of the same width when it is uint16/32/64 (torch has no
    index_select, repeat_interleave or equality kernels for those), else ``x`` itself. Zero-copy; equality and
    ``+`` are preserved; ``Tensor.view(dtype)`` is not differentiable, so it is only taken when the dtype changes.

    >>> as_signed(torch.tensor([2**32 - 1], dtype=torch.uint32)).tolist()
    [-1]
    """
    signed = _SIGNED_OF.get(x.dtype)
    return x if signed is None else x.view(signed)


def is_int(x: Any) -> bool:
    """True for a Python or NumPy integer, False for ``bool`` (``True`` is an int to Python, never a size here)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_int(value: Any, name: str, *, min: int | None = None, max: int | None = None, hint: str = "") -> int:
    """``value`` as an ``int`` if it is an integer in ``[min, max]``; else a TypeError / ValueError naming it.

    >>> check_int(4, "cp_size", min=1)
    4
    """
    fix = f"; {hint}" if hint else ""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}){fix}")
    value = operator.index(value)
    if min is not None and value < min:
        raise ValueError(f"{name} must be >= {min}, got {value}{fix}")
    if max is not None and value > max:
        raise ValueError(f"{name} must be <= {max}, got {value}{fix}")
    return value


def check_number(value: Any, name: str, *, min: float | None = None, allow_none: bool = False) -> float | None:
    """``value`` as a float if it is a real number (not bool) ``>= min``; ``None`` passes when ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        extra = " or None" if allow_none else ""
        raise TypeError(f"{name} must be a number{extra}, got {value!r} ({type(value).__name__})")
    value = float(value)
    if value != value:
        raise ValueError(f"{name} must be a number, got nan")
    if min is not None and not value >= min:
        raise ValueError(f"{name} must be >= {min}, got {value}")
    return value


def check_ignore_index(value: Any) -> int:
    """``value`` as an int label value to ignore (any int64); else a TypeError / ValueError naming it.

    >>> check_ignore_index(-100)
    -100
    """
    return check_int(value, "ignore_index", min=-(2**63), max=2**63 - 1, hint="the label value to ignore, e.g. -100")


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a ``bool``; else a TypeError (``1`` or ``"yes"`` are not flags)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_choice(value: Any, name: str, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices``; else a ValueError listing them."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(repr(c) for c in choices)}")
    return value


_NO_RANK = object()


def check_cp(cp_size: Any, cp_rank: Any = _NO_RANK) -> None:
    """Raise a clear TypeError / ValueError for a bad ``cp_size`` or (when given, ``None`` included) ``cp_rank``."""
    check_int(cp_size, "cp_size", min=1)
    if cp_rank is not _NO_RANK:
        if not is_int(cp_rank):
            raise TypeError(
                f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r} ({type(cp_rank).__name__}); "
                "use the rank in the CP group (dist.get_rank(cp_group))"
            )
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")


def check_tensor(x: Any, name: str, shape: str = "") -> torch.Tensor:
    """``x`` if it is a dense, non-meta ``torch.Tensor``; else a TypeError (``shape`` describes what is expected)."""
    what = f" {shape}" if shape else ""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{what}, got {type(x).__name__}; wrap it with torch.as_tensor")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {x.layout}; convert with .to_dense()")
    if x.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (no data); materialise it on a real device first")
    return x


def check_doc_ids(doc_ids: Any, name: str = "doc_ids") -> torch.Tensor:
    """A neat-packing doc map: a dense 2D integer tensor ``[B, S]`` that int32 ``cu_seqlens`` can index."""
    check_tensor(doc_ids, name, "of shape [batch, sequence]")
    if doc_ids.dim() != 2:
        raise ValueError(
            f"{name} must be 2D [batch, sequence], got shape {tuple(doc_ids.shape)}; "
            f"add a batch dimension with {name}.unsqueeze(0) for a single row"
        )
    if doc_ids.dtype not in INTEGER_DTYPES:
        raise TypeError(
            f"{name} must have an integer dtype (1-based document index, 0 = padding), got {doc_ids.dtype}; "
            f"convert with {name}.to(torch.int32)"
        )
    if doc_ids.numel() > INT32_MAX:
        raise ValueError(
            f"{name} has {doc_ids.numel()} tokens, more than int32 cu_seqlens can index ({INT32_MAX}); split the batch"
        )
    return doc_ids


def check_cu_seqlens(cu_seqlens: Any, name: str = "cu_seqlens", *, total: int | None = None) -> np.ndarray:
    """Validated int64 NumPy copy ``[N + 1]`` of ``cu_seqlens`` (a host sync for a device tensor).

    Raises:
        TypeError: not a tensor, or not an integer dtype.
        ValueError: not 1-D and non-empty, not starting at 0, decreasing somewhere, or (``total`` given) not
            ending at ``total``.
    """
    check_tensor(cu_seqlens, name, "(int, [num_segments + 1])")
    if cu_seqlens.dtype not in INTEGER_DTYPES:
        raise TypeError(f"{name} must be an integer tensor, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{name} must be 1-D [num_segments + 1] and non-empty, got shape {tuple(cu_seqlens.shape)}")
    cu = np.ascontiguousarray(cu_seqlens.detach().to("cpu", torch.int64).numpy())
    if cu[0] != 0 or np.any(cu[1:] < cu[:-1]):
        shown = cu[:8].tolist()
        raise ValueError(
            f"{name} must start at 0 and never decrease (cumulative segment lengths), got {shown}"
            f"{'...' if cu.size > 8 else ''}; build it with packed_seq_params_from_doc_ids(doc_ids)"
        )
    if total is not None and int(cu[-1]) != total:
        raise ValueError(
            f"{name} ends at {int(cu[-1])} but the doc map has B*S = {total} tokens: the segments must cover every "
            "token exactly once; build the params with packed_seq_params_from_doc_ids(doc_ids)"
        )
    return cu


def check_divisible(total: int, cp_size: int) -> None:
    """Every CP rank holds ``total // cp_size`` tokens: ``total`` must be divisible by ``cp_size``."""
    if total % cp_size:
        raise ValueError(
            f"the batch has T = B*S = {total} tokens, not divisible by cp_size={cp_size}; every rank must hold "
            f"the same number of tokens: pad the rows to a multiple of {cp_size} (cp_packing.pad_segments(doc_ids, "
            f"multiple=...) pads rows and documents)"
        )


def check_fits_dtype(value: Any, dtype: torch.dtype, what: str, *, fix: str = "") -> None:
    """Raise a ValueError unless ``value`` is exactly representable in ``dtype``.

    Why: torch converts silently, e.g. ``-100`` becomes ``156`` in ``uint8`` (a real class id a loss would count).
    ``what`` names the value in the message (``"the pad value -100 for tensors['labels']"``).

    >>> check_fits_dtype(-100, torch.int16, "ignore_index")
    """
    problem = None
    if dtype == torch.bool:
        if isinstance(value, (bool, np.bool_)) or (is_int(value) and value in (0, 1)):
            return
        problem = "bool tensors take only 0/1/True/False"
    elif not (dtype.is_floating_point or dtype.is_complex):
        if isinstance(value, (float, np.floating)) and not float(value).is_integer():
            problem = "an integer tensor cannot hold a fractional value"
        elif not (is_int(value) or isinstance(value, (bool, np.bool_, float, np.floating))):
            problem = f"not a number ({type(value).__name__})"
        else:
            info = torch.iinfo(dtype)
            if not info.min <= int(value) <= info.max:
                problem = f"{dtype} holds [{info.min}, {info.max}]"
    else:
        try:
            torch.full((), value, dtype=dtype)
        except (RuntimeError, TypeError) as exc:
            problem = str(exc)
    if problem:
        raise ValueError(f"{what} does not fit its dtype {dtype} ({problem}){'; ' + fix if fix else ''}")


MAX_COST_TOKENS = 3_037_000_499
"""The longest stream whose causal cost ``sum(p + 1)`` cp-packing counts exactly in int64 (``T * (T + 1)`` fits)."""


def check_cost_tokens(total: Any, name: str = "cu_seqlens") -> int:
    """``total`` (the token count T of ``name``) if its causal cost fits int64; else a ValueError, never a silent
    overflow.

    >>> check_cost_tokens(8)
    8
    """
    return check_int(
        total,
        f"the token count T of {name}",
        max=MAX_COST_TOKENS,
        hint="its causal cost sum(p + 1) could overflow int64; split the batch",
    )


def check_softcap(softcap: Any) -> float | None:
    """``softcap`` (logit soft-capping: a scaled score ``s`` becomes ``softcap * tanh(s / softcap)``, Gemma 2's
    ``attn_logit_softcapping``) as a float > 0, or ``None`` (no capping).

    >>> check_softcap(50), check_softcap(None)
    (50.0, None)
    """
    if softcap is None:
        return None
    value = check_number(softcap, "softcap")
    if not (0.0 < value < float("inf")):
        raise ValueError(
            f"softcap must be a finite number > 0 (scores become softcap * tanh(scores / softcap)), got {softcap!r}; "
            "pass the model's attn_logit_softcapping, or None for no soft-capping (0 does not mean 'off' here)"
        )
    return value


MAX_SOFTMAX_SCALE = 1e6
"""The largest ``softmax_scale`` taken: ``1 / sqrt(head_dim)`` is below 1, and a scale far above it makes the scores
``scale * q.k`` overflow to inf (NaN outputs, silently)."""


def check_softmax_scale(scale: Any, name: str = "softmax_scale") -> float | None:
    """``scale`` (attention scores are ``scale * q.k``) as a float in ``(0, MAX_SOFTMAX_SCALE]``, or ``None`` (the
    default ``1 / sqrt(head_dim)``).

    >>> check_softmax_scale(0.125), check_softmax_scale(None)
    (0.125, None)
    """
    if scale is None:
        return None
    value = check_number(scale, name)
    if not 0.0 < value <= MAX_SOFTMAX_SCALE:
        raise ValueError(
            f"{name} must be a finite number in (0, {MAX_SOFTMAX_SCALE:g}] (scores are {name} * q.k; a larger or "
            f"infinite scale overflows them to NaN outputs), got {scale!r}; pass the model's scaling (HF's "
            "module.scaling, typically 1/sqrt(head_dim)), or None for 1/sqrt(head_dim)"
        )
    return value


def check_window(window: Any, causal: Any = True, name: str = "window") -> int | None:
    """``window`` (sliding-window attention: a query at in-document position ``p`` attends keys at positions
    ``p - window < k <= p``, HF's ``sliding_window``) as an int >= 1, or ``None`` (no window). A window needs
    ``causal=True`` (HF's bidirectional window is another mask, not supported).

    >>> check_window(4), check_window(None)
    (4, None)
    """
    if window is None:
        return None
    window = check_int(window, name, min=1, max=INT32_MAX, hint="pass the model's sliding_window (>= 1; a window of "
                       f"{INT32_MAX} tokens or more covers any stream int32 cu_seqlens index), or None for full "
                       "attention")
    if causal is not True:
        raise ValueError(
            f"{name}={window} needs causal=True (a query attends the {window} keys ending at itself); call with "
            f"causal=True, or {name}=None for non-causal attention"
        )
    return window


def check_windows(window: Any, name: str = "window") -> int | tuple[int | None, ...] | None:
    """The sliding window(s) a cost model or layout plans for, in a hashable form: ``None`` (full causal attention),
    an int ``>= 1`` (one window for every layer), or a per-layer list/tuple of ``int | None`` (models that mix
    sliding and global layers, e.g. Gemma 2 or Qwen2 with ``max_window_layers``), returned as a tuple.

    Raises:
        TypeError: not ``None``, an int or a list/tuple; a bool, float or string (also as a list entry).
        ValueError: a window ``< 1`` (also as a list entry), or an empty list.

    >>> check_windows(4), check_windows([4096, None]), check_windows(None)
    (4, (4096, None), None)
    """
    if window is None or is_int(window):
        return check_window(window, name=name)
    if not isinstance(window, (list, tuple)):
        raise TypeError(
            f"{name} must be an int >= 1, None or a per-layer list of (int | None), got {window!r} "
            f"({type(window).__name__}); pass the model's sliding_window, or one entry per layer (None = global)"
        )
    if not window:
        raise ValueError(
            f"{name} is an empty list: a per-layer window needs one entry per layer (an int, or None for a global "
            "layer); pass None for full attention everywhere"
        )
    return tuple(check_window(w, name=f"{name}[{i}]") for i, w in enumerate(window))


def check_weighted_cost_tokens(total: Any, weight: int, name: str = "cu_seqlens") -> int:
    """``total`` (the token count T of ``name``) if ``weight`` times its causal cost ``T (T + 1) / 2`` fits int64
    (``weight``: how many layers a per-layer window sums); else a ValueError, never a silent overflow.

    >>> check_weighted_cost_tokens(8, 3)
    8
    """
    total = check_cost_tokens(total, name)
    if weight * (total * (total + 1) // 2) > 2**63 - 1:
        raise ValueError(
            f"the token count T={total} of {name} with a per-layer window summed over {weight} layer(s) could "
            "overflow int64 in the cost sum(min(p + 1, window)); split the batch or pass fewer layers (the cost "
            "depends only on each distinct window's share of the layers)"
        )
    return total
