"""Test-only helpers: a hypothesis strategy of doc maps, plain-Python reference segmentation and mask, and the attention check every layout test shares (seeded
maps come from ``cp_packing.testing.synthetic_doc_ids``)."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from cp_packing.adapters import ring_flash_attn_kwargs


@st.composite
def doc_maps(draw, max_b: int = 3, max_s: int = 48, multiple: int = 1, max_doc_len: int = 12, pad_p: float = 0.2):
    """A ``[B, S]`` int64 doc map: runs of random length, ids counting up per row (sometimes reused), padding (0)
    anywhere. With ``multiple > 1`` every run (padding too) has a length that is a multiple of it."""
    B = draw(st.integers(1, max_b))
    n_units = draw(st.integers(1, max(1, max_s // multiple)))
    S = n_units * multiple
    rows = []
    for _ in range(B):
        row: list[int] = []
        doc = 1
        while len(row) < S:
            units = draw(st.integers(1, max(1, max_doc_len // multiple)))
            length = min(units * multiple, S - len(row))
            kind = draw(st.sampled_from(["doc", "doc", "doc", "pad", "reuse"]))
            if kind == "pad" or (kind == "reuse" and doc == 1):
                value = 0
            elif kind == "reuse":
                value = draw(st.integers(1, doc))
            else:
                value = doc
                doc += 1
            # a run must differ from its left neighbour, or it would merge into it
            if row and row[-1] == value:
                value = doc
                doc += 1
            row += [value] * length
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def runs_of_row(row: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` maximal runs of a row."""
    out, start = [], 0
    for s in range(1, len(row) + 1):
        if s == len(row) or row[s] != row[s - 1]:
            out.append((row[start], start, s))
            start = s
    return out


def segments_of(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Plain-Python reference segmentation: ``(start, end)`` flat ranges, runs within a row."""
    B, S = doc_ids.shape
    out = []
    rows = doc_ids.tolist()
    for b in range(B):
        start = 0
        for s in range(1, S + 1):
            if s == S or rows[b][s] != rows[b][s - 1]:
                out.append((b * S + start, b * S + s))
                start = s
    return out


def block_diagonal_causal(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference inputs for an HF eager model over the flat stream: an additive 4-D mask ``[1, 1, T, T]`` that lets
    token i see j iff both are in one segment and ``j <= i``, and ``position_ids`` ``[1, T]`` restarting per
    segment. Built from the plain-Python segmentation, independent of the library."""
    T = doc_ids.numel()
    seg = torch.empty(T, dtype=torch.int64)
    pos = torch.empty(T, dtype=torch.int64)
    for k, (a, b) in enumerate(segments_of(doc_ids)):
        seg[a:b] = k
        pos[a:b] = torch.arange(b - a)
    t = torch.arange(T)
    allowed = (seg[:, None] == seg[None, :]) & (t[:, None] >= t[None, :])
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None], pos[None]


def _causal_attention(q, k, v):
    """q [m, H, D], k/v [n, H, D], causal aligned bottom-right (query i sees keys j <= i + n - m)."""
    m, n = q.shape[0], k.shape[0]
    scores = torch.einsum("mhd,nhd->hmn", q, k) / math.sqrt(q.shape[-1])
    mask = torch.arange(n)[None, :] <= torch.arange(m)[:, None] + (n - m)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v)


def _full_attention(q, k, v, doc_ids):
    out = torch.empty_like(q)
    for start, end in segments_of(doc_ids):
        out[start:end] = _causal_attention(q[start:end], k[start:end], v[start:end])
    return out


def assert_local_attention_equals_full(doc_ids, shards):
    """Each rank runs causal attention from ITS metadata only (runs + key starts; keys gathered from all ranks) and
    must get full attention per segment; where the layout gives llama3 metadata (``local_k_slice``), that too."""
    T = doc_ids.numel()
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    ref = _full_attention(q, k, v, doc_ids)
    # the all-gather: every rank's k/v in rank order, put back in global order
    k_glob = shards[0].unshard([s.shard(k) for s in shards]).reshape(T, 2, 4)
    v_glob = shards[0].unshard([s.shard(v) for s in shards]).reshape(T, 2, 4)
    for s in shards:
        q_loc = s.shard(q)
        out = torch.empty_like(q_loc)
        cu = s.cu_seqlens.tolist()
        for i, key_start in enumerate(s.key_start.tolist()):
            run_end = int(s.token_index[cu[i + 1] - 1]) + 1
            out[cu[i] : cu[i + 1]] = _causal_attention(
                q_loc[cu[i] : cu[i + 1]], k_glob[key_start:run_end], v_glob[key_start:run_end]
            )
        torch.testing.assert_close(out, ref[s.token_index])
        if s.layout == "contiguous":  # llama3 metadata: keys = one slice, cu_seqlens_k relative to it
            kw = ring_flash_attn_kwargs(s)
            k_sl, v_sl = k_glob[kw["local_k_slice"]], v_glob[kw["local_k_slice"]]
            cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
            out2 = torch.cat(
                [
                    _causal_attention(q_loc[cq[i] : cq[i + 1]], k_sl[ck[i] : ck[i + 1]], v_sl[ck[i] : ck[i + 1]])
                    for i in range(len(cq) - 1)
                ]
            )
            torch.testing.assert_close(out2, ref[s.token_index])
