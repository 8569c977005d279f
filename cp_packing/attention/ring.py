"""ring-flash-attn adapter: a robust import, and one call that routes a CP shard to the kernel of its layout.

``import_ring_flash_attn()`` imports ring-flash-attn 0.1.8, whose package ``__init__`` also imports its
HuggingFace adapter, and that adapter does ``from transformers.modeling_flash_attention_utils import
is_flash_attn_greater_or_equal_2_10`` -- a name transformers >= 5.4 no longer exports there, so the whole package
fails to import. Two workarounds were possible:

* import the varlen submodules without running the package ``__init__`` (a hand-made, hollow ``ring_flash_attn``
  package in ``sys.modules``): every later ``import ring_flash_attn`` in the process, the user's included, would
  then see a package without its public names;
* add the missing name back where the adapter looks for it (CHOSEN). It is one additive attribute, set only when
  missing, holding ``transformers.utils``' own function of that name where it still exists (what transformers
  < 5.4 re-exported), else ``True`` (the flag's value whenever ring-flash-attn can run at all, flash-attn >= 2.1).
  The adapter only tests its truth, to decide whether to honour ``FLASH_ATTENTION_DETERMINISTIC``.
  Nothing existing in transformers changes, and ring-flash-attn imports completely, HF adapter included.

ring-flash-attn also needs ``flash_attn`` (GPU; tests use the pure-torch stand-in in ``tests/flash_attn_stub``)
and ``transformers`` at import time; a missing one gives an ImportError that says what to install.

``ring_attention(q, k, v, sharded, group=...)`` calls ``zigzag_ring_flash_attn_varlen_func`` for the zigzag layout
and ``llama3_flash_attn_varlen_func`` for the contiguous layout, with ``ring_flash_attn_kwargs(sharded)``.
Upstream bug it guards against: ring-flash-attn 0.1.8's zigzag (and ring) BACKWARD is wrong in float32. It starts
its float32 accumulators with ``dq = dq_buffer.to(torch.float32)``, which for a float32 buffer returns the buffer
itself, so the next block's kernel call overwrites the running sum (same for dk/dv). In bf16/fp16 ``.to`` copies
and the result is right. So float32 + zigzag is refused. The llama3 (all-gather) backward writes each head group's
gradients straight into fresh tensors and reduce-scatters them, without that aliasing; it is right in float32
(checked against full attention in ``tests/test_ring_flash_attn.py``, on the test stand-in). The real flash-attn
runs fp16/bf16 only, so with it every other dtype is refused up front, with the fix, instead of failing inside
flash-attn.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

import torch

from cp_packing._checks import HALF_DTYPES
from cp_packing.attention.allgather import resolve_attention_group
from cp_packing.groups import GroupLike
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["flash_attn_is_test_stub", "import_ring_flash_attn", "ring_attention", "ring_dtype_refusal"]

_SHIM_NAME = "is_flash_attn_greater_or_equal_2_10"


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent that fails to import; a module set to None in sys.modules
        return None


def _restore_transformers_flag() -> None:
    """Give ``transformers.modeling_flash_attention_utils`` back the flag that ring-flash-attn's adapter imports
    (removed from there in transformers 5.4). Additive and idempotent: only set when missing."""
    fa_utils = importlib.import_module("transformers.modeling_flash_attention_utils")
    if not hasattr(fa_utils, _SHIM_NAME):
        # transformers.utils still has the (deprecated) function in some 5.x releases: re-export it, as < 5.4 did.
        setattr(fa_utils, _SHIM_NAME, getattr(importlib.import_module("transformers.utils"), _SHIM_NAME, True))


def import_ring_flash_attn() -> ModuleType:
    """Import and return the ``ring_flash_attn`` package (0.1.8 API), working around its transformers >= 5.4 import
    failure (see module docstring).

    Raises:
        ImportError: ring-flash-attn, flash_attn or transformers is not installed; the message says what to install.
    """
    module = _loaded_ring_flash_attn()
    if module is not None:
        return module
    if _find_spec("ring_flash_attn") is None:
        raise ImportError(
            "ring-flash-attn is not installed: pip install cp-packing[ring] (ring-flash-attn==0.1.8, which also "
            "needs flash-attn on a CUDA machine and transformers); or use cp-packing's built-in all-gather attention"
        )
    if _find_spec("flash_attn") is None:
        raise ImportError(
            "ring-flash-attn imports flash_attn, which is not installed: pip install cp-packing[flash] (flash-attn, "
            "CUDA only); on CPU use cp-packing's built-in all-gather attention"
        )
    if _find_spec("transformers") is None:
        raise ImportError(
            "ring-flash-attn imports transformers in its package __init__ (HF adapter), which is not installed: "
            "pip install cp-packing[hf]"
        )
    _restore_transformers_flag()
    return importlib.import_module("ring_flash_attn")


def _loaded_ring_flash_attn() -> ModuleType | None:
    module = sys.modules.get("ring_flash_attn")
    if module is not None and hasattr(module, "zigzag_ring_flash_attn_varlen_func"):
        return module
    return None


def flash_attn_is_test_stub() -> bool:
    """Whether the imported ``flash_attn`` is cp-packing's pure-torch test stand-in (``tests/flash_attn_stub``, which
    sets ``IS_CP_PACKING_STUB = True``) rather than the real CUDA package."""
    return bool(getattr(sys.modules.get("flash_attn"), "IS_CP_PACKING_STUB", False))


def ring_dtype_refusal(layout: str, dtype: torch.dtype) -> str | None:
    """Why ``ring_attention`` refuses ``dtype`` with ``layout`` by design, or None when it runs it.

    float32 zigzag: ring-flash-attn 0.1.8's float32 backward is wrong (module docstring). Any non-fp16/bf16 dtype
    with the real flash-attn: its CUDA kernels run fp16/bf16 only (they would fail deep inside flash-attn); only
    the test stand-in runs float32/float64. Call after :func:`import_ring_flash_attn` (which imports flash_attn).
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


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sharded: ShardedPackedSeqParams,
    *,
    group: GroupLike,
    softmax_scale: float | None = None,
    heads_k_stride: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of this rank's tokens over the whole packed batch, with ring-flash-attn.

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, H_kv, D]`` (``H % H_kv == 0``), this rank's tokens in the order
            of ``sharded.shard(...)``; fp16/bf16 (flash-attn's dtypes; float32 with the contiguous layout only on
            the pure-torch test stand-in of flash_attn).
        sharded: this rank's ``ShardedPackedSeqParams``; ``layout="zigzag"`` runs
            ``zigzag_ring_flash_attn_varlen_func`` (KV passed around the ring), ``"contiguous"`` runs
            ``llama3_flash_attn_varlen_func`` (KV all-gathered). Other layouts have no ring-flash-attn kernel.
        group: the CP process group (``None`` = the default group); its size and this process's rank in it must
            be the shard's ``cp_size`` / ``cp_rank``.
        softmax_scale: default ``1 / sqrt(D)``.
        heads_k_stride: llama3 only: key/value heads all-gathered per step (default all of them: one all-gather;
            smaller values save memory). Must divide ``H_kv``.

    Returns:
        ``out [T_local, H, D]``, differentiable (ring-flash-attn's autograd functions).

    Raises:
        TypeError: a dtype other than fp16/bf16 (real flash-attn runs only those; float32 zigzag is refused
            even on the test stand-in, see the module docstring).
        ValueError: shapes that do not match the shard, an unknown layout, a group that is not the shard's.
        ImportError: ring-flash-attn / flash_attn / transformers missing (see ``import_ring_flash_attn``).
    """
    from cp_packing.attention.allgather import check_attention_inputs
    from cp_packing.adapters import ring_flash_attn_kwargs

    check_attention_inputs(q, k, v, sharded)  # the shard's type, [T_local, H, D] shapes, GQA, one dtype and device
    if sharded.layout not in ("zigzag", "contiguous"):
        raise ValueError(
            f"ring-flash-attn has no kernel for layout {sharded.layout!r}; shard with layout='zigzag' or "
            "'contiguous', or use cp-packing's built-in all-gather attention for this layout"
        )
    if sharded.layout == "zigzag" and q.dtype not in HALF_DTYPES:
        raise TypeError(ring_dtype_refusal(sharded.layout, q.dtype))  # independent of which flash_attn: no import yet
    rfa = import_ring_flash_attn()
    refusal = ring_dtype_refusal(sharded.layout, q.dtype)  # after the import: real flash-attn or the test stand-in
    if refusal is not None:
        raise TypeError(refusal)
    group = resolve_attention_group(group, sharded, q.device)  # size, rank and device checked as for all-gather
    # The shard's metadata lives where it was built (often CPU); the kernels need it on q's device (the all-gather
    # path does the same). A no-op when it is already there.
    kwargs = {
        name: value.to(q.device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        for name, value in ring_flash_attn_kwargs(sharded).items()
    }
    if sharded.layout == "zigzag":
        return rfa.zigzag_ring_flash_attn_varlen_func(
            q, k, v, softmax_scale=softmax_scale, causal=True, group=group, **kwargs
        )
    H_kv = k.shape[1]
    stride = H_kv if heads_k_stride is None else heads_k_stride
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1 or H_kv % stride:
        raise ValueError(f"heads_k_stride={heads_k_stride!r} must be a positive int dividing the {H_kv} k/v heads")
    return rfa.llama3_flash_attn_varlen_func(
        q, k, v, heads_k_stride=stride, softmax_scale=softmax_scale, causal=True, group=group, **kwargs
    )
