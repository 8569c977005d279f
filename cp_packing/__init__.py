"""cp-packing: neat-packed documents -> varlen attention metadata, sharded across context-parallel ranks.

The top level holds what a training loop needs; everything else lives in its module (``cp_packing.adapters`` for
ring-flash-attn / TransformerEngine kwargs, ``cp_packing.cost`` and ``cp_packing.report`` for load balance,
``cp_packing.attention`` for kernels and backends, ``cp_packing.testing`` for synthetic maps and a rank runner).
Importing ``cp_packing`` imports torch and numpy only; ``cp_packing.hf`` is the HuggingFace layer (import it
explicitly), and flash_attn / ring_flash_attn are imported inside the functions that need them.
"""

import signal as _signal
import sys as _sys

STARTUP_SIGTERMS: list = []
"""SIGTERMs caught while ``python -m cp_packing train`` (or ``cp-packing train``) imports torch, before the
launcher's own handler: ``cp_packing.__main__`` hands them on as a request to stop (exit 3), not a kill."""


def _startup_train() -> bool:
    """Whether this process is ``python -m cp_packing train`` (``sys.argv[0]`` is ``-m`` while the package imports)
    or the ``cp-packing train`` script."""
    if _sys.argv[0] == "-m":
        argv = getattr(_sys, "orig_argv", [])  # the interpreter's own command line
        at = argv.index("-m") if "-m" in argv else -1
        return at >= 0 and argv[at + 1:at + 3] == ["cp_packing", "train"]
    return _sys.argv[0].endswith("cp-packing") and _sys.argv[1:2] == ["train"]


if _startup_train():  # before torch is imported below (a second or more)
    _signal.signal(_signal.SIGTERM, lambda signum, frame: STARTUP_SIGTERMS.append(signum))

from cp_packing.attention import context_parallel_attention, prepare_attention  # noqa: E402
from cp_packing.cost import choose_layout, layout_cost
from cp_packing.distributed import distribute_batch, distribute_packed_seq_params
from cp_packing.formats import (
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    doc_ids_from_seq_idx,
    doc_ids_from_seq_lens,
)
from cp_packing.layouts import LAYOUTS
from cp_packing.loader import cp_dataloader, shard_batch
from cp_packing.gradients import param_digest, sum_gradients
from cp_packing.groups import CPMesh
from cp_packing.loss import (count_valid_labels, next_token_labels, packed_cross_entropy, packed_linear_cross_entropy,
                             reduce_loss_for_logging)
from cp_packing.options import AttentionOptions
from cp_packing.packing import pack_documents
from cp_packing.packed_seq import PackedSeqParams, packed_seq_params_from_doc_ids, to_flash_attention_kwargs
from cp_packing.padding import pad_segments
from cp_packing.sharding import ShardedPackedSeqParams, shard_packed_seq_params

__version__ = "0.1.0"


def clear_caches() -> None:
    """Empty every per-process cache of the library: the layout plans and ``layout="auto"`` choices, the kernel
    lookups, the step plans' per-group state, Ulysses x all-gather sub-groups, and the model features read from HF
    configs (when ``cp_packing.hf`` is loaded).

    For tests, a re-initialised world, or memory. Caches never change results, only whether work is redone; call it
    on every rank of a group alike (the next hybrid step re-creates its sub-groups, a collective). The agreement's
    per-group step counters are not a cache and are kept (they must stay equal across ranks).

    >>> clear_caches()
    """
    from cp_packing.attention import hybrid, kernels, ops, plan
    from cp_packing.layouts import _cached_plan, choose

    for cached in (_cached_plan, choose._cached_choice,
                   kernels._parameter_names, ops._kernel, ops._decode):
        cached.cache_clear()
    plan.clear_caches()
    hybrid._GROUPS.clear()
    hf = _sys.modules.get("cp_packing.hf")
    if hf is not None:
        hf._CONFIG_FEATURES.clear()


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
    "shard_batch",
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
    "sum_gradients",
    "param_digest",
    # tests, a re-initialised world
    "clear_caches",
]
