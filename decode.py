"""Text generation from a checkpoint: `python3 decode.py configs/base.yml load_parameters_path=PATH
tokenizer_path=PATH [key=value ...] --prompt "text" [--max_new_tokens N ...]` (getting_started/Decode.md)."""

import sys

from train import _use_cpu_on_hosts_without_accelerators  # same device choice as training; puts src/ on the path

if __name__ == "__main__":
    _use_cpu_on_hosts_without_accelerators()
    from tessera.decode import main

    sys.exit(main(sys.argv[1:]))
