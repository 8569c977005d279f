"""Attention for packed, context-parallel batches.

``kernels``: one varlen kernel API (pure-torch reference, flash-attn, torch varlen); ``ring``: the ring-flash-attn
adapter; ``allgather``: the built-in all-gather CP attention; ``dispatch``: ``context_parallel_attention``, the
one entry point. Importing this package imports torch only; flash_attn, ring_flash_attn and transformers are imported inside
the functions that need them.
"""

from cp_packing.attention.kernels import (
    KERNELS,
    available_kernels,
    select_kernel,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from cp_packing.attention.ring import import_ring_flash_attn, ring_attention
from cp_packing.attention.allgather import AllGatherKeys, allgather_attention, allgather_keys
from cp_packing.attention.dispatch import BACKENDS, context_parallel_attention, select_backend

__all__ = [
    "AllGatherKeys",
    "BACKENDS",
    "allgather_attention",
    "allgather_keys",
    "context_parallel_attention",
    "select_backend",
    "KERNELS",
    "available_kernels",
    "import_ring_flash_attn",
    "ring_attention",
    "select_kernel",
    "varlen_attention",
    "varlen_attention_backward",
    "varlen_attention_forward",
]
