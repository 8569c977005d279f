"""Test-only helpers: a hypothesis strategy of doc maps and plain-Python reference segmentation and mask (seeded
maps come from ``cp_packing.testing.synthetic_doc_ids``)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


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
