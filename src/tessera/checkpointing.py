"""Checkpoints through Orbax: periodic (async) saves, resume, parameter-only and full-state loads.

A checkpoint is one folder per step under `checkpoint_dir`, with three items:
`state` (step, params, opt_state: sharded arrays), `data` (the input pipeline's position, JSON)
and `config` (the final flat config, JSON). Orbax writes a step into a temporary folder and
renames it (or, on GCS, writes `commit_success.txt`) only when every file is complete, so a
save cut short by SIGKILL leaves a `*.orbax-checkpoint-tmp*` folder that is never listed as
a step. At start-up `Checkpointer` moves such folders to `<checkpoint_dir>_incomplete/` and
says so in the log: they are never loaded and never deleted. A save that fails (disk full)
raises CheckpointSaveError at that save, or for an async save at the next save, check, wait or
close; its partial folder is set aside the same way and earlier steps stay loadable.

A step whose files are damaged (`state/_METADATA` missing, an array file truncated) is reported
as damaged, naming the earlier step the run resumes from once it is moved away. Orbax's event
loops are made to cancel and await their pending reads and writes before closing, so a failed
read or write is one error, not a page of abandoned-task tracebacks.

Every save also records the size and CRC32C of each file it wrote, and every read compares the
files with that list first (`checkpoint_checksums`; see `tessera.checkpoint_checksums`): a file
changed in place after the save is reported as damaged instead of being trained on.

Before restoring, the checkpoint's own metadata is compared with the state the current config
expects; any difference (missing or extra arrays, shapes, dtypes) is reported by path and
nothing is loaded or overwritten. A path to load from that does not exist, or holds no
checkpoint (e.g. a run folder instead of a step folder), is reported as such, with a step folder
to use when there is one nearby. Paths arrive absolute: the config layer resolves them, and
Orbax refuses relative ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec
from etils import epath

from tessera import checkpoint_checksums as checksums
from tessera.config import CheckpointConfig, ConfigError
from tessera.data.errors import brief

log = logging.getLogger(__name__)

INCOMPLETE_MARKER = ".orbax-checkpoint-tmp"
PYTREE_METADATA_FILE = "_METADATA"  # what Orbax writes in every complete PyTree item (the tree and its arrays)


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the message names the path and what is wrong."""


class _TidyEventLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first cancels the tasks still pending and lets them end.

    Orbax runs each read or write in a fresh loop and closes it as soon as the first array
    fails (a truncated file, a full disk), while the other arrays' tasks are still pending.
    Python then reports every abandoned task at garbage collection ("Task was destroyed",
    "_GatheringFuture exception was never retrieved", "Exception ignored in: <coroutine ...>").
    Cancelling and awaiting them before the close ends them quietly, and the one error that
    caused it reaches us alone."""

    def call_soon_threadsafe(self, callback, *args, context=None):
        """A TensorStore thread may complete a read after Orbax closed this loop (a race seen
        when a damaged checkpoint fails one array while others are still in flight): nobody
        awaits that result any more, so it is dropped instead of printing a traceback."""
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise

    def call_exception_handler(self, context) -> None:
        """When the disk fills up, every array's write fails: Orbax raises the first failure (which
        the trainer reports) and the others end as finished tasks nobody asks for. Python would print
        each at garbage collection ("Task exception was never retrieved") with its traceback; those
        echoes of the reported storage error are dropped. Anything else is reported as usual."""
        exc = context.get("exception")
        if "never retrieved" in str(context.get("message", "")) and _is_storage_error(exc):
            log.debug("dropped a repeated storage error of an abandoned Orbax task: %s", exc)
            return
        super().call_exception_handler(context)

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            pending = [t for t in asyncio.all_tasks(self) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


def _is_storage_error(exc) -> bool:
    """A failed TensorStore read or write (full disk, missing or truncated file)."""
    text = str(exc)
    return isinstance(exc, OSError) or (isinstance(exc, ValueError) and any(
        s in text for s in ("RESOURCE_EXHAUSTED", "Error writing", "Error reading", "No space left")))


class _TidyEventLoopPolicy(asyncio.DefaultEventLoopPolicy):
    _loop_factory = _TidyEventLoop


def _use_tidy_event_loops() -> None:
    """Make new event loops `_TidyEventLoop`s (called before every Orbax read and write)."""
    if not isinstance(asyncio.get_event_loop_policy(), _TidyEventLoopPolicy):
        asyncio.set_event_loop_policy(_TidyEventLoopPolicy())


def read_error(e: Exception, message: str) -> CheckpointError:
    """`message (<the array, when known>: <what TensorStore said>)`, without the page-long spec."""
    arrays = re.findall(r"'path': '([^'/]+)/'", str(e))  # the innermost path of the spec is the array
    cause = e.__cause__ if e.__cause__ is not None and arrays else e
    detail = str(cause).split(" See full TensorStore details")[0]
    detail = " ".join(re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", detail).split())[:400]
    where = f"array {arrays[-1]}: " if arrays else ""
    return CheckpointError(f"{message} ({where}{type(cause).__name__}: {detail})")


def _path_key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _flat(tree) -> dict[str, Any]:
    """{"params/layers/mlp/wi_0": leaf, ...} for arrays, ShapeDtypeStructs or Orbax metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {_path_key(path): leaf for path, leaf in leaves if leaf is not None}


def _restacked(saved, expected):
    """(target, finish) for restoring `saved` into `expected` when they differ only in how the
    decoder's stacked blocks are laid out: [L, ...] (plain or GPipe) against [R, L/R, ...]
    (circular pipelining, `tessera.models.pipeline`), the same layers in the same order. Such
    arrays are read in their saved shape (split as `expected` splits the other axes) and
    `finish` reshapes them into `expected`'s shape and sharding; everything else is unchanged."""
    have, moved = _flat(saved), []

    def adapt(path, want):
        key = _path_key(path)
        h = have.get(key)
        if h is None or not hasattr(want, "sharding") or "layers" not in key.split("/"):
            return want
        hs, ws = tuple(h.shape), tuple(want.shape)
        for a, b in ((1, 2), (2, 1)):  # leading axes [L] saved, [R, L/R] wanted, or the other way round
            if hs != ws and len(hs) - a == len(ws) - b and hs[a:] == ws[b:] and math.prod(hs[:a]) == math.prod(ws[:b]):
                spec = tuple(want.sharding.spec) + (None,) * (len(ws) - len(want.sharding.spec))
                moved.append(f"{key} {hs} -> {ws}")
                return jax.ShapeDtypeStruct(hs, want.dtype, sharding=NamedSharding(
                    want.sharding.mesh, PartitionSpec(*([None] * a), *spec[b:])))
        return want

    target = jax.tree_util.tree_map_with_path(adapt, expected)
    if moved:
        log.info("checkpoint: %d stacked-layer array(s) saved with another pipeline layout are reshaped on restore "
                 "(e.g. %s)", len(moved), moved[0])

    def finish(restored):
        def fit(x, want):
            if not hasattr(want, "sharding") or tuple(x.shape) == tuple(want.shape):
                return x
            return jax.jit(lambda a: a.reshape(want.shape), out_shardings=want.sharding)(x)

        return jax.tree.map(fit, restored, expected)

    return target, finish


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


def raise_on_mismatch(path, saved, expected, only_prefix: str = "") -> None:
    problems = describe_mismatch(saved, expected, only_prefix)
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(
            f"checkpoint {path} does not match this config ({len(problems)} difference(s)):\n  {shown}\n"
            "Use the model settings the checkpoint was trained with (its config is saved beside it), "
            "or start a new run_name. Nothing was loaded or overwritten."
        )


class CheckpointSaveError(Exception):
    """Saving a checkpoint failed (a full disk, lost permissions): the run must stop (EXIT_SAVE_FAILED)."""


class Checkpointer:
    """Saves and restores the train state of one run under `directory`, which is created by the
    first save (a run that fails before it leaves no empty checkpoint folder behind).

    A save that fails, in the foreground or in the background (its error surfaces at the next
    `save`, `check`, `wait` or `close`), raises CheckpointSaveError naming the step, the folder
    and its free space; its partial folder is set aside like an interrupted save's."""

    def __init__(self, cfg: CheckpointConfig, directory: str):
        self.cfg, self.directory = cfg, epath.Path(directory)
        self.incomplete = set_aside_incomplete(self.directory)
        _quiet_orbax_error_logs()
        self._saving: int | None = None  # the step whose (async) save was started last
        self._failed = False  # a save failed (its partial folder is set aside again at close)
        self._checksums = cfg.checkpoint_checksums and checksums.is_local(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if cfg.max_num_checkpoints_to_keep < 1 else cfg.max_num_checkpoints_to_keep,
            enable_async_checkpointing=cfg.async_checkpointing,
            cleanup_tmp_directories=False,
            create=False,
            # an async save's checksums: recorded on Orbax's thread once the items are complete and
            # before the step folder is committed (a committed step always has them)
            async_options=ocp.AsyncOptions(post_finalization_callback=self._record_checksums)
            if self._checksums and cfg.async_checkpointing else None,
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
        _use_tidy_event_loops()
        with self._failing_save(self._saving):  # the previous save's error surfaces here, before this one starts
            self.manager.wait_until_finished()
        self._saving = step
        with self._failing_save(step):
            self.manager.save(step, args=args, force=True)
            if not self.cfg.async_checkpointing:
                self._record_checksums()

    def _record_checksums(self) -> None:
        """Record the checksums of the step being saved (process 0; on Orbax's thread when async),
        in its folder: the temporary one while Orbax finalizes, the step's own after a sync save."""
        if not self._checksums or jax.process_index() != 0 or self._saving is None:
            return
        pending = [p for p in self.directory.iterdir() if p.name.startswith(f"{self._saving}{INCOMPLETE_MARKER}")]
        checksums.record(pending[0] if len(pending) == 1 else self.step_path(self._saving), items_only=True)

    def check(self) -> None:
        """Raise CheckpointSaveError if a background save has already failed (never waits)."""
        with self._failing_save(self._saving):
            self.manager.check_for_errors()
            if self._finalize_failed():  # its thread has ended: joining it returns at once and raises
                self.manager.wait_until_finished()

    def _finalize_failed(self) -> bool:
        """True when the manager's background finalize thread has ended with an error. Orbax keeps that
        error on the thread and raises it only from wait_until_finished: check_for_errors looks at the
        async checkpointer, whose error the finalize thread has already taken (orbax 0.12)."""
        ref = getattr(self.manager, "_finalize_thread", None)
        thread = ref.map(lambda t: t) if ref is not None else None
        return thread is not None and not thread.is_alive() and getattr(thread, "exception", None) is not None

    def wait(self) -> None:
        with self._failing_save(self._saving):
            self.manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.manager.close()
            if self._failed:  # a writer thread of the failed save may have re-created its folder after it was
                set_aside_incomplete(self.directory)  # set aside; closing the manager has joined them all

    @contextlib.contextmanager
    def _failing_save(self, step: int | None):
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failed write loses the step: report it as one error
            self._saving, self._failed = None, True
            raise self._save_error(step, e) from None

    def _save_error(self, step: int | None, e: Exception) -> CheckpointSaveError:
        moved = set_aside_incomplete(self.directory)
        last = self.manager.reload() or self.latest_step()
        code = re.search(r"os_error_code='(\d+)'", str(e))
        detail = " ".join(str(e).split())
        detail = os.strerror(int(code[1])) if code else f"{type(e).__name__}: {detail[:300]}"
        return CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory} failed: {detail} (free space there: "
            f"{_free_space(self.directory)}). "
            + (f"The partial save was moved to {moved[0]}. " if moved else "")
            + (f"The last complete checkpoint is step {last} ({self.step_path(last)}); " if last is not None
               else "No complete checkpoint was saved; ")
            + "free some space (or fix the folder's permissions) and run the same command again to resume")

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """(state, data_state) of `step`, placed with the shardings in `abstract_state`."""
        path = self.step_path(step)
        _use_tidy_event_loops()
        self.check_complete(step)
        if self.cfg.checkpoint_checksums:
            self.verify(step)
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any unreadable metadata means an unusable checkpoint
            raise read_error(e, str(self._damaged(step, "cannot be read"))) from None
        target, finish = _restacked(getattr(saved, "tree", saved), abstract_state)
        raise_on_mismatch(path, getattr(saved, "tree", saved), target)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise read_error(e, str(self._damaged(step, "could not be restored: files may be missing or corrupt"))
                             ) from None
        return finish(restored["state"]), dict(restored["data"] or {})

    def check_complete(self, step: int) -> None:
        """CheckpointError unless step's folder holds a saved state (an empty or half-copied folder
        named like a step is not a checkpoint, even though Orbax lists it as one)."""
        if not (self.step_path(step) / "state" / PYTREE_METADATA_FILE).exists():
            raise self._damaged(step, f"is damaged: its file state/{PYTREE_METADATA_FILE} is missing")

    def verify(self, step: int) -> None:
        """CheckpointError when a file of `step` differs from the checksums recorded at its save
        (collective in a multi-process job)."""
        path = self.step_path(step)
        if not checksums.is_local(path):
            return
        if not (path / checksums.MANIFEST).exists():
            checksums.unverified(path)
            return
        why = checksums.problem(path)
        if why:
            raise self._damaged(step, f"is damaged: {why}")

    def _damaged(self, step: int, what: str) -> CheckpointError:
        """'checkpoint <path> <what>. Move it away ... to resume from step <earlier>' (or to start afresh)."""
        path = self.step_path(step)
        earlier = [s for s in self.manager.all_steps() if s < step]
        then = f"to resume from step {max(earlier)}" if earlier else "to start this run from step 0"
        return CheckpointError(f"checkpoint {path} {what}. Move it away (e.g. mv {path} {path}.damaged) {then}")


def _free_space(directory: epath.Path) -> str:
    """'1.2 GiB of 50.0 GiB' for the nearest existing folder at or above `directory`."""
    path = directory
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(str(path))
    except (OSError, TypeError, ValueError):  # a bucket has no disk usage
        return "unknown"
    return f"{_size(usage.free)} of {_size(usage.total)}"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class _OrbaxErrorLogs(logging.Filter):
    """Drops Orbax's own ERROR log records (each with a traceback) about a failed save or read:
    every such failure also reaches Checkpointer as an exception and is reported once, by us."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


def _quiet_orbax_error_logs() -> None:
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxErrorLogs) for f in absl_logger.filters):
        absl_logger.addFilter(_OrbaxErrorLogs())


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


# loggers of the bucket clients, which log each failed retry with its traceback before raising
_STORAGE_LOGGERS = ("gcsfs", "fsspec", "google", "google.auth", "urllib3", "aiohttp")


def remote_exists(path: str, key: str, error=ConfigError, subject: str | None = None) -> bool:
    """Whether a bucket URL exists, or `error` (one line naming `key=path`, or `subject`) when the bucket
    cannot be reached: no network, no credentials, no permission. The clients' own retry logs are held back."""
    loggers = [logging.getLogger(name) for name in _STORAGE_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        return epath.Path(path).exists()
    except Exception as e:  # noqa: BLE001 - DNS, auth and permission errors come in many types
        raise error(f"{subject or f'{key}={path}'} cannot be reached ({brief(e)}); check the network, the bucket "
                    "name and the credentials (gcloud auth application-default login)") from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _state_item(path: str, key: str | None = None) -> epath.Path:
    """The `state` item of a step folder, or `path` itself when it is an item (a converted
    checkpoint). CheckpointError naming `key=path` when nothing loadable is there."""
    p = epath.Path(path)
    label = _label(key, p)
    if "://" in path:
        remote_exists(path, key or "checkpoint", CheckpointError)
    if not p.exists():
        raise CheckpointError(f"{label} does not exist; {_step_folder_hint(p)}")
    if INCOMPLETE_MARKER in p.name:
        raise CheckpointError(f"{label} is an incomplete (interrupted) save; use a complete step folder")
    item = p / "state" if (p / "state").exists() else p
    if item != p and not (item / PYTREE_METADATA_FILE).exists():
        raise CheckpointError(f"{label} is damaged: its file state/{PYTREE_METADATA_FILE} is missing; "
                              f"{_step_folder_hint(p)}")
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


def saved_tree(path: str, key: str | None = None, verify: bool = True) -> tuple[epath.Path, Any]:
    """(the item folder, the metadata tree of the arrays saved in it) for a step folder or a
    {"params": ...} checkpoint; CheckpointError naming `key=path` when there is nothing to read, or
    (`verify`) when its files differ from the checksums recorded at its save."""
    item = _state_item(path, key)
    if verify:
        verify_item(item, key, epath.Path(path))
    _use_tidy_event_loops()
    try:  # the handler, not a Checkpointer: that would look for (and warn about) step metadata an item lacks
        saved = ocp.PyTreeCheckpointHandler().metadata(item)
    except Exception as e:  # noqa: BLE001
        raise read_error(e, f"{_label(key, item)} is not a readable Orbax checkpoint") from None
    return item, getattr(saved, "tree", saved)


def verify_item(item: epath.Path, key: str | None, path: epath.Path) -> None:
    """CheckpointError naming `key=path` when a file of checkpoint item `item` differs from the
    checksums recorded at its save (collective in a multi-process job); a log line when none were."""
    found = checksums.find(item)
    if found is None:
        checksums.unverified(item)
        return
    why = checksums.problem(*found)
    if why:
        hint = _step_folder_hint(path) if item.name == "state" else "copy or write it again from its source"
        raise CheckpointError(f"{_label(key, path)} is damaged: {why}. Nothing was loaded; {hint}")


def record_checksums(folder) -> None:
    """After a single-item checkpoint (converted or quantized parameters) is written to `folder`:
    record its files' checksums, which every later load verifies."""
    if jax.process_index() == 0:
        checksums.record(folder, items_only=False)


def _restore_tree(path: str, key: str | None, target, partial: bool, verify: bool = True):
    item, tree = saved_tree(path, key, verify)
    label = _label(key, item)
    if partial and "params" not in tree:
        raise CheckpointError(f"{label} holds no parameters (its tree has {', '.join(map(str, tree))}); "
                              "point it at a training step folder or a converted checkpoint")
    target, finish = _restacked(tree, target)
    raise_on_mismatch(item, tree, target, only_prefix="params/" if partial else "")
    restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), target)
    try:
        return finish(ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
            item=target, restore_args=restore_args, partial_restore=partial)))
    except Exception as e:  # noqa: BLE001
        raise read_error(e, f"{label} could not be restored: files may be missing or corrupt") from None


def load_parameters(path: str, abstract_params, key: str | None = "load_parameters_path", verify: bool = True) -> Any:
    """Parameters only, from a Tessera checkpoint step or a checkpoint holding {"params": ...}.
    `key` names the path in errors (None: "checkpoint <path>"). `verify`: check the files against
    their recorded checksums first (the whole state item: Orbax mixes arrays within files)."""
    return _restore_tree(path, key, {"params": abstract_params}, partial=True, verify=verify)["params"]


def load_full_state(path: str, abstract_state, key: str | None = "load_full_state_path", verify: bool = True) -> Any:
    """Parameters, optimizer state and step from a Tessera checkpoint step folder."""
    return _restore_tree(path, key, abstract_state, partial=False, verify=verify)


def check_writable(path: str, key: str, folder_name: str | None = None) -> None:
    """ConfigError naming `key=path` unless a file can be created in folder `path`; for a folder derived
    from `key` (`folder_name`, e.g. "the checkpoint folder") the error names that folder, then the key. The probe
    (and every folder it had to create) is removed again, so nothing is left behind either way.
    A bucket URL is only checked to be reachable (`remote_exists`): its write permission shows at
    the first save. In a multi-process
    job only process 0 probes: processes creating and removing the same folders at once would
    trip over each other (the others write into the same folders at the first save)."""
    if jax.process_index() != 0:
        return
    subject = f"{folder_name} {path} (from {key})" if folder_name else f"{key}={path}"
    if "://" in path:
        remote_exists(path, key, subject=subject)  # reachable; write permission shows at the first save
        return
    folder, created = epath.Path(path), []
    probe = folder / f".tessera-write-probe-{os.getpid()}"
    try:
        for p in reversed([p for p in (folder, *folder.parents) if not p.exists()]):
            try:
                p.mkdir()
            except FileExistsError:  # made meanwhile by someone else: theirs to keep
                continue
            created.append(p)
        probe.write_text("")
    except OSError as e:
        blocker = next((p for p in folder.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker else f"{e.strerror or e}"
        raise ConfigError(f"{subject} cannot be written: {why}; choose another {key} or fix the folder's "
                          f"permissions (free space there: {_free_space(folder)})") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
            for p in reversed(created):
                p.rmdir()
