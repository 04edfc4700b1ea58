"""Grouped-query self-attention with the kernel `attention_choice.select_attention` chose.

`attention=dot_product` is the reference: explicit scores, a causal + same-segment mask and a
float32 softmax; it runs on any device. On TPUs the fused kernel is Pallas splash attention
(`splash.py`), on NVIDIA GPUs cuDNN's fused attention through
`jax.nn.dot_product_attention(implementation="cudnn")`; a batch of packed segments runs the
reference on GPUs.

Decoding passes a KV cache (`tessera.models.kv_cache`) to `Attention.__call__`: the new keys
and values are written into it and the queries attend over all of it, always with the
reference math, masked by the cached keys' positions instead of their indices, a prompt's
queries in chunks (`masked_attention`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tessera.config import ModelConfig
from tessera.models import attention_cpu
from tessera.models.kv_cache import EmptyKVCache, KVCache
from tessera.models.layers import (RMSNorm, fan_in_std, param, project, rms_normalized, rope_frequencies, rotary_tables,
                                   rotate, soft_cap, yarn_frequencies, yarn_score_scale)
from tessera.mesh import shard_logically, traced_platform

def rope_frequencies_of(cfg: ModelConfig, local: bool = False, rotary_dim: int = 0) -> np.ndarray:
    """The rotary inverse wavelengths a config asks for (rope_max_timescale, rope_scaling) for
    heads of `rotary_dim` (default head_dim); `local`: those of the sliding-window layers of gemma3
    and olmo3 (local_rope_max_timescale, never scaled)."""
    dim = rotary_dim or cfg.head_dim
    if local:
        return rope_frequencies(dim, cfg.local_rope_theta)
    if cfg.rope_scaling == "yarn":
        return yarn_frequencies(dim, cfg.rope_max_timescale, cfg.rope_scaling_factor, cfg.rope_original_max_position,
                                cfg.beta_fast, cfg.beta_slow, cfg.rope_truncate)
    inv_freq = rope_frequencies(dim, cfg.rope_max_timescale, (
        cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
        cfg.rope_original_max_position) if cfg.rope_scaling == "llama3" else None)
    return inv_freq / np.float32(cfg.rope_scaling_factor) if cfg.rope_scaling == "linear" else inv_freq


class HeadsRMSNorm(nnx.Module):
    """RMSNorm of each token's heads together ([B, T, N, H]: one mean square over N and H) with a
    learned scale [N, H], in float32, rounded once to the input's dtype: OLMo 3's query and key norms
    (over the flat N * H projection in its checkpoints). With the heads sharded, the mean is a sum
    over the shards."""

    def __init__(self, heads: int, head_dim: int, heads_axis: str, eps: float, weight_dtype, rngs: nnx.Rngs):
        self.scale = param(rngs, (heads, head_dim), (heads_axis, "head_dim"), weight_dtype, None, fill=1.0)
        self.eps = eps

    def __call__(self, x_btnh: jax.Array) -> jax.Array:
        x = x_btnh.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=(-2, -1), keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(x_btnh.dtype)


QUERY_CHUNK = 128  # causal attention skips key blocks entirely after a chunk of this many queries
MAX_CHUNKS = 16  # longer sequences use larger chunks, so the compiled program stays small


def dot_product_attention(q_btnh, k_bskh, v_bskh, segment_q_bt, segment_k_bs, *, scale: float | None = None,
                          logits_soft_cap: float = 0.0, window: int = 0, sinks_n=None, chunk: int = 0,
                          packed: bool = True):
    """Reference causal attention with grouped kv heads; tokens attend only within their segment.

    `scale` multiplies the scores (default head_dim**-0.5); `logits_soft_cap` > 0 squashes them
    with cap * tanh(s / cap) before the mask (Gemma 2); `window` > 0 lets a query see only the
    `window` most recent positions, itself included (sliding-window attention); `chunk` > 0 lets
    it see only the earlier keys of its own chunk of `chunk` positions (index // chunk; Llama 4's
    chunked attention); `sinks_n` [N]
    (attention_sink): a logit per query head that each softmax adds to its denominator, as a
    key every query sees whose value is zero (gpt-oss). `packed` False: rows hold one document each, so
    the segment ids may be left out where that is faster (XLA:CPU's form below; padding then sees the
    tokens before it, as with cuDNN; the loss never counts padding).

    On XLA:CPU, float32 self-attention without a cap, window, chunks or sinks runs as
    `attention_cpu.causal_attention`: the same chunks and softmax with a backward pass of its own, in
    the layouts XLA:CPU multiplies fastest (gradients equal to float32 rounding).

    Heads are moved in front of the sequence axes first, so both products are plain batched
    matmuls over (batch, kv head): measured 2x faster forward on CPU than contracting in the
    [B, T, N, H] layout. Long sequences are processed in chunks of QUERY_CHUNK queries (at most
    MAX_CHUNKS chunks; longer sequences get longer chunks, which keeps compiles short), each
    against only the keys it can see (up to its end, and from its start - window on), which
    skips the fully masked blocks of the score matrix ((C+1)/2C of the work for C chunks).

    On XLA:CPU, bfloat16 queries, keys and values are widened to float32 once, before the
    chunks: this way the gradients of keys and values, sums over the chunks, add up in float32
    and are rounded once, and the queries' gradient is put together from its chunks without
    conversions (left in bfloat16, those sums and conversions took 240 ms of a 2.8 s step of
    `benchmarks/cpu_llama.py`, on a CPU whose bfloat16 matmul is slower than its float32 one).
    On a CPU that multiplies bfloat16 natively (`tessera.cpu_matmul`) they are widened too.
    Measured on `benchmarks/cpu_llama.py`'s bfloat16 step, alternating: on an AMD EPYC with
    AVX512-BF16, keeping them in bfloat16 was no faster (1.02 and 1.02 s against 0.99 and
    1.09 s); on an Intel Xeon with AMX, bfloat16 copies taken inside each chunk made the step
    about 3% faster (1.19 and 1.15 s against 1.20 and 1.22 s) but rounded each chunk's part of
    the key and value gradients (26% further from float32 than the queries' gradient; the test
    `test_bfloat16_chunked_attention_adds_key_and_value_gradients_over_chunks_in_float32`
    refuses that). Keeping those sums in float32 around bfloat16 products would need a
    backward pass of attention's own. The forward pass is unchanged: probabilities and outputs
    are rounded to the compute dtype.
    """
    b, t, n, h = q_btnh.shape
    kv_heads = k_bskh.shape[2]
    dtype, attention_chunk, on_cpu = q_btnh.dtype, chunk, traced_platform() == "cpu"
    scale = h**-0.5 if scale is None else scale
    # the CPU form reads one set of segment ids for both sides: the queries' must be the keys' (self-attention)
    same_segments = segment_q_bt is segment_k_bs or not packed
    if on_cpu and same_segments and attention_cpu.applies(q_btnh, k_bskh, v_bskh, logits_soft_cap=logits_soft_cap,
                                                           window=window, chunk=chunk, sinks_n=sinks_n):
        return attention_cpu.causal_attention(q_btnh, k_bskh, v_bskh, segment_q_bt if packed else None,
                                              scale=scale, query_chunk=query_chunk(t))
    if dtype == jnp.bfloat16 and on_cpu:
        q_btnh, k_bskh, v_bskh = (a.astype(jnp.float32) for a in (q_btnh, k_bskh, v_bskh))
    q_bkgth = q_btnh.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4)
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    chunk = query_chunk(t) if t == k_bskh.shape[1] else t
    sinks_kg = None if sinks_n is None else sinks_n.reshape(kv_heads, n // kv_heads)
    mask_args = (scale, logits_soft_cap, window, dtype, sinks_kg, attention_chunk)
    outs = []
    # split, not sliced: the gradient of a split is one concatenation (of slices, a sum of padded copies)
    for start, q_chunk in zip(range(0, t, chunk), jnp.split(q_bkgth, t // chunk, axis=3)):
        end = start + chunk
        keys_end = end if chunk < t else k_bksh.shape[2]
        keys_start = max(0, start - window + 1) if window and chunk < t else 0
        if attention_chunk and chunk < t:
            keys_start = max(keys_start, start // attention_chunk * attention_chunk)
        outs.append(_attend(q_chunk, k_bksh[:, :, keys_start:keys_end],
                            v_bksh[:, :, keys_start:keys_end], segment_q_bt[:, start:end],
                            segment_k_bs[:, keys_start:keys_end], start - keys_start, *mask_args, k_first=keys_start))
    out_bkgth = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, -1)  # values may be narrower than q and k (MLA)


def query_chunk(t: int) -> int:
    """The queries per chunk of causal self-attention over T tokens: QUERY_CHUNK, more for sequences over
    MAX_CHUNKS chunks, all T when those do not divide it."""
    chunk = max(QUERY_CHUNK, t // MAX_CHUNKS)
    return chunk if t % chunk == 0 else t


def _attend(q_bkgth, k_bksh, v_bksh, segment_q_bt, segment_k_bs, q_offset: int, scale: float, cap: float,
            window: int, dtype, sinks_kg=None, chunk: int = 0, k_first: int = 0):
    """Masked softmax attention of queries at index q_offset.. against keys at index 0..S-1 (of a
    sequence whose first `k_first` keys are left out: chunks are counted from its start)."""
    t, s = q_bkgth.shape[3], k_bksh.shape[2]
    distance_ts = (jnp.arange(t)[:, None] + q_offset) - jnp.arange(s)[None, :]
    visible_ts = (distance_ts >= 0) & ((distance_ts < window) if window else True)
    if chunk:
        q_chunk = (jnp.arange(t) + q_offset + k_first) // chunk
        visible_ts &= q_chunk[:, None] == ((jnp.arange(s) + k_first) // chunk)[None, :]
    same_segment_bts = segment_q_bt[:, :, None] == segment_k_bs[:, None, :]
    return _softmax_attend(q_bkgth, k_bksh, v_bksh, visible_ts[None] & same_segment_bts, scale, cap, dtype, sinks_kg)


def _softmax_attend(q_bkgth, k_bksh, v_bksh, mask_bts, scale: float, cap: float, dtype, sinks_kg=None):
    """Scaled (and soft-capped) scores, masked by `mask_bts`, float32 softmax, weighted values;
    probabilities and output in `dtype` (the compute dtype). `sinks_kg` [K, G]: each query head's
    sink logit joins its softmax's denominator (a query that sees no key then outputs zeros)."""
    scores = project("bkgth,bksh->bkgts", q_bkgth, k_bksh, preferred_element_type=jnp.float32) * scale
    scores = soft_cap(scores, cap)
    scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks_kg is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    else:
        sink = sinks_kg.astype(jnp.float32)[None, :, :, None, None]
        # the shift cancels out of the ratio, so it needs no gradient
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
        e = jnp.exp(scores - top)
        probs = (e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(dtype)
    return project("bkgts,bksh->bkgth", probs, v_bksh).astype(dtype)


# Cached attention takes its queries in chunks whose scores hold at most this many elements per row
# and head (16 MiB in float32): a prompt's prefill never builds its whole [T, S] score matrix.
SCORES_PER_ROW_AND_HEAD = 1 << 22


def masked_attention(q_btnh, k_bskh, v_bskh, visible, positions_bt, segment_ids_bt, *, scale: float,
                     logits_soft_cap: float = 0.0, scores_per_row_and_head: int | None = None, sinks_n=None):
    """Attention of queries [B, T, N, H] at `positions_bt` in `segment_ids_bt` over keys and values
    [B, S, K, H], where `visible(positions, segment_ids)` -> [B, T', S] allows it (decoding over a KV
    cache; a query that sees nothing gets the mean value). Queries go through in chunks of
    max(1, scores_per_row_and_head // S) (a `lax.map`; default SCORES_PER_ROW_AND_HEAD), so the
    scores and the mask of a long prompt's prefill are never whole: for a 32k-token prompt and 36k
    keys, chunks of 113 queries."""
    b, t, n, _ = q_btnh.shape
    kv_heads = k_bskh.shape[2]
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    sinks_kg = None if sinks_n is None else sinks_n.reshape(kv_heads, n // kv_heads)

    def attend(q, positions, segment_ids):
        q_bkgth = q.reshape(b, q.shape[1], kv_heads, n // kv_heads, -1).transpose(0, 2, 3, 1, 4)
        out_bkgth = _softmax_attend(q_bkgth, k_bksh, v_bksh, visible(positions, segment_ids), scale,
                                    logits_soft_cap, q_btnh.dtype, sinks_kg)
        return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, q.shape[1], n, -1)

    chunk = max(1, (scores_per_row_and_head or SCORES_PER_ROW_AND_HEAD) // k_bskh.shape[1])
    if chunk >= t:
        return attend(q_btnh, positions_bt, segment_ids_bt)
    count = -(-t // chunk)  # the last chunk is padded with queries of segment 0, whose output is dropped

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, count * chunk - t)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(b, count, chunk, *a.shape[2:]).swapaxes(0, 1)

    out = jax.lax.map(lambda xs: attend(*xs), (split(q_btnh), split(positions_bt), split(segment_ids_bt)))
    return out.swapaxes(0, 1).reshape(b, count * chunk, n, -1)[:, :t]


class Attention(nnx.Module):
    """Multi-head attention with K <= N kv heads (grouped-query).

    Options a block family picks: rotary positions (`use_rope`) or none (positions added to
    the embeddings instead), biases on every projection (`use_bias`; on the query, key and value
    projections only with `output_bias=False`, as in Qwen2), a sliding window,
    an RMSNorm over each query and key head before the rotation (`qk_norm`: the norm kind,
    "rms" in Qwen3, "rms_zero_centered" in Gemma 3; "rms_all_heads" in OLMo 3: one RMSNorm over
    all heads of a token's queries, and one over its keys, with a scale per head and dimension;
    "" none), the rotary frequencies of the local layers of gemma3 and olmo3 (`local_rope`) and an
    output gate (`output_gate`, Qwen3-Next: the context times sigmoid(x W_gate) before the output
    projection). From the config: `partial_rotary_factor` (only that fraction of each head
    rotates), `fused_qkv` (one [D, 3, N, H] projection; needs K == N),
    `query_pre_attn_scalar` (scores scaled by its inverse square root instead of head_dim's),
    `attn_logits_soft_cap`, `attention_bias` (biases as `use_bias`, which gpt3 always sets),
    `attention_sink` (a learned sink logit per query head, `sinks_n`, initialized to zero) and,
    with rope_scaling=yarn, YaRN's score multiplier (`yarn_score_scale`: Hugging Face scales
    the rotary sines and cosines by its square root, which multiplies the scores by it when
    every dimension rotates).
    """

    def __init__(self, cfg: ModelConfig, kernel: str, rngs: nnx.Rngs, *, sliding_window: int = 0,
                 use_bias: bool = False, use_rope: bool = True, qk_norm: str = "", local_rope: bool = False,
                 chunk: int = 0, temperature_tuning: bool = False, output_bias: bool = True,
                 output_gate: bool = False):
        d, n, k, h, wdtype = cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim, cfg.weight_dtype
        std = fan_in_std(d)
        use_bias = use_bias or cfg.attention_bias
        if cfg.fused_qkv:
            self.wqkv_dcnh = param(rngs, (d, 3, n, h), ("embed", None, "heads", "head_dim"), wdtype, std)
        else:
            self.wq_dnh = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), wdtype, std)
            self.wk_dkh = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), wdtype, std)
            self.wv_dkh = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), wdtype, std)
        self.wo_nhd = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), wdtype, fan_in_std(n * h))
        if output_gate:  # qwen3_next: the context times sigmoid(x W_gate), per head and dimension
            self.wgate_dnh = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), wdtype, std)
        if use_bias:
            if cfg.fused_qkv:
                self.bqkv_cnh = param(rngs, (3, n, h), (None, "heads", "head_dim"), wdtype, None, fill=0.0)
            else:
                self.bq_nh = param(rngs, (n, h), ("heads", "head_dim"), wdtype, None, fill=0.0)
                self.bk_kh = param(rngs, (k, h), ("kv_heads", "head_dim"), wdtype, None, fill=0.0)
                self.bv_kh = param(rngs, (k, h), ("kv_heads", "head_dim"), wdtype, None, fill=0.0)
            if output_bias:
                self.bo_d = param(rngs, (d,), ("norm",), wdtype, None, fill=0.0)
        if cfg.attention_sink:
            self.sinks_n = param(rngs, (n,), ("heads",), wdtype, None, fill=0.0)
        if qk_norm in ("rms", "rms_zero_centered"):
            norm_args = (h, cfg.normalization_layer_epsilon, cfg.dtype, wdtype, rngs)
            self.query_norm = RMSNorm(*norm_args, zero_centered=qk_norm == "rms_zero_centered")
            self.key_norm = RMSNorm(*norm_args, zero_centered=qk_norm == "rms_zero_centered")
        elif qk_norm == "rms_all_heads":
            eps = cfg.normalization_layer_epsilon
            self.query_norm = HeadsRMSNorm(n, h, "heads", eps, wdtype, rngs)
            self.key_norm = HeadsRMSNorm(k, h, "kv_heads", eps, wdtype, rngs)
        scale = float(cfg.query_pre_attn_scalar or h) ** -0.5
        if use_rope and cfg.rope_scaling == "yarn" and not local_rope:
            scale *= yarn_score_scale(cfg.rope_scaling_factor, cfg.mscale)
        rotary_dim = round(h * cfg.partial_rotary_factor)  # (a whole, even number: config.family_checks)
        self.set_static(cfg, kernel, scale=scale,
                        rope_inv_freq=rope_frequencies_of(cfg, local_rope, rotary_dim) if use_rope else (),
                        fused=cfg.fused_qkv, use_bias=use_bias, qk_norm=qk_norm, window=sliding_window, chunk=chunk,
                        logits_soft_cap=cfg.attn_logits_soft_cap, sinks=cfg.attention_sink,
                        temperature_tuning=temperature_tuning, output_bias=output_bias, output_gate=output_gate)

    def set_static(self, cfg: ModelConfig, kernel: str, *, scale: float, rope_inv_freq, fused: bool = False,
                   use_bias: bool = False, qk_norm: str = "", window: int = 0, chunk: int = 0,
                   logits_soft_cap: float = 0.0, sinks: bool = False, temperature_tuning: bool = False,
                   output_bias: bool = True, output_gate: bool = False):
        """Every static setting the shared methods (`attend`, `attend_prompt`, `output`, `sink_logits`,
        `__call__`) read, set in one place: a subclass with weights of its own (`MlaAttention`) calls this
        rather than `Attention.__init__`, and cannot leave one of them unset."""
        # static: tuples are not nnx state leaves
        self.rope_inv_freq = tuple(float(f) for f in rope_inv_freq)
        self.kernel, self.dtype, self.fused, self.use_bias, self.qk_norm = kernel, cfg.dtype, fused, use_bias, qk_norm
        self.output_bias = use_bias and output_bias
        self.scale, self.sinks, self.temperature_tuning = scale, sinks, temperature_tuning
        self.logits_soft_cap, self.window, self.chunk, self.output_gate = logits_soft_cap, window, chunk, output_gate
        self.cfg = cfg  # static: splash attention reads its block sizes from it

    def project_qkv(self, x_btd, positions_bt):
        """Query [B, T, N, H], key and value [B, T, K, H], with rotary positions applied."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        if self.fused:
            qkv = project("btd,dcnh->btcnh", x_btd, w(self.wqkv_dcnh), quantization=self.cfg.quantization)
            if self.use_bias:
                qkv = qkv + w(self.bqkv_cnh)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:
            q = project("btd,dnh->btnh", x_btd, w(self.wq_dnh), quantization=self.cfg.quantization)
            k = project("btd,dkh->btkh", x_btd, w(self.wk_dkh), quantization=self.cfg.quantization)
            v = project("btd,dkh->btkh", x_btd, w(self.wv_dkh), quantization=self.cfg.quantization)
            if self.use_bias:
                q, k, v = q + w(self.bq_nh), k + w(self.bk_kh), v + w(self.bv_kh)
        q, k, v = checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
        if self.qk_norm == "l2":  # no scale; a rotation keeps a head's norm, so before or after rotary is the same
            eps = self.cfg.normalization_layer_epsilon
            q, k = rms_normalized(q, eps).astype(q.dtype), rms_normalized(k, eps).astype(k.dtype)
        elif self.qk_norm:
            q, k = self.query_norm(q), self.key_norm(k)
        if self.temperature_tuning:
            q = (q * self.query_temperature(positions_bt)[:, :, None, None]).astype(q.dtype)
        if self.rope_inv_freq:
            tables = rotary_tables(positions_bt, np.asarray(self.rope_inv_freq, np.float32))
            q, k = rotate(q, tables), rotate(k, tables)
        q = shard_logically(q, ("batch", "length", "act_heads", None))
        k = shard_logically(k, ("batch", "length", "act_kv_heads", None))
        v = shard_logically(v, ("batch", "length", "act_kv_heads", None))
        return q, k, v

    def query_temperature(self, positions_bt):
        """temperature_tuning's multiplier of the queries at `positions_bt` [B, T], in float32."""
        cfg = self.cfg
        steps = jnp.floor((positions_bt.astype(jnp.float32) + 1.0) / cfg.temperature_tuning_floor_scale)
        return jnp.log1p(steps) * cfg.temperature_tuning_scale + 1.0

    def output(self, ctx_btnh, gate_btnh=None):
        """The output projection of the attention context [B, T, N, H] -> [B, T, D], the context first
        multiplied by sigmoid(gate) when the layer has an output gate."""
        if gate_btnh is not None:
            ctx_btnh = (ctx_btnh.astype(jnp.float32) * jax.nn.sigmoid(gate_btnh.astype(jnp.float32))).astype(self.dtype)
        ctx = checkpoint_name(shard_logically(ctx_btnh, ("batch", "length", "act_heads", None)), "context")
        out = project("btnh,nhd->btd", ctx, self.wo_nhd[...].astype(self.dtype), quantization=self.cfg.quantization)
        if self.output_bias:
            out = out + self.bo_d[...].astype(self.dtype)
        return checkpoint_name(out, "out_proj")

    def __call__(self, x_btd, positions_bt, segment_ids_bt, packed: bool, kv_cache: KVCache | None = None):
        """(output [B, T, D], kv_cache). Without a cache (training) the T tokens attend causally
        to each other and the returned cache is None. With one (decoding) their keys and values
        are written into it at its index, the queries attend over the whole cache, masked by
        position, and the updated cache is returned."""
        q, k, v = self.project_qkv(x_btd, positions_bt)
        gate = None
        if self.output_gate:
            gate = project("btd,dnh->btnh", x_btd, self.wgate_dnh[...].astype(self.dtype), quantization=self.cfg.quantization)
        if kv_cache is None:
            return self.output(self.attend(q, k, v, segment_ids_bt, packed), gate), None
        if not (self.window or self.chunk):  # (a window's or a chunk's cache is a ring of its length)
            kv_cache.check_room(q.shape[1])
        if isinstance(kv_cache, EmptyKVCache):  # the prompts' prefill: their tokens see only each other
            new = kv_cache.stored(k, v, positions_bt, segment_ids_bt)  # as later steps will read them back
            ctx = self.attend_prompt(q, new.keys(q.dtype), new.values(q.dtype), new, positions_bt, segment_ids_bt)
            return self.output(ctx, gate), kv_cache.add(new)
        if (self.window or self.chunk) and q.shape[1] > 1:
            # a sliding-window cache is a ring of `window` slots: writing several tokens may
            # overwrite keys the first of them still see, so they read the cache as it was
            # plus their own keys (as stored), and the write comes after
            new, old = kv_cache.stored(k, v, positions_bt, segment_ids_bt), kv_cache
            keys, values = (jnp.concatenate(pair, axis=1) for pair in (
                (old.keys(q.dtype), new.keys(q.dtype)), (old.values(q.dtype), new.values(q.dtype))))
            visible = lambda p, s: jnp.concatenate([c.mask(p, s, self.window, self.chunk)  # noqa: E731
                                                    for c in (old, new)], -1)
            kv_cache = old.add(new)
        else:
            kv_cache = kv_cache.write(k, v, positions_bt, segment_ids_bt)
            keys, values = kv_cache.keys(q.dtype), kv_cache.values(q.dtype)
            visible = functools.partial(kv_cache.mask, window=self.window, chunk=self.chunk)
        ctx = masked_attention(q, keys, values, visible, positions_bt, segment_ids_bt, scale=self.scale,
                               logits_soft_cap=self.logits_soft_cap, sinks_n=self.sink_logits())
        return self.output(ctx, gate), kv_cache

    def attend_prompt(self, q, k, v, new: KVCache, positions_bt, segment_ids_bt):
        """The prefill's attention of the prompts' tokens among themselves: splash attention when
        that is the kernel (TPU; the prompts are padded on the left to its tiles; not for Llama 4's
        chunked layers, whose chunks splash counts by index, where a prompt's count from its first
        token), else the reference with its
        queries in chunks (`masked_attention`), whose memory stays bounded for long prompts (the
        training reference's causal chunks would hold several [2048, T] score blocks at once:
        34.2 against 4.2 GiB of temporaries for mistral-7b and a 32k-token prompt)."""
        if self.kernel.startswith("splash") and not self.chunk:  # splash counts chunks by index, and prompts are padded
            return self.attend(q, k, v, segment_ids_bt, packed=True)
        return masked_attention(q, k, v, functools.partial(new.mask, window=self.window, chunk=self.chunk), positions_bt,
                                segment_ids_bt, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                                sinks_n=self.sink_logits())

    def attend(self, q, k, v, segment_ids_bt, packed: bool):
        """Causal attention of the T tokens among themselves with the chosen kernel: context [B, T, N, Hv]."""
        if self.kernel.startswith("splash"):
            from tessera.models import splash

            shards = splash.sequence_shards()
            ctx = splash.splash_attention(q, k, v, segment_ids_bt, scale=self.scale,
                                          logits_soft_cap=self.logits_soft_cap, window=self.window,
                                          chunk=self.chunk, sinks_n=self.sink_logits(),
                                          blocks=splash.block_sizes(self.cfg, q.shape[1], shards),
                                          load_balance=splash.load_balanced(self.cfg, q.shape[1], shards),
                                          interpret=self.kernel == "splash_interpret")
        elif self.kernel == "cudnn" and not packed and not (self.chunk and q.shape[1] > self.chunk):
            window = (self.window - 1, 0) if self.window else None
            ctx = jax.nn.dot_product_attention(q, k, v, scale=self.scale, is_causal=True, local_window_size=window,
                                               implementation="cudnn")
        else:
            ctx = dot_product_attention(q, k, v, segment_ids_bt, segment_ids_bt, scale=self.scale,
                                        logits_soft_cap=self.logits_soft_cap, window=self.window,
                                        chunk=self.chunk, sinks_n=self.sink_logits(), packed=packed)
        return ctx

    def sink_logits(self):
        """The sink logit of each query head [N] in float32 (attention_sink), or None."""
        if not self.sinks:
            return None
        return shard_logically(self.sinks_n[...].astype(jnp.float32), ("act_heads",))
