"""MagiAttention's own dispatch, run from a local checkout: ``bench_planner.py --magi PATH`` times it beside ``local``.

``load(path)`` returns ``dispatch(cu, cp) -> (rank, start, length)``: MagiAttention's
``make_dispatch_meta_from_qk_ranges`` (the chunk areas of every 512-token chunk under per-document causal masks, then
its default ``DispatchConfig``: the pure-Python min-heap solver ``_solve_with_minhp``) for rank 0, as each rank runs
it, and its chunk partition as runs. Nothing of it is copied here: the checkout is imported as it is (``git clone
https://github.com/SandAI-org/MagiAttention``; the benchmark was run on commit ``2c64135``).

Its package needs its CUDA extensions, Triton and debugpy at import time, none of which the dispatch runs. So that it
imports on a CPU machine: the package's ``__init__`` (which loads the extensions) is not run (the package is made
from its directory), a stand-in ``triton`` module is present only while its modules import (their range ops are
Triton kernels the dispatch never calls; torch probes for triton later, so the stand-in is removed after), a
stand-in ``debugpy`` likewise, and ``torch.cuda.nvtx`` range markers (which its functions are wrapped in, and a CPU
build of torch lacks) are no-ops while it runs (on a GPU they cost microseconds). The hollow package and its
modules stay imported for the rest of the process (a benchmark's); a process that already imported
``magi_attention`` is refused, so that the checkout given is the one timed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import numpy as np
import torch

CHUNK = 512


def _stand_ins() -> dict[str, types.ModuleType]:
    """Modules that only have to import: ``triton`` (decorators that return the function, names that are types)
    and ``debugpy``."""

    class _Names(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    triton = _Names("triton")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton.autotune = triton.heuristics = lambda *a, **kw: (lambda f: f)
    triton.cdiv = lambda a, b: -(-a // b)
    language, extra, libdevice = _Names("triton.language"), _Names("triton.language.extra"), \
        _Names("triton.language.extra.libdevice")
    language.__path__, extra.__path__ = [], []
    triton.language, language.extra, extra.libdevice = language, extra, libdevice
    debugpy = types.ModuleType("debugpy")
    debugpy.listen = debugpy.wait_for_client = lambda *a, **kw: None
    return {"triton": triton, "triton.language": language, "triton.language.extra": extra,
            "triton.language.extra.libdevice": libdevice, "debugpy": debugpy}


def load(path: str):
    """``dispatch(cu, cp)`` from the MagiAttention checkout at ``path`` (the folder holding ``magi_attention/``)."""
    root = os.path.join(path, "magi_attention")
    if not os.path.isfile(os.path.join(root, "meta", "_make_dispatch_meta.py")):
        raise ValueError(f"--magi {path!r}: no magi_attention/meta/_make_dispatch_meta.py there; pass the folder of a "
                         "MagiAttention checkout (git clone https://github.com/SandAI-org/MagiAttention)")
    if "magi_attention" in sys.modules:
        raise ValueError(f"--magi {path!r}: a magi_attention package is already imported in this process; run the "
                         "benchmark in a fresh one (the checkout would not be the one timed)")
    package = types.ModuleType("magi_attention")
    package.__path__ = [root]
    stand_ins = {name: mod for name, mod in _stand_ins().items() if name not in sys.modules}
    sys.modules.update(stand_ins)
    sys.modules["magi_attention"] = package  # stays, with its modules, for the process: a benchmark's
    try:
        from magi_attention.common import AttnRanges
        from magi_attention.common.enum import AttnMaskType
        from magi_attention.meta._make_dispatch_meta import make_dispatch_meta_from_qk_ranges
        from magi_attention.meta.solver.dispatch_solver import DispatchConfig
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)

    def dispatch(cu: np.ndarray, cp: int):
        total = int(cu[-1])
        if total % (CHUNK * cp):
            raise ValueError(f"MagiAttention's dispatch needs T = {total} divisible by cp * {CHUNK} = {CHUNK * cp}")
        pairs = [[int(a), int(b)] for a, b in zip(cu[:-1], cu[1:]) if b > a]
        with _no_nvtx():
            meta_q, _ = make_dispatch_meta_from_qk_ranges(
                AttnRanges.from_ranges(pairs), AttnRanges.from_ranges(pairs), [AttnMaskType.CAUSAL] * len(pairs),
                total, total, CHUNK, cp, 0, DispatchConfig(), True, True, True)
        owner = np.empty(total // CHUNK, dtype=np.int64)
        for rank, chunks in enumerate(meta_q.partitions):
            owner[np.asarray(chunks, dtype=np.int64)] = rank
        cuts = np.union1d(cu, np.arange(total // CHUNK + 1, dtype=np.int64) * CHUNK)
        start, length = cuts[:-1], np.diff(cuts)
        start, length = start[length > 0], length[length > 0]
        return owner[start // CHUNK], start, length

    return dispatch


@contextlib.contextmanager
def _no_nvtx():
    nvtx = torch.cuda.nvtx
    push, pop = nvtx.range_push, nvtx.range_pop
    nvtx.range_push = nvtx.range_pop = lambda *a, **kw: None
    try:
        yield
    finally:
        nvtx.range_push, nvtx.range_pop = push, pop
