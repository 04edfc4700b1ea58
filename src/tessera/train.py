"""A training run, top to bottom: config -> mesh -> model and sharded state -> input ->
compiled step -> the loop with metrics and checkpoints (`tessera.train_loop`) -> report.
`python3 train.py configs/base.yml key=value ...`.

Exit codes (the table is in getting_started/Checkpointing.md): 0 finished; 2 bad config, input
data, output folder or checkpoint, or a run folder another training process holds (earlier
checkpoints are kept); 3 non-finite loss or gradient with on_nonfinite_loss=stop; 4 multi-process
start-up failed; 5 hang watchdog (no step within step_timeout_seconds, or a multi-process step
failed in a collective); 6 a checkpoint could not be saved (disk full, permissions); 7 the state or
the step does not fit in memory (checked before allocating, see memory_fit); 130 stopped by SIGINT
(Ctrl-C) and 143 by SIGTERM, after saving a checkpoint (128 + the signal's number; outside the
training loop, at start-up or while compiling, they stop with one line and no new checkpoint).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
import traceback
from typing import Any

import jax
import numpy as np

from tessera import host_malloc, metrics
from tessera.checkpointing import Checkpointer, CheckpointError, CheckpointSaveError, saved_config
from tessera.compile_cache import cache_hits, check_cache_folder, loaded_note, use_compilation_cache
from tessera.config import Config, ConfigError, changed_keys, flat_dict, load_config
from tessera.config.derived import RunPlan
from tessera.data import DataError, close_input, make_input
from tessera.distributed import EXIT_DISTRIBUTED, DistributedError, initialize
from tessera.job_sync import check_same_config, wait_for_all
from tessera.evaluation import Evaluator
from tessera.job_failure import FailureWatch, end_job, follow_earlier_failure, in_job
from tessera.loop_records import Profiler, RunClock, StepMeter, steps_logged_after
from tessera.memory_fit import (EXIT_OUT_OF_MEMORY, HostBuffers, OutOfMemory, check_state_fits, check_step_fits,
                                out_of_memory, save_buffers, state_advice, state_shapes, step_advice)
from tessera.mesh import sharding_report
from tessera.platforms import check_platforms_start, run_settings_restored
from tessera.output_folders import check_output_folders, refuse_unread_checkpoints
from tessera.run_folder import RunFolderLock, create_run_folder, write_report
from tessera.stop_signals import TerminatedOutsideLoop, TrainingStopped
from tessera.start_state import (changes_since_save, initial_state, show_setting, state_source, unread_load_paths,
                                  warn_if_no_step_learns)
from tessera.step import Trainer, compile_step, init_program, setup
from tessera.tools.cli import EXIT_USER_ERROR  # 2, also when train.py finds the config error before these imports
from tessera.train_loop import TrainLoop, local_state_bytes

log = logging.getLogger("tessera")

EXIT_OK, EXIT_SAVE_FAILED = 0, 6
EXIT_INTERRUPTED, EXIT_PREEMPTED = 128 + signal.SIGINT, 128 + signal.SIGTERM  # 130, 143


# --------------------------------------------------------------------------- the run


def run(cfg: Config, devices=None, clock: RunClock | None = None) -> dict[str, Any]:
    """Train until `cfg.run.steps`; returns the run report (also written as report.json).

    Nothing is written until the mesh, the input pipeline and the starting state are known good:
    a run that fails before its first step leaves no run folder behind. `clock` (started by
    train.py before it reads the config; else here) times the run's phases for the report."""
    clock = clock or RunClock()
    # ---- mesh, model, shardings
    trainer = setup(cfg, devices)
    ckpt_dir = trainer.plan.checkpoint_dir
    check_output_folders(cfg, ckpt_dir)
    lock = RunFolderLock()
    if trainer.plan.run_dir.is_dir():  # a run folder already: held before its checkpoints are read
        lock.take(trainer.plan.run_dir)
    try:
        return _locked_run(cfg, trainer, ckpt_dir, clock, lock)
    finally:
        lock.release()


def _locked_run(cfg: Config, trainer: Trainer, ckpt_dir: str, clock: RunClock, lock: RunFolderLock) -> dict[str, Any]:
    wait_for_all("setup", cfg.run.step_timeout_seconds, "the checkpoint manager (its first collective)")
    ckpt = Checkpointer(cfg.checkpoint, ckpt_dir) if cfg.checkpoint.enable_checkpointing else None
    try:
        # a finished run stops here, before reading its checkpoint or compiling anything
        latest = ckpt.latest_step() if ckpt else None
        if latest is None:
            refuse_unread_checkpoints(cfg, ckpt_dir)
        if latest is not None and latest >= cfg.run.steps:
            ckpt.check_complete(latest)  # a step folder with nothing in it is not a finished run
        done = _nothing_to_do(cfg, latest)
        if done is not None:
            changes = changes_since_save(saved_config(str(ckpt.step_path(latest))), cfg)
            for key, path in unread_load_paths(changes):
                log.warning("%s=%s is not read: the run is already at step %d of its own checkpoints (a load path is "
                            "read only when the run has no checkpoint). To start from %s, train in a new run_name",
                            key, path, latest, path)
            unused = [f"{k}={show_setting(now)}" for k, (_, now) in changes.items()
                      if k not in ("steps", "load_parameters_path", "load_full_state_path")]
            if unused:  # `run_name=demo base_emb_dim=128` on the finished demo said only "nothing to do"
                more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
                log.warning("%s%s %s from the settings step %d was saved with, and nothing is trained with them: "
                            "the run is complete. For a run with these settings, choose a new run_name",
                            ", ".join(unused[:5]), more, "differs" if len(unused) == 1 else "differ", latest)
            if not (trainer.plan.run_dir / "report.json").is_file():  # e.g. a signal during the last evaluation
                log.warning("%s has no report.json: the run was stopped after saving step %d, before its report%s; "
                            "neither is made again (raise steps to train on)", trainer.plan.run_dir, latest,
                            " and its last evaluation" if cfg.data.eval_interval else "")
            return done
        _log_shardings(cfg, trainer)
        return _train(cfg, trainer, ckpt, clock, lock)
    finally:
        if ckpt:
            ckpt.close()


def _log_shardings(cfg: Config, trainer: Trainer) -> None:
    """The table of parameters (path, shape, sharding), and large parameters left replicated."""
    rows, warnings = sharding_report(trainer.mesh, trainer.state_shardings["params"], trainer.model.param_shapes(),
                                     cfg.mesh.param_replication_warn_mib, logical_axes=trainer.model.logical_axes())
    log.info("parameters (path, shape, sharding):\n  %s", "\n  ".join(rows))
    for w in warnings:
        log.warning(w)


def _nothing_to_do(cfg: Config, step: int | None) -> dict[str, Any] | None:
    """An empty report (and a log line) when the run is already at `steps`; None otherwise."""
    if step is None or step < cfg.run.steps:
        return None
    log.info("nothing to do: the run is already at step %d of %d", step, cfg.run.steps)
    return metrics.run_report([], cfg.run.report_warmup_steps, run_name=cfg.run.run_name, start_step=step)


def _train(cfg: Config, trainer: Trainer, ckpt: Checkpointer | None, clock: RunClock,
           lock: RunFolderLock) -> dict[str, Any]:
    # ---- input and state (fresh, loaded or resumed): their errors come before anything is written
    data = make_input(cfg.data, cfg.model.vocab_size, trainer.plan.global_batch, sharding=trainer.batch_sharding)
    evaluator = None
    try:  # the pipelines' worker processes end with the run, however it ends (a notebook or a sweep goes on)
        evaluator = Evaluator(cfg.data, trainer) if cfg.data.eval_interval else None
        return _train_on(cfg, trainer, ckpt, clock, lock, data, evaluator)
    finally:
        close_input(data)
        if evaluator:
            close_input(evaluator.data)


def _train_on(cfg: Config, trainer: Trainer, ckpt: Checkpointer | None, clock: RunClock, lock: RunFolderLock,
              data, evaluator: Evaluator | None) -> dict[str, Any]:
    plan = trainer.plan
    clock.switch("state")
    source = state_source(ckpt, cfg.checkpoint)
    with host_malloc.returning_freed_memory():  # the init's and the read's buffers are not the steps' to reuse
        program = None if source else init_program(trainer, cfg.run.init_weights_seed)
        check_state_fits(trainer, read=source, init_program=program)
        state = initial_state(trainer, ckpt, data, cfg, program)
    start_step = int(jax.device_get(state["step"]))
    clock.steps_redone = _steps_redone(cfg, plan, start_step)
    done = _nothing_to_do(cfg, start_step)  # e.g. load_full_state_path at or past `steps`
    if done is not None:
        return done
    warn_if_no_step_learns(cfg, trainer.schedule, state, start_step)
    if evaluator:
        with clock.during("evaluation"):
            reached = evaluator.at_target_already(start_step, state["params"])
        if reached:
            return metrics.run_report([], cfg.run.report_warmup_steps, run_name=cfg.run.run_name,
                                      start_step=start_step)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    log.info("%s parameters, global batch %d x %d tokens%s", f"{n_params:,}", plan.global_batch,
             plan.max_target_length, f" in {plan.micro_batches} micro-batches of {plan.global_batch // plan.micro_batches}"
             if plan.micro_batches > 1 else "")

    # ---- compiled step, run folder
    clock.switch("compile")
    hits = cache_hits()
    with host_malloc.returning_freed_memory():  # the compiler's memory is not the steps' to reuse either
        step_fn, compile_seconds = compile_step(trainer, cfg.run.init_weights_seed)
    log.info("train step compiled in %.1f s%s", compile_seconds, loaded_note(hits))
    check_step_fits(step_fn, trainer, _save_buffers(cfg, trainer, ckpt, start_step))
    if evaluator:  # compiled already when a resumed run evaluated its start (no save was being written then)
        evaluator.compile(_save_buffers(cfg, trainer, ckpt, start_step, evaluation=True))
    run_dir = create_run_folder(cfg, plan.run_dir, lock)
    wait_for_all("compiled", cfg.run.step_timeout_seconds, "the first training step (every process compiled)")

    # ---- the steps, then the report
    clock.switch("training")
    writer = metrics.MetricsWriter(
        plan.metrics_path, run_dir / "tensorboard" if cfg.run.enable_tensorboard else None, cfg.run.log_period,
        write_files=jax.process_index() == 0, upload_dir=plan.metrics_upload_dir, last_step=cfg.run.steps,
        first_step=start_step + 1)
    meter, profiler = StepMeter(trainer), Profiler(cfg, run_dir, start_step)
    try:
        TrainLoop(cfg, trainer, ckpt, data, evaluator, writer, meter, profiler, clock).run(step_fn, state, start_step)
    finally:
        profiler.stop()
        writer.close()
    return write_report(cfg, trainer, writer, meter, run_dir, n_params, compile_seconds, start_step, clock)


def _steps_redone(cfg: Config, plan: RunPlan, start_step: int) -> int:
    """The steps after `start_step` that an earlier attempt of this run logged and lost (not saved), which this
    one trains again, up to `steps` (a lowered `steps` trains fewer again); logged when there are any."""
    # an earlier attempt of this run got to its steps only if it made the run folder's config.yml: records in a
    # metrics_file without one are another run's (one file given to several runs), not steps trained again
    earlier_attempt = (plan.run_dir / "config.yml").is_file()
    logged = steps_logged_after(plan.metrics_path, start_step) if earlier_attempt else 0
    redone = min(logged, max(0, cfg.run.steps - start_step))  # a lowered `steps` trains fewer again
    if logged:
        past = "" if redone == logged else (
            f"; steps {cfg.run.steps + 1}-{start_step + logged}, past steps={cfg.run.steps}, are not, and their "
            "records stay from that attempt")
        log.info("the attempt before this one logged %d step(s) after step %d, lost before they were saved: %s "
                 "trained again (%s keeps both records of each; the later one is this attempt's)%s", logged,
                 start_step, f"steps {start_step + 1}-{cfg.run.steps} are" if past else "they are",
                 plan.metrics_path.name, past)
    return redone


def _save_buffers(cfg: Config, trainer: Trainer, ckpt: Checkpointer | None, start_step: int,
                  evaluation: bool = False) -> HostBuffers:
    """What this run's checkpoint saves hold on the host (`memory_fit.save_buffers`): none without
    checkpoints; the second state only when an asynchronous save can happen before the last step.
    During an `evaluation`: the copy such a save may still be writing from, nothing else."""
    if ckpt is None:
        return HostBuffers()
    beside = cfg.checkpoint.async_checkpointing and cfg.checkpoint.checkpoint_period < cfg.run.steps - start_step
    if evaluation and not beside:
        return HostBuffers()
    return save_buffers(state_shapes(trainer), local_state_bytes(trainer), beside and not evaluation)


def format_changed_keys(cfg: Config) -> str:
    """`key=value, ...` for the keys that differ from configs/base.yml (the full config goes to config.yml)."""
    changed = changed_keys(cfg)
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in changed.items()) or "none"


def main(argv: list[str]) -> int:
    from tessera.tools.cli import command_logging, exit_if_help, train_help

    exit_if_help(argv, train_help)
    with command_logging():  # the caller's logging again afterwards (a notebook trains on)
        return _main_logged(argv)


def _main_logged(argv: list[str]) -> int:
    from tessera.tools.cli_signals import sigterm_raises

    watch = FailureWatch()
    try:
        # the loop's StopSignal takes over while it runs; the GPU and dump keys' settings end with the run
        with sigterm_raises(TerminatedOutsideLoop), run_settings_restored():
            code, line = _main(argv, watch)
    except Exception as e:  # a bug of ours: its traceback; in a job, the other processes stop too
        watch.stop()
        if in_job():
            follow_earlier_failure()  # unless it is the consequence of another process's error (a failed collective)
            traceback.print_exc()
            end_job(1, f"{type(e).__name__}: {' '.join(str(e).split())[:300]} (the traceback is in its log)")
        raise
    watch.stop()
    if line:
        print(line, file=sys.stderr)
        # an error, or a signal outside the loop, perhaps on this process alone: the job ends with it (leaving
        # through JAX's shutdown barrier would wait for the others, then abort); the loop's stops are collective
        end_job(code, line)
    return code


def _main(argv: list[str], watch: FailureWatch) -> tuple[int, str]:
    """(exit code, the error line to print: empty when there is none)."""
    clock = RunClock()  # the report's time starts here, before the config is read
    try:
        cfg = load_config(argv)
        from tessera.gpu_tuning import apply_gpu_tuning  # before any device use: JAX reads these at start-up
        apply_gpu_tuning(cfg.gpu)
        if not cfg.run.run_name:
            cfg.run.run_name = time.strftime("run_%Y%m%d_%H%M%S")
        from tessera.xla_dump import apply_hlo_dump  # before any device use, as the GPU tuning

        apply_hlo_dump(cfg)  # before use_compilation_cache: the dump turns the cache off
        use_compilation_cache(cfg.run.jax_cache_dir)
        log.info("config (differs from base.yml): %s", format_changed_keys(cfg))
        log.info("host malloc: %s", host_malloc.describe())
        initialize()
        check_platforms_start()  # JAX_PLATFORMS=cuda on a host without the CUDA plugin: one line, not a traceback
        check_same_config(flat_dict(cfg), cfg.run.step_timeout_seconds)
        watch.start()  # after the config check: processes started differently each say so themselves
        check_cache_folder(cfg.run.jax_cache_dir)  # joined and watched now (process 0 probes); before any compile
        run(cfg, clock=clock)
    except DistributedError as e:
        return EXIT_DISTRIBUTED, f"distributed start-up error: {e}"
    except (ConfigError, CheckpointError) as e:
        kind = "data" if isinstance(e, DataError) else "config" if isinstance(e, ConfigError) else "checkpoint"
        return EXIT_USER_ERROR, f"{kind} error: {e}"
    except CheckpointSaveError as e:
        return EXIT_SAVE_FAILED, f"checkpoint save error: {e} (exit code {EXIT_SAVE_FAILED})"
    except metrics.MetricsWriteError as e:
        return EXIT_SAVE_FAILED, f"metrics write error: {e} (exit code {EXIT_SAVE_FAILED})"
    except (OutOfMemory, jax.errors.JaxRuntimeError) as e:  # an allocation failed outside the loop's steps
        oom = e if isinstance(e, OutOfMemory) else out_of_memory(
            e, "while creating or loading the train state or compiling the step",
            f"for the state: {state_advice()}; for the step: {step_advice()}")
        if oom is None:
            raise
        return EXIT_OUT_OF_MEMORY, f"memory error: {oom} (exit code {EXIT_OUT_OF_MEMORY})"
    except TrainingStopped as e:
        log.error("%s (exit code %d)", e, e.exit_code)
        return e.exit_code, ""
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, compile, the final save)
        return EXIT_INTERRUPTED, (f"interrupted (Ctrl-C) outside the training loop: no new checkpoint (exit code "
                                  f"{EXIT_INTERRUPTED}); an unfinished save is set aside at the next start")
    except TerminatedOutsideLoop:
        return EXIT_PREEMPTED, (f"stopped by SIGTERM outside the training loop: no new checkpoint (exit code "
                                f"{EXIT_PREEMPTED}); an unfinished save is set aside at the next start")
    return EXIT_OK, ""


if __name__ == "__main__":  # .venv/bin/python -m tessera.train: as train.py at the repository's root
    from tessera.tools.cli import prepare_training_process

    prepare_training_process(sys.argv[1:])  # JAX is imported but has not started: a restart is still clean
    sys.exit(main(sys.argv[1:]))
