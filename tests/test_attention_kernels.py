"""Splash attention (the TPU flash kernel) against the reference attention, run in Pallas'
interpreter on CPU: outputs and gradients for every feature the model families use, sharded
under a mesh, and in a whole model; the kernel choice per platform; AOT for a TPU topology."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from tessera.config import ConfigError, build_config
from tessera.models import build_model
from tessera.models.attention import dot_product_attention
from tessera.models.attention_choice import select_attention
from jax.sharding import PartitionSpec as P

from tessera.models.splash import (_from_balanced, _kernel, _to_balanced, balanced_order, block_sizes, load_balanced,
                                   splash_attention)

T, H = 256, 64  # the smallest sequence with two 128-token blocks
# float32 in the interpreter: the kernel's online softmax sums in another order than the
# reference's one-pass softmax; measured differences are ~1e-6, the bound leaves room
TOL = dict(rtol=2e-5, atol=2e-5)

CASES = {  # name: (query heads, kv heads, window, soft cap, scale, packed, sink logits)
    "causal": (4, 4, 0, 0.0, H**-0.5, False, False),
    "grouped-query": (4, 2, 0, 0.0, H**-0.5, False, False),
    "sliding-window": (2, 2, 100, 0.0, H**-0.5, False, False),
    "soft-cap": (2, 1, 0, 5.0, H**-0.5, False, False),
    "query_pre_attn_scalar": (2, 2, 0, 0.0, 144**-0.5, False, False),
    "packed-segments": (4, 2, 0, 0.0, H**-0.5, True, False),
    "gemma2-local": (4, 2, 128, 50.0, 256**-0.5, True, False),
    "gpt-oss-local (sinks, window)": (4, 2, 128, 0.0, H**-0.5 * 1.5, True, True),
    "gpt-oss-global (sinks)": (4, 2, 0, 0.0, H**-0.5, True, True),
    "llama4-chunks of 96": (4, 2, -96, 0.0, H**-0.5, True, False),  # a negative window: chunks of that many tokens
}


def _sinks(n, use: bool):
    """Sink logits [N] of the size of the scores (from about -2 to 2), or None."""
    return 2.0 * jax.random.normal(jax.random.key(7), (n,), jnp.float32) if use else None


def _inputs(n, k, packed, batch=2, length=T):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, length, n, H), jnp.float32)
    kk = jax.random.normal(keys[1], (batch, length, k, H), jnp.float32)
    v = jax.random.normal(keys[2], (batch, length, k, H), jnp.float32)
    seg = np.ones((batch, length), np.int32)
    if packed:  # three documents in row 0, then padding (segment 0); two in row 1
        seg[0, 90:200], seg[0, 200:], seg[1, 131:] = 2, 0, 3
    return q, kk, v, jnp.asarray(seg)


def _blocks():
    return block_sizes(tiny_config(max_target_length=T).model, T)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_splash_matches_the_reference_in_outputs_and_gradients(case):
    """Outputs and the gradients of queries, keys, values (and sink logits, where the case has them)."""
    n, k, window, cap, scale, packed, use_sinks = CASES[case]
    window, chunk = max(window, 0), max(-window, 0)
    q, kk, v, seg = _inputs(n, k, packed)
    sinks = _sinks(n, use_sinks)
    ref = lambda q, kk, v, s: dot_product_attention(q, kk, v, seg, seg, scale=scale,  # noqa: E731
                                                    logits_soft_cap=cap, window=window, sinks_n=s, chunk=chunk)
    ours = lambda q, kk, v, s: splash_attention(q, kk, v, seg, scale=scale, logits_soft_cap=cap,  # noqa: E731
                                                window=window, blocks=_blocks(), interpret=True, sinks_n=s,
                                                chunk=chunk)
    # each side jitted: one compile, not one per operation
    np.testing.assert_allclose(jax.jit(ours)(q, kk, v, sinks), jax.jit(ref)(q, kk, v, sinks), **TOL)
    weights = jax.random.normal(jax.random.key(1), q.shape)  # a loss that weighs every output
    argnums = (0, 1, 2, 3) if use_sinks else (0, 1, 2)
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * weights), argnums=argnums))(q, kk, v, sinks)
             for f in (ours, ref)]
    for g_ours, g_ref, name in zip(*grads, ("q", "k", "v", "sinks")):
        np.testing.assert_allclose(g_ours, g_ref, err_msg=f"d{name}", **TOL)


@pytest.mark.parametrize("scale", [12**-0.5, 0.135234], ids=["gemma2-27b (1/12)", "deepseek-v3 (yarn)"])
def test_splash_scales_bfloat16_queries_without_rounding_the_scale(scale):
    """The kernel does not scale, so the queries are scaled before it: multiplied by the scale cast
    to bfloat16, which is 1/12 + 0.2% (Gemma 2 27B's query_pre_attn_scalar=144) and DeepSeek-V3's
    0.135234 - 0.35%, every score's temperature off by that under splash alone (the reference and cuDNN
    scale in float32). The queries the kernel gets are now each exact product rounded once: no bias."""
    from tessera.models.splash import _attend

    q = jax.random.normal(jax.random.key(0), (2, 128, 4, 16), jnp.float32).astype(jnp.bfloat16)
    kv = jnp.zeros((2, 128, 2, 16), jnp.bfloat16)
    seg = jnp.ones((2, 128), jnp.int32)
    given = _attend(lambda q_gth, *_, **__: q_gth, q, kv, kv, seg, seg, scale=scale)  # the kernel's queries
    exact = np.asarray(q, np.float32) * scale
    np.testing.assert_array_equal(np.asarray(given, np.float32), np.asarray(jnp.asarray(exact, jnp.bfloat16),
                                                                           np.float32))
    assert abs(np.mean(np.asarray(given, np.float32) / exact) - 1) < 2e-4  # was +1.3e-3 and -3.6e-3


def test_splash_under_a_mesh_splits_batch_and_heads():
    q, kk, v, seg = _inputs(4, 2, True, batch=4)
    mesh = jax.make_mesh((2, 1, 2, 1, 2, 1), ("data", "stage", "fsdp", "sequence", "tensor", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 6)
    ref = dot_product_attention(q, kk, v, seg, seg, scale=H**-0.5)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda *a: splash_attention(*a, scale=H**-0.5, blocks=_blocks(), interpret=True))(q, kk, v, seg)
    np.testing.assert_allclose(out, ref, **TOL)


@pytest.mark.parametrize("family", ["llama2", "deepseek", "llama2-sequence-split", "llama4"])
@pytest.mark.slow
def test_a_model_with_splash_attention_equals_the_reference(family):
    """Loss and gradients of a whole model with the kernel. DeepSeek's dense layer and its expert
    layers are two scans: a kernel kept from the first one's trace leaked a tracer into the second.
    With the sequence split, the model runs under an fsdp 2 x sequence 2 x tensor 2 mesh (the
    layers pick their query tiles and the load-balanced layout from it) against the reference on
    one device. Llama 4's pattern: chunks of 96 on its rotary layers, a NoPE layer whose queries
    the temperature scales."""
    from test_decode import DEEPSEEK, FAMILIES

    overrides = {"deepseek": DEEPSEEK, "llama4": dict(FAMILIES["llama4"], chunk_attn_window_size=96,
                                                      temperature_tuning_floor_scale=64.0)}.get(
        family, dict(base_num_kv_heads=2))
    length = 2 * T if family.endswith("sequence-split") else T  # load-balanced: 4 parts of 128 tokens
    cfg = tiny_config(max_target_length=length, **{"base_num_decoder_layers": 2 if family != "llama4" else 4,
                                                   **overrides})
    tokens = jax.random.randint(jax.random.key(2), (2, length), 0, cfg.model.vocab_size)
    ref_model, splash_model = (build_model(cfg.model, kernel) for kernel in ("dot_product", "splash_interpret"))
    params = jax.jit(ref_model.init)(jax.random.key(0))  # jitted here and below: one compile, not one per operation

    def loss(model, p):
        return jnp.mean(jax.nn.log_softmax(model.apply(p, tokens))[..., 0])

    def loss_and_grads(model):
        return jax.jit(jax.value_and_grad(lambda p: loss(model, p)))(params)

    if family.endswith("sequence-split"):
        mesh = jax.make_mesh((1, 1, 2, 2, 2, 1), ("data", "stage", "fsdp", "sequence", "tensor", "expert"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 6)
        with jax.set_mesh(mesh):
            splash_value, g_splash = loss_and_grads(splash_model)
    else:
        splash_value, g_splash = loss_and_grads(splash_model)
    ref_value, g_ref = loss_and_grads(ref_model)
    np.testing.assert_allclose(splash_value, ref_value, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_splash), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_latent_attention_with_values_wider_than_its_keys_runs_splash_as_the_reference():
    """A fused kernel takes queries, keys and values of one width: MLA padded its values to the
    query/key width, and with v_head_dim above qk_nope_head_dim + qk_rope_head_dim the padding was
    negative (a ValueError from splash attention on TPUs and cuDNN on GPUs)."""
    from test_decode import DEEPSEEK

    cfg = tiny_config(max_target_length=128, **dict(DEEPSEEK, base_num_decoder_layers=1, first_num_dense_layers=0,
                                                    v_head_dim=32))
    tokens = jax.random.randint(jax.random.key(2), (1, 128), 0, cfg.model.vocab_size)
    ref_model, splash_model = (build_model(cfg.model, kernel) for kernel in ("dot_product", "splash_interpret"))
    params = jax.jit(ref_model.init)(jax.random.key(0))  # jitted here and below: one compile, not one per operation

    def loss_and_grads(model):
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(jax.nn.log_softmax(model.apply(p, tokens))[..., 0])))(
            params)

    (splash_value, g_splash), (ref_value, g_ref) = (loss_and_grads(m) for m in (splash_model, ref_model))
    np.testing.assert_allclose(splash_value, ref_value, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_splash), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


SPLIT_CASES = {  # name: ((mesh data, fsdp, sequence, tensor), CASES' features, length, load balance)
    "fsdp2-sequence2-tensor2, grouped-query, packed, balanced": ((1, 2, 2, 2), "packed-segments", 512, True),
    "fsdp2-sequence2-tensor2, grouped-query, packed, contiguous": ((1, 2, 2, 2), "packed-segments", 512, False),
    "sequence4, gemma2-local (window, soft cap), balanced": ((1, 2, 4, 1), "gemma2-local", 1024, True),
    "sequence4, gemma2-local (window, soft cap), contiguous": ((1, 2, 4, 1), "gemma2-local", 512, False),
    "sequence2, fewer kv heads than tensor ways, balanced": ((2, 1, 2, 2), "soft-cap", 512, True),
    "fsdp2-sequence2-tensor2, gpt-oss-local (sinks), balanced": ((1, 2, 2, 2), "gpt-oss-local (sinks, window)", 512,
                                                                  True),
    "sequence4, llama4 chunks of 96, balanced": ((1, 2, 4, 1), "llama4-chunks of 96", 1024, True),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
@pytest.mark.slow
def test_splash_with_the_sequence_split_matches_the_reference(case):
    """Context parallelism: each device attends with its part of the queries over the gathered keys
    and values (with load balance: parts j and 2S-1-j of 2S, exchanged there and back); the global
    causal, window and segment masks hold across the parts, and the key and value gradients are
    summed back over the sequence axis."""
    (data, fsdp, seq, tensor), features, length, balance = SPLIT_CASES[case]
    n, k, window, cap, scale, packed, use_sinks = CASES[features]
    window, chunk = max(window, 0), max(-window, 0)
    q, kk, v, seg = _inputs(n, k, packed, length=length)  # row 1's last document crosses the parts
    sinks = _sinks(n, use_sinks)
    mesh = jax.make_mesh((data, 1, fsdp, seq, tensor, 1), ("data", "stage", "fsdp", "sequence", "tensor", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 6)
    model = tiny_config(max_target_length=length, context_parallel_load_balance=balance).model
    blocks = block_sizes(model, length, q_shards=seq)
    assert load_balanced(model, length, seq) == balance
    assert blocks.block_q == length // seq // (2 if balance else 1)  # the largest tile of one part of the queries
    ref = lambda q, kk, v, s: dot_product_attention(q, kk, v, seg, seg, scale=scale,  # noqa: E731
                                                    logits_soft_cap=cap, window=window, sinks_n=s, chunk=chunk)
    ours = lambda q, kk, v, s: splash_attention(q, kk, v, seg, scale=scale, logits_soft_cap=cap,  # noqa: E731
                                                window=window, blocks=blocks, load_balance=balance, interpret=True,
                                                sinks_n=s, chunk=chunk)
    weights = jax.random.normal(jax.random.key(1), q.shape)
    argnums = (0, 1, 2, 3) if use_sinks else (0, 1, 2)
    with jax.set_mesh(mesh):
        out = jax.jit(ours)(q, kk, v, sinks)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * weights), argnums=argnums))(q, kk, v, sinks)
    np.testing.assert_allclose(out, jax.jit(ref)(q, kk, v, sinks), **TOL)  # jitted: one compile, not one per operation
    ref_grads = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * weights), argnums=argnums))(q, kk, v, sinks)
    for g_ours, g_ref, name in zip(grads, ref_grads, ("q", "k", "v", "sinks")):
        np.testing.assert_allclose(g_ours, g_ref, err_msg=f"d{name}", **TOL)


def test_load_balance_gives_every_device_the_same_kernel_work():
    """The kernel's block table (which query x key tiles it visits; a fully masked one is skipped),
    per device of a sequence split 4 ways, 4096 tokens in tiles of 512: contiguous parts visit
    3, 7, 11 and 15 tiles (the step waits for 15); balanced ones 9 each. The exchange puts every
    query row where `balanced_order` says, and back."""
    for balance, visits in ((False, [3, 7, 11, 15]), (True, [9, 9, 9, 9])):
        model = tiny_config(context_parallel_load_balance=balance).model
        blocks = block_sizes(model, 4096, q_shards=4)
        for info in (kernel := _kernel(1, 4096, 0, 0.0, blocks, True, 4, balance)).fwd_mask_info, kernel.dkv_mask_info:
            per_device = np.split(np.asarray(info.block_mask)[0], 4, axis=0)
            assert [int(np.count_nonzero(part)) for part in per_device] == visits, balance
    rows = jnp.arange(2 * 1024).reshape(2, 1024)  # 2 sequences of 1024 positions, split 4 ways
    mesh = jax.make_mesh((2, 4), ("fsdp", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    there = jax.shard_map(lambda x: _to_balanced(x, "sequence", 4), mesh=mesh, in_specs=P("fsdp", "sequence"),
                          out_specs=P("fsdp", "sequence"), check_vma=False)
    back = jax.shard_map(lambda x: _from_balanced(x, "sequence", 4), mesh=mesh, in_specs=P("fsdp", "sequence"),
                         out_specs=P("fsdp", "sequence"), check_vma=False)
    balanced = jax.jit(there)(rows)
    np.testing.assert_array_equal(balanced, rows[:, balanced_order(1024, 4)])
    assert balanced_order(1024, 4)[:256].tolist() == [*range(128), *range(896, 1024)]  # device 0: first and last
    np.testing.assert_array_equal(jax.jit(back)(balanced), rows)


@pytest.mark.parametrize("length, window, shards, balance, blocks", [
    (2048, 0, 1, False, dict(sa_block_q=256, sa_block_kv=512)),
    (4096, 0, 4, True, dict(sa_block_q=256, sa_block_q_dkv=512, sa_block_kv_dkv=256)),
    (4096, 0, 4, False, dict(sa_block_q=512)),
    (3072, 640, 3, True, dict(sa_block_q=256, sa_block_kv=384, sa_block_kv_compute=128)),  # window edges in blocks
    (2048, 256, 2, False, dict(sa_block_q=128, sa_block_kv=128, sa_block_q_dkv=128, sa_block_kv_dkv=128)),
    (3072, -384, 3, True, dict(sa_block_q=256, sa_block_kv=256)),  # chunks of 384 (negative: a chunk, not a window)
    (2048, -512, 2, False, dict(sa_block_q=128, sa_block_kv=512)),
], ids=["causal", "causal split balanced", "causal split", "window split balanced", "window small blocks",
        "chunks split balanced", "chunks split"])
def test_mask_tables_from_block_bounds_equal_the_element_wise_ones(length, window, shards, balance, blocks,
                                                                   monkeypatch):
    """The kernel's three mask tables (forward, dQ, dK/dV: which blocks it visits, where each one's next data
    is, the partial blocks) built from masks that answer wholly visible or hidden blocks from their bounds equal
    those JAX's own masks give when every block is computed element by element."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    from tessera.models import splash

    from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask import ChunkedCausalMask

    model = tiny_config(context_parallel_load_balance=balance, **blocks).model
    sizes = block_sizes(model, length, q_shards=shards)
    window, chunk = max(window, 0), max(-window, 0)
    fast = _kernel(2, length, window, 0.0, sizes, True, shards, balance, chunk)
    monkeypatch.setattr(splash, "_Causal", sa.CausalMask)
    monkeypatch.setattr(splash, "_Local", sa.LocalMask)
    monkeypatch.setattr(splash, "_Chunked", ChunkedCausalMask)
    plain = _kernel(2, length, window, 0.0, sizes, True, shards, balance, chunk)
    for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        ours, theirs = getattr(fast, name), getattr(plain, name)
        assert (ours is None) == (theirs is None), name
        for field, a, b in zip(ours._fields, ours, theirs) if ours is not None else ():
            assert (a is None) == (b is None), (name, field)
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}.{field}")


_NO_PIPELINE: list = []  # the reference run's records, computed once


@pytest.mark.parametrize("mesh", [dict(ici_pipeline_parallelism=2),
                                  dict(ici_pipeline_parallelism=2, ici_sequence_parallelism=2, ici_fsdp_parallelism=2)])
@pytest.mark.slow
def test_splash_inside_the_pipeline_trains_like_the_reference(mesh, tmp_path, monkeypatch, caplog):
    """Splash attention nests its shard_map inside the pipeline's (whose stage axis is manual there),
    also with the sequence split (load-balanced: 512 tokens in 4 parts): two steps give the losses
    and gradient norms of the reference attention without a pipeline, to 1e-5. Two layers, one a stage: the
    nesting is the same with more (four took 70 s of CPU for both meshes, two 45)."""
    import json
    import logging

    from tessera import step
    from tessera.models.attention_choice import AttentionChoice
    from tessera.train import run

    def records(name, **overrides):
        cfg = tiny_config(tmp_path / name, base_num_decoder_layers=2, scan_layers=True, steps=2,
                          enable_checkpointing=False, max_target_length=512, **overrides)
        run(cfg, jax.devices())
        return [json.loads(line) for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]

    if not _NO_PIPELINE:
        _NO_PIPELINE.extend(records("reference"))  # fsdp over the 8 devices, the reference kernel (CPU's)
    monkeypatch.setattr(step, "select_attention", lambda *_: AttentionChoice("splash_interpret", "under test"))
    with caplog.at_level(logging.INFO, logger="tessera"):
        got = records("pipelined", **mesh)
    assert "attention kernel: splash_interpret (under test)" in caplog.text
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in _NO_PIPELINE], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("overrides, kernel, why", [
    (dict(attention="flash", max_target_length=2048), "splash", "splash attention"),
    (dict(attention="autoselected", max_target_length=1024, attn_logits_soft_cap=50.0), "splash", "splash"),
    (dict(attention="flash", max_target_length=1000), "dot_product", "multiple of 128"),
    (dict(attention="dot_product", max_target_length=2048), "dot_product", "requested"),
])
def test_tpu_gets_splash_where_it_can_serve(overrides, kernel, why):
    cfg = tiny_config(**overrides)
    choice = select_attention(cfg.model, "tpu", cfg.data.max_target_length, {"sequence": 1})
    assert choice.kernel == kernel and why in choice.reason
    seq = select_attention(cfg.model, "tpu", cfg.data.max_target_length, {"sequence": 2})
    assert seq.kernel == kernel  # the sequence axis splits the queries
    assert ("queries split 2 ways over the sequence axis, load-balanced" in seq.reason) == (kernel == "splash")
    contiguous = tiny_config(**{**overrides, "context_parallel_load_balance": False})
    seq = select_attention(contiguous.model, "tpu", cfg.data.max_target_length, {"sequence": 2})
    assert ("split 2 ways over the sequence axis, in contiguous parts)" in seq.reason) == (kernel == "splash")


def test_a_sequence_split_needs_query_tiles_on_every_device():
    cfg = tiny_config(attention="flash", max_target_length=1152)  # 9 tiles of 128
    assert select_attention(cfg.model, "tpu", 1152, {"sequence": 1}).kernel == "splash"
    choice = select_attention(cfg.model, "tpu", 1152, {"sequence": 2})
    assert choice.kernel == "dot_product" and "multiple of 256, not 1152" in choice.reason
    odd = select_attention(tiny_config(attention="flash").model, "tpu", 768, {"sequence": 2})  # 3 tiles per device
    assert odd.kernel == "splash" and "in contiguous parts (a balanced split needs a multiple of 512)" in odd.reason
    contiguous = tiny_config(context_parallel_load_balance=False).model
    assert block_sizes(contiguous, 2048, q_shards=4).block_q == 512
    assert block_sizes(contiguous, 2048, q_shards=8).block_q == 256  # 256 queries per device
    assert block_sizes(tiny_config().model, 2048, q_shards=4).block_q == 256  # balanced: two parts of 256
    assert block_sizes(tiny_config(sa_block_q=512).model, 3072).block_q == 512  # divides the whole sequence
    with pytest.raises(ConfigError, match=r"sa_block_q=512: .* splitting the queries 4 ways each device holds 768 of "
                                          r"them, and .* e\.g\. 256"):
        block_sizes(tiny_config(sa_block_q=512, context_parallel_load_balance=False).model, 3072, q_shards=4)
    with pytest.raises(ConfigError, match=r"sa_block_q=512: .* each device holds 1536 of them in two parts of 768 "
                                          r"\(context_parallel_load_balance\), .* e\.g\. 256, or set "
                                          r"context_parallel_load_balance=false \(shares of 1536\)$"):
        block_sizes(tiny_config(sa_block_q=512).model, 6144, q_shards=4)  # but not one device's part


def test_block_sizes_are_checked_against_the_sequence():
    assert block_sizes(tiny_config(sa_block_q=1024).model, 2048).block_q == 1024
    with pytest.raises(ConfigError, match="sa_block_kv_dq=384.*divide the sequence length 2048"):
        block_sizes(tiny_config(sa_block_q=1024, sa_block_kv_dq=384).model, 2048)
    auto = block_sizes(tiny_config().model, 640)
    assert auto.block_q == auto.block_kv_dq == 128  # 640 = 5 x 128: 512 and 256 do not divide it
    assert block_sizes(tiny_config().model, 4096).block_q == 512


def test_a_compute_block_defaults_to_its_key_block_and_must_divide_it():
    """sa_block_kv=256 alone (2,048 tokens) left its compute block at the automatic 512, larger than the
    block it steps through: splash raised 'ValueError: bkv=256 must be a multiple of bkv_compute=512' as
    the step was traced (a traceback from train_compile, exit 1); so did sa_block_kv_dkv=128 ('bkv_compute=512
    should not be greater than bkv=128'). A compute block of 0 now takes its key block's size, and one that
    does not divide it is a config error naming both."""
    blocks = block_sizes(tiny_config(sa_block_kv=256, sa_block_kv_dkv=128).model, 2048)
    assert (blocks.block_kv, blocks.block_kv_compute, blocks.block_kv_dkv, blocks.block_kv_dkv_compute) == (
        256, 256, 128, 128)
    assert block_sizes(tiny_config(sa_block_kv=256, sa_block_kv_compute=128).model, 2048).block_kv_compute == 128
    auto = block_sizes(tiny_config().model, 2048)
    assert (auto.block_kv, auto.block_kv_compute, auto.block_kv_dkv, auto.block_kv_dkv_compute) == (512,) * 4
    for keys, message in ((dict(sa_block_kv=384, sa_block_kv_compute=256), "sa_block_kv_compute=256: .* "
                           "sa_block_kv=384 in steps of it, so it must divide 384 .* e\\.g\\. 384"),
                          (dict(sa_block_kv_dkv=256, sa_block_kv_dkv_compute=512), "sa_block_kv_dkv_compute=512: .* "
                           "sa_block_kv_dkv=256 in steps of it, so it must divide 256")):
        with pytest.raises(ConfigError, match=message):
            block_sizes(tiny_config(**keys).model, 1536)
    with pytest.raises(ConfigError, match=r"^sa_block_kv=384: .* divide the sequence length 1024"):
        block_sizes(tiny_config(sa_block_kv=384).model, 1024)  # (its compute block of 0 follows it, unnamed)
    q, kk, v, seg = _inputs(2, 1, True, length=512)  # the kernels accept the blocks (traced, not run)
    small = block_sizes(tiny_config(sa_block_kv=128, sa_block_kv_dkv=256).model, 512)
    loss = lambda q: jnp.sum(splash_attention(q, kk, v, seg, scale=H**-0.5, blocks=small, interpret=True))  # noqa: E731
    assert jax.eval_shape(jax.grad(loss), q).shape == q.shape


@pytest.mark.parametrize("sequence", [1, 2])
def test_aot_compile_for_tpu_runs_the_splash_kernel(sequence):
    """Also with the sequence axis splitting the queries (context parallelism): the keys and
    values are gathered over it, and their gradients reduce-scattered back."""
    from tessera.train_compile import compile_for_topology

    cfg = build_config({"compile_topology": "v5e-4", "dtype": "bfloat16", "attention": "flash",
                        "max_target_length": 256 * sequence, "base_num_decoder_layers": 2,
                        "per_device_batch_size": 1, "ici_sequence_parallelism": sequence})
    report = compile_for_topology(cfg)
    assert report.fits and report.attention_kernel == "splash"
    assert report.custom_calls.get("tpu_custom_call", 0) >= 3  # forward, dK/dV and dQ kernels
    # named in the report: splash_mqa_fwd_segmented_residuals, splash_mqa_dkv_segmented_no_residuals, ...
    assert {k.split("_")[2] for k in report.tpu_kernels if k.startswith("splash_")} == {"fwd", "dkv", "dq"}
    if sequence > 1:  # load-balanced (512 = 2 x 2 parts of 128): the queries go there and back by permutes
        assert report.collectives.get("all-gather", 0) and report.collectives.get("reduce-scatter", 0)
        assert report.collectives.get("collective-permute", 0) >= 4


@pytest.mark.slow
def test_aot_compile_for_tpu_runs_splash_with_sink_logits():
    """gpt-oss's sinks reach the kernel, its heads (and sinks) split over tensor: the train step
    compiles for a TPU slice with the splash kernels of both its local and its global layers."""
    from tessera.train_compile import compile_for_topology

    cfg = build_config({"compile_topology": "v5e-4", "dtype": "bfloat16", "attention": "flash",
                        "max_target_length": 256, "per_device_batch_size": 1, "ici_tensor_parallelism": 2,
                        "decoder_block": "gpt_oss", "base_num_decoder_layers": 2, "sliding_window_size": 128,
                        "num_experts": 4, "num_experts_per_tok": 2, "attention_sink": True, "attention_bias": True,
                        "mlp_bias": True, "mlp_activations": ["sigmoid", "linear"], "mlp_activations_limit": 7.0,
                        "sparse_matmul": True})
    report = compile_for_topology(cfg)
    assert report.fits and report.attention_kernel == "splash"
    assert report.custom_calls.get("tpu_custom_call", 0) >= 6  # forward, dK/dV and dQ kernels of two layers


def test_aot_compile_for_tpu_runs_the_prompts_prefill_with_splash():
    """decode.py on a TPU slice: the prefill (prompts padded on the left to 128 tokens) compiles with
    the splash kernel, where the reference compiles none."""
    from tessera.decode import _prefill_kernel, prefill_program, prompt_width
    from tessera.hardware import tpu_slice
    from tessera.mesh import create_mesh, named_shardings
    from tessera.train_compile import topology_devices

    cfg = tiny_config(dtype="bfloat16", attention="flash", max_target_length=256, base_num_decoder_layers=2)
    mesh = create_mesh(cfg.mesh, topology_devices(tpu_slice("v5e-4"), 1))
    decoding = dict(prompts=[[1, 2, 3], [4, 5]], max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0)
    kernel = _prefill_kernel(cfg, mesh, decoding)
    assert kernel == "splash" and prompt_width(decoding["prompts"], kernel) == 128
    calls = {}
    for name in (kernel, "dot_product"):
        model = build_model(cfg.model, name)
        shardings = named_shardings(mesh, model.logical_axes(), model.param_shapes())
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                              model.param_shapes(), shardings)
        with jax.set_mesh(mesh):
            calls[name] = prefill_program(model, params, **decoding).as_text().count("tpu_custom_call")
    assert calls == {"splash": 1, "dot_product": 0}  # the forward kernel, in the scanned layers' body
