"""gpt-oss decoder blocks (`decoder_block=gpt_oss`).

gpt-oss (OpenAI 2025: gpt-oss-20b, gpt-oss-120b) is a pre-RMSNorm mixture-of-experts decoder
whose layers alternate between sliding-window attention (the first of each pair; 128 tokens)
and full attention. What sets it apart, each a config key the model files set:
- grouped-query attention (64 query heads, 8 kv heads of 64) with a bias on every projection
  (`attention_bias`) and a learned sink logit per query head (`attention_sink`): each query's
  softmax also sees a key whose value is zero, so a head can attend to nothing;
- rotary positions with YaRN over an original 4096-token context, 32 times longer, without
  rounding its ramp's ends (`rope_truncate=false`); the scores are multiplied by YaRN's
  (0.1 ln 32 + 1)^2, as `Attention` does for every rope_scaling=yarn model;
- experts (32 of them in 20b, 128 in 120b; 4 per token) with a learned router bias added to
  the logits (part of this family, as in the checkpoints), the chosen experts weighted by the
  softmax of their logits (norm_topk_prob), a bias after every expert projection (`mlp_bias`),
  and a clamped gate: gate * sigmoid(1.702 gate) * (up + 1), with the gate clipped above at
  `mlp_activations_limit` (7) and up to [-7, 7] (mlp_activations=["sigmoid","linear"], as
  MaxText spells it).
One block holds a local and a global layer, so `num_decoder_layers` must be even and a scanned
stack scans over pairs (as Gemma 2's); when decoding, a block's KV cache is the pair.

Where it differs from the references (the Hugging Face `transformers` implementation, which
the parity tests compare against, and OpenAI's release): the released checkpoints store the
experts' weights in MXFP4 (4-bit values sharing a power-of-two scale per 32); conversion reads
them as the values they stand for (`tessera.tools.hf_checkpoint`) and training keeps them in
weight_dtype. New sink logits start at zero (Hugging Face draws them from a normal). The
load-balancing loss is Mixtral's (`tessera.models.moe`), averaged over layers; dropout, absent
in the references, can be switched on.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import dropout_rate
from tessera.models.attention import Attention
from tessera.models.blocks import LayerPair, make_norm, residual
from tessera.models.moe import MoeMlp


class GptOssLayer(nnx.Module):
    """x + attention(norm(x)), then x + experts(norm(x)); `sliding_window` 0: full attention."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, sliding_window: int):
        self.pre_attention_norm = make_norm("rms", cfg, rngs)
        self.attention = Attention(cfg, attention_kernel, rngs, sliding_window=sliding_window)
        self.pre_mlp_norm = make_norm("rms", cfg, rngs)
        self.mlp = MoeMlp(cfg, rngs, router_bias=True, clamped_glu=True)
        self.dropout_rate = dropout_rate(cfg)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, keys, packed: bool, kv_cache=None):
        """(x_btd, the router's aux, kv_cache): the layer's output, statistics and updated cache."""
        h, kv_cache = self.attention(self.pre_attention_norm(x_btd), positions_bt, segment_ids_bt, packed, kv_cache)
        x_btd = residual(x_btd, h, self.dropout_rate, keys[0])
        h, aux = self.mlp(self.pre_mlp_norm(x_btd))
        return residual(x_btd, h, self.dropout_rate, keys[1]), aux, kv_cache


class GptOssBlock(LayerPair):
    """A sliding-window layer followed by a full-attention layer (`LayerPair`); the two layers'
    router statistics are stacked ([2, E] per block)."""

    layer_cls = GptOssLayer
