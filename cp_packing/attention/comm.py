"""Token and head collectives the CP attention backends share (the communication, apart from the math).

* ``all_gather_tokens`` / ``reduce_scatter_tokens``: ``[T_local, ...]`` on every rank <-> ``[cp * T_local, ...]``
  (the all-gather backend's K/V and their gradients);
* ``seq_to_heads`` / ``heads_to_seq``: the Ulysses all-to-all between a sequence shard ``[T_local, H, D]`` and a
  head shard ``[cp * T_local, H / cp, D]``.

gloo has no ``all_gather_into_tensor`` / ``reduce_scatter_tensor``: those go through a list all-gather and one
in-place reduce per chunk there (no second full-size buffer). Every function is called by every rank of ``group`` with the same shapes (the agreement in
``context_parallel_attention`` checks that before the first one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_tokens", "heads_to_seq", "reduce_scatter_tokens", "seq_to_heads"]


def _is_gloo(group) -> bool:
    return str(dist.get_backend(group)).lower() == "gloo"


def all_gather_tokens(x: torch.Tensor, group, cp_size: int) -> torch.Tensor:
    """``[T_local, ...]`` on every rank -> ``[cp * T_local, ...]``, rank-major."""
    x = x.contiguous()
    out = x.new_empty((cp_size * x.shape[0], *x.shape[1:]))
    if _is_gloo(group):
        dist.all_gather(list(out.chunk(cp_size)), x, group=group)
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x, group=group)
    return out


def reduce_scatter_tokens(x: torch.Tensor, group, cp_size: int) -> torch.Tensor:
    """``[cp * T_local, ...]`` on every rank -> ``[T_local, ...]``: rank r gets the SUM over ranks of chunk r."""
    x = x.contiguous()
    T_local = x.shape[0] // cp_size
    if _is_gloo(group):  # one reduce per chunk, in place in x: no second full-size buffer
        chunks = x.view(cp_size, T_local, *x.shape[1:])
        for r in range(cp_size):
            dist.reduce(chunks[r], dist.get_global_rank(group, r), group=group)
        return chunks[dist.get_rank(group)].clone()
    out = x.new_empty((T_local, *x.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x, group=group)
    return out


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:i]) for i in range(len(sizes))]


def seq_to_heads(parts: list[torch.Tensor], group, cp_size: int) -> list[torch.Tensor]:
    """Every ``[T_local, h_i, D]`` in ``parts`` (``cp`` divides each ``h_i``) -> ``[cp * T_local, h_i / cp, D]``:
    this rank's head slice of every rank's tokens, rank-major. One all-to-all for all parts."""
    T_local, D = parts[0].shape[0], parts[0].shape[2]
    heads = [x.shape[1] // cp_size for x in parts]
    send = parts[0].new_empty((cp_size, T_local, sum(heads), D))  # chunk j goes to rank j
    for x, h, at in zip(parts, heads, _offsets(heads)):  # one copy of each part, straight into the send buffer
        send[:, :, at:at + h].copy_(x.reshape(T_local, cp_size, h, D).transpose(0, 1))
    if group is None:
        received = send
    else:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # chunk j came from rank j: its tokens, my heads
        del send
    received = received.reshape(cp_size * T_local, sum(heads), D)
    return list(received.split(heads, dim=1))


def heads_to_seq(parts: list[torch.Tensor], group, cp_size: int) -> list[torch.Tensor]:
    """Inverse of ``seq_to_heads``: every ``[cp * T_local, h_i, D]`` -> ``[T_local, cp * h_i, D]``."""
    T, D = parts[0].shape[0], parts[0].shape[2]
    T_local = T // cp_size
    heads = [x.shape[1] for x in parts]
    send = torch.cat(parts, 1).reshape(cp_size, T_local, sum(heads), D)  # chunk j: rank j's tokens
    if group is None:
        received = send
    else:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)  # chunk j: my tokens, rank j's heads
        del send
    received = received.transpose(0, 1)  # [T_local, cp, sum h, D]
    return [x.reshape(T_local, cp_size * h, D).contiguous() for x, h in zip(received.split(heads, dim=2), heads)]

