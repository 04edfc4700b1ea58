"""The Pallas kernel of the gated delta rule's recurrence (tessera.models.delta_rule_kernel), run in Pallas'
interpreter on the CPU: it equals the XLA loop in outputs, final memory and every input's gradient (packed
documents, a carried starting memory, chunk sizes from 1 to a padded one), through a sharded training step
too; gdn_kernel's choice per platform; and the TPU compiler builds it (AOT, the kernels in the program)."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, tiny_config
from tessera.config import build_config
from tessera.models import delta_rule_kernel
from tessera.models.delta_rule_kernel import chunk_recurrence, select_delta_rule_kernel
from tessera.models.gated_deltanet import chunked_delta_rule, l2_normalized

B, T, H, DK, DV = 2, 37, 3, 8, 5
SEGMENTS = jnp.array([[1] * 10 + [2] * 20 + [3] * 7, [4] * 37])
GDN = dict(decoder_block="qwen3_next", base_num_decoder_layers=4, num_experts=4, num_experts_per_tok=2,
           shared_experts=1, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=8, gdn_value_head_dim=6,
           gdn_chunk_size=4, dtype="float32")


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 8)
    q = l2_normalized(jax.random.normal(ks[0], (B, T, H, DK)))
    k = l2_normalized(jax.random.normal(ks[1], (B, T, H, DK)))
    v = jax.random.normal(ks[2], (B, T, H, DV))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    state = jax.random.normal(ks[5], (B, H, DK, DV))
    probes = jax.random.normal(ks[6], (B, T, H, DV)), jax.random.normal(ks[7], (B, H, DK, DV))
    return (q, k, v, g, beta, state), probes


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("carried", [False, True])
def test_the_kernel_equals_the_xla_loop_with_gradients(chunk, carried):
    """Outputs, the final memory and the gradients of q, k, v, g, beta (and the starting memory) within 1e-6
    (measured: bitwise equal on the AMD EPYC host), three packed documents in the first row; with `carried`
    the rows start from a memory of their first segment (the first row) or of another one (the second)."""
    args, (probe_out, probe_state) = _inputs()
    state_segment = jnp.array([1, 3]) if carried else None

    def loss(kernel, q, k, v, g, beta, state):
        out, final = chunked_delta_rule(q, k, v, g, beta, SEGMENTS, chunk, state if carried else None, state_segment,
                                        kernel=kernel)
        return jnp.sum(jnp.sin(out) * probe_out) + jnp.sum(final * probe_state), (out, final)

    grads = {kernel: jax.grad(loss, argnums=range(1, 7), has_aux=True)(kernel, *args)
             for kernel in ("xla", "pallas_interpret")}
    (ref_grads, (ref_out, ref_final)), (got_grads, (got_out, got_final)) = grads["xla"], grads["pallas_interpret"]
    assert float(jnp.abs(ref_out).max()) > 0.2 and float(jnp.abs(ref_final).max()) > 0.2
    np.testing.assert_allclose(got_out, ref_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got_final, ref_final, rtol=0, atol=1e-6)
    for name, got, ref in zip(("q", "k", "v", "g", "beta", "state"), got_grads, ref_grads):
        assert float(jnp.abs(ref).max()) > 0 or (name == "state" and not carried), name
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=name)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: loss("pallas_interpret", *a)[0], argnums=range(5)))(*args))
    # forward without the memory at each chunk's start; backward: forward again keeping it, then the reverse walk
    assert re.findall(r"name=(delta_rule_\w+)", jaxpr) == ["delta_rule_chunks", "delta_rule_chunks_states",
                                                           "delta_rule_chunks_bwd"]


def test_a_prompt_through_the_kernel_then_decoded_tokens_equal_one_pass(monkeypatch):
    """Decoding: a left-padded prompt of 7 tokens runs the kernel (chunks of 4, from the empty cache's memory), each
    later token XLA's loop (one chunk of one); their outputs equal one pass of the layer over the row."""
    from flax import nnx

    from tessera.models import gated_deltanet
    from tessera.models.gated_deltanet import GatedDeltaNet
    from tessera.models.kv_cache import DeltaNetCache

    cfg = tiny_config(**GDN).model
    layer = GatedDeltaNet(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(6), (1, 12, cfg.emb_dim))
    seg = jnp.array([[0, 0] + [1] * 10])
    whole, _ = layer(x, seg)
    calls = []

    def recorded(*args, **kwargs):
        calls.append(args[0].shape)
        return chunk_recurrence(*args, **kwargs)

    monkeypatch.setattr(delta_rule_kernel, "select_delta_rule_kernel", lambda choice: "pallas_interpret")
    monkeypatch.setattr(gated_deltanet, "chunk_recurrence", recorded)
    out, cache = layer(x[:, :7], seg[:, :7], DeltaNetCache.empty(cfg, 1))
    outs = [out]
    for t in range(7, 12):
        out, cache = layer(x[:, t:t + 1], seg[:, t:t + 1], cache)
        outs.append(out)
    assert calls == [(2, 1, cfg.gdn_num_value_heads, 4, cfg.gdn_value_head_dim)]  # the prompt only: 2 chunks of 4
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1)[:, 2:], whole[:, 2:], rtol=0, atol=1e-5)


def _train_step(monkeypatch, kernel: str, devices: int, **mesh):
    """(loss, updated parameters) of one training step of a small qwen3_next on `devices` CPU devices, the
    recurrence run by `kernel`; rows packed with two documents."""
    from tessera.step import create_state, make_train_step, setup

    monkeypatch.setattr(delta_rule_kernel, "select_delta_rule_kernel", lambda choice: kernel)
    trainer = setup(tiny_config(**GDN, **mesh), jax.devices()[:devices])
    state = create_state(trainer, 0)
    rows, length = trainer.plan.global_batch, 13
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (rows, length)), jnp.int32)
    segments = jnp.where(jnp.arange(length) < 5, 1, 2) * jnp.ones((rows, 1), jnp.int32)
    positions = jnp.where(jnp.arange(length) < 5, jnp.arange(length), jnp.arange(length) - 5)
    batch = {"tokens": tokens, "segment_ids": segments, "positions": jnp.broadcast_to(positions, tokens.shape)}
    new_state, stats = jax.jit(make_train_step(trainer, 0))(state, batch)
    return float(stats["loss"]), jax.tree.map(np.asarray, new_state["params"])


def test_a_sharded_training_step_with_the_kernel_equals_the_xla_loops(monkeypatch):
    """fsdp 4 x tensor 2: the kernel runs inside shard_map (rows over fsdp, the value heads over tensor); with
    plain SGD (an update linear in the gradients) the loss and every updated parameter equal the same mesh's step
    with the XLA loop within float32 rounding, and the loss the one-device step's."""
    sgd = dict(opt_type="sgd", gradient_clipping_threshold=0.0, learning_rate=0.5)
    one_loss, _ = _train_step(monkeypatch, "xla", 1, per_device_batch_size=8, **sgd)
    mesh = dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2, per_device_batch_size=1, **sgd)
    ref_loss, ref_params = _train_step(monkeypatch, "xla", 8, **mesh)
    loss, params = _train_step(monkeypatch, "pallas_interpret", 8, **mesh)
    assert loss == pytest.approx(ref_loss, rel=1e-6) and loss == pytest.approx(one_loss, rel=1e-6)
    moved = 0
    for (path, ref), got, before in zip(jax.tree_util.tree_leaves_with_path(ref_params), jax.tree.leaves(params),
                                        jax.tree.leaves(_initial_params(mesh))):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))
        moved += "linear_attention" in jax.tree_util.keystr(path) and float(np.abs(ref - before).max()) > 1e-3
    assert moved >= 10  # the Gated DeltaNets' weights took the step


def _initial_params(keys):
    from tessera.step import create_state, setup

    return jax.tree.map(np.asarray, create_state(setup(tiny_config(**GDN, **keys), jax.devices()), 0)["params"])


def test_gdn_kernel_picks_pallas_on_tpus_only_and_says_when_it_cannot(caplog):
    assert select_delta_rule_kernel("autoselected") == "xla"  # (this host's CPU)
    assert select_delta_rule_kernel("xla") == "xla"
    delta_rule_kernel._FELL_BACK.clear()
    with caplog.at_level(logging.INFO, logger="tessera.models.delta_rule_kernel"):
        assert select_delta_rule_kernel("pallas") == "xla"
        assert select_delta_rule_kernel("pallas") == "xla"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["gdn_kernel=pallas: the Pallas kernel of the gated delta rule is compiled for TPUs only; on cpu "
                     "the recurrence runs as an XLA loop (the same results)"]


def test_the_tpu_program_runs_the_kernel_forward_and_backward():
    """AOT for v5e-8 (fsdp 4 x tensor 2), a pattern of three Gated DeltaNets and one attention layer: autoselected
    compiles per Gated DeltaNet the forward kernel, and for the backward pass the forward kernel that keeps the
    memory at each chunk's start and the reverse one (Mosaic takes the small heads whole); with
    remat_policy=full the forward kernel once more (the backward pass repeats the forward pass); gdn_kernel=xla
    compiles none; under two pipeline stages (stage 2 x fsdp 4, two patterns) each stage's layers run it."""
    from tessera.hardware import tpu_slice
    from tessera.hlo_text import tpu_kernels
    from tessera.step import compile_step, setup
    from tessera.train_compile import topology_devices

    kernels = {}
    for choice, remat in (("autoselected", "none"), ("autoselected", "full"), ("xla", "none")):
        cfg = build_config({**TINY, **GDN, "dtype": "bfloat16", "gdn_kernel": choice, "ici_fsdp_parallelism": 4,
                            "ici_tensor_parallelism": 2, "attention": "dot_product", "remat_policy": remat})
        program = compile_step(setup(cfg, topology_devices(tpu_slice("v5e-8"), 1)), 0)[0].as_text()
        kernels[choice, remat] = tpu_kernels(program)
    backward = {"delta_rule_chunks_bwd": 3, "delta_rule_chunks_states": 3}
    assert kernels["autoselected", "none"] == {"delta_rule_chunks": 3, **backward}
    assert kernels["autoselected", "full"] == {"delta_rule_chunks": 6, **backward}
    assert kernels["xla", "none"] == {}
    cfg = build_config({**TINY, **GDN, "dtype": "bfloat16", "base_num_decoder_layers": 8, "ici_fsdp_parallelism": 4,
                        "ici_pipeline_parallelism": 2, "attention": "dot_product"})
    program = compile_step(setup(cfg, topology_devices(tpu_slice("v5e-8"), 1)), 0)[0].as_text()
    assert tpu_kernels(program) == {"delta_rule_chunks": 3, **backward}
