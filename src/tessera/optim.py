"""Optimizer (`opt_type`: AdamW, SGD or Muon) with linear warm-up and a cosine decay or a WSD
schedule (warm-up, stable, decay; `lr_schedule_type`), global-norm clipping.

Muon (optax.contrib's `scale_by_muon`) updates the blocks' weight matrices with their momentum
orthogonalized by Newton-Schulz iterations; the embeddings, the output layer, norms, biases and
other vectors stay with AdamW (the same AdamW as `opt_type=adamw`, with its weight-decay mask), as
Muon's authors and MaxText do. Which axes of a weight form the matrix is read from its logical
axes (`muon_dimension_numbers`): stacked layers and experts are batches of matrices, each
orthogonalized on its own; a projection into the residual stream (embed last) takes every other
axis as its input, a projection out of it (embed first) every other axis as its output, so the
attention projections are whole [embed, heads x head_dim] matrices.

Gradient accumulation (`gradient_accumulation_steps`) happens inside the train step (the
micro-batches are summed before one optimizer update), not here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

from tessera.muon_layout import scale_by_muon_whole_matrices
from tessera.param_masks import frozen_mask, matcher

from tessera.config import ConfigError, OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate`, then (`lr_schedule_type`) a cosine decay to the final
    fraction over the rest of `total_steps`, or WSD: the peak held, then a linear or cosine decay to the
    final fraction over the last `wsd_decay_steps_fraction` of them. Either reaches its final value at
    `total_steps`, which the steps after keep. ConfigError for a schedule of no steps."""
    if total_steps < 1:
        raise ConfigError(f"learning_rate_schedule_steps={total_steps} gives a learning-rate schedule of no steps (its "
                          "rate would drop to the final value after step 0); set it to -1 (as long as steps) or >= 1")
    warmup = _steps(cfg.warmup_steps_fraction, total_steps)
    end_value = cfg.learning_rate * cfg.cosine_learning_rate_final_fraction
    if cfg.lr_schedule_type == "wsd":
        return _wsd(cfg, total_steps, warmup, end_value)
    if warmup == 0:
        alpha = end_value / max(cfg.learning_rate, 1e-30)
        return optax.cosine_decay_schedule(cfg.learning_rate, total_steps, alpha=alpha)
    if warmup >= total_steps:  # all warm-up (warmup_steps_fraction=1): no decay, the steps after it at the end value
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.learning_rate, warmup),
                                     optax.constant_schedule(end_value)], [total_steps])
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=end_value,
    )


def _steps(fraction: float, total_steps: int) -> int:
    """The whole steps in `fraction` of `total_steps`, rounded to 6 decimals first: 0.29 x 100 is 28.999999999999996
    in floating point, which int() alone made 28 warm-up steps."""
    return int(round(fraction * total_steps, 6))


def _wsd(cfg: OptimConfig, total_steps: int, warmup: int, end_value: float) -> optax.Schedule:
    """Warm-up, stable, decay: `warmup` steps up to the peak, the peak until the decay's last
    `wsd_decay_steps_fraction` x `total_steps` steps, which go to `end_value` (reached at `total_steps`).
    The fractions' sum is at most 1 (config checks, to 1e-9): the decay takes no more than the warm-up leaves."""
    peak = cfg.learning_rate
    decay = min(_steps(cfg.wsd_decay_steps_fraction, total_steps), total_steps - warmup)
    if decay == 0:  # all warm-up and stable phase: the final fraction is never reached
        pieces = [optax.constant_schedule(peak)]
    elif cfg.wsd_decay_style == "cosine":
        pieces = [optax.cosine_decay_schedule(peak, decay, alpha=end_value / max(peak, 1e-30))]
    else:
        pieces = [optax.linear_schedule(peak, end_value, decay)]
    boundaries = []
    if total_steps - warmup - decay > 0 and decay > 0:  # a stable phase before the decay
        pieces.insert(0, optax.constant_schedule(peak))
        boundaries.insert(0, total_steps - decay)
    if warmup > 0:
        pieces.insert(0, optax.linear_schedule(0.0, peak, warmup))
        boundaries.insert(0, warmup)
    return optax.join_schedules(pieces, boundaries) if boundaries else pieces[0]


def schedule_step(opt_state: Any) -> jax.Array:
    """The step at which the optimizer's schedule reads its next learning rate: the count of updates
    it applied (optax's ScaleByScheduleState, the same in every part of the optimizer). A step the
    train step skips (non-finite loss or gradient) leaves it where it was, so after skips it trails
    the train step, and the rate the next update applies is `schedule(schedule_step(opt_state))`."""
    counts = optax.tree_utils.tree_get_all_with_path(
        opt_state, "count", filtering=lambda path, _: getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState")
    if not counts:
        raise ValueError("the optimizer state holds no schedule count (ScaleByScheduleState)")
    return counts[0][1]


def make_optimizer(cfg: OptimConfig, total_steps: int, logical_axes: Any = None) -> optax.GradientTransformation:
    """Clip (if enabled) then the `opt_type` update. AdamW's weight decay applies to every parameter
    but the norms' scales and DeepSeek's routing biases (`NO_DECAY`; the biases' gradient is zero, so
    AdamW leaves them as they are): matrices, embeddings and position tables, biases (LayerNorm's
    too) and attention sinks decay. (MaxText's adamw decays every parameter.)
    Muon needs the parameters' `logical_axes` (the model's tree of axis-name tuples)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    if cfg.opt_type == "sgd":  # MaxText's sgd: optax.sgd, no momentum and no weight decay
        update = optax.sgd(schedule)
    elif cfg.opt_type == "muon":
        if logical_axes is None:
            raise ValueError("opt_type=muon needs the parameters' logical axes")
        update = muon(cfg, schedule, logical_axes)
    else:
        update = _adamw(cfg, schedule)
    if cfg.gradient_clipping_threshold > 0:
        update = optax.chain(clip_by_global_norm(cfg.gradient_clipping_threshold), update)
    if cfg.trainable_parameters_mask:  # the others frozen: no update, and no optimizer state for them
        patterns = cfg.trainable_parameters_mask
        return optax.partition({"train": update, "frozen": optax.set_to_zero()},
                               lambda params: jax.tree.map(lambda f: "frozen" if f else "train",
                                                           frozen_mask(params, patterns)))
    return update


def _adamw(cfg: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(learning_rate=schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                       eps_root=cfg.adam_eps_root, weight_decay=cfg.adam_weight_decay, mask=decay_mask(cfg.adamw_mask), mu_dtype=mu_dtype(cfg))


def mu_dtype(cfg: OptimConfig):
    """The first moment's dtype (`mu_dtype`), None for the parameters' own."""
    return jnp.dtype(cfg.mu_dtype) if cfg.mu_dtype else None


def muon(cfg: OptimConfig, schedule: optax.Schedule, logical_axes: Any) -> optax.GradientTransformation:
    """Muon for the weight matrices `muon_dimension_numbers` finds, AdamW for the other parameters:
    momentum (muon_beta, Nesterov) orthogonalized by optax's Newton-Schulz iterations, scaled for the
    matrix's shape (muon_consistent_rms), decayed by muon_weight_decay x the learning rate, times the
    learning rate. The same schedule drives both parts."""
    dims = muon_dimension_numbers(logical_axes)
    labels = jax.tree.map(lambda d: "adamw" if d is None else "muon", dims, is_leaf=_is_dims)
    masked_dims = masked(dims)
    return optax.partition({
        "muon": optax.chain(
            scale_by_muon_whole_matrices(cfg.muon_beta, cfg.adam_eps, masked_dims, logical_axes, mu_dtype(cfg)),
            _scale_by_shape(masked_dims, cfg.muon_consistent_rms),
            optax.add_decayed_weights(cfg.muon_weight_decay),
            optax.scale_by_learning_rate(schedule),
        ),
        "adamw": _adamw(cfg, schedule),
    }, labels)


def _is_dims(x) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)  # a NamedTuple is a pytree: stop at it


def masked(dims: Any) -> Any:
    """`muon_dimension_numbers` as the Muon branch of the partition sees it: AdamW's parameters are
    MaskedNode leaves there, and so must their dimension numbers be."""
    return jax.tree.map(lambda d: optax.MaskedNode() if d is None else d, dims, is_leaf=_is_dims)


# stacked layers (with a circular pipeline's repeats before them) and experts: batches of matrices, each
# orthogonalized alone
BATCH_AXES = ("pipeline_repeats", "layers", "exp")
MUON_NAMED = ("router_de", "projection_ced")  # matrices Muon takes besides the weights named w...


def muon_dimension_numbers(logical_axes: Any) -> Any:
    """Per parameter, the axes of the matrix Muon orthogonalizes (MuonDimensionNumbers: input, then
    output axes; the others are batch axes), or None for a parameter AdamW trains. Muon takes the
    weights of the blocks (names starting with w, the MoE router and multi-token prediction's
    projection): not the token table or the output layer (a vocab axis), norms, biases, position
    tables, attention sinks. A weight whose
    name spells its axes (wqkv_dcnh) orthogonalizes each of its c stacked matrices alone."""

    def dims(path, axes):
        name = str(getattr(path[-1], "key", ""))
        if not (name.startswith("w") or name in MUON_NAMED) or {"vocab", "norm"} & set(axes):
            return None
        batch = [i for i, a in enumerate(axes) if a in BATCH_AXES]
        rest = [i for i in range(len(axes)) if i not in batch]
        spelled = name.rsplit("_", 1)[-1]
        if name == "projection_ced":  # MTP's one [embedding | hidden] -> D matrix: c and e are its input
            return MuonDimensionNumbers(tuple(rest[:-1]), (rest[-1],))
        if spelled.isalpha() and len(spelled) == len(rest):
            rest = [i for i, letter in zip(rest, spelled) if letter != "c"]
        if len(rest) < 2:
            return None
        if axes[rest[-1]] == "embed":  # into the residual stream: all before it is the input
            return MuonDimensionNumbers(tuple(rest[:-1]), (rest[-1],))
        return MuonDimensionNumbers((rest[0],), tuple(rest[1:]))

    return jax.tree_util.tree_map_with_path(dims, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def _scale_by_shape(masked_dims: Any, consistent_rms: float) -> optax.GradientTransformation:
    """Each orthogonalized update times sqrt(max(1, fan_out / fan_in)) (consistent_rms 0), or times
    sqrt(max(fan_in, fan_out)) x consistent_rms, which gives every matrix's update the same RMS."""

    def factor(u, d):
        if isinstance(d, optax.MaskedNode):
            return u
        fan_in = math.prod(u.shape[i] for i in d.reduction_axis)
        fan_out = math.prod(u.shape[i] for i in d.output_axis)
        if consistent_rms:
            scale = math.sqrt(max(fan_in, fan_out)) * consistent_rms
        else:
            scale = math.sqrt(max(1.0, fan_out / fan_in))
        return u * jnp.asarray(scale, u.dtype)

    def update(updates, state, params=None):
        del params
        return jax.tree.map(factor, updates, masked_dims,
                            is_leaf=lambda x: isinstance(x, (optax.MaskedNode, MuonDimensionNumbers))), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm's rule (gradients whose global norm is at least `max_norm` are
    scaled down to it) and its state (EmptyState: checkpoints are unchanged), applied as one
    scalar factor. `global_norm=`, when the caller has it (the train step computes it for its
    metrics), saves a second reduction over the gradients.

    optax's version divides every gradient by the norm before it selects, so XLA materializes
    g / norm, a full pass over the gradients on every step, clipped or not (50 ms of a 2.5 s
    step of benchmarks/cpu_llama.py). Here an unclipped gradient is multiplied by exactly 1
    (bit-identical to optax); a clipped one by max_norm / norm (optax: (g / norm) * max_norm,
    which can differ in the last bit)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        scale = jnp.where(norm < max_norm, jnp.ones_like(norm), max_norm / norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(init, update)


NO_DECAY = ("scale", "routed_bias_e")  # norm scales; MoE choice biases (moved by the train step, not by AdamW)


def decay_mask(patterns=()):
    """params -> True for the weights AdamW decays: everything except normalization scales, DeepSeek's routing
    biases (`routed_bias_e`; gpt-oss's learned `router_bias_e` decays like the other biases) and the parameters
    one of the regular expressions `patterns` (adamw_mask, `tessera.param_masks`) is found in."""
    matches = matcher(patterns)

    def decays(path, _):
        return not any(getattr(k, "key", None) in NO_DECAY for k in path) and not matches(path)

    return lambda params: jax.tree_util.tree_map_with_path(decays, params)
