"""Qwen3-Next's Gated DeltaNet: the chunked delta rule equals the token-by-token definition (outputs and
gradients, any chunk size, packed segments), a packed row computes what its documents compute alone, decoding's
carried memory and convolution equal one pass, and the pieces around it (partial rotary, the output and
shared-expert gates, the config checks, the FLOPs count)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from tessera.config import ConfigError
from tessera.metrics import training_flops_per_step
from tessera.models.gated_deltanet import (GatedDeltaNet, causal_conv, chunked_delta_rule, l2_normalized,
                                           recurrent_delta_rule)
from tessera.models.kv_cache import DeltaNetCache
from tessera.models.layers import rotary_tables, rotate

B, T, H, DK, DV = 2, 37, 3, 8, 5
SEGMENTS = jnp.array([[1] * 10 + [2] * 20 + [3] * 7, [1] * 37])  # three documents in the first row
GDN = dict(decoder_block="qwen3_next", base_num_decoder_layers=4, num_experts=4, num_experts_per_tok=2,
           shared_experts=1, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=8, gdn_value_head_dim=6,
           dtype="float32")


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = l2_normalized(jax.random.normal(ks[0], (B, T, H, DK)))
    k = l2_normalized(jax.random.normal(ks[1], (B, T, H, DK)))
    v = jax.random.normal(ks[2], (B, T, H, DV))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))  # decays in (0, 1)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_delta_rule_equals_the_token_by_token_rule(chunk):
    """Chunks of 1 (the recurrence), chunks crossing document boundaries (4, 16) and one padded chunk (64 > 37):
    outputs and the gradients of every input within float32 rounding (measured 1.3e-7 and 2.4e-7)."""
    args = _inputs()
    out, _ = chunked_delta_rule(*args, SEGMENTS, chunk)
    ref = recurrent_delta_rule(*args, SEGMENTS)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)
    assert float(jnp.abs(ref).max()) > 0.2  # (queries scaled by dk**-0.5)

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=range(5))(*args)

    for a, b in zip(grads(lambda *a: chunked_delta_rule(*a, SEGMENTS, chunk)[0]),
                    grads(lambda *a: recurrent_delta_rule(*a, SEGMENTS))):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)


def test_no_memory_crosses_a_document_boundary():
    """Each document of the packed row computes what it computes alone (its own row, no other segment)."""
    args = _inputs(1)
    packed, _ = chunked_delta_rule(*args, SEGMENTS, 8)
    for start, end in ((0, 10), (10, 30), (30, 37)):
        alone, _ = chunked_delta_rule(*(a[:1, start:end] for a in args), jnp.ones((1, end - start), jnp.int32), 8)
        np.testing.assert_allclose(packed[:1, start:end], alone, rtol=0, atol=2e-6)


def test_the_carried_memory_continues_a_sequence():
    """The final memory of the first 20 tokens, given to the last 17, gives the one-pass outputs; a state given
    to another segment is not read."""
    args, ones = _inputs(2), jnp.ones((B, T), jnp.int32)
    whole, final = chunked_delta_rule(*args, ones, 8)
    first, state = chunked_delta_rule(*(a[:, :20] for a in args), ones[:, :20], 8)
    second, state2 = chunked_delta_rule(*(a[:, 20:] for a in args), ones[:, 20:], 8, state, ones[:, 0])
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), whole, rtol=0, atol=2e-6)
    np.testing.assert_allclose(state2, final, rtol=0, atol=2e-6)
    fresh, _ = chunked_delta_rule(*(a[:, 20:] for a in args), ones[:, 20:], 8)
    other, _ = chunked_delta_rule(*(a[:, 20:] for a in args), ones[:, 20:], 8, state, 2 * ones[:, 0])
    np.testing.assert_array_equal(other, fresh)


def test_causal_conv_sees_only_earlier_tokens_of_its_segment():
    x = jax.random.normal(jax.random.key(3), (1, 8, 2))
    w = jax.random.normal(jax.random.key(4), (4, 2))
    seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]])
    out = causal_conv(x, w, seg)
    expected = np.zeros((8, 2))
    for t in range(8):
        acc = x[0, t] * w[3]
        for s in range(1, 4):
            if t - s >= 0 and seg[0, t - s] == seg[0, t]:
                acc = acc + x[0, t - s] * w[3 - s]
        expected[t] = jax.nn.silu(acc)
    np.testing.assert_allclose(out[0], expected, rtol=1e-6, atol=1e-6)


def _layer(**keys):
    cfg = tiny_config(**{**GDN, **keys}).model
    return GatedDeltaNet(cfg, nnx.Rngs(0)), cfg


def test_a_packed_row_equals_its_documents_alone_through_the_layer():
    """Projections, the causal convolution (reset at the boundary), the delta rule, the gated norm: the layer on
    two packed documents equals the layer on each (chunks of 4 cross the boundary at 7)."""
    layer, cfg = _layer(gdn_chunk_size=4)
    x = jax.random.normal(jax.random.key(5), (1, 16, cfg.emb_dim))
    seg = jnp.array([[1] * 7 + [2] * 9])
    packed, _ = layer(x, seg)
    for start, end in ((0, 7), (7, 16)):
        alone, _ = layer(x[:, start:end], jnp.ones((1, end - start), jnp.int32))
        np.testing.assert_allclose(packed[:, start:end], alone, rtol=0, atol=1e-5)
    assert float(jnp.abs(packed).std()) > 0.01


def test_decoding_one_token_at_a_time_equals_one_pass():
    """A left-padded prompt (padding: segment 0) through the cache, then tokens one by one: the outputs of one
    pass over the whole row, the convolution reading the cached inputs."""
    layer, cfg = _layer(gdn_chunk_size=4)
    x = jax.random.normal(jax.random.key(6), (1, 12, cfg.emb_dim))
    seg = jnp.array([[0, 0] + [1] * 10])
    whole, _ = layer(x, seg)
    cache = DeltaNetCache.empty(cfg, 1)
    out, cache = layer(x[:, :7], seg[:, :7], cache)
    outs = [out]
    for t in range(7, 12):
        out, cache = layer(x[:, t:t + 1], seg[:, t:t + 1], cache)
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1)[:, 2:], whole[:, 2:], rtol=0, atol=1e-5)
    assert cache.segment_b.tolist() == [1] and cache.conv_segments_bw.tolist() == [[1, 1, 1]]


def test_partial_rotary_rotates_the_first_dimensions_only():
    x = jax.random.normal(jax.random.key(7), (1, 3, 2, 8))
    tables = rotary_tables(jnp.arange(3)[None], np.array([1.0, 0.1], np.float32))  # 4 of the 8 dimensions
    out = rotate(x, tables)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    np.testing.assert_allclose(out[..., :4], rotate(x[..., :4], tables), rtol=0, atol=1e-7)
    assert float(jnp.abs(out[:, 1:, :, :4] - x[:, 1:, :, :4]).max()) > 0.1


@pytest.mark.parametrize("keys,message", [
    (dict(gdn_num_value_heads=3), "gdn_num_value_heads=3 is not a multiple of gdn_num_key_heads=2"),
    (dict(sliding_window_size=4), "sliding_window_size=4: decoder_block=qwen3_next's attention layers see"),
    (dict(partial_rotary_factor=0.3), r"partial_rotary_factor=0\.3 of head_dim 8 rotates 2\.4 dimensions"),
    (dict(partial_rotary_factor=0.5, rope_scaling="yarn"), "partial_rotary_factor=0.5 with rope_scaling=yarn"),
    (dict(base_num_decoder_layers=3), "needs at least 4 layers .*3 linear-attention and 1 full-attention"),
    # MaxText's qwen3_next file has no shared_experts key (its block always builds the shared expert)
    (dict(shared_experts=0), "shared_experts=0: every decoder_block=qwen3_next layer has a shared expert"),
    (dict(decoder_block="gpt3", num_experts=1, num_experts_per_tok=1, shared_experts=0, partial_rotary_factor=0.5),
     "decoder_block=gpt3 has no rotary positions"),
])
def test_impossible_qwen3_next_settings_are_refused(keys, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**{**GDN, "head_dim": 8, **keys})


def test_flops_count_attention_in_one_layer_of_four():
    """The three Gated DeltaNets of a pattern do no softmax attention: longer sequences add attention FLOPs for one
    layer in four, and the delta rule's cost per token grows with its chunk, not with the length."""
    cfg = tiny_config(**GDN).model

    def per_token(length):
        return training_flops_per_step(cfg, 1, length) / length

    per_key = 3 * 2 * cfg.num_query_heads * 2 * cfg.head_dim  # forward and backward, scores and values
    # a query sees half the sequence (the causal convention), in the 1 attending layer of the 4
    assert per_token(4096) - per_token(2048) == pytest.approx(per_key * (4096 - 2048) / 2 * 1, rel=1e-9)
