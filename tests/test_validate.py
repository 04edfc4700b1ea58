"""Validation suite: placeholders refused, every key mapped or reported, real CPU runs pass and fail."""

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO
from tessera.tools.validate import ValidationInputError, build_plan, load, main, node_commands, select

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
        assert f"--{flag}={value}" in xla
    assert plan.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == data["config"]["xla_python_client_mem_fraction"]
    assert plan.env["JAX_COORDINATOR_PORT"] == "1234"
    assert plan.overrides["steps"] == data["config"]["training_steps"]
    assert plan.overrides["base_emb_dim"] == entry["base_emb_dim"]
    assert plan.overrides["mlp_activations"] == '["silu", "linear"]'
    assert "precision" in plan.ignored and "tokenizer_model" in plan.ignored
    if "nccl_proto" in data["config"]:
        assert plan.env["NCCL_PROTO"] == data["config"]["nccl_proto"]
    accounted = set(plan.overrides) | set(plan.ignored) | {"xla_flags", "result_dict"}
    aliases = {"sequence_length": "max_target_length", "micro_batch_size": "per_device_batch_size"}
    for key in entry:
        assert key in accounted or aliases.get(key) in accounted, key
    assert "{user-id}" not in json.dumps(plan.env)


def test_dry_run_prints_each_node(tmp_path, capsys):
    path = _filled(REPO / "configs" / "gpu" / "amd" / "mi300x_distributed_llama3_1_70b.json", tmp_path)
    data = load(path)
    plan = build_plan(data, *select(data, True, None, None))
    commands = node_commands(plan, ["h1", "h2"], "r", engine=None)
    assert [c[0] for c in commands] == ["h1", "h2"]
    assert commands[1][2]["NODE_RANK"] == "1" and commands[1][2]["JAX_COORDINATOR_IP"] == "h1"
    assert commands[1][1][0] == "ssh" and "NODE_RANK=1" in commands[1][1][2]
    assert main([path, "--nodes", "h1,h2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# node 1 (h2)" in out and "export NODE_RANK=1" in out


@pytest.mark.parametrize("gpu, code", [("cpu", 0), ("cpu-unreachable", 1)])
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
