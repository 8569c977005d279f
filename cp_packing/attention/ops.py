"""The attention op: one layer of any backend as ONE ``torch.library`` custom op pair, eager and compiled alike.

``cp_packing::attention_fwd`` runs a backend's collectives and kernel for one layer and returns ``[out, lse,
*saved]``; ``cp_packing::attention_bwd`` is its registered backward. Both run :func:`run_forward` /
:func:`run_backward`, which eager calls run too, through a thin autograd function (the op's dispatch costs more
per call than the layer itself). Both take the step's tables as tensors (the
host-side sizes in a CPU tensor, so a new step's values are data, not constants that recompile), the groups by name
and the layer's arguments as constants; both have fake implementations, so ``torch.compile`` traces through a
model with no graph break and runs the op as one opaque node (the collectives and the kernel stay together, which
keeps the exchange backend's overlap of its transfer with the local part).

:data:`BACKEND_TABLE` is the one explicit table from a backend's name to its implementation (no registration by
import). ring-flash-attn brings its own autograd functions: it runs eagerly only, outside the op.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from cp_packing.attention import allgather, exchange, hybrid, kernels, ring, ulysses

__all__ = ["BACKEND_TABLE", "Backend", "Layer", "layer_spec", "run_backward", "run_forward", "run_layer"]


@dataclass(frozen=True)
class Backend:
    """One backend: ``build(ctx, causal, window, chunk) -> tables`` (once per step and kind of layer; the op's
    ``(blob, sizes)``, which ``decode`` turns into the backend's own tables), and either the op's ``forward`` /
    ``backward`` / ``fake`` or an ``eager`` layer function with its own autograd."""

    build: Callable
    decode: Callable | None = None
    forward: Callable | None = None
    backward: Callable | None = None
    fake: Callable | None = None
    eager: Callable | None = None


BACKEND_TABLE: dict[str, Backend] = {
    "allgather": Backend(allgather.build_tables, allgather.from_wire, allgather.forward, allgather.backward,
                         allgather.fake),
    "exchange": Backend(exchange.build_tables, exchange.from_wire, exchange.forward, exchange.backward, exchange.fake),
    "ulysses": Backend(ulysses.build_tables, ulysses.from_wire, ulysses.forward, ulysses.backward, ulysses.fake),
    "hybrid": Backend(hybrid.build_tables, allgather.from_wire, hybrid.forward, hybrid.backward, hybrid.fake),
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


_SEP = ";"


def layer_spec(backend: str, groups: str, cp_size: int, cp_rank: int, kernel: str, scale: float | None,
               causal: bool, window: int | None, softcap: float | None, overlap: bool, ulysses_size: int,
               check: int) -> str:
    """A layer's constants as the op's ONE string argument (a constant of a compiled graph; one argument rather than
    twelve keeps the op's eager dispatch cheap: torch's schema handling is quadratic in the argument count)."""
    return _SEP.join((backend, groups, str(cp_size), str(cp_rank), kernel, repr(scale), str(int(causal)), repr(window),
                      repr(softcap), str(int(overlap)), str(ulysses_size), str(check)))


@functools.lru_cache(maxsize=1024)
def _decode(spec: str) -> tuple:
    backend, groups, cp, rank, kernel, scale, causal, window, softcap, overlap, U, check = spec.split(_SEP)
    number = (lambda x: None if x == "None" else float(x))  # noqa: E731 - repr of a float round-trips exactly
    return (backend, groups, int(cp), int(rank), kernel, number(scale), causal == "1",
            None if window == "None" else int(window), number(softcap), overlap == "1", int(U), int(check))


def _group(name: str):
    return dist.distributed_c10d._resolve_process_group(name) if name else None


@functools.lru_cache(maxsize=64)
def _kernel(kernel: str, device: torch.device, dtype: torch.dtype, softcap: bool) -> str:
    """The concrete kernel for the kernel option, q's device and dtype (resolved once per combination)."""
    return kernels.resolve_kernel(kernel, torch.empty(0, dtype=dtype, device=device), softcap=1.0 if softcap else None)


def _layer(q, spec: str) -> tuple[str, Layer, int]:
    """``(backend, Layer, check)`` of the op's ``spec``: the groups resolved by name, the kernel for q."""
    backend, groups, cp, rank, kernel, scale, causal, window, softcap, overlap, U, check = _decode(spec)
    names = groups.split(",")
    subgroups = (_group(names[1]), _group(names[2])) if len(names) == 3 else (None, None)
    layer = Layer(_group(names[0]), subgroups, cp, rank, _kernel(kernel, q.device, q.dtype, softcap is not None), scale,
                  causal, window, softcap, overlap, U)
    return backend, layer, check


def _fake_layer(spec: str) -> tuple[str, Layer]:
    backend, _, cp, rank, kernel, scale, causal, window, softcap, overlap, U, _ = _decode(spec)
    return backend, Layer(None, (None, None), cp, rank, kernel, scale, causal, window, softcap, overlap, U)


def _no_autocast(device_type: str):
    """Autocast off inside the layer (entered only where it is on: the context manager costs a few us a call)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()


def run_forward(q, k, v, sinks, tables, spec: str) -> list[torch.Tensor]:
    """One layer's forward of the backend ``spec`` names (:func:`layer_spec`): ``[out [T_local, H, D], lse,
    *saved]``. The one implementation the op and the eager autograd function both run."""
    backend, layer, _ = _layer(q, spec)
    with _no_autocast(q.device.type):  # the caller cast q/k/v; the kernel runs in their dtype
        return BACKEND_TABLE[backend].forward(q, k, v, sinks, tables, layer)


def run_backward(dout, q, k, v, sinks, saved, tables, spec: str) -> list[torch.Tensor]:
    """One layer's backward: ``[dq, dk, dv]`` (and ``dsinks`` with sinks). The spec's ``check`` (eager, checked
    steps): the layer's number, agreed over the group first, so a backward desync raises on every rank."""
    backend, layer, check = _layer(q, spec)
    if check:
        from cp_packing.agreement import fail_together

        with fail_together("attention backward", (layer.group, "CP group")) as agreement:
            agreement.fields = {"layer": check}
    with _no_autocast(q.device.type):
        dq, dk, dv, dsinks = BACKEND_TABLE[backend].backward(dout.contiguous(), q, k, v, sinks, list(saved), tables,
                                                            layer)
    return [dq, dk, dv] if dsinks is None else [dq, dk, dv, dsinks]


@torch.library.custom_op("cp_packing::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                  tables: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """:func:`run_forward` as an opaque op (what a compiled model runs)."""
    return run_forward(q, k, v, sinks, tables, spec)


@attention_fwd.register_fake
def _(q, k, v, sinks, tables, spec):
    backend, layer = _fake_layer(spec)
    return BACKEND_TABLE[backend].fake(q, k, v, sinks, tables, layer)


@torch.library.custom_op("cp_packing::attention_bwd", mutates_args=())
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                  saved: list[torch.Tensor], tables: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """:func:`run_backward` as an opaque op, the registered backward of :func:`attention_fwd`."""
    return run_backward(dout, q, k, v, sinks, saved, tables, spec)


@attention_bwd.register_fake
def _(dout, q, k, v, sinks, saved, tables, spec):
    grads = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]
    return grads if sinks is None else grads + [torch.empty_like(sinks)]


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, tables, spec = inputs
    ctx.save_for_backward(q, k, v, sinks, *tables, *output)
    ctx.num_tables, ctx.spec, ctx.has_sinks = len(tables), spec, sinks is not None


def _backward(ctx, grads):
    q, k, v, sinks, *rest = ctx.saved_tensors
    tables, saved = rest[:ctx.num_tables], rest[ctx.num_tables:]
    grad = torch.ops.cp_packing.attention_bwd(grads[0], q, k, v, sinks, list(saved), list(tables), ctx.spec)
    return grad[0], grad[1], grad[2], grad[3] if ctx.has_sinks else None, [None] * ctx.num_tables, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager binding of the same :func:`run_forward` / :func:`run_backward` the op runs, without the op's
    dispatch (torch.library's Python custom-op path costs far more per call than the layer's own Python)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, spec, tables):
        outs = run_forward(q, k, v, sinks, tables, spec)  # ``tables``: the backend's, decoded once per step
        ctx.save_for_backward(q, k, v, sinks, *outs)
        ctx.spec, ctx.tables = spec, tables
        return outs[0]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, *saved = ctx.saved_tensors
        grad = run_backward(dout, q, k, v, sinks, saved, ctx.tables, ctx.spec)
        return grad[0], grad[1], grad[2], grad[3] if sinks is not None else None, None, None


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
    spec = layer_spec(plan.backend, plan.group_names, sharded.cp_size, sharded.cp_rank, plan.kernel, scale, causal,
                      window, softcap, options.overlap, U, check)
    if torch.compiler.is_compiling():  # the opaque op: one node in the graph, its fake implementation for tracing
        return torch.ops.cp_packing.attention_fwd(q, k, v, sinks, [tables.blob, tables.sizes], spec)[0]
    return _EagerAttention.apply(q, k, v, sinks, spec, tables.native)
