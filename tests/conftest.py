"""Test set-up: CPU only, 8 fake devices. Must run before JAX is imported anywhere."""

import logging
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

# The suite's programs are tiny: XLA's compile of them, not their run, is most of its time, and
# LLVM's optimization of the generated CPU code is most of each compile. Level 0 (on XLA's own HLO
# passes, which decide fusion, sharding and collectives, it has no effect) halves a compile; every
# equality test compares programs built the same way. Tests that start processes with their own
# XLA_FLAGS add it too.
FAST_COMPILE = "--xla_backend_optimization_level=0"

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
                           + FAST_COMPILE).strip()

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import jax  # noqa: E402
import pytest  # noqa: E402

from tessera.config import build_config  # noqa: E402

# The tests compile without JAX's persistent compilation cache. Until 2026-12-01 each test process kept
# one (a third of test_train's compiles were loads), but in both full CI runs of that day a worker that had
# compiled about a thousand programs crashed (SIGSEGV) inside JAX's serialization of a program into that
# cache, and once inside the reading of one back (test_mtp.py's, which pass alone); xdist then hung.
# The tests of jax_cache_dir run train.py in processes of their own, with a cache of their own.

# Small, mostly odd sizes so that a mixed-up dimension fails loudly.
TINY = dict(
    base_emb_dim=24, base_num_query_heads=4, base_num_kv_heads=2, head_dim=6, base_mlp_dim=40,
    base_num_decoder_layers=3, vocab_size=96, max_target_length=12, per_device_batch_size=1,
    steps=3, log_period=1, enable_tensorboard=False, report_warmup_steps=0, remat_policy="none",
    learning_rate=1e-2, warmup_steps_fraction=0.0,
)


def tiny_config(tmp_path=None, **overrides):
    values = dict(TINY)
    if tmp_path is not None:
        values["base_output_directory"] = str(tmp_path)
        values["run_name"] = "test"
    values.update(overrides)
    return build_config(values)


def refused_or_one_devices_losses(tmp_path, mesh_keys: dict, refusal: str, **keys) -> None:
    """A mesh XLA:CPU may compute wrong results on (tessera.cpu_miscompile) is never silently wrong: either
    training on it is refused (a ConfigError matching the regex `refusal`), because the check found the
    output projection wrong on it here, or its losses over the 8 devices are one device's."""
    import json

    import numpy as np

    from tessera.config import ConfigError
    from tessera.cpu_miscompile import einsum_is_right
    from tessera.mesh import create_mesh
    from tessera.train import run

    def losses(name, devices, **more):
        run(tiny_config(tmp_path / name, **keys, **more), jax.devices()[:devices])
        return np.array([json.loads(line)["loss"] for line in
                         (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()])

    if not einsum_is_right(create_mesh(tiny_config(**mesh_keys).mesh)):
        with pytest.raises(ConfigError, match=refusal):
            run(tiny_config(tmp_path / "mesh", per_device_batch_size=0.5, **keys, **mesh_keys))
        return
    reference = losses("one", 1, per_device_batch_size=4)
    np.testing.assert_allclose(losses("mesh", 8, per_device_batch_size=0.5, **mesh_keys), reference, rtol=1e-4)


# The test files that take longest, with their seconds in a full run (2 workers, 2026-12-01; those trimmed
# since, estimated). With `-n` the files go to the workers in this order, longest first (pyproject.toml
# turns off pytest-xdist's own order, by number of tests): a long file started last would leave the other
# worker idle while it runs. Figures gone stale cost only balance; the files not listed follow in their
# collection order.
FILE_SECONDS = {
    "test_train.py": 395, "test_distributed.py": 370, "test_pipeline.py": 340, "test_checkpointing.py": 300,
    "test_decode.py": 265, "test_train_compile.py": 245, "test_families.py": 240, "test_faults.py": 210,
    "test_attention_kernels.py": 195, "test_hf_parity.py": 195, "test_mtp.py": 145, "test_model.py": 130,
    "test_quantization.py": 110, "test_optim.py": 105, "test_validate.py": 100, "test_data_training.py": 95,
    "test_readme_commands.py": 65, "test_plan.py": 60, "test_memory_fit.py": 60, "test_xla_dump.py": 55,
    "test_moe.py": 50, "test_estimate.py": 50, "test_data_grain.py": 45, "test_cli_help.py": 40,
}


def pytest_collection_modifyitems(config, items):
    """test_mtp.py first, so that a fresh worker runs it: late in a worker's process it crashed XLA:CPU
    (see `_compiled_programs_freed_after_each_file`); then the longest files (FILE_SECONDS)."""
    items.sort(key=lambda item: (item.path.name != "test_mtp.py", -FILE_SECONDS.get(item.path.name, 0)))


def pytest_collection_finish(session):
    """Python's cyclic garbage collector runs after every 700 new container objects by default; tracing and
    lowering a train step makes millions, so it ran hundreds of times a test (7% of the CPU time of three
    tiny training runs). The tests collect after every 50,000 (test_model.py and test_optim.py alone: 3-4%
    less CPU time), and the objects alive once the test files are imported (JAX, Flax, Orbax, the models: never
    garbage) are left out of every collection. Each file still ends with a full collection
    (`_compiled_programs_freed_after_each_file`)."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# Programs compiled by this test file, by JAX's own cache key (the module, the compile options with the
# device assignment, the XLA flags, the platform and JAX's version): `_same_program_compiled_once`.
_PROGRAMS: dict[str, object] = {}


def _same_program_compiled_once(compile_or_get_cached):
    """JAX's compile step (`jax._src.compiler.compile_or_get_cached`), made to compile a program only once
    per test file. Most of the suite's time is XLA's compile (73% of test_train.py's, 480 programs), and
    many tests of a file compile the very same program again: each `train.run` traces its step anew,
    and JAX keeps no program across traces (only its persistent compilation cache did, which the suite
    no longer uses, see above). XLA's compile is deterministic, so the program a test gets is the one it
    would have compiled. Left to XLA: programs with host callbacks, with an XLA dump asked for (a dump is
    the compile's side effect) and while a test has JAX's own persistent cache on (the loads it counts).
    JAX still records a compile event for every request, so the tests that count compiles see them."""
    from jax._src import cache_key

    def compiled(backend, computation, devices, compile_options, host_callbacks, executable_devices,
                 pgle_profiler=None):
        def compile_now():
            return compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks,
                                         executable_devices, pgle_profiler)

        if (host_callbacks or pgle_profiler is not None or jax.config.jax_compilation_cache_dir
                or "xla_dump_to" in os.environ.get("XLA_FLAGS", "")):
            return compile_now()
        try:
            key = cache_key.get(computation, devices, compile_options, backend)
        except Exception:  # a module JAX cannot key (it then compiles without its cache too)
            return compile_now()
        if key not in _PROGRAMS:
            _PROGRAMS[key] = compile_now()
        return _PROGRAMS[key]

    return compiled


from jax._src import compiler as _jax_compiler  # noqa: E402

_jax_compiler.compile_or_get_cached = _same_program_compiled_once(_jax_compiler.compile_or_get_cached)


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_freed_after_each_file():
    """Each test process (an xdist worker) runs many files and compiles thousands of programs; JAX keeps
    every one it compiled. Four full runs of 2026-12-01 crashed a worker (SIGSEGV) in test_mtp.py, late in
    its process, inside XLA:CPU: compiling, serializing or deserializing a program; test_mtp.py passes
    alone. Dropping the compiled programs after each file (JAX's and `_PROGRAMS`) keeps a worker's state
    that of a short run (a file's own fixtures still share theirs)."""
    yield
    import gc

    _PROGRAMS.clear()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_persistent_compilation_cache_after(request):
    """The suite compiles without JAX's persistent compilation cache (see above). In a full CI run of
    2026-12-01 a worker still crashed (SIGSEGV) serializing a test_mtp.py program into one: a test of the
    same process had left JAX's cache on. After every test the cache is turned off again (JAX keeps an
    initialized cache even once its folder setting is cleared, so it is reset too), and the test that left
    it on is named in the warnings summary."""
    yield
    from jax._src import compilation_cache

    folder = jax.config.jax_compilation_cache_dir
    if folder or compilation_cache._cache is not None:
        where = folder or "its folder cleared, the cache still initialized"
        warnings.warn(f"{request.node.nodeid} left JAX's persistent compilation cache on ({where}); turned off "
                      "for the tests after it")
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests need 8 fake CPU devices (XLA_FLAGS set in conftest.py)"


@pytest.fixture(autouse=True)
def _root_log_handlers_restored():
    """train, decode and convert `main` give the caller's logging back when they return (`command_logging`);
    train_compile's `main` and tests that set up logging themselves still install a root log handler on the
    stream of that test's captured stderr, which pytest closes when the test ends: later tests' log lines
    would hit a closed file ("--- Logging error ---" in their stderr). Each test ends with the root handlers
    it started with."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
    root.setLevel(level)


# The suite writes checkpoints, data and compiled programs under the temporary directory (about
# 300 MB at its peak; a passing test's tmp_path is deleted when it ends, see pyproject.toml).
NEEDS_FREE_BYTES = 1 << 30


def pytest_sessionstart(session):
    """Stop at once, with one line, when the temporary directory's disk is nearly full: otherwise
    every test that writes fails on its own with "No space left on device"."""
    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free
    if free < NEEDS_FREE_BYTES:
        pytest.exit(f"only {free >> 20} MB free on the disk of {tmp}; the tests need about {NEEDS_FREE_BYTES >> 30} GB "
                    "there. Free some space (old pytest-of-* folders, for one) or set TMPDIR to another disk.",
                    returncode=4)


# What one test worker may hold at its peak (8 fake devices, plus the runs some tests start).
WORKER_BYTES = 3 << 30


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (README's test command): a worker per core this process may use, no more than the
    host's free memory holds at WORKER_BYTES each. PYTEST_XDIST_AUTO_NUM_WORKERS overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    from tessera.memory_fit import host_room

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    room = host_room()
    return max(1, min(cores, room[0] // WORKER_BYTES if room else cores))


# An entry script (train.py, decode.py) held for up to a minute just before it calls a function of Tessera's
# (tessera.step.setup, which builds the mesh; tessera.step.compile_step; tessera.generation.generate;
# tessera.checkpointing.checksums.record, on Orbax's thread before a save is committed), in a Python sleep,
# where a signal's handler runs at once (a hold on another thread leaves the main thread free for it; a signal
# that one of XLA's threads took wakes the main thread through tools.cli_signals' nudge, as in a real run). A test
# of a signal during start-up sends it once HELD_LINE is out: from the config line to the first step took
# under 2 s on a fast host, and a test process that read its line 2.5 s late (a CI run: train_compile's own
# test) signalled a process that had finished.
# Run as `python -c HOLD ...`, then the script and its arguments; train.py's restart with mimalloc runs it
# again (sys.orig_argv). The function is replaced before the script imports it by name. With `when`, only
# the calls made while that file exists are held (a test creates it at the moment it wants the next one held).
HELD_LINE = "held by a test before "
_HOLD = """
import importlib, os, runpy, sys, time
sys.path.insert(0, {src!r})
module = importlib.import_module({module!r})
function = getattr(module, {name!r})
when = {when!r}
def held(*args, **kwargs):
    if when is None or os.path.exists(when):
        print({line!r}, file=sys.stderr, flush=True)
        time.sleep(60)
    return function(*args, **kwargs)
setattr(module, {name!r}, held)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def held_before(cmd: list[str], at: str, when: Path | None = None) -> list[str]:
    """`cmd` (Python, then an entry script and its arguments) held before it calls the function `at`
    ("tessera.step.setup"): it prints HELD_LINE and `at`, then waits. With `when`, only calls made
    while that file exists are held (on whichever thread makes them)."""
    import importlib

    module, name = at.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name)), at
    return [cmd[0], "-c", _HOLD.format(src=str(REPO / "src"), module=module, name=name, line=HELD_LINE + at,
                                       when=None if when is None else str(Path(when).resolve())), *cmd[1:]]


def sigterm_after_line(cmd, marker: str, **popen) -> tuple[int, str]:
    """Start `cmd`, wait for a stderr line holding `marker`, send SIGTERM; (exit code, whole stderr)."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            break
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    return proc.returncode, "".join(seen) + rest
