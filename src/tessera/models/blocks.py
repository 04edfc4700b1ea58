"""What every decoder block family shares: the block interface and the norms it may use.

A block is built as `Family(cfg, attention_kernel, rngs)` and called as
`block(x_btd, positions_bt, segment_ids_bt, dropout_key, packed, kv_cache=None) -> (x_btd, aux,
kv_cache)`, where `aux` is a dict of scalars the decoder averages over layers (the
mixture-of-experts losses; empty for dense blocks) and `kv_cache` is the block's cache
(`empty_cache`) when decoding, passed to its attention and returned updated; None in training.
Class attributes tell the decoder what surrounds the blocks of a family; the registry of
families is `tessera.models.registry.BLOCKS`.
"""

from __future__ import annotations

import jax
from flax import nnx

from tessera.config import ModelConfig
from tessera.mesh import shard_logically
from tessera.models.kv_cache import KVCache
from tessera.models.layers import LayerNorm, RMSNorm, dropout


class Block(nnx.Module):
    """Base class of the decoder block families (defaults are Llama's)."""

    layers_per_block = 1  # decoder layers in one block (Gemma 2 pairs a local and a global layer)
    norm = "rms"  # kind of every norm of the family, the final one included: rms | rms_zero_centered | layer
    scale_embeddings = False  # multiply token embeddings by sqrt(emb_dim) (Gemma)
    absolute_positions = False  # add position embeddings to the tokens instead of rotating q and k (GPT-3)
    qk_norm = ""  # norm kind applied to each query and key head before the rotation ("": none; Qwen3, Gemma 3)

    @classmethod
    def prefix_blocks(cls, cfg: ModelConfig) -> tuple[int, type | None]:
        """(count, block class) of the blocks of another kind below this family's (deepseek's dense
        layers); the decoder stacks them separately. (0, None): none."""
        return 0, None

    @classmethod
    def empty_cache(cls, cfg: ModelConfig, batch: int, length: int, layers: tuple[int, ...] = (),
                    window: int | None = None):
        """The KV cache one block decodes with (a block with one attention layer: one `KVCache`);
        `layers=(L,)` stacks L of them for a scanned stack. `window`: the sliding window of the
        attention it serves (default the config's `sliding_window_size`, which every layer of a
        one-layer family uses), whose cache is a ring of that many slots."""
        return KVCache.empty(batch, length, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, layers,
                             cfg.kv_quant_dtype if cfg.quantize_kvcache else "", cfg.kv_quant_axis,
                             window=cfg.sliding_window_size if window is None else window)


def make_norm(kind: str, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """A norm of `kind` (see Block.norm) over emb_dim, with the config's epsilon and dtypes."""
    args = (cfg.emb_dim, cfg.normalization_layer_epsilon, cfg.dtype, cfg.weight_dtype, rngs)
    if kind == "layer":
        return LayerNorm(*args)
    return RMSNorm(*args, zero_centered=kind == "rms_zero_centered")


def dropout_keys(dropout_key, n: int) -> tuple:
    """`n` keys for the dropout sites of one block (all None when dropout is off)."""
    return (None,) * n if dropout_key is None else tuple(jax.random.split(dropout_key, n))


def residual(x_btd, h_btd, rate: float, key):
    """x + dropout(h), sharded as a residual-stream activation."""
    return shard_logically(x_btd + dropout(h_btd, rate, key), ("batch", "length", "act_embed"))
