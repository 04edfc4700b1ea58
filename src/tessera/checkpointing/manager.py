"""`Checkpointer`: one run's periodic (async) saves, resume, and the handling of failed or
interrupted saves."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from tessera.checkpointing import checksums
from tessera.checkpointing.storage import (CONFIG_FILE, INCOMPLETE_MARKER, PYTREE_METADATA_FILE, CheckpointError,
                                           free_space, quiet_orbax_logs, read_error, skip_tensorstore_byte_counts,
                                           use_tidy_event_loops)
from tessera.checkpointing.trees import raise_on_mismatch, restacked
from tessera.config import CheckpointConfig

log = logging.getLogger(__name__)


# A save that blocks the training loop gets this long from the hang watchdog, beyond
# step_timeout_seconds: its bytes at this rate. Healthy saves write to disks and buckets at 100 MB/s
# and more per process; one slower than this is taken for stuck.
SLOWEST_SAVE_BYTES_PER_SECOND = 20 * 10**6


def save_allowance_seconds(nbytes: int) -> float:
    """What the hang watchdog allows a blocking save of `nbytes` (this process's share) beyond
    step_timeout_seconds: a synchronous save, or a save waiting for the previous one to finish."""
    return nbytes / SLOWEST_SAVE_BYTES_PER_SECOND


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
        refuse_files_named_as_steps(self.directory)
        quiet_orbax_logs()
        skip_tensorstore_byte_counts()
        self._saving: int | None = None  # the step whose (async) save was started last
        self._writing_since: float | None = None  # when that async save started, until its end is logged
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
        handlers = {"state": _state_handler(self._checksums), "data": ocp.JsonCheckpointHandler(),
                    "config": ocp.JsonCheckpointHandler(CONFIG_FILE)}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._steps = set(self.manager.all_steps())  # the saved steps last seen (for the removal log line)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        """Start saving `step` (returns once arrays are copied to host when async)."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config))
        use_tidy_event_loops()
        start = time.monotonic()
        with self._failing_save(self._saving):  # the previous save's error surfaces here, before this one starts
            self.manager.wait_until_finished()
        self._log_written()
        waited = time.monotonic() - start  # for the previous save (its bytes were still being written)
        self._saving = step
        with self._failing_save(step):
            self.manager.save(step, args=args, force=True)
            if not self.cfg.async_checkpointing:
                try:
                    self._record_checksums()
                except OSError:  # committed without its list (a full disk): set aside like a save cut short
                    self.step_path(step).rename(self.directory / f"{step}{INCOMPLETE_MARKER}")
                    raise
        size = _mib(copied_bytes(state))
        if self.cfg.async_checkpointing:
            self._writing_since = start + waited
            previous = f"{waited:.2f} s for the previous save to finish, then " if waited >= 0.01 else ""
            log.info("checkpoint %d: the loop waited %.2f s (%s%s on this process's devices copied to host); "
                     "writing %s in the background", step, time.monotonic() - start, previous, size,
                     self.step_path(step))
        else:
            log.info("checkpoint %d saved in %.2f s (%s on this process's devices): %s", step,
                     time.monotonic() - start, size, self.step_path(step))
            self._log_removed()

    def _log_written(self) -> None:
        """Log the end of the background save started last, once (it is known to have finished)."""
        if self._writing_since is not None and self._saving is not None:
            log.info("checkpoint %d written in %.2f s: %s", self._saving, time.monotonic() - self._writing_since,
                     self.step_path(self._saving))
        self._writing_since = None
        self._log_removed()

    def _log_removed(self) -> None:
        """Name the checkpoints max_num_checkpoints_to_keep had Orbax delete since the last look (a resume
        with a lower value removed older ones without a word)."""
        now = set(self.manager.all_steps())
        removed = sorted(self._steps - now)
        if removed:
            log.info("checkpoint(s) %s removed: max_num_checkpoints_to_keep=%d keeps the newest",
                     ", ".join(map(str, removed)), self.cfg.max_num_checkpoints_to_keep)
        self._steps = now

    def _record_checksums(self) -> None:
        """Record the checksums of the step being saved (process 0; on Orbax's thread when async),
        in its folder: the temporary one while Orbax finalizes, the step's own after a sync save.
        The processes' own lists of the array files they wrote (`_state_handler`) are merged in."""
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
        if self._writing_since is not None and not self.manager.is_saving_in_progress():
            self._log_written()

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
        self._log_written()

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
            self._saving, self._failed, self._writing_since = None, True, None
            if isinstance(e, jax.errors.JaxRuntimeError) and jax.process_count() > 1:
                # a collective of the save whose peer is gone (killed, lost its network): the loop ends this process
                # as for a failed step (exit 5). Reported as a save error it said "free some space" (exit 6), and the
                # partial save, moved aside under Orbax's writer threads, made their errors a traceback (exit 1)
                e.tessera_save_step = step  # the loop's line names the save, not "step N failed"
                raise
            raise self._save_error(step, e) from None

    def _save_error(self, step: int | None, e: Exception) -> CheckpointSaveError:
        moved = set_aside_incomplete(self.directory)
        last = self.manager.reload() or self.latest_step()
        code = e.errno if isinstance(e, OSError) and e.errno else re.search(r"os_error_code='(\d+)'", str(e))
        detail = " ".join(str(e).split())
        code = int(code if isinstance(code, int) else code[1]) if code else None
        detail = os.strerror(code) if code else f"{type(e).__name__}: {detail[:300]}"
        return CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory} failed: {detail} (free space there: "
            f"{free_space(self.directory)}). "
            + (f"The partial save was moved to {moved[0]}. " if moved else "")
            + (f"The last complete checkpoint is step {last} ({self.step_path(last)}); " if last is not None
               else "No complete checkpoint was saved; ")
            + "free some space (or fix the folder's permissions) and run the same command again to resume"
            + (self._room_hint(last) if code == errno.ENOSPC else ""))

    def _room_hint(self, last: int | None) -> str:
        """For a save that found the disk full: what a checkpoint takes, that max_num_checkpoints_to_keep
        deletes older ones only after a new save is complete (so a full disk is not emptied by it: the
        newest complete checkpoint is never deleted before the next one is), and the older steps to delete."""
        steps = sorted(s for s in self.manager.all_steps() if last is not None and s <= last)
        if not steps or not checksums.is_local(self.directory):
            return ""
        try:
            size = {s: _folder_bytes(self.step_path(s)) for s in steps}
        except OSError:
            return ""
        keep = self.cfg.max_num_checkpoints_to_keep
        rule = (f"max_num_checkpoints_to_keep={keep} deletes older checkpoints only after a new one is complete, so "
                f"the disk needs room for {keep + 1} of them" if keep >= 1 else
                "every checkpoint is kept (max_num_checkpoints_to_keep=-1)")
        older = steps[:-1]
        delete = (f"; step{'s' * (len(older) > 1)} {', '.join(map(str, older))} ({_mib(sum(size[s] for s in older))}) "
                  f"{'are' if len(older) > 1 else 'is'} older than step {last} and may be deleted to make room"
                  if older else "")
        return f". Step {last} takes {_mib(size[last])} and {rule}{delete}"

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """(state, data_state) of `step`, placed with the shardings in `abstract_state`."""
        path = self.step_path(step)
        use_tidy_event_loops()
        self.check_complete(step)
        if self.cfg.checkpoint_checksums:
            self.verify(step)
        try:
            saved = self.manager.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any unreadable metadata means an unusable checkpoint
            raise read_error(e, str(self._damaged(step, "cannot be read"))) from None
        target, finish = restacked(getattr(saved, "tree", saved), abstract_state)
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
        why = checksums.check(self.step_path(step))
        if why:
            raise self._damaged(step, f"is damaged: {why}")

    def _damaged(self, step: int, what: str) -> CheckpointError:
        """'checkpoint <path> <what>. Move it away ... to resume from step <earlier>' (or to start afresh)."""
        path = self.step_path(step)
        earlier = [s for s in self.manager.all_steps() if s < step]
        then = f"to resume from step {max(earlier)}" if earlier else "to start this run from step 0"
        return CheckpointError(f"checkpoint {path} {what}. Move it away (e.g. mv {path} {path}.damaged) {then}")


def _folder_bytes(folder: epath.Path) -> int:
    """The bytes of the files under a local `folder`."""
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(folder) for n in names)


def copied_bytes(state) -> int:
    """The bytes of `state` a save copies from this process's devices to host: every shard once. A
    shard replicated over devices (data parallelism) is copied from one replica (`_WholeReplicas`), or
    in slices, one per replica (Orbax's default, with several processes): its copies are not added up
    (a data=2 x fsdp=4 mesh was said to copy 84.2 MiB of the demo's 42.0)."""
    total = 0.0
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            shard_shape = leaf.sharding.shard_shape(leaf.shape)
            shards = math.prod(-(-dim // part) for dim, part in zip(leaf.shape, shard_shape) if part)
            replicas = max(1, leaf.sharding.num_devices // max(1, shards))
            total += sum(shard.data.nbytes for shard in leaf.addressable_shards) / replicas
    return round(total)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.2f} GiB"


def _state_handler(list_own_files: bool) -> ocp.StandardCheckpointHandler:
    """Orbax's handler for the train state. With `list_own_files`, each process also lists the
    checksums of the array files it wrote (checksums.record_share) once its writes are complete,
    on its own thread and before the processes meet to commit, so process 0 reads back only its
    own share. Orbax has no hook there but the handler's futures, so this instance's `async_save`
    (which its synchronous `save` awaits too) chains one; the handler's type, and so what the
    checkpoint's metadata records, stays Orbax's own."""
    handler = ocp.StandardCheckpointHandler()
    if jax.process_count() == 1:  # as Orbax builds it, with replicated arrays saved whole (_WholeReplicas)
        handler._impl = ocp.PyTreeCheckpointHandler(save_concurrent_gb=96, restore_concurrent_gb=96,
                                                    type_handler_registry=_WholeReplicas())
    if not list_own_files:
        return handler
    save = handler.async_save

    async def async_save(directory, *args, **kwargs):
        futures = await save(directory, *args, **kwargs)
        path = directory if isinstance(directory, epath.Path) else directory.path  # or one awaiting creation
        process = jax.process_index()
        return [ocp.future.ChainedFuture(list(futures or []), lambda: checksums.record_share(path, "state", process))]

    handler.async_save = async_save
    return handler


class _WholeReplicas(ocp.type_handlers.TypeHandlerRegistry):
    """Orbax's type handlers, but an array replicated over devices is saved from one replica whole.
    Orbax's default (use_replica_parallel) has each replica copy a slice of it, cut by an eager
    `jax.lax.slice_in_dim`: a program compiled at the run's first save for every replicated shape
    and device (the loop waited 3 s at the first save of a 5.7 MiB state on 8 CPU devices with
    data=2, 0.04 s at the next). Spreading the writes pays off only when the replicas live in
    several processes, which then keep Orbax's default."""

    def __init__(self):
        default = ocp.type_handlers.get_type_handler(jax.Array)
        self.arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=False,
                                                     array_metadata_store=default._array_metadata_store)

    def get(self, ty):
        handler = ocp.type_handlers.get_type_handler(ty)
        return self.arrays if isinstance(handler, ocp.type_handlers.ArrayHandler) else handler

    def has(self, ty) -> bool:
        return ocp.type_handlers.has_type_handler(ty)

    def add(self, ty, handler, func=None, override=False):
        raise NotImplementedError("the state's handlers are fixed")


def refuse_files_named_as_steps(directory: epath.Path) -> None:
    """CheckpointError for a file in `directory` named as a step (`6`): Orbax does not take it for a checkpoint,
    and deleted it without a word when the run saved that step. Likewise for a parameters-only checkpoint
    there (decode.py's save_quantized_params_path, a converted one): the newest was resumed from and reported
    as damaged, an older one deleted by max_num_checkpoints_to_keep."""
    if not directory.is_dir():
        return
    named = sorted((p for p in directory.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    files = [p for p in named if not p.is_dir()]
    if files:
        raise CheckpointError(f"{files[0]} is a file, where the checkpoint of step {files[0].name} would be saved (the "
                              f"save would delete it); move it away (e.g. mv {files[0]} {files[0]}.file) and run the "
                              "same command again")
    params_only = [p for p in named if (p / PYTREE_METADATA_FILE).exists() and not (p / "state").exists()]
    if params_only:
        p = params_only[0]
        raise CheckpointError(f"{p} is a parameters-only checkpoint (decode.py save_quantized_params_path or the "
                              f"converter wrote it), not a training step: its name makes it step {p.name} of this run, "
                              f"to resume from or to delete. Move it out of {directory} (e.g. mv {p} "
                              f"{directory.parent / f'params-{p.name}'}) and run the same command again")


def set_aside_incomplete(directory: epath.Path) -> list[epath.Path]:
    """Move interrupted saves out of `directory` (a new save of the same step would replace them)
    into `<directory>_incomplete/`, log each move, and return the new paths."""
    if not directory.exists():
        return []
    moved = []
    for path in sorted(p for p in directory.iterdir() if INCOMPLETE_MARKER in p.name):
        target_dir = directory.parent / f"{directory.name}_incomplete"
        if target_dir.exists() and not target_dir.is_dir():
            raise CheckpointError(f"{target_dir} is a file, where interrupted saves such as {path.name} are moved; "
                                  "move it away and run the same command again")
        target_dir.mkdir(parents=True, exist_ok=True)
        stamp = f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}"
        # the same step set aside twice within a second (a save that failed, then what Orbax left of it
        # when the manager closed) keeps both: CI saw the second rename fail on the first's name
        # every process of a job looks at start-up: on a shared folder another may take the name first
        # (FileExistsError: the next name) or move the folder first (FileNotFoundError: nothing to do)
        target = None
        for name in [stamp, *(f"{stamp}-{n}" for n in range(1, 1000))]:
            if (target_dir / name).exists():
                continue
            try:
                path.rename(target_dir / name)
            except FileNotFoundError:
                break
            except OSError as e:  # FileExistsError, or ENOTEMPTY when the other's rename won the race
                if isinstance(e, FileExistsError) or e.errno == errno.ENOTEMPTY:
                    continue
                raise
            target = target_dir / name
            break
        if target is None:
            continue
        log.warning("incomplete checkpoint %s (an interrupted save) was not loaded; moved to %s. "
                    "Delete it once you no longer need it", path, target)
        moved.append(target)
    return moved
