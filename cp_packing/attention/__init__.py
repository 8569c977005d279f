"""Attention for packed, context-parallel batches.

``dispatch``: ``context_parallel_attention``, the one entry point (local checks, one agreement per step, then the
backend); ``kernels``: one varlen kernel API (pure-torch reference, flash-attn, torch varlen); ``allgather``: the
built-in all-gather CP attention; ``ulysses``: the built-in all-to-all (head shard) CP attention; ``hybrid``: Ulysses
inside groups of ranks, all-gather across them; ``ring``: the ring-flash-attn adapter. The backends are importable from their
modules for tests and experiments, but only the entry point raises a one-rank mistake on every rank. Importing this
package imports torch only; flash_attn, ring_flash_attn and transformers are imported inside the functions that
need them.
"""

from cp_packing.attention.dispatch import BACKENDS, context_parallel_attention, select_backend
from cp_packing.attention.plan import StepPlan, prepare_attention
from cp_packing.attention.kernels import (
    KERNELS,
    available_kernels,
    select_kernel,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from cp_packing.attention.ring import import_ring_flash_attn

__all__ = [
    "BACKENDS",
    "KERNELS",
    "StepPlan",
    "available_kernels",
    "context_parallel_attention",
    "import_ring_flash_attn",
    "prepare_attention",
    "select_backend",
    "select_kernel",
    "varlen_attention",
    "varlen_attention_backward",
    "varlen_attention_forward",
]
