"""Text generation from a checkpoint: `python3 decode.py configs/base.yml load_parameters_path=PATH
tokenizer_path=PATH [key=value ...] --prompt "text" [--max_new_tokens N ...]` (getting_started/Decode.md)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # also works without `pip install -e .`

if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    from tessera.decode import main

    sys.exit(main(sys.argv[1:]))
