"""DeepSeek-V3 and DeepSeek-V2 decoder blocks (`decoder_block=deepseek`).

DeepSeek-V3 (DeepSeek-AI 2024) is a pre-RMSNorm decoder whose attention is multi-head latent
attention (`tessera.models.mla`: low-rank query and compressed key/value projections, a
decoupled rotary part shared by the heads, YaRN rotary scaling) and whose MLPs are mixtures of
fine-grained experts (`tessera.models.moe`) with:
- `shared_experts` experts every token goes through (one dense gated MLP that many experts wide);
- sigmoid router scores (`routed_score_func=sigmoid`), experts chosen from a token's best
  `topk_routing_group` of `n_routing_groups` groups, weighted by their scores renormalized and
  multiplied by `routed_scaling_factor` (2.5);
- auxiliary-loss-free balancing (`routed_bias`): a per-expert bias added to the scores only to
  choose the experts; after every step the train step moves each layer's bias by
  `routed_bias_update_rate` towards balance (down for an expert that took more than its share
  of the token copies, up for one that took less), plus DeepSeek's small load-balancing loss
  (`load_balance_loss_weight`, 0.0001 in the model file);
- the first `first_num_dense_layers` (3) layers with a dense MLP of `base_mlp_dim` instead of
  experts: the decoder stacks them separately (`dense_layers`) below the expert layers.

DeepSeek-V2 (`deepseek2-236b`, and the Lite model `deepseek2-16b`) is the same block routed otherwise:
softmax scores weighted as they are (`norm_topk_prob=false`) times `routed_scaling_factor` (16 in
236B), no balancing bias, and in 236B groups ranked by their best expert's score
(`routing_group_score=max`: DeepSeek's group-limited greedy choice; V3 ranks them by the sum of
their two best); V2-Lite has a full-rank query projection (`q_lora_rank=0`) and no groups. Its
report's device- and communication-level balancing losses are not built (they balance a particular
device layout), only the expert-level one (`load_balance_loss_weight`).

Where it differs from the reference (the Hugging Face `transformers` implementation, which the
parity tests compare against, and DeepSeek's report): the multi-token-prediction module
(`num_nextn_predict_layers`, an extra training objective whose weights are not part of the
671B main model) is built only with `mtp_num_layers` (`tessera.models.mtp`; off in the model
file, and absent from `transformers`' model, so the parity tests do not cover it); DeepSeek's
load-balancing loss is computed per sequence, ours over the batch (Switch-style, on the
renormalized sigmoid scores); the bias update uses the loads of the whole (global) batch
after each optimizer step, as the report describes, and is not part of the gradients.
Rotary dimensions: see `tessera.models.mla` (the converter reorders DeepSeek's interleaved pairs).
"""

from __future__ import annotations

from flax import nnx

from tessera.config import ModelConfig
from tessera.models.kv_cache import KVCache
from tessera.models.llama import LlamaBlock
from tessera.models.mla import MlaAttention
from tessera.models.moe import MoeMlp


class DeepseekDenseBlock(LlamaBlock):
    """x + mla(norm(x)), then x + mlp(norm(x)): the dense layers at the bottom."""

    def make_attention(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs) -> nnx.Module:
        return MlaAttention(cfg, attention_kernel, rngs)

    @classmethod
    def empty_cache(cls, cfg: ModelConfig, batch: int, length: int, layers: tuple[int, ...] = ()):
        """MLA's cache: the latent [kv_lora_rank] and the rotary key [qk_rope_head_dim] per token."""
        return KVCache.empty(batch, length, 1, cfg.kv_lora_rank, cfg.dtype, layers,
                             cfg.kv_quant_dtype if cfg.quantize_kvcache else "", cfg.kv_quant_axis,
                             value_dim=cfg.qk_rope_head_dim)


class DeepseekBlock(DeepseekDenseBlock):
    """x + mla(norm(x)), then x + moe(norm(x)); returns the router's statistics as aux."""

    @classmethod
    def prefix_blocks(cls, cfg: ModelConfig) -> tuple[int, type | None]:
        return cfg.first_num_dense_layers, (DeepseekDenseBlock if cfg.first_num_dense_layers else None)

    def make_mlp(self, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
        return MoeMlp(cfg, rngs)

    def call_mlp(self, x_btd):
        return self.mlp(x_btd)
