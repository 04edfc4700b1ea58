"""The file-level pieces of checkpoint conversion (see `tessera.tools.convert`): reading
Hugging Face safetensors one tensor at a time, filling memory-mapped scratch arrays, restoring
Tessera parameters one at a time and writing safetensors shards (the `config.json` written beside
them is `tessera.tools.hf_config_out`'s)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from tessera.checkpointing.storage import SOURCE_CONFIG
from tessera.config import Config, ConfigError
from tessera.tools.hf_configs import HF_MULTIMODAL
from tessera.tools.hf_layouts import Layout, Rule

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


def param_targets(cfg: Config) -> dict[str, jax.ShapeDtypeStruct]:
    """Our parameter path ("layers/attention/wq_dnh") -> its shape and dtype, for `cfg`."""
    from tessera.models import build_model

    shapes = build_model(cfg.model).param_shapes()
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return {"/".join(str(k.key) for k in path): leaf for path, leaf in flat}


def expand(layout: Layout, num_layers: int, scanned: bool) -> list[tuple[Rule, str, int | None, Any]]:
    """(rule, our path prefix, stacked index, hf-name formatter) jobs, rule by rule over layers."""
    jobs: list[tuple[Rule, str, int | None, Any]] = [(r, "", None, lambda n: n) for r in layout.model_rules]
    for i in range(num_layers):
        for rule in layout.rules_for(i):
            prefix, index = layout.layer_prefix(i, scanned)
            jobs.append((rule, prefix, index, lambda n, i=i: layout.hf_layer.format(i=i) + n))
    for k, rules in enumerate(layout.mtp_rules):  # multi-token-prediction depths: the layers after those
        jobs += [(rule, "", None, lambda n, i=num_layers + k: layout.hf_layer.format(i=i) + n) for rule in rules]
    return jobs


def _nest(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


class ScratchArrays:
    """Our parameters as memory-mapped files, filled tensor by tensor (RAM stays bounded)."""

    def __init__(self, scratch: Path, targets: dict[str, jax.ShapeDtypeStruct]):
        self.scratch, self.targets = scratch, targets
        self.arrays: dict[str, np.memmap] = {}
        self.filled: dict[str, int] = {}

    def put(self, path: str, index: int | None, value: np.ndarray) -> None:
        target = self.targets.get(path)
        if target is None:
            raise ConfigError(f"converted tensor {path} has no parameter in this model; is model_name right?")
        shape = target.shape if index is None else target.shape[1:]
        if tuple(value.shape) != tuple(shape):
            raise ConfigError(f"{path}: the checkpoint gives shape {tuple(value.shape)}, the model needs {tuple(shape)}")
        if path not in self.arrays:
            self.scratch.mkdir(parents=True, exist_ok=True)
            file = _allocated(self.scratch / f"{len(self.arrays)}.bin", np.dtype(target.dtype).itemsize *
                              int(np.prod(target.shape)))
            self.arrays[path] = np.memmap(file, dtype=np.dtype(target.dtype), mode="r+", shape=target.shape)
        dest = self.arrays[path]
        if index is None:
            dest[...] = value.astype(dest.dtype)
        else:
            dest[index] = value.astype(dest.dtype)
        self.filled[path] = self.filled.get(path, 0) + (1 if index is not None else target.shape[0] if target.shape else 1)

    def check_complete(self) -> None:
        missing = [p for p, t in self.targets.items() if self.filled.get(p, 0) < (t.shape[0] if t.shape else 1)]
        if missing:
            raise ConfigError(f"the checkpoint left {len(missing)} parameters unset: {', '.join(missing[:8])}")

    def tree(self) -> dict:
        return _nest(self.arrays)

    def close(self) -> None:
        for a in self.arrays.values():
            a.flush()
        self.arrays.clear()


def _allocated(path: Path, nbytes: int) -> Path:
    """A new file of `nbytes` whose disk blocks are reserved now: a full disk is an OSError here. A sparse
    file (what np.memmap's w+ makes) took no space until its pages were written, and a page written
    through the map on a full disk killed the process with SIGBUS (exit 135, no message, scratch left)."""
    with open(path, "wb") as f:
        if hasattr(os, "posix_fallocate") and nbytes:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        else:  # macOS has no posix_fallocate
            f.truncate(nbytes)
    return path




def save_params(out_dir: Path, params: dict, source_config: dict | None = None) -> None:
    """An Orbax checkpoint holding {"params": ...}: what load_parameters_path accepts; with
    `source_config`, the Hugging Face config.json they come from beside it (SOURCE_CONFIG).

    Orbax copies the arrays while it writes them. Without OCDBT (one folder per array) that is
    about one model's worth of RAM at peak; with OCDBT it measured 1.6 models' worth."""
    from tessera.checkpointing.storage import use_tidy_event_loops

    use_tidy_event_loops()  # a failed write (a full disk) is one error, not a traceback per abandoned array task
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    absl_logger, quiet = logging.getLogger("absl"), _NoOcdbtMergeWarning()
    absl_logger.addFilter(quiet)
    try:
        ocp.Checkpointer(handler).save(out_dir.absolute(), args=ocp.args.PyTreeSave({"params": params}))
    except ValueError as e:  # TensorStore's failed write (a full disk) names its OSError's code: that error, one line
        code = re.search(r"os_error_code='(\d+)'", str(e))
        if not code:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1]))) from None
    finally:
        absl_logger.removeFilter(quiet)
    if source_config is not None:
        (out_dir / SOURCE_CONFIG).write_text(json.dumps(source_config, indent=2) + "\n")
    from tessera.checkpointing import record_checksums

    record_checksums(out_dir.absolute())  # every load verifies the files against them


class _NoOcdbtMergeWarning(logging.Filter):
    """Drops Orbax's "Skipping merge of OCDBT checkpoints" warning: save_params writes without
    OCDBT on purpose, so there is nothing to merge."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in str(record.msg)


def _circular_stacks(saved, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.ShapeDtypeStruct]:
    """{path: the saved shape} of the stacked blocks a circular pipeline saved [R, L/R, ...]
    (`tessera.models.pipeline`) where `targets` has them [L, ...]."""
    out, params = {}, saved.get("params", {}) if isinstance(saved, dict) else {}
    for path, want in targets.items():
        node = params
        for key in path.split("/"):
            node = node.get(key) if isinstance(node, dict) else None
        shape = tuple(getattr(node, "shape", ()) or ())
        if path.split("/")[0] == "layers" and len(shape) == len(want.shape) + 1 and shape[2:] == want.shape[1:] \
                and shape[0] * shape[1] == want.shape[0]:
            out[path] = jax.ShapeDtypeStruct(shape, want.dtype)
    return out


class ParamSource:
    """Parameters of a Tessera checkpoint, restored one at a time (the last few are kept)."""

    def __init__(self, checkpoint: str, targets: dict[str, jax.ShapeDtypeStruct], keep: int = 4):
        from tessera.checkpointing import raise_on_mismatch, saved_tree
        from tessera.checkpointing.trees import cast_summary

        # saved_tree reads the item's own metadata: no "Metadata file does not exist" warning
        self.path, saved = saved_tree(checkpoint, key=None)
        self.targets, self.keep = targets, keep
        self.checkpointer = ocp.PyTreeCheckpointer()
        # a circular pipeline's run saves its stacked blocks [R, L/R, ...]: read so, flattened to [L, ...] in `get`
        self.restacked = _circular_stacks(saved, targets)
        expected = {"params": _nest({**targets, **self.restacked})}
        # another floating weight_dtype is written as that dtype (float32 weights exported as bfloat16)
        raise_on_mismatch(self.path, saved, expected, only_prefix="params/", cast_floats=True)
        if casts := cast_summary({"params": saved["params"]}, expected):
            log.info("checkpoint %s: parameters are written in weight_dtype (%s)", self.path, casts)
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def get(self, path: str, index: int | None) -> np.ndarray:
        if path not in self.cache:
            item = {"params": _nest({path: self.targets[path]})}
            args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
            try:
                restored = self.checkpointer.restore(self.path, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=args, partial_restore=True))
            except Exception as e:  # noqa: BLE001 - a truncated or missing array file: the trainer's one line
                from tessera.checkpointing import read_error

                raise read_error(e, f"checkpoint {self.path} could not be restored: files may be missing or "
                                     "corrupt") from None
            value = restored["params"]
            for key in path.split("/"):
                value = value[key]
            value = np.asarray(value)
            if path in self.restacked:  # [R, L/R, ...] -> [L, ...]: the blocks in the model's order
                value = value.reshape(self.targets[path].shape)
            self.cache[path] = value.astype(self.targets[path].dtype, copy=False)
            while len(self.cache) > self.keep:
                self.cache.popitem(last=False)
        value = self.cache[path]
        return value if index is None else value[index]


class ShardWriter:
    """safetensors shards of at most `max_bytes` each, named and indexed as Hugging Face does."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.current: dict[str, np.ndarray] = {}
        self.size, self.shards, self.weight_map, self.total = 0, [], {}, 0

    def add(self, name: str, value: np.ndarray) -> None:
        if self.current and self.size + value.nbytes > self.max_bytes:
            self._flush()
        self.current[name] = np.ascontiguousarray(value)
        self.size += value.nbytes
        self.total += value.nbytes

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self.shards)}.safetensors"
        try:
            save_file(self.current, path, metadata={"format": "pt"})
        except SafetensorError as e:  # a full disk: the OSError it names (os error 28), reported in one line
            code = re.search(r"os error (\d+)", str(e))
            if not code:
                raise
            raise OSError(int(code[1]), os.strerror(int(code[1]))) from None
        os.chmod(path, 0o666 & ~_umask())  # safetensors writes 0600: readable as config.json is, by the umask
        self.shards.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> None:
        if self.current:
            self._flush()
        n = len(self.shards)
        for k, (path, names) in enumerate(self.shards):
            final = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out_dir / final)
            self.weight_map.update({name: final for name in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _umask() -> int:
    """The process's umask (reading it means setting it: set back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
