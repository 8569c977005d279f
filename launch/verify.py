"""torchrun entry point of ``python -m cp_packing verify`` (``cp_packing.tools.verify``): check context-parallel
attention against full attention on your cluster, every layout, backend and kernel.

    torchrun --standalone --nproc-per-node 4 launch/verify.py [options]    # options: python -m cp_packing verify -h
"""

import sys

from cp_packing.tools.verify import main

if __name__ == "__main__":
    sys.exit(main())
