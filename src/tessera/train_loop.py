"""The loop over a run's steps (`TrainLoop`): each step dispatched before the previous one's
metrics are read, then evaluation, checkpoint saves and a stop on SIGTERM or SIGINT, under the hang
watchdog; a step that fails on the device ends the run (or, in a multi-process job, this process)
with one message. `tessera.train` builds everything the loop needs and writes the report after it.
"""

from __future__ import annotations

import logging

import jax

from tessera import metrics
from tessera.checkpointing import Checkpointer, save_allowance_seconds
from tessera.config import Config
from tessera.data import place_batch, state_to_save
from tessera.hang_watchdog import HangWatchdog
from tessera.evaluation import Evaluator, at_target
from tessera.job_failure import follow_earlier_failure
from tessera.loop_records import Profiler, RunClock, StepMeter
from tessera.memory_fit import EXIT_OUT_OF_MEMORY, local_devices, out_of_memory, state_bytes
from tessera.start_state import saved_config_entries
from tessera.step import Trainer
from tessera.step_stats import METRICS_LAG, StatsReader
from tessera.stop_signals import StopSignal, stop_after_signal

log = logging.getLogger("tessera")


class TrainLoop:
    """The steps after `start_step` up to `steps`: each one's metrics (read one step late, see
    METRICS_LAG), finite check, evaluation, checkpoint and stop on SIGTERM or SIGINT, under the
    hang watchdog; `clock` gets the time of evaluations, saves and taking batches."""

    def __init__(self, cfg: Config, trainer: Trainer, ckpt: Checkpointer | None, data, evaluator: Evaluator | None,
                 writer: metrics.MetricsWriter, meter: StepMeter, profiler: Profiler, clock: RunClock):
        self.cfg, self.trainer, self.ckpt, self.data, self.evaluator = cfg, trainer, ckpt, data, evaluator
        self.writer, self.meter, self.profiler = writer, meter, profiler
        self.config_json = saved_config_entries(cfg, trainer.plan.global_batch)
        self.clock = clock
        # a save blocks the loop (a synchronous one, or one waiting for the previous save) for longer than a step
        self.save_allowance = save_allowance_seconds(local_state_bytes(trainer))

    def run(self, step_fn, state: dict, start_step: int) -> None:
        cfg, trainer, step = self.cfg, self.trainer, start_step
        try:
            with StopSignal() as stop, HangWatchdog(cfg.run.step_timeout_seconds) as watchdog:
                stats = StatsReader(cfg, self.writer, self.meter, self.profiler, watchdog, self.ckpt)
                for step in range(start_step + 1, cfg.run.steps + 1):
                    if self.profiler.bounds_before(step):  # the steps before the trace starts or ends are done
                        stats.finish()
                    if self.profiler.before_step(step):
                        self.meter.restart_clock()  # starting the trace is no step's time
                    with self.clock.taking_input():
                        batch = place_batch(self.data, next(self.data), trainer.batch_sharding,
                                            trainer.plan.global_batch)
                    state, step_stats = step_fn(state, batch)
                    # The step runs on the device while the host reads the previous step's stats and
                    # prepares the next batch: metrics are logged one step late (METRICS_LAG).
                    stats.add(step, step_stats)
                    stats.finish(keep=METRICS_LAG)
                    if self._after_step(step, state, stats, stop, watchdog):
                        break  # target_eval_loss reached
                if self.ckpt:  # the last save's background write, watched like the saves before it
                    with watchdog.allowing(f"checkpoint save of step {step}", self.save_allowance), \
                            self.clock.during("checkpoint"):
                        self.ckpt.wait()
        except jax.errors.JaxRuntimeError as e:  # a collective whose peer is gone raised instead of hanging
            _step_failed(step, e, watchdog)

    def _after_step(self, step: int, state: dict, stats: StatsReader, stop: StopSignal,
                    watchdog: HangWatchdog) -> bool:
        """Evaluate, save, stop on a signal; True when this step's evaluation reached target_eval_loss
        (saved, the run ends here)."""
        cfg, ckpt, last = self.cfg, self.ckpt, step == self.cfg.run.steps
        evaluating = self.evaluator and (step % cfg.data.eval_interval == 0 or last)
        stopping = stop.stop_after(step)
        saving = ckpt and (step % cfg.checkpoint.checkpoint_period == 0 or last or stopping)
        if evaluating or saving or stopping or last:
            stats.finish()  # a non-finite step stops the run before anything is evaluated or saved
        if saving and not (last or stopping) and stats.skipped_since is not None:
            # skip_step: the state is that of before the skips, which may be broken (a run of them): periodic saves
            # of it would push the good checkpoints out (max_num_checkpoints_to_keep): the next period saves
            log.warning("step %d was skipped (non-finite, on_nonfinite_loss=skip_step): its periodic checkpoint is left "
                        "out, so that skipped steps never replace good checkpoints", step)
            saving = False
        reached = False
        if evaluating:
            # a signal during a long evaluation must not eat into a preemption's grace period: the
            # evaluation breaks off (every process of a job after the same batch) and the step is saved
            with self.clock.during("evaluation"):
                record = self.evaluator.run(step, state["params"], watchdog.beat,
                                            interrupted=stop.interrupts_evaluation(step))
            stopping = stop.stop_after(step)  # a signal during the evaluation stops after this step
            saving = saving or bool(ckpt and stopping)
            evaluating = record is not None
        if evaluating:
            self.writer.write_eval(record)
            reached = at_target(cfg.data, record["eval_loss"])
            if reached and not last:
                self.writer.ends_at(step)
                log.info("eval loss %.4f is at or below target_eval_loss=%g: stopping at step %d of %d%s",
                         record["eval_loss"], cfg.data.target_eval_loss, step, cfg.run.steps,
                         " (checkpoint saved)" if ckpt else "")
            saving = saving or (ckpt and reached)
        if stopping:  # its line (log_period may have left it out) before its checkpoint's
            self.writer.ends_at(step)
        if saving:
            with watchdog.allowing(f"checkpoint save of step {step}", self.save_allowance), \
                    self.clock.during("checkpoint"):
                data_state = state_to_save(self.data, step, cfg.run.step_timeout_seconds)
                ckpt.save(step, state, data_state, self.config_json)  # raises if the previous save failed
        elif ckpt:
            ckpt.check()  # a background save that failed stops the run now, not at the next save
        if evaluating or saving:  # every dispatched step was read above: the next one's time starts now
            self.meter.restart_clock()
        if stopping:
            with watchdog.allowing(f"checkpoint save of step {step}", self.save_allowance), \
                    self.clock.during("checkpoint"):
                stop_after_signal(step, stop, ckpt)
        return reached


def _step_failed(step: int, error: jax.errors.JaxRuntimeError, watchdog: HangWatchdog) -> None:
    """A step that raised on the device: out of memory (exit 7), or on a multi-process job a
    collective whose peer is gone (the watchdog ends this process, exit 5)."""
    oom = out_of_memory(error, f"at step {step}")
    if jax.process_count() == 1 and oom:
        raise oom from None
    if jax.process_count() == 1:
        raise error
    follow_earlier_failure()  # a peer that stopped with an error of its own: its code and line, not "lost peer"
    if oom:  # the other processes stop in their next collective, by their watchdogs
        watchdog.fail(str(oom), exit_code=EXIT_OUT_OF_MEMORY, kind="memory error")
    watchdog.fail(_failed_step_message(step, error))


def _failed_step_message(step: int, error: Exception) -> str:
    """What the survivors of a multi-process job say when a step raises instead of hanging."""
    said = " ".join(str(error).split())[:400]
    saved = getattr(error, "tessera_save_step", None)  # set by the checkpointer: its save's collective raised
    what = f"step {step}" if saved is None else f"the checkpoint save of step {saved}"
    where = "on the device or in a collective" if saved is None else "in a collective"
    return (f"{what} of this {jax.process_count()}-process job failed {where} "
            f"(JAX said: {said}). Most often another process of the job died or lost its network: its log says "
            "why. Ending this process now rather than in JAX's shutdown barrier, which would wait for the lost "
            "process and then abort")


def local_state_bytes(trainer: Trainer) -> int:
    """Bytes of the train state on this process's devices (the most of it this process saves)."""
    return sum(state_bytes(trainer).values()) * len(local_devices(trainer.mesh))
