"""Text generation from a checkpoint: `python3 decode.py configs/base.yml load_parameters_path=PATH
tokenizer_path=PATH [key=value ...] --prompt "text" [--max_new_tokens N ...]` (getting_started/Decode.md)."""

import importlib
import signal
import sys
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C and SIGTERM wait for the imports (tessera.tools.cli_signals.ctrl_c_held_while_starting)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # also works without `pip install -e .`

if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators
    from tessera.tools.cli import packages_installed, run_printing
    from tessera.tools.cli_signals import ctrl_c_held_while_starting

    # a Ctrl-C inside an import is one line, after the imports; so is a package this Python lacks
    with ctrl_c_held_while_starting(), packages_installed("decode.py"):
        use_cpu_on_hosts_without_accelerators()
        from tessera.decode_args import exit_if_arguments_fail

        exit_if_arguments_fail(sys.argv[1:])  # --help, a bad flag or config: one line, before JAX's import
        importlib.import_module("jax")  # here, where a Ctrl-C waits for the import (decode imports it later)
        from tessera.decode import main

    sys.exit(run_printing(main, sys.argv[1:]))  # `| head` and a full disk: an exit code, not a traceback
