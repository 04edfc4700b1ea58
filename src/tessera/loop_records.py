"""What the training loop records per step: `StepMeter` turns a step's stats and wall time into
a metrics record (TFLOP/s, tokens/s, MFU against `tessera.hardware`'s peaks), and `Profiler`
captures a JAX trace of a window of steps. `tessera.train` drives both."""

from __future__ import annotations

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
        return {
            "step": step, "loss": float(stats["loss"]), "grad_norm": float(stats["grad_norm"]),
            "learning_rate": float(stats["learning_rate"]), "step_seconds": seconds,
            "tflops_per_sec_per_device": tflops, "tokens_per_sec_per_device": self.tokens / seconds / self.devices,
            "mfu": None if self.peak is None else tflops / self.peak,
            # router loss, dropped tokens; the multi-token-prediction loss and its MoE blocks' figures
            **{k: float(v) for k, v in stats.items() if k.startswith(("moe_", "mtp_"))},
        }


class Profiler:
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
