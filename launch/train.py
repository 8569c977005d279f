"""torchrun entry point of ``python -m cp_packing train`` (``cp_packing.tools.train``): train a causal LM with
context parallelism (a tiny preset on synthetic documents, or your local model and data; docs/launcher.md).

    torchrun --standalone --nproc-per-node 2 launch/train.py [options]     # options: python -m cp_packing train -h

A SIGTERM is caught from the first line on (a stdlib handler while torch and transformers import, then the
launcher's own): a preemption during start-up stops the run cleanly (exit 3) instead of killing it.
"""

import signal
import sys

_sigterm: list = []  # SIGTERMs while the imports below run; handed to the launcher's flag
signal.signal(signal.SIGTERM, lambda signum, frame: _sigterm.append(signum))

from cp_packing.tools.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(early_signals=_sigterm))
