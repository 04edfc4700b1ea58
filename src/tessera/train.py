"""The training loop, top to bottom: config -> mesh -> model and sharded state -> input ->
compiled step -> loop with metrics and checkpoints -> report.
`python3 train.py configs/base.yml key=value ...`.

Exit codes (also in getting_started/Checkpointing.md): 0 finished; 2 bad config or unusable
checkpoint (nothing was written); 3 non-finite loss or gradient with on_nonfinite_loss=stop;
4 multi-process start-up failed; 5 hang watchdog (no step within step_timeout_seconds);
143 stopped by SIGTERM after saving a checkpoint (128 + 15, the usual status of a SIGTERM).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from tessera import metrics
from tessera.checkpointing import (
    Checkpointer, CheckpointError, checkpoint_directory, load_full_state, load_parameters,
)
from tessera.config import Config, ConfigError, changed_keys, config_digest, flat_dict, load_config
from tessera.data import make_input, place_batch
from tessera.distributed import EXIT_DISTRIBUTED, DistributedError, HangWatchdog, initialize
from tessera.evaluation import Evaluator
from tessera.mesh import sharding_report
from tessera.step import (  # noqa: F401 - re-exported: the public face of the trainer
    Trainer, abstract_state, compile_step, create_state, device_batch, loss_sums, make_train_step, setup,
    state_from_params,
)

log = logging.getLogger("tessera")

EXIT_OK, EXIT_USER_ERROR, EXIT_NONFINITE, EXIT_PREEMPTED = 0, 2, 3, 143


class TrainingStopped(Exception):
    """The run ended early on purpose; `exit_code` says why."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class _StopSignal:
    """Turns SIGTERM into a flag the loop checks between steps (the step in flight finishes)."""

    def __init__(self):
        self.received = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: leave signal handling to the caller
            self._previous = None
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM received: finishing this step, then saving a checkpoint and exiting")
        self.received = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# --------------------------------------------------------------------------- the run


def run(cfg: Config, devices=None) -> dict[str, Any]:
    """Train until `cfg.run.steps`; returns the run report (also written as report.json).

    Nothing is written until the mesh, the input pipeline and the starting state are known good:
    a run that fails before its first step leaves no run folder behind."""
    # ---- mesh, model, shardings
    trainer = setup(cfg, devices)
    ckpt = None
    if cfg.checkpoint.enable_checkpointing:
        ckpt = Checkpointer(cfg.checkpoint, checkpoint_directory(cfg.checkpoint, cfg.run.base_output_directory,
                                                                 cfg.run.run_name))
    try:
        # a finished run stops here, before reading its checkpoint or compiling anything
        done = _nothing_to_do(cfg, ckpt.latest_step() if ckpt else None)
        if done is not None:
            return done
        _log_shardings(cfg, trainer)
        return _train(cfg, trainer, ckpt)
    finally:
        if ckpt:
            ckpt.close()


def _log_shardings(cfg: Config, trainer: Trainer) -> None:
    """The table of parameters (path, shape, sharding), and large parameters left replicated."""
    rows, warnings = sharding_report(trainer.mesh, trainer.state_shardings["params"], trainer.model.param_shapes(),
                                     cfg.mesh.param_replication_warn_mib)
    log.info("parameters (path, shape, sharding):\n  %s", "\n  ".join(rows))
    for w in warnings:
        log.warning(w)


def _nothing_to_do(cfg: Config, step: int | None) -> dict[str, Any] | None:
    """An empty report (and a log line) when the run is already at `steps`; None otherwise."""
    if step is None or step < cfg.run.steps:
        return None
    log.info("nothing to do: the run is already at step %d of %d", step, cfg.run.steps)
    return metrics.run_report([], cfg.run.report_warmup_steps, run_name=cfg.run.run_name, start_step=step)


def _create_run_folder(cfg: Config) -> Path:
    """base_output_directory/run_name with the full final config in config.yml."""
    run_dir = Path(cfg.run.base_output_directory) / cfg.run.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        (run_dir / "config.yml").write_text(yaml.safe_dump(flat_dict(cfg), sort_keys=False))
    log.info("run %s -> %s (full config in config.yml, digest %s)", cfg.run.run_name, run_dir, config_digest(cfg))
    return run_dir


def _train(cfg: Config, trainer: Trainer, ckpt: Checkpointer | None) -> dict[str, Any]:
    # ---- input and state (fresh, loaded or resumed): their errors come before anything is written
    data = make_input(cfg.data, cfg.model.vocab_size, trainer.global_batch)
    evaluator = Evaluator(cfg, trainer) if cfg.data.eval_interval else None
    state = initial_state(trainer, ckpt, data)
    start_step = int(jax.device_get(state["step"]))
    done = _nothing_to_do(cfg, start_step)  # e.g. load_full_state_path at or past `steps`
    if done is not None:
        return done
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    log.info("%s parameters, global batch %d x %d tokens", f"{n_params:,}", trainer.global_batch,
             cfg.data.max_target_length)

    # ---- run folder, compiled step
    run_dir = _create_run_folder(cfg)
    step_fn, compile_seconds = compile_step(trainer, cfg.run.init_weights_seed)
    log.info("train step compiled in %.1f s", compile_seconds)

    # ---- loop: step, metrics, finite check, checkpoint, SIGTERM
    writer = metrics.MetricsWriter(
        Path(cfg.run.metrics_file) if cfg.run.metrics_file else run_dir / "metrics.jsonl",
        run_dir / "tensorboard" if cfg.run.enable_tensorboard else None, cfg.run.log_period,
        write_files=jax.process_index() == 0)
    meter, profiler, config_json = _StepMeter(cfg, trainer), _Profiler(cfg, run_dir), flat_dict(cfg)
    try:
        with _StopSignal() as stop, HangWatchdog(cfg.run.step_timeout_seconds) as watchdog:
            for step in range(start_step + 1, cfg.run.steps + 1):
                profiler.before_step(step)
                state, stats = step_fn(state, place_batch(data, next(data), trainer.batch_sharding,
                                                          trainer.global_batch))
                stats = jax.device_get(stats)
                watchdog.beat()
                writer.write(meter.record(step, stats))
                profiler.after_step(step)
                _check_finite(cfg, step, stats, ckpt)
                if evaluator and (step % cfg.data.eval_interval == 0 or step == cfg.run.steps):
                    writer.write_eval(evaluator.run(step, state["params"]))
                    watchdog.beat()
                if ckpt and (step % cfg.checkpoint.checkpoint_period == 0 or step == cfg.run.steps or stop.received):
                    ckpt.save(step, state, data.get_state(), config_json)
                if stop.received:
                    _stop_after_sigterm(step, ckpt)
    finally:
        profiler.stop()
        writer.close()
    return _write_report(cfg, trainer, writer, meter, run_dir, n_params, compile_seconds, start_step)


def _write_report(cfg: Config, trainer: Trainer, writer: metrics.MetricsWriter, meter: _StepMeter, run_dir: Path,
                  n_params: int, compile_seconds: float, start_step: int) -> dict[str, Any]:
    """The run report: logged, written as report.json (process 0) and returned."""
    report = metrics.run_report(
        writer.records, cfg.run.report_warmup_steps, run_name=cfg.run.run_name, config_digest=config_digest(cfg),
        device_kind=meter.device_kind, num_devices=trainer.mesh.size, mesh=dict(trainer.mesh.shape),
        peak_tflops_per_device=meter.peak, flops_per_step=meter.flops, num_parameters=n_params,
        compile_seconds=compile_seconds, attention_kernel=trainer.model.attention_kernel,
        global_batch=trainer.global_batch, max_target_length=cfg.data.max_target_length, start_step=start_step,
        final_eval_loss=writer.eval_records[-1]["eval_loss"] if writer.eval_records else None,
    )
    if jax.process_index() == 0:
        (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    log.info("done: final loss %.4f, median %.3f s/step; report %s", report["final_loss"], report["step_seconds"],
             run_dir / "report.json")
    return report


def _stop_after_sigterm(step: int, ckpt: Checkpointer | None) -> None:
    if ckpt is None:
        raise TrainingStopped(f"stopped by SIGTERM after step {step} (checkpointing is off: nothing saved)",
                              EXIT_PREEMPTED)
    ckpt.wait()
    raise TrainingStopped(f"stopped by SIGTERM after step {step}; checkpoint {ckpt.step_path(step)}", EXIT_PREEMPTED)


def initial_state(trainer: Trainer, ckpt: Checkpointer | None, data) -> dict:
    """Resume from this run's newest checkpoint, else load_full_state_path, load_parameters_path or init."""
    cfg = trainer.cfg.checkpoint
    latest = ckpt.latest_step() if ckpt else None
    if latest is not None:
        state, data_state = ckpt.restore(latest, abstract_state(trainer))
        if data_state:
            data.set_state(data_state)
        log.info("resuming from step %d: %s", latest, ckpt.step_path(latest))
        return state
    if cfg.load_full_state_path:
        state = load_full_state(cfg.load_full_state_path, abstract_state(trainer), key="load_full_state_path")
        step = int(jax.device_get(state["step"]))
        data.set_state({"step": step})
        log.info("loaded full state at step %d from %s", step, cfg.load_full_state_path)
        return state
    if cfg.load_parameters_path:
        params = load_parameters(cfg.load_parameters_path, abstract_state(trainer)["params"],
                                 key="load_parameters_path")
        log.info("loaded parameters from %s (fresh optimizer state, step 0)", cfg.load_parameters_path)
        return state_from_params(trainer, params)
    return create_state(trainer, trainer.cfg.run.init_weights_seed)


def _check_finite(cfg: Config, step: int, stats: dict, ckpt: Checkpointer | None) -> None:
    if bool(stats["finite"]):
        return
    what = f"non-finite loss ({float(stats['loss'])}) or gradient norm ({float(stats['grad_norm'])}) at step {step}"
    if cfg.run.on_nonfinite_loss == "skip_step":
        log.warning("%s: update skipped (on_nonfinite_loss=skip_step)", what)
        return
    last = ckpt.latest_step() if ckpt else None
    where = f"last good checkpoint: step {last} at {ckpt.step_path(last)}" if last is not None else "no checkpoint yet"
    raise TrainingStopped(
        f"{what}; stopping without saving ({where}). Lower learning_rate, raise warmup_steps_fraction or "
        "gradient_clipping_threshold, or set on_nonfinite_loss=skip_step", EXIT_NONFINITE)


class _StepMeter:
    """Turns a step's stats and wall time into a metrics record (TFLOP/s, tokens/s, MFU)."""

    def __init__(self, cfg: Config, trainer: Trainer):
        self.device_kind = trainer.mesh.devices.flat[0].device_kind
        self.peak = metrics.peak_tflops(self.device_kind)
        if self.peak is None:
            log.info("device kind %r is not in the peak table: MFU is reported as unknown", self.device_kind)
        self.flops = metrics.training_flops_per_step(cfg.model, trainer.global_batch, cfg.data.max_target_length)
        self.tokens = trainer.global_batch * cfg.data.max_target_length
        self.devices = trainer.mesh.size
        self.last = time.perf_counter()

    def record(self, step: int, stats: dict) -> dict:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        tflops = self.flops / seconds / self.devices / 1e12
        return {
            "step": step, "loss": float(stats["loss"]), "grad_norm": float(stats["grad_norm"]),
            "learning_rate": float(stats["learning_rate"]), "step_seconds": seconds,
            "tflops_per_sec_per_device": tflops, "tokens_per_sec_per_device": self.tokens / seconds / self.devices,
            "mfu": None if self.peak is None else tflops / self.peak,
            **{k: float(v) for k, v in stats.items() if k.startswith("moe_")},  # router loss, dropped tokens
        }


class _Profiler:
    """Captures an xplane trace of `profiler_steps` steps after `skip_first_n_steps_for_profiler`."""

    def __init__(self, cfg: Config, run_dir: Path):
        p = cfg.profiler
        self.enabled = p.profiler == "xplane"
        self.first = p.skip_first_n_steps_for_profiler + 1
        self.last = self.first + p.profiler_steps - 1
        self.dir, self.active = run_dir / "profile", False

    def before_step(self, step: int) -> None:
        if self.enabled and step == self.first:
            jax.profiler.start_trace(str(self.dir))
            self.active = True

    def after_step(self, step: int) -> None:
        if self.active and step == self.last:
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            log.info("profile written to %s", self.dir)


def format_changed_keys(cfg: Config) -> str:
    """`key=value, ...` for the keys that differ from configs/base.yml (the full config goes to config.yml)."""
    changed = changed_keys(cfg)
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in changed.items()) or "none"


def main(argv: list[str]) -> int:
    from tessera.tools.cli import exit_if_help, train_help

    exit_if_help(argv, train_help)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S",
                        force=True)
    logging.getLogger("jax").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
    try:
        cfg = load_config(argv)
        from tessera.gpu_tuning import apply_gpu_tuning  # before any device use: JAX reads these at start-up
        apply_gpu_tuning(cfg.gpu)
        if not cfg.run.run_name:
            cfg.run.run_name = time.strftime("run_%Y%m%d_%H%M%S")
        log.info("config (differs from base.yml): %s", format_changed_keys(cfg))
        initialize()
        run(cfg)
    except DistributedError as e:
        print(f"distributed start-up error: {e}", file=sys.stderr)
        return EXIT_DISTRIBUTED
    except (ConfigError, CheckpointError) as e:
        print(f"{'config' if isinstance(e, ConfigError) else 'checkpoint'} error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingStopped as e:
        log.error("%s (exit code %d)", e, e.exit_code)
        return e.exit_code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
