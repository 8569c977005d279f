"""What runs: the one table of CP attention backends and varlen kernels, and the refusals it implies.

Every place that must know whether a combination runs reads this module: ``select_backend`` (``"auto"`` skips what
a backend refuses), the explicit-backend refusals, the cluster verifier's SKIP rows, and the table in
docs/attention.md (generated from :func:`markdown_table`, checked by a test). Pure data and functions: no torch
import beyond dtypes, no communication.

Why each refusal: docs/attention.md, section "What runs".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from cp_packing._checks import HALF_DTYPES

__all__ = [
    "BACKENDS",
    "BACKEND_SUPPORT",
    "COMPILED_BACKENDS",
    "HALF_DTYPES",
    "KERNELS",
    "KERNEL_SUPPORT",
    "Support",
    "backend_refusal",
    "flash_attn_is_test_stub",
    "kernel_refusal",
    "markdown_table",
    "ring_dtype_refusal",
]

BACKENDS = ("allgather", "exchange", "ulysses", "hybrid", "ring_flash_attn")
"""The CP attention backends (``backend="auto"`` picks one of them)."""

KERNELS = ("torch", "flash_attn", "torch_varlen")
"""The varlen kernels, reference first (``kernel="auto"`` picks one)."""

@dataclass(frozen=True)
class Support:
    """What one backend (or kernel) runs.

    Attributes:
        layouts: the layouts it runs (``None``: every layout).
        window: a sliding window. softcap: logit soft-capping. sinks: attention sinks.
        non_causal: ``causal=False``.
        kernels: the kernels it runs (``None``: every kernel).
        devices: device types (``None``: every device).
        half_only: fp16 / bf16 only.
        compiled: a ``torch.compile`` path without graph breaks.
        heads: what it needs of the head count (prose, for the docs table).
    """

    layouts: tuple[str, ...] | None = None
    window: bool = True
    softcap: bool = True
    sinks: bool = True
    non_causal: bool = True
    kernels: tuple[str, ...] | None = None
    devices: tuple[str, ...] | None = None
    half_only: bool = False
    compiled: bool = False
    heads: str = "any"


BACKEND_SUPPORT: dict[str, Support] = {
    "allgather": Support(compiled=True),
    "exchange": Support(compiled=True),
    "ulysses": Support(compiled=True, heads="cp_size divides H"),
    "hybrid": Support(window=False, compiled=True, heads="ulysses_size divides cp_size and H"),
    "ring_flash_attn": Support(layouts=("zigzag", "contiguous"), window=False, softcap=False, sinks=False,
                               non_causal=False, kernels=("flash_attn",), half_only=True),
}
"""Backend name -> what it runs."""

KERNEL_SUPPORT: dict[str, Support] = {
    "torch": Support(),
    "flash_attn": Support(devices=("cuda",), half_only=True),
    "torch_varlen": Support(softcap=False, devices=("cuda",), half_only=True),
}
"""Kernel name -> what it runs (``torch_varlen``'s window needs a torch whose ``varlen_attn`` has ``window_size``)."""

COMPILED_BACKENDS = ("auto",) + tuple(name for name, s in BACKEND_SUPPORT.items() if s.compiled)
"""The ``backend`` values with a compiled path (``"auto"`` picks among them when compiled)."""


def flash_attn_is_test_stub() -> bool:
    """Whether the imported ``flash_attn`` is cp-packing's pure-torch test stand-in (``tests/flash_attn_stub``)."""
    return bool(getattr(sys.modules.get("flash_attn"), "IS_CP_PACKING_STUB", False))


def ring_dtype_refusal(layout: str, dtype: torch.dtype) -> str | None:
    """Why the ring backend refuses ``dtype`` with ``layout`` by design, or None when it runs it.

    float32 zigzag: ring-flash-attn 0.1.8's float32 backward is wrong (its float32 accumulator aliases the kernel's
    output buffer). Any non-fp16/bf16 dtype with the real flash-attn: its kernels run fp16/bf16 only; only the test
    stand-in runs float32 (contiguous).

    >>> ring_dtype_refusal("zigzag", torch.bfloat16) is None
    True
    """
    if dtype in HALF_DTYPES:
        return None
    if layout == "zigzag":
        return (
            f"zigzag ring attention got {dtype}; ring-flash-attn 0.1.8's zigzag backward returns WRONG gradients "
            "in float32 (its float32 accumulator aliases the kernel's output buffer, which the next step "
            "overwrites). Cast q/k/v to torch.bfloat16 or torch.float16, or use layout='contiguous' (llama3, right "
            "in float32 on the test stand-in) or cp-packing's built-in all-gather attention"
        )
    if not flash_attn_is_test_stub():
        return (
            f"ring attention got {dtype}, but flash-attn's kernels run torch.float16 / torch.bfloat16 only; cast "
            "q/k/v to torch.bfloat16 or torch.float16 (e.g. under torch.autocast), or use cp-packing's built-in "
            "all-gather attention (backend='allgather', any dtype)"
        )
    return None


def kernel_refusal(kernel: str, *, softcap: float | None = None) -> tuple[type[Exception], str] | None:
    """``(exception class, message)`` when ``kernel`` cannot take these options, else None (availability on the
    device is ``cp_packing.attention.kernels.resolve_kernel``'s).

    >>> kernel_refusal("torch_varlen", softcap=30.0)[0].__name__
    'ValueError'
    """
    if kernel not in KERNEL_SUPPORT:
        return ValueError, f"unknown attention kernel {kernel!r}; choose one of 'auto', {', '.join(map(repr, KERNELS))}"
    if softcap is not None and not KERNEL_SUPPORT[kernel].softcap:
        return ValueError, (
            f"kernel={kernel!r} cannot soft-cap scores (softcap={softcap}): torch's varlen_attn has no softcap; "
            "use kernel='auto' (flash-attn when installed, else the reference), 'flash_attn' or 'torch'"
        )
    return None


def backend_refusal(
    backend: str, *, layout: str, causal: bool = True, window: object = None, softcap: float | None = None,
    sinks: bool = False, kernel: str = "auto", dtype: torch.dtype | None = None,
) -> tuple[type[Exception], str] | None:
    """``(exception class, message)`` when ``backend`` cannot run these options, else None.

    Head counts (Ulysses, hybrid) and imports are checked where the tensors are known
    (``cp_packing.attention.dispatch.select_backend``).

    >>> backend_refusal("ring_flash_attn", layout="balanced")[1][:44]
    "backend='ring_flash_attn' has no kernel for "
    >>> backend_refusal("allgather", layout="balanced", window=64) is None
    True
    """
    if backend not in BACKEND_SUPPORT:
        choices = ", ".join(map(repr, ("auto", *BACKENDS)))
        return ValueError, f"unknown attention backend {backend!r}; choose one of {choices}"
    support = BACKEND_SUPPORT[backend]
    if window is not None and not support.window:
        why = "ring-flash-attn 0.1.8 has no sliding window" if backend == "ring_flash_attn" else "not yet"
        return NotImplementedError, (
            f"backend={backend!r} cannot run window={window} ({why}; the sliding window runs on the all-gather, "
            "exchange and Ulysses backends); use backend='allgather', 'exchange' or 'ulysses' (or 'auto')"
        )
    if not causal and not support.non_causal:
        return NotImplementedError, (
            f"backend={backend!r} is causal only (ring-flash-attn's zigzag varlen asserts causal); use "
            "backend='allgather' for causal=False"
        )
    if (softcap is not None and not support.softcap) or (sinks and not support.sinks):
        what = f"softcap={softcap}" if softcap is not None and not support.softcap else "attention sinks"
        return NotImplementedError, (
            f"backend={backend!r} cannot run {what} (ring-flash-attn 0.1.8 passes neither to its kernels); use "
            "backend='allgather' or 'ulysses' (or 'auto', which picks one of them)"
        )
    if support.layouts is not None and layout not in support.layouts:
        return ValueError, (
            f"backend={backend!r} has no kernel for layout {layout!r}; use backend='allgather' (any layout) or shard "
            f"with layout={' / '.join(repr(x) for x in support.layouts)}"
        )
    if support.kernels is not None and kernel not in ("auto", *support.kernels):
        return ValueError, (
            f"backend={backend!r} runs flash-attn kernels only, got kernel={kernel!r}; use kernel='auto' or "
            "backend='allgather' to choose a kernel"
        )
    if support.half_only and dtype is not None and backend == "ring_flash_attn":
        refusal = ring_dtype_refusal(layout, dtype)
        if refusal is not None:
            return TypeError, refusal
    return None


def _yes(flag: bool) -> str:
    return "yes" if flag else "refused"


def markdown_table() -> str:
    """The docs table of what runs, generated from :data:`BACKEND_SUPPORT` and :data:`KERNEL_SUPPORT`."""
    lines = ["| backend | layouts | window | softcap | sinks | causal=False | kernels | heads | compiled |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in BACKEND_SUPPORT.items():
        lines.append(
            f"| `{name}` | {'any' if s.layouts is None else ', '.join(s.layouts)} | {_yes(s.window)} | "
            f"{_yes(s.softcap)} | {_yes(s.sinks)} | {_yes(s.non_causal)} | "
            f"{'any' if s.kernels is None else ', '.join(s.kernels)} | {s.heads} | {'yes' if s.compiled else 'no'} |"
        )
    lines += ["", "| kernel | devices | dtypes | window | softcap | sinks |", "|---|---|---|---|---|---|"]
    for name, s in KERNEL_SUPPORT.items():
        lines.append(
            f"| `{name}` | {'any' if s.devices is None else ', '.join(s.devices)} | "
            f"{'fp16, bf16' if s.half_only else 'any'} | {_yes(s.window)} | {_yes(s.softcap)} | {_yes(s.sinks)} |"
        )
    return "\n".join(lines)
