"""TPU flash attention: Pallas splash attention from `jax.experimental.pallas.ops.tpu`.

Why this kernel: it ships with the pinned jax (no extra dependency whose releases could drift
from jax's), it is the kernel MaxText's TPU figures are measured with, and its block-sparse
masks skip the masked half of causal attention and everything outside a sliding window
without computing it. It supports everything Tessera's attention does: causal masks, sliding
windows (a `LocalMask`), packed documents (segment ids), grouped-query heads (the "MQA"
variant, vmapped over kv heads), score soft-capping (`attn_logits_soft_cap`), and any score
scale (the queries are multiplied by it first, as the kernel does not scale).

Layout: queries [B, T, N, H] become [B, K, G, T, H] (K kv heads, G = N/K queries per kv head);
the kernel runs on one batch row and one kv head at a time (vmapped). Under a mesh it runs
inside `shard_map`: batch split over data/fsdp/expert, heads over tensor (kv heads too when
tensor divides them, else they are repeated to the query heads first), the sequence whole.
Tests run the same code with `interpret=True` (Pallas' interpreter on CPU).

Block sizes are the `sa_block_*` keys (MaxText's names); 0 picks the largest of 512, 256 and
128 that divides the sequence length.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from tessera.config import ConfigError, ModelConfig

BLOCK_KEYS = ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv",
              "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")
LANE = 128  # the kernel tiles the sequence in multiples of this


def unsupported(m: ModelConfig, length: int, mesh_shape: dict[str, int] | None) -> str | None:
    """Why splash attention cannot serve this model and sequence length, or None if it can."""
    if not length:
        return "the sequence length is not known here; splash attention is chosen only with one"
    if length % LANE:
        return f"splash attention needs a sequence length that is a multiple of {LANE}, not {length}"
    if mesh_shape and mesh_shape.get("sequence", 1) > 1:
        return "splash attention here keeps the sequence whole on each device; the mesh splits it (sequence axis)"
    return None


def block_sizes(m: ModelConfig, length: int, use_fused_bwd: bool | None = None) -> sa.BlockSizes:
    """The kernel's tiles from the sa_block_* keys; ConfigError for any that does not divide `length`."""
    auto = next(b for b in (512, 256, LANE) if length % b == 0)
    chosen, bad = {}, []
    for name in BLOCK_KEYS:
        value = getattr(m, name) or auto
        value = min(value, length)
        if length % value or value % LANE:
            bad.append(f"{name}={getattr(m, name)}")
        chosen[name] = value
    if bad:
        raise ConfigError(f"{', '.join(bad)}: splash attention block sizes must be multiples of {LANE} that divide "
                          f"the sequence length {length} (0 picks one); e.g. {auto}")
    fused = m.sa_use_fused_bwd_kernel if use_fused_bwd is None else use_fused_bwd
    layout = {name: getattr(sa.QKVLayout, getattr(m, f"sa_{name}_layout").upper())
              for name in ("q", "k", "v")}
    return sa.BlockSizes(
        block_q=chosen["sa_block_q"], block_kv=chosen["sa_block_kv"], block_kv_compute=chosen["sa_block_kv_compute"],
        block_q_dkv=chosen["sa_block_q_dkv"], block_kv_dkv=chosen["sa_block_kv_dkv"],
        block_kv_dkv_compute=chosen["sa_block_kv_dkv_compute"],
        block_q_dq=None if fused else chosen["sa_block_q_dq"], block_kv_dq=None if fused else chosen["sa_block_kv_dq"],
        use_fused_bwd_kernel=fused, q_layout=layout["q"], k_layout=layout["k"], v_layout=layout["v"])


def _kernel(groups: int, length: int, window: int, cap: float, blocks: sa.BlockSizes, interpret: bool):
    """A splash MQA kernel for `groups` query heads sharing one kv head. Built afresh for every
    call being traced: its mask tables become arrays of the trace that builds it, so a kernel kept
    from one trace (a scan's body: deepseek's dense layers) and used in another (its expert
    layers) would hold a leaked tracer."""
    if window:
        mask = sa.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
    else:
        mask = sa.CausalMask((length, length))
    return sa.make_splash_mqa_single_device(sa.MultiHeadMask([mask] * groups), block_sizes=blocks,
                                            attn_logits_soft_cap=cap or None, interpret=interpret)


def _attend(q_btnh, k_bskh, v_bskh, segment_bt, *, scale, cap, window, blocks, interpret):
    """Splash attention on local arrays (one device's shard)."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q = (q_btnh * jnp.asarray(scale, q_btnh.dtype)).reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4)
    k, v = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)  # [B, K, S, H]
    kernel = _kernel(n // kv, t, window, float(cap), blocks, interpret)

    def one(q_gth, k_sh, v_sh, seg_t):
        return kernel(q_gth, k_sh, v_sh, segment_ids=sa.SegmentIds(q=seg_t, kv=seg_t))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))  # over kv heads
    out = jax.vmap(per_head, in_axes=(0, 0, 0, 0))(q, k, v, segment_bt)  # over batch rows: [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def splash_attention(q_btnh, k_bskh, v_bskh, segment_bt, *, scale: float, logits_soft_cap: float = 0.0,
                     window: int = 0, blocks: sa.BlockSizes, interpret: bool = False):
    """Causal attention of q [B, T, N, H] over k, v [B, T, K, H] within segments, as
    `attention.dot_product_attention` computes it, with the splash kernel."""
    attend = functools.partial(_attend, scale=scale, cap=logits_soft_cap, window=window, blocks=blocks,
                               interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape.values()) == 1:
        return attend(q_btnh, k_bskh, v_bskh, segment_bt)
    sizes = dict(mesh.shape)
    batch = tuple(a for a in ("data", "fsdp", "expert") if sizes.get(a, 1) > 1)
    ways = math.prod(sizes[a] for a in batch)
    batch = batch if batch and q_btnh.shape[0] % ways == 0 else ()
    heads = "tensor" if sizes.get("tensor", 1) > 1 else None
    if heads and k_bskh.shape[2] % sizes["tensor"]:  # fewer kv heads than tensor ways: one per query head
        repeat = q_btnh.shape[2] // k_bskh.shape[2]
        k_bskh, v_bskh = jnp.repeat(k_bskh, repeat, axis=2), jnp.repeat(v_bskh, repeat, axis=2)
    batch_spec = (batch if len(batch) > 1 else batch[0]) if batch else None
    qkv = P(batch_spec, None, heads, None)
    return jax.shard_map(attend, in_specs=(qkv, qkv, qkv, P(batch_spec, None)), out_specs=qkv,
                         check_vma=False)(q_btnh, k_bskh, v_bskh, segment_bt)

