"""The key/value cache for decoding, and the switch that makes attention use it.

Each attention module gets a `KVCache` of S slots: the keys and values it has already
computed, with the position and segment id of every slot. Decoding writes a prompt into the
cache in one call (prefill), then one token per call; each call's queries attend over the
whole cache, masked by position rather than by index:

    key position <= query position, query position - key position < window (when window > 0),
    and the same segment id (0 marks empty slots and left padding; real tokens have 1).

For tokens stored in order this is the training mask (causal, window, same segment) of
`dot_product_attention`, so cached decoding computes the same logits as running the model on
the whole sequence. Prompts of different lengths share one batch by left padding: pad tokens
have segment id 0, so real tokens never see them; each row's real tokens have positions 0, 1, ...

The cache is a pytree of arrays passed into and returned from each call (no mutable module
state), so it composes with `jit` and with the scanned layer stack (caches stacked on a leading
layers axis, scanned with the parameters). Blocks need no cached variant: inside
`cached_attention(modules, caches)` every listed `Attention` adds its new keys and values to
its cache and attends over all of it (`Attention.attend_cached`); the updated caches are
collected by module path.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from tessera.mesh import shard_logically


class KVCache(NamedTuple):
    """One attention module's cache of S slots (arrays may carry a leading layers axis)."""

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


class _Active(threading.local):
    calls: dict | None = None  # id(attention module) -> (path, cache in, dict of caches out)


_ACTIVE = _Active()


@contextlib.contextmanager
def cached_attention(modules: dict[str, object], caches: dict[str, KVCache]):
    """While active, each module of `modules` ({path: Attention}) attends over `caches[path]`;
    yields a dict that, once the block has run, holds each module's updated cache by path."""
    if set(modules) != set(caches):
        raise ValueError(f"cache entries {sorted(caches)} do not match the attention modules {sorted(modules)}")
    if _ACTIVE.calls is not None:
        raise RuntimeError("cached_attention is already active (nested decoding calls are not supported)")
    updated: dict[str, KVCache] = {}
    _ACTIVE.calls = {id(m): (path, caches[path], updated) for path, m in modules.items()}
    try:
        yield updated
    finally:
        _ACTIVE.calls = None
    missing = sorted(set(modules) - set(updated))
    if missing:
        raise RuntimeError(f"attention modules {missing} were not called while decoding with a cache")


def active_cache(module) -> tuple[KVCache, Callable[[KVCache], None]] | None:
    """(its cache, a function to record the updated cache) when `module` should attend over a
    cache, else None."""
    calls = _ACTIVE.calls
    if calls is None or id(module) not in calls:
        return None
    path, cache, updated = calls[id(module)]
    return cache, functools.partial(updated.__setitem__, path)
