"""Grouped matmuls and the token exchange of dropless mixture-of-experts routing
(`tessera.models.moe`): a grouped matmul multiplies consecutive runs of rows by their group's
matrix (`jax.lax.ragged_dot`, or the Pallas megablox kernel on TPUs); the exchange sends each
expert shard its rows over the `expert` axis and brings the results back (XLA's ragged
all-to-all, or on XLA:CPU a dense all-to-all of padded runs).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from tessera.config import ModelConfig
from tessera.mesh import traced_platform
from tessera.models.quantization import ragged_dot as quantized_ragged_dot

log = logging.getLogger(__name__)


def row_bias(group_sizes, rows: int):
    """A function from a bias [G, N] to each row's group's bias [rows, N], where rows come grouped
    (`group_sizes`) and rows past the groups' total get zeros."""
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")  # G: past every group
    grouped = (group < group_sizes.shape[0])[:, None]
    return lambda bias_gn: jnp.where(grouped, jnp.take(bias_gn, group, axis=0, mode="clip"), 0).astype(bias_gn.dtype)


def grouped_matmul_kernel(cfg: ModelConfig) -> str:
    """"megablox" (the Pallas grouped matmul made for TPUs) when `megablox=true` and the mesh is
    of TPUs, else "ragged_dot" (XLA's grouped matmul, any device), as MaxText chooses."""
    return "megablox" if cfg.megablox and traced_platform() == "tpu" else "ragged_dot"


MEGABLOX_TILE = 128  # rows, contraction and output columns per tile of the Pallas kernel
_FELL_BACK: set[tuple[int, int]] = set()  # widths whose fallback to ragged_dot was logged (once per process)


def grouped_matmul(lhs_md, rhs_gdn, group_sizes, kernel: str, quantization: str = ""):
    """lhs rows [sum(group_sizes[:g]), sum(group_sizes[:g+1])) times rhs[g], for each group g;
    rows past the groups' total are zero. `kernel`: "ragged_dot", "megablox", or
    "megablox_interpret" (the Pallas kernel in its interpreter, to test it on a CPU).
    `quantization` (int8, fp8, ...): qwix's quantized ragged dot, whatever the kernel."""
    if quantization:
        return quantized_ragged_dot(lhs_md, rhs_gdn, group_sizes, quantization)
    m, (k, n) = lhs_md.shape[0], rhs_gdn.shape[1:]
    if kernel != "ragged_dot" and (k % MEGABLOX_TILE or n % MEGABLOX_TILE):
        # the backward pass runs the kernel with k and n swapped, so one tile must fit both
        if (k, n) not in _FELL_BACK:
            _FELL_BACK.add((k, n))
            log.info("megablox=true: grouped matmuls of width %d x %d run jax.lax.ragged_dot (the Pallas kernel "
                     "needs both multiples of %d)", k, n, MEGABLOX_TILE)
        kernel = "ragged_dot"
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(lhs_md, rhs_gdn, group_sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    rows = -(-m // MEGABLOX_TILE) * MEGABLOX_TILE  # the kernel tiles rows only in whole tiles
    tiling = (MEGABLOX_TILE,) * 3
    # the kernel leaves rows of no group unwritten, forward and backward: zero them both ways
    grouped = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
    lhs_md = jnp.where(grouped, lhs_md, 0)
    out = megablox.gmm(jnp.pad(lhs_md, ((0, rows - m), (0, 0))), rhs_gdn, group_sizes.astype(jnp.int32),
                       lhs_md.dtype, tiling, None, None, False, kernel == "megablox_interpret")[:m]
    return jnp.where(grouped, out, 0)


def ragged_exchange(rows, send, send_offsets, recv, recv_offsets, dest_offsets, out_rows, run_rows):
    """Over the `expert` axis: my `send[j]` rows at `send_offsets[j]` of `rows` go to device j,
    landing at `dest_offsets[j]` of its [out_rows, D] result; I receive `recv[i]` rows from
    device i at `recv_offsets[i]`; no run is longer than `run_rows`. Only the rows sent cross
    the network (XLA's ragged all-to-all; TPU and GPU, not XLA:CPU)."""
    del recv_offsets, run_rows  # where received runs land is set by the senders' dest_offsets
    out = jnp.zeros((out_rows, rows.shape[1]), rows.dtype)
    return jax.lax.ragged_all_to_all(rows, out, send_offsets.astype(jnp.int32), send.astype(jnp.int32),
                                     dest_offsets.astype(jnp.int32), recv.astype(jnp.int32), axis_name="expert")


def padded_exchange(rows, send, send_offsets, recv, recv_offsets, dest_offsets, out_rows, run_rows):
    """`ragged_exchange` with a dense all-to-all, each run padded to `run_rows`: for XLA:CPU,
    which has no ragged all-to-all. The same result, but it moves every run at its longest
    possible length, so accelerators use the ragged one."""
    del dest_offsets  # a dense all-to-all puts device i's run in slot i; recv_offsets says where that is
    n, d = rows.shape
    r = jnp.arange(run_rows)
    take = send_offsets[:, None] + r[None, :]  # [destination, slot]
    runs = jnp.where((r[None, :] < send[:, None])[..., None], rows[jnp.clip(take, 0, n - 1)], 0)
    got = jax.lax.all_to_all(runs, "expert", split_axis=0, concat_axis=0, tiled=False)  # [source, slot, D]
    # place source i's first recv[i] rows at recv_offsets[i] of the result
    pos = jnp.where(r[None, :] < recv[:, None], recv_offsets[:, None] + r[None, :], out_rows)  # out_rows: dropped
    return jnp.zeros((out_rows, d), rows.dtype).at[pos.reshape(-1)].set(got.reshape(-1, d), mode="drop")
