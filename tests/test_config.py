"""Config: every shipped YAML validates; precedence; clear errors for bad input."""

import dataclasses
import logging
import math
import os
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from tessera.config import ConfigError, build_config, flat_dict, load_config
from tessera.config.fields import DECODER_BLOCKS, REMAT_POLICIES
from tessera.config.schema import all_fields, path_keys, render_base_yml
from tessera.models import BLOCKS
from tessera.models import REMAT_POLICIES as MODEL_REMAT_POLICIES

BASE = str(REPO / "configs" / "base.yml")
MODELS = sorted(p.stem for p in (REPO / "configs" / "models").glob("*.yml"))


def test_base_yml_is_generated_from_schema():
    assert (REPO / "configs" / "base.yml").read_text() == render_base_yml(), (
        "configs/base.yml is stale: run `.venv/bin/python -m tessera.config > configs/base.yml`"
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
    # a value in quotes, as `docker run --env-file` passes M_RUN_NAME="x" (quotes kept), is read as on the command line
    cfg = load_config([BASE], env={"M_RUN_NAME": '"envrun"', "M_LEARNING_RATE": "'1e-3'", "M_METRICS_FILE": '""'})
    assert (cfg.run.run_name, cfg.optim.learning_rate, cfg.run.metrics_file) == ("envrun", 0.001, "")


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
    for typed in ("STEPS=3", "--steps=3"):  # upper case, or a flag's dashes: the key is still found
        with pytest.raises(ConfigError, match=f"unknown config key '{typed.split('=')[0]}' in the command line; "
                                              "did you mean steps,"):
            load_config([BASE, typed], env={})


@pytest.mark.parametrize("arg, expect", [
    ("steps=abc", "steps='abc' is not a valid int"),
    ("steps=1.5", "must be a whole number"),
    ("steps=0", "must be >= 1"),
    ("scan_layers=maybe", "use true or false"),
    ("attention=fastest", "choose one of: 'dot_product'"),
    ("remat_policy=some", "choose one of"),
    ("base_num_kv_heads=3", "must be a multiple of kv heads"),
    ("ici_fsdp_parallelism=-1 ici_data_parallelism=-1", "only one ici_*_parallelism may be -1"),
    ("ici_fsdp_parallelism=-1 ici_data_parallelism=-1",
     "but ici_data_parallelism and ici_fsdp_parallelism both are; give the others a size"),
    ("dcn_fsdp_parallelism=-1 dcn_data_parallelism=-1 dcn_tensor_parallelism=-1",
     "but dcn_data_parallelism, dcn_fsdp_parallelism and dcn_tensor_parallelism all are"),
    # a dcn -1 takes the slices left, not devices
    ("dcn_fsdp_parallelism=-1", "only one dcn_*_parallelism may be -1 .the axis that takes the slices left"),
    ("model_name=llama9", "Did you mean llama3-8b, llama2-7b, llama3-70b?"),
    ("num_pipeline_repeats=0", "num_pipeline_repeats=0 must be a positive integer or -1"),
    ("ici_fsdp_parallelism=0", "ici_fsdp_parallelism=0 must be a positive integer or -1 .fill from device count."),
    ("dcn_data_parallelism=-3", "dcn_data_parallelism=-3 must be a positive integer or -1 .fill from device count."),
    ("mlp_activations=[\"swish\"]", "must be one or two of"),
    ("head_dim=7", "head_dim=7 must be even .rotary embeddings rotate pairs."),
    ("rope_scaling=llama3 rope_low_freq_factor=4 rope_high_freq_factor=1",
     "rope_high_freq_factor=1.0 must be at least rope_low_freq_factor=4.0 with rope_scaling=llama3"),
    ("steps", "not of the form key=value"),
])
def test_bad_values_are_explained(arg, expect):
    with pytest.raises(ConfigError, match=expect.replace("[", r"\[").replace("*", r"\*")):
        load_config([BASE, *arg.split()], env={})


def test_a_key_given_apart_from_its_value_is_told_the_form():
    """`steps 100` and `--steps 100` (argparse's form) said only "argument 'steps' is not of the form key=value";
    the error now shows the argument to give."""
    assert _config_error([BASE, "run_name=x", "steps", "100"]) == (
        "argument 'steps' is not of the form key=value: it is the config key steps without its value; give the two "
        "as one argument: steps=100")
    assert _config_error([BASE, "--steps", "100"]).endswith("give the two as one argument: steps=100")
    assert _config_error([BASE, "sequence_length"]).endswith("as one argument: sequence_length=<value>")  # an alias
    assert _config_error([BASE, "bogus", "5"]) == "argument 'bogus' is not of the form key=value (e.g. steps=100)"


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(["configs/nope.yml"], env={})


def test_first_runs_typo_example_is_what_the_config_says(monkeypatch):
    """First_run.md shows the error of a typo; the text it showed had other suggestions than the real one."""
    monkeypatch.chdir(REPO)
    text = (REPO / "getting_started" / "First_run.md").read_text()
    example = re.search(r"^\$ \.venv/bin/python train\.py (.*learning_rat=.*)\n(config error: .*)$", text, re.M)
    command, shown = example.groups()
    with pytest.raises(ConfigError) as error:
        load_config(command.split(), env={})
    assert f"config error: {error.value}" == shown


def test_a_config_path_typed_from_another_folder_names_the_repositorys_file(tmp_path, monkeypatch):
    """The docs' commands run from the repository root; run from elsewhere, `configs/base.yml` does not exist
    there, and the message said "pass a path such as configs/base.yml", the very path that was typed."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config(["configs/base.yml", "run_name=x"], env={})
    assert str(error.value) == (f"config file configs/base.yml does not exist in the current folder {tmp_path}; the "
                                f"repository's is {REPO / 'configs' / 'base.yml'}: run the command from {REPO}, as "
                                "the docs do, or give that path")


def test_a_misspelled_config_file_names_the_closest_files(tmp_path):
    (tmp_path / "base.yml").write_text("steps: 3\n")
    with pytest.raises(ConfigError, match=r"config file .*bse.yml does not exist; did you mean .*base.yml\?$"):
        load_config([str(tmp_path / "bse.yml")], env={})
    with pytest.raises(ConfigError, match="nope.yml does not exist; pass a path such as configs/base.yml$"):
        load_config([str(tmp_path / "nope.yml")], env={})


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
    # any <word> in a path key: a guide's placeholder made a folder of that name (or a bucket path)
    (["base_output_directory=gs://<bucket>/runs"], {}, "base_output_directory='gs://<bucket>/runs' holds the "
     "placeholder <bucket>; put the real path or URL in its place (from the command line)"),
    ([], {"M_TOKENIZER_PATH": "<tokenizer>"}, "tokenizer_path='<tokenizer>' holds the placeholder <tokenizer>"),
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
    """`.venv/bin/python -m tessera.config` and train_compile refuse them with exit code 2 from the config
    alone; eval_steps fails in build_config, the expert count (which the estimator may size on
    any block family) in `validate_for_build`."""
    from tessera import train_compile
    from tessera.config.__main__ import main as config_main
    from tessera.config.checks import validate_for_build

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


def test_a_batch_size_of_zero_or_less_is_one_message():
    """-1 said "it must be >= 0.0", and 0 then "must be > 0": one rule, said once."""
    for value in ("-1", "0"):
        with pytest.raises(ConfigError) as e:
            load_config([BASE, f"per_device_batch_size={value}"], env={})
        assert str(e.value).startswith(f"per_device_batch_size={float(value):g} must be > 0 (a fraction such as 0.5 "
                                       "is allowed"), str(e.value)


def test_another_trainers_config_is_named_as_such_after_its_first_unknown_keys(tmp_path):
    """MaxText's whole base.yml has 432 keys Tessera does not know: they filled the terminal and the
    advice (start from configs/base.yml) was nowhere. Now the first 10, the others counted, the advice last."""
    theirs = tmp_path / "their_base.yml"
    theirs.write_text("".join(f"their_key_{i}: {i}\n" for i in range(30)) + "steps: abc\nmesh_axes: [data]\n")
    with pytest.raises(ConfigError) as e:
        load_config([str(theirs), "run_name=x"], env={})
    lines = str(e.value).splitlines()
    assert lines[0] == "32 problems in the config:"  # 30 unknown keys, a bad value, a refused MaxText key
    assert [line for line in lines if "unknown config key" in line] == [
        f"  unknown config key 'their_key_{i}' in {theirs}; see configs/base.yml for every key" for i in range(10)]
    assert "  steps='abc' is not a valid int (from " + str(theirs) + ")" in lines
    assert any(line.startswith("  mesh_axes=['data'] is a MaxText key Tessera does not implement") for line in lines)
    assert lines[-1].startswith(f"  ... and 20 more unknown keys in {theirs} (30 in all): if it is another "
                                "trainer's config (MaxText's base.yml or a copy of it), start from configs/base.yml")
    # a few typos are still listed one by one, each with its closest keys
    mine = tmp_path / "mine.yml"
    mine.write_text("base_config: base.yml\n" + "".join(f"stepz{i}: 1\n" for i in range(20)))
    with pytest.raises(ConfigError) as e:
        load_config([str(mine)], env={})
    assert str(e.value).startswith("20 problems in the config:") and str(e.value).count("unknown config key") == 20


def test_config_errors_exit_2(capsys):
    from tessera.config.__main__ import main

    assert main([BASE, "stepz=3", "steps=abc"]) == 2
    assert capsys.readouterr().err.startswith("config error: 2 problems in the config:")


# --------------------------------------------------------------------------- bad input: files and values


def _config_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(argv, env={})
    return str(e.value)


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfebad", "is not UTF-8 text (byte 0xff at offset 0); it must be a YAML file of key: value lines"),
    (b"", "is empty (no key: value lines); start from a copy of configs/base.yml"),
    (b"# only a comment\n", "is empty (no key: value lines)"),
    (b"- steps\n- 3\n", "must be a mapping of key: value lines, got list"),
    (b"just words\n", "must be a mapping of key: value lines, got str"),
    (b"steps: [1\n", "is not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>' (while "
                     "parsing a flow sequence started at line 1); correct the file there"),
    (b"steps: " + b"[" * 5000 + b"]" * 5000 + b"\n",  # a RecursionError traceback
     "is not a config file: its values are nested hundreds of levels deep; a config file is key: value lines"),
    # YAML aliases that multiply ("billion laughs"): 9 levels of 9 references hung the loader, which writes values
    # into its messages; 6 levels (531,441 items) are enough here
    (b"a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + b"".join(
        b"%c: &%c [%s]\n" % (c, c, b", ".join([b"*%c" % (c - 1)] * 9)) for c in b"bcdef") + b"steps: *f\n",
     "is not a config file: with its YAML aliases (*name) expanded, its values hold more than 100,000 items"),
])
def test_a_bad_config_file_gets_its_own_one_line_error(tmp_path, content, message):
    path = tmp_path / "my.yml"
    path.write_bytes(content)
    msg = _config_error([str(path), "run_name=x"])
    assert msg == f"config file {path} {message}" or msg.startswith(f"config file {path} {message}"), msg
    assert "\n" not in msg and "model" not in msg  # not hidden behind the model file lookup


@pytest.mark.parametrize("content, key, line", [
    ("steps: 3\n5: x\n", "5", 2),
    ("null: 3\n", "null", 1),
    ("steps: 3\non: true\n", "on", 2),  # YAML 1.1 reads on/off/yes/no as booleans
])
def test_a_key_that_yaml_reads_as_no_name_is_one_line(tmp_path, content, key, line):
    """A key YAML reads as a number, null or a bool ended in AttributeError: 'int' object has no
    attribute 'lower' (exit 1), from the config file or a model file alike."""
    path = tmp_path / "my.yml"
    path.write_text(content)
    assert _config_error([str(path)]) == (f"config file {path}: the key {key!r} on line {line} is not a name (YAML "
                                          "reads it as a number, null or true/false); keys are names such as steps")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.yml").write_text(content)
    assert _config_error([BASE, f"model_name={tmp_path}/models/mine"]).startswith(
        f"model file {tmp_path}/models/mine.yml: the key {key!r}")
    path.write_text("'5': 3\n")  # quoted, it is a name: an unknown key
    assert _config_error([str(path)]).startswith("unknown config key '5'")


def test_an_empty_base_output_directory_is_the_working_directory(tmp_path, monkeypatch):
    """MaxText's default base_output_directory is "": the run folder was ./run_name but the
    checkpoints went to /run_name/checkpoints, at the root of the file system."""
    from tessera.config.derived import plan_run

    monkeypatch.chdir(tmp_path)
    cfg = load_config([BASE, "base_output_directory=", "run_name=r"], env={})
    assert cfg.run.base_output_directory == str(tmp_path)
    plan = plan_run(cfg, {"data": 1, "stage": 1, "fsdp": 8, "sequence": 1, "tensor": 1, "expert": 1})
    assert (str(plan.run_dir), plan.checkpoint_dir) == (str(tmp_path / "r"), str(tmp_path / "r" / "checkpoints"))


def test_a_config_file_key_the_model_file_overrides_gets_a_warning(tmp_path, caplog):
    """The model file wins over a config file (MaxText's order): an experiment file's model keys, or a
    saved config.yml given back after a model key was changed on the command line, were dropped
    without a word. Files that set most keys warn only for their values away from the defaults."""
    (tmp_path / "exp.yml").write_text("base_config: base.yml\nmodel_name: llama2-7b\nbase_num_decoder_layers: 4\n"
                                      "steps: 3\nvocab_size: 32000\n")
    with caplog.at_level("WARNING", logger="tessera"):
        cfg = load_config([str(tmp_path / "exp.yml")], env={})
    assert cfg.model.base_num_decoder_layers == 32 and cfg.run.steps == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / 'exp.yml'} sets base_num_decoder_layers=4; the model file {REPO}/configs/models/llama2-7b.yml "
        "sets base_num_decoder_layers=32, and a model file's values win over a config file's (MaxText's order); to "
        "change them, give them on the command line"]  # vocab_size: 32000 is the model's value: nothing lost
    caplog.clear()
    saved = tmp_path / "config.yml"
    saved.write_text(yaml.safe_dump(flat_dict(load_config([BASE, "model_name=llama2-7b", "base_num_decoder_layers=2"],
                                                          env={}))))
    with caplog.at_level("WARNING", logger="tessera"):
        assert load_config([str(saved), "base_num_decoder_layers=2"], env={}).model.base_num_decoder_layers == 2
        assert not caplog.records  # the command line wins over the model file: nothing lost
        load_config([str(saved)], env={})
    assert len(caplog.records) == 1 and "sets base_num_decoder_layers=2; the model file" in caplog.text
    caplog.clear()  # a value that is not even valid, which the model file's replaces, is warned of too (it was not)
    (tmp_path / "exp.yml").write_text("base_config: base.yml\nmodel_name: llama2-7b\ndecoder_block: mixtrl\n"
                                      "head_dim: {}\n")
    with caplog.at_level("WARNING", logger="tessera"):
        assert load_config([str(tmp_path / "exp.yml")], env={}).model.decoder_block == "llama2"
    assert caplog.records[0].getMessage().startswith(
        f"{tmp_path / 'exp.yml'} sets decoder_block=mixtrl; {tmp_path / 'exp.yml'} sets head_dim={{}}; the model file "
        f"{REPO}/configs/models/llama2-7b.yml sets decoder_block=llama2, head_dim=128, and a model file's values win")


def test_an_unreadable_config_file_is_a_config_error(tmp_path, monkeypatch):
    path = tmp_path / "my.yml"
    path.write_text("steps: 3\n")
    real_read_text = type(path).read_text

    def refuse(self, *args, **kwargs):  # chmod 000 does not stop root, so refuse the read itself
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "read_text", refuse)
    assert _config_error([str(path)]) == f"config file {path} cannot be read (Permission denied); check its permissions"


def test_a_directory_given_as_the_config_file_is_named_as_one(tmp_path):
    assert _config_error([str(REPO / "configs"), "run_name=x"]) == (
        f"config file {REPO / 'configs'} is a directory; a config file is expected, e.g. {REPO / 'configs' / 'base.yml'}")
    assert _config_error([str(tmp_path)]) == (
        f"config file {tmp_path} is a directory; a config file is expected, e.g. configs/base.yml")


@pytest.mark.parametrize("args, message", [
    (["/tmp/bin.yml"], "config error: config file /tmp/bin.yml is not UTF-8 text (byte 0xff at offset 0)"),
    (["configs"], "config error: config file configs is a directory; a config file is expected, e.g. "
                  "configs/base.yml"),
    (["configs/base.yml", "steps=99999999999999999999999"], "config error: steps='99999999999999999999999' is out "
                                                            "of range; an integer key takes whole numbers from"),
])
def test_train_py_turns_bad_input_into_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    args = [str(tmp_path / "bin.yml") if a == "/tmp/bin.yml" else a for a in args]
    message = message.replace("/tmp/bin.yml", str(tmp_path / "bin.yml"))
    (tmp_path / "bin.yml").write_bytes(b"\xff\xfebad")
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args, "run_name=x"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith(message), proc.stderr[-3000:]


@pytest.mark.parametrize("arg, message", [
    ("train_data_columns=[text", "train_data_columns='[text' is not a valid list (expected ',' or ']', but got "
                                 "'<stream end>'); write it as train_data_columns=[\"a\",\"b\"] or "
                                 "train_data_columns=a,b (from the command line)"),
    ("mlp_activations=[silu, [linear", "mlp_activations='[silu, [linear' is not a valid list"),
    ("mlp_activations=[a: b, c: d", "mlp_activations='[a: b, c: d' is not a valid list"),
    # the example is the key's own default: train_data_columns was shown mlp_activations' ["silu","linear"]
    ("train_data_columns=[1,2]", "train_data_columns='[1,2]' must be a list of strings, e.g. "
                                 "train_data_columns=[\"text\"] (from the command line)"),
    ("mlp_activations=[1]", "mlp_activations='[1]' must be a list of strings, e.g. mlp_activations=[\"silu\",\"linear\"]"),
])
def test_a_list_value_that_is_not_yaml_names_the_key_and_value(arg, message):
    assert _config_error([BASE, arg]).startswith(message)


@pytest.mark.parametrize("arg, message", [
    ("steps=99999999999999999999999", "steps='99999999999999999999999' is out of range; an integer key takes "
                                      "whole numbers from -9223372036854775808 to 9223372036854775807"),
    ("init_weights_seed=9223372036854775808", "init_weights_seed='9223372036854775808' is out of range"),
    ("init_weights_seed=-9223372036854775809", "init_weights_seed='-9223372036854775809' is out of range"),
    ("data_shuffle_seed=1e30", "data_shuffle_seed='1e30' is out of range"),
    ("steps=3000000000", "steps='3000000000' is too large; it must be <= 2147483647"),
    ("learning_rate_schedule_steps=2147483648", "learning_rate_schedule_steps='2147483648' is too large"),
    ("steps=nan", "steps='nan' must be a whole number"),
    ("steps=inf", "steps='inf' must be a whole number"),
    ("steps=10.000000000000000001", "steps='10.000000000000000001' must be a whole number"),  # float says 10.0
    # a head width with extra zeros used to fill the host's memory while the model was built (its rotary table)
    ("head_dim=1000000000", "head_dim='1000000000' is too large; it must be <= 65536"),
    ("qk_rope_head_dim=1000000000", "qk_rope_head_dim='1000000000' is too large; it must be <= 65536"),
    ("base_num_decoder_layers=1000000000", "base_num_decoder_layers='1000000000' is too large; it must be <= 65536"),
    # attention windows past int32 positions stopped the first step with an OverflowError traceback in the mask
    ("sliding_window_size=9000000000000000000", "sliding_window_size='9000000000000000000' is too large; it must be "
                                                "<= 2147483647"),
    ("chunk_attn_window_size=2147483648", "chunk_attn_window_size='2147483648' is too large; it must be <= 2147483647"),
    # each block of multi-token prediction is built on its own: 10^6 of them ran for hours without a line
    ("mtp_num_layers=1000000", "mtp_num_layers='1000000' is too large; it must be <= 1024"),
    # each data worker is a process of its own
    ("grain_worker_count=100000000000000", "grain_worker_count='100000000000000' is too large; it must be <= 1024"),
    ("num_slices=-2", "num_slices='-2' is too small; it must be >= -1"),
    # libtpu aborted with a core dump at 512 slices, and hung at 100000
    ("compile_topology_num_slices=512", "compile_topology_num_slices='512' is too large; it must be <= 511"),
    ("num_slices=0", "num_slices=0: give the number of slices (1 or more), or -1 to detect it from the devices"),
    # a run's checkpoints and files went to the folder above base_output_directory (the repository root for
    # the default outputs), into the base itself, or past it
    ("run_name=..", "run_name='..' has a '.' or '..' part, which would put the run's checkpoints and files outside"),
    ("run_name=../x", "run_name='../x' has a '.' or '..' part"),
    ("run_name=.", "run_name='.' has a '.' or '..' part"),
    ("run_name=a/./b", "run_name='a/./b' has a '.' or '..' part"),
    ("run_name=/tmp/x", "run_name='/tmp/x' is a path, not a name (its folder is base_output_directory/run_name): "
                        "put the folder above it in base_output_directory and its last part in run_name"),
    ("run_name=gs://b/x", "run_name='gs://b/x' is a path, not a name"),
    ("run_name= ", "run_name=' ' starts or ends with white space"),
    ("run_name=demo ", "run_name='demo ' starts or ends with white space"),
    # the run folder's check said "File name too long; choose another base_output_directory"
    ("run_name=sweep/" + "é" * 128, "run_name='sweep/" + "é" * 34 + "'... has a folder name of 256 bytes, and file "
                                   "systems take names of at most 255 bytes (its folder is base_output_directory/"
                                   "run_name); use a shorter run_name"),
])
def test_integer_keys_are_exact_and_within_range(arg, message):
    assert _config_error([BASE, arg]).startswith(message)


def test_integer_keys_never_go_through_float(tmp_path):
    big = 2**63 - 1  # float(big) is 2**63, out of range; exact parsing keeps it
    for seed in (big, -2**63):
        assert load_config([BASE, f"init_weights_seed={seed}"], env={}).run.init_weights_seed == seed
    # data_shuffle_seed takes 0..2**32-1, the seeds grain's shuffle takes (past it grain raised mid-start)
    cfg = load_config([BASE, f"data_shuffle_seed={2**32 - 1}", "steps=2147483647",
                       "checkpoint_period=1e3", "log_period=+7"], env={})
    assert cfg.data.data_shuffle_seed == 2**32 - 1
    assert _config_error([BASE, f"data_shuffle_seed={2**32}"]).startswith(
        "data_shuffle_seed='4294967296' is too large; it must be <= 4294967295")
    assert (cfg.run.steps, cfg.checkpoint.checkpoint_period, cfg.run.log_period) == (2147483647, 1000, 7)
    assert all(type(v) is int for v in (cfg.data.data_shuffle_seed, cfg.run.steps, cfg.checkpoint.checkpoint_period))
    path = tmp_path / "big.yml"  # a YAML integer from a file, too
    path.write_text("steps: 99999999999999999999999\n")
    assert _config_error([str(path)]).startswith("steps=99999999999999999999999 is out of range")


def test_a_config_file_reads_values_as_the_command_line_does(tmp_path):
    """PyYAML reads YAML 1.1: an unquoted 010 is 8 (octal) and 1:30 is 90 (base 60), and a text key's
    unquoted number or bool became its Python text: `run_name: 010` trained into the folder 8 and
    `steps: 010` 8 steps, where run_name=010 steps=010 on the command line are '010' and 10."""
    path = tmp_path / "exp.yml"
    path.write_text("base_config: base.yml\nrun_name: 010\nsteps: 010\nsequence_length: 0100\ntrain_split: 1:30\n"
                    "dataset_name: 1_000\neval_split: yes\nlearning_rate: 1e-3\ncheckpoint_period: 0x10\n")
    cfg = load_config([str(path)], env={})
    assert (cfg.run.run_name, cfg.run.steps, cfg.data.max_target_length) == ("010", 10, 100)
    assert (cfg.data.train_split, cfg.data.dataset_name, cfg.data.eval_split) == ("1:30", "1_000", "yes")
    assert (cfg.optim.learning_rate, cfg.checkpoint.checkpoint_period) == (0.001, 16)  # read as before
    on_the_command_line = load_config([BASE, "run_name=010", "steps=010"], env={})
    assert (on_the_command_line.run.run_name, on_the_command_line.run.steps) == ("010", 10)
    path.write_text("base_config: base.yml\nsteps: 1:30\n")
    assert _config_error([str(path)]) == f"steps='1:30' is not a valid int (from {path})"


def test_sizes_global_parameter_scale_makes_are_bounded_as_the_base_sizes_are():
    """global_parameter_scale took 4 layers past MAX_LAYERS (2^62: 4 million; the estimate ran out of memory
    listing them) and weights past what XLA can compile (2^44: a RuntimeError traceback, "overflow in static
    extent product"; a weight of 10^18 elements aborted the process); a vocabulary past int32 token ids was a
    traceback in the synthetic data. Each is a config error naming the keys."""
    assert _config_error([BASE, f"global_parameter_scale={2**62}"]).startswith(
        f"base_num_decoder_layers=4 and global_parameter_scale={2**62} make 4,194,304 decoder layers, more than the "
        "65,536 a model may have")
    assert _config_error([BASE, f"global_parameter_scale={2**44}"]).startswith(
        "the MLP's first projection [layers 65536, emb 8388608, mlp 25165824] would hold 1.38e+19 elements, more than "
        "the 7.21e+16 a weight may hold (beyond, compiling overflows XLA's 64-bit byte counts); lower base_mlp_dim, "
        f"base_emb_dim, base_num_decoder_layers or global_parameter_scale={2**44}")
    assert "the token embedding [vocab 2147483648, emb 67108864]" in _config_error(
        [BASE, f"vocab_size={2**31}", f"base_emb_dim={2**26}"])
    assert _config_error([BASE, "vocab_size=3000000000"]).startswith(
        "vocab_size='3000000000' is too large; it must be <= 2147483648")
    assert load_config([BASE, f"global_parameter_scale={2**36}"], env={}).model.num_decoder_layers == 16384
    assert load_config([BASE, "model_name=1b", "global_parameter_scale=128"], env={}).model.emb_dim == 8192


@pytest.mark.parametrize("model, key, weight", [
    ("gpt3-52k", "trainable_position_size", "the position embedding [positions"),
    ("deepseek-small", "q_lora_rank", "the query's up-projection [layers 4, rank"),
    ("deepseek-small", "kv_lora_rank", "the key/value up-projection [layers 4, rank"),
    ("deepseek-small", "shared_experts", "the shared experts' first projection [layers 4, emb 256, mlp"),
])
def test_sizes_of_the_families_own_weights_are_bounded(model, key, weight):
    """A weight only some families build was not counted against MAX_WEIGHT_ELEMENTS: model_name=gpt3-52k
    trainable_position_size=9e18 (or deepseek-small's q_lora_rank, kv_lora_rank, shared_experts) passed the
    config and stopped train.py with a traceback while the model was initialized ("random bits array of size
    exceeding 2 ** 64"). It is a config error naming the weight and the key; the model files still load."""
    message = _config_error([BASE, f"model_name={model}", f"{key}={9 * 10**18}"])
    assert message.startswith(weight) and f"lower {key}, " in message, message
    assert f"{key} from the command line" in message
    assert getattr(load_config([BASE, f"model_name={model}"], env={}).model, key) > 0


@pytest.mark.parametrize("line, key", [('run_name: "a\\0b"', "run_name"),
                                       ('base_output_directory: "out\\0put"', "base_output_directory"),
                                       ('train_data_columns: ["te\\0xt"]', "train_data_columns")])
def test_a_nul_character_in_a_text_value_is_a_config_error(tmp_path, line, key):
    """A YAML file's "\\0" escape put a NUL in a name or path: train.py stopped with a ValueError traceback
    ("embedded null byte", when Orbax removed a file of the run folder); now one config error, exit code 2."""
    (tmp_path / "exp.yml").write_text(f"base_config: base.yml\nsteps: 1\n{line}\n")
    message = _config_error([str(tmp_path / "exp.yml")])
    assert message.startswith(f"{key}=") and "contains a NUL character (\\0), which no path, name or flag can hold; " \
        "remove it (from " in message, message
    if key == "run_name":
        proc = subprocess.run([sys.executable, str(REPO / "train.py"), str(tmp_path / "exp.yml")], capture_output=True,
                              text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.splitlines()[-1].startswith("config error: run_name='a\\x00b' contains a NUL"), \
            proc.stderr[-3000:]

FLOAT_KEYS = sorted(n for n, (_, f) in all_fields().items() if f.type in ("float", float))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "NaN"])
@pytest.mark.parametrize("name", ["learning_rate", "per_device_batch_size", "capacity_factor", "adam_eps"])
def test_non_finite_floats_are_refused(name, value):
    assert _config_error([BASE, f"{name}={value}"]).startswith(f"{name}={value!r} must be a finite number (not nan or inf)")


def test_every_float_key_refuses_nan_and_inf(tmp_path):
    assert len(FLOAT_KEYS) > 20 and "learning_rate" in FLOAT_KEYS
    path = tmp_path / "nan.yml"  # YAML's own .nan and .inf, from a file
    path.write_text("".join(f"{n}: {'.nan' if i % 2 else '.inf'}\n" for i, n in enumerate(FLOAT_KEYS)))
    lines = _config_error([str(path)]).splitlines()
    assert lines[0] == f"{len(FLOAT_KEYS)} problems in the config:"
    for i, n in enumerate(FLOAT_KEYS):
        assert f"  {n}={math.nan if i % 2 else math.inf} must be a finite number (not nan or inf) (from {path})" in lines


@pytest.mark.parametrize("value, message", [
    ("2", "compile_hbm_budget_fraction=2 must be in (0, 1]: the share of a chip's HBM the compiled step may use, "
          "e.g. 0.95 (from the command line)"),
    ("1.0001", "compile_hbm_budget_fraction=1.0001 must be in (0, 1]"),
    ("0", "compile_hbm_budget_fraction=0 must be in (0, 1]"),
    ("-0.5", "compile_hbm_budget_fraction='-0.5' is too small; it must be >= 0.0"),
    ("1", None), ("0.5", None), ("1e-6", None),
])
def test_compile_hbm_budget_fraction_is_in_0_1(value, message):
    if message is None:
        cfg = load_config([BASE, f"compile_hbm_budget_fraction={value}"], env={})
        assert cfg.compile.compile_hbm_budget_fraction == float(value)
    else:
        assert _config_error([BASE, f"compile_hbm_budget_fraction={value}"]).startswith(message)


@pytest.mark.parametrize("args, message", [
    (["tile_weight_dim=200"], "tile_weight_dim=200 must be a multiple of 128 (the TPU's lane width: the Pallas grouped "
                              "matmul's tiles are whole lanes), e.g. 512 or 1024 (from the command line)"),
    (["tile_batch_seq=640", "tile_activation_dim=100"], "tile_activation_dim='100' is too small; it must be >= 128"),
    (["tile_batch_seq=384", "tile_activation_dim=2000"], "tile_activation_dim=2000 must be a multiple of 128"),
    (["tile_batch_seq=384", "tile_activation_dim=256", "tile_weight_dim=2048"], None),
])
def test_megablox_tiles_are_whole_lanes(args, message):
    if message is None:
        m = load_config([BASE, *args], env={}).model
        assert (m.tile_batch_seq, m.tile_activation_dim, m.tile_weight_dim) == (384, 256, 2048)
    else:
        assert _config_error([BASE, *args]).startswith(message)


def test_a_url_that_lost_a_slash_is_refused_not_made_a_local_folder(tmp_path, monkeypatch):
    """checkpoint_dir=gs:/b/ck (as pathlib's Path('gs://b/ck') prints it) wrote the checkpoints to ./gs:/b/ck."""
    monkeypatch.chdir(tmp_path)
    assert _config_error([BASE, "checkpoint_dir=gs:/b/ck"]) == (
        f"checkpoint_dir=gs:/b/ck is a URL with one slash after its scheme, which would be read as the local folder "
        f"{tmp_path}/gs:/b/ck; write gs://b/ck (pathlib's Path('gs://b/x') drops one slash) (from the command line)")
    assert _config_error([BASE, "load_parameters_path=gs:/b/ck/4"]).startswith("load_parameters_path=gs:/b/ck/4 is a URL")
    cfg = load_config([BASE, "checkpoint_dir=gs://b/ck", "load_parameters_path=ck/4"], env={})
    assert (cfg.checkpoint.checkpoint_dir, cfg.checkpoint.load_parameters_path) == ("gs://b/ck", str(tmp_path / "ck/4"))


def test_a_file_url_is_refused_with_the_local_path_to_write(tmp_path, monkeypatch):
    """load_parameters_path=file:///x ended in etils' KeyError: 'file://' traceback (exit code 1), and
    base_output_directory=file:///x in "cannot be reached (KeyError: 'file://'); check the network"."""
    monkeypatch.chdir(tmp_path)
    assert _config_error([BASE, "load_parameters_path=file:///data/my%20run/4"]) == (
        "load_parameters_path=file:///data/my%20run/4 is a file: URL, which is not read as a local path; write the "
        "path itself, /data/my run/4 (from the command line)")
    assert _config_error([BASE, "base_output_directory=FILE:runs"]).endswith(f"write the path itself, {tmp_path}/runs "
                                                                            "(from the command line)")
    assert _config_error([BASE, "dataset_type=hf", "hf_path=json", "hf_train_files=/d/a.json,file:///d/b.json"]) \
        .startswith("hf_train_files=/d/a.json,file:///d/b.json is a file: URL")
    assert _config_error([BASE, "jax_cache_dir=file://"]).endswith(f"write the path itself, {tmp_path} "
                                                                   "(from the command line)")


def test_a_home_of_a_user_that_does_not_exist_is_refused(tmp_path, monkeypatch):
    """base_output_directory=~nosuchuser/runs: expanduser keeps it, and the run wrote into ./~nosuchuser/runs."""
    monkeypatch.chdir(tmp_path)
    assert _config_error([BASE, "base_output_directory=~nosuchuser_tessera/runs"]) == (
        "base_output_directory=~nosuchuser_tessera/runs: ~nosuchuser_tessera is the home folder of a user "
        "'nosuchuser_tessera', and there is none here; write the folder's full path (from the command line)")
    assert _config_error([BASE, "hf_path=json", "hf_train_files=~nosuchuser_tessera/*.json"]).startswith(
        "hf_train_files=~nosuchuser_tessera/*.json: ~nosuchuser_tessera is the home folder")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_config([BASE, "base_output_directory=~/runs"], env={}).run.base_output_directory == \
        str(tmp_path / "home" / "runs")

def test_a_config_file_given_as_a_file_url_names_the_path_to_write():
    """train.py file:///repo/configs/base.yml said "config file file:/repo/configs/base.yml does not exist"."""
    assert _config_error([f"file://{BASE}"]) == (f"config file file://{BASE} is a file: URL, which is not read as a "
                                                 f"local path; write the path itself, {BASE}")

def test_a_url_without_a_bucket_is_refused():
    """base_output_directory=gs:// ended in Orbax's ValueError traceback ("The GCS path should contain the bucket
    name"), exit code 1, after the model was built."""
    assert _config_error([BASE, "base_output_directory=gs://"]) == (
        "base_output_directory=gs:// names no bucket after gs://; write gs://<bucket>/<folder>, e.g. "
        "gs://my-bucket/runs (from the command line)")
    assert _config_error([BASE, "checkpoint_dir=gs:///ck/"]).startswith("checkpoint_dir=gs:///ck/ names no bucket "
                                                                         "after gs://; write gs://<bucket>/<folder>, "
                                                                         "e.g. gs://my-bucket/ck (")
    cfg = load_config([BASE, "base_output_directory=gs://bucket", "hf_path=hf://datasets/x/y"], env={})
    assert (cfg.run.base_output_directory, cfg.data.hf_path) == ("gs://bucket", "hf://datasets/x/y")


@pytest.mark.parametrize("key", ["metrics_file", "base_output_directory", "load_parameters_path", "tokenizer_path",
                                 "hf_train_files"])
def test_a_path_with_a_name_too_long_for_file_systems_is_refused(tmp_path, key):
    """metrics_file=/tmp/<300 letters>.jsonl ended in OSError "File name too long", a traceback from the run
    folder's checks (Path.is_dir)."""
    long = "b" * 300
    message = _config_error([BASE, f"{key}={tmp_path}/{long}/x.json"])
    assert message == (f"{key}={tmp_path}/{'b' * 20}.../x.json has a file or folder name of 300 bytes, and file "
                       "systems take names of at most 255 bytes; use a shorter name (from the command line)")
    assert load_config([BASE, f"{key}={tmp_path}/{'b' * 255}"], env={})
    assert load_config([BASE, f"{key}=gs://bucket/{'b' * 300}"], env={})  # object names may be up to 1,024 bytes

@pytest.mark.parametrize("value, ok", [("0", False), ("-2", False), ("-1", True), ("1", True), ("5", True)])
def test_max_num_checkpoints_to_keep_is_minus_1_or_positive(value, ok):
    if ok:
        assert load_config([BASE, f"max_num_checkpoints_to_keep={value}"], env={}).checkpoint \
            .max_num_checkpoints_to_keep == int(value)
    else:
        assert _config_error([BASE, f"max_num_checkpoints_to_keep={value}"]) == (
            f"max_num_checkpoints_to_keep={value} is not allowed; use -1 to keep every checkpoint, or N >= 1 to keep "
            "the newest N (from the command line)")


@pytest.mark.parametrize("key, value, ok", [
    ("adam_b1", "0.99", True), ("adam_b1", "1", False), ("adam_b2", "0.999", True), ("adam_b2", "1.5", False),
    ("warmup_steps_fraction", "1", True), ("warmup_steps_fraction", "1.5", False),
    ("muon_beta", "0.99", True), ("muon_beta", "1", False),
])
def test_adam_betas_below_1_and_warmup_fraction_at_most_1(key, value, ok):
    """Each value refused here trained into NaN or a traceback before it was checked."""
    if ok:
        load_config([BASE, f"{key}={value}"], env={})
        return
    message = _config_error([BASE, f"{key}={value}"])
    if key == "warmup_steps_fraction":
        assert message == f"{key}='{value}' is too large; it must be <= 1.0 (from the command line)"
    elif key == "muon_beta":
        assert message.startswith("muon_beta=1 must be below 1: it is Muon's momentum decay (1 would never update it)")
    else:
        assert message.startswith(f"{key}={float(value):g} must be below 1: it is AdamW's decay of a moment average")


def test_a_key_set_twice_in_a_file_or_on_the_command_line_gets_a_warning(tmp_path, caplog):
    """YAML and key=value both keep the last value without a word; an edited copy of base.yml with
    `steps:` added at its end, or a command line with a key repeated at its end, is worth a line."""
    base_text = (REPO / "configs" / "base.yml").read_text()
    path = tmp_path / "mine.yml"
    path.write_text(base_text + "\nsteps: 7\n")
    base_line = next(i for i, line in enumerate(base_text.splitlines(), 1) if line.startswith("steps:"))
    with caplog.at_level("INFO", logger="tessera"):
        cfg = load_config([str(path), "run_name=a", "learning_rate=0.1", "learning_rate=0.2", "run_name=a"], env={})
    assert cfg.run.steps == 7 and cfg.optim.learning_rate == 0.2
    last = len(base_text.splitlines()) + 2
    # a warning for the file; an info line for the command line, where a recipe's overrides follow its own keys
    # on purpose; run_name=a twice, with the same value: nothing to say
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"config file {path} sets steps 2 times (lines {base_line}, {last}); the last, on line {last}, "
                    "is used"),
        ("INFO", "learning_rate is given twice on the command line (learning_rate=0.1, then learning_rate=0.2); the "
                 "last is used")]
    caplog.clear()
    with caplog.at_level("WARNING", logger="tessera"):
        load_config([BASE, "run_name=a"], env={})  # the repository's files set each key once
        for model in sorted((REPO / "configs" / "models").glob("*.yml")):
            load_config([BASE, "run_name=a", f"model_name={model.stem}"], env={})
    assert not caplog.records


def test_adam_eps_of_zero_and_a_negative_data_seed_are_refused():
    """adam_eps=0 trained into NaN at step 2 and was reported as a non-finite loss with advice about the
    learning rate; data_shuffle_seed=-1 ended in numpy's ValueError traceback."""
    assert _config_error([BASE, "adam_eps=0"]).startswith("adam_eps=0 must be above 0: AdamW divides each update by "
                                                           "sqrt(v) + adam_eps")
    load_config([BASE, "adam_eps=1e-12"], env={})
    assert _config_error([BASE, "data_shuffle_seed=-1"]) == ("data_shuffle_seed='-1' is too small; it must be >= 0 "
                                                             "(from the command line)")


# --------------------------------------------------------------------------- model files beside the config or in configs/models


def test_a_config_file_under_the_home_folder_is_found_as_typed(tmp_path, monkeypatch):
    """train.py "~/exp.yml" (quoted, or in a job's argument list, where no shell expands it) said the file does
    not exist, where -m tessera.config (which resolves the path first) and base_config: ~/... found it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "exp.yml").write_text("base_config: base.yml\nsteps: 7\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.yml").write_text("base_emb_dim: 48\n")
    cfg = load_config(["~/exp.yml", "model_name=mine"], env={})
    assert (cfg.run.steps, cfg.model.base_emb_dim) == (7, 48)


def test_a_config_file_outside_configs_finds_the_repository_models(tmp_path):
    path = tmp_path / "my.yml"
    path.write_text((REPO / "configs" / "base.yml").read_text())
    assert load_config([str(path), "run_name=x"], env={}).model.model_name == "default"
    assert load_config([str(path), "model_name=llama3.1-8b"], env={}).model.emb_dim == 4096
    (tmp_path / "models").mkdir()  # a models/ folder beside the config without that model: still the repository's
    (tmp_path / "models" / "mine.yml").write_text("base_emb_dim: 48\n")
    assert load_config([str(path), "model_name=llama3.1-8b"], env={}).model.emb_dim == 4096
    assert load_config([str(path), "model_name=mine"], env={}).model.base_emb_dim == 48
    (tmp_path / "models" / "1b.yml").write_text("base_emb_dim: 40\n")  # the file beside the config wins
    assert load_config([str(path), "model_name=1b"], env={}).model.base_emb_dim == 40


def test_maxtexts_deepseek_v3_name_reads_our_file_unless_one_of_that_name_is_beside_the_config(tmp_path, caplog):
    """MaxText's model_name=deepseek3-671b was refused ("Did you mean deepseek-v3?") on a command copied from it."""
    with caplog.at_level(logging.INFO, logger="tessera"):
        cfg = load_config([BASE, "model_name=deepseek3-671b"], env={})
    theirs = load_config([BASE, "model_name=deepseek-v3"], env={})
    assert cfg.model.model_name == "deepseek3-671b"
    assert dataclasses.replace(cfg.model, model_name="deepseek-v3") == theirs.model
    assert f"model_name=deepseek3-671b is MaxText's name for deepseek-v3; reading {REPO / 'configs' / 'models'}" \
        "/deepseek-v3.yml" in caplog.text
    path = tmp_path / "my.yml"
    path.write_text("steps: 3\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "deepseek3-671b.yml").write_text("base_emb_dim: 48\n")  # the user's own file of that name
    assert load_config([str(path), "model_name=deepseek3-671b"], env={}).model.base_emb_dim == 48


def test_an_unknown_model_lists_the_folders_searched_and_the_known_names(tmp_path):
    path = tmp_path / "my.yml"
    path.write_text("steps: 3\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.yml").write_text("base_emb_dim: 48\n")
    msg = _config_error([str(path), "model_name=xyz"])  # nothing close: every known name
    known = ", ".join(sorted({*MODELS, "mine"}))
    assert msg == (f"model_name='xyz': no file xyz.yml in {tmp_path / 'models'} or {REPO / 'configs' / 'models'}"
                   f". Known models: {known} (from the command line)")
    assert _config_error([BASE, "model_name=xyz"]) == (  # configs/models searched once
        f"model_name='xyz': no file xyz.yml in {REPO / 'configs' / 'models'}. Known models: {', '.join(MODELS)} "
        "(from the command line)")
    # a near miss: its closest names, not all 38 (the style's rule for an unknown key)
    assert _config_error([str(path), "model_name=Mine_"]) == (
        f"model_name='Mine_': no file Mine_.yml in {tmp_path / 'models'} or {REPO / 'configs' / 'models'}. Did you "
        f"mean mine? ({len(MODELS) + 1} models in all, a .yml file each there) (from the command line)")
    assert _config_error([BASE, "model_name=llama3.1_8B"]).startswith(
        f"model_name='llama3.1_8B': no file llama3.1_8B.yml in {REPO / 'configs' / 'models'}. Did you mean "
        "llama3.1-8b, ")
    # an empty name (model_name=, M_MODEL_NAME=""): said "no file .yml" and listed every name
    assert _config_error([BASE, "model_name="]) == (
        f"model_name='' is empty: it names a model file of {REPO / 'configs' / 'models'} without its .yml, e.g. "
        "model_name=default (the tiny model) or model_name=llama2-7b (from the command line)")
    # a path to a model file: the name to give (a path listed all 38 names, without a word on the path)
    assert _config_error([BASE, "model_name=configs/models/llama2-7b.yml"]) == (
        f"model_name='configs/models/llama2-7b.yml': no file configs/models/llama2-7b.yml.yml in "
        f"{REPO / 'configs' / 'models'}. model_name is a model's name, its file's without the folder and .yml: "
        "model_name=llama2-7b; a model file of your own goes in a models/ folder beside the config file, and "
        "model_name=llama2-7b names it (from the command line)")
    assert _config_error([str(path), "model_name=/elsewhere/mine.yaml"]).endswith(
        "model_name=mine; a model file of your own goes in a models/ folder beside the config file, and "
        "model_name=mine names it (from the command line)")
    name = "x" * 300  # longer than a file name may be: OSError (File name too long) and a traceback
    assert _config_error([BASE, f"model_name={name}"]).startswith(f"model_name='{name}': no file {name}.yml in ")


def test_base_config_inherits_as_maxtext_config_files_do(tmp_path, monkeypatch):
    """A MaxText-style `base_config: <file>` line: the parent is read first (beside the file, else
    in the repository's configs/), the child's keys win, the model file and the command line
    still come after both; a bad value names the file it is in; a missing parent, a value that
    is no file name and a cycle are one config error each."""
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "parent.yml").write_text("base_config: base.yml\nsteps: 4\nlearning_rate: 0.002\n")
    (exp / "child.yml").write_text("base_config: parent.yml\nsteps: 5\nbase_emb_dim: 40\n")
    cfg = load_config(["exp/child.yml"], env={})
    assert (cfg.run.steps, cfg.optim.learning_rate, cfg.model.base_emb_dim) == (5, 0.002, 40)
    assert cfg.data.per_device_batch_size == load_config([BASE], env={}).data.per_device_batch_size  # base.yml's
    cfg = load_config(["exp/child.yml", "model_name=llama2-7b", "steps=6"], env={})
    assert (cfg.run.steps, cfg.model.base_emb_dim, cfg.optim.learning_rate) == (6, 4096, 0.002)  # model file over both
    (exp / "parent.yml").write_text("base_config: base.yml\nlearning_rate: abc\n")
    assert _config_error(["exp/child.yml"]) == "learning_rate='abc' is not a valid float (from exp/parent.yml)"
    cases = {
        "base_config: nope.yml\n": "base_config: nope.yml in exp/c.yml names no file (looked for exp/nope.yml and "
                                   f"{REPO / 'configs' / 'nope.yml'})",
        "base_config: 3\n": "base_config=3 in exp/c.yml must name a YAML file",
        "base_config: c.yml\n": "names a file that inherits from exp/c.yml already",
    }
    for text, message in cases.items():
        (exp / "c.yml").write_text(text)
        assert message in _config_error(["exp/c.yml"]), text


def test_a_base_config_under_the_home_folder_is_found(tmp_path, monkeypatch):
    """`base_config: ~/exp/parent.yml` was looked for as a folder named ~ beside the file and in configs/."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "parent.yml").write_text("base_config: base.yml\nsteps: 7\n")
    (tmp_path / "child.yml").write_text("base_config: ~/exp/parent.yml\nlearning_rate: 0.002\n")
    cfg = load_config([str(tmp_path / "child.yml")], env={})
    assert (cfg.run.steps, cfg.optim.learning_rate) == (7, 0.002)


def test_an_environment_variable_that_is_a_near_miss_of_a_key_is_warned_about(caplog):
    """M_ variables that name no key are not Tessera's and are left alone, but one a letter or two
    from a key is most likely a typo that would silently train with the default: a warning names it."""
    import logging

    with caplog.at_level(logging.WARNING, logger="tessera"):
        cfg = load_config([BASE], env={"M_STPES": "3", "M_ARCH": "x86", "M_HOME": "/h", "M_STEPS_": "4"})
    assert cfg.run.steps == load_config([BASE], env={}).run.steps
    assert [r.getMessage() for r in caplog.records] == [
        "environment variable M_STEPS_ is not a config key and is ignored; did you mean M_STEPS?",
        "environment variable M_STPES is not a config key and is ignored; did you mean M_STEPS?"]


def test_a_run_name_may_hold_sub_folders():
    cfg = load_config([BASE, "run_name=sweep1/lr_3e-4", "base_output_directory=gs://bucket/runs"], env={})
    assert cfg.run.run_name == "sweep1/lr_3e-4"


@pytest.mark.parametrize("keys, mesh, message", [
    # one device: no "divisible by data*fsdp*expert=1"; the accumulation steps are a fix
    ({"gradient_accumulation_steps": 3}, {"data": 1, "fsdp": 1},
     "global batch 8 is not a multiple of gradient_accumulation_steps=3 (each accumulation step takes an equal share "
     "of it); change per_device_batch_size or gradient_accumulation_steps"),
    # 32 does not split into 3 steps on any mesh: the mesh is no fix
    ({"gradient_accumulation_steps": 3}, {"data": 1, "fsdp": 4},
     "global batch 32 / gradient_accumulation_steps=3 must be a whole number divisible by data*fsdp*expert=4 (mesh "
     "{'data': 1, 'stage': 1, 'fsdp': 4, 'sequence': 1, 'tensor': 1, 'expert': 1}), so a multiple of 12; change "
     "per_device_batch_size or gradient_accumulation_steps"),
    # 2 sequences split over 4 shards whatever the steps: the accumulation steps are no fix
    ({"gradient_accumulation_steps": 2, "per_device_batch_size": 0.5}, {"data": 1, "fsdp": 4},
     "global batch 2 / gradient_accumulation_steps=2 must be a whole number divisible by data*fsdp*expert=4 (mesh "
     "{'data': 1, 'stage': 1, 'fsdp': 4, 'sequence': 1, 'tensor': 1, 'expert': 1}), so a multiple of 8; change "
     "per_device_batch_size or the mesh"),
])
def test_an_accumulated_batch_that_does_not_split_names_the_fixes_that_work(keys, mesh, message):
    from tessera.config.derived import plan_run

    shape = {"data": 1, "stage": 1, "fsdp": 1, "sequence": 1, "tensor": 1, "expert": 1, **mesh}
    with pytest.raises(ConfigError) as e:
        plan_run(build_config(keys), shape)
    assert str(e.value) == message


@pytest.mark.parametrize("keys, stages, fsdp, message", [
    # tc compile_topology=v5p-8 ...: no num_pipeline_microbatches works (2 < 2 x 2 stages; 4 leaves 1 row per 2 shards)
    ({"gradient_accumulation_steps": 4, "per_device_batch_size": 4, "pipeline_delay_activation_forwarding": True,
      "num_pipeline_repeats": 2}, 2, 2,
     "the accumulation micro-batch of 4 sequences (global batch 16 / gradient_accumulation_steps=4) cannot be cut into "
     "4 pipeline microbatches (two per stage at least) that each split over data*fsdp*expert=2 devices; raise "
     "per_device_batch_size so the global batch is a multiple of 32 or lower gradient_accumulation_steps so each "
     "micro-batch is a multiple of 8"),
    ({"gradient_accumulation_steps": 2, "per_device_batch_size": 1}, 2, 4,
     "the accumulation micro-batch of 4 sequences (global batch 8 / gradient_accumulation_steps=2) cannot be cut into "
     "2 pipeline microbatches (one per stage at least) that each split over data*fsdp*expert=4 devices; raise "
     "per_device_batch_size so the global batch is a multiple of 16 or lower gradient_accumulation_steps so each "
     "micro-batch is a multiple of 8"),
    # 12 rows over 2 shards: 6 microbatches work where the automatic 2, 4 or 8 do not
    ({"per_device_batch_size": 1.5, "base_num_decoder_layers": 4}, 4, 2,
     "the batch of 12 sequences cannot be cut into 4 pipeline microbatches (one per stage at least) that each split "
     "over data*fsdp*expert=2 devices; raise per_device_batch_size so the batch is a multiple of 8 or set "
     "num_pipeline_microbatches=6"),
])
def test_a_pipelined_batch_that_does_not_split_names_the_fixes_that_work(keys, stages, fsdp, message):
    from tessera.config.derived import plan_run

    with pytest.raises(ConfigError) as e:
        plan_run(build_config({"ici_pipeline_parallelism": stages, **keys}),
                 {"data": 1, "stage": stages, "fsdp": fsdp, "sequence": 1, "tensor": 1, "expert": 1})
    assert str(e.value) == message


def test_keys_a_run_does_not_read_are_named():
    """Pipeline keys without pipeline stages, per-tensor remat keys without remat_policy=custom and MoE
    routing keys on a dense model were accepted without a word (pipeline_fsdp_ag_once alone was refused)."""
    from tessera.config.unread_keys import keys_without_effect

    cfg = load_config([BASE, "num_pipeline_microbatches=4", "pipeline_delay_activation_forwarding=true",
                       "query_proj=device", "megablox=true", "capacity_factor=1.0"], env={})
    assert keys_without_effect(cfg, {"fsdp": 8}) == [
        "num_pipeline_microbatches=4, pipeline_delay_activation_forwarding=True: no effect, this mesh has no pipeline "
        "stages (ici_pipeline_parallelism or dcn_pipeline_parallelism above 1 makes them)",
        "query_proj=device: no effect with remat_policy=full; the per-tensor keys are read with remat_policy=custom",
        "megablox=True, capacity_factor=1.0: no effect on a dense model (num_experts=1); they route a mixture of "
        "experts"]
    assert keys_without_effect(cfg, {"stage": 2, "fsdp": 4})[0].startswith("query_proj")  # a pipeline reads them
    # gathering a stage's weights over fsdp once, on stages not split over fsdp, changed nothing, silently
    once = load_config([BASE, "pipeline_fsdp_ag_once=true"], env={})
    assert keys_without_effect(once, {"data": 4, "stage": 2, "fsdp": 1}) == [
        "pipeline_fsdp_ag_once=true: no effect, this mesh has no fsdp axis (ici_fsdp_parallelism x "
        "dcn_fsdp_parallelism is 1), so a stage's weights are not split over one to gather"]
    assert keys_without_effect(once, {"stage": 2, "fsdp": 4}) == []
    # ZeRO-1 over a data axis of 1 (the default mesh is all fsdp) split nothing more, silently
    zero1 = load_config([BASE, "shard_optimizer_over_data=true"], env={})
    assert keys_without_effect(zero1, {"data": 1, "fsdp": 8}) == [
        "shard_optimizer_over_data=true: no effect, this mesh has no data axis (ici_data_parallelism x "
        "dcn_data_parallelism is 1); the optimizer state is split with the weights already"]
    assert keys_without_effect(zero1, {"data": 2, "fsdp": 4}) == []
    custom = load_config([BASE, "remat_policy=custom", "query_proj=device", "model_name=mixtral-8x7b",
                          "megablox=true"], env={})
    assert keys_without_effect(custom, {"fsdp": 8}) == []
    assert keys_without_effect(load_config([BASE], env={}), {"fsdp": 8}) == []
    # evaluation, profiler and bucket-metrics keys on a run that never reads them
    idle = load_config([BASE, "eval_steps=10", "eval_per_device_batch_size=4", "profiler_steps=3", "gcs_metrics=true",
                        "pgle_profiling_runs=5"], env={})
    assert keys_without_effect(idle, {"fsdp": 8}) == [
        "eval_steps=10, eval_per_device_batch_size=4.0: no effect, this run never evaluates (eval_interval=N evaluates "
        "every N steps)",
        "profiler_steps=3: no effect without profiler=xplane",
        "pgle_profiling_runs=5: no effect without enable_pgle=true (JAX's automatic PGLE, which it sizes)",
        "gcs_metrics=true: no effect with a local base_output_directory (metrics.jsonl in the run folder holds every "
        "record)"]
    pgle = load_config([BASE, "enable_pgle=true", "pgle_profiling_runs=5"], env={})
    assert keys_without_effect(pgle, {"fsdp": 8}) == []
    # model keys that only some families or rope_scaling=yarn read (a llama trained the same numbers with them)
    family = load_config([BASE, "trainable_position_size=64", "local_rope_max_timescale=100", "mscale=0.5",
                          "beta_fast=8"], env={})
    assert keys_without_effect(family, {"fsdp": 8}) == [
        "trainable_position_size=64: no effect, decoder_block=llama2 rotates its queries and keys; only "
        "decoder_block=gpt3 learns a position table",
        "local_rope_max_timescale=100: no effect, it is the rotary theta of the local layers of decoder_block=gemma3 "
        "and olmo3; decoder_block=llama2 uses rope_max_timescale",
        "beta_fast=8.0, mscale=0.5: no effect with rope_scaling=none"]
    # qwen3_next's Gated DeltaNet sizes on another family; its layers of a pattern have no local rotary theta
    gdn = load_config([BASE, "gdn_num_value_heads=64", "gdn_chunk_size=128"], env={})
    assert keys_without_effect(gdn, {"fsdp": 8}) == [
        "gdn_num_value_heads=64, gdn_chunk_size=128: no effect, they size the Gated DeltaNet layers of "
        "decoder_block=qwen3_next; decoder_block=llama2 has none"]
    nxt = load_config([BASE, "decoder_block=qwen3_next", "num_experts=4", "num_experts_per_tok=2", "shared_experts=1",
                       "local_rope_max_timescale=100"], env={})
    assert keys_without_effect(nxt, {"fsdp": 8}) == [
        "local_rope_max_timescale=100: no effect, it is the rotary theta of the local layers of decoder_block=gemma3 "
        "and olmo3; decoder_block=qwen3_next uses rope_max_timescale"]
    dense = load_config([BASE, "shared_experts=1", "base_moe_mlp_dim=512"], env={})
    assert keys_without_effect(dense, {"fsdp": 8}) == [
        "shared_experts=1, base_moe_mlp_dim=512: no effect on a dense model (num_experts=1), whose MLP is base_mlp_dim "
        "wide; they size or route a mixture of experts"]
    moe_keys = load_config([BASE, "model_name=mixtral-8x7b", "routed_bias_update_rate=0.01", "topk_routing_group=2",
                            "routing_group_score=max", "sparse_matmul=false", "megablox=false",
                            "ragged_buffer_factor=2", "temperature_tuning_scale=0.2",
                            "mtp_loss_scaling_factor=0.3", "rope_scaling_factor=4"], env={})
    assert keys_without_effect(moe_keys, {"fsdp": 8}) == [
        "routed_bias_update_rate=0.01: no effect without routed_bias=true",
        "topk_routing_group=2, routing_group_score=max: no effect without n_routing_groups (above 1)",
        "ragged_buffer_factor=2.0: no effect with capacity routing; it sizes dropless routing's buffer "
        "(sparse_matmul=true or megablox=true)",
        "temperature_tuning_scale=0.2: no effect without temperature_tuning=true (decoder_block=llama4)",
        "mtp_loss_scaling_factor=0.3: no effect without mtp_num_layers (above 0)",
        "rope_scaling_factor=4.0: no effect with rope_scaling=none"]
    # experts of base_moe_mlp_dim and no dense layer: base_mlp_dim sized nothing, without a word
    wide = load_config([BASE, "model_name=mixtral-8x7b", "base_moe_mlp_dim=4096"], env={})
    assert keys_without_effect(wide, {"fsdp": 8}) == [
        "base_mlp_dim=14336: no effect, every layer's MLP is experts of base_moe_mlp_dim=4096; base_mlp_dim sizes "
        "only dense layers (deepseek's first_num_dense_layers, llama4's between its expert layers)"]
    assert keys_without_effect(load_config([BASE, "model_name=deepseek-small", "base_mlp_dim=512"], env={}),
                               {"fsdp": 8}) == []  # its first layer is dense
    gpt3 = load_config([BASE, "model_name=gpt3-52k", "rope_scaling=linear", "rope_max_timescale=500000"], env={})
    assert keys_without_effect(gpt3, {"fsdp": 8}) == [
        "rope_max_timescale=500000, rope_scaling=linear: no effect, decoder_block=gpt3 adds position embeddings and "
        "has no rotary embedding"]
    for model in (REPO / "configs" / "models").glob("*.yml"):  # the model files set only keys their model reads
        assert keys_without_effect(load_config([BASE, f"model_name={model.stem}"], env={}), {"fsdp": 8}) == [], model
    # mesh axes that do not divide what they would split (the split is dropped; results stay right)
    moe = load_config([BASE, "model_name=mixtral-8x7b", "num_experts=6", "max_target_length=36"], env={})
    assert keys_without_effect(moe, {"sequence": 8, "expert": 4}) == [
        "the sequence axis (8 ways) does not divide max_target_length=36: the tokens are not split over it, and its "
        "devices repeat each other's work; choose a length 8 divides",
        "the expert axis (4 ways) does not divide num_experts=6: the experts are not split over it (it splits their "
        "weights like fsdp instead); choose an expert parallelism that divides num_experts"]
    assert keys_without_effect(moe, {"sequence": 4, "expert": 2}) == []
    # dropless routing's receive buffer exists only with an expert axis (it was taken without a word)
    buffer = load_config([BASE, "model_name=mixtral-8x7b", "ragged_buffer_factor=2"], env={})
    assert keys_without_effect(buffer, {"fsdp": 8}) == [
        "ragged_buffer_factor=2.0: no effect without an expert axis (ici_expert_parallelism x "
        "dcn_expert_parallelism is 1); it sizes the buffer an expert shard receives token copies into, and here "
        "every device runs all the experts on its own copies"]
    assert keys_without_effect(buffer, {"fsdp": 2, "expert": 4}) == []
    used = load_config([BASE, "eval_interval=5", "eval_steps=10", "profiler=xplane", "profiler_steps=3",
                        "base_output_directory=gs://b/runs", "gcs_metrics=true"], env={})
    assert keys_without_effect(used, {"fsdp": 8}) == []


def test_splash_attention_keys_the_run_does_not_read_are_named(caplog):
    """A TPU recipe's sa_block_* tiles on a CPU or GPU run (another kernel than splash), the dQ kernel's
    blocks beside sa_use_fused_bwd_kernel=true (the fused backward kernel has no dQ blocks: block_sizes
    sets them to None) and context_parallel_load_balance without a sequence axis were accepted without
    a word. The trainer's set-up logs the line after the kernel's."""
    import logging

    import jax

    from tessera.config.unread_keys import attention_keys_without_effect
    from tessera.step import setup

    tiles = load_config([BASE, "sa_block_q=1024", "sa_block_kv=512", "sa_q_layout=SEQ_MINOR"], env={})
    line = ("sa_block_q=1024, sa_block_kv=512, sa_q_layout=SEQ_MINOR: no effect, this run's attention kernel is "
            "dot_product; they tune Pallas splash attention, the TPU kernel of attention=flash or autoselected")
    assert attention_keys_without_effect(tiles, "dot_product", {"fsdp": 8}) == [line]
    assert attention_keys_without_effect(tiles, "cudnn", {"fsdp": 8}) == [line.replace("is dot_product", "is cudnn")]
    assert attention_keys_without_effect(tiles, "splash", {"fsdp": 8}) == []
    fused = load_config([BASE, "sa_use_fused_bwd_kernel=true", "sa_block_q_dq=256", "sa_block_q_dkv=256",
                         "context_parallel_load_balance=false"], env={})
    assert attention_keys_without_effect(fused, "splash", {"fsdp": 4, "sequence": 2}) == [
        "sa_block_q_dq=256: no effect with sa_use_fused_bwd_kernel=true, whose one backward kernel computes dQ with "
        "dK and dV in the dK/dV kernel's blocks (sa_block_q_dkv, sa_block_kv_dkv)"]
    assert attention_keys_without_effect(fused, "splash_interpret", {"fsdp": 8})[1] == (
        "context_parallel_load_balance=false: no effect without a sequence axis (ici_sequence_parallelism x "
        "dcn_sequence_parallelism is 1), whose parts it balances")
    assert attention_keys_without_effect(load_config([BASE], env={}), "dot_product", {"fsdp": 8}) == []
    with caplog.at_level(logging.WARNING, logger="tessera"):
        setup(load_config([BASE, "sa_block_q=256", "steps=1"], env={}), jax.devices()[:1])
    assert [r.getMessage() for r in caplog.records if "sa_block_q" in r.getMessage()] == [
        "sa_block_q=256: no effect, this run's attention kernel is dot_product; they tune Pallas splash attention, "
        "the TPU kernel of attention=flash or autoselected"]


def test_other_optimizers_and_decodings_keys_are_named_in_training():
    """adam_* with opt_type=sgd, muon_* without muon, kv_quant_* without quantize_kvcache and
    save_quantized_params_path given to train.py were accepted without a word."""
    from tessera.config.unread_keys import keys_without_effect

    sgd = load_config([BASE, "opt_type=sgd", "adam_b2=0.99", "muon_beta=0.9", "kv_quant_dtype=int4",
                       "save_quantized_params_path=q", "quantization=int8"], env={})
    assert keys_without_effect(sgd, {"fsdp": 8}) == [
        "adam_b2=0.99: no effect with opt_type=sgd (plain SGD: no moments, no weight decay)",
        "muon_beta=0.9: no effect with opt_type=sgd; they are read with opt_type=muon",
        "kv_quant_dtype=int4: no effect without quantize_kvcache=true (and only in decoding)",
        "save_quantized_params_path: no effect on training; decode.py writes the loaded weights quantized there "
        "(checkpoints of a run with `quantization` hold them in weight_dtype)"]
    muon = load_config([BASE, "opt_type=muon", "adam_b2=0.99", "muon_beta=0.9"], env={})
    assert keys_without_effect(muon, {"fsdp": 8}) == []  # muon's AdamW part reads adam_*


def test_a_quantized_kv_cache_is_named_in_training():
    """quantize_kvcache=true (with kv_quant_dtype=int4) given to train.py was accepted without a word, as if the
    run stored something quantized: training keeps no KV cache."""
    from tessera.config.unread_keys import keys_without_effect

    kv = load_config([BASE, "quantize_kvcache=true", "kv_quant_dtype=int4"], env={})
    assert keys_without_effect(kv, {"fsdp": 8}) == [
        "quantize_kvcache=true, kv_quant_dtype=int4: no effect on training, which keeps no KV cache; decode.py "
        "stores its cache quantized (`quantization` quantizes the training matmuls)"]


def test_keys_of_another_input_pipeline_checkpoints_off_or_no_hlo_dump_are_named():
    """Data keys of another dataset_type (dataset_type=hf with grain_eval_files; data_shuffle_seed with hf,
    which does not shuffle; a tokenizer with synthetic tokens), checkpoint keys with enable_checkpointing=false
    and the HLO dump's keys without dump_hlo=true were accepted without a word."""
    from tessera.config.unread_keys import keys_without_effect

    hf = load_config([BASE, "dataset_type=hf", "hf_path=json", "hf_train_files=/d/a.json", "grain_eval_files=/d/e",
                      "dataset_name=c4", "data_shuffle_seed=3", "tokenizer_path=/t.model"], env={})
    assert keys_without_effect(hf, {"fsdp": 8}) == [
        "dataset_name=c4, grain_eval_files=/d/e, data_shuffle_seed=3: no effect with dataset_type=hf (dataset_name is "
        "read with dataset_type=tfds; grain_eval_files is read with dataset_type=grain; data_shuffle_seed is read "
        "with dataset_type=synthetic or grain or tfds)"]
    synthetic = load_config([BASE, "tokenizer_path=/t.model", "packing=false", "dataset_path=/d"], env={})
    assert keys_without_effect(synthetic, {"fsdp": 8}) == [
        "dataset_path=/d: no effect with dataset_type=synthetic (Tessera's default; MaxText's is tfds), which trains "
        "on random tokens; set dataset_type=tfds, hf or grain to read that data",
        "tokenizer_path=/t.model, packing=False: no effect with dataset_type=synthetic, whose random tokens need no "
        "files, tokenizer or documents"]
    grain = load_config([BASE, "dataset_type=grain", "grain_train_files=/d/*.array_record", "grain_worker_count=2",
                         "data_shuffle_seed=3", "tokenizer_path=/t.model", "packing=false"], env={})
    assert keys_without_effect(grain, {"fsdp": 8}) == []
    off = load_config([BASE, "enable_checkpointing=false", "checkpoint_period=5", "async_checkpointing=false",
                       "dump_hlo_local_dir=/tmp/dump", "dump_hlo_module_name=jit_eval_step"], env={})
    assert keys_without_effect(off, {"fsdp": 8}) == [
        "checkpoint_period=5, async_checkpointing=False: no effect with enable_checkpointing=false, which saves no "
        "checkpoint",
        "dump_hlo_local_dir=/tmp/dump, dump_hlo_module_name=jit_eval_step: no effect without dump_hlo=true"]
    flags = load_config([BASE, "dump_hlo=true", "dump_hlo_xla_flags=--xla_dump_to=/tmp/d", "dump_hlo_module_name=x"],
                        env={})
    assert keys_without_effect(flags, {"fsdp": 8}) == [
        "dump_hlo_module_name=x: no effect beside dump_hlo_xla_flags, whose flags XLA is given instead of the dump "
        "folder and program filter"]
    used = load_config([BASE, "checkpoint_period=5", "dump_hlo=true", "dump_hlo_local_dir=/tmp/dump"], env={})
    assert keys_without_effect(used, {"fsdp": 8}) == []


def test_latent_attention_keys_on_another_family_are_named():
    """q_lora_rank, kv_lora_rank and the MLA head widths size deepseek's latent attention only; on a llama
    or mixtral they were accepted without a word (Models.md: a family key set for a model that does not
    read it is named in a start-up warning)."""
    from tessera.config.unread_keys import keys_without_effect

    llama = load_config([BASE, "q_lora_rank=16", "kv_lora_rank=32", "v_head_dim=16"], env={})
    assert keys_without_effect(llama, {"fsdp": 8}) == [
        "q_lora_rank=16, kv_lora_rank=32, v_head_dim=16: no effect, they size decoder_block=deepseek's latent "
        "attention (MLA); decoder_block=llama2's heads are head_dim=64 wide"]
    deepseek = load_config([BASE, "model_name=deepseek-small", "q_lora_rank=16", "kv_lora_rank=32"], env={})
    assert keys_without_effect(deepseek, {"fsdp": 8}) == []


def test_llama3_rope_band_factors_without_llama3_scaling_are_named():
    """rope_low_freq_factor and rope_high_freq_factor are read by rope_scaling=llama3 only; with none,
    linear or yarn (or on gpt3) they were accepted without a word."""
    from tessera.config.unread_keys import keys_without_effect

    plain = load_config([BASE, "rope_high_freq_factor=2"], env={})
    assert keys_without_effect(plain, {"fsdp": 8}) == ["rope_high_freq_factor=2.0: no effect with rope_scaling=none"]
    gemma3 = load_config([BASE, "model_name=gemma3-4b", "rope_low_freq_factor=2", "rope_high_freq_factor=8"], env={})
    assert keys_without_effect(gemma3, {"fsdp": 8}) == [
        "rope_low_freq_factor=2.0, rope_high_freq_factor=8.0: no effect with rope_scaling=linear"]
    gpt3 = load_config([BASE, "model_name=gpt3-52k", "rope_low_freq_factor=2"], env={})
    assert keys_without_effect(gpt3, {"fsdp": 8}) == [
        "rope_low_freq_factor=2.0: no effect, decoder_block=gpt3 adds position embeddings and has no rotary embedding"]
    llama3 = load_config([BASE, "model_name=llama3.1-8b", "rope_low_freq_factor=2", "rope_high_freq_factor=8"], env={})
    assert keys_without_effect(llama3, {"fsdp": 8}) == []


def test_bias_keys_on_gpt3_are_named():
    """gpt3 always has its attention and MLP biases: attention_bias=true or mlp_bias=true on it was
    accepted without a word."""
    from tessera.config.unread_keys import keys_without_effect

    gpt3_biases = load_config([BASE, "model_name=gpt3-52k", "attention_bias=true", "mlp_bias=true"], env={})
    assert keys_without_effect(gpt3_biases, {"fsdp": 8}) == [
        "attention_bias=True, mlp_bias=True: no effect, decoder_block=gpt3 always has biases on its attention and MLP "
        "projections"]


def test_a_final_learning_rate_above_the_peak_is_refused():
    with pytest.raises(ConfigError, match="cosine_learning_rate_final_fraction"):
        load_config([BASE, "cosine_learning_rate_final_fraction=2"], env={})
    assert load_config([BASE, "cosine_learning_rate_final_fraction=1"], env={}).optim.cosine_learning_rate_final_fraction == 1


def test_deepseek_refuses_a_sliding_window_its_attention_would_ignore():
    with pytest.raises(ConfigError, match=r"sliding_window_size=4: decoder_block=deepseek's latent attention \(MLA\) "
                                          "attends over the whole sequence and would ignore it"):
        load_config([BASE, "model_name=deepseek-small", "sliding_window_size=4"], env={})


def test_no_config_file_names_the_program_that_was_run(tmp_path):
    """decode.py without arguments suggested `python3 train.py configs/base.yml run_name=demo`."""
    for program, shown in (([str(REPO / "decode.py")], "decode.py"),
                           (["-m", "tessera.train_compile"], "-m tessera.train_compile")):
        proc = subprocess.run([sys.executable, *program], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
            f"config error: no config file given: the first argument is a config file, e.g. `.venv/bin/python {shown} "
            "configs/base.yml ...`"), proc.stderr[-2000:]
    # an empty first argument (`train.py "$CONFIG"` with CONFIG unset) said "config file . is a directory"
    for program, shown in (([str(REPO / "train.py")], "train.py"), (["-m", "tessera.config"], "-m tessera.config")):
        proc = subprocess.run([sys.executable, *program, "", "steps=3"], capture_output=True, text=True, cwd=tmp_path,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
            "config error: no config file given: the first argument is empty (''); it is a config file, e.g. "
            f"`.venv/bin/python {shown} configs/base.yml ...`"), proc.stderr[-2000:]


def test_a_command_that_starts_with_a_key_is_told_the_config_file_comes_first(tmp_path):
    """MaxText's newer commands may leave the config file out (`python3 -m MaxText.train run_name=x ...`); here that
    said "config file run_name=x does not exist", as if the argument were a file name."""
    for program, shown in (([str(REPO / "train.py")], "train.py"), (["-m", "tessera.config"], "-m tessera.config")):
        proc = subprocess.run([sys.executable, *program, "run_name=x", "steps=3"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
            "config error: no config file given: the first argument, 'run_name=x', is a key=value; the config file "
            f"comes first, e.g. `.venv/bin/python {shown} configs/base.yml run_name=x steps=3`"), proc.stderr[-2000:]


def test_a_runs_config_yml_given_back_is_read_as_it_stands(tmp_path):
    """A run's config.yml holds every key, its model file's included: read back as the config file (to decode
    with, or to resume), it gives the same config. The model file was applied over it again, so a run trained
    with base_emb_dim=64 on llama2-7b came back 4096 wide and its checkpoint matched no shape. With another
    model_name on the command line, that model's file applies as usual."""
    from tessera.run_folder import create_run_folder

    sizes = ["model_name=llama2-7b", "base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=128",
             "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=32", "vocab_size=512"]
    cfg = load_config([BASE, "run_name=r", f"base_output_directory={tmp_path}", *sizes], env={})
    saved = create_run_folder(cfg, tmp_path / "r") / "config.yml"
    assert flat_dict(load_config([str(saved)], env={})) == flat_dict(cfg)
    again = load_config([str(saved), "steps=7"], env={})
    assert again.run.steps == 7 and again.model.emb_dim == 64
    other = load_config([str(saved), "model_name=gemma-2b"], env={}).model
    assert other.emb_dim == 2048 and other.decoder_block == "gemma"


def test_train_compiles_keys_given_to_train_are_each_said_to_be_read_by_train_compile(tmp_path, caplog):
    """train.py reads none of the compile section's keys; compile_topology and compiled_trainstep_file were
    said so in the log, while compile_topology_num_slices=2 and compile_hbm_budget_fraction=0.8 went without
    a word. At their defaults no line is logged."""
    from tessera.run_folder import create_run_folder

    keys = {"compile_topology": "v5e-8", "compile_topology_num_slices": "2", "compile_hbm_budget_fraction": "0.8",
            "compiled_trainstep_file": str(tmp_path / "step.pkl")}
    for run, given in (("a", keys), ("b", {})):
        caplog.clear()
        cfg = load_config([BASE, f"run_name={run}", f"base_output_directory={tmp_path}",
                           *[f"{k}={v}" for k, v in given.items()]], env={})
        with caplog.at_level(logging.INFO, logger="tessera"):
            create_run_folder(cfg, tmp_path / run)
        said = [r.getMessage() for r in caplog.records if " by train_compile" in r.getMessage()]
        assert len(said) == len(given) and all(f"{k}={cfg.compile.__dict__[k]} is " in line
                                               for k, line in zip(given, said)), said
