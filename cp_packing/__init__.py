"""cp-packing: neat-packed documents -> varlen attention metadata, sharded across context-parallel ranks.

Importing ``cp_packing`` imports torch and numpy only; transformers, flash_attn and ring_flash_attn are imported
inside the functions that need them.
"""

from cp_packing.layouts import LAYOUTS, global_token_order, layout_token_index
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids, to_flash_attention_kwargs
from cp_packing.sharding import (
    ShardedPackedSeqParams,
    ring_flash_attn_kwargs,
    shard_packed_seq_params,
    transformer_engine_kwargs,
)

__version__ = "0.1.0"

__all__ = [
    "PackedSeqParams",
    "packed_seq_params_from_doc_ids",
    "to_flash_attention_kwargs",
    "LAYOUTS",
    "layout_token_index",
    "global_token_order",
    "ShardedPackedSeqParams",
    "shard_packed_seq_params",
    "ring_flash_attn_kwargs",
    "transformer_engine_kwargs",
]
