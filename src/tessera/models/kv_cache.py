"""The key/value cache for decoding: one attention layer's keys and values so far.

Each attention layer decoding with a cache gets a `KVCache` of S slots: the keys and values it
has already computed, with the position and segment id of every slot. Decoding writes a prompt
into the cache in one call (prefill), then one token per call; each call's queries attend over
the whole cache, masked by position rather than by index:

    key position <= query position, query position - key position < window (when window > 0),
    the same chunk of positions (position // chunk, when chunk > 0: Llama 4's chunked layers),
    and the same segment id (0 marks empty slots and left padding; real tokens have 1).

This is the training mask (causal, window, same segment) of `dot_product_attention`, so cached
decoding computes the same logits as running the model on the whole sequence. Prompts of
different lengths share one batch by left padding: pad tokens have segment id 0, so real tokens
never see them; each row's real tokens have positions 0, 1, ...

A sliding-window layer (window W) never looks further back than its last W keys, so its cache
has min(W, length) slots, written round (a ring buffer): slot `index` is the next to write, and
a full ring overwrites its oldest key. Because the mask reads positions, not slot order, the
ring needs no reordering. One write of several tokens (a prompt) can overwrite keys its own
first tokens still need, so the attention reads those calls as the cache before the write plus
the new keys (`stored`), then writes; a write of more tokens than slots keeps the last ones.
Mistral 7B's 4096-token window then caches 4096 positions of a 32k sequence, and Gemma 3's
local layers (five of every six, window 1024) 1024 of a 128k one: 2.6 GiB instead of 17.0 for
Gemma 3 4B's bfloat16 cache of one 128k-token prompt.

The first call of a decoding run gets its cache as an `EmptyKVCache`: the same arrays, marked
(in the pytree's type, so the mark is known while tracing) as holding nothing yet. Its tokens
then attend only to each other (`Attention.attend_prompt`: splash attention on TPU, else the
reference over their own keys), not over every slot of the cache; their keys and values are
stored after (`add` returns a plain `KVCache`).

`quantize_kvcache=true` stores keys and values quantized (qwix): `kv_quant_dtype` int8 or int4,
with one absmax scale per slot and kv head (`kv_quant_axis=dkv`: reduced over the head
dimension) or per slot (`heads_and_dkv`: over heads and head dimension). Attention reads them
back dequantized (`keys`, `values`); the prompt's own keys are quantized too, so prefill and
each decoded token see the same stored values.

The cache is an argument, not state: `Decoder.__call__(..., kv_cache=...)` hands each block
its layer's cache, the block hands it to its attention, and the updated caches come back as
return values (stacked on a leading layers axis when the layers are scanned, and then part of
the layers' `jax.lax.scan` carry, each layer writing its part back in place). Training passes no
cache, so its program has no cache in it.

On a mesh the cache is split as the attention reading it is (`KVCache.shard_tree`): its rows over the
batch axes (data, fsdp, expert) when they divide the number of prompts, its kv heads over tensor
when that divides them. Decoding creates it split, and every write keeps it so.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tessera.mesh import shard_logically


KV_QUANT_TYPES = {"int8": jnp.int8, "int4": jnp.int4}
# kv_quant_axis -> the axes of [B, S, K, H] that keep their own scale (the others are reduced)
KV_QUANT_SCALE_AXES = {"dkv": (0, 1, 2), "heads_and_dkv": (0, 1)}


class KVCache(NamedTuple):
    """One attention layer's cache of S slots (arrays may carry a leading layers axis)."""

    k_bskh: jax.Array  # keys [B, S, K, H], rotary positions applied (int8/int4 when quantized)
    v_bskh: jax.Array  # values [B, S, K, H]
    positions_bs: jax.Array  # int32 [B, S]: position of each key
    segment_ids_bs: jax.Array  # int32 [B, S]: 0 for empty slots and padding (never seen by real tokens)
    index: jax.Array  # int32 []: the next slot to write, the same for every row
    k_scale: jax.Array  # float32 [B, S, K or 1, 1] when quantized, else an empty [0]
    v_scale: jax.Array

    @classmethod
    def empty(cls, batch: int, length: int, kv_heads: int, head_dim: int, dtype, layers: tuple[int, ...] = (),
              quant_dtype: str = "", quant_axis: str = "heads_and_dkv", value_dim: int = 0, window: int = 0):
        """A cache with no keys yet for up to `length` tokens; `layers=(L,)` stacks L of them for a
        scanned stack. `quant_dtype` (int8, int4) stores keys and values quantized, scaled over
        `quant_axis`. `value_dim`: values narrower or wider than keys (MLA caches its latent and
        rotary key). `window` > 0 (the layer's sliding window): min(window, length) slots, a ring."""
        length = min(length, window) if window else length
        store = KV_QUANT_TYPES[quant_dtype] if quant_dtype else dtype
        kv = lambda h=head_dim: jnp.zeros((*layers, batch, length, kv_heads, h), store)  # noqa: E731
        ids = lambda: jnp.zeros((*layers, batch, length), jnp.int32)  # noqa: E731
        scale_heads = kv_heads if quant_axis == "dkv" else 1
        scale = (lambda: jnp.ones((*layers, batch, length, scale_heads, 1), jnp.float32)) if quant_dtype \
            else (lambda: jnp.zeros((*layers, 0), jnp.float32))
        return cls(kv(), kv(value_dim or head_dim), ids(), ids(), jnp.zeros(layers, jnp.int32), scale(), scale())

    @property
    def quantized(self) -> bool:
        return jnp.issubdtype(self.k_bskh.dtype, jnp.integer)

    def stored(self, k_btkh, v_btkh, positions_bt, segment_ids_bt) -> KVCache:
        """A cache of exactly these T tokens, stored as this one stores them (quantized when it is):
        what a query reads back for them after `write`."""
        k_scale = v_scale = self.k_scale
        if self.quantized:
            import qwix

            axes = (0, 1, 2) if self.k_scale.shape[-2] == k_btkh.shape[2] else (0, 1)  # dkv, heads_and_dkv
            qk, qv = (qwix.quantize(a, self.k_bskh.dtype, channelwise_axes=axes, scale_dtype=jnp.float32)
                      for a in (k_btkh, v_btkh))
            k_btkh, v_btkh = qk.qvalue, qv.qvalue
            k_scale, v_scale = (q.scale.reshape(*q.scale.shape[:2], -1, 1) for q in (qk, qv))
        return KVCache(k_btkh.astype(self.k_bskh.dtype), v_btkh.astype(self.v_bskh.dtype),
                       positions_bt.astype(jnp.int32), segment_ids_bt.astype(jnp.int32), jnp.zeros((), jnp.int32),
                       k_scale, v_scale)

    def check_room(self, tokens: int) -> None:
        """ValueError when one call writes more `tokens` than this cache has slots, for a layer
        without a sliding window (whose queries see every earlier position): `add` keeps the last
        slots, so the layer forgot its oldest keys and attended as a sliding window, without a word."""
        slots = self.k_bskh.shape[-3]
        if tokens > slots:
            raise ValueError(f"{tokens} tokens written at once into a KV cache of {slots} slots, for an attention "
                             "layer without a sliding window that must keep every position; create the cache with "
                             f"init_cache(batch, max_len) for max_len >= the prompt plus the new tokens ({tokens} or more)")

    def write(self, k_btkh, v_btkh, positions_bt, segment_ids_bt) -> KVCache:
        """The cache with T new tokens stored from slot `index` on, round the end to slot 0 (the
        oldest). T >= slots keeps the last `slots` tokens. The caller sizes a cache without a
        window to hold every token it writes; a sliding-window cache forgets keys older than it
        (see the module docstring)."""
        return self.add(self.stored(k_btkh, v_btkh, positions_bt, segment_ids_bt))

    def add(self, new: KVCache) -> KVCache:
        """`write` of tokens already in stored form (`stored`)."""
        slots, t, i = self.k_bskh.shape[1], new.k_bskh.shape[1], self.index
        if t >= slots:  # the last `slots` tokens fill the cache in order; slot 0 holds the oldest
            put = lambda old, a: a[:, t - slots:]  # noqa: E731
            index = jnp.zeros((), jnp.int32)
        elif t == 1:  # one token per decoding step: index < slots, nothing wraps
            put = lambda old, a: jax.lax.dynamic_update_slice(old, a, (0, i) + (0,) * (a.ndim - 2))  # noqa: E731
            index = (i + 1) % slots
        else:
            at = (i + jnp.arange(t)) % slots
            put = lambda old, a: old.at[:, at].set(a, unique_indices=True)  # noqa: E731
            index = (i + t) % slots
        if self.quantized:
            k_scale, v_scale = put(self.k_scale, new.k_scale), put(self.v_scale, new.v_scale)
        else:
            k_scale, v_scale = self.k_scale, self.v_scale
        return KVCache.shard_tree(KVCache(put(self.k_bskh, new.k_bskh), put(self.v_bskh, new.v_bskh),
                                          put(self.positions_bs, new.positions_bs),
                                          put(self.segment_ids_bs, new.segment_ids_bs), index, k_scale, v_scale))

    def logical_axes(self) -> tuple[tuple[str | None, ...], ...]:
        """Each field's logical axis names, in field order: rows over the batch axes, kv heads over
        tensor (as the attention that reads them), a leading layers axis whole. Works on shapes too."""
        lead = (None,) * self.index.ndim
        kv = (*lead, "batch", None, "act_kv_heads", None)
        ids = (*lead, "batch", None)
        scale = kv if self.quantized else (*lead, None)  # [.., B, S, K or 1, 1], or an empty [0]
        return kv, kv, ids, ids, lead, scale, scale

    @staticmethod
    def is_cache(x) -> bool:
        """Whether `x` is one layer's cache (a `KVCache` or a `DeltaNetCache`), a leaf of a tree of caches."""
        return isinstance(x, (KVCache, DeltaNetCache))

    @staticmethod
    def caches_in(tree) -> list:
        """The caches of a tree of caches (`KVCache`s and `DeltaNetCache`s), in `jax.tree.leaves` order."""
        return jax.tree.leaves(tree, is_leaf=KVCache.is_cache)

    @staticmethod
    def tree_logical_axes(caches) -> list[tuple[str | None, ...]]:
        """The logical axis names of every array of a tree of caches, in `jax.tree.leaves` order."""
        return [names for cache in KVCache.caches_in(caches) for names in cache.logical_axes()]

    @staticmethod
    def shard_tree(caches):
        """A tree of caches constrained to their logical sharding on the current mesh (unchanged
        without one): each device keeps its rows and kv heads, not a copy of the whole cache."""
        leaves, treedef = jax.tree.flatten(caches)
        return treedef.unflatten([shard_logically(x, names)
                                  for x, names in zip(leaves, KVCache.tree_logical_axes(caches))])

    def keys(self, dtype) -> jax.Array:
        """The cached keys [B, S, K, H] in `dtype` (dequantized when stored quantized)."""
        return self._read(self.k_bskh, self.k_scale, dtype)

    def values(self, dtype) -> jax.Array:
        return self._read(self.v_bskh, self.v_scale, dtype)

    def _read(self, stored, scale, dtype):
        if not self.quantized:
            return stored.astype(dtype)
        return (stored.astype(jnp.float32) * scale).astype(dtype)

    @staticmethod
    def as_empty(caches, empty: bool = True):
        """A tree of caches, each marked as holding nothing yet (`EmptyKVCache`): for the first call;
        with empty=False, without the mark (plain `KVCache`s)."""
        kind = EmptyKVCache if empty else KVCache
        return jax.tree.map(lambda c: kind(*c) if isinstance(c, KVCache) else c, caches, is_leaf=KVCache.is_cache)

    @staticmethod
    def is_empty(caches) -> bool:
        """Whether a tree of caches carries the empty mark (`as_empty`)."""
        return any(isinstance(c, EmptyKVCache) for c in KVCache.caches_in(caches))

    def mask(self, positions_bt, segment_ids_bt, window: int, chunk: int = 0) -> jax.Array:
        """[B, T, S]: which cached keys each query sees (see the module docstring); `chunk` > 0:
        only the keys of the query's own chunk of positions (position // chunk)."""
        distance_bts = positions_bt[:, :, None] - self.positions_bs[:, None, :]
        visible = distance_bts >= 0
        if window:
            visible &= distance_bts < window
        if chunk:
            visible &= (positions_bt[:, :, None] // chunk) == (self.positions_bs[:, None, :] // chunk)
        return visible & (segment_ids_bt[:, :, None] == self.segment_ids_bs[:, None, :])


class DeltaNetCache(NamedTuple):
    """One Gated DeltaNet layer's decoding state (qwen3_next's linear layers; `tessera.models.gated_deltanet`):
    instead of keys and values, the memory of each value head and the last inputs of its causal convolution, so a
    decoded token costs the same at any length. The memory belongs to segment `segment_b` (0: none yet), the
    convolution inputs to `conv_segments_bw`; a token of another segment reads neither (a prompt's left padding
    has segment 0, its tokens 1). Arrays may carry a leading layers axis."""

    state_bhkv: jax.Array  # float32 [B, Hv, dk, dv]: the memory
    conv_q_bwkh: jax.Array  # [B, W - 1, Kh, dk]: the last query projections, before the convolution
    conv_k_bwkh: jax.Array  # [B, W - 1, Kh, dk]
    conv_v_bwvh: jax.Array  # [B, W - 1, Hv, dv]
    conv_segments_bw: jax.Array  # int32 [B, W - 1]: their segments (0: empty)
    segment_b: jax.Array  # int32 [B]: the memory's segment

    @classmethod
    def empty(cls, cfg, batch: int, layers: tuple[int, ...] = ()) -> DeltaNetCache:
        kh, vh, dk, dv, w = (cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim,
                             cfg.gdn_value_head_dim, cfg.gdn_conv_kernel_dim - 1)
        lead = (*layers, batch)
        return cls(jnp.zeros((*lead, vh, dk, dv), jnp.float32), jnp.zeros((*lead, w, kh, dk), cfg.dtype),
                   jnp.zeros((*lead, w, kh, dk), cfg.dtype), jnp.zeros((*lead, w, vh, dv), cfg.dtype),
                   jnp.zeros((*lead, w), jnp.int32), jnp.zeros(lead, jnp.int32))

    def logical_axes(self) -> tuple[tuple[str | None, ...], ...]:
        """Rows over the batch axes and heads over tensor, as the layer computes them; a layers axis whole."""
        lead = (None,) * (self.segment_b.ndim - 1)
        conv = (*lead, "batch", None, "act_heads", None)
        return ((*lead, "batch", "act_heads", None, None), conv, conv, conv, (*lead, "batch", None), (*lead, "batch"))


class EmptyKVCache(KVCache):
    """A `KVCache` nothing has been written to yet (see the module docstring); only its type differs."""
