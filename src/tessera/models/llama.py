"""Llama 2 / Llama 3.x and Mistral decoder blocks (`decoder_block=llama2`, `decoder_block=mistral`).

Pre-RMSNorm, grouped-query attention with rotary positions, gated MLP (SwiGLU with
mlp_activations=["silu","linear"]), residual connections.

Where they differ from the references (Touvron et al. 2023 and Meta's code; Jiang et al. 2023
for Mistral; the Hugging Face `transformers` implementations, which the parity tests compare
against): rotary embeddings use the half-split layout of the Hugging Face checkpoints (with
Llama 3.1's long-context frequency scaling when rope_scaling=llama3); dropout, absent in the
references, can be switched on after attention and the MLP. Mistral is the Llama block with
sliding-window attention (`sliding_window_size`): a query sees its own position and the
`sliding_window_size - 1` before it; when decoding, its KV cache is a rolling buffer of that
many slots (`tessera.models.kv_cache`), as in Mistral's reference code.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import dropout_rate
from tessera.models.attention import Attention
from tessera.models.blocks import Block, dropout_keys, make_norm, residual
from tessera.models.layers import Mlp


class LlamaBlock(Block):
    """x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs):
        self.pre_attention_norm = make_norm(self.norm, cfg, rngs)
        self.attention = self.make_attention(cfg, attention_kernel, rngs)
        self.pre_mlp_norm = make_norm(self.norm, cfg, rngs)
        self.mlp = self.make_mlp(cfg, rngs)
        self.dropout_rate = dropout_rate(cfg)

    def make_attention(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs) -> nnx.Module:
        return Attention(cfg, attention_kernel, rngs, sliding_window=cfg.sliding_window_size, qk_norm=self.qk_norm)

    def make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return Mlp.of(cfg, rngs)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool, kv_cache=None):
        keys = dropout_keys(dropout_key, 2)
        h, kv_cache = self.attention(self.pre_attention_norm(x_btd), positions_bt, segment_ids_bt, packed, kv_cache)
        x_btd = residual(x_btd, h, self.dropout_rate, keys[0])
        h, aux = self.call_mlp(self.pre_mlp_norm(x_btd))
        return residual(x_btd, h, self.dropout_rate, keys[1]), aux, kv_cache

    def call_mlp(self, x_btd):
        return self.mlp(x_btd), {}


class MistralBlock(LlamaBlock):
    """The Llama block; Mistral model files set sliding_window_size (4096 for Mistral 7B v0.1)."""
