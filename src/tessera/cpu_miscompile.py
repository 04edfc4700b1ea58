"""A guard against a wrong-results bug of XLA:CPU (jax 0.12.0.1, the version the lock pins).

On a CPU mesh whose `data`, `fsdp` and `tensor` axes are all above 1, the attention's output
projection, einsum("btnh,nhd->btd") with the heads split over `tensor`, the weight's model axis
over `fsdp` and the result's rows over (data, fsdp) and its model axis over `tensor` (the
residual stream's sequence-parallel layout), comes back with rows of different batch shards
exchanged: the compiled program permutes devices and never permutes them back. Training on such
a mesh silently computed other losses than one device (0.6% at the first step, 33% in the
gradient norm). It happens without Tessera too, on the same shardings; a TPU compile of them has
no such permute.

`check_cpu_mesh` runs that einsum on the run's own mesh (a fraction of a second) and refuses the
mesh when the result is wrong, so that a fixed jax makes the check pass by itself.
"""

from __future__ import annotations

import numpy as np

from tessera.config import ConfigError


def einsum_is_right(mesh) -> bool:
    """Whether the output projection's einsum, with the shardings above, computes the right rows on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows, heads, model = mesh.shape["data"] * mesh.shape["fsdp"], 2 * mesh.shape["tensor"], \
        4 * mesh.shape["fsdp"] * mesh.shape["tensor"]
    rng = np.random.default_rng(0)
    context = rng.standard_normal((rows, 2, heads, 4)).astype(np.float32)
    weight = rng.standard_normal((heads, 4, model)).astype(np.float32)
    batch = ("data", "fsdp")
    out_sharding = NamedSharding(mesh, P(batch, None, "tensor"))

    def project(c, w):
        return jax.lax.with_sharding_constraint(jnp.einsum("btnh,nhd->btd", c, w), out_sharding)

    got = jax.jit(project)(jax.device_put(context, NamedSharding(mesh, P(batch, None, "tensor", None))),
                           jax.device_put(weight, NamedSharding(mesh, P("tensor", None, "fsdp"))))
    return bool(np.allclose(np.asarray(got), np.einsum("btnh,nhd->btd", context, weight), rtol=1e-4, atol=1e-4))


def check_cpu_mesh(mesh) -> None:
    """ConfigError for a CPU mesh with data, fsdp and tensor all above 1 on which XLA:CPU computes
    the output projection wrongly (see the module's docstring); nothing for any other mesh."""
    import jax

    if mesh.devices.flat[0].platform != "cpu" or not all(mesh.shape.get(a, 1) > 1 for a in ("data", "fsdp", "tensor")):
        return
    if einsum_is_right(mesh):
        return
    shape = ", ".join(f"{a} {mesh.shape[a]}" for a in ("data", "fsdp", "tensor"))
    raise ConfigError(f"on CPU, this jax ({jax.__version__}) computes wrong results on a mesh with {shape}: XLA:CPU "
                      "exchanges rows of the batch shards in the attention's output projection (checked just now, "
                      "without Tessera's model); use at most two of the data, fsdp and tensor axes above 1 on CPU "
                      "(an axis is ici_<axis>_parallelism x dcn_<axis>_parallelism, fsdp also x the "
                      "fsdp_transpose keys; src/tessera/cpu_miscompile.py)")
