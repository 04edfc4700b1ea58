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
import jax.numpy as jnp
from flax import nnx

from tessera.config import ModelConfig
from tessera.mesh import shard_logically
from tessera.models.kv_cache import KVCache
from tessera.models.layers import LayerNorm, RMSNorm, dropout
from tessera.models.pipeline import PER_LAYER


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


class LayerPair(Block):
    """A local (sliding-window) layer followed by a global one, each a `layer_cls(cfg, kernel, rngs,
    window)` called as `layer(x, positions, segment_ids, keys, packed, kv_cache) -> (x, aux,
    kv_cache)` (Gemma 2, gpt-oss). `num_decoder_layers` must be even and a scanned stack scans over
    pairs; when decoding, the block's cache is (local layer's, a ring of sliding_window_size slots;
    global layer's)."""

    layers_per_block = 2
    layer_cls: type

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs):
        self.local_layer = self.layer_cls(cfg, attention_kernel, rngs, cfg.sliding_window_size)
        self.global_layer = self.layer_cls(cfg, attention_kernel, rngs, 0)

    @classmethod
    def empty_cache(cls, cfg: ModelConfig, batch: int, length: int, layers: tuple[int, ...] = ()):
        one = super().empty_cache
        return one(cfg, batch, length, layers, cfg.sliding_window_size), one(cfg, batch, length, layers, 0)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool, kv_cache=None):
        keys = dropout_keys(dropout_key, 4)
        caches, auxes = (None, None) if kv_cache is None else kv_cache, []
        for i, layer in enumerate((self.local_layer, self.global_layer)):
            x_btd, aux, cache = layer(x_btd, positions_bt, segment_ids_bt, keys[2 * i:2 * i + 2], packed, caches[i])
            caches, auxes = caches[:i] + (cache,) + caches[i + 1:], auxes + [aux]
        return x_btd, stacked_aux(auxes), None if kv_cache is None else caches


class LayerPattern(Block):
    """A repeating pattern of `layers_per_block` layers, all local (sliding-window) but the last
    (Gemma 3: 5 + 1, OLMo 3: 3 + 1), each `make_layer(cfg, kernel, rngs, local)` named layer_0,
    layer_1, ... and called as `layer(x, positions, segment_ids, keys, packed, kv_cache) -> (x,
    aux, kv_cache)`. A model whose layer count is not a multiple of the pattern ends in a shorter
    block of local layers (the decoder's `tail`, built with `num_layers`), as the first layers of
    the pattern: Gemma 3 4B's 34 layers are 5 blocks and a tail of 4. When decoding, the block's
    cache is a tuple with one cache per layer (the local layers' rings of sliding_window_size
    slots)."""

    def __init__(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, num_layers: int = 0):
        num_layers = num_layers or self.layers_per_block
        for j in range(num_layers):
            setattr(self, f"layer_{j}", self.make_layer(cfg, attention_kernel, rngs, self.is_local(j)))
        self.num_layers = num_layers

    def make_layer(self, cfg: ModelConfig, attention_kernel: str, rngs: nnx.Rngs, local: bool) -> nnx.Module:
        raise NotImplementedError

    @classmethod
    def is_local(cls, j: int) -> bool:
        """Whether layer j of a block (or of its tail) has local, sliding-window attention."""
        return j < cls.layers_per_block - 1

    @classmethod
    def empty_cache(cls, cfg: ModelConfig, batch: int, length: int, layers: tuple[int, ...] = (),
                    num_layers: int = 0):
        one = super().empty_cache
        return tuple(one(cfg, batch, length, layers, cfg.sliding_window_size if cls.is_local(j) else 0)
                     for j in range(num_layers or cls.layers_per_block))

    def __call__(self, x_btd, positions_bt, segment_ids_bt, dropout_key, packed: bool, kv_cache=None):
        keys = dropout_keys(dropout_key, 2 * self.num_layers)
        caches, auxes = [], []
        for j in range(self.num_layers):
            x_btd, aux, cache = getattr(self, f"layer_{j}")(x_btd, positions_bt, segment_ids_bt, keys[2 * j:2 * j + 2],
                                                            packed, None if kv_cache is None else kv_cache[j])
            caches.append(cache)
            auxes.append(aux)
        return x_btd, stacked_aux(auxes), None if kv_cache is None else tuple(caches)


def stacked_aux(auxes: list[dict]) -> dict:
    """One aux of a block's layers (those without, such as dense layers, give {}): "per_layer/"
    entries stacked, a row per layer that has them, so the decoder's per-layer statistics cover
    every layer; scalars averaged over those layers."""
    auxes = [a for a in auxes if a]
    return {k: jnp.stack([a[k] for a in auxes]) if k.startswith(PER_LAYER) else sum(a[k] for a in auxes) / len(auxes)
            for k in (auxes[0] if auxes else {})}


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
