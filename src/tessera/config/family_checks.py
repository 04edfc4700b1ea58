"""Checks of the model keys particular to some decoder block families (gemma2's pairs, Llama 4's
pattern, gpt-oss's clamped experts, DeepSeek's latent attention and dense layers) and of the expert
routing keys: part of `tessera.config.checks.validate`, which runs on every loaded config."""

from __future__ import annotations

from tessera.config.fields import MOE_BLOCKS
from tessera.config.layers import LAYERS_PER_BLOCK, TAIL_BLOCKS
from tessera.config.schema import ConfigError


def validate_family(m) -> None:
    """Checks of the keys particular to some decoder block families (`checks.validate` runs them)."""
    if m.decoder_block == "gemma2" and m.num_decoder_layers % 2:
        raise ConfigError(f"decoder_block=gemma2 needs an even number of layers (local and global alternate), "
                          f"not {m.num_decoder_layers}; change base_num_decoder_layers")
    if m.local_rope_max_timescale == 0:
        raise ConfigError("local_rope_max_timescale=0 is not a rotary theta; give the local layers' theta (gemma3: "
                          "10000), or -1 for the global layers' rope_max_timescale")
    _validate_llama4(m)
    if m.decoder_block == "gpt_oss":
        _validate_gpt_oss(m)
    elif m.mlp_activations_limit > 0:
        raise ConfigError(f"mlp_activations_limit={m.mlp_activations_limit:g} clips gpt-oss's expert activations and "
                          f"applies to decoder_block=gpt_oss only; set mlp_activations_limit=-1")
    if m.decoder_block == "deepseek" and m.sliding_window_size:
        raise ConfigError(f"sliding_window_size={m.sliding_window_size}: decoder_block=deepseek's latent attention "
                          "(MLA) attends over the whole sequence and would ignore it; set sliding_window_size=0")
    if m.decoder_block == "deepseek" and (m.attention_sink or m.attention_bias or m.fused_qkv):
        which = " and ".join(n for n in ("attention_bias", "attention_sink", "fused_qkv") if getattr(m, n))
        raise ConfigError(f"{which}=true: decoder_block=deepseek's latent attention (MLA) has no such input; "
                          f"set {which}=false")
    if m.decoder_block == "deepseek" and (m.attn_logits_soft_cap or m.query_pre_attn_scalar):
        # MLA scales its scores by (qk_nope_head_dim + qk_rope_head_dim)**-0.5 (times YaRN's factor), uncapped
        which = [f"{n}={getattr(m, n):g}" for n in ("attn_logits_soft_cap", "query_pre_attn_scalar") if getattr(m, n)]
        raise ConfigError(f"{' and '.join(which)}: decoder_block=deepseek's latent attention (MLA) scales its scores "
                          "by (qk_nope_head_dim + qk_rope_head_dim)**-0.5 without a cap and would ignore "
                          f"{'them' if len(which) > 1 else 'it'}; set {' and '.join(w.split('=')[0] + '=0' for w in which)}")
    if m.decoder_block in TAIL_BLOCKS and m.num_decoder_layers < LAYERS_PER_BLOCK[m.decoder_block]:
        pattern = LAYERS_PER_BLOCK[m.decoder_block]
        kinds = "linear-attention and 1 full-attention" if m.decoder_block == "qwen3_next" else "local and 1 global"
        raise ConfigError(f"decoder_block={m.decoder_block} needs at least {pattern} layers (one pattern of "
                          f"{pattern - 1} {kinds} layer), not {m.num_decoder_layers}; change "
                          "base_num_decoder_layers")
    _validate_partial_rotary(m)
    if m.decoder_block == "qwen3_next":
        _validate_qwen3_next(m)
    if m.decoder_block == "deepseek":
        _validate_deepseek(m)
    elif m.first_num_dense_layers:
        raise ConfigError(f"first_num_dense_layers={m.first_num_dense_layers} applies to decoder_block=deepseek only")
    _validate_routing(m)
    if m.fused_qkv and m.num_kv_heads != m.num_query_heads:
        raise ConfigError(f"fused_qkv=true needs multi-head attention (kv heads = query heads), but there are "
                          f"{m.num_kv_heads} kv heads and {m.num_query_heads} query heads; set fused_qkv=false")
    if m.fused_mlp and len(m.mlp_activations) != 2:
        raise ConfigError(f"fused_mlp=true fuses the gate and up projections of a gated MLP, but mlp_activations="
                          f"{m.mlp_activations} has one activation (no gate); set fused_mlp=false")
    if m.fused_mlp and m.decoder_block in MOE_BLOCKS:
        raise ConfigError(f"fused_mlp=true applies to dense MLPs; decoder_block={m.decoder_block}'s experts keep "
                          "separate gate and up projections; set fused_mlp=false")


def _validate_partial_rotary(m) -> None:
    """partial_rotary_factor: a whole, even number of rotating dimensions, on a family that rotates its heads."""
    if m.partial_rotary_factor == 1.0:
        return
    rotary = m.head_dim * m.partial_rotary_factor
    if m.decoder_block in ("deepseek", "gpt3"):
        why = ("rotates qk_rope_head_dim dimensions of its own" if m.decoder_block == "deepseek"
               else "has no rotary positions")
        raise ConfigError(f"partial_rotary_factor={m.partial_rotary_factor:g}: decoder_block={m.decoder_block} {why}; "
                          "set partial_rotary_factor=1")
    if abs(rotary - round(rotary)) > 1e-6 or round(rotary) % 2 or not round(rotary):
        raise ConfigError(f"partial_rotary_factor={m.partial_rotary_factor:g} of head_dim {m.head_dim} rotates {rotary:g} "
                          "dimensions; rotary pairs need a whole, even, non-zero number of them: give a factor of "
                          f"2k / {m.head_dim} (k = 1 .. {m.head_dim // 2})")
    if m.rope_scaling == "yarn":
        raise ConfigError(f"partial_rotary_factor={m.partial_rotary_factor:g} with rope_scaling=yarn: YaRN's score "
                          "multiplier assumes every dimension rotates; use rope_scaling none, linear or llama3, or "
                          "partial_rotary_factor=1")


def _validate_qwen3_next(m) -> None:
    """Qwen3-Next's Gated DeltaNet heads and its attention layers, which have no window."""
    if m.gdn_num_value_heads % m.gdn_num_key_heads:
        raise ConfigError(f"gdn_num_value_heads={m.gdn_num_value_heads} is not a multiple of gdn_num_key_heads="
                          f"{m.gdn_num_key_heads}: each key head serves a whole group of value heads; change either")
    if m.num_experts > 1 and not m.shared_experts:  # (transformers' Qwen3-Next and MaxText's build it too)
        raise ConfigError("shared_experts=0: every decoder_block=qwen3_next layer has a shared expert behind its "
                          "sigmoid gate, beside the routed ones; set shared_experts (Qwen3-Next: 1, as wide as an "
                          "expert)")
    if m.sliding_window_size:
        raise ConfigError(f"sliding_window_size={m.sliding_window_size}: decoder_block=qwen3_next's attention layers see "
                          "the whole causal past (its Gated DeltaNets are the local memory); set sliding_window_size=0")


def _validate_routing(m) -> None:
    """Checks of the expert routing keys: groups, capacity and the dropless receive buffer."""
    if m.n_routing_groups == 0 or m.n_routing_groups < -1:  # the routing read it as -1 (no groups) without a word
        raise ConfigError(f"n_routing_groups={m.n_routing_groups} is not a number of expert groups; use 2 or more "
                          "(DeepSeek-V3: 8, with topk_routing_group=4), or -1 for no groups")
    if m.n_routing_groups > 1:
        if m.num_experts % m.n_routing_groups:
            raise ConfigError(f"n_routing_groups={m.n_routing_groups} does not divide num_experts={m.num_experts} "
                              "into groups of equal size; use a divisor of it (DeepSeek-V3: 8 groups of 256 "
                              "experts), or -1 for no groups")
        if not 1 <= m.topk_routing_group <= m.n_routing_groups:
            raise ConfigError(f"topk_routing_group={m.topk_routing_group} must be between 1 and n_routing_groups="
                              f"{m.n_routing_groups}: the groups a token may take its experts from (DeepSeek-V3: 4 "
                              "of 8)")
        if m.num_experts // m.n_routing_groups < 2 and m.routing_group_score == "top2_sum":  # (a top_k traceback)
            raise ConfigError(f"n_routing_groups={m.n_routing_groups} leaves groups of one expert (num_experts="
                              f"{m.num_experts}), but a group is scored by its two best experts; use at most "
                              f"{m.num_experts // 2} groups, routing_group_score=max, or n_routing_groups=-1 for no "
                              "groups")
        if m.num_experts_per_tok > (allowed := m.topk_routing_group * m.num_experts // m.n_routing_groups):
            raise ConfigError(f"num_experts_per_tok={m.num_experts_per_tok} is more experts than the "
                              f"topk_routing_group={m.topk_routing_group} groups a token may use hold ("
                              f"{m.topk_routing_group} x {m.num_experts // m.n_routing_groups} = {allowed}, "
                              f"n_routing_groups={m.n_routing_groups} splitting num_experts={m.num_experts}); "
                              "raise topk_routing_group or lower num_experts_per_tok")
    if m.num_experts > 1 and m.routed_scaling_factor == 0:
        raise ConfigError("routed_scaling_factor=0 multiplies the routed experts' weights by zero: they would add "
                          "nothing to a token and their router would learn nothing; use 1 (no scaling) or a positive "
                          "factor (DeepSeek-V3: 2.5)")
    if m.capacity_factor != -1 and m.capacity_factor <= 0:
        raise ConfigError(f"capacity_factor={m.capacity_factor} must be > 0, or -1 for no capacity limit")
    if m.ragged_buffer_factor != -1 and m.ragged_buffer_factor <= 0:
        raise ConfigError(f"ragged_buffer_factor={m.ragged_buffer_factor} must be > 0, or -1 for a buffer with room "
                          "for every token copy")


_LLAMA4_KEYS = {"use_qk_norm": False, "chunk_attn_window_size": 0, "nope_layer_interval": 0, "temperature_tuning": False,
                "interleave_moe_layer_step": 1}
# blocks that always norm each query and key head, with a learned scale: use_qk_norm=true (what MaxText's qwen3 model
# files set, and its gemma3 always does; olmo3's and olmo2's norm all heads at once, as MaxText's olmo3 with true) is
# what they do
QK_NORM_BLOCKS = ("qwen3", "qwen3_moe", "gemma3", "olmo3", "olmo2", "qwen3_next")


def _validate_llama4(m) -> None:
    """Llama 4's keys: only its family reads them, and its 4-layer pattern must hold them."""
    if m.decoder_block != "llama4":
        used = [f"{k}={getattr(m, k)}" for k, off in _LLAMA4_KEYS.items() if getattr(m, k) != off
                and not (k == "use_qk_norm" and m.decoder_block in QK_NORM_BLOCKS)]
        if used:
            raise ConfigError(f"{', '.join(used)}: Llama 4's settings, which decoder_block={m.decoder_block} does not "
                              "have; use decoder_block=llama4, or leave them at their defaults")
        return
    if m.num_decoder_layers % 4:
        raise ConfigError(f"decoder_block=llama4 needs a multiple of 4 layers (its pattern of rotary and NoPE, dense "
                          f"and expert layers repeats every 4), not {m.num_decoder_layers}; change base_num_decoder_layers")
    for name in ("nope_layer_interval", "interleave_moe_layer_step"):
        if getattr(m, name) not in (0, 1, 2, 4) or (name == "interleave_moe_layer_step" and not getattr(m, name)):
            raise ConfigError(f"{name}={getattr(m, name)} must divide llama4's 4-layer pattern: 1, 2 or 4"
                              + (" (or 0: none)" if name == "nope_layer_interval" else ""))
    if m.sliding_window_size:
        raise ConfigError(f"sliding_window_size={m.sliding_window_size}: decoder_block=llama4 attends within chunks "
                          "instead (chunk_attn_window_size); set sliding_window_size=0")
    if m.routed_bias:
        raise ConfigError("routed_bias=true (DeepSeek's auxiliary-loss-free balancing) is not built for "
                          "decoder_block=llama4; set routed_bias=false")


def _validate_gpt_oss(m) -> None:
    """Local and global layers alternate; the experts' activation is gpt-oss's clamped SwiGLU."""
    if m.num_decoder_layers % 2:
        raise ConfigError(f"decoder_block=gpt_oss needs an even number of layers (sliding-window and full attention "
                          f"layers alternate), not {m.num_decoder_layers}; change base_num_decoder_layers")
    if len(m.mlp_activations) != 2 or m.mlp_activations[1] != "linear":
        raise ConfigError(f"decoder_block=gpt_oss: mlp_activations={m.mlp_activations} must be two, the second "
                          "\"linear\": its experts compute gate * act0(1.702 * gate) * (up + 1) (gpt-oss: "
                          "[\"sigmoid\",\"linear\"])")
    if m.routed_bias:
        raise ConfigError("routed_bias=true (DeepSeek's auxiliary-loss-free balancing) is not built for "
                          "decoder_block=gpt_oss, whose router has a learned bias of its own; set routed_bias=false")
    if m.shared_experts:  # the shared MLP is a plain gated one: act0(gate) * up, not the experts' clamped gate
        raise ConfigError(f"shared_experts={m.shared_experts} is not built for decoder_block=gpt_oss: a shared expert "
                          f"would be a plain gated MLP ({m.mlp_activations[0]}(gate) * up), not an expert with gpt-oss's "
                          f"clamped gate (gate * {m.mlp_activations[0]}(1.702 * gate) * (up + 1)); set shared_experts=0")
    if m.mlp_activations_limit == 0 or m.mlp_activations_limit < -1:
        raise ConfigError(f"mlp_activations_limit={m.mlp_activations_limit:g} must be > 0, or -1 for no clipping")


def _validate_deepseek(m) -> None:
    """Multi-head latent attention's widths and the dense layers below the experts."""
    width = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.head_dim != width:
        raise ConfigError(f"decoder_block=deepseek: head_dim={m.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                          f"= {width} (the query/key width attention kernels see); set head_dim={width}")
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary positions turn pairs)")
    if m.first_num_dense_layers >= m.num_decoder_layers:
        raise ConfigError(f"first_num_dense_layers={m.first_num_dense_layers} leaves no expert layer of the "
                          f"{m.num_decoder_layers}; use fewer")
