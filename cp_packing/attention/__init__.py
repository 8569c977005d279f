"""Attention for packed, context-parallel batches.

``plan``: ``prepare_attention``, the step prepared and agreed once before the model runs (a frozen ``StepPlan``);
``dispatch``: ``context_parallel_attention``, the per-layer entry point; ``ops``: the one custom op pair every
backend's layer runs in, eager and compiled, and the explicit backend table; ``kernels``: one varlen kernel API
(pure-torch reference, flash-attn, torch varlen); the backends ``allgather``, ``exchange``, ``ulysses``, ``hybrid``
and ``ring`` (the ring-flash-attn adapter) each build their tables and run a layer's collectives and kernel;
``comm``: their collectives. Importing this package imports torch only; flash_attn, ring_flash_attn and
transformers are imported inside the functions that need them.
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
