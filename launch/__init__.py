"""Thin torchrun entry points (``launch/train.py``, ``launch/verify.py``) over ``cp_packing.tools``."""
