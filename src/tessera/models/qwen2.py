"""Qwen2 / Qwen2.5 decoder block (`decoder_block=qwen2`).

Qwen2 (Qwen Team 2024) is the Llama block with a learned bias on the query, key and value
projections and none on the output projection; Qwen2.5 keeps the architecture and changes the
data. `attention_bias=true`, as the model files and MaxText's qwen2.5-7b file set it, means those
three biases here (on other families it adds the output projection's as well); with
`attention_bias=false` the block is Llama's. Rotary theta 1,000,000 and RMSNorm epsilon 1e-6 in the
released models; 0.5B, 1.5B and 3B tie the output layer to the embedding.

Where it differs from the reference (the Hugging Face `transformers` implementation, which the
parity tests compare against): Qwen2's optional sliding-window layers (`use_sliding_window`,
off in every released model) are not built, and a checkpoint that sets them is refused by the
converter.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.models.attention import Attention
from tessera.models.llama import LlamaBlock


class Qwen2Block(LlamaBlock):
    """Llama's block; attention_bias puts biases on the query, key and value projections only."""

    def make_attention(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs) -> nnx.Module:
        return Attention(cfg, attention_kernel, rngs, sliding_window=cfg.sliding_window_size, qk_norm=self.qk_norm,
                         output_bias=False)
