"""Entry points launched with torchrun (or ``python launch/<script>.py --nproc N``): train.py, verify.py."""
