"""The key/value cache for decoding: one attention layer's keys and values so far.

Each attention layer decoding with a cache gets a `KVCache` of S slots: the keys and values it
has already computed, with the position and segment id of every slot. Decoding writes a prompt
into the cache in one call (prefill), then one token per call; each call's queries attend over
the whole cache, masked by position rather than by index:

    key position <= query position, query position - key position < window (when window > 0),
    and the same segment id (0 marks empty slots and left padding; real tokens have 1).

For tokens stored in order this is the training mask (causal, window, same segment) of
`dot_product_attention`, so cached decoding computes the same logits as running the model on
the whole sequence. Prompts of different lengths share one batch by left padding: pad tokens
have segment id 0, so real tokens never see them; each row's real tokens have positions 0, 1, ...

The cache is an argument, not state: `Decoder.__call__(..., kv_cache=...)` hands each block
its layer's cache, the block hands it to its attention, and the updated caches come back as
return values (stacked on a leading layers axis when the layers are scanned, carried through
`jax.lax.scan` like the parameters). Training passes no cache, so its program has no cache in it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tessera.mesh import shard_logically


class KVCache(NamedTuple):
    """One attention layer's cache of S slots (arrays may carry a leading layers axis)."""

    k_bskh: jax.Array  # keys [B, S, K, H], rotary positions applied
    v_bskh: jax.Array  # values [B, S, K, H]
    positions_bs: jax.Array  # int32 [B, S]: position of each key
    segment_ids_bs: jax.Array  # int32 [B, S]: 0 for empty slots and padding (never seen by real tokens)
    index: jax.Array  # int32 []: the next slot to write, the same for every row

    @classmethod
    def empty(cls, batch: int, length: int, kv_heads: int, head_dim: int, dtype, layers: tuple[int, ...] = ()):
        """A cache with no keys yet; `layers=(L,)` stacks L of them for a scanned stack."""
        kv = lambda: jnp.zeros((*layers, batch, length, kv_heads, head_dim), dtype)  # noqa: E731
        ids = lambda: jnp.zeros((*layers, batch, length), jnp.int32)  # noqa: E731
        return cls(kv(), kv(), ids(), ids(), jnp.zeros(layers, jnp.int32))

    def write(self, k_btkh, v_btkh, positions_bt, segment_ids_bt) -> KVCache:
        """The cache with T new keys stored at slots index .. index+T-1 (the caller sizes the
        cache: past the end, `dynamic_update_slice` would move the write back and overwrite)."""
        i = self.index
        k = jax.lax.dynamic_update_slice(self.k_bskh, k_btkh.astype(self.k_bskh.dtype), (0, i, 0, 0))
        v = jax.lax.dynamic_update_slice(self.v_bskh, v_btkh.astype(self.v_bskh.dtype), (0, i, 0, 0))
        names = ("batch", None, "act_kv_heads", None)
        positions = jax.lax.dynamic_update_slice(self.positions_bs, positions_bt.astype(jnp.int32), (0, i))
        segments = jax.lax.dynamic_update_slice(self.segment_ids_bs, segment_ids_bt.astype(jnp.int32), (0, i))
        return KVCache(shard_logically(k, names), shard_logically(v, names), positions, segments,
                       i + k_btkh.shape[1])

    def mask(self, positions_bt, segment_ids_bt, window: int) -> jax.Array:
        """[B, T, S]: which cached keys each query sees (see the module docstring)."""
        distance_bts = positions_bt[:, :, None] - self.positions_bs[:, None, :]
        visible = distance_bts >= 0
        if window:
            visible &= distance_bts < window
        return visible & (segment_ids_bt[:, :, None] == self.segment_ids_bs[:, None, :])
