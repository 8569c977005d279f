"""The gradient sum of a CP step, and a digest of the parameters.

Every rank's loss is its *share* of the global mean (its sum over the valid labels of the whole step, CP and DP;
docs/loss.md), so the true gradient is the SUM of the ranks' gradients, over the CP group and over the DP replicas:
:func:`sum_gradients` does that after ``loss.backward()``, in a few flat buckets, after one agreement.
:func:`param_digest` tells ranks whose weights drifted apart (a loop that skipped the sum) from ranks in step.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from cp_packing._checks import check_choice, check_int, check_number
from cp_packing.agreement import digest, fail_together
from cp_packing.groups import CPMesh, GroupLike, backend_config, backend_for_device, resolve_group

__all__ = ["BUCKET_MB", "DIGEST_SAMPLE", "param_digest", "sum_gradients"]

BUCKET_MB = 25.0
"""The default bucket size of :func:`sum_gradients`, in MiB (DDP's): one flat all-reduce per bucket and group."""

DIGEST_SAMPLE = 1024
"""The most elements of one parameter :func:`param_digest` reads."""

_HAS_GRAD = "parameters with a .grad"
_HAS_GRAD_FIX = ("; a rank without the .grad its peers have skipped its backward, or did not use that parameter on "
                 "its tokens (e.g. an MoE expert): then pass missing='zeros'")


def _named_params(model_or_params: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of a module (its ``named_parameters()``) or of an iterable of tensors, each once."""
    if isinstance(model_or_params, torch.nn.Module):
        return list(model_or_params.named_parameters())
    if isinstance(model_or_params, torch.Tensor) or not isinstance(model_or_params, Iterable):
        raise TypeError(f"expected a torch.nn.Module or an iterable of parameters, got "
                        f"{type(model_or_params).__name__}; pass the model, or e.g. [tensor]")
    out, seen = [], set()
    for i, p in enumerate(model_or_params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {i} is a {type(p).__name__}, not a tensor; pass model.parameters()")
        if id(p) not in seen:
            seen.add(id(p))
            out.append((f"parameter {i}", p))
    return out


def _groups(mesh_or_group: Any) -> list[tuple[dist.ProcessGroup, str]]:
    """The groups to sum over, in order (CP, then DP), without the one-rank ones."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch built without DeviceMesh
        DeviceMesh = ()
    if isinstance(mesh_or_group, DeviceMesh) and mesh_or_group.ndim == 2:
        mesh_or_group = CPMesh.from_device_mesh(mesh_or_group)
    if isinstance(mesh_or_group, CPMesh):
        mesh = mesh_or_group
        for name, size, group in (("cp", mesh.cp_size, mesh.cp_group), ("dp", mesh.dp_size, mesh.dp_group)):
            if size > 1 and group is None:
                raise ValueError(f"the mesh has {name}_size={size} but no {name} process group (a CPMesh.from_ints "
                                 "mesh, or one unpickled in a worker); build it with CPMesh.from_device_mesh, "
                                 "from_world or from_groups")
        pairs = [(mesh.cp_group, "CP group"), (mesh.dp_group, "DP group")]
    else:
        pairs = [(resolve_group(mesh_or_group, name="mesh_or_group").group, "CP group")]
    return [(g, name) for g, name in pairs if g is not None and dist.get_world_size(g) > 1]


def _check_param(name: str, p: torch.Tensor) -> None:
    """Refuse what this sum cannot reduce right: FSDP2 DTensors, sparse gradients."""
    if hasattr(p, "full_tensor") or hasattr(p.grad, "full_tensor"):
        raise TypeError(
            f"{name} is a DTensor (FSDP2 fully_shard): FSDP2 reduce-scatters its gradients over its own mesh in "
            "backward, so no sum is needed; shard over the flattened DP x CP mesh with set_gradient_divide_factor"
            "(1.0) (docs/integration.md) and do not call sum_gradients"
        )
    if p.grad is not None and p.grad.is_sparse:
        raise TypeError(f"{name} has a sparse gradient; sum_gradients reduces dense gradients only")


def _check_devices(named: list[tuple[str, torch.Tensor]], groups: list[tuple[dist.ProcessGroup, str]]) -> None:
    """Raise a ValueError for a gradient on a device type a group's backend does not move (CUDA on gloo-only)."""
    first = {}
    for name, p in named:
        if p.grad is not None:
            first.setdefault(p.grad.device.type, (name, p.grad.device))
    for group, group_name in groups:
        config = backend_config(group)
        for device_type, (name, device) in first.items():
            if backend_for_device(config, device_type) == "":
                raise ValueError(f"{name}'s gradient is on {device}, but the {group_name}'s backend ({config}) "
                                 f"moves no {device_type} tensors; move the model to the group's device")


def _has_grad_field(named: list[tuple[str, torch.Tensor]]) -> str:
    """Which parameters have a ``.grad``, as a short text (compared across ranks; named in the error)."""
    missing = [name for name, p in named if p.grad is None]
    if not missing:
        return f"all {len(named)}"
    if len(missing) == len(named):
        return f"none of {len(named)} (no backward on this rank?)"
    return (f"{len(named) - len(missing)} of {len(named)}, none for {', '.join(missing[:2])}"
            f"{', ...' if len(missing) > 2 else ''} [{digest(*missing)[:8]}]")


def _buckets(grads: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one device and dtype, up to ``max_bytes`` per bucket (a larger one alone)."""
    open_, out = {}, []
    for g in grads:
        key = (g.device, g.dtype)
        bucket = open_.get(key)
        size = g.numel() * g.element_size()
        if bucket is None or bucket[1] + size > max_bytes:
            bucket = open_[key] = [[], 0]
            out.append(bucket[0])
        bucket[0].append(g)
        bucket[1] += size
    return out


def _reduce(bucket: list[torch.Tensor], groups: list[tuple[dist.ProcessGroup, str]]) -> None:
    """SUM one bucket over every group: one all-reduce per group (in place for a lone contiguous gradient)."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        flat = bucket[0]
    else:
        flat = torch.cat([g.reshape(-1) for g in bucket])
    for group, _ in groups:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if flat is not bucket[0]:
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def _agree(model_or_params: Any, groups: list[tuple[dist.ProcessGroup, str]], missing: str, bucket_mb: float
           ) -> list[tuple[str, torch.Tensor]]:
    """The local checks and the one agreement of :func:`sum_gradients`; returns the trainable parameters."""
    with fail_together("sum_gradients", *groups) as agreement:
        missing = check_choice(missing, "missing", ("raise", "zeros"))
        bucket_mb = check_number(bucket_mb, "bucket_mb", min=1e-6)
        if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
            raise TypeError("the model is wrapped in DistributedDataParallel, which already averages its gradients "
                            "over its process group in backward; unwrap it (model.module) and let sum_gradients "
                            "sum them, or keep DDP over every DP x CP rank and multiply the loss by its world size "
                            "(docs/loss.md)")
        named = [(n, p) for n, p in _named_params(model_or_params) if p.requires_grad]
        for name, p in named:
            _check_param(name, p)
        _check_devices(named, groups)
        agreement.fields = {
            "parameter shapes and dtypes": digest(*[f"{tuple(p.shape)}{p.dtype}" for _, p in named]),
            "missing": missing,
            "bucket_mb": bucket_mb,
            _HAS_GRAD: "-" if missing == "zeros" else _has_grad_field(named),
        }
    return named


def sum_gradients(model_or_params: Any, mesh_or_group: CPMesh | GroupLike, *, missing: str = "raise",
                  bucket_mb: float = BUCKET_MB) -> None:
    """SUM every parameter's ``.grad`` over the CP group, and over the DP group when a DP x CP mesh is given.

    Call it after ``loss.backward()`` (after the last micro-batch's) and before ``optimizer.step()``, with the loss
    of cp-packing (each rank's share of the step's global mean over CP and DP), so that every rank then holds the
    single-process gradient of the global batch. The DP replicas are SUMMED, not averaged: the loss already divides
    by the count of valid labels of every replica (docs/loss.md). Gradients travel in flat buckets of at most
    ``bucket_mb`` MiB (one all-reduce per bucket and group), after one agreement: a rank whose parameters, or whose
    set of parameters with a ``.grad``, differ from its peers' raises on every rank instead of hanging.

    Args:
        model_or_params: a ``torch.nn.Module`` or an iterable of its parameters. Parameters without
            ``requires_grad`` are skipped, and so are those without a ``.grad`` on every rank.
        mesh_or_group: a :class:`CPMesh` (CP, then DP), a 2-D ``("dp", "cp")`` DeviceMesh, or the CP group alone
            (a ``ProcessGroup`` or 1-D DeviceMesh; ``None``: the world).
        missing: ``"raise"`` (a parameter with a ``.grad`` on some ranks only is an error on every rank: one rank
            skipped its backward) or ``"zeros"`` (it counts as zeros there: a parameter no token of a rank used,
            e.g. an MoE expert; every trainable parameter then gets a ``.grad``).
        bucket_mb: the largest bucket, in MiB (extra memory: one bucket).

    Raises:
        ValueError: on every rank: another set of parameters or of gradients on some rank, a mesh without its
            groups, a gradient on a device the group's backend cannot move.
        TypeError: on every rank: FSDP2 (DTensor) parameters, which FSDP2 reduces over its own mesh in backward
            (docs/integration.md), a model wrapped in DistributedDataParallel, sparse gradients.

    >>> model = torch.nn.Linear(2, 1)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> sum_gradients(model, CPMesh.from_ints())  # one process: nothing to sum
    >>> model.weight.grad
    tensor([[1., 1.]])
    """
    groups = _groups(mesh_or_group)
    try:
        named = _agree(model_or_params, groups, missing, bucket_mb)
    except ValueError as exc:  # every rank has this error, whichever group found it: name the fix everywhere
        if f"disagree on {_HAS_GRAD}" in str(exc):
            raise type(exc)(f"{exc}{_HAS_GRAD_FIX}") from exc
        raise
    if missing == "zeros":  # every trainable parameter of every rank is in the sum
        for _, p in named:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    grads = [p.grad for _, p in named if p.grad is not None]
    if groups:
        for bucket in _buckets(grads, max(1, int(min(bucket_mb, 2.0**30) * 2**20))):
            _reduce(bucket, groups)


@torch.no_grad()
def param_digest(model_or_params: Any, *, sample: int = DIGEST_SAMPLE) -> str:
    """A cheap digest of the parameters' values: equal on ranks with equal weights, different once they drift.

    Per parameter, the float64 sum of at most ``sample`` elements at a fixed stride (elements ``0, s, 2s, ...``),
    each weighted by its place in the samples (so that a swap counts); those sums, the shapes and the dtypes go
    through BLAKE2b (:func:`cp_packing.agreement.digest`). A change to a sampled element (every element of a
    parameter of at most ``sample`` elements) changes it; a change to unsampled elements alone does not (drifting
    ranks differ everywhere). A DTensor contributes its local shard (compare across ranks holding the same shard).

    Cost: one gather of at most ``sample`` elements per parameter into one buffer, a multiply and a segment sum (a
    few kernels in all), one host sync for the ``[num_params]`` float64 sums, and a BLAKE2b of them; no collective.
    Measured on one CPU thread (benchmarks/bench_gradients.py, docs/benchmarks.md): 1.5 ms for 11M parameters in
    122 tensors (1-3% of ``sum_gradients`` on 2 gloo ranks), 14 ms for 1,000 tensors: ~14 us per tensor.

    >>> a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    >>> _ = b.load_state_dict(a.state_dict())
    >>> param_digest(a) == param_digest(b)
    True
    """
    sample = check_int(sample, "sample", min=1)
    named = _named_params(model_or_params)
    if not named:
        return digest("no parameters")
    tensors = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]
    device = tensors[0].device
    picks = [t.view(-1)[:: max(1, -(-t.numel() // sample))] if t.is_contiguous()
             else t.reshape(-1)[:: max(1, -(-t.numel() // sample))] for t in tensors]
    picks = [x if x.device == device else x.to(device) for x in picks]
    values = torch.cat(picks).to(torch.float64)  # [sum of the samples' sizes]; one copy (cat promotes dtypes)
    weighted = values * torch.arange(1, values.numel() + 1, dtype=torch.float64, device=device)
    sums = torch.segment_reduce(weighted, "sum", lengths=torch.tensor([x.numel() for x in picks], device=device))
    return digest(sums, *[f"{tuple(t.shape)}{t.dtype}" for t in tensors])
