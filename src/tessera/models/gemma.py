"""Gemma, Gemma 2 and Gemma 3 decoder blocks (`decoder_block=gemma`, `gemma2`, `gemma3`).

Gemma (Gemma Team 2024) is the Llama block with: RMSNorm scales stored as an offset from one
(x * (1 + scale)); token embeddings multiplied by sqrt(emb_dim); GeGLU MLP
(mlp_activations=["gelu","linear"], tanh-approximated GELU); output logits tied to the
embedding; multi-query attention in the 2B model and head_dim 256.

Gemma 2 (Gemma Team 2024b) adds: a norm after attention and after the MLP as well as before
them (four per layer); layers alternating between local sliding-window attention
(`sliding_window_size`, 4096) and global attention, the local one first; attention scores
scaled by query_pre_attn_scalar**-0.5 and soft-capped (attn_logits_soft_cap, 50); final
logits soft-capped (final_logits_soft_cap, 30). One Gemma 2 block holds a local and a global
layer, so `num_decoder_layers` must be even and a scanned stack scans over pairs; when
decoding, a block's KV cache is the pair (local layer's cache, global layer's cache).

Gemma 3 (Gemma Team 2025; text only) keeps Gemma 2's four norms per layer and drops its soft
caps; it adds an RMSNorm (Gemma's 1 + scale) on each query and key head before the rotation,
and repeats five local layers (sliding window 1024 in 4B-27B, rotary theta
`local_rope_max_timescale` 10k) and one global layer (theta `rope_max_timescale` 1M, with
linear rope scaling by 8 in 4B-27B). A block is one 6-layer pattern; the decoder runs the
layers left over (34 = 5 x 6 + 4 in Gemma 3 4B) as a tail block of local layers.

Where they differ from the references (the Hugging Face `transformers` implementations, which
the parity tests compare against): the embedding scale is applied in the compute dtype as
there; cuDNN's fused attention has no score soft cap, so `select_attention` (which sees
attn_logits_soft_cap) gives Gemma 2 the reference attention kernel on GPUs; dropout, absent
in the references, can be switched on.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import dropout_rate
from tessera.models.attention import Attention
from tessera.models.blocks import LayerPair, LayerPattern, make_norm, residual
from tessera.models.layers import Mlp
from tessera.models.llama import LlamaBlock


class GemmaBlock(LlamaBlock):
    """Llama's block with Gemma's norms; the decoder scales the embeddings."""

    norm = "rms_zero_centered"
    scale_embeddings = True


class Gemma2Layer(nnx.Module):
    """x + post_norm(attention(pre_norm(x))), then x + post_norm(mlp(pre_norm(x))). Gemma 3's
    layers add a norm on each query and key head (`qk_norm`) and, when local, their own rotary
    frequencies (`local_rope`)."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, sliding_window: int,
                 qk_norm: str = "", local_rope: bool = False):
        norm = "rms_zero_centered"
        self.pre_attention_norm = make_norm(norm, cfg, rngs)
        self.attention = Attention(cfg, attention_kernel, rngs, sliding_window=sliding_window, qk_norm=qk_norm,
                                   local_rope=local_rope)
        self.post_attention_norm = make_norm(norm, cfg, rngs)
        self.pre_mlp_norm = make_norm(norm, cfg, rngs)
        self.mlp = Mlp.of(cfg, rngs)
        self.post_mlp_norm = make_norm(norm, cfg, rngs)
        self.dropout_rate = dropout_rate(cfg)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, keys, packed: bool, kv_cache=None):
        """(x_btd, {}, kv_cache): the layer's output, no aux, and its updated cache (None without one)."""
        h, kv_cache = self.attention(self.pre_attention_norm(x_btd), positions_bt, segment_ids_bt, packed, kv_cache)
        x_btd = residual(x_btd, self.post_attention_norm(h), self.dropout_rate, keys[0])
        h = self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x_btd)))
        return residual(x_btd, h, self.dropout_rate, keys[1]), {}, kv_cache


class Gemma2Block(LayerPair):
    """A local (sliding-window) layer followed by a global layer (`LayerPair`)."""

    layer_cls = Gemma2Layer
    norm = "rms_zero_centered"
    scale_embeddings = True


class Gemma3Block(LayerPattern):
    """Gemma 3's repeating pattern (`LayerPattern`): layers layer_0 .. layer_4 local (sliding
    window, rotary theta local_rope_max_timescale), layer_5 global (rope_max_timescale with
    rope_scaling); Gemma 3 4B's 34 layers are 5 blocks and a tail of 4 local layers."""

    layers_per_block = 6
    norm = "rms_zero_centered"
    scale_embeddings = True
    qk_norm = "rms_zero_centered"

    def make_layer(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, local: bool) -> nnx.Module:
        return Gemma2Layer(cfg, attention_kernel, rngs, cfg.sliding_window_size if local else 0, qk_norm=self.qk_norm,
                           local_rope=local)
