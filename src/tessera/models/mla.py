"""Multi-head latent attention (MLA; DeepSeek-V2, DeepSeek-V3), used by `decoder_block=deepseek`.

Keys and values of every head come from one compressed latent per token: x [B, T, D] ->
latent [B, T, R] (`kv_lora_rank`, RMS-normalized) -> per head a key part without positions
[Hn] (`qk_nope_head_dim`) and a value [Hv] (`v_head_dim`). A second, small projection of x
gives one rotary key part [Hr] (`qk_rope_head_dim`) that all heads share. Queries are
[Hn + Hr] per head, from x directly or through a low-rank bottleneck of `q_lora_rank`
(RMS-normalized). Scores are q . [k_nope, k_rope] scaled by (Hn + Hr)^-0.5, times YaRN's
(0.1 mscale ln(factor) + 1)^2 with rope_scaling=yarn.

Decoding caches what MLA is designed to cache: the normalized latent [R] and the rotated
shared key part [Hr] per token (576 numbers per token and layer in DeepSeek-V3, against
2 x 128 heads x 192 for the expanded keys and values). They go in the `KVCache`'s two
arrays (keys: the latent, values: the rotary part, one "head" each).

Where it differs from the reference (Hugging Face `DeepseekV3Attention`, which the parity
tests compare against): DeepSeek's checkpoints store the rotary dimensions interleaved in
pairs and rotate each pair (`rope_interleave`); we rotate the two halves, so the converter
reorders the rotary output columns of the query and latent projections (even dimensions
first, then odd), which makes the rotated vectors, and so the scores, the same. A fused
kernel (splash, cuDNN) gets the values padded with zeros to the query/key width (or the
queries and keys to a wider v_head_dim) and its output cut back. A decoding step (one token per row) attends in the latent space instead:
the key up-projection is folded into the queries and the value up-projection applied to the
attention-weighted latents (`attend_latent`), so the cached latents are never expanded per head;
a prompt's prefill expands them, which costs fewer operations per score. With a quantized
training mode (`quantization`) both use the expanded form, whose products that mode quantizes.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tessera.config import ModelConfig
from tessera.mesh import shard_logically
from tessera.models.attention import Attention, masked_attention, rope_frequencies_of
from tessera.models.kv_cache import EmptyKVCache, KVCache
from tessera.models.layers import RMSNorm, fan_in_std, param, project, rotary_tables, rotate, yarn_score_scale


class MlaAttention(Attention):
    """Multi-head latent attention; `Attention`'s kernels and output projection."""

    def __init__(self, cfg: ModelConfig, kernel: str, rngs: nnx.Rngs):
        d, n, wdtype = cfg.emb_dim, cfg.num_query_heads, cfg.weight_dtype
        hn, hr, hv, r, rq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
        norm_args = (cfg.normalization_layer_epsilon, cfg.dtype, wdtype, rngs)
        if rq:
            self.wq_a_dr = param(rngs, (d, rq), ("embed", None), wdtype, fan_in_std(d))
            self.q_norm = RMSNorm(rq, *norm_args)
            # the rank axes are split like the embedding (over fsdp): left whole, these two up-projections
            # would be copied on every fsdp/expert device (0.8B parameters per chip in DeepSeek-V3)
            self.wq_b_rnh = param(rngs, (rq, n, hn + hr), ("embed", "heads", "head_dim"), wdtype, fan_in_std(rq))
        else:
            self.wq_dnh = param(rngs, (d, n, hn + hr), ("embed", "heads", "head_dim"), wdtype, fan_in_std(d))
        self.wkv_a_dr = param(rngs, (d, r + hr), ("embed", None), wdtype, fan_in_std(d))
        self.kv_norm = RMSNorm(r, *norm_args)
        self.wkv_b_rnh = param(rngs, (r, n, hn + hv), ("embed", "heads", "head_dim"), wdtype, fan_in_std(r))
        self.wo_nhd = param(rngs, (n, hv, d), ("heads", "head_dim", "embed"), wdtype, fan_in_std(n * hv))
        score_scale = yarn_score_scale(cfg.rope_scaling_factor, cfg.mscale) if cfg.rope_scaling == "yarn" else 1.0
        # MLA's own projections (project_qkv is not used); the kernels and the output projection are Attention's
        self.set_static(cfg, kernel, scale=(hn + hr) ** -0.5 * score_scale,
                        rope_inv_freq=rope_frequencies_of(cfg, rotary_dim=hr))
        self.dims = (hn, hr, hv, r)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, packed: bool, kv_cache: KVCache | None = None):
        """(output [B, T, D], kv_cache): as `Attention.__call__`, caching the latent and rotary key."""
        hn, hr, hv, r = self.dims
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        quant = self.cfg.quantization
        tables = rotary_tables(positions_bt, np.asarray(self.rope_inv_freq, np.float32))
        if hasattr(self, "wq_a_dr"):
            q = project("btr,rnh->btnh", self.q_norm(project("btd,dr->btr", x_btd, w(self.wq_a_dr), quantization=quant)),
                        w(self.wq_b_rnh), quantization=quant)
        else:
            q = project("btd,dnh->btnh", x_btd, w(self.wq_dnh), quantization=quant)
        q = jnp.concatenate([q[..., :hn], rotate(q[..., hn:], tables)], axis=-1)
        q = shard_logically(checkpoint_name(q, "query_proj"), ("batch", "length", "act_heads", None))
        kv = project("btd,dr->btr", x_btd, w(self.wkv_a_dr), quantization=quant)
        latent_btr = self.kv_norm(kv[..., :r])
        k_rope_bth = rotate(kv[..., None, r:], tables)[:, :, 0]
        if kv_cache is None:
            return self.output(self.attend(q, *self.expand(latent_btr, k_rope_bth), segment_ids_bt, packed)), None
        kv_cache.check_room(q.shape[1])  # MLA has no sliding window
        if isinstance(kv_cache, EmptyKVCache):  # the prompts' prefill (see `Attention.__call__`)
            new = kv_cache.stored(latent_btr[:, :, None], k_rope_bth[:, :, None], positions_bt, segment_ids_bt)
            k, v = self.expand(new.keys(q.dtype)[:, :, 0], new.values(q.dtype)[:, :, 0])
            return self.output(self.attend_prompt(q, k, v, new, positions_bt, segment_ids_bt)), kv_cache.add(new)
        kv_cache = kv_cache.write(latent_btr[:, :, None], k_rope_bth[:, :, None], positions_bt, segment_ids_bt)
        latent_bsr, k_rope_bsh = kv_cache.keys(q.dtype)[:, :, 0], kv_cache.values(q.dtype)[:, :, 0]
        visible = functools.partial(kv_cache.mask, window=0)
        if q.shape[1] == 1 and not quant:  # a decoding step
            ctx = self.attend_latent(q, latent_bsr, k_rope_bsh, visible, positions_bt, segment_ids_bt)
        else:  # a prompt: expanded keys cost fewer operations per score
            k, v = self.expand(latent_bsr, k_rope_bsh)
            ctx = masked_attention(q, k, v, visible, positions_bt, segment_ids_bt, scale=self.scale)
        return self.output(ctx), kv_cache

    def attend_latent(self, q_btnh, latent_bsr, k_rope_bsh, visible, positions_bt, segment_ids_bt):
        """Cached attention without expanding the cache: the key up-projection is folded into the
        queries (q_nope W_k^T, [B, T, N, R]), which then meet the cached latents directly, one
        key "head" for all query heads; the attention-weighted latents go through the value
        up-projection. The same scores and outputs as `expand`, in another order of sums, with
        no [B, S, N, H] keys and values: per step and layer that is R + Hr numbers per cached
        token read (576 in DeepSeek-V3) instead of N (2 Hn + Hr + Hv) (128 x 448) computed."""
        hn = self.dims[0]
        w_rnh = self.wkv_b_rnh[...].astype(self.dtype)
        q_latent = project("btnh,rnh->btnr", q_btnh[..., :hn], w_rnh[..., :hn])
        q_btnr = shard_logically(jnp.concatenate([q_latent, q_btnh[..., hn:]], axis=-1),
                                 ("batch", "length", "act_heads", None))
        keys_bs1r = jnp.concatenate([latent_bsr, k_rope_bsh.astype(latent_bsr.dtype)], axis=-1)[:, :, None]
        ctx_btnr = masked_attention(q_btnr, keys_bs1r, latent_bsr[:, :, None], visible, positions_bt,
                                    segment_ids_bt, scale=self.scale)
        return project("btnr,rnh->btnh", ctx_btnr, w_rnh[..., hn:])

    def expand(self, latent_bsr, k_rope_bsh):
        """Keys [B, S, N, Hn + Hr] and values [B, S, N, Hv] of every head from the latents."""
        hn = self.dims[0]
        kv = project("bsr,rnh->bsnh", latent_bsr, self.wkv_b_rnh[...].astype(self.dtype),
                     quantization=self.cfg.quantization)
        k_rope = jnp.broadcast_to(k_rope_bsh[:, :, None, :], (*kv.shape[:3], k_rope_bsh.shape[-1]))
        k = jnp.concatenate([kv[..., :hn], k_rope.astype(kv.dtype)], axis=-1)
        k = shard_logically(checkpoint_name(k, "key_proj"), ("batch", "length", "act_heads", None))
        v = shard_logically(checkpoint_name(kv[..., hn:], "value_proj"), ("batch", "length", "act_heads", None))
        return k, v

    def attend(self, q, k, v, segment_ids_bt, packed: bool):
        """The chosen kernel; a fused one gets queries, keys and values of one width, the narrower
        padded with zeros (values to the query/key width; queries and keys, whose zeros add nothing
        to a score, to a wider v_head_dim), and its output cut back to the value width."""
        width, hv = q.shape[-1], v.shape[-1]
        if self.kernel == "dot_product" or hv == width:
            return super().attend(q, k, v, segment_ids_bt, packed)
        padded = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, max(width, hv) - a.shape[-1])])  # noqa: E731
        return super().attend(padded(q), padded(k), padded(v), segment_ids_bt, packed)[..., :hv]
