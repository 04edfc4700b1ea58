"""The training loop, top to bottom: config -> mesh -> model and sharded state -> input ->
compiled step -> loop with metrics -> report. `python3 train.py configs/base.yml key=value ...`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tessera import metrics
from tessera.config import Config, ConfigError, config_digest, flat_dict, load_config
from tessera.data import make_input
from tessera.mesh import create_mesh, logical_spec, named_shardings, sharding_report
from tessera.models import OFFLOADING_POLICIES, ModelDef, build_model
from tessera.models.attention import select_attention
from tessera.optim import learning_rate_schedule, make_optimizer

log = logging.getLogger("tessera")


@dataclasses.dataclass
class Trainer:
    """What the loop needs, built once from the config (see `setup`)."""

    cfg: Config
    mesh: Mesh
    model: ModelDef
    optimizer: optax.GradientTransformation
    state_shardings: Any
    batch_sharding: NamedSharding
    global_batch: int


def setup(cfg: Config, devices=None) -> Trainer:
    """Mesh, model, optimizer and shardings for `cfg` (no parameters are allocated yet)."""
    mesh = create_mesh(cfg.mesh, devices)
    platform = mesh.devices.flat[0].platform
    choice = select_attention(cfg.model.attention, platform, cfg.model.dtype, cfg.model.head_dim)
    log.info("attention kernel: %s (%s)", choice.kernel, choice.reason)
    _check_remat(cfg.model.remat_policy, mesh)
    model = build_model(cfg.model, choice.kernel)
    optimizer = make_optimizer(cfg.optim, cfg.total_steps_in_schedule)

    param_shardings = named_shardings(mesh, model.logical_axes(), model.param_shapes())
    abstract_state = jax.eval_shape(lambda p: init_state_from_params(optimizer, p), model.param_shapes())
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, abstract_state["opt_state"], param_shardings,
        transform_non_params=lambda _: replicated,
    )
    state_shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}

    global_batch = _global_batch(cfg, mesh)
    sizes = dict(mesh.shape)
    batch_sharding = NamedSharding(mesh, logical_spec(("batch", None), (global_batch, 1), sizes))
    return Trainer(cfg, mesh, model, optimizer, state_shardings, batch_sharding, global_batch)


def init_state_from_params(optimizer, params) -> dict:
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}


def create_state(trainer: Trainer, seed: int) -> dict:
    """Train state created directly in its sharded layout (never whole on one device)."""

    def init(key):
        return init_state_from_params(trainer.optimizer, trainer.model.init(key))

    with jax.set_mesh(trainer.mesh):
        return jax.jit(init, out_shardings=trainer.state_shardings)(jax.random.key(seed))


def _global_batch(cfg: Config, mesh: Mesh) -> int:
    exact = cfg.data.per_device_batch_size * mesh.size
    batch = int(round(exact))
    if abs(exact - batch) > 1e-9 or batch < 1:
        raise ConfigError(
            f"per_device_batch_size={cfg.data.per_device_batch_size} x {mesh.size} devices = {exact:g} sequences; "
            "the global batch must be a whole number >= 1"
        )
    accum = cfg.optim.gradient_accumulation_steps
    shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    if batch % accum or (batch // accum) % shards:
        raise ConfigError(
            f"global batch {batch} / gradient_accumulation_steps={accum} must be a whole number divisible by "
            f"data*fsdp*expert={shards} (mesh {dict(mesh.shape)}); change per_device_batch_size or the mesh"
        )
    return batch


def _check_remat(policy: str, mesh: Mesh) -> None:
    if policy in OFFLOADING_POLICIES:
        kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
        if "pinned_host" not in kinds:
            raise ConfigError(
                f"remat_policy={policy} offloads activations to pinned host memory, which "
                f"{mesh.devices.flat[0].platform} devices here do not have (memories: {sorted(kinds)}); "
                "use remat_policy=full or minimal"
            )


# --------------------------------------------------------------------------- loss and step


def loss_sums(model: ModelDef, params, batch, dropout_key):
    """(sum of token losses, number of target tokens) for a batch of `tokens` [B, T+1].

    Inputs are tokens[:, :-1] and targets tokens[:, 1:]. A target counts only if it is not
    padding (segment id 0) and belongs to the same segment as its input token.
    """
    tokens, segments = batch["tokens"], batch["segment_ids"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    weights = (segments[:, 1:] != 0) & (segments[:, 1:] == segments[:, :-1])
    logits = model.apply(params, inputs, batch["positions"][:, :-1], segments[:, :-1], dropout_key)
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(token_loss * weights), jnp.sum(weights).astype(jnp.float32)


def make_train_step(trainer: Trainer, seed: int):
    """The pure step function (state, batch) -> (state, metrics); the caller jits it."""
    cfg, model, optimizer = trainer.cfg, trainer.model, trainer.optimizer
    accum = cfg.optim.gradient_accumulation_steps
    schedule = learning_rate_schedule(cfg.optim, cfg.total_steps_in_schedule)
    use_dropout = cfg.model.enable_dropout and cfg.model.dropout_rate > 0

    def summed_loss(p, b, k):
        loss_sum, count = loss_sums(model, p, b, k)
        return loss_sum, (loss_sum, count)

    grad_fn = jax.grad(summed_loss, has_aux=True)

    def step_fn(state, batch):
        params = state["params"]
        key = jax.random.fold_in(jax.random.key(seed + 1), state["step"]) if use_dropout else None
        micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

        def accumulate(carry, i):
            grads, loss_sum, count = carry
            mb = jax.tree.map(lambda x: x[i], micro)
            g, (l, n) = grad_fn(params, mb, None if key is None else jax.random.fold_in(key, i))
            return (jax.tree.map(jnp.add, grads, g), loss_sum + l, count + n), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, loss_sum, count), _ = jax.lax.scan(accumulate, (zeros, 0.0, 0.0), jnp.arange(accum))
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates), "opt_state": opt_state}
        stats = {"loss": loss_sum / count, "grad_norm": optax.tree.norm(grads),
                 "learning_rate": schedule(state["step"]), "tokens": count}
        return new_state, stats

    return step_fn


def compile_step(trainer: Trainer, seed: int):
    """AOT-compile the train step for this mesh; returns (compiled, seconds)."""
    cfg = trainer.cfg
    length = cfg.data.max_target_length + 1
    batch_shapes = {k: jax.ShapeDtypeStruct((trainer.global_batch, length), jnp.int32, sharding=trainer.batch_sharding)
                    for k in ("tokens", "segment_ids", "positions")}
    state_shapes = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        jax.eval_shape(lambda p: init_state_from_params(trainer.optimizer, p), trainer.model.param_shapes()),
        trainer.state_shardings,
    )
    replicated = NamedSharding(trainer.mesh, PartitionSpec())
    jitted = jax.jit(make_train_step(trainer, seed), out_shardings=(trainer.state_shardings, replicated),
                     donate_argnums=0)
    start = time.perf_counter()
    with jax.set_mesh(trainer.mesh):
        compiled = jitted.lower(state_shapes, batch_shapes).compile()
    return compiled, time.perf_counter() - start


def device_batch(host_batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Place a global host batch on the mesh; each device receives only its own rows."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in host_batch.items()}


# --------------------------------------------------------------------------- the run


def run(cfg: Config, devices=None) -> dict[str, Any]:
    """Train for `cfg.run.steps` steps; returns the run report (also written as report.json)."""
    run_dir = Path(cfg.run.base_output_directory) / cfg.run.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yml").write_text(yaml.safe_dump(flat_dict(cfg), sort_keys=False))
    log.info("run %s -> %s (config digest %s)", cfg.run.run_name, run_dir, config_digest(cfg))

    # ---- mesh, model and sharded state
    trainer = setup(cfg, devices)
    rows, warnings = sharding_report(trainer.mesh, trainer.state_shardings["params"], trainer.model.param_shapes(),
                                     cfg.mesh.param_replication_warn_mib)
    log.info("parameters (path, shape, sharding):\n  %s", "\n  ".join(rows))
    for w in warnings:
        log.warning(w)
    state = create_state(trainer, cfg.run.init_weights_seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    log.info("%s parameters, global batch %d x %d tokens", f"{n_params:,}", trainer.global_batch,
             cfg.data.max_target_length)

    # ---- input and compiled step
    data = make_input(cfg.data, cfg.model.vocab_size, trainer.global_batch)
    step_fn, compile_seconds = compile_step(trainer, cfg.run.init_weights_seed)
    log.info("train step compiled in %.1f s", compile_seconds)

    # ---- loop
    device_kind = trainer.mesh.devices.flat[0].device_kind
    peak = metrics.peak_tflops(device_kind)
    if peak is None:
        log.info("device kind %r is not in the peak table: MFU is reported as unknown", device_kind)
    flops = metrics.training_flops_per_step(cfg.model, trainer.global_batch, cfg.data.max_target_length)
    tokens_per_step = trainer.global_batch * cfg.data.max_target_length
    writer = metrics.MetricsWriter(
        Path(cfg.run.metrics_file) if cfg.run.metrics_file else run_dir / "metrics.jsonl",
        run_dir / "tensorboard" if cfg.run.enable_tensorboard else None,
        cfg.run.log_period,
    )
    profiler = _Profiler(cfg, run_dir)
    last = time.perf_counter()
    try:
        for step in range(1, cfg.run.steps + 1):
            profiler.before_step(step)
            batch = device_batch(next(data), trainer.batch_sharding)
            state, stats = step_fn(state, batch)
            stats = jax.device_get(stats)
            now = time.perf_counter()
            seconds, last = now - last, now
            tflops = flops / seconds / trainer.mesh.size / 1e12
            writer.write({
                "step": step, "loss": float(stats["loss"]), "grad_norm": float(stats["grad_norm"]),
                "learning_rate": float(stats["learning_rate"]), "step_seconds": seconds,
                "tflops_per_sec_per_device": tflops,
                "tokens_per_sec_per_device": tokens_per_step / seconds / trainer.mesh.size,
                "mfu": None if peak is None else tflops / peak,
            })
            profiler.after_step(step)
    finally:
        profiler.stop()
        writer.close()

    # ---- report
    report = metrics.run_report(
        writer.records, cfg.run.report_warmup_steps, run_name=cfg.run.run_name, config_digest=config_digest(cfg),
        device_kind=device_kind, num_devices=trainer.mesh.size, mesh=dict(trainer.mesh.shape),
        peak_tflops_per_device=peak, flops_per_step=flops, num_parameters=n_params, compile_seconds=compile_seconds,
        attention_kernel=trainer.model.attention_kernel, global_batch=trainer.global_batch,
        max_target_length=cfg.data.max_target_length,
    )
    (run_dir / "report.json").write_text(json.dumps(report, indent=2))
    log.info("done: final loss %.4f, median %.3f s/step; report %s", report["final_loss"], report["step_seconds"],
             run_dir / "report.json")
    return report


class _Profiler:
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


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        cfg = load_config(argv)
        if not cfg.run.run_name:
            cfg.run.run_name = time.strftime("run_%Y%m%d_%H%M%S")
        log.info("config:\n%s", yaml.safe_dump(flat_dict(cfg), sort_keys=False).rstrip())
        run(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0
