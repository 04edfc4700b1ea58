"""The train step and the sharded state it works on.

`setup` turns a config into a `Trainer` (mesh, model, optimizer, shardings and the `RunPlan` of
values derived from the config and the mesh shape) without allocating parameters; `create_state`
makes the state directly in its sharded layout; `make_train_step` is the pure step function and
`compile_step` compiles it ahead of time. Below `setup` nothing sees the root config: the
`Trainer` carries the model and optimizer (each built from its own section) and the plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tessera import cpu_matmul, spikes
from tessera.compile_cache import unloadable_programs_unsaved
from tessera.config import Config, ConfigError, ModelConfig
from tessera.config.checks import check_tpu_compiler_limits, check_trainable_dtypes
from tessera.config.derived import RunPlan, plan_run
from tessera.config.layers import LAYERS_PER_BLOCK
from tessera.config.maxtext_model import accumulation_note
from tessera.config.unread_keys import attention_keys_without_effect, keys_without_effect
from tessera.cpu_miscompile import check_cpu_mesh
from tessera.gradients import (gradient_mean_in_update, gradient_norm, gradients_to_apply, mtp_step_counts,
                               objective_fn, summed_gradients, update_decision)
from tessera.losses import MTP_SUMS, Z_SUM
from tessera.mesh import create_mesh, logical_spec, named_shardings
from tessera.models import ModelDef, build_model, matmul_precision, offloads_to_host
from tessera.models.attention_choice import select_attention
from tessera.models.decoder import MTP_LOAD
from tessera.models.moe import describe_routing
from tessera.models.moe_balance import PER_LAYER_LOAD, update_routed_bias
from tessera.models.quantization import check_platform as check_quantization
from tessera.optim import learning_rate_schedule, make_optimizer, schedule_step
from tessera.optimizer_offload import Offload, check_offload, make_offload, streamed_update
from tessera.param_masks import check_adamw_mask, frozen_params
from tessera.seeds import prng_key

log = logging.getLogger("tessera")


@dataclasses.dataclass
class Trainer:
    """What the loop needs, built once from the config (see `setup`)."""

    mesh: Mesh
    model: ModelDef  # model.cfg: the model section
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule  # the optimizer's learning rate by step (reported with each step)
    state_shardings: Any
    batch_sharding: NamedSharding
    plan: RunPlan  # global batch, micro-batches, dropout, packing, paths
    spikes: spikes.SpikeRule | None = None  # skip_step_on_spikes: the window's rule (its state: state["spikes"])
    grad_dtype: Any = None  # grad_dtype=bfloat16: the dtype float32 gradients are rounded to (None: kept)
    frozen: Any = None  # trainable_parameters_mask: a tree of bools, True for the parameters that do not train
    offload: Offload | None = None  # optimizer_memory_host_offload: the moments in host memory, the update streamed


def _log_moe_routing(m: ModelConfig, platform: str) -> None:
    """Log `moe.describe_routing` for a mixture-of-experts model (nothing for a dense one)."""
    line, warning = describe_routing(m, platform)
    if line:
        log.info("%s", line)
    if warning:
        log.warning("%s", warning)


def setup(cfg: Config, devices=None) -> Trainer:
    """Mesh, plan, model, optimizer and shardings for `cfg` (no parameters are allocated yet)."""
    mesh = create_mesh(cfg.mesh, devices)
    plan = plan_run(cfg, dict(mesh.shape))
    check_cpu_mesh(mesh)  # a mesh XLA:CPU computes wrong results on (tessera.cpu_miscompile)
    check_trainable_dtypes(cfg.model, device_platform(mesh))
    check_tpu_compiler_limits(cfg.model, device_platform(mesh), dict(mesh.shape))
    for line in keys_without_effect(cfg, dict(mesh.shape)):
        log.warning("%s", line)
    if note := accumulation_note(cfg.data.per_device_batch_size, plan.micro_batches, plan.global_batch):
        log.info("%s", note)
    device = mesh.devices.flat[0]
    choice = select_attention(cfg.model, device_platform(mesh), cfg.data.max_target_length, dict(mesh.shape),
                              device.device_kind, str(getattr(device, "compute_capability", "")), plan.packed)
    log.info("attention kernel: %s (%s)", choice.kernel, choice.reason)
    for line in attention_keys_without_effect(cfg, choice.kernel, dict(mesh.shape)):
        log.warning("%s", line)
    bf16_matmul = cpu_matmul.decision()  # checks TESSERA_CPU_BF16_MATMUL on every platform
    if device_platform(mesh) == "cpu" and cfg.model.dtype == "bfloat16":
        log.info("bfloat16 matmuls on CPU: %s (%s)", *bf16_matmul)
    _check_remat(cfg.model, mesh)
    check_quantization(cfg.model.quantization, device.device_kind, device_platform(mesh), str(getattr(
        device, "compute_capability", "")), tied_logits=cfg.model.logits_via_embedding)
    _log_moe_routing(cfg.model, device_platform(mesh))
    if plan.pipeline is not None:
        log.info("pipeline: %s", plan.pipeline.describe(LAYERS_PER_BLOCK.get(cfg.model.decoder_block, 1)))
    model = build_model(cfg.model, choice.kernel, plan.pipeline)
    logical_axes = model.logical_axes()
    check_adamw_mask(cfg.optim, model.param_shapes())
    frozen = frozen_params(cfg.optim, model.param_shapes())
    optimizer = make_optimizer(cfg.optim, plan.schedule_steps, logical_axes)

    param_shardings = named_shardings(mesh, logical_axes, model.param_shapes())
    rule = spikes.spike_rule(cfg.optim)
    abstract_state = jax.eval_shape(lambda p: init_state_from_params(optimizer, p, rule), model.param_shapes())
    replicated = NamedSharding(mesh, PartitionSpec())
    state_param_shardings = param_shardings
    if cfg.optim.shard_optimizer_over_data:
        state_param_shardings = jax.tree.map(lambda sh, s: over_data(sh, s.shape), param_shardings,
                                             model.param_shapes())
    # (Muon's two parts each hold the other's parameters as MaskedNode: nothing to place)
    opt_shardings = optax.tree_map_params(
        optimizer, lambda v, s: v if isinstance(v, optax.MaskedNode) else s, abstract_state["opt_state"],
        state_param_shardings, transform_non_params=lambda _: replicated,
        is_leaf=lambda v: isinstance(v, optax.MaskedNode))
    state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
    offload = None
    if cfg.optim.optimizer_memory_host_offload:
        check_offload(mesh)
        offload = make_offload(optimizer, abstract_state["opt_state"], opt_shardings, logical_axes,
                               model.param_shapes(), state_param_shardings)
        state_shardings["opt_state"] = offload.state_shardings
        log.info("optimizer_memory_host_offload: the optimizer's moments live in pinned host memory; the update "
                 "streams them through the devices one layer at a time")
        if device_platform(mesh) == "cpu":
            log.warning("optimizer_memory_host_offload=true saves no memory on CPU devices, whose memory is the "
                        "host's; the update runs a layer at a time all the same (set it to false here)")
    if rule is not None:
        state_shardings[spikes.WINDOW] = jax.tree.map(lambda _: replicated, abstract_state[spikes.WINDOW])

    batch_sharding = NamedSharding(mesh, logical_spec(("batch", None), (plan.global_batch, 1), dict(mesh.shape)))
    schedule = learning_rate_schedule(cfg.optim, plan.schedule_steps)
    grad_dtype = jnp.dtype(cfg.optim.grad_dtype) if cfg.optim.grad_dtype == "bfloat16" else None
    return Trainer(mesh, model, optimizer, schedule, state_shardings, batch_sharding, plan, rule, grad_dtype, frozen,
                   offload)


def over_data(sharding: NamedSharding, shape) -> NamedSharding:
    """`sharding` with the mesh's `data` axis added to the first dimension it divides, in front of
    the axes already there (data is the outermost mesh axis): how shard_optimizer_over_data
    (ZeRO-1) splits an optimizer-state leaf whose parameter is replicated over `data`. A leaf
    no dimension of which divides stays as it is."""
    mesh, ways = sharding.mesh, sharding.mesh.shape["data"]
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    if ways == 1 or any("data" in (a if isinstance(a, tuple) else (a,)) for a in spec):
        return sharding
    for i, (axes, dim) in enumerate(zip(spec, shape)):
        axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        if dim % (math.prod(mesh.shape[a] for a in axes) * ways) == 0:
            spec[i] = ("data", *axes) if axes else "data"
            return NamedSharding(mesh, PartitionSpec(*spec))
    return sharding


def device_platform(mesh: Mesh) -> str:
    """"cpu", "gpu", "tpu", ...: the platform of the mesh's devices (kernels are chosen for it)."""
    return mesh.devices.flat[0].platform


def init_state_from_params(optimizer, params, rule: spikes.SpikeRule | None = None) -> dict:
    """A fresh train state (step 0, new optimizer state, with skip_step_on_spikes an empty window) around
    `params`."""
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}
    if rule is not None:
        state[spikes.WINDOW] = spikes.new_window(rule.interval)
    return state


def init_program(trainer: Trainer, seed: int):
    """The compiled program that creates the train state (`create_state`): compiled first, so that
    its temporaries (the random draws of the initializers) can be checked before it runs."""

    def init(key):
        return init_state_from_params(trainer.optimizer, trainer.model.init(key), trainer.spikes)

    with jax.set_mesh(trainer.mesh):
        return jax.jit(init, out_shardings=trainer.state_shardings).lower(prng_key(seed)).compile()


def create_state(trainer: Trainer, seed: int, program=None) -> dict:
    """Train state created directly in its sharded layout (never whole on one device), by
    `program` when given (`init_program` of the same trainer and seed)."""
    program = program or init_program(trainer, seed)
    with jax.set_mesh(trainer.mesh):
        return program(prng_key(seed))


def _check_remat(m, mesh: Mesh) -> None:
    policy = m.remat_policy
    if offloads_to_host(m):
        kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
        if "pinned_host" not in kinds:
            raise ConfigError(
                f"remat_policy={policy} offloads activations to pinned host memory, which "
                f"{mesh.devices.flat[0].platform} devices here do not have (memories: {sorted(kinds)}); "
                "use remat_policy=full or minimal"
            )


# --------------------------------------------------------------------------- the step


def updated(trainer: Trainer, grads, opt_state, params, *, learns, grad_norm, prepare, rebalance):
    """(new parameters, new optimizer state): the optimizer's update of `params` by `prepare(grads)` (the clip
    takes `grad_norm`) when `learns`, else both as they were. `rebalance`: the MoE choice biases' move after the
    update, or None. With optimizer_memory_host_offload the moments stream from host memory a layer at a time
    (optimizer_offload.streamed_update)."""
    optimizer, offload = trainer.optimizer, trainer.offload
    if offload is not None:
        params, opt_state = streamed_update(optimizer, offload, grads, opt_state, params, learns=learns,
                                            global_norm=grad_norm, prepare=prepare)
        return (params if rebalance is None else jax.lax.cond(learns, rebalance, lambda p: p, params)), opt_state

    def update(operands):
        p, opt = operands
        updates, opt = optimizer.update(prepare(grads), opt, p, global_norm=grad_norm)
        p = optax.apply_updates(p, updates)
        return (p if rebalance is None else rebalance(p)), opt

    return jax.lax.cond(learns, update, lambda operands: operands, (params, opt_state))


def make_train_step(trainer: Trainer, seed: int):
    """The pure step function (state, batch) -> (state, metrics); the caller jits it."""
    model, schedule, plan = trainer.model, trainer.schedule, trainer.plan
    rule, grad_dtype, frozen = trainer.spikes, trainer.grad_dtype, trainer.frozen
    accum, use_dropout, packed = plan.micro_batches, plan.dropout_on, plan.packed
    bias_rate, mtp_depths = model.cfg.routed_bias_update_rate, model.cfg.mtp_num_layers
    mean_in_update = gradient_mean_in_update(device_platform(trainer.mesh))

    summed_loss = objective_fn(model, packed)
    def train_step(state, batch):  # its programs are named jit_train_step (dump_hlo_module_name)
        params = state["params"]
        key = jax.random.fold_in(prng_key(seed + 1), state["step"]) if use_dropout else None
        mtp_counts, mtp_scale = mtp_step_counts(batch["segment_ids"], mtp_depths) if mtp_depths else (None, None)
        grad_fn = jax.grad(lambda p, b, k: summed_loss(p, b, k, mtp_scale), has_aux=True)
        with matmul_precision(model.cfg):  # the backward pass's products too
            grads, loss_sum, targets, auxes = summed_gradients(grad_fn, params, batch, key, accum)
        grads = gradients_to_apply(grads, frozen, grad_dtype)
        count = jnp.maximum(targets, 1.0)
        if mtp_depths:  # the logged multi-token-prediction loss: of the whole step, not a mean of micro-batches'
            auxes["mtp_loss"] = jnp.mean(auxes.pop(MTP_SUMS) / jnp.maximum(mtp_counts, 1.0))
        z_loss = auxes.pop(Z_SUM, None)  # the z-loss term, logged per target token as the objective weighs it
        loads = auxes.pop(PER_LAYER_LOAD, None)  # MoE expert loads per layer (routed_bias)
        mtp_loads = auxes.pop(MTP_LOAD, None)  # and per multi-token-prediction depth
        # Gradients are sums over the batch's tokens; the update takes their mean (x 1/count).
        inv_count = 1.0 / count

        def mean(sums):
            return jax.tree.map(lambda g: (g * inv_count).astype(g.dtype), sums)

        if not mean_in_update:
            grads = mean(grads)
        grad_norm = gradient_norm(grads, inv_count if mean_in_update else 1.0)
        loss = loss_sum / count
        finite, learns, window, spike_stats = update_decision(loss, grad_norm, targets, state.get(spikes.WINDOW),
                                                              rule)

        # auxiliary-loss-free balancing: the choice biases move after the update
        rebalance = None if loads is None else (lambda p: update_routed_bias(p, loads, bias_rate, mtp_loads))
        new_params, new_opt = updated(trainer, grads, state["opt_state"], params, learns=learns, grad_norm=grad_norm,
                                      prepare=mean if mean_in_update else (lambda g: g), rebalance=rebalance)
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": new_opt}
        if window is not None:
            new_state[spikes.WINDOW] = window
        rate = schedule(schedule_step(state["opt_state"]))  # the update's (skipped steps do not advance it)
        stats = {"loss": loss, "grad_norm": grad_norm, "learning_rate": rate, "tokens": targets,
                 "finite": finite, **jax.tree.map(jnp.mean, auxes), **spike_stats}
        if z_loss is not None:
            stats["z_loss"] = model.cfg.z_loss_multiplier * z_loss / count
        if loads is not None:  # how far the most loaded expert is above its fair share (1: balanced), layer mean
            stats["moe_max_expert_load"] = jnp.mean(jnp.max(loads, axis=-1))
        return new_state, stats

    return train_step


def batch_shapes(trainer: Trainer, rows: int = 0) -> dict:
    """ShapeDtypeStructs with shardings of one global batch (tokens, segment ids, positions) of
    `rows` sequences (default: the train batch's)."""
    shape = (rows or trainer.plan.global_batch, trainer.plan.max_target_length + 1)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
            for k in ("tokens", "segment_ids", "positions")}


def compile_step(trainer: Trainer, seed: int):
    """AOT-compile the train step for this mesh; returns (compiled, seconds)."""
    state_shapes = abstract_state(trainer)
    replicated = NamedSharding(trainer.mesh, PartitionSpec())
    jitted = jax.jit(make_train_step(trainer, seed), out_shardings=(trainer.state_shardings, replicated),
                     donate_argnums=0)
    start = time.perf_counter()
    with jax.set_mesh(trainer.mesh), unloadable_programs_unsaved(trainer.mesh):
        compiled = jitted.lower(state_shapes, batch_shapes(trainer)).compile()
    return compiled, time.perf_counter() - start


def abstract_state(trainer: Trainer):
    """ShapeDtypeStructs with shardings for the whole train state (for restores and AOT)."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(lambda p: init_state_from_params(trainer.optimizer, p, trainer.spikes),
                       trainer.model.param_shapes()),
        trainer.state_shardings,
    )


def state_from_params(trainer: Trainer, params) -> dict:
    """A fresh train state around loaded parameters, created in its sharded layout."""
    with jax.set_mesh(trainer.mesh):
        return jax.jit(lambda p: init_state_from_params(trainer.optimizer, p, trainer.spikes),
                       out_shardings=trainer.state_shardings,
                       donate_argnums=0)(params)
