"""MaxText keys whose meaning depends on the model they come with: `maxtext.translate` keeps them, and
the loader holds each against the built model config (`check_in_context`). A value that asks for
what Tessera's block does is accepted; any other is refused with what the block does.

MaxText's model files set them: gemma2's post norms, the tied Qwen3's and gpt3's
normalize_embedding_logits=false, llama4's layer cycle of 4, the YaRN factor. This module imports
nothing from JAX.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from tessera.config.fields import OLMO_BLOCKS


# Tessera's Gemma blocks scale the token embeddings by sqrt(emb_dim) on the way in, where MaxText's store the table
# times sqrt(emb_dim) and divide the tied logits by it (normalize_embedding_logits=true, its default): the same model.
GEMMA_BLOCKS = ("gemma", "gemma2", "gemma3")
POST_NORM_BLOCKS = ("gemma2", "gemma3")  # a norm after attention and after the MLP, always
LAYER_CYCLES = {"llama4": 4, "gpt_oss": 2, "olmo3": 4, "qwen3_next": 4}  # layers after which a block's pattern of layer kinds repeats


def _embedding_logits(on: bool, m) -> str:
    if not m.logits_via_embedding or on == (m.decoder_block in GEMMA_BLOCKS):
        return ""  # MaxText reads it with tied logits only
    if on:
        return (f"normalize_embedding_logits=true divides the tied logits (logits_via_embedding=true) by sqrt(emb_dim) "
                f"in MaxText; Tessera's decoder_block={m.decoder_block} does not, as its Hugging Face reference: set "
                "normalize_embedding_logits=false (as MaxText's gpt3 and tied Qwen3 files do) or leave it out")
    return (f"normalize_embedding_logits=false: MaxText's Gemma stores its token table times sqrt(emb_dim), and "
            f"false leaves the tied logits that much larger; Tessera's decoder_block={m.decoder_block} scales the "
            "embeddings by sqrt(emb_dim) on the way in instead, the same model as MaxText's true: set "
            "normalize_embedding_logits=true or leave it out")


def _post_norm(name: str, where: str) -> Callable[[bool, Any], str]:
    def check(on: bool, m) -> str:
        # MaxText's olmo3 always has its post norms whatever these say (its olmo3 file leaves them at false), as here
        # (and olmo2, which MaxText does not have: the same layer)
        if on == (m.decoder_block in POST_NORM_BLOCKS) or m.decoder_block in OLMO_BLOCKS:
            return ""
        if on:
            return (f"{name}=true adds a norm after {where} in MaxText's gemma2 and gemma3 blocks; "
                    f"decoder_block={m.decoder_block} has none: use decoder_block=gemma2 or gemma3, or {name}=false")
        return (f"{name}=false: Tessera's decoder_block={m.decoder_block} always has a norm after {where} (as Gemma "
                f"2 and 3); set {name}=true (MaxText's gemma2 and gemma3 files do) or leave it out")
    return check


def _layer_cycle(value: int, m) -> str:
    cycle = LAYER_CYCLES.get(m.decoder_block, 1)
    if value in (1, cycle):
        return ""
    pattern = f"repeats its kinds of layer every {cycle} layers" if cycle > 1 else "has one kind of layer"
    return (f"inhomogeneous_layer_cycle_interval={value}: MaxText scans the layers in groups of this many, for "
            f"families whose kinds of layer repeat; Tessera's decoder_block={m.decoder_block} {pattern} and scans "
            f"them itself: give {cycle} or leave it out")


def _in_effect(value, final) -> bool:
    try:
        return float(str(value).replace("_", "")) == float(final)
    except ValueError:
        return False


def _yarn_only(alias: str, target: str, readers: tuple[str, ...]) -> Callable[[Any, Any], str]:
    """MaxText reads rope_factor and original_max_position_embeddings with rope_type=yarn only (its llama3.1 scaling
    has its own 8 and 8192); the keys here they stand for (`target`, maxtext.ALIASES) are read by the rope_scaling
    values in `readers` too."""

    def check(value, m) -> str:
        if m.rope_scaling not in readers or not _in_effect(value, getattr(m, target)):
            return ""  # not read, or a later layer (the command line) gave the key itself
        return (f"{alias}={value} is MaxText's YaRN setting (read with rope_type=yarn only; its llama3.1 scaling "
                f"keeps its own factor 8 and context 8192), but here it sets {target}, which rope_scaling="
                f"{m.rope_scaling} reads: give {target}={value} to mean that, or leave {alias} out")
    return check


def _attention_type(value, m) -> str:
    """MaxText's deepseek files set mla (latent attention), its others leave global; local_sliding and chunk are
    sliding_window_size and chunk_attn_window_size here."""
    kind = str(value).strip().lower()
    if kind == ("mla" if m.decoder_block == "deepseek" else "global"):
        return ""
    if kind in ("mla", "global"):
        does = ("always attends with latent attention (MaxText's mla)" if m.decoder_block == "deepseek" else
                "has no latent attention (decoder_block=deepseek has)")
        return f"attention_type={value}: Tessera's decoder_block={m.decoder_block} {does}; leave attention_type out"
    return (f"attention_type={value!r} is MaxText's; in Tessera decoder_block decides the kind of attention, with "
            "sliding_window_size (MaxText's local_sliding) and chunk_attn_window_size (chunk, llama4): give those "
            "and leave attention_type out")


def _yarn_score_scale(on: bool, m) -> str:
    """MaxText's rope_attention_scaling scales the rotary output by YaRN's mscale (the scores by its square), as
    Tessera's YaRN always does; its deepseek (MLA) scales the scores itself, with false (its deepseek files)."""
    if m.rope_scaling != "yarn" or on == (m.decoder_block != "deepseek"):
        return ""
    if on:
        return ("rope_attention_scaling=true would scale YaRN's attention scores a second time in MaxText's deepseek "
                "(its latent attention scales them itself, as Tessera's does once); set it to false or leave it out")
    return (f"rope_attention_scaling=false leaves the attention scores of MaxText's YaRN unscaled; Tessera's "
            f"decoder_block={m.decoder_block} with rope_scaling=yarn always multiplies them by (0.1 mscale "
            "ln(rope_scaling_factor) + 1)^2 (MaxText's true, as its gpt-oss files set); set it to true or leave it out")


def _yarn_length(value: int, m) -> str:
    """MaxText's YaRN reads max_position_embeddings for its position table, and its deepseek scales the scores only
    when it exceeds original_max_position_embeddings; Tessera's has no table and always scales."""
    if m.rope_scaling != "yarn" or m.decoder_block != "deepseek" or value > m.rope_original_max_position:
        return ""
    return (f"max_position_embeddings={value} is not above rope_original_max_position={m.rope_original_max_position} "
            f"(MaxText's original_max_position_embeddings), so MaxText's deepseek would leave YaRN's attention scores "
            "unscaled; Tessera's always scales them: give a longer max_position_embeddings or leave it out")


# key -> (type of its value, check); None: an alias's value, which its key's type reads
IN_CONTEXT = {
    "normalize_embedding_logits": (bool, _embedding_logits),
    "use_post_attn_norm": (bool, _post_norm("use_post_attn_norm", "attention")),
    "use_post_ffw_norm": (bool, _post_norm("use_post_ffw_norm", "the MLP")),
    "inhomogeneous_layer_cycle_interval": (int, _layer_cycle),
    "attention_type": (None, _attention_type),
    "rope_attention_scaling": (bool, _yarn_score_scale),
    "max_position_embeddings": (int, _yarn_length),
    "rope_factor": (None, _yarn_only("rope_factor", "rope_scaling_factor", ("llama3", "linear"))),
    "original_max_position_embeddings": (None, _yarn_only("original_max_position_embeddings",
                                                          "rope_original_max_position", ("llama3",))),
}


def check_in_context(values: Mapping[str, Any], m) -> list[str]:
    """One error line per IN_CONTEXT key in `values` (their last layer's values) that asks for something model
    config `m` does not do, or whose value is not of its type."""
    lines = []
    for name, raw in values.items():
        kind, check = IN_CONTEXT[name]
        text = "" if raw is None else str(raw).strip().lower()
        if kind is None:
            lines.append(check(raw, m))
        elif kind is bool and text in ("true", "1", "false", "0"):
            lines.append(check(text in ("true", "1"), m))
        elif kind is int and re.fullmatch(r"[+-]?\d+", text):
            lines.append(check(int(text), m))
        else:
            lines.append(f"{name}={raw!r} is not a valid {kind.__name__}; use " +
                         ("true or false" if kind is bool else "a whole number"))
    return [line for line in lines if line]


def accumulation_note(per_device_batch_size: float, accumulation_steps: int, batch: int) -> str:
    """The start-up line for gradient_accumulation_steps > 1, the shared key whose meaning differs most: Tessera's
    splits the global `batch` (per_device_batch_size x devices) into micro-batches, MaxText's multiplies it."""
    if accumulation_steps <= 1:
        return ""
    steps, devices = accumulation_steps, round(batch / per_device_batch_size)
    return (f"gradient_accumulation_steps={steps} splits the global batch of {batch} sequences (per_device_batch_size="
            f"{per_device_batch_size:g} x {devices} devices) into {steps} micro-batches of {batch // steps}; MaxText's "
            f"multiplies it ({batch * steps} sequences in micro-batches of {batch}): per_device_batch_size="
            f"{per_device_batch_size * steps:g} trains MaxText's batch here")
