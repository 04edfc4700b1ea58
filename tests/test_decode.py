"""Decoding with a KV cache: cached generation equals full recomputation for every block family;
sampling; the command line."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FAST_COMPILE, HELD_LINE, REPO, TINY, held_before, sigterm_after_line, tiny_config
from tessera.checkpointing import Checkpointer
from tessera.config import build_config, flat_dict
from tessera.decode import generate, main, sample
from tessera.models import BLOCKS, build_model, kv_cache
from tessera.losses import loss_sums

PROMPTS = [[5, 17, 3, 88, 41, 9], [60, 2, 33]]  # different lengths: the second is left-padded
NEW_TOKENS = 5  # 6 + 5 tokens fit max_target_length=12 of the tiny config

# MLA (latent 12, rotary 16), YaRN, one dense layer below two expert layers (groups, shared expert, bias)
DEEPSEEK = dict(decoder_block="deepseek", base_num_decoder_layers=3, first_num_dense_layers=1, head_dim=24, q_lora_rank=20,
                kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=10, num_experts=8,
                num_experts_per_tok=3, n_routing_groups=4, topk_routing_group=2, shared_experts=1,
                routed_score_func="sigmoid", routed_bias=True, sparse_matmul=True, rope_scaling="yarn",
                rope_scaling_factor=4.0, rope_original_max_position=1024)
FAMILIES = {
    "llama2 scanned": dict(),
    "llama2 loop": dict(scan_layers=False),
    "mistral window 3": dict(decoder_block="mistral", sliding_window_size=3),
    "mixtral dropless": dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, sparse_matmul=True),
    "gemma": dict(decoder_block="gemma", logits_via_embedding=True, mlp_activations=["gelu", "linear"]),
    "gemma2": dict(decoder_block="gemma2", base_num_decoder_layers=2, sliding_window_size=3, attn_logits_soft_cap=2.0,
                   final_logits_soft_cap=3.0, query_pre_attn_scalar=10.0, logits_via_embedding=True),
    "gpt3": dict(decoder_block="gpt3", fused_qkv=True, base_num_kv_heads=4, trainable_position_size=16,
                 mlp_activations=["gelu"], logits_via_embedding=True),
    "qwen2": dict(decoder_block="qwen2", attention_bias=True),
    "qwen3": dict(decoder_block="qwen3"),
    "qwen3_moe dropless": dict(decoder_block="qwen3_moe", num_experts=8, num_experts_per_tok=3, sparse_matmul=True),
    # 7 layers: one 6-layer pattern (its sixth layer global) and a tail block of one local layer
    "gemma3": dict(decoder_block="gemma3", base_num_decoder_layers=7, sliding_window_size=3, query_pre_attn_scalar=10.0,
                   logits_via_embedding=True, rope_scaling="linear", local_rope_max_timescale=100),
    "gemma3 loop": dict(decoder_block="gemma3", base_num_decoder_layers=7, sliding_window_size=3, scan_layers=False,
                        logits_via_embedding=True),
    # 6 layers: one 4-layer pattern (its fourth layer global) and a tail block of two local layers; YaRN on the global
    "olmo3": dict(decoder_block="olmo3", base_num_decoder_layers=6, sliding_window_size=3, rope_scaling="yarn",
                  rope_scaling_factor=4.0, rope_original_max_position=8, local_rope_max_timescale=-1),
    "olmo3 loop": dict(decoder_block="olmo3", base_num_decoder_layers=6, sliding_window_size=3, scan_layers=False),
    # one global OLMo 3 layer per block, YaRN in every layer
    "olmo2": dict(decoder_block="olmo2", base_num_decoder_layers=3, rope_scaling="yarn", rope_scaling_factor=4.0,
                  rope_original_max_position=8),
    "deepseek": dict(DEEPSEEK),
    "deepseek loop": dict(DEEPSEEK, scan_layers=False, q_lora_rank=0),
    # sinks (a query's softmax over the cache includes them), biases, a window of 3 on the local layers
    "gpt_oss": dict(decoder_block="gpt_oss", base_num_decoder_layers=2, sliding_window_size=3, num_experts=4,
                    num_experts_per_tok=2, attention_bias=True, attention_sink=True, mlp_bias=True,
                    mlp_activations=["sigmoid", "linear"], mlp_activations_limit=1.0, sparse_matmul=True),
    # chunks of 3 on the rotary layers (the 6-token prompts and 5 new tokens cross chunks), a NoPE layer with the
    # temperature from the third token, experts with a shared one in every other layer
    "llama4": dict(decoder_block="llama4", base_num_decoder_layers=4, num_experts=4, num_experts_per_tok=1,
                   shared_experts=1, routed_score_func="sigmoid", norm_topk_prob=False, use_qk_norm=True,
                   chunk_attn_window_size=3, nope_layer_interval=4, temperature_tuning=True,
                   temperature_tuning_floor_scale=3.0, interleave_moe_layer_step=2, sparse_matmul=True),
    # 6 layers: one 3-linear/1-full pattern and a tail of two Gated DeltaNets (memory and convolution carried in the
    # cache; chunks of 4, so a prompt crosses chunks), a quarter of each head rotating, a gated shared expert
    "qwen3_next": dict(decoder_block="qwen3_next", base_num_decoder_layers=6, head_dim=8, partial_rotary_factor=0.25,
                       num_experts=4, num_experts_per_tok=2, shared_experts=1, gdn_num_key_heads=2,
                       gdn_num_value_heads=4, gdn_key_head_dim=8, gdn_value_head_dim=6, gdn_chunk_size=4,
                       sparse_matmul=True),
    "qwen3_next loop": dict(decoder_block="qwen3_next", base_num_decoder_layers=5, num_experts=4, num_experts_per_tok=2,
                            shared_experts=1, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=8,
                            gdn_value_head_dim=6, scan_layers=False),
}


def _model(**overrides):
    """A tiny float32 model with random weights (numpy draws: much faster on CPU than `init`)."""
    model = build_model(tiny_config(dtype="float32", **overrides).model)
    rng = np.random.default_rng(3)
    params = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), model.param_shapes())
    return model, params


@pytest.fixture(scope="module")
def llama():
    return _model()


def full_recomputation(model, params, prompts, new_tokens):
    """Greedy decoding by re-running the whole model on each row's sequence at every step.

    Rows are laid out from index 0 (no padding) in one buffer; causal attention makes the slots
    after a row's current token irrelevant to its logits."""
    apply = jax.jit(model.apply)
    tokens = np.zeros((len(prompts), max(map(len, prompts)) + new_tokens), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    out_tokens, out_logits = [[] for _ in prompts], [[] for _ in prompts]
    for i in range(new_tokens):
        logits = np.asarray(apply(params, tokens))
        for row, prompt in enumerate(prompts):
            last = len(prompt) + i - 1
            out_logits[row].append(logits[row, last])
            out_tokens[row].append(int(np.argmax(logits[row, last])))
            tokens[row, last + 1] = out_tokens[row][-1]
    return out_tokens, [np.stack(r) for r in out_logits]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_cached_decoding_equals_full_recomputation(family):
    model, params = _model(**FAMILIES[family])
    tokens, logits = generate(model, params, PROMPTS, NEW_TOKENS, return_logits=True)
    want_tokens, want_logits = full_recomputation(model, params, PROMPTS, NEW_TOKENS)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["mistral window 3", "gemma2", "gemma3", "deepseek", "gpt_oss", "llama4"])
def test_a_one_token_prompt_beside_long_ones_decodes_to_the_length_limit_as_full_recomputation(family):
    """Prompts of 9, 1 and 4 tokens (the second all padding but its last slot; the first three times the
    window and the chunk) and 8 new tokens: 17 positions, exactly max_target_length, every ring wrapped
    several times. Measured 2026-12-01: the same tokens, logits within 3.1e-6."""
    model, params = _model(**FAMILIES[family], max_target_length=17)
    prompts = [[5, 17, 3, 88, 41, 9, 12, 7, 30], [60], [2, 33, 4, 8]]
    tokens, logits = generate(model, params, prompts, 8, return_logits=True)
    want_tokens, want_logits = full_recomputation(model, params, prompts, 8)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama2 scanned", "gemma2", "deepseek", "gpt_oss", "llama4"])
def test_a_splash_prefill_decodes_as_full_recomputation(family):
    """The prompts' prefill runs the training kernel: splash attention (here in Pallas' interpreter)
    over the prompts padded on the left to 128 tokens; then each token attends over the cache as
    always. Tokens and logits as the reference model recomputing the whole sequence."""
    from tessera.decode import prompt_width

    model, params = _model(**FAMILIES[family])
    splash = build_model(tiny_config(dtype="float32", **FAMILIES[family]).model, "splash_interpret")
    assert prompt_width(PROMPTS, splash.attention_kernel) == 128 and prompt_width(PROMPTS) == 6
    tokens, logits = generate(splash, params, PROMPTS, 3, return_logits=True)
    want_tokens, want_logits = full_recomputation(model, params, PROMPTS, 3)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_the_prefill_on_a_gpu_is_logged_as_the_reference_math_it_runs(caplog):
    """On a GPU training picks cuDNN's fused attention, and decode.py logged "prefill attention:
    attention=autoselected: cuDNN fused attention on gpu", while the prefill runs the reference math
    (`Attention.attend_prompt` takes a fused kernel only for splash). The log now says what runs."""
    from types import SimpleNamespace

    from tessera.decode import _prefill_kernel

    h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    mesh = SimpleNamespace(devices=np.array([h100], dtype=object), shape={"data": 1, "fsdp": 1, "tensor": 1})
    cfg = tiny_config(dtype="bfloat16", head_dim=64, base_emb_dim=256)
    with caplog.at_level("INFO", logger="tessera"):
        assert _prefill_kernel(cfg, mesh, dict(prompts=[[1, 2, 3]], max_new_tokens=2)) == "dot_product"
    assert "prefill attention: the reference math, its queries in chunks (training's choice, attention=autoselected: " \
           "cuDNN fused attention on gpu, is not used for the prefill" in caplog.text, caplog.text


def test_the_prefill_of_llama4_chunked_layers_on_a_tpu_is_logged_as_the_reference_math(caplog):
    """On a TPU the prefill runs splash attention, except in Llama 4's chunked layers (splash counts
    chunks by index, and the prompts are left-padded): the log said splash for every layer."""
    from types import SimpleNamespace

    from tessera.decode import _prefill_kernel

    v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    mesh = SimpleNamespace(devices=np.array([v5e], dtype=object), shape={"data": 1, "fsdp": 1, "tensor": 1})
    for family, note in (("llama4", True), ("llama2 scanned", False)):
        caplog.clear()
        with caplog.at_level("INFO", logger="tessera"):
            assert _prefill_kernel(tiny_config(**FAMILIES[family], head_dim=128, base_emb_dim=256), mesh,
                                   dict(prompts=[[1, 2, 3]], max_new_tokens=2)) == "splash"
        assert "Pallas splash attention on TPU" in caplog.text
        assert ("; Llama 4's chunked layers: the reference math, its queries in chunks" in caplog.text) == note


def test_the_prefill_on_a_tpu_picks_its_own_splash_tiles_where_the_trained_ones_do_not_fit(caplog):
    """sa_block_q=384 fits training's 1,536 tokens, not prompts padded to 512: decode.py stopped with
    'config error: sa_block_q=384: splash attention block sizes must be multiples of 128 that divide the
    sequence length 512', a length no key sets. The prefill now leaves such tiles to splash's own pick,
    with one line; tiles that fit the prompts are kept."""
    import dataclasses
    from types import SimpleNamespace

    from tessera.config import ConfigError
    from tessera.decode import _prefill_kernel, _prefill_tiles
    from tessera.models.splash import block_sizes

    v5e = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    mesh = SimpleNamespace(devices=np.array([v5e], dtype=object), shape={"data": 1, "fsdp": 1, "tensor": 1})
    cfg = tiny_config(max_target_length=1536, sa_block_q=384, sa_block_kv=768)
    long, short = dict(prompts=[[1] * 400], max_new_tokens=2), dict(prompts=[[1] * 200], max_new_tokens=2)
    with pytest.raises(ConfigError, match="sa_block_q=384"):
        _prefill_kernel(cfg, mesh, long)  # (as load_model asked before)
    with caplog.at_level("INFO", logger="tessera"):
        m = _prefill_tiles(cfg.model, mesh, long)
    assert (m.sa_block_q, m.sa_block_kv) == (0, 0) and block_sizes(m, 512).block_q == 512
    assert "prefill attention: the prompts are padded to 512 tokens, which the tiles do not fit (sa_block_q=384" \
        in caplog.text
    assert _prefill_kernel(dataclasses.replace(cfg, model=m), mesh, long) == "splash"
    assert _prefill_tiles(cfg.model, mesh, short) is cfg.model  # 256 tokens: tiles of 256 (384 and 768 cut to it)
    gpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")], dtype=object), shape={})
    assert _prefill_tiles(cfg.model, gpu, long) is cfg.model


def test_mla_caches_the_compressed_latent():
    """MLA's cache holds, per token and layer, the latent (kv_lora_rank) and the shared rotary key
    (qk_rope_head_dim): 12 + 16 numbers here, not 2 x heads x head_dim of expanded keys and values."""
    model, _ = _model(**DEEPSEEK)
    cache = model.init_cache(2, 8)
    assert set(cache) == {"dense_layers", "layers"}
    for segment, layers in (("dense_layers", 1), ("layers", 2)):
        assert cache[segment].k_bskh.shape == (layers, 2, 8, 1, 12)
        assert cache[segment].v_bskh.shape == (layers, 2, 8, 1, 16)


@pytest.mark.parametrize("family, windows", [
    ("mistral window 3", [3]),  # one cache stacked over the layers
    ("gemma2", [3, 0]),  # (local, global), each stacked over the blocks
    ("gemma3", [3, 3, 3, 3, 3, 0, 3]),  # five local and one global layer, then a tail of one local layer
    ("gemma3 loop", [3, 3, 3, 3, 3, 0, 3]),
    ("olmo3", [3, 3, 3, 0, 3, 3]),  # three local and one global layer, then a tail of two local layers
    ("olmo3 loop", [3, 3, 3, 0, 3, 3]),
    ("gpt_oss", [3, 0]),  # (local, global), as gemma2
    ("llama4", [3, 3, 3, 0]),  # three chunked layers (a ring of the chunk's 3 slots) and a NoPE layer
])
def test_sliding_window_layers_cache_only_their_window(family, windows):
    """A local layer's cache is a ring of sliding_window_size slots (a chunked one of its chunk's), a global layer's holds every
    token, and kv_cache_bytes counts them so (the decoding tests above wrap these rings: 6-token
    prompts and 5 new tokens through windows of 3). A window longer than the tokens caches the tokens."""
    from tessera.decode import kv_cache_bytes

    def caches(m, tokens):
        return kv_cache.KVCache.caches_in(m.init_cache(2, tokens))

    model, _ = _model(**FAMILIES[family])
    full = build_model(tiny_config(dtype="float32", **dict(FAMILIES[family], sliding_window_size=0,
                                                           chunk_attn_window_size=0)).model)
    ring, whole = caches(model, 11), caches(full, 11)
    assert [c.k_bskh.shape[-3] for c in ring] == [w or 11 for w in windows]
    assert [c.k_bskh.nbytes * 11 for c in ring] == [f.k_bskh.nbytes * (w or 11) for f, w in zip(whole, windows)]
    assert kv_cache_bytes(model, 2, 11) == sum(a.nbytes for a in jax.tree.leaves(ring)) < kv_cache_bytes(full, 2, 11)
    assert [c.k_bskh.shape[-3] for c in caches(model, 2)] == [2] * len(windows)


@pytest.mark.parametrize("quant", ["", "int8", "int4"])
def test_a_ring_cache_attends_as_a_full_cache_does(quant):
    """A window-3 attention layer fed tokens in writes of 5 (more than the ring holds), 1 and 2
    (round the ring's end) gives the same outputs with a ring of 3 slots as with a cache of every
    token; left padding included. int8, int4: each slot has its own scale, so both store the same values."""
    from flax import nnx

    from tessera.models.attention import Attention

    cfg = tiny_config(dtype="float32", quantize_kvcache=bool(quant), kv_quant_dtype=quant or "int8").model
    attention = Attention(cfg, "dot_product", nnx.Rngs(0), sliding_window=3)
    writes = [5, 1, 1, 1, 1, 2, 1, 1, 2, 1]  # ring index after each: 0 1 2 0 1 0 1 2 1 2 (the 2-token write at 2 wraps)
    total = sum(writes)
    x = jax.random.normal(jax.random.key(1), (2, total, cfg.emb_dim))
    positions = np.stack([np.arange(total), np.maximum(np.arange(total) - 2, 0)]).astype(np.int32)
    segments = np.ones((2, total), np.int32)
    segments[1, :2] = 0  # the second row starts with two tokens of left padding
    args = (2, cfg.num_kv_heads, cfg.head_dim, jnp.float32, (), quant, cfg.kv_quant_axis)
    caches = {"ring": kv_cache.KVCache.empty(args[0], total, *args[1:], window=3),
              "full": kv_cache.KVCache.empty(args[0], total, *args[1:])}
    assert caches["ring"].k_bskh.shape[1] == 3 and caches["full"].k_bskh.shape[1] == total
    call = jax.jit(lambda c, x, p, s: attention(x, p, s, False, c))
    start = 0
    for t in writes:
        outs = {}
        for name in caches:
            outs[name], caches[name] = call(caches[name], x[:, start:start + t], positions[:, start:start + t],
                                            segments[:, start:start + t])
        real = segments[:, start:start + t] != 0  # (a padding query sees the empty slots: how many differs)
        np.testing.assert_allclose(np.asarray(outs["ring"])[real], np.asarray(outs["full"])[real], atol=1e-6, rtol=1e-6)
        start += t
    assert int(caches["ring"].index) == 2 and int(caches["full"].index) == 0  # the full cache's last write filled it
    assert sorted(np.asarray(caches["ring"].positions_bs[0]).tolist()) == [total - 3, total - 2, total - 1]


def test_cached_attention_in_query_chunks_equals_one_pass():
    """Queries in chunks of 1, 2 and 3 (the last one padded) give the one-pass outputs."""
    from tessera.models.attention import masked_attention

    keys = iter(jax.random.split(jax.random.key(0), 3))
    q = jax.random.normal(next(keys), (2, 7, 4, 8))
    k, v = (jax.random.normal(next(keys), (2, 10, 2, 8)) for _ in range(2))
    key_positions = np.stack([np.arange(10), np.arange(10) - 3])
    key_segments = np.stack([np.ones(10, np.int32), (np.arange(10) >= 3).astype(np.int32)])
    positions = key_positions[:, 3:] + 0  # the last 7 keys' own queries, left padding included
    segments = key_segments[:, 3:] + 0

    def visible(p, s):
        return (p[:, :, None] >= key_positions[:, None, :]) & (s[:, :, None] == key_segments[:, None, :])

    args = (q, k, v, visible, positions, segments)
    whole = masked_attention(*args, scale=0.3, logits_soft_cap=2.0)
    for budget in (10, 20, 30):  # chunks of 1, 2, 3 queries against 10 keys
        np.testing.assert_allclose(masked_attention(*args, scale=0.3, logits_soft_cap=2.0,
                                                    scores_per_row_and_head=budget), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama2 scanned", "mistral window 3", "deepseek"])
def test_a_prompt_written_in_two_calls_attends_in_query_chunks(family, monkeypatch):
    """A prompt written in two calls (4 tokens into the empty cache, then 7 into the cache that
    holds them) gives the logits of the whole sequence at once. Under a score budget of 44 per
    row and head the second call's queries go in chunks: of 3 against 12 slots, of 4 against
    the window's 3 slots and the 7 new keys (the last chunk padded)."""
    from tessera.models import attention

    monkeypatch.setattr(attention, "SCORES_PER_ROW_AND_HEAD", 44)
    model, params = _model(**FAMILIES[family])
    tokens = np.array([[5, 17, 3, 88, 41, 9, 12, 60, 2, 33, 4]], np.int32)
    positions, segments = np.arange(11, dtype=np.int32)[None], np.ones_like(tokens)
    call = jax.jit(lambda p, t, pos, seg, c: model.apply(p, t, pos, seg, kv_cache=c))
    cache = kv_cache.KVCache.as_empty(model.init_cache(1, 12))
    first, cache = call(params, tokens[:, :4], positions[:, :4], segments[:, :4], cache)
    written = kv_cache.KVCache.caches_in(cache)
    assert all(type(c) is kv_cache.KVCache and int(c.positions_bs.max()) == 3 for c in written)  # no longer empty
    second, _ = call(params, tokens[:, 4:], positions[:, 4:], segments[:, 4:], cache)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), model.apply(params, tokens),
                               atol=1e-5, rtol=1e-5)


def _unstack(params, num_blocks):
    """Scanned parameters {'layers': stacked} -> unrolled {'layers_0': ..., ...}."""
    out = {k: v for k, v in params.items() if k != "layers"}
    out.update({f"layers_{i}": jax.tree.map(lambda x: x[i], params["layers"]) for i in range(num_blocks)})
    return out


@pytest.mark.parametrize("family", ["llama2 scanned", "deepseek", "gemma2"])
def test_a_prompt_longer_than_a_full_attention_cache_is_refused(family):
    """`ModelDef.apply` with a cache of 4 slots and a 6-token prompt kept positions 2..5 in every
    layer: a layer without a sliding window then attended as one of 4, without a word. A window
    layer's ring of fewer slots than the prompt is as it should be (gemma2's local layers, window 3),
    but its global layers are refused the same way."""
    from tessera.models.kv_cache import KVCache

    model, params = _model(**FAMILIES[family] if family in FAMILIES else DEEPSEEK)
    tokens = np.array([PROMPTS[0]], np.int32)
    positions, segments = np.arange(6, dtype=np.int32)[None], np.ones_like(tokens)
    with pytest.raises(ValueError, match=re.escape("6 tokens written at once into a KV cache of 4 slots, for an "
                                                   "attention layer without a sliding window")):
        model.apply(params, tokens, positions, segments, kv_cache=KVCache.as_empty(model.init_cache(1, 4)))
    model.apply(params, tokens, positions, segments, kv_cache=KVCache.as_empty(model.init_cache(1, 6)))  # room


@pytest.mark.parametrize("family", ["llama2 scanned", "gemma2"])
def test_scanned_and_unrolled_layers_decode_the_same_tokens(family):
    """The same weights, stacked or split: the caches are laid out like them (stacked on a
    leading layers axis, or one per block; a Gemma 2 block carries a pair) and decode alike."""
    scanned, params = _model(**FAMILIES[family])
    unrolled = build_model(tiny_config(dtype="float32", scan_layers=False, **FAMILIES[family]).model)
    blocks = scanned.cfg.num_decoder_layers // BLOCKS[scanned.cfg.decoder_block].layers_per_block
    stacked_cache, loop_cache = scanned.init_cache(2, 8), unrolled.init_cache(2, 8)
    assert len(loop_cache) == blocks
    assert jax.tree.structure(stacked_cache) == jax.tree.structure(loop_cache[0])
    assert all(leaf.shape[0] == blocks for leaf in jax.tree.leaves(stacked_cache))

    tokens, logits = generate(scanned, params, PROMPTS, NEW_TOKENS, return_logits=True)
    loop_tokens, loop_logits = generate(unrolled, _unstack(params, blocks), PROMPTS, NEW_TOKENS, return_logits=True)
    assert loop_tokens == tokens
    for got, want in zip(loop_logits, logits):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_training_holds_no_cache_state(llama):
    """The cache is an argument: no module keeps decoding state, the training program takes
    exactly the parameters and the batch and writes no cache, and only decoding calls carry a
    cache in and out."""
    for name, module in sys.modules.items():
        if name.startswith("tessera.models"):
            assert not [k for k, v in vars(module).items() if isinstance(v, threading.local)], name
    assert {k for k, v in vars(kv_cache).items()
            if getattr(v, "__module__", None) == kv_cache.__name__} == {"KVCache", "EmptyKVCache", "DeltaNetCache"}

    model, params = llama
    batch = {k: jax.ShapeDtypeStruct((2, 13), np.int32) for k in ("tokens", "segment_ids", "positions")}
    train = jax.make_jaxpr(jax.grad(lambda p, b: loss_sums(model, p, b, None)[0]))(params, batch)
    assert len(train.jaxpr.invars) == len(jax.tree.leaves(params)) + 3
    assert len(train.jaxpr.outvars) == len(jax.tree.leaves(params))
    assert "dynamic_update_slice" not in str(train)  # the cache write

    cache = model.init_cache(2, 8)
    step = jax.make_jaxpr(lambda p, t, c: model.apply(p, t, t, t, kv_cache=c))
    decode = step(params, jax.ShapeDtypeStruct((2, 1), np.int32), cache)
    assert len(decode.jaxpr.invars) == len(jax.tree.leaves(params)) + 1 + len(jax.tree.leaves(cache))
    assert len(decode.jaxpr.outvars) == 1 + len(jax.tree.leaves(cache))


def test_generation_stops_rows_at_eos(llama):
    model, params = llama
    free = generate(model, params, PROMPTS, NEW_TOKENS)
    eos = free[1][1]  # the second row's second token: that row stops there
    stopped = generate(model, params, PROMPTS, NEW_TOKENS, eos_id=eos)
    assert stopped[1] == free[1][:2]
    first = free[0][:free[0].index(eos) + 1] if eos in free[0] else free[0]
    assert stopped[0] == first


def _stopped_at_first(tokens, stops):
    """`tokens` cut after the first of `stops` among them."""
    at = next((i for i, t in enumerate(tokens) if t in stops), len(tokens) - 1)
    return tokens[:at + 1]


def test_several_stop_tokens_stop_a_row_at_the_first_it_generates(checkpoint, capsys):
    """A Llama 3 instruct model ends a turn with <|eot_id|> and a text with <|end_of_text|>: `generate`
    takes a list of stop ids, and decode.py a repeated --eos_id. The second --eos_id replaced the first
    without a word (only it stopped a row)."""
    path, free = checkpoint
    model_stops = [free[0][1], free[1][2]]  # the first row's second token, the second row's third
    want = [_stopped_at_first(row, model_stops) for row in free]
    assert want != [_stopped_at_first(row, model_stops[1:]) for row in free]  # the last one alone stops otherwise
    from tessera.config import load_config
    from tessera.decode import load_model
    from tessera.mesh import create_mesh

    cfg = load_config([*CONFIG_ARGS, f"load_parameters_path={path}"], env={})
    mesh = create_mesh(cfg.mesh)
    model, params, _ = load_model(cfg, mesh)
    with jax.set_mesh(mesh):
        assert generate(model, params, PROMPTS, NEW_TOKENS, eos_id=model_stops) == want
        assert generate(model, params, PROMPTS, NEW_TOKENS, eos_id=np.array(model_stops)) == want
    assert main([*CONFIG_ARGS, f"load_parameters_path={path}", *(f"--tokens={','.join(map(str, p))}" for p in PROMPTS),
                 "--max_new_tokens", str(NEW_TOKENS), "--eos_id", str(model_stops[0]), "--eos_id",
                 str(model_stops[1])]) == 0
    assert [[int(t) for t in line.split()] for line in capsys.readouterr().out.splitlines()] == want
    with pytest.raises(ValueError, match=re.escape("eos_id=96 is not a token id in [0, vocab_size=96)")):
        generate(model, params, PROMPTS, NEW_TOKENS, eos_id=[1, 96])


def test_stop_tokens_given_as_one_list_are_told_to_repeat_the_flag(capsys):
    """--eos_id 3,4 (as --tokens takes its ids) said only "invalid int value: '3,4'"."""
    from tessera.decode_args import parse_args

    for value, message in (("3,4", "argument --eos_id: '3,4': give each stop token as its own flag: --eos_id 3 "
                                    "--eos_id 4"),
                           ("x", "argument --eos_id: 'x' is not a token id (a whole number)")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--tokens", "1", "--eos_id", value])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert parse_args(["--tokens", "1", "--eos_id", "3", "--eos_id", " 4"])[0].eos_id == [3, 4]


def test_generating_again_with_the_same_shapes_compiles_nothing(llama):
    """Programs are kept per model, prompt width, cache length and sampling settings (Decode.md): the
    empty KV cache was made by a new jitted lambda per call, compiled again at every `generate`."""
    model, params = llama
    generate(model, params, PROMPTS, NEW_TOKENS)
    compiles = []

    def listen(event, seconds, **_):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        generate(model, params, PROMPTS, NEW_TOKENS, seed=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


def test_sampling_is_reproducible_and_stays_in_the_top_k(llama):
    logits_bv = 3.0 * jax.random.normal(jax.random.key(0), (4, 96))
    draws = np.asarray(jax.vmap(lambda k: sample(logits_bv, k, 1.5, 5))(jax.random.split(jax.random.key(1), 200)))
    top5 = np.argsort(-np.asarray(logits_bv), axis=-1)[:, :5]
    for row in range(4):
        assert set(draws[:, row]) <= set(top5[row])
        assert len(set(draws[:, row])) > 1  # a draw, not the argmax
    np.testing.assert_array_equal(sample(logits_bv, jax.random.key(1), 0.0, 5), np.argmax(logits_bv, axis=-1))
    # a top_k of the whole vocabulary or more keeps every token, as 0 does (lax.top_k raised beyond it)
    for top_k in (96, 97, 100_000):
        np.testing.assert_array_equal(sample(logits_bv, jax.random.key(2), 1.5, top_k),
                                      sample(logits_bv, jax.random.key(2), 1.5, 0))

    model, params = llama
    a, logits = generate(model, params, PROMPTS, NEW_TOKENS, temperature=1.0, top_k=3, seed=7, return_logits=True)
    assert generate(model, params, PROMPTS, NEW_TOKENS, temperature=1.0, top_k=3, seed=7) == a
    assert generate(model, params, PROMPTS, NEW_TOKENS, temperature=1.0, top_k=3, seed=8) != a
    # seeds that differ only above their low 32 bits draw differently (they drew the same tokens)
    assert generate(model, params, PROMPTS, NEW_TOKENS, temperature=1.0, top_k=3, seed=7 + 2**32) != a
    for row_tokens, row_logits in zip(a, logits):
        for token, step_logits in zip(row_tokens, row_logits):
            assert token in np.argsort(-step_logits)[:3]


def test_top_p_samples_from_the_smallest_set_that_reaches_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05 (at temperature 1): top_p 0.8 keeps the first two (0.8
    reached), 0.81 the first three, 0.4 only the first; every kept token is drawn about as often as
    its renormalized probability; top_k applies first; top_p=1 changes nothing."""
    probs = np.array([0.3, 0.05, 0.5, 0.15])  # the most likely token is not the first
    logits_bv = np.log(np.tile(probs, (2, 1))).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 4000)

    def draws(**kw):
        return np.asarray(jax.vmap(lambda k: sample(logits_bv, k, 1.0, **kw))(keys))[:, 0]

    for top_p, kept in ((0.8, [2, 0]), (0.81, [2, 0, 3]), (0.4, [2])):
        got = draws(top_k=0, top_p=top_p)
        assert set(got) == set(kept), top_p
        share = {t: np.mean(got == t) for t in kept}
        for t in kept:
            assert share[t] == pytest.approx(probs[t] / probs[kept].sum(), abs=0.03), (top_p, t)
    assert set(draws(top_k=2, top_p=0.9)) == {2, 0}  # top_k 2 leaves 0.5 and 0.3: 0.625 + 0.375
    assert set(draws(top_k=3, top_p=0.6)) == {2, 0}  # renormalized over three: 0.53, then 0.84 >= 0.6
    np.testing.assert_array_equal(draws(top_k=0, top_p=1.0), draws(top_k=0))


def test_sampling_keeps_exactly_top_k_and_the_most_likely_token_at_any_top_p_or_temperature():
    """top_k kept every token tied with the k-th (bfloat16 logits tie often: 9 ties in a top 40);
    a top_p or a temperature so small that float32 holds it as 0 (1e-46) drew token 0 every time,
    where the docs promise the most likely token."""
    logits_bv = np.array([[0.0, 2.0, 5.0, 5.0, 1.0], [3.0, 3.0, 3.0, -1.0, 9.0]], np.float32)
    keys = jax.random.split(jax.random.key(0), 400)

    def draws(temperature, top_k=0, top_p=1.0):
        return np.asarray(jax.vmap(lambda k: sample(logits_bv, k, temperature, top_k, top_p))(keys))

    got = draws(1.0, top_k=1)
    assert set(got[:, 0]) == {2} and set(got[:, 1]) == {4}  # one token, the lower id of a tie
    got = draws(50.0, top_k=2)
    assert set(got[:, 0]) == {2, 3} and set(got[:, 1]) == {4, 0}  # two tokens, though three tie at 3.0
    for tiny in (1e-46, 1e-30):
        assert set(draws(1.0, top_p=tiny)[:, 1]) == {4}
        assert set(draws(tiny)[:, 1]) == {4}  # near-greedy (row 0's two maxima stay a tie)
        assert set(draws(tiny)[:, 0]) == {2, 3}


def test_top_k_and_top_p_keep_the_most_likely_tokens_at_the_largest_temperature():
    """At --temperature 3e38 (allowed: up to float32's largest) every logit difference divided by it
    is a subnormal XLA flushes to 0, and top_k / top_p ranked the tokens after the division: the
    'top 2' were token 0 and the most likely one, token 1 was in the top_p set."""
    logits_bv = np.tile(np.arange(8, dtype=np.float32), (2, 1))
    keys = jax.random.split(jax.random.key(0), 200)
    for top_k, top_p, want in ((2, 1.0, {6, 7}), (0, 0.3, {5, 6, 7}), (3, 0.5, {6, 7})):
        got = np.asarray(jax.vmap(lambda k: sample(logits_bv, k, 3e38, top_k, top_p))(keys))
        assert set(got.ravel()) == want, (top_k, top_p)


def test_a_rows_draw_does_not_depend_on_the_rows_after_it():
    """The first n rows draw the same tokens with or without more rows after them (JAX's random
    bits depend on the element's index, not on the array's size): the filler rows a mesh adds
    (`generate`) change no prompt's draws."""
    logits_bv = 3.0 * jax.random.normal(jax.random.key(0), (6, 96))
    for seed in range(10):
        key = jax.random.key(seed)
        every = sample(logits_bv, key, 1.0, 0).tolist()
        for n in range(1, 6):
            assert sample(logits_bv[:n], key, 1.0, 0).tolist() == every[:n]
        assert sample(logits_bv[1:], key, 1.0, 0).tolist() != every[1:]  # but on its index


@pytest.mark.parametrize("family", ["llama2", "int8 cache per kv head", "deepseek", "mistral window 3"])
@pytest.mark.slow
def test_decoding_on_a_mesh_splits_the_cache_and_generates_what_one_device_does(llama, family):
    """On fsdp 4 x tensor 2 the cache is created split (rows over fsdp, kv heads over tensor; MLA's
    one latent head stays whole), each device holds kv_cache_bytes(..., mesh) of it, and 3 prompts
    (decoded in 4 rows, one row filling the batch) give the tokens and logits of one device,
    stopping at eos as there."""
    from tessera.decode import empty_cache, kv_cache_bytes
    from tessera.mesh import create_mesh

    overrides = {"llama2": None, "int8 cache per kv head": dict(quantize_kvcache=True, kv_quant_axis="dkv"),
                 "deepseek": DEEPSEEK, "mistral window 3": FAMILIES["mistral window 3"]}[family]
    slots = 3 if family.startswith("mistral") else 11  # a sliding-window layer's cache is a ring of 3
    model, params = _model(**overrides) if overrides else llama
    mesh = create_mesh(tiny_config(ici_fsdp_parallelism=4, ici_tensor_parallelism=2).mesh)
    prompts = [*PROMPTS, [7, 1]]
    want, want_logits = generate(model, params, prompts, NEW_TOKENS, return_logits=True)
    with jax.set_mesh(mesh):
        cache = empty_cache(model, 4, 11)
        k = jax.tree.leaves(cache)[0]  # keys [layers, rows, slots, kv heads, head dim]
        heads = None if family == "deepseek" else "tensor"
        split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp", None, heads))
        assert k.sharding.is_equivalent_to(split, k.ndim)
        assert k.addressable_shards[0].data.shape == (k.shape[0], 1, slots, 1, k.shape[-1])  # 2 kv heads, or 1 latent
        held = sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(cache))
        assert k.addressable_shards[0].data.nbytes * (8 if heads else 4) == k.nbytes
        assert held == kv_cache_bytes(model, 4, 11, mesh) < kv_cache_bytes(model, 4, 11) / 3
        got, got_logits = generate(model, params, prompts, NEW_TOKENS, return_logits=True)
        eos = want[2][1]
        stopped = generate(model, params, prompts, NEW_TOKENS, eos_id=eos)
    assert got == want
    # int8: keys that differ in the last float32 bits (the sharded products add in another order)
    # can round to a neighbouring int8 step, which moves a logit by about 0.007 here
    tolerance = 1e-2 if family.startswith("int8") else 1e-5
    for g, w in zip(got_logits, want_logits):
        np.testing.assert_allclose(g, w, atol=tolerance, rtol=1e-5)
    assert stopped == generate(model, params, prompts, NEW_TOKENS, eos_id=eos)
    assert len(stopped[2]) == 2


# ---- the command line

CONFIG_ARGS = [str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in TINY.items()), "dtype=float32"]


@pytest.fixture(scope="module")
def checkpoint(llama, tmp_path_factory):
    """A checkpoint step folder of the tiny Llama as training writes it (only params in `state`),
    and the tokens greedy decoding generates from it."""
    model, params = llama
    directory = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    saver = Checkpointer(tiny_config().checkpoint, str(directory))
    saver.save(1, {"params": params}, {}, {})
    saver.close()
    return str(directory / "1"), generate(model, params, PROMPTS, NEW_TOKENS)


def test_decode_py_prints_generated_tokens(checkpoint):
    path, want = checkpoint
    cmd = [sys.executable, str(REPO / "decode.py"), *CONFIG_ARGS, f"load_parameters_path={path}",
           "--tokens", ",".join(map(str, PROMPTS[0])), "--tokens", ",".join(map(str, PROMPTS[1])),
           "--max_new_tokens", str(NEW_TOKENS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [[int(t) for t in line.split()] for line in proc.stdout.splitlines()]
    assert printed == want  # on 8 devices with sharded parameters, as in-process on one
    assert f"generated {2 * NEW_TOKENS} tokens for 2 prompt(s)" in proc.stderr
    assert re.search(r"memory: parameters \S+ MiB \(float32, over a mesh of 8 device\(s\)\), KV cache \S+ MiB per "
                     r"device for 2 prompt\(s\) of up to 11 tokens in 8 rows, split 8 ways, prefill temporaries \S+ MiB",
                     proc.stderr), proc.stderr[-3000:]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose every write fails")
def test_output_to_a_full_disk_or_a_closed_pipe_ends_without_a_traceback(checkpoint, tmp_path):
    """decode.py > out.txt on a full disk printed an OSError traceback, and `-m tessera.decode ... | head`
    whose reader went away a BrokenPipeError traceback (exit code 1 both); now one line and exit code 1
    (a full disk), and exit code 141 (128 + SIGPIPE) with nothing printed, as for the other commands
    that print (tools.cli.run_printing)."""
    path, _ = checkpoint
    args = [*CONFIG_ARGS, f"load_parameters_path={path}", "--tokens", "1,2", "--max_new_tokens", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "XLA_FLAGS": FAST_COMPILE}
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, str(REPO / "decode.py"), *args], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=300, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.endswith("error: the output could not be written (No space left on device); what was written "
                                "of it is incomplete: free space (or choose another file) and run the command again\n")
    proc = subprocess.Popen([sys.executable, "-m", "tessera.decode", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]


def test_two_processes_decode_what_one_does_and_print_it_once(llama, checkpoint):
    """decode.py in a 2-process job (4 CPU devices each, the parameters and the cache split over
    all 8): sampled tokens as one process draws them in-process, printed by process 0 alone, with
    nothing but them on its stdout (the collectives' connection lines go to stderr)."""
    import os

    from test_distributed import _free_port

    model, params = llama
    path, _ = checkpoint
    sampling = dict(temperature=1.0, top_k=50, top_p=0.9, seed=4)
    want = generate(model, params, PROMPTS, NEW_TOKENS, **sampling)
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}",
                   JAX_COORDINATOR_IP="127.0.0.1", JAX_COORDINATOR_PORT=str(port), NNODES="2", NODE_RANK=str(rank),
                   JAX_DISTRIBUTED_INITIALIZATION_TIMEOUT_SECONDS="60")
        cmd = [sys.executable, str(REPO / "decode.py"), *CONFIG_ARGS, f"load_parameters_path={path}",
               *(a for prompt in PROMPTS for a in ("--tokens", ",".join(map(str, prompt)))),
               "--max_new_tokens", str(NEW_TOKENS), *(a for k, v in sampling.items() for a in (f"--{k}", str(v)))]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for out, err, code in outs:
        assert code == 0, err[-3000:]
        assert "joined: process" in err and "4 local / 8 global devices" in err, err[-3000:]
    assert [[int(t) for t in line.split()] for line in outs[0][0].splitlines()] == want
    assert outs[1][0] == ""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_IP="127.0.0.1", NNODES="2", NODE_RANK="5")
    bad = subprocess.run([sys.executable, str(REPO / "decode.py"), *CONFIG_ARGS, f"load_parameters_path={path}",
                          "--tokens", "1,2"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 4 and bad.stdout == "", bad.stderr[-3000:]  # train.py's exit code for start-up
    assert "Traceback" not in bad.stderr and "distributed start-up error: NODE_RANK=5 must be in" in bad.stderr


def test_sigterm_stops_decoding_with_one_line_and_exit_143(checkpoint):
    path, _ = checkpoint
    cmd = [sys.executable, str(REPO / "decode.py"), *CONFIG_ARGS, f"load_parameters_path={path}",
           "--tokens", ",".join(map(str, PROMPTS[0])), "--max_new_tokens", "4"]
    # parameters loaded, the handler in place; held before generating (2,000 tokens were once the margin)
    code, err = sigterm_after_line(held_before(cmd, "tessera.generation.generate"), HELD_LINE)
    assert "loaded parameters from" in err
    assert code == 143, err[-3000:]
    assert "stopped by SIGTERM (exit code 143)" in err and "Traceback" not in err


def test_a_mesh_xla_cpu_miscompiles_is_refused_or_decodes_one_devices_tokens(checkpoint, capsys):
    """data 2 x fsdp 2 x tensor 2 decoded other tokens than one device on CPU, silently (XLA:CPU
    exchanges rows in the attention's output projection, tessera.cpu_miscompile); training refused
    that mesh, decoding did not check it. Either it is refused, or its tokens are one device's."""
    from tessera.cpu_miscompile import einsum_is_right
    from tessera.mesh import create_mesh

    path, want = checkpoint
    mesh_keys = ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"]
    prompts = [arg for prompt in PROMPTS for arg in ("--tokens", ",".join(map(str, prompt)))]
    code = main([*CONFIG_ARGS, f"load_parameters_path={path}", *mesh_keys, *prompts,
                 "--max_new_tokens", str(NEW_TOKENS)])
    out, err = capsys.readouterr()
    if not einsum_is_right(create_mesh(tiny_config(ici_data_parallelism=2, ici_fsdp_parallelism=2,
                                                   ici_tensor_parallelism=2).mesh)):
        assert code == 2 and out == ""
        assert re.search(r"config error: on CPU, this jax \(.*\) computes wrong results on a mesh with data 2, fsdp 2, "
                         r"tensor 2", err), err
        return
    assert code == 0, err
    assert [[int(t) for t in line.split()] for line in out.splitlines()] == want


def test_missing_checkpoint_is_a_one_line_error(tmp_path):
    cmd = [sys.executable, "-m", "tessera.decode", *CONFIG_ARGS, f"load_parameters_path={tmp_path / 'nope'}",
           "--tokens", "1,2,3", "--max_new_tokens", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"checkpoint error: load_parameters_path={tmp_path / 'nope'} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def _hf_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "the cat sat on a mat and a dog ran to the park".split()
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))],
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<s>", "</s>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_a_checkpoint_trained_with_other_model_keys_that_fit_is_loaded_with_a_warning(llama, tmp_path, capsys):
    """A rotary base (or a window, a soft cap) other than the one the parameters were trained with
    fits the same shapes: decoding ran silently as another model. Keys of how the model is computed
    (remat_policy, attention, use_iota_embed: a lookup as a one-hot matmul, ...) are no reason to warn."""
    from tessera.checkpointing.loading import IMPLEMENTATION_KEYS
    from tessera.config import ModelConfig

    assert IMPLEMENTATION_KEYS <= {f.name for f in dataclasses.fields(ModelConfig)}
    _, params = llama
    saved = json.loads(json.dumps(flat_dict(build_config(dict(TINY, dtype="float32")))))
    saved.update(rope_max_timescale=100, remat_policy="full", use_iota_embed=True)
    saver = Checkpointer(tiny_config().checkpoint, str(tmp_path / "checkpoints"))
    saver.save(1, {"params": params}, {}, saved)
    saver.close()
    assert main([*CONFIG_ARGS, f"load_parameters_path={tmp_path / 'checkpoints' / '1'}", "--tokens", "1,2",
                 "--max_new_tokens", "2"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "trained with other model keys" in line]
    assert len(warning) == 1 and "other model keys: rope_max_timescale=100 (here 10000" in warning[0], err
    assert "remat_policy" not in warning[0] and "use_iota_embed" not in warning[0], warning  # it warned of the latter


def test_converted_parameters_read_with_other_model_keys_are_named(llama, tmp_path, capsys):
    """Parameters hf-to-tessera wrote keep the config.json they came from (hf_source_config.json), and
    no config item: decoding them with another rotary base (a converted Llama 3.1 read as llama3-8b,
    the same shapes) ran silently as another model, and a width that does not fit was listed by
    parameter path without the key. Both now name the key with the config.json's value."""
    from tessera.tools.hf_checkpoint import save_params
    from tessera.tools.hf_config_out import hf_config

    _, params = llama
    folder = tmp_path / "converted"
    save_params(folder, params, source_config=hf_config(tiny_config(dtype="float32").model, 12))
    args = [*CONFIG_ARGS, f"load_parameters_path={folder}", "--tokens", "1,2", "--max_new_tokens", "2"]
    assert main(args) == 0
    assert "other model keys" not in capsys.readouterr().err  # the keys it was converted with
    assert main([*args, "rope_max_timescale=500000", "scan_layers=false"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "other model keys" in line]
    assert len(warning) == 1 and ("converted from a config.json with other model keys: rope_max_timescale=10000 (here "
                                  "500000). They fit, so they were loaded") in warning[0], warning
    assert main([*args, "base_emb_dim=36"]) == 2
    assert ("The config.json it was converted from (hf_source_config.json) differs in its model keys: base_emb_dim=24 "
            "(here 36)") in capsys.readouterr().err


def test_generated_ids_past_the_tokenizer_are_left_out_of_the_text(checkpoint, tmp_path, capsys):
    """vocab_size may pad the tokenizer's vocabulary (96 here, 32 tokens): a generated id past the
    tokenizer ended the run with a traceback from the tokenizer after all the work (SentencePiece
    IndexError, tiktoken KeyError; Hugging Face dropped them silently)."""
    path, _ = checkpoint
    tokenizer = _hf_tokenizer(tmp_path / "tok")
    assert main([*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={tokenizer}", "--prompt",
                 "the cat sat", "--max_new_tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("the cat sat")
    assert re.search(r"\d+ generated token\(s\) have ids past the tokenizer's 32 tokens \(vocab_size=96 pads it\): "
                     "left out of the text", err), err


def test_an_eos_id_in_the_prompt_stays_in_the_printed_text(checkpoint, tmp_path, capsys):
    """--eos_id is the token a row stops at; the printed text left it out of the prompt too: with the
    id of "the", "the cat sat on the mat" was printed as "cat sat on mat"."""
    from tokenizers import Tokenizer

    path, _ = checkpoint
    tokenizer = _hf_tokenizer(tmp_path / "tok")
    the = Tokenizer.from_file(f"{tokenizer}/tokenizer.json").token_to_id("the")
    assert main([*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={tokenizer}", "--prompt",
                 "the cat sat on the mat", "--max_new_tokens", "2", "--eos_id", str(the)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat sat on the mat"), out


def test_a_generation_config_beside_the_tokenizer_adds_its_stop_tokens(checkpoint, tmp_path, capsys, monkeypatch):
    """A Hugging Face model folder's generation_config.json lists the tokens its rows end at (Llama 3 instruct:
    128001, 128008, 128009); only the tokenizer's end token stopped a row, and answers ran on past their end.
    Its eos_token_id now stops rows too, unless --eos_id is given; a broken file is one line, exit code 2.
    --ignore_eos stops at none (a fixed length)."""
    import tessera.decode as decoding

    stops, outputs = [], []  # what decode.py asked generate() for, and what it returned

    def spy(*args, **kwargs):
        stops.append(args[7])
        outputs.append(generate(*args, **kwargs)[0])
        return [outputs[-1]]

    monkeypatch.setattr(decoding, "generate", spy)
    path, _ = checkpoint
    tokenizer = _hf_tokenizer(tmp_path / "tok")
    args = [*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={tokenizer}", "--prompt", "the cat sat",
            "--max_new_tokens", "6"]
    assert main(args) == 0
    assert stops[-1] == [1] and len(outputs[-1]) == 6 and 1 not in outputs[-1]  # the tokenizer's "</s>" only
    third = outputs[0][2]
    (tmp_path / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": [third, 1]}))
    capsys.readouterr()
    assert main(args) == 0
    assert stops[-1] == [1, third] and outputs[-1] == outputs[0][:outputs[0].index(third) + 1]
    assert (f"a row stops at token(s) 1, {third}: the tokenizer's end token and eos_token_id of "
            f"{tmp_path / 'tok' / 'generation_config.json'} (--eos_id replaces them)") in capsys.readouterr().err
    assert main([*args, "--eos_id", "5"]) == 0 and stops[-1] == [5]
    assert main([*args, "--ignore_eos"]) == 0 and stops[-1] is None and outputs[-1] == outputs[0]  # all 6 tokens
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--ignore_eos", "--eos_id", "5"])
    assert stopped.value.code == 2
    assert "--ignore_eos and --eos_id: give stop tokens or none, not both" in capsys.readouterr().err
    for text, message in (("{", "cannot be read"), ("[1]", "is not a JSON object"),
                          ('{"eos_token_id": 96}', "eos_token_id 96 is not a token id in [0, vocab_size=96)"),
                          ('{"eos_token_id": ["2"]}', "eos_token_id '2' is not a token id")):
        (tmp_path / "tok" / "generation_config.json").write_text(text)
        assert main(args) == 2
        err = capsys.readouterr().err
        assert f"generation_config.json {message}" in err or f"generation_config.json: {message}" in err, err
        assert "fix it, or give the stop tokens as --eos_id (which replaces it)" in err and "Traceback" not in err


def test_a_tokenizer_or_add_bos_other_than_the_checkpoints_is_named(llama, tmp_path, capsys):
    """--prompt with a tokenizer other than the one the run trained with (its saved tokenizer_path)
    encoded the prompt into ids that mean other text to the model and printed garbage without a word.
    The same file at another path (a copy) is no reason to warn. add_bos other than the training's
    encoded the prompts without the BOS token every training document began with, silently too."""
    import shutil

    _, params = llama
    trained = _hf_tokenizer(tmp_path / "trained")
    shutil.copytree(trained, tmp_path / "copy")
    other = json.loads((tmp_path / "trained" / "tokenizer.json").read_text())
    vocab = other["model"]["vocab"]
    vocab["the"], vocab["cat"] = vocab["cat"], vocab["the"]  # the same words, other ids
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(other))
    saved = json.loads(json.dumps(flat_dict(build_config(dict(TINY, dtype="float32", tokenizer_path=trained)))))
    saver = Checkpointer(tiny_config().checkpoint, str(tmp_path / "checkpoints"))
    saver.save(1, {"params": params}, {}, saved)
    saver.close()
    path = tmp_path / "checkpoints" / "1"
    for tokenizer, warned in ((trained, False), (tmp_path / "copy", False), (tmp_path / "other", True)):
        assert main([*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={tokenizer}", "--prompt",
                     "the cat", "--max_new_tokens", "1"]) == 0
        err = capsys.readouterr().err
        assert (f"was trained with tokenizer_path={trained}, which differs from tokenizer_path={tokenizer}" in err
                ) == warned, err
        assert "trained with add_bos" not in err
    assert main([*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={trained}", "add_bos=false",
                 "--prompt", "the cat", "--max_new_tokens", "1"]) == 0
    assert (f"load_parameters_path={path} was trained with add_bos=true, and the prompts are encoded with "
            "add_bos=false (without the BOS token that began every document it learned): give add_bos=true"
            ) in capsys.readouterr().err


def test_a_prompt_without_a_tokenizer_is_told_of_tokens(checkpoint, capsys):
    """--prompt without tokenizer_path got the data pipeline's line, "unless the text columns are already token ids",
    which names no flag of decode.py; it names --tokens, the way to decode without a tokenizer."""
    path, _ = checkpoint
    assert main([*CONFIG_ARGS, f"load_parameters_path={path}", "--prompt", "the cat"]) == 2
    err = capsys.readouterr().err
    assert "to encode --prompt; without one, give token ids with --tokens 1,2,3" in err and "columns" not in err, err


def test_text_prompts_and_user_errors(checkpoint, tmp_path, capsys, monkeypatch):
    path, _ = checkpoint
    tokenizer = _hf_tokenizer(tmp_path / "tok")
    args = [*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={tokenizer}"]
    assert main([*args, "--prompt", "the cat sat", "--max_new_tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the cat sat")

    cache_file = tmp_path / "not_a_folder"
    cache_file.write_text("")
    errors = {
        "no tokenizer": ([*CONFIG_ARGS, f"load_parameters_path={path}", "--prompt", "the cat"],
                         "config error: reading text needs tokenizer_path"),
        "missing tokenizer": ([*args, f"tokenizer_path={tmp_path / 'none'}", "--prompt", "the"],
                              "does not exist; give the path of a tokenizer"),
        "too long": ([*args, "--tokens", ",".join(["7"] * 10), "--max_new_tokens", "3"],
                     "prompt 1 has 10 tokens + --max_new_tokens 3 = 13, more than max_target_length=12"),
        "no checkpoint": ([*CONFIG_ARGS, "--tokens", "1,2"], "decoding needs load_parameters_path="),
        "training's resume path": ([*CONFIG_ARGS, f"load_full_state_path={path}", "--tokens", "1,2"],
                                   f"not load_full_state_path (training's resume): give load_parameters_path={path}"),
        "bad token": ([*args, "--tokens", "1,96"], "token ids outside [0, vocab_size=96)"),
        "negative token": ([*args, "--tokens", "-1,2"], "prompt 1 has token ids outside [0, vocab_size=96): [-1, 2]"),
        "cache folder is a file": ([*args, f"jax_cache_dir={cache_file}", "--tokens", "1,2"],
                                   f"jax_cache_dir={cache_file} cannot be written: {cache_file} is a file, not a folder"),
        "eos past the vocabulary": ([*args, "--tokens", "1,2", "--max_new_tokens", "3", "--eos_id", "96"],
                                    "--eos_id 96 is outside the model's vocabulary [0, vocab_size=96)"),
        # raising max_target_length, as the "too long" line says, cannot help here (was a ValueError traceback)
        "past gpt3's position table": ([*args, "decoder_block=gpt3", "trainable_position_size=4", "--tokens",
                                        "1,2,3", "--max_new_tokens", "3"],
                                       "3 prompt tokens + --max_new_tokens 3 = 6, more than the "
                                       "trainable_position_size=4 positions this model has learned embeddings for"),
        # found before the load (was a NotADirectoryError traceback after it)
        "quantized folder under a file": ([*args, "quantization=int8", f"save_quantized_params_path={cache_file}/q",
                                           "--tokens", "1,2", "--max_new_tokens", "3"],
                                          f"save_quantized_params_path={cache_file}/q cannot be written: {cache_file} "
                                          "is a file, not a folder"),
    }
    for name, (argv, message) in errors.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert message in err, (name, err)
        # a refused cache folder is not left as JAX's setting for what this process compiles next
        assert jax.config.jax_compilation_cache_dir != str(cache_file), name
    for top_p in ("0", "1.5", "-0.1", "nan"):  # refused by the flag parser: usage, the error, exit code 2
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--tokens", "1,2", "--temperature", "1", "--top_p", top_p])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"error: --top_p {float(top_p)} must be in (0, 1]" in err, err
    for temperature in ("nan", "inf", "-1", "1e300"):  # nan sampled token 0 every time, without a word
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--tokens", "1,2", "--temperature", temperature])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and (f"error: --temperature {float(temperature)} must be a number from 0 "
                                          "(greedy) to 3.40282e+38 (the largest float32)") in err, err
    # each wrong flag is named with its value, and only the wrong ones (the message named all four before)
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--tokens", "1,2", "--top_k", "-1", "--max_new_tokens", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == (  # one line, without argparse's usage block
        ".venv/bin/python -m tessera.decode: error: --max_new_tokens 0 must be at least 1; --top_k -1 must be >= 0 "
        "(0: all tokens) (--help lists the flags)\n"), err
    for seed in (str(2**63), str(-2**63 - 1)):  # a seed past 64 bits ended in an OverflowError traceback
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--tokens", "1,2", "--temperature", "1", "--seed", seed])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"--seed {seed} must be a whole number from {-2**63} to {2**63 - 1}" in err
    for argv, message in ((["max_new_tokens=5"], "max_new_tokens=5 is a decoding flag, not a config key: give it as "
                                                  "--max_new_tokens 5"),  # was: did you mean max_num_checkpoints_to_keep?
                          (["--max-new-tokens", "5"], "unknown flag --max-new-tokens; did you mean --max_new_tokens? "
                                                      "config keys are given as key=value"),
                          (["--prompt", "--verbose"], "argument --prompt: expected one argument (one that starts "
                                                      "with '-' is given as --prompt=VALUE)"),
                          # both were "config error: argument 'cat' is not of the form key=value"
                          (["--prompt", "the", "cat", "sat"], 'cat sat after --prompt the is neither a flag nor a '
                                                             'key=value; quote a prompt of several words: --prompt '
                                                             '"the cat sat"'),
                          (["--tokens", "3", "4"], "4 after --tokens 3 is neither a flag nor a key=value; token ids "
                                                   "are separated by commas: --tokens 3,4"),
                          (["--prompt=the", "cat"], 'cat after --prompt the is neither a flag nor a key=value; quote '
                                                    'a prompt of several words: --prompt "the cat"')):
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--tokens", "1,2", *argv])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, err
    with monkeypatch.context() as env:  # M_TEMPERATURE was ignored, with "did you mean M_TEMPERATURE_TUNING?"
        env.setenv("M_TEMPERATURE", "0.8")
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--tokens", "1,2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and ("environment variable M_TEMPERATURE=0.8 is a decoding flag, not a config key: "
                                      "give it as --temperature 0.8 (and unset M_TEMPERATURE)") in err, err
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--tokens", "1,2", "--eos_id", "-2"])
    assert exit_.value.code == 2 and "--eos_id -2 is not a token id" in capsys.readouterr().err
    for tokens in ("1,,2", "1,2,", "", "1,two", "1.5"):  # an empty entry was skipped: `1,,2` decoded `1,2`
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--tokens", tokens])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"{tokens!r} is not a comma-separated list of token ids" in err, err


def test_sampling_flags_without_a_temperature_are_named(checkpoint, capsys):
    """--top_k, --top_p and --seed without --temperature were ignored without a word: greedy decoding."""
    path, want = checkpoint
    args = [*CONFIG_ARGS, f"load_parameters_path={path}", "--tokens", ",".join(map(str, PROMPTS[0])),
            "--max_new_tokens", str(NEW_TOKENS)]
    assert main([*args, "--top_k", "5", "--top_p", "0.9", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert [int(t) for t in out.split()] == want[0]  # greedy, as the warning says
    assert ("--top_k 5, --top_p 0.9, --seed 3: no effect at --temperature 0, which decodes greedily; give a "
            "--temperature above 0 (e.g. 1) to sample") in err, err
    assert main([*args, "--top_k", "5", "--temperature", "1"]) == 0
    assert "no effect at --temperature 0" not in capsys.readouterr().err


def test_keys_decoding_does_not_read_are_named(checkpoint, capsys):
    """kv_quant_dtype=int4 without quantize_kvcache=true decoded with a float cache, compile_topology
    compiled nothing ahead of time, a gpt3 key on a llama model and capacity routing (whose steps drop
    no token) went without a word: training warned of such keys, decode.py did not."""
    from tessera.config.unread_keys import decoding_keys_without_effect

    path, want = checkpoint
    args = [*CONFIG_ARGS, f"load_parameters_path={path}", "--tokens", ",".join(map(str, PROMPTS[0])),
            "--max_new_tokens", str(NEW_TOKENS)]
    assert main([*args, "kv_quant_dtype=int4", "compile_topology=v5e-4", "trainable_position_size=16"]) == 0
    out, err = capsys.readouterr()
    assert [int(t) for t in out.split()] == want[0]
    for line in ("kv_quant_dtype=int4: no effect without quantize_kvcache=true; the KV cache is stored in dtype=float32",
                 "compile_topology=v5e-4: no effect, decode.py decodes on the devices it finds",
                 "trainable_position_size=16: no effect, decoder_block=llama2 rotates its queries and keys"):
        assert line in err, (line, err)
    moe = dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2)
    assert any(line.startswith("capacity_factor=1.5: a decoding step routes one token per prompt")
               for line in decoding_keys_without_effect(tiny_config(**moe, capacity_factor=1.5)))
    assert decoding_keys_without_effect(tiny_config(**moe, capacity_factor=1.5, sparse_matmul=True)) == []
    assert decoding_keys_without_effect(tiny_config(quantize_kvcache=True, kv_quant_dtype="int4")) == []
    # decode.py read load_parameters_path and ignored load_full_state_path without a word (training refuses the pair)
    assert main([*args, f"load_full_state_path={path}x"]) == 0
    assert (f"load_full_state_path={path}x: no effect, decode.py decodes the parameters of load_parameters_path={path}"
            in capsys.readouterr().err)
    assert decoding_keys_without_effect(tiny_config(load_parameters_path=path, load_full_state_path=path)) == []


def test_decoding_routes_every_token_copy_whatever_ragged_buffer_factor_says(tmp_path):
    """A bounded receive buffer (ragged_buffer_factor, training's memory saving; the v5p DeepSeek-V3 recipe
    sets it) dropped token copies while decoding over an expert axis, without a word: other tokens than the
    model gives. decode.py builds the model with room for every copy, and names the key."""
    from tessera.config.unread_keys import decoding_keys_without_effect
    from tessera.decode import load_model
    from tessera.mesh import create_mesh

    moe = dict(decoder_block="mixtral", num_experts=8, num_experts_per_tok=2, sparse_matmul=True)
    model, params = _model(**moe)
    prompts = [*PROMPTS, [7, 1], [9, 4, 5]]
    want = generate(model, params, prompts, NEW_TOKENS)
    saver = Checkpointer(tiny_config().checkpoint, str(tmp_path / "checkpoints"))
    saver.save(1, {"params": params}, {}, {})
    saver.close()
    cfg = tiny_config(**moe, dtype="float32", ragged_buffer_factor=1.0, ici_expert_parallelism=4,
                      ici_fsdp_parallelism=2, load_parameters_path=str(tmp_path / "checkpoints" / "1"))
    mesh = create_mesh(cfg.mesh)
    decoding, loaded, _ = load_model(cfg, mesh)
    with jax.set_mesh(mesh):
        assert generate(decoding, loaded, prompts, NEW_TOKENS) == want
    assert ("ragged_buffer_factor=1: no effect, decoding gives each expert shard room for every token copy, so that "
            "none is dropped (a bounded buffer saves training memory)") in decoding_keys_without_effect(cfg)


def test_a_prompt_the_tokenizer_encodes_to_nothing_is_refused(checkpoint, tmp_path, capsys):
    """A Hugging Face BPE without an unknown token drops characters it lacks: "日本語" became no
    tokens, so decoding continued the begin token alone (the prompt silently gone), or, with
    add_bos=false, was refused as "prompt 1 is empty" though text was given."""
    path, _ = checkpoint
    tokenizer = _hf_tokenizer(tmp_path / "tok")
    for add_bos in ("true", "false"):
        assert main([*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={tokenizer}", f"add_bos={add_bos}",
                     "--prompt", "the cat", "--prompt", "日本語", "--max_new_tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert f"prompt 2 ('日本語') encodes to no tokens with tokenizer_path={tokenizer}" in err, err


def test_a_prompt_that_is_not_utf8_is_refused(checkpoint, tmp_path, capsys):
    """A command-line prompt holding bytes that are not UTF-8 (Latin-1 `café`) reaches Python as a lone
    surrogate: SentencePiece and Hugging Face tokenizers ended in a TypeError traceback (exit code 1),
    tiktoken silently encoded U+FFFD in its place."""
    path, _ = checkpoint
    tokenizer = _hf_tokenizer(tmp_path / "tok")
    prompt = os.fsdecode(b"the caf\xe9")  # what sys.argv holds for these bytes
    assert main([*CONFIG_ARGS, f"load_parameters_path={path}", f"tokenizer_path={tokenizer}", "--prompt", "the cat",
                 "--prompt", prompt, "--max_new_tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "config error: prompt 2 ('the caf\\udce9') is not UTF-8 text: byte 0xe9 at character 7" in err, err


def test_a_quantized_checkpoint_read_as_float_names_checkpoint_is_quantized(llama, checkpoint, tmp_path, capsys):
    """A checkpoint written by save_quantized_params_path, read without checkpoint_is_quantized=true
    (or a float one read with it), listed every matrix as missing and unexpected without a word on
    the key that explains it."""
    from tessera.checkpointing.quantized import save_quantized

    model, params = llama
    path, _ = checkpoint
    save_quantized(params, model.logical_axes(), "int8", str(tmp_path / "q8"))
    args = [*CONFIG_ARGS, "--tokens", "1,2", "--max_new_tokens", "2"]
    assert main([*args, f"load_parameters_path={tmp_path / 'q8'}"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint error: " in err and err.rstrip().endswith(
        f"load_parameters_path={tmp_path / 'q8'} holds quantized parameters (int8, written by save_quantized_params_path): "
        "read them with checkpoint_is_quantized=true quantization=int8"), err
    assert main([*args, f"load_parameters_path={path}", "quantization=int8", "checkpoint_is_quantized=true"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"load_parameters_path={path} holds parameters that are not quantized: leave out "
                                 "checkpoint_is_quantized=true"), err
    # read with another mode: every matrix's dtype was listed, with "use the model settings" as the advice
    assert main([*args, f"load_parameters_path={tmp_path / 'q8'}", "quantization=fp8", "checkpoint_is_quantized=true"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(
        f"load_parameters_path={tmp_path / 'q8'} holds parameters quantized to int8, not to float8_e4m3fn "
        "(quantization=fp8): read them with quantization=int8"), err


@pytest.mark.parametrize("stage", ["orbax", "checksums"])
def test_a_quantized_save_interrupted_leaves_no_folder_behind(llama, tmp_path, monkeypatch, stage):
    """Ctrl-C after Orbax's rename left a quantized folder without its config or checksums, which the next
    decode read as a whole checkpoint (and the next save refused as existing); one during Orbax's write left
    its temporary folder. Either is removed now, and the interrupt goes on to decode.py's exit 130."""
    import orbax.checkpoint as ocp

    from tessera.checkpointing import quantized

    model, params = llama
    target = tmp_path / "q8"
    if stage == "orbax":
        def interrupted(self, path, tree, *a, **k):
            (tmp_path / "q8.orbax-checkpoint-tmp-123").mkdir()
            raise KeyboardInterrupt
        monkeypatch.setattr(ocp.PyTreeCheckpointer, "save", interrupted)
    else:
        monkeypatch.setattr("tessera.checkpointing.record_checksums",
                            lambda path: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        quantized.save_quantized(params, model.logical_axes(), "int8", str(target), config={"model_name": "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    quantized.save_quantized(params, model.logical_axes(), "int8", str(target), config={"model_name": "x"})
    assert (target / "config").is_dir() and target.is_dir()


def test_a_cache_that_does_not_fit_is_not_told_to_quantize_again(tmp_path, capsys):
    """The memory error advised quantize_kvcache=true to a run that had set it: int8 is told int4,
    int4 neither (checked before the checkpoint is read: none is needed). On CPU, where int4 takes a
    byte per value as int8 does (Quantization.md), int8 was told int4 too, which fits no better."""
    from tessera.decode_memory import memory_advice

    long = [a for a in CONFIG_ARGS if not a.startswith("max_target_length=")] + ["max_target_length=1000000002"]
    args = [*long, f"load_parameters_path={tmp_path / 'none'}", "--tokens", "1,2", "--max_new_tokens", "1000000000"]
    for extra, advice in (([], "lower --max_new_tokens or set quantize_kvcache=true;"),
                          (["quantize_kvcache=true"], "lower --max_new_tokens;"),
                          (["quantize_kvcache=true", "kv_quant_dtype=int4"], "lower --max_new_tokens;")):
        assert main([*args, *extra]) == 7
        err = capsys.readouterr().err
        assert "memory error: not enough memory for the parameters and the KV cache" in err and advice in err, err
    assert "lower --max_new_tokens or set kv_quant_dtype=int4;" in memory_advice(False, cache=True, kv_quant="int8")
    assert "int4" not in memory_advice(False, cache=True, kv_quant="int4")
    # the prefill's temporaries (a MoE over an expert axis holds room for every token copy) are told to the prompts
    assert memory_advice(False, prefill=True).startswith("decode fewer or shorter prompts at once (the prefill's "
                                                          "temporaries grow with the prompts' tokens; over an expert")
    assert "shorter prompts" not in memory_advice(False, cache=True)


def test_float32_parameters_that_do_not_fit_are_told_weight_dtype_bfloat16(tmp_path, capsys):
    """Decode.md: float32 weights decode as weight_dtype=bfloat16, at half the memory; the memory error
    of float32 parameters said only "free memory, or decode on a host with more" (llama2-7b on a
    24 GiB host). Checked before the checkpoint is read: none is needed."""
    args = [str(REPO / "configs" / "base.yml"), "model_name=llama3.1-405b", f"load_parameters_path={tmp_path / 'none'}",
            "--tokens", "1,2", "--max_new_tokens", "2"]
    for extra, told in (([], True), (["weight_dtype=bfloat16"], False)):
        assert main([*args, *extra]) == 7
        err = capsys.readouterr().err
        assert "memory error: not enough memory for the parameters" in err, err
        assert ("set weight_dtype=bfloat16 (float32 parameters are read as bfloat16, half the memory)" in err) == told


def test_generate_refuses_sampling_arguments_it_cannot_honour(llama):
    """From Python, a negative temperature sampled greedily and a nan one drew token 0 every time,
    a top_p of 0 was greedy: the command line refused them, `generate` and `sample` did not."""
    model, params = llama
    logits_bv = np.zeros((1, 8), np.float32)
    for kwargs, message in (
        (dict(temperature=-1.0), "temperature=-1.0 must be a number from 0 (greedy)"),
        (dict(temperature=float("nan")), "temperature=nan must be"),
        (dict(top_k=-2), "top_k=-2 must be a whole number >= 0"),
        (dict(temperature=1.0, top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(temperature=1.0, top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        (dict(temperature=True), "temperature=True must be a number"),  # a bool was taken as 1
        (dict(temperature="0.7"), "temperature='0.7' must be a number"),  # a TypeError traceback
        (dict(temperature=1.0, top_k=True), "top_k=True must be a whole number"),  # one token kept
        (dict(temperature=1.0, top_p="0.9"), "top_p='0.9' must be in (0, 1]"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            generate(model, params, PROMPTS, 2, **kwargs)
        with pytest.raises(ValueError, match=re.escape(message)):
            sample(logits_bv, jax.random.key(0), **dict(dict(temperature=0.0, top_k=0), **kwargs))


def test_generate_refuses_token_ids_it_cannot_decode(llama):
    """From Python, token -1 was decoded as the table's last token (95) and token 96 gave nan logits
    (then token 0), an eos_id outside the vocabulary never stopped a row, and max_new_tokens=2.0
    ended in a shape TypeError: the command line refused them, `generate` did not. Bools were taken as
    0 and 1, and a seed of 1.5 was a TypeError traceback."""
    model, params = llama
    for args, kwargs, message in (
        ([[1, 2, -1]], {}, "prompt 1 has token ids outside [0, vocab_size=96): [-1]"),
        ([[1], [2, 96, 3]], {}, "prompt 2 has token ids outside [0, vocab_size=96): [96]"),
        ([[1, 2]], dict(eos_id=96), "eos_id=96 is not a token id in [0, vocab_size=96)"),
        ([[1, 2]], dict(eos_id=-1), "eos_id=-1 is not a token id"),
        ([[1, 2]], dict(max_new_tokens=2.0), "max_new_tokens=2.0 must be a whole number >= 1"),
        ([[1, True]], {}, "prompt 1 has token ids outside [0, vocab_size=96): [True]"),  # was token 1
        ([[1, 2]], dict(max_new_tokens=True), "max_new_tokens=True must be a whole number"),
        ([[1, 2]], dict(eos_id=False), "eos_id=False is not a token id"),  # was token 0
        ([[1, 2]], dict(seed=1.5), "seed=1.5 must be a whole number"),  # a TypeError traceback
        ([[1, 2]], dict(seed=True), "seed=True must be a whole number"),  # was seed 1
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            generate(model, params, args, **dict(dict(max_new_tokens=2), **kwargs))
    assert generate(model, params, [np.array([1, 95])], np.int64(1), eos_id=np.int32(0))  # numpy integers are fine
    # so is a 2-D array of prompts (it was a ValueError traceback: 'the truth value of an array ... is ambiguous')
    assert generate(model, params, np.array([[1, 95], [3, 4]]), 2) == generate(model, params, [[1, 95], [3, 4]], 2)


def test_generate_names_prompts_and_lengths_of_the_wrong_type(llama):
    """One prompt given as a flat list ([1, 2]), prompts=None, and a max_new_tokens of "5" or None were
    TypeError tracebacks from deep inside `generate` ("'int' object is not iterable", "'<' not supported"),
    where Decode.md promises a ValueError naming the argument."""
    model, params = llama
    for prompts, new, message in (
        ([1, 2], 2, "prompts=[1, 2] is not a list of prompts, each a list of token ids: give one prompt as "
                    "[[1, 2, 3]]"),
        (np.array([1, 2]), 2, "is not a list of prompts"),
        (None, 2, "prompts=None is not a list of prompts"),
        ([[1, 2]], "5", "max_new_tokens='5' must be a whole number >= 1"),
        ([[1, 2]], None, "max_new_tokens=None must be a whole number >= 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            generate(model, params, prompts, new)


def test_logits_that_are_nan_are_an_error_not_token_0(llama, tmp_path, capsys):
    """Parameters holding NaN (or float16 activations past 65504) give NaN logits, from which greedy
    decoding and sampling gave token 0 at every step, printed with exit code 0."""
    from tessera.decode import NonFiniteLogits

    model, params = llama
    params = jax.tree.map(np.array, params)
    params["token_embedder"]["table_vd"][7] = np.nan  # only prompt 2 holds token 7
    for temperature in (0.0, 1.0):
        with pytest.raises(NonFiniteLogits, match=re.escape("the logits of prompt 2 hold NaN or inf at new token 1")):
            generate(model, params, [[1, 2, 3], [5, 7]], 2, temperature=temperature)
    saver = Checkpointer(tiny_config().checkpoint, str(tmp_path / "checkpoints"))
    saver.save(1, {"params": params}, {}, {})
    saver.close()
    assert main([*CONFIG_ARGS, f"load_parameters_path={tmp_path / 'checkpoints' / '1'}", "--tokens", "7,1",
                 "--max_new_tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and ("error: the logits of prompt 1 hold NaN or inf at new token 1, so its tokens would "
                                   "be meaningless (token 0 every time): the parameters hold NaN or inf") in captured.err


def test_a_relative_config_file_that_is_missing_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["configs/base.yml", "load_parameters_path=x", "--tokens", "1,2"]) == 2
    err = capsys.readouterr().err
    assert f"error: config file {tmp_path / 'configs' / 'base.yml'} does not exist" in err


def test_decode_py_applies_the_gpu_keys_as_train_py_does(checkpoint):
    """optimization_level and xla_python_client_mem_fraction (which a GPU recipe's config.yml holds) were read by
    train.py only: decode.py left JAX at its 0.75 of each GPU's memory without a word."""
    path, want = checkpoint
    cmd = [sys.executable, str(REPO / "decode.py"), *CONFIG_ARGS, f"load_parameters_path={path}",
           "optimization_level=O1", "xla_python_client_mem_fraction=0.9", "--tokens",
           ",".join(map(str, PROMPTS[0])), "--max_new_tokens", str(NEW_TOKENS)]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_OPTIMIZATION_LEVEL")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [int(t) for t in proc.stdout.split()] == want[0]
    assert ("gpu tuning: optimization_level=O1, enable_pgle=false, pgle_profiling_runs=-, pgle_profile_path=-, "
            "xla_python_client_mem_fraction=0.9") in proc.stderr, proc.stderr[-3000:]
