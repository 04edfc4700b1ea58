"""Optimizer: AdamW with linear warm-up and cosine decay, global-norm clipping.

Gradient accumulation (`gradient_accumulation_steps`) happens inside the train step (the
micro-batches are summed before one optimizer update), not here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tessera.config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to `learning_rate`, then cosine decay to the final fraction."""
    warmup = int(cfg.warmup_steps_fraction * total_steps)
    end_value = cfg.learning_rate * cfg.cosine_learning_rate_final_fraction
    if warmup == 0:
        return optax.cosine_decay_schedule(cfg.learning_rate, max(total_steps, 1), alpha=end_value / max(cfg.learning_rate, 1e-30))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=end_value,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clip (if enabled) then AdamW. Weight decay applies to matrices only, not norms' scales or
    routing biases (their gradient is zero, so AdamW leaves them as they are)."""
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg, total_steps),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.adam_weight_decay,
        mask=_decay_mask,
    )
    if cfg.gradient_clipping_threshold > 0:
        return optax.chain(clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
    return adamw


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


def _decay_mask(params):
    """True for weights that decay: everything except normalization scales and routing biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in NO_DECAY for k in path), params)
