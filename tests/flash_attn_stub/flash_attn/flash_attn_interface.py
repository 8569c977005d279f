"""Pure-torch stand-ins for the flash-attn 2.8 private kernels that ring-flash-attn 0.1.8 calls. TEST-ONLY.

Faithful to flash-attn 2.8 where ring-flash-attn can tell:

* signatures (names, order, defaults), because ring-flash-attn builds keyword arguments from
  ``inspect.getfullargspec`` of these functions;
* varlen forward returns ``(out [T, H, D], softmax_lse [H, T] float32, S_dmask, rng_state)``; the batched forward
  returns ``out [B, S, H, D]`` and ``softmax_lse [B, H, S]``;
* causal masks are aligned bottom-right when a sequence has more keys than queries; GQA (``H % H_kv == 0``);
* a query with no key gets ``out = 0`` and ``lse = +inf`` (flash-attn's value; cp-packing's API uses -inf);
* backward USES the passed-in ``out`` and ``softmax_lse`` and WRITES ``dq``/``dk``/``dv`` IN PLACE into the given
  tensors (allocating them when ``None``), returning ``softmax_d = rowsum(dout * out)`` (``[H, T]`` varlen,
  ``[B, H, S]`` batched; flash-attn pads it, nobody reads it).

Deliberate differences: CPU tensors and float32/float64 are accepted (flash-attn: CUDA fp16/bf16 only), so the
float32 paths of ring-flash-attn can be tested; dropout, sliding windows, softcap, ALiBi, paged KV and
``return_softmax`` are refused with NotImplementedError instead of being computed.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from cp_packing.attention.kernels import varlen_attention_backward, varlen_attention_forward


def _refuse(dropout_p=0.0, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            return_softmax=False, **paged) -> None:
    if dropout_p:
        raise NotImplementedError(f"flash_attn stub: dropout_p={dropout_p} is not supported (use 0.0)")
    if (window_size_left, window_size_right) != (-1, -1):
        raise NotImplementedError(
            f"flash_attn stub: window_size=({window_size_left}, {window_size_right}) is not supported (use -1, -1)"
        )
    if softcap:
        raise NotImplementedError(f"flash_attn stub: softcap={softcap} is not supported (use 0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError("flash_attn stub: alibi_slopes are not supported")
    if return_softmax:
        raise NotImplementedError("flash_attn stub: return_softmax=True is not supported")
    for name, value in paged.items():
        if value is not None:
            raise NotImplementedError(f"flash_attn stub: {name} is not supported")


def _to_flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """cp-packing writes -inf for a query without keys; flash-attn writes +inf."""
    return lse.float().masked_fill(torch.isneginf(lse), float("inf"))


def _batch_cu(batch: int, seqlen: int, device: torch.device) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen


def _write(dst: Optional[torch.Tensor], src: torch.Tensor) -> torch.Tensor:
    if dst is None:
        return src.clone()
    dst.copy_(src)
    return dst


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax,
            block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k)
    out, lse = varlen_attention_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
        softmax_scale=softmax_scale, causal=causal, kernel="torch",
    )
    S_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.zeros((2,), dtype=torch.int64, device=q.device)
    return out, _to_flash_lse(lse), S_dmask, rng_state


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    _refuse(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    grads = varlen_attention_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
        softmax_scale=softmax_scale, causal=causal, kernel="torch",
    )
    for dst, src in zip((dq, dk, dv), grads):
        _write(dst, src)
    return (dout.float() * out.float()).sum(-1).T.contiguous()  # softmax_d [H, Tq]


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax)
    B, S, H, D = q.shape
    Sk = k.shape[1]
    out, lse = varlen_attention_forward(
        q.reshape(B * S, H, D), k.reshape(B * Sk, *k.shape[2:]), v.reshape(B * Sk, *v.shape[2:]),
        _batch_cu(B, S, q.device), _batch_cu(B, Sk, q.device), S, Sk,
        softmax_scale=softmax_scale, causal=causal, kernel="torch",
    )
    lse = _to_flash_lse(lse).view(H, B, S).transpose(0, 1).contiguous()  # [B, H, S]
    S_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.zeros((2,), dtype=torch.int64, device=q.device)
    return out.view(B, S, H, D), lse, S_dmask, rng_state


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _refuse(dropout_p, window_size_left, window_size_right, softcap, alibi_slopes)
    B, S, H, D = q.shape
    Sk = k.shape[1]
    flat_kv = (B * Sk, *k.shape[2:])
    grads = varlen_attention_backward(
        dout.reshape(B * S, H, D), q.reshape(B * S, H, D), k.reshape(flat_kv), v.reshape(flat_kv),
        out.reshape(B * S, H, D), softmax_lse.transpose(0, 1).reshape(H, B * S),
        _batch_cu(B, S, q.device), _batch_cu(B, Sk, q.device), S, Sk,
        softmax_scale=softmax_scale, causal=causal, kernel="torch",
    )
    for dst, src, like in zip((dq, dk, dv), grads, (q, k, v)):
        _write(dst, src.view(like.shape))
    return (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # softmax_d [B, H, S]
