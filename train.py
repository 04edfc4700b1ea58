"""Tessera entry point: `python3 train.py configs/base.yml run_name=demo [key=value ...]` (--help: the keys)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # also works without `pip install -e .`

if __name__ == "__main__":
    from tessera.tools.cli import prepare_training_process

    prepare_training_process(sys.argv[1:])  # --help, CPU on hosts without accelerators, mimalloc on CPU
    from tessera.train import main

    sys.exit(main(sys.argv[1:]))
