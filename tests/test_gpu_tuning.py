"""GPU tuning keys: they reach JAX's config, XLA_FLAGS and the environment before JAX starts,
a bad value is a config error (exit 2), the GPU recipes' dry runs export the settings their
hardware needs, and the PGLE tools behave as getting_started/GPU_performance.md says."""

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO
from test_recipes import GPU, dry_run, flags, parse
from tessera.config import ConfigError, load_config
from tessera.config.schema import GpuConfig
from tessera.gpu_tuning import PGLE_FLAG, apply_gpu_tuning, effective_settings, write_pgle_profile
from tessera.tools.cli import UsageError

BASE = str(REPO / "configs" / "base.yml")
O1_BUNDLE = ("xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_enable_pipelined_all_gather",
             "xla_gpu_enable_pipelined_reduce_scatter", "xla_gpu_enable_pipelined_all_reduce",
             "xla_gpu_enable_while_loop_double_buffering")

# Loads a config from the command line, applies it as train.py does, then reports what JAX and XLA see.
PROBE = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, {src!r})
if {jax_first}:
    import jax  # as in train.py, where tessera.train imports JAX before main() applies the keys
from tessera.config import load_config
from tessera.gpu_tuning import apply_gpu_tuning
cfg = load_config([{base!r}, *sys.argv[1:]], env={{}})
apply_gpu_tuning(cfg.gpu)
import jax, jax.numpy as jnp
compiled = float(jax.jit(lambda x: x * 2)(jnp.float32(3)))  # XLA parsed XLA_FLAGS and compiled at O1
print(json.dumps({{"level": jax.config.jax_optimization_level, "pgle": jax.config.jax_enable_pgle,
                  "runs": jax.config.jax_pgle_profiling_runs, "xla_flags": os.environ["XLA_FLAGS"],
                  "fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), "compiled": compiled}}))
"""


@pytest.mark.parametrize("jax_first", [True, False], ids=["jax imported first", "jax imported after"])
def test_keys_reach_jax_config_xla_flags_and_the_environment(tmp_path, jax_first):
    profile = tmp_path / "pgle.pb"
    profile.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_OPTIMIZATION", "JAX_ENABLE_PGLE", "JAX_PGLE"))}
    env.update(JAX_PLATFORMS="cpu", XLA_PYTHON_CLIENT_MEM_FRACTION="0.3",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {PGLE_FLAG}=/stale/profile.pb")
    script = PROBE.format(src=str(REPO / "src"), base=BASE, jax_first=jax_first)
    proc = subprocess.run([sys.executable, "-c", script, "optimization_level=O1", "enable_pgle=true",
                           "pgle_profiling_runs=2", f"pgle_profile_path={profile}",
                           "xla_python_client_mem_fraction=0.8"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert (seen["level"], seen["pgle"], seen["runs"], seen["compiled"]) == ("O1", True, 2, 6.0)
    assert seen["xla_flags"].split() == ["--xla_force_host_platform_device_count=2", f"{PGLE_FLAG}={profile}"]
    assert seen["fraction"] == "0.8"  # the key wins over the variable exported before
    assert "gpu tuning: optimization_level=O1, enable_pgle=true, pgle_profiling_runs=2" in proc.stderr


def test_defaults_change_nothing_and_the_environment_still_counts():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d", "JAX_OPTIMIZATION_LEVEL": "O1"}
    before = dict(environ)
    settings = apply_gpu_tuning(GpuConfig(), environ)
    assert environ == before
    assert settings == {"optimization_level": "O1", "enable_pgle": "false", "pgle_profiling_runs": "-",
                        "pgle_profile_path": "-", "xla_python_client_mem_fraction": "default (0.75)"}
    level = GpuConfig(optimization_level="O0")
    assert effective_settings(level, environ)["optimization_level"] == "O0"  # a key that is set wins


@pytest.mark.parametrize("argument, message", [
    ("optimization_level=O2", "optimization_level='O2' is not allowed; choose one of: '', 'O0', 'O1'"),
    ("pgle_profiling_runs=0", "pgle_profiling_runs='0' is too small; it must be >= 1"),
    ("xla_python_client_mem_fraction=-0.1", "xla_python_client_mem_fraction='-0.1' is too small"),
    ("xla_python_client_mem_fraction=1.5", "xla_python_client_mem_fraction=1.5 must be in (0, 1]"),
    ("pgle_profile_path=no/such/profile.pb", "pgle_profile_path='no/such/profile.pb' does not exist"),
])
def test_a_bad_value_names_the_key(argument, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config([BASE, argument], env={})


def test_a_trace_or_a_folder_without_a_profile_is_refused_as_pgle_profile_path(tmp_path):
    """The trace folder of step 1 of the PGLE workflow (step 2 skipped) was taken: XLA looks in a folder only for
    <fingerprint>.pb or .pbtxt, so it found no profile and scheduled without one, and no line said so."""
    run = tmp_path / "profile" / "plugins" / "profile" / "2026_11_30"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(b"trace")
    (tmp_path / "empty").mkdir()
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "0123abcd.pb").write_bytes(b"")
    for path, why in [(tmp_path / "profile", "is a trace folder (profiler=xplane's), not a profile"),
                      (run, "is a trace folder (profiler=xplane's), not a profile"),
                      (run / "host.xplane.pb", "is a trace (profiler=xplane's), not a profile"),
                      (tmp_path / "empty", "is a folder without a profile (.pb or .pbtxt file)")]:
        with pytest.raises(ConfigError, match=re.escape(f"pgle_profile_path='{path}' {why}: XLA would read no usable "
                                                        "profile from it") + ".*python -m tessera.gpu_tuning"):
            load_config([BASE, f"pgle_profile_path={path}"], env={})
    assert load_config([BASE, f"pgle_profile_path={tmp_path / 'profiles'}"], env={}).gpu.pgle_profile_path


def test_a_bad_value_stops_train_py_with_exit_code_2():
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), BASE, "xla_python_client_mem_fraction=2"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2
    assert "config error: xla_python_client_mem_fraction=2 must be in (0, 1]" in proc.stderr
    assert "(from the command line)" in proc.stderr and "Traceback" not in proc.stderr


def test_settings_that_would_come_too_late_are_refused():
    jax.devices()  # the backends are up in this process
    environ = {}
    with pytest.raises(RuntimeError, match="before any device use"):
        apply_gpu_tuning(GpuConfig(xla_python_client_mem_fraction=0.9), environ)
    assert environ == {}


def test_pgle_without_the_latency_hiding_scheduler_warns(tmp_path, caplog, monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)  # as in train.py: not started yet
    profile = tmp_path / "p.pb"
    profile.write_bytes(b"")
    gpu = GpuConfig(pgle_profile_path=str(profile))
    with caplog.at_level(logging.INFO, logger="tessera"):
        apply_gpu_tuning(gpu, {"XLA_FLAGS": ""})
    assert "the profile is not used" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        apply_gpu_tuning(gpu, {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true"})
    assert "not used" not in caplog.text and f"pgle_profile_path={profile}" in caplog.text


def test_a_variable_a_key_replaces_is_named(tmp_path, caplog, monkeypatch):
    """The GPU recipes set optimization_level and xla_python_client_mem_fraction as keys, so
    `bash <recipe> XLA_PYTHON_CLIENT_MEM_FRACTION=0.95` exported a variable the key then overrode without a word."""
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    profile = tmp_path / "p.pb"
    profile.write_bytes(b"")
    environ = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", "JAX_OPTIMIZATION_LEVEL": "O1",
               "XLA_FLAGS": f"{PGLE_FLAG}=/old/p.pb"}
    with caplog.at_level(logging.INFO, logger="tessera"):
        apply_gpu_tuning(GpuConfig(optimization_level="O1", xla_python_client_mem_fraction=0.9,
                                   pgle_profile_path=str(profile)), environ)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "gpu tuning: xla_python_client_mem_fraction=0.9 replaces XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 of the "
        "environment (a key wins); to use 0.95, give xla_python_client_mem_fraction=0.95",
        f"gpu tuning: pgle_profile_path={profile} replaces {PGLE_FLAG}=/old/p.pb of XLA_FLAGS (a key wins)"]
    assert environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):  # the same values (0.90 is 0.9): nothing to say
        apply_gpu_tuning(GpuConfig(xla_python_client_mem_fraction=0.9), {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90"})
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_automatic_pgle_skips_ahead_of_time_compiled_functions():
    """Why GPU_performance.md sends the train step (compiled with jit(...).lower().compile()) to
    pgle_profile_path: JAX's automatic PGLE profiles only functions called through jit."""
    from jax._src import config, pjit

    x = jax.device_put(np.ones((4, 4), np.float32), jax.devices()[0])
    with config.enable_pgle(True), config.pgle_profiling_runs(1), pytest.warns(RuntimeWarning, match="empty trace"):
        before = len(pjit._pgle_profiler_dict)
        compiled = jax.jit(lambda a: a @ a + 1).lower(x).compile()
        for _ in range(2):
            compiled(x)
        after_aot = len(pjit._pgle_profiler_dict)
        jitted = jax.jit(lambda a: a @ a - 1)
        for _ in range(2):
            jitted(x)
    assert after_aot == before and len(pjit._pgle_profiler_dict) == before + 1


def test_pgle_profile_tool_answers_help_without_jax():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "tessera.gpu_tuning", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0 and proc.stdout.startswith("usage: .venv/bin/python -m tessera.gpu_tuning TRACE_FOLDER")
    assert "getting_started/GPU_performance.md" in proc.stdout
    assert not any(line.rstrip().endswith("| jax") for line in proc.stderr.splitlines())


def test_pgle_profile_tool_needs_a_gpu_trace(tmp_path):
    with pytest.raises(UsageError, match="no trace"):
        write_pgle_profile(str(tmp_path), str(tmp_path / "p.pb"))
    f = jax.jit(lambda a: a * 2)
    f(jnp.ones(4)).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "profile")):
        f(jnp.ones(4)).block_until_ready()
    with pytest.raises(UsageError, match="holds no GPU kernel times"):  # a CPU trace has no kernel times
        write_pgle_profile(str(tmp_path / "profile"), str(tmp_path / "p.pb"))
    assert not (tmp_path / "p.pb").exists()


def test_pgle_profile_tool_names_the_folder_of_one_process_of_a_multi_process_trace(tmp_path):
    """Each process of a multi-process run traces into profile/process_<i>: the run's profile folder was 'no trace'."""
    for i in (0, 1):
        run = tmp_path / "profile" / f"process_{i}" / "plugins" / "profile" / "2026_11_30"
        run.mkdir(parents=True)
        (run / "host.xplane.pb").write_bytes(b"")
    with pytest.raises(UsageError, match=re.escape(f"{tmp_path / 'profile'} holds the traces of a multi-process run, "
                                                   f"one folder per process; give one of them, e.g. "
                                                   f"{tmp_path / 'profile' / 'process_0'}")):
        write_pgle_profile(str(tmp_path / "profile"), str(tmp_path / "p.pb"))


def test_pgle_profile_tool_says_a_damaged_trace_or_an_unwritable_profile_in_one_line(tmp_path, monkeypatch, capsys):
    """A trace cut short ended in a JaxRuntimeError traceback (exit 1), as did a profile path in a missing folder."""
    from jax.experimental import profiler

    from tessera import gpu_tuning

    run = tmp_path / "profile" / "plugins" / "profile" / "2026_01_01"
    run.mkdir(parents=True)
    (run / "host.xplane.pb").write_bytes(b"cut short")
    assert gpu_tuning.main([str(tmp_path / "profile"), str(tmp_path / "p.pb")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the trace in {run} cannot be read (") and "trace the run again" in err
    monkeypatch.setattr(profiler, "get_profiled_instructions_proto", lambda folder: b"profile")
    assert gpu_tuning.main([str(tmp_path / "profile"), str(tmp_path / "none" / "p.pb")]) == 2
    assert (f"error: the profile {tmp_path / 'none' / 'p.pb'} cannot be written: No such file or directory; "
            "give another path") in capsys.readouterr().err


# ---------------------------------------------------------------------------- recipes


def settings(recipe: str) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(exported variables, XLA flags, train.py key=value arguments) of a recipe's dry run."""
    exports, commands = parse(dry_run(recipe).stdout)
    return exports, flags(exports.get("XLA_FLAGS", "")), dict(a.partition("=")[::2] for a in commands[-1][3:])


@pytest.mark.parametrize("recipe", GPU)
def test_gpu_recipes_use_o1_instead_of_its_flags(recipe):
    _, xla, arguments = settings(recipe)
    assert arguments["optimization_level"] == "O1"
    assert not set(O1_BUNDLE) & set(xla), f"{recipe} sets flags that optimization_level=O1 already turns on"
    assert 0 < float(arguments["xla_python_client_mem_fraction"]) <= 0.9


def test_b200_recipe_has_the_blackwell_settings():
    exports, xla, arguments = settings("gpu/b200/llama3.1_8b_1vm")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in exports
    assert xla["xla_gpu_enable_command_buffer"] == "FUSION,CUSTOM_CALL"
    h200_exports, h200_xla, h200_arguments = settings("gpu/h200/llama3.1_8b_1vm")
    assert h200_exports["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and h200_xla["xla_gpu_enable_command_buffer"] == ""
    assert float(arguments["per_device_batch_size"]) > float(h200_arguments["per_device_batch_size"])  # 180 GB
    assert arguments["remat_policy"] == "save_dot_except_mlp"


def test_tensor_parallel_recipe_turns_on_collective_matmul_and_user_buffers():
    exports, xla, arguments = settings("gpu/a3/llama3.1_70b_tp8_4vm")
    assert xla["xla_gpu_multi_streamed_windowed_einsum"] == "true"
    assert xla["xla_gpu_threshold_for_windowed_einsum_mib"] == "0"
    assert xla["xla_gpu_enable_nccl_user_buffers"] == "true"
    assert int(exports["XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB"]) > 0 and exports["NCCL_NVLS_ENABLE"] == "1"
    assert float(arguments["xla_python_client_mem_fraction"]) < 0.9  # room for the user-buffer pool
    assert arguments["ici_tensor_parallelism"] == "8" and exports["NNODES"] == "4"


def test_the_gpu_guide_is_linked():
    guide = "getting_started/GPU_performance.md"
    assert (REPO / guide).is_file()
    assert f"]({guide})" in (REPO / "README.md").read_text()
    assert "](GPU_performance.md)" in (REPO / "getting_started" / "GPU_multi_node.md").read_text()


@pytest.mark.slow
def test_flags_configs_readme_calls_gone_are_rejected_by_xla():
    """configs/README.md names flags of older GPU guides that the installed XLA refuses; keep it true."""
    text = (REPO / "configs" / "README.md").read_text()
    paragraph = text.split("keeps out flags", 1)[1].split("What it cannot check", 1)[0]
    gone = re.findall(r"`(xla_\w+)`", paragraph)
    assert len(gone) >= 6
    for name in gone:
        proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--{name}=true"}, timeout=120)
        assert proc.returncode != 0 and "Unknown flag" in proc.stderr, name


@pytest.mark.parametrize("xla_flags, level, warned", [
    ("--xla_gpu_enable_latency_hiding_scheduler=True", "", False),
    ("--xla_gpu_enable_latency_hiding_scheduler=1", "", False),
    ("--xla_gpu_enable_latency_hiding_scheduler", "", False),
    ("--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_latency_hiding_scheduler=false", "", True),
    ("", "O2", False),
    ("", "O0", True),
])
def test_the_scheduler_check_reads_flags_and_levels_as_xla_and_jax_do(tmp_path, caplog, monkeypatch, xla_flags,
                                                                      level, warned):
    """XLA takes True, 1 or no value for a boolean flag (and the last occurrence), and JAX has levels O2 and O3
    above O1: each was warned about as if the scheduler were off, and the profile unused."""
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    profile = tmp_path / "p.pb"
    profile.write_bytes(b"")
    environ = {"XLA_FLAGS": xla_flags, **({"JAX_OPTIMIZATION_LEVEL": level} if level else {})}
    with caplog.at_level(logging.INFO, logger="tessera"):
        apply_gpu_tuning(GpuConfig(pgle_profile_path=str(profile)), environ)
    assert ("the profile is not used" in caplog.text) == warned


@pytest.mark.parametrize("platforms, said", [("cuda", "no CUDA plugin (jax-cuda12-plugin) is installed"),
                                             ("rocm", "Unable to initialize backend 'rocm'")])
def test_a_platform_jax_cannot_start_is_one_config_error(platforms, said, tmp_path):
    """JAX_PLATFORMS=cuda on a host without the CUDA plugin (a CPU install on a GPU VM, or no GPU) ended in a
    traceback of JAX's (a bare AssertionError for cuda), exit code 1."""
    if platforms == "cuda" and any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        pytest.skip("a CUDA plugin is installed here")
    env = {**os.environ, "JAX_PLATFORMS": platforms, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"),
                           f"base_output_directory={tmp_path}", "run_name=p", "steps=1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"config error: JAX_PLATFORMS={platforms}: JAX cannot start that platform here") \
        and said in line and "tessera.doctor" in line, line
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("entry", ["train", "decode"])
def test_a_runs_settings_end_with_it(tmp_path, monkeypatch, entry):
    """In one Python process (a notebook, a sweep) a run with optimization_level=O1 enable_pgle=true left
    JAX_OPTIMIZATION_LEVEL/JAX_ENABLE_PGLE and JAX's options set: every later run compiled with them, and its
    start-up line named them as its own. With a dump folder in XLA_FLAGS (the A3 recipes') the persistent
    compilation cache stayed off for every later run too. Here the run stops with a config error, after the
    keys were applied; each setting is again what it was before."""
    import tessera.decode
    import tessera.train
    from tessera.platforms import RUN_JAX_OPTIONS

    for name in ("JAX_OPTIMIZATION_LEVEL", "JAX_ENABLE_PGLE", "JAX_PGLE_PROFILING_RUNS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ['XLA_FLAGS']} --xla_dump_to={tmp_path / 'dump'}")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))  # read by JAX at import only
    before = {name: getattr(jax.config, name) for name in RUN_JAX_OPTIONS}
    keys = ["optimization_level=O1", "enable_pgle=true", "pgle_profiling_runs=2", f"base_output_directory={tmp_path}",
            "run_name=x"]
    if entry == "train":  # a mesh that does not fit the 8 devices
        assert tessera.train.main([BASE, *keys, "ici_fsdp_parallelism=3"]) == 2
    else:
        assert tessera.decode.main([BASE, *keys, f"load_parameters_path={tmp_path / 'none'}", "--tokens", "1,2"]) == 2
    assert {name: getattr(jax.config, name) for name in RUN_JAX_OPTIONS} == before
    assert not {"JAX_OPTIMIZATION_LEVEL", "JAX_ENABLE_PGLE", "JAX_PGLE_PROFILING_RUNS"} & set(os.environ)
    assert os.environ["XLA_FLAGS"].endswith(f"--xla_dump_to={tmp_path / 'dump'}")
