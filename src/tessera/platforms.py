"""Device choice before JAX starts its backends, and the check that the chosen platform starts
(this module imports nothing heavy)."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys


def check_backends_not_started(what: str) -> None:
    """RuntimeError when JAX has started its backends: environment variables they read at start-up
    (XLA_FLAGS, XLA_PYTHON_CLIENT_MEM_FRACTION) would be set too late. `what` names the caller's
    change, for the message."""
    if "jax" not in sys.modules:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(f"{what} after JAX started its backends, where they have no effect; call it before any "
                           "device use")


def use_cpu_on_hosts_without_accelerators() -> None:
    """libtpu (installed for ahead-of-time TPU compiles) probes for TPU chips, noisily, on every
    host. Where no TPU, NVIDIA or AMD device exists, go straight to the CPU; an explicit
    JAX_PLATFORMS always wins. Works before or after `import jax`, not after JAX has started."""
    if "JAX_PLATFORMS" in os.environ:
        return
    devices = [p for pattern in ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
               for p in glob.glob(pattern)]
    if devices:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # the config read the environment at import time
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def check_platforms_start() -> None:
    """Start JAX's backends; ConfigError when the platform JAX_PLATFORMS names cannot start here
    (JAX_PLATFORMS=cuda on a host without NVIDIA GPUs or without the CUDA plugin), whose own error
    is a traceback (for cuda a bare AssertionError). Call it after `jax.distributed.initialize`."""
    import jax

    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:
        wanted = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
        if not wanted:
            raise
        from tessera.config.schema import ConfigError

        said = " ".join(str(e).split())[:300] or "no backend started"
        if set(wanted.split(",")) & {"cuda", "gpu"} and not any(
                importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
            said = "no CUDA plugin (jax-cuda12-plugin) is installed"
        raise ConfigError(f"JAX_PLATFORMS={wanted}: JAX cannot start that platform here ({said}); unset "
                          "JAX_PLATFORMS to use the devices this host has, or install the flavour for it (bash "
                          "setup.sh DEVICE=gpu); .venv/bin/python -m tessera.doctor lists what JAX sees") from None
