"""tessera.tools.convert on damaged inputs, without the Hugging Face reference interpreter: a tiny Tessera
checkpoint written here (and its Hugging Face form, converted by the tool) with one file truncated is one
error line naming the file, exit 2, and no output left behind."""

import os
import re

import numpy as np
import pytest

from tessera.tools import hf_checkpoint, hf_reader
from tessera.tools.convert import main
from tessera.tools.estimate import load_model_config

KEYS = ["model_name=default", "base_emb_dim=24", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=6",
        "base_mlp_dim=40", "base_num_decoder_layers=2", "vocab_size=96"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(a Tessera params checkpoint of the tiny model, the same converted to a Hugging Face folder)."""
    root = tmp_path_factory.mktemp("convert")
    targets = hf_checkpoint.param_targets(load_model_config(None, KEYS))
    rng = np.random.default_rng(0)  # random values: the array files are large enough to cut in half
    params = hf_checkpoint._nest({k: rng.standard_normal(t.shape).astype(t.dtype) for k, t in targets.items()})
    hf_checkpoint.save_params(root / "tessera", params)
    assert main(["tessera-to-hf", str(root / "tessera"), str(root / "hf"), *KEYS]) == 0
    return root / "tessera", root / "hf"


def _truncated_copy(src, dst, name):
    import shutil

    shutil.copytree(src, dst)
    victim = dst / name
    os.truncate(victim, victim.stat().st_size // 2)
    return victim


def test_a_truncated_tessera_array_file_is_one_checkpoint_error(checkpoints, tmp_path, capsys):
    ckpt, _ = checkpoints
    capsys.readouterr()
    victim = _truncated_copy(ckpt, tmp_path / "ckpt", "params.token_embedder.table_vd/0.0")
    size = (ckpt / "params.token_embedder.table_vd/0.0").stat().st_size
    assert main(["tessera-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), *KEYS]) == 2
    err = capsys.readouterr().err  # the checksums recorded when it was written catch it before reading
    assert err == (f"checkpoint error: checkpoint {tmp_path / 'ckpt'} is damaged: its file "
                   f"params.token_embedder.table_vd/0.0 has {size // 2} bytes, {size} when it was saved. Nothing was "
                   "loaded; copy or write it again from its source\n")
    assert not (tmp_path / "out").exists()
    (tmp_path / "ckpt" / "tessera_checksums.json").unlink()  # as written before checksums were recorded
    assert main(["tessera-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), *KEYS]) == 2
    read_unverified, err = capsys.readouterr().err.split("\n", 1)  # the log line Checkpointing.md promises
    assert f"{tmp_path / 'ckpt'} has no checksum list" in read_unverified
    assert err.startswith(f"checkpoint error: checkpoint {tmp_path / 'ckpt'} could not be restored: files may be "
                          "missing or corrupt (")
    assert str(victim) in err and "Truncated" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # no half-written Hugging Face folder left behind


def test_a_truncated_safetensors_file_is_one_error_naming_it(checkpoints, tmp_path, capsys):
    _, hf = checkpoints
    capsys.readouterr()
    victim = _truncated_copy(hf, tmp_path / "hf", "model.safetensors")
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "out"), *KEYS]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {victim} is damaged (truncated or not a safetensors file: ")
    assert err.endswith("; download or save it again\n") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_truncated_shard_is_named_when_it_is_read(checkpoints, tmp_path, capsys):
    """A sharded checkpoint opens its files only when a tensor is read: the damaged shard is still named."""
    ckpt, _ = checkpoints
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "sharded"), *KEYS, "--max-shard-size", "20000"]) == 0
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    os.truncate(shards[-1], shards[-1].stat().st_size // 2)
    capsys.readouterr()
    assert main(["hf-to-tessera", str(tmp_path / "sharded"), str(tmp_path / "out"), *KEYS]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {shards[-1]} is damaged (truncated") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_float32_weights_export_as_bfloat16_when_weight_dtype_says_so(checkpoints, tmp_path):
    """tessera-to-hf with weight_dtype=bfloat16 on a float32 checkpoint writes bfloat16 tensors,
    each the float32 value rounded (it refused the checkpoint before), and says so in config.json."""
    import json

    import ml_dtypes
    from safetensors.numpy import load_file

    ckpt, hf = checkpoints
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "half"), *KEYS, "weight_dtype=bfloat16"]) == 0
    half, full = load_file(str(tmp_path / "half" / "model.safetensors")), load_file(str(hf / "model.safetensors"))
    assert sorted(half) == sorted(full)
    for name, value in full.items():
        assert value.dtype == np.float32 and half[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(half[name], value.astype(ml_dtypes.bfloat16))
    assert json.loads((tmp_path / "half" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_the_log_lines_the_docs_promise_reach_stderr(checkpoints, tmp_path, capsys):
    """main() configures logging (it printed none of its log lines): an export in another weight_dtype
    says so, and the checksums of the checkpoint it read are reported (Models.md, Checkpointing.md)."""
    ckpt, _ = checkpoints
    capsys.readouterr()
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "half"), *KEYS, "weight_dtype=bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "parameters are written in weight_dtype (float32 -> bfloat16)" in err
    assert f"under {ckpt}" in err and " match (" in err


def test_mxfp4_tensors_are_read_as_the_values_they_hold(tmp_path):
    """gpt-oss's released experts are MXFP4: <name>_blocks (two 4-bit codes a byte, the low nibble
    first) and <name>_scales (a power of two per 32 values, biased by 127) of a matrix stored
    transposed. The reader names the pair as the one tensor and returns its values in the
    bfloat16 layout; test_hf_parity checks the same values against transformers'."""
    import ml_dtypes
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 3, 2, 16), dtype=np.uint8)  # 2 experts, 3 rows of 2 groups of 32
    scales = rng.integers(120, 135, (2, 3, 2), dtype=np.uint8)
    save_file({"x.gate_up_proj_blocks": blocks, "x.gate_up_proj_scales": scales, "x.other": np.ones(3, np.float32)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    reader = hf_reader.Reader(tmp_path)
    assert sorted(reader.names) == ["x.gate_up_proj", "x.other"]
    values = reader.get("x.gate_up_proj")
    assert values.shape == (2, 64, 3) and values.dtype == ml_dtypes.bfloat16
    for e, c, r in [(0, 0, 0), (1, 37, 2), (1, 63, 1), (0, 32, 2)]:
        byte = blocks[e, r, c // 32, (c % 32) // 2]
        code = byte & 0x0F if c % 2 == 0 else byte >> 4
        assert float(values[e, c, r]) == hf_reader.FP4_E2M1[code] * 2.0 ** (int(scales[e, r, c // 32]) - 127)
    np.testing.assert_array_equal(reader.get("x.other"), np.ones(3, np.float32))


def test_hf_to_tessera_never_deletes_a_folder_it_did_not_make(checkpoints, tmp_path, capsys):
    """It emptied `.<out>.scratch` beside the output first, whoever's it was; now its scratch folder is a new one,
    removed after a conversion and after a failed one."""
    _, hf = checkpoints
    theirs = tmp_path / "x" / ".ts9.scratch"
    theirs.mkdir(parents=True)
    (theirs / "keep.txt").write_text("important")
    assert main(["hf-to-tessera", str(hf), str(tmp_path / "x" / "ts9"), *KEYS]) == 0
    assert (theirs / "keep.txt").read_text() == "important"
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == [".ts9.scratch", "ts9"]
    ckpt, _ = checkpoints  # a shard damaged at its end fails mid-conversion, the scratch folder in use
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "sharded"), *KEYS, "--max-shard-size", "20000"]) == 0
    last = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size // 2)
    (tmp_path / "y").mkdir()
    assert main(["hf-to-tessera", str(tmp_path / "sharded"), str(tmp_path / "y" / "out"), *KEYS]) == 2
    assert str(last) in capsys.readouterr().err
    assert list((tmp_path / "y").iterdir()) == []  # no output, no scratch left behind


def test_max_shard_size_is_refused_for_hf_to_tessera(checkpoints, tmp_path, capsys):
    """The option sizes tessera-to-hf's safetensors only; hf-to-tessera accepted and ignored it."""
    _, hf = checkpoints
    for option in (["--max-shard-size", "1000"], ["--max-shard-size=1000"]):
        assert main(["hf-to-tessera", str(hf), str(tmp_path / "out"), *KEYS, *option]) == 2
        assert capsys.readouterr().err == ("error: --max-shard-size sizes the safetensors files tessera-to-hf writes; "
                                           "hf-to-tessera writes an Orbax checkpoint: leave the option out\n")
        assert not (tmp_path / "out").exists()


def test_exported_shards_are_readable_as_config_json_is(checkpoints, tmp_path):
    """safetensors wrote the shards 0600 (config.json: 0644 under umask 022): nobody else, a serving container
    included, could read the exported model."""
    ckpt, _ = checkpoints
    previous = os.umask(0o022)
    try:
        assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "hf"), *KEYS, "--max-shard-size", "20000"]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len([n for n in modes if n.endswith(".safetensors")]) > 1
    assert set(modes.values()) == {0o644}, modes


def _edited_copy(hf, dst, edit):
    """A copy of the Hugging Face folder `hf` whose tensors `edit` changed (name -> array, edited in place)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


UP = "model.layers.0.mlp.up_proj.weight"  # [mlp 40, emb 24]


@pytest.mark.parametrize("change,extra,given", [
    # a tensor stored transposed has the right size: a reshape took it and scrambled it (exit 0)
    (lambda t: t.update({UP: np.ascontiguousarray(t[UP].T)}), [], f"{UP} (24, 40)"),
    # one of another size was a ValueError traceback from the reshape, and from np.stack with fused_mlp
    (lambda t: t.update({UP: t[UP][:-1].copy()}), [], f"{UP} (39, 24)"),
    (lambda t: t.update({UP: t[UP][:-1].copy()}), ["fused_mlp=true"],
     f"model.layers.0.mlp.gate_proj.weight (40, 24), {UP} (39, 24)"),
], ids=["transposed", "one-row-short", "one-row-short-fused"])
def test_a_tensor_of_another_shape_is_refused_by_name(checkpoints, tmp_path, capsys, change, extra, given):
    _, hf = checkpoints
    broken = _edited_copy(hf, tmp_path / "hf", change)
    capsys.readouterr()
    assert main(["hf-to-tessera", str(broken), str(tmp_path / "out"), *KEYS, *extra]) == 2
    err = capsys.readouterr().err
    needs = "(40, 24), (40, 24)" if extra else "(40, 24)"
    assert err.endswith(f"error: the checkpoint's tensor shapes do not fit this model: {given}, where it needs "
                        f"{needs}; does config.json describe these tensors?\n") and "Traceback" not in err
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "hf"]  # no scratch left


def _write_safetensors(path, tensors, raw):
    """A safetensors file of numpy `tensors` plus `raw` ones: name -> (dtype name, shape, bytes), e.g. float8."""
    import json
    import struct

    header, blobs, offset = {}, [], 0
    entries = {n: ({"float32": "F32"}[str(a.dtype)], list(a.shape), a.tobytes()) for n, a in tensors.items()}
    for name, (dtype, shape, data) in {**entries, **raw}.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_integer_and_float8_tensors_are_refused_with_one_line(checkpoints, tmp_path, capsys):
    """An int8 tensor was cast to float32 and converted (exit 0); a float8 one (DeepSeek's release) was an
    AttributeError traceback from numpy, which has no float8 type."""
    from safetensors.numpy import load_file

    _, hf = checkpoints
    ints = _edited_copy(hf, tmp_path / "ints", lambda t: t.update({UP: (t[UP] * 10).astype(np.int8)}))
    capsys.readouterr()
    assert main(["hf-to-tessera", str(ints), str(tmp_path / "out"), *KEYS]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: tensor {UP} (int8) holds integers, not weights (a quantized checkpoint?); the converter reads "
        "float32, bfloat16 and float16 tensors (and gpt-oss's MXFP4 experts)\n")
    f8 = _edited_copy(hf, tmp_path / "f8", lambda t: None)
    tensors = load_file(str(f8 / "model.safetensors"))
    up = tensors.pop(UP)
    _write_safetensors(f8 / "model.safetensors", tensors, {UP: ("F8_E4M3", list(up.shape), bytes(up.size))})
    assert main(["hf-to-tessera", str(f8), str(tmp_path / "out"), *KEYS]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: tensor {UP} of {f8 / 'model.safetensors'} is stored as F8_E4M3, which the converter "
                        "does not read (float32, bfloat16, float16, gpt-oss's MXFP4 and float8 with a scale per block, "
                        "<name>_scale_inv, as DeepSeek-V3 and Kimi K2 store theirs, are read); convert the checkpoint "
                        "to bfloat16 first\n") and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _block_quantized(w, rows, cols):
    """(float8 e4m3 values, float32 scale per block) of w [R, C] as DeepSeek quantizes its weights: each block of
    rows x cols (the last ones cut short) divided by its largest magnitude over 448, float8's largest value."""
    import ml_dtypes

    scale = np.zeros((-(-w.shape[0] // rows), -(-w.shape[1] // cols)), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            scale[i, j] = np.abs(block).max() / 448
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def test_float8_weights_with_block_scales_convert_to_the_values_they_hold(checkpoints, tmp_path):
    """DeepSeek-V3's and Kimi K2's releases store their projections as float8 (e4m3) with a float32 scale per block
    of 128 x 128 (<name>_scale_inv; config.json's quantization_config.weight_block_size): the converter refused
    them ("convert the checkpoint to bfloat16 first"). It reads each value times its block's scale, in float32, as
    DeepSeek's own conversion does; here with blocks of 16 x 16, so that the 40 x 24 and 24 x 24 weights end in
    blocks cut short. Exported back, the weights are those values, every other tensor as it was."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    _, hf = checkpoints
    dst = tmp_path / "fp8"
    shutil.copytree(hf, dst)
    original = load_file(str(dst / "model.safetensors"))
    stored, want = dict(original), dict(original)
    for name, w in original.items():
        if w.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name:
            q, scale = _block_quantized(w, 16, 16)
            stored.update({name: q, name + "_scale_inv": scale})
            rows, cols = np.indices(w.shape)  # each value's block, written out element by element
            want[name] = q.astype(np.float32) * scale[rows // 16, cols // 16]
            assert 0 < np.abs(want[name] - w).max() <= np.abs(w).max() / 8  # float8's rounding: 3 mantissa bits
    save_file(stored, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (dst / "config.json").write_text(json.dumps(config))
    assert sorted(hf_reader.Reader(dst).names) == sorted(original)  # a weight and its scales: one tensor
    assert main(["hf-to-tessera", str(dst), str(tmp_path / "tessera"), *KEYS]) == 0
    assert main(["tessera-to-hf", str(tmp_path / "tessera"), str(tmp_path / "back"), *KEYS]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(back[name], want[name], err_msg=name)


def test_a_kimi_k2_config_json_reads_as_deepseek_v3s():
    """Kimi K2's config.json says model_type kimi_k2 (architectures DeepseekV3ForCausalLM) over DeepSeek-V3's keys:
    it was refused as not supported. It describes the model of the kimi-k2-1t file."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    m = load_model_config("kimi-k2-1t", []).model
    written = hf_config(m, 131072)
    assert written["model_type"] == "deepseek_v3"
    kimi = {**written, "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    assert config_from_hf(kimi) == config_from_hf(written)
    with pytest.raises(ConfigError, match="model_type='kimi_k3' is not supported; supported: .*, kimi_k2$"):
        config_from_hf({**kimi, "model_type": "kimi_k3"})


def test_float8_block_scales_of_another_shape_are_one_line(checkpoints, tmp_path, capsys):
    """Scales that do not tile the weight in blocks of weight_block_size (a wrong block size, a cut checkpoint)
    name the tensor and the shape they need (a scale whose weight is missing: test_tensors_are_checked_by_name_...)."""
    import ml_dtypes

    _, hf = checkpoints

    def scaled(blocks):
        return lambda t: t.update({UP: t[UP].astype(ml_dtypes.float8_e4m3fn),
                                   UP + "_scale_inv": np.ones(blocks, np.float32)})

    bad = _edited_copy(hf, tmp_path / "bad", scaled((2, 1)))  # 128 x 128 blocks of [40, 24]: scales [1, 1]
    capsys.readouterr()
    assert main(["hf-to-tessera", str(bad), str(tmp_path / "out"), *KEYS]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: {UP}: a float8 weight [40, 24] with block scales [2, 1]; blocks of 128 x 128 "
                        "(quantization_config.weight_block_size) need a 2-D weight and scales [1, 1]; is the "
                        "checkpoint whole?\n") and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_config_json_without_a_needed_key_is_one_line(checkpoints, tmp_path, capsys):
    """It was a KeyError traceback (exit 1)."""
    import json
    import shutil

    _, hf = checkpoints
    shutil.copytree(hf, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "out"), *KEYS]) == 2
    assert capsys.readouterr().err == ("error: config.json of model_type='llama' has no 'hidden_size', which Tessera "
                                       "needs to describe the model; pass the model's own config.json, as "
                                       "transformers saves it\n")


def test_tensors_are_checked_by_name_before_any_is_converted(checkpoints, tmp_path, capsys):
    """Every missing tensor is named at once, before a tensor is read (it stopped at the first, mid-conversion); a
    float8 block scale without its weight says what it is; an index that places a tensor in the wrong file says so
    (it called that file damaged)."""
    import json

    ckpt, _ = checkpoints
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "sharded"), *KEYS, "--max-shard-size", "20000"]) == 0
    index_path = tmp_path / "sharded" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = dict(index, weight_map={**index["weight_map"], UP: next(s for s in shards if s != index["weight_map"][UP])})
    index_path.write_text(json.dumps(wrong))
    capsys.readouterr()
    assert main(["hf-to-tessera", str(tmp_path / "sharded"), str(tmp_path / "out"), *KEYS]) == 2
    assert capsys.readouterr().err == (f"error: {wrong['weight_map'][UP]} has no tensor {UP}, which "
                                       "model.safetensors.index.json places there; save the model again (or fix the "
                                       "index)\n")
    gone = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    scales = {UP + "_scale_inv": shards[0]}
    index_path.write_text(json.dumps(dict(index, weight_map={**{k: v for k, v in index["weight_map"].items()
                                                                 if k not in gone}, **scales})))
    for shard in shards:  # unreadable: only the names may be looked at
        (tmp_path / "sharded" / shard).write_bytes(b"")
    assert main(["hf-to-tessera", str(tmp_path / "sharded"), str(tmp_path / "out"), *KEYS]) == 2
    assert capsys.readouterr().err == (f"error: the checkpoint has no tensor {gone[0]!r}, {gone[1]!r}; is model_name "
                                       "(or decoder_block) right?\n")
    orphan = "model.layers.0.mlp.extra_proj.weight_scale_inv"  # a weight's scales with it are read (float8 below)
    index_path.write_text(json.dumps(dict(index, weight_map={**index["weight_map"], orphan: shards[0]})))
    assert main(["hf-to-tessera", str(tmp_path / "sharded"), str(tmp_path / "out"), *KEYS]) == 2
    assert capsys.readouterr().err == (f"error: 1 tensors of the checkpoint have no place in this Tessera model: "
                                       f"{orphan}; a *_scale_inv tensor is the block scale of the float8 weight of the "
                                       "same name without the suffix, which this checkpoint does not have: is it "
                                       "whole?\n")
    assert not (tmp_path / "out").exists()


def test_export_names_the_model_keys_a_training_checkpoint_was_saved_with(checkpoints, tmp_path, capsys):
    """A training step keeps its config: tessera-to-hf now says, as train.py and decode.py do, which model keys
    differ when the parameters do not fit, and warns when they fit but the model keys change what the exported
    model computes (a rotary base here): its config.json is written from the command line's keys."""
    import json
    import shutil

    from tessera.checkpointing.storage import CONFIG_FILE

    ckpt, _ = checkpoints
    step = tmp_path / "step"
    shutil.copytree(ckpt, step)
    (step / "config").mkdir()
    (step / "config" / CONFIG_FILE).write_text(json.dumps({"base_num_decoder_layers": 2, "rope_max_timescale": 10000}))
    capsys.readouterr()
    assert main(["tessera-to-hf", str(step), str(tmp_path / "deeper"), *KEYS, "base_num_decoder_layers=3"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("\nThe config saved with it differs in its model keys: base_num_decoder_layers=2 (here 3)\n")
    assert not (tmp_path / "deeper").exists()
    assert main(["tessera-to-hf", str(step), str(tmp_path / "hf"), *KEYS, "rope_max_timescale=500000"]) == 0
    err = capsys.readouterr().err
    assert f"W the parameters of {step} were trained with other model keys: rope_max_timescale=10000 (here 500000)" \
        in err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_theta"] == 500000


def test_a_gemma_config_json_without_tie_word_embeddings_is_tied(tmp_path, capsys):
    """Google's Gemma and Gemma 2 config.json files leave tie_word_embeddings out (transformers, whose Gemma
    configs tie by default, wrote only non-default values): it was read as untied, so the model file's
    logits_via_embedding=true was refused, and with the suggested logits_via_embedding=false there was no
    lm_head.weight to read."""
    import json

    keys = ["model_name=gemma-2b", "base_emb_dim=24", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=6",
            "base_mlp_dim=40", "base_num_decoder_layers=2", "vocab_size=96"]
    targets = hf_checkpoint.param_targets(load_model_config(None, keys))
    assert "logits_dense_dv" not in targets  # the model file ties them
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(t.shape).astype(t.dtype) for k, t in targets.items()}
    hf_checkpoint.save_params(tmp_path / "tessera", hf_checkpoint._nest(params))
    assert main(["tessera-to-hf", str(tmp_path / "tessera"), str(tmp_path / "hf"), *keys]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.pop("tie_word_embeddings") is True
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))  # as google/gemma-2b's has it
    capsys.readouterr()
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "back"), *keys]) == 0, capsys.readouterr().err
    from tessera.checkpointing import load_parameters
    import jax

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=device),
                            hf_checkpoint._nest(targets))
    back = load_parameters(str(tmp_path / "back"), abstract)
    for path, value in params.items():
        node = back
        for key in path.split("/"):
            node = node[key]
        np.testing.assert_array_equal(np.asarray(node), value, err_msg=path)


def test_bucket_urls_are_refused_where_only_local_folders_work(checkpoints, tmp_path, monkeypatch, capsys):
    """An output URL passed the reachability check and became pathlib's gs:/bucket/out: the checkpoint was written
    into a local folder named gs: under the working directory, and the bucket got nothing."""
    from tessera.checkpointing import storage

    monkeypatch.setattr(storage, "remote_exists", lambda *a, **k: None)  # a bucket that can be reached
    monkeypatch.chdir(tmp_path)
    ckpt, hf = checkpoints
    capsys.readouterr()
    for args, name, url in [(["hf-to-tessera", str(hf), "gs://bucket/out"], "output folder", "gs://bucket/out"),
                            (["tessera-to-hf", str(ckpt), "gs://bucket/hf"], "output folder", "gs://bucket/hf"),
                            (["hf-to-tessera", "gs://bucket/hf", str(tmp_path / "o")], "Hugging Face folder",
                             "gs://bucket/hf")]:
        assert main([*args, *KEYS]) == 2
        assert capsys.readouterr().err == (f"error: {name} {url}: the converter reads and writes local folders here; "
                                           "copy the model to a local folder first, or convert into one and copy "
                                           "that to the bucket afterwards\n")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_the_write_leaves_nothing_behind(checkpoints, tmp_path, monkeypatch, capsys):
    """Ctrl-C while Orbax wrote `<out>.orbax-checkpoint-tmp` left that folder (a model's worth of disk, never
    cleaned up: the output folder the message said to delete did not exist), and Orbax's writer threads printed
    tracebacks as the interpreter shut down under them. Now the write ends first, then everything is removed."""
    import signal
    import time

    _, hf = checkpoints

    def save_params(out_dir, params, source_config=None):  # Orbax's order: a temporary folder, renamed once complete
        tmp = out_dir.parent / f"{out_dir.name}.orbax-checkpoint-tmp"
        tmp.mkdir()
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in the middle of the write
        time.sleep(0.2)
        (tmp / "array").write_bytes(b"x" * 100)
        tmp.rename(out_dir)

    monkeypatch.setattr(hf_checkpoint, "save_params", save_params)
    (tmp_path / "x").mkdir()
    capsys.readouterr()
    assert main(["hf-to-tessera", str(hf), str(tmp_path / "x" / "out"), *KEYS]) == 130
    err = capsys.readouterr().err
    assert "W interrupted: stopping once the checkpoint write in progress ends; it is then removed" in err
    assert err.endswith("error: interrupted (Ctrl-C); nothing was written (the partial output was removed): convert "
                        "again\n")
    assert list((tmp_path / "x").iterdir()) == []  # no output, no temporary folder, no scratch copy


def test_an_interrupted_export_removes_what_it_wrote(checkpoints, tmp_path, monkeypatch, capsys):
    """tessera-to-hf removed its partial output only for a damaged checkpoint: Ctrl-C (or a full disk) left
    the shards written so far, without config.json."""
    ckpt, _ = checkpoints
    added = []

    def add(self, name, value, original=hf_checkpoint.ShardWriter.add):
        if len(added) == 6:
            raise KeyboardInterrupt
        added.append(name)
        original(self, name, value)

    monkeypatch.setattr(hf_checkpoint.ShardWriter, "add", add)
    capsys.readouterr()
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "hf"), *KEYS, "--max-shard-size", "5000"]) == 130
    assert capsys.readouterr().err.endswith("error: interrupted (Ctrl-C); nothing was written (the partial output "
                                            "was removed): convert again\n")
    assert not (tmp_path / "hf").exists()
    (tmp_path / "given").mkdir()  # an empty folder given as the output stays, empty
    added.clear()
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "given"), *KEYS, "--max-shard-size", "5000"]) == 130
    assert list((tmp_path / "given").iterdir()) == []


def test_export_of_quantized_parameters_says_why_they_do_not_fit(tmp_path, capsys):
    """decode.py's save_quantized_params_path output listed every matrix as missing and unexpected (qvalue,
    scale) and told the user to fix the model keys, which were right."""
    targets = hf_checkpoint.param_targets(load_model_config(None, KEYS))
    params = hf_checkpoint._nest({k: np.zeros(t.shape, t.dtype) for k, t in targets.items()})
    table = params["token_embedder"]["table_vd"]
    params["token_embedder"]["table_vd"] = {"qvalue": table.astype(np.int8), "scale": np.ones((len(table), 1))}
    hf_checkpoint.save_params(tmp_path / "q8", params)
    capsys.readouterr()
    assert main(["tessera-to-hf", str(tmp_path / "q8"), str(tmp_path / "hf"), *KEYS]) == 2
    assert capsys.readouterr().err.endswith(
        f"\ncheckpoint {tmp_path / 'q8'} holds quantized parameters (written by decode.py save_quantized_params_path), "
        "which only decode.py reads (checkpoint_is_quantized=true); convert the float checkpoint they were written "
        "from\n")
    assert not (tmp_path / "hf").exists()


def test_a_hugging_face_folder_given_as_a_load_path_says_to_convert_it(checkpoints):
    """load_parameters_path (and decode.py's, tessera-to-hf's checkpoint) at a Hugging Face folder said it holds no
    checkpoint and pointed at training step folders; it is a checkpoint, in another format."""
    from tessera.checkpointing import CheckpointError, load_parameters

    _, hf = checkpoints
    with pytest.raises(CheckpointError) as e:
        load_parameters(str(hf), {})
    assert str(e.value) == (f"load_parameters_path={hf} is a Hugging Face checkpoint (config.json and safetensors); "
                            f"convert it first: .venv/bin/python -m tessera.tools.convert hf-to-tessera {hf} <out_dir> "
                            "model_name=<name>, then give <out_dir> (getting_started/Models.md)")


@pytest.mark.parametrize("model_name,change,message", [
    ("gpt3-52k", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
    ("gpt3-52k", {"scale_attn_weights": False}, "scale_attn_weights=false"),
    ("gemma2-2b", {"layer_types": ["full_attention", "sliding_attention"] * 13}, "layer_types do not alternate"),
    ("gemma3-4b", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ("deepseek-small", {"rope_interleave": False}, "rope_interleave=false"),
    # transformers' deepseek_v2 router ignores norm_topk_prob (DeepSeek's own code renormalizes), and both families
    # ignore moe_layer_freq (DeepSeek's puts experts in every n-th layer)
    ("deepseek2-16b", {"norm_topk_prob": True}, "norm_topk_prob=true, which transformers' deepseek_v2 router ignores"),
    ("deepseek-v3", {"moe_layer_freq": 2}, "sets moe_layer_freq=2 "),
    ("deepseek2-236b", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'; Tessera's deepseek builds what "
                                                     "transformers' deepseek_v2 computes: softmax with greedy or group_"),
    ("deepseek-v3", {"scoring_func": "softmax"}, "scoring_func='softmax' .* deepseek_v3 computes: sigmoid with noaux_tc"),
    ("llama4-17b-16e", {"layer_types": ["full_attention"] * 48}, "layer_types are not chunked attention"),
    # a flag written as text was true whatever it said: an untied Llama read as tied took its logits from the embedding
    ("llama2-7b", {"tie_word_embeddings": "false"}, "^config.json has tie_word_embeddings='false', text where "
                                                    "transformers writes a JSON boolean; write it as false without "
                                                    "quotes$"),
    ("gemma3-4b", {"use_bidirectional_attention": " True"}, "use_bidirectional_attention=' True', text"),
    # rotary embedding over part of each head: read as if it covered the whole head
    ("llama2-7b", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5\); Tessera's llama rotates the whole"),
    ("qwen3-32b", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     r"partial_rotary_factor=0\.25"),
])
def test_config_json_options_that_change_the_numbers_are_refused(model_name, change, message):
    """transformers computes another model with these (each moved the tiny models' logits by 0.5 to 4), and
    the converter read the tensors as if they were not set: a checkpoint that converted and then gave wrong
    logits."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    written = hf_config(load_model_config(model_name, []).model, 4096)
    config_from_hf(written)  # as tessera-to-hf writes it: converts
    with pytest.raises(ConfigError, match=message):
        config_from_hf({**written, **change})


@pytest.mark.parametrize("model_name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_a_config_json_gives_the_experts_width_when_base_moe_mlp_dim_sets_it(model_name):
    """With base_moe_mlp_dim the experts are that wide and base_mlp_dim sizes nothing; config.json gave
    base_mlp_dim as the experts' width (Mixtral's intermediate_size 14,336 and Qwen3's moe_intermediate_size 768
    for experts of 512), so the exported checkpoint's tensors did not match its config."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    m = load_model_config(model_name, ["base_moe_mlp_dim=512"]).model
    back = load_model_config(None, [f"{k}={v}" for k, v in config_from_hf(hf_config(m, 4096)).items()
                                    if not isinstance(v, (list, dict))]).model
    assert back.expert_mlp_dim == m.expert_mlp_dim == 512


def test_an_untied_gpt2_output_layer_converts_both_ways(tmp_path):
    """GPT-2 with tie_word_embeddings=false has an lm_head.weight of its own: import dropped it (the logits
    came from the embedding, silently) and export of logits_via_embedding=false wrote neither it nor the flag."""
    import json

    from safetensors.numpy import load_file

    keys = ["model_name=gpt3-52k", "base_emb_dim=24", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=6",
            "base_mlp_dim=40", "base_num_decoder_layers=2", "vocab_size=96", "trainable_position_size=16",
            "logits_via_embedding=false"]
    targets = hf_checkpoint.param_targets(load_model_config(None, keys))
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(t.shape).astype(t.dtype) for k, t in targets.items()}
    hf_checkpoint.save_params(tmp_path / "tessera", hf_checkpoint._nest(params))
    assert main(["tessera-to-hf", str(tmp_path / "tessera"), str(tmp_path / "hf"), *keys]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_positions"] == 16  # the table's rows
    np.testing.assert_array_equal(load_file(str(tmp_path / "hf" / "model.safetensors"))["lm_head.weight"],
                                  params["logits_dense_dv"].T)
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "back"), *keys]) == 0
    assert main(["tessera-to-hf", str(tmp_path / "back"), str(tmp_path / "hf2"), *keys]) == 0
    first, second = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "hf2"))
    assert sorted(first) == sorted(second)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_a_llama4_config_json_stores_floor_scale_as_transformers_reads_it():
    """transformers' Llama4TextConfig refuses a float floor_scale (`Field 'floor_scale' expected int, got float`),
    so an exported Llama 4 did not load."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config

    written = hf_config(load_model_config("llama4-17b-16e", []).model, 4096)
    assert written["floor_scale"] == 8192 and type(written["floor_scale"]) is int
    with pytest.raises(ConfigError, match="temperature_tuning_floor_scale=8192.5"):
        hf_config(load_model_config("llama4-17b-16e", ["temperature_tuning_floor_scale=8192.5"]).model, 4096)


def test_fused_qkv_converts_both_ways_with_the_same_logits(tmp_path):
    """Models.md: the layout follows fused_qkv. For the llama-like families it did not: hf-to-tessera with
    fused_qkv=true was a KeyError traceback ('layers/attention/wq_dnh'), and so was tessera-to-hf."""
    import jax

    from safetensors.numpy import load_file

    from tessera.checkpointing import load_parameters
    from tessera.models import build_model

    keys = [*KEYS[:3], "base_num_kv_heads=4", *KEYS[4:], "attention_bias=true", "attention=dot_product"]
    targets = hf_checkpoint.param_targets(load_model_config(None, keys))
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(t.shape).astype(t.dtype) for k, t in targets.items()}
    hf_checkpoint.save_params(tmp_path / "tessera", hf_checkpoint._nest(params))
    assert main(["tessera-to-hf", str(tmp_path / "tessera"), str(tmp_path / "hf"), *keys]) == 0
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "fused"), *keys, "fused_qkv=true"]) == 0
    assert main(["tessera-to-hf", str(tmp_path / "fused"), str(tmp_path / "back"), *keys, "fused_qkv=true"]) == 0
    first, back = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("hf", "back"))
    assert sorted(first) == sorted(back)
    for name in first:
        np.testing.assert_array_equal(first[name], back[name], err_msg=name)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tokens = rng.integers(0, 96, (1, 7)).astype(np.int32)
    logits = []
    for folder, extra in (("tessera", []), ("fused", ["fused_qkv=true"])):
        model = build_model(load_model_config(None, [*keys, *extra]).model)
        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), model.param_shapes())
        logits.append(np.asarray(model.apply(load_parameters(str(tmp_path / folder), abstract), tokens)))
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=1e-5)


def _full_disk(where):
    """Each place a full disk surfaced, failing as it did (found on a 40-120 KiB tmpfs)."""
    import errno

    from safetensors import SafetensorError

    def fallocate(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def orbax_save(self, *args, **kwargs):
        raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "x/0": Failed to write 105 bytes to file 26: '
                         "No space left on device [tensorstore_spec='{}'] [os_error_code='28']")

    def save_file(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    return {"scratch": (os, "posix_fallocate", fallocate),
            "orbax": (hf_checkpoint.ocp.Checkpointer, "save", orbax_save),
            "safetensors": (hf_checkpoint, "save_file", save_file)}[where]


@pytest.mark.parametrize("where", ["scratch", "orbax", "safetensors"])
def test_a_full_disk_is_one_line_and_leaves_nothing(checkpoints, tmp_path, monkeypatch, capsys, where):
    """A full disk was: while filling the memory-mapped scratch files, a SIGBUS (exit 135, no message, the
    scratch folder left behind: its sparse files took no disk until a page was written); while Orbax wrote,
    TensorStore's ValueError as a traceback (exit 1); while writing safetensors, a SafetensorError traceback."""
    ckpt, hf = checkpoints
    command = ["tessera-to-hf", str(ckpt)] if where == "safetensors" else ["hf-to-tessera", str(hf)]
    monkeypatch.setattr(*_full_disk(where))
    (tmp_path / "x").mkdir()
    capsys.readouterr()
    assert main([*command, str(tmp_path / "x" / "out"), *KEYS]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: writing failed: [Errno 28] No space left on device; nothing was written (the partial output was "
        "removed): convert again")
    assert list((tmp_path / "x").iterdir()) == []


def test_orbax_error_records_are_held_back_when_run_as_a_command(tmp_path):
    """`python -m tessera.tools.convert` made the "absl" logger a plain Logger before absl.logging was imported:
    its records then named absl's file, not Orbax's, and the filter of Orbax's ERROR records let them through
    (two tracebacks above the one-line error of a full disk). Not seen in-process, where absl came first."""
    import subprocess
    import sys

    from conftest import REPO

    code = ("import logging, sys; from tessera.tools.convert import main; main(['nothing']); "
            "print(type(logging.getLogger('absl')).__name__)")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.strip() == "ABSLLogger", proc.stderr[-2000:]


@pytest.mark.parametrize("key", ["query_pre_attn_scalar=3", "attn_logits_soft_cap=20", "final_logits_soft_cap=30"])
def test_score_scale_and_soft_caps_a_family_has_no_setting_for_are_named(checkpoints, tmp_path, capsys, key):
    """Every family's attention reads these (the decoder the last), but only Gemma 2 and 3's config.json has them:
    a Llama checkpoint converted with one set without a word (then computed other logits), and the export of such
    a model wrote a config.json without it, which transformers runs without it."""
    ckpt, hf = checkpoints
    name, value = key.split("=")
    capsys.readouterr()
    assert main(["hf-to-tessera", str(hf), str(tmp_path / "in"), *KEYS, key]) == 2
    err = capsys.readouterr().err
    assert "describes another model" in err and f"  {name}: checkpoint 0" in err and f"(set {name}=0" in err
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "out"), *KEYS, key]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: {name}={value}: Hugging Face's llama config.json has no such setting, so the exported model would "
        "compute other logits than this one; it cannot be exported\n")
    assert not (tmp_path / "in").exists() and not (tmp_path / "out").exists()


def test_the_exported_activation_is_the_one_the_model_computes():
    """config.json named Tessera's gelu "gelu", which transformers computes exactly (Tessera's is the tanh
    approximation; and hf-to-tessera refused the file back), wrote GPT-2's activation as gelu_new whatever
    the model's was, and an MLP the family cannot build was a KeyError traceback (or written without a word)."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    gelu = load_model_config(None, [*KEYS, 'mlp_activations=["gelu","linear"]']).model
    assert hf_config(gelu, 4096)["hidden_act"] == "gelu_pytorch_tanh"
    assert config_from_hf(hf_config(gelu, 4096))["mlp_activations"] == ["gelu", "linear"]
    relu = load_model_config("gpt3-52k", ['mlp_activations=["relu"]']).model
    assert hf_config(relu, 4096)["activation_function"] == "relu"
    for model, acts in ((None, '["silu"]'), (None, '["silu","silu"]'), ("gpt3-52k", '["gelu","linear"]')):
        m = load_model_config(model, [*(KEYS if model is None else []), f"mlp_activations={acts}"]).model
        with pytest.raises(ConfigError, match=r"mlp_activations=\[.*MLP is .*so this model cannot be exported"):
            hf_config(m, 4096)



@pytest.mark.parametrize("model_name,keys,message", [
    ("mixtral-8x7b", ["norm_topk_prob=false"], r"norm_topk_prob=false: .*mixtral .*computes norm_topk_prob=true"),
    ("mixtral-8x7b", ["routed_score_func=sigmoid", "routed_scaling_factor=2.5"],
     r"routed_score_func=sigmoid, routed_scaling_factor=2.5: .*computes routed_score_func=softmax, routed_scaling_"),
    ("mixtral-8x7b", ["n_routing_groups=4", "topk_routing_group=2"], "n_routing_groups=4, topk_routing_group=2: "),
    ("mixtral-8x7b", ["shared_experts=1"], "shared_experts=1: "),
    ("qwen3-30b-a3b", ["routed_scaling_factor=2"], "routed_scaling_factor=2.0: Hugging Face's qwen3_moe"),
    ("gpt-oss-20b", ["norm_topk_prob=false"], "norm_topk_prob=false: Hugging Face's gpt_oss"),
    ("llama4-17b-16e", ["shared_experts=2"], "shared_experts=2: .*computes shared_experts=1"),
    ("deepseek-v3", ["routed_score_func=softmax"], "routed_score_func=softmax: Hugging Face's deepseek_v3"),
    ("deepseek2-16b", ["norm_topk_prob=true"], "norm_topk_prob=true: .*deepseek_v2 .*computes norm_topk_prob=false"),
    ("deepseek2-236b", ["routing_group_score=top2_sum"], "routing_group_score=top2_sum: Hugging Face's deepseek_v2"),
])
def test_routing_a_family_has_no_setting_for_is_named_both_ways(model_name, keys, message):
    """transformers' Mixtral always renormalizes the chosen experts' softmax weights, and has no scaling, groups,
    shared expert or sigmoid scores (nor Qwen3-MoE but for norm_topk_prob, gpt-oss, Llama 4 their own, DeepSeek-V3
    sigmoid scores alone): an export with another routing wrote a config.json transformers routes otherwise, and a
    checkpoint converted with one set without a word (then computed other logits)."""
    from tessera.config import ConfigError
    from tessera.tools.convert import check_same_model
    from tessera.tools.hf_config_out import hf_config

    written = hf_config(load_model_config(model_name, []).model, 4096)
    other = load_model_config(model_name, keys)
    with pytest.raises(ConfigError, match=message + ".*it cannot be exported"):
        hf_config(other.model, 4096)
    with pytest.raises(ConfigError, match=f"describes another model .*\\n  {keys[0].split('=')[0]}: checkpoint"):
        check_same_model(other, written)
    # what the family's config.json holds, or routes as: exported as it is
    for model_name, keys in (("qwen3-30b-a3b", ["norm_topk_prob=false"]), ("deepseek-v3", ["routed_bias=false"]),
                             ("deepseek-v3", ["norm_topk_prob=false", "n_routing_groups=-1"]),
                             ("mixtral-8x7b", ["n_routing_groups=1"])):
        hf_config(load_model_config(model_name, keys).model, 4096)

def test_a_global_parameter_scale_is_named_when_the_sizes_differ_by_it(checkpoints, tmp_path, capsys):
    """With global_parameter_scale=2 the refusal said "set base_mlp_dim=40" for a config that had base_mlp_dim=40
    (the scale doubles it): the line to set was missing."""
    _, hf = checkpoints
    capsys.readouterr()
    assert main(["hf-to-tessera", str(hf), str(tmp_path / "out"), *KEYS, "global_parameter_scale=2"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].startswith("  global_parameter_scale: checkpoint 1, config 2  (set global_parameter_scale=1")
    assert "  mlp_dim: checkpoint 40, config 80  (set base_mlp_dim=40)" in lines


def test_model_safetensors_beside_an_index_is_read_as_transformers_reads_it(checkpoints, tmp_path, capsys):
    """transformers loads model.safetensors when a folder has it and an index too; the converter read the index's
    shards: another model's weights when one of them was stale, without a word."""
    from safetensors.numpy import load_file, save_file

    ckpt, hf = checkpoints
    assert main(["tessera-to-hf", str(ckpt), str(tmp_path / "both"), *KEYS, "--max-shard-size", "20000"]) == 0
    other = {k: 2 * v for k, v in load_file(str(hf / "model.safetensors")).items()}
    save_file(other, str(tmp_path / "both" / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["hf-to-tessera", str(tmp_path / "both"), str(tmp_path / "t"), *KEYS]) == 0
    assert "has both model.safetensors and model.safetensors.index.json: reading model.safetensors, as " \
           "transformers does" in capsys.readouterr().err
    assert main(["tessera-to-hf", str(tmp_path / "t"), str(tmp_path / "back"), *KEYS]) == 0
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(other)
    for name in other:
        np.testing.assert_array_equal(back[name], other[name], err_msg=name)


class _NotHandled(Exception):
    pass


def test_sigterm_removes_what_the_conversion_wrote(checkpoints, tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler's time limit, `kill`) ended the process on the spot: exit 143 without a word, and the
    scratch copy of the model (one model's worth of disk) left beside the output. Now it stops as Ctrl-C does."""
    import signal

    _, hf = checkpoints
    puts = []

    def put(self, path, index, value, original=hf_checkpoint.ScratchArrays.put):
        if len(puts) == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # in the middle of filling the scratch files
        puts.append(path)
        original(self, path, index, value)

    def not_handled(number, frame):  # what SIGTERM does when main() installs nothing (Python's default kills pytest)
        raise _NotHandled

    monkeypatch.setattr(hf_checkpoint.ScratchArrays, "put", put)
    previous = signal.signal(signal.SIGTERM, not_handled)
    try:
        (tmp_path / "x").mkdir()
        capsys.readouterr()
        assert main(["hf-to-tessera", str(hf), str(tmp_path / "x" / "out"), *KEYS]) == 143
    finally:
        assert signal.signal(signal.SIGTERM, previous) is not_handled  # main() put the handler back
    assert capsys.readouterr().err.endswith("error: terminated (SIGTERM); nothing was written (the partial output was "
                                            "removed): convert again\n")
    assert list((tmp_path / "x").iterdir()) == []  # no output, no scratch copy


def test_a_quantized_checkpoint_is_refused_for_what_it_is(tmp_path, capsys):
    """checkpoint_is_quantized=true was refused as needing load_parameters_path, a key the converter does not read."""
    (tmp_path / "ckpt").mkdir()
    assert main(["tessera-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), *KEYS,
                 "checkpoint_is_quantized=true"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: checkpoint_is_quantized=true: the converter reads float checkpoints only (a quantized one "
                   "is decode.py's); convert the float checkpoint it was written from, and leave the key out\n")
    assert not (tmp_path / "out").exists()


def test_a_circular_pipeline_checkpoint_exports_as_the_plain_one(tmp_path):
    """A run with num_pipeline_repeats=R > 1 saves its stacked blocks [R, L/R, ...]: tessera-to-hf refused them
    ("checkpoint has shape (2, 2, 24, 4, 6), this config expects (4, 24, 4, 6)") with a hint at scan_layers
    that could not help. They are read as saved and flattened, the blocks in the model's order."""
    from safetensors.numpy import load_file

    keys = [k for k in KEYS if not k.startswith("base_num_decoder_layers")] + ["base_num_decoder_layers=4"]
    targets = hf_checkpoint.param_targets(load_model_config(None, keys))
    rng = np.random.default_rng(0)
    plain = {k: rng.standard_normal(t.shape).astype(t.dtype) for k, t in targets.items()}
    circular = {k: v.reshape(2, 2, *v.shape[1:]) if k.startswith("layers/") else v for k, v in plain.items()}
    for name, params in (("plain", plain), ("circular", circular)):
        hf_checkpoint.save_params(tmp_path / name, hf_checkpoint._nest(params))
        assert main(["tessera-to-hf", str(tmp_path / name), str(tmp_path / f"hf_{name}"), *keys]) == 0
    first, second = (load_file(str(tmp_path / f"hf_{n}" / "model.safetensors")) for n in ("plain", "circular"))
    assert sorted(first) == sorted(second)
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_a_gpt3_with_sinusoidal_positions_is_refused_before_writing(tmp_path, capsys):
    """trainable_position_size=0 (fixed sinusoidal positions) exported as n_positions=0 without a wpe tensor,
    exit 0: transformers loaded the folder and failed on its first token (its GPT-2 learns a position table)."""
    keys = ["model_name=gpt3-52k", "base_emb_dim=24", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=6",
            "base_mlp_dim=40", "base_num_decoder_layers=2", "vocab_size=96", "trainable_position_size=0"]
    targets = hf_checkpoint.param_targets(load_model_config(None, keys))
    hf_checkpoint.save_params(tmp_path / "tessera", hf_checkpoint._nest(
        {k: np.zeros(t.shape, t.dtype) for k, t in targets.items()}))
    capsys.readouterr()
    assert main(["tessera-to-hf", str(tmp_path / "tessera"), str(tmp_path / "hf"), *keys]) == 2
    err = capsys.readouterr().err
    assert "trainable_position_size=0 (fixed sinusoidal positions)" in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("model_name,keys,trained,written", [
    ("llama2-7b", [], 4096, 4096), ("llama2-7b", [], 16384, 16384),  # were 8192 whatever the run trained on
    ("llama3.1-8b", [], 4096, 65536),  # was 8192 = original_max_position_embeddings: transformers warned
    ("llama3.1-8b", [], 131072, 131072),
    ("default", ["rope_scaling=yarn", "rope_original_max_position=1024", "rope_scaling_factor=4"], 128, 4096),
    ("gpt-oss-20b", [], 4096, 131072), ("deepseek-v3", [], 4096, 163840),
    ("deepseek-v3", ["rope_scaling_factor=2.5"], 4096, 10240),  # was 4096 * int(2.5)
])
def test_max_position_embeddings_is_the_trained_length_or_the_scaled_context(model_name, keys, trained, written):
    """config.json's max_position_embeddings was max(8192, rope_original_max_position) (YaRN: x the factor):
    a Llama 2 trained on 16384 tokens said 8192, every Llama 3.x said 8192, its own original context (transformers
    warns: it must be longer), and a YaRN model's context differed from original x factor (transformers warns)."""
    from tessera.tools.hf_config_out import hf_config

    assert hf_config(load_model_config(model_name, keys).model, trained)["max_position_embeddings"] == written


def test_export_writes_the_length_the_checkpoint_was_trained_on(checkpoints, tmp_path, capsys):
    """tessera-to-hf reads max_target_length from the command line, else from the training checkpoint's saved
    config; with neither (converted parameters) it writes base.yml's default and says so."""
    import json
    import shutil

    from tessera.checkpointing.storage import CONFIG_FILE

    ckpt, _ = checkpoints
    step = tmp_path / "step"
    shutil.copytree(ckpt, step)
    (step / "config").mkdir()
    (step / "config" / CONFIG_FILE).write_text(json.dumps({"max_target_length": 2048}))
    capsys.readouterr()
    for source, out, extra, want in ((step, "saved", [], 2048), (step, "given", ["max_target_length=3000"], 3000),
                                     (ckpt, "converted", [], 128)):
        assert main(["tessera-to-hf", str(source), str(tmp_path / out), *KEYS, *extra]) == 0
        assert json.loads((tmp_path / out / "config.json").read_text())["max_position_embeddings"] == want, out
        err = capsys.readouterr().err
        assert f"I config.json: max_position_embeddings={want} (" in err, err
        assert ("W max_position_embeddings=128 is configs/base.yml's max_target_length default" in err) == \
            (out == "converted"), err


def test_export_writes_the_length_of_the_model_the_parameters_were_converted_from(checkpoints, tmp_path, capsys):
    """hf-to-tessera keeps the config.json it read beside the parameters: exported again without a
    max_target_length, they wrote base.yml's 128 (a Llama 2 round trip said 128, not 4096), and a fine-tune
    on shorter sequences its own length. Now the source's 4,096 is written, the longer of the two for a
    fine-tune, and a given max_target_length still decides."""
    import json
    import shutil

    from tessera.checkpointing.storage import CONFIG_FILE

    _, hf = checkpoints
    source = tmp_path / "hf"
    shutil.copytree(hf, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    assert main(["hf-to-tessera", str(source), str(tmp_path / "converted"), *KEYS]) == 0
    step = tmp_path / "step"  # a fine-tune's step: its run started from the converted parameters
    shutil.copytree(tmp_path / "converted", step)
    (step / "config").mkdir()
    (step / "config" / CONFIG_FILE).write_text(json.dumps({
        "max_target_length": 2048, "load_parameters_path": str(tmp_path / "converted")}))
    capsys.readouterr()
    for folder, out, extra, want in ((tmp_path / "converted", "again", [], 4096), (step, "tuned", [], 4096),
                                     (step, "given", ["max_target_length=1024"], 1024)):
        assert main(["tessera-to-hf", str(folder), str(tmp_path / out), *KEYS, *extra]) == 0
        assert json.loads((tmp_path / out / "config.json").read_text())["max_position_embeddings"] == want, out
        err = capsys.readouterr().err
        assert f"I config.json: max_position_embeddings={want} (" in err, err
        assert "converted from a Hugging Face model of max_position_embeddings=4096" in err or out == "given", err
        assert "base.yml's max_target_length default" not in err, err


def test_export_says_so_when_the_converted_parameters_a_run_started_from_were_moved(checkpoints, tmp_path, capsys):
    """The fine-tune's step finds the Hugging Face config.json through the absolute load_parameters_path saved
    with it: once that folder was moved or renamed, the export wrote the run's own 2,048 instead of the
    source's 4,096, without a word. Now a warning names the missing folder and what to give."""
    import json
    import shutil

    from tessera.checkpointing.storage import CONFIG_FILE

    ckpt, _ = checkpoints
    step = tmp_path / "step"
    shutil.copytree(ckpt, step)
    (step / "config").mkdir()
    gone = tmp_path / "converted renamed"
    (step / "config" / CONFIG_FILE).write_text(json.dumps({"max_target_length": 2048,
                                                           "load_parameters_path": str(gone)}))
    capsys.readouterr()
    for out, extra, warned in (("moved", [], True), ("given", ["max_target_length=4096"], False)):
        assert main(["tessera-to-hf", str(step), str(tmp_path / out), *KEYS, *extra]) == 0
        err = capsys.readouterr().err
        assert (f"W the checkpoint's run started from load_parameters_path={gone}, which is not there any more (moved "
                "or renamed?)" in err) == warned, err
    gone.mkdir()  # there (a training run's start that was no conversion): nothing to say
    assert main(["tessera-to-hf", str(step), str(tmp_path / "there"), *KEYS]) == 0
    assert "not there any more" not in capsys.readouterr().err

def test_a_gemma3_config_json_as_released_keeps_its_global_rope_scaling():
    """The released Gemma 3 config.json (transformers 4) says rope_scaling (linear x8, the global layers'),
    rope_theta and rope_local_base_freq; transformers 5 reads them as rope_parameters. The converter read only
    rope_parameters: rope_scaling=none, and told a gemma3-4b user to set rope_scaling=none (other logits)."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    m = load_model_config("gemma3-4b", []).model
    written = hf_config(m, 4096)  # transformers 5's form
    released = {k: v for k, v in written.items() if k != "rope_parameters"}
    released.update(rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1_000_000.0,
                    rope_local_base_freq=10_000.0)
    keys = config_from_hf(released)
    assert keys == config_from_hf(written)
    assert (keys["rope_scaling"], keys["rope_scaling_factor"]) == ("linear", 8.0) == (m.rope_scaling,
                                                                                      m.rope_scaling_factor)
    assert config_from_hf({**released, "rope_scaling": {"type": "linear", "factor": 8.0}}) == keys  # older spelling


def test_a_gpt3_sliding_window_is_named_both_ways(checkpoints, tmp_path, capsys):
    """Tessera's gpt3 reads sliding_window_size, GPT-2's config.json has no window: a gpt3 with a window was
    exported without a word (transformers then attended to every earlier position), and a GPT-2 checkpoint
    converted into one."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config

    keys = ["model_name=gpt3-52k", "base_emb_dim=24", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=6",
            "base_mlp_dim=40", "base_num_decoder_layers=2", "vocab_size=96", "trainable_position_size=16"]
    with pytest.raises(ConfigError, match="sliding_window_size=5: Hugging Face's gpt2 config.json has no sliding"):
        hf_config(load_model_config(None, [*keys, "sliding_window_size=5"]).model, 16)
    targets = hf_checkpoint.param_targets(load_model_config(None, keys))
    hf_checkpoint.save_params(tmp_path / "tessera", hf_checkpoint._nest(
        {k: np.zeros(t.shape, t.dtype) for k, t in targets.items()}))
    capsys.readouterr()
    assert main(["tessera-to-hf", str(tmp_path / "tessera"), str(tmp_path / "hf"), *keys]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().err  # GPT-2 writes n_positions, the table's size
    assert main(["hf-to-tessera", str(tmp_path / "hf"), str(tmp_path / "back"), *keys, "sliding_window_size=5"]) == 2
    err = capsys.readouterr().err
    assert "sliding_window_size: checkpoint 0, config 5  (set sliding_window_size=0)" in err, err
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("model_name,model_type", [("llama2-7b", "llama"), ("llama3.1-8b", "llama"),
                                                   ("gemma-7b", "gemma"), ("qwen2.5-7b", "qwen2"),
                                                   ("qwen3-8b", "qwen3"), ("qwen3-30b-a3b", "qwen3_moe")])
def test_a_sliding_window_the_family_has_no_setting_for_is_not_exported(model_name, model_type):
    """Tessera's llama, gemma and qwen3 blocks attend within sliding_window_size; transformers' have no window
    (qwen3's is refused on import): such a model was exported without a word, as a model without it."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config

    with pytest.raises(ConfigError, match=f"sliding_window_size=64: Hugging Face's {model_type} config.json has no "
                                          "sliding window here"):
        hf_config(load_model_config(model_name, ["sliding_window_size=64"]).model, 4096)
    for name in ("mistral-7b", "gemma2-9b", "gemma3-4b", "gpt-oss-20b"):  # these write theirs
        assert hf_config(load_model_config(name, ["sliding_window_size=64"]).model, 4096)["sliding_window"] == 64


@pytest.mark.parametrize("model_name", ["qwen2.5-7b", "qwen3-8b"])
@pytest.mark.parametrize("window", [{"use_sliding_window": True, "sliding_window": 4096},
                                    {"layer_types": ["full_attention"] * 27 + ["sliding_attention"]}])
def test_a_qwen_checkpoint_with_sliding_window_layers_is_refused(model_name, window):
    """Qwen2's and Qwen3's optional sliding-window layers (off in every released model) are not built: a
    config.json asking for them is refused by name, not converted into a model attending to every position."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    written = hf_config(load_model_config(model_name, []).model, 4096)
    assert config_from_hf(written)["decoder_block"] == written["model_type"]  # as written, it converts
    name = "Qwen2" if written["model_type"] == "qwen2" else "Qwen3"
    with pytest.raises(ConfigError, match=f"this {name} checkpoint sets use_sliding_window=true"):
        config_from_hf({**written, **window, "num_hidden_layers": 28})


def test_qwen2_biases_are_its_query_key_and_value_ones():
    """transformers' Qwen2 always has biases on the query, key and value projections and none on the output one:
    its config.json has no attention_bias, the converter reads it as true, and a qwen2 model without them has no
    Hugging Face counterpart (refused, as gpt-oss without its sinks is)."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf
    from tessera.tools.hf_layouts import layout_for

    m = load_model_config("qwen2.5-7b", []).model
    written = hf_config(m, 32768)
    assert "attention_bias" not in written and written["architectures"] == ["Qwen2ForCausalLM"]
    assert config_from_hf({**written, "attention_bias": False})["attention_bias"] is True
    names = {hf for rule in layout_for(m).layer_rules for hf in rule.hf}
    assert {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"} <= names
    assert "self_attn.o_proj.bias" not in names
    with pytest.raises(ConfigError, match=r"attention_bias=false \(Qwen2 always has its query, key and value biases"):
        layout_for(load_model_config("qwen2.5-7b", ["attention_bias=false"]).model)


def test_settings_a_config_json_leaves_out_are_transformers_defaults():
    """A config.json without a Gemma 2 soft cap, query_pre_attn_scalar or window (or a Mistral, Gemma 3 or
    gpt-oss window) is built by transformers with its config class's defaults (50 and 30, 256, 4096; gpt-oss
    128); the converter read no cap, head_dim**-0.5 and no window: another model (the tiny Gemma 2's logits
    3.6 off)."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    left_out = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window")
    for name, want in (("gemma2-9b", dict(query_pre_attn_scalar=256, attn_logits_soft_cap=50.0,
                                          final_logits_soft_cap=30.0, sliding_window_size=4096)),
                       ("gemma3-4b", dict(query_pre_attn_scalar=256, attn_logits_soft_cap=0.0,
                                          final_logits_soft_cap=0.0, sliding_window_size=4096)),
                       ("mistral-7b", dict(sliding_window_size=4096)), ("gpt-oss-20b", dict(sliding_window_size=128))):
        written = hf_config(load_model_config(name, ["sliding_window_size=7"]).model, 4096)
        keys = config_from_hf({k: v for k, v in written.items() if k not in left_out})
        assert {k: keys[k] for k in want} == want, name
        assert config_from_hf({**written, "sliding_window": None})["sliding_window_size"] == 0, name  # null: none


def test_routing_and_attention_settings_a_config_json_leaves_out_are_transformers_defaults():
    """DeepSeek-V3's and Llama 4's config classes default to their released models' routing and attention
    (routed_scaling_factor 2.5, norm_topk_prob, 8 groups choosing 4; q/k norms, the temperature, chunks of 8192);
    the converter read 1.0, false, no groups, no norms, no temperature, no chunks (the tiny models' logits 1.9
    and 3.5 off)."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    written = hf_config(load_model_config("deepseek-v3", []).model, 4096)
    left_out = ("routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group")
    keys = config_from_hf({k: v for k, v in written.items() if k not in left_out})
    assert (keys["routed_scaling_factor"], keys["norm_topk_prob"], keys["n_routing_groups"],
            keys["topk_routing_group"]) == (2.5, True, 8, 4)
    written = hf_config(load_model_config("llama4-17b-16e", []).model, 4096)
    left_out = ("use_qk_norm", "attn_temperature_tuning", "attention_chunk_size")
    keys = config_from_hf({k: v for k, v in written.items() if k not in left_out})
    assert (keys["use_qk_norm"], keys["temperature_tuning"], keys["chunk_attn_window_size"]) == (True, True, 8192)


def test_a_gpt_oss_config_json_without_rope_settings_gets_its_default_yarn():
    """transformers' GptOssConfig defaults to YaRN x32 over 4096 tokens (theta 150000, untruncated); a
    config.json with neither rope_parameters nor rope_scaling was read as plain RoPE (logits 2.5 off)."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    m = load_model_config("gpt-oss-20b", []).model
    written = hf_config(m, 4096)
    bare = {k: v for k, v in written.items() if k not in ("rope_scaling", "rope_theta")}
    assert config_from_hf(bare) == config_from_hf(written)
    keys = config_from_hf({**bare, "rope_theta": 5e5})
    assert (keys["rope_scaling"], keys["rope_scaling_factor"], keys["rope_max_timescale"]) == ("yarn", 32.0, 500000)


def test_a_sliding_window_the_family_ignores_is_not_read():
    """transformers' llama, gemma and llama4_text attend to every earlier position whatever sliding_window their
    config.json holds (a tiny Llama's logits equal with and without one); the converter read it as a window, and
    told a llama2-7b user to set sliding_window_size=4096 (then computed other logits than the checkpoint's)."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    for name in ("llama2-7b", "llama3.1-8b", "gemma-7b", "llama4-17b-16e"):
        written = hf_config(load_model_config(name, []).model, 4096)
        assert config_from_hf({**written, "sliding_window": 4096})["sliding_window_size"] == 0, name
    for name in ("mistral-7b", "mixtral-8x7b", "gemma2-9b", "gemma3-4b", "gpt-oss-20b"):  # these read theirs
        written = hf_config(load_model_config(name, []).model, 4096)
        assert config_from_hf({**written, "sliding_window": 77})["sliding_window_size"] == 77, name


def test_a_head_dim_a_config_json_leaves_out_is_transformers_default():
    """transformers' Gemma (1, 2, 3), Qwen3, gpt-oss and Llama 4 config classes default head_dim to a number
    (256, 128, 64, 128), not to hidden_size // num_attention_heads: without head_dim, gpt-oss-20b's config.json was
    read as head_dim 45 and gemma3-4b's as 320, and the converter told the user to set that."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    for name, head_dim in (("gemma-7b", 256), ("gemma2-2b", 256), ("gemma3-4b", 256), ("qwen3-8b", 128),
                           ("gpt-oss-20b", 64), ("llama4-17b-16e", 128), ("llama2-7b", 128), ("mistral-7b", 128)):
        written = hf_config(load_model_config(name, []).model, 4096)
        assert written["head_dim"] == head_dim, name
        bare = {k: v for k, v in written.items() if k != "head_dim"}
        assert config_from_hf(bare) == config_from_hf(written), name


def test_the_activation_is_read_from_the_key_the_family_reads():
    """transformers' Gemma runs config.json's hidden_act (its legacy "gelu" as the tanh GELU), Gemma 2 and 3 their
    hidden_activation alone: a Gemma with hidden_act=silu was converted as a GeGLU, a Gemma 2 whose hidden_act
    said silu (hidden_activation left out) as a SiLU; and a Gemma with another gated activation was refused on
    export."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    gemma = hf_config(load_model_config("gemma-2b", []).model, 4096)
    for hidden_act, acts in (("silu", ["silu", "linear"]), ("relu", ["relu", "linear"]), ("gelu", ["gelu", "linear"]),
                             ("gelu_pytorch_tanh", ["gelu", "linear"])):
        assert config_from_hf({**gemma, "hidden_act": hidden_act})["mlp_activations"] == acts, hidden_act
    for name in ("gemma2-2b", "gemma3-4b"):
        written = {k: v for k, v in hf_config(load_model_config(name, []).model, 4096).items()
                   if k != "hidden_activation"}
        assert config_from_hf({**written, "hidden_act": "silu"})["mlp_activations"] == ["gelu", "linear"], name
        assert config_from_hf({**written, "hidden_activation": "silu"})["mlp_activations"] == ["silu", "linear"]
    for name in ("gemma-2b", "gemma2-2b", "gemma3-4b"):  # a gated SiLU Gemma exports as one, and reads back so
        m = load_model_config(name, ['mlp_activations=["silu","linear"]']).model
        written = hf_config(m, 4096)
        assert (written["hidden_act"], written["hidden_activation"]) == ("silu", "silu"), name
        assert config_from_hf(written)["mlp_activations"] == ["silu", "linear"], name


def test_the_released_deepseek_v2_config_jsons_describe_the_deepseek2_model_files():
    """deepseek-ai/DeepSeek-V2-Lite's and DeepSeek-V2's config.json (transformers 4.33's keys: rope_theta beside a
    rope_scaling of "type" yarn; V2-Lite's q_lora_rank null and greedy routing in one group, V2's groups ranked by
    their best expert) are the model files deepseek2-16b and deepseek2-236b; transformers routes both as Tessera's
    deepseek does with softmax scores, no balancing bias and no renormalization. Exported, each is written as
    deepseek_v2 again."""
    from tessera.config import ConfigError
    from tessera.tools.convert import check_same_model
    from tessera.tools.hf_config_out import hf_config

    common = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
              "hidden_act": "silu", "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_layer_freq": 1,
              "first_k_dense_replace": 1, "n_shared_experts": 2, "norm_topk_prob": False, "num_experts_per_tok": 6,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-06,
              "rope_theta": 10000, "scoring_func": "softmax", "seq_aux": True, "tie_word_embeddings": False,
              "vocab_size": 102400, "torch_dtype": "bfloat16",
              "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                               "original_max_position_embeddings": 4096, "type": "yarn"}}
    lite = {**common, "aux_loss_alpha": 0.001, "hidden_size": 2048, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 64, "num_attention_heads": 16,
            "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None, "routed_scaling_factor": 1.0,
            "topk_group": 1, "topk_method": "greedy"}
    full = {**common, "aux_loss_alpha": 0.003, "hidden_size": 5120, "intermediate_size": 12288,
            "moe_intermediate_size": 1536, "n_group": 8, "n_routed_experts": 160, "num_attention_heads": 128,
            "num_hidden_layers": 60, "num_key_value_heads": 128, "q_lora_rank": 1536, "routed_scaling_factor": 16.0,
            "topk_group": 3, "topk_method": "group_limited_greedy"}
    for name, released in (("deepseek2-16b", lite), ("deepseek2-236b", full)):
        cfg = load_model_config(name, [])
        check_same_model(cfg, released)
        written = hf_config(cfg.model, 4096)
        assert (written["model_type"], written["topk_method"], written["n_group"], written["q_lora_rank"]) == (
            "deepseek_v2", released["topk_method"], released["n_group"], released["q_lora_rank"])
    with pytest.raises(ConfigError, match=r"describes another model .*\n  routing_group_score: checkpoint 'max', "
                                          r"config 'top2_sum'  \(set routing_group_score=max\)"):
        check_same_model(load_model_config("deepseek2-236b", ["routing_group_score=top2_sum"]), full)


def test_the_released_multimodal_gemma3_4b_config_json_describes_gemma3_4b():
    """google/gemma-3-4b-pt's config.json (Gemma3ForConditionalGeneration, transformers 4.50's keys) keeps in its
    text_config only what differs from Gemma3TextConfig's defaults: no heads, head_dim, vocabulary, norm epsilon
    or rotary thetas. It was refused (model_type gemma3 unsupported); read with those defaults it is gemma3-4b."""
    from tessera.tools.convert import check_same_model

    released = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
                "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
                "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                "sliding_window": 1024},
                "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896}}
    check_same_model(load_model_config("gemma3-4b", []), released)


def test_a_rope_scaling_the_family_config_json_is_not_written_with_is_refused_on_export():
    """A deepseek model with linear or llama3 rope scaling, or a gemma3 one with yarn or llama3, was exported with
    plain RoPE (deepseek) or plain global RoPE (gemma3) in its config.json, without a word; and DeepSeek's YaRN
    without truncation was written and read back truncated (transformers rounds the ramp unless told not to)."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    yarn = ["rope_scaling=yarn", "rope_scaling_factor=4", "rope_original_max_position=1024"]
    for name, keys in (("deepseek-small", ["rope_scaling=linear", "rope_scaling_factor=4"]),
                       ("deepseek-small", ["rope_scaling=llama3", "rope_original_max_position=1024"]),
                       ("gemma3-4b", yarn), ("gemma3-4b", ["rope_scaling=llama3", "rope_original_max_position=1024"])):
        with pytest.raises(ConfigError, match=f"^{keys[0]}: the .* config.json is written with rope_scaling .* it "
                                              "cannot be exported$"):
            hf_config(load_model_config(name, keys).model, 4096)
    for truncate in (True, False):
        written = hf_config(load_model_config("deepseek-small", [*yarn, f"rope_truncate={truncate}"]).model, 4096)
        assert written["rope_parameters"]["truncate"] is truncate
        assert config_from_hf(written)["rope_truncate"] is truncate


def test_a_gemma3_sliding_window_pattern_other_than_6_is_refused():
    """A Gemma 3 config.json without layer_types (transformers 4's files) has transformers build them from
    sliding_window_pattern (a global layer every that many); the converter checked only layer_types, so a pattern of
    4 converted into Tessera's 5 local : 1 global layers without a word."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    written = hf_config(load_model_config("gemma3-4b", []).model, 4096)
    bare = {k: v for k, v in written.items() if k != "layer_types"}
    assert config_from_hf({**bare, "sliding_window_pattern": 6}) == config_from_hf(bare) == config_from_hf(written)
    with pytest.raises(ConfigError, match=r"layer_types \(or sliding_window_pattern\) are not the 5 local : 1 global"):
        config_from_hf({**bare, "sliding_window_pattern": 4})
    config_from_hf({**written, "sliding_window_pattern": 4})  # layer_types, when given, are what transformers reads


def test_numbers_that_are_not_whole_are_refused_where_the_other_side_holds_whole_ones():
    """Tessera's rope_max_timescale is a whole number and transformers' query_pre_attn_scalar too: a config.json's
    rope_theta of 10000.5 converted into a model rotating with 10000, and a gemma2 model's query_pre_attn_scalar of
    144.5 exported as 144 (other scores), both without a word."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    for name in ("llama2-7b", "deepseek-v3", "gemma3-4b"):
        written = hf_config(load_model_config(name, []).model, 4096)
        if name == "llama2-7b":
            written["rope_theta"] = 10000.5
        elif name == "deepseek-v3":
            written["rope_parameters"]["rope_theta"] = 10000.5
        else:
            written["rope_parameters"]["sliding_attention"]["rope_theta"] = 10000.5
        with pytest.raises(ConfigError, match=r"rope_theta=10000\.5 is not a whole number"):
            config_from_hf(written)
    assert config_from_hf({**hf_config(load_model_config("llama2-7b", []).model, 4096),
                           "rope_theta": 5e5})["rope_max_timescale"] == 500000
    with pytest.raises(ConfigError, match=r"query_pre_attn_scalar=144\.5: Hugging Face's config stores a whole number"):
        hf_config(load_model_config("gemma2-27b", ["query_pre_attn_scalar=144.5"]).model, 4096)
    assert hf_config(load_model_config("gemma2-27b", []).model, 4096)["query_pre_attn_scalar"] == 144


def test_gemma_attention_biases_are_written_and_read_back():
    """transformers' Gemma, Gemma 2 and Gemma 3 have attention_bias; tessera-to-hf refused a gemma model with
    attention biases ("Hugging Face's gemma model has no such tensors")."""
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf
    from tessera.tools.hf_layouts import layout_for

    for name in ("gemma-7b", "gemma2-9b", "gemma3-4b"):
        m = load_model_config(name, ["attention_bias=true"]).model
        layout_for(m)
        assert config_from_hf(hf_config(m, 4096))["attention_bias"] is True, name
        assert config_from_hf(hf_config(load_model_config(name, []).model, 4096))["attention_bias"] is False, name


def test_attention_biases_the_converter_does_not_place_are_named():
    """A DeepSeek-V3 or Llama 4 config.json with attention_bias=true (transformers builds the biases) was refused
    only when its tensors were found to have "no place in this Tessera model", with the question whether
    model_name was the right family; the setting is named now."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    for name, model_type in (("deepseek-v3", "deepseek_v3"), ("llama4-17b-16e", "llama4_text")):
        written = hf_config(load_model_config(name, []).model, 4096)
        config_from_hf({**written, "attention_bias": False})
        with pytest.raises(ConfigError, match=f"^this {model_type} checkpoint sets attention_bias=true"):
            config_from_hf({**written, "attention_bias": True})
    multimodal = {"model_type": "llama4", "text_config": {**written, "attention_bias": True}}
    with pytest.raises(ConfigError, match="llama4_text checkpoint sets attention_bias=true"):
        config_from_hf(multimodal)


def test_main_leaves_the_callers_logging_as_it_was(tmp_path):
    """main() used logging.basicConfig(force=True): called from a notebook it closed the caller's own handlers (a
    log file) and left its own, and INFO, for the rest of the process."""
    import logging

    root = logging.getLogger()
    theirs, level = logging.FileHandler(tmp_path / "mine.log"), root.level
    root.addHandler(theirs)
    try:
        root.setLevel(logging.WARNING)
        assert main(["tessera-to-hf", str(tmp_path / "none"), str(tmp_path / "out"), *KEYS]) == 2
        assert theirs in root.handlers and not theirs.stream.closed and root.level == logging.WARNING
    finally:
        root.removeHandler(theirs)
        theirs.close()
        root.setLevel(level)


def test_an_olmo3_config_json_as_released_describes_olmo3_7b():
    """OLMo 3's released config.json (transformers 4's form: rope_theta and the global layers' YaRN as rope_scaling,
    with its attention_factor) describes Tessera's olmo3-7b, whose file gives the local layers' theta as -1 (the
    global one): the converter compares the theta the local layers are built with. transformers 5's form (the
    exporter's: rope_parameters per layer type) reads the same."""
    from tessera.config import ConfigError
    from tessera.tools.convert import check_same_model
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    cfg = load_model_config("olmo3-7b", [])
    released = {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "hidden_size": 4096,
                "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
                "num_hidden_layers": 32, "vocab_size": 100278, "rms_norm_eps": 1e-6, "rope_theta": 500000,
                "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                                 "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1},
                "sliding_window": 4096, "max_position_embeddings": 65536, "tie_word_embeddings": False,
                "attention_bias": False, "hidden_act": "silu",
                "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(32)]}
    check_same_model(cfg, released)
    written = hf_config(cfg.model, 4096)
    assert written["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert written["rope_parameters"]["full_attention"]["rope_type"] == "yarn" and "rope_scaling" not in written
    assert config_from_hf(written) == config_from_hf(released)
    check_same_model(cfg, written)
    other = {**written, "rope_parameters": {**written["rope_parameters"],
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
    with pytest.raises(ConfigError, match=r"local_rope_max_timescale: checkpoint 10000, config 500000  \(set "
                                          r"local_rope_max_timescale=10000\)"):
        check_same_model(cfg, other)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(32)]},
     "this OLMo 3 checkpoint's layer_types are not the 3 local : 1 global pattern Tessera's olmo3 builds"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}},
     "OLMo 3 local layers with rope_type='linear' are not supported"),
])
def test_olmo3_layer_patterns_and_local_scalings_tessera_does_not_build_are_refused(change, message):
    """Layers other than 3 local : 1 global, or scaled local rotary frequencies, would convert into another model
    than transformers builds from the config.json."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    written = hf_config(load_model_config("olmo3-7b", []).model, 4096)
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_hf({**written, **change})


def test_olmo2_converts_into_olmo2_and_a_windowless_olmo3_exports_as_olmo2():
    """OLMo 2 (model_type olmo2: OLMo 3's layer, every layer global, one rotary embedding) converts into Tessera's
    olmo2 (one layer per block), with a rotary scaling if it has one (olmo2 scales every layer, as transformers'
    does; when OLMo 2 was built as olmo3 without windows such a checkpoint was refused). An olmo3 model without
    windows whose layers rotate alike still exports as olmo2 (transformers' olmo3 needs a window); one whose
    layers rotate differently has neither form and is refused by name."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import as_overrides, config_from_hf

    olmo2 = {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 4096,
             "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
             "vocab_size": 100352, "rms_norm_eps": 1e-6, "rope_theta": 500000, "tie_word_embeddings": False,
             "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": 4096}
    keys = config_from_hf(olmo2)
    assert (keys["decoder_block"], keys["rope_max_timescale"], keys["rope_scaling"]) == ("olmo2", 500000, "none")
    assert "local_rope_max_timescale" not in keys and not keys.get("sliding_window_size")
    m = load_model_config("olmo2-7b", []).model
    assert config_from_hf(hf_config(m, 4096)) == keys
    scaled = config_from_hf({**olmo2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert (scaled["decoder_block"], scaled["rope_scaling"], scaled["rope_scaling_factor"]) == ("olmo2", "linear", 2.0)
    written = hf_config(load_model_config("default", as_overrides(scaled)).model, 4096)
    assert (written["model_type"], written["rope_scaling"]["rope_type"], written["rope_scaling"]["factor"]) == (
        "olmo2", "linear", 2.0)
    assert config_from_hf(written) == scaled

    windowless = load_model_config("olmo3-7b", ["sliding_window_size=0", "rope_scaling=none",
                                                "vocab_size=100352"]).model
    written = hf_config(windowless, 4096)
    assert (written["model_type"], written["architectures"]) == ("olmo2", ["Olmo2ForCausalLM"])
    assert "sliding_window" not in written and "layer_types" not in written
    assert config_from_hf(written) == keys  # read back as OLMo 2 is: decoder_block=olmo2
    yarn = load_model_config("olmo3-7b", ["sliding_window_size=0"]).model
    with pytest.raises(ConfigError, match="sliding_window_size=0 with rope_scaling=yarn and local_rope_max_timescale=-1: "
                                          "transformers' olmo3 needs a window"):
        hf_config(yarn, 4096)
    with pytest.raises(ConfigError, match="sliding_window_size=64: Hugging Face's olmo2 config.json has no sliding "
                                          "window"):
        hf_config(load_model_config("olmo2-7b", ["sliding_window_size=64"]).model, 4096)


def test_an_olmo2_checkpoint_converts_into_olmo3_without_windows_and_into_nothing_else_of_olmo3():
    """OLMo 2 is olmo3 without windows at one rotary theta (the same function in 4-layer blocks): an OLMo 2
    checkpoint converts into that config too (as before decoder_block=olmo2 existed), and into an olmo3 with
    windows, or with its rotary scaled (olmo3 scales its global layers only), it is refused as another model,
    each difference named with the key that fixes it."""
    from tessera.config import ConfigError
    from tessera.tools.convert import check_same_model
    from tessera.tools.hf_config_out import hf_config

    olmo2 = hf_config(load_model_config("olmo2-7b", []).model, 4096)
    check_same_model(load_model_config("olmo2-7b", []), olmo2)
    windowless = ["decoder_block=olmo3", "sliding_window_size=0", "local_rope_max_timescale=-1"]
    check_same_model(load_model_config("olmo2-7b", windowless), olmo2)
    with pytest.raises(ConfigError, match=r"sliding_window_size: checkpoint 0, config 4096 +\(set sliding_window_size=0\)"):
        check_same_model(load_model_config("olmo2-7b", ["decoder_block=olmo3", "sliding_window_size=4096",
                                                        "local_rope_max_timescale=-1"]), olmo2)
    scaled = {**olmo2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    check_same_model(load_model_config("olmo2-7b", ["rope_scaling=linear", "rope_scaling_factor=2.0"]), scaled)
    with pytest.raises(ConfigError, match=r"decoder_block: checkpoint 'olmo2', config 'olmo3' +\(set decoder_block=olmo2\)"):
        check_same_model(load_model_config("olmo2-7b", [*windowless, "rope_scaling=linear", "rope_scaling_factor=2.0"]),
                         scaled)


@pytest.mark.parametrize("name, official", [
    # allenai/OLMo, configs/official-1124/OLMo2-7B-stage1.yaml and OLMo2-13B-stage1.yaml: d_model, n_heads and
    # the kv heads (none grouped), n_layers, mlp_hidden_size (SwiGLU's two halves together), embedding_size,
    # rope_theta, layer_norm_eps; attention_layer_norm and norm_after true, weight_tying false
    ("olmo2-7b", (4096, 32, 32, 32, 22016, 100352, 500000, 1e-6)),
    ("olmo2-13b", (5120, 40, 40, 40, 27648, 100352, 500000, 1e-6)),
    # allenai/OLMo-core, TransformerConfig.olmo2_32B: d_model 5120, 40 heads, 8 kv heads, 64 layers, a feed-forward
    # hidden_size (each half) of int(8/3 x 5120) = 13653 times 27648 / 13653.33, up to a multiple of 512: 27648;
    # the tokenizer's 100,278 padded to 100,352; rope_theta 500k, eps 1e-6; qk_norm, reordered norms
    ("olmo2-32b", (5120, 40, 8, 64, 2 * 27648, 100352, 500000, 1e-6)),
])
def test_the_olmo2_model_files_are_the_official_configs_and_export_as_olmo2(name, official):
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import config_from_hf

    m = load_model_config(name, []).model
    assert (m.emb_dim, m.num_query_heads, m.num_kv_heads, m.num_decoder_layers, 2 * m.mlp_dim, m.vocab_size,
            m.rope_max_timescale, m.normalization_layer_epsilon) == official
    assert m.head_dim == 128 and not m.logits_via_embedding and m.sliding_window_size == 0
    assert (m.decoder_block, m.rope_scaling) == ("olmo2", "none")
    written = hf_config(m, 4096)
    assert (written["model_type"], written["hidden_size"], written["num_key_value_heads"], written["intermediate_size"],
            written["vocab_size"]) == ("olmo2", official[0], official[2], official[4] // 2, official[5])
    assert config_from_hf(written)["decoder_block"] == "olmo2"


QWEN3_NEXT = ["decoder_block=qwen3_next", "base_emb_dim=64", "base_num_decoder_layers=8", "base_num_query_heads=4",
              "base_num_kv_heads=2", "head_dim=16", "partial_rotary_factor=0.25", "num_experts=8",
              "num_experts_per_tok=2", "base_mlp_dim=32", "shared_experts=2", "gdn_num_key_heads=2",
              "gdn_num_value_heads=4", "gdn_key_head_dim=16", "gdn_value_head_dim=8"]


def test_a_qwen3_next_config_json_round_trips_and_its_other_variants_are_refused():
    """Qwen3-Next's config.json as tessera-to-hf writes it reads back as the same model (partial rotary from
    rope_parameters; without it transformers' default quarter); the variants Tessera does not build are refused:
    another layer pattern, dense layers, attention biases, a shared expert that is not whole experts wide."""
    from tessera.config import ConfigError
    from tessera.tools.hf_config_out import hf_config
    from tessera.tools.hf_configs import as_overrides, config_from_hf

    m = load_model_config(None, QWEN3_NEXT).model
    written = hf_config(m, 4096)
    assert written["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert written["shared_expert_intermediate_size"] == 64 and written["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert load_model_config(None, as_overrides(config_from_hf(written))).model == m
    released = {k: v for k, v in written.items() if k != "layer_types"}
    released["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}  # as transformers 4 wrote it
    assert config_from_hf(released)["partial_rotary_factor"] == 0.25
    for change, message in [
            ({"layer_types": ["full_attention", "linear_attention"] * 4}, "layer_types are not the 3 linear-attention"),
            ({"full_attention_interval": 2, "layer_types": None}, "layer_types are not the 3 linear-attention"),
            ({"decoder_sparse_step": 2}, "dense MLP layers between expert layers"),
            ({"num_experts": 0}, r"dense MLPs \(num_experts < 2\)"),
            ({"attention_bias": True}, "attention_bias=true"),
            ({"shared_expert_intermediate_size": 48}, "shared expert is 48 wide, not a multiple of its experts' width 32")]:
        with pytest.raises(ConfigError, match=message):
            config_from_hf({**written, **change})
