"""From a model and a slice to the mesh, remat policy and batch that should train it fastest.

    python3 -m tessera.tools.plan llama3.1-8b max_target_length=2048 --hardware v6e-256
    python3 -m tessera.tools.plan my_model.yml weight_dtype=bfloat16 --hardware v6e-256 --slices 16 \
        --tokens-per-device 2048
    python3 -m tessera.tools.plan llama3.1-70b max_target_length=4096 --hardware h100-64
    python3 -m tessera.tools.plan llama3.1-8b max_target_length=2048 --hardware v6e-256 --top 2 --compile

Enumerates meshes (data, fsdp, tensor, expert and pipeline ways inside a slice; data, fsdp and
pipeline ways across slices), remat policies and per-device batches, scores each with the
estimator (tessera.tools.estimate) and prints the best `--top` of them, ranked, with one or two
sentences on the winner. `--compile` then AOT-compiles those on the real TPU topology, one at a
time, moves each one's batch to the largest the compiler fits, and writes a recipe script and a
JSON report (TPU only).

Enumeration keeps only sizes that split the model evenly: tensor ways divide the query heads,
the kv heads, mlp_dim and the expert width; expert ways divide num_experts; fsdp x expert ways divide emb_dim;
pipeline stages satisfy the trainer's own pipeline layout (`derived.pipeline_layout`), and the
global batch splits over data x fsdp x expert (`derived.global_batch`). Tensor and expert ways
stay inside a slice (their collectives run at every layer); sequence parallelism is not tried.
Pipelines are tried as GPipe and as circular with one layer per group.

Memory per chip is the estimator's (`estimate_memory`).

Each parallel axis is scored with the public TPU sizing guide's arithmetic intensity (FLOPs per
byte it makes a chip communicate), tokens T per device, sparsity s = experts / experts per token:

    fsdp    T x tensor x expert x stages / s       (the estimator's rooflines)
    expert  4 x mlp_dim / expert
    tensor  mlp_dim / tensor
    stage   a stage's FLOPs per token / the activation bytes it passes on per token
    data    3 x T x fsdp x tensor x expert x stages / (s x bytes per gradient)   (one all-reduce of the
            gradient shard per step: 2 x its bytes, against 6 x active parameters x T FLOPs)

against the hardware's: peak FLOP/s / the bandwidth the axis can use. Inside a TPU slice that is
links x one ICI link's bandwidth. Axes are laid out as nested tiles of the chip grid, innermost
first (tensor, expert, sequence, fsdp, stage, data: the guide's "8x8 ring of 2x2 subrings" for
TP=4 on a 16x16 pod); per grid dimension an axis spans it gets 2 links when it closes a ring
through the slice's wraparound and 1 otherwise. So on v6e-256 a 256-way axis has 4 links
(2,550 FLOPs/byte), a 16-way axis inside one 16x16 dimension 2 (5,100), as in the guide. This
layout is the guide's; tessera.mesh takes the device order from jax's mesh_utils, which may
place axes differently. Across slices an axis uses DCN (`hardware.DCN_BYTES_PER_S` per chip); a
collective over an axis with i ways inside each slice and d across sends 1/i of its bytes over
DCN, so its DCN intensity is i x the formula above. GPUs are nodes of `GPUS_PER_NODE` joined by
NVLink (the port's bandwidth) and a network between nodes; the mesh's axes are placed in
tessera.mesh's order (expert innermost) and an axis that leaves a node uses the network.

The MFU figure is an estimate, a simple function of five numbers:

    MFU = base x min(1, r) x (1 - bubble) x 3 / (3 + recomputed) / executed

r is the binding axis' intensity over the hardware's (below 1 the step waits for that axis in
proportion), bubble the pipeline's idle fraction (S-1)/(M*R+S-1), `recomputed` the share of the
forward matmul FLOPs the remat policy computes again (1 for full, 0 for none; a forward pass is
a third of a training step's FLOPs), and `executed` what capacity-routed MoE layers compute
beyond the counted FLOPs (padded expert slots, one-hot dispatch and combine; 1 otherwise).
`base` is an assumed ceiling for a compute-bound step, the one the TPU recipes' READMEs derive
their targets from: BASE_MFU (0.6), or TENSOR_MFU (0.5) with a tensor axis, whose per-layer
activation all-reduces sit partly on the critical path even above their roofline (a recipe's
target is this formula for its own mesh and remat policy). The guide's measured runs reached
26-50%. Estimates within half a point are ties; they go to the candidate with fewer pipeline
stages (no bubble, no stage buffers), then more headroom r, then more tokens per device, then
less memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from typing import Iterator

from tessera.config import Config, ConfigError
from tessera.config.derived import global_batch, pipeline_layout
from tessera.hardware import DCN_BYTES_PER_S, GPUS_PER_NODE, tpu_slice
from tessera.tools.cli import config_epilog
from tessera.tools.estimate import (
    DTYPE_BYTES, Hardware, ParamCounts, count_params, estimate_memory, load_model_config, mesh_sizes,
    parse_hardware, rooflines, sequence_note, token_mlp_width,
)

BASE_MFU = 0.6  # a compute-bound step's share of peak (the recipes' READMEs' assumption)
TENSOR_MFU = 0.5  # the same with tensor parallelism: part of its all-reduces stays exposed
REMAT_POLICIES = ("full", "save_qkv_proj", "save_dot_except_mlp", "minimal", "none")
ICI_AXES = ("data", "stage", "fsdp", "tensor", "expert")
DCN_AXES = ("data", "stage", "fsdp")
TILE_ORDER = ("tensor", "expert", "sequence", "fsdp", "stage", "data")  # TPU: innermost tile first
GPU_ORDER = ("expert", "tensor", "sequence", "fsdp", "stage", "data")  # tessera.mesh's order, innermost first
KEY = {"data": "data", "stage": "pipeline", "fsdp": "fsdp", "tensor": "tensor", "expert": "expert"}
MAX_GLOBAL_TOKENS = 2**24  # 16.8M tokens per step: the largest global batch tried without --tokens-per-device


# --------------------------------------------------------------------------- candidates


@dataclasses.dataclass(frozen=True)
class Mesh:
    ici: dict[str, int]  # ways per axis inside a slice (a GPU node)
    dcn: dict[str, int]  # ways per axis across slices (nodes)
    gpu: bool = False  # one grid over every GPU (ici and dcn: the parts inside and across nodes)

    @property
    def sizes(self) -> dict[str, int]:
        """Each mesh axis' total ways, as estimate.mesh_sizes gives them."""
        axes = ("data", "stage", "fsdp", "sequence", "tensor", "expert")
        return {a: self.ici.get(a, 1) * self.dcn.get(a, 1) for a in axes}

    def keys(self) -> list[str]:
        """key=value overrides that build this mesh (GPUs: one ICI mesh over every GPU, as the GPU recipes)."""
        if self.gpu:
            return [f"ici_{KEY[a]}_parallelism={self.sizes[a]}" for a in ICI_AXES] + ["ici_sequence_parallelism=1"]
        ici = [f"ici_{KEY[a]}_parallelism={self.ici.get(a, 1)}" for a in ICI_AXES] + ["ici_sequence_parallelism=1"]
        return ici + [f"dcn_{KEY[a]}_parallelism={self.dcn.get(a, 1)}" for a in DCN_AXES]

    def describe(self) -> str:
        inner = " x ".join(f"{a} {n}" for a, n in self.ici.items() if n > 1) or "one device"
        outer = " x ".join(f"{a} {n}" for a, n in self.dcn.items() if n > 1)
        return inner + (f" | {'nodes' if self.gpu else 'dcn'} {outer}" if outer else "")


@dataclasses.dataclass(frozen=True)
class Axis:
    """One parallel axis' roofline: its intensity against the hardware's over the link it uses."""

    axis: str
    ways: int
    intensity: float  # FLOPs per byte this axis makes a chip communicate over `link`
    hardware: float  # peak FLOP/s / bytes/s of that link
    link: str  # "ici x4", "dcn", "nvlink", "network"

    @property
    def ratio(self) -> float:
        return self.intensity / self.hardware


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    repeats: int  # pipeline repeats (1: GPipe)
    remat: str
    per_device_batch: float  # sequences per device (per_device_batch_size)
    tokens_per_device: int
    memory: float  # bytes per chip
    budget: float  # bytes per chip the step may use
    axes: tuple[Axis, ...]
    bubble: float
    mfu: float
    compiled: bool = False  # memory is the compiler's, not the estimate

    @property
    def fits(self) -> bool:
        return self.memory <= self.budget

    @property
    def binding(self) -> Axis | None:
        return min(self.axes, key=lambda a: a.ratio) if self.axes else None

    def rank_key(self) -> tuple:
        return (self.fits, *self.roofline_key())

    def roofline_key(self) -> tuple:
        """Estimated MFU to half a point (the model is not finer than that: closer estimates tie), then fewer
        pipeline stages, headroom above the roofline, more tokens per device, less memory."""
        headroom = min(self.binding.ratio, 1e6) if self.binding else 1e6
        return (round(self.mfu * 200), -self.mesh.sizes["stage"], round(headroom, 3), self.tokens_per_device,
                -self.memory)

    def tokens_needed(self) -> int:
        """Tokens per device at which the binding axis reaches its roofline, when it is fsdp or data (their
        intensity grows with the batch); 0 otherwise."""
        b = self.binding
        return math.ceil(self.tokens_per_device / b.ratio) if b and b.axis in ("fsdp", "data") else 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_ok(m, t: int) -> bool:
    return m.num_query_heads % t == 0 and m.num_kv_heads % t == 0 and m.mlp_dim % t == 0 and m.expert_mlp_dim % t == 0


def ici_meshes(cfg: Config, devices: int) -> Iterator[dict[str, int]]:
    """Every split of one slice's devices over ICI_AXES that keeps the model's dimensions whole."""
    m = cfg.model
    experts = m.num_experts if m.num_experts > 1 else 1
    for t in (t for t in divisors(devices) if tensor_ok(m, t)):
        for e in (e for e in divisors(devices // t) if experts % e == 0):
            for s in (s for s in divisors(devices // (t * e)) if m.num_decoder_layers % s == 0):
                rest = devices // (t * e * s)
                for f in divisors(rest):
                    yield {"data": rest // f, "stage": s, "fsdp": f, "tensor": t, "expert": e}


def dcn_meshes(slices: int) -> Iterator[dict[str, int]]:
    for d, s in itertools.product(divisors(slices), repeat=2):
        if slices % (d * s) == 0:
            yield {"data": d, "stage": s, "fsdp": slices // (d * s)}


def gpu_split(sizes: dict[str, int]) -> Mesh:
    """A GPU mesh (one grid in tessera.mesh's order) as the part of each axis inside a node and across nodes."""
    ici, dcn, inner = {}, {}, 1
    for axis in GPU_ORDER:
        n = sizes.get(axis, 1)
        inside = math.gcd(n, max(1, GPUS_PER_NODE // inner))
        ici[axis], dcn[axis], inner = inside, n // inside, inner * n
    return Mesh({a: ici.get(a, 1) for a in ICI_AXES}, {a: dcn.get(a, 1) for a in ICI_AXES}, gpu=True)


def meshes(cfg: Config, hw: Hardware) -> Iterator[Mesh]:
    gpu = hw.accelerator.torus_dims == 0
    if gpu:  # one grid over every GPU; where each axis runs follows from its place in it
        for sizes in ici_meshes(cfg, hw.num_devices):
            yield gpu_split(sizes)
        return
    for ici in ici_meshes(cfg, hw.num_devices // hw.num_slices):
        for dcn in dcn_meshes(hw.num_slices):
            yield Mesh(ici, dcn)


def mesh_config(cfg: Config, mesh: Mesh, repeats: int, per_device_batch: float) -> Config:
    """`cfg` with this mesh and batch (the sections are copied, `cfg` is left as it was)."""
    sizes = {**{f"ici_{KEY[a]}_parallelism": mesh.ici.get(a, 1) for a in ICI_AXES},
             **{f"dcn_{KEY[a]}_parallelism": mesh.dcn.get(a, 1) for a in ICI_AXES}}
    if mesh.gpu:
        sizes = {**{k: 1 for k in sizes}, **{f"ici_{KEY[a]}_parallelism": mesh.sizes[a] for a in ICI_AXES}}
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, ici_sequence_parallelism=1, dcn_sequence_parallelism=1,
                                      ici_fsdp_transpose_parallelism=1, dcn_fsdp_transpose_parallelism=1,
                                      num_pipeline_repeats=repeats, num_layers_per_pipeline_stage=-1, **sizes),
        data=dataclasses.replace(cfg.data, per_device_batch_size=per_device_batch))


# --------------------------------------------------------------------------- scoring


def ici_links(shape: tuple[int, ...], wraps: bool, ici: dict[str, int]) -> dict[str, int]:
    """ICI links each axis' collectives use: axes tile the chip grid innermost first (TILE_ORDER);
    per grid dimension an axis spans, 2 links if it closes a ring through the wraparound, else 1."""
    remaining, links = list(shape), {}
    for axis in TILE_ORDER:
        ways = ici.get(axis, 1)
        if ways == 1:
            continue
        extent = [1] * len(shape)
        for p in sorted(_prime_factors(ways), reverse=True):
            free = [d for d in range(len(shape)) if (remaining[d] // extent[d]) % p == 0]
            if not free:  # does not tile the grid: a ring on a line, one link
                extent = None
                break
            extent[max(free, key=lambda d: remaining[d] // extent[d])] *= p
        if extent is None:
            links[axis] = 1
            continue
        links[axis] = sum((2 if wraps and e == remaining[d] else 1) for d, e in enumerate(extent) if e > 1)
        remaining = [r // e for r, e in zip(remaining, extent)]
    return links


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def axis_intensities(cfg: Config, mesh: dict[str, int], hw: Hardware) -> dict[str, float]:
    """FLOPs per byte communicated, per axis in use (the formulas of the module docstring)."""
    m = cfg.model
    values = {r.axis: r.intensity for r in rooflines(cfg, mesh, hw) if r.size > 1}
    if mesh["data"] > 1:
        sparsity = m.num_experts / m.num_experts_per_tok if m.num_experts > 1 else 1.0
        tokens = cfg.data.per_device_batch_size * cfg.data.max_target_length
        shards = mesh["fsdp"] * mesh["tensor"] * mesh["expert"] * mesh["stage"]
        values["data"] = 3 * tokens * shards / (sparsity * DTYPE_BYTES[m.weight_dtype])
    return values


def score_axes(cfg: Config, mesh: Mesh, hw: Hardware) -> tuple[Axis, ...]:
    """Each axis in use against the link it runs over; the DCN part of an axis on its own line."""
    acc, gpu = hw.accelerator, hw.accelerator.torus_dims == 0
    if gpu:
        links = {a: 1 for a in ICI_AXES}
    else:
        s = tpu_slice(hw.name, key="--hardware")
        links = ici_links(s.shape, s.has_wraparound, mesh.ici)
    dcn_hw = acc.peak_flops / DCN_BYTES_PER_S[acc.name]
    lines = []
    for axis, value in axis_intensities(cfg, mesh.sizes, hw).items():
        inside, outside = mesh.ici.get(axis, 1), mesh.dcn.get(axis, 1)
        if inside > 1:
            bw = links[axis] * acc.link_bytes_per_s
            lines.append(Axis(axis, inside, value, acc.peak_flops / bw, "nvlink" if gpu else f"ici x{links[axis]}"))
        if outside > 1:
            lines.append(Axis(axis, outside, value * inside, dcn_hw, "network" if gpu else "dcn"))
    return tuple(lines)


def recomputed_share(cfg: Config, policy: str) -> float:
    """Share of a layer's forward matmul FLOPs that `policy` computes again in the backward pass."""
    m = cfg.model
    d, h, length = m.emb_dim, m.head_dim, cfg.data.max_target_length
    qkv = d * (m.num_query_heads + 2 * m.num_kv_heads) * h
    out = m.num_query_heads * h * d
    scores = m.num_query_heads * h * length  # causal: half of 2 x T x heads x head_dim per token
    mlp = d * token_mlp_width(m) * (len(m.mlp_activations) + 1)
    total = qkv + out + scores + mlp
    again = {"none": 0.0, "minimal": 0.0, "save_dot_except_mlp": mlp, "save_qkv_proj": total - qkv,
             "full": total}
    return again[policy] / total


def executed_ratio(cfg: Config) -> float:
    """FLOPs a step executes over those MFU counts, beyond recomputation: 1, or for capacity routing (MoE without
    sparse_matmul / megablox) the padded expert slots (capacity_factor x the routed copies) and the one-hot
    dispatch and combine matmuls (2 x 2 x experts x slots x emb_dim per token)."""
    m, length = cfg.model, cfg.data.max_target_length
    if m.num_experts <= 1 or m.sparse_matmul or m.megablox:
        return 1.0
    from tessera.metrics import training_flops_per_step  # imported here: `--help` runs without jax
    from tessera.models.moe import expert_capacity

    counts = count_params(m)
    counted = training_flops_per_step(m, 1, length) / length / 3  # forward FLOPs per token
    k = min(m.num_experts_per_tok, m.num_experts)
    routed = 2 * k * counts.per_expert_mlp  # the chosen experts' forward FLOPs per token
    slots = expert_capacity(length, m)  # per expert and sequence
    padding = routed * (m.num_experts * slots / (k * length) - 1)
    dispatch = 4 * m.num_experts * slots * m.emb_dim
    return 1.0 + counts.expert_layers * (padding + dispatch) / counted


def estimate_mfu(axes: tuple[Axis, ...], bubble: float, recomputed: float, executed: float = 1.0) -> float:
    ratio = min((a.ratio for a in axes), default=1e6)
    base = TENSOR_MFU if any(a.axis == "tensor" for a in axes) else BASE_MFU
    return base * min(1.0, ratio) * (1.0 - bubble) * 3 / (3 + recomputed) / executed


def fused_attention(cfg: Config, hw: Hardware) -> bool:
    """The estimator's rule: cuDNN on GPUs (16-bit), splash on TPUs (flash / autoselected)."""
    if hw.accelerator.torus_dims == 0:
        return cfg.model.dtype in ("bfloat16", "float16")
    return cfg.model.attention in ("flash", "autoselected")


# --------------------------------------------------------------------------- search


def token_options(cfg: Config, hw: Hardware, tokens_per_device: int) -> list[int]:
    """Tokens per device to try, ascending: the one asked for, else powers of two times the sequence
    length from 1/128 of a sequence up to MAX_GLOBAL_TOKENS over all devices."""
    if tokens_per_device:
        return [tokens_per_device]
    length = cfg.data.max_target_length
    most = max(MAX_GLOBAL_TOKENS // hw.num_devices, length)
    sizes = (length * 2**i for i in range(-7, 8))
    return [int(t) for t in sizes if 1 <= t <= most and t == int(t)]


def pipeline_repeats(cfg: Config, stages: int) -> list[int]:
    """GPipe (1 repeat) and circular with one block per group."""
    return [1] if stages == 1 else sorted({1, max(1, cfg.model.num_decoder_layers // stages)})


def layout_or_none(cfg: Config, mesh: Mesh):
    """(pipeline layout or None) when this batch and mesh are valid for the trainer, else raises ConfigError."""
    rows = global_batch(cfg.data.per_device_batch_size, 1, mesh.sizes)
    return pipeline_layout(cfg, mesh.sizes, rows)


def mesh_candidates(cfg: Config, counts: ParamCounts, hw: Hardware, mesh: Mesh, tokens: list[int],
                    repeats_tried: list[int] | None = None) -> list[Candidate]:
    """Per remat policy and pipeline schedule (`pipeline_repeats` unless given): the largest batch that fits (else
    the smallest tried)."""
    fused, executed = fused_attention(cfg, hw), executed_ratio(cfg)
    budget = hw.accelerator.hbm_bytes * cfg.compile.compile_hbm_budget_fraction
    found: dict[tuple[int, str], Candidate] = {}
    for repeats in repeats_tried or pipeline_repeats(cfg, mesh.sizes["stage"]):
        for t in tokens:
            c = mesh_config(cfg, mesh, repeats, t / cfg.data.max_target_length)
            try:
                layout = layout_or_none(c, mesh)
            except ConfigError:
                continue
            mem, axes = estimate_memory(c, counts, mesh.sizes, fused), score_axes(c, mesh, hw)
            bubble = layout.bubble if layout else 0.0
            for policy in REMAT_POLICIES:
                cand = Candidate(mesh, repeats, policy, c.data.per_device_batch_size, t, mem.total(policy), budget,
                                 axes, bubble, estimate_mfu(axes, bubble, recomputed_share(c, policy), executed))
                if cand.fits or (repeats, policy) not in found:
                    found[(repeats, policy)] = cand
    return list(found.values())


def config_mesh(cfg: Config, hw: Hardware) -> Mesh:
    """The mesh `cfg` asks for on `hw` (-1 entries filled in as tessera.mesh fills them)."""
    sizes = mesh_sizes(cfg, hw)
    if hw.accelerator.torus_dims == 0:
        return gpu_split(sizes)
    dcn = {a: max(1, getattr(cfg.mesh, f"dcn_{KEY[a]}_parallelism")) for a in ICI_AXES}
    return Mesh({a: sizes[a] // dcn[a] for a in ICI_AXES}, {a: dcn[a] for a in DCN_AXES})


def own_candidates(cfg: Config, hw: Hardware) -> dict[str, Candidate]:
    """The plan's score of the mesh, batch and pipeline schedule `cfg` already has (a recipe's, say), per remat
    policy the plan tries (and `cfg`'s own policy, scored as full when the plan does not model it)."""
    mesh = config_mesh(cfg, hw)
    tokens = round(cfg.data.per_device_batch_size * cfg.data.max_target_length)
    repeats = max(cfg.mesh.num_pipeline_repeats, 1) if mesh.sizes["stage"] > 1 else 1
    found = {c.remat: c for c in mesh_candidates(cfg, count_params(cfg.model), hw, mesh, [tokens], [repeats])}
    if found:
        found.setdefault(cfg.model.remat_policy, found["full"])
    return found


def search(cfg: Config, hw: Hardware, tokens_per_device: int = 0) -> list[Candidate]:
    """Every mesh's candidates (per remat policy and pipeline schedule), best first (fitting ones before the
    others, which come smallest first)."""
    m, counts = cfg.model, count_params(cfg.model)
    tokens = token_options(cfg, hw, tokens_per_device)
    found = []
    for mesh in meshes(cfg, hw):
        sizes = mesh.sizes
        if m.emb_dim % (sizes["fsdp"] * sizes["expert"]):
            continue  # the embedding dimension would not split: those weights would be copied, not sharded
        found += mesh_candidates(cfg, counts, hw, mesh, tokens)
    fitting = sorted((c for c in found if c.fits), key=Candidate.rank_key, reverse=True)
    return fitting + sorted((c for c in found if not c.fits), key=lambda c: c.memory)


def plan(cfg: Config, hw: Hardware, tokens_per_device: int = 0) -> list[Candidate]:
    """The best candidate of each mesh and pipeline schedule, best first; when none fits, smallest first."""
    return best_per_mesh(search(cfg, hw, tokens_per_device))


def best_per_mesh(ranked: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in ranked:
        key = (c.mesh.describe(), c.repeats)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def run_args(c: Candidate, cfg: Config) -> list[str]:
    """The overrides a recipe gives train_compile / train.py for this candidate."""
    stages = c.mesh.sizes["stage"]
    pipe = [f"num_pipeline_repeats={c.repeats}"] if stages > 1 else []
    return [*c.mesh.keys(), *pipe, f"per_device_batch_size={c.per_device_batch:g}",
            f"max_target_length={cfg.data.max_target_length}", f"remat_policy={c.remat}"]


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m tessera.tools.plan", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config_epilog(("model_name", "max_target_length", "dtype", "weight_dtype", "attention",
                              "compile_hbm_budget_fraction"), ("getting_started/Plan.md",)))
    p.add_argument("model", nargs="?", help="model name (configs/models/<name>.yml) or path to a model YAML file "
                   "(default: model_name=... among the overrides, else the default model)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (max_target_length, weight_dtype, ...); "
                   "mesh, batch and remat keys are what the plan chooses")
    p.add_argument("--hardware", required=True, help="TPU slice type (v6e-256, v5p-128, ...) or <gpu>-<count> (h100-8)")
    p.add_argument("--slices", type=int, default=1, help="TPU slices joined over DCN (GPUs: that many times the "
                   "count; default 1)")
    p.add_argument("--tokens-per-device", type=int, default=0, help="fix the batch at this many tokens per device "
                   "(default: the largest that fits, up to 16.8M tokens per step)")
    p.add_argument("--top", type=int, default=5, help="rows of the ranked table, and candidates --compile tries")
    p.add_argument("--compile", action="store_true", help="AOT-compile the top candidates for the TPU topology, "
                   "fit the batch to the compiler's memory, write a recipe and a JSON report")
    p.add_argument("--output", default="", help="with --compile: the recipe to write (default configs/tpu/<gen>/"
                   "plan_<model>.sh); the JSON report goes next to it")
    args = p.parse_intermixed_args(argv)
    if args.model is not None and "=" in args.model:  # only key=value arguments: no model named
        args.model, args.overrides = None, [args.model, *args.overrides]
    return args


def main(argv: list[str]) -> int:
    from tessera.tools.plan_report import explain, no_fit_message, report_header, table

    args = parse_args(argv)
    try:
        if args.slices < 1 or args.top < 1 or args.tokens_per_device < 0:
            raise ConfigError("--slices and --top must be at least 1 and --tokens-per-device at least 0")
        cfg = load_model_config(args.model, args.overrides)
        hw = parse_hardware(args.hardware, args.slices)
        print(report_header(cfg, hw, sequence_note(cfg, args.overrides)), flush=True)
        ranked = search(cfg, hw, args.tokens_per_device)
        if not ranked:
            raise ConfigError(f"no mesh of {hw.num_devices} devices splits this model evenly with a whole global "
                              "batch; change --tokens-per-device or the device count")
        shown = best_per_mesh(ranked)
        if not ranked[0].fits:
            print("\nnothing fits; the smallest candidates (! = over the memory budget):\n" + table(shown[:args.top]))
            raise ConfigError(no_fit_message(cfg, hw, ranked, args.tokens_per_device))
        ranked = shown
        print("\n" + table(ranked[:args.top]))
        print("\n" + explain(ranked[0], ranked[1] if len(ranked) > 1 else None))
        if args.compile:
            from tessera.tools.plan_compile import compile_top

            return compile_top(cfg, hw, ranked[:args.top], args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
