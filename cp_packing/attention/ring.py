"""ring-flash-attn adapter: a robust import, and the ring backend that routes a shard to the kernel of its layout.

``import_ring_flash_attn()`` imports ring-flash-attn 0.1.8 with transformers >= 5.4, whose removal of
``is_flash_attn_greater_or_equal_2_10`` breaks ring-flash-attn's package import: the one missing name is added back
where its HF adapter looks (additive, only when missing; docs/integration.md, "The transformers >= 5.4 import
shim"). The backend calls ``zigzag_ring_flash_attn_varlen_func`` for the zigzag layout and
``llama3_flash_attn_varlen_func`` for the contiguous one, with ``cp_packing.adapters.ring_flash_attn_kwargs``; the
dtypes it refuses, and why: ``cp_packing.capabilities.ring_dtype_refusal``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType

import torch

from cp_packing.capabilities import flash_attn_is_test_stub, ring_dtype_refusal

__all__ = ["build_tables", "eager", "flash_attn_is_test_stub", "import_ring_flash_attn", 
           "ring_dtype_refusal"]

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
    failure (docs/integration.md).

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


def build_tables(ctx, causal: bool, window: int | None, chunk: int | None = None) -> dict:
    """The step plan's ring-flash-attn call: the kernel of the shard's layout and its kwargs
    (``cp_packing.adapters.ring_flash_attn_kwargs``) on q's device, built once per step, not in every layer."""
    from cp_packing.adapters import ring_flash_attn_kwargs

    kwargs = {name: value.to(ctx.device, non_blocking=True) if isinstance(value, torch.Tensor) else value
              for name, value in ring_flash_attn_kwargs(ctx.sharded).items()}
    return {"layout": ctx.sharded.layout, "heads_k_stride": ctx.options.heads_k_stride, "kwargs": kwargs}


def eager(q, k, v, sinks, tables: dict, layer) -> torch.Tensor:
    """One ring-flash-attn layer (zigzag ring or llama3 all-gather, by the shard's layout): ring-flash-attn's own
    autograd functions, so it runs eagerly only (``torch.compile`` is refused by the step plan)."""
    rfa = import_ring_flash_attn()
    if tables["layout"] == "zigzag":
        return rfa.zigzag_ring_flash_attn_varlen_func(q, k, v, softmax_scale=layer.scale, causal=True,
                                                      group=layer.group, **tables["kwargs"])
    H_kv = k.shape[1]
    stride = H_kv if tables["heads_k_stride"] is None else tables["heads_k_stride"]  # divides H_kv: checked
    return rfa.llama3_flash_attn_varlen_func(q, k, v, heads_k_stride=stride, softmax_scale=layer.scale, causal=True,
                                             group=layer.group, **tables["kwargs"])
