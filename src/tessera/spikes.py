"""Skipping the update of a step whose loss or gradient norm spikes (`skip_step_on_spikes`, MaxText's
keys, after OLMo-core's skip-step optimizer).

The train state keeps a window of the last `skip_step_interval` steps' losses and gradient norms
(`state["spikes"]`, saved with it). A step whose loss or gradient norm (before clipping) is more
than `skip_step_scaling_factor` standard deviations above the window's mean drops its update, as a
non-finite step does: parameters, optimizer state and the schedule's count stay where they were.
Its values still join the window (a lasting change of level becomes the new baseline after a few
steps); non-finite values and steps without target tokens do not. No step is skipped before the
window holds max(2, interval // 2) values, so a run (or a resume that starts a new window) trains
that many steps first.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

WINDOW = "spikes"  # the train state's entry


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    interval: int  # skip_step_interval: steps in the window
    scaling: float  # skip_step_scaling_factor: standard deviations above the mean that make a spike

    @property
    def min_history(self) -> int:
        return max(2, self.interval // 2)


def spike_rule(optim) -> SpikeRule | None:
    """The rule of an OptimConfig with skip_step_on_spikes, else None."""
    return SpikeRule(optim.skip_step_interval, optim.skip_step_scaling_factor) if optim.skip_step_on_spikes else None


def new_window(interval: int) -> dict:
    """An empty window: the values' ring buffers and how many values were ever added (`count`)."""
    return {"losses": jnp.zeros((interval,), jnp.float32), "grad_norms": jnp.zeros((interval,), jnp.float32),
            "count": jnp.zeros((), jnp.int32)}


def _mean_std(values, held):
    """Mean and standard deviation (Bessel's n - 1) of the first `held` entries of a ring buffer (all of them once
    it is full: the order does not matter)."""
    mask = jnp.arange(values.shape[0]) < held
    n = jnp.maximum(held, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(mask, values, 0.0)) / n
    var = jnp.sum(jnp.where(mask, (values - mean) ** 2, 0.0)) / jnp.maximum(held - 1, 1).astype(jnp.float32)
    return mean, jnp.sqrt(var)


def check(window: dict, loss, grad_norm, counts, rule: SpikeRule):
    """(spike, the window after this step, thresholds) for a step's `loss` and `grad_norm`; `counts`: whether its
    values join the window (finite, with target tokens). `thresholds`: the loss and gradient norm above which a
    step counts as a spike (inf while the window is too short), for the log line."""
    interval = window["losses"].shape[0]
    held = jnp.minimum(window["count"], interval)
    thresholds = []
    for values in (window["losses"], window["grad_norms"]):
        mean, std = _mean_std(values, held)
        thresholds.append(jnp.where(held >= rule.min_history, mean + rule.scaling * std, jnp.inf))
    loss32, norm32 = jnp.asarray(loss, jnp.float32), jnp.asarray(grad_norm, jnp.float32)
    spike = counts & ((loss32 > thresholds[0]) | (norm32 > thresholds[1]))
    at = window["count"] % interval
    added = {"losses": window["losses"].at[at].set(loss32), "grad_norms": window["grad_norms"].at[at].set(norm32),
             "count": window["count"] + 1}
    after = {k: jnp.where(counts, added[k], window[k]) for k in window}
    return spike, after, (thresholds[0], thresholds[1])
