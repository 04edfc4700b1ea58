"""The `config.json` that tessera-to-hf writes: a Tessera model config as Hugging Face
`transformers` spells it, per family (the inverse of `tessera.tools.hf_configs.config_from_hf`;
a test converts each family both ways and compares), and the sequence length it declares
(`trained_length`: given, trained on, or of the model the parameters were converted from)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tessera.config import Config, ConfigError, ModelConfig
from tessera.config.layers import LAYERS_PER_BLOCK, local_global_types
from tessera.models.layers import yarn_score_scale
from tessera.tools.hf_configs import HF_ATTENTION_BIAS, HF_MLP_BIAS, HF_MODEL_TYPES, NO_CAPS


def hf_config(m: ModelConfig, trained_length: int) -> dict[str, Any]:
    """A transformers `config.json` for the model `m` describes (inverse of config_from_hf), whose
    parameters were trained on sequences of `trained_length` tokens (see max_positions)."""
    model_type = {v: k for k, v in HF_MODEL_TYPES.items()}[m.decoder_block]
    if m.decoder_block == "deepseek":  # DeepSeek-V2 routes by softmax without a bias, V3 by sigmoid with one
        model_type = "deepseek_v2" if m.routed_score_func == "softmax" and not m.routed_bias else "deepseek_v3"
    if m.decoder_block == "olmo3" and not m.sliding_window_size:
        model_type = _olmo_without_windows(m)
    unwritten = [f"{key}={getattr(m, key):g}" for key in NO_CAPS if getattr(m, key)]
    if unwritten and model_type not in ("gemma2", "gemma3_text"):
        raise ConfigError(f"{', '.join(unwritten)}: Hugging Face's {model_type} config.json has no such setting, so "
                          "the exported model would compute other logits than this one; it cannot be exported")
    act = _activation_name(m, model_type)
    if m.decoder_block == "deepseek":
        return _refuse_other_routing(m, _deepseek_config(m, model_type, act, max_positions(m, trained_length)))
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
            "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gpt2": "GPT2LMHeadModel",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "gpt_oss": "GptOssForCausalLM", "llama4_text": "Llama4ForCausalLM", "olmo2": "Olmo2ForCausalLM",
            "olmo3": "Olmo3ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}[model_type]
    dtype = "bfloat16" if m.weight_dtype == "bfloat16" else m.weight_dtype
    if model_type == "gpt2":
        return _refuse_no_window(m, {"architectures": [arch], "model_type": model_type, "n_embd": m.emb_dim, "n_head": m.num_query_heads,
                "n_layer": m.num_decoder_layers, "n_inner": m.mlp_dim, "n_positions": m.trainable_position_size,
                "vocab_size": m.vocab_size, "layer_norm_epsilon": m.normalization_layer_epsilon,
                "activation_function": act, "tie_word_embeddings": m.logits_via_embedding,
                "torch_dtype": dtype})
    config = {
        "architectures": [arch], "model_type": model_type, "hidden_size": m.emb_dim, "intermediate_size": m.mlp_dim,
        "num_attention_heads": m.num_query_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "num_hidden_layers": m.num_decoder_layers, "vocab_size": m.vocab_size, "rms_norm_eps": m.normalization_layer_epsilon,
        "rope_theta": float(m.rope_max_timescale), "tie_word_embeddings": m.logits_via_embedding, "torch_dtype": dtype,
        "max_position_embeddings": max_positions(m, trained_length), "hidden_act": act,
    }
    config.update(_rope_scaling_keys(m))
    if model_type in HF_ATTENTION_BIAS:
        config["attention_bias"] = m.attention_bias
    if model_type in HF_MLP_BIAS:
        config["mlp_bias"] = m.mlp_bias
    _add_family_keys(config, m, model_type)
    return _refuse_other_routing(m, _refuse_no_window(m, config))


def _refuse_no_window(m: ModelConfig, written: dict[str, Any]) -> dict[str, Any]:
    """`written`, unless m attends within a sliding window its config.json does not hold (llama, gemma, gpt2,
    qwen2, qwen3 have no window in transformers): such a model was exported without a word, and transformers then
    attended to every earlier position."""
    if m.sliding_window_size and not written.get("sliding_window"):
        raise ConfigError(f"sliding_window_size={m.sliding_window_size}: Hugging Face's {written['model_type']} "
                          "config.json has no sliding window here (its attention sees every earlier position), so the "
                          "exported model would compute other logits than this one; it cannot be exported")
    return written


def _rope_scaling_keys(m: ModelConfig) -> dict[str, Any]:
    """`rope_scaling` for a scaled RoPE; nothing for plain RoPE."""
    keys: dict[str, Any] = {}
    if m.rope_scaling == "llama3":
        keys["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
                                "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                                "original_max_position_embeddings": m.rope_original_max_position}
    elif m.rope_scaling == "linear":
        keys["rope_scaling"] = {"rope_type": "linear", "factor": m.rope_scaling_factor}
    elif m.rope_scaling == "yarn":  # attention_factor: the square root of Attention's score multiplier
        keys["rope_scaling"] = {"rope_type": "yarn", "factor": m.rope_scaling_factor,
                                "original_max_position_embeddings": m.rope_original_max_position,
                                "beta_fast": m.beta_fast, "beta_slow": m.beta_slow, "truncate": m.rope_truncate,
                                "attention_factor": yarn_score_scale(m.rope_scaling_factor, m.mscale) ** 0.5}
    return keys


def max_positions(m: ModelConfig, trained_length: int) -> int:
    """config.json's `max_position_embeddings`, the longest sequence the model handles: the longer of
    `trained_length` (the sequences its parameters were trained on) and the context a llama3 or YaRN
    RoPE scaling stretches rope_original_max_position to (x rope_scaling_factor). transformers warns
    when a llama3 context is not past the original one, or a YaRN one not the original times the factor
    (it was max(8192, rope_original_max_position), whatever the model was trained on)."""
    stretched = m.rope_original_max_position * m.rope_scaling_factor if m.rope_scaling in ("llama3", "yarn") else 0
    return max(trained_length, int(stretched))


def _add_family_keys(config: dict[str, Any], m: ModelConfig, model_type: str) -> None:
    """The keys (and the changes to the common ones) of each family's config.json, into `config`."""
    if model_type == "gpt_oss":
        config.update(hidden_act="silu", intermediate_size=m.expert_mlp_dim, num_local_experts=m.num_experts,
                      num_experts_per_tok=m.num_experts_per_tok, sliding_window=m.sliding_window_size or None,
                      # -1 (no clipping) as a limit no activation reaches: transformers' gpt-oss always clips
                      swiglu_limit=m.mlp_activations_limit if m.mlp_activations_limit > 0 else 1e30,
                      router_aux_loss_coef=m.load_balance_loss_weight,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                   for i in range(m.num_decoder_layers)])
    if model_type == "llama4_text":
        config.update(_llama4_config(m))
    if model_type in ("gemma", "gemma2", "gemma3_text"):  # Gemma reads hidden_act, Gemma 2 and 3 hidden_activation
        config["hidden_activation"] = config["hidden_act"]
    if model_type in ("mistral", "mixtral", "gemma2", "gemma3_text", "olmo3"):
        config["sliding_window"] = m.sliding_window_size or None
    if model_type == "mixtral":  # its experts' width (base_moe_mlp_dim when set: then no layer is base_mlp_dim wide)
        config.update(num_local_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                      intermediate_size=m.expert_mlp_dim)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None)
    if model_type == "qwen2":  # the first layer a window would start from: none here (use_sliding_window is false)
        config["max_window_layers"] = m.num_decoder_layers
    if model_type == "qwen3_moe":  # every layer is an expert layer; intermediate_size (dense layers) is unused
        config.update(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                      moe_intermediate_size=m.expert_mlp_dim, norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=[])
    if model_type == "qwen3_next":  # (its partial rotary factor read from rope_parameters, as transformers 5 writes it)
        config.update(_qwen3_next_config(m))
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta"),
                                     "partial_rotary_factor": config.pop("partial_rotary_factor")}
    if model_type in ("gemma2", "gemma3_text"):
        config.update(query_pre_attn_scalar=_whole(m.query_pre_attn_scalar or m.head_dim, "query_pre_attn_scalar"),
                      attn_logit_softcapping=m.attn_logits_soft_cap or None,
                      final_logit_softcapping=m.final_logits_soft_cap or None)
    if model_type in ("gemma3_text", "olmo3"):  # rope_scaling is the global layers' only; the local ones rotate unscaled
        if model_type == "gemma3_text":
            _refuse_rope_scaling(m, model_type, ("none", "linear"))
        glob = {"rope_type": "default", **config.pop("rope_scaling", {}), "rope_theta": config.pop("rope_theta")}
        config["rope_parameters"] = {"full_attention": glob, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(m.local_rope_theta)}}
        config["layer_types"] = local_global_types(LAYERS_PER_BLOCK[m.decoder_block], m.num_decoder_layers)


def _qwen3_next_config(m: ModelConfig) -> dict[str, Any]:
    """Qwen3-Next's keys: its Gated DeltaNet sizes, layer pattern, partial rotary and experts."""
    _refuse_rope_scaling(m, "qwen3_next", ("none",))
    return {"linear_num_key_heads": m.gdn_num_key_heads, "linear_num_value_heads": m.gdn_num_value_heads,
            "linear_key_head_dim": m.gdn_key_head_dim, "linear_value_head_dim": m.gdn_value_head_dim,
            "linear_conv_kernel_dim": m.gdn_conv_kernel_dim, "partial_rotary_factor": m.partial_rotary_factor,
            "layer_types": ["full_attention" if (i + 1) % LAYERS_PER_BLOCK["qwen3_next"] == 0 else "linear_attention"
                            for i in range(m.num_decoder_layers)],
            "num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.expert_mlp_dim, "shared_expert_intermediate_size": m.shared_experts * m.expert_mlp_dim,
            "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": m.load_balance_loss_weight}


def _olmo_without_windows(m: ModelConfig) -> str:
    """The model_type of an olmo3 model without sliding windows: olmo2 (OLMo 2: every layer global, one rotary embedding)
    when its layers all rotate alike; transformers' olmo3 needs a window for its sliding layers, so another is
    refused."""
    if m.rope_scaling == "none" and m.local_rope_theta == m.rope_max_timescale:
        return "olmo2"
    raise ConfigError(f"sliding_window_size=0 with rope_scaling={m.rope_scaling} and local_rope_max_timescale="
                      f"{m.local_rope_max_timescale}: transformers' olmo3 needs a window on its sliding-window layers, "
                      "and its olmo2 (every layer global) rotates every layer alike, so this model cannot be exported; "
                      "give sliding_window_size, or rope_scaling=none and local_rope_max_timescale=-1 (OLMo 2)")


def _llama4_config(m: ModelConfig) -> dict[str, Any]:
    """Llama 4's keys of a Llama4ForCausalLM config.json (its layer pattern written out per layer)."""
    from tessera.config.layers import llama4_moe, llama4_nope

    layers = range(m.num_decoder_layers)
    return {"intermediate_size": m.expert_mlp_dim, "intermediate_size_mlp": m.mlp_dim,
            "num_local_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "interleave_moe_layer_step": m.interleave_moe_layer_step,
            "moe_layers": [i for i in layers if llama4_moe(m, i)],
            "no_rope_layers": [int(not llama4_nope(m, i)) for i in layers],
            "no_rope_layer_interval": m.nope_layer_interval or 4,
            "attention_chunk_size": m.chunk_attn_window_size or None, "use_qk_norm": m.use_qk_norm,
            "attn_temperature_tuning": m.temperature_tuning, "floor_scale": _whole(m.temperature_tuning_floor_scale,
                                                                                     "temperature_tuning_floor_scale"),
            "attn_scale": m.temperature_tuning_scale, "router_aux_loss_coef": m.load_balance_loss_weight}


def _deepseek_config(m: ModelConfig, model_type: str, act: str, max_position_embeddings: int) -> dict[str, Any]:
    """config.json of a deepseek model: DeepSeek-V3's keys, or DeepSeek-V2's (`model_type`) for a model that routes
    as V2 does (rotary dimensions interleaved, as their checkpoints)."""
    _refuse_rope_scaling(m, model_type, ("none", "yarn"))
    v2 = model_type == "deepseek_v2"
    if v2 and m.mtp_num_layers:
        raise ConfigError(f"mtp_num_layers={m.mtp_num_layers}: Hugging Face's deepseek_v2 (the family of this model's "
                          "softmax routing without a balancing bias) has no multi-token-prediction module; set "
                          "mtp_num_layers=0 to export the main model")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rope_max_timescale)}
    if m.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=m.rope_scaling_factor, beta_fast=m.beta_fast, beta_slow=m.beta_slow,
                    mscale=m.mscale, mscale_all_dim=m.mscale, truncate=m.rope_truncate,
                    original_max_position_embeddings=m.rope_original_max_position)
    groups = m.n_routing_groups > 1
    # (transformers' deepseek_v2 router never renormalizes: a model that does is refused by name after)
    routing = ({"scoring_func": "softmax", "topk_method": "group_limited_greedy" if groups else "greedy",
                "norm_topk_prob": False} if v2 else
               {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": m.norm_topk_prob,
                "rope_interleave": True, "num_nextn_predict_layers": m.mtp_num_layers})
    return {
        "architectures": ["DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"], "model_type": model_type,
        "hidden_size": m.emb_dim, "intermediate_size": m.mlp_dim, "moe_intermediate_size": m.expert_mlp_dim,
        "num_attention_heads": m.num_query_heads, "num_key_value_heads": m.num_kv_heads,
        "num_hidden_layers": m.num_decoder_layers, "vocab_size": m.vocab_size, "rms_norm_eps": m.normalization_layer_epsilon,
        "tie_word_embeddings": m.logits_via_embedding, "hidden_act": act,
        "torch_dtype": "bfloat16" if m.weight_dtype == "bfloat16" else m.weight_dtype,
        "max_position_embeddings": max_position_embeddings,
        "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.num_experts_per_tok, "n_shared_experts": m.shared_experts,
        "first_k_dense_replace": m.first_num_dense_layers, "routed_scaling_factor": m.routed_scaling_factor,
        "n_group": max(m.n_routing_groups, 1), "topk_group": max(m.topk_routing_group, 1), "rope_parameters": rope,
        **routing,
    }


def _refuse_other_routing(m: ModelConfig, written: dict[str, Any]) -> dict[str, Any]:
    """`written`, the config.json of m, when transformers routes tokens with it as m does; ConfigError
    naming the routing keys its family has no setting for (or reads otherwise) when m sets them."""
    from tessera.config import build_config
    from tessera.tools.hf_configs import config_from_hf

    if m.num_experts <= 1:
        return written
    hf = build_config(config_from_hf(written)).model

    def groups(c: ModelConfig) -> int:  # 1 group and -1 both route without groups
        return max(c.n_routing_groups, 1)

    keys = ["routed_score_func", "norm_topk_prob", "routed_scaling_factor", "shared_experts"]
    differ = [k for k in keys if getattr(m, k) != getattr(hf, k)]
    if groups(m) != groups(hf) or (groups(m) > 1 and m.topk_routing_group != hf.topk_routing_group):
        differ += ["n_routing_groups", "topk_routing_group"]
    if groups(m) > 1 and m.routing_group_score != hf.routing_group_score:
        differ.append("routing_group_score")
    if m.routed_bias and not hf.routed_bias:  # deepseek_v3's bias of zeros routes as no bias
        differ.append("routed_bias")
    if differ:
        def shown(c: ModelConfig) -> str:
            return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                             for k, v in ((k, getattr(c, k)) for k in differ))

        raise ConfigError(f"{shown(m)}: Hugging Face's {written['model_type']} config.json has no such setting (its "
                          f"router computes {shown(hf)}), so the exported model would compute other logits than this "
                          "one; it cannot be exported")
    return written


def _refuse_rope_scaling(m: ModelConfig, model_type: str, written: tuple[str, ...]) -> None:
    """ConfigError for a rope_scaling that the family's config.json is not written with here (it was written as
    plain RoPE: transformers then rotated with other frequencies than the model was trained with)."""
    if m.rope_scaling not in written:
        raise ConfigError(f"rope_scaling={m.rope_scaling}: the {model_type} config.json is written with rope_scaling "
                          f"{' or '.join(written)} only (what hf-to-tessera reads back), so the exported model would "
                          "compute other logits than this one; it cannot be exported")


def _whole(value: float, key: str) -> int:
    """A float key that transformers' config stores as an int (it refuses a float when loading)."""
    if value != int(value):
        raise ConfigError(f"{key}={value}: Hugging Face's config stores a whole number here; set {key}={round(value)}"
                          " (or leave it) to export this model")
    return int(value)


# transformers' names of Tessera's activations (its "gelu" is the exact one; Tessera's gelu is the tanh approximation)
HF_ACTIVATIONS = {"gelu": "gelu_pytorch_tanh", "silu": "silu", "relu": "relu"}


def _activation_name(m: ModelConfig, model_type: str) -> str:
    """The `hidden_act` (GPT-2: `activation_function`) of m's MLP; ConfigError for an MLP the family's
    transformers model does not build (it wrote a name transformers runs otherwise, or failed with a KeyError)."""
    acts = list(m.mlp_activations)
    if model_type == "gpt2":
        ok, built = len(acts) == 1 and acts[0] in HF_ACTIVATIONS, "one activation (gelu, silu or relu), not gated"
    elif model_type == "gpt_oss":
        ok, built = acts == ["sigmoid", "linear"], 'its clamped SwiGLU (["sigmoid", "linear"])'
    else:
        ok, built = len(acts) == 2 and acts[0] in HF_ACTIVATIONS and acts[1] == "linear", \
            'gated: [gelu, silu or relu, then "linear"]'
    if not ok:
        raise ConfigError(f"mlp_activations={json.dumps(acts)}: Hugging Face's {model_type} MLP is {built}, so this "
                          "model cannot be exported")
    return "gelu_new" if model_type == "gpt2" and acts[0] == "gelu" else HF_ACTIVATIONS.get(acts[0], "silu")


def trained_length(checkpoint: str, cfg: Config) -> tuple[int, list[tuple[int, str]]]:
    """The sequence length the checkpoint's parameters handle, for config.json's max_position_embeddings:
    max_target_length from the command line; else the longer of the one saved with a training checkpoint
    and the max_position_embeddings of the Hugging Face model the parameters were converted from (kept by
    hf-to-tessera beside them, found through the training run's load_parameters_path): a fine-tune of a
    4,096-token model on 2,048-token sequences still handles 4,096. With the log records (level, text)
    saying what is written and where it comes from, and a warning when nothing says."""
    from tessera.checkpointing import saved_config
    from tessera.config.schema import all_fields

    length, default = cfg.data.max_target_length, all_fields()["max_target_length"][1].default
    saved_run = saved_config(checkpoint)
    saved = saved_run.get("max_target_length")
    converted = converted_from_length(checkpoint, saved_run.get("load_parameters_path"))
    sources = []
    if length != default:  # model files leave it to base.yml: another value was given on the command line
        sources.append(f"max_target_length={length} given")
    else:
        if isinstance(saved, int):
            sources.append(f"the checkpoint's training run used max_target_length={saved}")
        if converted:
            sources.append(f"its parameters were converted from a Hugging Face model of max_position_embeddings="
                           f"{converted}")
        length = max([n for n in (saved, converted) if isinstance(n, int)], default=length)
    source = "; ".join(sources) or "no max_target_length given, and the checkpoint keeps no training config"
    written = max_positions(cfg.model, length)
    if written > length:
        source += f"; rope_scaling={cfg.model.rope_scaling} stretches the model's context to {written}"
    notes = [(logging.INFO, f"config.json: max_position_embeddings={written} ({source})")]
    notes += _start_gone(saved_run.get("load_parameters_path"), converted, given=cfg.data.max_target_length != default)
    if written == length and not sources:
        notes.append((logging.WARNING, f"max_position_embeddings={written} is configs/base.yml's max_target_length "
                                       "default, not a length this model was trained on; give max_target_length=<the "
                                       "context it handles> (e.g. 4096) to write that"))
    return length, notes


def _start_gone(start, converted: int | None, given: bool) -> list[tuple[int, str]]:
    """A warning when the training run's load_parameters_path (`start`, saved absolute) is a local
    folder that is not there any more (moved or renamed since): the Hugging Face config.json kept
    beside converted parameters cannot be read, and max_position_embeddings fell back to the training
    length (a Llama 2 fine-tuned on 2,048 tokens said 2,048, not 4,096) without a word."""
    if converted or given or not isinstance(start, str) or not start or "://" in start or Path(start).exists():
        return []
    return [(logging.WARNING, f"the checkpoint's run started from load_parameters_path={start}, which is not there any "
                              "more (moved or renamed?): if those parameters were converted from a Hugging Face model, "
                              "its max_position_embeddings is not known here; give max_target_length=<its context> "
                              "(e.g. 4096) to write that")]


def converted_from_length(*folders: str | None) -> int | None:
    """max_position_embeddings of the Hugging Face config.json that hf-to-tessera kept beside the parameters it
    wrote (hf_checkpoint.SOURCE_CONFIG), in the first of `folders` that has one; None when none has."""
    from etils import epath

    from tessera.tools.hf_checkpoint import SOURCE_CONFIG

    for folder in filter(None, folders):
        try:
            hf = json.loads((epath.Path(folder) / SOURCE_CONFIG).read_text())
        except Exception:  # noqa: BLE001 - no such file (a training step, older conversions), or unreadable: unknown
            continue
        value = hf.get("max_position_embeddings", (hf.get("text_config") or {}).get("max_position_embeddings"))
        if isinstance(value, int) and value > 0:
            return value
    return None
