"""Parameter counts and the per-device memory model behind `tessera.tools.estimate` and the planner.

Parameters, gradients and AdamW state are split as `tessera.mesh` splits them. Activation memory
is an estimate: the tensors each remat policy keeps per layer, plus one layer's recomputation and
its gradients (with a sequence split, the keys and values attention gathers from the other
shares), plus the logits (float32 and a compute-dtype copy); FSDP keeps two layers gathered
(the next one is gathered ahead) and the logits' matrix, each with its gradient. Against the
compiler's figures for our 31 TPU recipes (benchmarks/results/aot_recipes.json, 2026-11-28) the
total ranges from 16% below (v5p/gpt_oss_120b: its expert layers' 32-bit copies of routed rows
are not modelled) to 27% above (v6e/qwen3_30b_a3b), 28 of them within 15% and 23 within 10%
(v5p/deepseek_v3 +7.0% since MLA's own key, value and latent shapes are modelled, +10.3% before;
benchmarks/plan_recipes.py prints the comparison); `EXECUTABLE=train_compile` gives the exact
figure for a TPU topology.

Active parameters count what a token multiplies through: attention, the experts it is routed
to, embeddings and norms. The router (num_experts x emb_dim per layer) is in the total but not
in the active count, as in the public TPU sizing guide's tables (it changes the 10T model's
active count by 0.02%).
"""

from __future__ import annotations

import dataclasses
import math

from tessera.config import Config, ConfigError, ModelConfig
from tessera.config.derived import pipeline_layout
from tessera.config.fields import OLMO_BLOCKS
from tessera.config.layers import dense_layers, linear_attention_layers
from tessera.metrics import gated_deltanet_matmul_params, mla_matmul_params

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    per_layer: int  # all experts included (deepseek: an expert layer's)
    per_expert_mlp: int
    layers_total: int = 0  # every decoder layer's parameters (deepseek's dense layers included)
    expert_layers: int = 0  # layers with experts


def count_params(m: ModelConfig) -> ParamCounts:
    """Parameter counts of the model `m` describes, equal to the built model's (tested per family).
    For deepseek, `per_layer` is an expert layer's; its dense layers are counted apart."""
    d, n, k, h = m.emb_dim, m.num_query_heads, m.num_kv_heads, m.head_dim
    layer_norm = m.decoder_block == "gpt3"
    attention_bias, mlp_bias = (m.decoder_block == "gpt3" or m.attention_bias), (m.decoder_block == "gpt3" or m.mlp_bias)
    biases = (n + 2 * k) * h + (0 if m.decoder_block == "qwen2" else d)  # qwen2 has no output projection bias
    attention = mla_params(m) if m.decoder_block == "deepseek" else \
        d * n * h * 2 + d * k * h * 2 + (biases if attention_bias else 0) + (n if m.attention_sink else 0)
    remainder = 0  # qwen3_next: its mixers' parameters beyond `layers` times their per-layer mean
    if m.decoder_block == "qwen3_next":  # gated attention (and q/k norms) in 1 layer of 4, Gated DeltaNets in the rest
        linear = linear_attention_layers(m)
        gdn = gated_deltanet_matmul_params(m) + m.gdn_conv_kernel_dim * (
            2 * m.gdn_num_key_heads * m.gdn_key_head_dim + m.gdn_num_value_heads * m.gdn_value_head_dim) + \
            2 * m.gdn_num_value_heads + m.gdn_value_head_dim
        mixers = (m.num_decoder_layers - linear) * (attention + d * n * h + 2 * h) + linear * gdn
        attention, remainder = divmod(mixers, m.num_decoder_layers)
    gated = len(m.mlp_activations) + 1

    def mlp(f: int) -> int:  # one gated MLP of width f, with its biases
        return d * f * gated + ((len(m.mlp_activations) * f + d) if mlp_bias else 0)

    moe = m.num_experts > 1  # a dense model builds one MLP of mlp_dim: no expert width, no shared experts
    f = m.expert_mlp_dim if moe else m.mlp_dim
    expert_mlp = mlp(f)
    router_bias = (m.routed_bias, m.decoder_block == "gpt_oss").count(True)  # choice bias, learned logit bias
    router = d * m.num_experts + m.num_experts * router_bias if moe else 0
    shared = mlp(f * m.shared_experts) if m.shared_experts and moe else 0
    shared += d if shared and m.decoder_block == "qwen3_next" else 0  # the shared experts' gate
    norm = 2 * d if layer_norm else d
    norms = norm * (4 if m.decoder_block in ("gemma2", "gemma3") else 2)
    norms += 2 * h if m.decoder_block in ("qwen3", "qwen3_moe", "gemma3") else 0  # per-head q and k norms
    norms += (n + k) * h if m.decoder_block in OLMO_BLOCKS else 0  # q and k norms over all heads
    positions = m.trainable_position_size * d if m.decoder_block == "gpt3" else 0
    embeddings = d * m.vocab_size * (1 if m.logits_via_embedding else 2) + norm + positions  # + final norm
    per_layer = attention + m.num_experts * expert_mlp + shared + router + norms
    active_layer = attention + min(m.num_experts_per_tok, m.num_experts) * expert_mlp + shared + norms
    dense = dense_layers(m)
    dense_total = dense * (attention + mlp(m.mlp_dim) + norms)
    layers = m.num_decoder_layers - dense
    # multi-token prediction: per depth a block of the family, its three norms and a [2, D, D] projection
    mtp_extra = 3 * norm + 2 * d * d
    mtp, mtp_active = m.mtp_num_layers * (per_layer + mtp_extra), m.mtp_num_layers * (active_layer + mtp_extra)
    return ParamCounts(layers * per_layer + dense_total + embeddings + mtp + remainder,
                       layers * active_layer + dense_total + embeddings + mtp_active + remainder,
                       per_layer, expert_mlp, layers * per_layer + dense_total + remainder,
                       layers if m.num_experts > 1 else 0)


def token_mlp_width(m: ModelConfig) -> int:
    """Hidden units of the MLPs one token passes through in a (main-stack) layer: its experts' (and the
    shared experts') for a MoE model, mlp_dim for a dense one."""
    if m.num_experts > 1:
        return m.expert_mlp_dim * (min(m.num_experts_per_tok, m.num_experts) + m.shared_experts)
    return m.mlp_dim


def attention_widths(m: ModelConfig) -> tuple[int, int, int, int]:
    """Elements per token of a layer's queries, keys, values and attention output, all heads. MLA
    (decoder_block=deepseek) expands every query head's own key [Hn + Hr] and value [Hv] from its
    latent, whatever num_kv_heads says, and its output is v_head_dim wide (tessera.models.mla)."""
    n = m.num_query_heads
    if m.decoder_block == "deepseek":
        qk = n * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        return qk, qk, n * m.v_head_dim, n * m.v_head_dim
    q, kv = n * m.head_dim, m.num_kv_heads * m.head_dim
    return q, kv, kv, q


def mla_params(m: ModelConfig) -> int:
    """Multi-head latent attention's weights (tessera.models.mla), its latent norms included."""
    return mla_matmul_params(m) + m.kv_lora_rank + m.q_lora_rank


def expert_rows_per_token(m: ModelConfig, ep: int) -> float:
    """Rows a MoE layer's expert MLPs compute per token of a device: the top-k copies when dropless
    (sparse_matmul), times the receive buffer's room over the `ep`-way expert axis (every sender's
    copies at worst, ragged_buffer_factor's share when set); with capacity routing each expert's
    slots, capacity_factor x its fair share (every token with -1) of a group. megablox=true routes
    dropless too, with or without sparse_matmul (tessera.models.moe)."""
    k = min(m.num_experts_per_tok, m.num_experts)
    if m.sparse_matmul or m.megablox:
        return k * (ep if m.ragged_buffer_factor <= 0 else min(ep, m.ragged_buffer_factor))
    return m.num_experts if m.capacity_factor <= 0 else min(m.num_experts, m.capacity_factor * k)


def _saved_per_token(m: ModelConfig, policy: str, tp: int, ep: int = 1) -> float:
    """Activation elements one block keeps per token for the backward pass, beyond its input; `ep`
    is the expert axis (a MoE layer's rows per token: expert_rows_per_token)."""
    return _saved_per_token_by_policy(m, tp, ep).get(policy, 0.0)


def _saved_per_token_by_policy(m: ModelConfig, tp: int, ep: int = 1) -> dict[str, float]:
    """`_saved_per_token` of every policy that keeps something (full and the offloading policies keep
    nothing else on the device)."""
    d = m.emb_dim
    if m.num_experts <= 1:
        f, routed, out = token_mlp_width(m) / tp, 0.0, d
    else:  # the experts' rows: their hidden units, the token copies they read and the outputs they write
        rows = expert_rows_per_token(m, ep)
        f, routed, out = m.expert_mlp_dim * (rows + m.shared_experts) / tp, d * rows, d * (rows + m.shared_experts)
    q, k, v, ctx = (width / tp for width in attention_widths(m))
    kv = k + v
    # MLA's other matmul outputs: the query and key/value latents (replicated over tensor), and its keys are
    # a matmul's [N, Hn] and the shared rotary part broadcast ([Hr] of one head, not a matmul output)
    latents = (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) if m.decoder_block == "deepseek" else 0
    kv_dots = kv - (m.num_query_heads * m.qk_rope_head_dim / tp if latents else 0)
    acts = len(m.mlp_activations)
    kept = {
        # norms, q, k, v, context, out, (routed copies,) mlp in/act, mlp out
        "none": 2 * d + latents + q + kv + ctx + d + routed + acts * f + f + out,
        "minimal": latents + q + kv_dots + d + acts * f + out,
        "save_dot_except_mlp": q + kv + ctx + d,
        "save_dot_except_mlpwi": q + kv + ctx + d + d,
        "save_qkv_proj": q + kv,
        "save_out_proj": d,
    }
    # custom: the named tensors set to `device` (the block input is counted by the caller)
    named = {"query_proj": q, "key_proj": k, "value_proj": v, "context": ctx, "out_proj": d,
             "mlpwi": f, "mlpwi_0": f, "mlpwi_1": f, "mlpwo": out}
    kept["custom"] = sum(size for name, size in named.items() if getattr(m, name) == "device")
    return kept


def logits_bytes(m: ModelConfig, tokens: float) -> float:
    """Bytes of the logits of `tokens` tokens (whole vocabulary): float32 for the loss and a copy in
    the compute dtype; once more per multi-token-prediction depth. With num_vocab_tiling the loss
    takes one chunk of the tokens at a time (tessera.losses.cross_entropy_sum): 1/tiles of them
    (1b-sized llama2 at 4 x 1024 tokens per v5e chip, vocab 131,072: compiled 3.25 GiB, 0.65 with 8 tiles)."""
    return (1 + m.mtp_num_layers) * tokens / m.num_vocab_tiling * m.vocab_size * (4 + DTYPE_BYTES[m.dtype])


def activation_bytes(cfg: Config, mesh: dict[str, int], policy: str, fused_attention: bool,
                     microbatches: int = 1) -> float:
    """Per-device activation memory of one step under `policy`, in bytes (an estimate). With pipeline
    stages, `microbatches` is the layout's M: the backward pass recomputes one layer of one microbatch."""
    return activation_bytes_by_policy(cfg, mesh, (policy,), fused_attention, microbatches)[policy]


def activation_bytes_by_policy(cfg: Config, mesh: dict[str, int], policies: tuple[str, ...], fused_attention: bool,
                               microbatches: int = 1) -> dict[str, float]:
    """`activation_bytes` of each of `policies` (what they share computed once: the planner asks for every
    policy of every mesh it scores)."""
    m, a = cfg.model, DTYPE_BYTES[cfg.model.dtype]
    tp = mesh["tensor"]
    # with gradient accumulation a pass holds one micro-batch's activations (per_device_batch_size is the step's)
    micro_seqs = cfg.data.per_device_batch_size / cfg.optim.gradient_accumulation_steps
    seqs = micro_seqs * mesh["tensor"] * mesh["sequence"] * mesh["stage"]
    tokens = seqs * cfg.data.max_target_length / mesh["sequence"]
    scores = 0.0 if fused_attention else m.num_query_heads / tp * cfg.data.max_target_length * 6  # f32 + bf16
    # a sequence split gathers the other shares' keys and values for attention, per own token the
    # sequence axis' other ways' (attention's residuals: remat_policy=none keeps them per layer)
    gathered_kv = (mesh["sequence"] - 1) * sum(attention_widths(m)[1:3]) / tp * a
    ep = mesh["expert"]
    saved = _saved_per_token_by_policy(m, tp, ep)
    # a pipeline stage keeps its own layers' activations (of every microbatch) and three
    # microbatch buffers the size of the whole batch's residual stream (inputs, outputs, loop-back)
    # (multi-token prediction depths run as layers after the decoder; they are refused with stages)
    depth = m.num_decoder_layers / mesh["stage"] + m.mtp_num_layers
    buffers = 3 * tokens * m.emb_dim * a if mesh["stage"] > 1 else 0.0
    one_layer = tokens / microbatches * (2 * (saved["none"] * a + gathered_kv) + scores)  # recompute + grads
    logits = logits_bytes(m, tokens) / tp
    # a multi-token-prediction depth runs after the layers' scan, and the compiler gives it a working
    # set of its own (v5p DeepSeek-V3 recipe with one depth, 2026-11-27: 6.84 GiB more temporaries,
    # the routing buffers of a second expert layer among them; this model adds 3.37 GiB in all)
    out = {}
    for policy in policies:
        keep = saved.get(policy, 0.0) * a + (scores + gathered_kv if policy == "none" else 0.0)
        offloaded_input = policy == "custom" and m.decoder_layer_input == "offload"
        layers = depth * tokens * (0.0 if offloaded_input else m.emb_dim * a + keep)
        out[policy] = layers + buffers + one_layer * (1 + m.mtp_num_layers) + logits
    return out


def unmodelled_notes(cfg: Config) -> list[str]:
    """Lines naming the keys that change the compiler's memory, or the step's time, and are not in these models."""
    m, notes = cfg.model, []
    if m.quantization:
        notes.append(f"quantization={m.quantization} is not modelled: with a remat policy that keeps matmul outputs "
                     "the compiler's activations are larger (int8, remat_policy=minimal, a 4-layer model of width "
                     "1,024 at 4 x 1,024 tokens per v5e chip: 1.42 GiB compiled against 0.89 without; with full, the "
                     "same 0.42-0.44); compile to check (EXECUTABLE=train_compile)")
    if cfg.optim.optimizer_memory_host_offload:
        notes.append("optimizer_memory_host_offload=true: the moments' moves between host memory and HBM (both "
                     "ways, every step) are not in the time or MFU estimates, only their memory")
    return notes


@dataclasses.dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    # weights whole on each FSDP device, with their gradients: two layers (the one in use and the next,
    # gathered ahead; pipeline_fsdp_ag_once: a stage's weights, without) and the logits' [vocab, embed]
    gathered: float
    activations: dict[str, float]  # remat policy -> bytes

    def total(self, policy: str) -> float:
        return self.params + self.grads + self.optimizer + self.gathered + self.activations[policy]


def estimate_memory(cfg: Config, counts: ParamCounts, mesh: dict[str, int], fused_attention: bool) -> Memory:
    w = DTYPE_BYTES[cfg.model.weight_dtype]
    m = cfg.model
    experts = counts.expert_layers * m.num_experts * counts.per_expert_mlp
    layer_norms, final_norm = 2 * m.num_decoder_layers * m.emb_dim, m.emb_dim  # replicated: too small to shard
    # tessera.mesh splits a weight's embed dimension over fsdp, sequence and expert (an expert
    # weight's expert dimension takes the expert axis instead) and its heads / MLP over tensor
    shards = mesh["fsdp"] * mesh["sequence"] * mesh["tensor"] * mesh["expert"]
    stage = mesh["stage"]  # pipeline stages split the layers (not the embeddings)
    dense_layers = counts.layers_total - experts - layer_norms
    other = counts.total - counts.layers_total - final_norm
    router = counts.expert_layers * m.emb_dim * m.num_experts  # [embed, experts]: not split over tensor
    sharded = (other + (dense_layers - router + experts) / stage) / shards + router / stage / (shards / mesh["tensor"])
    params = (sharded + layer_norms / stage + final_norm) * w
    gathered = 0.0
    if mesh["fsdp"] * mesh["sequence"] * mesh["expert"] > 1:  # gathered after the cast to the compute dtype
        a = DTYPE_BYTES[m.dtype]
        gathered = 2 * m.vocab_size * m.emb_dim / mesh["tensor"] * a  # the logits' [vocab, embed] and its gradient
        if stage > 1 and mesh["fsdp"] > 1 and cfg.mesh.pipeline_fsdp_ag_once:  # a stage's weights (not gradients)
            gathered += (dense_layers / mesh["tensor"] + experts / (mesh["tensor"] * mesh["expert"])) / stage * w
        else:  # two layers, each with its gradient (an expert layer's experts split over the expert axis)
            layer_experts = experts / counts.expert_layers if counts.expert_layers else 0
            gathered += 4 * ((counts.per_layer - layer_experts) + layer_experts / mesh["expert"]) / mesh["tensor"] * a
    policies = ("none", "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj",
                "full", "offload")
    # tessera.mesh splits the residual stream over `tensor` (act_embed) as well as heads and MLP: a
    # tensor-parallel chip keeps 1/tp of the activations of tp times the sequences, the bytes of a
    # chip without tensor parallelism
    act_mesh = {**mesh, "tensor": 1}
    micro = _microbatches(cfg, mesh)
    acts = activation_bytes_by_policy(cfg, act_mesh, tuple(dict.fromkeys((*policies, m.remat_policy))),
                                      fused_attention, micro)
    zero1 = mesh["data"] if cfg.optim.shard_optimizer_over_data else 1  # ZeRO-1 splits the moments over data
    mu = params / w * DTYPE_BYTES[cfg.optim.mu_dtype or cfg.model.weight_dtype]  # the first moment (mu_dtype)
    if cfg.optim.opt_type == "adamw":  # two moments of every parameter
        moments = mu + params
    elif cfg.optim.opt_type == "muon":  # one momentum of every parameter, and AdamW's second of all but the blocks'
        moments = mu + (other / shards + layer_norms / stage + final_norm) * w  # matrices (biases left out)
    else:  # plain SGD keeps none
        moments = 0.0
    # gradient accumulation adds up the micro-batches' gradients in a second buffer, in float32 at least (1b on
    # v5e-8, 2 steps of 1 sequence of 1024 tokens: the compiler's temporaries grew by 0.77 GiB, 0.51 of it this)
    if cfg.optim.optimizer_memory_host_offload:  # in device memory only while updated: the moments of the parameters
        # outside the layer stack, moved in whole, then one layer's (tessera.optimizer_offload)
        per_device = params / w
        outside = other / shards + final_norm
        moments *= (outside + (per_device - outside) / m.num_decoder_layers) / per_device
    g = 2 if cfg.optim.grad_dtype == "bfloat16" else w  # float32 gradients rounded to grad_dtype
    grads = params / w * min(g, w) + (params / w * max(w, 4) if cfg.optim.gradient_accumulation_steps > 1 else 0)
    return Memory(params, grads, moments / zero1, gathered, acts)


def _microbatches(cfg: Config, mesh: dict[str, int]) -> int:
    """The pipeline layout's microbatches for this mesh and batch (1 without stages or when it has none)."""
    if mesh["stage"] == 1:
        return 1
    rows = round(cfg.data.per_device_batch_size * math.prod(mesh.values())) // cfg.optim.gradient_accumulation_steps
    try:
        layout = pipeline_layout(cfg, mesh, rows)
    except ConfigError:
        return 1
    return layout.microbatches if layout else 1
