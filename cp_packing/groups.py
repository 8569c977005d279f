"""Process groups: the one place a user's ``group`` argument is interpreted (no collectives here).

A CP group is a ``torch.distributed`` ``ProcessGroup``, a 1-D ``DeviceMesh`` (the CP dimension of a DP x CP mesh,
``mesh["cp"]``) or ``None`` (the default, world, group where a group is needed; no communication where it is
optional, as in the loss). The CP rank and size are the rank and size *in that group*, never the global ones.
NCCL moves CUDA tensors only and gloo CPU ones: ``CPGroup.device`` is the device a group's collectives use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CPGroup",
    "GroupLike",
    "as_process_group",
    "backend_config",
    "backend_for_device",
    "check_shard_in_group",
    "device_for_backend",
    "resolve_group",
]

GroupLike = Optional[Union[dist.ProcessGroup, "DeviceMesh"]]
"""What a ``group=`` argument may be: a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``None``."""


@dataclass(frozen=True)
class CPGroup:
    """A resolved process group.

    Attributes:
        group: the ``ProcessGroup`` (the default group's object when the caller passed ``None``).
        rank: this process's rank in ``group``, ``0 <= rank < size``.
        size: the group size.
        backend: ``str(dist.get_backend(group))``.
        device: the device collectives on ``group`` use (CUDA current device for NCCL, else CPU).
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    backend: str
    device: torch.device

    def global_rank(self, group_rank: int) -> int:
        """The global rank of group rank ``group_rank`` (what ``dist.broadcast(src=...)`` takes)."""
        return dist.get_global_rank(self.group, group_rank)


def device_for_backend(backend: str) -> torch.device:
    """The device whose tensors a backend moves: CUDA (current device) for anything naming NCCL, else CPU.

    Raises:
        ValueError: the backend is NCCL and CUDA is not available.
    """
    if "nccl" in str(backend).lower():
        if not torch.cuda.is_available():
            raise ValueError(
                f"the CP group uses backend {backend!r}, which moves CUDA tensors only, but CUDA is not available; "
                "use a gloo group on CPU-only machines"
            )
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_mesh_class():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without distributed mesh support
        return None
    return DeviceMesh


def as_process_group(group: GroupLike, *, name: str = "group") -> dist.ProcessGroup | None:
    """A 1-D ``DeviceMesh`` -> its ``ProcessGroup``; a ``ProcessGroup`` -> itself; ``None`` -> ``None``.

    Raises:
        ValueError: a mesh with more than one dimension; ``GroupMember.NON_GROUP_MEMBER`` (what ``dist.new_group``
            returns on a process outside the group).
        TypeError: anything else.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    mesh_cls = _device_mesh_class()
    if mesh_cls is not None and isinstance(group, mesh_cls):
        if group.ndim != 1:
            names = getattr(group, "mesh_dim_names", None)
            raise ValueError(
                f"{name} is a {group.ndim}-D DeviceMesh (dims {names}, shape {tuple(group.mesh.shape)}); pass its "
                "context-parallel dimension as a 1-D mesh, e.g. mesh['cp']"
            )
        return group.get_group()
    if isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of {name} (dist.new_group returned "
            "GroupMember.NON_GROUP_MEMBER here); call this only on the group's ranks"
        )
    raise TypeError(
        f"{name} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}"
    )


def resolve_group(group: GroupLike, *, name: str = "group", optional: bool = False) -> CPGroup | None:
    """Resolve a ``group=`` argument (local, no communication).

    Args:
        group: ``ProcessGroup``, 1-D ``DeviceMesh`` or ``None``.
        name: the argument's name, for error messages.
        optional: ``None`` means "no group" (returns ``None``) instead of the default (world) group.

    Raises:
        ValueError: torch.distributed is not initialized, a mesh with more than one dimension, or this process is not
            a member of ``group``.
        TypeError: ``group`` is of another type.
    """
    pg = as_process_group(group, name=name)
    if pg is None and optional:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{name} needs torch.distributed, which is not initialized; call torch.distributed.init_process_group"
            "(...) first (torchrun does the rendezvous), or use cp_packing.shard_packed_seq_params(params, "
            f"cp_size=..., cp_rank=...) in a single process{f' and pass {name}=None' if optional else ''}"
        )
    if pg is None:
        pg = dist.group.WORLD
    rank = dist.get_rank(pg)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of {name}; call this only on the "
            "group's ranks, with the group they belong to"
        )
    backend = str(dist.get_backend(pg))
    return CPGroup(group=pg, rank=rank, size=dist.get_world_size(pg), backend=backend,
                   device=device_for_backend(backend))


def backend_config(group: dist.ProcessGroup) -> str:
    """``group``'s backend per device type (``"cpu:gloo,cuda:nccl"``), or its single backend name."""
    try:
        return str(dist.get_backend_config(group))
    except Exception:  # noqa: BLE001 - a group this torch has no config for: its single backend name
        return str(dist.get_backend(group))


def backend_for_device(config: str, device_type: str) -> str | None:
    """The backend a group with backend ``config`` (``backend_config(group)``: ``"cpu:gloo,cuda:nccl"``,
    ``"cuda:nccl"``, or a plain name like ``"nccl"``) uses for ``device_type`` tensors: ``""`` when it has none for
    that device type, ``None`` when unknown (a custom backend without declared devices).

    >>> backend_for_device("cpu:gloo,cuda:nccl", "cpu")
    'gloo'
    """
    config = str(config).lower()
    if ":" in config:
        pairs = dict(pair.split(":", 1) for pair in config.split(",") if ":" in pair)
        return pairs.get(device_type, "")
    devices = dist.Backend.backend_capability.get(config)
    if devices is None:
        return None
    return config if device_type in devices else ""


def check_shard_in_group(cp_size: int, cp_rank: int, group_size: int, group_rank: int, *, which: str = "the CP group"
                         ) -> None:
    """Raise a ValueError unless a shard built for ``(cp_size, cp_rank)`` belongs to this process in a group of
    ``group_size`` ranks where it is rank ``group_rank`` (the DP x CP mesh mistake: the global rank's view)."""
    if group_size != cp_size:
        raise ValueError(
            f"sharded.cp_size={cp_size} but {which} has {group_size} ranks; pass the context-parallel group as "
            f"group= (e.g. mesh['cp'].get_group()) or shard with cp_size={group_size}"
        )
    if group_rank != cp_rank:
        raise ValueError(
            f"sharded.cp_rank={cp_rank} but this process is rank {group_rank} of the CP group; shard with "
            "cp_rank=torch.distributed.get_rank(group) (in a DP x CP mesh: mesh['cp'])"
        )
