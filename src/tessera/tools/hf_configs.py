"""How a Hugging Face `config.json` maps onto Tessera's model keys, per family, and back to
`key=value` arguments.

`config_from_hf(hf_config)` turns a `config.json` into Tessera model keys (the converter checks
them against the run's config, and the parity tests build their models from them); options no
released model uses and Tessera does not build are refused by name. The tensor side, which
Hugging Face tensor is which Tessera parameter, is `tessera.tools.hf_layouts`.
"""

from __future__ import annotations

import json
from typing import Any

from tessera.config import ConfigError
from tessera.tools.hf_layer_kinds import check_layer_types, gemma3_keys, olmo3_keys, qwen3_next_keys
from tessera.tools.hf_rope import rope_keys, rope_theta

HF_MODEL_TYPES = {"llama": "llama2", "mistral": "mistral", "mixtral": "mixtral", "gemma": "gemma", "gemma2": "gemma2",
                  "gpt2": "gpt3", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "gemma3_text": "gemma3",
                  "deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "gpt_oss": "gpt_oss", "llama4_text": "llama4",
                  "olmo2": "olmo2", "olmo3": "olmo3", "qwen3_next": "qwen3_next"}
# multimodal checkpoints whose language model Tessera converts: model_type -> its text model's model_type
# (the text model's config is the checkpoint's text_config; its tensors carry the language_model. prefix). Gemma 3
# 4B, 12B and 27B are released only as such (Gemma3ForConditionalGeneration), and were refused as unsupported
HF_MULTIMODAL = {"llama4": "llama4_text", "gemma3": "gemma3_text"}
# checkpoints of another model_type whose config.json and tensors are those of a family above: Kimi K2's
# (model_type kimi_k2, architectures DeepseekV3ForCausalLM) are DeepSeek-V3's keys and names
HF_SAME_AS = {"kimi_k2": "deepseek_v3"}
# Hugging Face families whose config.json has attention_bias / mlp_bias (the biases Tessera builds with those keys)
HF_ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "gemma", "gemma2", "gemma3_text", "olmo2", "olmo3")
HF_MLP_BIAS = ("llama",)
# Hugging Face families whose attention reads config.json's sliding_window (qwen2's and qwen3's use_sliding_window is
# refused):
# transformers' llama, gemma and llama4_text ignore a sliding_window their config.json holds
HF_SLIDING_WINDOW = ("mistral", "mixtral", "gemma2", "gemma3_text", "gpt_oss", "olmo3")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
# families whose transformers config ties the output layer to the embedding unless it says otherwise: Google's
# released Gemma and Gemma 2 config.json files leave tie_word_embeddings out (transformers wrote only non-defaults)
TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3_text")
# what a family without these settings computes (gemma2 and gemma3_text read theirs): a Tessera config that sets one
# describes another model, so the converter names it (any family's attention reads them, and the decoder the last)
NO_CAPS = {"query_pre_attn_scalar": 0, "attn_logits_soft_cap": 0.0, "final_logits_soft_cap": 0.0}
# how the routers of transformers' MoE families choose and weight experts where their config.json has no setting
# for it (qwen3_moe reads norm_topk_prob; gpt_oss and llama4_text set theirs below; deepseek_v3 reads its own): a
# Tessera config routing otherwise describes another model, so the converter names it (it converted and then
# computed other logits, and the export wrote a config.json transformers routes otherwise)
HF_ROUTING = {"routed_score_func": "softmax", "norm_topk_prob": True, "routed_scaling_factor": 1.0,
              "n_routing_groups": -1, "shared_experts": 0}
HF_MOE = ("mixtral", "qwen3_moe", "gpt_oss", "llama4_text", "qwen3_next")
# what transformers' config classes use for a setting a config.json leaves out, where it changes the numbers and
# Tessera's reading of no value would differ (a window of 0, no soft cap): such a config.json converted into
# another model than transformers builds from it (transformers writes them all; hand-written files may not)
HF_DEFAULTS = {"gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                          "sliding_window": 4096},
               # the released multimodal Gemma 3 4B's text_config leaves out its heads, vocabulary and norm epsilon
               "gemma3_text": {"query_pre_attn_scalar": 256, "sliding_window": 4096, "num_attention_heads": 8,
                               "num_key_value_heads": 4, "vocab_size": 262208, "rms_norm_eps": 1e-6},
               "mistral": {"sliding_window": 4096}, "olmo3": {"sliding_window": 4096, "rope_theta": 500000.0},
               "gpt_oss": {"sliding_window": 128, "attention_bias": True},
               # transformers' DeepseekV2Config: greedy (no groups); its router ignores norm_topk_prob
               "deepseek_v2": {"routed_scaling_factor": 1.0, "norm_topk_prob": False, "topk_method": "greedy",
                               "first_k_dense_replace": 0, "n_shared_experts": 2, "q_lora_rank": 1536},
               "deepseek_v3": {"routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
                               "first_k_dense_replace": 3, "n_shared_experts": 1, "q_lora_rank": 1536},
               "llama4_text": {"use_qk_norm": True, "attn_temperature_tuning": True, "attention_chunk_size": 8192}}
# head_dim where transformers' config class has a fixed default instead of hidden_size // num_attention_heads
# (the other families): a config.json without head_dim was read as that quotient (gpt-oss-20b 45, gemma3-4b 320)
HF_HEAD_DIMS = {"gemma": 256, "gemma2": 256, "gemma3_text": 256, "qwen3": 128, "gpt_oss": 64, "llama4_text": 128,
                "qwen3_next": 256}
# gpt-oss's rotary default (transformers' GptOssConfig), for a config.json with neither rope_parameters nor rope_scaling
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


def config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Tessera model keys (global_parameter_scale=1) describing the model of a config.json; ConfigError
    for a config.json without a key its family needs, or with a value of the wrong type."""
    try:
        text = text_model_config(hf)
        _refuse_quoted_booleans(text)
        _refuse_unread_biases(text)
        return _keys_of(text)
    except ConfigError:
        raise
    except KeyError as e:
        raise ConfigError(f"config.json of model_type={hf.get('model_type')!r} has no {e.args[0]!r}, which Tessera "
                          "needs to describe the model; pass the model's own config.json, as transformers saves it"
                          ) from None
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise ConfigError(f"config.json of model_type={hf.get('model_type')!r} has a value of the wrong type "
                          f"({type(e).__name__}: {e}); pass the model's own config.json, as transformers saves it"
                          ) from None


def _refuse_quoted_booleans(hf: dict[str, Any]) -> None:
    """A flag written as text ("false") would read as true (a non-empty string); transformers refuses it too."""
    for key, value in hf.items():
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            raise ConfigError(f"config.json has {key}={value!r}, text where transformers writes a JSON boolean; "
                              f"write it as {value.strip().lower()} without quotes")


def _refuse_unread_biases(hf: dict[str, Any]) -> None:
    """DeepSeek-V3's and Llama 4's attention take biases with attention_bias=true (transformers reads it), which
    the converter does not place: it refused their tensors as having "no place" in the model, asking whether the
    family was right."""
    if hf.get("attention_bias") and hf.get("model_type") in ("deepseek_v3", "llama4_text"):
        raise ConfigError(f"this {hf['model_type']} checkpoint sets attention_bias=true (biases on its attention "
                          "projections), which Tessera's converter does not read for this family; it is not converted")


def _keys_of(hf: dict[str, Any]) -> dict[str, Any]:
    kind = hf.get("model_type")
    if kind not in HF_MODEL_TYPES:
        raise ConfigError(f"config.json model_type={kind!r} is not supported; supported: "
                          f"{', '.join([*HF_MODEL_TYPES, *HF_MULTIMODAL, *HF_SAME_AS])}")
    hf = {**HF_DEFAULTS.get(kind, {}), **hf}  # a key given as null stays null (no window, no cap), as in transformers
    if kind in HF_HEAD_DIMS and hf.get("head_dim") is None:
        hf["head_dim"] = HF_HEAD_DIMS[kind]
    if kind == "gpt_oss" and not hf.get("rope_parameters") and not hf.get("rope_scaling"):  # its class's default
        hf["rope_parameters"] = {**GPT_OSS_ROPE, "rope_theta": hf.get("rope_theta", GPT_OSS_ROPE["rope_theta"])}
    if kind == "gpt2":
        return _gpt2_keys(hf)
    if kind in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_keys(hf)
    heads = hf["num_attention_heads"]
    keys = {
        "decoder_block": HF_MODEL_TYPES[kind], "global_parameter_scale": 1, "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads, "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "base_mlp_dim": hf["intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"], "vocab_size": hf["vocab_size"],
        "normalization_layer_epsilon": hf["rms_norm_eps"],
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", kind in TIED_BY_DEFAULT)),
        "mlp_activations": [_activation(_hidden_act(hf)), "linear"],
        "sliding_window_size": (hf.get("sliding_window") or 0) if kind in HF_SLIDING_WINDOW else 0,
        **rope_keys(hf), **NO_CAPS,
    }
    if kind in HF_MOE:
        keys.update(HF_ROUTING)
    if kind in HF_ATTENTION_BIAS:
        keys["attention_bias"] = bool(hf.get("attention_bias"))
    if kind in HF_MLP_BIAS:
        keys["mlp_bias"] = bool(hf.get("mlp_bias"))
    if kind == "gpt_oss":
        keys.update(_gpt_oss_keys(hf))
    if kind == "llama4_text":
        keys.update(_llama4_keys(hf))
    if kind == "mixtral":
        keys.update(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"])
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        _refuse_qwen_variants(hf)
        keys["sliding_window_size"] = 0  # a window given with use_sliding_window=false is not used
    if kind == "qwen2":  # transformers' Qwen2 always has the query, key and value biases (and no output bias)
        keys["attention_bias"] = True
    if kind == "qwen3_moe":
        keys.update(num_experts=hf.get("num_experts") or hf["num_local_experts"],
                    num_experts_per_tok=hf["num_experts_per_tok"], base_mlp_dim=hf["moe_intermediate_size"],
                    norm_topk_prob=bool(hf.get("norm_topk_prob")))
    if kind in ("gemma2", "gemma3_text"):
        keys.update(query_pre_attn_scalar=hf.get("query_pre_attn_scalar") or 0,
                    attn_logits_soft_cap=hf.get("attn_logit_softcapping") or 0.0,
                    final_logits_soft_cap=hf.get("final_logit_softcapping") or 0.0)
    if kind == "gemma2":  # local/global pairs, the first sliding
        check_layer_types(hf, ["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(hf["num_hidden_layers"])],
                          "this Gemma 2 checkpoint's layer_types do not alternate sliding-window and full attention "
                          "layers (the first sliding), the local/global pairs Tessera's gemma2 builds")
    if kind == "gemma3_text":
        keys.update(gemma3_keys(hf))
    if kind == "olmo3":
        keys.update(olmo3_keys(hf))
    if kind == "qwen3_next":
        keys.update(qwen3_next_keys(hf))
    return keys


def _refuse_qwen_variants(hf: dict[str, Any]) -> None:
    """Qwen2 and Qwen3 options no released model uses and Tessera does not build."""
    name = "Qwen2" if hf.get("model_type") == "qwen2" else "Qwen3"
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise ConfigError(f"this {name} checkpoint sets use_sliding_window=true (sliding-window layers); Tessera's "
                          f"{name.lower()} families build full attention only, as every released {name} model uses")
    if hf.get("model_type") == "qwen3_moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        raise ConfigError("this Qwen3-MoE checkpoint has dense MLP layers between expert layers (mlp_only_layers / "
                          "decoder_sparse_step); Tessera's qwen3_moe has experts in every layer")


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config of the model Tessera converts: a multimodal checkpoint's text_config (HF_MULTIMODAL), or
    the config.json as the family it is the same as (HF_SAME_AS)."""
    kind = hf.get("model_type")
    if kind in HF_SAME_AS:
        return {**hf, "model_type": HF_SAME_AS[kind]}
    if kind in HF_MULTIMODAL:
        if not isinstance(hf.get("text_config"), dict):
            raise ConfigError(f"this {kind} checkpoint's config.json has no text_config describing its language model")
        return {**hf["text_config"], "model_type": HF_MULTIMODAL[kind]}
    return hf


def _llama4_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's layer pattern (NoPE and expert layers), chunks and temperature, checked against the
    4-layer pattern Tessera's llama4 builds."""
    layers, step = hf["num_hidden_layers"], hf.get("interleave_moe_layer_step", 1)
    if hf.get("moe_layers") is not None and list(hf["moe_layers"]) != list(range(step - 1, layers, step)):
        raise ConfigError(f"this Llama 4 checkpoint's moe_layers are not every {step}th layer, the pattern Tessera's "
                          "llama4 builds")
    rope = [bool(r) for r in hf.get("no_rope_layers") or []]
    interval = 0 if all(rope) else next((i + 1 for i, r in enumerate(rope) if not r), 0)
    if rope and (interval not in (1, 2, 4) or rope != [bool(interval == 0 or (i + 1) % interval) for i in range(layers)]):
        raise ConfigError("this Llama 4 checkpoint's no_rope_layers are not one NoPE layer every 1, 2 or 4 layers, the "
                          "pattern Tessera's llama4 builds")
    if not rope:
        interval = hf.get("no_rope_layer_interval", 4)
    uses_rope = rope or [interval == 0 or bool((i + 1) % interval) for i in range(layers)]
    check_layer_types(hf, ["chunked_attention" if r else "full_attention" for r in uses_rope],
                      "this Llama 4 checkpoint's layer_types are not chunked attention on its rotary layers and full "
                      "attention on the others (no_rope_layers), the pattern Tessera's llama4 builds")
    return {"base_mlp_dim": hf.get("intermediate_size_mlp", 16384), "base_moe_mlp_dim": hf["intermediate_size"],
            "num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "shared_experts": 1, "routed_score_func": "sigmoid", "norm_topk_prob": False,
            "interleave_moe_layer_step": step, "nope_layer_interval": interval,
            "chunk_attn_window_size": hf.get("attention_chunk_size") or 0, "use_qk_norm": bool(hf.get("use_qk_norm")),
            "temperature_tuning": bool(hf.get("attn_temperature_tuning")),
            "temperature_tuning_floor_scale": float(hf.get("floor_scale", 8192)),
            "temperature_tuning_scale": float(hf.get("attn_scale", 0.1))}


def _gpt_oss_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's experts, sinks and layer pattern (alternating sliding-window and full attention,
    the first sliding), checked against what Tessera's gpt_oss builds."""
    from tessera.models.moe import SWIGLU_ALPHA

    layers = hf["num_hidden_layers"]
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if hf.get("layer_types") and list(hf["layer_types"]) != expected:
        raise ConfigError("this gpt-oss checkpoint's layer_types do not alternate sliding-window and full attention "
                          "layers (the first sliding), the pattern Tessera's gpt_oss builds")
    alpha = hf.get("swiglu_alpha", SWIGLU_ALPHA)
    if abs(alpha - SWIGLU_ALPHA) > 1e-6:
        raise ConfigError(f"this gpt-oss checkpoint's experts use swiglu_alpha={alpha}; Tessera's gpt_oss builds "
                          f"the released models' {SWIGLU_ALPHA}")
    limit = hf.get("swiglu_limit", 7.0)
    return {"num_experts": hf["num_local_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "norm_topk_prob": True, "attention_sink": True, "mlp_bias": True,
            "mlp_activations": ["sigmoid", "linear"], "mlp_activations_limit": float(limit) if limit else -1.0}


def _deepseek_routing(hf: dict[str, Any]) -> dict[str, Any]:
    """The routing keys of a DeepSeek config.json as transformers routes it: DeepSeek-V3's sigmoid scores with a
    balancing bias and groups ranked by their two best experts (noaux_tc), or DeepSeek-V2's softmax scores, in
    groups ranked by their best expert (group_limited_greedy) or without groups (greedy), never renormalized."""
    v2, method = hf["model_type"] == "deepseek_v2", hf.get("topk_method", "noaux_tc")
    expected, scores = (("greedy", "group_limited_greedy"), "softmax") if v2 else (("noaux_tc",), "sigmoid")
    if method not in expected or hf.get("scoring_func", scores) != scores:
        raise ConfigError(f"this {hf['model_type']} checkpoint routes with scoring_func={hf.get('scoring_func')!r} and "
                          f"topk_method={method!r}; Tessera's deepseek builds what transformers' {hf['model_type']} "
                          f"computes: {'softmax with ' + ' or '.join(expected) if v2 else 'sigmoid with noaux_tc'}")
    if v2 and hf.get("norm_topk_prob"):
        raise ConfigError("this deepseek_v2 checkpoint sets norm_topk_prob=true, which transformers' deepseek_v2 "
                          "router ignores (DeepSeek's own code renormalizes): which model it is, is unclear, so it "
                          "is not converted; the released DeepSeek-V2 models set false")
    groups = (hf.get("n_group") or 1) > 1 and method != "greedy"
    keys = {"routed_score_func": "softmax" if v2 else "sigmoid", "routed_bias": not v2,
            "norm_topk_prob": bool(hf.get("norm_topk_prob")) and not v2,
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
            "n_routing_groups": hf["n_group"] if groups else -1, "topk_routing_group": hf["topk_group"] if groups else -1}
    if groups:  # (without groups it has no effect)
        keys["routing_group_score"] = "max" if v2 else "top2_sum"
    return keys


def _deepseek_keys(hf: dict[str, Any]) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise ConfigError(f"this DeepSeek checkpoint sets moe_layer_freq={hf['moe_layer_freq']} (DeepSeek's code "
                          "then has experts in fewer layers, transformers' in every one); Tessera's deepseek has them "
                          "in every layer after the first dense ones, as the released models (1), so it is not "
                          "converted")
    if not hf.get("rope_interleave", True):  # the converter reorders interleaved rotary dimensions (hf_layouts)
        raise ConfigError("this DeepSeek checkpoint sets rope_interleave=false (rotary dimensions in two halves); "
                          "the converter reads DeepSeek-V3's interleaved layout (rope_interleave=true)")
    keys = {
        "decoder_block": "deepseek", "global_parameter_scale": 1, "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads, "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], "base_mlp_dim": hf["intermediate_size"],
        "base_moe_mlp_dim": hf["moe_intermediate_size"], "base_num_decoder_layers": hf["num_hidden_layers"],
        "vocab_size": hf["vocab_size"], "normalization_layer_epsilon": hf["rms_norm_eps"],
        "logits_via_embedding": bool(hf.get("tie_word_embeddings")),
        "mlp_activations": [_activation(hf.get("hidden_act") or "silu"), "linear"], "sliding_window_size": 0,
        "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"], "num_experts": hf["n_routed_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"], "shared_experts": hf.get("n_shared_experts") or 0,
        "first_num_dense_layers": hf.get("first_k_dense_replace", 0), "final_logits_soft_cap": 0.0,
        **_deepseek_routing(hf),
    }
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    keys["rope_max_timescale"] = rope_theta(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        mscale, all_dims = params.get("mscale") or 0, params.get("mscale_all_dim") or 0
        if mscale != all_dims or not mscale:
            raise ConfigError(f"this checkpoint's YaRN has mscale={mscale} and mscale_all_dim={all_dims}; Tessera's "
                              "deepseek supports DeepSeek-V3's equal, non-zero pair (rotary scale 1)")
        keys.update(rope_scaling="yarn", rope_scaling_factor=float(params["factor"]),
                    rope_original_max_position=int(params["original_max_position_embeddings"]),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    mscale=float(mscale), rope_truncate=bool(params.get("truncate", True)))
    elif kind == "default":
        keys["rope_scaling"] = "none"
    else:
        raise ConfigError(f"DeepSeek rope_type {kind!r} is not supported (default and yarn are)")
    return keys


def _gpt2_keys(hf: dict[str, Any]) -> dict[str, Any]:
    d, heads = hf["n_embd"], hf["n_head"]
    scaled, by_layer = hf.get("scale_attn_weights", True), hf.get("scale_attn_by_inverse_layer_idx", False)
    if not scaled or by_layer:
        raise ConfigError(f"this GPT-2 checkpoint sets scale_attn_weights={str(scaled).lower()} and "
                          f"scale_attn_by_inverse_layer_idx={str(by_layer).lower()}; Tessera's gpt3 scales the scores "
                          "by head_dim**-0.5 only (true and false, GPT-2's defaults)")
    return {
        "decoder_block": "gpt3", "global_parameter_scale": 1, "base_emb_dim": d, "base_num_query_heads": heads,
        "base_num_kv_heads": heads, "head_dim": d // heads, "base_mlp_dim": hf.get("n_inner") or 4 * d,
        "base_num_decoder_layers": hf["n_layer"], "vocab_size": hf["vocab_size"],
        "normalization_layer_epsilon": hf["layer_norm_epsilon"],
        "logits_via_embedding": bool(hf.get("tie_word_embeddings", True)),  # untied: an lm_head.weight of its own
        "mlp_activations": [_activation(hf.get("activation_function", "gelu_new"))],
        "trainable_position_size": hf["n_positions"], "sliding_window_size": 0, **NO_CAPS,  # GPT-2 has no window
    }


def _hidden_act(hf: dict[str, Any]) -> str:
    """The activation of the family's transformers MLP: Gemma 2 and 3 read hidden_activation only, the others
    hidden_act only (Gemma's legacy "gelu" meaning its tanh GELU). Google's files carry both keys; reading the
    one transformers ignores gave a GeGLU model a SiLU MLP, or the reverse."""
    kind = hf.get("model_type")
    if kind in ("gemma2", "gemma3_text"):
        return hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if kind == "gemma":
        act = hf.get("hidden_act") or "gelu_pytorch_tanh"
        return "gelu_pytorch_tanh" if act == "gelu" else act
    return hf.get("hidden_act") or "silu"


def _activation(name: str) -> str:
    if name in GELU_TANH:
        return "gelu"
    if name in ("silu", "swish", "relu"):
        return "relu" if name == "relu" else "silu"
    raise ConfigError(f"activation {name!r} of this checkpoint has no Tessera equivalent (we have silu, relu and the "
                      "tanh-approximated gelu)")


def as_overrides(keys: dict[str, Any]) -> list[str]:
    """`key=value` arguments (as on a command line) for config_from_hf's keys."""
    def text(v):
        return json.dumps(v) if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else str(v)

    return [f"{k}={text(v)}" for k, v in keys.items()]
