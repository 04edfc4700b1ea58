"""Grouped matmuls and the token exchange of dropless mixture-of-experts routing
(`tessera.models.moe`): a grouped matmul multiplies consecutive runs of rows by their group's
matrix (`jax.lax.ragged_dot`, or the Pallas megablox kernel on TPUs); the exchange sends each
expert shard its rows over the `expert` axis and brings the results back (XLA's ragged
all-to-all, or on XLA:CPU a dense all-to-all of padded runs).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from tessera.config import ModelConfig
from tessera.mesh import traced_platform
from tessera.models.precision import at_default_precision
from tessera.models.quantization import ragged_dot as quantized_ragged_dot

log = logging.getLogger(__name__)


def row_bias(group_sizes, rows: int):
    """A function from a bias [G, N] to each row's group's bias [rows, N], where rows come grouped
    (`group_sizes`) and rows past the groups' total get zeros."""
    group = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")  # G: past every group
    return lambda bias_gn: _rows_bias(bias_gn, group, bias_gn.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rows_bias(bias_gn, group_r, groups: int):
    """bias_gn[group_r] (zeros where group_r >= groups, G). The gradient is a matmul of the rows'
    one-hot groups with the rows' cotangent, not the gather's own gradient, a scatter-add of every
    row: the TPU compiler runs that on 32-bit buffers of the rows' size, and in the v5p
    gpt-oss-120b recipe (131072 rows of 2880 per expert shard, three biases a layer) they cost
    5.2 GiB per chip."""
    return jnp.where((group_r < groups)[:, None], jnp.take(bias_gn, group_r, axis=0, mode="clip"), 0)


def _rows_bias_fwd(bias_gn, group_r, groups):
    return _rows_bias(bias_gn, group_r, groups), group_r


def _rows_bias_bwd(groups, group_r, g_rn):
    one_hot_rg = jax.nn.one_hot(group_r, groups, dtype=g_rn.dtype)  # rows past every group: zeros
    return jnp.einsum("rg,rn->gn", one_hot_rg, g_rn, preferred_element_type=jnp.float32).astype(g_rn.dtype), None


_rows_bias.defvjp(_rows_bias_fwd, _rows_bias_bwd)


def grouped_matmul_kernel(cfg: ModelConfig) -> str:
    """"megablox" (the Pallas grouped matmul made for TPUs) when `megablox=true` and the mesh is
    of TPUs, else "ragged_dot" (XLA's grouped matmul, any device), as MaxText chooses."""
    return "megablox" if cfg.megablox and traced_platform() == "tpu" else "ragged_dot"


LANES = 128  # the TPU vector lane width: the Pallas kernel's tiles are whole multiples of it
# VMEM one grouped matmul's tiles may take: TPUs v4 and v5 give a kernel 16 MiB of scoped VMEM by default (v6e 32)
TILE_VMEM_BYTES = 14 * 2**20
_SHRUNK: set[tuple] = set()  # tile choices whose shrinking was logged (once per process)


def tile_vmem_bytes(tm: int, tk: int, tn: int, itemsize: int) -> int:
    """VMEM of the kernel's tiles: the two input tiles and the output tile, each double-buffered, and
    the float32 accumulator (the output tile's size forward, [tk, tn] for the weights' gradient)."""
    return 2 * itemsize * (tm * tk + tk * tn + tm * tn) + 4 * tn * max(tm, tk)


def megablox_tiles(tile_rows: int, tile_contraction: int, tile_out: int, itemsize: int, m: int, k: int, n: int):
    """The Pallas kernel's tile (rows, contraction, output columns) for an [m, k] x [k, n] product: the
    configured sizes (`tile_batch_seq`, `tile_activation_dim`, `tile_weight_dim`), a narrower matrix
    taken whole, the wider of the column tiles halved while the tiles would not fit TILE_VMEM_BYTES
    (float32's tiles take twice bfloat16's). The kernel asks again with its own dimensions for each
    backward product, where k and n trade places; a width that is no multiple of the tile ends in a
    partial tile, which the kernel masks."""
    tm, tk, tn = min(tile_rows, m), min(tile_contraction, k), min(tile_out, n)
    chosen = (tm, tk, tn)
    while tile_vmem_bytes(tm, tk, tn, itemsize) > TILE_VMEM_BYTES and max(tk, tn) > LANES:
        if tk >= tn:
            tk = max(LANES, tk // 2 // LANES * LANES)
        else:
            tn = max(LANES, tn // 2 // LANES * LANES)
    if (tm, tk, tn) != chosen and (chosen, itemsize) not in _SHRUNK:
        _SHRUNK.add((chosen, itemsize))
        log.info("megablox: tiles %s of %d-byte values need %.0f MiB of VMEM, more than %d: the grouped matmul of "
                 "[%d, %d] x [%d, %d] uses %s", chosen, itemsize, tile_vmem_bytes(*chosen, itemsize) / 2**20,
                 TILE_VMEM_BYTES // 2**20, m, k, k, n, (tm, tk, tn))
    return tm, tk, tn


def grouped_matmul(lhs_md, rhs_gdn, group_sizes, kernel: str, quantization: str = "",
                   tiles: tuple[int, int, int] = (512, 1024, 1024)):
    """lhs rows [sum(group_sizes[:g]), sum(group_sizes[:g+1])) times rhs[g], for each group g;
    rows past the groups' total are zero. `kernel`: "ragged_dot", "megablox", or
    "megablox_interpret" (the Pallas kernel in its interpreter, to test it on a CPU); `tiles`:
    the kernel's largest tile (multiples of 128; see `megablox_tiles`).
    `quantization` (int8, fp8, ...): qwix's quantized ragged dot, whatever the kernel."""
    if quantization:
        return quantized_ragged_dot(lhs_md, rhs_gdn, group_sizes, quantization)
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(lhs_md, rhs_gdn, group_sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    m = lhs_md.shape[0]
    # the kernel tiles rows only in whole tiles (of at most tile_batch_seq, at least one lane's worth)
    tile_rows = min(tiles[0], -(-m // LANES) * LANES)
    rows = -(-m // tile_rows) * tile_rows
    tiling = functools.partial(megablox_tiles, tile_rows, *tiles[1:], lhs_md.dtype.itemsize)
    # the kernel leaves rows of no group unwritten, forward and backward: zero them both ways
    grouped = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
    lhs_md = jnp.where(grouped, lhs_md, 0)
    def gmm(lhs, rhs, sizes):
        return megablox.gmm(lhs, rhs, sizes, lhs_md.dtype, tiling, None, None, False, kernel == "megablox_interpret")

    # (matmul_precision does not reach the kernel's products)
    out = at_default_precision(gmm, jnp.pad(lhs_md, ((0, rows - m), (0, 0))), rhs_gdn, group_sizes.astype(jnp.int32))
    out = out[:m]
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
