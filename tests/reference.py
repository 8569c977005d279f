"""The one reference attention the attention tests share: dense float64 softmax per segment, from the definitions.

Written in plain torch from an explicit ``[Tq_seg, Tk_seg]`` mask per segment, independent of cp_packing's
kernels and backends: nothing of ``cp_packing.attention`` is used. Differentiable (autograd gives the reference
gradients of q, k, v and the sinks).
"""

from __future__ import annotations

import torch


def dense_attention(q, k, v, cu_q, cu_k=None, *, causal=True, window=None, softcap=None, sinks=None, scale=None,
                    return_lse=False):
    """Varlen attention of ``q`` ``[Tq, H, D]`` over ``k``, ``v`` ``[Tk, H_kv, D]``, float64; GQA by repetition.

    Segment ``i`` is queries ``[cu_q[i], cu_q[i+1])`` over keys ``[cu_k[i], cu_k[i+1])`` (``cu_k=None``: the same
    bounds, self-attention on one stream). Query ``a`` of a segment with ``m`` queries and ``n`` keys sits at key
    position ``p = a + n - m`` (bottom-right alignment, flash-attn's) and sees key ``j`` when ``j <= p`` (causal),
    ``j > p - window`` (window), with logits ``softcap * tanh(s / softcap)`` (Gemma 2) and one ``sinks[h]`` logit
    per head appended to every row and dropped after the softmax (gpt-oss). A row without keys (and no sink), or a
    token past ``cu[-1]``, gives 0 and an lse of ``-inf``.

    Returns:
        ``out`` ``[Tq, H, D]`` float64, or ``(out, lse)`` with ``return_lse`` (lse ``[H, Tq]``, the sink included).
    """
    cu_k = cu_q if cu_k is None else cu_k
    cq, ck = [int(x) for x in cu_q.tolist()], [int(x) for x in cu_k.tolist()]
    assert len(cq) == len(ck), "cu_q and cu_k must have one bound per segment alike"
    q, k, v = q.double(), k.double(), v.double()
    Tq, H, D = q.shape
    G = H // k.shape[1]
    scale = D**-0.5 if scale is None else scale
    outs, lses = [], []
    pieces = [(a, b, c, d, sinks) for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])]
    pieces.append((cq[-1], Tq, ck[-1], ck[-1], None))  # tokens after the last segment: no keys, no sink
    for a, b, c, d, sink in pieces:
        m, n = b - a, d - c
        p = torch.arange(m)[:, None] + (n - m)  # [m, 1] each query's key position
        j = torch.arange(n)[None, :]  # [1, n]
        allowed = torch.ones(m, n, dtype=torch.bool)
        if causal:
            allowed &= j <= p
        if window is not None:
            allowed &= j > p - window
        s = torch.einsum("ihd,jhd->hij", q[a:b], k[c:d].repeat_interleave(G, 1)) * scale  # [H, m, n]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~allowed, float("-inf"))
        has_key = allowed.any(-1)  # [m]
        if sink is not None:  # one more logit per head and row, with no value
            s = torch.cat([s, sink.double()[:, None, None].expand(H, m, 1)], -1)
            has_key = torch.ones_like(has_key)
        lses.append(torch.logsumexp(s, -1))  # [H, m]
        prob = torch.softmax(torch.where(has_key[None, :, None], s, torch.zeros_like(s)), -1) * has_key[None, :, None]
        outs.append(torch.einsum("hij,jhd->ihd", prob[..., :n], v[c:d].repeat_interleave(G, 1)))
    out = torch.cat(outs)
    return (out, torch.cat(lses, 1)) if return_lse else out
