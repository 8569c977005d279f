"""cp-packing: neat-packed documents -> varlen attention metadata, sharded across context-parallel ranks.

The top level holds what a training loop needs; everything else lives in its module (``cp_packing.adapters`` for
ring-flash-attn / TransformerEngine kwargs, ``cp_packing.cost`` and ``cp_packing.report`` for load balance,
``cp_packing.attention`` for kernels and backends, ``cp_packing.testing`` for synthetic maps and a rank runner).
Importing ``cp_packing`` imports torch and numpy only; ``cp_packing.hf`` is the HuggingFace layer (import it
explicitly), and flash_attn / ring_flash_attn are imported inside the functions that need them.
"""

from cp_packing.attention import context_parallel_attention, prepare_attention
from cp_packing.cost import choose_layout, layout_cost
from cp_packing.distributed import distribute_batch, distribute_packed_seq_params
from cp_packing.formats import (
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    doc_ids_from_seq_idx,
    doc_ids_from_seq_lens,
)
from cp_packing.layouts import LAYOUTS
from cp_packing.loader import cp_dataloader
from cp_packing.groups import CPMesh
from cp_packing.loss import (count_valid_labels, next_token_labels, packed_cross_entropy, packed_linear_cross_entropy,
                             reduce_loss_for_logging)
from cp_packing.options import AttentionOptions
from cp_packing.packing import pack_documents
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids, to_flash_attention_kwargs
from cp_packing.padding import pad_segments
from cp_packing.sharding import ShardedPackedSeqParams, shard_packed_seq_params

__version__ = "0.1.0"

__all__ = [
    # seed: doc map -> metadata
    "PackedSeqParams",
    "packed_seq_params_from_doc_ids",
    "to_flash_attention_kwargs",
    # data in: other packing formats -> a doc map; documents -> packed, DP-balanced steps
    "doc_ids_from_position_ids",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_seq_idx",
    "doc_ids_from_seq_lens",
    "pack_documents",
    "cp_dataloader",
    # one rank's shard
    "LAYOUTS",
    "ShardedPackedSeqParams",
    "shard_packed_seq_params",
    "pad_segments",
    "choose_layout",
    "layout_cost",
    # over torch.distributed
    "distribute_batch",
    "distribute_packed_seq_params",
    # attention and loss
    "AttentionOptions",
    "CPMesh",
    "prepare_attention",
    "context_parallel_attention",
    "next_token_labels",
    "packed_cross_entropy",
    "packed_linear_cross_entropy",
    "count_valid_labels",
    "reduce_loss_for_logging",
]
