"""Sparse mixture-of-experts MLP: a router picks `num_experts_per_tok` of `num_experts`
gated MLPs per token and mixes their outputs with the router probabilities, renormalized over
the chosen experts (`norm_topk_prob=true`: Mixtral, Qwen3-MoE) or not.

Two ways to run the experts, with the same result when nothing is dropped (tested):

- capacity routing (default): each expert takes at most
  C = ceil(capacity_factor * k * T / E) tokens of a sequence of T tokens (capacity_factor=-1:
  C = T, so no token is ever dropped). Tokens are placed in expert buffers [E, C, D] by
  one-hot dispatch matmuls; a token over capacity skips that expert (its residual stream
  passes unchanged). First choices are placed before second choices, earlier tokens before
  later ones. Buffers are sharded over the `expert` mesh axis, so with expert parallelism
  each device computes only its experts and XLA moves tokens with all-to-alls.
- dropless (`sparse_matmul=true` or `megablox=true`): token copies are sorted by expert and
  each expert multiplies exactly its tokens with a grouped matmul (`jax.lax.ragged_dot`; with
  `megablox=true` on TPUs, the Pallas megablox kernel): no capacity, no padding, no dropped
  tokens. Each device sorts only its own tokens; with an expert axis it sends each expert
  shard its copies and gets the results back (see `dropless_experts`), into a buffer that
  `ragged_buffer_factor` may bound (then copies past its end are dropped and counted).

The router's statistics, the load-balancing loss made of them and auxiliary-loss-free balancing
(`routed_bias`) are in `tessera.models.moe_balance`.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from tessera.config import ModelConfig
from tessera.mesh import shard_logically, traced_platform
from tessera.models.grouped import grouped_matmul, grouped_matmul_kernel, padded_exchange, ragged_exchange, row_bias
from tessera.models.layers import ACTIVATIONS, Mlp, fan_in_std, param
from tessera.models.moe_balance import layer_statistics
from tessera.models.quantization import einsum as quantized_einsum


def describe_routing(m: ModelConfig, platform: str) -> tuple[str, str]:
    """(one start-up line saying how a mixture-of-experts model routes its tokens on `platform`, a
    warning or ""): the warning when capacity_factor is set for dropless routing, which never uses
    it (as in MaxText). ("", "") for a dense model."""
    if m.num_experts <= 1:
        return "", ""
    if m.sparse_matmul or m.megablox:
        key = "megablox=true" if m.megablox else "sparse_matmul=true"
        how = "the Pallas megablox kernel" if m.megablox and platform == "tpu" else "jax.lax.ragged_dot"
        if m.quantization:  # grouped_matmul: qwix's ragged dot whatever the kernel
            how = f"qwix's quantized ragged dot (quantization={m.quantization})" + (
                ", not the Pallas megablox kernel" if m.megablox and platform == "tpu" else "")
        warning = ""
        if m.capacity_factor > 0:
            warning = (f"capacity_factor={m.capacity_factor:g} is not used: dropless routing ({key}) never drops a "
                       "token; set sparse_matmul=false megablox=false for capacity routing, or leave capacity_factor "
                       "at -1")
        return f"MoE routing: dropless ({key}; token copies grouped by expert, {how})", warning
    if m.capacity_factor <= 0:
        return (f"MoE routing: capacity without a limit (capacity_factor={m.capacity_factor:g}: each expert has a "
                "slot for every token of a sequence, none is dropped, and every slot is computed); sparse_matmul=true "
                "computes only the routed copies (dropless grouped matmuls)"), ""
    return (f"MoE routing: capacity_factor={m.capacity_factor:g} (an expert takes at most {m.capacity_factor:g} x "
            "its fair share of a sequence's tokens; the others skip it)"), ""


def expert_capacity(tokens: int, cfg: ModelConfig) -> int:
    """Slots per expert for a group of `tokens` tokens (see the module docstring), in exact
    arithmetic on capacity_factor as written: in floats, 1.1 x 2 x 3000 / 8 is 825.0000000000001,
    whose ceiling gave 826 slots."""
    if cfg.capacity_factor <= 0:
        return tokens
    slots = Fraction(repr(cfg.capacity_factor)) * tokens * cfg.num_experts_per_tok / cfg.num_experts
    return max(1, min(tokens, math.ceil(slots)))


SWIGLU_ALPHA = 1.702  # gpt-oss: the gate's gain inside its activation, gate * act0(1.702 * gate) * (up + 1)


class ExpertWeights(NamedTuple):
    """The experts' weights in the compute dtype: input projections [E, D, F] (one per activation),
    the output projection [E, F, D] and, with mlp_bias, their biases ([E, F] each, and [E, D])."""

    wis: list
    wo: jax.Array
    bis: list
    bo: jax.Array | None


class MoeMlp(nnx.Module):
    """Router [D, E] and E gated MLPs ([E, D, F] in, [E, F, D] out); with `shared_experts`, a
    dense gated MLP every token goes through; with `routed_bias`, a per-expert choice bias [E].

    A family may ask for a learned router bias [E] added to the logits (`router_bias`: gpt-oss),
    for a sigmoid gate on the shared experts' output (`shared_gate`: Qwen3-Next), for gpt-oss's
    clamped gate (`clamped_glu`: gate * act0(1.702 * gate) * (up + 1), the gate clipped above at
    mlp_activations_limit and the up projection to +-limit), and for each token
    to enter an expert already multiplied by its weight, the outputs then added unweighted
    (`scale_inputs`: Llama 4). mlp_bias adds a bias after every expert projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, router_bias: bool = False, clamped_glu: bool = False,
                 scale_inputs: bool = False, shared_gate: bool = False):
        d, f, e, wdtype = cfg.emb_dim, cfg.expert_mlp_dim, cfg.num_experts, cfg.weight_dtype
        self.router_de = param(rngs, (d, e), ("embed", None), wdtype, fan_in_std(d))
        if router_bias:
            self.router_bias_e = param(rngs, (e,), (None,), wdtype, None, fill=0.0)
        if cfg.routed_bias:  # moved by the train step (auxiliary-loss-free balancing), never by gradients
            self.routed_bias_e = param(rngs, (e,), (None,), jnp.float32, None, fill=0.0)
        for i in range(len(cfg.mlp_activations)):
            setattr(self, f"wi_{i}", param(rngs, (e, d, f), ("exp", "embed", "mlp"), wdtype, fan_in_std(d)))
            if cfg.mlp_bias:
                setattr(self, f"bi_{i}_ef", param(rngs, (e, f), ("exp", "mlp"), wdtype, None, fill=0.0))
        self.wo_efd = param(rngs, (e, f, d), ("exp", "mlp", "embed"), wdtype, fan_in_std(f))
        if cfg.mlp_bias:
            self.bo_ed = param(rngs, (e, d), ("exp", "embed"), wdtype, None, fill=0.0)
        if cfg.shared_experts:
            self.shared = Mlp.of(cfg, rngs, cfg.shared_experts * f, fused=False)
            if shared_gate:  # Qwen3-Next: the shared expert's output times sigmoid(x w), a scalar per token
                self.shared_gate_d = param(rngs, (d,), ("embed",), wdtype, fan_in_std(d))
        self.cfg, self.dtype = cfg, cfg.dtype
        self.dropless = cfg.sparse_matmul or cfg.megablox
        self.router_bias, self.clamped_glu, self.scale_inputs = router_bias, clamped_glu, scale_inputs
        self.shared_gate = shared_gate and bool(cfg.shared_experts)

    def __call__(self, x_btd):
        experts_btk, weights_btk, aux = self.route(x_btd)
        if self.dropless:
            out_btd, aux["moe_dropped_fraction"] = self.dropless_experts(x_btd, experts_btk, weights_btk)
        else:
            out_btd, aux["moe_dropped_fraction"] = self.capacity_experts(x_btd, experts_btk, weights_btk)
        if self.cfg.shared_experts:
            shared_btd = self.shared(x_btd)
            if self.shared_gate:
                gate_bt = jnp.einsum("btd,d->bt", x_btd, self.shared_gate_d[...].astype(self.dtype))
                shared_btd = (shared_btd * jax.nn.sigmoid(gate_bt.astype(jnp.float32))[..., None]).astype(self.dtype)
            out_btd = out_btd + shared_btd
        return checkpoint_name(out_btd, "mlpwo"), aux

    def route(self, x_btd):
        """(experts_btk, weights_btk, aux): each token's top-k experts and their weights.

        Scores are the softmax of the router logits, or their sigmoids (`routed_score_func`).
        Experts are chosen on the scores plus `routed_bias` (when on), only from the token's
        best `topk_routing_group` of `n_routing_groups` groups (a group scores the sum of its two
        best, or with `routing_group_score=max` its best); they are weighted by their scores,
        renormalized to sum to one (`norm_topk_prob`) and multiplied by `routed_scaling_factor`."""
        cfg, e = self.cfg, self.cfg.num_experts
        logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.router_de[...].astype(jnp.float32))
        if self.router_bias:
            logits_bte = logits_bte + self.router_bias_e[...].astype(jnp.float32)
        sigmoid = cfg.routed_score_func == "sigmoid"
        scores_bte = jax.nn.sigmoid(logits_bte) if sigmoid else jax.nn.softmax(logits_bte, axis=-1)
        choice_bte = scores_bte
        if cfg.routed_bias:
            choice_bte = choice_bte + jax.lax.stop_gradient(self.routed_bias_e[...])
        if cfg.n_routing_groups > 1:
            groups = choice_bte.reshape(*choice_bte.shape[:2], cfg.n_routing_groups, e // cfg.n_routing_groups)
            if cfg.routing_group_score == "max":  # DeepSeek-V2's group-limited greedy choice
                group_score_btg = jnp.max(groups, axis=-1)
            else:
                group_score_btg = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)
            _, best_btg = jax.lax.top_k(group_score_btg, cfg.topk_routing_group)
            allowed_btg = jnp.sum(jax.nn.one_hot(best_btg, cfg.n_routing_groups, dtype=jnp.bool_), axis=2) > 0
            allowed_bte = jnp.repeat(allowed_btg, e // cfg.n_routing_groups, axis=-1)
            choice_bte = jnp.where(allowed_bte, choice_bte, -jnp.inf)
        _, experts_btk = jax.lax.top_k(choice_bte, cfg.num_experts_per_tok)
        weights_btk = jnp.take_along_axis(scores_bte, experts_btk, axis=-1)
        if cfg.norm_topk_prob:
            weights_btk = weights_btk / (jnp.sum(weights_btk, axis=-1, keepdims=True) + (1e-20 if sigmoid else 0.0))
        weights_btk = weights_btk * cfg.routed_scaling_factor
        probs_bte = scores_bte / jnp.sum(scores_bte, axis=-1, keepdims=True) if sigmoid else scores_bte
        return experts_btk, weights_btk, layer_statistics(probs_bte, experts_btk, e)

    def expert_mlp(self, h, contract: str, weights: ExpertWeights):
        """The gated MLP of every expert on `h`, a [B, E, C, D] buffer (einsum spec `contract`), with the
        input weights `weights.wis` ([E, D, F] each) and their biases."""
        outs = []
        for i, w in enumerate(weights.wis):
            a = quantized_einsum(contract, h, w, self.cfg.quantization)
            if weights.bis:
                a = a + weights.bis[i][None, :, None, :]
            outs.append(checkpoint_name(a, f"mlpwi_{i}"))
        return checkpoint_name(self.gated(outs), "mlpwi")  # names as the dense MLP's, for remat_policy=custom

    def gated(self, projections):
        """The experts' activation of their input projections: the product of mlp_activations applied
        to each, or gpt-oss's clamped gate (`clamped_glu`)."""
        acts = [ACTIVATIONS[name] for name in self.cfg.mlp_activations]
        dtype = projections[0].dtype
        if self.cfg.activations_in_float32:  # rounded to dtype once, at the end
            projections = [a.astype(jnp.float32) for a in projections]
        if not self.clamped_glu:
            out = None
            for act, a in zip(acts, projections):
                out = act(a) if out is None else out * act(a)
            return out.astype(dtype)
        gate, up = projections
        limit = self.cfg.mlp_activations_limit
        if limit > 0:
            gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
        return (gate * acts[0](SWIGLU_ALPHA * gate) * (up + 1)).astype(dtype)

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
        if self.scale_inputs:  # the weights go in with the tokens, and the outputs come back unweighted
            combine_btec, dispatch_btec = dispatch_btec, combine_btec.astype(self.dtype)
        # With an expert axis: each device gathers its expert group's rows (batch over data x fsdp only) and keeps
        # its own experts' columns of the dispatch and combine masks, so the dispatch and combine einsums are
        # local. Left to itself, XLA's partitioner gathered the whole global batch on every device (Mixtral 8x7B
        # over fsdp 64 x expert 4 on a v6e-256: 82 GiB per chip with remat_policy=full).
        x_btd = shard_logically(x_btd, ("act_batch_no_exp", None, "act_embed"))
        dispatch_btec = shard_logically(dispatch_btec, ("act_batch_no_exp", None, "act_exp", None))
        combine_btec = shard_logically(combine_btec.astype(self.dtype), ("act_batch_no_exp", None, "act_exp", None))
        buffers_becd = jnp.einsum("btd,btec->becd", x_btd, dispatch_btec)
        buffers_becd = shard_logically(buffers_becd, ("act_batch_no_exp", "act_exp", None, "act_embed"))
        weights = self._expert_weights()
        h_becf = self.expert_mlp(buffers_becd, "becd,edf->becf", weights)
        h_becf = shard_logically(h_becf, ("act_batch_no_exp", "act_exp", None, "act_mlp"))
        out_becd = quantized_einsum("becf,efd->becd", h_becf, weights.wo, self.cfg.quantization)
        if weights.bo is not None:  # empty slots get it too, and combine gives them no weight
            out_becd = out_becd + weights.bo[None, :, None, :]
        out_btd = jnp.einsum("becd,btec->btd", out_becd, combine_btec)  # summed over the expert axis
        return shard_logically(out_btd, ("batch", None, "act_embed")), dropped

    def dropless_experts(self, x_btd, experts_btk, weights_btk):
        """(output, fraction of token copies dropped: 0 unless ragged_buffer_factor > 0).

        Dropless routing inside shard_map, so no device ever holds the token copies of the
        global batch: the batch is split over data/fsdp/expert, the experts over `expert`, their
        MLP width over `tensor` (partial outputs summed with a psum).

        Without an expert axis each device sorts and groups only its own tokens against all
        experts (gathered). With one, each device sorts its token copies by expert, sends each
        expert shard its rows (`grouped.ragged_exchange`), groups what it received by local expert for the
        grouped matmuls, and sends the results back the same way. Routing is per token, so a sequence
        axis splits the token copies as the batch axes do: each device routes its own part of its
        sequences. A batch or length the mesh does not divide falls back to sorting the whole batch's
        copies together."""
        mesh = jax.sharding.get_abstract_mesh()
        sizes = {} if mesh.empty else dict(mesh.shape)
        ep, e = sizes.get("expert", 1), self.cfg.num_experts
        batch = tuple(a for a in ("data", "fsdp", "expert") if sizes.get(a, 1) > 1)
        sequence = "sequence" if sizes.get("sequence", 1) > 1 else None
        shards = math.prod(sizes.get(a, 1) for a in batch)
        if (not batch and not sequence) or x_btd.shape[0] % shards or e % ep \
                or (sequence and x_btd.shape[1] % sizes["sequence"]):
            return self._dropless(x_btd, experts_btk, weights_btk, self._expert_weights()), jnp.zeros((), jnp.float32)
        tp = sizes.get("tensor", 1)
        tensor = "tensor" if tp > 1 and self.cfg.expert_mlp_dim % tp == 0 else None
        experts = "expert" if ep > 1 else None
        rows = P(batch or None, sequence, None)
        token_axes = batch + ((sequence,) if sequence else ())  # the axes that split the token copies
        ragged = traced_platform() != "cpu"  # XLA:CPU has no ragged all-to-all

        def local(x, experts_btk, weights_btk, weights):
            if tensor and weights.bo is not None:  # the partial outputs are summed over tensor: add the bias once
                weights = weights._replace(bo=jnp.where(jax.lax.axis_index("tensor") == 0, weights.bo, 0))
            if experts:
                out, dropped = self._dropless_expert_parallel(x, experts_btk, weights_btk, weights, ep, ragged)
                dropped = jax.lax.pmean(dropped, token_axes)  # every device holds as many copies
            else:
                out, dropped = self._dropless(x, experts_btk, weights_btk, weights), jnp.zeros((), jnp.float32)
            return (jax.lax.psum(out, "tensor") if tensor else out), dropped

        weights = self._expert_weights()
        specs = ExpertWeights([P(experts, None, tensor)] * len(weights.wis), P(experts, tensor, None),
                              [P(experts, tensor)] * len(weights.bis), None if weights.bo is None else P(experts, None))
        return jax.shard_map(local, in_specs=(rows, rows, rows, specs), out_specs=(rows, P()),
                             check_vma=False)(x_btd, experts_btk, weights_btk, weights)

    def _expert_weights(self) -> ExpertWeights:
        """The experts' weights and biases in the compute dtype."""
        n = len(self.cfg.mlp_activations)
        wis = [getattr(self, f"wi_{i}")[...].astype(self.dtype) for i in range(n)]
        bis = [getattr(self, f"bi_{i}_ef")[...].astype(self.dtype) for i in range(n)] if self.cfg.mlp_bias else []
        bo = self.bo_ed[...].astype(self.dtype) if self.cfg.mlp_bias else None
        return ExpertWeights(wis, self.wo_efd[...].astype(self.dtype), bis, bo)

    def _sort_copies(self, x_btd, experts_btk, weights_btk):
        """(rows [B*T*k, D] sorted by expert, their order, rows per expert [E]); with `scale_inputs`
        each row is its token times the copy's router weight."""
        b, t, d = x_btd.shape
        k, e = self.cfg.num_experts_per_tok, self.cfg.num_experts
        flat_experts = experts_btk.reshape(-1)  # token copy i*k + j: token i's j-th expert
        order = jnp.argsort(flat_experts, stable=True)
        rows = x_btd.reshape(b * t, d)[order // k]
        if self.scale_inputs:
            rows = rows * weights_btk.reshape(-1)[order][:, None].astype(rows.dtype)
        return rows, order, jnp.bincount(flat_experts, length=e).astype(jnp.int32)

    def _combine(self, out_sorted, order, weights_btk):
        """The expert outputs of the sorted copies back in token order, mixed by the router weights
        (added as they are with `scale_inputs`: the weights went in with the tokens)."""
        b, t, k = weights_btk.shape
        if self.scale_inputs:
            weights_btk = jnp.ones_like(weights_btk)
        out_copies = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(b, t, k, -1)
        return jnp.einsum("btkd,btk->btd", out_copies, weights_btk.astype(self.dtype))

    def _grouped_mlp(self, rows, group_sizes, weights: ExpertWeights):
        """The gated MLP of expert g on its consecutive rows (`group_sizes[g]` of them), as grouped
        matmuls (`grouped_matmul`); rows past the groups' total come out zero."""
        kernel, cfg = grouped_matmul_kernel(self.cfg), self.cfg
        mm = functools.partial(grouped_matmul, group_sizes=group_sizes, kernel=kernel, quantization=cfg.quantization,
                               tiles=(cfg.tile_batch_seq, cfg.tile_activation_dim, cfg.tile_weight_dim))
        bias = row_bias(group_sizes, rows.shape[0]) if weights.bis else None
        projections = []
        for i, w_edf in enumerate(weights.wis):
            a = mm(rows, w_edf)
            projections.append(checkpoint_name(a if bias is None else a + bias(weights.bis[i]), f"mlpwi_{i}"))
        h = checkpoint_name(self.gated(projections), "mlpwi")
        out = mm(h, weights.wo)
        return out if bias is None else out + bias(weights.bo)

    def _dropless(self, x_btd, experts_btk, weights_btk, weights):
        x_sorted, order, group_sizes = self._sort_copies(x_btd, experts_btk, weights_btk)
        return self._combine(self._grouped_mlp(x_sorted, group_sizes, weights), order, weights_btk)

    def _dropless_expert_parallel(self, x_btd, experts_btk, weights_btk, weights, ep: int, ragged: bool):
        """One device's part of dropless routing over an expert axis of `ep` devices, each holding
        E/ep consecutive experts (inside shard_map; see `dropless_experts`). Returns (output,
        the fraction of this device's token copies dropped for want of buffer room).

        Its C = B*T*k token copies, sorted by expert, go in `ep` consecutive runs, one per expert
        shard. A shard stacks the runs it receives source by source in a buffer of
        `receive_buffer_rows` rows, groups them by its local experts for the grouped matmuls,
        and returns each run to where it came from. Every device knows every run's length (an
        all-gather of the counts), so senders and receivers agree on where each run lands and
        on how much of it fits; the part of a run past the buffer's end is dropped (only with
        ragged_buffer_factor > 0) and those copies add nothing to their token's output."""
        e_local = self.cfg.num_experts // ep
        x_sorted, order, counts = self._sort_copies(x_btd, experts_btk, weights_btk)
        c = x_sorted.shape[0]
        rows = self.receive_buffer_rows(c, ep)
        me = jax.lax.axis_index("expert")
        all_counts = jax.lax.all_gather(counts.reshape(ep, e_local), "expert")  # [source, destination, local expert]
        runs = all_counts.sum(axis=2)  # [source, destination] rows
        starts = jnp.cumsum(runs, axis=0) - runs  # where each run starts in its destination's buffer
        kept = jnp.clip(rows - starts, 0, runs)  # how much of it fits
        offsets = jnp.cumsum(runs, axis=1) - runs  # [source, destination]: where the source's run starts in its copies
        send_offsets = offsets[me]
        exchange = ragged_exchange if ragged else padded_exchange
        received = exchange(x_sorted, kept[me], send_offsets, kept[:, me], starts[:, me], starts[me], rows, c)
        # the buffer's rows are source-major, each source's run sorted by local expert: regroup by expert
        ends = jnp.minimum(jnp.cumsum(all_counts[:, me], axis=1), kept[:, me, None])  # [source, local expert]
        row = jnp.arange(rows)
        source = jnp.searchsorted(jnp.cumsum(kept[:, me]), row, side="right")  # ep: past every run
        in_run = row - starts[jnp.minimum(source, ep - 1), me]
        expert = jnp.sum(in_run[:, None] >= ends[jnp.minimum(source, ep - 1)], axis=1)
        expert = jnp.where(source < ep, expert, e_local)  # e_local: an empty row, sorted last
        by_expert = jnp.argsort(expert, stable=True)
        group_sizes = jnp.sum(jnp.diff(ends, axis=1, prepend=0), axis=0).astype(jnp.int32)
        out = self._grouped_mlp(received[by_expert], group_sizes, weights)
        out = jnp.zeros_like(out).at[by_expert].set(out)
        # back: the part of source i's run I kept returns to where source i keeps its run for me
        out_sorted = exchange(out, kept[:, me], starts[:, me], kept[me], send_offsets, offsets[:, me], c, c)
        dropped = (c - jnp.sum(kept[me])) / c
        return self._combine(out_sorted, order, weights_btk), dropped

    def receive_buffer_rows(self, copies: int, ep: int) -> int:
        """Rows of the buffer a device receives token copies into, when each of the `ep` devices
        of the expert axis sends `copies`: all of them at worst (ragged_buffer_factor=-1), else
        ragged_buffer_factor x `copies`, the average (at most the worst case)."""
        factor = self.cfg.ragged_buffer_factor
        return ep * copies if factor <= 0 else min(ep * copies, max(1, math.ceil(factor * copies)))
