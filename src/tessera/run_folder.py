"""What a run writes outside its checkpoints, in the run folder (base_output_directory/run_name):
config.yml once the state and the step are known good, and report.json at the end. `tessera.train`
calls these in that order (after `tessera.output_folders` has checked the folders, before anything
is compiled), holding the folder's lock (`RunFolderLock`) from the moment the folder exists."""

from __future__ import annotations

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
from tessera.checkpointing import unwritable
from tessera.config import Config, ConfigError, config_digest, flat_dict
from tessera.config.schema import all_fields
from tessera.config.yaml_file import RUN_CONFIG_HEADER
from tessera.config.derived import remote_run_dir
from tessera.evaluation import at_target
from tessera.loop_records import input_bound_warning, time_line

if TYPE_CHECKING:
    from tessera.loop_records import RunClock, StepMeter
    from tessera.step import Trainer

log = logging.getLogger("tessera")


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
        spiked, nonfinite = report["steps_skipped_spikes"], report["steps_skipped"] - report["steps_skipped_spikes"]
        why = {(True, False): "a non-finite loss or gradient, on_nonfinite_loss=skip_step",
               (False, True): "a loss or gradient norm spike, skip_step_on_spikes; also marked \"spike\"",
               (True, True): f"{nonfinite} for a non-finite loss or gradient, on_nonfinite_loss=skip_step; {spiked} for "
                             "a spike, skip_step_on_spikes, also marked \"spike\""}[bool(nonfinite), bool(spiked)]
        log.warning("%d of the %d steps trained were skipped (%s): their updates were dropped; they are marked "
                    "\"skipped\" in the metrics file", report["steps_skipped"], report["steps"], why)
    slow_input = input_bound_warning(report["time"], cfg.data.dataset_type)
    if slow_input:
        log.warning(slow_input)
    log.info("done: final loss %s, median %.3f s/step; report %s", loss_text(report["final_loss"]), report["step_seconds"],
             folder / "report.json" if jax.process_index() == 0 else "written by process 0")
    return report
