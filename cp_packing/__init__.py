"""cp-packing: neat-packed documents -> varlen attention metadata, sharded across context-parallel ranks.

Importing ``cp_packing`` imports torch and numpy only; transformers, flash_attn and ring_flash_attn are imported
inside the functions that need them.
"""

from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids, to_flash_attention_kwargs

__version__ = "0.1.0"

__all__ = [
    "PackedSeqParams",
    "packed_seq_params_from_doc_ids",
    "to_flash_attention_kwargs",
]
