"""Qwen3 dense and mixture-of-experts decoder blocks (`decoder_block=qwen3`, `qwen3_moe`).

Qwen3 (Qwen Team 2025) is the Llama block with an RMSNorm over each query and key head
(learned scale of head_dim, applied after the projections and before the rotation) and no
QKV bias (Qwen2 had one). Qwen3-MoE replaces every MLP with fine-grained experts: many small
gated MLPs (`base_mlp_dim` is the width of one expert: 768 in Qwen3-30B-A3B, 1536 in
Qwen3-235B-A22B), a softmax router choosing top-k (8 of 128) with the chosen probabilities
renormalized (`norm_topk_prob`), no shared expert, and the Switch-style load-balancing loss
(router_aux_loss_coef 0.001 -> `load_balance_loss_weight`).

Where they differ from the references (the Hugging Face `transformers` implementations,
which the parity tests compare against): the q/k norm multiplies by its scale in float32 and
rounds once (transformers rounds the normalized value to the compute dtype first: equal in
float32, within a bfloat16 rounding otherwise); Qwen3's optional sliding-window layers
(`use_sliding_window`, off in every released model) and Qwen3-MoE's dense layers between
expert layers (`decoder_sparse_step` > 1, `mlp_only_layers`; unused in released models) are
not built, and a checkpoint that sets them is refused by the converter. The MoE routing,
capacity and dropless paths are Mixtral's (`tessera.models.moe`; its notes apply).
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.models.llama import LlamaBlock
from tessera.models.moe import MoeMlp


class Qwen3Block(LlamaBlock):
    """Llama's block with a per-head RMSNorm on queries and keys."""

    qk_norm = "rms"


class Qwen3MoeBlock(Qwen3Block):
    """x + attention(norm(x)), then x + moe(norm(x)); returns the router's losses as aux."""

    def make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoeMlp(cfg, rngs)

    def call_mlp(self, x_btd):
        return self.mlp(x_btd)
