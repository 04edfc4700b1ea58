"""Evaluation during training: every `eval_interval` steps, the mean token loss over `eval_steps`
batches of the eval stream (or all of it with `eval_steps=-1`), and its perplexity exp(loss).

Every evaluation reads the same batches from the start of the eval stream, so the numbers of
two evaluations differ only because the parameters changed. Padding rows at the end of the eval
data carry no targets and do not count. Where each process reads its own share of the eval files,
a share that ends first goes on as padding batches until every share has ended (`_batches`).

With multi-token prediction (mtp_num_layers) it also reports `eval_mtp_loss`, the mean over
depths of each depth's mean cross-entropy on the eval tokens (unscaled, as `mtp_loss` in
training), and with mtp_eval_target_module=k `eval_mtp_acceptance_rate_percent`: at the
positions whose chain of targets stays in the document, how often depth k's greedy guess of the
token k+1 places ahead equals the main model's greedy guess of that token from k positions
later (both given the true tokens). Speculative decoding with depth k as the draft would accept
its guess that often.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tessera import host_malloc
from tessera.compile_cache import cache_hits, loaded_note, unloadable_programs_unsaved
from tessera.config import ConfigError, DataConfig
from tessera.data import make_input, place_batch
from tessera.data.packing import stack_rows
from tessera.losses import cross_entropy_sum, cross_entropy_sum_and_greedy, greedy_tokens, mtp_depths, target_weights
from tessera.memory_fit import HostBuffers, check_eval_fits
from tessera.models import ModelDef
from tessera.models.mtp import chain_weights, shift_left
from tessera.step import Trainer, abstract_state, batch_shapes


def eval_sums(model: ModelDef, params, batch, packed: bool = False) -> dict:
    """One eval batch's sums, to be added over batches: "loss_sum" and "count" (`loss_sums`); with
    mtp_num_layers, "mtp_loss_sums" and "mtp_counts" [D]; with mtp_eval_target_module k,
    "mtp_accepted" (positions where depth k's greedy token equals the main model's k positions
    later) and "mtp_offered" (positions counted)."""
    cfg = model.cfg
    tokens, segments = batch["tokens"], batch["segment_ids"]
    targets, weights = tokens[:, 1:], target_weights(segments)
    x_btd, _ = model.hidden_with_aux(params, tokens[:, :-1], batch["positions"][:, :-1], segments[:, :-1],
                                     None, packed=packed)
    main_fn = lambda x: model.logits(params, x)  # noqa: E731
    k = cfg.mtp_eval_target_module
    if k:  # the main model's greedy tokens too, from the same logits
        loss_sum, main = cross_entropy_sum_and_greedy(main_fn, x_btd, targets, weights, cfg.num_vocab_tiling)
    else:
        loss_sum = cross_entropy_sum(main_fn, x_btd, targets, weights, cfg.num_vocab_tiling)
    sums = {"loss_sum": loss_sum, "count": jnp.sum(weights).astype(jnp.float32),
            "rows": jnp.sum(segments[:, 0] > 0).astype(jnp.float32)}  # rows holding data (padding rows: 0)
    if not cfg.mtp_num_layers:
        return sums
    hiddens, _, sums["mtp_loss_sums"], sums["mtp_counts"] = mtp_depths(model, params, x_btd, batch, None, packed)
    if k:
        draft = greedy_tokens(lambda x: model.logits(params, x, k), hiddens[k - 1], cfg.num_vocab_tiling)
        offered = chain_weights(weights, k)
        sums["mtp_accepted"] = jnp.sum(offered & (draft == shift_left(main, k))).astype(jnp.float32)
        sums["mtp_offered"] = jnp.sum(offered).astype(jnp.float32)
    return sums

log = logging.getLogger("tessera")

NO_TARGETS = ("the eval data holds no target tokens (every document is shorter than 2 tokens?); check hf_eval_files "
              "/ grain_eval_files / eval_split")


def perplexity(loss: float) -> float:
    """exp(loss); inf past float64's range (a loss above about 709, written as null to metrics.jsonl), where
    exp(min(loss, 700)) reported 1.01e304 for any such loss, an infinite one too."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def at_target(cfg: DataConfig, eval_loss: float) -> bool:
    """Whether an evaluation's loss ends the run: target_eval_loss is set and the loss is at or below it."""
    return bool(cfg.target_eval_loss) and eval_loss <= cfg.target_eval_loss


def eval_step(trainer: Trainer):
    """The jitted eval step (params, batch) -> `eval_sums`."""
    model, packed = trainer.model, trainer.plan.packed

    def eval_step_sums(params, batch):  # its name is the compiled program's (jit_eval_step_sums)
        return eval_sums(model, params, batch, packed)

    return jax.jit(eval_step_sums)


def compile_eval_step(trainer: Trainer, jitted=None):
    """`eval_step` (or `jitted`) compiled for the train state's parameters and an eval batch
    (plan.eval_batch sequences), from shapes alone: on the trainer's devices, or ahead of time for
    a TPU topology (`tessera.train_compile`)."""
    with jax.set_mesh(trainer.mesh), unloadable_programs_unsaved(trainer.mesh):
        return (jitted or eval_step(trainer)).lower(abstract_state(trainer)["params"],
                                                    batch_shapes(trainer, trainer.plan.eval_batch)).compile()


class Evaluator:
    """Built once at start-up (so a bad eval set fails before training); `compile()` compiles its
    step from shapes (so that a compile error, too, comes before training, and no compile runs
    inside the loop); `run(params)` evaluates. A batch holds `plan.eval_batch` sequences
    (eval_per_device_batch_size). `eval_steps` was checked with the rest of the config
    (`tessera.config.checks.validate`)."""

    def __init__(self, cfg: DataConfig, trainer: Trainer):
        self.trainer, self.cfg, self.steps = trainer, cfg, cfg.eval_steps
        self.data = make_input(cfg, trainer.model.cfg.vocab_size, trainer.plan.eval_batch, split="eval",
                               sharding=trainer.batch_sharding)
        self.start = self.data.get_state()
        self._check_targets()
        self.step_fn = eval_step(trainer)
        self.compiled = False
        self.said_short = False  # the eval data ended before eval_steps batches (said once)

    def _check_targets(self) -> None:
        """ConfigError at start-up when the batches an evaluation reads hold no target token (every
        document shorter than 2 tokens), found on the host, reading only as far as the first target:
        the evaluation's own check came after `eval_interval` steps of training, before that step's
        checkpoint was saved. With several processes reading their own shares, any process's
        target will do."""
        found = False
        for batches, batch in enumerate(self.data, start=1):
            segments = batch["segment_ids"]
            if np.any(target_weights(segments)):
                found = True
                break
            if batches == self.steps:
                break
        self.data.set_state(self.start)
        if getattr(self.data, "process_local", False) and jax.process_count() > 1:
            from jax.experimental import multihost_utils

            found = bool(np.any(multihost_utils.process_allgather(np.array(found))))
        if not found:
            raise ConfigError(NO_TARGETS)

    def compile(self, saves: HostBuffers = HostBuffers()) -> None:
        """Compile the eval step for the train state's parameters and a batch (once), and log how
        long it took. OutOfMemory (`check_eval_fits`) when its temporaries cannot fit beside the
        train state and `saves` (what an asynchronous save may hold on the host meanwhile)."""
        if not self.compiled:
            start, hits = time.perf_counter(), cache_hits()
            with host_malloc.returning_freed_memory():  # the compiler's memory is not the steps' to reuse
                self.step_fn = compile_eval_step(self.trainer, self.step_fn)
            log.info("eval step compiled in %.1f s%s", time.perf_counter() - start, loaded_note(hits))
            self.compiled = True
        check_eval_fits(self.step_fn, self.trainer, saves)

    def at_target_already(self, start_step: int, params) -> bool:
        """A resumed run with target_eval_loss evaluates its starting state first: True when that is
        at the target already (the run had stopped there), so there is nothing to train."""
        cfg = self.cfg
        if not (cfg.target_eval_loss and start_step):
            return False
        self.compile()
        loss = self.run(start_step, params)["eval_loss"]
        if not at_target(cfg, loss):
            log.info("resumed at step %d with eval loss %.4f, above target_eval_loss=%g: training on", start_step,
                     loss, cfg.target_eval_loss)
            return False
        log.info("nothing to do: the state of step %d has eval loss %.4f, at or below target_eval_loss=%g (lower "
                 "it, or set it to 0, to train on)", start_step, loss, cfg.target_eval_loss)
        return True

    def _batches(self):
        """The eval stream's host batches. Where each process reads its own share of the files, the
        shares can end after different numbers of batches, and a process that stopped alone would
        leave the others waiting in the eval step's collectives: a process whose share has ended
        goes on with padding batches, and `run` stops at the first batch without a data row on any
        process (its `rows` sum is global)."""
        yield from self.data
        if getattr(self.data, "process_local", False) and jax.process_count() > 1:
            padding = stack_rows([], self.data.rows, self.data.length)
            while True:
                yield padding

    def _sums(self, params):
        """Each eval batch's sums (`eval_sums`) on the host, in order. Batch k+1 is placed and dispatched
        before batch k's sums are read, as the loop's steps are (the device does not wait while the host
        prepares a batch), and never a batch past `eval_steps`; a caller that stops early leaves at most
        one batch computed in vain."""
        ahead = None
        batches = self._batches() if self.steps < 0 else itertools.islice(self._batches(), self.steps)
        for host_batch in batches:
            batch = place_batch(self.data, host_batch, self.trainer.batch_sharding, self.trainer.plan.eval_batch)
            sums = self.step_fn(params, batch)
            if ahead is not None:
                yield jax.device_get(ahead)
            ahead = sums
        if ahead is not None:
            yield jax.device_get(ahead)

    def run(self, step: int, params, beat: Callable[[], None] = lambda: None,
            interrupted: Callable[[int], bool] = lambda batches: False) -> dict | None:
        """{'step', 'eval_loss', 'eval_perplexity', 'eval_tokens', 'eval_batches', 'eval_seconds'}, with
        MTP 'eval_mtp_loss' and 'eval_mtp_acceptance_rate_percent' (see the module's docstring);
        `beat()` after each batch (the hang watchdog's: a long evaluation is not a hung step). None
        when `interrupted(batches done)` turns true between batches (a stop signal: the save comes
        first; `StopSignal.interrupts_evaluation`)."""
        start = time.perf_counter()
        self.data.set_state(self.start)
        totals, batches = {}, 0
        with jax.set_mesh(self.trainer.mesh):
            for sums in self._sums(params):
                if sums["rows"] == 0:  # every process's share of the eval data has ended
                    break
                totals = {k: totals.get(k, 0.0) + np.asarray(v, np.float64) for k, v in sums.items()}
                batches += 1
                beat()
                if batches == self.steps:
                    break
                if interrupted(batches):
                    log.warning("evaluation of step %d stopped after %d batch(es) by the stop signal: not recorded; "
                                "saving the checkpoint comes first", step, batches)
                    return None
        if 0 < batches < self.steps and not self.said_short:
            log.warning("the eval data ended after %d batch(es), fewer than eval_steps=%d: every evaluation scores "
                        "those %d; set eval_steps=-1 to say so, or add eval documents", batches, self.steps, batches)
            self.said_short = True
        if not batches or totals["count"] == 0:
            raise ConfigError(NO_TARGETS)
        loss = float(totals["loss_sum"] / totals["count"])
        record = {"step": step, "eval_loss": loss, "eval_perplexity": perplexity(loss),
                  "eval_tokens": int(totals["count"]), "eval_batches": batches,
                  "eval_seconds": time.perf_counter() - start}
        if "mtp_loss_sums" in totals:
            record["eval_mtp_loss"] = float(np.mean(totals["mtp_loss_sums"] / np.maximum(totals["mtp_counts"], 1)))
        if "mtp_accepted" in totals:
            record["eval_mtp_acceptance_rate_percent"] = 100 * float(totals["mtp_accepted"] /
                                                                     max(totals["mtp_offered"], 1))
        return record
