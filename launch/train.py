"""torchrun entry point of ``python -m cp_packing train`` (``cp_packing.tools.train``): train a tiny causal LM with
context parallelism on synthetic neat-packed documents.

    torchrun --standalone --nproc-per-node 2 launch/train.py [options]     # options: python -m cp_packing train -h
"""

import sys

from cp_packing.tools.train import main

if __name__ == "__main__":
    sys.exit(main())
