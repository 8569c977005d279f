"""One entry point for context-parallel attention over a packed batch: ``context_parallel_attention``.

It takes this rank's ``q [T_local, H, D]``, ``k``/``v [T_local, H_kv, D]`` and its ``ShardedPackedSeqParams`` and
returns ``[T_local, H, D]``: for every local token, attention over the keys of its segment (causal: up to itself),
equal to full attention on the global stream, sharded. Backends:

* ``"allgather"`` (built in, ``cp_packing.attention.allgather``): all-gather K/V, one key index per step, varlen
  attention per local run. Every layout (contiguous, zigzag, balanced, ...), every kernel, every dtype, causal or
  not, with or without a sliding ``window``, CPU or CUDA.
* ``"ring_flash_attn"`` (``cp_packing.attention.ring``): ring-flash-attn 0.1.8's zigzag ring (``zigzag``) or llama3
  all-gather (``contiguous``) varlen functions; causal only; needs ring-flash-attn and flash_attn (CUDA; on CPU the
  test stand-in). fp16/bf16 only (flash-attn's dtypes; the test stand-in also runs float32 contiguous); float32
  zigzag is refused everywhere (ring-flash-attn's float32 backward is wrong).
* ``"ulysses"`` (built in, ``cp_packing.attention.ulysses``): all-to-all from the sequence shard to a head shard,
  varlen attention over the whole stream on the global ``cu_seqlens`` for ``H / cp`` heads, all-to-all back. Every
  layout, every kernel, causal or not; ``cp_size`` must divide the query heads (key/value heads are replicated
  when it does not divide them). ``"auto"`` picks it when it moves fewer bytes (below).
* ``"hybrid"`` (``cp_packing.attention.hybrid``, with ``ulysses_size=U``): Ulysses inside groups of ``U``
  consecutive CP ranks, the all-gather backend across them; ``U`` divides ``cp_size`` and the query heads.
  Explicit only.
* ``"auto"``: ``ring_flash_attn`` when it is importable, the tensors are CUDA bf16/fp16, the layout is zigzag or
  contiguous, ``causal=True``, no ``window``, no ``softcap``, no ``sinks``, ``cp_size > 1`` and ``kernel`` is
  ``"auto"``/``"flash_attn"``; otherwise
  ``ulysses`` when ``cp_size`` divides the query heads, there is no ``window`` and it moves fewer forward bytes per
  layer than the all-gather (``cp_packing.cost.choose_backend_by_bytes``: ``H + H_kv' < cp * H_kv``, e.g. 32/8
  heads at cp 8, MHA at cp 4), else ``allgather`` (ties included); the log line then gives both byte figures. float32 therefore never reaches the ring's wrong float32 zigzag backward. The choice is logged
  once per (backend, kernel) on the ``cp_packing`` logger (INFO). Whether ring-flash-attn imports is asked on
  every call; a failed import is remembered (until ``sys.path`` changes), not retried in every layer.

What each backend runs (``kernel`` = the varlen kernel of allgather / ulysses / hybrid):

| backend | window | softcap | sinks |
|---|---|---|---|
| ``allgather`` | yes | yes | yes (each rank: its queries' share of the gradient) |
| ``ulysses`` | yes (explicit; ``auto`` keeps the all-gather for a window) | yes | yes (each rank: its head slice's gradient) |
| ``hybrid`` | refused | yes | yes (each rank: its head slice's gradient) |
| ``ring_flash_attn`` | refused | refused | refused (ring-flash-attn 0.1.8 passes neither) |

Kernels: ``softcap`` runs on ``"torch"`` and ``"flash_attn"`` (flash-attn >= 2.6), not ``"torch_varlen"`` (``"auto"``
skips it); sinks on every kernel (a rescale of the kernel's ``out``/``lse``, see ``cp_packing.attention.kernels``).
"""

from __future__ import annotations

import torch

from cp_packing.attention import allgather, exchange, hybrid, ring, ulysses  # noqa: F401  (they register)
from cp_packing.attention.plan import prepare_attention, select_backend
from cp_packing.capabilities import BACKENDS as _BACKENDS
from cp_packing.groups import GroupLike
from cp_packing.options import AttentionOptions
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["BACKENDS", "context_parallel_attention", "select_backend"]

BACKENDS = ("auto", *_BACKENDS)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sharded: ShardedPackedSeqParams,
    *,
    group: GroupLike = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    kernel: str = "auto",
    ulysses_size: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this CP rank's tokens over their whole segments, for any layout. Differentiable.

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, H_kv, D]`` with ``H % H_kv == 0`` (GQA): this rank's tokens in
            ``sharded``'s local order (``sharded.shard(x)``), one floating dtype, one device.
        sharded: this rank's ``ShardedPackedSeqParams`` (``shard_packed_seq_params``).
        group: the CP ``ProcessGroup`` or a 1-D ``DeviceMesh`` (``None`` = the default group); size
            ``sharded.cp_size``, this process's rank ``sharded.cp_rank``. With ``cp_size == 1`` (and the allgather backend) nothing is communicated
            and no process group is needed.
        causal: causal within each segment (default). ``False``: every token attends its whole segment
            (allgather and ulysses backends).
        softmax_scale: default ``1 / sqrt(D)``.
        backend: ``"auto"`` (default: ring-flash-attn, else all-gather or Ulysses by bytes), ``"allgather"``, ``"ring_flash_attn"``, ``"ulysses"`` (``cp_size`` must
            divide H) or ``"hybrid"`` (see module docstring).
        kernel: the varlen kernel of the allgather, ulysses and hybrid backends: ``"auto"``, ``"torch"``,
            ``"flash_attn"``, ``"torch_varlen"`` (``cp_packing.attention.kernels``).
        ulysses_size: ``backend="hybrid"`` only: ranks per Ulysses group (divides ``cp_size`` and H).
        window: sliding window per segment (``None``: none; needs ``causal=True``): a token at in-segment
            position ``p`` attends keys ``p - window < k <= p`` (HF's ``sliding_window``). allgather and ulysses
            backends (``"auto"`` then picks the all-gather, whose key index shrinks with the window).
        softcap: logit soft-capping (``None``: none; a float > 0): scaled scores ``s`` become
            ``softcap * tanh(s / softcap)`` before the softmax (HF Gemma 2's ``attn_logit_softcapping``). allgather,
            ulysses and hybrid backends; kernels ``"torch"`` and ``"flash_attn"``.
        sinks: attention sinks (``None``: none): a floating ``[H]`` tensor on q's device, one learned logit per
            query head that joins every softmax denominator with no value (HF's ``s_aux``, gpt-oss). allgather,
            ulysses and hybrid backends, every kernel. Its gradient on each rank is this rank's part; the parts
            summed over the CP group (as a DP gradient all-reduce over the CP ranks does) are the batch's gradient.

    Returns:
        ``[T_local, H, D]`` in q's dtype.

    Raises:
        TypeError / ValueError: malformed inputs (the message names the value and the fix), a group that does
            not match ``sharded``, an unknown backend or kernel, ``backend="ulysses"`` with a head count that
            ``cp_size`` does not divide.
        NotImplementedError: ``backend="ring_flash_attn"`` with ``causal=False``, a ``window``, ``softcap`` or
            ``sinks``; ``backend="hybrid"`` with a ``window``.
        ImportError: ``backend="ring_flash_attn"`` without ring-flash-attn / flash_attn installed.

    Every rank must call it with the same backend, kernel and flags (they decide which collectives run); an
    all-padding rank joins them like any other. Before its first collective of a step, every rank's local checks
    and one agreement run (``cp_packing.agreement``), so a mistake on one rank is raised on every rank.

    >>> import torch, cp_packing
    >>> params = cp_packing.packed_seq_params_from_doc_ids(torch.tensor([[1, 1, 1, 2, 2, 0]]))
    >>> sharded = cp_packing.shard_packed_seq_params(params, cp_size=1, cp_rank=0)  # no CP: no group needed
    >>> q = k = v = torch.randn(6, 2, 8)
    >>> context_parallel_attention(q, k, v, sharded).shape
    torch.Size([6, 2, 8])
    """
    if not isinstance(sharded, ShardedPackedSeqParams):
        from cp_packing.attention.plan import check_attention_inputs

        check_attention_inputs(q, k, v, sharded)  # the TypeError naming the fix (every rank passes the same type)
    plan, error = sharded.plan, None
    if plan is None or (group is not None and group is not plan._group_arg):
        try:
            options = AttentionOptions(backend=backend, kernel=kernel, ulysses_size=ulysses_size, causal=causal,
                                       softcap=softcap, sinks=isinstance(sinks, torch.Tensor), scale=softmax_scale)
        except (TypeError, ValueError) as exc:  # raised on every rank, through the call's agreement
            options, error = AttentionOptions(), exc
        plan = prepare_attention(sharded, group=group, options=options).plan  # this call is its own step
    return plan.attend(q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks, scale=softmax_scale,
                       error=error)
