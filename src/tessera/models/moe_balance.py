"""What a mixture-of-experts layer (`tessera.models.moe`) reports about its routing, and the
two ways Tessera balances the experts' loads with it.

The router adds a load-balancing loss, E * sum_e c_e * p_e (c_e: token copies routed to
expert e per token, p_e: mean router probability of e), as in Switch Transformer and with
Hugging Face Mixtral's scale (num_experts_per_tok when perfectly balanced), so Mixtral's
router_aux_loss_coef carries over as `load_balance_loss_weight`. Each layer reports c and p
(per-layer aux entries, see `layer_statistics`); after the blocks the decoder forms the loss per
layer and averages it over layers (`finish_aux`), and the train step adds
`load_balance_loss_weight` times it to the loss. A pipeline averages c and p over its
microbatches before the product, so the loss is the whole batch's there too.
Gradient accumulation does not: each micro-batch's loss is its own (the train step weights them
by their target counts and reports their mean).

Auxiliary-loss-free balancing (`routed_bias`, DeepSeek-V3): `finish_aux` also turns c into each
expert's load (PER_LAYER_LOAD), and after every optimizer step the train step moves each layer's
choice bias towards balance with it (`update_routed_bias`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tessera.config import ModelConfig

# aux key of each MoE layer's expert loads [E] (copies per expert / fair share), stacked over
# layers [L, E] (with routed_bias): the train step moves routed_bias with it
PER_LAYER_LOAD = "per_layer/moe_expert_load"
# what each MoE layer reports (stacked over layers, like every "per_layer/" aux entry, and
# averaged over a pipeline's microbatches): token copies routed to each expert per token, and
# each expert's mean router probability, both [E]; `finish_aux` turns them into the loss
_COPIES, _MEAN_PROB = "per_layer/moe_copies_per_token", "per_layer/moe_mean_router_prob"


def layer_statistics(probs_bte, experts_btk, num_experts: int) -> dict:
    """One layer's per-layer aux: token copies per token routed to each expert (of `experts_btk`,
    each token's chosen experts [B, T, k]) and the mean router probability of each (of `probs_bte`,
    [B, T, E], summing to one per token), [E] each (`finish_aux` makes the loss and loads of them)."""
    copies_e = jnp.sum(jnp.mean(jax.nn.one_hot(experts_btk, num_experts, dtype=jnp.float32), axis=(0, 1)), axis=0)
    return {_COPIES: copies_e, _MEAN_PROB: jnp.mean(probs_bte, axis=(0, 1))}


def finish_aux(aux: dict, cfg: ModelConfig) -> dict:
    """The blocks' aux (scalars averaged over layers, "per_layer/" entries stacked [L, ...]) with
    the MoE layers' statistics replaced by the load-balancing loss, E * sum_e c_e * p_e averaged
    over layers, and (routed_bias) by the expert loads PER_LAYER_LOAD [L, E]."""
    if _COPIES not in aux:
        return aux
    aux, e = dict(aux), cfg.num_experts
    copies_le, prob_le = aux.pop(_COPIES), aux.pop(_MEAN_PROB)
    aux["moe_load_balance_loss"] = jnp.mean(e * jnp.sum(copies_le * prob_le, axis=-1))
    if cfg.routed_bias:  # each expert's share of the token copies (1: its fair share)
        aux[PER_LAYER_LOAD] = copies_le * (e / cfg.num_experts_per_tok)
    return aux


def update_routed_bias(params: dict, loads_le, rate: float, mtp_loads_de=None) -> dict:
    """`params` with every MoE layer's routed_bias moved by `rate` towards balance: down where
    the layer's expert took more than its fair share of the token copies (load > 1), up where
    less. `loads_le` [L, E]: the layers' loads (PER_LAYER_LOAD), in the order of the stacked
    `layers` (scan_layers=true; a circular pipeline stores them [R, L/R], the same order) or of
    `layers_0 ... layers_{L-1}`. `mtp_loads_de` [D, E]: those of the multi-token-prediction
    depths' blocks `mtp_1 ... mtp_D` (tessera.models.mtp), when there are any."""
    def step(bias, load):
        return bias + rate * jnp.sign(1.0 - load.reshape(bias.shape)).astype(bias.dtype)

    def moved(layer, load):
        return {**layer, "mlp": {**layer["mlp"], "routed_bias_e": step(layer["mlp"]["routed_bias_e"], load)}}

    out = dict(params)
    for k in range(0 if mtp_loads_de is None else mtp_loads_de.shape[0]):
        out[f"mtp_{k + 1}"] = {**params[f"mtp_{k + 1}"], "block": moved(params[f"mtp_{k + 1}"]["block"],
                                                                         mtp_loads_de[k])}
    if "layers" in params:
        return {**out, "layers": moved(params["layers"], loads_le)}
    for i in range(loads_le.shape[0]):
        out[f"layers_{i}"] = moved(params[f"layers_{i}"], loads_le[i])
    return out
