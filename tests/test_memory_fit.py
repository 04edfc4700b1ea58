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
from tessera import host_limits, memory_fit
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
        rf"{NUMBER}, optimizer state {NUMBER}, and {NUMBER} of temporaries while it is initialized, over a mesh of 8 "
        rf"device\(s\)\); this host's 8 cpu devices need {NUMBER} in all and have {NUMBER} left \(ulimit -v 8.0 GiB, "
        rf"of which this process has mapped {NUMBER}; raise it with `ulimit -v`\)\. Nothing was allocated; use a "
        r"smaller model or weight_dtype=bfloat16 or free memory; `.venv/bin/python -m tessera.tools.estimate` and "
        r"`.venv/bin/python -m tessera.tools.plan` size a run beforehand \(exit code 7\)", line)
    assert match, line
    per_device, params, opt, init, total, left, mapped = map(float, match.groups())
    # the state (75.3 GiB over 8 devices) and the init program's temporaries, from XLA's memory analysis
    assert per_device == pytest.approx(75.3 / 8 + init, abs=0.1) and opt == pytest.approx(2 * params, abs=0.1)
    assert 0 < init < per_device
    assert total == pytest.approx(8 * per_device, abs=0.5) and left + mapped == pytest.approx(LIMIT_GIB, abs=0.1)
    assert not tmp_path.joinpath("big").exists()  # no run folder, no checkpoint folder


@pytest.mark.slow
def test_a_step_larger_than_the_host_allows_stops_before_it_runs(tmp_path):
    # a tiny model, but 32 sequences of 2048 tokens per device: the state fits, the activations do not
    line = _memory_error(_train_limited(tmp_path, "per_device_batch_size=32", "max_target_length=2048", "steps=1"))
    match = re.fullmatch(
        rf"memory error: not enough memory for the train step: its activations, gradients and other temporaries "
        rf"need {NUMBER} per device \(a global batch of 256 sequences of 2048 tokens over 8 device\(s\), "
        rf"remat_policy=full\) on top of the train state, and up to (\d+\.\d) MiB on the host for checkpoint saves "
        rf"\(a copy of the state to write from\); this host's 8 cpu devices need {NUMBER} in all and have "
        rf"{NUMBER} left \(ulimit -v 8.0 GiB, .*\)\. Nothing was run; lower per_device_batch_size or "
        r"max_target_length or run the batch in micro-batches \(gradient_accumulation_steps\); .* \(exit code 7\)",
        line)
    assert match, line
    per_device, saves, total, left = map(float, match.groups())
    # one save, at the last step: a copy of the state to write from, no second state beside it
    assert saves == pytest.approx(42.0, abs=0.1)  # the 3,672,320 float32 parameters and their two AdamW moments
    assert total == pytest.approx(8 * per_device + saves / 1024, abs=0.5) and total > left
    assert not tmp_path.joinpath("big").exists()


@pytest.mark.slow
def test_an_eval_step_larger_than_the_host_allows_stops_before_training(tmp_path):
    # the train step fits (one sequence per device); an evaluation of 32 sequences of 2048 tokens per
    # device does not: found when the eval step is compiled, before the first step
    line = _memory_error(_train_limited(tmp_path, "per_device_batch_size=1", "max_target_length=2048", "steps=2",
                                        "eval_interval=1", "eval_steps=1", "eval_per_device_batch_size=32"))
    match = re.fullmatch(
        rf"memory error: not enough memory for the eval step: its activations and logits need {NUMBER} per device "
        rf"\(an eval batch of 256 sequences of 2048 tokens over 8 device\(s\)\) on top of the train state; this "
        rf"host's 8 cpu devices need {NUMBER} in all and have {NUMBER} left \(ulimit -v 8.0 GiB, .*\)\. Nothing was "
        r"run; lower eval_per_device_batch_size or compute the logits in pieces \(num_vocab_tiling\); .* "
        r"\(exit code 7\)", line)
    assert match, line
    per_device, total, left = map(float, match.groups())
    assert total == pytest.approx(8 * per_device, abs=0.5) and total > left  # per_device is rounded to 0.1
    assert not tmp_path.joinpath("big").exists()


def test_a_checkpoint_to_read_counts_its_host_buffers(tmp_path):
    """Reading parameters (or a whole state) holds buffers on the host beside the arrays it fills;
    under `ulimit -v` they are the address space of every array read: here the 25.1 GiB of
    llama2-7b's float32 parameters (load_parameters_path need not exist: nothing is read)."""
    line = _memory_error(_train_limited(tmp_path, "model_name=llama2-7b", "steps=1",
                                        f"load_parameters_path={tmp_path}/none"))
    match = re.fullmatch(
        rf"memory error: not enough memory for the train state: {NUMBER} per device \(parameters "
        rf"{NUMBER}, optimizer state {NUMBER}, over a mesh of 8 device\(s\); and up to {NUMBER} on the host while "
        rf"the checkpoint is read\); this host's 8 cpu devices need {NUMBER} in all and have {NUMBER} left "
        r"\(ulimit -v 8.0 GiB, .*\)\. Nothing was allocated; .* \(exit code 7\)", line)
    assert match, line
    per_device, params, _, buffers, total, _ = map(float, match.groups())
    assert buffers == 25.1 and buffers == pytest.approx(8 * params, abs=0.5)  # 8 x the rounded 3.1 GiB
    assert total == pytest.approx(8 * per_device + buffers, abs=0.5)


def test_host_buffers_are_weighed_against_each_host_bound_in_its_own_terms(monkeypatch):
    """Resident bytes against memory (available, cgroups), mapped bytes against `ulimit -v`; the
    message names the bound missed by most; devices with memory of their own do not count them."""
    from tessera.memory_fit import HostBuffers, Room, _short_of

    gib = 2**30
    free = Room(3 * gib, True, 1, "cpu", "the least")
    read = HostBuffers(resident=gib // 2, mapped=2 * gib, what="while the checkpoint is read")
    bounds = [(3 * gib, "available host memory", False), (5 * gib, "ulimit -v", True)]
    monkeypatch.setattr(memory_fit, "host_bounds", lambda: bounds)
    assert _short_of(free, 2 * gib, read) is None  # 2.5 of 3 resident, 4 of 5 mapped
    bounds[1] = (3 * gib, "ulimit -v", True)
    bound, host = _short_of(free, 2 * gib, read)
    assert (bound.source, bound.free_bytes, host) == ("ulimit -v", 3 * gib, 2 * gib)
    bounds[0] = (gib, "a memory cgroup", False)  # short by 1.5 GiB there, by 1 under ulimit -v
    assert _short_of(free, 2 * gib, read)[0].source == "a memory cgroup"
    assert _short_of(Room(3 * gib, False, 8, "tpu", "limit"), 2 * gib, read) is None


def test_an_eval_counts_the_copy_an_asynchronous_save_may_still_write_from(monkeypatch):
    """An evaluation can run while an earlier step's asynchronous save is still being written: the
    copy of the state it writes from is on the host meanwhile (no second state: an evaluation makes
    none). Counted only when such a save can happen (async, a save before the last step)."""
    from types import SimpleNamespace

    from conftest import tiny_config
    from tessera.memory_fit import HostBuffers, Room, check_eval_fits, state_bytes
    from tessera.step import setup
    from tessera.train import _save_buffers

    trainer = setup(tiny_config(steps=10, checkpoint_period=4))
    state = sum(state_bytes(trainer).values()) * len(memory_fit.local_devices(trainer.mesh))
    copy = _save_buffers(trainer_cfg := tiny_config(steps=10, checkpoint_period=4), trainer, object(), 0,
                         evaluation=True)
    assert 0 < copy.resident == copy.mapped <= state and copy.what.endswith("(a copy of the state to write from)")
    step = _save_buffers(trainer_cfg, trainer, object(), 0)
    assert step.resident == copy.resident + state and "second state" in step.what  # a step makes another state
    for change in (dict(async_checkpointing=False), dict(checkpoint_period=10)):  # no save in flight at an eval
        assert _save_buffers(tiny_config(steps=10, **{"checkpoint_period": 4, **change}), trainer, object(), 0,
                             evaluation=True) == HostBuffers()
    assert _save_buffers(trainer_cfg, trainer, None, 0, evaluation=True) == HostBuffers()  # no checkpoints

    gib = 2**30
    monkeypatch.setattr(memory_fit, "room", lambda devices: Room(3 * gib, True, 8, "cpu", "the least"))
    monkeypatch.setattr(memory_fit, "host_bounds", lambda: [(3 * gib, "available host memory", False)])
    eval_step = SimpleNamespace(memory_analysis=lambda: SimpleNamespace(
        temp_size_in_bytes=gib // 4, output_size_in_bytes=0, alias_size_in_bytes=0))  # 2 GiB on 8 devices
    check_eval_fits(eval_step, trainer)  # 2 of 3 GiB
    saving = HostBuffers(gib + gib // 2, gib + gib // 2, "for checkpoint saves (a copy of the state to write from)")
    with pytest.raises(memory_fit.OutOfMemory, match=r"on top of the train state, and up to 1\.5 GiB on the host "
                       r"for checkpoint saves \(a copy of the state to write from\); .* Nothing was run; set "
                       r"async_checkpointing=false \(no save is then being written while an evaluation runs\)"):
        check_eval_fits(eval_step, trainer, saving)


def test_decoding_parameters_larger_than_the_host_allows_stops_before_reading_them(tmp_path):
    line = _memory_error(_limited("-m", "tessera.decode", "configs/base.yml", "model_name=llama2-7b",
                                  f"load_parameters_path={tmp_path}/none", "--tokens", "1,2"))
    assert re.fullmatch(
        rf"memory error: not enough memory for the parameters and the KV cache: {NUMBER} per device \(parameters "
        rf"{NUMBER} \(float32, over a mesh of 8 device\(s\)\), KV cache 34.0 MiB per device for 1 prompt\(s\) of "
        rf"up to 34 tokens in 8 rows, split 8 ways; and up to 25.1 GiB on the host while the checkpoint is read\); "
        rf"this host's 8 cpu devices need {NUMBER} in all and have "
        rf"{NUMBER} left "
        r"\(ulimit -v .*\)\. Nothing was allocated; set weight_dtype=bfloat16 \(float32 parameters are read as "
        r"bfloat16, half the memory\); free memory, or decode on a host with more \(exit code 7\)",
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
        rf"prompt\(s\) of up to 200002 tokens in 8 rows, split 8 ways; and up to 14.0 MiB on the host while the "
        rf"checkpoint is read\); this host's 8 cpu devices need {NUMBER} "
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
    files = dict(host_limits._CGROUP_FILES)
    files[version] = (str(mount), *files[version][1:])
    files[3 - version] = (str(root / "absent"), *files[3 - version][1:])
    monkeypatch.setattr(host_limits, "_CGROUP_FILES", files)
    (root / "cgroup").write_text(cgroup_line + "\n")
    monkeypatch.setattr(host_limits, "PROC_SELF_CGROUP", root / "cgroup")


def test_the_tightest_enclosing_cgroup_v2_limit_bounds_the_host(tmp_path, monkeypatch):
    gib = 2**30
    mount = _cgroup_tree(tmp_path, 2, {
        "": {"memory.max": "max"},  # the root has no limit
        "job": {"memory.max": str(4 * gib), "memory.current": str(3 * gib), "memory.stat": f"anon 1\ninactive_file {gib // 2}\n"},
        "job/step": {"memory.max": "max", "memory.current": str(3 * gib), "memory.stat": "inactive_file 0\n"},
    })
    _point_at(monkeypatch, tmp_path, mount, 2, "0::/job/step")
    rooms = host_limits.cgroup_rooms()
    assert rooms == [(gib + gib // 2, f"memory cgroup limit 4.0 GiB of {mount / 'job'}")]
    assert host_room() == min(rooms + [host_limits.meminfo_room()])


def test_a_cgroups_clean_file_cache_counts_as_room_active_or_not(tmp_path, monkeypatch):
    """A checkpoint read twice (checksums, then the restore) sits on the active file list: counting
    only the inactive one refused resumes that fitted. Dirty pages and pages under writeback are
    not free until written."""
    mib = 2**20
    mount = _cgroup_tree(tmp_path, 2, {"job": {
        "memory.max": str(4096 * mib), "memory.current": str(4000 * mib),
        "memory.stat": f"anon 5\nactive_file {1100 * mib}\ninactive_file {600 * mib}\nfile_dirty {150 * mib}\n"
                       f"file_writeback {50 * mib}\n"}})
    _point_at(monkeypatch, tmp_path, mount, 2, "0::/job")
    assert host_limits.cgroup_rooms() == [((96 + 1100 + 600 - 150 - 50) * mib,
                                           f"memory cgroup limit 4.0 GiB of {mount / 'job'}")]


def test_a_cgroup_v1_limit_inside_a_container_is_read_at_the_namespace_root(tmp_path, monkeypatch):
    gib = 2**30
    # /proc/self/cgroup names the host's path, which the container's mount does not have
    mount = _cgroup_tree(tmp_path, 1, {"": {"memory.limit_in_bytes": str(2 * gib), "memory.usage_in_bytes": str(gib),
                                            "memory.stat": "cache 5\ntotal_inactive_file 0\n"}})
    _point_at(monkeypatch, tmp_path, mount, 1, "4:memory:/kubepods/pod1/abc")
    assert host_limits.cgroup_rooms() == [(gib, f"memory cgroup limit 2.0 GiB of {mount}")]
    # no limit (the kernel's largest value) is no bound
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host_limits.cgroup_rooms() == []


def test_an_allocation_xla_refuses_is_an_out_of_memory_error():
    with pytest.raises(jax.errors.JaxRuntimeError) as refused:  # 16 TiB: more than any host here has
        jax.jit(lambda: jnp.ones((2**42,), jnp.float32))().block_until_ready()
    oom = out_of_memory(refused.value, "at step 3")
    assert oom is not None and str(oom).startswith(
        "out of device memory at step 3 (XLA said: RESOURCE_EXHAUSTED: Out of memory allocating 17592186044416 "
        "bytes.); lower per_device_batch_size")
    assert out_of_memory(RuntimeError("INTERNAL: a collective failed"), "at step 3") is None


def test_a_prefill_whose_temporaries_do_not_fit_stops_before_the_parameters_load(tmp_path, monkeypatch):
    """decode.py compiles the prompts' prefill from shapes and counts its temporaries with the
    parameters and the cache: on a device with room for those but not for the temporaries too,
    one memory error names them, before the (missing) checkpoint is read."""
    from conftest import tiny_config
    from tessera.checkpointing.storage import CheckpointError
    from tessera.decode import kv_cache_bytes, load_model, prefill_program
    from tessera.memory_fit import OutOfMemory, Room, bytes_per_device
    from tessera.mesh import create_mesh, named_shardings
    from tessera.models import build_model

    cfg = tiny_config(dtype="float32", max_target_length=600, load_parameters_path=str(tmp_path / "none"))
    mesh = create_mesh(tiny_config(ici_fsdp_parallelism=1).mesh, jax.devices()[:1])
    decoding = dict(prompts=[list(range(1, 500))] * 2, max_new_tokens=4, temperature=0.0, top_k=0)
    model = build_model(cfg.model, "dot_product")
    shardings = named_shardings(mesh, model.logical_axes(), model.param_shapes())
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            model.param_shapes(), shardings)
    with jax.set_mesh(mesh):
        temporaries = prefill_program(model, abstract, **decoding).memory_analysis().temp_size_in_bytes
    held = bytes_per_device(model.param_shapes(), shardings) + kv_cache_bytes(model, 2, 503, mesh)
    assert temporaries > held  # 2 prompts of 499 tokens: their activations outweigh a tiny model
    monkeypatch.setattr(memory_fit, "room", lambda devices: Room(held + temporaries // 2, False, 1, "tpu", "limit"))
    with pytest.raises(OutOfMemory, match=(
            r"not enough memory for the parameters and the KV cache with the prompts' prefill: .* per device "
            r"\(parameters .*, KV cache .* per device for 2 prompt\(s\) of up to 503 tokens, prefill temporaries "
            r"(\d+\.\d) MiB\); .*Nothing was allocated")) as error:
        load_model(cfg, mesh, decoding)
    assert float(re.search(r"prefill temporaries (\d+\.\d) MiB", str(error.value)).group(1)) == pytest.approx(
        temporaries / 2**20, abs=0.05)
    monkeypatch.setattr(memory_fit, "room", lambda devices: Room(held + temporaries, False, 1, "tpu", "limit"))
    with pytest.raises(CheckpointError, match="does not exist"):  # it fits: the load goes ahead, finds nothing
        load_model(cfg, mesh, decoding)


class _Gpu:
    platform = "gpu"

    def memory_stats(self):
        return {"bytes_limit": 60 * 2**30, "bytes_in_use": 58 * 2**30}


@pytest.mark.parametrize("fraction, said", [
    (None, "0.75 of the GPU's memory, JAX's default; xla_python_client_mem_fraction=0.9 gives it more"),
    ("0.9", "0.9 of the GPU's memory, XLA_PYTHON_CLIENT_MEM_FRACTION")])
def test_a_gpu_that_is_short_names_the_share_of_its_memory_jax_took(monkeypatch, fraction, said):
    """On a GPU the limit is the share of its memory JAX took at start-up (0.75 unless set): the error advised a
    smaller batch or more recomputation only, where xla_python_client_mem_fraction=0.9 would have made room."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    if fraction:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    with pytest.raises(memory_fit.OutOfMemory) as e:
        memory_fit.check_fits([_Gpu(), _Gpu()], 4 * 2**30, "the train state", "parameters")
    assert f"each gpu device has 2.0 GiB left (memory limit 60.0 GiB per device: {said}). Nothing was allocated" \
        in str(e.value)
