"""Checkpoints through Orbax: periodic (async) saves, resume, parameter-only and full-state loads.

A checkpoint is one folder per step under `checkpoint_dir`, with three items:
`state` (step, params, opt_state: sharded arrays), `data` (the input pipeline's position, JSON)
and `config` (the final flat config, JSON). Orbax writes a step into a temporary folder and
renames it (or, on GCS, writes `commit_success.txt`) only when every file is complete, so a
save cut short by SIGKILL leaves a `*.orbax-checkpoint-tmp*` folder that is never listed as
a step. At start-up `Checkpointer` moves such folders to `<checkpoint_dir>_incomplete/` and
says so in the log: they are never loaded and never deleted.

Before restoring, the checkpoint's own metadata is compared with the state the current config
expects; any difference (missing or extra arrays, shapes, dtypes) is reported by path and
nothing is loaded or overwritten. A path to load from that does not exist, or holds no
checkpoint (e.g. a run folder instead of a step folder), is reported as such, with a step folder
to use when there is one nearby. Paths arrive absolute: the config layer resolves them, and
Orbax refuses relative ones.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from tessera.config import CheckpointConfig

log = logging.getLogger(__name__)

INCOMPLETE_MARKER = ".orbax-checkpoint-tmp"
PYTREE_METADATA_FILE = "_METADATA"  # what Orbax writes in every complete PyTree item (the tree and its arrays)


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the message names the path and what is wrong."""


def _drop_abandoned_read_echoes() -> None:
    """Keep a failed read to one clear message (called before every Orbax read).

    When one array of a checkpoint cannot be read, Orbax stops waiting and closes its event
    loop while TensorStore still finishes the other reads; their completion callbacks then
    fail with "Event loop is closed" and Python prints each as a traceback. Those are echoes
    of the error we report, not new ones, so they are dropped; every other unraisable
    exception still reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "tessera_drops_abandoned_reads", False):
        return

    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    hook.tessera_drops_abandoned_reads = True
    sys.unraisablehook = hook


def _read_error(e: Exception, message: str) -> CheckpointError:
    detail = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", str(e))  # the spec is a page of JSON
    return CheckpointError(f"{message} ({type(e).__name__}: {detail})")


def _flat(tree) -> dict[str, Any]:
    """{"params/layers/mlp/wi_0": leaf, ...} for arrays, ShapeDtypeStructs or Orbax metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    out = {}
    for path, leaf in leaves:
        if leaf is None:
            continue
        parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out["/".join(parts)] = leaf
    return out


def describe_mismatch(saved, expected, only_prefix: str = "") -> list[str]:
    """Human-readable differences between saved metadata and the expected abstract tree."""
    have, want = _flat(saved), _flat(expected)
    have = {k: v for k, v in have.items() if k.startswith(only_prefix)}
    problems = [f"missing in checkpoint: {k} {tuple(want[k].shape)}" for k in sorted(set(want) - set(have))]
    problems += [f"not expected by this config: {k} {tuple(have[k].shape)}" for k in sorted(set(have) - set(want))]
    for k in sorted(set(have) & set(want)):
        h, w = have[k], want[k]
        if tuple(h.shape) != tuple(w.shape):
            problems.append(f"{k}: checkpoint has shape {tuple(h.shape)}, this config expects {tuple(w.shape)}")
        elif h.dtype is not None and jax.numpy.dtype(h.dtype) != jax.numpy.dtype(w.dtype):
            problems.append(f"{k}: checkpoint has dtype {h.dtype}, this config expects {w.dtype}")
    return problems


def _raise_on_mismatch(path, saved, expected, only_prefix: str = "") -> None:
    problems = describe_mismatch(saved, expected, only_prefix)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(
            f"checkpoint {path} does not match this config ({len(problems)} difference(s)):\n  {shown}\n"
            "Use the model settings the checkpoint was trained with (its config is saved beside it), "
            "or start a new run_name. Nothing was loaded or overwritten."
        )


def checkpoint_directory(cfg: CheckpointConfig, base_output_directory: str, run_name: str) -> str:
    """`checkpoint_dir`, or base_output_directory/run_name/checkpoints; `gs://` paths stay URLs."""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir
    return f"{base_output_directory.rstrip('/')}/{run_name}/checkpoints"


class Checkpointer:
    """Saves and restores the train state of one run under `directory`, which is created by the
    first save (a run that fails before it leaves no empty checkpoint folder behind)."""

    def __init__(self, cfg: CheckpointConfig, directory: str):
        self.cfg, self.directory = cfg, epath.Path(directory)
        self.incomplete = set_aside_incomplete(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if cfg.max_num_checkpoints_to_keep < 1 else cfg.max_num_checkpoints_to_keep,
            enable_async_checkpointing=cfg.async_checkpointing,
            cleanup_tmp_directories=False,
            create=False,
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                    "config": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        """Start saving `step` (returns once arrays are copied to host when async)."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config))
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """(state, data_state) of `step`, placed with the shardings in `abstract_state`."""
        path = self.step_path(step)
        _drop_abandoned_read_echoes()
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any unreadable metadata means an unusable checkpoint
            raise _read_error(e, f"checkpoint {path} cannot be read; move it away to resume from an "
                                           "earlier step") from None
        _raise_on_mismatch(path, getattr(saved, "tree", saved), abstract_state)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise _read_error(e, f"checkpoint {path} could not be restored: files may be missing or "
                                           "corrupt. Move it away to resume from an earlier step") from None
        return restored["state"], dict(restored["data"] or {})

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def set_aside_incomplete(directory: epath.Path) -> list[epath.Path]:
    """Move interrupted saves out of `directory` (a new save of the same step would replace them)
    into `<directory>_incomplete/`, log each move, and return the new paths."""
    if not directory.exists():
        return []
    moved = []
    for path in sorted(p for p in directory.iterdir() if INCOMPLETE_MARKER in p.name):
        target_dir = directory.parent / f"{directory.name}_incomplete"
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}"
        path.rename(target)
        log.warning("incomplete checkpoint %s (an interrupted save) was not loaded; moved to %s. "
                    "Delete it once you no longer need it", path, target)
        moved.append(target)
    return moved


def _state_item(path: str, key: str | None = None) -> epath.Path:
    """The `state` item of a step folder, or `path` itself when it is an item (a converted
    checkpoint). CheckpointError naming `key=path` when nothing loadable is there."""
    p = epath.Path(path)
    label = _label(key, p)
    if not p.exists():
        raise CheckpointError(f"{label} does not exist; {_step_folder_hint(p)}")
    if INCOMPLETE_MARKER in p.name:
        raise CheckpointError(f"{label} is an incomplete (interrupted) save; use a complete step folder")
    item = p / "state" if (p / "state").exists() else p
    if not (item / PYTREE_METADATA_FILE).exists():
        raise CheckpointError(f"{label} holds no checkpoint (no state item, no Orbax metadata); "
                              f"{_step_folder_hint(p)}")
    return item


def _label(key: str | None, path: epath.Path) -> str:
    """How errors name a path: `load_parameters_path=/abs/path`, or `checkpoint /abs/path` without a key."""
    return f"{key}={path}" if key else f"checkpoint {path}"


def _step_folder_hint(p: epath.Path) -> str:
    """'point it at a step folder such as ...', naming a real step folder near `p` when there is one."""
    for folder in (p, p / "checkpoints", p.parent):
        if not folder.is_dir():
            continue
        steps = sorted(int(c.name) for c in folder.iterdir() if c.name.isdigit() and c != p)
        if steps:
            return f"point it at a step folder such as {folder / str(steps[-1])}"
    return "point it at a step folder such as outputs/<run_name>/checkpoints/<step>"


def saved_tree(path: str, key: str | None = None) -> tuple[epath.Path, Any]:
    """(the item folder, the metadata tree of the arrays saved in it) for a step folder or a
    {"params": ...} checkpoint; CheckpointError naming `key=path` when there is nothing to read."""
    item = _state_item(path, key)
    _drop_abandoned_read_echoes()
    try:  # the handler, not a Checkpointer: that would look for (and warn about) step metadata an item lacks
        saved = ocp.PyTreeCheckpointHandler().metadata(item)
    except Exception as e:  # noqa: BLE001
        raise _read_error(e, f"{_label(key, item)} is not a readable Orbax checkpoint") from None
    return item, getattr(saved, "tree", saved)


def _restore_tree(path: str, key: str | None, target, partial: bool):
    item, tree = saved_tree(path, key)
    label = _label(key, item)
    if partial and "params" not in tree:
        raise CheckpointError(f"{label} holds no parameters (its tree has {', '.join(map(str, tree))}); "
                              "point it at a training step folder or a converted checkpoint")
    _raise_on_mismatch(item, tree, target, only_prefix="params/" if partial else "")
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), target)
    try:
        return ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=partial))
    except Exception as e:  # noqa: BLE001
        raise _read_error(e, f"{label} could not be restored: files may be missing or corrupt") from None


def load_parameters(path: str, abstract_params, key: str | None = "load_parameters_path") -> Any:
    """Parameters only, from a Tessera checkpoint step or a checkpoint holding {"params": ...}.
    `key` names the path in errors (None: "checkpoint <path>")."""
    return _restore_tree(path, key, {"params": abstract_params}, partial=True)["params"]


def load_full_state(path: str, abstract_state, key: str | None = "load_full_state_path") -> Any:
    """Parameters, optimizer state and step from a Tessera checkpoint step folder."""
    return _restore_tree(path, key, abstract_state, partial=False)
