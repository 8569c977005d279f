"""Process groups and the DP x CP mesh: where a user's ``group`` or mesh argument is interpreted (no collectives).

A CP group is a ``torch.distributed`` ``ProcessGroup``, a 1-D ``DeviceMesh`` (the CP dimension of a DP x CP mesh,
``mesh["cp"]``) or ``None`` (the default, world, group where a group is needed; no communication where it is
optional, as in the loss). The CP rank and size are the rank and size *in that group*, never the global ones.
NCCL moves CUDA tensors only and gloo CPU ones: ``CPGroup.device`` is the device a group's collectives use.
:class:`CPMesh` is the one DP x CP mesh type (from a ``DeviceMesh``, the world, two groups or plain ints) that the
loader, the trainers and the CLI share; its ``sum_gradients`` hands over to ``cp_packing.gradients``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "CPGroup",
    "CPMesh",
    "GroupLike",
    "as_process_group",
    "backend_config",
    "backend_for_device",
    "check_shard_in_group",
    "device_for_backend",
    "peek_group",
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


def peek_group(group: GroupLike, cp_size: int) -> dist.ProcessGroup | None:
    """The group a call would communicate over, or None; never raises (the strict checks run inside the
    agreement, and their error travels through it)."""
    try:
        pg = as_process_group(group)
    except (TypeError, ValueError):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if pg is None:
        return dist.group.WORLD if cp_size != 1 else None
    return pg if dist.get_rank(pg) >= 0 and dist.get_world_size(pg) > 1 else None


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


# ------------------------------------------------------------------------------------------------ the DP x CP mesh


@dataclass(frozen=True)
class CPMesh:
    """This process's place in a DP x CP grid: the one mesh type of the loader, the trainers and the CLI.

    Build it with one of the constructors: :meth:`from_device_mesh` (a 2-D ``("dp", "cp")`` DeviceMesh, or a 1-D
    ``"cp"`` one), :meth:`from_world` (the initialised world cut into CP groups of consecutive ranks),
    :meth:`from_groups` (the two process groups) or :meth:`from_ints` (no torch.distributed: DataLoader workers,
    tests). It pickles without its process groups (what a DataLoader worker needs are the ints).

    Gradient convention (one for the whole library, docs/distributed.md): the loss of every rank is its SHARE of the
    global mean (local sum / global count of valid labels), so the gradients are SUMMED over all ``dp_size *
    cp_size`` ranks, never averaged: :meth:`sum_gradients` in your own loop. FSDP2 / DDP, which average by default,
    get a divide factor of 1 (or the loss is multiplied by the world size where the divisor cannot be set).

    Attributes:
        dp_rank, dp_size: this process's data-parallel replica and the number of replicas.
        cp_rank, cp_size: this process's rank in its replica's CP group, and the CP group size.
        cp_group, dp_group: the ProcessGroups (``None`` where the size is 1 or without torch.distributed).
        device_mesh: the ``("dp", "cp")`` DeviceMesh when the mesh was built from one (``None`` otherwise).

    >>> CPMesh.from_ints(dp_rank=1, dp_size=2, cp_rank=0, cp_size=4).global_rank
    4
    """

    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    cp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    device_mesh: Any = None

    def __post_init__(self) -> None:
        from cp_packing._checks import check_int

        for name in ("dp_size", "cp_size"):
            check_int(getattr(self, name), name, min=1)
        check_int(self.dp_rank, "dp_rank", min=0, max=self.dp_size - 1, hint=f"a replica in [0, {self.dp_size})")
        check_int(self.cp_rank, "cp_rank", min=0, max=self.cp_size - 1, hint=f"a CP rank in [0, {self.cp_size})")

    @property
    def world_size(self) -> int:
        """``dp_size * cp_size``."""
        return self.dp_size * self.cp_size

    @property
    def global_rank(self) -> int:
        """``dp_rank * cp_size + cp_rank`` (the rank in a world laid out replica after replica)."""
        return self.dp_rank * self.cp_size + self.cp_rank

    def sum_gradients(self, model: Any, **kwargs: Any) -> None:
        """SUM every gradient of ``model`` over this mesh's CP group, then its DP group: a shortcut for
        :func:`cp_packing.sum_gradients(model, self, **kwargs) <cp_packing.gradients.sum_gradients>`."""
        from cp_packing.gradients import sum_gradients

        sum_gradients(model, self, **kwargs)

    def __getstate__(self) -> dict:
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size, "cp_rank": self.cp_rank, "cp_size": self.cp_size}

    def __setstate__(self, state: dict) -> None:
        for name, value in {**state, "cp_group": None, "dp_group": None, "device_mesh": None}.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_ints(cls, *, dp_rank: int = 0, dp_size: int = 1, cp_rank: int = 0, cp_size: int = 1) -> "CPMesh":
        """A mesh of plain ints (no process groups)."""
        return cls(dp_rank, dp_size, cp_rank, cp_size)

    @classmethod
    def from_groups(cls, cp_group: GroupLike, dp_group: GroupLike = None) -> "CPMesh":
        """The mesh of a CP group (ProcessGroup or 1-D DeviceMesh) and an optional DP group (``None``: one
        replica)."""
        cp = resolve_group(cp_group, name="cp_group")
        dp = resolve_group(dp_group, name="dp_group", optional=True)
        return cls(0 if dp is None else dp.rank, 1 if dp is None else dp.size, cp.rank, cp.size,
                   cp.group, None if dp is None else dp.group)

    @classmethod
    def from_device_mesh(cls, mesh: "DeviceMesh", dim_names: tuple[str, str] = ("dp", "cp")) -> "CPMesh":
        """The mesh of a 2-D DeviceMesh with dims ``dim_names``, or of a 1-D mesh named like the CP dim."""
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        dp_name, cp_name = dim_names
        if mesh.ndim == 1 and names in ((cp_name,), ()):
            return cls(0, 1, mesh.get_local_rank(), mesh.size(), mesh.get_group(), None, mesh)
        if mesh.ndim != 2 or dp_name not in names or cp_name not in names:
            raise ValueError(
                f"mesh has dims {names or None} (shape {tuple(mesh.mesh.shape)}); pass a 2-D DeviceMesh with dims "
                f"{dim_names}, e.g. init_device_mesh('cuda', (dp, cp), mesh_dim_names={dim_names}), or dim_names= "
                "the names of yours"
            )
        dp_size = mesh.size(names.index(dp_name))
        return cls(mesh.get_local_rank(dp_name), dp_size, mesh.get_local_rank(cp_name),
                   mesh.size(names.index(cp_name)), mesh[cp_name].get_group(),
                   mesh[dp_name].get_group(), mesh)

    @classmethod
    def from_world(cls, cp_size: int, *, device_type: str | None = None) -> "CPMesh":
        """The initialised world as ``(world // cp_size, cp_size)``: consecutive global ranks form a CP group
        (``init_device_mesh``). Without torch.distributed, the one-process mesh (``cp_size`` must be 1)."""
        from cp_packing._checks import check_int

        cp_size = check_int(cp_size, "cp_size", min=1)
        if not (dist.is_available() and dist.is_initialized()):
            if cp_size > 1:
                raise ValueError(f"cp_size={cp_size} needs a process group of a multiple of {cp_size} ranks; launch "
                                 f"with torchrun --nproc-per-node {cp_size} (or more)")
            return cls(0, 1, 0, 1)
        world = dist.get_world_size()
        if world % cp_size:
            raise ValueError(f"the world has {world} ranks, not a multiple of cp_size={cp_size}; pick a cp_size "
                             f"that divides {world}")
        if world == 1:
            return cls(0, 1, 0, 1)
        from torch.distributed.device_mesh import init_device_mesh

        device_type = device_type or device_for_backend(str(dist.get_backend())).type
        mesh = init_device_mesh(device_type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
        return cls.from_device_mesh(mesh)
