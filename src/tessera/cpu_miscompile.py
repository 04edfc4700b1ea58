"""A guard against a wrong-results bug of XLA:CPU (jax 0.12.0.1, the version the lock pins).

On a CPU mesh whose `data`, `fsdp` and `tensor` axes are all above 1, the attention's output
projection, einsum("btnh,nhd->btd") with the heads split over `tensor`, the weight's model axis
over `fsdp` and the result's rows over (data, fsdp) and its model axis over `tensor` (the
residual stream's sequence-parallel layout), comes back with rows of different batch shards
exchanged: the compiled program permutes devices and never permutes them back. Training on such
a mesh silently computed other losses than one device (0.6% at the first step, 33% in the
gradient norm). It happens without Tessera too, on the same shardings; a TPU compile of them has
no such permute. The `expert` axis splits the batch and the weight's model axis as `fsdp` does
(`LOGICAL_RULES`), so data x expert x tensor is the same product and is computed as wrongly.

`check_cpu_mesh` runs that einsum on the run's own mesh, with the shardings `LOGICAL_RULES` give
its operands there (a fraction of a second), whenever they use three mesh axes or more, and
refuses the mesh when the result is wrong, so that a fixed jax makes the check pass by itself.
"""

from __future__ import annotations

import numpy as np

from tessera.config import ConfigError

# the output projection's operands and result, by their logical names in the attention (models/attention.py)
# and the residual stream's at the block boundary (models/blocks.py)
CONTEXT, WEIGHT, OUTPUT = ("batch", "length", "act_heads", None), ("heads", "head_dim", "embed"), \
    ("batch", "length", "act_embed")


def _operands(sizes: dict[str, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes (context [B, T, N, H], weight [N, H, D]) that every mesh axis their rules name divides."""
    from tessera.mesh import LOGICAL_RULES

    def ways(name: str) -> int:
        return int(np.prod([sizes.get(a, 1) for a in LOGICAL_RULES[name]]))

    heads = 2 * ways("act_heads") * ways("heads")
    return (ways("batch"), 2 * ways("length"), heads, 4), (heads, 4, 4 * ways("embed") * ways("act_embed"))


def _specs(sizes: dict[str, int]):
    """The PartitionSpecs of (context, weight, output) on a mesh of `sizes`."""
    from tessera.mesh import logical_spec

    context, weight = _operands(sizes)
    output = (context[0], context[1], weight[2])
    return tuple(logical_spec(n, s, sizes) for n, s in ((CONTEXT, context), (WEIGHT, weight), (OUTPUT, output)))


def axes_used(sizes: dict[str, int]) -> list[str]:
    """The mesh axes (above 1, in mesh order) the output projection's operands and result are split over."""
    from tessera.mesh import MESH_AXES

    named = {a for spec in _specs(sizes) for dim in spec if dim for a in (dim if isinstance(dim, tuple) else (dim,))}
    return [a for a in MESH_AXES if a in named]


def einsum_is_right(mesh) -> bool:
    """Whether the output projection's einsum, with its shardings on `mesh`, computes the right rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    sizes = dict(mesh.shape)
    (context_shape, weight_shape), (context_spec, weight_spec, out_spec) = _operands(sizes), _specs(sizes)
    rng = np.random.default_rng(0)
    context = rng.standard_normal(context_shape).astype(np.float32)
    weight = rng.standard_normal(weight_shape).astype(np.float32)
    out_sharding = NamedSharding(mesh, out_spec)

    def project(c, w):
        return jax.lax.with_sharding_constraint(jnp.einsum("btnh,nhd->btd", c, w), out_sharding)

    got = jax.jit(project)(jax.device_put(context, NamedSharding(mesh, context_spec)),
                           jax.device_put(weight, NamedSharding(mesh, weight_spec)))
    # gathered whole onto every device by a program of its own, so that every process of a job reads all of it
    # (a process cannot read another's shards) and they all reach the same verdict
    got = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))(got)
    return bool(np.allclose(np.asarray(got), np.einsum("btnh,nhd->btd", context, weight), rtol=1e-4, atol=1e-4))


def check_cpu_mesh(mesh) -> None:
    """ConfigError for a CPU mesh on which XLA:CPU computes the output projection wrongly (see the
    module's docstring); nothing for any other mesh, or one whose projection uses two axes or fewer."""
    import jax

    axes = axes_used(dict(mesh.shape))
    if mesh.devices.flat[0].platform != "cpu" or "tensor" not in axes or len(axes) < 3:
        return
    if einsum_is_right(mesh):
        return
    shape = ", ".join(f"{a} {mesh.shape[a]}" for a in axes)
    named = f"{', '.join(axes[:-1])} and {axes[-1]}"
    raise ConfigError(f"on CPU, this jax ({jax.__version__}) computes wrong results on a mesh with {shape}: XLA:CPU "
                      "exchanges rows of the batch shards in the attention's output projection (checked just now, "
                      f"without Tessera's model); use at most two of the {named} axes above 1 on CPU "
                      "(an axis is ici_<axis>_parallelism x dcn_<axis>_parallelism, fsdp also x the "
                      "fsdp_transpose keys; src/tessera/cpu_miscompile.py)")
