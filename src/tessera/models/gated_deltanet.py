"""Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024): the linear-attention layer of Qwen3-Next.

Each value head keeps a state S [dk, dv], a fast-weight memory from keys to values. At token t the
memory first fades by a = exp(g_t) (g_t <= 0, data-dependent), then moves its answer for the key
k_t towards the value v_t by the step beta_t (the delta rule), and the query reads it:

    S_t = a_t S_{t-1} + k_t beta_t (v_t - a_t S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

Run token by token this is a scan over the sequence; `chunked_delta_rule` computes the same outputs
chunk by chunk (the WY form of Yang et al.): within a chunk of C tokens the products are [C, C]
matrices and one unit-lower-triangular solve, and only the state crosses chunks, so a sequence of T
tokens is T / C sequential steps of matmuls. Everything runs in float32.

Packed sequences: a token never reads the memory of another document. Inside a chunk, the pairs
of tokens of different segments are masked; across chunks, the carried state reaches only the
tokens of the segment it was written by (the last one of the previous chunk), and a chunk whose last
token starts or continues another segment hands on only that segment's part. The short causal
convolution in front of the rule is masked the same way, so a packed row computes what its documents
would alone (the test checks this against separate rows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tessera.config import ModelConfig
from tessera.mesh import shard_logically
from tessera.models import delta_rule_kernel
from tessera.models.delta_rule_kernel import chunk_recurrence
from tessera.models.kv_cache import DeltaNetCache, KVCache
from tessera.models.layers import fan_in_std, param, project, rms_normalized


def causal_conv(x_btc: jax.Array, w_wc: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """Depthwise causal convolution over the sequence with kernel [W, C] (w[W - 1] weighs the token
    itself, w[W - 1 - s] the token s back), each token seeing only earlier tokens of its own segment;
    then SiLU. Computed in float32, returned in x's dtype."""
    width, t = w_wc.shape[0], x_btc.shape[1]
    x = x_btc.astype(jnp.float32)
    w = w_wc.astype(jnp.float32)
    out = x * w[width - 1]
    for s in range(1, min(width, t + 1)):
        back = jnp.pad(x, ((0, 0), (s, 0), (0, 0)))[:, :t]
        same = segment_ids_bt == jnp.pad(segment_ids_bt, ((0, 0), (s, 0)), constant_values=-1)[:, :t]
        out = out + jnp.where(same[..., None], back, 0.0) * w[width - 1 - s]
    return jax.nn.silu(out).astype(x_btc.dtype)


def l2_normalized(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (the delta rule's query and key norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def chunked_delta_rule(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, segment_ids_bt, chunk: int, state_bhkv=None,
                       state_segment_b=None, kernel: str = "xla"):
    """(outputs [B, T, H, dv], final memory [B, H, dk, dv]), both float32, of the gated delta rule (module
    docstring), from queries and keys [B, T, H, dk] (already L2-normed; the queries are scaled by dk**-0.5
    here), values [B, T, H, dv], log decays g [B, T, H] (<= 0) and steps beta [B, T, H], in chunks of
    `chunk` tokens, the memory never crossing a segment boundary. It starts empty, or as `state_bhkv`
    belonging to segment `state_segment_b` [B] (decoding: what the earlier tokens left); the final memory
    is the last token's segment's. `kernel`: the recurrence over the chunks as an XLA `lax.scan` ("xla"),
    or the Pallas TPU kernel of `delta_rule_kernel` ("pallas"; "pallas_interpret": in Pallas' interpreter)."""
    b, t, h, dk = q_bthk.shape
    dv = v_bthv.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731

    def chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...], zero padded (a padded token changes nothing)
        a = jnp.pad(f32(a), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(b, n, chunk, *a.shape[2:])
        return jnp.moveaxis(a, (1, 3), (0, 2))

    q, k, v = chunks(q_bthk * dk**-0.5), chunks(k_bthk), chunks(v_bthv)
    g, beta = chunks(g_bth), chunks(beta_bth)
    # padded tokens continue the row's last segment, so they neither cut nor carry anything
    seg = jnp.pad(segment_ids_bt, ((0, 0), (0, pad)), mode="edge").reshape(b, n, chunk).swapaxes(0, 1)  # [N, B, C]
    # the segment the carried state belongs to: the previous chunk's last token's (the first chunk: the given
    # state's, or without one its first token's)
    first = seg[:1, :, :1] if state_segment_b is None else state_segment_b.astype(seg.dtype)[None, :, None]
    seg_before = jnp.concatenate([first, seg[:-1, :, -1:]], axis=0)  # [N, B, 1]
    continues = (seg == seg_before)[:, :, None, :, None]  # [N, B, 1, C, 1]: the token reads the carried state
    in_last = (seg == seg[:, :, -1:])[:, :, None, :, None]  # the token's segment is the chunk's last one
    same_ncc = seg[..., :, None] == seg[..., None, :]  # [N, B, C, C]

    cum = jnp.cumsum(g, axis=-1)  # [N, B, H, C]: log decay from the chunk's start through each token
    visible = jnp.tril(jnp.ones((chunk, chunk), bool)) & same_ncc[:, :, None]
    decay_cc = jnp.exp(jnp.where(visible, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    strictly_lower = np.tril(np.ones((chunk, chunk), bool), -1)
    k_beta = k * beta[..., None]
    # (I + L) [u | w] = [v beta | k beta exp(cum)]: the chunk's corrected values u and the
    # state's reach w, with L the earlier tokens' keys as seen by each (unit lower-triangular)
    lower = jnp.where(strictly_lower, jnp.einsum("nbhik,nbhjk->nbhij", k_beta, k) * decay_cc, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None] * continues], axis=-1)
    solved = jax.lax.linalg.triangular_solve(lower + jnp.eye(chunk, dtype=jnp.float32), rhs, left_side=True,
                                             lower=True, unit_diagonal=True)
    u, w = solved[..., :dv], solved[..., dv:]
    scores = jnp.einsum("nbhik,nbhjk->nbhij", q, k) * decay_cc
    q_reads = q * jnp.exp(cum)[..., None] * continues
    k_writes = k * jnp.exp(cum[..., -1:] - cum)[..., None] * in_last
    carried = jnp.exp(cum[..., -1]) * (seg[:, :, -1] == seg_before[:, :, 0])[:, :, None]  # [N, B, H]

    def step(state_bhkv, xs):
        u_c, w_c, scores_c, q_c, k_c, carried_c = xs
        v_new = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, state_bhkv)
        out = jnp.einsum("bhck,bhkv->bhcv", q_c, state_bhkv) + jnp.einsum("bhij,bhjv->bhiv", scores_c, v_new)
        state_bhkv = state_bhkv * carried_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, v_new)
        return state_bhkv, out

    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state_bhkv is None else state_bhkv.astype(jnp.float32)
    if kernel == "xla":
        state, out = jax.lax.scan(step, state, (u, w, scores, q_reads, k_writes, carried))  # [N, B, H, C, dv]
    else:
        out, state = chunk_recurrence(u, w, scores, q_reads, k_writes, carried, state,
                                      interpret=kernel == "pallas_interpret")
    return jnp.moveaxis(out, (0, 2), (1, 3)).reshape(b, n * chunk, h, dv)[:, :t], state


def recurrent_delta_rule(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, segment_ids_bt):
    """The gated delta rule token by token (the definition; tests compare `chunked_delta_rule` with it)."""
    dk = q_bthk.shape[-1]
    f32 = lambda a: jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # noqa: E731
    seg = segment_ids_bt.swapaxes(0, 1)
    cont = jnp.concatenate([jnp.zeros_like(seg[:1], bool), seg[1:] == seg[:-1]])  # [T, B]

    def step(state, xs):
        q, k, v, g, beta, c = xs
        state = state * (jnp.exp(g) * c[:, None])[..., None, None]
        delta = (v - jnp.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
        state = state + k[..., None] * delta[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q * dk**-0.5)

    b, _, h, _ = q_bthk.shape
    state = jnp.zeros((b, h, dk, v_bthv.shape[-1]), jnp.float32)
    _, out = jax.lax.scan(step, state, (f32(q_bthk), f32(k_bthk), f32(v_bthv), f32(g_bth), f32(beta_bth), cont))
    return jnp.moveaxis(out, 0, 1)


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's linear-attention layer: x -> q, k (gdn_num_key_heads of gdn_key_head_dim), v and the
    output gate z (gdn_num_value_heads of gdn_value_head_dim), the step beta = sigmoid(x W_b) and the decay
    g = -exp(A_log) softplus(x W_a + dt_bias) per value head; q, k and v through a causal depthwise
    convolution (gdn_conv_kernel_dim) and SiLU, q and k L2-normed, each key head serving
    value_heads / key_heads value heads; the gated delta rule in chunks of gdn_chunk_size; each head's
    output RMS-normed (scale per dimension), times silu(z), then projected back to emb_dim.

    Hugging Face stores q, k, v and z as one projection and the convolution's channels as one kernel,
    interleaved per key head; the converter splits them into the weights here, each [D, heads, dim]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, wdtype = cfg.emb_dim, cfg.weight_dtype
        kh, vh, dk, dv, width = (cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim,
                                 cfg.gdn_value_head_dim, cfg.gdn_conv_kernel_dim)
        std = fan_in_std(d)
        self.wq_dkh = param(rngs, (d, kh, dk), ("embed", "linear_heads", "head_dim"), wdtype, std)
        self.wk_dkh = param(rngs, (d, kh, dk), ("embed", "linear_heads", "head_dim"), wdtype, std)
        self.wv_dvh = param(rngs, (d, vh, dv), ("embed", "linear_heads", "head_dim"), wdtype, std)
        self.wz_dvh = param(rngs, (d, vh, dv), ("embed", "linear_heads", "head_dim"), wdtype, std)
        self.wb_dv = param(rngs, (d, vh), ("embed", "linear_heads"), wdtype, std)
        self.wa_dv = param(rngs, (d, vh), ("embed", "linear_heads"), wdtype, std)
        conv_std = fan_in_std(width)
        self.conv_q_wkh = param(rngs, (width, kh, dk), (None, "linear_heads", "head_dim"), wdtype, conv_std)
        self.conv_k_wkh = param(rngs, (width, kh, dk), (None, "linear_heads", "head_dim"), wdtype, conv_std)
        self.conv_v_wvh = param(rngs, (width, vh, dv), (None, "linear_heads", "head_dim"), wdtype, conv_std)
        # decay rates exp(A_log) spread over [1, 16] across the heads, as Mamba 2 and Qwen3-Next start them
        self.a_log_v = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, vh)).astype(wdtype), out_sharding=("linear_heads",),
                                 eager_sharding=False)
        self.dt_bias_v = param(rngs, (vh,), ("linear_heads",), wdtype, None, fill=1.0)
        self.norm_scale_h = param(rngs, (dv,), (None,), wdtype, None, fill=1.0)
        self.wo_vhd = param(rngs, (vh, dv, d), ("linear_heads", "head_dim", "embed"), wdtype, fan_in_std(vh * dv))
        self.dtype, self.eps, self.chunk = cfg.dtype, cfg.normalization_layer_epsilon, cfg.gdn_chunk_size
        self.quantization, self.kernel = cfg.quantization, cfg.gdn_kernel

    def __call__(self, x_btd, segment_ids_bt, cache: DeltaNetCache | None = None):
        """(output [B, T, D], the updated cache, or None without one). With a cache (decoding) the tokens
        continue its memory and convolution where they belong to the same segment."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        b, t, _ = x_btd.shape
        proj = lambda spec, p: project(spec, x_btd, w(p), quantization=self.quantization)  # noqa: E731
        q, k, v = proj("btd,dkh->btkh", self.wq_dkh), proj("btd,dkh->btkh", self.wk_dkh), proj("btd,dvh->btvh", self.wv_dvh)
        z = proj("btd,dvh->btvh", self.wz_dvh)
        beta_btv = jax.nn.sigmoid(project("btd,dv->btv", x_btd, w(self.wb_dv)).astype(jnp.float32))
        a_btv = project("btd,dv->btv", x_btd, w(self.wa_dv)).astype(jnp.float32)
        g_btv = -jnp.exp(self.a_log_v[...].astype(jnp.float32)) * jax.nn.softplus(
            a_btv + self.dt_bias_v[...].astype(jnp.float32))
        past = 0 if cache is None else cache.conv_segments_bw.shape[1]
        segments = segment_ids_bt if cache is None else jnp.concatenate(
            [cache.conv_segments_bw, segment_ids_bt.astype(jnp.int32)], axis=1)
        before = (None, None, None) if cache is None else (cache.conv_q_bwkh, cache.conv_k_bwkh, cache.conv_v_bwvh)

        def conv(a, p, earlier):  # (the convolution of T tokens after the cached ones, the inputs to cache next)
            if earlier is not None:
                a = jnp.concatenate([earlier, a.astype(earlier.dtype)], axis=1)
            out = causal_conv(a.reshape(b, past + t, -1), p[...].reshape(p.shape[0], -1), segments)
            return out.reshape(a.shape)[:, past:], a[:, a.shape[1] - past:]

        (q, q_in), (k, k_in), (v, v_in) = (conv(q, self.conv_q_wkh, before[0]), conv(k, self.conv_k_wkh, before[1]),
                                           conv(v, self.conv_v_wvh, before[2]))
        q, k = l2_normalized(q), l2_normalized(k)
        groups = v.shape[2] // q.shape[2]  # key head i serves value heads i * groups ... (i + 1) * groups - 1
        q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
        q = shard_logically(q, ("batch", "length", "act_heads", None))
        k = shard_logically(k, ("batch", "length", "act_heads", None))
        v = shard_logically(v, ("batch", "length", "act_heads", None))
        # (a decoded token is one chunk of one, left to XLA's loop)
        kernel = delta_rule_kernel.select_delta_rule_kernel(self.kernel) if cache is None or t > 1 else "xla"
        if cache is None:
            out, _ = chunked_delta_rule(q, k, v, g_btv, beta_btv, segment_ids_bt, self.chunk, kernel=kernel)
        else:  # (chunks no longer than the call)
            out, state = chunked_delta_rule(q, k, v, g_btv, beta_btv, segment_ids_bt, min(self.chunk, t),
                                            cache.state_bhkv, cache.segment_b, kernel=kernel)
            cache = KVCache.shard_tree(DeltaNetCache(state, q_in, k_in, v_in, segments[:, segments.shape[1] - past:],
                                                           segment_ids_bt[:, -1].astype(jnp.int32)))
        out = rms_normalized(out, self.eps).astype(self.dtype) * w(self.norm_scale_h)
        out = (out.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)
        out = checkpoint_name(shard_logically(out, ("batch", "length", "act_heads", None)), "context")
        return checkpoint_name(project("btvh,vhd->btd", out, w(self.wo_vhd), quantization=self.quantization),
                               "out_proj"), cache
