"""Tessera entry point: `python3 train.py configs/base.yml run_name=demo [key=value ...]` (--help: the keys)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # also works without `pip install -e .`

if __name__ == "__main__":
    from tessera.tools.cli import exit_if_help, train_help

    exit_if_help(sys.argv[1:], train_help)  # before JAX is imported: instant, no device probing
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    from tessera.host_malloc import reexec

    reexec()  # CPU runs: start again with mimalloc preloaded (each step's buffers stay mapped)
    from tessera.train import main

    sys.exit(main(sys.argv[1:]))
