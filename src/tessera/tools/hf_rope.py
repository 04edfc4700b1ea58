"""The rotary embedding settings of a Hugging Face config.json (rope_theta, rope_scaling or rope_parameters:
default, linear, llama3 and YaRN) as Tessera's keys, for `hf_configs.config_from_hf`."""

from __future__ import annotations

import math
from typing import Any

from tessera.config import ConfigError


def rope_theta(value: float) -> int:
    """A rotary theta as Tessera's rope_max_timescale holds it, a whole number; ConfigError for another one (it was
    truncated: a theta of 10000.5 converted into a model rotating with 10000)."""
    if float(value) != int(value):
        raise ConfigError(f"this checkpoint's rope_theta={value} is not a whole number; Tessera's rope_max_timescale "
                          "(and local_rope_max_timescale) holds whole numbers only, so it is not converted")
    return int(value)


def rope_keys(hf: dict[str, Any]) -> dict[str, Any]:
    params = hf.get("rope_parameters") or {}
    if hf.get("model_type") == "gemma3_text":  # per layer type: see hf_layer_kinds.gemma3_keys
        return {}
    if "full_attention" in params:  # per-layer-type parameters; all layer types share them in these families
        params = params["full_attention"]
    scaling = hf.get("rope_scaling") or params
    # transformers' Qwen3NextConfig rotates a quarter of each head unless told otherwise
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor",
                                                        0.25 if hf.get("model_type") == "qwen3_next" else 1.0))
    partial = 1.0 if partial is None else float(partial)
    if partial != 1.0 and hf.get("model_type") != "qwen3_next":
        raise ConfigError(f"this checkpoint rotates part of each head (partial_rotary_factor={partial:g}); Tessera's "
                          f"{hf.get('model_type')} rotates the whole head, so its logits would differ: not converted")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    keys: dict[str, Any] = {"rope_max_timescale": rope_theta(theta), "rope_scaling": "none"}
    if hf.get("model_type") == "qwen3_next":
        keys["partial_rotary_factor"] = partial
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "llama3":
        keys.update(rope_scaling="llama3", rope_scaling_factor=float(scaling["factor"]),
                    rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_position=int(scaling["original_max_position_embeddings"]))
    elif rope_type == "linear":
        keys.update(rope_scaling="linear", rope_scaling_factor=float(scaling["factor"]))
    elif rope_type == "yarn":
        keys.update(yarn_keys(hf, scaling))
    elif rope_type != "default":
        raise ConfigError(f"rope scaling type {rope_type!r} of this checkpoint is not supported (default, linear, "
                          "llama3 and yarn are)")
    return keys


def yarn_keys(hf: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """YaRN for the families built on `Attention`, which multiplies the scores by
    (0.1 * mscale * ln(factor) + 1)^2: transformers scales the rotary sines and cosines by
    attention_factor (given, or from factor, mscale and mscale_all_dim), the square root of that."""
    factor = float(params.get("factor") or hf["max_position_embeddings"] / params["original_max_position_embeddings"])

    def gain(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, all_dims = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = gain(mscale) / gain(all_dims) if mscale and all_dims else gain(1.0)
    mscale = (attention_factor - 1.0) / (0.1 * math.log(factor)) if factor > 1 else 1.0
    if mscale < 0:
        raise ConfigError(f"this checkpoint's YaRN attention_factor={attention_factor:g} shrinks the scores; "
                          "Tessera's mscale cannot express that")
    return {"rope_scaling": "yarn", "rope_scaling_factor": factor,
            "rope_original_max_position": int(params["original_max_position_embeddings"]),
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "mscale": round(mscale, 12), "rope_truncate": bool(params.get("truncate", True))}
