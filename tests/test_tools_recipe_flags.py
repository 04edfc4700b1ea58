"""configs/run_recipe.sh: the caller's compiler flags and variables reach the run.

GPU_performance.md tells a user to force a flag "in XLA_FLAGS" and to try NCCL settings; the
recipes export their own XLA_FLAGS / LIBTPU_INIT_ARGS / NCCL_* after run_recipe.sh has read the
arguments, which used to replace the caller's without a word."""

import os
import shlex
import subprocess

from conftest import REPO


def dry_run(recipe: str, *args: str, env: dict | None = None) -> dict[str, str]:
    """The variables a recipe's dry run exports."""
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **(env or {})}
    proc = subprocess.run(["bash", str(REPO / "configs" / f"{recipe}.sh"), "DRY_RUN=1", "RUN_NAME=t", *args],
                          capture_output=True, text=True, env=clean, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    exports = {}
    for line in proc.stdout.splitlines():
        if line.startswith("export "):
            name, _, value = shlex.split(line)[1].partition("=")
            exports[name] = value
    return exports


def test_callers_xla_flags_go_after_the_recipes_own():
    own = dry_run("gpu/a3/llama_2_7B/1vm")["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_command_buffer=" in own
    for how in ({"args": ["XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION --xla_gpu_enable_latency_hiding_scheduler=true"]},
                {"env": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION --xla_gpu_enable_latency_hiding_scheduler=true"}}):
        flags = dry_run("gpu/a3/llama_2_7B/1vm", *how.get("args", []), env=how.get("env"))["XLA_FLAGS"].split()
        assert flags == [*own, "--xla_gpu_enable_command_buffer=FUSION", "--xla_gpu_enable_latency_hiding_scheduler=true"]


def test_callers_libtpu_flags_go_after_the_recipes_own_and_are_kept_where_the_recipe_sets_none():
    own = dry_run("tpu/v5e/16b")["LIBTPU_INIT_ARGS"].split()
    got = dry_run("tpu/v5e/16b", "LIBTPU_INIT_ARGS=--xla_enable_async_all_gather=false")
    assert got["LIBTPU_INIT_ARGS"].split() == [*own, "--xla_enable_async_all_gather=false"]
    # an argument replaces the environment's value, as `export` would
    got = dry_run("tpu/v5e/16b", "LIBTPU_INIT_ARGS=--b=1", env={"LIBTPU_INIT_ARGS": "--a=1"})
    assert got["LIBTPU_INIT_ARGS"].split() == [*own, "--b=1"]
    # a TPU recipe sets no XLA_FLAGS: the caller's stay exactly as they were
    assert dry_run("tpu/v5e/16b", env={"XLA_FLAGS": "--xla_dump_to=/tmp/d"})["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"


def test_variable_arguments_replace_the_recipes_exports():
    default = dry_run("gpu/a3/llama_2_7B/1vm")
    assert default["NCCL_PROTO"] == "SIMPLE,LL,LL128" and default["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    got = dry_run("gpu/a3/llama_2_7B/1vm", "NCCL_PROTO=SIMPLE", "CUDA_DEVICE_MAX_CONNECTIONS=8")
    assert got["NCCL_PROTO"] == "SIMPLE" and got["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    # the recipe's own settings stay the recipe's: its VM count (another one is refused, exit 2:
    # test_recipes.test_a_node_count_other_than_the_gpu_recipes_is_refused) and the run name it derives
    got = dry_run("gpu/a3/llama_2_7B/2vm", "NNODES=2", "M_RUN_NAME=other")
    assert got["NNODES"] == "2" and got["M_RUN_NAME"] == "t"


def test_every_recipe_started_with_sh_runs_as_with_bash():
    """`sh recipe.sh` started a POSIX shell (dash on Debian): "Bad substitution", "source: not found", exit 127.
    Each recipe now runs itself again under bash, so both print the same dry run."""
    recipes = sorted(p for p in (REPO / "configs").rglob("*.sh") if p.name != "run_recipe.sh")
    assert len(recipes) > 30
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    for recipe in recipes:
        runs = [subprocess.run([shell, str(recipe), "DRY_RUN=1", "RUN_NAME=t"], capture_output=True, text=True,
                               env=clean, cwd="/", timeout=60) for shell in ("sh", "bash")]
        assert runs[0].returncode == runs[1].returncode == 0, (recipe, runs[0].stderr)
        assert runs[0].stdout == runs[1].stdout and "train.py" in runs[0].stdout, recipe


def test_a_dry_run_prints_every_variable_given_as_an_argument():
    """TPU_STDERR_LOG_LEVEL=0 as an argument (or from the environment) was exported to the run but left out of
    the environment a dry run prints: of the families an argument may set, TPU_* was not listed."""
    got = dry_run("tpu/v5p/128b", "TPU_STDERR_LOG_LEVEL=0", "PLATFORM=gke")
    assert got["TPU_STDERR_LOG_LEVEL"] == "0"
    assert dry_run("tpu/v5p/128b", env={"TPU_MIN_LOG_LEVEL": "1"})["TPU_MIN_LOG_LEVEL"] == "1"


def test_a_run_name_with_spaces_keeps_the_hlo_dump_in_one_folder():
    """RUN_NAME="my run" made XLA_FLAGS hold --xla_dump_to=/tmp/xla_dump/my run: XLA splits its flags at spaces,
    dumped into /tmp/xla_dump/my (shared with every run named "my ...") and ignored the stray "run"."""
    for recipe in ("gpu/a3/llama_2_7B/1vm", "gpu/a3/llama3.1_70b_tp8_4vm"):
        flags = dry_run(recipe, "RUN_NAME=my run")["XLA_FLAGS"].split()
        assert flags[0] == "--xla_dump_to=/tmp/xla_dump/my_run" and "run" not in flags, (recipe, flags)


def test_callers_flags_on_lines_of_their_own_all_reach_the_run():
    """A multi-line LIBTPU_INIT_ARGS or XLA_FLAGS (`export XLA_FLAGS="` then one flag per line, or a YAML block)
    kept only its first line: the flags after a newline were dropped without a word (all of them after a
    leading newline)."""
    own = dry_run("tpu/v5e/16b")["LIBTPU_INIT_ARGS"].split()
    got = dry_run("tpu/v5e/16b", "LIBTPU_INIT_ARGS=\n  --xla_a=1\n  --xla_b=2\n")
    assert got["LIBTPU_INIT_ARGS"].split() == [*own, "--xla_a=1", "--xla_b=2"]
    got = dry_run("tpu/v5e/16b", env={"XLA_FLAGS": "--xla_dump_to=/tmp/d\n--xla_cpu_enable_fast_math=false"})
    assert got["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_cpu_enable_fast_math=false"
