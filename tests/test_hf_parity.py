"""Hugging Face checkpoints: conversion both ways, and our logits against `transformers`.

Tiny random models are built and run by the transformers implementation in the reference
interpreter (`bash setup.sh HF_REFERENCE=1`; see tessera.tools.hf_env). Without it these
tests skip, except in CI (CI or TESSERA_REQUIRE_HF_REFERENCE set), where they fail.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO

from tessera.checkpointing import load_parameters
from tessera.models import build_model
from tessera.tools import hf_env, hf_reader
from tessera.tools.check_logits import compare
from tessera.tools.convert import hf_to_tessera, tessera_to_hf
from tessera.tools.estimate import load_model_config
from tessera.tools.hf_reader import Reader, mxfp4_values
from tessera.tools.hf_config_out import hf_config
from tessera.tools.hf_configs import as_overrides, config_from_hf

ATOL = 1e-4  # float32 on both sides; measured differences are ~4e-6 on logits of magnitude ~5
TINY_VOCAB = 97  # every family's tiny checkpoint (hf_reference.VOCAB; checked when they are made)


def _require_reference():
    if hf_env.reference_python() is None:
        if os.environ.get("CI") or os.environ.get("TESSERA_REQUIRE_HF_REFERENCE"):
            pytest.fail(str(hf_env.ReferenceUnavailable()))
        pytest.skip(str(hf_env.ReferenceUnavailable()))


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """family -> (its tiny random HF checkpoint folder, sharded into several files; the reference's
    logits on _padded_batch): every family made and run in one start of the reference interpreter
    (each start costs seconds, more than a tiny model)."""
    _require_reference()
    root = tmp_path_factory.mktemp("hf")
    families = sorted({family for family, _ in CASES.values()})
    folders = {family: root / family / "model" for family in families}
    logits = hf_env.reference_outputs_many(
        [(folders[family], *_padded_batch(TINY_VOCAB)) for family in families],
        before=[hf_env.tiny_command(family, folders[family], max_shard_size="20KB") for family in families])
    for family in families:
        assert json.loads((folders[family] / "config.json").read_text())["vocab_size"] == TINY_VOCAB, family
    return {family: (folders[family], out["logits"]) for family, out in zip(families, logits)}


@pytest.fixture(scope="module")
def hf_model(prebuilt, tmp_path_factory):
    """family -> a tiny random HF checkpoint folder (sharded into several files), built once."""
    made = {(family, 0): folder for family, (folder, _) in prebuilt.items()}

    def get(family, seed=0):
        if (family, seed) not in made:
            out = tmp_path_factory.mktemp(f"hf_{family}_{seed}")
            made[family, seed] = hf_env.make_tiny(family, out / "model", seed=seed, max_shard_size="20KB")
        return made[family, seed]

    return get


def _config(hf_dir, *extra):
    keys = config_from_hf(json.loads((hf_dir / "config.json").read_text()))
    return load_model_config("default", [*as_overrides(keys), "attention=dot_product", *extra])


def _restore(cfg, path):
    model = build_model(cfg.model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), model.param_shapes())
    return model, load_parameters(str(path), abstract)


def _padded_batch(vocab):
    tokens = np.random.default_rng(0).integers(3, vocab, size=(2, 9)).astype(np.int32)
    mask = np.ones((2, 9), np.int32)
    mask[1, 6:] = 0  # the second row ends in 3 padding tokens
    return tokens, mask


CASES = {
    "llama2": ("llama2", ()),
    "llama2-unscanned": ("llama2", ("scan_layers=false",)),
    "llama3-rope-scaling": ("llama3", ()),
    "llama3-fused-mlp": ("llama3", ("fused_mlp=true",)),
    "mistral-sliding-window": ("mistral", ()),
    "mixtral-dropless": ("mixtral", ("sparse_matmul=true",)),
    "mixtral-capacity": ("mixtral", ("capacity_factor=-1",)),
    "gemma": ("gemma", ()),
    "gemma2": ("gemma2", ()),
    "gemma2-unscanned": ("gemma2", ("scan_layers=false",)),
    "gpt2-fused-qkv": ("gpt2", ("fused_qkv=true",)),
    "gpt2-unfused-unscanned": ("gpt2", ("fused_qkv=false", "scan_layers=false")),
    "qwen2": ("qwen2", ()),
    "qwen3": ("qwen3", ()),
    "qwen3-unscanned": ("qwen3", ("scan_layers=false",)),
    "qwen3_moe-dropless": ("qwen3_moe", ("sparse_matmul=true",)),
    "qwen3_moe-capacity": ("qwen3_moe", ("capacity_factor=-1",)),
    "gemma3": ("gemma3", ()),
    "gemma3-unscanned": ("gemma3", ("scan_layers=false",)),
    "deepseek-dropless": ("deepseek", ("sparse_matmul=true",)),
    "deepseek-capacity-unscanned": ("deepseek", ("capacity_factor=-1", "scan_layers=false")),
    "deepseek_v2-dropless": ("deepseek_v2", ("sparse_matmul=true",)),
    "deepseek_v2-capacity-unscanned": ("deepseek_v2", ("capacity_factor=-1", "scan_layers=false")),
    "gpt_oss-dropless": ("gpt_oss", ("sparse_matmul=true",)),
    "gpt_oss-capacity-unscanned": ("gpt_oss", ("capacity_factor=-1", "scan_layers=false")),
    "llama-biases-yarn": ("llama_bias_yarn", ()),
    "llama4-dropless": ("llama4", ("sparse_matmul=true",)),
    "llama4-capacity-unscanned": ("llama4", ("capacity_factor=-1", "scan_layers=false")),
    "olmo3": ("olmo3", ()),
    "olmo3-unscanned": ("olmo3", ("scan_layers=false",)),
    "olmo2": ("olmo2", ()),
    "olmo2-unscanned": ("olmo2", ("scan_layers=false",)),
    # the same checkpoint as Tessera's olmo3 without windows (4-layer blocks, the local layers at the global theta)
    "olmo2-as-olmo3": ("olmo2", ("decoder_block=olmo3", "local_rope_max_timescale=-1")),
    # chunks of 4 tokens: the 9-token rows cross two chunk boundaries (one chunk would hold them whole)
    "qwen3_next-dropless": ("qwen3_next", ("sparse_matmul=true", "gdn_chunk_size=4")),
    "qwen3_next-capacity-unscanned": ("qwen3_next", ("capacity_factor=-1", "scan_layers=false")),
}


@pytest.fixture(scope="module")
def reference_logits(prebuilt):
    """family -> the reference's logits for _padded_batch on its tiny checkpoint."""
    return lambda family: prebuilt[family][1]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_logits_match_transformers(case, hf_model, reference_logits, tmp_path):
    family, extra = CASES[case]
    hf_dir = hf_model(family)
    cfg = _config(hf_dir, *extra)
    hf_to_tessera(hf_dir, tmp_path / "converted", cfg)
    model, params = _restore(cfg, tmp_path / "converted")
    tokens, mask = _padded_batch(cfg.model.vocab_size)
    ours = np.asarray(model.apply(params, tokens, None, mask))  # padding: segment id 0
    ref = reference_logits(family)
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 1.0  # logits big enough for the tolerance to mean something
    np.testing.assert_allclose(ours[real], ref[real], rtol=0, atol=ATOL)


@pytest.mark.parametrize("family,extra", [("llama3", ("scan_layers=true",)), ("llama3", ("fused_mlp=true",)),
                                          ("gemma2", ("scan_layers=false",)),
                                          ("mixtral", ()), ("gpt2", ("fused_qkv=false",)), ("qwen2", ()), ("qwen3", ()),
                                          ("qwen3_moe", ()), ("gemma3", ()), ("gemma3", ("scan_layers=false",)),
                                          ("deepseek", ()), ("deepseek", ("scan_layers=false",)), ("deepseek_v2", ()),
                                          ("gpt_oss", ()), ("gpt_oss", ("scan_layers=false",)),
                                          ("llama_bias_yarn", ("fused_mlp=true",)),
                                          ("llama4", ()), ("llama4", ("scan_layers=false",)), ("olmo3", ()),
                                          ("olmo3", ("scan_layers=false",)), ("olmo2", ()),
                                          ("olmo2", ("decoder_block=olmo3", "local_rope_max_timescale=-1")),
                                          ("qwen3_next", ()), ("qwen3_next", ("scan_layers=false",))])
@pytest.mark.slow
def test_round_trip_is_exact(family, extra, hf_model, tmp_path):
    hf_dir = hf_model(family)
    cfg = _config(hf_dir, *extra)
    hf_to_tessera(hf_dir, tmp_path / "tessera", cfg)
    tessera_to_hf(str(tmp_path / "tessera"), tmp_path / "back", cfg, max_shard_size=30_000)
    original, back = Reader(hf_dir), Reader(tmp_path / "back")
    assert sorted(back.names) == sorted(n for n in original.names if n != "lm_head.weight" or not cfg.model.logits_via_embedding)
    assert len(list((tmp_path / "back").glob("model-*-of-*.safetensors"))) > 1  # sharded, with an index
    for name in back.names:
        a, b = original.get(name), back.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    # the written config.json describes the same model, and transformers loads what we wrote
    assert config_from_hf(json.loads((tmp_path / "back" / "config.json").read_text())) == config_from_hf(original.config)
    if family not in ("gemma2", "mixtral", "qwen3_moe", "gemma3", "deepseek", "deepseek_v2", "olmo3", "olmo2",
                      "qwen3_next") \
            or extra == ("scan_layers=false",) \
            and family in ("gemma3", "deepseek", "olmo3", "qwen3_next"):
        return  # the richest configs, once each (each check costs a reference run of two models)
    tokens, _ = _padded_batch(cfg.model.vocab_size)
    back_logits, original_logits = hf_env.reference_outputs_many([(tmp_path / "back", tokens), (hf_dir, tokens)])
    np.testing.assert_array_equal(back_logits["logits"], original_logits["logits"])


@pytest.mark.slow
def test_a_gemma3_config_json_as_released_converts_to_the_same_logits(hf_model, tmp_path):
    """The released Gemma 3 config.json (transformers 4's keys: the global layers' rope_scaling, rope_theta,
    rope_local_base_freq), which transformers reads as rope_parameters: the converter read no rope scaling
    (logits 0.9 off on the tiny model), and told a gemma3-4b user to set rope_scaling=none."""
    hf_dir = tmp_path / "released"
    shutil.copytree(hf_model("gemma3"), hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_scaling={k: v for k, v in rope["full_attention"].items() if k != "rope_theta"},
                  rope_theta=rope["full_attention"]["rope_theta"],
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    (hf_dir / "config.json").write_text(json.dumps(config))
    cfg = _config(hf_dir)
    assert (cfg.model.rope_scaling, cfg.model.rope_scaling_factor) == ("linear", 8.0)
    _assert_converts_to_the_reference_logits(hf_dir, cfg, tmp_path)


def _assert_converts_to_the_reference_logits(hf_dir, cfg, tmp_path):
    """hf_dir converted with `cfg` gives transformers' logits of hf_dir (its own config.json) on a padded batch."""
    hf_to_tessera(hf_dir, tmp_path / "converted", cfg)
    model, params = _restore(cfg, tmp_path / "converted")
    tokens, mask = _padded_batch(cfg.model.vocab_size)
    ours = np.asarray(model.apply(params, tokens, None, mask))
    ref = hf_env.reference_logits(hf_dir, tokens, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], rtol=0, atol=ATOL)


@pytest.mark.slow
def test_a_gemma2_config_json_without_its_caps_and_window_converts_to_the_same_logits(hf_model, tmp_path):
    """transformers builds the settings a config.json leaves out with its config class's defaults (Gemma 2: soft
    caps 50 and 30, query_pre_attn_scalar 256, window 4096); the converter read no caps, head_dim**-0.5 and no
    window (logits 3.6 off on the tiny model)."""
    hf_dir = tmp_path / "trimmed"
    shutil.copytree(hf_model("gemma2"), hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
        del config[key]
    (hf_dir / "config.json").write_text(json.dumps(config))
    cfg = _config(hf_dir)
    _assert_converts_to_the_reference_logits(hf_dir, cfg, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family,change", [("gemma", {"hidden_act": "silu", "sliding_window": 3}),
                                           ("llama2", {"sliding_window": 3})])
def test_config_json_keys_read_as_transformers_reads_them_convert_to_the_same_logits(family, change, hf_model,
                                                                                     tmp_path):
    """transformers' Gemma runs the hidden_act of its config.json (the converter built a GeGLU whatever it said), and
    its Gemma and Llama attend to every earlier position whatever sliding_window says (the converter read a window)."""
    hf_dir = tmp_path / "changed"
    shutil.copytree(hf_model(family), hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **change}))
    _assert_converts_to_the_reference_logits(hf_dir, _config(hf_dir), tmp_path)


@pytest.mark.slow
def test_a_deepseek_yarn_without_truncation_converts_to_the_same_logits(hf_model, tmp_path):
    """transformers reads YaRN's `truncate` for DeepSeek-V3 as for every family; the converter read DeepSeek's YaRN
    as truncated whatever it said (the tiny model's mixed frequencies moved, logits off)."""
    hf_dir = tmp_path / "untruncated"
    shutil.copytree(hf_model("deepseek"), hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "truncate": False}
    (hf_dir / "config.json").write_text(json.dumps(config))
    cfg = _config(hf_dir)
    assert cfg.model.rope_truncate is False
    _assert_converts_to_the_reference_logits(hf_dir, cfg, tmp_path)


@pytest.mark.slow
def test_a_kimi_k2_checkpoint_in_float8_converts_to_the_logits_of_its_values(hf_model, reference_logits, tmp_path):
    """Kimi K2's release (model_type kimi_k2, DeepSeek-V3's architecture, keys and tensor names) and DeepSeek-V3's
    store their projections as float8 with a scale per block: the tiny DeepSeek-V3 so stored (blocks of 16 x 16,
    the router, embedding and output layer unquantized, as in the releases) and named kimi_k2 converts to the
    logits transformers computes from the values it holds (each float8 value times its block's scale)."""
    from safetensors.numpy import save_file

    from test_convert import _block_quantized

    source = Reader(hf_model("deepseek"))
    stored, values = {}, {}
    for name in source.names:
        w = stored[name] = values[name] = source.get(name)
        if w.ndim == 2 and name.endswith("proj.weight"):  # attention's and the MLPs' projections, experts' too
            q, scale = _block_quantized(w, 16, 16)
            stored.update({name: q, name + "_scale_inv": scale})
            values[name] = hf_reader.block_dequantized(q, scale, (16, 16), name)
    assert sum(n.endswith("_scale_inv") for n in stored) > 20
    config = json.loads((hf_model("deepseek") / "config.json").read_text())
    for folder, tensors, changes in (
            ("values", values, {}),
            ("kimi", stored, {"model_type": "kimi_k2", "quantization_config": {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}})):
        (tmp_path / folder).mkdir()
        save_file(tensors, str(tmp_path / folder / "model.safetensors"))
        (tmp_path / folder / "config.json").write_text(json.dumps({**config, **changes}))
    cfg = _config(tmp_path / "kimi")
    assert cfg.model.decoder_block == "deepseek" and cfg.model == _config(tmp_path / "values").model
    hf_to_tessera(tmp_path / "kimi", tmp_path / "converted", cfg)
    model, params = _restore(cfg, tmp_path / "converted")
    tokens, mask = _padded_batch(cfg.model.vocab_size)
    ours = np.asarray(model.apply(params, tokens, None, mask))
    ref = hf_env.reference_logits(tmp_path / "values", tokens, mask)
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 1.0
    np.testing.assert_allclose(ours[real], ref[real], rtol=0, atol=ATOL)
    assert np.abs(ref[real] - reference_logits("deepseek")[real]).max() > 10 * ATOL  # float8 moved the logits


@pytest.mark.slow
def test_a_gemma3_with_attention_biases_converts_to_the_same_logits(hf_model, tmp_path):
    """transformers' Gemma, Gemma 2 and Gemma 3 read attention_bias (biases on q/k/v/o_proj, before the q/k norms);
    the converter refused such a checkpoint as having tensors with no place in the model ("is model_name the right
    family?"), and tessera-to-hf refused a gemma model with attention_bias=true."""
    from safetensors.numpy import save_file

    hf_dir = tmp_path / "biased"
    shutil.copytree(hf_model("gemma3"), hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    rng, h = np.random.default_rng(1), config["head_dim"]
    sizes = {"q_proj": config["num_attention_heads"] * h, "k_proj": config["num_key_value_heads"] * h,
             "v_proj": config["num_key_value_heads"] * h, "o_proj": config["hidden_size"]}
    biases = {f"model.layers.{i}.self_attn.{name}.bias": rng.normal(0, 0.3, (n,)).astype(np.float32)
              for i in range(config["num_hidden_layers"]) for name, n in sizes.items()}
    save_file(biases, str(hf_dir / "biases.safetensors"))
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(biases, "biases.safetensors"))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = _config(hf_dir)
    assert cfg.model.attention_bias
    _assert_converts_to_the_reference_logits(hf_dir, cfg, tmp_path)
    tessera_to_hf(str(tmp_path / "converted"), tmp_path / "back", cfg, max_shard_size=10**9)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["attention_bias"] is True


def test_mxfp4_values_equal_transformers(tmp_path):
    """gpt-oss's MXFP4 experts, read by us and dequantized by transformers: the same values, layout included."""
    _require_reference()
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 2, 16), dtype=np.uint8)  # 3 experts, 10 rows of 64 values
    scales = rng.integers(100, 150, (3, 10, 2), dtype=np.uint8)
    np.savez(tmp_path / "in.npz", blocks=blocks, scales=scales)
    hf_env.run_reference("mxfp4", str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    with np.load(tmp_path / "out.npz") as out:
        reference = out["values"]
    ours = mxfp4_values(blocks, scales)
    assert ours.shape == reference.shape == (3, 64, 10)
    np.testing.assert_array_equal(ours.astype(np.float32), reference)


def test_hf_config_round_trips_every_model_file():
    for name in ("llama2-7b", "llama3.1-8b", "mistral-7b", "mixtral-8x7b", "gemma-7b", "gemma2-9b", "gemma2-27b",
                 "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-480b-a35b", "gemma3-4b", "gemma3-27b", "deepseek-v3",
                 "deepseek2-16b", "deepseek2-236b", "kimi-k2-1t",
                 "gpt-oss-20b", "gpt-oss-120b", "llama4-17b-16e", "llama4-17b-128e", "olmo3-7b", "olmo3-32b",
                 "olmo2-7b", "olmo2-13b", "olmo2-32b"):
        m = load_model_config(name, []).model
        keys = config_from_hf(hf_config(m, 4096))
        rebuilt = load_model_config("default", as_overrides(keys)).model
        for key in keys:
            if key != "global_parameter_scale" and not key.startswith("base_"):
                # (the local layers' theta as built: olmo3's files give -1, the global layers' theta)
                attr = "local_rope_theta" if key == "local_rope_max_timescale" else key
                assert getattr(rebuilt, attr) == getattr(m, attr), (name, key)
        assert (rebuilt.emb_dim, rebuilt.num_decoder_layers, rebuilt.mlp_dim) == (m.emb_dim, m.num_decoder_layers,
                                                                                  m.mlp_dim)


def _cli(*args, timeout=300, **extra_env):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **extra_env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)


@pytest.mark.slow
def test_convert_cli_then_train_and_check_logits(hf_model, tmp_path):
    hf_dir = hf_model("mistral")
    keys = as_overrides(config_from_hf(json.loads((hf_dir / "config.json").read_text())))
    out = tmp_path / "ckpt"
    proc = _cli("-m", "tessera.tools.convert", "hf-to-tessera", str(hf_dir), str(out), *keys)
    assert proc.returncode == 0, proc.stderr
    assert f"load_parameters_path={out}" in proc.stdout
    # the trainer starts from it
    train = _cli("train.py", "configs/base.yml", *keys, f"load_parameters_path={out}", "steps=1", "max_target_length=16",
                 "per_device_batch_size=1", f"base_output_directory={tmp_path}", "run_name=from_hf",
                 "enable_checkpointing=false", "enable_tensorboard=false")
    assert train.returncode == 0, train.stderr[-2000:]
    assert "loaded parameters" in (train.stdout + train.stderr).lower()
    # the logits checker passes on the converted model ...
    check = _cli("-m", "tessera.tools.check_logits", str(hf_dir), str(out), *keys, "--tokens", "5,17,3,88,42,9,61")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "PASS" in check.stdout and check.stdout.count("e-") >= 14  # 7 positions x (diff, KL)
    # ... and fails against another model's weights (same shapes, other seed)
    other = hf_model("mistral", seed=1)
    other_out = tmp_path / "other"
    hf_to_tessera(other, other_out, _config(other))
    check = _cli("-m", "tessera.tools.check_logits", str(hf_dir), str(other_out), *keys, "--tokens", "5,17,3")
    assert check.returncode == 1 and "FAIL" in check.stdout
    # the Hugging Face side failing is bad input (exit 2, one line), never exit 1, which says the logits differ:
    # it was a traceback with exit 1 for a damaged checkpoint, an interpreter without torch, or a folder
    damaged = tmp_path / "damaged"
    shutil.copytree(hf_dir, damaged)
    for f in damaged.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    failures = {"damaged": ([str(damaged)], {}, "error: the Hugging Face reference failed (exit 1): "),
                "no torch": ([str(hf_dir)], {"TESSERA_HF_PYTHON": sys.executable}, "cannot import what the reference"),
                "a folder": ([str(hf_dir)], {"TESSERA_HF_PYTHON": str(tmp_path)}, "is not an executable file")}
    for name, (folder, env, message) in failures.items():
        check = _cli("-m", "tessera.tools.check_logits", *folder, str(out), *keys, "--tokens", "5,17,3", **env)
        assert check.returncode == 2 and "Traceback" not in check.stderr, (name, check.stderr[-2000:])
        assert message in check.stderr and len(check.stderr.strip().splitlines()) == 1, (name, check.stderr)


def test_convert_refuses_a_mismatched_config_and_keeps_outputs(hf_model, tmp_path):
    hf_dir = hf_model("gemma")
    proc = _cli("-m", "tessera.tools.convert", "hf-to-tessera", str(hf_dir), str(tmp_path / "out"), "model_name=default")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "describes another model" in proc.stderr and "set base_emb_dim=24" in proc.stderr
    assert "set decoder_block=gemma" in proc.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep.txt").write_text("data")
    keys = as_overrides(config_from_hf(json.loads((hf_dir / "config.json").read_text())))
    proc = _cli("-m", "tessera.tools.convert", "hf-to-tessera", str(hf_dir), str(tmp_path / "exists"), *keys)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert (tmp_path / "exists" / "keep.txt").read_text() == "data"
    proc = _cli("-m", "tessera.tools.convert", "hf-to-tessera", str(tmp_path / "nowhere"), str(tmp_path / "o2"), *keys)
    assert proc.returncode == 2 and f"Hugging Face folder {tmp_path / 'nowhere'} does not exist" in proc.stderr


def test_convert_names_tensors_that_do_not_fit(hf_model, tmp_path):
    """A checkpoint whose config agrees but whose tensors are missing or extra fails by name."""
    import shutil

    from safetensors.numpy import save_file

    hf_dir = hf_model("llama2")
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = "extra.safetensors"
    save_file({"model.layers.0.extra.weight": np.zeros((2,), np.float32)}, broken / "extra.safetensors")
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Exception, match="have no place in this Tessera model: model.layers.0.extra.weight"):
        hf_to_tessera(broken, tmp_path / "out", _config(hf_dir))
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Exception, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        hf_to_tessera(broken, tmp_path / "out2", _config(hf_dir))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_a_multimodal_llama4_checkpoint_converts_its_language_model(hf_model, tmp_path):
    """Meta's Llama 4 releases are multimodal (Llama4ForConditionalGeneration): the config's text_config
    describes the language model, whose tensors carry a language_model. prefix, beside the vision
    encoder's. The converter takes the language model (the same parameters as from the text-only
    checkpoint) and leaves out the rest, saying so."""
    from safetensors.numpy import load_file, save_file

    text = hf_model("llama4")
    multimodal = tmp_path / "multimodal"
    multimodal.mkdir()
    tensors = {}
    for path in sorted(text.glob("*.safetensors")):
        tensors.update({f"language_model.{k}": v for k, v in load_file(path).items()})
    tensors["vision_model.patch_embedding.linear.weight"] = np.zeros((4, 3), np.float32)
    tensors["multi_modal_projector.linear_1.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(multimodal / "model.safetensors"))
    config = json.loads((text / "config.json").read_text())
    (multimodal / "config.json").write_text(json.dumps({"model_type": "llama4", "architectures":
                                                        ["Llama4ForConditionalGeneration"], "text_config": config}))
    cfg = _config(text)
    assert _config(multimodal).model == cfg.model
    hf_to_tessera(text, tmp_path / "from_text", cfg)
    hf_to_tessera(multimodal, tmp_path / "from_multimodal", cfg)
    (_, a), (_, b) = _restore(cfg, tmp_path / "from_text"), _restore(cfg, tmp_path / "from_multimodal")
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow
def test_a_multimodal_gemma3_checkpoint_converts_to_the_logits_transformers_computes(hf_model, tmp_path):
    """Gemma 3 4B, 12B and 27B are released only as Gemma3ForConditionalGeneration (model_type gemma3: the
    language model described by text_config, its tensors under language_model., a vision tower beside): the
    converter refused them as an unsupported model_type. Now their language model converts, to the logits
    transformers' multimodal model computes on text."""
    hf_dir = hf_model("gemma3_multimodal")
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3" and config["text_config"]["model_type"] == "gemma3_text"
    cfg = _config(hf_dir)
    assert cfg.model == _config(hf_model("gemma3")).model
    _assert_converts_to_the_reference_logits(hf_dir, cfg, tmp_path)


def test_compare_reports_kl_and_difference():
    ref = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    diff, kl = compare(ref, ref)
    assert np.all(diff == 0) and np.allclose(kl, 0)
    shifted = ref + 3.0  # softmax is shift-invariant: same distribution, large raw difference
    diff, kl = compare(shifted, ref)
    np.testing.assert_allclose(diff, 3.0)
    np.testing.assert_allclose(kl, 0, atol=1e-12)
    other = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.1, 0.8]]))
    _, kl = compare(other, ref)
    np.testing.assert_allclose(kl[0], 0.5 * np.log(2) + 0.25 * np.log(0.5), rtol=1e-12)


@pytest.mark.slow
def test_a_qwen3_next_checkpoint_with_its_mtp_layer_converts_without_it(hf_model, tmp_path, caplog):
    """The released Qwen3-Next checkpoints store a multi-token-prediction layer (mtp.*), which transformers does not
    load: the converter refused them as tensors with "no place" in the model. Now they are left out with a log
    line, and the rest converts to transformers' logits (transformers loads the same folder, ignoring them)."""
    import logging

    from safetensors.numpy import save_file

    hf_dir = tmp_path / "with_mtp"
    shutil.copytree(hf_model("qwen3_next"), hf_dir)  # (sharded: the layer goes into a shard of its own)
    mtp = {"mtp.fc.weight": np.ones((24, 48), np.float32), "mtp.norm.weight": np.ones((24,), np.float32)}
    save_file(mtp, hf_dir / "model-mtp.safetensors", metadata={"format": "pt"})
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-mtp.safetensors" for name in mtp})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="tessera"):
        _assert_converts_to_the_reference_logits(hf_dir, _config(hf_dir), tmp_path)
    assert "left out 2 tensors of Qwen3-Next's multi-token-prediction layer" in caplog.text
