"""Which decoder layer is what, from the model section alone: how many layers one block of a
family holds, which layers have a sliding window or an attention chunk, which have no rotary
positions, experts or a dense MLP. The models build their layers from the same rules; the planner,
the FLOPs count and the Hugging Face conversion read them here without importing the models.
"""

from __future__ import annotations

import collections
import functools
import types


# decoder layers in one block of the families whose block is not one layer (a test keeps this
# equal to the block classes' `layers_per_block`; the config side never imports the models)
LAYERS_PER_BLOCK = {"gemma2": 2, "gemma3": 6, "gpt_oss": 2, "llama4": 4, "olmo3": 4, "qwen3_next": 4}
# families whose pattern is local layers then one global layer, and whose layers after the last whole
# pattern form a shorter block of local layers (the decoder's tail)
TAIL_BLOCKS = ("gemma3", "olmo3", "qwen3_next")


def local_global_types(pattern: int, layers: int) -> list[str]:
    """transformers' `layer_types` of `layers` layers with one full-attention layer in every `pattern`, the last
    of each, and the others sliding-window: those of gemma3 (6) and olmo3 (4), whose tail layers are sliding."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]


def tail_layers(m) -> int:
    """The local layers after the last whole pattern of a TAIL_BLOCKS family (0 for the others)."""
    return m.num_decoder_layers % LAYERS_PER_BLOCK[m.decoder_block] if m.decoder_block in TAIL_BLOCKS else 0


def linear_attention_layers(m) -> int:
    """Decoder layers whose mixer is linear attention (qwen3_next's Gated DeltaNets: all but every 4th layer), not
    softmax attention over the sequence (0 for the other families)."""
    if m.decoder_block != "qwen3_next":
        return 0
    return m.num_decoder_layers - m.num_decoder_layers // LAYERS_PER_BLOCK["qwen3_next"]


def llama4_nope(m, layer: int) -> bool:
    """Whether llama4's decoder layer `layer` has no rotary positions (every nope_layer_interval-th)."""
    return bool(m.nope_layer_interval) and (layer + 1) % m.nope_layer_interval == 0


def llama4_moe(m, layer: int) -> bool:
    """Whether llama4's decoder layer `layer` has experts (every interleave_moe_layer_step-th)."""
    return (layer + 1) % m.interleave_moe_layer_step == 0


def dense_layers(m) -> int:
    """Decoder layers with a dense MLP of base_mlp_dim in a mixture-of-experts model: deepseek's
    first_num_dense_layers, llama4's layers between its expert layers (0 for the other families)."""
    if m.decoder_block == "deepseek":
        return m.first_num_dense_layers
    if m.decoder_block == "llama4":
        return sum(not llama4_moe(m, i) for i in range(m.num_decoder_layers))
    return 0


def mlp_dim_unused(m) -> bool:
    """Whether no layer is built with base_mlp_dim: a mixture of experts whose experts are base_moe_mlp_dim wide
    and which has no dense layers (every family but deepseek's first_num_dense_layers and llama4's interleaved
    dense layers)."""
    return m.num_experts > 1 and m.base_moe_mlp_dim > 0 and not dense_layers(m)


def mlp_widths(m) -> str:
    """The MLP widths a model is built with, for a report's header: `mlp F`, or with base_moe_mlp_dim the
    dense layers' and the experts'."""
    if m.num_experts <= 1 or not m.base_moe_mlp_dim:
        return f"mlp {m.mlp_dim}"
    if mlp_dim_unused(m):
        return f"expert mlp {m.expert_mlp_dim}"
    return f"mlp {m.mlp_dim} ({dense_layers(m)} dense layers), expert mlp {m.expert_mlp_dim}"


def layer_windows(m) -> list[int]:
    """The sliding window of each decoder layer's attention, bottom to top (0: the whole causal
    past): gemma2 and gpt_oss alternate local and global layers, the local first; gemma3 has one
    global layer in each 6 and olmo3 one in each 4, the last (their tail layers are local);
    deepseek's latent attention has no window; the other families apply sliding_window_size to
    every layer."""
    w, layers = m.sliding_window_size, m.num_decoder_layers
    if m.decoder_block in ("gemma2", "gpt_oss"):
        return [w if i % 2 == 0 else 0 for i in range(layers)]
    if m.decoder_block in TAIL_BLOCKS:
        pattern = LAYERS_PER_BLOCK[m.decoder_block]
        return [0 if i % pattern == pattern - 1 else w for i in range(layers)]

    return [0 if m.decoder_block == "deepseek" else w] * layers


def layer_chunks(m) -> list[int]:
    """The attention chunk of each decoder layer, bottom to top (0: none): llama4's rotary layers
    attend within chunks of chunk_attn_window_size tokens."""
    chunk = m.chunk_attn_window_size if m.decoder_block == "llama4" else 0
    return [0 if llama4_nope(m, i) else chunk for i in range(m.num_decoder_layers)]


def layer_attention(m) -> tuple[tuple[int, int, int], ...]:
    """(window, chunk, layers): how many decoder layers attend (qwen3_next: its full-attention layers) with each
    window and chunk of
    `layer_windows` and `layer_chunks` (remembered per family and sizes: the planner's FLOPs count
    asks for every candidate)."""
    return _layer_attention(m.decoder_block, m.num_decoder_layers, m.sliding_window_size,
                            m.chunk_attn_window_size, m.nope_layer_interval)


@functools.cache
def _layer_attention(decoder_block: str, num_decoder_layers: int, sliding_window_size: int,
                     chunk_attn_window_size: int, nope_layer_interval: int) -> tuple[tuple[int, int, int], ...]:
    m = types.SimpleNamespace(decoder_block=decoder_block, num_decoder_layers=num_decoder_layers,
                              sliding_window_size=sliding_window_size, chunk_attn_window_size=chunk_attn_window_size,
                              nope_layer_interval=nope_layer_interval)
    attending = zip(layer_windows(m), layer_chunks(m))
    if decoder_block == "qwen3_next":  # its Gated DeltaNet layers attend to nothing
        attending = [pair for i, pair in enumerate(attending) if (i + 1) % LAYERS_PER_BLOCK["qwen3_next"] == 0]
    counts = collections.Counter(attending)
    return tuple((window, chunk, layers) for (window, chunk), layers in counts.items())
