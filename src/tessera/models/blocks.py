"""Decoder blocks, one class per family, and the registry that maps `decoder_block` to them.

A block is built from a `ModelConfig` and called as
`block(x_btd, positions_bt, segment_ids_bt, dropout_key, packed) -> x_btd`.
"""

from __future__ import annotations

import jax
from flax import nnx

from tessera.config import ModelConfig
from tessera.mesh import shard_logically
from tessera.models.attention import Attention
from tessera.models.layers import Mlp, RMSNorm, dropout, rope_frequencies


def rope_frequencies_of(cfg: ModelConfig):
    """The rotary inverse wavelengths a config asks for (rope_max_timescale, rope_scaling)."""
    scaling = None
    if cfg.rope_scaling == "llama3":
        scaling = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                   cfg.rope_original_max_position)
    return rope_frequencies(cfg.head_dim, cfg.rope_max_timescale, scaling)


class LlamaBlock(nnx.Module):
    """Llama 2 / Llama 3.x block: pre-RMSNorm, grouped-query attention with rotary positions,
    gated MLP (SwiGLU with mlp_activations=["silu","linear"]), residual connections.

    Differences from the reference (Touvron et al. 2023; Meta's and Hugging Face's code): rotary
    embeddings use the half-split layout of the Hugging Face checkpoints (with Llama 3.1's
    long-context frequency scaling when rope_scaling=llama3); dropout (absent in
    the reference) can be switched on after attention and the MLP.
    """

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs):
        dtype, wdtype = cfg.dtype, cfg.weight_dtype
        self.pre_attention_norm = RMSNorm(cfg.emb_dim, cfg.normalization_layer_epsilon, dtype, wdtype, rngs)
        self.attention = Attention(cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim,
                                   rope_frequencies_of(cfg), attention_kernel, dtype, wdtype, rngs)
        self.pre_mlp_norm = RMSNorm(cfg.emb_dim, cfg.normalization_layer_epsilon, dtype, wdtype, rngs)
        self.mlp = Mlp(cfg.emb_dim, cfg.mlp_dim, cfg.mlp_activations, dtype, wdtype, rngs)
        self.dropout_rate = cfg.dropout_rate if cfg.enable_dropout else 0.0

    def __call__(self, x_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool):
        keys = (None, None) if dropout_key is None else tuple(jax.random.split(dropout_key))
        h = self.attention(self.pre_attention_norm(x_btd), positions_bt, segment_ids_bt, packed)
        x_btd = x_btd + dropout(h, self.dropout_rate, keys[0])
        h = self.mlp(self.pre_mlp_norm(x_btd))
        x_btd = x_btd + dropout(h, self.dropout_rate, keys[1])
        return shard_logically(x_btd, ("batch", "length", "act_embed"))


BLOCKS: dict[str, type[nnx.Module]] = {
    "llama2": LlamaBlock,
}
