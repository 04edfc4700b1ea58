"""Llama 4 decoder blocks (`decoder_block=llama4`; the text model).

Llama 4 (Meta 2025: Scout 17B-16E, Maverick 17B-128E) is the Llama block with:
- layers without rotary positions ("NoPE"): every `nope_layer_interval`-th layer (4) attends to
  its whole causal past without positions, its queries scaled by `temperature_tuning`'s
  0.1 ln(1 + floor((p + 1) / 8192)) + 1 at position p (sharper attention far into a long context);
- attention within chunks on the other layers (`chunk_attn_window_size`, 8192): a query sees the
  earlier tokens of its own chunk only; with `use_qk_norm` (Scout) their queries and keys go
  through an RMS norm without a scale;
- experts: `num_experts` (16 or 128) with one chosen per token by the sigmoid of its router
  logit; the token enters the expert already multiplied by that score, and a shared expert
  (`shared_experts=1`, the experts' width) takes every token. Maverick alternates dense layers
  (`base_mlp_dim`, 16384) with expert layers (`interleave_moe_layer_step=2`), Scout has experts
  in every layer.
A block is one 4-layer pattern (three rotary, chunked layers and a NoPE layer; experts as the
step says), scanned like any block; `num_decoder_layers` must be a multiple of 4. Decoding
caches a ring of the chunk's length for the chunked layers (a query never looks further back)
and every token for the NoPE ones.

Where it differs from the references (the Hugging Face `transformers` implementation, which the
parity tests compare against, and Meta's release): rotary embeddings use the half-split layout,
so the converter reorders the checkpoints' interleaved query and key dimensions (as for
DeepSeek's); the temperature follows each token's position in its document under packing
(`transformers` counts from the start of the row, as both do for chunks; without packing it is
the same); decoding counts chunks by position, from a prompt's first token; the
router's load-balancing loss is Mixtral's, and dropout can be switched on. The vision encoder of
the released multimodal checkpoints is not built.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.config.derived import dropout_rate
from tessera.config.layers import llama4_moe, llama4_nope
from tessera.models.attention import Attention
from tessera.models.blocks import Block, dropout_keys, make_norm, residual, stacked_aux
from tessera.models.layers import Mlp
from tessera.models.moe import MoeMlp

PATTERN = 4  # layers in one block: the pattern of NoPE and expert layers repeats every 4


class Llama4Layer(nnx.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): rotary and chunked, or NoPE and global;
    experts or a dense MLP."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, nope: bool, moe: bool):
        self.pre_attention_norm = make_norm("rms", cfg, rngs)
        self.attention = Attention(cfg, attention_kernel, rngs, use_rope=not nope,
                                   qk_norm="l2" if cfg.use_qk_norm and not nope else "",
                                   chunk=0 if nope else cfg.chunk_attn_window_size,
                                   temperature_tuning=cfg.temperature_tuning and nope)
        self.pre_mlp_norm = make_norm("rms", cfg, rngs)
        if moe:
            self.mlp = MoeMlp(cfg, rngs, scale_inputs=True)
        else:
            self.mlp = Mlp.of(cfg, rngs, fused=False)
        self.moe, self.dropout_rate = moe, dropout_rate(cfg)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, keys, packed: bool, kv_cache=None):
        """(x_btd, the router's aux ({} for a dense layer), kv_cache)."""
        h, kv_cache = self.attention(self.pre_attention_norm(x_btd), positions_bt, segment_ids_bt, packed, kv_cache)
        x_btd = residual(x_btd, h, self.dropout_rate, keys[0])
        h, aux = self.mlp(self.pre_mlp_norm(x_btd)) if self.moe else (self.mlp(self.pre_mlp_norm(x_btd)), {})
        return residual(x_btd, h, self.dropout_rate, keys[1]), aux, kv_cache


class Llama4Block(Block):
    """Layers layer_0 .. layer_3 of the pattern; the router statistics of its expert layers are
    stacked ([expert layers in the block, E]), so the decoder's per-layer entries cover every one."""

    layers_per_block = PATTERN

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs):
        for j in range(PATTERN):
            setattr(self, f"layer_{j}", Llama4Layer(cfg, attention_kernel, rngs, llama4_nope(cfg, j),
                                                    llama4_moe(cfg, j)))

    @classmethod
    def empty_cache(cls, cfg: ModelConfig, batch: int, length: int, layers: tuple[int, ...] = ()):
        """One cache per layer: a chunked layer's a ring of chunk_attn_window_size slots (its queries see
        no key further back), a NoPE layer's every token."""
        one = super().empty_cache
        return tuple(one(cfg, batch, length, layers, 0 if llama4_nope(cfg, j) else cfg.chunk_attn_window_size)
                     for j in range(PATTERN))

    def __call__(self, x_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool, kv_cache=None):
        keys = dropout_keys(dropout_key, 2 * PATTERN)
        caches, auxes = [], []
        for j in range(PATTERN):
            x_btd, aux, cache = getattr(self, f"layer_{j}")(x_btd, positions_bt, segment_ids_bt, keys[2 * j:2 * j + 2],
                                                           packed, None if kv_cache is None else kv_cache[j])
            caches.append(cache)
            auxes.append(aux)
        return x_btd, stacked_aux(auxes), None if kv_cache is None else tuple(caches)
