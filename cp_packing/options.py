"""The frozen options of CP attention: everything that shapes a step's attention, validated once.

:class:`AttentionOptions` is the one way options reach the attention: ``cp_packing.attention.prepare_attention``
takes it (or its fields as keywords), and every other entry point (``cp_packing.hf.cp_model_inputs``'s ``backend`` /
``kernel`` / ``ulysses_size``, the HF ``cp_backend`` / ``cp_kernel`` kwargs of hand-built calls, the trainers, the
CLI) only constructs one. It goes into the step's plan; the layers only read it. Per-layer values that HF passes to
the attention function (a layer's ``sliding_window``, ``scaling``, soft-capping, sinks, ``is_causal``) override the
defaults here for that layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cp_packing._checks import check_bool, check_int, check_softcap, check_softmax_scale, check_windows
from cp_packing.capabilities import BACKENDS, KERNELS

__all__ = ["AttentionOptions", "CHECKED_STEPS"]

CHECKED_STEPS = 2
"""With ``check_layers=None``, the first this-many steps of a CP group check every layer against the other ranks."""


@dataclass(frozen=True)
class AttentionOptions:
    """What shapes a step's CP attention (validated in ``__post_init__``; hashable; compare with ``==``).

    Attributes:
        backend: ``"auto"`` (chosen per step, docs/attention.md), ``"allgather"``, ``"exchange"``, ``"ulysses"``,
            ``"hybrid"`` (with ``ulysses_size``) or ``"ring_flash_attn"``.
        kernel: the varlen kernel: ``"auto"``, ``"torch"``, ``"flash_attn"`` or ``"torch_varlen"``.
        ulysses_size: ranks per Ulysses group of ``backend="hybrid"`` (and only with it).
        window: the layers' sliding window(s), ``None``, an int or a per-layer tuple of ``int | None``: a step
            prepared without the model's features gets key tables for each distinct window (with ``model=`` the
            model's own layers decide).
        causal: causal attention within each document (a layer's ``is_causal`` overrides it).
        softcap: logit soft-capping of layers that pass none (``None``: none).
        sinks: whether the model's layers have attention sinks (rules out backends that cannot take them).
        scale: softmax scale of layers that pass none (``None``: ``1 / sqrt(head_dim)``).
        overlap: the exchange backend hides its transfer behind the local part of the attention.
        heads_k_stride: ring-flash-attn's llama3 kernel: key/value heads all-gathered per step (``None``: all; a
            divisor of the key/value heads, smaller saves memory).
        hardware: the rates ``backend="auto"``'s step-time model prices with (a ``cp_packing.cost.Hardware``;
            ``None``: ``cost.DEFAULT_HARDWARE``, an H100-class node with InfiniBand between nodes).
        memory_budget: bytes one attention layer may allocate at a rank (forward or backward, above its inputs):
            ``backend="auto"`` only picks a backend whose modelled peak (``cp_packing.cost.backend_memory``) fits,
            and raises a ValueError when none does (``None``: no budget).
        check_layers: every layer's call checked against the other ranks (a small agreement per layer, so a per-layer
            mistake on one rank raises everywhere): ``True``, ``False``, or ``None`` = the first
            :data:`CHECKED_STEPS` steps of a CP group.

    >>> AttentionOptions(backend="hybrid", ulysses_size=2).ulysses_size
    2
    >>> AttentionOptions(window=[4096, None]).window
    (4096, None)
    """

    backend: str = "auto"
    kernel: str = "auto"
    ulysses_size: int | None = None
    window: Any = None
    causal: bool = True
    softcap: float | None = None
    sinks: bool = False
    scale: float | None = None
    overlap: bool = True
    heads_k_stride: int | None = None
    hardware: Any = None
    check_layers: bool | None = None
    memory_budget: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"unknown attention backend {self.backend!r}; choose one of "
                             f"{', '.join(map(repr, ('auto', *BACKENDS)))}")
        if self.kernel not in ("auto", *KERNELS):
            raise ValueError(f"unknown attention kernel {self.kernel!r}; choose one of 'auto', "
                             f"{', '.join(map(repr, KERNELS))}")
        if (self.backend == "hybrid") != (self.ulysses_size is not None):
            raise ValueError(
                f"ulysses_size={self.ulysses_size!r} with backend={self.backend!r}: ulysses_size (ranks per Ulysses "
                "group) goes with backend='hybrid' and only with it; use backend='ulysses' for Ulysses over the whole "
                "CP group"
            )
        if self.ulysses_size is not None:
            check_int(self.ulysses_size, "ulysses_size", min=1)
        object.__setattr__(self, "window", check_windows(self.window))
        check_bool(self.causal, "causal")
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        check_bool(self.sinks, "sinks")
        object.__setattr__(self, "scale", check_softmax_scale(self.scale))
        check_bool(self.overlap, "overlap")
        if self.heads_k_stride is not None:
            check_int(self.heads_k_stride, "heads_k_stride", min=1)
        if self.check_layers is not None:
            check_bool(self.check_layers, "check_layers")
        if self.memory_budget is not None:
            check_int(self.memory_budget, "memory_budget", min=1)
        if self.hardware is not None:
            from cp_packing.cost import Hardware

            if not isinstance(self.hardware, Hardware):
                raise TypeError(f"hardware must be a cp_packing.cost.Hardware (or None for the defaults), got "
                                f"{type(self.hardware).__name__}")

    def replace(self, **changes: Any) -> "AttentionOptions":
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The distinct per-layer windows, ``None`` (a global layer) included: the step's key tables to prepare."""
        layers = self.window if isinstance(self.window, tuple) else (self.window,)
        return tuple(dict.fromkeys(layers))
