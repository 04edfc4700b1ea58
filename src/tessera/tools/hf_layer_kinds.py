"""The config.json readers of the families whose layers come in kinds, for `hf_configs.config_from_hf`: the check
of a checkpoint's `layer_types` against the pattern Tessera builds, and the rotary settings of Gemma 3 and OLMo 3,
whose sliding-window (local) layers rotate otherwise than their global ones."""

from __future__ import annotations

from typing import Any

from tessera.config import ConfigError
from tessera.config.layers import LAYERS_PER_BLOCK, local_global_types
from tessera.tools.hf_rope import rope_theta


def check_layer_types(hf: dict[str, Any], expected: list[str], refusal: str) -> None:
    """ConfigError(`refusal`) when the checkpoint's `layer_types` (transformers builds its attention
    masks from them) are not the `expected` ones of the layers Tessera builds: the weights would be
    converted into another model."""
    if hf.get("layer_types") and list(hf["layer_types"]) != expected:
        raise ConfigError(refusal)


def _local_theta(hf: dict[str, Any], name: str, fallback: float) -> int:
    """The local layers' rotary theta from transformers 5's `rope_parameters` (else `fallback`); ConfigError when
    they are scaled, which the local layers of Tessera's gemma3 and olmo3 never are."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"{name} local layers with rope_type={local['rope_type']!r} are not supported (default is)")
    return rope_theta(local.get("rope_theta", fallback))


def gemma3_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's per-layer-type rotary settings, and a check of its 5 local : 1 global pattern."""
    layers = hf["num_hidden_layers"]
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("this Gemma 3 checkpoint sets use_bidirectional_attention=true (every token attends to the "
                          "whole sequence, an encoder such as EmbeddingGemma); Tessera's gemma3 is a causal decoder")
    pattern = hf.get("sliding_window_pattern") or 6  # transformers' layer_types when the file has none
    hf = {**hf, "layer_types": hf.get("layer_types") or local_global_types(pattern, layers)}
    check_layer_types(hf, local_global_types(LAYERS_PER_BLOCK["gemma3"], layers),
                      "this Gemma 3 checkpoint's layer_types (or sliding_window_pattern) are not the 5 local : 1 "
                      "global pattern Tessera's gemma3 builds")
    # the released checkpoints' config.json (transformers 4) has the global layers' rope_scaling beside rope_theta
    # and rope_local_base_freq, which transformers 5 reads as rope_parameters; it was read as no scaling
    glob = (hf.get("rope_parameters") or {}).get("full_attention") or hf.get("rope_scaling") or {}
    keys: dict[str, Any] = {"local_rope_max_timescale": _local_theta(hf, "Gemma 3",
                                                                     hf.get("rope_local_base_freq", 10000.0)),
                            "rope_max_timescale": rope_theta(glob.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
                            "rope_scaling": "none"}
    kind = glob.get("rope_type", glob.get("type", "default"))
    if kind == "linear":
        keys.update(rope_scaling="linear", rope_scaling_factor=float(glob["factor"]))
    elif kind != "default":
        raise ConfigError(f"Gemma 3 global layers with rope_type={kind!r} are not supported (default and linear are)")
    return keys


def olmo3_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's local layers' rotary theta (their rope_parameters are never scaled: a checkpoint's rope_scaling
    is the global layers'), and a check of its 3 local : 1 global pattern."""
    check_layer_types(hf, local_global_types(LAYERS_PER_BLOCK["olmo3"], hf["num_hidden_layers"]),
                      "this OLMo 3 checkpoint's layer_types are not the 3 local : 1 global pattern Tessera's olmo3 "
                      "builds")
    return {"local_rope_max_timescale": _local_theta(hf, "OLMo 3", hf["rope_theta"])}



def qwen3_next_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's Gated DeltaNet sizes, experts and shared expert, and a check of its 3 linear : 1 full attention
    pattern (transformers' default layer_types, from full_attention_interval 4)."""
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(layers)]
    check_layer_types({"layer_types": types}, ["full_attention" if (i + 1) % LAYERS_PER_BLOCK["qwen3_next"] == 0
                                               else "linear_attention" for i in range(layers)],
                      "this Qwen3-Next checkpoint's layer_types are not the 3 linear-attention : 1 full-attention "
                      "pattern Tessera's qwen3_next builds")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError("this Qwen3-Next checkpoint has dense MLP layers between expert layers (mlp_only_layers / "
                          "decoder_sparse_step); Tessera's qwen3_next has experts in every layer")
    if hf.get("attention_bias"):
        raise ConfigError("this Qwen3-Next checkpoint sets attention_bias=true; Tessera's qwen3_next builds its "
                          "attention without biases, as the released models")
    keys: dict[str, Any] = {
        "gdn_num_key_heads": hf["linear_num_key_heads"], "gdn_num_value_heads": hf["linear_num_value_heads"],
        "gdn_key_head_dim": hf["linear_key_head_dim"], "gdn_value_head_dim": hf["linear_value_head_dim"],
        "gdn_conv_kernel_dim": hf["linear_conv_kernel_dim"], "sliding_window_size": 0}
    if (hf.get("num_experts") or 0) < 2:
        raise ConfigError("this Qwen3-Next checkpoint has dense MLPs (num_experts < 2); Tessera's qwen3_next has "
                          "experts in every layer, as the released models")
    width, shared = hf["moe_intermediate_size"], hf.get("shared_expert_intermediate_size") or 0
    if shared % width:
        raise ConfigError(f"this Qwen3-Next checkpoint's shared expert is {shared} wide, not a multiple of its "
                          f"experts' width {width}; Tessera's shared experts are a whole number of experts wide")
    keys.update(num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"], base_mlp_dim=width,
                norm_topk_prob=bool(hf.get("norm_topk_prob")), shared_experts=shared // width)
    return keys
