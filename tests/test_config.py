"""Config: every shipped YAML validates; precedence; clear errors for bad input."""

import os
import subprocess
import sys

import pytest

from conftest import REPO
from tessera.config import ConfigError, build_config, load_config
from tessera.config.schema import DECODER_BLOCKS, REMAT_POLICIES, all_fields, path_keys, render_base_yml
from tessera.models import BLOCKS
from tessera.models import REMAT_POLICIES as MODEL_REMAT_POLICIES

BASE = str(REPO / "configs" / "base.yml")
MODELS = sorted(p.stem for p in (REPO / "configs" / "models").glob("*.yml"))


def test_base_yml_is_generated_from_schema():
    assert (REPO / "configs" / "base.yml").read_text() == render_base_yml(), (
        "configs/base.yml is stale: run `python3 -m tessera.config > configs/base.yml`"
    )


@pytest.mark.parametrize("model", MODELS)
def test_every_model_file_validates(model):
    cfg = load_config([BASE, f"model_name={model}"], env={})
    assert cfg.model.model_name == model


def test_required_model_files_exist():
    required = {"default", "llama2-7b", "llama2-13b", "llama2-70b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b"}
    assert required <= set(MODELS)


def test_published_sizes():
    m = load_config([BASE, "model_name=llama3.1-70b"], env={}).model
    assert (m.emb_dim, m.num_query_heads, m.num_kv_heads, m.mlp_dim, m.num_decoder_layers, m.vocab_size) == (
        8192, 64, 8, 28672, 80, 128256)


def test_precedence_base_model_cli_env():
    cfg = load_config([BASE, "model_name=llama2-7b"], env={})
    assert cfg.model.base_emb_dim == 4096 and cfg.run.steps == 150  # model file over base, base default
    cfg = load_config([BASE, "model_name=llama2-7b", "base_emb_dim=1024", "steps=7"], env={})
    assert cfg.model.base_emb_dim == 1024 and cfg.run.steps == 7  # command line over model file
    cfg = load_config([BASE, "model_name=llama2-7b", "steps=7"], env={"M_STEPS": "9", "M_RUN_NAME": "envrun"})
    assert cfg.run.steps == 9 and cfg.run.run_name == "envrun"  # environment over command line


def test_types_are_coerced():
    cfg = load_config([BASE, "steps=12", "scan_layers=false", "learning_rate=1e-4", "mlp_activations=gelu,linear",
                       "per_device_batch_size=0.5"], env={})
    assert cfg.run.steps == 12 and cfg.model.scan_layers is False and cfg.optim.learning_rate == 1e-4
    assert cfg.model.mlp_activations == ["gelu", "linear"] and cfg.data.per_device_batch_size == 0.5


def test_global_parameter_scale_rule():
    m = load_config([BASE, "model_name=1b", "global_parameter_scale=128"], env={}).model
    # log2(128) = 7 = 3*2 + 1: layers x4, emb x4, heads and mlp x8
    assert (m.emb_dim, m.num_query_heads, m.mlp_dim, m.num_decoder_layers) == (8192, 128, 57344, 64)
    m = load_config([BASE, "model_name=1b", "global_parameter_scale=4"], env={}).model
    assert (m.emb_dim, m.num_query_heads, m.mlp_dim, m.num_decoder_layers) == (4096, 32, 14336, 16)
    with pytest.raises(ConfigError, match="power of two"):
        build_config({"global_parameter_scale": 3})


def test_unknown_key_names_closest_keys():
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "per_device_batch_siz=4"], env={})
    msg = str(e.value)
    assert "'per_device_batch_siz'" in msg and "per_device_batch_size" in msg
    assert msg.count(",") <= 2  # at most three suggestions, never the whole key list


@pytest.mark.parametrize("arg, expect", [
    ("steps=abc", "steps='abc' is not a valid int"),
    ("steps=1.5", "must be a whole number"),
    ("steps=0", "must be >= 1"),
    ("scan_layers=maybe", "use true or false"),
    ("attention=fastest", "choose one of: 'dot_product'"),
    ("remat_policy=some", "choose one of"),
    ("base_num_kv_heads=3", "must be a multiple of kv heads"),
    ("ici_fsdp_parallelism=-1 ici_data_parallelism=-1", "only one ici_*_parallelism may be -1"),
    ("model_name=llama9", "Known models:"),
    ("num_pipeline_repeats=0", "num_pipeline_repeats=0 must be a positive integer or -1"),
    ("mlp_activations=[\"swish\"]", "must be one or two of"),
    ("steps", "not of the form key=value"),
])
def test_bad_values_are_explained(arg, expect):
    with pytest.raises(ConfigError, match=expect.replace("[", r"\[").replace("*", r"\*")):
        load_config([BASE, *arg.split()], env={})


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["configs/nope.yml"], env={})


def test_cli_user_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), BASE, "run_name=x", "learning_rat=0.1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "unknown config key 'learning_rat'" in proc.stderr and "learning_rate" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_schema_lists_match_implementations():
    assert set(DECODER_BLOCKS) == set(BLOCKS)
    assert set(REMAT_POLICIES) == set(MODEL_REMAT_POLICIES)


def test_relative_paths_are_resolved_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config([BASE, "load_parameters_path=outputs/demo/checkpoints/150", "tokenizer_path=../tok.model",
                       "metrics_file=./m.jsonl", "checkpoint_dir=gs://bucket/ckpts", "dataset_path="], env={})
    assert cfg.run.base_output_directory == str(tmp_path / "outputs")  # the default of base.yml
    assert cfg.checkpoint.load_parameters_path == str(tmp_path / "outputs" / "demo" / "checkpoints" / "150")
    assert cfg.data.tokenizer_path == str(tmp_path.parent / "tok.model")
    assert cfg.run.metrics_file == str(tmp_path / "m.jsonl")
    assert cfg.checkpoint.checkpoint_dir == "gs://bucket/ckpts"  # URLs are kept
    assert cfg.data.dataset_path == "" and cfg.checkpoint.load_full_state_path == ""  # empty stays empty
    assert build_config({}).run.base_output_directory == str(tmp_path / "outputs")  # schema defaults too


def test_glob_lists_are_resolved_per_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = build_config({"hf_train_files": "a/*.json, /data/b-*.json,gs://bucket/c*.json,",
                        "grain_eval_files": "eval/*.arrayrecord"})
    assert cfg.data.hf_train_files == f"{tmp_path}/a/*.json,/data/b-*.json,gs://bucket/c*.json"
    assert cfg.data.grain_eval_files == f"{tmp_path}/eval/*.arrayrecord"


def test_hf_path_is_resolved_only_when_it_is_local(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_dataset").mkdir()
    (tmp_path / "parquet").mkdir()  # a format name stays a format name
    hf_path = lambda value: build_config({"hf_path": value}).data.hf_path  # noqa: E731
    assert hf_path("my_dataset") == str(tmp_path / "my_dataset")
    assert hf_path("./not_yet") == str(tmp_path / "not_yet")
    assert hf_path("parquet") == "parquet"
    assert hf_path("allenai/c4") == "allenai/c4"  # a Hub dataset name
    assert hf_path("hf://datasets/x/y") == "hf://datasets/x/y"


def test_every_path_key_is_marked():
    """One list of path keys (the `path=` of the schema); a new key named like a path must join it."""
    suffixes = ("_path", "_dir", "_directory", "_file", "_files")
    looks_like_a_path = {name for name, (_, f) in all_fields().items() if f.type in ("str", str) and name.endswith(suffixes)}
    assert looks_like_a_path <= set(path_keys()), looks_like_a_path - set(path_keys())
    assert "hf_path" in path_keys() and "[path]" in (REPO / "configs" / "base.yml").read_text()


# --------------------------------------------------------------------------- issue 13: where a bad value was set


def _config_folder(tmp_path, base_edit=("", ""), model_text="head_dim: 6\n"):
    """A copy of configs/base.yml (one line edited) next to models/mine.yml."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.yml").write_text(model_text)
    (tmp_path / "base.yml").write_text((REPO / "configs" / "base.yml").read_text().replace(*base_edit))
    return str(tmp_path / "base.yml")


@pytest.mark.parametrize("where, source", [
    ("env", "(from the environment variable M_STEPS)"),
    ("cli", "(from the command line)"),
    ("model", "models/mine.yml)"),
    ("base", "base.yml)"),
])
def test_a_bad_value_names_where_it_was_set(tmp_path, where, source):
    base = _config_folder(tmp_path, ("steps: 150", "steps: abc") if where == "base" else ("", ""),
                          "steps: abc\n" if where == "model" else "head_dim: 6\n")
    argv = [base, "model_name=mine"] + (["steps=abc"] if where == "cli" else [])
    with pytest.raises(ConfigError) as e:
        load_config(argv, env={"M_STEPS": "abc"} if where == "env" else {})
    assert str(e.value).startswith("steps='abc' is not a valid int") and str(e.value).endswith(source), str(e.value)


def test_an_error_about_several_keys_names_each_source():
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "ici_fsdp_parallelism=-1"], env={"M_ICI_DATA_PARALLELISM": "-1"})
    assert str(e.value).endswith("(ici_data_parallelism from the environment variable M_ICI_DATA_PARALLELISM; "
                                 "ici_fsdp_parallelism from the command line)"), str(e.value)


@pytest.mark.parametrize("argv, env, message", [
    (["run_name=<changeme>"], {}, "run_name='<changeme>' is a placeholder; set it, e.g. run_name=my_run "
                                  "(from the command line)"),
    ([], {"M_RUN_NAME": "<changeme>"}, "run_name='<changeme>' is a placeholder; set it, e.g. run_name=my_run "
                                       "(from the environment variable M_RUN_NAME)"),
    (["hf_train_files=/data/<changeme>/*.json"], {}, "hf_train_files='/data/<changeme>/*.json' is a placeholder"),
    (["steps=<changeme>"], {}, "steps='<changeme>' is a placeholder"),  # before its type is checked
    (["model_name=<changeme>"], {}, "model_name='<changeme>' is a placeholder"),  # before a model file is looked for
    (["mlp_activations=[\"<changeme>\"]"], {}, "mlp_activations='[\"<changeme>\"]' is a placeholder"),
])
def test_placeholders_are_refused_from_every_source(argv, env, message):
    with pytest.raises(ConfigError) as e:
        load_config([BASE, *argv], env=env)
    assert str(e.value).startswith(message), str(e.value)


def test_train_py_names_the_variable_and_refuses_placeholders_before_anything_runs(tmp_path):
    for env, message in [({"M_STEPS": "abc"}, "config error: steps='abc' is not a valid int (from the environment "
                                              "variable M_STEPS)"),
                         ({"M_RUN_NAME": "<changeme>"}, "config error: run_name='<changeme>' is a placeholder; set it, "
                                                        "e.g. run_name=my_run (from the environment variable "
                                                        "M_RUN_NAME)")]:
        proc = subprocess.run([sys.executable, str(REPO / "train.py"), BASE], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120, env={**os.environ, **env})
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.splitlines()[-1] == message
    assert list(tmp_path.iterdir()) == []  # no outputs/<changeme>/, nothing at all


@pytest.mark.parametrize("keys, message", [
    ({"num_experts": 8, "num_experts_per_tok": 2}, "num_experts=8: decoder_block=llama2 has a dense MLP"),
    ({"decoder_block": "mixtral"}, "decoder_block=mixtral needs num_experts >= 2"),
    ({"eval_interval": 5, "eval_steps": 0}, "eval_steps=0: use a positive number of batches, or -1"),
    ({"eval_interval": 5, "eval_steps": -3}, "eval_steps=-3: use a positive number of batches, or -1"),
    ({"eval_interval": 5}, "eval_steps=-1 reads the eval data to its end, but synthetic data never ends"),
])
def test_model_and_eval_keys_are_checked_before_any_model_is_built(keys, message, capsys):
    """`python3 -m tessera.config` and train_compile refuse them with exit code 2 from the config
    alone; eval_steps fails in build_config, the expert count (which the estimator may size on
    any block family) in `validate_for_build`."""
    from tessera import train_compile
    from tessera.config.__main__ import main as config_main
    from tessera.config.loader import validate_for_build

    with pytest.raises(ConfigError, match=message):
        validate_for_build(build_config(keys).model)
    argv = [BASE, *(f"{k}={v}" for k, v in keys.items())]
    assert config_main(argv) == 2 and message in capsys.readouterr().err
    assert train_compile.main([*argv, "compile_topology=v5p-8"]) == 2 and message in capsys.readouterr().err


def test_eval_steps_is_not_checked_while_evaluation_is_off():
    assert build_config({"eval_interval": 0, "eval_steps": 0}).data.eval_steps == 0
    assert build_config({"eval_interval": 3, "eval_steps": 2}).data.eval_steps == 2


# --------------------------------------------------------------------------- every problem in one error


def test_every_unknown_key_and_bad_value_is_reported_in_one_error():
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "per_device_batch_siz=4", "stepz=3", "steps=abc", "scan_layers=maybe"],
                    env={"M_DTYPE": "float8"})
    lines = str(e.value).splitlines()
    assert lines[0] == "5 problems in the config:"
    assert lines[1].startswith("  unknown config key 'per_device_batch_siz' in the command line; did you mean")
    assert lines[2].startswith("  unknown config key 'stepz' in the command line; did you mean steps")
    assert "  steps='abc' is not a valid int (from the command line)" in lines
    assert "  scan_layers='maybe' is not a valid bool; use true or false (from the command line)" in lines
    assert any(line.startswith("  dtype='float8' is not allowed") and
               line.endswith("(from the environment variable M_DTYPE)") for line in lines)


def test_config_errors_exit_2(capsys):
    from tessera.config.__main__ import main

    assert main([BASE, "stepz=3", "steps=abc"]) == 2
    assert capsys.readouterr().err.startswith("config error: 2 problems in the config:")
