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

import logging

import torch
import torch.distributed as dist

from cp_packing._checks import HALF_DTYPES, check_bool, check_number, check_softcap, check_window
from cp_packing._imports import try_import
from cp_packing.agreement import agree, digest
from cp_packing.attention.allgather import allgather_attention, check_attention_inputs, resolve_attention_group
from cp_packing.attention.kernels import check_sinks, resolve_kernel
from cp_packing.attention.hybrid import check_ulysses_size, hybrid_attention
from cp_packing.attention.ulysses import check_ulysses_heads, ulysses_attention
from cp_packing.cost import choose_backend_by_bytes
from cp_packing.groups import GroupLike, as_process_group
from cp_packing.sharding import ShardedPackedSeqParams

__all__ = ["BACKENDS", "context_parallel_attention", "select_backend"]

BACKENDS = ("auto", "allgather", "ring_flash_attn", "ulysses", "hybrid")

logger = logging.getLogger("cp_packing")
_LOGGED: set[tuple[str, str]] = set()
_RING_LAYOUTS = ("zigzag", "contiguous")


def _ring_importable() -> bool:
    """Whether ring-flash-attn (and the flash_attn it imports) can be imported here. Never raises; a failure is not
    retried under the same ``sys.path``."""
    from cp_packing.attention.ring import import_ring_flash_attn

    return try_import("ring_flash_attn", import_ring_flash_attn) is not None


def _auto_wants_ring(device_type: str, dtype: torch.dtype, layout: str, cp_size: int, causal: bool, kernel: str) -> bool:
    """``backend="auto"``'s rule, before the import check: ring-flash-attn only where it is fast AND right
    (CUDA fp16/bf16: its float32 zigzag backward is wrong), where it has a kernel (zigzag/contiguous, causal), where
    there is something to communicate (cp_size > 1) and where the caller did not ask for another kernel."""
    return (
        causal
        and kernel in ("auto", "flash_attn")
        and layout in _RING_LAYOUTS
        and cp_size > 1
        and device_type == "cuda"
        and dtype in HALF_DTYPES
    )


def _auto_bytes_choice(q, sharded, window, num_kv_heads) -> tuple[str, int, int | None]:
    """``choose_backend_by_bytes`` for this call's shapes: ``(backend, allgather bytes, ulysses bytes)``."""
    H = q.shape[1]
    H_kv = H if num_kv_heads is None else num_kv_heads
    if H_kv < 1 or H % H_kv:
        return "allgather", 0, None  # malformed GQA: check_attention_inputs names it
    return choose_backend_by_bytes(T_local=sharded.num_local_tokens, cp_size=sharded.cp_size, num_heads=H,
                                   num_kv_heads=H_kv, head_dim=max(1, q.shape[2]), dtype_bytes=q.element_size(),
                                   window=window)


def select_backend(
    q: torch.Tensor, sharded: ShardedPackedSeqParams, *, causal: bool = True, backend: str = "auto", kernel: str = "auto",
    ulysses_size: int | None = None, window: int | None = None, num_kv_heads: int | None = None,
    softcap: float | None = None, sinks: bool = False,
) -> tuple[str, str]:
    """The ``(backend, kernel)`` pair ``context_parallel_attention`` runs for these arguments.

    ``backend="auto"`` resolves as described in the module docstring; an explicit backend is checked
    (``ring_flash_attn``: causal, zigzag/contiguous layout, kernel ``"auto"``/``"flash_attn"``, CUDA tensors or an
    importable ``flash_attn`` on CPU; ``ulysses``: ``sharded.cp_size`` divides q's heads; ``hybrid``:
    ``ulysses_size`` divides ``sharded.cp_size`` and q's heads; ``ulysses_size`` with another backend is refused). The kernel of
    ``ring_flash_attn`` is always ``"flash_attn"``. ``num_kv_heads`` (k's heads; ``None``: q's, as in MHA) feeds
    ``"auto"``'s bytes rule between ``allgather`` and ``ulysses``. ``softcap`` (the value) and ``sinks`` (whether
    the call has attention sinks) rule out ``ring_flash_attn``; a ``softcap`` rules out the ``"torch_varlen"`` kernel.

    Raises:
        ValueError: unknown backend or kernel, or an explicit backend that cannot serve these arguments.
        NotImplementedError: ``ring_flash_attn`` with ``causal=False``, a ``window``, a ``softcap`` or ``sinks``
            (``"auto"`` then picks ``allgather`` or ``ulysses``).
        ImportError: explicit ``ring_flash_attn`` that cannot be imported.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    if (backend == "hybrid") != (ulysses_size is not None):
        raise ValueError(
            f"ulysses_size={ulysses_size!r} with backend={backend!r}: ulysses_size (ranks per Ulysses group) goes "
            "with backend='hybrid' and only with it; use backend='ulysses' for Ulysses over the whole CP group"
        )
    if backend == "auto":
        if (
            window is None
            and softcap is None
            and not sinks
            and _auto_wants_ring(q.device.type, q.dtype, sharded.layout, sharded.cp_size, causal, kernel)
            and _ring_importable()
        ):
            return "ring_flash_attn", "flash_attn"
        return _auto_bytes_choice(q, sharded, window, num_kv_heads)[0], resolve_kernel(kernel, q, softcap=softcap)
    if backend == "allgather":
        return "allgather", resolve_kernel(kernel, q, softcap=softcap)
    if window is not None and backend == "hybrid":
        raise NotImplementedError(
            f"backend={backend!r} cannot run window={window} yet (the sliding window runs on the all-gather and "
            "Ulysses backends); use backend='allgather' or 'ulysses' (or 'auto')"
        )
    if backend == "ulysses":
        check_ulysses_heads(q.shape[1], sharded.cp_size)  # rank-local, so it runs before the agreement
        return "ulysses", resolve_kernel(kernel, q, softcap=softcap)
    if backend == "hybrid":
        check_ulysses_size(ulysses_size, q.shape[1], sharded.cp_size)  # rank-local, before the agreement
        return "hybrid", resolve_kernel(kernel, q, softcap=softcap)
    # explicit ring_flash_attn
    if not causal:
        raise NotImplementedError(
            "backend='ring_flash_attn' is causal only (ring-flash-attn's zigzag varlen asserts causal); use "
            "backend='allgather' for causal=False"
        )
    if window is not None:
        raise NotImplementedError(
            f"backend='ring_flash_attn' cannot run window={window} (ring-flash-attn 0.1.8 has no sliding window); "
            "use backend='allgather' (or 'auto', which picks it for a window)"
        )
    if softcap is not None or sinks:
        what = f"softcap={softcap}" if softcap is not None else "attention sinks"
        raise NotImplementedError(
            f"backend='ring_flash_attn' cannot run {what} (ring-flash-attn 0.1.8 passes neither to its kernels); use "
            "backend='allgather' or 'ulysses' (or 'auto', which picks one of them)"
        )
    if sharded.layout not in _RING_LAYOUTS:
        raise ValueError(
            f"backend='ring_flash_attn' has no kernel for layout {sharded.layout!r}; use backend='allgather' (any "
            "layout) or shard with layout='zigzag' / 'contiguous'"
        )
    if kernel not in ("auto", "flash_attn"):
        raise ValueError(
            f"backend='ring_flash_attn' runs flash-attn kernels only, got kernel={kernel!r}; use kernel='auto' or "
            "backend='allgather' to choose a kernel"
        )
    from cp_packing.attention.ring import import_ring_flash_attn

    import_ring_flash_attn()  # ImportError that says what to install
    return "ring_flash_attn", "flash_attn"


def _log_choice(backend: str, kernel: str, sharded: ShardedPackedSeqParams, q: torch.Tensor, why: str = "") -> None:
    if (backend, kernel) in _LOGGED:
        return
    _LOGGED.add((backend, kernel))
    logger.info(
        "context_parallel_attention: backend=%s kernel=%s (layout=%s, cp_size=%d, %s on %s)%s",
        backend, kernel, sharded.layout, sharded.cp_size, str(q.dtype).replace("torch.", ""), q.device.type, why,
    )


def _agreement_group(group: object, sharded: object) -> dist.ProcessGroup | None:
    """The group the attention call would communicate over, or ``None`` when it communicates with no one."""
    try:
        pg = as_process_group(group)
    except (TypeError, ValueError):
        return None  # not a group at all: every rank sees the same TypeError
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if pg is None:
        return dist.group.WORLD if getattr(sharded, "cp_size", 1) != 1 else None
    return pg if dist.get_rank(pg) >= 0 and dist.get_world_size(pg) > 1 else None


def _agree_once_per_step(q, k, sharded, group, error, **options) -> None:
    """One ``agree`` over the CP group per step (cached on the shard per call signature), and on every error.

    Every rank sends what decides the collectives and their sizes: the shard's plan (cp size, layout and a digest
    of the global ``cu_seqlens``), ``T_local``, q/k shapes and dtype, backend, kernel and flags. A rank whose own
    checks failed sends its error instead, and every rank raises it. Layers after the first reuse the agreement.
    """
    pg = _agreement_group(group, sharded)
    if pg is None:
        if error is not None:
            raise error
        return
    if error is not None:
        agree(pg, "context_parallel_attention", {}, error=error)
        return  # agree raised on every rank
    fields = {
        "cp_size": sharded.cp_size,
        "layout": sharded.layout,
        "plan": sharded.cached("plan_digest", lambda: digest(sharded.global_params.cu_seqlens, sharded.layout,
                                                            sharded.cp_size)),
        "T_local": sharded.num_local_tokens,
        "q": (tuple(q.shape[1:]), str(q.dtype), q.device.type),
        "k": tuple(k.shape[1:]),
        **{name: value for name, value in options.items()},
    }
    signature = tuple(fields.items())
    sharded.cached(("attention_agreed", signature), lambda: agree(pg, "context_parallel_attention", fields))


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
    error, chosen, kernel_name = None, backend, kernel
    try:  # every rank-local check first; a failure goes through the agreement, so every rank raises it
        check_attention_inputs(q, k, v, sharded)
        check_bool(causal, "causal")
        check_number(softmax_scale, "softmax_scale", allow_none=True)
        check_window(window, causal)
        softcap = check_softcap(softcap)
        check_sinks(sinks, q)
        chosen, kernel_name = select_backend(q, sharded, causal=causal, backend=backend, kernel=kernel,
                                             ulysses_size=ulysses_size, window=window, num_kv_heads=k.shape[1],
                                             softcap=softcap, sinks=sinks is not None)
        resolve_attention_group(group, sharded, q.device)
    except (TypeError, ValueError, NotImplementedError, ImportError) as exc:
        error = exc
    _agree_once_per_step(q, k, sharded, group, error, chosen=chosen, kernel=kernel_name, causal=causal,
                         softmax_scale=softmax_scale, ulysses_size=ulysses_size, window=window, softcap=softcap,
                         sinks=None if not isinstance(sinks, torch.Tensor) else tuple(sinks.shape))
    why = ""
    if backend == "auto" and chosen in ("allgather", "ulysses"):
        _, allgather_bytes, ulysses_bytes = _auto_bytes_choice(q, sharded, window, k.shape[1])
        why = (f"; auto by forward bytes per layer and rank: allgather {allgather_bytes}, ulysses "
               f"{'n/a' if ulysses_bytes is None else ulysses_bytes}")
    _log_choice(chosen, kernel_name, sharded, q, why)
    if chosen == "allgather":
        return allgather_attention(
            q, k, v, sharded, group=group, causal=causal, softmax_scale=softmax_scale, kernel=kernel_name,
            window=window, softcap=softcap, sinks=sinks,
        )
    if chosen == "ulysses":
        return ulysses_attention(
            q, k, v, sharded, group=group, causal=causal, softmax_scale=softmax_scale, kernel=kernel_name,
            softcap=softcap, sinks=sinks, window=window,
        )
    if chosen == "hybrid":
        return hybrid_attention(
            q, k, v, sharded, ulysses_size=ulysses_size, group=group, causal=causal, softmax_scale=softmax_scale,
            kernel=kernel_name, softcap=softcap, sinks=sinks,
        )
    from cp_packing.attention.ring import ring_attention

    return ring_attention(q, k, v, sharded, group=group, softmax_scale=softmax_scale)
