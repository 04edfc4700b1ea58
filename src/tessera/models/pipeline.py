"""Pipeline parallelism: the decoder's blocks split over the `stage` mesh axis.

Each of the S stages holds R groups of B consecutive blocks (B = blocks per stage, R =
`num_pipeline_repeats`); group r of stage s is the model's chunk r*S + s, so a microbatch goes
round the ring of stages R times (circular pipelining when R > 1, GPipe when R = 1). The
batch is cut into M microbatches (`num_pipeline_microbatches`, rows interleaved so every
microbatch keeps the batch's data/fsdp split). After each iteration every stage hands its
output to the next with one collective permute (in a circular pipeline the last stage's goes
back to stage 0). The next stage works on it H iterations later (the hop, H = 1; H = 2 with
`pipeline_delay_activation_forwarding`, so that the transfer runs during an iteration whose
compute does not need it). The schedule runs M*R + H*(S - 1) iterations; at iteration t stage s
works on item k = t - H*s (microbatch k mod M, repeat k div M) when 0 <= k < M*R and idles
otherwise (the bubble: H*(S - 1) / (M*R + H*(S - 1)) of the iterations). Stage 0 takes a fresh
microbatch in repeat 0 and in later repeats the output of the last stage's previous repeat,
kept in a buffer of M microbatches because it arrives M - H*S iterations before it is needed
(M >= H*S is required).

The loop runs inside `shard_map`, manual over `stage` only: data, fsdp, tensor and expert
splits inside a stage are left to the compiler as everywhere else, and the blocks' own
kernels (splash attention, dropless MoE) nest their own `shard_map` as usual. An fsdp-split
weight is then gathered where each iteration uses it, in the forward and again in the
backward; with `pipeline_fsdp_ag_once` a stage's weights are gathered over fsdp once, before
the iterations, for the memory of the stage's whole weights on every device. The blocks send
their weights' gradients to the fsdp shares, each iteration's to its group's rows
(`group_weights`), so no device holds a whole stage's gradient.

Parameters. With R = 1 the stacked blocks keep the layout of `scan_layers=true`, [L, ...],
their first axis split over `stage`, so a checkpoint moves between pipelined and plain runs
unchanged. With R > 1 they are stored [R, L/R, ...]: flattening the first two axes gives back
the plain order, and splitting the second over `stage` gives stage s exactly its R groups.
`tessera.checkpointing` reshapes between the two on restore.

Auxiliary values. A group's scalars (the MoE losses) are averaged over all blocks and
microbatches. Entries whose key starts with `PER_LAYER` ("per_layer/", e.g. the expert loads
that move DeepSeek's routing biases) are one row per block: they come back averaged over the
microbatches, [L, ...] in the model's block order (as `scan_layers=true` gives them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tessera.config.derived import PipelineLayout
from tessera.mesh import logical_spec

__all__ = ["PER_LAYER", "PipelineLayout", "StageWeights", "block_weights", "group_weights", "run_pipeline",
           "stacked_shape", "stage_specs"]

# aux keys with this prefix hold one row per block (stacked), not one value to average
PER_LAYER = "per_layer/"


def stacked_shape(layout: PipelineLayout | None, num_blocks: int) -> tuple[int, ...]:
    """The leading axes of the stacked block parameters: (L,) or (R, L/R) when circular."""
    if layout is None or layout.repeats == 1:
        return (num_blocks,)
    return (layout.repeats, num_blocks // layout.repeats)


def stage_specs(layout: PipelineLayout, stacked, names, mesh_sizes: dict[str, int], gathered: bool):
    """A PartitionSpec per leaf of `stacked` (the blocks' weights, leading axes `stacked_shape`,
    logical axis `names` per leaf) for a stage's [R, B, ...] share of it, split as the weight
    itself (`mesh.logical_spec`), without the fsdp split when `gathered`
    (`pipeline_fsdp_ag_once`)."""
    lead = 1 if layout.repeats == 1 else 2

    def without_fsdp(entry):
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in (None, "fsdp"))
        return axes[0] if len(axes) == 1 else axes or None

    def share(a, leaf_names):
        split = tuple(logical_spec(tuple(leaf_names), a.shape, mesh_sizes))[lead:]
        return P(None, None, *(tuple(without_fsdp(e) for e in split) if gathered else split))

    return jax.tree.map(share, stacked, names)


# A block's weights are `stage[repeat, layer]`, taken where the block runs (inside its remat region,
# if any, so the backward pass takes them again; kept, the pipeline's loop would hold a copy per
# iteration). Their gradient is routed through a "sink": zeros the shape of one group, made in each
# iteration from the stage's weights. Plain indexing would form the stage's whole gradient inside
# the group's scan as well as in the pipeline's loop, two stage-sized sums (whole stages with
# pipeline_fsdp_ag_once).
@jax.custom_vjp
def _block_weight(stage, sink, repeat, layer):
    return stage[repeat, layer]


_block_weight.defvjp(lambda stage, sink, repeat, layer: (stage[repeat, layer], None),
                     lambda _, g: (None, g, None, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _group_sink(repeats, stage, repeat):
    return jnp.zeros(stage.shape[1:], stage.dtype)


def _group_sink_fwd(repeats, stage, repeat):
    return _group_sink(repeats, stage, repeat), repeat


def _group_sink_bwd(repeats, repeat, g):
    return jnp.zeros((repeats, *g.shape), g.dtype).at[repeat].set(g), None


_group_sink.defvjp(_group_sink_fwd, _group_sink_bwd)


@dataclasses.dataclass(frozen=True)
class StageWeights:
    """A stage's [R, B, ...] blocks' weights in the pipeline's loop: `compute`, what the blocks
    compute with (gathered over fsdp with pipeline_fsdp_ag_once, else `shares`); `shares`, the
    stage's weights as stored, where their gradient goes; `specs`, the shares' PartitionSpecs
    (None: as the compiler places them)."""
    compute: object
    shares: object
    specs: object = None


def group_weights(weights: StageWeights, repeat):
    """(stage, sinks) for running group `repeat` with each block taking its weights where it
    runs, inside its remat region if any (`block_weights`): `stage` is `weights.compute` cut off
    from the gradient, `sinks` per leaf zeros [B, ...] (split as the shares) whose gradient
    becomes the group's rows of the shares' gradient. Scan the blocks over the sinks. With
    pipeline_fsdp_ag_once the gradient so reaches the fsdp shares directly: no gradient of a
    whole gathered stage."""
    sinks = jax.tree.map(lambda a: _group_sink(a.shape[0], a, repeat), weights.shares)
    if weights.specs is not None:
        sinks = jax.tree.map(lambda z, spec: jax.lax.with_sharding_constraint(z, P(*tuple(spec)[1:])), sinks,
                             weights.specs)
    return jax.tree.map(jax.lax.stop_gradient, weights.compute), sinks


def block_weights(stage, sinks, repeat, layer):
    """Block `layer` of group `repeat` of `stage` (`group_weights`); its gradient goes to `sinks`
    (this block's rows of them)."""
    return jax.tree.map(lambda a, s: _block_weight(a, s, repeat, layer), stage, sinks)


def _microbatches(a, m: int):
    """[B, ...] -> [M, B/M, ...]; microbatch i holds rows i, i + M, ... (keeps the batch split)."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _whole_batch(a):
    """The inverse of `_microbatches`: [M, B/M, ...] -> [B, ...]."""
    return jnp.swapaxes(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def run_pipeline(layout: PipelineLayout, run_group, stacked, keys, use_keys: bool, x, positions, segments,
                 specs=None, gathered_specs=None):
    """(x after every block [B, T, D], aux): aux's scalars averaged over blocks and microbatches,
    its `PER_LAYER` entries averaged over microbatches and stacked over the L blocks in the
    model's order.

    `run_group(weights, repeat, h, positions, segments, group_keys) -> (h, aux)` runs group
    `repeat` of `layout.blocks_per_stage` blocks on one microbatch; `weights` is this stage's
    `StageWeights` ([R, B, ...]: the blocks take the group's where they run, through
    `group_weights`, so that remat regions take them again in the backward pass); its aux
    holds scalars already averaged over the group and `PER_LAYER` entries [B, ...].
    `stacked`: the blocks' parameters, leading axes `stacked_shape`; `keys`: dropout keys [L]
    (`use_keys`; else placeholders [L] that `run_group` ignores). With `layout.gather_fsdp_once`,
    `specs` and `gathered_specs` are `stage_specs` of `stacked` with and without the fsdp split:
    the weights take the gathered one once, before the iterations; their gradients go to the
    shares, split as `specs`."""
    s_, r_, b_, m_ = layout.stages, layout.repeats, layout.blocks_per_stage, layout.microbatches
    # [R, S, B, ...] views whose stage axis is the one split over `stage`
    grouped = jax.tree.map(lambda a: a.reshape(r_, s_, b_, *a.shape[1 if r_ == 1 else 2:]), stacked)
    grouped_keys = keys.reshape(r_, s_, b_, *keys.shape[1:])
    xs, pos, seg = (_microbatches(a, m_) for a in (x, positions, segments))
    stage_split = P(None, "stage")
    outputs, aux, per_layer = jax.shard_map(
        _stage_program(layout, run_group, use_keys, specs, gathered_specs),
        in_specs=(jax.tree.map(lambda _: stage_split, grouped), stage_split, P(), P(), P()),
        out_specs=(P("stage"), P(), P(None, "stage")), axis_names={"stage"}, check_vma=False,
    )(grouped, grouped_keys, xs, pos, seg)
    # [R, S, B, ...]: group r of stage s is chunk r*S + s, so the flat order is the blocks' order
    aux.update({k: v.reshape(r_ * s_ * b_, *v.shape[3:]) for k, v in per_layer.items()})
    return _whole_batch(outputs[s_ - 1]), aux


def _add_aux(total: dict, aux: dict, valid, repeat) -> dict:
    """`total` plus one iteration's `aux` where `valid`: scalars summed, `PER_LAYER` entries into row `repeat`."""
    out = {}
    for k, v in aux.items():
        v = jnp.where(valid, v, 0.0)
        out[k] = total[k].at[repeat].add(v) if k.startswith(PER_LAYER) else total[k] + v
    return out


def _stage_program(layout: PipelineLayout, run_group, use_keys: bool, specs, gathered_specs):
    """run_pipeline's program for one stage, run under `shard_map` over `stage`: (this stage's groups
    [R, 1, B, ...], their keys [R, 1, B, ...], the microbatches xs, pos, seg [M, B/M, ...]) ->
    (outputs [1, M, B/M, ...], aux scalars averaged over every block and microbatch, per-layer aux
    [R, 1, B, ...] averaged over microbatches)."""
    s_, r_, m_, hop = layout.stages, layout.repeats, layout.microbatches, layout.hop
    items, iterations = m_ * r_, layout.iterations
    # each stage hands its output to the next; only a circular pipeline sends the last stage's back to stage 0
    ring = [(i, (i + 1) % s_) for i in range(s_ if r_ > 1 else s_ - 1)]

    def local(params, group_keys, xs, pos, seg):
        shares = jax.tree.map(lambda a: a[:, 0], params)  # [R, B, ...]: this stage's groups
        compute = shares
        if gathered_specs is not None:  # gathered once here, a loop invariant: not again in every iteration
            compute = jax.tree.map(jax.lax.with_sharding_constraint, shares, gathered_specs)
        params = StageWeights(compute, shares, specs)
        group_keys = group_keys[:, 0]
        stage = jax.lax.axis_index("stage")
        aux_shape = jax.eval_shape(lambda: run_group(params, 0, xs[0], pos[0], seg[0], group_keys[0])[1])
        # per-layer rows are summed into this stage's slot of each repeat: [R, B, ...]
        zeros_aux = {k: jnp.zeros((r_, *a.shape) if k.startswith(PER_LAYER) else a.shape, jnp.float32)
                     for k, a in aux_shape.items()}

        def iteration(carry, t):
            previous, in_flight, loop_back, outputs, aux_sum = carry
            received = jax.lax.ppermute(previous, "stage", ring)
            # what this stage works on from the previous one: with hop 2 it was sent during the
            # last iteration, so this iteration's compute does not wait for `received`
            arrived = received if hop == 1 else in_flight
            if r_ > 1:  # stage 0 keeps what the last stage finished, for that microbatch's next repeat
                done = t - hop * s_  # the item whose last-stage output arrives now
                keep = (stage == 0) & (done >= 0) & (done < items - m_)
                slot = jnp.clip(done, 0, items - 1) % m_
                loop_back = loop_back.at[slot].set(jnp.where(keep, arrived, loop_back[slot]))
            k = t - hop * stage
            valid = (k >= 0) & (k < items)
            k = jnp.clip(k, 0, items - 1)
            mb, repeat = k % m_, k // m_
            first = xs[mb] if r_ == 1 else jnp.where(repeat == 0, xs[mb], loop_back[mb])
            h = jnp.where(stage == 0, first, arrived)
            step_keys = group_keys[repeat]
            if use_keys:  # the same block draws a different mask for each microbatch
                step_keys = jax.vmap(lambda key: jax.random.fold_in(key, mb))(step_keys)
            h, aux = run_group(params, repeat, h, pos[mb], seg[mb], step_keys)
            last = valid & (stage == s_ - 1) & (repeat == r_ - 1)
            outputs = outputs.at[mb].set(jnp.where(last, h, outputs[mb]))
            aux_sum = _add_aux(aux_sum, aux, valid, repeat)
            return (h, received if hop > 1 else in_flight, loop_back, outputs, aux_sum), None

        placeholder = jnp.zeros((), xs.dtype)
        start = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs[0]) if hop > 1 else placeholder,
                 jnp.zeros_like(xs) if r_ > 1 else placeholder, jnp.zeros_like(xs), zeros_aux)
        (_, _, _, outputs, aux_sum), _ = jax.lax.scan(iteration, start, jnp.arange(iterations))
        # every item passes every stage once: the mean over all blocks and microbatches
        aux = {k: jax.lax.psum(v, "stage") / (items * s_) for k, v in aux_sum.items() if not k.startswith(PER_LAYER)}
        # each block ran once per microbatch; [R, B, ...] -> [R, 1, B, ...], gathered over stages below
        per_layer = {k: (v / m_)[:, None] for k, v in aux_sum.items() if k.startswith(PER_LAYER)}
        return outputs[None], aux, per_layer

    return local
