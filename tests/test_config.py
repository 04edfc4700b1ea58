"""Config: every shipped YAML validates; precedence; clear errors for bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from tessera.config import ConfigError, build_config, load_config
from tessera.config.schema import DECODER_BLOCKS, REMAT_POLICIES, render_base_yml
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
    ("ici_pipeline_parallelism=2", "pipeline parallelism is not supported"),
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
