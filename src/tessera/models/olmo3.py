"""OLMo 3 and OLMo 2 decoder blocks (`decoder_block=olmo3`, MaxText's name, and `decoder_block=olmo2`).

OLMo 3 (Team OLMo 2025; Hugging Face allenai/Olmo-3-1025-7B and Olmo-3-1125-32B) keeps OLMo 2's
layer: no norm before attention or the MLP, an RMSNorm after each (x + norm(attention(x)), then
x + norm(mlp(x))), and one RMSNorm over all query heads of a token at once and one over all its key
heads (a scale per head and dimension), after the projections and before the rotation. It adds
sliding-window attention: three local layers (window 4096) then one global layer, repeated; the
local layers rotate with rope_max_timescale unscaled (`local_rope_max_timescale`, -1 in its model
files: the same theta), the global ones with YaRN (factor 8 over 8192 tokens). One block is one
4-layer pattern (`LayerPattern`); a layer count that is not a multiple of 4 ends in a tail block of
local layers, as Hugging Face's layer_types rule ((i + 1) % 4: full attention) builds it. The 7B
model has as many key and value heads as query heads, the 32B 8 for 40; the embeddings are not tied.

OLMo 2 (Team OLMo 2024; model_type olmo2) is that layer with every layer global and one rotary
embedding (rope_scaling, if any, applies to every layer): `Olmo2Block`, one layer per block, so a
scanned stack scans over layers (a pipeline stage or a remat unit can hold any number of them) and
its parameters are a Llama-shaped stack. An olmo3 model with sliding_window_size=0 and its local
layers at the global theta computes the same function in 4-layer blocks (and exports as olmo2 too).

Where they differ from the reference (the Hugging Face `transformers` implementations, which the
parity tests compare against): the query and key norms multiply by their scales in float32 and round
once (transformers rounds the product to the compute dtype too: equal in float32); dropout, absent
there, can be switched on.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import dropout_rate
from tessera.models.attention import Attention
from tessera.models.blocks import Block, LayerPattern, dropout_keys, make_norm, residual
from tessera.models.layers import Mlp


class Olmo3Layer(nnx.Module):
    """x + post_norm(attention(x)), then x + post_norm(mlp(x)), attending within `window` tokens (0: the whole
    past); OLMo 3's local layers (`local_rope`) rotate with the unscaled local frequencies."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, window: int, local_rope: bool = False):
        self.attention = Attention(cfg, attention_kernel, rngs, sliding_window=window, qk_norm="rms_all_heads",
                                   local_rope=local_rope)
        self.post_attention_norm = make_norm("rms", cfg, rngs)
        self.mlp = Mlp.of(cfg, rngs)
        self.post_mlp_norm = make_norm("rms", cfg, rngs)
        self.dropout_rate = dropout_rate(cfg)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, keys, packed: bool, kv_cache=None):
        """(x_btd, {}, kv_cache): the layer's output, no aux, and its updated cache (None without one)."""
        h, kv_cache = self.attention(x_btd, positions_bt, segment_ids_bt, packed, kv_cache)
        x_btd = residual(x_btd, self.post_attention_norm(h), self.dropout_rate, keys[0])
        h = self.post_mlp_norm(self.mlp(x_btd))
        return residual(x_btd, h, self.dropout_rate, keys[1]), {}, kv_cache


class Olmo3Block(LayerPattern):
    """OLMo 3's repeating pattern (`LayerPattern`): layer_0 .. layer_2 local, layer_3 global."""

    layers_per_block = 4

    def make_layer(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, local: bool) -> nnx.Module:
        return Olmo3Layer(cfg, attention_kernel, rngs, cfg.sliding_window_size if local else 0, local_rope=local)


class Olmo2Block(Olmo3Layer, Block):
    """OLMo 2: one layer of OLMo 3's kind per block, global (sliding_window_size, 0 in its model files, would apply to
    every layer, as Mistral's does) and rotated with rope_max_timescale and rope_scaling."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs):
        super().__init__(cfg, attention_kernel, rngs, cfg.sliding_window_size)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool, kv_cache=None):
        return super().__call__(x_btd, positions_bt, segment_ids_bt, dropout_keys(dropout_key, 2), packed, kv_cache)
