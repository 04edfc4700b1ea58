"""Device choice before JAX starts its backends, the check that the chosen platform starts, and
the settings a run makes for itself undone when it ends (this module imports nothing heavy)."""

from __future__ import annotations

import contextlib
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


# What a run's keys set for the whole process (gpu_tuning.py's keys, xla_dump.py's dump_hlo, and train_compile's
# description of a TPU slice for libtpu): the environment variables, and JAX's options of the same settings,
# which JAX reads at each compile
RUN_VARIABLES = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_OPTIMIZATION_LEVEL", "JAX_ENABLE_PGLE",
                 "JAX_PGLE_PROFILING_RUNS", "ALLOW_MULTIPLE_LIBTPU_LOAD", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE")
RUN_JAX_OPTIONS = ("jax_optimization_level", "jax_enable_pgle", "jax_pgle_profiling_runs",
                   "jax_enable_compilation_cache")


@contextlib.contextmanager
def run_settings_restored():
    """The environment variables and JAX options a run's keys set (RUN_VARIABLES, RUN_JAX_OPTIONS) as
    they were before it, once it ends, however it ends. In one Python process (a notebook, a sweep,
    the tests) a run with optimization_level=O1 enable_pgle=true left them on for every later run, whose
    start-up line named them as its own, and dump_hlo=true left the persistent compilation cache off
    (with its dump folder in XLA_FLAGS): a later run with jax_cache_dir said "compilation cache: ..." and
    wrote nothing there. Flags XLA read when its backends started stay in force for the process."""
    import jax

    variables = {name: os.environ.get(name) for name in RUN_VARIABLES}
    options = {name: getattr(jax.config, name) for name in RUN_JAX_OPTIONS}
    try:
        yield
    finally:
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, value in options.items():
            if getattr(jax.config, name) != value:
                jax.config.update(name, value)


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
