"""The file-level pieces of checkpoint conversion (see `tessera.tools.convert`) on Tessera's side: filling
memory-mapped scratch arrays, restoring Tessera parameters one at a time and writing safetensors shards (the
`config.json` written beside them is `tessera.tools.hf_config_out`'s; reading a Hugging Face checkpoint is
`tessera.tools.hf_reader`'s)."""

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
from safetensors import SafetensorError
from safetensors.numpy import save_file

from tessera.checkpointing.storage import SOURCE_CONFIG
from tessera.config import Config, ConfigError
from tessera.tools.hf_layouts import Layout, Rule

log = logging.getLogger("tessera")


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
