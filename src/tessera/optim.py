"""Optimizer: AdamW with linear warm-up and cosine decay, global-norm clipping.

Gradient accumulation (`gradient_accumulation_steps`) happens inside the train step (the
micro-batches are summed before one optimizer update), not here.
"""

from __future__ import annotations

import jax
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
        return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
    return adamw


NO_DECAY = ("scale", "routed_bias_e")  # norm scales; MoE choice biases (moved by the train step, not by AdamW)


def _decay_mask(params):
    """True for weights that decay: everything except normalization scales and routing biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(getattr(k, "key", None) in NO_DECAY for k in path), params)
