"""Size a model and a sharding before compiling anything.

    python3 -m tessera.tools.estimate llama3.1-70b per_device_batch_size=2 --hardware v5p-256
    python3 -m tessera.tools.estimate my_model.yml ici_tensor_parallelism=4 --hardware v6e-256
    python3 -m tessera.tools.estimate 1b global_parameter_scale=128 --hardware h100-64 --mfu 0.4
    python3 -m tessera.tools.estimate base_emb_dim=4096 base_num_decoder_layers=32 --hardware v5e-256

With only key=value arguments the model starts from `model_name` among them, else `default`.
Sequences are `max_target_length` tokens long, as in training; the first line of the report
says which length was used and where it came from (the base.yml default is 128, far shorter
than a large model's runs: pass max_target_length=... for real numbers).

Prints total and active parameters, training FLOPs per token (the trainer's own formula),
memory per device for parameters, gradients, AdamW state and activations (per remat policy),
and the roofline checks of the public TPU sizing guide for each parallel axis in use: an axis is worth its
communication when the arithmetic intensity (FLOPs per byte moved) it leaves is above the
hardware's, peak FLOP/s divided by the ICI bandwidth the collective can use:

    FSDP    tokens per device x tensor x expert / sparsity     (sparsity = experts / experts per token)
    expert  4 x mlp_dim / expert
    tensor  mlp_dim / tensor

Activation memory is an estimate: the tensors each remat policy keeps per layer, plus one
layer's recomputation and its gradients, plus the logits (float32 and a compute-dtype copy);
FSDP keeps two layers gathered (the next one is gathered ahead) and the logits' matrix, each
with its gradient. Against the compiler's figures for our 30 TPU recipes
(benchmarks/results/aot_recipes.json, 2026-11-27) the total ranges from 14% below
(v6e/qwen3_8b) to 27% above (v6e/qwen3_30b_a3b), 26 of them within 15% and 22 within 10%
(benchmarks/plan_recipes.py prints the comparison); `EXECUTABLE=train_compile` gives the
exact figure for a TPU topology.

Active parameters count what a token multiplies through: attention, the experts it is routed
to, embeddings and norms. The router (num_experts x emb_dim per layer) is in the total but not
in the active count, as in the public TPU sizing guide's tables (it changes the 10T model's active count by 0.02%).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path

from tessera.config import Config, ConfigError, ModelConfig, build_config, load_config
from tessera.config.derived import LAYERS_PER_BLOCK, pipeline_layout
from tessera.config.loader import read_yaml
from tessera.config.schema import all_fields
from tessera.hardware import GIB, GPUS, Accelerator, tpu_slice
from tessera.metrics import mla_matmul_params, training_flops_per_step
from tessera.tools.cli import config_epilog

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
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
    biased, layer_norm = m.decoder_block == "gpt3", m.decoder_block == "gpt3"
    attention = mla_params(m) if m.decoder_block == "deepseek" else \
        d * n * h * 2 + d * k * h * 2 + ((n + 2 * k) * h + d if biased else 0)
    gated = len(m.mlp_activations) + 1
    f = m.expert_mlp_dim
    expert_mlp = d * f * gated + ((len(m.mlp_activations) * f + d) if biased else 0)
    router = d * m.num_experts + (m.num_experts if m.routed_bias else 0) if m.num_experts > 1 else 0
    shared = d * f * m.shared_experts * gated
    norm = 2 * d if layer_norm else d
    norms = norm * (4 if m.decoder_block in ("gemma2", "gemma3") else 2)
    norms += 2 * h if m.decoder_block in ("qwen3", "qwen3_moe", "gemma3") else 0  # per-head q and k norms
    positions = m.trainable_position_size * d if m.decoder_block == "gpt3" else 0
    embeddings = d * m.vocab_size * (1 if m.logits_via_embedding else 2) + norm + positions  # + final norm
    per_layer = attention + m.num_experts * expert_mlp + shared + router + norms
    active_layer = attention + min(m.num_experts_per_tok, m.num_experts) * expert_mlp + shared + norms
    dense = m.first_num_dense_layers if m.decoder_block == "deepseek" else 0
    dense_total = dense * (attention + d * m.mlp_dim * gated + norms)
    layers = m.num_decoder_layers - dense
    return ParamCounts(layers * per_layer + dense_total + embeddings, layers * active_layer + dense_total + embeddings,
                       per_layer, expert_mlp, layers * per_layer + dense_total, layers if m.num_experts > 1 else 0)


def token_mlp_width(m: ModelConfig) -> int:
    """Hidden units of the MLPs one token passes through in a (main-stack) layer: its experts' (and the
    shared experts') for a MoE model, mlp_dim for a dense one."""
    if m.num_experts > 1:
        return m.expert_mlp_dim * (min(m.num_experts_per_tok, m.num_experts) + m.shared_experts)
    return m.mlp_dim


def mla_params(m: ModelConfig) -> int:
    """Multi-head latent attention's weights (tessera.models.mla), its latent norms included."""
    return mla_matmul_params(m) + m.kv_lora_rank + m.q_lora_rank


@dataclasses.dataclass(frozen=True)
class Hardware:
    accelerator: Accelerator
    name: str
    num_devices: int
    num_slices: int
    links: int  # ICI links (one way each) a ring collective uses; 1 for a GPU's NVLink port

    @property
    def intensity(self) -> float:
        """FLOPs per byte of collective traffic at which compute and communication take equal time."""
        return self.accelerator.peak_flops / (self.links * self.accelerator.link_bytes_per_s)


def parse_hardware(text: str, num_slices: int = 1, ici_links: int = 0) -> Hardware:
    """"v6e-256" (a TPU slice type) or "h100-8" (that many GPUs)."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", text.strip().lower())
    if match and match.group(1) in GPUS:
        if int(match.group(2)) < 1:
            raise ConfigError(f"--hardware={text!r} has no GPUs; give the count after the name, e.g. "
                              f"{match.group(1)}-8")
        count = int(match.group(2)) * num_slices
        return Hardware(GPUS[match.group(1)], text, count, num_slices, ici_links or 1)
    try:
        s = tpu_slice(text, key="--hardware")
    except ConfigError:
        gpus = ", ".join(f"{g}-<count>" for g in GPUS)
        raise ConfigError(f"--hardware={text!r} is neither a TPU slice type (v5p-256, v5e-256, v6e-256, v4-128) "
                          f"nor {gpus}") from None
    return Hardware(s.accelerator, text, s.devices * num_slices, num_slices, ici_links or (4 if s.has_wraparound else 2))


def mesh_sizes(cfg: Config, hw: Hardware) -> dict[str, int]:
    """Size of each mesh axis (ICI x DCN), as the trainer would build it on this hardware."""
    from tessera.mesh import mesh_shape

    ici, dcn = mesh_shape(cfg.mesh, hw.num_devices, hw.num_slices)
    return {axis: ici[axis] * dcn[axis] for axis in ici}


def expert_rows_per_token(m: ModelConfig, ep: int) -> float:
    """Rows a MoE layer's expert MLPs compute per token of a device: the top-k copies when dropless
    (sparse_matmul), times the receive buffer's room over the `ep`-way expert axis (every sender's
    copies at worst, ragged_buffer_factor's share when set); with capacity routing each expert's
    slots, capacity_factor x its fair share (every token with -1) of a group."""
    k = min(m.num_experts_per_tok, m.num_experts)
    if m.sparse_matmul:
        return k * (ep if m.ragged_buffer_factor <= 0 else min(ep, m.ragged_buffer_factor))
    return m.num_experts if m.capacity_factor <= 0 else min(m.num_experts, m.capacity_factor * k)


def _saved_per_token(m: ModelConfig, policy: str, tp: int, ep: int = 1) -> float:
    """Activation elements one block keeps per token for the backward pass, beyond its input; `ep`
    is the expert axis (a MoE layer's rows per token: expert_rows_per_token)."""
    d = m.emb_dim
    if m.num_experts <= 1:
        f, routed, out = token_mlp_width(m) / tp, 0.0, d
    else:  # the experts' rows: their hidden units, the token copies they read and the outputs they write
        rows = expert_rows_per_token(m, ep)
        f, routed, out = m.expert_mlp_dim * (rows + m.shared_experts) / tp, d * rows, d * (rows + m.shared_experts)
    q, kv = m.num_query_heads * m.head_dim / tp, 2 * m.num_kv_heads * m.head_dim / tp
    acts = len(m.mlp_activations)
    kept = {
        # norms, q, k, v, context, out, (routed copies,) mlp in/act, mlp out
        "none": 2 * d + q + kv + q + d + routed + acts * f + f + out,
        "minimal": q + kv + d + acts * f + out,
        "save_dot_except_mlp": q + kv + q + d,
        "save_dot_except_mlpwi": q + kv + q + d + d,
        "save_qkv_proj": q + kv,
        "save_out_proj": d,
    }
    if policy == "custom":  # the named tensors set to `device` (the block input is counted by the caller)
        named = {"query_proj": q, "key_proj": kv / 2, "value_proj": kv / 2, "context": q, "out_proj": d,
                 "mlpwi": f, "mlpwi_0": f, "mlpwi_1": f, "mlpwo": out}
        return sum(size for name, size in named.items() if getattr(m, name) == "device")
    return kept.get(policy, 0.0)  # full and the offloading policies keep nothing else on the device


def activation_bytes(cfg: Config, mesh: dict[str, int], policy: str, fused_attention: bool,
                     microbatches: int = 1) -> float:
    """Per-device activation memory of one step under `policy`, in bytes (an estimate). With pipeline
    stages, `microbatches` is the layout's M: the backward pass recomputes one layer of one microbatch."""
    m, a = cfg.model, DTYPE_BYTES[cfg.model.dtype]
    tp = mesh["tensor"]
    seqs = cfg.data.per_device_batch_size * mesh["tensor"] * mesh["sequence"] * mesh["stage"]
    tokens = seqs * cfg.data.max_target_length / mesh["sequence"]
    scores = 0.0 if fused_attention else m.num_query_heads / tp * cfg.data.max_target_length * 6  # f32 + bf16
    ep = mesh["expert"]
    keep = _saved_per_token(m, policy, tp, ep) * a + (scores if policy == "none" else 0.0)
    offloaded_input = policy == "custom" and m.decoder_layer_input == "offload"
    # a pipeline stage keeps its own layers' activations (of every microbatch) and three
    # microbatch buffers the size of the whole batch's residual stream (inputs, outputs, loop-back)
    layers = m.num_decoder_layers / mesh["stage"] * tokens * (0.0 if offloaded_input else m.emb_dim * a + keep)
    buffers = 3 * tokens * m.emb_dim * a if mesh["stage"] > 1 else 0.0
    one_layer = tokens / microbatches * (2 * _saved_per_token(m, "none", tp, ep) * a + scores)  # recompute + grads
    logits = tokens * m.vocab_size / tp * (4 + a)  # float32 for the loss and a copy in the compute dtype
    return layers + buffers + one_layer + logits


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
    acts = {p: activation_bytes(cfg, act_mesh, p, fused_attention, micro) for p in policies}
    acts.setdefault(m.remat_policy, activation_bytes(cfg, act_mesh, m.remat_policy, fused_attention, micro))
    zero1 = mesh["data"] if cfg.optim.shard_optimizer_over_data else 1  # ZeRO-1 splits AdamW's moments over data
    return Memory(params, params, 2 * params / zero1, gathered, acts)


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


@dataclasses.dataclass(frozen=True)
class Roofline:
    axis: str
    size: int
    intensity: float
    hardware: float

    @property
    def verdict(self) -> str:
        if self.size == 1:
            return "not used"
        if self.intensity >= self.hardware:
            return "compute-bound (ok)"
        return "communication-bound: grow the batch or shrink this axis"


def rooflines(cfg: Config, mesh: dict[str, int], hw: Hardware) -> list[Roofline]:
    m = cfg.model
    sparsity = m.num_experts / m.num_experts_per_tok if m.num_experts > 1 else 1.0
    tokens = cfg.data.per_device_batch_size * cfg.data.max_target_length
    fsdp = tokens * mesh["tensor"] * mesh["expert"] * mesh["stage"] / sparsity
    lines = [
        Roofline("fsdp", mesh["fsdp"], fsdp, hw.intensity),
        Roofline("expert", mesh["expert"], 4 * m.mlp_dim / mesh["expert"], hw.intensity),
        Roofline("tensor", mesh["tensor"], m.mlp_dim / mesh["tensor"], hw.intensity),
    ]
    if mesh["stage"] > 1:  # a stage's FLOPs per token against the activation bytes it passes on per token
        layout = pipeline_plan(cfg, mesh, hw)
        flops = training_flops_per_step(m, 1, cfg.data.max_target_length) / cfg.data.max_target_length
        sent = 2 * layout.repeats * m.emb_dim * DTYPE_BYTES[m.dtype]  # forward activation + backward gradient
        lines.append(Roofline("stage", mesh["stage"], flops / mesh["stage"] / sent, hw.intensity))
    return lines


def pipeline_plan(cfg: Config, mesh: dict[str, int], hw: Hardware):
    """The trainer's pipeline layout for this mesh and batch (None without a stage axis)."""
    rows = round(cfg.data.per_device_batch_size * hw.num_devices) // cfg.optim.gradient_accumulation_steps
    return pipeline_layout(cfg, mesh, rows)


def load_model_config(model: str | None, overrides: list[str]) -> Config:
    """A model name from configs/models, or a path to a model YAML file, plus key=value overrides.
    With no model, the `model_name=` among the overrides, else the default model."""
    base = CONFIGS / "base.yml"
    if model is None:
        names = [o.partition("=")[2] for o in overrides if o.partition("=")[0].strip() == "model_name"]
        model = names[-1] if names else "default"
        overrides = [o for o in overrides if o.partition("=")[0].strip() != "model_name"]
    if not model.endswith((".yml", ".yaml")):
        return load_config([str(base), f"model_name={model}", *overrides], env={})
    path = Path(model)
    if not path.is_file():
        raise ConfigError(f"model file {path} does not exist")
    flat = {**read_yaml(base, "config file"), **read_yaml(path, "model file")}  # the loader's YAML errors
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"argument {item!r} is not of the form key=value")
        flat[name] = value
    flat["model_name"] = path.stem
    return build_config(flat)


def sequence_note(cfg: Config, overrides: list[str]) -> str:
    """Which sequence length the estimate uses and where it comes from."""
    length = cfg.data.max_target_length
    if any(o.partition("=")[0].strip() == "max_target_length" for o in overrides):
        return f"sequence length {length} tokens (max_target_length from the command line)"
    if length != all_fields()["max_target_length"][1].default:
        return f"sequence length {length} tokens (max_target_length of the model config)"
    return (f"sequence length {length} tokens: the max_target_length default of configs/base.yml, not this model's "
            "context; pass max_target_length=<your run's> (e.g. 8192) for the numbers of your run")


def report(cfg: Config, hw: Hardware, mfu: float, sequence: str = "") -> str:
    """The whole estimate as text; `sequence` (see sequence_note) comes first."""
    m, counts = cfg.model, count_params(cfg.model)
    mesh = mesh_sizes(cfg, hw)
    # fused attention keeps no score matrix: cuDNN on GPUs (16-bit), splash on TPUs (flash / autoselected)
    fused = (m.dtype in ("bfloat16", "float16")) if hw.accelerator.torus_dims == 0 \
        else m.attention in ("flash", "autoselected")
    mem = estimate_memory(cfg, counts, mesh, fused)
    tokens = cfg.data.max_target_length
    flops_token = training_flops_per_step(m, 1, tokens) / tokens
    hbm = hw.accelerator.hbm_bytes
    lines = [
        sequence or f"sequence length {tokens} tokens (max_target_length)",
        f"model {m.model_name}: {m.num_decoder_layers} layers, emb {m.emb_dim}, mlp {m.mlp_dim}, heads "
        f"{m.num_query_heads}/{m.num_kv_heads} x {m.head_dim}, vocab {m.vocab_size}"
        + (f", {m.num_experts} experts (top {m.num_experts_per_tok})" if m.num_experts > 1 else ""),
        f"parameters: total {counts.total:.3e}, active {counts.active:.3e}",
        f"training FLOPs per token: {flops_token:.3e} (forward + backward, sequence {tokens})",
        f"hardware: {hw.name} x{hw.num_slices} = {hw.num_devices} x {hw.accelerator.device_kind}, "
        f"{hbm / GIB:.1f} GiB HBM, {hw.accelerator.peak_flops / 1e12:.0f} TFLOP/s bf16",
        f"mesh: {', '.join(f'{k}={v}' for k, v in mesh.items() if v > 1) or 'one device'}; "
        f"global batch {cfg.data.per_device_batch_size * hw.num_devices:g} sequences",
        "",
        "memory per device (GiB):",
        f"  parameters ({m.weight_dtype})      {mem.params / GIB:8.2f}",
        f"  gradients                  {mem.grads / GIB:8.2f}",
        f"  AdamW state (2 moments)    {mem.optimizer / GIB:8.2f}",
        (f"  a stage gathered once      {mem.gathered / GIB:8.2f}   (pipeline_fsdp_ag_once; and the logits' "
         "matrix with its gradient)" if mesh["stage"] > 1 and mesh["fsdp"] > 1 and cfg.mesh.pipeline_fsdp_ag_once else
         f"  FSDP-gathered weights      {mem.gathered / GIB:8.2f}   (2 layers in flight and the logits' matrix, "
         "with their gradients)"),
        "  activations by remat_policy" + ("" if fused else " (reference attention: scores kept in memory)"),
    ]
    for policy, value in mem.activations.items():
        mark = "  <- remat_policy" if policy == m.remat_policy else ""
        lines.append(f"    {policy:<24} {value / GIB:8.2f}   total {mem.total(policy) / GIB:8.2f}{mark}")
    fits = mem.total(m.remat_policy) <= hbm * cfg.compile.compile_hbm_budget_fraction
    lines += [
        f"  -> {'fits' if fits else 'does NOT fit'} in {cfg.compile.compile_hbm_budget_fraction:g} x "
        f"{hbm / GIB:.1f} GiB with remat_policy={m.remat_policy}",
        "",
        f"roofline (hardware intensity {hw.intensity:,.0f} FLOPs/byte with {hw.links} link(s) per collective):",
    ]
    for r in rooflines(cfg, mesh, hw):
        value = f"{r.intensity:12,.0f}" if r.size > 1 else f"{'-':>12}"
        verdict = r.verdict
        if r.axis == "stage" and cfg.mesh.dcn_pipeline_parallelism > 1:
            verdict = "over DCN: compare with the DCN's FLOPs per byte (peak / DCN bytes/s per chip)"
        lines.append(f"  {r.axis:<7} x{r.size:<5} intensity {value}   {verdict}")
    layout = pipeline_plan(cfg, mesh, hw)
    if layout is not None:
        lines += ["", f"pipeline: {layout.describe(LAYERS_PER_BLOCK.get(m.decoder_block, 1))}"]
    if mfu:
        busy = 1.0 - (layout.bubble if layout is not None else 0.0)
        rate = mfu * busy * hw.accelerator.peak_flops / flops_token
        bubble = f" ({mfu:.1%} outside the pipeline bubble x {busy:.3f} busy = {mfu * busy:.1%})" if layout else ""
        lines += ["", f"at {f'{mfu * busy:.1%}' if layout else f'{mfu:.0%}'} MFU{bubble}: {rate:,.0f} tokens/s per device, "
                      f"{rate * hw.num_devices:,.0f} tokens/s in all, {mfu * busy * hw.accelerator.peak_flops / 1e12:.0f} "
                      "TFLOP/s per device"]
    return "\n".join(lines)


def check_options(args: argparse.Namespace) -> None:
    """ConfigError for option values no hardware has: fewer than one slice or link, an MFU outside (0, 1]."""
    if args.num_slices < 1:
        raise ConfigError(f"--num_slices={args.num_slices}: give at least 1 (the slices joined over DCN)")
    if args.ici_links is not None and args.ici_links < 1:
        raise ConfigError(f"--ici_links={args.ici_links}: give at least 1 (the ICI links a collective uses), "
                          "or leave it out for the slice's own")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu={args.mfu:g}: give a fraction above 0 and at most 1, e.g. --mfu 0.4 for 40%")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python3 -m tessera.tools.estimate", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config_epilog(("model_name", "per_device_batch_size", "max_target_length", "remat_policy", "dtype",
                              "ici_tensor_parallelism", "ici_expert_parallelism", "global_parameter_scale"),
                             ("getting_started/AOT_compile.md#estimating-first",)))
    p.add_argument("model", nargs="?", help="model name (configs/models/<name>.yml) or path to a model YAML file "
                   "(default: model_name=... among the overrides, else the default model)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (mesh, batch, remat_policy, ...)")
    p.add_argument("--hardware", required=True, help="TPU slice type (v6e-256, v5p-128, ...) or <gpu>-<count> (h100-8)")
    p.add_argument("--num_slices", type=int, default=1, help="slices joined over DCN (default 1)")
    p.add_argument("--ici_links", type=int, default=None, help="links per collective, at least 1 (default: 4 on "
                   "slices with wraparound, else 2; 1 on GPUs)")
    p.add_argument("--mfu", type=float, default=None, help="also print the throughput at this MFU, above 0 and at "
                   "most 1 (e.g. 0.4)")
    args = p.parse_intermixed_args(argv)  # key=value may come before or after the options
    model, overrides = args.model, args.overrides
    if model is not None and "=" in model:  # only key=value arguments: no model named
        model, overrides = None, [model, *overrides]
    try:
        check_options(args)
        cfg = load_model_config(model, overrides)
        hw = parse_hardware(args.hardware, args.num_slices, args.ici_links or 0)
        print(report(cfg, hw, args.mfu or 0.0, sequence_note(cfg, overrides)))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
