"""Tessera entry point: `python3 train.py configs/base.yml run_name=demo [key=value ...]` (--help: the keys)."""

import signal
import sys
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C and SIGTERM wait for the imports (tessera.tools.cli_signals.ctrl_c_held_while_starting)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # also works without `pip install -e .`

if __name__ == "__main__":
    from tessera.tools.cli import packages_installed, prepare_training_process
    from tessera.tools.cli_signals import ctrl_c_held_while_starting

    # a Ctrl-C inside an import is one line, after the imports; so is a package this Python lacks
    with ctrl_c_held_while_starting(), packages_installed("train.py"):
        prepare_training_process(sys.argv[1:])  # --help, CPU on hosts without accelerators, mimalloc on CPU
        from tessera.train import main

    sys.exit(main(sys.argv[1:]))
