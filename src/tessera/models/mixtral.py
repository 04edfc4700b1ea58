"""Mixtral decoder block (`decoder_block=mixtral`): the Mistral/Llama block with its MLP
replaced by a sparse mixture of experts (`tessera.models.moe`).

Where it differs from the reference (Jiang et al. 2024; Hugging Face `MixtralForCausalLM`):
the routing math is the same (softmax over the router logits, top `num_experts_per_tok`,
weights renormalized over the chosen experts) and with capacity_factor=-1 or the dropless
path no token is dropped, as in the reference; a positive capacity_factor drops tokens over
capacity, which the reference never does. The load-balancing loss is averaged over layers
(Hugging Face pools the router statistics of all layers before multiplying them), and it does
not leave padding out. Router jitter noise is not implemented.
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.models.llama import LlamaBlock
from tessera.models.moe import MoeMlp


class MixtralBlock(LlamaBlock):
    """x + attention(norm(x)), then x + moe(norm(x)); returns the router's losses as aux."""

    def make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoeMlp(cfg, rngs)

    def call_mlp(self, x_btd):
        return self.mlp(x_btd)
