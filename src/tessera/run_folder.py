"""What a run writes outside its checkpoints, in the run folder (base_output_directory/run_name):
the output folders checked before anything is compiled, config.yml once the state and the step are
known good, and report.json at the end. `tessera.train` calls these in that order, holding the
folder's lock (`RunFolderLock`) from the moment the folder exists."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import yaml

from tessera import metrics
from tessera.checkpointing import PYTREE_METADATA_FILE, check_writable, unwritable
from tessera.config import Config, ConfigError, config_digest, flat_dict
from tessera.config.schema import all_fields
from tessera.config.yaml_file import RUN_CONFIG_HEADER
from tessera.config.derived import checkpoint_directory, remote_run_dir, run_dir
from tessera.evaluation import at_target
from tessera.loop_records import input_bound_warning, time_line

if TYPE_CHECKING:
    from tessera.loop_records import RunClock, StepMeter
    from tessera.step import Trainer

log = logging.getLogger("tessera")


def check_output_folders(cfg: Config, ckpt_dir: str) -> None:
    """ConfigError now, before anything is compiled, for an output folder that cannot be written
    (a parent that is a file, no permission); the probe leaves nothing behind."""
    check_writable(str(run_dir(cfg.run)), "base_output_directory", "the run folder")
    if cfg.checkpoint.enable_checkpointing:
        if cfg.checkpoint.checkpoint_dir:
            _refuse_checkpoint_inside(ckpt_dir)
            check_writable(ckpt_dir, "checkpoint_dir")
        else:
            check_writable(ckpt_dir, "base_output_directory", "the checkpoint folder")
    if cfg.run.gcs_metrics and remote_run_dir(cfg.run):  # else the first upload, after the last step, failed
        _check_upload_scheme(cfg.run.base_output_directory)
    if "://" in cfg.run.metrics_file:  # Path() would make gs://b/m.jsonl the local file gs:/b/m.jsonl
        raise ConfigError(f"metrics_file={cfg.run.metrics_file} is a URL; metrics_file is a local file, appended to "
                          "after every step, which an object store cannot do. For metrics in a bucket, set "
                          "base_output_directory to a gs:// folder and gcs_metrics=true (metrics.jsonl stays local)")
    if cfg.run.metrics_file:
        if Path(cfg.run.metrics_file).is_dir():
            raise ConfigError(f"metrics_file={cfg.run.metrics_file} is a folder; give the path of a file, e.g. "
                              f"{Path(cfg.run.metrics_file) / 'metrics.jsonl'}")
        check_writable(str(Path(cfg.run.metrics_file).parent), "metrics_file", "the metrics file's folder")
        _refuse_run_file_as_metrics(Path(cfg.run.metrics_file), run_dir(cfg.run))
    else:  # the run folder's own files, where something else may sit under their names
        _check_kind(run_dir(cfg.run) / "metrics.jsonl", "a file", "base_output_directory")
    _check_appendable(Path(cfg.run.metrics_file) if cfg.run.metrics_file else run_dir(cfg.run) / "metrics.jsonl",
                      "metrics_file" if cfg.run.metrics_file else "base_output_directory")
    if cfg.run.enable_tensorboard:
        _check_kind(run_dir(cfg.run) / "tensorboard", "a folder", "base_output_directory")
        if (run_dir(cfg.run) / "tensorboard").is_dir():  # a resumed run's (a new one's is made in the checked folder)
            check_writable(str(run_dir(cfg.run) / "tensorboard"), "base_output_directory", "the TensorBoard folder")
    if cfg.profiler.profiler:
        _check_kind(run_dir(cfg.run) / "profile", "a folder", "base_output_directory")
    for name in (LOCK_FILE, "config.yml", "report.json"):  # the lock, taken first; the others written after compiling
        _check_kind(run_dir(cfg.run) / name, "a file", "base_output_directory")


def _check_appendable(path: Path, key: str) -> None:
    """ConfigError for an existing metrics file the run cannot append to (read-only, another user's): the
    writer opened it after compiling, a PermissionError traceback (exit code 1). A pipe or device is
    not opened here (a named pipe would block until it has a reader)."""
    if jax.process_index() != 0 or not path.is_file():
        return
    try:
        with open(path, "rb+"):  # as the writer opens it (a record cut off at the end is removed); nothing changes
            pass
    except OSError as e:
        raise ConfigError(f"the metrics file {path} (from {key}) cannot be written ({e.strerror or e}): the run "
                          "appends each step's record to it; make it writable, or choose another "
                          f"{'metrics_file' if key == 'metrics_file' else 'run_name'}") from None


def _refuse_run_file_as_metrics(metrics_file: Path, folder: Path) -> None:
    """ConfigError for a metrics_file that is a file the run writes itself in its folder: report.json
    replaced the records with the report at the end, the lock's removal deleted them, config.yml (and an
    earlier attempt's report, renamed at a resume) mixed them with other contents; exit code 0 each time."""
    path = metrics_file.resolve()
    if path.parent != folder.resolve():
        return
    what = {LOCK_FILE: "the run folder's lock, removed when the run ends",
            "config.yml": "the run's config, written at its start (and read at a resume)",
            "report.json": "the run's report, which replaces it when the run ends"}.get(path.name)
    if what is None and path.name.startswith("report.until_"):
        what = "an earlier attempt's report"
    if what is not None:
        raise ConfigError(f"metrics_file={metrics_file} is {what}: its records would be lost or mixed with it; "
                          f"give a file of its own, or leave metrics_file out ({folder / 'metrics.jsonl'})")


def _refuse_checkpoint_inside(ckpt_dir: str) -> None:
    """ConfigError for a checkpoint_dir that is a step folder, one of its items or a run folder: it holds
    no step folders itself, so the run started from step 0 and saved its steps inside it, without a word."""
    p = Path(ckpt_dir)
    if "://" in ckpt_dir or not p.is_dir():
        return
    step = next((f for f in (p, p.parent) if f.name.isdigit() and (f / "state" / PYTREE_METADATA_FILE).is_file()), None)
    if step is not None:
        raise ConfigError(f"checkpoint_dir={ckpt_dir} is {'the step folder' if step == p else 'in the step folder'} "
                          f"{step}, not a folder of step folders: this run would start from step 0 and save inside it. "
                          f"To start from that step, use load_full_state_path={step} (or load_parameters_path={step} "
                          f"for its parameters alone); to save beside its run's steps, checkpoint_dir={step.parent}")
    own = p / "checkpoints"
    if own.is_dir() and any(c.name.isdigit() for c in own.iterdir()) and not any(c.name.isdigit() for c in p.iterdir()):
        raise ConfigError(f"checkpoint_dir={ckpt_dir} is a run folder, whose step folders are in {own}: this run "
                          f"would start from step 0 and save its steps there, beside checkpoints/; give checkpoint_dir={own} to "
                          f"train on from its newest step, or load_full_state_path=<one of its steps> for a new run")


def _check_upload_scheme(base: str) -> None:
    """ConfigError for a URL base_output_directory whose scheme etils (the file layer gcs_metrics
    writes through) has no client for, such as file://."""
    from etils import epath

    try:
        epath.Path(base)
    except KeyError:
        scheme = base.split("://", 1)[0]
        raise ConfigError(f"gcs_metrics=true with base_output_directory={base}: no client writes to {scheme}:// "
                          "URLs (gs://, s3://, az:// and hf:// have one); use one of those, or a local folder "
                          "(without ://), where metrics.jsonl holds every record") from None


def _check_kind(path: Path, kind: str, key: str) -> None:
    """ConfigError when `path`, which the run writes as `kind` ("a file" or "a folder"), exists as the other."""
    if "://" in str(path) or not path.exists() or path.is_dir() == (kind == "a folder"):
        return
    raise ConfigError(f"{path} (in the run folder, from {key}) is {'a folder' if kind == 'a file' else 'a file'}, "
                      f"where the run writes {kind}; move it away, or choose another run_name")


def refuse_unread_checkpoints(cfg: Config, ckpt_dir: str) -> None:
    """ConfigError when the run's own checkpoint folder holds steps this start would not read
    (enable_checkpointing=false, or checkpoint_dir elsewhere with nothing in it), or when the run
    folder holds a finished run's report: it would train again from step 0 beside them, append
    to their metrics and replace their config and report. (Called when there is no checkpoint to
    resume from.)"""
    own = checkpoint_directory(dataclasses.replace(cfg.checkpoint, checkpoint_dir=""), cfg.run.base_output_directory,
                               cfg.run.run_name)
    local = "://" not in own and not (cfg.checkpoint.enable_checkpointing and own == ckpt_dir) and Path(own).is_dir()
    steps = sorted(int(p.name) for p in Path(own).iterdir() if p.name.isdigit() and p.is_dir()) if local else []
    if steps:
        why = ("enable_checkpointing=false" if not cfg.checkpoint.enable_checkpointing else
               f"checkpoint_dir={cfg.checkpoint.checkpoint_dir} holds none")
        raise ConfigError(f"{own} holds this run's checkpoints up to step {steps[-1]}, which this start would not "
                          f"read ({why}): it would train again from step 0 beside them. To continue the run, leave "
                          f"out {why.split('=')[0]}; for a new run, choose a new run_name")
    before = _saved_checkpoint_dir(run_dir(cfg.run) / "config.yml")
    if before and (before != ckpt_dir or not cfg.checkpoint.enable_checkpointing) and "://" not in before \
            and Path(before).is_dir():
        steps = sorted(int(p.name) for p in Path(before).iterdir() if p.name.isdigit() and p.is_dir())
        if steps:
            why = "enable_checkpointing=false" if not cfg.checkpoint.enable_checkpointing else \
                f"checkpoint_dir={cfg.checkpoint.checkpoint_dir or '(not set)'}"
            raise ConfigError(f"{run_dir(cfg.run)} is a run whose checkpoints, up to step {steps[-1]}, are in {before} "
                              f"(checkpoint_dir in its config.yml), which this start would not read ({why}): it would "
                              f"train again from step 0. To continue the run, give checkpoint_dir={before}; for a new "
                              "run, choose a new run_name")
    folder = run_dir(cfg.run)  # its report, or an earlier attempt's (`_set_aside_earlier_report`)
    report = next((p for p in (folder / "report.json", *sorted(folder.glob("report.until_*.json"))) if p.is_file()),
                  None)
    if report is not None:  # a run that ended (enable_checkpointing=false, or its checkpoints deleted since)
        raise ConfigError(f"{report.parent} holds a run that finished ({report.name}) and no checkpoint this start "
                          "could resume from: it would train again from step 0 and mix its metrics with the finished "
                          "run's. For a new run, choose a new run_name (or move that folder away)")


def _saved_checkpoint_dir(config_file: Path) -> str:
    """The checkpoint_dir the run folder's config.yml (written by the run's last start) names; "" when it
    names none (the default folder, checked apart) or cannot be read."""
    try:
        saved = yaml.safe_load(config_file.read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return ""
    value = saved.get("checkpoint_dir") if isinstance(saved, dict) else None
    return value if isinstance(value, str) else ""


LOCK_FILE = ".tessera.lock"


class RunFolderInUse(ConfigError):
    """Another training process holds the run folder's lock."""


class RunFolderLock:
    """Keeps a second training process out of a run folder while one trains in it.

    Two processes started with the same run_name (the same command typed twice, a job restarted
    while its old process still runs) would resume from the same checkpoint, save into the same
    step folders and append to the same metrics: the folder would end up with a mix of two runs.
    Process 0 of a run takes an exclusive `flock` on `<run folder>/.tessera.lock` as soon as the
    folder exists (at the start for a resumed run, when it is created for a new one); a second
    process then stops with RunFolderInUse, naming the holder (its pid, host and start time,
    written in the file), before it reads or writes anything there. The kernel drops the lock when
    its process ends, however it ends (a crash, `kill -9`): no stale lock is left to clear by hand.
    The file is removed when the run ends. The other processes of a multi-process job share the
    folder and take no lock. It covers the local run folder, on one machine (or a network
    file system with locks); two machines writing the same gs:// checkpoints are not detected, and
    on a file system without locks (some FUSE mounts) the run trains unguarded, with a warning."""

    def __init__(self):
        self._file = None
        self._path: Path | None = None
        self.tried = False  # take() was called: the lock is held, or the folder's file system has none

    def take(self, folder: Path) -> None:
        """Hold `folder`'s lock (once; process 0 only); RunFolderInUse when another process holds it."""
        if self.tried or jax.process_index() != 0:
            return
        self.tried = True
        import fcntl  # POSIX; imported here so the module imports everywhere

        path = folder / LOCK_FILE
        while True:
            handle = open(path, "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise RunFolderInUse(
                    f"the run folder {folder} is in use by another training process ({holder}): two processes "
                    "writing one run's checkpoints and metrics would mix them. Wait for that run to end or stop it, "
                    f"or choose another run_name (a crashed process holds no lock; {path} names the last "
                    "holder)") from None
            except OSError as e:  # a file system without locks (some FUSE mounts of buckets): train on, unguarded
                handle.close()
                log.warning("the run folder %s is on a file system without file locks (%s): a second training process "
                            "started in it would not be stopped", folder, e.strerror or e)
                return
            try:  # the holder before may have removed the file between our open and our lock: lock the new one
                if os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            handle.close()
        self._file, self._path = handle, path
        try:  # unbuffered: a note that did not fit (a full disk) is not written again when the file is closed
            handle.seek(0)
            handle.truncate()
            os.write(handle.fileno(), f"pid {os.getpid()} on host {socket.gethostname()}, since "
                                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        except OSError:  # the lock is held all the same; config.yml, written next, reports the folder
            pass

    def release(self) -> None:
        """Remove the lock file and let go of the lock (nothing when not held)."""
        if self._file is None:
            return
        import fcntl

        try:
            self._path.unlink()
        except FileNotFoundError:
            pass
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = self._path = None


def create_run_folder(cfg: Config, folder: Path, lock: RunFolderLock | None = None) -> Path:
    """`folder` (base_output_directory/run_name) with the full final config in config.yml; `lock`
    is taken as soon as the folder exists, before anything is written in it. RunFolderInUse when the
    folder, new at this run's start (its lock not taken then), holds another run's config.yml now: a
    second process started with the same run_name while the first compiled, which ended (or was
    stopped) before this one got here, would train from step 0 over that run's checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    if lock is not None:
        new = not lock.tried
        lock.take(folder)
        if new and jax.process_index() == 0 and (folder / "config.yml").exists():
            raise RunFolderInUse(
                f"the run folder {folder} was created by another training process while this one was starting "
                "(its config.yml is there now): this one started from step 0 and would train over that run's "
                "checkpoints and metrics. Run the same command again to resume from what that run saved (once it "
                "has ended), or choose another run_name")
    if remote_run_dir(cfg.run):
        log.info("base_output_directory is a URL (run folder %s): config.yml, TensorBoard, the report and metrics.jsonl "
                 "are kept locally in %s; %s", remote_run_dir(cfg.run), folder,
                 "the metrics also go to the run folder's metrics/ (gcs_metrics=true)" if cfg.run.gcs_metrics
                 else "set gcs_metrics=true to write the metrics to the run folder too")
    _say_train_compile_keys(cfg)
    if jax.process_index() == 0:
        _set_aside_earlier_report(folder)
        try:
            (folder / "config.yml").write_text(RUN_CONFIG_HEADER + yaml.safe_dump(flat_dict(cfg), sort_keys=False))
        except OSError as e:  # the disk filled up since the folders were checked, before compiling
            raise unwritable(f"the run folder {folder} (from base_output_directory)", "base_output_directory",
                             folder, e) from None
    log.info("run %s -> %s (full config in config.yml, digest %s)", cfg.run.run_name, folder, config_digest(cfg))
    return folder


# The compile section's keys, which only train_compile reads, and what train.py does instead.
_TRAIN_COMPILE_ONLY = {
    "compile_topology": "is read by train_compile; train.py trains on the devices it finds",
    "compile_topology_num_slices": "is read by train_compile; train.py trains on the devices it finds",
    "compile_hbm_budget_fraction": "is read by train_compile (and the plan and estimate tools); train.py uses "
                                   "the memory its devices have",
    "compiled_trainstep_file": "is written by train_compile; train.py compiles its own step",
}


def _say_train_compile_keys(cfg: Config) -> None:
    """One line for each of train_compile's keys set away from its default: train.py does not read them
    (compile_hbm_budget_fraction=0.8 and compile_topology_num_slices=2 went without a word)."""
    for name, what in _TRAIN_COMPILE_ONLY.items():
        value = getattr(cfg.compile, name)
        if value != all_fields()[name][1].default:
            log.info("%s=%s %s", name, value, what)


def _set_aside_earlier_report(folder: Path) -> None:
    """An earlier attempt's report.json, renamed report.until_step_<N>.json (.2.json, ... when that name is taken)
    as this attempt starts its steps: left in place, a resumed attempt stopped before its own report (SIGTERM, a
    crash) left the folder reading as finished at the earlier attempt's last step, with its figures."""
    report = folder / "report.json"
    if not report.is_file():
        return
    try:
        earlier = json.loads(report.read_text())
        last = f"step_{int(earlier['start_step']) + int(earlier['steps'])}"
    except (OSError, ValueError, TypeError, KeyError):
        last = "an_earlier_step"  # cut short by a full disk, say: kept all the same
    kept, attempt = folder / f"report.until_{last}.json", 2
    while kept.exists():  # the same step again (checkpoints deleted, the run started over): both reports are kept
        kept, attempt = folder / f"report.until_{last}.{attempt}.json", attempt + 1
    try:
        report.replace(kept)
    except OSError as e:
        raise unwritable(f"the run folder {folder} (from base_output_directory)", "base_output_directory", folder,
                         e) from None
    log.info("the earlier attempt's report.json is kept as %s; this attempt writes its own at its end", kept.name)


def loss_text(loss: float | None) -> str:
    """The final loss for a log line: 'none' when no step had target tokens (`run_report`)."""
    return "none (no step had target tokens)" if loss is None else f"{loss:.4f}"


def write_report(cfg: Config, trainer: Trainer, writer: metrics.MetricsWriter, meter: StepMeter, folder: Path,
                 n_params: int, compile_seconds: float, start_step: int, clock: RunClock) -> dict[str, Any]:
    """The run report: logged, written as report.json (process 0) and returned. Its `time` is
    `clock`'s account of the run's wall time by phase, with the goodput (`loop_records.RunClock`)."""
    # an evaluation at target_eval_loss ends the loop, so only the last one can be
    last_eval = writer.last_eval or {}
    reached = last_eval["step"] if last_eval and at_target(cfg.data, last_eval["eval_loss"]) else None
    report = metrics.run_report(
        writer.steps, cfg.run.report_warmup_steps, run_name=cfg.run.run_name, config_digest=config_digest(cfg),
        device_kind=meter.device_kind, num_devices=trainer.mesh.size, mesh=dict(trainer.mesh.shape),
        peak_tflops_per_device=meter.peak, flops_per_step=meter.flops, num_parameters=n_params,
        compile_seconds=compile_seconds, attention_kernel=trainer.model.attention_kernel,
        global_batch=trainer.plan.global_batch, max_target_length=trainer.plan.max_target_length, start_step=start_step,
        final_eval_loss=last_eval.get("eval_loss"),
        **{f"final_{k}": v for k, v in last_eval.items()
           if k.startswith("eval_mtp_")},  # multi-token prediction's eval loss and acceptance rate
        target_eval_loss_reached_at=reached,
        time=clock.summary(),
    )
    log.info(time_line(report["time"]))
    if jax.process_index() == 0:
        try:
            (folder / "report.json").write_text(metrics.to_json(report, indent=2))
        except OSError as e:  # a full disk at the end: one line (exit code 6), as for metrics.jsonl
            raise metrics.MetricsWriteError(
                f"the run's report could not be written to {folder / 'report.json'} ({e.strerror or e}); its steps "
                f"are trained (final loss {loss_text(report['final_loss'])}, median {report['step_seconds']:.3f} s/step) and "
                "in the metrics file. Free some space (or fix the folder's permissions)") from None
    if report["steps_skipped"]:
        log.warning("%d of the %d steps trained were skipped (a non-finite loss or gradient, on_nonfinite_loss="
                    "skip_step): their updates were dropped; they are marked \"skipped\" in the metrics file",
                    report["steps_skipped"], report["steps"])
    slow_input = input_bound_warning(report["time"], cfg.data.dataset_type)
    if slow_input:
        log.warning(slow_input)
    log.info("done: final loss %s, median %.3f s/step; report %s", loss_text(report["final_loss"]), report["step_seconds"],
             folder / "report.json" if jax.process_index() == 0 else "written by process 0")
    return report
