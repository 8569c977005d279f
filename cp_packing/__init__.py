"""cp-packing: neat-packed documents -> varlen attention metadata, sharded across context-parallel ranks.

Importing ``cp_packing`` imports torch and numpy only; transformers, flash_attn and ring_flash_attn are imported
inside the functions that need them (``cp_packing.hf`` is the HuggingFace layer: import it explicitly).
"""

from cp_packing.attention import (
    available_kernels,
    context_parallel_attention,
    import_ring_flash_attn,
    ring_attention,
    select_kernel,
    varlen_attention,
)
from cp_packing.cost import LayoutCost, causal_cost, choose_layout, layout_cost
from cp_packing.distributed import DOC_IDS_KEY, distribute_batch, distribute_packed_seq_params
from cp_packing.layouts import LAYOUTS, global_token_order, layout_token_index
from cp_packing.layouts.balanced import balanced_runs
from cp_packing.loss import next_token_labels, packed_cross_entropy, reduce_loss_for_logging
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids, to_flash_attention_kwargs
from cp_packing.padding import PaddedBatch, pad_segments
from cp_packing.report import balance_report, plot_balance
from cp_packing.sharding import (
    ShardedPackedSeqParams,
    ring_flash_attn_kwargs,
    shard_packed_seq_params,
    transformer_engine_kwargs,
)

__version__ = "0.1.0"

__all__ = [
    # seed
    "PackedSeqParams",
    "packed_seq_params_from_doc_ids",
    "to_flash_attention_kwargs",
    # layouts and sharding
    "LAYOUTS",
    "layout_token_index",
    "global_token_order",
    "ShardedPackedSeqParams",
    "shard_packed_seq_params",
    "ring_flash_attn_kwargs",
    "transformer_engine_kwargs",
    "PaddedBatch",
    "pad_segments",
    "balanced_runs",
    "choose_layout",
    # cost model and report
    "LayoutCost",
    "layout_cost",
    "causal_cost",
    "balance_report",
    "plot_balance",
    # torch.distributed
    "DOC_IDS_KEY",
    "distribute_packed_seq_params",
    "distribute_batch",
    # loss
    "next_token_labels",
    "packed_cross_entropy",
    "reduce_loss_for_logging",
    # attention
    "context_parallel_attention",
    "varlen_attention",
    "available_kernels",
    "select_kernel",
    "ring_attention",
    "import_ring_flash_attn",
]
