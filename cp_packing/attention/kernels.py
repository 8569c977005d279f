"""Varlen attention kernels behind one API: a pure-torch reference, flash-attn, and torch's own varlen kernel.

The rest of cp-packing calls attention through three functions with flash-attn's varlen conventions:

* ``varlen_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> (out, lse)``
* ``varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ...) -> (dq, dk, dv)``
* ``varlen_attention(...) -> out``, the differentiable wrapper (a ``torch.autograd.Function`` over the two above).

Conventions (the same for every kernel, so that callers can merge partial results across CP ranks):

* ``q`` is ``[Tq, H, D]``, ``k``/``v`` are ``[Tk, H_kv, D]`` with ``H % H_kv == 0`` (GQA: query head ``h`` reads
  key/value head ``h // (H // H_kv)``, as flash-attn does). Sequence ``i`` has queries
  ``[cu_seqlens_q[i], cu_seqlens_q[i+1])`` and keys ``[cu_seqlens_k[i], cu_seqlens_k[i+1])``.
* ``causal=True`` aligns the mask BOTTOM-RIGHT when a sequence has more keys than queries: query ``i`` of a
  length-``m`` query run attends keys ``j <= i + (n - m)`` of its length-``n`` key run (flash-attn >= 2.1). That is
  what lets a CP rank attend its local queries against keys that reach back to the segment start.
* ``lse`` is float32 ``[H, Tq]`` (float64 for float64 inputs): the natural-log logsumexp of the SCALED scores
  ``softmax_scale * q.k`` over the keys each query attends. A query that attends no key (an empty row, e.g. the
  first ``m - n`` queries when ``n < m``) gets ``out = 0`` and ``lse = -inf`` -- the logsumexp of an empty set, the
  identity of a logsumexp merge -- never NaN. flash-attn itself writes ``+inf`` there; the flash-attn and
  torch-varlen paths translate. Tokens outside ``[cu_seqlens[0], cu_seqlens[-1])`` are treated like empty rows.
* ``window=w`` (sliding window, default ``None``; needs ``causal=True``): query ``i`` of a length-``m`` run with
  ``n`` keys attends only keys ``i + (n - m) - w < j <= i + (n - m)``, the last ``w`` keys up to its own aligned
  position (HF's ``sliding_window``; flash-attn ``window_size=(w - 1, 0)``).
* ``softcap=c`` (logit soft-capping, default ``None``): every scaled score ``s = softmax_scale * q.k`` becomes
  ``c * tanh(s / c)`` before the mask and the softmax, as HF's eager attention does for Gemma 2
  (``attn_logit_softcapping``) and flash-attn's ``softcap`` does; ``lse`` is that of the capped scores. Reference
  and flash-attn kernels (flash-attn >= 2.6); ``torch_varlen`` has none.
* ``sinks`` (attention sinks, default ``None``): a ``[H]`` tensor, one learned logit per query head that joins
  every query's softmax denominator but carries no value (gpt-oss, HF's ``s_aux``). The kernels never see it: the
  forward rescales a kernel's result, ``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse - lse')``, which is
  softmax over the keys plus the sink exactly; a backward given ``out'``/``lse'`` then returns the right dq/dk/dv,
  and ``sink_grad`` gives the sink's gradient ``-sum_q exp(sink - lse'_q) * rowsum(dout_q * out'_q)``. So every
  kernel takes sinks. The returned ``lse`` includes the sink; a query that attends no key gets ``lse = sink``.
* ``varlen_attention_backward`` uses the ``out`` and ``lse`` it is GIVEN (not a recomputation), as flash-attn
  does: with the ``out``/``lse`` of a larger attention (merged over several key blocks) it returns this key
  block's share of the gradient, which is what ring attention needs.

Kernels (``kernel=``): ``"torch"`` (reference, any device and dtype), ``"flash_attn"`` (flash-attn 2.x, fp16/bf16
on CUDA), ``"torch_varlen"`` (``torch.nn.attention.varlen.varlen_attn``, recent torch, fp16/bf16 on CUDA), or
``"auto"`` = ``select_kernel(q.device, q.dtype)``. Nothing is imported from flash_attn at module import time.
"""

from __future__ import annotations

import importlib
import functools
import inspect
import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from cp_packing._checks import HALF_DTYPES, check_softcap, check_window
from cp_packing._imports import try_import
from cp_packing.capabilities import KERNELS, kernel_refusal

__all__ = [
    "KERNELS",
    "available_kernels",
    "add_sinks",
    "check_sinks",
    "resolve_kernel",
    "run_backward",
    "run_backward_per_kv_head",
    "run_forward",
    "select_kernel",
    "sink_grad",
    "varlen_attention",
    "varlen_attention_backward",
    "varlen_attention_forward",
]



_INDEX_DTYPES = (torch.int32, torch.int64)

# Reference kernel: at most this many float32 elements per [sequences, heads, max_q, max_k] score tensor (256 MiB).
# Sequences are processed in groups that fit; a single longer sequence is processed alone.
_REFERENCE_SCORE_BUDGET = 1 << 26


# --------------------------------------------------------------------------------------------------- availability


def _flash_attn_interface() -> ModuleType | None:
    """``flash_attn.flash_attn_interface`` if importable, else ``None`` (never raises; a failure is not retried
    under the same ``sys.path``)."""
    name = "flash_attn.flash_attn_interface"
    return try_import(name, lambda: importlib.import_module(name))


def _torch_varlen_attn():
    """``torch.nn.attention.varlen.varlen_attn`` if this torch ships it, else ``None``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:  # noqa: BLE001 - older torch
        return None
    return varlen_attn


def available_kernels(device: torch.device | str | None = None) -> tuple[str, ...]:
    """The kernels that can run on ``device`` here (default: CUDA if available, else CPU).

    ``"torch"`` always; ``"flash_attn"`` and ``"torch_varlen"`` only on a CUDA device with the package / torch
    version that provides them (both run fp16/bf16 only; see ``select_kernel``).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    names = ["torch"]
    if device.type == "cuda":
        if _flash_attn_interface() is not None:
            names.append("flash_attn")
        if _torch_varlen_attn() is not None:
            names.append("torch_varlen")
    return tuple(names)


def select_kernel(device: torch.device | str, dtype: torch.dtype | None = None, *, softcap: bool = False) -> str:
    """The best kernel for tensors of ``dtype`` on ``device``: what ``kernel="auto"`` uses.

    CUDA with fp16/bf16 (or ``dtype=None``): ``"flash_attn"`` if flash-attn imports, else ``"torch_varlen"`` if
    this torch has ``torch.nn.attention.varlen``; everything else (CPU, float32, float64) gets the ``"torch"``
    reference kernel. ``softcap=True`` (the call soft-caps its scores) skips ``"torch_varlen"``, which cannot.
    Attention sinks do not change the choice (every kernel takes them, see the module docstring).
    """
    device = torch.device(device)
    if device.type != "cuda" or (dtype is not None and dtype not in HALF_DTYPES):
        return "torch"
    names = available_kernels(device)
    for name in ("flash_attn",) if softcap else ("flash_attn", "torch_varlen"):
        if name in names:
            return name
    return "torch"


# ------------------------------------------------------------------------------------------------------ checking


def check_qkv(q: Any, k: Any, v: Any, *, tokens: str = "T") -> None:
    """Raise a clear TypeError / ValueError unless q ``[T, H, D]`` and k/v ``[Tk, H_kv, D]`` are floating tensors of
    one dtype with ``H % H_kv == 0``. ``tokens`` names the token dim in messages (``"T_local"`` for a CP shard)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [{tokens}, heads, head_dim], got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [{tokens}, heads, head_dim] (varlen layout, batch flattened), got shape "
                f"{tuple(x.shape)}; flatten a [B, S, H, D] tensor with x.reshape(-1, H, D) (for [1, {tokens}, H, D]: "
                "x[0])"
            )
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [Tk, H_kv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    H, H_kv = q.shape[1], k.shape[1]
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(
            f"q has {H} heads and k/v have {H_kv}: the query heads must be a multiple of the key/value heads (GQA)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def _check_meta(cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, softmax_scale: Any) -> None:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a 1-D int32 tensor [num_seqs + 1], got {type(cu).__name__}")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be 1-D [num_seqs + 1] with at least one entry, got shape {tuple(cu.shape)}")
        if cu.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 (or int64), got {cu.dtype}; convert with {name}.to(torch.int32)")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.numel() - 1} sequences and cu_seqlens_k {cu_seqlens_k.numel() - 1}; "
            "every query sequence needs exactly one key sequence"
        )
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name} must be a Python int (the longest sequence), got {type(m).__name__}")
        if m < 0:
            raise ValueError(f"{name} must be >= 0, got {m}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))):
        raise TypeError(f"softmax_scale must be a float or None (1/sqrt(head_dim)), got {type(softmax_scale).__name__}")


def _check_grad_inputs(dout: Any, out: Any, lse: Any, q: torch.Tensor) -> None:
    for name, x in (("dout", dout), ("out", out)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor shaped like q {tuple(q.shape)}, got {type(x).__name__}")
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a float32 tensor [H, Tq], got {type(lse).__name__}")
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(
            f"lse must be [H, Tq] = [{q.shape[1]}, {q.shape[0]}] (flash-attn varlen convention), got "
            f"{tuple(lse.shape)}"
        )


def check_sinks(sinks: Any, q: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` (one attention-sink logit per query head) checked against q ``[T, H, D]``: ``None``, or a floating
    ``[H]`` tensor on q's device (any floating dtype: a float32 parameter next to bf16 q is fine; the sink math runs
    in float32). Raises a TypeError / ValueError naming the fix otherwise."""
    if sinks is None:
        return None
    H = q.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a floating torch.Tensor [H] = [{H}] (one logit per query head), got "
                        f"{type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor (learned logits), got {sinks.dtype}; cast with "
                        "sinks.float()")
    if tuple(sinks.shape) != (H,):
        raise ValueError(
            f"sinks must have shape [H] = [{H}] (one logit per query head of q {tuple(q.shape)}), got "
            f"{tuple(sinks.shape)}; pass the layer's full per-head sink vector (e.g. HF's module.sinks)"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q on {q.device}; move the sinks to q's device")
    return sinks


def resolve_kernel(kernel: str, q: torch.Tensor, *, softcap: float | None = None) -> str:
    """The concrete kernel for ``kernel`` and q: ``"auto"`` -> ``select_kernel(q.device, q.dtype)``; an explicit
    name is checked to exist and to run here, and to support ``softcap`` if one is given (a clear error, before any
    communication)."""
    if kernel == "auto":
        return select_kernel(q.device, q.dtype, softcap=softcap is not None)
    refusal = kernel_refusal(kernel, softcap=softcap)  # the capabilities table
    if refusal is not None:
        raise refusal[0](refusal[1])
    if kernel == "flash_attn" and _flash_attn_interface() is None:
        raise ImportError(
            "kernel='flash_attn' needs the flash-attn package (CUDA only): pip install cp-packing[flash]; "
            "or use kernel='auto' / 'torch'"
        )
    if kernel == "torch_varlen":
        if _torch_varlen_attn() is None:
            raise ValueError(
                f"kernel='torch_varlen' needs torch.nn.attention.varlen (recent torch), not in torch "
                f"{torch.__version__}; use kernel='auto'"
            )
        if q.device.type != "cuda":
            raise ValueError(f"kernel='torch_varlen' runs on CUDA tensors only, got {q.device}; use kernel='torch'")
    return kernel


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim) if head_dim else 1.0


# ------------------------------------------------------------------------------------------- reference (torch)


def _reference_layout(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, Tq: int, Tk: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host copies of the sequence starts and lengths, checked (the reference kernel's one host sync)."""
    cu = torch.stack([cu_seqlens_q.to(torch.int64).cpu(), cu_seqlens_k.to(torch.int64).cpu()])  # [2, N + 1]
    lens = cu[:, 1:] - cu[:, :-1]  # [2, N]
    for side, row, total, max_len, lens_row in (
        ("q", cu[0], Tq, max_seqlen_q, lens[0]),
        ("k", cu[1], Tk, max_seqlen_k, lens[1]),
    ):
        name = f"cu_seqlens_{side}"
        if int(row[0]) < 0 or int(row[-1]) > total:
            raise ValueError(
                f"{name} spans [{int(row[0])}, {int(row[-1])}), outside the {total} tokens of "
                f"{'q' if side == 'q' else 'k/v'}; cu_seqlens must index into the flattened stream"
            )
        if lens_row.numel() and int(lens_row.min()) < 0:
            bad = int(torch.nonzero(lens_row < 0)[0])
            raise ValueError(
                f"{name} decreases at sequence {bad} ({int(row[bad])} -> {int(row[bad + 1])}); it must be "
                "non-decreasing (cumulative lengths)"
            )
        longest = int(lens_row.max()) if lens_row.numel() else 0
        if longest > max_len:
            raise ValueError(
                f"max_seqlen_{side}={max_len} but {name} holds a sequence of length {longest}; a real kernel would "
                "silently skip the excess tokens. Pass the longest sequence length"
            )
    return cu[0, :-1].tolist(), lens[0].tolist(), cu[1, :-1].tolist(), lens[1].tolist()


def _chunks(lens_q: list[int], lens_k: list[int], heads: int):
    """Groups of consecutive sequences ``[lo, hi)`` whose padded score tensor fits the memory budget."""
    n = len(lens_q)
    if n == 0:
        return
    per_seq = heads * max(1, max(lens_q)) * max(1, max(lens_k))
    step = max(1, _REFERENCE_SCORE_BUDGET // per_seq)
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def _padded_index(starts: list[int], lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """int64 ``[n, M]`` flat token index of each (sequence, position) and bool ``[n, M]`` validity."""
    start = torch.tensor(starts, dtype=torch.int64, device=device)  # [n]
    length = torch.tensor(lens, dtype=torch.int64, device=device)  # [n]
    M = max(lens) if lens else 0
    pos = torch.arange(M, dtype=torch.int64, device=device)  # [M]
    valid = pos[None, :] < length[:, None]  # [n, M]
    index = torch.where(valid, start[:, None] + pos[None, :], torch.zeros((), dtype=torch.int64, device=device))
    return index, valid, M


def _gather(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [T, h, D]`` -> ``[n, M, h, D]`` in ``dtype``, zero where ``valid`` is False."""
    if x.shape[0] == 0:
        return torch.zeros(*index.shape, *x.shape[1:], dtype=dtype, device=x.device)
    g = x[index].to(dtype)  # [n, M, h, D]
    return g.masked_fill_(~valid[:, :, None, None], 0)


class _Chunk:
    """One group of sequences, padded: the score mask and gathered operands in [n, H_kv, G*M_q, ...] form.

    Query head ``h = kv_head * G + g``; folding ``G`` into the query axis lets one batched matmul serve every
    query head of a key/value head without copying K/V (GQA).
    """

    def __init__(self, q, k, cu_q_starts, lens_q, cu_k_starts, lens_k, causal, dtype, window=None):
        device = q.device
        H, H_kv, D = q.shape[1], k.shape[1], q.shape[2]
        G = H // H_kv
        self.G, self.H, self.H_kv, self.D = G, H, H_kv, D
        self.index_q, self.valid_q, Mq = _padded_index(cu_q_starts, lens_q, device)  # [n, Mq]
        self.index_k, self.valid_k, Mk = _padded_index(cu_k_starts, lens_k, device)  # [n, Mk]
        n = len(lens_q)
        self.n, self.Mq, self.Mk = n, Mq, Mk
        mask = self.valid_q[:, :, None] & self.valid_k[:, None, :]  # [n, Mq, Mk]
        if causal:
            shift = torch.tensor(lens_k, device=device) - torch.tensor(lens_q, device=device)  # [n] = n_k - m_q
            i = torch.arange(Mq, device=device)[None, :, None]
            j = torch.arange(Mk, device=device)[None, None, :]
            mask &= j <= i + shift[:, None, None]  # bottom-right aligned
            if window is not None:  # sliding window: the `window` keys ending at the query's own (aligned) position
                mask &= j > i + shift[:, None, None] - window
        self.mask = mask[:, None, None].expand(n, 1, G, Mq, Mk).reshape(n, 1, G * Mq, Mk)  # [n, 1, G*Mq, Mk]
        self.qh = self.heads_q(_gather(q, self.index_q, self.valid_q, dtype))  # [n, H_kv, G*Mq, D]
        self.kh = _gather(k, self.index_k, self.valid_k, dtype).permute(0, 2, 1, 3)  # [n, H_kv, Mk, D]

    def heads_q(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, Mq, H, E]`` -> ``[n, H_kv, G*Mq, E]``."""
        n, Mq, _, E = x.shape
        return x.view(n, Mq, self.H_kv, self.G, E).permute(0, 2, 3, 1, 4).reshape(n, self.H_kv, self.G * Mq, E)

    def tokens_q(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, H_kv, G*Mq, E]`` -> ``[n, Mq, H, E]`` (inverse of ``heads_q``)."""
        n, _, _, E = x.shape
        return x.view(n, self.H_kv, self.G, self.Mq, E).permute(0, 3, 1, 2, 4).reshape(n, self.Mq, self.H, E)

    def scores(self, scale: float, softcap: float | None = None) -> torch.Tensor:
        """Scaled (then soft-capped: ``softcap * tanh(s / softcap)``), masked scores ``[n, H_kv, G*Mq, Mk]``
        (-inf where masked)."""
        s = torch.matmul(self.qh, self.kh.transpose(-1, -2)) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap).mul_(softcap)
        return s.masked_fill_(~self.mask, float("-inf"))

    def softcap_slope(self, s: torch.Tensor, softcap: float) -> torch.Tensor:
        """``d capped / d scaled`` of the capped scores ``s``: ``1 - tanh^2 = 1 - (s / softcap)^2``; 0 where masked."""
        zero = torch.zeros((), dtype=s.dtype, device=s.device)
        return torch.where(self.mask, 1 - (s / softcap).square(), zero)

    def probs(self, s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """``exp(s - lse)`` where the mask allows, exactly 0 elsewhere (no NaN from ``-inf - -inf``)."""
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros((), dtype=lse.dtype, device=lse.device))
        return torch.where(self.mask, torch.exp(s - safe[..., None]), torch.zeros((), dtype=s.dtype, device=s.device))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reference_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window=None, softcap=None
):
    """Pure-torch varlen attention. Sequences are padded to the longest one of their group and run through a
    batched matmul with a mask; groups are sized to keep each score tensor under ``_REFERENCE_SCORE_BUDGET``
    elements, so memory is ``O(group * H * max_q * max_k)`` and time is that of dense attention over the padded
    groups (quadratic in the longest sequence). One host sync reads ``cu_seqlens``."""
    Tq, H, D = q.shape
    dtype = _compute_dtype(q.dtype)
    starts_q, lens_q, starts_k, lens_k = _reference_layout(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, Tq, k.shape[0]
    )
    out = torch.zeros(Tq, H, D, dtype=dtype, device=q.device)  # [Tq, H, D]
    lse = torch.full((H, Tq), float("-inf"), dtype=dtype, device=q.device)  # [H, Tq]
    for lo, hi in _chunks(lens_q, lens_k, H):
        c = _Chunk(q, k, starts_q[lo:hi], lens_q[lo:hi], starts_k[lo:hi], lens_k[lo:hi], causal, dtype, window)
        vh = _gather(v, c.index_k, c.valid_k, dtype).permute(0, 2, 1, 3)  # [n, H_kv, Mk, D]
        s = c.scores(scale, softcap)  # [n, H_kv, G*Mq, Mk]
        lse_c = torch.logsumexp(s, dim=-1)  # [n, H_kv, G*Mq]; -inf for empty rows
        o = torch.matmul(c.probs(s, lse_c), vh)  # [n, H_kv, G*Mq, D]
        rows = c.index_q[c.valid_q]  # [N_valid] flat query positions
        out[rows] = c.tokens_q(o)[c.valid_q]
        lse[:, rows] = c.tokens_q(lse_c[..., None])[..., 0][c.valid_q].T
    return out.to(q.dtype), lse


def _reference_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window=None,
    softcap=None,
):
    """Gradients of the reference attention, from the GIVEN ``out`` and ``lse`` (flash-attn semantics):
    ``P = exp(S - lse)`` with ``S = scale * q.k`` (soft-capped: ``c tanh(scale q.k / c)``), ``dV = P^T dO``,
    ``dS = P * (dO.V - rowsum(dO * O))`` (times ``1 - tanh^2`` under a softcap), ``dQ = scale dS K``,
    ``dK = scale dS^T Q``; GQA key/value gradients are summed over the query heads that share them."""
    Tq, H, D = q.shape
    dtype = _compute_dtype(q.dtype)
    starts_q, lens_q, starts_k, lens_k = _reference_layout(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, Tq, k.shape[0]
    )
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)  # [Tq, H, D]
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)  # [Tk, H_kv, D]
    dv = torch.zeros(v.shape, dtype=dtype, device=q.device)  # [Tk, H_kv, D]
    lse_t = lse.to(dtype).T[:, :, None]  # [Tq, H, 1]
    for lo, hi in _chunks(lens_q, lens_k, H):
        c = _Chunk(q, k, starts_q[lo:hi], lens_q[lo:hi], starts_k[lo:hi], lens_k[lo:hi], causal, dtype, window)
        vh = _gather(v, c.index_k, c.valid_k, dtype).permute(0, 2, 1, 3)  # [n, H_kv, Mk, D]
        do = c.heads_q(_gather(dout, c.index_q, c.valid_q, dtype))  # [n, H_kv, G*Mq, D]
        o = c.heads_q(_gather(out, c.index_q, c.valid_q, dtype))  # [n, H_kv, G*Mq, D]
        lse_c = c.heads_q(_gather(lse_t, c.index_q, c.valid_q, dtype))[..., 0]  # [n, H_kv, G*Mq]
        s = c.scores(scale, softcap)  # [n, H_kv, G*Mq, Mk]
        p = c.probs(s, lse_c)  # [n, H_kv, G*Mq, Mk]
        delta = (do * o).sum(-1, keepdim=True)  # [n, H_kv, G*Mq, 1]
        ds = p * (torch.matmul(do, vh.transpose(-1, -2)) - delta)  # [n, H_kv, G*Mq, Mk]
        if softcap is not None:
            ds = ds * c.softcap_slope(s, softcap)  # through the tanh
        dq_c = torch.matmul(ds, c.kh) * scale  # [n, H_kv, G*Mq, D]
        dk_c = torch.matmul(ds.transpose(-1, -2), c.qh) * scale  # [n, H_kv, Mk, D]
        dv_c = torch.matmul(p.transpose(-1, -2), do)  # [n, H_kv, Mk, D]
        rows_q = c.index_q[c.valid_q]
        rows_k = c.index_k[c.valid_k]
        dq[rows_q] = c.tokens_q(dq_c)[c.valid_q]
        dk[rows_k] = dk_c.permute(0, 2, 1, 3)[c.valid_k]
        dv[rows_k] = dv_c.permute(0, 2, 1, 3)[c.valid_k]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------------------- flash-attn


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> frozenset[str]:
    """The keyword names a flash-attn (or torch varlen) function takes, looked up once per function."""
    target = fn if inspect.isfunction(fn) else getattr(fn, "_init_fn", fn)
    return frozenset(inspect.signature(target).parameters)


def _fa_call(fn, **kwargs):
    """Call a flash-attn private function with the keyword names its installed version takes.

    flash-attn >= 2.7 takes ``window_size_left``/``window_size_right`` (and ``softcap``); 2.6 a ``window_size``
    tuple. Its functions may be ``torch.library`` custom ops whose Python function is ``_init_fn``. The signature is
    read once per function (:func:`_parameter_names`), not per call.
    """
    names = _parameter_names(fn)
    if kwargs.get("softcap") and "softcap" not in names:  # flash-attn < 2.6: it would be dropped silently
        raise ValueError(
            f"kernel='flash_attn' cannot soft-cap scores (softcap={kwargs['softcap']}): the installed flash-attn has "
            "no softcap argument (added in 2.6); upgrade flash-attn, or use kernel='torch'"
        )
    if "window_size_left" not in names:
        kwargs["window_size"] = (kwargs.pop("window_size_left"), kwargs.pop("window_size_right"))
    return fn(**{key: val for key, val in kwargs.items() if key in names})


def _left(window: int | None) -> int:
    """flash-attn's ``window_size_left`` for ``window`` (keys ``p - window < k <= p``): ``window - 1``; -1: none."""
    return -1 if window is None else window - 1


def _right(window: int | None) -> int:
    """flash-attn's ``window_size_right``: 0 under a (causal) window, -1 = none (``causal`` then decides)."""
    return -1 if window is None else 0


def _pad_head_dim(x: torch.Tensor, multiple: int = 8) -> torch.Tensor:
    """flash-attn kernels need ``head_dim % 8 == 0``; its own autograd functions zero-pad, and so do we."""
    extra = -x.shape[-1] % multiple
    return F.pad(x, [0, extra]) if extra else x


def _flash_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window=None, softcap=None
):
    fa = _flash_attn_interface()
    D = q.shape[-1]
    outputs = _fa_call(
        fa._flash_attn_varlen_forward,
        q=_pad_head_dim(q), k=_pad_head_dim(k), v=_pad_head_dim(v),
        cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=_left(window), window_size_right=_right(window), softcap=softcap or 0.0, alibi_slopes=None,
        return_softmax=False,
    )
    out, lse = (outputs[0], outputs[5]) if len(outputs) == 8 else (outputs[0], outputs[1])  # 2.6: 8 outputs
    lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))  # flash-attn: +inf for empty rows; ours: -inf
    return out[..., :D], lse


def _flash_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window=None,
    softcap=None,
):
    fa = _flash_attn_interface()
    D = q.shape[-1]
    q, k, v, out, dout = (_pad_head_dim(x) for x in (q, k, v, out, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _fa_call(
        fa._flash_attn_varlen_backward,
        dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse.masked_fill(torch.isneginf(lse), float("inf")),
        dq=dq, dk=dk, dv=dv,
        cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_seqlens_k.to(torch.int32),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dropout_p=0.0, softmax_scale=scale, causal=causal,
        window_size_left=_left(window), window_size_right=_right(window), softcap=softcap or 0.0, alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    return dq[..., :D], dk[..., :D], dv[..., :D]


# -------------------------------------------------------------------------------------------- torch varlen (CUDA)


def _expand_kv(x: torch.Tensor, H: int) -> torch.Tensor:
    """``[Tk, H_kv, D]`` -> ``[Tk, H, D]`` (GQA by repetition; kept simple and version-independent)."""
    return x if x.shape[1] == H else x.repeat_interleave(H // x.shape[1], dim=1)


def _torch_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window=None, softcap=None
):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    H = q.shape[1]
    kwargs: dict[str, Any] = {"return_aux": AuxRequest(lse=True), "scale": scale}
    names = _parameter_names(varlen_attn)
    if "is_causal" in names:  # torch 2.9 / 2.10: no window argument
        if window is not None:
            raise ValueError(
                f"kernel='torch_varlen' cannot run window={window}: torch {torch.__version__}'s varlen_attn has no "
                "window_size argument; use kernel='flash_attn' or 'torch', or a torch with varlen_attn(window_size=)"
            )
        kwargs["is_causal"] = causal
    else:  # torch >= 2.11: causal is window_size=(-1, 0), a sliding window (window - 1, 0)
        kwargs["window_size"] = (_left(window), 0) if causal else (-1, -1)
    with torch.no_grad():
        out, lse = varlen_attn(
            q, _expand_kv(k, H), _expand_kv(v, H), cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
            max_seqlen_q, max_seqlen_k, **kwargs,
        )
    if tuple(lse.shape) != (H, q.shape[0]):  # documented as [Tq, H] in some versions, [H, Tq] by the kernel
        lse = lse.T
    lse = lse.float().masked_fill(torch.isposinf(lse), float("-inf"))
    return out, lse.contiguous()


def _torch_varlen_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window=None,
    softcap=None,
):
    op = torch.ops.torch_attn._varlen_attn_backward
    H, H_kv = q.shape[1], k.shape[1]
    kwargs: dict[str, Any] = {"scale": scale}
    if "window_size" in {a.name for a in op.default._schema.arguments}:
        kwargs["window_size"] = [_left(window), 0] if causal else [-1, -1]
    elif window is not None:
        raise ValueError(
            f"kernel='torch_varlen' cannot run window={window}: this torch's varlen backward has no window_size; "
            "use kernel='flash_attn' or 'torch'"
        )
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout is always 0 in varlen_attn
    dq, dk, dv = op(
        dout.contiguous(), q, _expand_kv(k, H), _expand_kv(v, H), out,
        lse.masked_fill(torch.isneginf(lse), float("inf")).contiguous(),
        cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32), max_seqlen_q, max_seqlen_k, causal, rng_state,
        **kwargs,
    )
    if H != H_kv:
        dk = dk.view(dk.shape[0], H_kv, H // H_kv, -1).sum(2)
        dv = dv.view(dv.shape[0], H_kv, H // H_kv, -1).sum(2)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------------ public API

_FORWARD = {"torch": _reference_forward, "flash_attn": _flash_forward, "torch_varlen": _torch_varlen_forward}
_BACKWARD = {"torch": _reference_backward, "flash_attn": _flash_backward, "torch_varlen": _torch_varlen_backward}


def _checked(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, kernel, causal=True, window=None,
    softcap=None,
) -> tuple[str, float, int | None, float | None]:
    """Validate a varlen call; return the concrete kernel, the softmax scale, the window and the softcap."""
    check_qkv(q, k, v)
    _check_meta(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    window = check_window(window, bool(causal))
    softcap = check_softcap(softcap)
    return resolve_kernel(kernel, q, softcap=softcap), _scale(softmax_scale, q.shape[2]), window, softcap


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A kernel's ``(out [Tq, H, D], lse [H, Tq])`` -> the same attention with one extra, valueless logit per head
    in every softmax: ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')`` (exact, no recomputation)."""
    lse_sink = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None])  # [H, Tq]
    keep = torch.exp(lse - lse_sink)  # [H, Tq] in [0, 1]; 0 for a query without keys (lse = -inf)
    keep = torch.nan_to_num(keep, nan=0.0)  # a -inf sink next to an empty row: -inf - -inf
    out = (out.to(lse.dtype) * keep.T[:, :, None]).to(out.dtype)
    return out, lse_sink


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the attention sinks, from the forward's ``out``/``lse`` (both WITH the sinks) and ``dout``.

    A sink is a logit with no value, so ``d sink_h = -sum_q exp(sink_h - lse[h, q]) * rowsum(dout[q, h] * out[q, h])``
    (the softmax gradient of that logit), summed over this call's queries only: when the queries of a batch are
    split over CP ranks, each rank's share summed over the ranks is the gradient of the whole batch.

    Args:
        dout, out: ``[Tq, H, D]``; lse: ``[H, Tq]`` (``varlen_attention_forward(..., sinks=sinks)``'s outputs).
        sinks: ``[H]``, the sink logits the forward used.

    Returns:
        ``[H]`` in ``sinks``' dtype (computed in float32, float64 for float64 inputs).
    """
    dtype = torch.float64 if torch.float64 in (lse.dtype, out.dtype, sinks.dtype) else torch.float32
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)  # [Tq, H]
    lse = lse.to(dtype)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros((), dtype=dtype, device=lse.device))
    p_sink = torch.where(finite, torch.exp(sinks.to(dtype)[:, None] - safe), torch.zeros_like(safe))  # [H, Tq]
    return -(p_sink * delta.T).sum(1).to(sinks.dtype)


def run_forward(kernel: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                scale: float | None, causal: bool, window: int | None, softcap: float | None, sinks=None):
    """``varlen_attention_forward`` without its checks, for callers that checked once per step (the step plan):
    ``kernel`` is a concrete name. Records no autograd graph when called inside a backend's autograd function."""
    out, lse = _FORWARD[kernel](q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                _scale(scale, q.shape[2]), causal, window, softcap)
    return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def run_backward(kernel: str, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                 max_seqlen_k: int, scale: float | None, causal: bool, window: int | None, softcap: float | None):
    """``varlen_attention_backward`` without its checks (see :func:`run_forward`): ``(dq, dk, dv)``."""
    return _BACKWARD[kernel](dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             _scale(scale, q.shape[2]), causal, window, softcap)


def run_backward_per_kv_head(kernel: str, dout, q, k, v, out, lse, *meta):
    """:func:`run_backward` one key/value head (and its query heads) at a time when there are more keys than
    queries under GQA: flash-attn expands dK/dV to the query heads (``[T_k, H, D]`` each) inside its backward, and
    a rank attending far more keys than it holds (the all-gather, the exchange's received keys) would hold that for
    all of them. Attention is independent per head, so the result is the same; ``meta`` as :func:`run_backward`'s
    arguments after ``lse``."""
    H, H_kv = q.shape[1], k.shape[1]
    if H == H_kv or k.shape[0] <= q.shape[0]:
        return run_backward(kernel, dout, q, k, v, out, lse, *meta)
    rep = H // H_kv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for g in range(H_kv):
        heads, kv = slice(g * rep, (g + 1) * rep), slice(g, g + 1)
        dq[:, heads], dk[:, kv], dv[:, kv] = run_backward(
            kernel, dout[:, heads].contiguous(), q[:, heads].contiguous(), k[:, kv].contiguous(),
            v[:, kv].contiguous(), out[:, heads].contiguous(), lse[heads].contiguous(), *meta)
    return dq, dk, dv


def varlen_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    *, softmax_scale: float | None = None, causal: bool = True, kernel: str = "auto", window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen (packed) attention forward. Records no autograd graph (use ``varlen_attention`` for that).

    Args:
        q: ``[Tq, H, D]``; k, v: ``[Tk, H_kv, D]`` (``H % H_kv == 0``), one floating dtype, one device.
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) ``[N + 1]``, non-decreasing; sequence ``i`` is
            ``[cu[i], cu[i+1])`` on each side.
        max_seqlen_q, max_seqlen_k: ints >= the longest query / key sequence (the reference kernel checks this).
        softmax_scale: default ``1 / sqrt(D)``.
        causal: bottom-right aligned causal mask per sequence (see module docstring).
        kernel: ``"auto"``, ``"torch"``, ``"flash_attn"`` or ``"torch_varlen"``.
        window: sliding window (``None``: none): query ``i`` attends only the ``window`` keys ending at its
            bottom-right aligned position, keys ``i + (n - m) - window < j <= i + (n - m)`` (HF's
            ``sliding_window``: ``p - window < k <= p``; flash-attn ``window_size=(window - 1, 0)``). Needs
            ``causal=True``. ``"torch_varlen"`` takes it only where torch's ``varlen_attn`` has ``window_size``.
        softcap: logit soft-capping (``None``: none; else a float > 0): scaled scores ``s`` become
            ``softcap * tanh(s / softcap)`` before the mask and softmax (HF Gemma 2; flash-attn ``softcap``). Not
            with ``"torch_varlen"`` (``"auto"`` then skips it).
        sinks: attention sinks (``None``: none; else a floating ``[H]`` tensor on q's device): one logit per query
            head added to every softmax denominator, with no value (HF ``s_aux``, gpt-oss). Any kernel.

    Returns:
        ``out`` ``[Tq, H, D]`` in q's dtype and ``lse`` float32 ``[H, Tq]`` (natural log; ``-inf`` for a query
        that attends no key, whose ``out`` row is 0; with ``sinks`` the sink is included, so such a query has
        ``lse = sink``).

    Raises:
        TypeError / ValueError: malformed shapes, dtypes or metadata (the message names the value and the fix),
            ``softcap <= 0``, ``sinks`` not a floating ``[H]`` tensor on q's device, ``softcap`` with
            ``kernel="torch_varlen"``.
        ImportError: ``kernel="flash_attn"`` without flash-attn installed.

    The reference kernel computes in float32 (float64 for float64 inputs) and syncs once with the host to read
    ``cu_seqlens``; the flash-attn and torch-varlen kernels are sync-free.

    >>> q = k = v = torch.randn(5, 2, 4, dtype=torch.float64)
    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> out, lse = varlen_attention_forward(q, k, v, cu, cu, 3, 3, softcap=5.0, sinks=torch.zeros(2))
    >>> out.shape, lse.shape, bool((lse >= 0).all())  # the sink (logit 0) is in every denominator
    (torch.Size([5, 2, 4]), torch.Size([2, 5]), True)
    """
    name, scale, window, softcap = _checked(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, kernel, causal, window,
        softcap,
    )
    sinks = check_sinks(sinks, q)
    with torch.no_grad():
        out, lse = _FORWARD[name](
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, bool(causal), window, softcap
        )
        return (out, lse) if sinks is None else add_sinks(out, lse, sinks)


def varlen_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    kernel: str = "auto",
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``varlen_attention_forward`` with respect to q, k, v.

    Args:
        dout: ``[Tq, H, D]``, the gradient of ``out``.
        out, lse: the forward's outputs (``[Tq, H, D]``, ``[H, Tq]``). They are USED, not recomputed: pass the
            merged ``out``/``lse`` of a larger attention to get this key block's share of its gradient. With
            attention sinks, pass the forward's (sink-including) ``out``/``lse``: dq/dk/dv are then right, and
            ``sink_grad(dout, out, lse, sinks)`` gives the sinks' gradient.
        the rest: as in ``varlen_attention_forward`` (same kernel choice, scale, mask, ``window`` and ``softcap``).

    Returns:
        ``dq [Tq, H, D]``, ``dk [Tk, H_kv, D]``, ``dv [Tk, H_kv, D]`` in the inputs' dtype (GQA gradients summed
        over each key/value head's query heads); zero for tokens outside every sequence.
    """
    name, scale, window, softcap = _checked(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, kernel, causal, window,
        softcap,
    )
    _check_grad_inputs(dout, out, lse, q)
    with torch.no_grad():
        return _BACKWARD[name](
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, bool(causal),
            window, softcap,
        )


class _VarlenAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, meta):
        max_seqlen_q, max_seqlen_k, scale, causal, kernel, window, softcap = meta
        out, lse = _FORWARD[kernel](
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window, softcap
        )
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.meta = meta
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k, scale, causal, kernel, window, softcap = ctx.meta
        dq, dk, dv = _BACKWARD[kernel](
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window,
            softcap,
        )
        dsinks = sink_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    *, softmax_scale: float | None = None, causal: bool = True, kernel: str = "auto", window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable varlen attention: ``out [Tq, H, D]`` (see ``varlen_attention_forward`` for the arguments).

    Backward runs the same kernel's backward from the saved ``out`` and ``lse`` (no recomputation of the forward);
    with GQA, ``k.grad``/``v.grad`` are ``[Tk, H_kv, D]``, summed over the query heads sharing each head; a
    ``sinks`` tensor that requires grad gets ``sink_grad``'s ``[H]`` gradient.
    """
    name, scale, window, softcap = _checked(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, kernel, causal, window,
        softcap,
    )
    sinks = check_sinks(sinks, q)
    meta = (max_seqlen_q, max_seqlen_k, scale, bool(causal), name, window, softcap)
    return _VarlenAttentionFunction.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, meta)
