"""Recipes: every script's dry run exports the flags configs/README.md lists for it (and the
table lists every flag used), builds a config that validates on the recipe's own device count,
and the installed libtpu and XLA accept every flag. Also rto_setup.sh with a fake `ip`."""

import dataclasses
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from fnmatch import fnmatch
from pathlib import Path

import jax
import pytest

from conftest import REPO
from tessera.config import load_config
from tessera.config.schema import GpuConfig
from tessera.hardware import tpu_slice
from tessera.mesh import mesh_shape

REQUIRED = [
    "tpu/v4/22b", "tpu/v4/52b",
    *(f"tpu/v5e/{n}" for n in ("16b", "32b", "64b", "128b", "llama2_7b", "llama2_13b", "llama2_70b", "gpt3_175b")),
    *(f"tpu/v5p/{n}" for n in ("32b", "64b", "128b", "256b", "512b", "1024b", "llama2_7b", "llama2_70b", "gpt3_175b")),
    *(f"tpu/v6e/{n}" for n in ("llama2_7b_4096", "llama3.1_8b", "mixtral_8x7b", "gemma2_9b", "gemma2_27b", "gpt3_175b")),
    *(f"gpu/a3/llama_2_7B/{n}vm" for n in (1, 2, 4, 8, 16)),
    "gpu/h100/llama3.2_3b_1gpu", "gpu/h200/llama3.1_8b_1vm", "gpu/b200/llama3.1_8b_1vm", "gpu/a3/llama3.1_70b_tp8_4vm",
]
RECIPES = sorted(str(p.relative_to(REPO / "configs"))[:-3] for p in (REPO / "configs").glob("*/**/*.sh"))
TPU = [r for r in RECIPES if r.startswith("tpu/")]
GPU = [r for r in RECIPES if r.startswith("gpu/")]
GPU_KEYS = {f.name for f in dataclasses.fields(GpuConfig)}  # config keys that configs/README.md tabulates too


def dry_run(recipe: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **(env or {})}
    return subprocess.run(["bash", str(REPO / "configs" / f"{recipe}.sh"), "DRY_RUN=1", "RUN_NAME=testrun", *args],
                          capture_output=True, text=True, env=clean, cwd="/", timeout=60)


def parse(out: str) -> tuple[dict[str, str], list[list[str]]]:
    """(exported variables, commands) from a dry run's output."""
    exports, commands = {}, []
    for line in out.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        words = shlex.split(line)
        if words[0] == "export":
            name, _, value = words[1].partition("=")
            exports[name] = value
        else:
            commands.append(words)
    return exports, commands


def flags(value: str) -> dict[str, str]:
    return dict(f.removeprefix("--").partition("=")[::2] for f in value.split())


def test_every_recipe_of_the_issue_exists():
    assert set(REQUIRED) <= set(RECIPES)


@pytest.mark.parametrize("recipe", TPU)
def test_tpu_recipes_take_their_flags_from_the_generation_include(recipe):
    """One LIBTPU_INIT_ARGS block per generation (configs/tpu/<gen>/flags.inc), none in a recipe."""
    text = (REPO / "configs" / f"{recipe}.sh").read_text()
    assert "LIBTPU_INIT_ARGS=" not in text
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"' in text
    include = REPO / "configs" / recipe.rsplit("/", 1)[0] / "flags.inc"
    assert include.read_text().count("export LIBTPU_INIT_ARGS=") == 1
    exports, _ = parse(dry_run(recipe).stdout)
    declared = re.search(r'LIBTPU_INIT_ARGS="([^"]*)"', include.read_text()).group(1).replace("\\\n", " ")
    assert flags(exports["LIBTPU_INIT_ARGS"]) == flags(declared) != {}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_header_and_dry_run_build_a_valid_config(recipe):
    text = (REPO / "configs" / f"{recipe}.sh").read_text()
    assert text.startswith("#!/usr/bin/env bash\n# Recipe: ") and "\nset -e\n" in text
    assert f"bash configs/{recipe}.sh " in text  # an example command in the header
    proc = dry_run(recipe, "PLATFORM=gce", "steps=7")
    assert proc.returncode == 0, proc.stderr
    exports, commands = parse(proc.stdout)
    assert exports["M_RUN_NAME"] == "testrun"
    *setup, train = commands
    assert train[1:3] == ["train.py", "configs/base.yml"] and train[-1] == "steps=7"  # user overrides come last
    cfg = load_config([str(REPO / "configs" / "base.yml"), *train[3:]], env={"M_RUN_NAME": exports["M_RUN_NAME"]})
    assert cfg.run.run_name == "testrun" and cfg.run.steps == 7
    if recipe.startswith("tpu/"):
        assert setup in ([["bash", "rto_setup.sh"]], [["sudo", "bash", "rto_setup.sh"]])
        assert cfg.model.dtype == "bfloat16" and "LIBTPU_INIT_ARGS" in exports
        devices = tpu_slice(topology(recipe)).chips * slices(recipe)
    else:
        assert setup == [] and "XLA_FLAGS" in exports
        devices = 8 * int(exports["NNODES"]) if "NNODES" in exports else 1
    mesh_shape(cfg.mesh, devices, slices(recipe))  # the mesh fits the recipe's hardware (raises otherwise)


def topology(recipe: str) -> str:
    text = (REPO / "configs" / f"{recipe}.sh").read_text()
    return re.search(r"^run_recipe (\S+)", text, re.M).group(1)


def slices(recipe: str) -> int:
    """The slices a recipe is made for: its NUM_SLICES default (1 when it sets none)."""
    found = re.search(r"^NUM_SLICES=\$\{NUM_SLICES:-(\d+)\}", (REPO / "configs" / f"{recipe}.sh").read_text(), re.M)
    return int(found.group(1)) if found else 1


@pytest.mark.parametrize("recipe", TPU)
def test_train_compile_and_gke_dry_runs(recipe):
    exports, commands = parse(dry_run(recipe, "EXECUTABLE=train_compile", "NUM_SLICES=2").stdout)
    assert len(commands) == 1  # no rto_setup.sh for a compile
    assert commands[0][1:4] == ["-m", "tessera.train_compile", "configs/base.yml"]
    assert commands[0][-2:] == [f"compile_topology={topology(recipe)}", "compile_topology_num_slices=2"]
    _, commands = parse(dry_run(recipe, "PLATFORM=gke").stdout)
    assert len(commands) == 1 and commands[0][1] == "train.py"


def readme_rows() -> list[tuple[str, set[str], list[str]]]:
    """(name, allowed values, recipe patterns) for each row of the two tables in configs/README.md."""
    rows = []
    for line in (REPO / "configs" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        values = set(re.findall(r"`([^`]*)`", cells[1])) if cells[1] != "(empty)" else {""}
        rows.append((cells[0].strip("`"), values, re.findall(r"`([^`]+)`", cells[3])))
    return rows


def recipe_settings() -> dict[str, dict[str, str]]:
    """recipe -> {flag, variable or GPU config key: value} as its dry run exports them or passes them to train.py."""
    out = {}
    for recipe in RECIPES:
        exports, commands = parse(dry_run(recipe).stdout)
        settings = {k: v for k, v in exports.items() if k not in ("M_RUN_NAME", "LIBTPU_INIT_ARGS", "XLA_FLAGS")}
        for var in ("LIBTPU_INIT_ARGS", "XLA_FLAGS"):
            settings.update(flags(exports.get(var, "")))
        arguments = dict(a.partition("=")[::2] for a in commands[-1][3:])
        settings.update({k: v for k, v in arguments.items() if k in GPU_KEYS})
        out[recipe] = settings
    return out


def test_flag_table_matches_the_recipes_both_ways():
    rows, used = readme_rows(), recipe_settings()
    assert len(rows) > 25
    for recipe, settings in used.items():
        for name, value in settings.items():
            value = value.replace("testrun", "$RUN_NAME")
            matching = [r for r in rows if r[0] == name and any(fnmatch(recipe, p) for p in r[2])]
            assert matching, f"{recipe} sets {name}, but no row of configs/README.md lists {recipe} for it"
            assert any(value in r[1] for r in matching), f"{recipe}: {name}={value}, README: {matching}"
    for name, values, patterns in rows:
        for p in patterns:
            users = [r for r in RECIPES if fnmatch(r, p)]
            assert users, f"configs/README.md: pattern {p} of {name} matches no recipe"
            wrong = [r for r in users if used[r].get(name, "<unset>").replace("testrun", "$RUN_NAME") not in values]
            assert not wrong, f"configs/README.md says {wrong} set {name} to {values}, but they do not"


def distinct(var: str) -> list[str]:
    return sorted({parse(dry_run(r).stdout)[0].get(var, "") for r in RECIPES} - {""})


def test_libtpu_accepts_every_tpu_flag_and_rejects_a_wrong_one():
    probe = ("from jax.experimental import topologies; "
             "topologies.get_topology_desc(topology_name='v5e:2x2', platform='tpu')")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_WORKER_HOSTNAMES": "localhost",
           "TPU_ACCELERATOR_TYPE": "v5litepod-4"}
    for value in [*distinct("LIBTPU_INIT_ARGS"), "--xla_tpu_no_such_flag=true"]:
        proc = subprocess.run([sys.executable, "-c", probe], env={**env, "LIBTPU_INIT_ARGS": value},
                              capture_output=True, text=True, timeout=120)
        accepted = proc.returncode == 0
        assert accepted == ("no_such" not in value), f"LIBTPU_INIT_ARGS={value}: {proc.stderr[-500:]}"


def test_xla_accepts_every_gpu_flag_and_rejects_a_wrong_one():
    probe = "import jax; jax.devices()"
    for value in [*distinct("XLA_FLAGS"), "--xla_gpu_no_such_flag=true"]:
        proc = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "JAX_PLATFORMS": "cpu",
                              "XLA_FLAGS": value}, capture_output=True, text=True, timeout=120)
        assert (proc.returncode == 0) == ("no_such" not in value), f"XLA_FLAGS={value}: {proc.stderr[-500:]}"


def test_default_run_name_is_the_same_on_every_worker():
    clean = {"PATH": os.environ["PATH"]}
    names = {subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "DRY_RUN=1"], env=clean,
                            capture_output=True, text=True, timeout=60).stdout.count("M_RUN_NAME=v5p_128b")
             for _ in range(2)}
    assert names == {1}


def test_recipe_arguments_are_checked():
    proc = dry_run("tpu/v5e/16b", "oops")
    assert proc.returncode == 2 and "'oops' is not KEY=VALUE" in proc.stderr
    assert dry_run("tpu/v5e/16b", "PLATFORM=aws").returncode == 2
    assert "EXECUTABLE=bogus is not train or train_compile" in dry_run("tpu/v5e/16b", "EXECUTABLE=bogus").stderr
    gpu_compile = dry_run("gpu/h100/llama3.2_3b_1gpu", "EXECUTABLE=train_compile")
    assert gpu_compile.returncode == 2 and "GPU recipes run EXECUTABLE=train" in gpu_compile.stderr
    with_data = dry_run("tpu/v5e/16b", "DATASET_PATH=gs://b/data", "dataset_name=c4/en:3.1.0")
    _, commands = parse(with_data.stdout)
    cfg = load_config([str(REPO / "configs" / "base.yml"), *commands[-1][3:]], env={})
    assert (cfg.data.dataset_type, cfg.data.dataset_path, cfg.data.dataset_name) == ("tfds", "gs://b/data",
                                                                                     "c4/en:3.1.0")




def test_recipe_help_prints_its_header_and_the_settings():
    """`bash <recipe> --help` was refused as "not KEY=VALUE" (exit code 2)."""
    for flag in ("--help", "-h"):
        proc = dry_run("tpu/v5e/16b", flag)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.startswith("Recipe: ")
        assert "bash configs/tpu/v5e/16b.sh EXECUTABLE=train_compile" in proc.stdout
        assert "RUN_NAME=name" in proc.stdout and "NUM_SLICES=n" in proc.stdout
        assert not [line for line in proc.stdout.splitlines() if line.startswith("#")]

def test_run_name_and_compile_topology_given_as_arguments_win():
    """run_name=... lost to the M_RUN_NAME the recipe exports (an M_RUN_NAME=... argument too, without a word),
    and compile_topology=... (or compile_topology_num_slices=...) to the recipe's own, which came after it."""
    exports, commands = parse(dry_run("tpu/v4/22b", "run_name=mine").stdout)
    cfg = load_config([str(REPO / "configs" / "base.yml"), *commands[-1][3:]],
                      env={"M_RUN_NAME": exports["M_RUN_NAME"]})
    assert cfg.run.run_name == "mine"
    ignored = dry_run("tpu/v4/22b", "M_RUN_NAME=mine")  # the recipe's own (test_tools_recipe_flags), with a word
    assert "warning: M_RUN_NAME is set from RUN_NAME (default v4_22b); give RUN_NAME=mine" in ignored.stderr
    _, commands = parse(dry_run("tpu/v4/22b", "EXECUTABLE=train_compile", "compile_topology=v4-256",
                                "compile_topology_num_slices=2").stdout)
    cfg = load_config([str(REPO / "configs" / "base.yml"), *commands[-1][4:]], env={})
    assert (cfg.compile.compile_topology, cfg.compile.compile_topology_num_slices) == ("v4-256", 2)


def test_sigterm_sent_to_a_recipe_reaches_its_program(tmp_path):
    """`kill <recipe's pid>` (a scheduler, GKE stopping the pod) ended the recipe's bash with 143 and left
    the program it had started running, orphaned, never told to save: the recipe now execs the program."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\ntrap 'echo TERM > {tmp_path}/got; exit 143' TERM\ntouch {tmp_path}/started\n"
                    "for i in $(seq 200); do sleep 0.1; done\n")
    fake.chmod(0o755)
    proc = subprocess.Popen(["bash", str(REPO / "configs" / "tpu" / "v4" / "22b.sh"), "EXECUTABLE=train_compile",
                             f"PYTHON={fake}"], env={"PATH": os.environ["PATH"]}, cwd="/")
    for _ in range(300):
        if (tmp_path / "started").exists() or proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.terminate()
    assert proc.wait(timeout=30) == 143
    assert (tmp_path / "got").exists()

def test_multi_vm_gpu_recipe_needs_its_coordinator():
    script = str(REPO / "configs" / "gpu" / "a3" / "llama_2_7B" / "2vm.sh")
    proc = subprocess.run(["bash", script, "RUN_NAME=t", "PYTHON=false"], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"]}, timeout=60)
    assert proc.returncode == 2 and "NODE_RANK=<0..1>" in proc.stderr and "JAX_COORDINATOR_IP" in proc.stderr
    if not (REPO / "src" / "tessera" / "distributed.py").is_file():
        proc = subprocess.run(["bash", script, "RUN_NAME=t", "PYTHON=false", "NODE_RANK=1", "JAX_COORDINATOR_IP=10.0.0.2"],
                              capture_output=True, text=True, env={"PATH": os.environ["PATH"]}, timeout=60)
        assert proc.returncode == 2 and "each VM would train alone" in proc.stderr


# ---------------------------------------------------------------------------- rto_setup.sh

ROUTES = "default via 10.128.0.1 dev ens4 proto dhcp src 10.128.0.9 metric 100\n10.128.0.1 dev ens4 proto dhcp scope link\n"


@pytest.fixture
def fake_net(tmp_path):
    """A fake `ip` that keeps its routes in a file and a fake `id`, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "routes").write_text(ROUTES)
    (bin_dir / "ip").write_text(f"""#!/bin/bash
echo "$*" >> {tmp_path}/ip_calls
if [ "$1 $2 $3" = "-4 route show" ]; then cat {tmp_path}/routes; exit 0; fi
if [ "$1 $2" = "route change" ]; then
  shift 2; args="$*"; base="${{args% rto_min *}}"
  grep -v -F -x "$base" {tmp_path}/routes > {tmp_path}/routes.new || true
  echo "$args" >> {tmp_path}/routes.new; mv {tmp_path}/routes.new {tmp_path}/routes; exit 0
fi
exit 1
""")
    (bin_dir / "id").write_text('#!/bin/sh\necho "${FAKE_UID:-0}"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return tmp_path, {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def rto(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "rto_setup.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=60)


def test_rto_setup_changes_each_route_once(fake_net):
    folder, env = fake_net
    first = rto(env)
    assert first.returncode == 0, first.stderr
    changes = [c for c in (folder / "ip_calls").read_text().splitlines() if c.startswith("route change")]
    assert changes == ["route change default via 10.128.0.1 dev ens4 proto dhcp src 10.128.0.9 metric 100 rto_min 5ms",
                       "route change 10.128.0.1 dev ens4 proto dhcp scope link rto_min 5ms"]
    again = rto(env)
    assert again.returncode == 0 and "changed 0 route(s); 2 already had rto_min 5ms" in again.stdout
    assert len([c for c in (folder / "ip_calls").read_text().splitlines() if c.startswith("route change")]) == 2


def test_rto_setup_dry_run_and_root_check(fake_net):
    folder, env = fake_net
    dry = rto({**env, "FAKE_UID": "1000"}, "DRY_RUN=1")
    assert dry.returncode == 0 and dry.stdout.count("would run: ip route change") == 2
    assert "route change" not in (folder / "ip_calls").read_text()
    refused = rto({**env, "FAKE_UID": "1000"})
    assert refused.returncode == 1 and "needs root" in refused.stderr and "sudo bash rto_setup.sh" in refused.stderr
    assert rto(env, "RTO_MIN=fast").returncode == 2


def test_rto_setup_started_with_sh_runs_under_bash(fake_net):
    """`sudo sh rto_setup.sh` stopped at `set -o pipefail` under dash (exit 2), as the recipes once did."""
    folder, env = fake_net
    out = subprocess.run(["sh", str(REPO / "rto_setup.sh"), "DRY_RUN=1"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.count("would run: ip route change") == 2, out.stderr


def test_a_tpu_recipe_in_a_container_says_to_use_platform_gke(fake_net, tmp_path):
    """In a GKE pod (no NET_ADMIN) with PLATFORM left at gce, the run ended with ip's line alone:
    "RTNETLINK answers: Operation not permitted"."""
    folder, env = fake_net
    (folder / "bin" / "ip").write_text(f'#!/bin/bash\nif [ "$1 $2 $3" = "-4 route show" ]; then cat {folder}/routes; '
                                       'exit 0; fi\necho "RTNETLINK answers: Operation not permitted" >&2; exit 2\n')
    out = subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "RUN_NAME=r1"],
                         capture_output=True, text=True, env={**env, "HOME": str(tmp_path), "PYTHON": "/bin/echo"},
                         timeout=60)
    assert out.returncode == 1 and out.stdout == "", out
    assert "Operation not permitted" in out.stderr
    assert "in a container (GKE, xpk) run the recipe with PLATFORM=gke" in out.stderr


def test_rto_min_reaches_rto_setup_through_sudo(fake_net, tmp_path):
    """RTO_MIN=10ms, a recipe setting, was exported to rto_setup.sh, but sudo resets the environment:
    on a TPU VM (not root) the routes got the default 5 ms, without a word."""
    folder, env = fake_net
    bin_dir = folder / "bin"
    (bin_dir / "sudo").write_text('#!/bin/sh\nexec env -i PATH="$PATH" "$@"\n')  # env_reset, as sudo's default
    (bin_dir / "sudo").chmod(0o755)
    out = subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "RTO_MIN=10ms"],  # uid 1000
                         capture_output=True, text=True, timeout=60,  # (root again under sudo: FAKE_UID is reset)
                         env={**env, "FAKE_UID": "1000", "HOME": str(tmp_path), "PYTHON": "/bin/true"})
    assert out.returncode == 0, out.stderr
    changes = [c for c in (folder / "ip_calls").read_text().splitlines() if c.startswith("route change")]
    assert len(changes) == 2 and all(c.endswith(" rto_min 10ms") for c in changes), changes


def test_dry_run_takes_true_and_refuses_other_words(fake_net, tmp_path):
    """DRY_RUN=true or yes ran the recipe for real, route changes included: they are dry runs now, and a
    value that is no yes or no is refused. The dry run names the folder and PYTHONPATH its commands need."""
    folder, env = fake_net
    env = {**env, "HOME": str(tmp_path), "PYTHON": "/bin/echo"}
    for value in ("true", "yes"):
        out = subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), f"DRY_RUN={value}"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith(f"# dry run of {REPO / 'configs' / 'tpu' / 'v5p' / '128b.sh'}"
                                                             f": nothing is executed; the commands below run from "
                                                             f"{REPO} with PYTHONPATH={REPO / 'src'}\n"), out.stdout
        assert rto(env, f"DRY_RUN={value}").stdout.count("would run: ip route change") == 2
    assert "route change" not in (folder / "ip_calls").read_text()
    maybe = subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "DRY_RUN=maybe"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert maybe.returncode == 2 and "DRY_RUN=maybe is not 1 or 0" in maybe.stderr and maybe.stdout == ""
    assert rto(env, "DRY_RUN=maybe").returncode == 2


def test_a_mistyped_recipe_setting_is_warned_about():
    """OUTPUT_DIR=... (for OUTPUT_PATH) or RUNNAME=... was exported and ignored without a word."""
    out = dry_run("tpu/v5p/128b", "OUTPUT_DIR=gs://b/runs", "RUNNAME=x", "RTO_MIN=10ms", "XLA_FLAGS=--a=1")
    assert out.returncode == 0
    warned = [line for line in out.stderr.splitlines() if "is not a recipe setting" in line]
    assert [line.split(": warning: ")[1].split()[0] for line in warned] == ["OUTPUT_DIR", "RUNNAME"], out.stderr
    assert "base_output_directory=outputs" in out.stdout  # what the run would use, as before



def test_the_messages_name_every_setting_and_value_they_accept(fake_net, tmp_path):
    """The mistyped-setting warning listed the recipe settings without RTO_MIN, which --help documents and the
    recipe accepts; DRY_RUN's refusal named 1 and 0 alone, where true, yes, false and no are taken too."""
    out = dry_run("tpu/v5p/128b", "OUTPUT_DIR=gs://b/runs")
    listed = out.stderr.split("is not a recipe setting (", 1)[1].split(")", 1)[0].split(", ")
    helped = re.findall(r"^  ([A-Z_]+)=", dry_run("tpu/v5p/128b", "--help").stdout, flags=re.M)
    assert "RTO_MIN" in helped and set(helped) <= set(listed), (helped, listed)
    _, env = fake_net
    env = {**env, "HOME": str(tmp_path), "PYTHON": "/bin/echo"}
    maybe = subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "DRY_RUN=maybe"],
                           capture_output=True, text=True, env=env, timeout=60)
    for refused in (maybe, rto(env, "DRY_RUN=maybe")):
        assert refused.returncode == 2 and "nor true, yes, false or no" in refused.stderr, refused.stderr


def test_a_python_under_the_home_folder_given_unexpanded_is_found(tmp_path):
    """zsh passes PYTHON=~/venvs/t/bin/python as typed: the recipe said it "is not a program here" (exit 2)."""
    python = tmp_path / "venvs" / "t" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho \"ran $*\"\n")
    python.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "PLATFORM=gke",
                           "PYTHON=~/venvs/t/bin/python", "OUTPUT_PATH=gs://b/runs"], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)}, cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ran train.py configs/base.yml model_name=1b")


def test_a_config_key_in_upper_case_is_refused():
    """STEPS=20 was exported with a warning, and the run trained the recipe's 100 steps."""
    out = dry_run("tpu/v5p/128b", "STEPS=20")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == (f"{REPO}/configs/tpu/v5p/128b.sh: STEPS is not a recipe setting but a config key, which is "
                                  "lower case: give steps=20 (an upper-case argument is only exported to the "
                                  "environment, which the run ignores)")
    assert dry_run("tpu/v5p/128b", "steps=20").returncode == 0


def test_num_slices_for_a_training_run_is_warned_about():
    """NUM_SLICES=2 is read by the AOT compile only; a training run ignored it without a word."""
    train = dry_run("tpu/v5p/128b", "NUM_SLICES=2")
    assert train.returncode == 0 and "warning: NUM_SLICES=2 is read with EXECUTABLE=train_compile only" in train.stderr
    assert "NUM_SLICES" not in dry_run("tpu/v5p/128b", "NUM_SLICES=2", "EXECUTABLE=train_compile").stderr
    assert "NUM_SLICES" not in dry_run("tpu/v5p/llama2_70b_pp2").stderr  # the recipe's own default


def test_a_slice_count_that_is_not_one_or_more_is_refused_by_name():
    """NUM_SLICES=0 or abc with EXECUTABLE=train_compile reached train_compile, whose error named
    compile_topology_num_slices, a key the caller never typed (a dry run printed the command, exit 0)."""
    for bad in ("0", "abc", "2 3"):
        out = dry_run("tpu/v5p/128b", "EXECUTABLE=train_compile", f"NUM_SLICES={bad}")
        assert out.returncode == 2 and out.stdout == "", out
        assert out.stderr.endswith(f"NUM_SLICES={bad} is not a number of slices; give 1 or more, e.g. NUM_SLICES=2\n")
    for good, slices in (("2", "2"), ("-1", "-1")):  # -1: MaxText's one slice, which the config translates
        _, commands = parse(dry_run("tpu/v5p/128b", "EXECUTABLE=train_compile", f"NUM_SLICES={good}").stdout)
        assert commands[0][-1] == f"compile_topology_num_slices={slices}"


def test_a_python_that_is_not_there_is_named():
    """PYTHON=<missing> ended the recipe with bash's "exec: ...: No such file or directory" from a line of
    run_recipe.sh, exit 127, naming no setting."""
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    out = subprocess.run(["bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "PYTHON=no/such/python",
                          "PLATFORM=gke", "OUTPUT_PATH=gs://b/r"], capture_output=True, text=True, env=clean,
                         cwd="/", timeout=60)
    assert out.returncode == 2 and out.stdout == "", out
    assert f"PYTHON=no/such/python is not a program here (a relative path is taken from {REPO})" in out.stderr


def test_a_gke_run_without_a_bucket_is_warned_about():
    """PLATFORM=gke with the default OUTPUT_PATH (outputs, inside the container) ran without a word: each worker
    kept its own checkpoints, and they went with its pod."""
    warning = "is not a gs:// URL: with PLATFORM=gke a local folder is inside the container"
    local = dry_run("tpu/v5p/128b", "PLATFORM=gke")
    assert local.returncode == 0 and f"the run's folder outputs {warning}" in local.stderr
    assert "base_output_directory=outputs" in local.stdout  # a warning: the run is as before
    assert warning in dry_run("tpu/v5p/128b", "PLATFORM=gke", "OUTPUT_PATH=gs://b/r",
                              "base_output_directory=/tmp/r").stderr  # the last one is used
    for quiet in (["OUTPUT_PATH=gs://b/r"], ["base_output_directory=gs://b/r"], ["EXECUTABLE=train_compile"]):
        assert warning not in dry_run("tpu/v5p/128b", "PLATFORM=gke", *quiet).stderr, quiet
    assert warning not in dry_run("tpu/v5p/128b", "PLATFORM=gce").stderr


def test_a_node_count_other_than_the_gpu_recipes_is_refused():
    """NNODES=2 given to a 4-VM recipe (as an argument or from the environment) was replaced by its 4 without a
    word: each process then waited for peers that were never started."""
    expected = ("configs/gpu/a3/llama_2_7B/4vm.sh: NNODES=2, but this recipe is for NNODES=4 VMs (its mesh and batch "
                "are set for them): run it on 4 VMs, or use a recipe for 2 VMs (or leave NNODES out)\n")
    for given in (dict(args=["NNODES=2"]), dict(env={"NNODES": "2"})):
        out = dry_run("gpu/a3/llama_2_7B/4vm", *given.get("args", []), env=given.get("env"))
        assert out.returncode == 2 and out.stderr.endswith(expected.split("configs/", 1)[1]), out.stderr
        assert out.stdout == ""
    assert parse(dry_run("gpu/a3/llama_2_7B/4vm", "NNODES=4").stdout)[0]["NNODES"] == "4"

def test_a_tpu_recipe_without_root_or_sudo_says_what_to_do(tmp_path):
    """A non-root user without sudo got only "sudo: command not found" (exit 127) from a TPU recipe."""
    bin_dir = tmp_path / "bin"  # the few tools the recipe needs, no sudo among them
    bin_dir.mkdir()
    for tool in ("dirname", "basename", "sort"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "id").write_text("#!/bin/sh\necho 1000\n")
    (bin_dir / "id").chmod(0o755)
    out = subprocess.run(["/bin/bash", str(REPO / "configs" / "tpu" / "v5p" / "128b.sh"), "RUN_NAME=x"],
                         capture_output=True, text=True, env={"PATH": str(bin_dir), "HOME": str(tmp_path),
                                                              "PYTHON": "/bin/echo"}, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out
    assert "rto_setup.sh, which needs root, and sudo is not installed: run the recipe as root, or with " \
           "PLATFORM=gke" in out.stderr


# ---------------------------------------------------------------------------- docs

DOCS = [REPO / "README.md", REPO / "configs" / "README.md", *sorted((REPO / "getting_started").glob("*.md")),
        *sorted((REPO / "configs").glob("*/*/README.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_point_only_at_files_that_exist(doc):
    text = doc.read_text()
    for script in re.findall(r"(?<![\w{])(configs/[\w./-]+\.sh)", text):
        if "..." in script:  # a placeholder, as in README's "a recipe (`bash configs/...sh`)"
            continue
        assert (REPO / script).is_file(), f"{doc.name} mentions {script}, which does not exist"
    for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not link.startswith(("http://", "https://")):
            assert (doc.parent / link).exists(), f"{doc.name} links to {link}, which does not exist"


def test_dockerfile_copies_files_that_exist():
    lines = (REPO / "getting_started" / "Dockerfile").read_text().splitlines()
    copies = [line.split()[1:-1] for line in lines if line.startswith("COPY ")]
    assert copies and all((REPO / src.rstrip("/")).exists() for sources in copies for src in sources)
    assert any("bash setup.sh DEVICE=" in line for line in lines)


@pytest.mark.parametrize("device, code", [("tpu", 0), ("gpu", 0), ("cpu", 0), ("xpu", 2), ("TPU", 2)])
def test_the_dockerfile_refuses_a_device_without_a_lock(device, code):
    """A --build-arg DEVICE other than cpu, gpu or tpu failed later as a missing locks/<device>.txt. The
    image's check runs first (the RUN line, as Docker's /bin/sh -c runs it)."""
    lines = (REPO / "getting_started" / "Dockerfile").read_text().splitlines()
    check = next(line[len("RUN "):] for line in lines if line.startswith("RUN case"))
    done = subprocess.run(["sh", "-c", check], env={"DEVICE": device, "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True)
    assert done.returncode == code and (done.stderr == "" if code == 0 else f"DEVICE={device} is not one of" in
                                        done.stderr), done.stderr
    assert all((REPO / f"locks/{d}.txt").is_file() for d in ("cpu", "gpu", "tpu"))


def test_the_docker_build_context_leaves_out_environments_and_runs():
    """The whole context goes to the daemon at each build: .venv (gigabytes of wheels) and outputs/ did."""
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv*", "outputs"} <= set(ignored)


# ---------------------------------------------------------------------------- expected performance

GENERATIONS = sorted({r.split("/")[1] for r in TPU})


def target_rows(readme: Path) -> dict[str, dict[str, str]]:
    """recipe file name -> {column: cell} for the table of a configs/tpu/<gen>/README.md."""
    header, rows = None, {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "recipe":
            header = cells
        elif header and len(cells) == len(header) and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = dict(zip(header, cells))
    return rows


@pytest.mark.parametrize("gen", GENERATIONS)
def test_tpu_readme_targets_follow_from_the_recipes(gen):
    """Each generation's README lists every recipe, and its FLOPs, rates and step times are what
    the recipe's own config gives at the stated MFU (so a changed recipe must update them). The
    stated MFU is tessera.tools.plan's estimate for the recipe's mesh, batch and remat policy: the
    READMEs and the planner make the same assumptions."""
    from tessera.metrics import training_flops_per_step
    from tessera.tools.estimate import parse_hardware
    from tessera.tools.plan import own_candidates

    rows = target_rows(REPO / "configs" / "tpu" / gen / "README.md")
    assert set(rows) == {f"{r.split('/')[-1]}.sh" for r in TPU if r.startswith(f"tpu/{gen}/")}
    for name, row in rows.items():
        recipe = f"tpu/{gen}/{name[:-3]}"
        _, commands = parse(dry_run(recipe, "PLATFORM=gke").stdout)
        cfg = load_config([str(REPO / "configs" / "base.yml"), *commands[-1][3:]], env={})
        s, n = tpu_slice(topology(recipe)), slices(recipe)
        chips = s.chips * n
        length = cfg.data.max_target_length
        flops = training_flops_per_step(cfg.model, 1, length) / length
        mfu = float(row["target MFU"].rstrip("%")) / 100
        planned = own_candidates(cfg, parse_hardware(s.name, n))[cfg.model.remat_policy]
        assert mfu == pytest.approx(planned.mfu, abs=5e-4), (recipe, planned.mfu)
        tokens_per_s = mfu * s.accelerator.peak_flops / flops
        batch = round(cfg.data.per_device_batch_size * chips)
        assert row["slice (chips)"] == (f"{n} x {s.name} ({chips})" if n > 1 else f"{s.name} ({chips})"), recipe
        assert row["global batch"] == f"{batch} x {length}", recipe
        assert float(row["FLOPs per token"]) == pytest.approx(flops, rel=5e-3), recipe
        assert float(row["TFLOP/s per chip"]) == pytest.approx(mfu * s.accelerator.peak_flops / 1e12, abs=0.5)
        assert float(row["tokens/s per chip"].replace(",", "")) == pytest.approx(tokens_per_s, rel=5e-3), recipe
        step = batch * length / (tokens_per_s * chips)
        assert float(row["step time"].removesuffix(" s")) == pytest.approx(step, rel=5e-3, abs=0.006), recipe


GPU_KINDS = {"a3": "NVIDIA H100 80GB HBM3", "h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200", "b200": "NVIDIA B200"}


@pytest.mark.parametrize("system", sorted({r.split("/")[1] for r in GPU}))
def test_gpu_readme_targets_follow_from_the_recipes(system):
    """Each GPU system's README has one row per recipe, and its figures are what the recipe's own
    config, the GPU's peak (tessera.metrics) and the stated MFU give: derived, not measured, so a
    changed recipe must update them."""
    from tessera.hardware import peak_tflops
    from tessera.metrics import training_flops_per_step

    rows = target_rows(REPO / "configs" / "gpu" / system / "README.md")
    recipes = [r for r in GPU if r.startswith(f"gpu/{system}/")]
    assert set(rows) == {f"{r.removeprefix(f'gpu/{system}/')}.sh" for r in recipes}
    peak = peak_tflops(GPU_KINDS[system]) * 1e12
    for name, row in rows.items():
        recipe = f"gpu/{system}/{name[:-3]}"
        exports, commands = parse(dry_run(recipe).stdout)
        cfg = load_config([str(REPO / "configs" / "base.yml"), *commands[-1][3:]], env={})
        gpus = 8 * int(exports.get("NNODES", "0")) or 1
        length = cfg.data.max_target_length
        flops = training_flops_per_step(cfg.model, 1, length) / length
        mfu = float(row["target MFU"].rstrip("%")) / 100
        tokens_per_s = mfu * peak / flops
        batch = round(cfg.data.per_device_batch_size * gpus)
        assert row["GPUs"] == str(gpus) and row["global batch"] == f"{batch} x {length}", recipe
        assert float(row["FLOPs per token"]) == pytest.approx(flops, rel=5e-3), recipe
        assert float(row["TFLOP/s per GPU"]) == pytest.approx(mfu * peak / 1e12, abs=0.5), recipe
        assert float(row["tokens/s per GPU"].replace(",", "")) == pytest.approx(tokens_per_s, rel=5e-3), recipe
        step = batch * length / (tokens_per_s * gpus)
        assert float(row["step time"].removesuffix(" s")) == pytest.approx(step, rel=5e-3, abs=0.006), recipe


@pytest.mark.parametrize("recipe", GPU)
def test_gpu_recipes_fit_their_gpus_by_the_estimate(recipe):
    """The estimator, given a GPU recipe's own config and its GPU (b200 too: the B200 README sized its recipe on an
    h200 entry and quoted a figure the estimator called "does NOT fit"), says it fits in the memory the recipe
    lets JAX take (xla_python_client_mem_fraction)."""
    from tessera.tools.estimate import parse_hardware, report

    exports, commands = parse(dry_run(recipe).stdout)
    cfg = load_config([str(REPO / "configs" / "base.yml"), *commands[-1][3:]], env={})
    gpu = {"a3": "h100"}.get(recipe.split("/")[1], recipe.split("/")[1])
    gpus = 8 * int(exports.get("NNODES", "0")) or 1
    text = report(cfg, parse_hardware(f"{gpu}-{gpus}"), 0.0)
    assert "  -> fits in " in text, (recipe, text)  # against the recipe's fraction, or JAX's default without one


@pytest.mark.parametrize("recipe", TPU)
def test_tpu_recipe_shards_its_parameters_over_the_whole_slice(recipe):
    """Parameters split over every mesh axis but `data` (which holds copies by design): a width
    that no axis divides would fall back to replication and blow HBM up (a 52B model with
    192-way FSDP gathers every weight on every chip). Checked from shapes alone, no compile."""
    from tessera.mesh import logical_spec
    from tessera.models import build_model

    from tessera.config.derived import plan_run

    _, commands = parse(dry_run(recipe, "PLATFORM=gke").stdout)
    cfg = load_config([str(REPO / "configs" / "base.yml"), *commands[-1][3:]], env={})
    n = slices(recipe)
    ici, dcn = mesh_shape(cfg.mesh, tpu_slice(topology(recipe)).chips * n, n)
    ici = {axis: size * dcn[axis] for axis, size in ici.items()}  # the whole mesh
    model = build_model(cfg.model, pipeline=plan_run(cfg, ici).pipeline)
    shapes = jax.tree.leaves(model.param_shapes())
    names = jax.tree.leaves(model.logical_axes(), is_leaf=lambda x: isinstance(x, tuple))
    total = per_device = 0
    for s, n in zip(shapes, names, strict=True):
        spec = logical_spec(n, s.shape, ici)
        split = [math.prod(ici[a] for a in ((p,) if isinstance(p, str) else p)) if p else 1 for p in spec]
        total += math.prod(s.shape)
        per_device += math.prod(d // k for d, k in zip(s.shape, split))
    shards = math.prod(size for axis, size in ici.items() if axis != "data")
    assert per_device <= 1.02 * total / shards, (
        f"{recipe}: {per_device / 1e9:.2f}B parameters per device, but {total / 1e9:.1f}B over {shards} shards "
        f"(mesh {ici}) should be {total / shards / 1e9:.2f}B: some are replicated")
