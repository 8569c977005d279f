"""TEST-ONLY pure-torch stand-in for the ``flash_attn`` package (never installed, never shipped).

ring-flash-attn 0.1.8 imports exactly four private functions from ``flash_attn.flash_attn_interface``; this package
provides them with flash-attn 2.8 signatures on top of cp-packing's reference kernel, so that CI can run the REAL
ring-flash-attn code on CPU + gloo. Tests put ``tests/flash_attn_stub`` first on ``sys.path`` before importing
ring_flash_attn. See ``flash_attn_interface`` for where it deliberately differs from flash-attn.
"""

__version__ = "2.8.3+cp_packing_stub"
IS_CP_PACKING_STUB = True
