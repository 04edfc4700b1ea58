"""Block families: scan == loop and parameter counts for each, fused QKV, sliding windows,
mixture-of-experts routing (dropless == capacity, dropped tokens, expert parallelism)."""

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from tessera.config import ConfigError
from tessera.metrics import format_record
from tessera.models import build_model
from tessera.tools.memory_model import count_params
from tessera.train import run

FAMILIES = {
    "mistral": dict(decoder_block="mistral", sliding_window_size=4),
    "mixtral": dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2),
    "gemma": dict(decoder_block="gemma", mlp_activations=["gelu", "linear"], logits_via_embedding=True),
    "gemma2": dict(decoder_block="gemma2", base_num_decoder_layers=4, sliding_window_size=4, attn_logits_soft_cap=5.0,
                   final_logits_soft_cap=3.0, query_pre_attn_scalar=10.0, mlp_activations=["gelu", "linear"],
                   logits_via_embedding=True),
    "gpt3": dict(decoder_block="gpt3", mlp_activations=["gelu"], base_num_kv_heads=4, trainable_position_size=16,
                 logits_via_embedding=True),
    "gpt3-sinusoidal": dict(decoder_block="gpt3", mlp_activations=["gelu"], base_num_kv_heads=4, fused_qkv=True),
    "qwen2": dict(decoder_block="qwen2", attention_bias=True),  # query, key and value biases; none on the output
    "qwen3": dict(decoder_block="qwen3"),
    "qwen3_moe": dict(decoder_block="qwen3_moe", num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
    # 8 layers: one 6-layer pattern and a tail of 2 local layers
    # MLA with a low-rank query, YaRN, 1 dense layer and 2 expert layers (8 experts in 4 groups, shared expert, bias)
    "deepseek": dict(decoder_block="deepseek", base_num_decoder_layers=3, first_num_dense_layers=1, head_dim=24,
                     base_num_kv_heads=4, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=10,
                     base_moe_mlp_dim=24, num_experts=8, num_experts_per_tok=3, n_routing_groups=4, topk_routing_group=2,
                     shared_experts=1, routed_score_func="sigmoid", routed_scaling_factor=2.5, routed_bias=True,
                     rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_position=1024),
    "deepseek-full-rank-query": dict(decoder_block="deepseek", base_num_decoder_layers=2, head_dim=24,
                                     kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=10,
                                     num_experts=4, num_experts_per_tok=2, routed_score_func="sigmoid"),
    "gemma3": dict(decoder_block="gemma3", base_num_decoder_layers=8, sliding_window_size=4, query_pre_attn_scalar=10.0,
                   mlp_activations=["gelu", "linear"], logits_via_embedding=True, rope_scaling="linear",
                   rope_scaling_factor=8.0, rope_max_timescale=1_000_000),
    # 2 pairs of a sliding-window and a full layer, sinks and biases, clamped experts (the clamp low enough
    # to bite at these sizes), YaRN without truncation
    "gpt_oss": dict(decoder_block="gpt_oss", base_num_decoder_layers=4, sliding_window_size=4, num_experts=4,
                    num_experts_per_tok=2, attention_bias=True, attention_sink=True, mlp_bias=True,
                    mlp_activations=["sigmoid", "linear"], mlp_activations_limit=0.5, rope_scaling="yarn",
                    rope_scaling_factor=4.0, rope_original_max_position=16, rope_truncate=False),
    # two 4-layer patterns: chunks of 5 on the rotary layers, q/k norms, a NoPE layer with the temperature (a
    # floor scale of 3 turns it on from the third token), experts (sigmoid, inputs scaled, a shared one) in every
    # other layer and dense MLPs between
    "llama4": dict(decoder_block="llama4", base_num_decoder_layers=8, num_experts=4, num_experts_per_tok=1,
                   shared_experts=1, base_moe_mlp_dim=16, routed_score_func="sigmoid", norm_topk_prob=False,
                   use_qk_norm=True, chunk_attn_window_size=5, nope_layer_interval=4, temperature_tuning=True,
                   temperature_tuning_floor_scale=3.0, interleave_moe_layer_step=2),
    # 6 layers: one 3-local/1-global pattern and a tail of 2 local layers; YaRN (global layers only) that bites
    "olmo3": dict(decoder_block="olmo3", base_num_decoder_layers=6, sliding_window_size=4, rope_scaling="yarn",
                  rope_scaling_factor=4.0, rope_original_max_position=16, local_rope_max_timescale=-1),
    # OLMo 3's layer, every layer global, one per block; YaRN on every layer
    "olmo2": dict(decoder_block="olmo2", base_num_decoder_layers=3, rope_scaling="yarn", rope_scaling_factor=4.0,
                  rope_original_max_position=16),
    # 6 layers: one 3-linear/1-full pattern and a tail of 2 Gated DeltaNets (2 key heads serving 4 value heads, in
    # chunks of 5 over the 12 tokens); a quarter of each head rotates; experts with a gated shared expert
    "qwen3_next": dict(decoder_block="qwen3_next", base_num_decoder_layers=6, head_dim=8, partial_rotary_factor=0.25,
                       num_experts=4, num_experts_per_tok=2, shared_experts=1, gdn_num_key_heads=2,
                       gdn_num_value_heads=4, gdn_key_head_dim=8, gdn_value_head_dim=6, gdn_chunk_size=5),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
# qwen3_next: the scanned and looped programs' logits (up to 3.9) were 1.0e-5 apart at most, float32 rounding
# through 5 Gated DeltaNets and their triangular solves (the 4-layer model without the tail: 5.8e-6)
SCAN_LOOP_ATOL = {"qwen3_next": 5e-5}


def _unstack(params, num_blocks=None):
    """Stacked segments (layers, deepseek's dense_layers) -> <segment>_0, <segment>_1, ..."""
    out = {k: v for k, v in params.items() if k not in ("layers", "dense_layers")}
    for segment in ("layers", "dense_layers"):
        if segment in params:
            for i in range(jax.tree.leaves(params[segment])[0].shape[0]):
                out[f"{segment}_{i}"] = jax.tree.map(lambda x: x[i], params[segment])
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.slow
def test_scan_equals_loop_and_counts_match_the_estimator(family):
    keys = FAMILIES[family]
    scanned = build_model(tiny_config(**keys).model)
    looped = build_model(tiny_config(scan_layers=False, **keys).model)
    params = scanned.init(jax.random.key(1))
    blocks = jax.tree.leaves(params["layers"])[0].shape[0]
    a, b = scanned.apply(params, TOKENS), looped.apply(_unstack(params, blocks), TOKENS)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=SCAN_LOOP_ATOL.get(family, 1e-5))
    jax.tree.map(np.testing.assert_array_equal, looped.init(jax.random.key(1)), _unstack(params, blocks))
    assert np.isfinite(a).all() and a.std() > 0.1
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert n == count_params(scanned.cfg).total


def test_soft_caps_bound_the_logits():
    model = build_model(tiny_config(**FAMILIES["gemma2"]).model)
    logits = model.apply(model.init(jax.random.key(0)), TOKENS)
    assert float(jnp.abs(logits).max()) < 3.0


@pytest.mark.parametrize("family", ["gpt3", "llama2"])
def test_fused_qkv_equals_separate_projections(family):
    keys = {**FAMILIES.get(family, {}), "base_num_kv_heads": 4}
    separate = build_model(tiny_config(**keys).model)
    fused = build_model(tiny_config(fused_qkv=True, **keys).model)
    params = separate.init(jax.random.key(2))
    att = params["layers"]["attention"]
    fused_att = {k: v for k, v in att.items() if k in ("wo_nhd", "bo_d")}
    fused_att["wqkv_dcnh"] = jnp.stack([att["wq_dnh"], att["wk_dkh"], att["wv_dkh"]], axis=2)  # [L, D, 3, N, H]
    if "bq_nh" in att:
        att["bq_nh"] = att["bq_nh"] + 0.1  # non-zero biases, so they are checked too
        fused_att["bqkv_cnh"] = jnp.stack([att["bq_nh"], att["bk_kh"], att["bv_kh"]], axis=1)
    fused_params = {**params, "layers": {**params["layers"], "attention": fused_att}}
    assert set(jax.tree.leaves(jax.tree.map(jnp.shape, fused.param_shapes()))) == set(
        jax.tree.leaves(jax.tree.map(jnp.shape, fused_params)))
    np.testing.assert_allclose(fused.apply(fused_params, TOKENS), separate.apply(params, TOKENS), rtol=1e-6, atol=1e-6)


def test_fused_qkv_needs_multi_head_attention():
    with pytest.raises(ConfigError, match="fused_qkv=true needs multi-head attention"):
        tiny_config(fused_qkv=True)  # TINY has 4 query and 2 kv heads


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_limits_what_a_token_sees(family):
    """One layer (gemma2: its local layer decides), window 4: a changed token at position 2
    changes positions 2..5 only."""
    keys = {**FAMILIES[family], "base_num_decoder_layers": 1 if family == "mistral" else 2}
    model = build_model(tiny_config(**keys).model)
    params = model.init(jax.random.key(3))
    if family == "gemma2":
        glob = params["layers"]["global_layer"]
        glob["attention"]["wv_dkh"] = jnp.zeros_like(glob["attention"]["wv_dkh"])  # the global layer adds nothing
    changed = TOKENS.at[:, 2].set((TOKENS[:, 2] + 1) % 96)
    moved = np.abs(np.asarray(model.apply(params, changed) - model.apply(params, TOKENS))).max(axis=(0, 2))
    assert (moved[:2] == 0).all() and (moved[2:6] > 1e-4).all() and (moved[6:] == 0).all(), moved


MOE = FAMILIES["mixtral"]


@pytest.mark.parametrize("keys, platform, line", [
    (dict(sparse_matmul=True), "cpu", "MoE routing: dropless (sparse_matmul=true; token copies grouped by expert, "
                                      "jax.lax.ragged_dot)"),
    (dict(megablox=True), "tpu", "MoE routing: dropless (megablox=true; token copies grouped by expert, the Pallas "
                                 "megablox kernel)"),
    (dict(megablox=True), "gpu", "MoE routing: dropless (megablox=true; token copies grouped by expert, "
                                 "jax.lax.ragged_dot)"),
    # quantized: qwix's ragged dot whatever the kernel (the line named the Pallas kernel, and a second line said not)
    (dict(megablox=True, quantization="int8"), "tpu", "MoE routing: dropless (megablox=true; token copies grouped by "
                                                      "expert, qwix's quantized ragged dot (quantization=int8), not the "
                                                      "Pallas megablox kernel)"),
    (dict(sparse_matmul=True, quantization="fp8"), "gpu", "MoE routing: dropless (sparse_matmul=true; token copies "
                                                          "grouped by expert, qwix's quantized ragged dot (quantization="
                                                          "fp8))"),
    (dict(capacity_factor=-1.0), "cpu", "MoE routing: capacity without a limit (capacity_factor=-1: each expert"),
    (dict(capacity_factor=1.25), "cpu", "MoE routing: capacity_factor=1.25 (an expert takes at most 1.25 x"),
])
def test_setup_says_how_a_moe_model_routes_its_tokens(keys, platform, line, caplog):
    from tessera.step import _log_moe_routing

    with caplog.at_level("INFO", logger="tessera"):
        _log_moe_routing(tiny_config(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, **keys).model,
                         platform)
        _log_moe_routing(tiny_config().model, platform)  # a dense model: nothing to say
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith(line)


def test_capacity_factor_with_dropless_routing_gets_a_warning(caplog):
    """MaxText also ignores capacity_factor when sparse_matmul is on; a user who sets both should hear so."""
    from tessera.step import _log_moe_routing

    with caplog.at_level("INFO", logger="tessera"):
        _log_moe_routing(tiny_config(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, sparse_matmul=True,
                                     capacity_factor=1.5).model, "cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["capacity_factor=1.5 is not used: dropless routing (sparse_matmul=true) never drops a token; "
                        "set sparse_matmul=false megablox=false for capacity routing, or leave capacity_factor at -1"]


def test_dropless_equals_capacity_routing_without_drops():
    dropless = build_model(tiny_config(sparse_matmul=True, **MOE).model)
    capacity = build_model(tiny_config(capacity_factor=-1, **MOE).model)
    params = dropless.init(jax.random.key(4))

    def loss(model, p):
        logits, aux = model.apply_with_aux(p, TOKENS)
        return jnp.mean(logits**2) + aux["moe_load_balance_loss"], aux

    (la, aux_a), ga = jax.value_and_grad(lambda p: loss(dropless, p), has_aux=True)(params)
    (lb, aux_b), gb = jax.value_and_grad(lambda p: loss(capacity, p), has_aux=True)(params)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6), ga, gb)
    assert float(aux_a["moe_dropped_fraction"]) == float(aux_b["moe_dropped_fraction"]) == 0.0
    # a small capacity drops tokens, says how many, and changes the output
    small = build_model(tiny_config(capacity_factor=0.5, **MOE).model)
    logits, aux = small.apply_with_aux(params, TOKENS)
    assert 0.4 <= float(aux["moe_dropped_fraction"]) < 1.0  # half the slots there are routed copies, or fewer
    assert not np.allclose(logits, dropless.apply(params, TOKENS), atol=1e-3)


_RUNS: dict = {}


def _moe_losses(tmp_path, name, num_devices, family=MOE, **overrides):
    """The metrics records of a run of `family` on `num_devices` devices (8 sequences a step); a
    configuration that several tests compare against (one device, dropless) runs once. One layer
    unless the family says (the routing and its splits are what is tested): the programs of a scan
    of one layer compile faster (the tests below: 17% less CPU time than with three layers)."""
    keys = {"steps": 2, "base_num_decoder_layers": 1, **family, **overrides}
    cache_key = json.dumps([num_devices, keys], sort_keys=True)
    if cache_key not in _RUNS:
        cfg = tiny_config(tmp_path / name, per_device_batch_size=8 / num_devices, enable_checkpointing=False, **keys)
        run(cfg, jax.devices()[:num_devices])
        _RUNS[cache_key] = [json.loads(line)
                            for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]
    return _RUNS[cache_key]


@pytest.mark.parametrize("routing", [dict(capacity_factor=1.0), dict(sparse_matmul=True)])
@pytest.mark.slow
def test_expert_parallel_gives_the_same_losses_as_one_device(routing, tmp_path):
    one = _moe_losses(tmp_path, "one", 1, **routing)
    ep = _moe_losses(tmp_path, "ep", 8, ici_expert_parallelism=4, ici_fsdp_parallelism=2, **routing)
    for key in ("loss", "grad_norm", "moe_load_balance_loss", "moe_dropped_fraction"):
        a, b = np.array([r[key] for r in one]), np.array([r[key] for r in ep])
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=key)
    if "capacity_factor" in routing:
        assert all(r["moe_dropped_fraction"] > 0 for r in one)  # capacity 1.0 on random routing drops some
        assert "dropped" in format_record(one[0])


@pytest.mark.slow
def test_qwen3_moe_expert_parallel_gives_the_same_losses_as_one_device(tmp_path):
    """Fine-grained experts (8, 3 per token, unnormalized weights) dropless over expert=4 x fsdp=2;
    the router statistics reach the metrics as Mixtral's do."""
    family = FAMILIES["qwen3_moe"]
    one = _moe_losses(tmp_path, "one", 1, family, sparse_matmul=True)
    ep = _moe_losses(tmp_path, "ep", 8, family, sparse_matmul=True, ici_expert_parallelism=4, ici_fsdp_parallelism=2)
    for key in ("loss", "grad_norm", "moe_load_balance_loss", "moe_dropped_fraction"):
        a, b = np.array([r[key] for r in one]), np.array([r[key] for r in ep])
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=key)
    assert all(r["moe_load_balance_loss"] > 0 for r in ep) and "router loss" in format_record(one[0])


@pytest.mark.slow
def test_deepseek_expert_parallel_gives_the_same_losses_as_one_device(tmp_path):
    """MLA, a dense layer, grouped sigmoid routing with the balancing bias and a shared expert, dropless
    over expert=4 x fsdp=2: the same losses, router statistics and (moved) biases as one device. With one
    MTP depth (itself a MoE block: test_mtp), whose loss and router loss are the same too. One expert layer
    after the dense one (each a scan of one layer): the train steps compile in about half the time of two."""
    family = {**FAMILIES["deepseek"], "base_num_decoder_layers": 2}
    one = _moe_losses(tmp_path, "one", 1, family, sparse_matmul=True, steps=3, mtp_num_layers=1)
    ep = _moe_losses(tmp_path, "ep", 8, family, sparse_matmul=True, steps=3, mtp_num_layers=1,
                     ici_expert_parallelism=4, ici_fsdp_parallelism=2)
    for key in ("loss", "grad_norm", "moe_load_balance_loss", "moe_dropped_fraction", "mtp_loss",
                "mtp_moe_load_balance_loss"):
        a, b = np.array([r[key] for r in one]), np.array([r[key] for r in ep])
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=key)
    assert not any(k.startswith("per_layer") for k in one[0])  # the loads move the biases; they are not logged
    assert all(r["moe_max_expert_load"] >= 1.0 for r in one) and "busiest expert" in format_record(one[0])
    np.testing.assert_allclose([r["moe_max_expert_load"] for r in ep], [r["moe_max_expert_load"] for r in one],
                               rtol=1e-5)


@pytest.mark.slow
def test_routed_bias_moves_towards_balance_after_each_step():
    """After a step every expert layer's bias moved by exactly routed_bias_update_rate towards balance
    (down for an expert that took more than its share of the token copies, up for one that took less),
    untouched by AdamW's update and weight decay; without routed_bias there is no bias."""
    from tessera.models.moe_balance import PER_LAYER_LOAD
    from tessera.losses import loss_terms
    from tessera.step import create_state, make_train_step, setup

    cfg = tiny_config(**FAMILIES["deepseek"], routed_bias_update_rate=0.01, adam_weight_decay=0.5, learning_rate=0.1)
    trainer = setup(cfg, jax.devices()[:1])
    state = create_state(trainer, 0)
    shape = (trainer.plan.global_batch, trainer.plan.max_target_length + 1)
    batch = {"tokens": jax.random.randint(jax.random.key(1), shape, 0, cfg.model.vocab_size),
             "segment_ids": jnp.ones(shape, jnp.int32), "positions": jnp.tile(jnp.arange(shape[1]), (shape[0], 1))}
    loads = loss_terms(trainer.model, state["params"], batch, None)[2][PER_LAYER_LOAD]  # [2 expert layers, 8]
    assert loads.shape == (2, 8) and np.allclose(jnp.mean(loads, axis=1), 1.0)  # fair share = 1
    before = state["params"]["layers"]["mlp"]["routed_bias_e"]
    new_state, stats = jax.jit(make_train_step(trainer, 0))(state, batch)
    moved = new_state["params"]["layers"]["mlp"]["routed_bias_e"] - before
    np.testing.assert_allclose(moved, 0.01 * np.sign(1.0 - np.asarray(loads)), atol=1e-7)
    assert (moved != 0).any() and PER_LAYER_LOAD not in stats
    plain = build_model(tiny_config(**{**FAMILIES["deepseek"], "routed_bias": False}).model).param_shapes()
    assert "routed_bias_e" not in plain["layers"]["mlp"]


@pytest.mark.parametrize("mesh", [dict(ici_fsdp_parallelism=4, ici_tensor_parallelism=2),
                                  dict(ici_data_parallelism=2, ici_fsdp_parallelism=4)])
@pytest.mark.slow
def test_dropless_per_shard_gives_the_same_losses_as_one_device(mesh, tmp_path):
    """Without an expert axis each device sorts only its own tokens (shard_map); with the MLP
    width split over tensor the partial outputs are summed. Same losses as one device."""
    one = _moe_losses(tmp_path, "one", 1, sparse_matmul=True)
    sharded = _moe_losses(tmp_path, "sharded", 8, sparse_matmul=True, **mesh)
    for key in ("loss", "moe_load_balance_loss"):
        a, b = np.array([r[key] for r in one]), np.array([r[key] for r in sharded])
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("axes", [dict(sequence=2, expert=2, fsdp=2), dict(sequence=2, tensor=2, data=2),
                                  dict(sequence=4, tensor=2)])
def test_dropless_under_a_sequence_axis_routes_each_device_s_tokens_and_equals_one_device(axes):
    """A sequence axis splits the token copies like the batch axes (routing is per token): loss and gradients
    equal one device's, and over an expert axis the rows still move with all-to-all rather than every device
    sorting the whole batch's copies (which the TPU compiler gave 247 GiB per chip for gpt-oss-120b)."""
    cfg = tiny_config(**MOE, sparse_matmul=True)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(3))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 96, (4, 12)), jnp.int32)

    def loss(p):
        logits, aux = model.apply_with_aux(p, tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5]) + aux["moe_load_balance_loss"]

    want, want_grads = jax.value_and_grad(loss)(params)
    names = ("data", "stage", "fsdp", "sequence", "tensor", "expert")
    mesh = jax.make_mesh(tuple(axes.get(a, 1) for a in names), names, axis_types=(jax.sharding.AxisType.Auto,) * 6)
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss))
        got, grads = step(params)
        text = step.lower(params).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, want_grads)
    # the sorts a device runs: its own copies (96 in all: 48 tokens x 2 experts, over the batch and sequence
    # axes), and over an expert axis the rows it received; never the whole batch's 96
    sorts = {int(n) for n in re.findall(r"= \(?s32\[(\d+)\][^=]*? sort\(", text)}
    split = math.prod(axes.get(a, 1) for a in ("data", "fsdp", "expert", "sequence"))
    assert 96 // split in sorts and max(sorts) < 96, sorts
    if "expert" in axes:
        assert "all-to-all" in text


def _noisy(params, seed=5):
    """`params` plus noise on every leaf: biases and sinks, zero at init, matter too."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("routing", [dict(sparse_matmul=True), dict(capacity_factor=-1)])
@pytest.mark.slow
def test_gpt_oss_under_expert_fsdp_and_tensor_axes_equals_one_device(routing):
    """gpt-oss's experts with biases, its router bias and its sinks: loss and gradients of the model
    under expert 2 x fsdp 2 x tensor 2 equal one device's. The experts' output bias is added once,
    though the tensor axis sums partial outputs (dropless), and each expert's input biases split over
    tensor with its width. One pair of layers (a sliding-window and a full one): the sharded program
    compiles in about a third of the time of two pairs'."""
    cfg = tiny_config(**{**FAMILIES["gpt_oss"], "base_num_decoder_layers": 2}, **routing)
    model = build_model(cfg.model)
    params = _noisy(model.init(jax.random.key(2)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (4, 12)), jnp.int32)

    def loss(p):
        logits, aux = model.apply_with_aux(p, tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + aux["moe_load_balance_loss"]

    want, want_grads = jax.value_and_grad(loss)(params)
    mesh = jax.make_mesh((1, 1, 2, 1, 2, 2), ("data", "stage", "fsdp", "sequence", "tensor", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 6)
    with jax.set_mesh(mesh):
        got, grads = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # float32 sums in other orders: differences up to ~3e-6 on gradients up to ~0.3
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), grads, want_grads)
    assert float(jnp.abs(want_grads["layers"]["local_layer"]["mlp"]["bo_ed"]).max()) > 1e-3


@pytest.mark.parametrize("keys,message", [
    (dict(decoder_block="gemma2", base_num_decoder_layers=3), "gemma2 needs an even number of layers"),
    (dict(FAMILIES["gpt_oss"], base_num_decoder_layers=3), "gpt_oss needs an even number of layers"),
    (dict(FAMILIES["gpt_oss"], mlp_activations=["silu"]), r"must be two, the second \"linear\""),
    (dict(FAMILIES["gpt_oss"], routed_bias=True), "routed_bias=true .* is not built for decoder_block=gpt_oss"),
    # a plain gated MLP beside clamped-gate experts, without a word
    (dict(FAMILIES["gpt_oss"], shared_experts=1), "shared_experts=1 is not built for decoder_block=gpt_oss"),
    (dict(mlp_activations_limit=7.0), "applies to decoder_block=gpt_oss only"),
    (dict(FAMILIES["deepseek"], attention_sink=True), "attention_sink=true: decoder_block=deepseek's latent"),
    # keys MLA would ignore (it trained the same numbers with them set)
    (dict(FAMILIES["deepseek"], base_num_kv_heads=4, fused_qkv=True), "fused_qkv=true: decoder_block=deepseek's latent"),
    (dict(FAMILIES["deepseek"], attn_logits_soft_cap=50.0), r"attn_logits_soft_cap=50: .* set attn_logits_soft_cap=0"),
    (dict(FAMILIES["deepseek"], query_pre_attn_scalar=144.0), r"query_pre_attn_scalar=144: .*would ignore it"),
    (dict(FAMILIES["llama4"], base_num_decoder_layers=6), "llama4 needs a multiple of 4 layers"),
    (dict(FAMILIES["olmo3"], base_num_decoder_layers=3), "olmo3 needs at least 4 layers .*3 local and 1 global"),
    (dict(FAMILIES["olmo3"], mtp_num_layers=1), r"decoder_block=olmo3's blocks hold 4 layers \(3 local and 1 global\)"),
    (dict(FAMILIES["llama4"], interleave_moe_layer_step=3), "interleave_moe_layer_step=3 must divide"),
    (dict(FAMILIES["llama4"], sliding_window_size=4), "attends within chunks instead"),
    (dict(chunk_attn_window_size=8192, use_qk_norm=True), "use_qk_norm=True, chunk_attn_window_size=8192: Llama 4's"),
    (dict(num_experts=4, num_experts_per_tok=2), "decoder_block=llama2 has a dense MLP"),
    (dict(decoder_block="mixtral"), "mixtral needs num_experts >= 2"),
    (dict(decoder_block="mixtral", num_experts=4, capacity_factor=0), "capacity_factor=0.0 must be > 0"),
    # YaRN divides by these (a ZeroDivisionError traceback while the model was built)
    (dict(rope_scaling="yarn", beta_fast=0.0), "beta_fast=0: rope_scaling=yarn .* give counts above 0"),
    (dict(FAMILIES["deepseek"], beta_slow=0.0), "beta_slow=0: rope_scaling=yarn"),
    (dict(rope_scaling="yarn", rope_max_timescale=1), "rope_max_timescale=1 with rope_scaling=yarn"),
    # routed as -1 (no groups) without a word
    (dict(FAMILIES["deepseek"], n_routing_groups=0), "n_routing_groups=0 is not a number of expert groups"),
    (dict(FAMILIES["mixtral"], n_routing_groups=-4), "n_routing_groups=-4 is not a number of expert groups"),
    # a group scores the sum of its two best experts: a top_k traceback in the first step
    (dict(FAMILIES["mixtral"], n_routing_groups=4, topk_routing_group=2),
     "n_routing_groups=4 leaves groups of one expert .* use at most 2 groups, routing_group_score=max, or"),
    (dict(FAMILIES["deepseek"], num_experts_per_tok=5),
     r"num_experts_per_tok=5 .* hold \(2 x 2 = 4, n_routing_groups=4 splitting num_experts=8\); raise"),
    # one message named both keys, saying "must divide" of groups that did divide
    (dict(FAMILIES["deepseek"], topk_routing_group=-1), r"^topk_routing_group=-1 must be between 1 and n_routing_groups=4"),
    (dict(FAMILIES["deepseek"], n_routing_groups=3), r"^n_routing_groups=3 does not divide num_experts=8 into groups"),
    # the routed experts' outputs all multiplied by zero, without a word
    (dict(FAMILIES["mixtral"], routed_scaling_factor=0.0), "routed_scaling_factor=0 multiplies the routed experts'"),
])
def test_family_config_errors(keys, message):
    with pytest.raises(ConfigError, match=message):
        build_model(tiny_config(**keys).model)


def test_keys_the_family_s_layers_leave_unread_are_named():
    """deepseek's latent attention has a key per query head whatever base_num_kv_heads says (the same
    logits with 1 or 2), and llama4's temperature_tuning, use_qk_norm and chunk_attn_window_size act on
    one kind of its layers, which nope_layer_interval may leave out: all were accepted without a word."""
    from tessera.config.unread_keys import keys_without_effect

    models = [build_model(tiny_config(**dict(FAMILIES["deepseek"], base_num_kv_heads=k)).model) for k in (1, 2)]
    logits = [m.apply(m.init(jax.random.key(0)), TOKENS) for m in models]
    np.testing.assert_array_equal(logits[0], logits[1])
    two = tiny_config(**dict(FAMILIES["deepseek"], base_num_kv_heads=2))
    assert ("base_num_kv_heads=2: no effect, decoder_block=deepseek's latent attention (MLA) derives a key and a "
            "value for each of its 4 query heads from one latent per token; set base_num_kv_heads to "
            "base_num_query_heads") in keys_without_effect(two, {"fsdp": 8})
    assert not [line for line in keys_without_effect(tiny_config(**FAMILIES["deepseek"]), {"fsdp": 8})
                if "base_num_kv_heads" in line]  # 4 and 4
    no_nope = tiny_config(**dict(FAMILIES["llama4"], nope_layer_interval=0))
    assert ("temperature_tuning=True: no effect, nope_layer_interval=0 leaves no layer without rotary positions, "
            "whose queries it scales; set nope_layer_interval (Llama 4: 4) or temperature_tuning=false"
            ) in keys_without_effect(no_nope, {"fsdp": 8})
    all_nope = tiny_config(**dict(FAMILIES["llama4"], nope_layer_interval=1))
    assert ("use_qk_norm=True, chunk_attn_window_size=5: no effect, nope_layer_interval=1 makes every layer a layer "
            "without rotary positions, and they act on the rotary layers only; set nope_layer_interval=4 (Llama 4) "
            "or leave them at their defaults") in keys_without_effect(all_nope, {"fsdp": 8})
    assert not [line for line in keys_without_effect(tiny_config(**FAMILIES["llama4"]), {"fsdp": 8})
                if "nope_layer_interval" in line]


def test_megablox_tiles_without_megablox_are_named():
    """tile_* size the Pallas megablox kernel's tiles only: with megablox=false the experts run capacity
    routing or jax.lax.ragged_dot, which take no tiles, and the keys were accepted without a word."""
    from tessera.config.unread_keys import keys_without_effect

    line = ("tile_batch_seq=256, tile_weight_dim=512: no effect without megablox=true; they size the tiles of the "
            "Pallas megablox kernel's grouped matmuls (TPUs), which this run's experts do not use")
    tiles = dict(FAMILIES["mixtral"], tile_batch_seq=256, tile_weight_dim=512)
    for routing in (dict(), dict(sparse_matmul=True)):
        assert line in keys_without_effect(tiny_config(**tiles, **routing), {"fsdp": 8}), routing
    assert not [x for x in keys_without_effect(tiny_config(**tiles, megablox=True), {"fsdp": 8}) if "tile_" in x]
    # quantized, the experts run qwix's ragged dot, not the kernel: the tiles were accepted without a word
    assert ("tile_batch_seq=256, tile_weight_dim=512: no effect with quantization=int8, whose experts run qwix's "
            "quantized ragged dot instead of the Pallas megablox kernel these tiles size"
            ) in keys_without_effect(tiny_config(**tiles, megablox=True, quantization="int8"), {"fsdp": 8})


def test_the_estimator_counts_a_dense_model_s_mlp_whatever_the_expert_keys_say():
    """A dense family builds one MLP of mlp_dim; the estimator counted base_moe_mlp_dim's width and the shared
    experts instead (both keys are named in a start-up warning: no effect on a dense model)."""
    for keys in (dict(shared_experts=2), dict(base_moe_mlp_dim=12), dict(FAMILIES["gemma3"], shared_experts=1)):
        cfg = tiny_config(**keys)
        built = sum(math.prod(x.shape) for x in jax.tree.leaves(build_model(cfg.model).param_shapes()))
        assert count_params(cfg.model).total == built, keys


@pytest.mark.parametrize("dropless", [False, True])
@pytest.mark.slow
def test_moe_blocks_name_their_mlp_tensors_for_custom_remat(dropless):
    """remat_policy=custom's mlpwi* keys reach the experts (the names are in the program) and
    keeping or recomputing them gives the gradients of remat_policy=none."""
    from tessera.losses import loss_sums

    def model_and_grads(**extra):
        cfg = tiny_config(**MOE, sparse_matmul=dropless, **extra)
        model = build_model(cfg.model)
        params = model.init(jax.random.key(0))
        batch = {"tokens": jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.model.vocab_size),
                 "segment_ids": jnp.ones((2, 17), jnp.int32), "positions": jnp.tile(jnp.arange(17), (2, 1))}
        loss = lambda p: loss_sums(model, p, batch, None)[0]  # noqa: E731
        return jax.make_jaxpr(loss)(params), jax.jit(jax.grad(loss))(params)

    jaxpr, custom = model_and_grads(remat_policy="custom", mlpwi="device", mlpwi_0="offload", mlpwo="device")
    for name in ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo"):
        assert re.search(rf"name={name}\b(?!_)", str(jaxpr)), name
    _, none = model_and_grads(remat_policy="none")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), none, custom)


def test_expert_parallelism_splits_the_weights_without_an_expert_dimension():
    from tessera.step import setup

    trainer = setup(tiny_config(**MOE, sparse_matmul=True, ici_expert_parallelism=4, ici_fsdp_parallelism=2))
    specs = jax.tree.map(lambda s: s.spec, trainer.state_shardings["params"])
    assert specs["layers"]["attention"]["wq_dnh"] == jax.sharding.PartitionSpec(None, ("fsdp", "expert"), None, None)
    assert specs["token_embedder"]["table_vd"] == jax.sharding.PartitionSpec(None, ("fsdp", "expert"))
    # expert weights: experts over expert, their embed dimension over fsdp only
    assert specs["layers"]["mlp"]["wi_0"] == jax.sharding.PartitionSpec(None, "expert", "fsdp", None)


def test_dropless_expert_parallel_moves_tokens_with_all_to_all():
    """The compiled expert-parallel step exchanges token rows over the expert axis (all-to-all
    on CPU, where XLA has no ragged all-to-all) instead of gathering the whole batch."""
    from tessera.step import compile_step, setup

    trainer = setup(tiny_config(**MOE, sparse_matmul=True, ici_expert_parallelism=4, ici_fsdp_parallelism=2,
                                per_device_batch_size=1))
    text = compile_step(trainer, 0)[0].as_text()
    assert "all-to-all" in text


@pytest.mark.slow
def test_ragged_buffer_factor_bounds_the_receive_buffer_and_reports_drops(tmp_path):
    """ragged_buffer_factor=0.5 gives each expert shard room for half the copies it receives on
    average: some are dropped, and the step says how many; factor 4 on a 4-way expert axis is the
    worst case, so nothing is dropped and the losses equal one device's."""
    mesh = dict(ici_expert_parallelism=4, ici_fsdp_parallelism=2)
    one = _moe_losses(tmp_path, "one", 1, sparse_matmul=True)
    roomy = _moe_losses(tmp_path, "roomy", 8, sparse_matmul=True, ragged_buffer_factor=4, **mesh)
    tight = _moe_losses(tmp_path, "tight", 8, sparse_matmul=True, ragged_buffer_factor=0.5, **mesh)
    np.testing.assert_allclose([r["loss"] for r in roomy], [r["loss"] for r in one], rtol=1e-4)
    assert all(r["moe_dropped_fraction"] == 0 for r in roomy)
    assert all(0.5 <= r["moe_dropped_fraction"] < 1 for r in tight)
    assert all(np.isfinite(r["loss"]) for r in tight) and tight[0]["loss"] != one[0]["loss"]
    with pytest.raises(ConfigError, match="ragged_buffer_factor=0.0 must be > 0"):
        build_model(tiny_config(**MOE, ragged_buffer_factor=0).model)


@pytest.mark.parametrize("k, n, tiles", [
    (128, 256, (512, 1024, 1024)),  # the default tiles: each matrix one tile
    (200, 328, (128, 128, 128)),  # no multiple of the tile: partial last tiles, forward and backward
    (72, 2880 // 16, (128, 128, 256)),  # narrower than a tile (gpt-oss's expert width split 16 ways)
])
def test_megablox_kernel_equals_ragged_dot_in_values_and_gradients(k, n, tiles):
    """The Pallas grouped matmul (in its interpreter here; on TPUs with megablox=true) against
    XLA's ragged_dot: rows not a multiple of its row tile, an empty group, rows past the
    groups' total (zero in both), widths that are no multiple of the 128-column tile."""
    from tessera.models.grouped import grouped_matmul

    lhs = jax.random.normal(jax.random.key(0), (150, k))
    rhs = jax.random.normal(jax.random.key(1), (4, k, n))
    sizes = jnp.array([50, 0, 61, 29], jnp.int32)  # 140 of 150 rows
    probe = jax.random.normal(jax.random.key(2), (150, n))

    def run(kernel, l, r):
        return grouped_matmul(l, r, sizes, kernel, tiles=tiles)

    ref, got = run("ragged_dot", lhs, rhs), run("megablox_interpret", lhs, rhs)
    assert "pallas_call" in str(jax.make_jaxpr(functools.partial(run, "megablox_interpret"))(lhs, rhs))
    np.testing.assert_allclose(got, ref, atol=1e-3)
    assert not np.any(got[140:])
    for a, b in zip(jax.grad(lambda l, r: jnp.sum(run("megablox_interpret", l, r) * probe), (0, 1))(lhs, rhs),
                    jax.grad(lambda l, r: jnp.sum(run("ragged_dot", l, r) * probe), (0, 1))(lhs, rhs)):
        np.testing.assert_allclose(a, b, atol=1e-3)


def test_expert_biases_take_their_gradient_by_matmul_not_scatter():
    """gpt-oss's expert biases, added to rows grouped by expert (rows past the groups' total get
    none): values and gradient equal the plain gather's (whose gradient XLA forms as a scatter-add,
    which the TPU compiler runs on 32-bit buffers of every row), and the gradient has no scatter."""
    from tessera.models.grouped import row_bias

    sizes = jnp.array([5, 0, 7, 3], jnp.int32)  # 15 of 18 rows
    bias = jax.random.normal(jax.random.key(0), (4, 6)).astype(jnp.bfloat16)
    probe = jax.random.normal(jax.random.key(1), (18, 6)).astype(jnp.bfloat16)
    group = jnp.repeat(jnp.arange(5), jnp.array([5, 0, 7, 3, 3]), total_repeat_length=18)

    def gathered(b):  # what row_bias computed before: the gather differentiated by XLA
        return jnp.where((group < 4)[:, None], jnp.take(b, group, axis=0, mode="clip"), 0)

    def loss(add_bias, b):
        return jnp.sum((add_bias(b) * probe).astype(jnp.float32))

    np.testing.assert_array_equal(row_bias(sizes, 18)(bias), gathered(bias))
    assert not np.any(row_bias(sizes, 18)(bias)[15:])
    got = jax.grad(functools.partial(loss, row_bias(sizes, 18)))(bias)
    want = jax.grad(functools.partial(loss, gathered))(bias)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)
    program = str(jax.make_jaxpr(jax.grad(functools.partial(loss, row_bias(sizes, 18))))(bias))
    assert "scatter" not in program and "dot_general" in program
    assert "scatter" in str(jax.make_jaxpr(jax.grad(functools.partial(loss, gathered)))(bias))


def test_latent_attention_has_every_static_setting_of_attention():
    """MlaAttention has weights of its own and so skips Attention.__init__, but runs Attention's kernels and
    output projection: every non-weight attribute a plain Attention has (the settings those methods read) is set
    on it too, from the same place (Attention.set_static)."""
    from flax import nnx

    from tessera.models.attention import Attention
    from tessera.models.mla import MlaAttention

    def settings(module):
        return {k for k, v in vars(module).items() if not isinstance(v, (nnx.Variable, nnx.Module))
                and not k.startswith("_")}

    cfg = tiny_config(**FAMILIES["deepseek"]).model
    plain = nnx.eval_shape(lambda: Attention(cfg, "dot_product", nnx.Rngs(params=0)))
    latent = nnx.eval_shape(lambda: MlaAttention(cfg, "dot_product", nnx.Rngs(params=0)))
    assert settings(plain) and settings(plain) <= settings(latent)
    assert latent.qk_norm == "" and not latent.temperature_tuning and latent.dims == (8, 16, 10, 12)


def test_olmo3_norms_after_attention_and_mlp_only_and_its_qk_norms_span_all_heads():
    """OLMo 3's layer: x + norm(attention(x)), x + norm(mlp(x)), with no norm before either; its query and key
    norms take one mean square over all of a token's heads (transformers' over the flat [N * H] projection),
    unlike Qwen3's per head: scaling one head's queries changes every head's normalized queries."""
    from tessera.models.attention import HeadsRMSNorm

    params = build_model(tiny_config(**FAMILIES["olmo3"]).model).param_shapes()
    layer = params["layers"]["layer_0"]
    assert set(layer) == {"attention", "post_attention_norm", "mlp", "post_mlp_norm"}
    assert (layer["attention"]["query_norm"]["scale"].shape, layer["attention"]["key_norm"]["scale"].shape) == (
        (1, 4, 6), (1, 2, 6))  # [blocks, heads, head_dim]: one block; 4 query and 2 kv heads of 6 (TINY)
    assert set(params["tail"]) == {"layer_0", "layer_1"}
    norm = HeadsRMSNorm(3, 4, "heads", 1e-6, "float32", nnx.Rngs(0))
    norm.scale[...] = jax.random.normal(jax.random.key(1), (3, 4))
    x = jax.random.normal(jax.random.key(2), (2, 5, 3, 4))
    flat = x.reshape(2, 5, 12)
    want = flat / jnp.sqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + 1e-6) * norm.scale[...].reshape(12)
    np.testing.assert_allclose(norm(x).reshape(2, 5, 12), want, rtol=1e-6, atol=1e-6)
    scaled = norm(x.at[:, :, 0].multiply(3.0))
    assert float(jnp.abs(scaled[:, :, 1:] - norm(x)[:, :, 1:]).min()) > 0  # the other heads moved too


def test_olmo3_local_layers_see_their_window_and_the_global_layer_everything():
    """The three local layers of a pattern attend within sliding_window_size, the fourth over the whole past: with
    only the global layer's values left, a token changed at position 0 moves every later position."""
    model = build_model(tiny_config(**dict(FAMILIES["olmo3"], base_num_decoder_layers=4)).model)
    params = model.init(jax.random.key(3))
    changed = TOKENS.at[:, 0].set((TOKENS[:, 0] + 1) % 96)

    def moved(p):
        return np.abs(np.asarray(model.apply(p, changed) - model.apply(p, TOKENS))).max(axis=(0, 2))

    assert (moved(params)[1:] > 1e-4).all()
    local_only = jax.tree.map(lambda a: a, params)
    wv = local_only["layers"]["layer_3"]["attention"]["wv_dkh"]
    local_only["layers"]["layer_3"]["attention"]["wv_dkh"] = jnp.zeros_like(wv)  # the global layer adds nothing
    # three local layers of window 4 carry a change at most 3 x 3 positions on: to position 9, not past it
    after = moved(local_only)
    assert (after[:10] > 0).all() and (after[10:] == 0).all(), after


def test_olmo2_is_olmo3_without_windows_one_layer_a_block():
    """OLMo 2's block is one of OLMo 3's layers (no window, the global rotary): a 5-layer olmo2 computes what an
    olmo3 without windows whose local layers rotate at the global theta computes with the same weights in its
    4-layer block and 1-layer tail (every layer's parameters the same tensors), and scans over single layers."""
    keys = dict(base_num_decoder_layers=5, rope_max_timescale=20000)
    olmo2 = build_model(tiny_config(decoder_block="olmo2", **keys).model)
    olmo3 = build_model(tiny_config(decoder_block="olmo3", sliding_window_size=0, local_rope_max_timescale=-1,
                                    **keys).model)
    params = olmo2.init(jax.random.key(4))
    assert jax.tree.leaves(params["layers"])[0].shape[0] == 5  # five scanned blocks of one layer
    assert set(params["layers"]) == {"attention", "post_attention_norm", "mlp", "post_mlp_norm"}
    layer = [jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(5)]
    as_olmo3 = {k: v for k, v in params.items() if k != "layers"}
    as_olmo3["layers"] = {f"layer_{j}": jax.tree.map(lambda x: x[None], layer[j]) for j in range(4)}
    as_olmo3["tail"] = {"layer_0": layer[4]}
    jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape), olmo3.param_shapes(), as_olmo3)
    a, b = olmo2.apply(params, TOKENS), olmo3.apply(as_olmo3, TOKENS)
    assert float(jnp.abs(a).max()) > 1.0
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_olmo3_with_its_heads_split_over_tensor_gives_the_same_losses_as_one_device(tmp_path):
    """OLMo 3's query and key norms take one mean square over all of a token's heads: with the heads split over
    a tensor axis (fsdp 4 x tensor 2; 4 query and 2 kv heads) each device holds part of them, and the norm must
    still span all (moved into per-shard code, such as splash attention's shard_map over the heads, it would see
    one device's heads only). Same losses and gradient norms as one device, over one 3-local/1-global pattern."""
    one = _moe_losses(tmp_path, "one", 1, FAMILIES["olmo3"], base_num_decoder_layers=4)
    split = _moe_losses(tmp_path, "split", 8, FAMILIES["olmo3"], base_num_decoder_layers=4, ici_fsdp_parallelism=4,
                        ici_tensor_parallelism=2)
    for key in ("loss", "grad_norm"):
        a, b = np.array([r[key] for r in one]), np.array([r[key] for r in split])
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=key)
