"""The attention op: one layer of any backend as ONE ``torch.library`` custom op pair, eager and compiled alike.

``cp_packing::attention_fwd`` runs a backend's collectives and kernel for one layer and returns ``[out, lse,
*saved]``; ``cp_packing::attention_bwd`` is its registered backward. Both take the step's tables as tensors (the
host-side sizes in a CPU tensor, so a new step's values are data, not constants that recompile), the groups by name
and the layer's arguments as constants; both have fake implementations, so ``torch.compile`` traces through a
model with no graph break and runs the op as one opaque node (the collectives and the kernel stay together, which
keeps the exchange backend's overlap of its transfer with the local part). Eager calls run the same op.

:data:`BACKEND_TABLE` is the one explicit table from a backend's name to its implementation (no registration by
import). ring-flash-attn brings its own autograd functions: it runs eagerly only, outside the op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from cp_packing.attention import allgather, exchange, hybrid, kernels, ring, ulysses

__all__ = ["BACKEND_TABLE", "Backend", "Layer", "run_layer"]


@dataclass(frozen=True)
class Backend:
    """One backend: ``build(ctx, causal, window, chunk) -> tables`` (once per step and kind of layer), and either
    the op's ``forward`` / ``backward`` / ``fake`` or an ``eager`` layer function with its own autograd."""

    build: Callable
    forward: Callable | None = None
    backward: Callable | None = None
    fake: Callable | None = None
    eager: Callable | None = None


BACKEND_TABLE: dict[str, Backend] = {
    "allgather": Backend(allgather.build_tables, allgather.forward, allgather.backward, allgather.fake),
    "exchange": Backend(exchange.build_tables, exchange.forward, exchange.backward, exchange.fake),
    "ulysses": Backend(ulysses.build_tables, ulysses.forward, ulysses.backward, ulysses.fake),
    "hybrid": Backend(hybrid.build_tables, hybrid.forward, hybrid.backward, hybrid.fake),
    "ring_flash_attn": Backend(ring.build_tables, eager=ring.eager),
}
"""Backend name -> implementation (``cp_packing.capabilities.BACKENDS`` lists the same names)."""


class Layer(NamedTuple):
    """A layer's constants, as the backends' forward and backward read them."""

    group: Any
    subgroups: tuple
    cp_size: int
    cp_rank: int
    kernel: str
    scale: float | None
    causal: bool
    window: int | None
    softcap: float | None
    overlap: bool
    ulysses_size: int


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name) if name else None


@functools.lru_cache(maxsize=64)
def _kernel(kernel: str, device: torch.device, dtype: torch.dtype, softcap: bool) -> str:
    """The concrete kernel for the kernel option, q's device and dtype (resolved once per combination)."""
    return kernels.resolve_kernel(kernel, torch.empty(0, dtype=dtype, device=device), softcap=1.0 if softcap else None)


def _layer(q, groups: str, cp_size, cp_rank, kernel, scale, causal, window, softcap, overlap, ulysses_size) -> Layer:
    names = groups.split(",")
    subgroups = (_group(names[1]), _group(names[2])) if len(names) == 3 else (None, None)
    return Layer(_group(names[0]), subgroups, cp_size, cp_rank, _kernel(kernel, q.device, q.dtype, softcap is not None),
                 scale, causal, window, softcap, overlap, ulysses_size)


@torch.library.custom_op("cp_packing::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor], tables: list[torch.Tensor],
    backend: str, groups: str, cp_size: int, cp_rank: int, kernel: str, scale: Optional[float], causal: bool,
    window: Optional[int], softcap: Optional[float], overlap: bool, ulysses_size: int, check: int,
) -> list[torch.Tensor]:
    """One layer of ``backend``: ``[out [T_local, H, D], lse, *saved]`` (what its backward reads)."""
    layer = _layer(q, groups, cp_size, cp_rank, kernel, scale, causal, window, softcap, overlap, ulysses_size)
    with torch.autocast(q.device.type, enabled=False):  # the caller cast q/k/v; the kernel runs in their dtype
        return BACKEND_TABLE[backend].forward(q, k, v, sinks, tables, layer)


@attention_fwd.register_fake
def _(q, k, v, sinks, tables, backend, groups, cp_size, cp_rank, kernel, scale, causal, window, softcap, overlap,
      ulysses_size, check):
    layer = Layer(None, (None, None), cp_size, cp_rank, kernel, scale, causal, window, softcap, overlap, ulysses_size)
    return BACKEND_TABLE[backend].fake(q, k, v, sinks, tables, layer)


@torch.library.custom_op("cp_packing::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
    saved: list[torch.Tensor], tables: list[torch.Tensor], backend: str, groups: str, cp_size: int, cp_rank: int,
    kernel: str, scale: Optional[float], causal: bool, window: Optional[int], softcap: Optional[float], overlap: bool,
    ulysses_size: int, check: int,
) -> list[torch.Tensor]:
    """The backward of :func:`attention_fwd`: ``[dq, dk, dv]`` (and ``dsinks`` with sinks). ``check`` (eager,
    checked steps): the layer's number, agreed over the group first, so a backward desync raises on every rank."""
    layer = _layer(q, groups, cp_size, cp_rank, kernel, scale, causal, window, softcap, overlap, ulysses_size)
    if check:
        from cp_packing.agreement import fail_together

        with fail_together("attention backward", (layer.group, "CP group")) as agreement:
            agreement.fields = {"layer": check}
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv, dsinks = BACKEND_TABLE[backend].backward(dout.contiguous(), q, k, v, sinks, saved, tables, layer)
    return [dq, dk, dv] if dsinks is None else [dq, dk, dv, dsinks]


@attention_bwd.register_fake
def _(dout, q, k, v, sinks, saved, tables, backend, groups, cp_size, cp_rank, kernel, scale, causal, window, softcap,
      overlap, ulysses_size, check):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    return grads if sinks is None else grads + [torch.empty_like(sinks)]


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, tables, *constants = inputs
    ctx.save_for_backward(q, k, v, sinks, *tables, *output)
    ctx.num_tables, ctx.constants, ctx.has_sinks = len(tables), tuple(constants), sinks is not None


def _backward(ctx, grads):
    q, k, v, sinks, *rest = ctx.saved_tensors
    tables, saved = rest[:ctx.num_tables], rest[ctx.num_tables:]
    grad = torch.ops.cp_packing.attention_bwd(grads[0], q, k, v, sinks, list(saved), list(tables),
                                              *ctx.constants)
    return (grad[0], grad[1], grad[2], grad[3] if ctx.has_sinks else None, [None] * ctx.num_tables,
            *([None] * len(ctx.constants)))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def run_layer(plan, tables, q, k, v, sinks, *, causal: bool, window: int | None, softcap: float | None,
              scale: float | None, check: int = 0) -> torch.Tensor:
    """One attention layer on the step ``plan`` (``StepPlan.attend`` calls it after its checks): ``[T_local, H, D]``."""
    impl = BACKEND_TABLE[plan.backend]
    options, sharded = plan.options, plan.sharded
    U = options.ulysses_size or 0
    scale = None if scale is None else float(scale)
    softcap = None if softcap is None else float(softcap)
    if impl.eager is not None:
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"backend={plan.backend!r} runs its own autograd functions, which torch.compile cannot trace as one "
                "op; use backend='exchange' or 'allgather' (or 'auto') for a compiled model")
        if window is not None or softcap is not None or sinks is not None:
            raise NotImplementedError(f"backend={plan.backend!r} takes no window, softcap or sinks; use backend="
                                      "'allgather' or 'exchange' (or 'auto')")
        layer = Layer(plan.group, (None, None), sharded.cp_size, sharded.cp_rank, plan.kernel, scale, causal, window,
                      softcap, options.overlap, U)
        return impl.eager(q, k, v, sinks, tables, layer)
    outs = torch.ops.cp_packing.attention_fwd(q, k, v, sinks, list(tables), plan.backend, plan.group_names,
                                              sharded.cp_size, sharded.cp_rank, plan.kernel, scale, causal, window,
                                              softcap, options.overlap, U, check)
    return outs[0]
