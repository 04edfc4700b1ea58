"""Validation suite: placeholders refused, every key mapped or reported, real CPU runs pass and fail."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from tessera.tools import validate, validate_commands, validate_file, validate_json, validate_nodes
from tessera.tools.validate import main
from tessera.tools.validate_file import build_plan
from tessera.tools.validate_json import ValidationInputError, load, select
from tessera.tools.validate_commands import node_commands, over_ssh

AMD = sorted((REPO / "configs" / "gpu" / "amd").glob("*.json"))
CPU = str(REPO / "configs" / "cpu" / "validate_tiny.json")


def test_ships_the_four_amd_files_and_an_h100_file():
    assert {p.name for p in AMD} == {"mi300x_singlenode_llama3_1_70b.json", "mi35x_singlenode_llama_3_1_70b.json",
                                     "mi300x_distributed_llama_3_1_405b.json", "mi300x_distributed_llama3_1_70b.json"}
    assert (REPO / "configs" / "gpu" / "nvidia" / "h100_singlenode_llama3_1_8b.json").is_file()


@pytest.mark.parametrize("path", AMD, ids=lambda p: p.name)
def test_placeholders_are_all_listed_and_refused(path):
    with pytest.raises(ValidationInputError) as e:
        load(str(path))
    raw = path.read_text()
    assert f"still has {raw.count('<changeme>')} <changeme>" in str(e.value)
    assert "config.nnodes" in str(e.value)
    proc = subprocess.run([sys.executable, "-m", "tessera.tools.validate", str(path), "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "<changeme>" in proc.stderr and "Traceback" not in proc.stderr


def _filled(path, tmp_path):
    text = re.sub(r'"<changeme>[^"]*"', '"1"', path.read_text())
    out = tmp_path / path.name
    out.write_text(text)
    return str(out)


@pytest.mark.parametrize("path", AMD, ids=lambda p: p.name)
def test_every_key_is_used_or_reported(path, tmp_path):
    data = load(_filled(path, tmp_path))
    name, entry = select(data, multi_node=True, model=None, gpu=None)
    plan = build_plan(data, name, entry)
    xla = plan.env["XLA_FLAGS"]
    for flag, value in entry["xla_flags"].items():
        if flag in validate_file.GONE_XLA_FLAGS:  # the installed XLA refuses it: replaced, and reported
            assert f"--{flag}=" not in xla and f"model_params.{name}.xla_flags.{flag}" in plan.ignored
        else:
            assert f"--{flag}={value}" in xla
    if entry["xla_flags"].get("xla_gpu_graph_level") == "0":  # no GPU graphs, as XLA now says it
        assert "--xla_gpu_enable_command_buffer=" in xla.split()
    fraction = data["config"]["xla_python_client_mem_fraction"]  # a train key: the trainer checks and applies it
    assert plan.overrides["xla_python_client_mem_fraction"] == fraction and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in plan.env
    assert plan.tuning == {"optimization_level": "default", "enable_pgle": "false", "pgle_profiling_runs": "-",
                           "pgle_profile_path": "-", "xla_python_client_mem_fraction": fraction}
    assert plan.env["JAX_COORDINATOR_PORT"] == "1234"
    assert plan.overrides["steps"] == data["config"]["training_steps"]
    assert plan.overrides["base_emb_dim"] == entry["base_emb_dim"]
    assert plan.overrides["mlp_activations"] == '["silu", "linear"]'
    assert "tokenizer_model" in plan.ignored
    if entry.get("precision") == "TE_FP8":  # Transformer Engine's fp8 training -> quantization=fp8 (qwix)
        want = "nanoo_fp8" if plan.name.rsplit(".", 1)[-1].startswith("mi300") else "fp8"  # AMD MI300: fnuz fp8
        assert plan.overrides["quantization"] == want and "precision" not in plan.ignored
    if "nccl_proto" in data["config"]:
        assert plan.env["NCCL_PROTO"] == data["config"]["nccl_proto"]
    accounted = set(plan.overrides) | set(plan.ignored) | {"xla_flags", "result_dict"}
    aliases = {"sequence_length": "max_target_length", "micro_batch_size": "per_device_batch_size",
               "precision": "quantization"}
    for key in entry:
        assert key in accounted or aliases.get(key) in accounted, key
    assert "{user-id}" not in json.dumps(plan.env)


@pytest.mark.parametrize("path", [*AMD, *sorted((REPO / "configs" / "gpu" / "nvidia").glob("*.json"))],
                         ids=lambda p: p.name)
def test_xla_accepts_every_flag_of_the_gpu_validation_files(path, tmp_path):
    """An XLA flag the installed XLA no longer has ends the run at start-up ("Unknown flag in XLA_FLAGS"):
    xla_gpu_graph_level, in the AMD files (kept as AMD publishes them), was removed for
    xla_gpu_enable_command_buffer; the plan replaces it."""
    data = load(_filled(path, tmp_path))
    for multi_node in (False, True):
        try:
            name, entry = select(data, multi_node=multi_node, model=None, gpu=None)
        except ValidationInputError:  # the file has no entry for this node count
            continue
        flags = build_plan(data, name, entry).env["XLA_FLAGS"]
        proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}, timeout=120)
        assert proc.returncode == 0, f"{name}: XLA_FLAGS={flags}: {proc.stderr[-300:]}"


def test_dry_run_prints_each_node(tmp_path, capsys):
    path = _filled(REPO / "configs" / "gpu" / "amd" / "mi300x_distributed_llama3_1_70b.json", tmp_path)
    data = load(path)
    plan = build_plan(data, *select(data, True, None, None))
    commands = node_commands(plan, ["h1", "h2"], "r", engine=None)
    assert [c[0] for c in commands] == ["h1", "h2"]
    assert commands[1][2]["NODE_RANK"] == "1" and commands[1][2]["JAX_COORDINATOR_IP"] == "h1"
    assert commands[1][1][0] == "ssh" and "NODE_RANK=1" in commands[1][1][2]
    assert f" {sys.executable} " in commands[1][1][2] and " python3 " not in commands[1][1][2]
    assert main([path, "--nodes", "h1,h2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# node 1 (h2)" in out and "export NODE_RANK=1" in out
    # the file's precision TE_FP8 runs as quantization=fp8, and the suite says what implements it
    assert "quantization: training matmuls in nanoo_fp8, implemented by qwix " in out  # an MI300X file


@pytest.mark.parametrize("gpu, code", [("cpu", 0), ("cpu-unreachable", 1)])
@pytest.mark.slow
def test_cpu_file_end_to_end(gpu, code, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tessera.tools.validate", CPU, "--gpu", gpu, "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "validation.json").read_text())
    assert result["passed"] is (code == 0)
    checks = {c["check"]: c for c in result["checks"]}
    assert checks["training finished"]["passed"] and checks["tokens_per_sec_per_gpu"]["passed"]
    assert checks["tflops_per_sec_per_gpu"]["passed"] is (code == 0)
    xml = (tmp_path / "validation.xml").read_text()
    assert f'failures="{0 if code == 0 else 1}"' in xml
    assert ("PASS" if code == 0 else "FAIL") in proc.stdout
    assert result["gpu_tuning"]["optimization_level"] == "default" and result["gpu_tuning"]["enable_pgle"] == "false"
    assert result["gpu_tuning"]["xla_python_client_mem_fraction"] == "0.5"  # config.xla_python_client_mem_fraction
    assert '<property name="optimization_level" value="default"/>' in xml
    assert "gpu tuning: optimization_level=default, enable_pgle=false" in proc.stdout


@pytest.mark.slow
def test_sigterm_to_the_suite_stops_its_nodes(tmp_path):
    """A scheduler's SIGTERM to the suite's process alone ended the suite (143, not a word) and left its
    trainer running with no parent. The signal is now passed on to every node, which stops after its
    step, and the suite says so once they have exited."""
    long = json.loads(Path(CPU).read_text())
    long["config"]["training_steps"] = "100000"
    path = tmp_path / "long.json"
    path.write_text(json.dumps(long))
    suite = subprocess.Popen([sys.executable, "-m", "tessera.tools.validate", str(path), "--gpu", "cpu", "--out",
                              str(tmp_path / "out")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    log = tmp_path / "out" / "logs" / "node0.log"
    deadline = time.time() + 300
    while time.time() < deadline and not (log.exists() and "| loss" in log.read_text()):
        time.sleep(0.5)
    assert log.exists() and "| loss" in log.read_text(), suite.stderr.read() if suite.poll() is not None else ""
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == suite.pid]
    assert len(children) == 1
    suite.send_signal(signal.SIGTERM)
    out, err = suite.communicate(timeout=300)
    assert suite.returncode == 143, out[-2000:] + err[-2000:]
    assert "SIGTERM received: passed on to the 1 running node(s)" in err
    assert err.rstrip().endswith(f"stopped by SIGTERM: every node has exited; node logs in {tmp_path / 'out' / 'logs'}")
    assert not Path(f"/proc/{children[0]}").exists()  # the trainer is gone, not orphaned
    assert "SIGTERM" in log.read_text()  # it stopped on the signal, after a step
    result = json.loads((tmp_path / "out" / "validation.json").read_text())
    assert result["checks"][0]["measured"] == "stopped by SIGTERM" and result["passed"] is False


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


FAKE_SSH = f"""#!{sys.executable}
# fake ssh: `ssh HOST COMMAND` records HOST and runs COMMAND here with bash, with a `python3`
# first on PATH that fails: a remote host's bare python3 is not the project's interpreter. Like ssh
# without a terminal, it passes its input on and no signal: a signal ends it, the remote command
# runs on in its own session and its input ends.
import os, subprocess, sys, threading
with open(os.environ["FAKE_SSH_HOSTS"], "a") as f:
    f.write(sys.argv[1] + "\\n")
env = dict(os.environ, PATH=os.environ["FAKE_BIN"] + ":" + os.environ["PATH"])
remote = subprocess.Popen(["bash", "-c", sys.argv[2]], stdin=subprocess.PIPE, env=env, start_new_session=True)
with open(os.environ["FAKE_SSH_HOSTS"] + ".sessions", "a") as f:
    f.write(str(remote.pid) + "\\n")
def pump():
    for line in sys.stdin.buffer:
        remote.stdin.write(line)
        remote.stdin.flush()
    remote.stdin.close()
threading.Thread(target=pump, daemon=True).start()
code = remote.wait()
os._exit(code if code >= 0 else 128 - code)  # not sys.exit: the pump may be reading stdin
"""
TRAP_PYTHON = """#!/bin/sh
echo "bare python3 was run on the remote host" >&2
exit 97
"""


@pytest.mark.slow
def test_remote_nodes_run_the_suites_interpreter(tmp_path):
    env = _fake_ssh_env(tmp_path)
    data = json.loads(open(CPU).read())
    data["config"]["training_steps"] = "3"
    short = tmp_path / "short.json"
    short.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, "-m", "tessera.tools.validate", str(short), "--gpu", "cpu", "--nodes",
                           "fakehost", "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=600)
    log = (tmp_path / "out" / "logs" / "node0.log").read_text()
    assert proc.returncode == 0, proc.stdout[-2000:] + log[-2000:]
    assert (tmp_path / "hosts").read_text().split() == ["fakehost"] and "bare python3" not in log
    assert "step     3 | loss" in log


def _fake_ssh_env(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("python3", TRAP_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_BIN": str(bin_dir),
            "FAKE_SSH_HOSTS": str(tmp_path / "hosts")}


def _processes_in_sessions(sessions: set[int], settle: float = 0.0) -> list[int]:
    """The live processes (not zombies) of `sessions`; with `settle`, waited for up to that many
    seconds to be none (a process that is leaving can outlast its parent's exit by a moment)."""
    deadline = time.time() + settle
    while True:
        found = []
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) in sessions and fields[0] != "Z":
                    found.append(int(pid))
            except (OSError, IndexError, ValueError):
                pass
        if not found or time.time() >= deadline:
            return found
        time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_to_the_suite_stops_its_nodes_over_ssh(tmp_path):
    """ssh without a terminal passes no signal on: the suite's SIGTERM to its ssh processes ended them
    and left every remote trainer running. Now the remote command's relay hears the signal over
    ssh's input and passes it to the trainer, which saves and stops."""
    long = json.loads(Path(CPU).read_text())
    long["config"]["training_steps"] = "100000"
    path = tmp_path / "long.json"
    path.write_text(json.dumps(long))
    out_dir = tmp_path / "out"
    suite = subprocess.Popen([sys.executable, "-m", "tessera.tools.validate", str(path), "--gpu", "cpu", "--nodes",
                              "fakehost", "--out", str(out_dir)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_fake_ssh_env(tmp_path))
    log, sessions = out_dir / "logs" / "node0.log", tmp_path / "hosts.sessions"
    remote = set()  # the "remote" session: the relay and the trainer in it
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (log.exists() and "| loss" in log.read_text()):
            time.sleep(0.5)
        assert log.exists() and "| loss" in log.read_text(), suite.stderr.read() if suite.poll() is not None else ""
        remote = {int(pid) for pid in sessions.read_text().split()}
        assert _processes_in_sessions(remote)  # the trainer (with the relay: bash and the relay too)
        suite.send_signal(signal.SIGTERM)
        out, err = suite.communicate(timeout=300)
        assert suite.returncode == 143, out[-2000:] + err[-2000:]
        assert "SIGTERM received: passed on to the 1 running node(s)" in err
        assert re.search(r"stopped by SIGTERM after step \d+", log.read_text()), log.read_text()[-2000:]
        assert not _processes_in_sessions(remote, settle=10)  # no trainer left running
    finally:
        suite.kill()
        for pid in _processes_in_sessions(remote):
            os.kill(pid, signal.SIGKILL)


def test_a_host_without_the_interpreter_says_so():
    cmd = over_ssh("h1", {"NODE_RANK": "1"}, ["/nowhere/bin/python", "train.py"])
    proc = subprocess.run(["bash", "-c", cmd[2]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "tessera.validate: /nowhere/bin/python is missing on h1" in proc.stderr and "bash setup.sh" in proc.stderr


def test_progress_lines_while_nodes_train(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(validate_nodes, "PROGRESS_SECONDS", 0.1)
    log = tmp_path / "node0.log"
    log.write_text("I attention kernel: dot_product\n10:00:01 I step     3 | loss 5.1 | 0.2 s\n")
    procs = [subprocess.Popen(["sleep", "0.6"]), subprocess.Popen(["sh", "-c", "exit 4"])]
    start = time.monotonic()
    assert validate_nodes.wait_for_nodes(procs, log, "8") == [0, 4]
    assert time.monotonic() - start >= 0.5
    lines = capsys.readouterr().out.splitlines()
    assert lines and re.fullmatch(r"training: 0s elapsed, step 3/8 on node 0, [12] of 2 node\(s\) running", lines[0])
    assert validate_nodes.last_step_logged(tmp_path / "none.log") == 0


def _tuned(tmp_path, **entry_keys):
    """The CPU file with `entry_keys` added to its cpu entry."""
    data = json.loads(open(CPU).read())
    data["model_params"]["single_node"]["default"]["cpu"].update(entry_keys)
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_optimization_level_and_pgle_are_reported(tmp_path, capsys):
    """The settings each run uses go into validation.json, the JUnit properties and the printed lines."""
    profile = tmp_path / "pgle.pb"
    profile.write_bytes(b"")
    path = _tuned(tmp_path, optimization_level="O1", enable_pgle="true", pgle_profiling_runs="2",
                  pgle_profile_path=str(profile))
    data = load(path)
    plan = build_plan(data, *select(data, False, None, "cpu"))
    assert plan.overrides["optimization_level"] == "O1" and plan.overrides["enable_pgle"] == "true"
    assert plan.tuning == {"optimization_level": "O1", "enable_pgle": "true", "pgle_profiling_runs": "2",
                           "pgle_profile_path": str(profile), "xla_python_client_mem_fraction": "0.5"}
    validate.write_results([{"check": "training finished", "target": "0", "measured": "[0]", "passed": True}],
                           plan, tmp_path / "out", 1.0)
    assert json.loads((tmp_path / "out" / "validation.json").read_text())["gpu_tuning"] == plan.tuning
    xml = (tmp_path / "out" / "validation.xml").read_text()
    assert '<property name="optimization_level" value="O1"/>' in xml
    assert '<property name="pgle_profiling_runs" value="2"/>' in xml
    assert main([path, "--gpu", "cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "gpu tuning: optimization_level=O1, enable_pgle=true, pgle_profiling_runs=2" in out
    assert "optimization_level=O1" in out.splitlines()[-1]  # passed to train.py as a key


def test_nodes_run_here_keep_this_environments_xla_flags_and_its_tuning_is_reported(tmp_path, monkeypatch, capsys):
    """A node started here runs with the suite's environment under the file's. Any xla_flags in the file replaced
    this environment's XLA_FLAGS whole (--xla_force_host_platform_device_count=4: the run had 1 device, not 4),
    where a file without one kept them all; and the gpu tuning line (validation.json's gpu_tuning) said
    "xla_python_client_mem_fraction=default (0.75)" for a run that used XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 from
    here. Over ssh and in a container only the file's environment is passed on, as before."""
    data = json.loads(Path(CPU).read_text())
    del data["config"]["xla_python_client_mem_fraction"]
    data["model_params"]["single_node"]["default"]["cpu"]["xla_flags"] = {"xla_cpu_enable_fast_math": "false"}
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    plan = build_plan(load(str(path)), *select(load(str(path)), False, None, "cpu"))
    both = "--xla_force_host_platform_device_count=4 --xla_cpu_enable_fast_math=false"  # the file's last: it wins
    assert node_commands(plan, [], "r", engine=None)[0][2]["XLA_FLAGS"] == both
    assert node_commands(plan, ["h1"], "r", engine=None)[0][2]["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    plan.container["container_image"] = "img"
    assert node_commands(plan, [], "r", engine="docker")[0][2]["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"
    seen = []
    monkeypatch.setattr(validate, "run_nodes", lambda commands, *a, **k: seen.append(commands[0][2]) or [0])
    assert main([str(path), "--gpu", "cpu", "--out", str(tmp_path / "out")]) == 1  # no report.json: no measurements
    assert seen[0]["XLA_FLAGS"] == both
    assert json.loads((tmp_path / "out" / "validation.json").read_text())["gpu_tuning"][
        "xla_python_client_mem_fraction"] == "0.9"
    assert capsys.readouterr().out.count("xla_python_client_mem_fraction=0.9") == 2  # before the run and with the table
    assert main([str(path), "--gpu", "cpu", "--nodes", "h1", "--dry-run"]) == 0  # a remote host's is not this one's
    assert "xla_python_client_mem_fraction=default (0.75)" in capsys.readouterr().out


def test_train_variables_of_this_environment_do_not_reach_the_nodes_run_here(tmp_path, monkeypatch, capsys):
    """train.py reads M_<KEY> over its command line: an M_STEPS=5 left in the shell ran 5 steps where the file
    said 8, without a word, and an M_RUN_NAME put report.json where the suite did not look (the run failed with
    "run the suite on the first host of --nodes", with no --nodes). They are not passed on to a node started here
    (the file's env_dict may set one), and a line says so."""
    data = json.loads(Path(CPU).read_text())
    data["config"]["container_config"]["env_dict"]["M_LOG_PERIOD"] = "2"  # the file's own: passed on
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv("M_STEPS", "5")
    monkeypatch.setenv("M_RUN_NAME", "elsewhere")
    monkeypatch.setenv("M_LOG_PERIOD", "3")
    monkeypatch.setenv("M_NOT_A_KEY", "x")  # not train.py's
    node = [sys.executable, "-c", "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith('M_')}))"]
    monkeypatch.setattr(validate, "node_commands", lambda *a: [("local", node, a[0].env)])
    assert main([str(path), "--gpu", "cpu", "--out", str(tmp_path / "out")]) == 1  # no report.json: no measurements
    assert json.loads((tmp_path / "out" / "logs" / "node0.log").read_text()) == {"M_LOG_PERIOD": "2",
                                                                                 "M_NOT_A_KEY": "x"}
    assert ("not passed on from this environment: M_RUN_NAME=elsewhere, M_STEPS=5 (train.py would read them over "
            "the file's train keys; set train keys in model_params.single_node.default.cpu)") in capsys.readouterr().out


def test_a_run_folder_variable_in_env_dict_is_refused_and_a_local_missing_report_says_where_to_look(
        tmp_path, monkeypatch, capsys):
    """env_dict's M_RUN_NAME (or M_BASE_OUTPUT_DIRECTORY) moved node 0's report.json away from the folder the suite
    reads; the run failed telling a run without --nodes to "run the suite on the first host of --nodes"."""
    data = json.loads(Path(CPU).read_text())
    data["config"]["container_config"]["env_dict"]["M_RUN_NAME"] = "mine"
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 2
    assert ("validation file error: config.container_config.env_dict.M_RUN_NAME=mine would move the run's folder, "
            "where the suite reads node 0's report.json") in capsys.readouterr().err
    monkeypatch.setattr(validate, "run_nodes", lambda commands, log_dir, steps, timeout=0.0: [0])
    assert main([CPU, "--gpu", "cpu", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"the line 'run <name> -> <folder>' of {tmp_path / 'out' / 'logs' / 'node0.log'} says where node 0" in err
    assert "--nodes" not in err


def test_a_bad_gpu_setting_stops_the_suite(tmp_path, capsys):
    assert main([_tuned(tmp_path, xla_python_client_mem_fraction="1.5"), "--gpu", "cpu", "--dry-run"]) == 2
    assert "xla_python_client_mem_fraction=1.5 must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "holds a JSON array at the top; a validation file is an object with config and model_params sections"),
    ('"text"', "holds a JSON string at the top; a validation file is an object"),
])
def test_a_file_that_is_not_a_json_object_is_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "v.json"
    path.write_text(content)
    assert main([str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith(f"validation file error: {path} {message}")


def test_a_file_with_a_byte_order_mark_is_read_and_an_empty_one_is_named(tmp_path, capsys):
    """A file saved with a UTF-8 byte-order mark (Windows editors) was refused as "Unexpected UTF-8 BOM (decode
    using utf-8-sig)"; an empty one was "Expecting value: line 1 column 1 (char 0)"."""
    path = tmp_path / "v.json"
    path.write_bytes(b"\xef\xbb\xbf" + Path(CPU).read_bytes())
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 0
    capsys.readouterr()
    path.write_text(" \n")
    assert main([str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"validation file error: {path} is empty; a validation file is a JSON object "
                                       "with config and model_params sections (configs/cpu/validate_tiny.json is "
                                       "one)\n")


def test_a_folder_given_as_the_file_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"validation file error: {tmp_path} is a folder; give the validation JSON file in it\n"
    assert captured.out == ""


def test_a_section_that_is_not_an_object_is_named(tmp_path, capsys):
    data = json.loads(open(CPU).read())
    data["model_params"]["single_node"]["default"] = ["cpu"]
    path = tmp_path / "nested.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--dry-run"]) == 2
    assert capsys.readouterr().err == ("validation file error: model_params.single_node.default is a JSON array; "
                                       "it must be an object of name: value\n")


def test_a_node_count_that_is_not_one_is_one_line(tmp_path, capsys):
    """config.nnodes (or env_dict's NNODES) that is not a whole number of at least 1: one line,
    exit 2 (a word or a fraction raised a ValueError traceback; 0 or -3 ran one node)."""
    for value in ("two", "2.5", "0", "-3"):
        data = json.loads(open(CPU).read())
        data["config"]["nnodes"] = value
        path = tmp_path / "nodes.json"
        path.write_text(json.dumps(data))
        assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 2, value
        assert capsys.readouterr().err == (f"validation file error: config.nnodes={value!r} is not a number of nodes; "
                                           "give a whole number of at least 1 (or leave it out for one node)\n")


def test_a_train_value_the_trainer_refuses_stops_the_dry_run(tmp_path, capsys):
    """The train keys go through train.py's own config loader before anything is printed or run."""
    data = json.loads(open(CPU).read())
    data["config"]["training_steps"] = "ten"
    path = tmp_path / "ten.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("validation file error: train.py would refuse the train keys of "
                                   "single_node.default.cpu: steps='ten'") and captured.err.count("\n") == 1
    # the file's key, not "(from the command line)": the user wrote none, and steps is training_steps there
    assert captured.err.endswith("(from config.training_steps)\n")
    assert captured.out == ""
    assert main([_tuned(tmp_path, remat_policy="sometimes"), "--gpu", "cpu", "--dry-run"]) == 2
    assert "remat_policy" in capsys.readouterr().err
    assert main([CPU, "--gpu", "cpu", "--dry-run"]) == 0  # the shipped file passes the same check


@pytest.mark.parametrize("key, value, kind", [("xla_flags", [1], "array"), ("xla_flags", "abc", "string"),
                                              ("result_dict", "abc", "string")])
def test_xla_flags_or_result_dict_that_is_not_an_object_is_one_line(key, value, kind, tmp_path, capsys):
    """An array or a string where the entry's xla_flags or result_dict should be an object ended in an
    AttributeError traceback."""
    data = json.loads(open(CPU).read())
    data["model_params"]["single_node"]["default"]["cpu"][key] = value
    path = tmp_path / "typed.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 2
    assert capsys.readouterr().err == (f"validation file error: model_params.single_node.default.cpu.{key} is a "
                                       f"JSON {kind}; it must be an object of name: value\n")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", -5, [1], None, True, "fast"])
def test_a_target_no_run_can_meet_is_refused(value, tmp_path, capsys):
    """nan, infinity, a negative number or no number at all as a target: the dry run accepted nan and the
    negatives (a target that can never be met, or always is) and a list ended in a TypeError traceback."""
    data = json.loads(open(CPU).read())
    data["model_params"]["single_node"]["default"]["cpu"]["result_dict"]["tflops_per_sec_per_gpu"] = value
    path = tmp_path / "target.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"validation file error: result_dict.tflops_per_sec_per_gpu={value!r} is not a target "
                          "a run can meet; give a finite number of at least 0") and err.count("\n") == 1


def test_nodes_says_which_settings_of_the_file_it_replaces(tmp_path, capsys):
    """--nodes decides the node count and the coordinator; the file's own were replaced silently."""
    data = json.loads(open(CPU).read())
    data["config"].update(nnodes="2", coordinator_ip="10")
    data["config"]["container_config"]["env_dict"]["JAX_COORDINATOR_IP"] = "10"
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run", "--nodes", "n1,n2,n3"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("--nodes")] == [
        "--nodes replaces config.nnodes=2 with 3 (n1, n2, n3)",
        "--nodes replaces config.coordinator_ip=10 with n1 (the first host)",
        "--nodes replaces config.container_config.env_dict.JAX_COORDINATOR_IP=10 with n1 (the first host)"]
    assert "export JAX_COORDINATOR_IP=n1" in out and "export NNODES=3" in out
    assert main([CPU, "--gpu", "cpu", "--dry-run", "--nodes", "n1"]) == 0  # the file's 1 node: nothing replaced
    assert "--nodes" not in capsys.readouterr().out
    # one node: the env_dict's job layout is left out (NNODES=2 made the trainer wait for a second node)
    data["config"]["container_config"]["env_dict"]["NNODES"] = "2"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run", "--nodes", "n1"]) == 0
    out = capsys.readouterr().out
    assert ("one node: config.container_config.env_dict JAX_COORDINATOR_IP=10, NNODES=2 not passed on (a one-node "
            "run joins no job)") in out
    assert "NNODES" not in out.split("one node:")[1].split("\n", 1)[1] and "JAX_COORDINATOR_IP=" not in \
        out.split("one node:")[1].split("\n", 1)[1]


@pytest.mark.parametrize("where", ["coordinator_ip", "JAX_COORDINATOR_IP"])
def test_a_coordinator_address_with_a_port_is_refused_by_the_dry_run(tmp_path, capsys, where):
    """"10.0.0.2:1234" as the coordinator: the dry run printed the commands and every trainer then refused the
    address (exit 4 on each node); the file is wrong, and the dry run is where to say so."""
    data = json.loads(open(CPU).read())
    data["config"]["nnodes"] = "2"
    if where == "coordinator_ip":
        data["config"]["coordinator_ip"] = "10.0.0.2:1234"
    else:
        data["config"]["container_config"]["env_dict"]["JAX_COORDINATOR_IP"] = "[fd00::1]:1234"
    path = tmp_path / "port.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 2
    err = capsys.readouterr().err
    field = "config.coordinator_ip=10.0.0.2:1234" if where == "coordinator_ip" else \
        "config.container_config.env_dict.JAX_COORDINATOR_IP=[fd00::1]:1234"
    host = "10.0.0.2" if where == "coordinator_ip" else "[fd00::1]"
    assert err == (f"validation file error: {field} holds a port: give the address alone, {host}, and the port as "
                   "config.container_config.env_dict.JAX_COORDINATOR_PORT=1234\n")
    data["config"]["coordinator_ip"] = "fd00::1"  # a bare IPv6 address has colons and no port: accepted
    data["config"]["container_config"]["env_dict"].pop("JAX_COORDINATOR_IP", None)
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 0


def test_without_nodes_the_files_own_node_settings_that_replace_env_dicts_are_said(tmp_path, capsys):
    """Run here with config.nnodes=2, the env_dict's NNODES=1 and JAX_COORDINATOR_IP=10.1.1.1 were replaced by
    config's 2 and localhost without a word (every key is used or said not to be)."""
    data = json.loads(open(CPU).read())
    data["config"]["nnodes"] = "2"
    data["config"]["container_config"]["env_dict"].update(NNODES="1", JAX_COORDINATOR_IP="10.1.1.1")
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "config.nnodes=2 replaces config.container_config.env_dict.NNODES=1\n" in out
    assert "config.coordinator_ip=localhost replaces config.container_config.env_dict.JAX_COORDINATOR_IP=10.1.1.1\n" \
        in out
    assert "export NNODES=2" in out and "export JAX_COORDINATOR_IP=localhost" in out
    data["config"]["container_config"]["env_dict"].update(NNODES="2", JAX_COORDINATOR_IP="localhost")  # the same
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 0
    assert " replaces " not in capsys.readouterr().out


def test_nodes_run_here_use_a_free_coordinator_port_unless_the_file_sets_one(tmp_path):
    """Every suite running a several-node job here used port 8476: a second one on this host failed (exit 4) and its
    node 1 joined the first suite's job, whose node 0 then aborted (SIGABRT) and whose node 1 waited 300 s."""
    data = json.loads(Path(CPU).read_text())
    data["config"]["nnodes"] = "2"
    path = tmp_path / "v.json"

    def planned():
        path.write_text(json.dumps(data))
        return build_plan(load(str(path)), *select(load(str(path)), False, None, "cpu"))

    plan = planned()
    ports = {c[2]["JAX_COORDINATOR_PORT"] for c in node_commands(plan, [], "r", engine=None)}
    assert len(ports) == 1 and ports != {"8476"}  # the same for both nodes
    other = {c[2]["JAX_COORDINATOR_PORT"] for c in node_commands(plan, [], "r2", engine=None)}
    assert other != ports  # a second suite's job
    with socket.socket() as s:  # free: the coordinator can take it
        s.bind(("", int(ports.pop())))
    assert {c[2]["JAX_COORDINATOR_PORT"] for c in node_commands(plan, ["h1", "h2"], "r", engine=None)} == {"8476"}
    data["config"]["container_config"]["env_dict"]["JAX_COORDINATOR_PORT"] = "1234"  # the file's: kept
    plan = planned()
    assert {c[2]["JAX_COORDINATOR_PORT"] for c in node_commands(plan, [], "r", engine=None)} == {"1234"}


def test_nodes_with_spaces_name_the_hosts_without_them(capsys):
    """`--nodes "n1, n2"` made the second host ' n2' (ssh could not resolve it); `--nodes "n1 n2"` one host."""
    assert main([CPU, "--gpu", "cpu", "--dry-run", "--nodes", "n1, n2"]) == 0
    out = capsys.readouterr().out
    assert "# node 1 (n2)" in out and "--nodes replaces config.nnodes=1 with 2 (n1, n2)" in out
    assert "'ssh', ' n2'" not in out and "ssh n2 " in out
    assert main([CPU, "--gpu", "cpu", "--dry-run", "--nodes", "n1 n2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ("error: --nodes 'n1 n2': a host name has no spaces; separate the "
                                                   "hosts with commas, e.g. --nodes h1,h2\n")


def test_steps_within_the_warm_up_are_refused(tmp_path, capsys):
    """With training_steps <= report_warmup_steps the report's medians fall back to every step, compilation
    included, and the suite checked those against the targets as if they were steady-state speed."""
    assert main([_tuned(tmp_path, report_warmup_steps="8"), "--gpu", "cpu", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "steps=8 is not more than report_warmup_steps=8" in err
    assert "raise config.training_steps above 8 or lower report_warmup_steps" in err
    # steps set in the model entry: that key is named, not config.training_steps (which the file may not have)
    assert main([_tuned(tmp_path, steps="3", report_warmup_steps="8"), "--gpu", "cpu", "--dry-run"]) == 2
    assert "raise model_params.single_node.default.cpu.steps above 8" in capsys.readouterr().err


def test_a_stopped_run_replaces_earlier_results_with_a_failure(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) wrote no results, so an earlier run's validation.json/.xml in the same --out
    still said PASS; a suite killed outright left them too. They are removed before the nodes start, and a
    stopped run writes its own, failed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "validation.json").write_text('{"passed": true}\n')
    (out / "validation.xml").write_text('<testsuite failures="0"/>\n')
    seen = []

    def stopped(commands, log_dir, steps, timeout=0.0):
        seen.append([(out / name).exists() for name in ("validation.json", "validation.xml")])
        raise validate.NodesStopped(signal.SIGINT)

    monkeypatch.setattr(validate, "run_nodes", stopped)
    assert main([CPU, "--gpu", "cpu", "--out", str(out)]) == 130
    assert seen == [[False, False]]
    result = json.loads((out / "validation.json").read_text())
    assert result["passed"] is False and result["name"] == "single_node.default.cpu"
    assert result["checks"][0]["measured"] == "stopped by SIGINT" and not result["checks"][0]["passed"]
    # training finished, no step skipped and the two targets: none measured
    assert 'failures="4"' in (out / "validation.xml").read_text()
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"stopped by SIGINT: every node has exited; node logs in {out / 'logs'}")


def test_a_bucket_as_out_is_refused(tmp_path, monkeypatch, capsys):
    """--out gs://bucket/results wrote the results into the local folder ./gs:/bucket/results, and said so as
    "results in gs:/bucket/results/validation.json"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(validate, "run_nodes", lambda *a, **k: [0])
    assert main([CPU, "--gpu", "cpu", "--out", "gs://bucket/results"]) == 2
    assert capsys.readouterr().err == ("error: --out gs://bucket/results: the suite writes validation.json/.xml and the "
                                       "node logs as local files; give a local folder (and copy it to the bucket "
                                       "afterwards)\n")
    assert not (tmp_path / "gs:").exists()


def test_a_log_dir_that_cannot_be_written_names_the_key(tmp_path, capsys):
    data = json.loads(Path(CPU).read_text())
    (tmp_path / "a_file").write_text("")
    data["config"]["log_dir"] = str(tmp_path / "a_file" / "runs")
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu"]) == 2
    assert (f"{tmp_path / 'a_file'} is a file, not a folder; set config.log_dir in the file, or give --out"
            in capsys.readouterr().err)


def test_an_out_folder_under_a_file_is_refused_naming_the_file_even_in_a_dry_run(tmp_path, monkeypatch, capsys):
    """--out under a file said only "Not a directory" once the nodes' log folder was made, and --dry-run
    printed the commands as if the folder could be written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(validate, "run_nodes", lambda *a, **k: pytest.fail("no node may start"))
    (tmp_path / "a_file").write_text("")
    for dry_run in (["--dry-run"], []):
        assert main([CPU, "--gpu", "cpu", "--out", "a_file/results", *dry_run]) == 2
        assert capsys.readouterr().err == (f"error: --out a_file/results: the results cannot go there: "
                                           f"{tmp_path / 'a_file'} is a file, not a folder; choose another --out\n")


def test_without_nodes_a_file_with_both_modes_runs_its_single_node_entry(tmp_path, capsys):
    """Without --nodes the suite took the first mode of model_params, so a file listing multi_node first
    ran its multi-node entry (dcn_data_parallelism=2) on this one host."""
    path = tmp_path / "both.json"
    path.write_text(json.dumps({"model_params": {"multi_node": {"m": {"g": {"dcn_data_parallelism": "2"}}},
                                                 "single_node": {"m": {"g": {"steps": "5"}}}}}))
    assert main([str(path), "--dry-run"]) == 0
    command = capsys.readouterr().out.splitlines()[-1]
    assert " steps=5 " in command and "dcn_data_parallelism" not in command
    assert select(json.loads(path.read_text()), True, None, None)[0] == "multi_node.m.g"


def test_a_report_that_is_not_json_fails_the_run(tmp_path, monkeypatch, capsys):
    """A report.json cut short (a full disk) ended the suite in a JSONDecodeError traceback."""
    data = json.loads(Path(CPU).read_text())
    data["config"]["log_dir"] = str(tmp_path / "runs")
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))

    def trained(commands, log_dir, steps, timeout=0.0):
        run_name = next(a for a in commands[0][1] if a.startswith("run_name=")).split("=", 1)[1]
        (tmp_path / "runs" / run_name).mkdir(parents=True)
        (tmp_path / "runs" / run_name / "report.json").write_text('{"tokens_per_sec')
        return [0]

    monkeypatch.setattr(validate, "run_nodes", trained)
    assert main([str(path), "--gpu", "cpu", "--out", str(tmp_path / "out")]) == 1
    out, err = capsys.readouterr()
    assert "report.json cannot be read" in err and "no measurements" in err
    assert "FAIL: single_node.default.cpu" in out
    assert json.loads((tmp_path / "out" / "validation.json").read_text())["passed"] is False


@pytest.mark.parametrize("config, entry, where", [
    ({"log_dir": None}, {}, "config.log_dir is a JSON null"),
    ({"nccl_debug": None}, {}, "config.nccl_debug is a JSON null"),
    ({"container_config": {"env_dict": {"A": {"x": 1}}}}, {}, "config.container_config.env_dict.A is a JSON object"),
    ({}, {"tokenizer_path": None}, "model_params.single_node.m.g.tokenizer_path is a JSON null"),
])
def test_a_null_or_object_value_is_refused_not_passed_as_none(config, entry, where, tmp_path, capsys):
    """A JSON null went on as the text "None": base_output_directory=None (a folder named None), NCCL_DEBUG=None."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": config, "model_params": {"single_node": {"m": {"g": entry}}}}))
    assert main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"validation file error: {where}, which has no value to pass on" in err and "None" not in err


def test_a_node_that_fails_is_named_with_the_end_of_its_log(tmp_path, monkeypatch, capsys):
    """A failed training showed only `[2]` and None in the table; the reason was in a log the user had to find."""
    def failed(commands, log_dir, steps, timeout=0.0):
        log_dir.mkdir(parents=True)
        (log_dir / "node0.log").write_text("step 1 | loss 6.0\n"
                                           "config error: dataset_type=grain needs grain_train_files\n")
        return [2]

    monkeypatch.setattr(validate, "run_nodes", failed)
    assert main([CPU, "--gpu", "cpu", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (f"node 0 exited with code 2; the end of {tmp_path / 'logs' / 'node0.log'}: config error: "
            "dataset_type=grain needs grain_train_files") in out


def test_a_node_killed_by_a_signal_says_which(tmp_path, monkeypatch, capsys):
    def killed(commands, log_dir, steps, timeout=0.0):
        log_dir.mkdir(parents=True)
        (log_dir / "node0.log").write_text("step 3 | loss 6.0\n")
        return [-signal.SIGKILL]

    monkeypatch.setattr(validate, "run_nodes", killed)
    assert main([CPU, "--gpu", "cpu", "--out", str(tmp_path)]) == 1
    assert "node 0 was killed by SIGKILL; the end of " in capsys.readouterr().out


@pytest.mark.parametrize("data, message", [
    ({"configs": {"training_steps": "5"}, "model_params": {"single_node": {"m": {"g": {}}}}},
     "configs is not a section of a validation file; did you mean config? use config or model_params"),
    ({"model_params": {"single_node": {"m": {"g": {}}}, "singlenode": {"m": {"g": {}}}}},
     "model_params.singlenode is not a section of a validation file; did you mean model_params.single_node? "
     "use model_params.single_node or model_params.multi_node"),
])
def test_a_misspelt_section_is_refused_not_dropped(data, message, tmp_path, capsys):
    """`configs` (for config) was dropped without a word: its training_steps=5 did not apply and the run
    trained the default 150 steps."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"_comment": "kept out", **data}))
    assert main([str(path), "--dry-run"]) == 2
    assert f"validation file error: {message} (keys starting with _ are comments)" in capsys.readouterr().err


@pytest.mark.parametrize("params, args, message", [
    ({"single_node": {}}, [], "model_params.single_node is empty; add an entry to it"),
    ({"single_node": {"m": {}}}, [], "model_params.single_node.m is empty; add an entry to it"),
    ({"single_node": {"m": {"g": {}}}}, ["--gpu", "h100"],
     "--gpu h100 is not in model_params.single_node.m; choose from ['g']"),
    ({"single_node": {"m": {"g": {}, "h": {}}}}, [], "--gpu is needed; choose from ['g', 'h']"),
])
def test_a_model_or_gpu_that_matches_nothing_says_what_to_do(params, args, message, tmp_path, capsys):
    """An empty section said `choose --model from []`, and a --gpu that matched nothing did not say so."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"model_params": params}))
    assert main([str(path), "--dry-run", *args]) == 2
    assert f"validation file error: {message}" in capsys.readouterr().err


def test_a_relative_log_dir_is_the_working_directorys_and_a_missing_report_is_explained(tmp_path, monkeypatch,
                                                                                         capsys):
    """Over ssh the nodes start in the repository, so a relative log_dir was another folder there than the
    one the suite read report.json from; and every node exiting 0 with no report.json here failed the
    `training finished` row without a word on why (node 0's report is on node 0's host)."""
    data = json.loads(Path(CPU).read_text())
    data["config"]["log_dir"] = "runs"
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(validate, "run_nodes", lambda commands, log_dir, steps, timeout=0.0: [0, 0])
    assert main([str(path), "--gpu", "cpu", "--nodes", "h1,h2", "--dry-run"]) == 0
    assert f"base_output_directory={tmp_path / 'runs'} " in capsys.readouterr().out
    assert main([str(path), "--gpu", "cpu", "--nodes", "h1,h2", "--out", "out"]) == 1
    err = capsys.readouterr().err
    assert f"every node exited with code 0 but there is no {tmp_path / 'runs'}/validate_v_" in err
    assert ("node 0 writes it on h1, where node 0 ran; run the suite on the first host of --nodes, or set "
            "config.log_dir to a folder all hosts share") in err


def test_a_user_without_a_name_gets_the_user_id(monkeypatch):
    """In a container whose user has no passwd entry (and no USER), getpass raised: a traceback."""
    def no_name():
        raise KeyError("getpwuid(): uid not found: 12345")

    monkeypatch.setattr(validate_json.getpass, "getuser", no_name)
    assert load(CPU)["config"]["log_dir"] == f"/tmp/tessera-validate-{os.getuid()}"


@pytest.mark.parametrize("path", [*AMD, *sorted((REPO / "configs" / "gpu" / "nvidia").glob("*.json"))],
                         ids=lambda p: p.name)
def test_the_user_in_a_volumes_host_folder_is_resolved(path, tmp_path, monkeypatch):
    """volume_dict's keys are host folders: `"/home/{user-id}": "/home/{user-id}"` (every shipped GPU file)
    was mounted as `-v /home/{user-id}:/home/alice`, a folder named {user-id}, not the user's home."""
    monkeypatch.setattr(validate_json, "_user_name", lambda: "alice")
    data = load(_filled(path, tmp_path))
    plan = build_plan(data, *select(data, multi_node=True, model=None, gpu=None))
    assert plan.container["volume_dict"]["/home/alice"] == "/home/alice"
    argv = node_commands(plan, [], "run", "docker")[0][1]
    assert "/home/alice:/home/alice" in argv and "{user-id}" not in " ".join(argv)


def test_a_placeholder_in_a_key_is_listed(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": {"container_config": {"volume_dict": {"<changeme>": "/data"}}},
                                "model_params": {"single_node": {"m": {"g": {}}}}}))
    with pytest.raises(ValidationInputError, match=r"config\.container_config\.volume_dict\.<changeme> \(the key\)"):
        load(str(path))


def test_mock_data_false_on_synthetic_data_says_so_and_a_bad_value_is_refused(tmp_path, capsys):
    """mock_data "False" (real data wanted) with no dataset_type in the entry trained on Tessera's default,
    synthetic data, without a word; "Ture" did nothing either."""
    path = tmp_path / "v.json"
    for mock, entry, code in (("False", {}, 0), ("False", {"dataset_type": "hf"}, 0), ("Ture", {}, 2)):
        path.write_text(json.dumps({"config": {"mock_data": mock, "training_steps": "10"},
                                    "model_params": {"single_node": {"m": {"g": entry}}}}))
        assert main([str(path), "--dry-run"]) == code
        out, err = capsys.readouterr()
        said = "ignored config.mock_data: false, but the run trains on synthetic data" in out
        assert said == (not entry and code == 0)
    assert "config.mock_data='Ture' is not true or false" in err


def test_a_run_name_in_the_entry_is_reported_as_replaced(tmp_path, capsys):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": {"training_steps": "10"},
                                "model_params": {"single_node": {"m": {"g": {"run_name": "mine"}}}}}))
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ignored run_name: the suite names the run validate_<file>" in out and "run_name=mine" not in out


def test_a_maxtext_feature_tessera_refuses_is_refused_in_an_entry_too(tmp_path, capsys):
    """An entry with ici_tensor_sequence_parallelism=4 (which train.py refuses) listed it as ignored and ran the
    entry without it, measured against MaxText's figures with it; set to its off value it stays listed."""
    path, refused = tmp_path / "v.json", ""
    for value, code in ((4, 2), (1, 0)):
        path.write_text(json.dumps({"config": {"training_steps": "10"}, "model_params": {
            "single_node": {"m": {"g": {"ici_tensor_sequence_parallelism": value}}}}}))
        assert main([str(path), "--dry-run"]) == code
        out, err = capsys.readouterr()
        said = "ignored ici_tensor_sequence_parallelism: MaxText key (off here, as in Tessera)" in out
        assert said == (code == 0)
        refused = err if code else refused
    assert ("model_params.single_node.m.g.ici_tensor_sequence_parallelism=4 is a MaxText key Tessera does not implement: a mesh "
            "axis sharding both tensor and sequence dimensions; use ici_tensor_parallelism and "
            "ici_sequence_parallelism. train.py refuses it, and the suite would measure the entry without it; remove "
            "it from the entry (or set it to 1)") in refused


def test_a_train_key_in_config_is_told_to_move_to_the_entry(tmp_path, capsys):
    """config.model_name was listed as "not a setting Tessera has", which it is (in the model entry)."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": {"training_steps": "10", "model_name": "llama2-7b", "micro_batch_size": 2},
                                "model_params": {"single_node": {"m": {"g": {}}}}}))
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    for key in ("model_name", "micro_batch_size"):
        assert (f"ignored config.{key}: a train key, which the suite reads from the model entry only: move it to "
                "model_params.single_node.m.g") in out


@pytest.mark.parametrize("config, entry, message", [
    ({"result_dict": {"tokens_per_sec_per_gpu": "4"}}, {},
     "config.result_dict is read from the model entry only: move it to model_params.single_node.m.g.result_dict"),
    ({"xla_flags": {"xla_gpu_autotune_level": "4"}}, {},
     "config.xla_flags is read from the model entry only: move it to model_params.single_node.m.g.xla_flags"),
    ({"env_dict": {"NCCL_DEBUG": "INFO"}}, {}, "config.env_dict is read from config.container_config only"),
    ({"container_configs": {"env_dict": {}}}, {}, "config.container_configs is not a section of a validation file; "
                                                  "did you mean config.container_config?"),
    ({}, {"results_dict": {"tokens_per_sec_per_gpu": "4"}},
     "model_params.single_node.m.g.results_dict is not a key of a model entry; did you mean result_dict?"),
])
def test_a_section_in_the_wrong_place_or_misspelt_is_refused(config, entry, message, tmp_path, capsys):
    """config.result_dict (or an entry's results_dict) was "ignored", and the run passed without its targets;
    config.env_dict was ignored, and its environment never set."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": {"training_steps": "10", **config},
                                "model_params": {"single_node": {"m": {"g": entry}}}}))
    assert main([str(path), "--dry-run"]) == 2
    assert f"validation file error: {message}" in capsys.readouterr().err


def test_an_xla_flag_set_in_config_and_in_the_entry_takes_the_entrys_value(tmp_path):
    """config.xla_* went into XLA_FLAGS after the entry's xla_flags, and XLA takes the last of a flag given
    twice: the config's value won over the entry's without a word (a train key takes the entry's)."""
    flag = "xla_gpu_executable_warn_stuck_timeout"
    for entry_value, config_value in (("180", "90"), ("90", "90")):
        data = {"config": {flag: config_value},
                "model_params": {"single_node": {"m": {"g": {"xla_flags": {flag: entry_value}}}}}}
        plan = build_plan(data, *select(data, False, None, None))
        assert plan.env["XLA_FLAGS"].split() == [f"--{flag}={entry_value}"]
        said = plan.ignored.get(f"config.{flag}")
        assert said == (None if entry_value == config_value else
                        f"model_params.single_node.m.g.xla_flags.{flag}=180 is used instead")


def test_a_bucket_as_log_dir_is_kept_and_the_report_read_from_the_local_run_folder(tmp_path, monkeypatch, capsys):
    """log_dir gs://b/logs became the local folder <here>/gs:/b/logs (the checkpoints never reached the bucket);
    with a bucket as base the trainer keeps report.json in outputs/<run_name> of its working directory."""
    data = json.loads(Path(CPU).read_text())
    data["config"]["log_dir"] = "gs://my-bucket/logs"
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 0
    assert " base_output_directory=gs://my-bucket/logs " in capsys.readouterr().out

    def trained(commands, log_dir, steps, timeout=0.0):
        run_name = next(a for a in commands[0][1] if a.startswith("run_name=")).split("=", 1)[1]
        (tmp_path / "outputs" / run_name).mkdir(parents=True)
        (tmp_path / "outputs" / run_name / "report.json").write_text(
            json.dumps({"tflops_per_sec_per_device": 1.0, "tokens_per_sec_per_device": 100.0,
                        "steps_skipped": 0}))
        return [0]

    monkeypatch.setattr(validate, "run_nodes", trained)
    assert main([str(path), "--gpu", "cpu", "--out", str(tmp_path / "out")]) == 0
    assert "PASS: single_node.default.cpu" in capsys.readouterr().out


@pytest.mark.parametrize("depth", [995, 100_000])
def test_a_file_nested_too_deep_is_one_line(depth, tmp_path, capsys):
    """A corrupt file of [[[[... (or objects nested just under the parser's limit) ended in a RecursionError
    traceback."""
    path = tmp_path / "v.json"
    path.write_text('{"config": ' + '{"a": ' * depth + "1" + "}" * depth + "}")
    assert main([str(path), "--dry-run"]) == 2
    assert "its JSON is nested hundreds of levels deep (a validation file has a few)" in capsys.readouterr().err


def test_the_guide_names_every_prefix_that_becomes_an_environment_variable():
    """Validation.md listed four of the nine prefixes (hsa_, ucx_, cuda_, hip_ were exported without a word)."""
    text = (REPO / "getting_started" / "Validation.md").read_text()
    for prefix in validate_file.ENV_PREFIXES:
        assert f"{prefix}*`" in text or f"`{prefix}`" in text, prefix


def test_an_environment_variable_set_in_config_and_env_dict_says_which_is_used():
    """config.nccl_debug replaced env_dict's NCCL_DEBUG without a word."""
    data = {"config": {"nccl_debug": "WARN", "nccl_proto": "Simple",
                       "container_config": {"env_dict": {"NCCL_DEBUG": "INFO", "NCCL_PROTO": "Simple"}}},
            "model_params": {"single_node": {"m": {"g": {}}}}}
    plan = build_plan(data, *select(data, False, None, None))
    assert plan.env["NCCL_DEBUG"] == "WARN" and plan.env["NCCL_PROTO"] == "Simple"
    assert plan.ignored == {"config.container_config.env_dict.NCCL_DEBUG": "config.nccl_debug=WARN is used instead"}


def test_nodes_that_outlast_the_timeout_are_stopped_then_killed(tmp_path, monkeypatch, capsys):
    """A node that hung (say in a collective, with step_timeout_seconds=0) blocked the suite forever: it had
    no timeout. --timeout gives the nodes SIGTERM, then SIGKILL to one that ignores it."""
    monkeypatch.setattr(validate_nodes, "KILL_AFTER_SECONDS", 0.5)
    commands = [("local", ["sleep", "100"], {}), ("local", ["sh", "-c", "trap '' TERM; sleep 100"], {})]
    start = time.monotonic()
    with pytest.raises(validate_nodes.NodesTimedOut) as stopped:
        validate_nodes.run_nodes(commands, tmp_path / "logs", "8", timeout=0.5)
    assert time.monotonic() - start < 30
    assert stopped.value.codes == [-signal.SIGTERM, -signal.SIGKILL]
    err = capsys.readouterr().err
    assert "timeout: the nodes have run for 0.5 s (--timeout); SIGTERM passed on to the 2 running node(s)" in err
    assert "timeout: SIGKILL to the 1 node(s) still running" in err


def test_a_signal_while_the_nodes_start_starts_no_more_of_them(tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) between two nodes' starts went to the nodes started so far, and the suite then started
    the rest, which never got it: they waited for the stopped ones (a job's initialization timeout), and so did
    the suite."""
    started = []
    real_start = validate_nodes._RunningNodes.start

    def start(self, rank, *args):
        real_start(self, rank, *args)
        started.append(rank)
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the suite's handler passes it on to node 0
            time.sleep(0.2)

    monkeypatch.setattr(validate_nodes._RunningNodes, "start", start)
    commands = [("local", ["sleep", "100"], {}), ("local", ["sleep", "3"], {})]
    with pytest.raises(validate_nodes.NodesStopped):
        validate_nodes.run_nodes(commands, tmp_path / "logs", "8")
    assert started == [0]


def test_a_closed_stderr_does_not_keep_the_timeout_from_killing_a_node(tmp_path, monkeypatch, capsys):
    """The --timeout watcher's thread wrote its SIGTERM line to a closed stderr and died with a BrokenPipeError
    traceback before its SIGKILL: a node that ignored SIGTERM kept the suite waiting, the --timeout undone."""
    monkeypatch.setattr(validate_nodes, "KILL_AFTER_SECONDS", 0.5)
    real_print = print

    def closed_stderr(*args, **kwargs):
        if kwargs.get("file") is sys.stderr:
            raise BrokenPipeError(32, "Broken pipe")
        real_print(*args, **kwargs)

    monkeypatch.setattr("builtins.print", closed_stderr)
    commands = [("local", ["sh", "-c", "trap '' TERM; sleep 8"], {})]
    start = time.monotonic()
    with pytest.raises(validate_nodes.NodesTimedOut) as stopped:
        validate_nodes.run_nodes(commands, tmp_path / "logs", "8", timeout=0.5)
    assert stopped.value.codes == [-signal.SIGKILL] and time.monotonic() - start < 7


def test_a_closed_stdout_stops_the_nodes_and_exits_141(tmp_path, monkeypatch):
    """`validate ... | head -2`: "node 0 started" met the closed pipe, the suite said "cannot write node logs ...:
    Broken pipe" (exit code 2, false) and left its trainer running without it."""
    monkeypatch.setattr(validate_nodes, "KILL_AFTER_SECONDS", 0.5)
    commands = [("local", ["sleep", "100"], {}), ("local", ["sh", "-c", "trap '' TERM; sleep 100"], {})]
    monkeypatch.setattr(validate, "node_commands", lambda *a: commands)
    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def closed_pipe(*args, **kwargs):
        if kwargs.get("flush") and len(started) == 2:  # "node 1 started": the reader went away
            time.sleep(0.5)  # node 1's shell has set its trap by now
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(validate_nodes.subprocess, "Popen", popen)
    monkeypatch.setattr("builtins.print", closed_pipe)
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": {"training_steps": "10"}, "model_params": {"single_node": {"m": {"g": {}}}}}))
    with pytest.raises(BrokenPipeError):  # run_printing turns it into exit code 141
        main([str(path), "--out", str(tmp_path / "out")])
    assert [p.poll() for p in started] == [-signal.SIGTERM, -signal.SIGKILL]


def test_a_stdout_closed_while_the_nodes_train_stops_them(tmp_path, monkeypatch):
    """`validate ... | head -7`: the reader went away at a progress line, written by the heartbeat's thread, which
    died with a BrokenPipeError traceback while the nodes trained on to the end without anyone reading."""
    monkeypatch.setattr(validate_nodes, "PROGRESS_SECONDS", 0.1)
    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    real_print = print

    def closed_at_progress(*args, **kwargs):
        if str(args[0]).startswith("training:"):
            raise BrokenPipeError(32, "Broken pipe")
        real_print(*args, **kwargs)

    monkeypatch.setattr(validate_nodes.subprocess, "Popen", popen)
    monkeypatch.setattr("builtins.print", closed_at_progress)
    start = time.monotonic()
    with pytest.raises(BrokenPipeError):  # run_printing turns it into exit code 141
        validate_nodes.run_nodes([("local", ["sleep", "30"], {})], tmp_path / "logs", "8")
    assert time.monotonic() - start < 20 and started[0].poll() == -signal.SIGTERM


def test_a_run_that_times_out_fails_with_its_own_exit_code(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(validate, "node_commands", lambda *a: [("local", ["sleep", "100"], {})])
    assert main([CPU, "--gpu", "cpu", "--out", str(tmp_path), "--timeout", "0.5"]) == validate.EXIT_TIMEOUT == 124
    out = capsys.readouterr().out
    assert "FAIL: single_node.default.cpu (timed out after 0.5 s (--timeout)); results in" in out
    assert "node 0 was killed by SIGTERM" in out
    result = json.loads((tmp_path / "validation.json").read_text())
    assert result["passed"] is False
    assert result["checks"][0]["measured"] == "timed out after 0.5 s (--timeout), exit codes [-15]"
    assert main([CPU, "--gpu", "cpu", "--dry-run", "--timeout", "0"]) == 0


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_seconds_is_refused(value, capsys):
    with pytest.raises(SystemExit) as exited:
        main([CPU, "--gpu", "cpu", "--dry-run", "--timeout", value])
    assert exited.value.code == 2
    assert f"--timeout: {value!r} is not a number of seconds; give one of at least 0" in capsys.readouterr().err


def test_a_container_engine_that_hangs_does_not_hang_the_suite(tmp_path, monkeypatch, capsys):
    """`docker info` was asked with no time limit, also for a file without container_image: a hung docker
    daemon kept every command, --dry-run included, waiting forever."""
    (tmp_path / "docker").write_text("#!/bin/sh\nexec sleep 100\n")
    (tmp_path / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(validate_commands, "ENGINE_SECONDS", 0.5)
    start = time.monotonic()
    assert main([CPU, "--gpu", "cpu", "--dry-run"]) == 0  # no container_image: docker is not asked
    data = json.loads(Path(CPU).read_text())
    data["config"]["container_image"] = "rocm/jax:latest"
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 0
    assert time.monotonic() - start < 20
    out = capsys.readouterr().out
    assert "docker info did not answer within 0.5 s: docker is not used" in out
    assert "no container engine answers here: running directly, not in rocm/jax:latest" in out


@pytest.mark.parametrize("container_config, message", [
    ({"device_list": "/dev/kfd"}, "config.container_config.device_list is a JSON string; give an array of device "
                                  'paths, e.g. ["/dev/kfd", "/dev/dri"]'),
    ({"device_list": ["/dev/kfd", None]}, "config.container_config.device_list[1] is a JSON null"),
    ({"volume_dict": ["/data:/data"]}, "config.container_config.volume_dict is a JSON array"),
])
def test_container_devices_and_volumes_of_the_wrong_kind_are_refused(container_config, message, tmp_path, capsys):
    """A device_list string went to docker letter by letter (`--device / --device d ...`), and an array of
    volumes ended the suite in a traceback once a container engine answered."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": {"container_image": "img", "container_config": container_config},
                                "model_params": {"single_node": {"m": {"g": {}}}}}))
    assert main([str(path), "--dry-run"]) == 2
    assert f"validation file error: {message}" in capsys.readouterr().err


def test_a_misspelt_container_setting_is_reported_not_dropped(tmp_path, capsys):
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"config": {"container_config": {"device_lists": ["/dev/kfd"]}},
                                "model_params": {"single_node": {"m": {"g": {}}}}}))
    assert main([str(path), "--dry-run"]) == 0
    assert ("ignored config.container_config.device_lists: not a container setting; the suite uses device_list, "
            "volume_dict and env_dict") in capsys.readouterr().out
    data = json.loads(path.read_text())
    plan = build_plan(data, *select(data, False, None, None))
    assert plan.container["device_list"] == [] and plan.container["volume_dict"] == {}


def test_a_user_at_host_node_gives_the_coordinator_as_the_host(capsys):
    """--nodes alice@h1,alice@h2 (ssh's user@host) made JAX_COORDINATOR_IP=alice@h1, which no node can reach."""
    assert main([CPU, "--gpu", "cpu", "--nodes", "alice@h1,alice@h2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "export JAX_COORDINATOR_IP=h1\n" in out and "JAX_COORDINATOR_IP=alice" not in out
    assert "ssh alice@h2 " in out
    assert "--nodes replaces config.coordinator_ip=localhost with h1 (the first host)" in out


@pytest.mark.parametrize("nodes", [",", " , ", "-oProxyCommand=x,h2"])
def test_nodes_that_name_no_host_are_refused(nodes, capsys):
    """`--nodes ,` ran here, as if --nodes had not been given, and `-o...` went to ssh as an option."""
    assert main([CPU, "--gpu", "cpu", f"--nodes={nodes}", "--dry-run"]) == 2
    assert f"error: --nodes {nodes!r} names no host; give host names (or user@host)" in capsys.readouterr().err


def test_suites_started_in_the_same_second_get_their_own_run_folders(tmp_path, monkeypatch):
    """Two suites started in the same second (`--gpu cpu` and `--gpu cpu-unreachable` side by side) had one run
    name: the second trainer was refused (the folder was in use), and its suite reported the first's report.json
    as its own measurements."""
    names = []

    def trained(commands, log_dir, steps, timeout=0.0):
        names.append(next(a for a in commands[0][1] if a.startswith("run_name=")).split("=", 1)[1])
        return [0]

    monkeypatch.setattr(validate, "run_nodes", trained)
    monkeypatch.setattr(validate.time, "strftime", lambda fmt: "20260101_000000")
    for pid, gpu in ((101, "cpu"), (102, "cpu-unreachable")):
        monkeypatch.setattr(validate.os, "getpid", lambda pid=pid: pid)
        main([CPU, "--gpu", gpu, "--out", str(tmp_path / gpu)])
    assert names == ["validate_validate_tiny_20260101_000000_101", "validate_validate_tiny_20260101_000000_102"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_before_the_nodes_start_is_one_line(signum, monkeypatch, capsys):
    """Ctrl-C while the suite loaded the config or asked docker was a KeyboardInterrupt traceback, and SIGTERM
    ended it with no word (exit -15)."""
    def signalled(*args):
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises here

    monkeypatch.setattr(validate, "check_train_keys", signalled)
    assert main([CPU, "--gpu", "cpu", "--dry-run"]) == 128 + signum
    assert capsys.readouterr().err.strip() == f"stopped by {signal.Signals(signum).name} (no node was running)"


def _hang_up_when_ready(log: Path, ignore: bool, monkeypatch):
    """A node that says `ready`, then sleeps (20 s, or 1 s with `ignore`; SIGTERM: exit 143), and SIGHUP to this
    process once it is ready. The SIGHUP handler it sets, a list of the signals it heard (SIG_IGN with `ignore`,
    as under nohup), stands where the suite sets none. Returns that list and the handler it replaced."""
    node = [sys.executable, "-c", "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
            "print('ready', flush=True)\ntime.sleep(20 if len(sys.argv) < 2 else 1)", *(["short"] if ignore else [])]
    monkeypatch.setattr(validate, "node_commands", lambda *a: [("local", node, {})])
    heard: list[int] = []
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore else lambda s, f: heard.append(s))

    def hang_up():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (log.exists() and "ready" in log.read_text()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGHUP)

    threading.Thread(target=hang_up, daemon=True).start()
    return heard, previous


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal_closed", "nohup"])
def test_sighup_to_the_suite_stops_its_nodes_unless_ignored(ignored, tmp_path, monkeypatch, capsys):
    """SIGHUP (the terminal or the ssh session the suite ran in closed) ended the suite alone (129) and left every
    local trainer running without a parent, holding its devices, with no validation.json. It is passed on as
    SIGTERM (the trainers save and stop) and the suite exits 129 with a failed result; under nohup, which
    ignores SIGHUP, the run goes on."""
    heard, previous = _hang_up_when_ready(tmp_path / "logs" / "node0.log", ignored, monkeypatch)
    try:
        code = main([CPU, "--gpu", "cpu", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGHUP, previous)
    out, err = capsys.readouterr()
    result = json.loads((tmp_path / "validation.json").read_text())
    if ignored:  # the node slept its second and exited 0; no report.json, so the run fails, but not by the signal
        assert code == 1 and "SIGHUP" not in err and "training finished" in out
        assert result["checks"][0]["measured"] == "[0]"
        return
    assert code == 129 and not heard, err
    assert "SIGHUP received: passed on as SIGTERM to the 1 running node(s)" in err
    assert err.rstrip().endswith(f"stopped by SIGHUP: every node has exited; node logs in {tmp_path / 'logs'}")
    assert result["passed"] is False and result["checks"][0]["measured"] == "stopped by SIGHUP"


def test_a_log_dir_under_the_home_is_not_a_folder_named_tilde(tmp_path, monkeypatch, capsys):
    """log_dir "~/runs" became <working directory>/~/runs: a folder named ~, where train.py reads ~ as the home."""
    data = json.loads(Path(CPU).read_text())
    data["config"]["log_dir"] = "~/runs"
    path = tmp_path / "v.json"
    path.write_text(json.dumps(data))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main([str(path), "--gpu", "cpu", "--dry-run"]) == 0
    assert f"base_output_directory={tmp_path / 'home' / 'runs'} " in capsys.readouterr().out


def test_a_misspelt_train_key_is_reported_with_the_key_it_resembles(tmp_path, capsys):
    """per_device_batch_sise was `ignored ...: not a Tessera train key`, and the run trained the default batch
    with nothing pointing at the typo."""
    path = tmp_path / "v.json"
    path.write_text(json.dumps({"model_params": {"single_node": {"m": {"g": {"per_device_batch_sise": "2"}}}}}))
    assert main([str(path), "--dry-run"]) == 0
    assert ("ignored per_device_batch_sise: not a Tessera train key; did you mean per_device_batch_size?"
            in capsys.readouterr().out)


def test_results_that_cannot_be_written_are_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    """A full disk when validation.json was written: a traceback (exit 1) and an empty validation.json."""
    monkeypatch.setattr(validate, "run_nodes", lambda commands, log_dir, steps, timeout=0.0: [0])
    real_write_text = Path.write_text

    def disk_full(self, text, *args, **kwargs):
        if self.name == "validation.xml":
            raise OSError(28, "No space left on device")
        return real_write_text(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full)
    assert main([CPU, "--gpu", "cpu", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert (f"error: cannot write validation.json/.xml in {tmp_path}: No space left on device; free some space "
            "there or choose another --out") in err
    assert "FAIL: single_node.default.cpu; no results written" in out
    assert not (tmp_path / "validation.json").exists()  # no half of the results


def test_a_model_entry_that_sets_a_config_setting_again_says_which_is_used(tmp_path, capsys):
    """config.training_steps=8 and the entry's steps=5: the run took 5 and dropped the 8 without a word."""
    path = tmp_path / "v.json"
    entry = {"steps": "5", "report_warmup_steps": "1", "base_output_directory": str(tmp_path / "a")}
    path.write_text(json.dumps({"config": {"training_steps": "8", "log_dir": str(tmp_path / "a")},
                                "model_params": {"single_node": {"m": {"g": entry}}}}))
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ignored config.training_steps: model_params.single_node.m.g.steps=5 is used instead" in out
    assert "config.log_dir" not in out  # the same value twice: nothing to say
    assert " steps=5 " in out


def test_a_key_given_twice_is_refused_not_half_dropped(tmp_path, capsys):
    """JSON keeps the last of a repeated key: training_steps "8" then "20" trained 20 steps, the 8 dropped silently."""
    path = tmp_path / "v.json"
    path.write_text('{"_c": 1, "_c": 2, "config": {"training_steps": "8", "training_steps": "20"}, '
                    '"model_params": {"single_node": {"m": {"g": {}}}}}')
    assert main([str(path), "--dry-run"]) == 2
    assert (f"validation file error: {path}: the key 'training_steps' appears twice in one object (\"8\" and then "
            "\"20\"); JSON would keep only the last: remove one") in capsys.readouterr().err


def test_the_junit_file_is_well_formed_for_any_entry_name(tmp_path):
    """A gpu entry named with a quote (`h100 "fast"`) wrote classname="... "fast"": an XML file CI could not read."""
    import xml.dom.minidom

    plan = validate_file.Plan('single_node.m.h100 "fast" & <co>', {}, {}, {}, {}, {}, 1, "localhost", "8476",
                              {"optimization_level": "O1"})
    rows = [{"check": "training finished", "target": "exit code 0 on every node", "measured": "[1]", "passed": False}]
    validate.write_results(rows, plan, tmp_path, 1.0)
    case = xml.dom.minidom.parse(str(tmp_path / "validation.xml")).getElementsByTagName("testcase")[0]
    assert case.getAttribute("classname") == 'single_node.m.h100 "fast" & <co>'


def test_a_run_whose_steps_were_skipped_fails(tmp_path, capsys):
    """on_nonfinite_loss=skip_step: a run whose updates were dropped for non-finite values (report.json's
    steps_skipped) passed on its speed alone; its figures are not those of a run that trains."""
    plan = validate_file.Plan("single_node.m.cpu", {}, {}, {"tokens_per_sec_per_gpu": 10.0}, {}, {}, 1, "localhost",
                              "8476", {"optimization_level": "O1"})
    for skipped, code in ((2, 1), (0, 0)):
        (tmp_path / "report.json").write_text(json.dumps({"tokens_per_sec_per_device": 50.0,
                                                          "steps_skipped": skipped}))
        assert validate._report(plan, [], [0], None, tmp_path, tmp_path, 1.0) == code
        result = json.loads((tmp_path / "validation.json").read_text())
        row = next(r for r in result["checks"] if r["check"] == "no step skipped")
        assert row["measured"] == skipped and row["passed"] is (skipped == 0) and result["passed"] is (skipped == 0)
        assert capsys.readouterr().out.rstrip().endswith(("PASS" if code == 0 else "FAIL")
                                                         + f": single_node.m.cpu; results in {tmp_path / 'validation.json'}"
                                                         " and validation.xml")
