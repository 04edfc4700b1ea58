"""The loop's reading of each step's stats, one step late: a metrics record per step, and the
stop (or the skipped update's warning) when a step's loss or gradient is not finite."""

from __future__ import annotations

import logging
from typing import Any

import jax

from tessera import metrics
from tessera.checkpointing import Checkpointer
from tessera.config import Config
from tessera.hang_watchdog import HangWatchdog
from tessera.loop_records import Profiler, StepMeter
from tessera.stop_signals import TrainingStopped

log = logging.getLogger("tessera")

EXIT_NONFINITE = 3  # a non-finite loss or gradient with on_nonfinite_loss=stop (or skip_step, SKIPS_IN_A_ROW times)

# With on_nonfinite_loss=skip_step, this many non-finite steps in a row stop the run as `stop` does: a
# skipped step leaves the state as it was, so the same parameters failed on that many batches; they
# are broken (a finite but ruinous update, such as learning_rate=1e38, is not caught), not the data.
SKIPS_IN_A_ROW = 20

# Steps whose stats the loop leaves unread while the next step runs: 1 keeps the device busy (the
# host never waits for a step before dispatching the next); 0 reads each step's stats before the
# next is dispatched (the old loop; benchmarks/host_overhead.py compares the two).
METRICS_LAG = 1


class StatsReader:
    """The stats of dispatched steps the host has not read yet, read in step order: each becomes
    a metrics record, and a non-finite one stops the run (see check_finite)."""

    def __init__(self, cfg: Config, writer: metrics.MetricsWriter, meter: StepMeter, profiler: Profiler,
                 watchdog: HangWatchdog, ckpt: Checkpointer | None):
        self.cfg, self.writer, self.meter, self.profiler, self.watchdog, self.ckpt = (
            cfg, writer, meter, profiler, watchdog, ckpt)
        self.pending: list[tuple[int, Any]] = []
        self.skipped_since: int | None = None  # the first step of the current run of skipped steps

    def add(self, step: int, stats) -> None:
        self.pending.append((step, stats))

    def finish(self, keep: int = 0) -> None:
        """Read all but the newest `keep` pending steps."""
        while len(self.pending) > keep:
            step, stats = self.pending.pop(0)
            stats = jax.device_get(stats)  # waits for that step only
            self.watchdog.beat()
            self.writer.write(self.meter.record(step, stats))
            if self.profiler.active and step == self.profiler.last:  # the trace, written with no step in flight
                # (bounds_before): seconds to minutes, named if it outlasts step_timeout_seconds, not "no training step"
                with self.watchdog.allowing(f"writing the trace of steps {self.profiler.first}-{step} "
                                            "(profiler=xplane, fewer profiler_steps write less)", 0.0):
                    self.profiler.after_step(step)
                self.meter.restart_clock()  # its time is not the next step's
            if float(stats.get("tokens", 1)) == 0:
                log.warning("step %d: its batch holds no target token (every row padding, or documents of one token): "
                            "no update (loss and gradient norm 0 mean nothing here)", step)
            if bool(stats.get("spike", False)):
                warn_spike(self.cfg, step, stats)
            finite = bool(stats["finite"])
            self.skipped_since = None if finite else self.skipped_since or step
            check_finite(self.cfg, step, stats, self.ckpt, self.skipped_since)


def warn_spike(cfg: Config, step: int, stats: dict) -> None:
    """The line of a step whose update skip_step_on_spikes dropped: which value crossed which threshold."""
    o = cfg.optim
    crossed = [f"{name} {float(stats[key]):.4g} above {float(stats[limit]):.4g}" for name, key, limit in
               (("loss", "loss", "spike_loss_threshold"), ("gradient norm", "grad_norm", "spike_grad_norm_threshold"))
               if float(stats[key]) > float(stats[limit])]
    log.warning("step %d: %s (the mean + %g standard deviations of the last %d steps' values): update skipped "
                "(skip_step_on_spikes)", step, " and ".join(crossed), o.skip_step_scaling_factor, o.skip_step_interval)


def check_finite(cfg: Config, step: int, stats: dict, ckpt: Checkpointer | None,
                 skipped_since: int | None = None) -> None:
    """TrainingStopped (exit 3) for a non-finite step with on_nonfinite_loss=stop; with skip_step a
    warning, until SKIPS_IN_A_ROW steps in a row (since `skipped_since`) were skipped."""
    if bool(stats["finite"]):
        return
    what = f"non-finite loss ({float(stats['loss'])}) or gradient norm ({float(stats['grad_norm'])}) at step {step}"
    skip = cfg.run.on_nonfinite_loss == "skip_step"
    in_a_row = step - (skipped_since or step) + 1
    if skip and in_a_row < SKIPS_IN_A_ROW:
        log.warning("%s: update skipped (on_nonfinite_loss=skip_step)", what)
        return
    if skip:
        what = (f"{what}, the {in_a_row}th skipped step in a row (on_nonfinite_loss=skip_step): the parameters of step "
                f"{skipped_since - 1} fail on every batch, so they are broken, not the data")
    last = ckpt.latest_step() if ckpt else None
    where = f"last good checkpoint: step {last} at {ckpt.step_path(last)}" if last is not None else "no checkpoint yet"
    if skip and last is not None and last >= skipped_since - 1:
        where = (f"the checkpoints of step {skipped_since - 1} and later hold those parameters, the newest at "
                 f"{ckpt.step_path(last)}: set them aside to resume from an earlier one")
    raise TrainingStopped(f"{what}; stopping without saving ({where}). {stability_advice(cfg)}", EXIT_NONFINITE)


def stability_advice(cfg: Config) -> str:
    """What to change after a non-finite loss or gradient, with the values the run had."""
    o = cfg.optim
    clip = (f"lower gradient_clipping_threshold (now {o.gradient_clipping_threshold:g})"
            if o.gradient_clipping_threshold > 0 else "turn on gradient clipping (gradient_clipping_threshold=1.0; "
            "it is 0, off)")
    decay = o.learning_rate * o.adam_weight_decay
    decay = (f"; learning_rate x adam_weight_decay = {decay:g} >= 1 makes AdamW's weight decay flip the weights' sign "
             "every step: lower adam_weight_decay" if decay >= 1 else "")
    return (f"Lower learning_rate (now {o.learning_rate:g}), raise warmup_steps_fraction (now "
            f"{o.warmup_steps_fraction:g}) or {clip}"
            f"{'' if cfg.run.on_nonfinite_loss == 'skip_step' else ', or set on_nonfinite_loss=skip_step'}{decay}")
