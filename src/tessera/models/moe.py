"""Sparse mixture-of-experts MLP: a router picks `num_experts_per_tok` of `num_experts`
gated MLPs per token and mixes their outputs with the renormalized router probabilities.

Two ways to run the experts, with the same result when nothing is dropped (tested):

- capacity routing (default): each expert takes at most
  C = ceil(capacity_factor * k * T / E) tokens of a sequence of T tokens (capacity_factor=-1:
  C = T, so no token is ever dropped). Tokens are placed in expert buffers [E, C, D] by
  one-hot dispatch matmuls; a token over capacity skips that expert (its residual stream
  passes unchanged). First choices are placed before second choices, earlier tokens before
  later ones. Buffers are sharded over the `expert` mesh axis, so with expert parallelism
  each device computes only its experts and XLA moves tokens with all-to-alls.
- dropless (`sparse_matmul=true` or `megablox=true`): token copies are sorted by expert and
  each expert multiplies exactly its tokens with a grouped matmul (`jax.lax.ragged_dot`); no
  capacity, no padding, no dropped tokens. On a mesh without an expert axis each device sorts
  only its own tokens (see `dropless_experts`); with one, the whole batch's copies are sorted.

The router adds a load-balancing loss, E * sum_e c_e * p_e (c_e: token copies routed to
expert e per token, p_e: mean router probability of e), as in Switch Transformer and with
Hugging Face Mixtral's scale (num_experts_per_tok when perfectly balanced), so Mixtral's
router_aux_loss_coef carries over as `load_balance_loss_weight`. The decoder averages it over
layers and the train step adds `load_balance_loss_weight` times it to the loss.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from tessera.config import ModelConfig
from tessera.mesh import shard_logically
from tessera.models.layers import ACTIVATIONS, fan_in_std, param


def expert_capacity(tokens: int, cfg: ModelConfig) -> int:
    """Slots per expert for a group of `tokens` tokens (see the module docstring)."""
    if cfg.capacity_factor <= 0:
        return tokens
    fair_share = tokens * cfg.num_experts_per_tok / cfg.num_experts
    return max(1, min(tokens, math.ceil(cfg.capacity_factor * fair_share)))


class MoeMlp(nnx.Module):
    """Router [D, E] and E gated MLPs ([E, D, F] in, [E, F, D] out)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, e, wdtype = cfg.emb_dim, cfg.mlp_dim, cfg.num_experts, cfg.weight_dtype
        self.router_de = param(rngs, (d, e), ("embed", None), wdtype, fan_in_std(d))
        for i in range(len(cfg.mlp_activations)):
            setattr(self, f"wi_{i}", param(rngs, (e, d, f), ("exp", "embed", "mlp"), wdtype, fan_in_std(d)))
        self.wo_efd = param(rngs, (e, f, d), ("exp", "mlp", "embed"), wdtype, fan_in_std(f))
        self.cfg, self.dtype = cfg, cfg.dtype
        self.dropless = cfg.sparse_matmul or cfg.megablox

    def __call__(self, x_btd):
        cfg = self.cfg
        logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.router_de[...].astype(jnp.float32))
        top_logits_btk, experts_btk = jax.lax.top_k(logits_bte, cfg.num_experts_per_tok)
        weights_btk = jax.nn.softmax(top_logits_btk, axis=-1)  # = softmax over all, renormalized over the top k
        aux = {"moe_load_balance_loss": self.load_balance_loss(logits_bte, experts_btk)}
        if self.dropless:
            out_btd = self.dropless_experts(x_btd, experts_btk, weights_btk)
            aux["moe_dropped_fraction"] = jnp.zeros((), jnp.float32)
        else:
            out_btd, aux["moe_dropped_fraction"] = self.capacity_experts(x_btd, experts_btk, weights_btk)
        return checkpoint_name(out_btd, "mlpwo"), aux

    def load_balance_loss(self, logits_bte, experts_btk):
        e = self.cfg.num_experts
        copies_per_token_e = jnp.sum(jnp.mean(jax.nn.one_hot(experts_btk, e, dtype=jnp.float32), axis=(0, 1)), axis=0)
        mean_prob_e = jnp.mean(jax.nn.softmax(logits_bte, axis=-1), axis=(0, 1))
        return e * jnp.sum(copies_per_token_e * mean_prob_e)

    def expert_mlp(self, h, contract: str):
        """The gated MLP of every expert on `h`, an [E, ..., D] buffer (einsum spec `contract`)."""
        out = None
        for i, name in enumerate(self.cfg.mlp_activations):
            a = jnp.einsum(contract, h, getattr(self, f"wi_{i}")[...].astype(self.dtype))
            a = ACTIVATIONS[name](checkpoint_name(a, f"mlpwi_{i}"))
            out = a if out is None else out * a
        return checkpoint_name(out, "mlpwi")  # names as the dense MLP's, for remat_policy=custom

    def capacity_experts(self, x_btd, experts_btk, weights_btk):
        b, t, _ = x_btd.shape
        k, e = self.cfg.num_experts_per_tok, self.cfg.num_experts
        capacity = expert_capacity(t, self.cfg)
        # slot order: all first choices of the row (by position), then all second choices, ...
        choice_bste = jax.nn.one_hot(experts_btk.transpose(0, 2, 1).reshape(b, k * t), e, dtype=jnp.int32)
        slot_bse = jnp.cumsum(choice_bste, axis=1) * choice_bste - 1  # position in the expert's buffer, -1: not routed
        kept_bse = (slot_bse >= 0) & (slot_bse < capacity)
        dropped = (b * t * k - jnp.sum(kept_bse)) / (b * t * k)  # every token copy has one slot
        dispatch_bsec = jax.nn.one_hot(jnp.where(kept_bse, slot_bse, -1), capacity, dtype=jnp.float32)
        dispatch_bktec = dispatch_bsec.reshape(b, k, t, e, capacity)
        combine_btec = jnp.einsum("bktec,btk->btec", dispatch_bktec, weights_btk)
        dispatch_btec = jnp.sum(dispatch_bktec, axis=1).astype(self.dtype)  # a token's k experts differ
        buffers_becd = jnp.einsum("btd,btec->becd", x_btd, dispatch_btec)
        buffers_becd = shard_logically(buffers_becd, ("act_batch_no_exp", "act_exp", None, "act_embed"))
        h_becf = self.expert_mlp(buffers_becd, "becd,edf->becf")
        h_becf = shard_logically(h_becf, ("act_batch_no_exp", "act_exp", None, "act_mlp"))
        out_becd = jnp.einsum("becf,efd->becd", h_becf, self.wo_efd[...].astype(self.dtype))
        out_btd = jnp.einsum("becd,btec->btd", out_becd, combine_btec.astype(self.dtype))
        return out_btd, dropped

    def dropless_experts(self, x_btd, experts_btk, weights_btk):
        """Dropless routing. Without expert parallelism each device sorts and groups only its own
        tokens (inside shard_map: batch split over data/fsdp, expert weights gathered, their MLP
        width split over tensor with a psum of the output), so no device ever holds the token
        copies of the global batch. With an expert axis the copies of the whole batch are sorted
        together (per-shard exchange over the expert axis is not implemented yet)."""
        mesh = jax.sharding.get_abstract_mesh()
        sizes = {} if mesh.empty else dict(mesh.shape)
        batch = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
        shards = math.prod(sizes.get(a, 1) for a in batch)
        if not batch or sizes.get("expert", 1) > 1 or sizes.get("sequence", 1) > 1 or x_btd.shape[0] % shards:
            return self._dropless(x_btd, experts_btk, weights_btk, self._expert_weights())
        tp = sizes.get("tensor", 1)
        tensor = "tensor" if tp > 1 and self.cfg.mlp_dim % tp == 0 else None
        rows = P(batch if len(batch) > 1 else batch[0], None, None)
        wi_spec, wo_spec = P(None, None, tensor), P(None, tensor, None)

        def local(x, experts, weights, wis, wo):
            out = self._dropless(x, experts, weights, (wis, wo))
            return jax.lax.psum(out, "tensor") if tensor else out

        wis, wo = self._expert_weights()
        return jax.shard_map(local, in_specs=(rows, rows, rows, [wi_spec] * len(wis), wo_spec), out_specs=rows,
                             check_vma=False)(x_btd, experts_btk, weights_btk, wis, wo)

    def _expert_weights(self):
        """([wi_0, wi_1, ...] as [E, D, F], wo [E, F, D]) in the compute dtype."""
        wis = [getattr(self, f"wi_{i}")[...].astype(self.dtype) for i in range(len(self.cfg.mlp_activations))]
        return wis, self.wo_efd[...].astype(self.dtype)

    def _dropless(self, x_btd, experts_btk, weights_btk, weights):
        wis, wo_efd = weights
        b, t, d = x_btd.shape
        k, e = self.cfg.num_experts_per_tok, self.cfg.num_experts
        flat_experts = experts_btk.reshape(-1)  # token copy i*k + j: token i's j-th expert
        order = jnp.argsort(flat_experts, stable=True)
        x_sorted = x_btd.reshape(b * t, d)[order // k]
        group_sizes = jnp.bincount(flat_experts, length=e).astype(jnp.int32)
        h = None
        for i, (name, w_edf) in enumerate(zip(self.cfg.mlp_activations, wis)):
            a = ACTIVATIONS[name](checkpoint_name(jax.lax.ragged_dot(x_sorted, w_edf, group_sizes), f"mlpwi_{i}"))
            h = a if h is None else h * a
        h = checkpoint_name(h, "mlpwi")
        out_sorted = jax.lax.ragged_dot(h, wo_efd, group_sizes)
        out_copies = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(b, t, k, d)
        return jnp.einsum("btkd,btk->btd", out_copies, weights_btk.astype(self.dtype))
