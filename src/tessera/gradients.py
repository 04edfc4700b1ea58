"""The step's gradients, from the objective to the decision to apply them.

The summed objective a micro-batch differentiates (token losses, the routers' balancing loss, the
multi-token-prediction depths, the z-loss), the gradients of a batch summed over its micro-batches,
the token mean and the global norm, what the update reads (frozen parameters zeroed, grad_dtype), and
whether the step learns at all (finite, has targets, not a spike). `tessera.step` assembles them into
the train step; nothing here sees the Trainer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tessera import spikes
from tessera.losses import MTP_SUMS, Z_SUM, loss_terms, mtp_target_counts, target_weights
from tessera.models.decoder import MTP_LOAD
from tessera.models.moe_balance import PER_LAYER_LOAD


def gradient_mean_in_update(platform: str) -> bool:
    """Whether the step multiplies the summed gradients by 1/token count inside the optimizer
    update (and takes the global norm of the sums, times 1/count) rather than before it. On
    XLA:CPU inside: the multiply fuses into the moment updates, where before the update it is a
    pass of its own over every gradient (XLA:CPU does not duplicate it into its consumers; about
    1% of a step of benchmarks/cpu_llama.py). Elsewhere before: on TPUs the raw sums feeding both
    the norm and the update made XLA hold more temporaries (MaxText's Mixtral 8x7B command on
    v6e-256: 14.38 GiB per chip against 11.48; on dense models the two are within 0.5%, e.g.
    MaxText's v5p 128B configuration 67.88 folded, 68.20 not). With optimizer_memory_host_offload
    as well, though the streamed update could scale a layer at a time: the v6e Mixtral 8x7B recipe
    with it needed 23.24 GiB per chip inside against 22.80, llama2-7b on v5e-8 10.52 against 10.43
    (on v5p-8, 2 x 2048 tokens per chip, 19.50 against 19.63)."""
    return platform == "cpu"


def gradient_norm(grads, scale=1.0) -> jax.Array:
    """The global norm of `grads` x `scale` (the mean gradient's, from the token sums x 1/count), its
    squares summed in float32 (bfloat16 weights have bfloat16 gradients: 8 bits). The scale is applied
    before squaring (it fuses into the reduction): the sums' squares overflowed float32 `count` times
    sooner than the mean's, so that on CPU (`gradient_mean_in_update`) a step of 4,096 tokens whose
    mean gradient had a finite norm of 1e16 reported inf and was taken for a non-finite step."""
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads))


def summed_gradients(grad_fn, params, batch, key, accum: int):
    """(gradients, loss sum, token count, auxiliary outputs) of `batch` in `accum` micro-batches, each with its
    dropout key folded from `key` (None: no dropout); the auxiliary outputs are micro-batch means."""
    if accum == 1:  # no accumulation loop: one pass, nothing to add up
        grads, (loss_sum, count, auxes) = grad_fn(params, batch, None if key is None else jax.random.fold_in(key, 0))
        return grads, loss_sum, count, auxes
    micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

    def accumulate(carry, i):
        grads, loss_sum, count = carry
        mb = jax.tree.map(lambda x: x[i], micro)
        g, (l, n, aux) = grad_fn(params, mb, None if key is None else jax.random.fold_in(key, i))
        return (jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, g), loss_sum + l, count + n), aux

    # the microbatches' gradients add up in float32 at least (bfloat16 sums lose a bit per addition)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
    (grads, loss_sum, count), auxes = jax.lax.scan(accumulate, (zeros, 0.0, 0.0), jnp.arange(accum))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)  # rounded once, to the weights' type
    # the expert loads (per layer, per multi-token-prediction depth) over the microbatches, as the other outputs
    # are averaged for the logs; the multi-token-prediction depths' loss sums and the z-loss sums add up
    auxes = {k: jnp.mean(v, axis=0) if k in (PER_LAYER_LOAD, MTP_LOAD) else jnp.sum(v, axis=0)
             if k in (MTP_SUMS, Z_SUM) else v for k, v in auxes.items()}
    return grads, loss_sum, count, auxes


def objective_fn(model, packed: bool):
    """(params, batch, dropout key, MTP scale) -> (the summed objective a micro-batch differentiates, (its summed
    token loss, its target count, its auxiliary outputs)); the MTP scale is `mtp_step_counts`'s (None without
    multi-token prediction)."""
    aux_weight, mtp_weight = model.cfg.load_balance_loss_weight, model.cfg.mtp_loss_scaling_factor
    z_weight = model.cfg.z_loss_multiplier

    def summed_loss(p, b, k, mtp_scale):
        loss_sum, count, aux = loss_terms(model, p, b, k, packed)
        # the routers' load-balancing losses, weighted like one more per-token loss term
        router = aux.get("moe_load_balance_loss", 0.0) + aux.get("mtp_moe_load_balance_loss", 0.0)
        objective = loss_sum + aux_weight * router * count
        if mtp_scale is not None:  # + mtp_weight x the mean over depths of each depth's mean loss over the whole
            # step, x its target count: each micro-batch adds its sums, scaled by the step's counts (mtp_scale)
            objective = objective + mtp_weight * jnp.sum(aux[MTP_SUMS] * mtp_scale)
        if z_weight > 0:  # the z-loss: z_loss_multiplier x log(Z)^2 per target token
            objective = objective + z_weight * aux[Z_SUM]
        return objective, (loss_sum, count, aux)

    return summed_loss


def mtp_step_counts(segments_bt, depths: int):
    """(each multi-token-prediction depth's target count in the step's batch [depths], the scale of each depth's
    loss sum in the objective: the step's target count / (depths x that depth's count)), so that micro-batches
    adding their depths' sums train as one batch."""
    counts = mtp_target_counts(segments_bt, depths)
    step_count = jnp.sum(target_weights(segments_bt)).astype(jnp.float32)
    return counts, step_count / (depths * jnp.maximum(counts, 1.0))


def gradients_to_apply(grads, frozen, grad_dtype):
    """The step's gradient sums as the update reads them: zero for trainable_parameters_mask's frozen parameters
    (`frozen`, None: none; XLA then drops their products), float32 ones rounded once to `grad_dtype` (None: kept)."""
    if frozen is not None:
        grads = jax.tree.map(lambda g, f: jnp.zeros_like(g) if f else g, grads, frozen)
    if grad_dtype is not None:
        grads = jax.tree.map(lambda g: g.astype(grad_dtype) if g.dtype == jnp.float32 else g, grads)
    return grads


def update_decision(loss, grad_norm, targets, window, rule: spikes.SpikeRule | None):
    """(finite, learns, the spike window after the step (None without one), the spike's stats) of a step.

    A non-finite loss or gradient leaves parameters and optimizer state as they were, so a NaN never reaches the
    state (or a checkpoint); the host decides to stop or go on. The update runs under a cond: no second pass over
    the state to select old or new. A batch without a target token (all padding, documents of one token) has
    nothing to learn from, and its zero gradient would still move the weights (AdamW's momentum and weight decay):
    no update either. With skip_step_on_spikes (`rule`), neither has a loss or gradient norm far above the recent
    ones; the stats name the thresholds, for the log line of a skipped spike."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    learns = finite & (targets > 0)
    if rule is None:
        return finite, learns, None, {}
    spike, window, (loss_limit, norm_limit) = spikes.check(window, loss, grad_norm, learns, rule)
    return finite, learns & ~spike, window, dict(spike=spike, spike_loss_threshold=loss_limit,
                                                 spike_grad_norm_threshold=norm_limit)
