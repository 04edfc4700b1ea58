"""dump_hlo (tessera.xla_dump): XLA's dump of the train step, from train.py and train_compile as a user runs them
(relative paths), with the persistent compilation cache in use; the flags it sets; its errors."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, tiny_config
from tessera.config import ConfigError
from tessera.config.loader import load_config
from tessera.xla_dump import apply_hlo_dump, dump_flags

BASE = str(REPO / "configs" / "base.yml")


def _run(tool, *args, cwd, env=None):
    return subprocess.run([sys.executable, *tool, BASE, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, env=env)


def _dumped(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_train_dumps_the_train_step_each_run_though_the_cache_holds_it(tmp_path):
    """Two runs with the same jax_cache_dir: both dump the train step (the dump flags are not in the cache's key, so
    the cache is off under dump_hlo), and only it (dump_hlo_module_name=jit_train_step). The demo model on a batch
    of 8 x 16 tokens: its default 64 x 128 took 7 s a step here, at the tests' fast-compile level."""
    for name in ("first", "again"):
        proc = _run([str(REPO / "train.py")], "steps=2", "per_device_batch_size=1", "max_target_length=16",
                    "dump_hlo=true", "jax_cache_dir=cache",
                    "base_output_directory=outputs", f"run_name={name}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        files = _dumped(tmp_path / "outputs" / name / "xla_dump")
        assert any(f.endswith(".jit_train_step.before_optimizations.txt") for f in files), files
        assert any(".jit_train_step." in f and f.endswith("after_optimizations.txt") for f in files), files
        assert files and all(".jit_train_step" in f for f in files), files
        assert "HLO dump: programs matching 'jit_train_step'" in proc.stderr
    assert "persistent compilation cache is off" in proc.stderr
    # without dump_hlo no folder is made: test_readme_commands' quick start checks its run folder


def test_train_compile_dumps_the_tpu_program(tmp_path):
    """The AOT compile for a TPU topology (libtpu on this CPU host) dumps the TPU compiler's program, to a folder
    of the user's (relative), every program with dump_hlo_module_name=''. A batch of 8 x 16 tokens: the TPU
    compiler took three times as long (26 s of CPU time) on the default 64 x 128."""
    proc = _run(["-m", "tessera.train_compile"], "compile_topology=v5e-8", "per_device_batch_size=1",
                "max_target_length=16", "dump_hlo=true", "dump_hlo_module_name=",
                "dump_hlo_local_dir=hlo", "base_output_directory=outputs", "run_name=aot", cwd=tmp_path,
                env={**os.environ, "PYTHONPATH": str(REPO / "src"), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = _dumped(tmp_path / "hlo")
    assert any(".jit_train_step." in f and f.endswith("tpu_comp_env.txt") for f in files), files
    assert any(".jit_train_step." in f and f.endswith("after_optimizations.txt") for f in files), files
    assert any(".jit_train_step" not in f for f in files)  # every program, not only the step


def test_flags_and_errors():
    cfg = tiny_config(dump_hlo=True, run_name="r")
    folder = cfg.run.base_output_directory + "/r/xla_dump"
    assert dump_flags(cfg) == [f"--xla_dump_to={folder}", "--xla_dump_hlo_module_re=jit_train_step"]
    own = tiny_config(dump_hlo=True, dump_hlo_xla_flags="--xla_dump_to=/x --xla_dump_hlo_as_proto")
    assert dump_flags(own) == ["--xla_dump_to=/x", "--xla_dump_hlo_as_proto"]
    for given, bad in (("xla_dump_to=/x", "'xla_dump_to=/x' is not"), ("abc", "'abc' is not"),
                       ("--xla_dump_to=/x  dump", "'dump' is not"), ("-- -x", "'--', '-x' are not")):
        # XLA aborted the process on the first two (a file of flags named so) and dropped the third's word
        with pytest.raises(ConfigError, match=f"^dump_hlo_xla_flags={re.escape(repr(given))}: {bad}"):
            dump_flags(tiny_config(dump_hlo=True, dump_hlo_xla_flags=given))
    assert apply_hlo_dump(tiny_config(), env := {}) is None and env == {}  # off: XLA_FLAGS untouched
    with pytest.raises(ConfigError, match=r"XLA_FLAGS already has --xla_dump_to=/mine, and dump_hlo=true adds"):
        apply_hlo_dump(cfg, {"XLA_FLAGS": "--xla_dump_to=/mine"})
    with pytest.raises(ConfigError, match="contains white space"):
        dump_flags(tiny_config(dump_hlo=True, dump_hlo_local_dir="/a b"))
    with pytest.raises(ConfigError, match=r"^dump_hlo_local_dir=gs://b/dump is a URL: XLA writes the dump to a local "
                                          "folder"):  # it dumped into the local folder ./gs:/b/dump
        dump_flags(tiny_config(dump_hlo=True, dump_hlo_local_dir="gs://b/dump"))
    # the program filter is checked as XLA would read it (unchecked, XLA logs an error per program, dumps nothing)
    assert dump_flags(tiny_config(dump_hlo=True, dump_hlo_module_name="jit_train_step|jit_eval.*"))[1] == (
        "--xla_dump_hlo_module_re=jit_train_step|jit_eval.*")
    for name, why in {"[": "is not a regular expression", "jit train": "contains white space",
                      "jit_(?!eval)": "uses a lookaround", r"(a)\1": "uses a lookaround"}.items():
        with pytest.raises(ConfigError, match=re.escape(f"dump_hlo_module_name={name!r} {why}")):
            dump_flags(tiny_config(dump_hlo=True, dump_hlo_module_name=name))
    # MaxText's keys: its local-dump filter is an alias, its upload keys are refused unless off, deletion accepted
    loaded = load_config([BASE, "dump_hlo_local_module_name=jit_x", "dump_hlo_delete_local_after=true",
                          "dump_hlo_gcs_dir=", "dump_step=-1"], env={})
    assert loaded.profiler.dump_hlo_module_name == "jit_x"
    with pytest.raises(ConfigError, match="dump_hlo_gcs_dir='gs://b/x' is a MaxText key Tessera does not implement"):
        load_config([BASE, "dump_hlo_gcs_dir=gs://b/x"], env={})


def test_a_dump_folder_that_cannot_be_written_is_refused_at_once(tmp_path):
    """XLA logs one error per file it cannot write (163 lines for the tiny model) and the run went on
    with no dump and exit code 0. /proc/self exists and no one may create files in it."""
    proc = _run([str(REPO / "train.py")], "run_name=r", "steps=1", "dump_hlo=true", "dump_hlo_local_dir=/proc/self",
                cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "config error: the HLO dump folder /proc/self cannot be written (" in proc.stderr
    assert "set dump_hlo_local_dir to a writable folder" in proc.stderr


def test_a_dump_folder_refused_names_what_is_in_the_way(tmp_path):
    """dump_hlo_local_dir=<a file> said "cannot be written (File exists)", and a dangling link "(No such file or
    directory)", naming neither the file nor the link."""
    from tessera.xla_dump import _probe

    (tmp_path / "afile").write_text("x")
    (tmp_path / "mnt").symlink_to(tmp_path / "gone")
    for folder, why in ((tmp_path / "afile", f"{tmp_path / 'afile'} is a file, not a folder"),
                        (tmp_path / "afile" / "d", f"{tmp_path / 'afile'} is a file, not a folder"),
                        (tmp_path / "mnt" / "d", f"{tmp_path / 'mnt'} is a symbolic link to {tmp_path / 'gone'}, "
                                                 "which does not exist")):
        with pytest.raises(ConfigError) as e:
            _probe(folder)
        assert str(e.value) == (f"the HLO dump folder {folder} cannot be written ({why}); set dump_hlo_local_dir to "
                                "a writable folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mnt"]

def test_a_run_that_stops_before_compiling_leaves_no_dump_folder(tmp_path):
    """The dump folder's write probe made outputs/r/xla_dump and left it: a run refused at set-up (a mesh that
    does not fit the devices) left an empty run folder, which a run that fails before its first step never does."""
    proc = _run([str(REPO / "train.py")], "run_name=r", "dump_hlo=true", "ici_tensor_parallelism=3", cwd=tmp_path)
    assert proc.returncode == 2 and "config error: ici_data_parallelism=1" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()


def test_own_dump_flags_without_a_folder_are_said_to_print_to_stdout():
    """dump_hlo_xla_flags without --xla_dump_to: XLA prints the whole dump to stdout, and the log said it
    went "to the folder in dump_hlo_xla_flags", and to "programs matching 'jit_train_step'", a filter those
    flags replace. (A fresh process: XLA_FLAGS is set before the backends start.)"""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
            "from tessera.config.loader import load_config\nfrom tessera.xla_dump import apply_hlo_dump\n"
            "apply_hlo_dump(load_config(sys.argv[1:], env={}), {})")
    proc = subprocess.run([sys.executable, "-c", code, BASE, "dump_hlo=true",
                           "dump_hlo_xla_flags=--xla_dump_hlo_as_text"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("dump_hlo_xla_flags='--xla_dump_hlo_as_text' has no --xla_dump_to=<folder>, so XLA prints the dump to "
            "stdout") in proc.stderr
    assert "HLO dump: the programs dump_hlo_xla_flags selects to stdout" in proc.stderr


def test_a_dump_folder_of_xla_flags_own_turns_the_cache_off_too(tmp_path):
    """The A3 GPU recipes dump through XLA_FLAGS (--xla_dump_to=/tmp/xla_dump/$RUN_NAME), not dump_hlo: with
    jax_cache_dir set, a second run loaded the train step from the cache and its dump had no train step."""
    import jax

    cfg = load_config([BASE, f"jax_cache_dir={tmp_path / 'cache'}"], env={})
    before = jax.config.jax_enable_compilation_cache
    try:
        environ = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
        assert apply_hlo_dump(cfg, environ) is None and jax.config.jax_enable_compilation_cache == before
        environ = {"XLA_FLAGS": f"--xla_dump_to={tmp_path / 'dump'}"}
        assert apply_hlo_dump(cfg, environ) is None
        assert environ == {"XLA_FLAGS": f"--xla_dump_to={tmp_path / 'dump'}"}  # XLA_FLAGS is left as it was
        assert jax.config.jax_enable_compilation_cache is False
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def test_a_later_run_in_the_same_process_neither_dumps_nor_loses_the_cache(tmp_path):
    """In one Python process (a notebook, a sweep), a run with dump_hlo=true left its dump folder in XLA_FLAGS
    and the persistent compilation cache off: the next run, without dump_hlo but with jax_cache_dir, said "XLA_FLAGS
    has --xla_dump_to=...: the persistent compilation cache is off" and then "compilation cache: ...", and wrote
    nothing there. Here the first run stops at a mesh that does not fit (after the dump flags were added)."""
    code = ("import json, os, sys, jax\nfrom tessera.train import main\n"
            "before = (os.environ['XLA_FLAGS'], jax.config.jax_enable_compilation_cache)\n"
            "code = main(sys.argv[1:])\n"
            "print(json.dumps([code, before == (os.environ['XLA_FLAGS'], jax.config.jax_enable_compilation_cache)]))")
    proc = subprocess.run([sys.executable, "-c", code, BASE, "run_name=r", "dump_hlo=true", "ici_tensor_parallelism=3",
                           f"jax_cache_dir={tmp_path / 'cache'}"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.stdout.splitlines()[-1:] == ["[2, true]"], proc.stderr[-2000:]
    assert "HLO dump: programs matching 'jit_train_step'" in proc.stderr  # the keys were applied
