"""Checkpoints: resume == uninterrupted, restore on other meshes, SIGTERM/SIGKILL, bad checkpoints, NaN."""

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, tiny_config
from tessera.config import ConfigError, load_config
from tessera.checkpointing import CheckpointError, Checkpointer, load_full_state, load_parameters
from tessera.config.derived import checkpoint_directory
from tessera.step import abstract_state, setup
from tessera.train import run

TRAIN = [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml")]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _restore(ckpt_dir, step, cfg, devices=None):
    trainer = setup(cfg, devices)
    return Checkpointer(cfg.checkpoint, str(ckpt_dir)).restore(step, abstract_state(trainer))[0]


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_resume_is_bitwise_identical_to_uninterrupted(tmp_path):
    # The interrupted run stops after 2 of 4 steps (same schedule), like a preempted job.
    common = dict(checkpoint_period=100, enable_dropout=True, dropout_rate=0.1, learning_rate_schedule_steps=4)
    straight = tiny_config(tmp_path / "a", steps=4, **common)
    run(straight)
    run(tiny_config(tmp_path / "b", steps=2, **common))
    resumed = tiny_config(tmp_path / "b", steps=4, **common)
    report = run(resumed)
    assert report["start_step"] == 2 and report["steps"] == 2
    a, b = _losses(tmp_path / "a" / "test"), _losses(tmp_path / "b" / "test")
    assert [a[s] for s in (1, 2, 3, 4)] == [b[s] for s in (1, 2, 3, 4)]  # bitwise, CPU is deterministic
    final_a = _restore(tmp_path / "a" / "test" / "checkpoints", 4, straight)
    final_b = _restore(tmp_path / "b" / "test" / "checkpoints", 4, resumed)
    jax.tree.map(np.testing.assert_array_equal, final_a, final_b)


@pytest.mark.parametrize("async_checkpointing", [False, True])
def test_checkpoints_beyond_max_num_checkpoints_to_keep_are_removed_and_named(tmp_path, caplog, async_checkpointing):
    """max_num_checkpoints_to_keep keeps the newest N (no test held it to that); lowering it at a resume
    deleted the older checkpoints without a line in the log."""
    keys = dict(checkpoint_period=1, async_checkpointing=async_checkpointing)
    run(tiny_config(tmp_path, steps=4, **keys))
    folder = tmp_path / "test" / "checkpoints"
    assert sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) == [1, 2, 3, 4]
    with caplog.at_level(logging.INFO, logger="tessera"):
        run(tiny_config(tmp_path, steps=6, max_num_checkpoints_to_keep=2, **keys))
    assert sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) == [5, 6]
    removed = [int(n) for line in re.findall(r"checkpoint\(s\) ([\d, ]+) removed: max_num_checkpoints_to_keep=2 "
                                             r"keeps the newest", caplog.text) for n in line.split(", ")]
    assert removed == [1, 2, 3, 4]


@pytest.mark.parametrize("first, then", [("true", "false"), ("false", "true")])
def test_scan_layers_may_change_at_a_resume_and_a_parameter_load(tmp_path, caplog, first, then):
    """A checkpoint holds the blocks stacked ([layers, ...]) with scan_layers=true and one entry per block
    without: another scan_layers stopped every load with a mismatch (decode.py with scan_layers=false on a
    training checkpoint, say). Now the arrays are read as saved and split or stacked: a resume continues as
    the straight run does (the scanned and the looped model compute the same function), and parameters
    load block for block."""
    common = dict(checkpoint_period=100, learning_rate_schedule_steps=4, scan_layers=first)
    run(tiny_config(tmp_path / "a", steps=4, **common))
    run(tiny_config(tmp_path / "b", steps=2, **common))
    with caplog.at_level(logging.INFO, logger="tessera"):
        report = run(tiny_config(tmp_path / "b", steps=4, **{**common, "scan_layers": then}))
    assert report["start_step"] == 2
    assert f"saved with scan_layers={first}, restored with scan_layers={then}" in caplog.text
    a, b = _losses(tmp_path / "a" / "test"), _losses(tmp_path / "b" / "test")
    np.testing.assert_allclose([b[s] for s in (1, 2, 3, 4)], [a[s] for s in (1, 2, 3, 4)], rtol=1e-5)
    path = tmp_path / "a" / "test" / "checkpoints" / "4"
    saved = load_parameters(str(path), abstract_state(setup(tiny_config(scan_layers=first)))["params"])
    loaded = load_parameters(str(path), abstract_state(setup(tiny_config(scan_layers=then)))["params"])
    stacked, single = (saved, loaded) if first == "true" else (loaded, saved)
    for i in range(3):
        jax.tree.map(lambda x, y, i=i: np.testing.assert_array_equal(x[i], y), stacked["layers"], single[f"layers_{i}"])
    np.testing.assert_array_equal(stacked["token_embedder"]["table_vd"], single["token_embedder"]["table_vd"])


@pytest.fixture(scope="module")
def fsdp_source(tmp_path_factory) -> Path:
    """A run folder of 2 steps on 8 fsdp devices resumed to a third, trained once for both meshes of
    test_restore_onto_a_different_mesh (which only read it: they load its step 2 into runs of their own)."""
    src = tmp_path_factory.mktemp("fsdp_source")
    run(tiny_config(src, steps=2, ici_fsdp_parallelism=8))
    cont = run(tiny_config(src, steps=3, ici_fsdp_parallelism=8))
    assert cont["start_step"] == 2
    return src / "test"


@pytest.mark.parametrize("mesh", ["2 data x 4 tensor", "1 device"])
@pytest.mark.slow
def test_restore_onto_a_different_mesh(tmp_path, mesh, fsdp_source):
    expected = _losses(fsdp_source)[3]
    path = str(fsdp_source / "checkpoints" / "2")
    if mesh == "1 device":
        cfg, devices = tiny_config(tmp_path / "dst", steps=3, per_device_batch_size=8, load_full_state_path=path), \
            jax.devices()[:1]
    else:
        cfg, devices = tiny_config(tmp_path / "dst", steps=3, ici_data_parallelism=2, ici_fsdp_parallelism=1,
                                   ici_tensor_parallelism=4, load_full_state_path=path), None
    report = run(cfg, devices)
    assert report["start_step"] == 2
    # same weights and batch; only the order of float32 reductions differs across meshes
    np.testing.assert_allclose(_losses(tmp_path / "dst" / "test")[3], expected, rtol=1e-5)


def test_load_parameters_only(tmp_path, caplog):
    cfg = tiny_config(tmp_path / "src", steps=2)
    run(cfg)
    path = tmp_path / "src" / "test" / "checkpoints" / "2"
    saved = _restore(tmp_path / "src" / "test" / "checkpoints", 2, cfg)
    fresh = tiny_config(tmp_path / "dst", steps=1, load_parameters_path=str(path))
    params = load_parameters(str(path), abstract_state(setup(fresh))["params"])
    jax.tree.map(np.testing.assert_array_equal, params, saved["params"])
    assert run(fresh)["start_step"] == 0  # a fresh optimizer and step counter
    with pytest.raises(CheckpointError, match="does not exist"):
        load_parameters(str(tmp_path / "nowhere"), abstract_state(setup(fresh))["params"])
    # a save that was interrupted (Orbax's temporary name) is refused, even one that holds every file of its step
    interrupted = tmp_path / "2.orbax-checkpoint-tmp-17"
    shutil.copytree(path, interrupted)
    with pytest.raises(CheckpointError, match=r"2.orbax-checkpoint-tmp-17 is an incomplete \(interrupted\) save"):
        load_parameters(str(interrupted), abstract_state(setup(fresh))["params"])
    # parameters alone are read into another weight_dtype (MaxText's load_parameters_path does the same):
    # each the saved float32 value rounded to bfloat16, and the log says so; a full state is not (it is refused)
    half = tiny_config(tmp_path / "half", steps=1, load_parameters_path=str(path), weight_dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="tessera"):
        cast = load_parameters(str(path), abstract_state(setup(half))["params"])
    records = [r.getMessage() for r in caplog.records]
    for got, want in zip(jax.tree.leaves(cast), jax.tree.leaves(saved["params"])):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
    assert any(r.endswith("parameters are read in the config's weight_dtype (float32 -> bfloat16)") for r in records)
    assert run(half)["start_step"] == 0
    with pytest.raises(CheckpointError, match="checkpoint has dtype float32, this config expects bfloat16"):
        load_full_state(str(path), abstract_state(setup(half)))
    # through the trainer, a mismatch names the model keys the checkpoint's saved config differs in, for a
    # step folder and for its state item alike
    for where in (path, path / "state"):
        wide = tiny_config(tmp_path / "wide", steps=1, load_parameters_path=str(where), base_mlp_dim=48)
        with pytest.raises(CheckpointError) as e:
            run(wide)
        assert str(e.value).endswith("The config saved with it differs in its model keys: base_mlp_dim=40 (here 48)")
    # layers stacked against one entry per layer: the line names scan_layers either way, also for parameters
    # saved without a config (a converted checkpoint, whose mismatch said "its config is saved beside it")
    from tessera.checkpointing.trees import raise_on_mismatch

    stacked, single = (abstract_state(setup(tiny_config(scan_layers=scan)))["params"] for scan in (True, False))
    for saved_tree, expected, hint in [(stacked, single, "saved with scan_layers=true): set scan_layers=true"),
                                       (single, stacked, "saved with scan_layers=false): set scan_layers=false")]:
        with pytest.raises(CheckpointError) as e:
            raise_on_mismatch("ckpt", saved_tree, expected)
        assert f"The checkpoint holds {'its layers stacked' if saved_tree is stacked else 'one entry per layer'} (" \
               f"{hint}.\nUse the model settings the checkpoint was made with" in str(e.value)
    with pytest.raises(CheckpointError) as e:
        raise_on_mismatch("ckpt", stacked, abstract_state(setup(tiny_config(base_mlp_dim=48)))["params"])
    assert "scan_layers" not in str(e.value)


def test_a_checkpoint_of_another_depth_in_the_other_layout_names_both_block_counts(caplog):
    """2 blocks saved one entry per block, 3 expected stacked: the report's last line said 'set
    scan_layers=false', after which the load mismatched again (2 layers against 3); scan_layers may
    change at any load now, so the line names the two depths."""
    from tessera.checkpointing.trees import raise_on_mismatch, restacked

    single = abstract_state(setup(tiny_config(base_num_decoder_layers=2, scan_layers=False)))["params"]
    stacked = abstract_state(setup(tiny_config(base_num_decoder_layers=3)))["params"]
    target, _ = restacked({"params": single}, {"params": stacked})
    with pytest.raises(CheckpointError) as e:
        raise_on_mismatch("ckpt", {"params": single}, target)
    assert ("\nThe checkpoint holds decoder blocks 2, one entry per block (scan_layers=false); this config has 3, "
            "stacked (scan_layers=true or a pipeline): scan_layers may change at a load, the number of layers may "
            "not.\nUse the model settings") in str(e.value)
    assert "set scan_layers" not in str(e.value)
    # 2 stacked, 3 expected one entry each: compared stacked; no line says the blocks are split before the refusal
    stacked, single = (abstract_state(setup(tiny_config(base_num_decoder_layers=n, scan_layers=n == 2)))["params"]
                       for n in (2, 3))
    with caplog.at_level(logging.INFO, logger="tessera"), pytest.raises(CheckpointError, match=re.escape(
            "params/layers/mlp/wi_0: checkpoint has shape (2, 24, 40), this config expects (3, 24, 40)")):
        raise_on_mismatch("ckpt", {"params": stacked}, restacked({"params": stacked}, {"params": single})[0])
    assert "split per block" not in caplog.text


def test_a_whole_state_mismatch_lists_the_parameters_before_the_optimizer_state():
    """A wider model read as a whole state: the optimizer state's paths (mu and nu of each parameter)
    sorted before `params/` and filled the 20 lines shown, so no parameter was named."""
    from tessera.checkpointing.trees import raise_on_mismatch

    saved, wide = (abstract_state(setup(tiny_config(base_emb_dim=d))) for d in (24, 32))
    with pytest.raises(CheckpointError) as e:
        raise_on_mismatch("ckpt", saved, wide)
    shown = [line.strip().split(":")[0] for line in str(e.value).splitlines()[1:21]]
    params = [k for k in shown if k.startswith("params/")]
    assert len(params) >= 8 and shown[:len(params)] == params, shown
    assert all(k.startswith("opt_state/") for k in shown[len(params):]) and "\n  ... and " in str(e.value)


def test_restored_arrays_are_donated_in_place(tmp_path):
    """A restored array's buffer must be one the runtime owns: on CPU, Orbax left large arrays in
    the host buffers they were read into, which a donating step could not write over (13 of the
    tiny state's 39 arrays on one device), so the first step after a resume allocated a second
    state (a 2.05 GiB state: 5.2 GiB resident after that step, 3.2 after a fresh start's)."""
    cfg = tiny_config(tmp_path, steps=1)
    run(cfg)
    for devices in (jax.devices()[:1], None):
        trainer = setup(cfg, devices)
        for state in (Checkpointer(cfg.checkpoint, str(tmp_path / "test" / "checkpoints")).restore(
                          1, abstract_state(trainer))[0],
                      load_full_state(str(tmp_path / "test" / "checkpoints" / "1"), abstract_state(trainer))):
            shards = [s for x in jax.tree.leaves(state) for s in x.addressable_shards]
            before = {s.data.unsafe_buffer_pointer() for s in shards}
            out = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)(state)
            after = {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(out) for s in x.addressable_shards}
            assert after == before and len(shards) == len(before)


def test_load_paths_without_a_checkpoint_say_so(tmp_path):
    cfg = tiny_config(tmp_path, steps=2, checkpoint_period=1)
    run(cfg)
    abstract = abstract_state(setup(cfg))
    run_dir, ckpts = tmp_path / "test", tmp_path / "test" / "checkpoints"
    with pytest.raises(CheckpointError, match=f"^load_parameters_path={ckpts}/150 does not exist; "
                                               f"point it at a step folder such as {ckpts}/2$"):
        load_parameters(str(ckpts / "150"), abstract["params"])
    for folder in (run_dir, ckpts):  # a run folder or the checkpoints folder instead of a step folder
        with pytest.raises(CheckpointError) as e:
            load_full_state(str(folder), abstract)
        assert str(e.value) == (f"load_full_state_path={folder} holds no checkpoint (no state item, no Orbax "
                                f"metadata); point it at a step folder such as {ckpts}/2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint .* such as outputs/<run_name>/checkpoints/<step>"):
        load_parameters(str(tmp_path / "empty"), abstract["params"])
    with pytest.raises(CheckpointError, match=f"^checkpoint {tmp_path}/nowhere does not exist"):
        load_parameters(str(tmp_path / "nowhere"), abstract["params"], key=None)
    # a file (the run's config.yml, a file inside a step folder) was "no checkpoint", pointed at outputs/<run_name>/...
    for file, hint in ((run_dir / "config.yml", f"a step folder such as {ckpts}/2"),
                       (ckpts / "1" / "state" / "_METADATA", f"the step folder {ckpts}/1")):
        with pytest.raises(CheckpointError) as e:
            load_parameters(str(file), abstract["params"])
        assert str(e.value) == f"load_parameters_path={file} is a file, not a checkpoint folder; point it at {hint}"
    # another item of a step folder (data/, config/) or a folder inside its state item pointed at outputs/<run_name>/...
    for item in (ckpts / "1" / "config", ckpts / "1" / "data", ckpts / "1" / "state" / "ocdbt.process_0"):
        with pytest.raises(CheckpointError) as e:
            load_parameters(str(item), abstract["params"])
        assert str(e.value) == (f"load_parameters_path={item} holds no checkpoint (no state item, no Orbax metadata); "
                                f"point it at the step folder {ckpts}/1")
    # a step folder whose state item was deleted was "no checkpoint" too
    shutil.rmtree(ckpts / "1" / "state")
    with pytest.raises(CheckpointError) as e:
        load_parameters(str(ckpts / "1"), abstract["params"])
    assert str(e.value) == (f"load_parameters_path={ckpts}/1 is damaged: its state item (state/, the parameters and "
                            f"optimizer state) is missing; point it at a step folder such as {ckpts}/2")


@pytest.mark.parametrize("given", ["other/checkpoints/4", "other/checkpoints/4/state", "other"])
def test_a_checkpoint_dir_that_is_a_step_or_run_folder_is_refused(tmp_path, given):
    """checkpoint_dir at a step folder (meant as a load path), its state item or a run folder held no step
    folders: the run trained from step 0 and saved its steps inside that step folder, without a word."""
    step = tmp_path / "other" / "checkpoints" / "4"
    (step / "state").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    with pytest.raises(ConfigError) as e:
        run(tiny_config(tmp_path, steps=1, checkpoint_dir=str(tmp_path / given)), jax.devices()[:1])
    if given == "other":
        assert str(e.value).startswith(f"checkpoint_dir={tmp_path / given} is a run folder, whose step folders are in "
                                       f"{step.parent}: this run would start from step 0"), str(e.value)
    else:
        assert str(e.value).startswith(f"checkpoint_dir={tmp_path / given} is {'the' if given.endswith('4') else 'in the'}"
                                       f" step folder {step}, not a folder of step folders: this run would start from "
                                       f"step 0 and save inside it. To start from that step, use load_full_state_path="
                                       f"{step}"), str(e.value)
    assert sorted(p.name for p in step.iterdir()) == ["state"] and not (tmp_path / "test").exists()


@pytest.mark.parametrize("given", ["other/checkpoints/4", "other/checkpoints/4/state/runs", "other/checkpoints"])
def test_a_run_inside_another_runs_step_folder_is_refused(tmp_path, monkeypatch, given):
    """base_output_directory at a step folder (meant as a load path) or inside one trained there: the other
    run's max_num_checkpoints_to_keep then deleted that step folder, and this run's folder with it."""
    monkeypatch.chdir(tmp_path)  # a relative path, as typed
    step = tmp_path / "other" / "checkpoints" / "4"
    (step / "state").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    cfg = tiny_config(steps=1, enable_checkpointing=False, enable_tensorboard=False, base_output_directory=given,
                      run_name="test")
    if given == "other/checkpoints":  # beside the step folders, not in one: their run's cleanup leaves such a folder be
        run(cfg, jax.devices()[:1])
        assert (step.parent / "test" / "report.json").is_file() and sorted(p.name for p in step.iterdir()) == ["state"]
        return
    with pytest.raises(ConfigError) as e:
        run(cfg, jax.devices()[:1])
    where = "a step folder" if given.endswith("4") else f"in the step folder {step}"
    assert str(e.value) == (
        f"base_output_directory={tmp_path / given} is {where}, another run's checkpoint: when that run keeps only its "
        "newest checkpoints (max_num_checkpoints_to_keep) it deletes "
        f"the folder, and this run's files with it. To start from that step, use load_full_state_path={step} (or "
        f"load_parameters_path={step} for its parameters alone); give base_output_directory a folder outside it "
        f"(such as {tmp_path})")
    assert sorted(p.name for p in step.iterdir()) == ["state"] and sorted(p.name for p in (step / "state").iterdir()) \
        == ["_METADATA"]


@pytest.mark.parametrize("key", ["base_output_directory", "checkpoint_dir"])
def test_an_output_folder_that_is_a_dangling_link_names_the_link(tmp_path, key):
    """A dangling symbolic link as the output folder (a mount not there, a moved disk) was refused with
    "cannot be written: No such file or directory", naming neither the link nor where it points."""
    (tmp_path / "runs").symlink_to(tmp_path / "gone")
    keys = {key: str(tmp_path / "runs")} if key == "base_output_directory" else {key: str(tmp_path / "runs" / "ck")}
    with pytest.raises(ConfigError) as e:
        run(tiny_config(tmp_path, steps=1, **keys), jax.devices()[:1])
    assert f"cannot be written: {tmp_path / 'runs'} is a symbolic link to {tmp_path / 'gone'}, which does not " \
           "exist; choose another" in str(e.value), str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]

def test_training_from_quantized_parameters_says_why_they_do_not_fit(tmp_path):
    """load_parameters_path at decode.py's save_quantized_params_path output listed every matrix as missing and
    unexpected (qvalue, scale) and told the user to fix the model settings, which were right."""
    from tessera.tools.hf_checkpoint import save_params

    cfg = tiny_config(tmp_path, steps=1)
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_state(setup(cfg))["params"])
    table = params["token_embedder"]["table_vd"]
    params["token_embedder"]["table_vd"] = {"qvalue": table.astype(np.int8), "scale": np.ones(table.shape[:1] + (1,),
                                                                                                 np.float32)}
    save_params(tmp_path / "q8", params)
    with pytest.raises(CheckpointError) as e:
        run(tiny_config(tmp_path, steps=1, load_parameters_path=str(tmp_path / "q8")), jax.devices()[:1])
    assert str(e.value).endswith(f"\nload_parameters_path={tmp_path / 'q8'} holds quantized parameters (written by "
                                 "decode.py save_quantized_params_path), which only decode.py reads "
                                 "(checkpoint_is_quantized=true); train from the float checkpoint they were written "
                                 "from"), str(e.value)
    assert not (tmp_path / "test").exists()


def test_a_full_state_load_of_parameters_only_says_to_load_parameters(tmp_path):
    """load_full_state_path at a converted checkpoint (parameters only) listed every optimizer array as missing
    and told the user to use the model settings it was made with; the settings were right, the key was not."""
    from tessera.tools.hf_checkpoint import save_params

    cfg = tiny_config(tmp_path, steps=1)
    abstract = abstract_state(setup(cfg))
    params = jax.tree.map(lambda s: np.full(s.shape, 0.5, s.dtype), abstract["params"])
    save_params(tmp_path / "converted", params)
    with pytest.raises(CheckpointError) as e:
        load_full_state(str(tmp_path / "converted"), abstract)
    assert str(e.value) == (f"load_full_state_path={tmp_path / 'converted'} holds parameters only (a converted or "
                            "quantized checkpoint: no optimizer state, no step); start from it with "
                            f"load_parameters_path={tmp_path / 'converted'} instead")
    loaded = load_parameters(str(tmp_path / "converted"), abstract["params"])  # what the message says works
    assert all(np.all(np.asarray(x) == 0.5) for x in jax.tree.leaves(loaded))


def test_relative_load_path_is_reported_resolved_and_writes_nothing(tmp_path):
    proc = subprocess.run([*TRAIN, "run_name=ft", "load_parameters_path=outputs/demo/checkpoints/150"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (f"checkpoint error: load_parameters_path={tmp_path}/outputs/demo/checkpoints/150 does not exist"
            in proc.stderr)
    assert "does not match" not in proc.stderr and not (tmp_path / "outputs").exists()


def _train(tmp_path, *args, timeout=300, env=None):
    return subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}", "per_device_batch_size=1",
                           "max_target_length=16", "base_num_decoder_layers=2", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_a_save_longer_than_the_step_timeout_is_not_a_hang(tmp_path):
    """A synchronous save blocks the loop for longer than a step: here 5.5 to 8 s for a 2.4 GB
    state (200M parameters with Adam's moments, one device) under a 4 s step_timeout_seconds,
    while a step, the first one included, takes about 0.5 s (2 s and more beside the suite's other
    tests on a slow 2-core host, where a 2 s timeout and a smaller state made this test fail). The
    watchdog allows a blocking save its bytes at 20 MB/s beyond the timeout, so the save
    completes and the run ends normally; before, the watchdog ended it with exit 5 ("no training
    step finished") before Orbax had finished. The save must take longer than the timeout, or the
    run would prove nothing."""
    timeout = 4.0
    proc = _train(tmp_path, "steps=1", "checkpoint_period=1", "async_checkpointing=false",
                  f"step_timeout_seconds={timeout}", "base_num_decoder_layers=1", "vocab_size=96000",
                  "base_emb_dim=1024", env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    assert proc.returncode == 0 and "hang watchdog" not in proc.stderr, proc.stderr[-3000:]
    assert "200,018,944 parameters" in proc.stderr
    saved = re.search(r"checkpoint 1 saved in ([0-9.]+) s", proc.stderr)
    assert saved and float(saved.group(1)) > timeout, proc.stderr[-2000:]
    assert [p.name for p in (tmp_path / "sub" / "checkpoints").iterdir()] == ["1"]


@pytest.mark.slow
def test_a_last_checkpoint_write_that_stalls_is_ended_by_the_watchdog_and_keeps_the_one_before(tmp_path):
    """The last save's background write is waited for inside the hang watchdog, with the save's
    allowance. Here the finalize of step 2 stalls in Orbax's background thread (as on a hung NFS
    mount or bucket): the run ends with exit 5 naming that save, and every step folder left behind
    (1, and 2 when its files were written before the stall) restores with matching checksums.
    Before, the loop ended, the watchdog stopped, and the process hung in the final close."""
    script = (f"import sys, time; sys.path.insert(0, {str(REPO / 'src')!r})\n"
              "import orbax.checkpoint as ocp\n"
              "commit = ocp.CheckpointManager._finalize_checkpoint\n"
              "def stalled(self, step):\n"
              "    if step == 2:\n        time.sleep(120)\n"
              "    return commit(self, step)\n"
              "ocp.CheckpointManager._finalize_checkpoint = stalled\n"
              "from tessera.train import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    args = [*TRAIN[2:], "run_name=sub", f"base_output_directory={tmp_path}", "per_device_batch_size=1",
            "max_target_length=16", "base_num_decoder_layers=2", "steps=2", "checkpoint_period=1",
            "step_timeout_seconds=2"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 5, proc.stderr[-3000:]
    said = re.search(r"hang watchdog: checkpoint save of step 2 did not finish in ([0-9.]+) s "
                     r"\(step_timeout_seconds=2 plus ([0-9.]+) s allowed for it\)", proc.stderr)
    assert said and float(said[1]) >= 2 + float(said[2]) - 0.05, proc.stderr[-3000:]  # both printed rounded
    assert time.monotonic() - start < 100  # not the 120 s stall
    done, abstract = tmp_path / "sub" / "checkpoints", abstract_state(setup(load_config(args)))
    steps = sorted(int(p.name) for p in done.iterdir() if p.name.isdigit())
    assert steps[0] == 1 and all(int(load_full_state(str(done / str(s)), abstract)["step"]) == s for s in steps)


def test_orbax_logs_what_the_checkpointer_reports_itself_only_once(caplog):
    """Orbax's warning that a save waited for the previous one repeats our save line ("the loop
    waited X s (Y s for the previous save to finish, ...)"), and its ERROR records repeat the
    one error a failed save or read raises: both are dropped; its other records pass."""
    import orbax.checkpoint as ocp

    from tessera.checkpointing.storage import quiet_orbax_logs

    quiet_orbax_logs()
    orbax_file = str(Path(ocp.__file__).parent / "checkpoint_manager.py")
    absl = logging.getLogger("absl")
    records = [(logging.WARNING, "Waiting for previous save to complete took 3.200000 seconds. If this number is "
                "high, consider checkpointing less frequently.", orbax_file),
               (logging.ERROR, "Failed to save: disk full", orbax_file),
               (logging.WARNING, "Some other Orbax warning", orbax_file),
               (logging.WARNING, "Waiting for previous save to complete took 1 s", "/elsewhere/tool.py")]
    with caplog.at_level(logging.INFO):
        for level, message, path in records:
            absl.handle(logging.LogRecord("absl", level, path, 1, message, (), None))
    assert [r.getMessage() for r in caplog.records] == ["Some other Orbax warning",
                                                         "Waiting for previous save to complete took 1 s"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> Path:
    """The run folder of one `_train(..., "steps=2")` (its checkpoint of step 2), trained once per test file that
    uses it (test_faults.py too): each test that damages, changes or resumes it takes a copy of its own, at
    tmp_path/sub."""
    out = tmp_path_factory.mktemp("two_steps")
    proc = _train(out, "steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "sub"


@pytest.mark.slow
def test_incompatible_checkpoint_is_explained_and_left_untouched(tmp_path, two_steps):
    shutil.copytree(two_steps, tmp_path / "sub")
    ckpt = tmp_path / "sub" / "checkpoints"
    before = _tree_digest(ckpt)
    proc = _train(tmp_path, "steps=4", "base_emb_dim=128")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(ckpt / "2") in proc.stderr and "checkpoint has shape" in proc.stderr and "(256" in proc.stderr
    # the config saved with the checkpoint names the model keys that differ
    assert proc.stderr.rstrip().endswith("The config saved with it differs in its model keys: base_emb_dim=256 "
                                         "(here 128)")
    proc = _train(tmp_path, "steps=4", "weight_dtype=bfloat16")
    assert proc.returncode == 2 and "checkpoint has dtype float32, this config expects bfloat16" in proc.stderr
    assert 'differs in its model keys: weight_dtype="float32" (here "bfloat16")' in proc.stderr
    assert _tree_digest(ckpt) == before


def test_missing_checkpoint_files_are_reported(tmp_path, two_steps):
    shutil.copytree(two_steps, tmp_path / "sub")
    state_dir = tmp_path / "sub" / "checkpoints" / "2" / "state"
    victims = [p for p in state_dir.rglob("*") if p.is_file() and "manifest" in p.name or p.suffix == ".ocdbt"]
    victims = victims or [p for p in state_dir.rglob("*") if p.is_file() and p.stat().st_size > 1000]
    for p in victims:
        p.unlink()
    proc = _train(tmp_path, "steps=4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(tmp_path / "sub" / "checkpoints" / "2") in proc.stderr


def _wait_for(predicate, timeout, interval=0.005):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(interval)
    return False


@pytest.mark.slow
def test_sigterm_saves_and_exits_with_documented_code(tmp_path):
    cmd = [*TRAIN, "run_name=sub", f"base_output_directory={tmp_path}", "per_device_batch_size=1",
           "max_target_length=16", "steps=100000", "checkpoint_period=100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "sub" / "metrics.jsonl"
    assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 240, 0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    last = max(_losses(tmp_path / "sub"))
    assert (tmp_path / "sub" / "checkpoints" / str(last)).is_dir()
    assert "stopped by SIGTERM after step" in err
    again = _train(tmp_path, f"steps={last + 2}", "max_target_length=16", "base_num_decoder_layers=4")
    assert again.returncode == 0 and f"resuming from step {last}" in again.stderr


@pytest.mark.slow
def test_sigkill_during_async_save_never_loads_the_partial_checkpoint(tmp_path):
    # A state of ~170 MB makes each save take long enough to be caught in the middle.
    big = ["base_emb_dim=512", "base_mlp_dim=2048", "vocab_size=8192", "base_num_decoder_layers=2",
           "checkpoint_period=1", "async_checkpointing=true", "per_device_batch_size=1", "max_target_length=16"]
    for attempt in range(4):
        out = tmp_path / f"try{attempt}"
        proc = subprocess.Popen([*TRAIN, "run_name=sub", f"base_output_directory={out}", "steps=100000", *big],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ckpt = out / "sub" / "checkpoints"

        def saving():
            try:
                names = [p.name for p in ckpt.iterdir()]
            except FileNotFoundError:  # not made yet, or start-up's write probe removed it again
                return False
            return any(n.isdigit() for n in names) and any("tmp" in n for n in names)

        try:
            assert _wait_for(saving, 300), "no save was seen in progress within 300 s"
        finally:  # never leave the trainer running (it would fill the disk with checkpoints)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        partial = [p for p in ckpt.iterdir() if "orbax-checkpoint-tmp" in p.name]
        if partial:
            break
    else:
        pytest.fail("could not catch a save in progress in 4 attempts")
    complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    again = subprocess.run([*TRAIN, "run_name=sub", f"base_output_directory={out}", f"steps={complete[-1] + 1}", *big],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming from step {complete[-1]}" in again.stderr
    assert "incomplete checkpoint" in again.stderr and partial[0].name in again.stderr
    kept = list((out / "sub" / "checkpoints_incomplete").glob(partial[0].name + ".*"))
    assert len(kept) == 1 and kept[0].is_dir()  # reported and set aside, never deleted


def test_nonfinite_loss_stops_without_saving(tmp_path):
    proc = _train(tmp_path, "steps=6", "learning_rate=1e38", "warmup_steps_fraction=0", "checkpoint_period=1",
                  "gradient_clipping_threshold=0")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "non-finite loss" in proc.stderr and "last good checkpoint: step" in proc.stderr
    # the advice names the values the run had, and the direction that helps (it said "raise" the clipping threshold)
    assert ("Lower learning_rate (now 1e+38), raise warmup_steps_fraction (now 0) or turn on gradient clipping "
            "(gradient_clipping_threshold=1.0; it is 0, off), or set on_nonfinite_loss=skip_step; learning_rate x "
            "adam_weight_decay = 1e+37 >= 1 makes AdamW's weight decay flip the weights' sign every step: lower "
            "adam_weight_decay") in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "sub" / "metrics.jsonl").read_text().splitlines()]
    bad = records[-1]["step"]
    assert None in (records[-1]["loss"], records[-1]["grad_norm"])  # a non-finite number is written as null
    saved = sorted(int(p.name) for p in (tmp_path / "sub" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and max(saved) < bad


def test_skip_step_keeps_the_state_finite(tmp_path):
    proc = _train(tmp_path, "steps=4", "learning_rate=1e38", "warmup_steps_fraction=0", "gradient_clipping_threshold=0",
                  "on_nonfinite_loss=skip_step")
    assert proc.returncode == 0 and "update skipped" in proc.stderr
    run_cfg = load_config([str(REPO / "configs" / "base.yml"), "per_device_batch_size=1", "max_target_length=16",
                           "base_num_decoder_layers=2", "gradient_clipping_threshold=0"], env={})
    state = _restore(tmp_path / "sub" / "checkpoints", 4, run_cfg)
    assert all(bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(state["params"]))


def test_checkpoint_directory_keeps_bucket_urls():
    cfg = tiny_config().checkpoint
    assert checkpoint_directory(cfg, "gs://bucket/runs/", "r1") == "gs://bucket/runs/r1/checkpoints"
    assert checkpoint_directory(cfg, "outputs", "r1") == "outputs/r1/checkpoints"
    custom = tiny_config(checkpoint_dir="gs://other/ckpts").checkpoint
    assert checkpoint_directory(custom, "outputs", "r1") == "gs://other/ckpts"


def test_exit_code_table_lists_every_code_the_trainer_returns():
    import tessera.distributed
    import tessera.hang_watchdog
    import tessera.step_stats
    import tessera.tools.cli
    import tessera.train

    text = (REPO / "getting_started" / "Checkpointing.md").read_text()
    table = text[text.index("## Exit codes"):].split("\n## ")[0]
    documented = {int(m) for m in re.findall(r"^\| (\d+) \|", table, flags=re.M)}
    modules = (tessera.train, tessera.distributed, tessera.hang_watchdog, tessera.step_stats)
    constants = {name: int(value) for module in modules for name, value in vars(module).items()
                 if name.startswith("EXIT_")}
    constants["EXIT_NOT_INSTALLED"] = tessera.tools.cli.EXIT_NOT_INSTALLED  # train.py run by a Python without jax
    assert documented == set(constants.values()), (documented, constants)
    assert {0, 1, 2, 3, 4, 5, 6, 130, 143} <= documented


def test_a_late_completion_on_a_closed_orbax_loop_is_dropped_quietly():
    # Orbax closes its loop when one array of a damaged checkpoint fails; a TensorStore thread
    # may still complete another read afterwards (seen once in CI as a printed traceback).
    import threading
    from tessera.checkpointing.storage import _TidyEventLoop

    loop = _TidyEventLoop()
    loop.close()
    errors = []

    def late():
        try:
            assert loop.call_soon_threadsafe(print, "never runs") is None
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=late)
    t.start()
    t.join()
    assert errors == []
    open_loop = _TidyEventLoop()  # an open loop still schedules as usual
    assert open_loop.call_soon_threadsafe(lambda: None) is not None
    open_loop.close()


def test_abandoned_storage_failures_are_not_echoed(caplog):
    """A full disk fails every array's write; Orbax raises the first (the trainer reports it) and
    the others end as finished tasks nobody retrieves. Their echoes are dropped at garbage
    collection; an unretrieved exception of any other kind is still reported."""
    import asyncio
    import gc
    from tessera.checkpointing.storage import _TidyEventLoop

    async def fails(exc):
        raise exc

    def abandon(exc):
        loop = _TidyEventLoop()
        task = loop.create_task(fails(exc))
        loop.run_until_complete(asyncio.sleep(0.01))
        assert task.done()
        loop.close()
        del task
        gc.collect()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        abandon(ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.mu" ... No space left on device'))
        assert not [r for r in caplog.records if r.name == "asyncio"]
        abandon(KeyError("a bug"))
        assert any("never retrieved" in r.getMessage() for r in caplog.records if r.name == "asyncio")


def _flip_middle_bytes(path: Path) -> None:
    """Change 64 bytes in the middle of `path`, keeping its size: what Orbax's own checks cannot see."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    path.write_bytes(bytes(data))


def _largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("async_save", [True, False])
@pytest.mark.slow
def test_every_save_records_the_checksums_of_its_items_and_logs_its_time(tmp_path, async_save, caplog):
    from tessera.checkpointing.checksums import MANIFEST, crc32c, problem

    with caplog.at_level(logging.INFO, logger="tessera.checkpointing"):
        run(tiny_config(tmp_path, steps=2, checkpoint_period=1, async_checkpointing=async_save))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint ")]
    ckpt, size = tmp_path / "test" / "checkpoints", r"\d+\.\d MiB on this process's devices"
    if async_save:  # where the loop waited, then (by the next save, or at the end) when the write was done
        assert len(said) == 4 and all(re.fullmatch(pattern, line) for pattern, line in zip((
            rf"checkpoint 1: the loop waited [\d.]+ s \({size} copied to host\); writing {ckpt / '1'} in the background",
            rf"checkpoint 1 written in [\d.]+ s: {ckpt / '1'}",
            rf"checkpoint 2: the loop waited [\d.]+ s \(([\d.]+ s for the previous save to finish, then )?{size} copied "
            rf"to host\); writing {ckpt / '2'} in the background",
            rf"checkpoint 2 written in [\d.]+ s: {ckpt / '2'}"), said)), said
    else:
        assert len(said) == 2 and all(re.fullmatch(rf"checkpoint {step} saved in [\d.]+ s \({size}\): {ckpt / str(step)}",
                                                   line) for step, line in zip((1, 2), said)), said
    for step in (1, 2):
        folder = tmp_path / "test" / "checkpoints" / str(step)
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        # every file of the items; the step's own top-level metadata, which Orbax rewrites at commit, is not listed
        items = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.parent != folder}
        assert set(listed) == items
        assert {n for n in listed if n.startswith("state/")} and {n for n in listed if n.startswith("data/")}
        for name, entry in listed.items():
            assert entry == {"size": (folder / name).stat().st_size, "crc32c": crc32c(folder / name)}
        assert problem(folder) is None


@pytest.mark.slow
def test_a_file_changed_after_the_save_is_reported_and_never_trained_on(tmp_path):
    assert _train(tmp_path, "steps=2", "checkpoint_period=1").returncode == 0
    ckpt = tmp_path / "sub" / "checkpoints"
    victim = _largest_file(ckpt / "2" / "state")
    _flip_middle_bytes(victim)
    before = _tree_digest(ckpt)
    proc = _train(tmp_path, "steps=3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"checkpoint error: checkpoint {ckpt / '2'} is damaged: its file {victim.relative_to(ckpt / '2')} has "
            "changed since it was saved (its CRC32C differs). Move it away "
            f"(e.g. mv {ckpt / '2'} {ckpt / '2'}.damaged) to resume from step 1") in proc.stderr
    assert _tree_digest(ckpt) == before  # nothing loaded, nothing saved over it
    (ckpt / "2").rename(ckpt / "2.damaged")  # what the message says to do
    again = _train(tmp_path, "steps=3")
    assert again.returncode == 0 and "resuming from step 1" in again.stderr, again.stderr[-3000:]
    assert re.search(rf"checksums of \d+ files \([\d.]+ MiB\) under {ckpt / '1'}/? match", again.stderr)


def test_load_paths_verify_the_checksums(tmp_path, caplog):
    from tessera.checkpointing.checksums import MANIFEST

    cfg = tiny_config(tmp_path, steps=1)
    run(cfg)
    step = tmp_path / "test" / "checkpoints" / "1"
    abstract = abstract_state(setup(cfg))
    victim = _largest_file(step / "state")
    original = victim.read_bytes()
    _flip_middle_bytes(victim)
    damaged = (f"is damaged: its file {victim.relative_to(step)} has changed since it was saved (its CRC32C "
               "differs). Nothing was loaded; point it at a step folder such as")
    with pytest.raises(CheckpointError) as e:
        load_parameters(str(step), abstract["params"])
    assert str(e.value).startswith(f"load_parameters_path={step} {damaged}")
    with pytest.raises(CheckpointError) as e:
        load_full_state(str(step / "state"), abstract)  # an item folder: the step's list covers it
    assert str(e.value).startswith(f"load_full_state_path={step / 'state'} {damaged}")
    victim.write_bytes(original)  # intact files, but a list that disagrees: checkpoint_checksums=false reads them
    listed = json.loads((step / MANIFEST).read_text())
    listed["files"][str(victim.relative_to(step))]["crc32c"] ^= 1
    (step / MANIFEST).write_text(json.dumps(listed))
    with pytest.raises(CheckpointError, match="its CRC32C differs"):
        load_full_state(str(step), abstract)
    load_full_state(str(step), abstract, verify=False)
    (step / MANIFEST).write_text('{"format": 1, "files": {')
    with pytest.raises(CheckpointError, match=f"^load_parameters_path={step} is damaged: its checksum list "
                                              f"{MANIFEST} cannot be read \\(JSONDecodeError"):
        load_parameters(str(step), abstract["params"])
    (step / MANIFEST).unlink()  # as saved before checksums were recorded: read, with a line saying so
    with caplog.at_level(logging.INFO, logger="tessera"):
        load_parameters(str(step), abstract["params"])
    assert f"{step / 'state'} has no checksum list ({MANIFEST}): read without verifying its files" in caplog.text


@pytest.mark.parametrize("saved_with", ["checksums", "no checksums", "a bucket", "no config"])
def test_a_missing_checksum_list_is_a_warning_when_the_run_that_saved_it_recorded_one(tmp_path, caplog, saved_with):
    """A step whose config says it was saved with checkpoint_checksums=true into a local folder had a list:
    without it (deleted, or the process ended between a sync save and its list) its files were read
    unverified after an INFO line, as for checkpoints that never had one."""
    from tessera.checkpointing.checksums import MANIFEST, check

    step = tmp_path / "checkpoints" / "3"
    (step / "config").mkdir(parents=True)
    (step / "state").mkdir()
    saved = {"checksums": dict(checkpoint_checksums=True, checkpoint_dir="", base_output_directory=str(tmp_path)),
             "no checksums": dict(checkpoint_checksums=False, checkpoint_dir="", base_output_directory=str(tmp_path)),
             "a bucket": dict(checkpoint_checksums=True, checkpoint_dir="gs://b/c", base_output_directory=str(tmp_path)),
             "no config": None}[saved_with]
    if saved is not None:
        (step / "config" / "metadata").write_text(json.dumps(saved))
    for target in (step, step / "state"):  # a resume, a load path
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tessera"):
            assert check(target) is None
        [record] = [r for r in caplog.records if "checksum list" in r.getMessage()]
        assert record.getMessage().startswith(f"{target} has no checksum list ({MANIFEST}): read without verifying "
                                              "its files")
        expected = saved_with == "checksums"
        assert (record.levelno == logging.WARNING) == expected
        assert ("though the run that saved it recorded one (checkpoint_checksums=true)" in record.getMessage()) == expected


def test_a_resume_from_a_step_without_its_config_says_its_settings_are_not_compared(tmp_path, caplog):
    """With checkpoint_checksums=false a step whose config item was deleted or damaged resumed without a
    word, and so without naming the settings changed since (here the learning-rate schedule's length)."""
    keys = dict(checkpoint_checksums=False, learning_rate_schedule_steps=2)
    run(tiny_config(tmp_path, steps=1, **keys))
    folder = tmp_path / "test" / "checkpoints" / "1"
    (folder / "config" / "metadata").write_text("{damaged")
    with caplog.at_level(logging.INFO, logger="tessera"):
        report = run(tiny_config(tmp_path, steps=2, **{**keys, "learning_rate_schedule_steps": 4}))
    assert report["start_step"] == 1
    assert (f"checkpoint {folder} keeps no readable config (config/metadata): the settings step 1 was saved with are "
            "not compared with this run's") in caplog.text
    assert "settings changed since" not in caplog.text


def test_a_step_without_orbaxs_metadata_file_resumes_with_its_warning_once(tmp_path, caplog):
    """A step folder whose _CHECKPOINT_METADATA (Orbax's step metadata) was lost resumes; Orbax's warning that
    it is missing was printed twice, once as the steps were listed and once as the step was read."""
    run(tiny_config(tmp_path, steps=1))
    missing = tmp_path / "test" / "checkpoints" / "1" / "_CHECKPOINT_METADATA"
    missing.unlink()
    with caplog.at_level(logging.WARNING):
        assert run(tiny_config(tmp_path, steps=2))["start_step"] == 1
    assert caplog.text.count(f"Metadata file does not exist: {missing}") == 1, caplog.text


def test_an_unreadable_checksum_list_says_that_deleting_it_reads_the_files_unverified(tmp_path):
    """A damaged list was refused with only 'move the step away', which gives up a step whose arrays may be
    intact; deleting the list (what a missing list means: read unverified, with a line) is the other way."""
    from tessera.checkpointing.checksums import MANIFEST, check

    (tmp_path / "state").mkdir()
    (tmp_path / MANIFEST).write_text('{"format": 1, "files": {')
    why = check(tmp_path)
    assert why.startswith(f"its checksum list {MANIFEST} cannot be read (JSONDecodeError: ")
    assert why.endswith(f"); if the list alone is damaged, deleting it ({tmp_path / MANIFEST}) reads the files "
                        "without verifying them")


def test_a_slow_checksum_list_says_what_it_cost(tmp_path, monkeypatch, caplog):
    from tessera.checkpointing import checksums

    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "a").write_bytes(b"x" * 1000)
    (tmp_path / "top").write_text("left out: a top-level file of a step folder")
    with caplog.at_level(logging.DEBUG, logger="tessera"):
        checksums.record(tmp_path, items_only=True)
    assert [r.levelno for r in caplog.records if "recorded checksums" in r.message] == [logging.DEBUG]
    monkeypatch.setattr(checksums, "SLOW_SECONDS", 0.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        checksums.record(tmp_path, items_only=True)
    assert [r.message for r in caplog.records] == [
        f"recorded checksums of 1 files (0.0 GiB) under {tmp_path} in 0.0 s (checkpoint_checksums=false skips them)"]
    assert list(json.loads((tmp_path / checksums.MANIFEST).read_text())["files"]) == ["params/a"]


def test_each_process_lists_the_files_it_wrote_and_process_0_merges_those_lists(tmp_path, caplog):
    """Process 1's own list of its array files goes into the step's list as it is: process 0 does
    not read those files back (a listed CRC that differs from the file's proves it), hashes the
    rest itself, reads a listed file again when its size changed since, says so of a list it
    cannot read, and removes the lists."""
    from tessera.checkpointing import checksums

    item = tmp_path / "state.orbax-checkpoint-tmp"  # the item folder while the save is in progress
    (item / "ocdbt.process_1" / "d").mkdir(parents=True)
    (item / "ocdbt.process_1" / "d" / "a").write_bytes(b"a" * 1000)
    (item / "ocdbt.process_1" / "manifest.ocdbt").write_bytes(b"m" * 10)
    (item / "_METADATA").write_text("{}")  # process 0's: not in process 1's list
    checksums.record_share(item, "state", 1)
    checksums.record_share(item, "state", 0)  # wrote no array files here: an empty list
    share = tmp_path / checksums.SHARE.format(1)
    own = json.loads(share.read_text())["files"]
    assert own == {f"state/ocdbt.process_1/{n}": {"size": (item / "ocdbt.process_1" / n).stat().st_size,
                                                  "crc32c": checksums.crc32c(item / "ocdbt.process_1" / n)}
                   for n in ("d/a", "manifest.ocdbt")}
    item.rename(tmp_path / "state")  # Orbax's commit of the item
    own["state/ocdbt.process_1/d/a"]["crc32c"] ^= 1
    own["state/ocdbt.process_1/manifest.ocdbt"]["size"] = 11  # changed since: read again
    share.write_text(json.dumps({"format": 1, "algorithm": "crc32c", "files": own}))
    (tmp_path / checksums.SHARE.format(2)).write_text('{"format": 1, "files": {')  # cut short
    with caplog.at_level(logging.WARNING, logger="tessera"):
        checksums.record(tmp_path, items_only=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / checksums.SHARE.format(2)} cannot be read (JSONDecodeError); its files' checksums are "
        "recorded from the files"]
    listed = json.loads((tmp_path / checksums.MANIFEST).read_text())["files"]
    state, own_files = tmp_path / "state", tmp_path / "state" / "ocdbt.process_1"
    assert listed == {
        "state/_METADATA": {"size": 2, "crc32c": checksums.crc32c(state / "_METADATA")},
        "state/ocdbt.process_1/d/a": {"size": 1000, "crc32c": checksums.crc32c(own_files / "d" / "a") ^ 1},
        "state/ocdbt.process_1/manifest.ocdbt": {"size": 10, "crc32c": checksums.crc32c(own_files / "manifest.ocdbt")}}
    assert not list(tmp_path.glob(".tessera_checksums*"))


def test_a_step_set_aside_twice_in_one_second_keeps_both(tmp_path):
    """A save that failed is set aside at once, and what Orbax left of it when the manager closed
    is set aside again, often within the same second: the second move gets its own name (CI saw
    it fail on the first's, after the disk-full message had been printed)."""
    from etils import epath
    from tessera.checkpointing.manager import INCOMPLETE_MARKER, set_aside_incomplete

    directory = epath.Path(tmp_path) / "checkpoints"
    directory.mkdir()
    moved = []
    for content in ("first", "second"):
        (directory / f"2{INCOMPLETE_MARKER}").mkdir()
        (directory / f"2{INCOMPLETE_MARKER}" / "part").write_text(content)
        moved += set_aside_incomplete(directory)
    assert len(set(moved)) == 2 and not list(directory.iterdir())
    assert sorted((p / "part").read_text() for p in moved) == ["first", "second"]


def test_gradient_clipping_turned_on_or_off_at_a_resume_reads_the_saved_state(tmp_path, caplog):
    """The clip adds an empty slot in front of the optimizer state, so a resume with clipping turned
    off (or on, as the advice after a non-finite stop says) stopped on a mismatch. The state is now
    read as saved: the first step after the resume sees the saved parameters (its loss equals the
    straight run's), and the optimizer's moments come back."""
    common = dict(checkpoint_period=100, learning_rate_schedule_steps=6)
    run(tiny_config(tmp_path / "a", steps=3, **common))
    run(tiny_config(tmp_path / "b", steps=2, **common))
    with caplog.at_level(logging.INFO, logger="tessera"):
        off = run(tiny_config(tmp_path / "b", steps=4, gradient_clipping_threshold=0.0, **common))
        on = run(tiny_config(tmp_path / "b", steps=6, gradient_clipping_threshold=0.5, **common))
    assert (off["start_step"], on["start_step"]) == (2, 4)
    assert "saved with gradient clipping on, restored with it off" in caplog.text
    assert "saved with gradient clipping off, restored with it on" in caplog.text
    assert _losses(tmp_path / "a" / "test")[3] == _losses(tmp_path / "b" / "test")[3]
    cfg = tiny_config(tmp_path / "b", steps=6, gradient_clipping_threshold=0.5, **common)
    moments = _restore(tmp_path / "b" / "test" / "checkpoints", 6, cfg)["opt_state"][1][0].mu
    assert any(np.abs(np.asarray(m)).max() > 0 for m in jax.tree.leaves(moments))


def test_a_resume_with_another_optimizer_says_how_to_switch(tmp_path):
    run(tiny_config(tmp_path, steps=2, checkpoint_period=100))
    with pytest.raises(CheckpointError) as e:
        run(tiny_config(tmp_path, steps=4, checkpoint_period=100, opt_type="muon"))
    step = tmp_path / "test" / "checkpoints" / "2"
    assert str(e.value) == (  # one reason, not the optimizer state's paths
        f"checkpoint {step} was saved by opt_type=adamw (here muon), whose state this optimizer cannot read; to switch "
        f"optimizers, start a new run_name with load_parameters_path={step} (its parameters, with a fresh optimizer "
        "state). Nothing was loaded or overwritten.")
    # with a model key changed as well, both reasons, after the differences
    with pytest.raises(CheckpointError) as e:
        run(tiny_config(tmp_path, steps=4, checkpoint_period=100, opt_type="muon", base_emb_dim=32))
    lines = str(e.value).splitlines()
    assert lines[-2].startswith("The config saved with it differs in its model keys: base_emb_dim=24 (here 32)")
    assert lines[-1].startswith(f"checkpoint {step} was saved by opt_type=adamw (here muon)")


def test_a_resume_in_another_weight_dtype_says_how_to_switch(tmp_path):
    """A resume with weight_dtype changed is refused (the state is read as saved), and the message's
    only advice was the generic "use the saved settings or start a new run_name", which starts from
    scratch; load_parameters_path reads the parameters into the new weight_dtype, and it now says so."""
    run(tiny_config(tmp_path, steps=2, checkpoint_period=100))
    with pytest.raises(CheckpointError) as e:
        run(tiny_config(tmp_path, steps=4, checkpoint_period=100, weight_dtype="bfloat16"))
    step = tmp_path / "test" / "checkpoints" / "2"
    assert str(e.value).endswith(
        f"to train on in weight_dtype=bfloat16, start a new run_name with load_parameters_path={step} (its "
        "parameters, read into weight_dtype, with a fresh optimizer state).")


SET_ASIDE_SCRIPT = """
import sys, time
from etils import epath
from tessera.checkpointing.manager import set_aside_incomplete
start = float(sys.argv[2])
while time.time() < start:  # both processes list the folder at the same moment
    pass
print(len(set_aside_incomplete(epath.Path(sys.argv[1]))))
"""


def test_a_file_where_interrupted_saves_are_moved_is_one_line(tmp_path):
    """`checkpoints_incomplete` as a file ended the start in a FileExistsError traceback (exit 1)."""
    from tessera.checkpointing import set_aside_incomplete
    from etils import epath

    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").mkdir(parents=True)
    (tmp_path / "checkpoints_incomplete").write_text("")
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/checkpoints_incomplete is a file, where interrupted saves "
                                              "such as 3.orbax-checkpoint-tmp are moved; move it away"):
        set_aside_incomplete(epath.Path(tmp_path / "checkpoints"))
    assert (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").is_dir()


def test_a_file_named_as_a_step_is_refused_not_deleted_by_that_step_s_save(tmp_path):
    """A file `checkpoints/6` was not taken for a checkpoint, and the save of step 6 deleted it without a word."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "6").write_text("notes")
    with pytest.raises(CheckpointError, match=f"^{tmp_path}/ckpt/6 is a file, where the checkpoint of step 6 would be "
                                              "saved .* move it away"):
        Checkpointer(tiny_config(tmp_path).checkpoint, str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "6").read_text() == "notes"


def test_a_parameters_only_checkpoint_named_as_a_step_is_refused_not_called_damaged(tmp_path):
    """decode.py save_quantized_params_path=<run>/checkpoints/999 wrote a {"params": ...} checkpoint where the run
    keeps its steps: the resume took it for step 999 and called it damaged (its state/_METADATA missing), and
    max_num_checkpoints_to_keep would have deleted one with an older number. It is named for what it is."""
    import orbax.checkpoint as ocp

    directory = tmp_path / "checkpoints"
    ocp.PyTreeCheckpointer().save(directory / "999", {"params": {"w": np.ones((2, 3), np.float32)}})
    with pytest.raises(CheckpointError) as e:
        Checkpointer(tiny_config(tmp_path).checkpoint, str(directory))
    assert str(e.value) == (f"{directory}/999 is a parameters-only checkpoint (decode.py save_quantized_params_path "
                            "or the converter wrote it), not a training step: its name makes it step 999 of this "
                            f"run, to resume from or to delete. Move it out of {directory} (e.g. mv {directory}/999 "
                            f"{tmp_path}/params-999) and run the same command again")
    assert (directory / "999" / "_METADATA").exists()


def test_processes_setting_aside_the_same_interrupted_saves_do_not_trip_over_each_other(tmp_path):
    """Every process of a job sets interrupted saves aside at start-up; on a shared folder the second
    one's rename found the folder gone (FileNotFoundError, a traceback and exit 1 on every restart
    after a kill -9 during a save). Each folder is now moved once, by whichever process comes first."""
    import time

    from tessera.checkpointing.manager import INCOMPLETE_MARKER

    directory = tmp_path / "checkpoints"
    directory.mkdir()
    for step in range(300):
        (directory / f"{step}{INCOMPLETE_MARKER}").mkdir()
    start = str(time.time() + 3)
    procs = [subprocess.Popen([sys.executable, "-c", SET_ASIDE_SCRIPT, str(directory), start],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0 and "Traceback" not in err, err[-2000:]
    assert sum(int(out) for out, _, _ in results) == 300  # each moved once
    assert not list(directory.iterdir()) and len(list((tmp_path / "checkpoints_incomplete").iterdir())) == 300


def test_a_save_compiles_nothing_for_replicated_arrays(tmp_path):
    """An array replicated over the devices is saved from one replica whole: Orbax's default cut it into
    a slice per replica by an eager jit(slice), a program per shape and device compiled at the run's
    first save (data=2 x fsdp=4 on 8 CPU devices: the loop waited 3 s for a 5.7 MiB state)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    state = {"step": jax.device_put(jnp.int32(3), NamedSharding(mesh, P())),
             "scale": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P())),
             "w": jax.device_put(jnp.ones((8, 12)), NamedSharding(mesh, P("fsdp")))}  # replicated over data
    compiles = []

    def listen(event, seconds, **_):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    ckpt = Checkpointer(tiny_config(tmp_path).checkpoint, str(tmp_path / "ckpt"))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        ckpt.save(1, state, {}, {})
        ckpt.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = ckpt.restore(1, abstract)[0]
    ckpt.close()
    assert all(np.array_equal(restored[k], state[k]) for k in state)


def test_a_save_counts_a_replicated_shard_once_in_what_it_copies_to_host(tmp_path, caplog):
    """The save's log line added up every device's copy of a shard: on data 2 x fsdp 4 (First_run.md's `sharded`
    run) the demo's 42.0 MiB state was said to be 84.2 MiB copied to host, where Orbax copies one replica."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    weights = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB
    state = {"fsdp_only": jax.device_put(weights, NamedSharding(mesh, P(None, "fsdp"))),  # 2 copies of each shard
             "both": jax.device_put(weights, NamedSharding(mesh, P("data", "fsdp"))),  # one
             "replicated": jax.device_put(weights, NamedSharding(mesh, P())),  # 8 copies
             "step": jax.device_put(np.int32(3), NamedSharding(mesh, P()))}
    checkpointer = Checkpointer(tiny_config(tmp_path, async_checkpointing=False).checkpoint, str(tmp_path / "ckpt"))
    with caplog.at_level(logging.INFO, logger="tessera.checkpointing"):
        checkpointer.save(1, state, {}, {})
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint 1 saved")]
    assert len(said) == 1 and "(6.0 MiB on this process's devices)" in said[0], said  # 3 x 2 MiB and 4 bytes
    checkpointer.close()


def test_saves_do_not_ask_tensorstore_for_its_byte_counts(tmp_path, monkeypatch):
    """A long run's host memory: Orbax asked TensorStore for its bytes written before and after every
    array save (a throughput line it logs at INFO), and each answer of experimental_collect_matching_metrics
    is never freed (about 3 KB a call with tensorstore 0.1.86): 18 KB of host memory per checkpoint held
    for good, 180 MB over 10,000 saves. The Checkpointer turns the count off; its saves still restore."""
    import tensorstore

    calls = []
    collect = tensorstore.experimental_collect_matching_metrics
    monkeypatch.setattr(tensorstore, "experimental_collect_matching_metrics",
                        lambda *a, **k: calls.append(a) or collect(*a, **k))
    ckpt = Checkpointer(tiny_config(tmp_path, max_num_checkpoints_to_keep=2).checkpoint, str(tmp_path / "ckpt"))
    state = {"w": jnp.arange(12.0).reshape(3, 4), "step": jnp.array(7)}
    for step in range(1, 5):
        ckpt.save(step, state, {"step": step}, {})
    ckpt.wait()
    assert calls == []
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    restored = ckpt.restore(4, abstract)[0]
    ckpt.close()
    assert ckpt.manager.all_steps() == [3, 4] and np.array_equal(restored["w"], state["w"])
