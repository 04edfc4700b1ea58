"""optimizer_memory_host_offload (MaxText's key): AdamW's moments live in the host's pinned memory
between steps, and the update streams them through device memory one layer at a time.

The forward and backward passes then run without the moments in device memory (two float32 copies
of the parameters: with FSDP, two thirds of the train state). Moving the whole state in for the
update does not help: XLA fetches it all before the update starts, so the old copies and the new
moments are on the device together, beside the gradients (llama2-7b on v5p-8, AOT: a peak of 42.67
GiB per chip against 29.99 without offload). Here the update runs in two parts:

- each stack of layers (leaves whose first logical axis is `layers`, grouped by their length): a
  `lax.scan` over the layers reads layer i of every moment from host memory, runs the optimizer on
  that slice, writes it back into the host array (dynamic-update-slice into host memory, the pattern
  XLA's host offloader streams) and updates layer i of the parameters in place (stacks of vectors,
  the norms' scales, keep their small moments on the devices: `_place`);
- then the parameters outside the stacks (embeddings, the final norm, the logits): their moments
  move in whole, are updated, and move back.

Each part calls the optimizer's own `update` on a tree in which the other part's leaves are empty
(zero rows): AdamW's transformations are element-wise given the step's global gradient norm (passed
in for the clip) and its count, so the slices update exactly as the whole tree would. Muon is not:
it orthogonalizes whole matrices (refused with it). The non-parameter entries of the state (the
counts) stay in device memory; every part reads them as they were, and they advance once, in the
last part. Llama2-7b, AOT for v5p-8 at 2 x 2048 tokens per chip: 32.05 GiB per chip without
offload, 19.63 with it (12.55 GiB of moments in host memory).

A skipped step (non-finite, or a spike) keeps every slice as it was (a select per slice, where the
step without offload skips the update with `lax.cond`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tessera.config import ConfigError

HOST = "pinned_host"
# in `state_stacks`, entries that stay in device memory: the counts and other non-parameter entries, and the
# moments of stacked vectors
COUNT, ON_DEVICE = -1, -2


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where the optimizer state's parameter-shaped leaves live and how the update streams them."""

    stacks: Any  # the parameters' tree: a streamed leaf's layer count (its leading axis), 0 for the others
    state_stacks: Any  # the optimizer state's tree: the same for its moments; COUNT, ON_DEVICE: on the devices
    state_shardings: Any  # the optimizer state's shardings, parameter-shaped leaves in pinned host memory
    # the parameters' tree: how the update reads the gradients, as the moments are split (on the devices). A layer
    # at a time tells XLA nothing of their layout: the sizing guide's 900B dense model on v6e-256 (fsdp 16 x
    # tensor 16) kept the query and key/value weights' gradient stacks whole over `tensor`, 16 times their share
    # (38.55 GiB per chip, 30.69 with them split)
    grad_shardings: Any


def check_offload(mesh) -> None:
    """ConfigError when the devices have no pinned host memory for the moments (what the config must
    be for the streamed update is checked as it loads: tessera.config.checks)."""
    kinds = {m.kind for m in mesh.devices.flat[0].addressable_memories()}
    if HOST not in kinds:
        raise ConfigError(f"optimizer_memory_host_offload=true keeps the moments in pinned host memory, which "
                          f"{mesh.devices.flat[0].platform} devices here do not have (memories: {sorted(kinds)}); "
                          "set optimizer_memory_host_offload=false")


def make_offload(optimizer, abstract_opt_state, opt_shardings, logical_axes, param_shapes,
                 moment_shardings) -> Offload:
    """The Offload of a trainer: its moments' shardings moved to pinned host memory, and which of
    their leaves the update streams by layer; `moment_shardings` (the parameters' tree) split the moments (the
    parameters' shardings, over data as well with shard_optimizer_over_data)."""
    places = jax.tree.map(_place, logical_axes, param_shapes, is_leaf=lambda x: isinstance(x, tuple))
    stacks = jax.tree.map(lambda n: max(n, 0), places)
    masked = lambda v: isinstance(v, optax.MaskedNode)  # noqa: E731 - partitioned states hold these for others
    state_stacks = optax.tree_map_params(
        optimizer, lambda v, n: v if masked(v) else n, abstract_opt_state, places,
        transform_non_params=lambda _: COUNT, is_leaf=masked)
    shardings = jax.tree.map(lambda s, n: s if n in (COUNT, ON_DEVICE) else s.with_memory_kind(HOST),
                             opt_shardings, state_stacks)
    return Offload(stacks, state_stacks, shardings, moment_shardings)


def _place(axes: tuple, shape) -> int:
    """Where a parameter's moments live and how the update reads them: its layer count (streamed, a layer at a
    time), 0 (host memory, moved in whole) or ON_DEVICE. A stack of vectors ([layers, embed]: the norms' scales)
    stays on the devices: its layers are rows of the TPU's tiled layout, which host transfers cannot slice one
    at a time in bfloat16 ("Strided Host<->HBM DMAs are not supported when slicing partial tiles along
    sublanes"), and it is small (one vector per layer)."""
    if not (axes and axes[0] == "layers"):
        return 0
    return shape.shape[0] if len(shape.shape) >= 3 else ON_DEVICE


def _slice_sharding(sharding: NamedSharding, kind: str) -> NamedSharding:
    """The sharding of one layer of a stacked leaf sharded as `sharding`, in memory `kind`."""
    return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]), memory_kind=kind)


def _empty(x) -> jax.Array:
    """A leaf of no rows standing in for `x` in the part of the update that does not touch it."""
    return jnp.zeros((0, *x.shape[1:]) if x.ndim else (0,), x.dtype)


def streamed_update(optimizer, offload: Offload, grads, opt_state, params, *, learns, global_norm,
                    prepare: Callable = lambda g: g):
    """(new parameters, new optimizer state) of one AdamW step with the moments in host memory:
    `optimizer.update` over each layer of each stack in a scan, then over the leaves outside the
    stacks (moments moved in whole). `prepare` shapes a gradient tree before the update (the mean over
    tokens); `learns` False keeps everything as it was."""
    stacks, state_stacks, shardings = offload.stacks, offload.state_stacks, offload.state_shardings
    grads = jax.lax.with_sharding_constraint(grads, offload.grad_shardings)

    def keep(new, old):
        return jnp.where(learns, new, old)

    def update(g, s, p):
        updates, s_new = optimizer.update(prepare(g), s, p, global_norm=global_norm)
        return optax.apply_updates(p, updates), s_new

    # each stack first: its iterations read the counts as they were before the step
    for length in sorted({n for n in jax.tree.leaves(stacks) if n}):
        params, opt_state = _stream_layers(update, keep, length, stacks, state_stacks, shardings, grads, opt_state,
                                           params)
    # then the parameters outside the stacks, the counts advancing once; the barrier ties the moments' move to
    # the device to the gradients, where XLA would start it with the step, beside the activations
    outside = lambda tree: jax.tree.map(lambda x, n: x if n == 0 else _empty(x), tree, stacks)  # noqa: E731
    opt_state, grads = jax.lax.optimization_barrier((opt_state, grads))
    state_in = jax.tree.map(
        lambda x, n, sh: x if n in (COUNT, ON_DEVICE) else jax.device_put(x, sh.with_memory_kind("device")) if n == 0
        else _empty(x), opt_state, state_stacks, shardings)
    p_in = outside(params)
    p_out, s_out = update(outside(grads), state_in, p_in)
    params = jax.tree.map(lambda x, new, old, n: x if n else keep(new, old), params, p_out, p_in, stacks)
    opt_state = jax.tree.map(
        lambda x, new, old, n, sh: keep(new, old) if n in (COUNT, ON_DEVICE)
        else jax.device_put(keep(new, old), sh) if n == 0 else x,
        opt_state, s_out, state_in, state_stacks, shardings)
    return params, opt_state


def _stream_layers(update, keep, length, stacks, state_stacks, shardings, grads, opt_state, params):
    """The update of the stacks of `length` layers, one layer per iteration of a scan."""
    def at(x, i):
        return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)

    def layer(carry, i):
        params, opt_state = carry
        p_i = jax.tree.map(lambda x, n: at(x, i) if n == length else _empty(x), params, stacks)
        g_i = jax.tree.map(lambda x, n: at(x, i) if n == length else _empty(x), grads, stacks)
        s_i = jax.tree.map(
            lambda x, n, sh: jax.device_put(at(x, i), _slice_sharding(sh, "device")) if n == length
            else x if n == COUNT else _empty(x), opt_state, state_stacks, shardings)
        p_new, s_new = update(g_i, s_i, p_i)
        params = jax.tree.map(
            lambda x, new, old, n: jax.lax.dynamic_update_index_in_dim(x, keep(new, old), i, 0) if n == length
            else x, params, p_new, p_i, stacks)
        opt_state = jax.tree.map(
            lambda x, new, old, n, sh: jax.lax.dynamic_update_index_in_dim(
                x, jax.device_put(keep(new, old), _slice_sharding(sh, HOST)), i, 0) if n == length else x,
            opt_state, s_new, s_i, state_stacks, shardings)
        return (params, opt_state), None

    (params, opt_state), _ = jax.lax.scan(layer, (params, opt_state), jnp.arange(length))
    return params, opt_state
