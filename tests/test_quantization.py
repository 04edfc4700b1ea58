"""Quantized training (quantization=int8|fp8|fp8_full, on qwix): the projections really run
in int8 / float8 in the compiled step, close to float32 in value and in training, with float32
master weights; bad modes and devices are refused before compiling."""

import json
import os
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

from tessera.config import ConfigError
from tessera.models.layers import project
from tessera.models.quantization import check_platform, quantize_params
from tessera.step import abstract_state, compile_step, make_train_step, setup
from tessera.train import run
from tessera.train_compile import low_precision_dots

# quantized dots in the tiny model's step (its 3 layers are scanned: one layer body): q, k, v,
# o, the MLP's two input and one output projections, each forward and in its two gradients
PROJECTION_DOTS = 7 * 3


def _lowered_dots(mode: str, **overrides) -> Counter:
    """(lhs type, rhs type) -> count of the dot_generals in the lowered train step."""
    trainer = setup(tiny_config(quantization=mode, **overrides), jax.devices()[:1])
    shape = (trainer.plan.global_batch, trainer.plan.max_target_length + 1)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
             for k in ("tokens", "segment_ids", "positions")}
    with jax.set_mesh(trainer.mesh):
        text = jax.jit(make_train_step(trainer, 0)).lower(abstract_state(trainer), batch).as_text()
    return Counter(re.findall(r"stablehlo.dot_general.*?\(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)", text))


@pytest.mark.parametrize("mode", ["int8", "fp8", "fp8_full", "nanoo_fp8"])
def test_the_step_runs_the_projections_quantized(mode):
    """The lowered step: every projection's forward product and both gradient products take
    int8 operands (int8) or float8 e4m3 with e5m2 gradients (fp8); the logits too with
    fp8_full; attention's own products and the float32 reference stay float32."""
    dots = _lowered_dots(mode)
    fwd, bwd = ("f8E4M3FNUZ", "f8E5M2FNUZ") if mode == "nanoo_fp8" else ("f8E4M3FN", "f8E5M2")
    low = {types: n for types, n in dots.items() if any(t in ("i8", fwd, bwd) for t in types)}
    logits = 3 if mode == "fp8_full" else 0
    assert sum(low.values()) == PROJECTION_DOTS + logits, dots
    if mode == "int8":
        assert set(low) == {("i8", "i8")}
    else:  # forward e4m3 x e4m3; each gradient product takes the e5m2 gradient and an e4m3 residual
        assert low[(fwd, fwd)] == 7 + logits // 3
        assert sum(n for (a, b), n in low.items() if bwd in (a, b)) == 14 + 2 * logits // 3
    assert all(t == "f32" for types in set(dots) - set(low) for t in types)  # attention products, loss
    assert not [t for t in _lowered_dots("") if set(t) != {"f32"}]


def test_capacity_routed_experts_are_quantized_too():
    """Mixtral blocks with capacity routing: the experts' input and output projections (and the
    attention's) run in int8; the router and the dispatch/combine einsums stay float."""
    dots = _lowered_dots("int8", decoder_block="mixtral", num_experts=4, num_experts_per_tok=2)
    int8 = sum(n for types, n in dots.items() if types == ("i8", "i8"))
    assert int8 == (4 + 3) * 3, dots  # q, k, v, o and the experts' 3 projections, forward and 2 gradients
    assert all(t in ("i8", "f32") for types in dots for t in types)


def test_dropless_experts_run_quantized_grouped_matmuls():
    """Dropless routing: the experts' grouped matmuls are qwix's quantized ragged dots. JAX
    lowers a ragged dot on CPU to dense products over the expert groups (operands with the
    4 experts leading), which must all take int8 operands, forward and backward."""
    def grouped(mode):
        trainer = setup(tiny_config(quantization=mode, decoder_block="mixtral", num_experts=4, num_experts_per_tok=2,
                                    sparse_matmul=True), jax.devices()[:1])
        shape = (trainer.plan.global_batch, trainer.plan.max_target_length + 1)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=trainer.batch_sharding)
                 for k in ("tokens", "segment_ids", "positions")}
        with jax.set_mesh(trainer.mesh):
            text = jax.jit(make_train_step(trainer, 0)).lower(abstract_state(trainer), batch).as_text()
        types = re.findall(r"stablehlo.dot_general.*?\(tensor<([^>]*)>, tensor<([^>]*)>\)", text)
        return [(a.rsplit("x", 1)[1], b.rsplit("x", 1)[1]) for a, b in types if a.startswith("4x") and b.startswith("4x")]

    plain, quantized = grouped(""), grouped("int8")
    assert len(quantized) == len(plain) >= 6 and {t for types in plain for t in types} == {"f32"}
    assert all(types == ("i8", "i8") for types in quantized), quantized


def test_xla_cpu_keeps_the_int8_products_in_int8():
    """XLA:CPU runs int8 x int8 -> int32 dots as such (it emulates float8 ones in float32, so
    for fp8 only the lowered program shows them; a TPU compile keeps them, see Quantization.md)."""
    trainer = setup(tiny_config(quantization="int8"), jax.devices()[:1])
    assert low_precision_dots(compile_step(trainer, 0)[0].as_text()) == {"s8": PROJECTION_DOTS}


@pytest.mark.parametrize("mode, rtol", [("int8", 0.02), ("fp8", 0.08)])
def test_quantized_projection_is_close_to_float(mode, rtol):
    """Per-channel scales: the product and both gradients within a few percent of float32."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (4, 16, 64)), jax.random.normal(kw, (64, 48)) * 0.1
    g = jax.random.normal(kg, (4, 16, 48))
    out, vjp = jax.vjp(lambda x_, w_: project("btd,df->btf", x_, w_, quantization=mode), x, w)
    ref, ref_vjp = jax.vjp(lambda x_, w_: jnp.einsum("btd,df->btf", x_, w_), x, w)
    for got, want in [(out, ref), *zip(vjp(g), ref_vjp(g))]:
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < rtol


@pytest.mark.parametrize("mode, rtol", [("int8", 0.02), ("fp8", 0.08), ("nanoo_fp8", 0.08)])
def test_float16_operands_keep_their_dtype_through_the_quantized_products(mode, rtol):
    """dtype=float16: qwix (0.1.8) makes int8 products of float16 operands zeros and returns the
    float8 modes' gradients of them in float32 (the step then failed to trace). The projection and
    the experts' grouped matmul give float16 outputs and gradients within the tolerance of
    `test_quantized_projection_is_close_to_float` of the float32 products."""
    from tessera.models.quantization import ragged_dot

    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (4, 16, 64)), jax.random.normal(kw, (64, 48)) * 0.1
    w3, sizes = jnp.stack([w, -w]), jnp.array([40, 24], jnp.int32)
    products = {"project": (lambda x_, w_: project("btd,df->btf", x_, w_, quantization=mode),
                            lambda x_, w_: jnp.einsum("btd,df->btf", x_, w_)),
                "ragged_dot": (lambda x_, w_: ragged_dot(x_.reshape(64, 64), w_, sizes, mode),
                               lambda x_, w_: jax.lax.ragged_dot(x_.reshape(64, 64), w_, sizes))}
    for name, (f, exact) in products.items():
        w_ = w3 if name == "ragged_dot" else w
        g = jax.random.normal(kg, exact(x, w_).shape)
        half, half_vjp = jax.vjp(f, x.astype(jnp.float16), w_.astype(jnp.float16))
        want, want_vjp = jax.vjp(exact, x, w_)
        for got, ref in [(half, want), *zip(half_vjp(g.astype(jnp.float16)), want_vjp(g))]:
            assert got.dtype == jnp.float16, (name, got.dtype)
            assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))) < rtol, name
    # the step of a float16 model traces, compiles and runs
    trainer = setup(tiny_config(quantization=mode, dtype="float16"), jax.devices()[:1])
    assert compile_step(trainer, 0)[0] is not None


_QUALITY: dict = {}
# a tiny model that learns the synthetic walks in 150 steps (8 x 32 tokens a step): its loss falls
# from ln 96 = 4.56 towards the floor ln 4 = 1.39 (4 successors per token) and ends near 1.57
LEARNS = dict(steps=150, log_period=1, enable_checkpointing=False, per_device_batch_size=8, max_target_length=32,
              base_emb_dim=48, base_mlp_dim=96)


def _last_losses(tmp_path, mode: str):
    name = mode or "float32"
    run(tiny_config(tmp_path / name, quantization=mode, **LEARNS), jax.devices()[:1])
    records = [json.loads(x) for x in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 150 and all(np.isfinite(r["grad_norm"]) and np.isfinite(r["loss"]) for r in records)
    return float(np.mean([r["loss"] for r in records[-20:]]))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.slow
def test_quantized_training_follows_float32(mode, tmp_path):
    """150 steps from the same weights and batches: the mean loss of the last 20 steps is within
    0.03 of float32's (measured: float32 1.576, int8 1.569, fp8 1.574), far below the start
    (4.56) and gradients finite all the way."""
    if "float32" not in _QUALITY:
        _QUALITY["float32"] = _last_losses(tmp_path, "")
    f32, quantized = _QUALITY["float32"], _last_losses(tmp_path, mode)
    print(f"{mode}: last-20 mean loss {quantized:.4f} against float32's {f32:.4f}")
    assert abs(quantized - f32) < 0.03
    assert f32 < 1.7


def test_quantized_state_keeps_float32_master_weights():
    trainer = setup(tiny_config(quantization="int8"), jax.devices()[:1])
    leaves = jax.tree.leaves(trainer.model.param_shapes())
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.float32)}


def test_bad_modes_and_devices_are_refused():
    with pytest.raises(ConfigError, match=r"quantization.*choose one of"):
        tiny_config(quantization="int4")
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB has no OCP float8 matrix units"):
        check_platform("fp8", "NVIDIA A100-SXM4-80GB", "gpu")
    check_platform("int8", "NVIDIA A100-SXM4-80GB", "gpu")
    check_platform("fp8_full", "NVIDIA H100 80GB HBM3", "gpu")
    with pytest.raises(ConfigError, match=r"use quantization=nanoo_fp8, its own float8 format"):
        check_platform("fp8", "AMD Instinct MI300X", "gpu")
    check_platform("nanoo_fp8", "AMD Instinct MI300X", "gpu")
    with pytest.raises(ConfigError, match=r"nanoo_fp8 is AMD MI300's float8 format, which NVIDIA H100"):
        check_platform("nanoo_fp8", "NVIDIA H100 80GB HBM3", "gpu")



def test_float8_is_decided_by_the_compute_capability_when_the_gpu_reports_it():
    """NVIDIA's OCP float8 units start at compute capability 8.9 (Ada): GPUs whose names the list misses
    (RTX 4090, RTX 6000 Ada, B300) were refused as having none; those before 8.9 still are."""
    for kind, cc in [("NVIDIA GeForce RTX 4090", "8.9"), ("NVIDIA RTX 6000 Ada Generation", "8.9"),
                     ("NVIDIA B300 SXM6", "10.3"), ("NVIDIA H100 80GB HBM3", "9.0")]:
        check_platform("fp8", kind, "gpu", cc)
    for kind, cc in [("NVIDIA A100-SXM4-80GB", "8.0"), ("Quadro RTX 4000", "7.5")]:
        with pytest.raises(ConfigError, match=rf"{kind} \(compute capability {cc}\) has no OCP float8 matrix units"):
            check_platform("fp8_full", kind, "gpu", cc)
    with pytest.raises(ConfigError, match=r"MI300X has no OCP float8 .* use quantization=nanoo_fp8"):
        check_platform("fp8", "AMD Instinct MI300X", "gpu", "gfx942")  # not an NVIDIA capability: by name


def test_fp8_full_says_when_tied_embeddings_keep_the_logits_unquantized(caplog):
    """With logits_via_embedding the logits are the token table's product, which fp8_full leaves in float
    (the lowered step has fp8 dots for the 7 projections only): set-up says so, where it said nothing."""
    dots = _lowered_dots("fp8_full", logits_via_embedding=True)
    assert sum(n for types, n in dots.items() if "f8E4M3FN" in types) == PROJECTION_DOTS
    with caplog.at_level("WARNING", logger="tessera"):
        setup(tiny_config(quantization="fp8_full", logits_via_embedding=True), jax.devices()[:1])
    assert "logits_via_embedding=true), which stays unquantized" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="tessera"):
        setup(tiny_config(quantization="fp8_full"), jax.devices()[:1])
    assert "unquantized" not in caplog.text

def test_decoding_checks_the_devices_for_the_quantization_mode_as_training_does(caplog):
    """decode.py runs the projections in `quantization` too, but never checked the devices: fp8 on an A100
    or nanoo_fp8 on a TPU went on to the load and the compile, and fp8_full with tied logits ran as fp8
    without the warning. Now refused (or logged) before anything is built or read."""
    from types import SimpleNamespace

    from tessera.decode import load_model

    def devices(platform, kind, cc=""):
        return SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform, device_kind=kind,
                                                                 compute_capability=cc)]))

    with pytest.raises(ConfigError, match=r"quantization=fp8: NVIDIA A100-SXM4-40GB \(compute capability 8.0\) has no"):
        load_model(tiny_config(quantization="fp8", load_parameters_path="unread"),
                   devices("gpu", "NVIDIA A100-SXM4-40GB", "8.0"))
    with pytest.raises(ConfigError, match=r"quantization=nanoo_fp8 is AMD MI300's float8 format, which TPU v6 lite"):
        load_model(tiny_config(quantization="nanoo_fp8", load_parameters_path="unread"), devices("tpu", "TPU v6 lite"))
    with caplog.at_level("INFO", logger="tessera"), pytest.raises(AttributeError):  # the fake mesh stops it after
        load_model(tiny_config(quantization="fp8_full", logits_via_embedding=True, load_parameters_path="unread"),
                   devices("cpu", "cpu"))
    assert "logits_via_embedding=true), which stays unquantized" in caplog.text
    assert "quantization=fp8_full: projections quantized by qwix" in caplog.text


def test_fp8_full_says_logits_dot_in_fp32_leaves_the_logits_in_float8():
    """logits_dot_in_fp32=true with quantization=fp8_full: the logits' product took float8 operands all the
    same (the lowered step's dots were fp8_full's alone), without a word; training and decoding now warn."""
    from tessera.config.unread_keys import decoding_keys_without_effect, keys_without_effect

    both = tiny_config(quantization="fp8_full", logits_dot_in_fp32=True)
    line = ("logits_dot_in_fp32=true: the output logits' product still runs in float8 with quantization=fp8_full "
            "(its float32 operands are quantized first); quantization=fp8 leaves that product unquantized, in float32 "
            "with logits_dot_in_fp32=true")
    assert line in keys_without_effect(both, {}) and line in decoding_keys_without_effect(both)
    for quiet in (tiny_config(quantization="fp8", logits_dot_in_fp32=True), tiny_config(quantization="fp8_full"),
                  tiny_config(quantization="fp8_full", logits_dot_in_fp32=True, logits_via_embedding=True)):
        assert not [x for x in keys_without_effect(quiet, {}) + decoding_keys_without_effect(quiet) if "logits" in x]


# ---------------------------------------------------------------------------- quantized KV cache

KV_PROMPTS = [list(map(int, np.random.default_rng(7).integers(1, 96, size=n))) for n in (6, 3, 5, 6, 4, 2, 6, 5)]


def _random_model(**overrides):
    """The tiny float32 model with fixed random weights (numpy draws, as the decode tests)."""
    from tessera.models import build_model

    model = build_model(tiny_config(dtype="float32", **overrides).model)
    rng = np.random.default_rng(3)
    return model, jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), model.param_shapes())


@pytest.mark.parametrize("dtype, axis, max_diff, min_agreement", [
    ("int8", "heads_and_dkv", 0.05, 0.9), ("int8", "dkv", 0.05, 0.9),
    ("int4", "heads_and_dkv", 0.4, 0.5), ("int4", "dkv", 0.4, 0.5),
])
@pytest.mark.slow
def test_quantized_kv_cache_decodes_like_the_float_cache(dtype, axis, max_diff, min_agreement):
    """Greedy decoding of 6 tokens for 8 prompts with the cache stored quantized: the logits of
    every token decoded from the same context as the float cache's differ by at most max_diff
    (logits reach 1.8 here; measured int8 0.019 / 0.011, int4 0.26 / 0.20), and the greedy
    tokens agree on at least min_agreement of the positions (measured int8 1.00 / 1.00, int4
    0.85 / 0.92: random weights leave near-ties, which int4's error flips)."""
    from tessera.decode import generate

    model, params = _random_model()
    quantized, _ = _random_model(quantize_kvcache=True, kv_quant_dtype=dtype, kv_quant_axis=axis)
    want_tokens, want_logits = generate(model, params, KV_PROMPTS, 6, return_logits=True)
    got_tokens, got_logits = generate(quantized, params, KV_PROMPTS, 6, return_logits=True)
    same = [a == b for row_a, row_b in zip(want_tokens, got_tokens) for a, b in zip(row_a, row_b)]
    assert np.mean(same) >= min_agreement
    for want, got, row_a, row_b in zip(want_logits, got_logits, want_tokens, got_tokens):
        shared = next((i for i, (a, b) in enumerate(zip(row_a, row_b)) if a != b), len(row_a)) + 1
        assert np.max(np.abs(want[:shared] - got[:shared])) < max_diff


@pytest.mark.parametrize("axis, scale_heads", [("heads_and_dkv", 1), ("dkv", 2)])
def test_quantized_kv_cache_is_smaller(axis, scale_heads):
    """Keys and values are stored in int8 (a quarter of float32's bytes) with one float32 scale
    per slot (heads_and_dkv) or per slot and kv head (dkv)."""
    model, _ = _random_model()
    quantized, _ = _random_model(quantize_kvcache=True, kv_quant_axis=axis)
    plain, small = model.init_cache(8, 12), quantized.init_cache(8, 12)
    assert small.k_bskh.dtype == jnp.int8 and small.k_bskh.nbytes * 4 == plain.k_bskh.nbytes
    assert small.k_scale.shape == (*small.k_bskh.shape[:3], scale_heads, 1)
    total = lambda c: sum(x.nbytes for x in jax.tree.leaves(c))  # noqa: E731
    assert total(small) < 0.5 * total(plain)


def test_kv_quant_axis_without_heads_to_tell_apart_is_named():
    """MLA's cache (one latent per token) and a single kv head have one scale per slot whichever
    kv_quant_axis says (deepseek decoded the same logits with dkv and heads_and_dkv): dkv was accepted
    without a word; decode.py now names it."""
    from test_families import FAMILIES

    from tessera.config.unread_keys import decoding_keys_without_effect

    dkv = dict(quantize_kvcache=True, kv_quant_axis="dkv")
    assert decoding_keys_without_effect(tiny_config(**FAMILIES["deepseek"], **dkv)) == [
        "kv_quant_axis=dkv: no effect, MLA caches one latent per token: one scale per slot either way"]
    assert decoding_keys_without_effect(tiny_config(base_num_kv_heads=1, **dkv)) == [
        "kv_quant_axis=dkv: no effect, num_kv_heads is 1: one scale per slot either way"]
    assert decoding_keys_without_effect(tiny_config(**dkv)) == []  # 2 kv heads: a scale for each


# ---------------------------------------------------------------------------- quantized checkpoints

@pytest.mark.parametrize("mode, stored", [("int8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_quantized_checkpoint_round_trip_decodes_like_the_float_one(mode, stored, tmp_path):
    """decode.py writes the loaded weights quantized (save_quantized_params_path) and decodes
    from them with checkpoint_is_quantized=true: weights within one rounding step of their row's
    scale, norm scales as they were, logits close to the float weights'."""
    import orbax.checkpoint as ocp

    from tessera.checkpointing import saved_tree
    from tessera.decode import generate, load_model
    from tessera.mesh import create_mesh

    model, params = _random_model()
    float_dir = tmp_path / "float"
    ocp.PyTreeCheckpointer().save(float_dir, {"params": params})
    quant_dir = tmp_path / "quantized"
    cfg = tiny_config(dtype="float32", quantization=mode, load_parameters_path=str(float_dir),
                      save_quantized_params_path=str(quant_dir))
    mesh = create_mesh(cfg.mesh, jax.devices()[:1])
    load_model(cfg, mesh)  # loads the float weights and writes the quantized ones
    _, tree = saved_tree(str(quant_dir))
    from tessera.checkpointing.checksums import MANIFEST, problem

    assert (quant_dir / MANIFEST).exists() and problem(quant_dir) is None  # every later load verifies it
    assert tree["params"]["layers"]["mlp"]["wi_0"]["qvalue"].dtype == stored
    # the scanned layers' norm scales are [layers, embed] arrays, not matrices: they stay as they are
    # (they were quantized, one int8 scale per layer, against what the docs say)
    assert tree["params"]["layers"]["pre_mlp_norm"]["scale"].dtype == np.float32
    assert params["layers"]["pre_mlp_norm"]["scale"].ndim == 2
    loaded_cfg = tiny_config(dtype="float32", quantization=mode, load_parameters_path=str(quant_dir),
                             checkpoint_is_quantized=True)
    _, restored, _ = load_model(loaded_cfg, mesh)
    matrices = jax.tree.leaves(jax.tree.map(lambda names: "embed" in names and len(names) - ("layers" in names) >= 2,
                                            model.logical_axes(), is_leaf=lambda x: isinstance(x, tuple)))
    assert sum(matrices) == 9 and len(matrices) == 12  # q, k, v, o, the MLP's three, token table, output layer; 3 norms
    for w, r, matrix in zip(jax.tree.leaves(params), jax.tree.leaves(restored), matrices):
        assert r.dtype == w.dtype
        if matrix:  # within half a quantization step of the row's absmax (int8: 1/127; e4m3: 1/16 relative)
            row_max = np.max(np.abs(w), axis=-1, keepdims=True)
            step = row_max / 127 if mode == "int8" else np.maximum(np.abs(w) / 8, row_max / 448 * 2.0**-9)
            assert np.all(np.abs(np.asarray(r) - w) <= step * 0.5 + 1e-7)
        else:
            np.testing.assert_array_equal(r, w)
    # the logits at every position of 16 random sequences (teacher-forced: greedy decoding of a random
    # model cascades from near-ties; fp8 agreed on 5 of 8 first tokens here, with smaller errors than when
    # the norm scales were quantized too, which had agreed on 8): within a bound, and the same next token
    # wherever the float model's margin between its two best exceeds twice the largest error
    tokens = np.random.default_rng(0).integers(1, 96, size=(16, 8))
    want, got = np.asarray(model.apply(params, tokens)), np.asarray(model.apply(restored, tokens))
    error = np.abs(got - want).max(-1)
    assert error.max() < {"int8": 0.05, "fp8": 0.2}[mode] < 0.5 * want.std(), error.max()
    best_two = np.sort(want, -1)[..., -2:]
    clear = best_two[..., 1] - best_two[..., 0] > 2 * error
    assert clear.mean() > 0.4 and np.all(got.argmax(-1)[clear] == want.argmax(-1)[clear])
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
    assert len(generate(model, restored, KV_PROMPTS, 6)) == len(KV_PROMPTS)  # and it decodes


def test_a_full_disk_during_the_quantized_save_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    """TensorStore reports a full disk as a ValueError naming the OSError's code: the quantized save let it
    through as a traceback (exit 1), with the partial folder removed but nothing said."""
    import orbax.checkpoint as ocp

    from tessera.checkpointing.quantized import save_quantized

    def full(self, directory, *args, **kwargs):
        os.makedirs(directory)
        raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "q/params.wi_0/0": Failed to write 105 bytes: '
                         "No space left on device [tensorstore_spec='{}'] [os_error_code='28']")

    model, params = _random_model()
    monkeypatch.setattr(ocp.PyTreeCheckpointer, "save", full)
    target = tmp_path / "q"
    with pytest.raises(ConfigError) as e:
        save_quantized(params, model.logical_axes(), "int8", str(target))
    assert str(e.value) == (f"save_quantized_params_path={target} could not be written (No space left on device); "
                            "choose another path (the partial folder was removed)")
    assert not target.exists()


def test_quantized_checkpoint_keys_are_checked():
    from tessera.models.quantization import storage_type

    with pytest.raises(ConfigError, match=r"quantized checkpoints need quantization=int8, fp8, fp8_full or nanoo_fp8"):
        storage_type("")
    with pytest.raises(ConfigError, match=r"save_quantized_params_path needs quantization"):
        tiny_config(save_quantized_params_path="q")
    with pytest.raises(ConfigError, match=r"checkpoint_is_quantized=true needs load_parameters_path"):
        tiny_config(checkpoint_is_quantized=True, quantization="int8")


def test_a_quantized_checkpoint_is_not_written_where_a_run_keeps_its_steps(tmp_path):
    """save_quantized_params_path=<run>/checkpoints/999 was written: the run's resume then took it for its step 999
    and reported it as damaged. Such a folder is refused before anything is loaded; other numbered folders are not."""
    from tessera.checkpointing.quantized import check_new_folder

    (tmp_path / "run" / "ckpt" / "4" / "state").mkdir(parents=True)
    for run_steps in (tmp_path / "run" / "checkpoints", tmp_path / "run" / "ckpt"):
        with pytest.raises(ConfigError) as e:
            check_new_folder(str(run_steps / "999"), "save_quantized_params_path")
        assert str(e.value) == (f"save_quantized_params_path={run_steps}/999 would be taken for step 999 of the run "
                                f"whose checkpoints are in {run_steps}; choose a folder outside it (e.g. "
                                f"{tmp_path}/run/quantized) (nothing was written)")
    check_new_folder(str(tmp_path / "quantized" / "999"), "save_quantized_params_path")  # no steps there
    check_new_folder(str(tmp_path / "run" / "ckpt" / "q999"), "save_quantized_params_path")
    assert not (tmp_path / "quantized").exists()
    # a folder that exists (an earlier quantized checkpoint) is refused too, before the load (save_quantized would
    # refuse it only after the parameters were read)
    (tmp_path / "q8").mkdir()
    with pytest.raises(ConfigError) as e:
        check_new_folder(str(tmp_path / "q8"), "save_quantized_params_path")
    assert str(e.value) == (f"save_quantized_params_path={tmp_path / 'q8'} exists already; choose a new folder (nothing "
                            "was written)")


def test_a_mismatch_is_not_put_on_the_quantization_keys(tmp_path):
    """A checkpoint that did not fit was explained by every model key its saved config differs in, the quantization
    keys too: train.py load_parameters_path=<quantized checkpoint> said `quantization="int8" (here "")`, and a
    quantized run's float checkpoint read with another width named quantization next to base_emb_dim. Those keys
    never change the parameters saved; the keys that do are still named."""
    from tessera.checkpointing import CheckpointMismatch, mismatch_explained

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "metadata").write_text(json.dumps(
        {"quantization": "int8", "quantize_kvcache": True, "kv_quant_dtype": "int4", "base_emb_dim": 24}))
    now = {"quantization": "", "quantize_kvcache": False, "kv_quant_dtype": "int8"}
    with pytest.raises(CheckpointMismatch) as e, mismatch_explained(str(tmp_path), {**now, "base_emb_dim": 32}):
        raise CheckpointMismatch("the arrays differ")
    assert str(e.value) == "the arrays differ\nThe config saved with it differs in its model keys: base_emb_dim=24 (here 32)"
    with pytest.raises(CheckpointMismatch) as e, mismatch_explained(str(tmp_path), {**now, "base_emb_dim": 24}):
        raise CheckpointMismatch("the arrays differ")
    assert str(e.value) == "the arrays differ"


def test_a_float8_checkpoint_is_not_cast_into_another_float8_format():
    """A checkpoint saved with quantization=fp8 (float8_e4m3fn values) loaded with nanoo_fp8 (e4m3fnuz)
    was cast as a weight_dtype change is: every value above 240 became NaN and decode gave token 0.
    Float8 values now have to match; 16- and 32-bit weights still cast."""
    from tessera.checkpointing import describe_mismatch

    def tree(values, scale):
        return {"params": {"mlp": {"wi": {"qvalue": jax.ShapeDtypeStruct((4, 8), values),
                                          "scale": jax.ShapeDtypeStruct((1, 8), scale)}}}}

    problems = describe_mismatch(tree(jnp.float8_e4m3fn, jnp.float32), tree(jnp.float8_e4m3fnuz, jnp.bfloat16),
                                 cast_floats=True)
    assert problems == ["params/mlp/wi/qvalue: checkpoint has dtype float8_e4m3fn, this config expects "
                        "float8_e4m3fnuz"], problems
    assert describe_mismatch(tree(jnp.bfloat16, jnp.float32), tree(jnp.float32, jnp.bfloat16), cast_floats=True) == []


def test_a_full_state_load_of_a_quantized_checkpoint_does_not_point_at_load_parameters_path(tmp_path):
    """load_full_state_path at a quantized checkpoint (decode.py save_quantized_params_path) said to start from
    it with load_parameters_path, which training refuses for quantized parameters: the error now says what the
    folder holds and that training starts from the float checkpoint."""
    import orbax.checkpoint as ocp

    from tessera.checkpointing import CheckpointError, load_full_state

    trainer = setup(tiny_config(), jax.devices()[:1])
    abstract = abstract_state(trainer)
    params = quantize_params(jax.tree.map(lambda s: np.full(s.shape, 0.5, s.dtype), abstract["params"]), "int8",
                             trainer.model.logical_axes())
    ocp.PyTreeCheckpointer().save(tmp_path / "quantized", {"params": params})
    with pytest.raises(CheckpointError) as e:
        load_full_state(str(tmp_path / "quantized"), abstract)
    assert str(e.value) == (f"load_full_state_path={tmp_path / 'quantized'} holds quantized parameters (written by "
                            "decode.py save_quantized_params_path), which only decode.py reads "
                            "(checkpoint_is_quantized=true); train from the float checkpoint they were written from")


def test_a_quantized_checkpoint_keeps_the_model_keys_its_weights_were_trained_with(tmp_path, caplog):
    """A quantized checkpoint kept no config: decoding it with other model keys that fit the weights (a rotary
    base here) loaded silently as another model, where the float checkpoint it came from warned. It now keeps
    the config of its source (or of the decode that wrote it), and a decode with other model keys is warned."""
    import orbax.checkpoint as ocp

    from tessera.checkpointing.checksums import problem
    from tessera.decode import load_model
    from tessera.mesh import create_mesh

    _, params = _random_model()
    ocp.PyTreeCheckpointer().save(tmp_path / "float", {"params": params})
    cfg = tiny_config(dtype="float32", quantization="int8", load_parameters_path=str(tmp_path / "float"),
                      save_quantized_params_path=str(tmp_path / "q8"))
    mesh = create_mesh(cfg.mesh, jax.devices()[:1])
    load_model(cfg, mesh)
    assert problem(tmp_path / "q8") is None  # the config's file is in the checksum list too
    read = dict(dtype="float32", quantization="int8", load_parameters_path=str(tmp_path / "q8"),
                checkpoint_is_quantized=True)
    with caplog.at_level("WARNING", logger="tessera"):
        load_model(tiny_config(**read), mesh)
    assert "trained with other model keys" not in caplog.text
    with caplog.at_level("WARNING", logger="tessera"):
        load_model(tiny_config(**read, rope_max_timescale=500), mesh)
    assert "trained with other model keys: rope_max_timescale=10000 (here 500)" in caplog.text
