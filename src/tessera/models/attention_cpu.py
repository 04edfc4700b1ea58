"""Causal self-attention for XLA:CPU with a backward pass of its own (the reference, `attention=dot_product`).

Same mathematics as `attention.dot_product_attention` (queries in chunks of `attention.QUERY_CHUNK`, each against
the keys up to its end, a float32 softmax), in a form XLA:CPU runs faster, measured on `benchmarks/cpu_llama.py`'s
layer (benchmarks/README.md has the figures):
- the heads stay in front of the sequence axes from the projections to the output, and a group of query heads
  sharing a kv head is one matrix of rows, [group x chunk, keys], so every product is a batched matmul over
  (row, kv head) in the layouts YNNPACK takes as they are;
- the scale is applied to the queries ([T, H] per head), not to each score block: a scalar broadcast over a block
  that feeds YNNPACK's fusion is written to memory first;
- the causal mask is a constant added to the scores, not a select whose gradient is another select;
- the backward pass is written out (`jax.custom_vjp`): it takes each chunk's probabilities from the forward pass
  (recomputed there under a remat policy), forms the key and value gradients transposed, [H, keys] per head, so
  their products need no transposed copy of a score block, adds the chunks' parts in that layout and transposes
  the sums once, where autodiff's form summed padded copies of every chunk's part transposed element by element.

Gradients equal autodiff's through the reference to float32 rounding (tests/test_attention_cpu.py: 1e-6
relative). Used where it applies (`applies`): float32 queries, keys and values, self-attention without a soft
cap, sliding window, attention chunks or sinks. Elsewhere, and off the CPU, the reference runs as it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NEG = float(np.finfo(np.float32).min)  # the masked score, as the reference's select writes it


def applies(q_btnh, k_bskh, v_bskh, *, logits_soft_cap: float, window: int, chunk: int, sinks_n) -> bool:
    """Whether `causal_attention` serves this call: float32 self-attention with nothing but the causal and
    segment masks (the reference keeps the rest: soft caps, windows, chunked attention, sinks, bfloat16's
    roundings of the probabilities and outputs)."""
    f32 = all(a.dtype == jnp.float32 for a in (q_btnh, k_bskh, v_bskh))
    return (f32 and q_btnh.shape[1] == k_bskh.shape[1] and not logits_soft_cap and not window and not chunk
            and sinks_n is None)


def causal_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, *, scale: float, query_chunk: int):
    """Causal attention [B, T, N, Hv] of float32 queries [B, T, N, H] over keys and values [B, T, K, H|Hv]
    (N a multiple of K), queries in chunks of `query_chunk` (a divisor of T); `segment_ids_bt` None when rows
    hold one document each, else tokens attend within their segment."""
    b, t, n, h = q_btnh.shape
    kv_heads = k_bskh.shape[2]
    group = n // kv_heads
    q_bkgth = (q_btnh * scale).reshape(b, t, kv_heads, group, h).transpose(0, 2, 3, 1, 4)
    k_bksh, v_bksh = k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)
    attend = _attention(query_chunk, segment_ids_bt is not None)
    args = (q_bkgth, k_bksh, v_bksh) + (() if segment_ids_bt is None else (segment_ids_bt,))
    out_bkgth = attend(*args)
    return out_bkgth.transpose(0, 3, 1, 2, 4).reshape(b, t, n, -1)


def _bmm(a, b, contract_a: int, contract_b: int):
    """a @ b batched over both operands' two leading axes (row, kv head), contracting one axis of each."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((0, 1), (0, 1))))


@functools.lru_cache(maxsize=64)
def _causal_bias(start: int, rows: int, group: int) -> np.ndarray:
    """[group x rows, start + rows]: 0 where query start + i sees key j (j <= start + i), else NEG; one block of
    rows per query head of the group."""
    visible = np.arange(rows)[:, None] + start >= np.arange(start + rows)[None, :]
    return np.tile(np.where(visible, np.float32(0), np.float32(NEG)), (group, 1))


def _chunk_rows(x_bkgth, start: int, rows: int):
    """Rows start..start+rows of every query head of a group, as one matrix [B, K, G x rows, H]."""
    b, k, g, _, h = x_bkgth.shape
    return x_bkgth[:, :, :, start:start + rows].reshape(b, k, g * rows, h)


def _probabilities(q_bkgth, k_bksh, segment_ids_bt, start: int, rows: int):
    """A chunk's softmax [B, K, G x rows, start + rows] over the keys up to its end."""
    b, kv_heads, group = q_bkgth.shape[:3]
    end = start + rows
    scores = _bmm(_chunk_rows(q_bkgth, start, rows), k_bksh[:, :, :end], 3, 3) + _causal_bias(start, rows, group)
    if segment_ids_bt is not None:
        same_btS = segment_ids_bt[:, start:end, None] == segment_ids_bt[:, None, :end]
        scores = jnp.where(same_btS[:, None, None], scores.reshape(b, kv_heads, group, rows, end), NEG)
        scores = scores.reshape(b, kv_heads, group * rows, end)
    return jax.nn.softmax(scores, axis=-1)


@functools.lru_cache(maxsize=16)
def _attention(rows: int, segmented: bool):
    """The custom-gradient attention of queries [B, K, G, T, H] (already scaled), keys [B, K, T, H] and values
    [B, K, T, Hv] (and segment ids [B, T] when `segmented`) in chunks of `rows` queries."""

    def forward(q_bkgth, k_bksh, v_bksh, *segments):
        b, kv_heads, group, t, _ = q_bkgth.shape
        segment_ids_bt = segments[0] if segmented else None
        outs, probs = [], []
        for start in range(0, t, rows):
            p = _probabilities(q_bkgth, k_bksh, segment_ids_bt, start, rows)
            probs.append(p)
            outs.append(_bmm(p, v_bksh[:, :, :start + rows], 3, 2).reshape(b, kv_heads, group, rows, -1))
        return jnp.concatenate(outs, axis=3), (q_bkgth, k_bksh, v_bksh, probs)

    def backward(residuals, dout_bkgth):
        q_bkgth, k_bksh, v_bksh, probs = residuals
        b, kv_heads, group, t, h = q_bkgth.shape
        dk_bkhs = jnp.zeros((b, kv_heads, h, t), q_bkgth.dtype)
        dv_bkhs = jnp.zeros((b, kv_heads, v_bksh.shape[3], t), q_bkgth.dtype)
        dqs = []
        for start, p in zip(range(0, t, rows), probs):
            end = start + rows
            dout = _chunk_rows(dout_bkgth, start, rows)
            dp = _bmm(dout, v_bksh[:, :, :end], 3, 3)
            ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))  # the softmax's gradient
            dqs.append(_bmm(ds, k_bksh[:, :, :end], 3, 2).reshape(b, kv_heads, group, rows, h))
            dk_bkhs = dk_bkhs.at[..., :end].add(_bmm(_chunk_rows(q_bkgth, start, rows), ds, 2, 2))
            dv_bkhs = dv_bkhs.at[..., :end].add(_bmm(dout, p, 2, 2))
        grads = (jnp.concatenate(dqs, axis=3), dk_bkhs.transpose(0, 1, 3, 2), dv_bkhs.transpose(0, 1, 3, 2))
        return grads + ((None,) if segmented else ())

    @jax.custom_vjp
    def attention(*args):
        return forward(*args)[0]

    attention.defvjp(forward, backward)
    return attention
