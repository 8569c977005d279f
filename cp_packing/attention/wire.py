"""A step's tables as the attention op takes them: ONE int64 tensor of every index piece and one CPU tensor of sizes.

A backend's tables (key indices, ``cu_seqlens``, send/receive splits, maxima) change length and value with every
batch. Packed into one device tensor (``blob``, at least 2 long, so ``torch.compile`` never specializes it on a
0 or 1 length) and one int64 CPU tensor (``sizes``: the host-side numbers, then the pieces' lengths; its shape is
fixed per backend and group), a new step's tables are data for a compiled model, never constants that recompile
it, and reading the numbers inside the op costs no device sync.

>>> import torch
>>> blob, sizes = pack([7, 3], [torch.tensor([0, 4, 9]), torch.tensor([], dtype=torch.int64)], "cpu")
>>> header, (cu, empty) = unpack((blob, sizes))
>>> header, cu.tolist(), empty.numel()
([7, 3], [0, 4, 9], 0)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

__all__ = ["Wire", "is_wire", "pack", "unpack"]


class Wire(NamedTuple):
    """One kind of layer's tables in a step plan: what the op takes (``blob``, ``sizes``) and, decoded once when the
    step is prepared by the backend's own decoder, what an eager call hands the backend directly (``native``)."""

    blob: torch.Tensor
    sizes: torch.Tensor
    native: Any


def is_wire(tables: Any) -> bool:
    """Whether ``tables`` are the op's ``[blob, sizes]`` (else a backend's decoded tables)."""
    return isinstance(tables, (list, tuple)) and not isinstance(tables, Wire) and len(tables) == 2 \
        and all(isinstance(x, torch.Tensor) for x in tables)


def pack(header: Sequence[int], pieces: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blob, sizes)``: the integer ``pieces`` end to end in one int64 tensor on ``device`` (padded to >= 2),
    and ``[len(header), *header, *piece lengths]`` on the CPU."""
    flat = [p.reshape(-1).to(device=device, dtype=torch.int64) for p in pieces]
    filler = torch.zeros(max(0, 2 - sum(p.numel() for p in flat)), dtype=torch.int64, device=device)
    blob = torch.cat([*flat, filler])
    sizes = torch.tensor([len(header), *(int(x) for x in header), *(p.numel() for p in flat)], dtype=torch.int64)
    return blob, sizes


def unpack(tables: Sequence[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """Inverse of :func:`pack`: ``(header, pieces)``, the pieces int64 views of the blob."""
    blob, sizes = tables
    values = sizes.tolist()
    n = values[0]
    header, lengths = values[1:1 + n], values[1 + n:]
    pieces = list(blob.split([*lengths, blob.numel() - sum(lengths)]))[:-1]
    return header, pieces
