"""Grouped-query self-attention and the choice of attention kernel.

`attention=dot_product` is the reference: explicit scores, a causal + same-segment mask and a
float32 softmax; it runs on any device. `flash`, `cudnn_flash_te` and `autoselected` ask for
the fastest fused kernel the device has: on NVIDIA GPUs cuDNN's fused attention through
`jax.nn.dot_product_attention(implementation="cudnn")`. Where no fused kernel applies (CPU,
TPU in this version, an unsupported dtype or head size, packed segments) the reference runs
and `select_attention` says why, once, in the log.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tessera.models.layers import fan_in_std, param, rotary
from tessera.mesh import shard_logically

log = logging.getLogger(__name__)


class AttentionChoice(NamedTuple):
    kernel: str  # "dot_product" or "cudnn"
    reason: str


def select_attention(requested: str, platform: str, dtype: str, head_dim: int) -> AttentionChoice:
    """Pick the attention kernel for `requested` on `platform` ("cpu", "gpu", "tpu", ...)."""
    if requested == "dot_product":
        return AttentionChoice("dot_product", "attention=dot_product requested")
    if platform not in ("gpu", "cuda"):
        return AttentionChoice("dot_product", f"no fused attention kernel is wired for platform {platform!r}")
    if dtype not in ("bfloat16", "float16"):
        return AttentionChoice("dot_product", f"cuDNN fused attention needs bfloat16/float16 compute, not dtype={dtype}")
    if head_dim > 256 or head_dim % 8:
        return AttentionChoice("dot_product", f"cuDNN fused attention needs head_dim <= 256 and a multiple of 8, not {head_dim}")
    return AttentionChoice("cudnn", f"attention={requested}: cuDNN fused attention on {platform}")


QUERY_CHUNK = 128  # causal attention skips key blocks entirely after a chunk of this many queries


def dot_product_attention(q_btnh, k_bskh, v_bskh, segment_q_bt, segment_k_bs):
    """Reference causal attention with grouped kv heads; tokens attend only within their segment.

    Heads are moved in front of the sequence axes first, so both products are plain batched
    matmuls over (batch, kv head): measured 2x faster forward on CPU than contracting in the
    [B, T, N, H] layout. Long sequences are processed in chunks of QUERY_CHUNK queries, each
    against only the keys up to its end, which skips the fully masked blocks of the causal
    score matrix ((C+1)/2C of the work for C chunks).
    """
    b, t, n, h = q_btnh.shape
    kv_heads = k_bskh.shape[2]
    q_bkgth = q_btnh.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    chunk = QUERY_CHUNK if t == k_bskh.shape[1] and t % QUERY_CHUNK == 0 else t
    outs = []
    for start in range(0, t, chunk):
        end = start + chunk
        keys = end if chunk < t else k_bksh.shape[2]
        outs.append(_attend(q_bkgth[:, :, :, start:end], k_bksh[:, :, :keys], v_bksh[:, :, :keys],
                            segment_q_bt[:, start:end], segment_k_bs[:, :keys], start))
    out_bkgth = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _attend(q_bkgth, k_bksh, v_bksh, segment_q_bt, segment_k_bs, q_offset: int):
    """Masked softmax attention of queries at positions q_offset.. against keys 0..S-1."""
    t, s, h = q_bkgth.shape[3], k_bksh.shape[2], q_bkgth.shape[-1]
    scores = jnp.einsum("bkgth,bksh->bkgts", q_bkgth, k_bksh, preferred_element_type=jnp.float32) * h**-0.5
    causal_ts = (jnp.arange(t)[:, None] + q_offset) >= jnp.arange(s)[None, :]
    same_segment_bts = segment_q_bt[:, :, None] == segment_k_bs[:, None, :]
    mask = causal_ts[None, None, None] & same_segment_bts[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bksh.dtype)
    return jnp.einsum("bkgts,bksh->bkgth", probs, v_bksh)


class Attention(nnx.Module):
    """Multi-head attention with K <= N kv heads (grouped-query), rotary positions, no biases."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_inv_freq: np.ndarray,
                 kernel: str, dtype, weight_dtype, rngs: nnx.Rngs):
        std = fan_in_std(dim)
        self.wq_dnh = param(rngs, (dim, num_heads, head_dim), ("embed", "heads", "head_dim"), weight_dtype, std)
        self.wk_dkh = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), weight_dtype, std)
        self.wv_dkh = param(rngs, (dim, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), weight_dtype, std)
        self.wo_nhd = param(rngs, (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), weight_dtype,
                            fan_in_std(num_heads * head_dim))
        self.rope_inv_freq = tuple(float(f) for f in rope_inv_freq)  # static: a tuple is not an nnx state leaf
        self.kernel, self.dtype = kernel, dtype

    def __call__(self, x_btd, positions_bt, segment_ids_bt, packed: bool):
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        q = checkpoint_name(jnp.einsum("btd,dnh->btnh", x_btd, w(self.wq_dnh)), "query_proj")
        k = checkpoint_name(jnp.einsum("btd,dkh->btkh", x_btd, w(self.wk_dkh)), "key_proj")
        v = checkpoint_name(jnp.einsum("btd,dkh->btkh", x_btd, w(self.wv_dkh)), "value_proj")
        inv_freq = np.asarray(self.rope_inv_freq, np.float32)
        q = shard_logically(rotary(q, positions_bt, inv_freq), ("batch", "length", "act_heads", None))
        k = shard_logically(rotary(k, positions_bt, inv_freq), ("batch", "length", "act_kv_heads", None))
        v = shard_logically(v, ("batch", "length", "act_kv_heads", None))
        if self.kernel == "cudnn" and not packed:
            ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
            ctx = dot_product_attention(q, k, v, segment_ids_bt, segment_ids_bt)
        ctx = checkpoint_name(shard_logically(ctx, ("batch", "length", "act_heads", None)), "context")
        return checkpoint_name(jnp.einsum("btnh,nhd->btd", ctx, w(self.wo_nhd)), "out_proj")
