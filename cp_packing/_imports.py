"""Optional imports that are tried once per ``sys.path``: flash-attn and ring-flash-attn.

``kernel="auto"`` and ``backend="auto"`` ask in every attention call (every layer) whether an optional package is
there. A failed import (``find_spec`` scans ``sys.path``; a broken CUDA build re-runs module code) is remembered
for the ``sys.path`` it failed under, so it is not retried in every layer, while a directory added to ``sys.path``
later (the tests' flash_attn stand-in, a package installed into a new path) is tried. A success needs no cache:
the module is then in ``sys.modules``.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Callable

__all__ = ["forget_import_failures", "try_import"]

_FAILED: set[tuple[str, tuple[str, ...]]] = set()


def try_import(name: str, importer: Callable[[], ModuleType]) -> ModuleType | None:
    """``importer()``, or ``None`` when it raises (never raises); a failure is remembered per ``sys.path``.

    Args:
        name: the module ``importer`` imports (a remembered failure is ignored once it is in ``sys.modules``).
        importer: a function that imports and returns the module.
    """
    key = (name, tuple(sys.path))
    if key in _FAILED and name not in sys.modules:
        return None
    try:
        return importer()
    except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA build raising OSError/RuntimeError
        _FAILED.add(key)
        return None


def forget_import_failures() -> None:
    """Forget every remembered failure (e.g. after installing a package into a running process)."""
    _FAILED.clear()
