"""Shared fixtures."""

from __future__ import annotations

import os
import sys

import pytest

STUB_DIR = os.path.join(os.path.dirname(__file__), "flash_attn_stub")


def use_flash_attn_stub() -> None:
    """Put the test-only pure-torch flash_attn stand-in first on sys.path (ring-flash-attn imports it)."""
    if STUB_DIR not in sys.path:
        sys.path.insert(0, STUB_DIR)


@pytest.fixture(scope="session")
def ring_flash_attn():
    """The real ring-flash-attn package, running on the pure-torch flash_attn stand-in."""
    if not os.path.isdir(STUB_DIR):
        pytest.skip("tests/flash_attn_stub is not there")
    use_flash_attn_stub()
    from cp_packing.attention.ring import import_ring_flash_attn

    return import_ring_flash_attn()
