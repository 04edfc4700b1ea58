"""What the training loop records: `StepMeter` turns a step's stats and wall time into a metrics
record (TFLOP/s, tokens/s, MFU against `tessera.hardware`'s peaks), `Profiler` captures a JAX
trace of a window of steps, and `RunClock` says where the run's wall time went (the report's
`time` and goodput). `tessera.train` drives all three."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from tessera import metrics
from tessera.config import Config
from tessera.hardware import peak_tflops

if TYPE_CHECKING:
    from tessera.step import Trainer

log = logging.getLogger("tessera")


class StepMeter:
    """Turns a step's stats and wall time into a metrics record (TFLOP/s, tokens/s, MFU)."""

    def __init__(self, trainer: Trainer):
        plan = trainer.plan
        self.device_kind = trainer.mesh.devices.flat[0].device_kind
        self.peak = peak_tflops(self.device_kind)
        if self.peak is None:
            log.info("device kind %r is not in the peak table: MFU is reported as unknown", self.device_kind)
        self.flops = metrics.training_flops_per_step(trainer.model.cfg, plan.global_batch, plan.max_target_length)
        self.tokens = plan.tokens_per_step
        self.devices = plan.num_devices
        self.last = time.perf_counter()

    def restart_clock(self) -> None:
        """The time until now belongs to no step: host work between steps (an evaluation, a
        checkpoint save; each logs its own time) is not counted in the next step's seconds."""
        self.last = time.perf_counter()

    def record(self, step: int, stats: dict) -> dict:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        tflops = self.flops / seconds / self.devices / 1e12
        # a non-finite loss or gradient: the step's update was dropped (on_nonfinite_loss), which a finite
        # loss with an infinite gradient norm would not show
        skipped = {} if bool(stats.get("finite", True)) else {"skipped": True}
        if bool(stats.get("spike", False)):  # skip_step_on_spikes dropped its update
            skipped.update(skipped=True, spike=True)
        if float(stats.get("tokens", 1)) == 0:  # no target token: no update either (its loss and norm are 0)
            skipped["no_targets"] = True
        return {
            "step": step, "loss": float(stats["loss"]), "grad_norm": float(stats["grad_norm"]),
            "learning_rate": float(stats["learning_rate"]), "step_seconds": seconds,
            "tflops_per_sec_per_device": tflops, "tokens_per_sec_per_device": self.tokens / seconds / self.devices,
            "mfu": None if self.peak is None else tflops / self.peak,
            # router loss, dropped tokens; the multi-token-prediction loss and its MoE blocks' figures; the z-loss
            **{k: float(v) for k, v in stats.items() if k.startswith(("moe_", "mtp_", "z_loss"))}, **skipped,
        }


class Profiler:
    """Captures an xplane trace of `profiler_steps` steps after the first
    `skip_first_n_steps_for_profiler` steps this run takes (counted from `start_step`, where a
    resumed run starts, as MaxText counts them). A window that begins after the run's last step
    is said once at the start: no trace would be written; so is one that the last step cuts short."""

    def __init__(self, cfg: Config, run_dir: Path, start_step: int = 0):
        p = cfg.profiler
        self.enabled = p.profiler == "xplane"
        self.first = start_step + p.skip_first_n_steps_for_profiler + 1
        self.last = self.first + p.profiler_steps - 1
        # each process traces its own devices; on one host they would write the same <host>.xplane.pb
        own = f"process_{jax.process_index()}" if jax.process_count() > 1 else ""
        self.dir, self.active = run_dir / "profile" / own if own else run_dir / "profile", False
        if self.enabled and self.first > cfg.run.steps:
            log.warning("profiler=xplane: no trace will be written: after skip_first_n_steps_for_profiler=%d the trace "
                        "would start at step %d, and the run ends at step %d (it starts after step %d); lower "
                        "skip_first_n_steps_for_profiler or raise steps", p.skip_first_n_steps_for_profiler,
                        self.first, cfg.run.steps, start_step)
        elif self.enabled and self.last > cfg.run.steps:
            log.warning("profiler=xplane: the trace will hold %d of profiler_steps=%d steps (%d-%d): the run ends "
                        "at step %d; raise steps or lower skip_first_n_steps_for_profiler for all of them",
                        cfg.run.steps - self.first + 1, p.profiler_steps, self.first, cfg.run.steps, cfg.run.steps)

    def before_step(self, step: int) -> bool:
        """Start the trace before its first step; True when it started (starting took time that is no step's)."""
        if self.enabled and step == self.first:
            try:
                jax.profiler.start_trace(str(self.dir))
            except RuntimeError as e:  # another trace running (JAX allows one); JaxRuntimeError is one too
                log.warning("profiler=xplane: the trace could not start (%s); training goes on without it", e)
                return False
            self.active = True
            return True
        return False

    def bounds_before(self, step: int) -> bool:
        """Whether the trace starts or ends before `step` is dispatched: the loop then reads the steps
        before it first (their stats arrive one step late), so that the trace holds exactly
        `profiler_steps` steps, not a part of the step before or after them too."""
        return (self.enabled and step == self.first) or (self.active and step == self.last + 1)

    def after_step(self, step: int) -> bool:
        """Stop the trace after its last step; True when it stopped (writing it took time that is no step's)."""
        if self.active and step == self.last:
            self.stop()
            return True
        return False

    def stop(self) -> None:
        """Write the trace. One that cannot be written (a full disk, `profile` a file) is a warning:
        it raised after the window's last step, a traceback, and again from the stop at the run's end."""
        if self.active:
            self.active = False
            try:
                jax.profiler.stop_trace()
            except RuntimeError as e:
                log.warning("profiler=xplane: the trace could not be written to %s (%s); training goes on "
                            "without it", self.dir, " ".join(str(e).split())[:300])
                return
            log.info("profile written to %s", self.dir)


class RunClock:
    """Where a run's wall time goes, phase by phase, on this process: a stopwatch that is always
    in exactly one phase, so the phases add up to the whole.

        setup       config, distributed start-up, mesh, model, input pipeline, checkpoint manager
        state       creating the train state, or reading it from a checkpoint
        compile     compiling the train step (and the evaluation step), the memory checks, the
                    run folder, the barrier after compiling
        training    the loop's steps: dispatching them, taking batches, reading metrics, logging
        evaluation  evaluations (also a resumed run's check of target_eval_loss at its start)
        checkpoint  the time saves held the loop up (a synchronous save, waiting for the previous
                    background save, the last save's wait at the end)

    `input_seconds` is the part of `training` the host spent taking batches from the input
    pipeline and placing them on the devices. The loop dispatches step N+1 before it reads step N's
    metrics, so batches are prepared while the devices compute; when `input_seconds` comes near
    `training_seconds`, the input pipeline sets the pace, not the devices. `goodput` is
    `training_seconds / total_seconds`, for this process and this attempt of the run. Steps that a
    restart trains again count in the attempt that trains them; `steps_redone` says how many
    (`steps_logged_after`)."""

    PHASES = ("setup", "state", "compile", "training", "evaluation", "checkpoint")

    def __init__(self, clock=time.perf_counter):
        self._now = clock
        self.start = self._mark = clock()
        self.phase = "setup"
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.input_seconds = 0.0
        self.steps_redone = 0

    def switch(self, phase: str) -> None:
        """From now on the time belongs to `phase`."""
        if phase not in self.seconds:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(self.PHASES)}")
        now = self._now()
        self.seconds[self.phase] += now - self._mark
        self.phase, self._mark = phase, now

    @contextlib.contextmanager
    def during(self, phase: str):
        """The block's time belongs to `phase`; afterwards the clock is back in the phase it was in."""
        previous = self.phase
        self.switch(phase)
        try:
            yield
        finally:
            self.switch(previous)

    @contextlib.contextmanager
    def taking_input(self):
        """The block's time is also counted as `input_seconds` (it stays in its phase)."""
        start = self._now()
        try:
            yield
        finally:
            self.input_seconds += self._now() - start

    def summary(self) -> dict:
        """The report's `time`: total and per-phase seconds, input_seconds and goodput, up to now."""
        self.switch(self.phase)
        total = self._mark - self.start
        return {"total_seconds": total, **{f"{p}_seconds": s for p, s in self.seconds.items()},
                "input_seconds": self.input_seconds, "steps_redone": self.steps_redone,
                "goodput": self.seconds["training"] / total if total > 0 else None}


def steps_logged_after(metrics_path: Path, start_step: int, tail_bytes: int = 1 << 16) -> int:
    """How many steps after `start_step` an earlier attempt of this run logged to its metrics file:
    steps it trained and lost with its process before they were saved, which this attempt trains
    again. Read from the file's last `tail_bytes` (the newest records; a long run's file is not
    read whole); 0 without a file, or for a pipe or device (metrics_file=/dev/stdout: a named pipe
    would block the read until it had a writer, /dev/full reads zeros for ever)."""
    if not metrics_path.is_file():
        return 0
    try:
        with open(metrics_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    last = start_step
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the first line of the tail, cut in the middle; a line cut by a crash
            continue
        if isinstance(record, dict) and "loss" in record and isinstance(record.get("step"), int):
            last = max(last, record["step"])
    return last - start_step


# taking batches for at least this share of the training time (and at least a second of it) gets a warning
INPUT_BOUND_SHARE = 0.5


def input_bound_warning(summary: dict, dataset_type: str) -> str | None:
    """A warning when taking batches held the loop up for INPUT_BOUND_SHARE or more of the
    training time (`RunClock.summary()`), with what to change for `dataset_type`; else None."""
    taking, training = summary["input_seconds"], summary["training_seconds"]
    if training <= 0 or taking < 1.0 or taking < INPUT_BOUND_SHARE * training:
        return None
    if dataset_type in ("grain", "tfds"):
        advice = "raise grain_worker_count (processes that read and tokenize records beside training)"
    elif dataset_type == "hf":
        advice = ("hf tokenizes in the training process; Parquet or ArrayRecord files read with dataset_type=grain "
                  "are tokenized by grain_worker_count worker processes")
    else:
        advice = "make the input pipeline cheaper or give it more processes"
    return (f"taking batches took {taking:.1f} s of the {training:.1f} s of training ({taking / training:.0%}): the "
            f"input pipeline ({dataset_type}), not the devices, set the pace of this run; {advice}")


def time_line(summary: dict) -> str:
    """One log line of `RunClock.summary()`: the phases that took time, largest first."""
    parts = sorted(((summary[f"{p}_seconds"], p) for p in RunClock.PHASES if p != "training"), reverse=True)
    rest = ", ".join(f"{name} {seconds:.1f} s" for seconds, name in parts if seconds >= 0.05)
    goodput, redone = summary["goodput"], summary["steps_redone"]
    return (f"time: {summary['total_seconds']:.1f} s in all; training {summary['training_seconds']:.1f} s "
            f"(goodput {'n/a' if goodput is None else f'{goodput:.0%}'}; taking batches "
            f"{summary['input_seconds']:.1f} s of it{f'; {redone} step(s) trained again' if redone else ''})"
            f"{', ' + rest if rest else ''}")
