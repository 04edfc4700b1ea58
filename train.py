"""Tessera entry point: `python3 train.py configs/base.yml run_name=demo [key=value ...]`."""

import glob
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # also works without `pip install -e .`


def _use_cpu_on_hosts_without_accelerators() -> None:
    """libtpu (installed for ahead-of-time TPU compiles) probes for TPU chips, noisily, on every
    host. Where no TPU, NVIDIA or AMD device exists, go straight to the CPU; an explicit
    JAX_PLATFORMS always wins."""
    if "JAX_PLATFORMS" in os.environ:
        return
    devices = [p for pattern in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
               for p in glob.glob(pattern)]
    if not devices:
        os.environ["JAX_PLATFORMS"] = "cpu"


if __name__ == "__main__":
    _use_cpu_on_hosts_without_accelerators()
    from tessera.train import main

    sys.exit(main(sys.argv[1:]))
