"""Evaluation during training: every `eval_interval` steps, the mean token loss over `eval_steps`
batches of the eval stream (or all of it with `eval_steps=-1`), and its perplexity exp(loss).

Every evaluation reads the same batches from the start of the eval stream, so the numbers of
two evaluations differ only because the parameters changed. Padding rows at the end of the eval
data carry no targets and do not count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax

from tessera.config import ConfigError, DataConfig
from tessera.data import make_input, place_batch
from tessera.step import Trainer, abstract_state, batch_shapes, loss_sums


class Evaluator:
    """Built once at start-up (so a bad eval set fails before training); `compile()` compiles its
    step from shapes (so that a compile error, too, comes before training, and no compile runs
    inside the loop); `run(params)` evaluates. `eval_steps` was checked with the rest of the
    config (`tessera.config.checks.validate`)."""

    def __init__(self, cfg: DataConfig, trainer: Trainer):
        self.trainer, self.steps = trainer, cfg.eval_steps
        self.data = make_input(cfg, trainer.model.cfg.vocab_size, trainer.plan.global_batch, split="eval")
        self.start = self.data.get_state()
        model, packed = trainer.model, trainer.plan.packed
        self.step_fn = jax.jit(lambda params, batch: loss_sums(model, params, batch, None, packed))

    def compile(self) -> float:
        """Compile the eval step for the train state's parameters and a batch; the seconds it took."""
        trainer, start = self.trainer, time.perf_counter()
        with jax.set_mesh(trainer.mesh):
            self.step_fn = self.step_fn.lower(abstract_state(trainer)["params"], batch_shapes(trainer)).compile()
        return time.perf_counter() - start

    def run(self, step: int, params, beat: Callable[[], None] = lambda: None) -> dict:
        """{'step', 'eval_loss', 'eval_perplexity', 'eval_tokens', 'eval_batches', 'eval_seconds'};
        `beat()` after each batch (the hang watchdog's: a long evaluation is not a hung step)."""
        start = time.perf_counter()
        self.data.set_state(self.start)
        loss_sum, count, batches = 0.0, 0.0, 0
        with jax.set_mesh(self.trainer.mesh):
            for host_batch in self.data:
                batch = place_batch(self.data, host_batch, self.trainer.batch_sharding,
                                    self.trainer.plan.global_batch)
                l, n = jax.device_get(self.step_fn(params, batch))
                loss_sum, count, batches = loss_sum + float(l), count + float(n), batches + 1
                beat()
                if batches == self.steps:
                    break
        if count == 0:
            raise ConfigError("the eval data holds no target tokens (every document is shorter than 2 tokens?); "
                              "check hf_eval_files / eval_split")
        loss = loss_sum / count
        return {"step": step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
                "eval_tokens": int(count), "eval_batches": batches, "eval_seconds": time.perf_counter() - start}
