"""Qwen3-Next decoder blocks (`decoder_block=qwen3_next`, MaxText's name).

Qwen3-Next (Qwen Team 2025; Hugging Face Qwen/Qwen3-Next-80B-A3B, model_type qwen3_next) mixes two
kinds of layer, three of linear attention then one of full attention, repeated (`LayerPattern`, one
block per pattern; a layer count that is not a multiple of 4 ends in a tail block of linear layers,
as transformers' layer_types rule builds it):
- the linear layers are Gated DeltaNets (`tessera.models.gated_deltanet`): a memory per value head,
  updated by the gated delta rule, no KV cache and no cost quadratic in the length;
- the full-attention layers are grouped-query attention (16 query and 2 kv heads of 256 in the 80B)
  with a zero-centered RMSNorm over each query and key head, rotary positions on the first quarter of
  each head (`partial_rotary_factor`) and an output gate: the context times sigmoid(x W_gate) (the
  query projection of the checkpoints is twice as wide and holds the gate too).
Every layer is pre-norm (x + mixer(norm(x)), then x + moe(norm(x))) with zero-centered (1 + scale)
RMSNorms, the final one included, and every MLP a mixture of 512 experts of width 512, top 10, the
chosen probabilities renormalized, plus one shared expert of the same width whose output is
multiplied by sigmoid(x w_gate) (a scalar per token).

Where it differs from the reference (transformers' Qwen3NextForCausalLM, which the parity test
compares against): the query and key norms multiply by their scales in float32 and round once;
the multi-token-prediction layer of the released checkpoints is not read. Decoding keeps, for each linear layer,
its memory and its convolution's last inputs (`DeltaNetCache`) beside the attention layers' KV caches: a quarter of
the layers hold a cache that grows with the length.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import dropout_rate
from tessera.models.attention import Attention
from tessera.models.blocks import Block, LayerPattern, make_norm, residual
from tessera.models.gated_deltanet import GatedDeltaNet
from tessera.models.kv_cache import DeltaNetCache
from tessera.models.moe import MoeMlp


class Qwen3NextLayer(nnx.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)); the mixer a Gated DeltaNet (`linear`) or gated attention."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, linear: bool):
        self.pre_attention_norm = make_norm("rms_zero_centered", cfg, rngs)
        if linear:
            self.linear_attention = GatedDeltaNet(cfg, rngs)
        else:
            self.attention = Attention(cfg, attention_kernel, rngs, qk_norm="rms_zero_centered", output_gate=True)
        self.pre_mlp_norm = make_norm("rms_zero_centered", cfg, rngs)
        self.mlp = MoeMlp(cfg, rngs, shared_gate=True)
        self.linear, self.dropout_rate = linear, dropout_rate(cfg)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, keys, packed: bool, kv_cache=None):
        """(x_btd, aux, cache): the layer's output, its router's losses and its updated cache (decoding: a
        `DeltaNetCache` for a linear layer, a `KVCache` for attention; None in training)."""
        h = self.pre_attention_norm(x_btd)
        if self.linear:
            h, kv_cache = self.linear_attention(h, segment_ids_bt, kv_cache)
        else:
            h, kv_cache = self.attention(h, positions_bt, segment_ids_bt, packed, kv_cache)
        x_btd = residual(x_btd, h, self.dropout_rate, keys[0])
        h, aux = self.mlp(self.pre_mlp_norm(x_btd))
        return residual(x_btd, h, self.dropout_rate, keys[1]), aux, kv_cache


class Qwen3NextBlock(LayerPattern):
    """Qwen3-Next's repeating pattern: layer_0 .. layer_2 Gated DeltaNets, layer_3 gated attention."""

    layers_per_block = 4
    norm = "rms_zero_centered"

    def make_layer(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, local: bool) -> nnx.Module:
        return Qwen3NextLayer(cfg, attention_kernel, rngs, linear=local)

    @classmethod
    def empty_cache(cls, cfg: ModelConfig, batch: int, length: int, layers: tuple[int, ...] = (),
                    num_layers: int = 0):
        """One cache per layer: a Gated DeltaNet's memory and convolution inputs (the same size at any length),
        the attention layer's keys and values."""
        return tuple(DeltaNetCache.empty(cfg, batch, layers) if cls.is_local(j) else
                     Block.empty_cache(cfg, batch, length, layers, 0) for j in range(num_layers or cls.layers_per_block))
