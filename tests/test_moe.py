"""The MoE layer (models/moe.py) against a reference written here, one token at a time in NumPy:
every token through its top-k experts with its weights, for capacity routing with room for every
token, dropless routing (ragged_dot and the megablox key) and each routing variant; the copies
capacity routing drops; the load-balancing loss."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from tessera.models.moe import MoeMlp, expert_capacity
from tessera.models.moe_balance import finish_aux

ACTS = {"silu": lambda a: a / (1 + np.exp(-a)), "linear": lambda a: a}


def _layer(keys, router_bias=False, scale_inputs=False, seed=0):
    """(MoeMlp in float32 with 4 experts, 2 per token unless `keys` say otherwise, its config, x [2, 8, D])."""
    cfg = tiny_config(**{"decoder_block": "mixtral", "num_experts": 4, "num_experts_per_tok": 2, "dtype": "float32",
                         **keys}).model
    layer = MoeMlp(cfg, nnx.Rngs(seed), router_bias=router_bias, scale_inputs=scale_inputs)
    rng = np.random.default_rng(seed + 1)
    if router_bias:
        layer.router_bias_e[...] = jnp.asarray(rng.normal(size=cfg.num_experts), jnp.float32)
    if cfg.routed_bias:  # as the train step would have moved it: changes the choice, not the weights
        layer.routed_bias_e[...] = jnp.asarray(0.3 * rng.normal(size=cfg.num_experts), jnp.float32)
    return layer, cfg, jnp.asarray(rng.normal(size=(2, 8, cfg.emb_dim)), jnp.float32)


def _scores(layer, cfg, x):
    """The router's scores [B, T, E] of `x`: softmax or sigmoid of its logits."""
    logits = np.asarray(x, np.float64) @ np.asarray(layer.router_de[...], np.float64)
    if hasattr(layer, "router_bias_e"):
        logits = logits + np.asarray(layer.router_bias_e[...], np.float64)
    if cfg.routed_score_func == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    return scores / scores.sum(-1, keepdims=True)


def _expert(layer, cfg, expert, h):
    """Expert `expert`'s gated MLP of one token h [D]."""
    wis = [np.asarray(getattr(layer, f"wi_{i}")[...], np.float64)[expert] for i in range(len(cfg.mlp_activations))]
    act = np.prod([ACTS[a](h @ wi) for a, wi in zip(cfg.mlp_activations, wis)], axis=0)
    return act @ np.asarray(layer.wo_efd[...], np.float64)[expert]


def _reference(layer, cfg, x, capacity=None, scale_inputs=False):
    """(output [B, T, D], load-balancing loss, dropped share) of routing `x` token by token; with
    `capacity`, an expert takes the first `capacity` copies of each sequence, first choices of every
    token before second choices, earlier tokens first."""
    x, scores = np.asarray(x, np.float64), _scores(layer, cfg, x)
    choice = scores + (np.asarray(layer.routed_bias_e[...], np.float64) if cfg.routed_bias else 0.0)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    out, copies, dropped = np.zeros_like(x), np.zeros(e), 0
    b_size, t_size, _ = x.shape
    for b in range(b_size):
        chosen = []
        for t in range(t_size):
            c = choice[b, t]
            if cfg.n_routing_groups > 1:  # the best topk_routing_group groups by the sum of their two best (or best)
                groups = c.reshape(cfg.n_routing_groups, -1)
                best_two = np.sort(groups, axis=1)[:, -2:]
                group_score = best_two[:, -1] if cfg.routing_group_score == "max" else best_two.sum(1)
                best = np.argsort(-group_score, kind="stable")[:cfg.topk_routing_group]
                allowed = np.isin(np.arange(e) // groups.shape[1], best)
                c = np.where(allowed, c, -np.inf)
            top = np.argsort(-c, kind="stable")[:k]
            w = scores[b, t, top] / (scores[b, t, top].sum() if cfg.norm_topk_prob else 1.0)
            chosen.append((top, w * cfg.routed_scaling_factor))
            copies[top] += 1
        fill = np.zeros(e, int)
        for j in range(k):
            for t, (top, w) in enumerate(chosen):
                expert = top[j]
                if capacity is not None and fill[expert] >= capacity:
                    dropped += 1
                    continue
                fill[expert] += 1
                y = _expert(layer, cfg, expert, x[b, t] * (w[j] if scale_inputs else 1.0))
                out[b, t] += y * (1.0 if scale_inputs else w[j])
    copies_per_token = copies / (b_size * t_size)
    probs = scores / scores.sum(-1, keepdims=True)  # sigmoid scores normalized, as the router loss takes them
    loss = e * np.sum(copies_per_token * probs.mean((0, 1)))
    return out, loss, dropped / (b_size * t_size * k)


DEEPSEEK = dict(decoder_block="deepseek", head_dim=24, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=8,
                qk_rope_head_dim=16, v_head_dim=10, num_experts=8, num_experts_per_tok=3, n_routing_groups=4,
                topk_routing_group=2, routed_score_func="sigmoid", routed_bias=True, routed_scaling_factor=2.5)
# DeepSeek-V2: softmax scores, no bias, groups ranked by their best expert, weights not renormalized
DEEPSEEK_V2 = dict(DEEPSEEK, q_lora_rank=0, routed_score_func="softmax", routed_bias=False, routing_group_score="max",
                   norm_topk_prob=False, routed_scaling_factor=1.0)


@pytest.mark.parametrize("keys,layer_keys", [
    (dict(capacity_factor=-1), {}),
    (dict(capacity_factor=2.0), {}),  # 2 x the fair share of 8 tokens: 8 slots, room for all
    (dict(sparse_matmul=True), {}),
    (dict(megablox=True), {}),  # jax.lax.ragged_dot off TPUs
    (dict(norm_topk_prob=False), {}),
    (dict(routed_score_func="sigmoid"), {}),
    (dict(routed_score_func="sigmoid", norm_topk_prob=False, routed_scaling_factor=2.5), {}),
    (dict(num_experts_per_tok=4), {}),  # every expert: the router loss is k, whatever the probabilities
    (DEEPSEEK, {}),
    (dict(DEEPSEEK, sparse_matmul=True), {}),
    (DEEPSEEK_V2, {}),
    (dict(DEEPSEEK_V2, sparse_matmul=True), {}),
    (dict(DEEPSEEK_V2, n_routing_groups=8, topk_routing_group=3), {}),  # groups of one expert: their scores
    # Llama 4: one expert by sigmoid score, the token multiplied by it on the way in
    (dict(num_experts_per_tok=1, routed_score_func="sigmoid", norm_topk_prob=False), dict(scale_inputs=True)),
    (dict(num_experts_per_tok=1, routed_score_func="sigmoid", norm_topk_prob=False, sparse_matmul=True),
     dict(scale_inputs=True)),
    (dict(routed_bias=False), dict(router_bias=True)),  # gpt-oss's learned router bias (softmax of the chosen)
])
def test_routing_equals_every_token_through_its_experts(keys, layer_keys):
    layer, cfg, x = _layer(keys, **layer_keys)
    out, aux = layer(x)
    aux = finish_aux(aux, cfg)
    want, loss, _ = _reference(layer, cfg, x, scale_inputs=layer_keys.get("scale_inputs", False))
    np.testing.assert_allclose(out, want, atol=2e-6)
    np.testing.assert_allclose(aux["moe_load_balance_loss"], loss, rtol=1e-6)
    assert float(aux["moe_dropped_fraction"]) == 0.0


def test_shared_experts_add_a_dense_mlp_of_their_width():
    layer, cfg, x = _layer(dict(shared_experts=2))
    out, _ = layer(x)
    want, _, _ = _reference(layer, cfg, x)
    assert layer.shared.wi_0.shape[-1] == 2 * cfg.expert_mlp_dim
    np.testing.assert_allclose(out, want + np.asarray(layer.shared(x), np.float64), atol=2e-6)


@pytest.mark.parametrize("capacity_factor,length,slots", [(0.25, 8, 1), (0.5, 8, 2), (1.0, 8, 4), (0.75, 7, 3)])
def test_capacity_drops_the_copies_past_each_expert_s_slots(capacity_factor, length, slots):
    """C = ceil(capacity_factor x k x T / E) slots per expert and sequence; first choices fill them
    before second choices, earlier tokens before later ones; a dropped copy adds nothing."""
    layer, cfg, x = _layer(dict(capacity_factor=capacity_factor))
    x = x[:, :length]
    assert expert_capacity(length, cfg) == slots
    out, aux = layer(x)
    want, _, dropped = _reference(layer, cfg, x, capacity=slots)
    assert dropped > 0
    np.testing.assert_allclose(out, want, atol=2e-6)
    np.testing.assert_allclose(aux["moe_dropped_fraction"], dropped, rtol=1e-6)


@pytest.mark.parametrize("capacity_factor,tokens,experts,slots", [(1.1, 3000, 8, 825), (2.2, 100, 8, 55),
                                                                  (1.35, 3000, 4, 2025), (1.1, 3001, 8, 826)])
def test_capacity_is_the_ceiling_of_the_exact_product(capacity_factor, tokens, experts, slots):
    """C = ceil(capacity_factor x k x T / E) with capacity_factor as written: in floats 1.1 x 2 x 3000 / 8
    is 825.0000000000001, and its ceiling gave Mixtral's experts 826 slots of a 3,000-token sequence."""
    cfg = tiny_config(decoder_block="mixtral", num_experts=experts, num_experts_per_tok=2,
                      capacity_factor=capacity_factor).model
    assert expert_capacity(tokens, cfg) == slots


def _received_reference(layer, cfg, x, ep, factor):
    """(output, dropped share) of dropless routing over an expert axis of `ep` devices, a sequence of
    `x` per device and `ep` consecutive sequences per expert group: each device sends every expert
    shard its copies sorted by expert (token order within one); a shard's buffer of
    ceil(factor x T x k) rows takes the runs source by source, and drops the copies past its end."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    b_size, t_size, _ = x.shape
    rows = min(ep * t_size * k, math.ceil(factor * t_size * k))
    x, scores = np.asarray(x, np.float64), _scores(layer, cfg, x)
    out, dropped = np.zeros_like(x), 0
    for first in range(0, b_size, ep):
        sent = []
        for b in range(first, first + ep):
            copies = []
            for t in range(t_size):
                top = np.argsort(-scores[b, t], kind="stable")[:k]
                copies += [(expert, t, w) for expert, w in zip(top, scores[b, t, top] / scores[b, t, top].sum())]
            sent.append(sorted(copies, key=lambda c: c[0]))  # a stable sort
        for shard in range(ep):
            taken = 0
            for source, copies in enumerate(sent):
                run = [c for c in copies if c[0] // (e // ep) == shard]
                kept = max(0, min(len(run), rows - taken))
                taken, dropped = taken + len(run), dropped + len(run) - kept
                for expert, t, w in run[:kept]:
                    out[first + source, t] += w * _expert(layer, cfg, expert, x[first + source, t])
    return out, dropped / (b_size * t_size * k)


@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_a_bounded_receive_buffer_drops_the_copies_past_its_end(factor):
    """Dropless routing over expert 4 x fsdp 2 with ragged_buffer_factor: the copies each expert shard
    keeps, the output and the dropped share are the reference's (4.0: the worst case, nothing dropped)."""
    layer, cfg, _ = _layer(dict(sparse_matmul=True, num_experts=8, ragged_buffer_factor=factor))
    x = jnp.asarray(np.random.default_rng(7).normal(size=(8, 8, cfg.emb_dim)), jnp.float32)
    names = ("data", "stage", "fsdp", "sequence", "tensor", "expert")
    mesh = jax.make_mesh((1, 1, 2, 1, 1, 4), names, axis_types=(jax.sharding.AxisType.Auto,) * 6)
    graph, state = nnx.split(layer)
    with jax.set_mesh(mesh):
        out, aux = jax.jit(lambda s, x: nnx.merge(graph, s)(x))(state, x)
    want, dropped = _received_reference(layer, cfg, x, 4, factor)
    assert (dropped > 0) == (factor < 4)
    np.testing.assert_allclose(out, want, atol=2e-6)
    np.testing.assert_allclose(aux["moe_dropped_fraction"], dropped, rtol=1e-6)


def test_the_pallas_megablox_kernel_equals_every_token_through_its_experts(monkeypatch):
    """megablox=true with the Pallas kernel in its interpreter (what TPUs run compiled), biases on."""
    import tessera.models.moe as moe

    monkeypatch.setattr(moe, "grouped_matmul_kernel", lambda cfg: "megablox_interpret")
    layer, cfg, x = _layer(dict(megablox=True, mlp_bias=True))
    rng = np.random.default_rng(3)
    layer.bo_ed[...] = jnp.asarray(rng.normal(size=layer.bo_ed.shape), jnp.float32)
    out, _ = layer(x)
    want, _, _ = _reference(layer, cfg, x)
    experts, weights, _ = layer.route(x)  # each copy adds its expert's output bias with its weight
    bias = np.einsum("btk,btkd->btd", np.asarray(weights), np.asarray(layer.bo_ed[...])[np.asarray(experts)])
    np.testing.assert_allclose(out, want + bias, atol=2e-6)


def test_the_train_step_adds_load_balance_loss_weight_times_the_router_loss():
    """With plain SGD, no clipping and a constant rate, the update with load_balance_loss_weight=w
    differs from the one with 0 by -rate x w x the gradient of moe_load_balance_loss, and the step
    reports that loss unweighted, beside the next-token loss it leaves out."""
    from tessera.step import create_state, make_train_step, setup

    def one_step(weight):
        cfg = tiny_config(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, opt_type="sgd",
                          gradient_clipping_threshold=0.0, learning_rate=0.5, cosine_learning_rate_final_fraction=1.0,
                          load_balance_loss_weight=weight, capacity_factor=1.0)
        trainer = setup(cfg, jax.devices()[:1])
        state = create_state(trainer, 0)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (trainer.plan.global_batch, 13)), jnp.int32)
        batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens),
                 "positions": jnp.broadcast_to(jnp.arange(13), tokens.shape)}
        new_state, stats = jax.jit(make_train_step(trainer, 0))(state, batch)
        router_grad = jax.grad(lambda p: trainer.model.apply_with_aux(p, tokens[:, :-1])[1]["moe_load_balance_loss"])(
            state["params"])
        return state["params"], new_state["params"], stats, router_grad

    _, without, stats_without, _ = one_step(0.0)
    params, weighted, stats, router_grad = one_step(3.0)
    assert float(stats["loss"]) == float(stats_without["loss"])  # the next-token loss alone
    assert float(stats["moe_load_balance_loss"]) == float(stats_without["moe_load_balance_loss"]) > 1.0
    jax.tree.map(lambda a, b, g: np.testing.assert_allclose(a - b, -0.5 * 3.0 * g, atol=2e-6),
                 weighted, without, router_grad)
    assert np.abs(np.asarray(router_grad["layers"]["mlp"]["router_de"])).max() > 1e-3
