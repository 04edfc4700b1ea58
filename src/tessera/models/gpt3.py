"""GPT-3 decoder block (`decoder_block=gpt3`).

Pre-LayerNorm (scale and bias), multi-head attention with biases and no rotary embedding,
a GELU MLP with biases (mlp_activations=["gelu"], tanh-approximated as in GPT-2/3), output
logits tied to the token embedding, positions added to the token embeddings: a learned table of
`trainable_position_size` rows, or fixed sinusoidal embeddings when it is 0.

Where it differs from the reference (Brown et al. 2020, which describes GPT-2's architecture
with alternating dense and locally banded sparse attention layers): every layer uses dense
attention (as do GPT-2 and the open reproductions; the sparse pattern was never released). The
parity tests compare against Hugging Face's GPT-2, the closest public relative, whose fused
c_attn projection maps to fused_qkv=true. Dropout is off unless dropout_rate > 0.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import dropout_rate
from tessera.models.attention import Attention
from tessera.models.blocks import Block, dropout_keys, make_norm, residual
from tessera.models.layers import Mlp


class Gpt3Block(Block):
    """x + attention(layernorm(x)), then x + mlp(layernorm(x))."""

    norm = "layer"
    absolute_positions = True

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs):
        self.pre_attention_norm = make_norm(self.norm, cfg, rngs)
        self.attention = Attention(cfg, attention_kernel, rngs, sliding_window=cfg.sliding_window_size,
                                   use_bias=True, use_rope=False)
        self.pre_mlp_norm = make_norm(self.norm, cfg, rngs)
        self.mlp = Mlp.of(cfg, rngs, use_bias=True)
        self.dropout_rate = dropout_rate(cfg)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool, kv_cache=None):
        keys = dropout_keys(dropout_key, 2)
        h, kv_cache = self.attention(self.pre_attention_norm(x_btd), positions_bt, segment_ids_bt, packed, kv_cache)
        x_btd = residual(x_btd, h, self.dropout_rate, keys[0])
        h = self.mlp(self.pre_mlp_norm(x_btd))
        return residual(x_btd, h, self.dropout_rate, keys[1]), {}, kv_cache
