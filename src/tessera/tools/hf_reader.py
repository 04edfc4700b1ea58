"""Reading a Hugging Face checkpoint folder for conversion (`tessera.tools.convert`): its config.json (or a
multimodal checkpoint's text_config), its safetensors one tensor at a time (sharded with an index or not), and the
quantized formats released checkpoints use (gpt-oss's MXFP4 experts, DeepSeek's block-scaled float8), dequantized as
they are read."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from tessera.config import ConfigError
from tessera.tools.hf_configs import HF_MULTIMODAL

log = logging.getLogger("tessera")


def read_hf_config(hf_dir: Path) -> dict:
    """The folder's config.json as a dict; ConfigError when it is missing, not JSON or not an object."""
    path = hf_dir / "config.json"
    if hf_dir.is_file():
        raise ConfigError(f"{hf_dir} is a file; pass the Hugging Face model folder that holds it "
                          "(config.json + *.safetensors)")
    if not path.is_file():
        raise ConfigError(f"{hf_dir} has no config.json; pass a Hugging Face model folder "
                          "(config.json + *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object of model settings "
                          '({"model_type": ..., "hidden_size": ..., ...}); pass the model\'s own config.json')
    return config


class Reader:
    """Tensors of a Hugging Face checkpoint folder, read lazily by name."""

    def __init__(self, hf_dir: Path):
        self.config = read_hf_config(hf_dir)
        index, single = hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"
        if single.is_file():  # first, as transformers reads it: an index beside it is left unread there too
            if index.is_file():
                log.warning("%s has both model.safetensors and %s: reading model.safetensors, as transformers does "
                            "(remove the stale one)", hf_dir, index.name)
            files = {n: single for n in _open(single).keys()}
        elif index.is_file():
            try:
                files = {n: hf_dir / f for n, f in json.loads(index.read_text())["weight_map"].items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{index} is not a safetensors index (JSON with a weight_map of tensor name -> "
                                  f"file): {type(e).__name__}: {e}; save the model again") from None
        else:
            raise ConfigError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json "
                              "(PyTorch .bin checkpoints are not read; save the model with safe_serialization=True)")
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise ConfigError(f"the checkpoint index names files that do not exist: {', '.join(missing)}")
        self._files = files
        self._aliases = {n: n for n in files}
        if self.config.get("model_type") == "gpt2":  # Hub GPT-2 checkpoints leave out the "transformer." prefix
            self._aliases.update({f"transformer.{n}": n for n in files if not n.startswith(("transformer.", "lm_head"))})
        if self.config.get("model_type") in HF_MULTIMODAL:  # the language model's tensors, by its own names
            self._aliases = {n.removeprefix("language_model."): n for n in files}
        # MXFP4 tensors (gpt-oss's released experts) are stored as <name>_blocks and <name>_scales
        self._mxfp4 = {n[:-len("_blocks")] for n in files
                       if n.endswith("_blocks") and n[:-len("_blocks")] + "_scales" in files}
        # float8 weights with a scale per block (DeepSeek-V3's and Kimi K2's releases): <name> and <name>_scale_inv
        self._fp8 = {n for n in files if n + "_scale_inv" in files}
        self._fp8_block = fp8_block_size(self.config)
        self._open: dict[Path, Any] = {}
        self._headers: dict[Path, dict] = {}

    @property
    def names(self) -> list[str]:
        """The checkpoint's tensors by the names the layouts use (an MXFP4 pair as the one tensor it holds)."""
        actual_to_alias = {v: k for k, v in self._aliases.items()}
        packed = {f"{n}{part}" for n in self._mxfp4 for part in ("_blocks", "_scales")} | {
            f"{n}_scale_inv" for n in self._fp8}
        return [actual_to_alias[n] for n in self._files if n not in packed] + sorted(self._mxfp4)

    def get(self, name: str) -> np.ndarray:
        if name in self._mxfp4:
            return mxfp4_values(self._read(name + "_blocks"), self._read(name + "_scales"))
        actual = self._aliases.get(name)
        if actual is None:
            raise ConfigError(f"the checkpoint has no tensor {name!r}; is model_name (or decoder_block) right?")
        if actual in self._fp8:
            return block_dequantized(self._read_float8(actual), self._read(actual + "_scale_inv"), self._fp8_block,
                                     actual)
        return self._read(actual)

    def _read_float8(self, actual: str) -> np.ndarray:
        """A float8 tensor as its ml_dtypes type, from the file's header and bytes (safetensors' numpy reader
        has no float8 type)."""
        import ml_dtypes

        path = self._files[actual]
        if path not in self._headers:
            self._headers[path] = _header(path)
        header, data_start = self._headers[path]
        entry = header.get(actual)
        if not isinstance(entry, dict):
            raise ConfigError(f"{path.name} has no tensor {actual}, which model.safetensors.index.json places there; "
                              "save the model again (or fix the index)")
        dtype = FLOAT8_TYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ConfigError(f"tensor {actual} of {path} is stored as {entry.get('dtype')}, but has block scales "
                              f"({actual}_scale_inv), which go with float8 weights (F8_E4M3 or F8_E5M2) only")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != int(np.prod(shape)) or data_start + end > path.stat().st_size:
            raise _damaged(path, ValueError(f"tensor {actual}'s bytes do not match its shape {list(shape)}"))
        raw = np.fromfile(path, np.uint8, count=end - begin, offset=data_start + begin)
        return raw.view(getattr(ml_dtypes, dtype)).reshape(shape)

    def _read(self, actual: str) -> np.ndarray:
        path = self._files[actual]
        if path not in self._open:
            self._open[path] = _open(path)
        try:
            return self._open[path].get_tensor(actual)
        except SafetensorError as e:
            if "does not contain tensor" in str(e):  # the index names the wrong file: the file may be fine
                raise ConfigError(f"{path.name} has no tensor {actual}, which model.safetensors.index.json places "
                                  "there; save the model again (or fix the index)") from None
            raise _damaged(path, e) from None
        except (AttributeError, TypeError):  # a dtype numpy has no type for: float8 (numpy.float8_e4m3fn)
            dtype = self._open[path].get_slice(actual).get_dtype()
            raise ConfigError(f"tensor {actual} of {path} is stored as {dtype}, which the converter does not read "
                              "(float32, bfloat16, float16, gpt-oss's MXFP4 and float8 with a scale per block, "
                              "<name>_scale_inv, as DeepSeek-V3 and Kimi K2 store theirs, are read); convert the "
                              "checkpoint to bfloat16 first") from None


# The 16 values of an FP4 (e2m1) code: sign bit, two exponent bits, one mantissa bit
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The bfloat16 values of an MXFP4 tensor as gpt-oss's checkpoints store it: `blocks` [E, R, G, 16]
    uint8 (two FP4 codes a byte, the low nibble first) and `scales` [E, R, G] uint8 (a power of two
    per group of 32, biased by 127), for a matrix [E, R, G*32] that is stored transposed: the result
    is [E, G*32, R], the layout of the tensor's bfloat16 form (gate_up_proj [E, D, 2F], down_proj
    [E, F, D]). Every value is exact in bfloat16."""
    import ml_dtypes

    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ConfigError(f"an MXFP4 tensor needs uint8 blocks [..., G, B] and uint8 scales [..., G]; this checkpoint "
                          f"has blocks {list(blocks.shape)} {blocks.dtype} and scales {list(scales.shape)} "
                          f"{scales.dtype}")
    *lead, rows, groups, width = blocks.shape
    out = np.empty((*lead, groups * width * 2, rows), ml_dtypes.bfloat16)
    for i in np.ndindex(*lead):  # one expert at a time: float32 copies of a whole 120b tensor would take 8.5 GB
        values = np.empty((rows, groups, width * 2), np.float32)
        values[..., 0::2] = FP4_E2M1[blocks[i] & 0x0F]
        values[..., 1::2] = FP4_E2M1[blocks[i] >> 4]
        values = np.ldexp(values, scales[i].astype(np.int32)[..., None] - 127)
        out[i] = values.reshape(rows, -1).T
    return out


FLOAT8_TYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # safetensors dtype -> ml_dtypes type


def fp8_block_size(hf_config: dict) -> tuple[int, int]:
    """The rows and columns of weight each float8 block scale covers: config.json's
    quantization_config.weight_block_size (DeepSeek-V3 and Kimi K2: 128 x 128), 128 x 128 without one."""
    quant = hf_config.get("quantization_config") or {}
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if block is None:
        return 128, 128
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config.json's quantization_config.weight_block_size={block!r} is not two positive whole "
                          "numbers (rows and columns of weight per block scale, e.g. [128, 128])")
    return block[0], block[1]


def block_dequantized(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
    """float32 values of a float8 weight [R, C] stored with one scale per block of `block` rows and columns
    (`scale_inv` [ceil(R / rows), ceil(C / columns)], the last blocks cut short): each value times its block's
    scale, in float32, as DeepSeek's own conversion to bfloat16 computes them before rounding."""
    rows, cols = block
    want = (-(-w.shape[0] // rows), -(-w.shape[-1] // cols)) if w.ndim == 2 else None
    if want is None or scale_inv.shape != want:
        raise ConfigError(f"{name}: a float8 weight {list(w.shape)} with block scales {list(scale_inv.shape)}; blocks "
                          f"of {rows} x {cols} (quantization_config.weight_block_size) need a 2-D weight and scales "
                          f"{list(want) if want else '[rows, columns] of blocks'}; is the checkpoint whole?")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), rows, axis=0), cols, axis=1)
    return w.astype(np.float32) * scale[:w.shape[0], :w.shape[1]]


def _header(path: Path) -> tuple[dict, int]:
    """(the safetensors file's JSON header, the offset of its data) read from its first bytes."""
    try:
        with open(path, "rb") as file:
            size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(size))
    except (OSError, ValueError) as e:
        raise _damaged(path, e) from None
    if not isinstance(header, dict):
        raise _damaged(path, ValueError("its header is not a JSON object"))
    return header, 8 + size


def _open(path: Path):
    """safe_open, with a damaged (truncated, overwritten) file as one ConfigError naming it."""
    try:
        return safe_open(path, "np")
    except SafetensorError as e:
        raise _damaged(path, e) from None


def _damaged(path: Path, e: Exception) -> ConfigError:
    return ConfigError(f"{path} is damaged (truncated or not a safetensors file: {e}); download or save it again")
