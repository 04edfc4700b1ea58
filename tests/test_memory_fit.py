"""A run too large for its memory stops before allocating, with one line and exit code 7
(tessera.memory_fit), instead of being killed by the kernel minutes later with no message, or
waiting forever under `ulimit -v` (XLA's CPU client hung in the state's creation before this)."""

import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import REPO
from test_faults import _no_echoes
from tessera import memory_fit
from tessera.memory_fit import EXIT_OUT_OF_MEMORY, host_room, out_of_memory

LIMIT_GIB = 8  # the address space the runs below get (`ulimit -v`), whatever the host has
NUMBER = r"(\d+\.\d) GiB"


def _train_limited(tmp_path, *args):
    """train.py as a user on a host with `ulimit -v` runs it (relative paths, from the repository)."""
    return _limited("train.py", "configs/base.yml", "run_name=big", f"base_output_directory={tmp_path}", *args)


def _limited(*args):
    command = " ".join(shlex.quote(a) for a in [sys.executable, *args])
    return subprocess.run(["bash", "-c", f"ulimit -v {LIMIT_GIB * 2**20}; exec {command}"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def _memory_error(proc) -> str:
    assert proc.returncode == EXIT_OUT_OF_MEMORY, proc.stderr[-3000:]
    _no_echoes(proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "memory error" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_state_larger_than_the_host_allows_stops_before_anything_is_allocated(tmp_path):
    line = _memory_error(_train_limited(tmp_path, "model_name=llama2-7b", "steps=1"))
    match = re.fullmatch(
        rf"memory error: not enough memory for the train state: {NUMBER} per device \(parameters "
        rf"{NUMBER}, optimizer state {NUMBER}, over a mesh of 8 device\(s\)\); this host's 8 cpu devices need "
        rf"{NUMBER} in all and have {NUMBER} left \(ulimit -v 8.0 GiB, of which this process has mapped {NUMBER}; "
        r"raise it with `ulimit -v`\)\. Nothing was allocated; use a smaller model or weight_dtype=bfloat16 or "
        r"free memory; `python3 -m tessera.tools.estimate` and `python3 -m tessera.tools.plan` size a run "
        r"beforehand \(exit code 7\)", line)
    assert match, line
    per_device, params, opt, total, left, mapped = map(float, match.groups())
    assert per_device == pytest.approx(75.3 / 8, abs=0.1) and opt == pytest.approx(2 * params, abs=0.1)
    assert total == pytest.approx(8 * per_device, abs=0.5) and left + mapped == pytest.approx(LIMIT_GIB, abs=0.1)
    assert not tmp_path.joinpath("big").exists()  # no run folder, no checkpoint folder


def test_a_step_larger_than_the_host_allows_stops_before_it_runs(tmp_path):
    # a tiny model, but 32 sequences of 2048 tokens per device: the state fits, the activations do not
    line = _memory_error(_train_limited(tmp_path, "per_device_batch_size=32", "max_target_length=2048", "steps=1"))
    match = re.fullmatch(
        rf"memory error: not enough memory for the train step: its activations, gradients and other temporaries "
        rf"need {NUMBER} per device \(a global batch of 256 sequences of 2048 tokens over 8 device\(s\), "
        rf"remat_policy=full\) on top of the train state; this host's 8 cpu devices need {NUMBER} in all and have "
        rf"{NUMBER} left \(ulimit -v 8.0 GiB, .*\)\. Nothing was run; lower per_device_batch_size or "
        r"max_target_length or run the batch in micro-batches \(gradient_accumulation_steps\); .* \(exit code 7\)",
        line)
    assert match, line
    per_device, total, left = map(float, match.groups())
    assert total == pytest.approx(8 * per_device, abs=0.5) and total > left
    assert not tmp_path.joinpath("big").exists()


def test_decoding_parameters_larger_than_the_host_allows_stops_before_reading_them(tmp_path):
    line = _memory_error(_limited("-m", "tessera.decode", "configs/base.yml", "model_name=llama2-7b",
                                  f"load_parameters_path={tmp_path}/none", "--tokens", "1,2"))
    assert re.fullmatch(
        rf"memory error: not enough memory for the parameters and the KV cache: {NUMBER} per device \(parameters "
        rf"{NUMBER} \(float32, over a mesh of 8 device\(s\)\), KV cache 34.0 MiB per device for 1 prompt\(s\) of "
        rf"up to 34 tokens in 8 rows, split 8 ways\); this host's 8 cpu devices need {NUMBER} in all and have "
        rf"{NUMBER} left "
        r"\(ulimit -v .*\)\. Nothing was allocated; free memory, or decode on a host with more \(exit code 7\)",
        line), line


def test_a_kv_cache_larger_than_the_host_allows_stops_before_the_parameters_load(tmp_path):
    """The cache decoding creates counts with the parameters: a small model's fit, its cache for 2
    prompts of up to 200,002 tokens on 8 CPU devices does not. The 2 prompts are decoded in 8 rows,
    one per device (the mesh's fsdp axis splits them), so each device holds half the 2 rows' cache."""
    from tessera.config import load_config
    from tessera.decode import kv_cache_bytes
    from tessera.mesh import create_mesh
    from tessera.models import build_model
    from tessera.tools.cli import resolve_config_file

    keys = ["configs/base.yml", "max_target_length=200002"]
    line = _memory_error(_limited("-m", "tessera.decode", *keys, f"load_parameters_path={tmp_path}/none",
                                  "--tokens", "1,2", "--tokens", "3", "--max_new_tokens", "200000"))
    match = re.fullmatch(
        rf"memory error: not enough memory for the parameters and the KV cache: {NUMBER} per device \(parameters "
        r"\d+\.\d MiB \(float32, over a mesh of 8 device\(s\)\), KV cache (\d+\.\d) GiB per device for 2 "
        rf"prompt\(s\) of up to 200002 tokens in 8 rows, split 8 ways\); this host's 8 cpu devices need {NUMBER} "
        rf"in all and have {NUMBER} "
        r"left \(ulimit -v .*\)\. Nothing was allocated; decode fewer prompts at once, lower --max_new_tokens or set "
        r"quantize_kvcache=true; free memory, or decode on a host with more \(exit code 7\)", line)
    assert match, line
    per_device, cache, total, left = map(float, match.groups())
    cfg = load_config(resolve_config_file(keys))
    model = build_model(cfg.model)
    assert cache == pytest.approx(kv_cache_bytes(model, 8, 200002, create_mesh(cfg.mesh)) / 2**30, abs=0.05)
    assert cache == pytest.approx(kv_cache_bytes(model, 2, 200002) / 2 / 2**30, abs=0.05)
    assert per_device == pytest.approx(cache, abs=0.1) and total == pytest.approx(8 * per_device, abs=0.5)
    assert total > left


def test_the_same_runs_go_ahead_when_they_fit(tmp_path):
    """The checks refuse only what does not fit: the default run under the same limit trains."""
    proc = _train_limited(tmp_path, "steps=2", "per_device_batch_size=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory error" not in proc.stderr


def _cgroup_tree(root, version: int, levels: dict[str, dict[str, str]]):
    """A cgroup file tree under `root`, as the kernel shows it, with the files of each level."""
    mount = root / ("sys/fs/cgroup" if version == 2 else "sys/fs/cgroup/memory")
    for level, files in levels.items():
        folder = mount / level.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name).write_text(text)
    return mount


def _point_at(monkeypatch, root, mount, version: int, cgroup_line: str) -> None:
    files = dict(memory_fit._CGROUP_FILES)
    files[version] = (str(mount), *files[version][1:])
    files[3 - version] = (str(root / "absent"), *files[3 - version][1:])
    monkeypatch.setattr(memory_fit, "_CGROUP_FILES", files)
    (root / "cgroup").write_text(cgroup_line + "\n")
    monkeypatch.setattr(memory_fit, "PROC_SELF_CGROUP", root / "cgroup")


def test_the_tightest_enclosing_cgroup_v2_limit_bounds_the_host(tmp_path, monkeypatch):
    gib = 2**30
    mount = _cgroup_tree(tmp_path, 2, {
        "": {"memory.max": "max"},  # the root has no limit
        "job": {"memory.max": str(4 * gib), "memory.current": str(3 * gib), "memory.stat": f"anon 1\ninactive_file {gib // 2}\n"},
        "job/step": {"memory.max": "max", "memory.current": str(3 * gib), "memory.stat": "inactive_file 0\n"},
    })
    _point_at(monkeypatch, tmp_path, mount, 2, "0::/job/step")
    rooms = memory_fit._cgroup_rooms()
    assert rooms == [(gib + gib // 2, f"memory cgroup limit 4.0 GiB of {mount / 'job'}")]
    assert host_room() == min(rooms + [memory_fit._meminfo_room()])


def test_a_cgroup_v1_limit_inside_a_container_is_read_at_the_namespace_root(tmp_path, monkeypatch):
    gib = 2**30
    # /proc/self/cgroup names the host's path, which the container's mount does not have
    mount = _cgroup_tree(tmp_path, 1, {"": {"memory.limit_in_bytes": str(2 * gib), "memory.usage_in_bytes": str(gib),
                                            "memory.stat": "cache 5\ntotal_inactive_file 0\n"}})
    _point_at(monkeypatch, tmp_path, mount, 1, "4:memory:/kubepods/pod1/abc")
    assert memory_fit._cgroup_rooms() == [(gib, f"memory cgroup limit 2.0 GiB of {mount}")]
    # no limit (the kernel's largest value) is no bound
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_fit._cgroup_rooms() == []


def test_an_allocation_xla_refuses_is_an_out_of_memory_error():
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:  # 16 TiB: more than any host here has
        jax.jit(lambda: jnp.ones((2**42,), jnp.float32))().block_until_ready()
    oom = out_of_memory(refused.value, "at step 3")
    assert oom is not None and str(oom).startswith(
        "out of device memory at step 3 (XLA said: RESOURCE_EXHAUSTED: Out of memory allocating 17592186044416 "
        "bytes.); lower per_device_batch_size")
    assert out_of_memory(RuntimeError("INTERNAL: a collective failed"), "at step 3") is None
