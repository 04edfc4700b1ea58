"""Model behaviour: scan == loop, remat policies == none, GQA, causality, loss masking."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, tiny_config
from tessera.config import ConfigError, load_config
from tessera.config.fields import REMAT_POLICIES
from tessera.models import build_model
from tessera.models.attention import dot_product_attention
from tessera.models.attention_choice import select_attention
from tessera.losses import loss_sums


def _batch(cfg, seed=0, batch=2):
    rng = np.random.default_rng(seed)
    t = cfg.data.max_target_length + 1
    return {"tokens": jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, t)), jnp.int32),
            "segment_ids": jnp.ones((batch, t), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))}


def _unstack(params, num_layers):
    """Scanned layout {'layers': stacked} -> unscanned {'layers_0': ..., ...}."""
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(num_layers):
        out[f"layers_{i}"] = jax.tree.map(lambda x: x[i], params["layers"])
    return out


def test_scan_and_loop_compute_the_same_function():
    scanned = build_model(tiny_config(scan_layers=True).model)
    looped = build_model(tiny_config(scan_layers=False).model)
    params = scanned.init(jax.random.key(1))
    tokens = _batch(tiny_config())["tokens"][:, :-1]
    # jitted: one compile each instead of the unrolled layers' many op-by-op dispatches
    a = jax.jit(scanned.apply)(params, tokens)
    b = jax.jit(looped.apply)(_unstack(params, 3), tokens)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # and they start from the same weights: a run may switch scan_layers and keep its seed's model
    jax.tree.map(np.testing.assert_array_equal, looped.init(jax.random.key(1)), _unstack(params, 3))


# remat_policy=custom: every choice on some of MaxText's per-tensor keys
_CUSTOM = dict(decoder_layer_input="offload", query_proj="device", value_proj="offload", out_proj="device",
               mlpwi_0="device", mlpwi="offload", mlpwo="device")


@functools.cache
def _remat_grads(policy: str, scan: bool):
    """The gradients of the tiny model with `policy`; the reference (policy none) is computed once per
    layout for all the policies compared with it."""
    custom = _CUSTOM if policy == "custom" else {}
    cfg = tiny_config(scan_layers=scan, remat_policy=policy, **custom)
    model, batch = build_model(cfg.model), _batch(tiny_config(scan_layers=scan))
    params = model.init(jax.random.key(0))
    return jax.jit(jax.grad(lambda p: loss_sums(model, p, batch, None)[0]))(params)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.slow
def test_remat_policy_gives_same_gradients(policy, scan):
    reference, got = _remat_grads("none", scan), _remat_grads(policy, scan)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), reference, got)


def test_grouped_query_attention_equals_repeated_kv_heads():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 7, 6, 4)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 7, 2, 4)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 7, 2, 4)), jnp.float32)
    seg = jnp.ones((2, 7), jnp.int32)
    grouped = dot_product_attention(q, k, v, seg, seg)
    full = dot_product_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), seg, seg)
    np.testing.assert_allclose(grouped, full, rtol=1e-6, atol=1e-6)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(grouped, ref, rtol=1e-5, atol=1e-5)


def test_chunked_causal_attention_equals_one_block():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 384, 4, 8)), jnp.float32)  # 3 chunks of 128 queries
    k = jnp.asarray(rng.normal(size=(2, 384, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 384, 2, 8)), jnp.float32)
    seg = jnp.asarray(np.repeat([[1, 2, 3]], 128, axis=1).repeat(2, axis=0), jnp.int32)  # packed documents
    got = dot_product_attention(q, k, v, seg, seg)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                       mask=(seg[:, None, :, None] == seg[:, None, None, :]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t, window, chunk", [(7, 3, 0), (7, 0, 3), (384, 200, 0), (384, 0, 96)])
def test_a_window_or_chunk_of_attention_sees_the_documented_keys(t, window, chunk):
    """dot_product_attention's docstring: with `window` a query sees the `window` most recent positions, itself
    included; with `chunk` the earlier keys of its own chunk (index // chunk). Against an explicit mask, in one
    block (7 tokens) and in query chunks of 128 (384 tokens, whose first keys each chunk leaves out).
    (The tests of the kernels and of decoding that also check it are slow.)"""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, n, 8)), jnp.float32) for n in (4, 2, 2))
    seg = jnp.ones((1, t), jnp.int32)
    got = dot_product_attention(q, k, v, seg, seg, window=window, chunk=chunk)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    visible = (i - j < window) if window else (i // chunk == j // chunk)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                       mask=jnp.asarray(visible)[None, None])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_chunked_attention_adds_key_and_value_gradients_over_chunks_in_float32():
    """The keys' and values' gradients are sums over the query chunks (4 here); added in float32
    and rounded once, they are as close to the float32 gradients as the queries' gradient, which
    is no sum (each chunk's queries get theirs from one chunk). Rounding each chunk's part and
    adding in bfloat16 made them 25% further off with these inputs."""
    rng = np.random.default_rng(2)
    shape_q, shape_kv = (2, 512, 4, 16), (2, 512, 2, 16)
    q, k, v, g = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in (shape_q, shape_kv, shape_kv, shape_q))
    seg = jnp.asarray(np.repeat([[1, 2]], 256, axis=1).repeat(2, axis=0), jnp.int32)

    def grads(dtype):
        attend = lambda q, k, v: dot_product_attention(q, k, v, seg, seg)  # noqa: E731
        return jax.jit(lambda *a: jax.vjp(attend, *a)[1](g.astype(dtype)))(*(a.astype(dtype) for a in (q, k, v)))

    def relative_rms_error(got, ref):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))

    errors = [relative_rms_error(a, b) for a, b in zip(grads(jnp.bfloat16), grads(jnp.float32))]
    dq, dk, dv = errors
    assert dq < 0.004, errors  # bfloat16 accuracy
    assert dk < 1.1 * dq and dv < 1.1 * dq, errors


def test_model_is_causal():
    model = build_model(tiny_config().model)
    params = model.init(jax.random.key(0))
    tokens = _batch(tiny_config())["tokens"][:, :-1]
    changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 96)
    a, b = model.apply(params, tokens), model.apply(params, changed)
    np.testing.assert_allclose(a[:, :8], b[:, :8], rtol=1e-6, atol=1e-6)
    assert not np.allclose(a[:, 8:], b[:, 8:])


def test_loss_shifts_targets_and_masks_padding():
    cfg = tiny_config()
    model = build_model(cfg.model)
    params = model.init(jax.random.key(0))
    batch = _batch(cfg, batch=1)
    tokens = batch["tokens"]
    # reference: explicit next-token cross-entropy over the first 8 targets
    logits = model.apply(params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    ref = -sum(float(logp[0, t, tokens[0, t + 1]]) for t in range(8))
    padded = dict(batch, segment_ids=batch["segment_ids"].at[:, 9:].set(0),
                  tokens=tokens.at[:, 9:].set(0))
    total, count = loss_sums(model, params, padded, None)
    assert int(count) == 8
    np.testing.assert_allclose(float(total), ref, rtol=1e-5)


def test_tied_embeddings_have_no_output_matrix():
    model = build_model(tiny_config(logits_via_embedding=True).model)
    assert "logits_dense_dv" not in model.param_shapes()
    params = model.init(jax.random.key(0))
    assert model.apply(params, _batch(tiny_config())["tokens"][:, :-1]).shape == (2, 12, 96)


def test_dropout_changes_training_outputs_only_with_a_key():
    model = build_model(tiny_config(enable_dropout=True, dropout_rate=0.5).model)
    params = model.init(jax.random.key(0))
    tokens = _batch(tiny_config())["tokens"][:, :-1]
    a = model.apply(params, tokens)
    np.testing.assert_array_equal(a, model.apply(params, tokens))
    b = model.apply(params, tokens, dropout_key=jax.random.key(3))
    assert not np.allclose(a, b)


def test_bfloat16_compute():
    model = build_model(tiny_config(dtype="bfloat16", weight_dtype="float32").model)
    params = model.init(jax.random.key(0))
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    out = model.apply(params, _batch(tiny_config())["tokens"][:, :-1])
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("requested, platform, dtype, head_dim, kernel, why", [
    ("dot_product", "gpu", "bfloat16", 128, "dot_product", "requested"),
    ("autoselected", "cpu", "bfloat16", 128, "dot_product", "platform 'cpu'"),
    ("flash", "tpu", "bfloat16", 128, "splash", "Pallas splash attention on TPU"),
    ("flash", "tpu", "float16", 128, "dot_product", "Mosaic cannot compile its float16 loads"),
    ("cudnn_flash_te", "gpu", "float32", 128, "dot_product", "bfloat16/float16"),
    ("autoselected", "gpu", "bfloat16", 100, "dot_product", "multiple of 8"),
    ("autoselected", "gpu", "bfloat16", 128, "cudnn", "cuDNN"),
])
def test_attention_selection_falls_back_with_a_reason(requested, platform, dtype, head_dim, kernel, why):
    cfg = tiny_config(attention=requested, dtype=dtype, head_dim=head_dim, max_target_length=256)
    choice = select_attention(cfg.model, platform, cfg.data.max_target_length)
    assert choice.kernel == kernel and why in choice.reason


@pytest.mark.parametrize("family", [dict(attn_logits_soft_cap=50.0), dict(attention_sink=True),
                                    dict(decoder_block="llama4", chunk_attn_window_size=64,
                                                                 base_num_decoder_layers=4)])
def test_a_cpu_run_is_told_that_the_cpu_has_no_fused_kernel(family):
    """A family feature cuDNN lacks (Gemma 2's soft cap, gpt-oss's sinks, Llama 4's chunks) was named as
    the reason on a CPU too ('attn_logits_soft_cap=50 needs the reference kernel (no fused kernel here caps
    scores)'), as if that model without it would get a fused kernel there."""
    cfg = tiny_config(attention="flash", dtype="bfloat16", max_target_length=256, **family)
    assert select_attention(cfg.model, "cpu", 256) == ("dot_product",
                                                       "no fused attention kernel is wired for platform 'cpu'")
    assert select_attention(cfg.model, "gpu", 256, {}, "NVIDIA H100 80GB HBM3", "9.0").kernel == "dot_product"


@pytest.mark.parametrize("overrides, mesh, kind, cc, kernel, why", [
    # jax's cuDNN path refuses ("Sharding on sequence dim is not allowed") queries split over the sequence
    ({}, {"sequence": 2}, "NVIDIA H100 80GB HBM3", "9.0", "dot_product", "sequence=2"),
    # ... and queries, keys and values split unlike each other: 2 kv heads stay whole on tensor=4
    ({"base_num_query_heads": 8}, {"tensor": 4}, "NVIDIA H100 80GB HBM3", "9.0", "dot_product", "num_kv_heads=2"),
    ({"base_num_query_heads": 8}, {"tensor": 2}, "NVIDIA H100 80GB HBM3", "9.0", "cudnn", "cuDNN"),
    # MLA expands its keys to every query head: they split like the queries
    ({"model_name": "deepseek-small"}, {"tensor": 4}, "NVIDIA H100 80GB HBM3", "9.0", "cudnn", "cuDNN"),
    # ... and pads its queries and keys to values wider than them: the kernel sees that width
    ({"model_name": "deepseek-small", "v_head_dim": 160}, {}, "NVIDIA A100-SXM4-80GB", "8.0", "dot_product",
     "head_dim <= 128 before Hopper (compute capability 8.0) and a multiple of 8, not 160 (v_head_dim"),
    # head sizes above 128 need Hopper (gemma-7b's 256 on an A100)
    ({"head_dim": 256}, {}, "NVIDIA A100-SXM4-80GB", "8.0", "dot_product", "head_dim <= 128 before Hopper"),
    ({"head_dim": 256}, {}, "NVIDIA H100 80GB HBM3", "9.0", "cudnn", "cuDNN"),
    ({"head_dim": 128}, {}, "NVIDIA A100-SXM4-80GB", "8.0", "cudnn", "cuDNN"),
    # cuDNN's fused attention needs Ampere (SM80) or later, which JAX does not check: a T4 or V100 was given it
    ({"head_dim": 128}, {}, "Tesla T4", "7.5", "dot_product", "Ampere or later GPU (compute capability 8.0 or above), "
                                                             "not Tesla T4 (compute capability 7.5)"),
    ({"head_dim": 64}, {}, "Tesla V100-SXM2-16GB", "7.0", "dot_product", "compute capability 7.0"),
    ({"head_dim": 128}, {}, "NVIDIA L4", "8.9", "cudnn", "cuDNN"),
    # ROCm builds of JAX have no cuDNN ("cuDNN is not detected" when traced); JAX calls their platform "gpu" too
    ({}, {}, "AMD Instinct MI300X", "gfx942", "dot_product", "NVIDIA GPUs, not on AMD Instinct MI300X"),
    ({}, {}, "", "", "cudnn", "cuDNN"),  # the device unknown (the estimator): as on the recipes' GPUs
])
def test_cudnn_is_chosen_only_where_jax_can_run_it(overrides, mesh, kind, cc, kernel, why):
    values = {"head_dim": 128, **overrides}
    if "model_name" in values:
        keys = [f"{k}={v}" for k, v in values.items() if k != "head_dim"]
        cfg = load_config([str(REPO / "configs" / "base.yml"), *keys, "dtype=bfloat16"], env={})
    else:
        cfg = tiny_config(attention="autoselected", dtype="bfloat16", max_target_length=256, **values)
    choice = select_attention(cfg.model, "gpu", 256, mesh, kind, cc)
    assert choice.kernel == kernel and why in choice.reason, choice


def test_setup_gives_select_attention_the_device(monkeypatch):
    """The trainer passes the device's kind and compute capability, which tell AMD and pre-Hopper GPUs apart."""
    from tessera import step
    from tessera.step import setup

    seen = []
    real = step.select_attention
    monkeypatch.setattr(step, "select_attention", lambda *a: seen.append(a) or real(*a))
    setup(tiny_config(), jax.devices()[:1])
    device = jax.devices()[0]
    assert seen[0][4:] == (device.device_kind, str(getattr(device, "compute_capability", "")), False)


@pytest.mark.parametrize("precision, dots", [("default", "DEFAULT"), ("highest", "HIGHEST"), ("float32", "HIGHEST"),
                                              ("high", "HIGH")])
def test_matmul_precision_reaches_every_product_of_the_train_step_and_decoding(precision, dots):
    """MaxText's matmul_precision (its commands set highest; it was refused): every product of the train step, the
    forward pass and the gradients JAX derives after it (which a context around the forward pass alone missed: 20
    of the 29 products of a tiny model's gradient stayed DEFAULT), and of decoding, lowered with that precision;
    "default" leaves JAX's."""
    from tessera.step import abstract_state, batch_shapes, make_train_step, setup

    trainer = setup(tiny_config(matmul_precision=precision, gradient_accumulation_steps=2, per_device_batch_size=2),
                    jax.devices()[:1])
    text = jax.jit(make_train_step(trainer, 0)).lower(abstract_state(trainer), batch_shapes(trainer)).as_text()
    model = trainer.model
    params = model.param_shapes()
    decode = jax.jit(lambda p, t, c: model.next_logits(p, t, jnp.zeros_like(t), jnp.ones_like(t), c))
    decoding = decode.lower(params, jax.ShapeDtypeStruct((2, 4), jnp.int32), model.init_cache(2, 8)).as_text()
    for program, least in ((text, 25), (decoding, 5)):
        found = re.findall(r"precision = \[(\w+), (\w+)\]", program)
        assert len(found) >= least and set(found) == {(dots, dots)}, (len(found), set(found))


@pytest.mark.slow
def test_pallas_kernels_keep_their_own_precision_under_matmul_precision():
    """matmul_precision=highest reached splash attention's own products too, which Mosaic refuses to compile in
    bfloat16 ("Bad lhs type", splash's forward on v5p, AOT). The kernels (splash, megablox) run at JAX's own precision
    in both passes, the rest of the step at the key's: shown here in their interpreters, with the gradients through
    the kernels unchanged."""
    from tessera.models import matmul_precision
    from tessera.models.grouped import grouped_matmul

    def precisions(text):
        return set(re.findall(r"precision = \[(\w+), \w+\]", text))

    cfg = tiny_config(matmul_precision="highest", max_target_length=128, head_dim=128, base_emb_dim=256).model
    model = build_model(cfg, "splash_interpret")
    params = jax.jit(model.init)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 128), 0, cfg.vocab_size)

    def grads():
        return jax.jit(jax.grad(lambda p: jnp.mean(jax.nn.log_softmax(model.apply(p, tokens))[..., 0])))

    with matmul_precision(cfg):
        text, highest = grads().lower(params).as_text(), grads()(params)
    assert "pallas" in text.lower() or "splash" in text  # the kernel, in its interpreter
    assert precisions(text) == {"HIGHEST", "DEFAULT"}  # the projections and the output layer; the kernel
    lhs, rhs = jax.random.normal(jax.random.key(2), (150, 128)), jax.random.normal(jax.random.key(3), (4, 128, 256))
    sizes = jnp.array([50, 0, 61, 29], jnp.int32)

    def gmm_grads(kernel):
        return jax.jit(jax.grad(lambda l, r: jnp.sum(grouped_matmul(l, r, sizes, kernel) ** 2), (0, 1)))

    with jax.default_matmul_precision("highest"):
        assert precisions(gmm_grads("megablox_interpret").lower(lhs, rhs).as_text()) == {"DEFAULT"}
        kept = gmm_grads("megablox_interpret")(lhs, rhs)
    for a, b in zip(kept, gmm_grads("megablox_interpret")(lhs, rhs)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(highest), jax.tree.leaves(grads()(params))):  # CPUs multiply float32 in full
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_activations_in_float32_computes_the_mlps_nonlinearities_in_float32_and_rounds_once():
    """MaxText's activations_in_float32 (refused before): the dense MLP's and the experts' activations and gated
    product in float32 from bfloat16 projections, rounded once before the output projection; every family's MLPs
    and experts take it (a block building its MLP by hand would not)."""
    from flax import nnx

    from tessera.models.layers import ACTIVATIONS, Mlp
    from tessera.models.moe import MoeMlp
    from tessera.models.registry import BLOCKS
    from test_families import FAMILIES

    cfg = tiny_config(dtype="bfloat16", activations_in_float32=True).model
    mlp = Mlp.of(cfg, nnx.Rngs(params=0))
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.emb_dim), jnp.bfloat16)
    gate, up = (p.astype(jnp.float32) for p in mlp.project_in(x))
    h = (ACTIVATIONS["silu"](gate) * up).astype(jnp.bfloat16)
    want = jnp.einsum("btf,fd->btd", h, mlp.wo_fd[...].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(mlp(x), np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32),
                               rtol=1e-2, atol=1e-2)
    plain = Mlp.of(dataclasses.replace(cfg, activations_in_float32=False), nnx.Rngs(params=0))
    silu = r"call @silu\(%\w+\) : \(tensor<[\dx]+x(\w+)>"  # jax.nn.silu's function in the lowered program
    assert re.findall(silu, jax.jit(mlp).lower(x).as_text()) == ["f32"]
    assert re.findall(silu, jax.jit(plain).lower(x).as_text()) == ["bf16"]  # bfloat16 without the key
    moe = MoeMlp(dataclasses.replace(cfg, num_experts=4, num_experts_per_tok=2, decoder_block="mixtral"),
                 nnx.Rngs(params=0))
    projections = [jnp.ones((3, 7), jnp.bfloat16) * 0.3, jnp.ones((3, 7), jnp.bfloat16)]
    assert re.findall(silu, jax.jit(moe.gated).lower(projections).as_text()) == ["f32"]
    assert moe.gated(projections).dtype == jnp.bfloat16
    for family, keys in FAMILIES.items():
        model = nnx.eval_shape(lambda: BLOCKS[keys["decoder_block"]](
            tiny_config(**keys, activations_in_float32=True).model, "dot_product", nnx.Rngs(params=0)))
        mlps = [m for _, m in nnx.iter_graph(model) if isinstance(m, Mlp)]
        experts = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoeMlp)]
        assert mlps or experts, family
        assert all(m.in_fp32 for m in mlps) and all(m.cfg.activations_in_float32 for m in experts), family


def test_packed_batches_are_logged_as_the_reference_on_gpu():
    """Packed batches (packing=true, a real dataset: the default) always ran the reference on GPUs
    while the log said cuDNN; the choice now says so."""
    cfg = tiny_config(attention="cudnn_flash_te", dtype="bfloat16", head_dim=128, max_target_length=256)
    choice = select_attention(cfg.model, "gpu", 256, {}, "NVIDIA H100 80GB HBM3", "9.0", True)
    assert choice.kernel == "dot_product" and "packing=true" in choice.reason
    assert select_attention(cfg.model, "gpu", 256, {}, "NVIDIA H100 80GB HBM3", "9.0", False).kernel == "cudnn"
    assert select_attention(cfg.model, "tpu", 256, {}, "TPU v5", "", True).kernel == "splash"  # splash takes segments


@pytest.mark.parametrize("model_file", sorted(p.stem for p in (REPO / "configs" / "models").glob("*.yml")))
def test_every_family_gets_a_kernel_that_has_its_features(model_file, monkeypatch, caplog):
    """Through `setup`, as a bf16 run on GPUs goes: a family whose attention soft-caps its scores
    (Gemma 2) or has sink logits (gpt-oss) must not get cuDNN's fused attention, which has neither;
    the others get it."""
    import logging

    from tessera.step import setup

    # gemma3: one whole 5-local/1-global pattern at least; deepseek-v3: its 3 dense layers and an expert layer;
    # llama4: one 4-layer pattern; olmo3: one 3-local/1-global pattern; qwen3-next: one 3-linear/1-full pattern
    layers = 6 if model_file.startswith("gemma3") else 4 if model_file in (
        "deepseek-v3", "llama4-17b-16e", "llama4-17b-128e") or model_file.startswith(("olmo3", "qwen3-next")) else 2
    cfg = load_config([str(REPO / "configs" / "base.yml"), f"model_name={model_file}", "dtype=bfloat16",
                       f"base_num_decoder_layers={layers}", "per_device_batch_size=1"], env={})
    monkeypatch.setattr("tessera.step.device_platform", lambda mesh: "gpu")
    with caplog.at_level(logging.INFO, logger="tessera"):
        trainer = setup(cfg, jax.devices()[:1])
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention kernel:")]
    assert len(chosen) == 1
    if cfg.model.attn_logits_soft_cap:
        assert "dot_product (attn_logits_soft_cap" in chosen[0] and trainer.model.attention_kernel == "dot_product"
    elif cfg.model.attention_sink:
        assert "dot_product (attention_sink=true" in chosen[0] and trainer.model.attention_kernel == "dot_product"
    elif cfg.model.chunk_attn_window_size:  # 8192-token chunks in sequences of 128: the whole causal past
        assert chosen[0].startswith("attention kernel: cudnn") and trainer.model.attention_kernel == "cudnn"
        longer = load_config([str(REPO / "configs" / "base.yml"), f"model_name={model_file}", "dtype=bfloat16",
                              "max_target_length=16384"], env={})
        choice = select_attention(longer.model, "gpu", longer.data.max_target_length)
        assert choice.kernel == "dot_product" and "no chunk mask" in choice.reason, choice
    else:
        assert chosen[0].startswith("attention kernel: cudnn") and trainer.model.attention_kernel == "cudnn"


def test_llama4_chunked_layers_attend_within_their_chunks_whatever_kernel_was_chosen(monkeypatch):
    """The cuDNN branch passed a window but not Llama 4's chunks: on GPUs its chunked layers attended
    over the whole causal past once sequences outgrew chunk_attn_window_size (the model trained was
    another). cuDNN's math is run here through XLA's implementation of the same call."""
    from flax import nnx

    from tessera.models.decoder import Decoder

    cfg = load_config([str(REPO / "configs" / "base.yml"), "model_name=llama4-17b-16e", "base_num_decoder_layers=4",
                       "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8",
                       "base_mlp_dim=32", "base_moe_mlp_dim=32", "num_experts=2", "vocab_size=64",
                       "chunk_attn_window_size=8", "max_target_length=32", "attention=flash"], env={})
    assert select_attention(cfg.model, "gpu", 32).kernel == "dot_product"
    fused = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **k: fused(*a, implementation="xla", **k))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 32)), jnp.int32)
    outs = {kernel: np.asarray(Decoder(cfg.model, kernel, nnx.Rngs(params=0))(tokens)[0], np.float32)  # the logits
            for kernel in ("dot_product", "cudnn")}
    np.testing.assert_allclose(outs["cudnn"], outs["dot_product"], atol=1e-5)


def _llama3_reference_frequencies(head_dim, theta, factor, low, high, original):
    """Llama 3.1's rule written branch by branch, one frequency at a time."""
    out = []
    for i in range(head_dim // 2):
        freq = 1.0 / theta ** (2 * i / head_dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
        elif wavelength > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_llama3_rope_scaling_follows_the_published_rule():
    from tessera.models.attention import rope_frequencies_of

    cfg = load_config([str(REPO / "configs" / "base.yml"), "model_name=llama3.1-8b"], env={}).model
    assert cfg.rope_scaling == "llama3"
    got = rope_frequencies_of(cfg)
    want = _llama3_reference_frequencies(128, 500000, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = rope_frequencies_of(dataclasses.replace(cfg, rope_scaling="none"))
    assert got[0] == plain[0] and np.isclose(got[-1], plain[-1] / 8)  # high kept, low divided by the factor
    mixed = (got != plain) & ~np.isclose(got, plain / 8)
    assert mixed.sum() > 0  # some frequencies lie between the two limits
    # Llama 4 Scout's rule has no band to mix in (both factors 1): each frequency is kept or divided
    scout = dataclasses.replace(cfg, rope_high_freq_factor=1.0, rope_scaling_factor=16.0)
    np.testing.assert_allclose(rope_frequencies_of(scout), _llama3_reference_frequencies(128, 500000, 16.0, 1.0, 1.0, 8192),
                               rtol=1e-6)
    with pytest.raises(ConfigError, match="rope_high_freq_factor=0.5 must be at least rope_low_freq_factor=1.0"):
        load_config([str(REPO / "configs" / "base.yml"), "rope_scaling=llama3", "rope_high_freq_factor=0.5"], env={})


def test_fused_mlp_equals_two_projections():
    batch = _batch(tiny_config())
    unfused = build_model(tiny_config().model)
    fused = build_model(tiny_config(fused_mlp=True).model)
    params = unfused.init(jax.random.key(0))
    mlp = params["layers"]["mlp"]
    fused_mlp = {"wi_dcf": jnp.stack([mlp["wi_0"], mlp["wi_1"]], axis=-2), "wo_fd": mlp["wo_fd"]}
    fused_params = dict(params, layers=dict(params["layers"], mlp=fused_mlp))
    assert jax.tree.map(jnp.shape, fused.param_shapes()) == jax.tree.map(jnp.shape, fused_params)
    tokens = batch["tokens"][:, :-1]
    np.testing.assert_allclose(jax.jit(fused.apply)(fused_params, tokens), jax.jit(unfused.apply)(params, tokens),
                               rtol=1e-6, atol=1e-6)
    mean_loss = lambda model, p: jnp.divide(*loss_sums(model, p, batch, None))  # noqa: E731  (as the train step)
    # jitted: one compile, not op by op
    grad = lambda model, p: jax.jit(jax.grad(lambda q: mean_loss(model, q)))(p)  # noqa: E731
    got, want = grad(fused, fused_params), grad(unfused, params)
    want_mlp = want["layers"]["mlp"]
    want["layers"]["mlp"] = {"wi_dcf": jnp.stack([want_mlp["wi_0"], want_mlp["wi_1"]], axis=-2),
                             "wo_fd": want_mlp["wo_fd"]}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)
    with pytest.raises(ConfigError, match=r"fused_mlp=true fuses the gate and up .* set fused_mlp=false"):
        tiny_config(fused_mlp=True, mlp_activations=["gelu"])
    # the Hugging Face converter stacks gate_proj and up_proj into wi_dcf, exactly both ways
    from tessera.tools.hf_layouts import layout_for

    rule = next(r for r in layout_for(fused.cfg).layer_rules if r.ours == ("mlp/wi_dcf",))
    gate, up = np.arange(40 * 24.0).reshape(40, 24), -np.arange(40 * 24.0).reshape(40, 24)
    (w,) = rule.to_ours(gate, up)
    assert w.shape == (24, 2, 40) and np.array_equal(w[:, 0], gate.T) and np.array_equal(w[:, 1], up.T)
    assert all(np.array_equal(a, b) for a, b in zip(rule.to_hf(w), (gate, up)))


def test_vocab_tiling_gives_same_loss_and_gradients():
    batch = _batch(tiny_config())
    batch["segment_ids"] = batch["segment_ids"].at[1, 9:].set(0)  # some padding: weights matter

    def loss_and_grads(tiles):
        model = build_model(tiny_config(num_vocab_tiling=tiles).model)
        return jax.jit(jax.value_and_grad(lambda p: jnp.divide(*loss_sums(model, p, batch, None))))(
            model.init(jax.random.key(0)))

    (want_loss, want), (got_loss, got) = loss_and_grads(1), loss_and_grads(3)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)
    with pytest.raises(ConfigError, match=r"num_vocab_tiling=5 must divide .* per_device_batch_size=1 x "
                                          r"max_target_length=12 / gradient_accumulation_steps=1 = 12"):
        tiny_config(num_vocab_tiling=5)


@pytest.mark.parametrize("spec, shapes", [
    ("btd,df->btf", [(2, 9, 16), (16, 40)]),  # x smaller than the output: x^T g
    ("btf,fd->btd", [(2, 9, 40), (40, 16)]),  # output smaller: g^T x, result transposed to w's order
    ("btd,dnh->btnh", [(2, 9, 16), (16, 4, 8)]),  # w with two output axes
    ("btnh,nhd->btd", [(2, 9, 4, 8), (4, 8, 16)]),  # w with two contracted axes
    ("bkgth,bksh->bkgts", [(2, 3, 2, 5, 8), (2, 3, 7, 8)]),  # attention scores: batch axes b, k
    ("bkgts,bksh->bkgth", [(2, 3, 2, 5, 7), (2, 3, 7, 8)]),  # attention's weighted values
    ("btd,de->bt", [(2, 9, 16), (16, 6)]),  # an axis of w only: the plain gradient
])
def test_cpu_projection_gradients_equal_the_einsums(spec, shapes):
    """float32 on XLA:CPU: `project`'s output and both gradients equal the einsum's for every
    layout of the weight gradient (`_canonical_operand_grad`), including its fallback."""
    from tessera.models.layers import project

    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x, w = jax.random.normal(kx, shapes[0]), jax.random.normal(kw, shapes[1])
    out, vjp = jax.vjp(lambda x_, w_: project(spec, x_, w_), x, w)
    ref_out, ref_vjp = jax.vjp(lambda x_, w_: jnp.einsum(spec, x_, w_), x, w)
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-5)
    g = jax.random.normal(kg, out.shape)
    for got, want in zip(vjp(g), ref_vjp(g)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_cpu_weight_gradients_run_in_ynnpack_fusions():
    """The point of `_canonical_operand_grad`: in the compiled gradient of a projection on
    XLA:CPU no matmul is left as a plain `dot` (outside YNNPACK), while the einsum's own
    gradient leaves the weight gradient as one."""
    from tessera.models.layers import project

    x, w = jnp.ones((4, 128, 256)), jnp.ones((256, 384))

    def plain_dots(fn):
        hlo = jax.jit(jax.grad(lambda x_, w_: jnp.sum(fn(x_, w_) ** 2), argnums=(0, 1))).lower(x, w).compile().as_text()
        entry = hlo[hlo.index("ENTRY"):]
        return len(re.findall(r"= f32\[[\d,]*\]\S* dot\(", entry))

    assert plain_dots(lambda x_, w_: jnp.einsum("btd,df->btf", x_, w_)) >= 1
    assert plain_dots(lambda x_, w_: project("btd,df->btf", x_, w_)) == 0


def test_cpu_weight_gradient_transposes_the_small_result_not_the_large_activation():
    """The MLP's down projection (x [B, T, F] larger than its output [B, T, D]): the weight
    gradient is g^T x, made as [D, F] and transposed to w's [F, D]. XLA:CPU must not swap the
    operands to make [F, D] directly, which transposed all of x ([F, B*T]) in every layer."""
    from tessera.models.layers import project

    x, w = jnp.ones((4, 128, 384)), jnp.ones((384, 96))
    hlo = jax.jit(jax.grad(lambda x_, w_: jnp.sum(project("btf,fd->btd", x_, w_) ** 2), argnums=(0, 1))
                  ).lower(x, w).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert not re.findall(r"= f32\[384,512\]", entry), "x was transposed for the weight gradient"
    assert re.findall(r"= f32\[96,384\]", entry)  # the product in the matmul's order, then transposed


@pytest.mark.parametrize("policy", ["none", "full", "save_dot_except_mlp", "custom"])
@pytest.mark.slow
def test_bfloat16_training_gradients_follow_float32(policy):
    """The tiny model's bfloat16 gradient stays close to float32's under each kind of remat policy."""
    custom = _CUSTOM if policy == "custom" else {}
    batch = _batch(tiny_config())
    grads = {}
    for dtype in ("float32", "bfloat16"):
        model = build_model(tiny_config(dtype=dtype, remat_policy=policy, **custom).model)
        params = model.init(jax.random.key(0))
        step = jax.jit(jax.grad(lambda p: loss_sums(model, p, batch, None)[0]))
        grads[dtype] = step(params)
    for a, b in zip(jax.tree.leaves(grads["float32"]), jax.tree.leaves(grads["bfloat16"])):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, rtol=0.1, atol=0.05 * float(np.max(np.abs(a))) + 1e-6)


def test_float16_compute_gradients_follow_float32():
    """dtype=float16 (float32 weights) trains on CPU: attention's score product asks for a float32
    result of float16 operands, and that product's gradient takes a float32 cotangent (it raised
    a type error before). Its gradient stays close to float32's."""
    batch = _batch(tiny_config())
    grads = {}
    for dtype in ("float32", "float16"):
        model = build_model(tiny_config(dtype=dtype, remat_policy="full").model)
        params = model.init(jax.random.key(0))
        grads[dtype] = jax.jit(jax.grad(lambda p: loss_sums(model, p, batch, None)[0]))(params)
    for a, b in zip(jax.tree.leaves(grads["float32"]), jax.tree.leaves(grads["float16"])):
        assert b.dtype == jnp.float32 and np.all(np.isfinite(b))
        np.testing.assert_allclose(b, a, rtol=0.02, atol=0.01 * float(np.max(np.abs(a))) + 1e-6)


def test_float16_weights_are_refused_for_training_with_what_to_use(tmp_path, capsys):
    """AdamW's moments in float16 turn the first update into NaN: training refuses the setting at
    start-up, in one line, before compiling (exit code 2)."""
    from tessera.train import main

    argv = [str(REPO / "configs" / "base.yml"), "run_name=f16", f"base_output_directory={tmp_path}",
            "weight_dtype=float16", "steps=1", "base_num_decoder_layers=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "config error: weight_dtype=float16 cannot be trained" in err and "weight_dtype=bfloat16" in err
    assert "Traceback" not in err
