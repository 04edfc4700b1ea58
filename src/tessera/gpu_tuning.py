"""GPU tuning keys (the `gpu` section of the config), applied before JAX starts its backends.

JAX and XLA read these settings from the environment or from JAX's config when a backend starts
or a program compiles, so `apply_gpu_tuning` runs after the config is loaded and before any
device use (train.py's `main`). Like platforms.py, this module imports nothing heavy.

    key                             where it goes
    optimization_level              JAX_OPTIMIZATION_LEVEL and jax_optimization_level
    enable_pgle                     JAX_ENABLE_PGLE and jax_enable_pgle
    pgle_profiling_runs             JAX_PGLE_PROFILING_RUNS and jax_pgle_profiling_runs (with enable_pgle)
    pgle_profile_path               --xla_gpu_pgle_profile_file_or_directory_path in XLA_FLAGS
    xla_python_client_mem_fraction  XLA_PYTHON_CLIENT_MEM_FRACTION

A key left at its default ('', false, 0) changes nothing, so a variable exported by hand still
works; a key that is set wins over the environment. getting_started/GPU_performance.md explains
when to use each.

Run as a module, it writes the PGLE profile that pgle_profile_path reads from the trace of an
earlier run (profiler=xplane on an NVIDIA GPU):

    .venv/bin/python -m tessera.gpu_tuning outputs/<run>/profile outputs/<run>/pgle.pb
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from typing import Mapping, MutableMapping

from tessera.config.schema import ConfigError, GpuConfig
from tessera.platforms import check_backends_not_started
from tessera.tools.cli import UsageError, exit_if_help, help_text, resolve_path

log = logging.getLogger("tessera")

PGLE_FLAG = "--xla_gpu_pgle_profile_file_or_directory_path"
LHS_FLAG = "--xla_gpu_enable_latency_hiding_scheduler"
TRUE_WORDS = ("1", "true", "t", "yes", "y", "on")  # what JAX accepts as true in a JAX_* variable
JAX_MEM_FRACTION = 0.75  # the share of each GPU's memory JAX takes when nothing sets XLA_PYTHON_CLIENT_MEM_FRACTION


def check_gpu_config(gpu: GpuConfig) -> None:
    """The checks the schema's `choices` and `minimum` cannot express (GpuConfig runs this when built)."""
    fraction = gpu.xla_python_client_mem_fraction
    if fraction and not 0.0 < fraction <= 1.0:
        raise ConfigError(f"xla_python_client_mem_fraction={fraction:g} must be in (0, 1]: the share of each GPU's "
                          "memory JAX takes at start-up, e.g. 0.9 (0 leaves XLA_PYTHON_CLIENT_MEM_FRACTION as it is)")
    path = gpu.pgle_profile_path
    if path and not os.path.exists(os.path.expanduser(path)):
        raise ConfigError(f"pgle_profile_path={path!r} does not exist; it must be a local profile file (.pb or "
                          ".pbtxt) or folder written by an earlier run (getting_started/GPU_performance.md, "
                          "'The PGLE workflow'), or empty")
    if any(c.isspace() for c in path):
        raise ConfigError(f"pgle_profile_path={path!r} contains white space, which XLA_FLAGS cannot carry; "
                          "move the profile to a path without spaces")
    why = not_a_profile(os.path.expanduser(path)) if path else ""
    if why:
        raise ConfigError(f"pgle_profile_path={path!r} {why}: XLA would read no usable profile from it and say "
                          "nothing. Write the profile from the trace first (.venv/bin/python -m tessera.gpu_tuning "
                          "<trace folder> <profile.pb>) and give that file")


def not_a_profile(path: str) -> str:
    """Why `path` cannot be a PGLE profile as XLA reads one ('' when it can be): a trace of
    profiler=xplane (a folder holding *.xplane.pb files, or one of them), or a folder with no
    <fingerprint>.pb or .pbtxt file, the only names XLA looks for in a folder."""
    if path.endswith(".xplane.pb"):
        return "is a trace (profiler=xplane's), not a profile"
    if not os.path.isdir(path):
        return ""
    if any(glob.glob(os.path.join(path, *sub, "*.xplane.pb")) for sub in ((), ("*",), ("plugins", "profile", "*"))):
        return "is a trace folder (profiler=xplane's), not a profile"
    if not glob.glob(os.path.join(path, "*.pb")) + glob.glob(os.path.join(path, "*.pbtxt")):
        return "is a folder without a profile (.pb or .pbtxt file)"
    return ""


def tuning_environment(gpu: GpuConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables the keys set, with their new values (only keys that are set)."""
    out = {}
    if gpu.optimization_level:
        out["JAX_OPTIMIZATION_LEVEL"] = gpu.optimization_level
    if gpu.enable_pgle:
        out["JAX_ENABLE_PGLE"] = "true"
        out["JAX_PGLE_PROFILING_RUNS"] = str(gpu.pgle_profiling_runs)
    if gpu.pgle_profile_path:
        kept = [f for f in environ.get("XLA_FLAGS", "").split() if f.partition("=")[0] != PGLE_FLAG]
        out["XLA_FLAGS"] = " ".join([*kept, f"{PGLE_FLAG}={gpu.pgle_profile_path}"])
    if gpu.xla_python_client_mem_fraction:
        out["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{gpu.xla_python_client_mem_fraction:g}"
    return out


def effective_settings(gpu: GpuConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """What a run with these keys in this environment uses: the key where it is set, else the
    environment variable, else JAX's default. For the start-up log and the validation suite."""
    env = {**environ, **tuning_environment(gpu, environ)}
    flags = dict(f.partition("=")[::2] for f in env.get("XLA_FLAGS", "").split())
    pgle_on = env.get("JAX_ENABLE_PGLE", "false").lower() in TRUE_WORDS
    return {
        "optimization_level": env.get("JAX_OPTIMIZATION_LEVEL") or "default",
        "enable_pgle": "true" if pgle_on else "false",
        "pgle_profiling_runs": env.get("JAX_PGLE_PROFILING_RUNS", "3") if pgle_on else "-",
        "pgle_profile_path": flags.get(PGLE_FLAG) or "-",
        "xla_python_client_mem_fraction": (env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
                                           or f"default ({JAX_MEM_FRACTION:g})"),
    }


def gpu_memory_fraction(gpu: GpuConfig, environ: Mapping[str, str]) -> tuple[float, str]:
    """(the share of each GPU's memory a run with these keys in this environment can use, where it
    comes from): the key, else XLA_PYTHON_CLIENT_MEM_FRACTION, else JAX's 0.75. JAX's GPU client
    allocates no more than that; the estimator and the planner size a GPU run against it."""
    if gpu.xla_python_client_mem_fraction:
        return gpu.xla_python_client_mem_fraction, "xla_python_client_mem_fraction"
    try:
        fraction = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""))
    except ValueError:
        fraction = 0.0
    if 0.0 < fraction <= 1.0:
        return fraction, "XLA_PYTHON_CLIENT_MEM_FRACTION"
    return JAX_MEM_FRACTION, "JAX's default; xla_python_client_mem_fraction=0.9 gives it more"


def apply_gpu_tuning(gpu: GpuConfig, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the environment (and JAX's config, when JAX is already imported) from the keys, log one
    line with the settings the run uses, and return them (see `effective_settings`)."""
    environ = os.environ if environ is None else environ
    changes = tuning_environment(gpu, environ)
    jax = sys.modules.get("jax")
    if changes.keys() & {"XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION"}:
        check_backends_not_started(f"apply_gpu_tuning sets {', '.join(sorted(changes))}")
    for line in replaced_variables(gpu, environ, changes):
        log.warning("gpu tuning: %s", line)
    environ.update(changes)
    if jax is not None:  # JAX read the JAX_* variables when it was imported: set its config as well
        if gpu.optimization_level:
            jax.config.update("jax_optimization_level", gpu.optimization_level)
        if gpu.enable_pgle:
            jax.config.update("jax_enable_pgle", True)
            jax.config.update("jax_pgle_profiling_runs", gpu.pgle_profiling_runs)
    settings = effective_settings(gpu, environ)
    # One line when something is tuned or a GPU may be used; a plain CPU run stays quiet.
    tuned = changes or any(v not in ("-", "false") and not v.startswith("default") for v in settings.values())
    (log.info if tuned or _gpu_present() else log.debug)(
        "gpu tuning: %s", ", ".join(f"{k}={v}" for k, v in settings.items()))
    lhs = settings["optimization_level"] in ("O1", "O2", "O3") or latency_hiding_forced(environ.get("XLA_FLAGS", ""))
    if (settings["enable_pgle"] == "true" or settings["pgle_profile_path"] != "-") and not lhs:
        log.warning("gpu tuning: PGLE feeds XLA's latency-hiding scheduler, which is off here; set "
                    "optimization_level=O1 (or %s=true in XLA_FLAGS) or the profile is not used", LHS_FLAG)
    return settings


KEY_OF = {"JAX_OPTIMIZATION_LEVEL": "optimization_level", "JAX_PGLE_PROFILING_RUNS": "pgle_profiling_runs",
          "XLA_PYTHON_CLIENT_MEM_FRACTION": "xla_python_client_mem_fraction"}


def replaced_variables(gpu: GpuConfig, environ: Mapping[str, str], changes: Mapping[str, str]) -> list[str]:
    """A line per variable of the environment that a key replaces with another value: a recipe sets
    optimization_level=O1 and xla_python_client_mem_fraction as keys, so XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
    given to it as an argument was exported and then overridden without a word."""
    lines = []
    for name, key in KEY_OF.items():
        if name in changes and not _same(environ.get(name, changes[name]), changes[name]):
            lines.append(f"{key}={getattr(gpu, key)} replaces {name}={environ[name]} of the environment (a key "
                         f"wins); to use {environ[name]}, give {key}={environ[name]}")
    old = dict(f.partition("=")[::2] for f in environ.get("XLA_FLAGS", "").split()).get(PGLE_FLAG)
    if "XLA_FLAGS" in changes and old and old != gpu.pgle_profile_path:
        lines.append(f"pgle_profile_path={gpu.pgle_profile_path} replaces {PGLE_FLAG}={old} of XLA_FLAGS (a key wins)")
    return lines


def _same(a: str, b: str) -> bool:
    """Whether two values of a variable are the same setting (0.90 and 0.9 are)."""
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def latency_hiding_forced(xla_flags: str) -> bool:
    """Whether XLA_FLAGS turns the latency-hiding scheduler on as XLA reads it: the last of the flag's
    occurrences, its value true, True or 1, or no value at all."""
    value = None
    for flag in xla_flags.split():
        name, sep, text = flag.partition("=")
        if name == LHS_FLAG:
            value = text if sep else "true"
    return value is not None and value.lower() in TRUE_WORDS


def _gpu_present() -> bool:
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd"))


# --------------------------------------------------------------------------- PGLE profiles


def write_pgle_profile(trace_dir: str, out: str) -> int:
    """Write the PGLE profile (a binary ProfiledInstructionsProto) of the newest trace in
    `trace_dir`, a run's `profile` folder or one of its `plugins/profile/<time>` folders; returns
    its size in bytes. Only a trace of NVIDIA GPUs holds the kernel times a profile is made of."""
    runs = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*"))) or [trace_dir]
    if not glob.glob(os.path.join(runs[-1], "*.xplane.pb")):
        processes = sorted(glob.glob(os.path.join(trace_dir, "process_*")), key=lambda p: (len(p), p))
        if processes:  # a multi-process run traces each process into profile/process_<i> (loop_records.Profiler)
            raise UsageError(f"{trace_dir} holds the traces of a multi-process run, one folder per process; give one "
                             f"of them, e.g. {processes[0]}")
        raise UsageError(f"no trace (*.xplane.pb) in {runs[-1]}; give the profile folder of a run that had "
                         "profiler=xplane, e.g. outputs/<run>/profile")
    from jax.errors import JaxRuntimeError
    from jax.experimental.profiler import get_profiled_instructions_proto

    try:
        profile = get_profiled_instructions_proto(runs[-1])
    except JaxRuntimeError as e:  # a trace cut short (a full disk, a killed run): was a traceback
        raise UsageError(f"the trace in {runs[-1]} cannot be read ({e}); trace the run again "
                         "(profiler=xplane)") from None
    if not profile:
        raise UsageError(f"the trace in {runs[-1]} holds no GPU kernel times (a trace of a CPU or TPU run "
                         "has none); trace a run on the NVIDIA GPUs the profile is for")
    try:
        with open(out, "wb") as f:
            f.write(profile)
    except OSError as e:
        raise UsageError(f"the profile {out} cannot be written: {e.strerror or e}; give another path") from None
    return len(profile)


def pgle_help() -> str:
    return help_text(
        ".venv/bin/python -m tessera.gpu_tuning TRACE_FOLDER PROFILE.pb",
        "Write a PGLE profile from the trace of an earlier run (profiler=xplane on NVIDIA GPUs): the\n"
        "measured time of every instruction, for XLA's latency-hiding scheduler. Train again with\n"
        "the same config plus pgle_profile_path=PROFILE.pb. Exit 2 when the folder has no GPU trace.",
        keys=("optimization_level", "pgle_profile_path"), docs=("getting_started/GPU_performance.md",))


def main(argv: list[str]) -> int:
    exit_if_help(argv, pgle_help)
    try:
        if len(argv) != 2:
            raise UsageError("give the trace folder and the profile to write, e.g. outputs/run/profile "
                             "outputs/run/pgle.pb")
        out = resolve_path(argv[1], "profile", must_exist=False)
        size = write_pgle_profile(resolve_path(argv[0], "trace folder"), out)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({size:,} bytes); train with pgle_profile_path={out}")
    return 0


if __name__ == "__main__":
    from tessera.platforms import use_cpu_on_hosts_without_accelerators

    use_cpu_on_hosts_without_accelerators()
    sys.exit(main(sys.argv[1:]))
