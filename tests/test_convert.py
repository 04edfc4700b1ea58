"""tessera.tools.convert on damaged inputs, without the Hugging Face reference interpreter: a tiny Tessera
checkpoint written here (and its Hugging Face form, converted by the tool) with one file truncated is one
error line naming the file, exit 2, and no output left behind."""

import os

import numpy as np
import pytest

from tessera.tools import hf_checkpoint
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
    reader = hf_checkpoint.Reader(tmp_path)
    assert sorted(reader.names) == ["x.gate_up_proj", "x.other"]
    values = reader.get("x.gate_up_proj")
    assert values.shape == (2, 64, 3) and values.dtype == ml_dtypes.bfloat16
    for e, c, r in [(0, 0, 0), (1, 37, 2), (1, 63, 1), (0, 32, 2)]:
        byte = blocks[e, r, c // 32, (c % 32) // 2]
        code = byte & 0x0F if c % 2 == 0 else byte >> 4
        assert float(values[e, c, r]) == hf_checkpoint.FP4_E2M1[code] * 2.0 ** (int(scales[e, r, c // 32]) - 127)
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
