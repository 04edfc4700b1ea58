"""The plan's scoring model: how fast a candidate mesh, remat policy and batch should train
(tessera.tools.plan enumerates the candidates and ranks them by this).

Each parallel axis is scored with the public TPU sizing guide's arithmetic intensity (FLOPs per
byte it makes a chip communicate), tokens T per device, sparsity s = experts / experts per token:

    fsdp    T x tensor x expert x stages / s       (the estimator's rooflines)
    expert  4 x F / expert                         (F: mlp_dim, or a MoE model's expert width,
    tensor  F / tensor                              base_moe_mlp_dim when set)
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

import dataclasses
import functools
from typing import TYPE_CHECKING

from tessera.config import Config, ConfigError
from tessera.hardware import DCN_BYTES_PER_S, tpu_slice
from tessera.tools.estimate import Hardware, param_layout
from tessera.tools.rooflines import rooflines
from tessera.metrics import mla_matmul_params
from tessera.tools.memory_model import DTYPE_BYTES, attention_widths, count_params, token_mlp_width

if TYPE_CHECKING:
    from tessera.tools.plan_meshes import Mesh

BASE_MFU = 0.6  # a compute-bound step's share of peak (the recipes' READMEs' assumption)
TENSOR_MFU = 0.5  # the same with tensor parallelism: part of its all-reduces stays exposed
REMAT_POLICIES = ("full", "save_qkv_proj", "save_dot_except_mlp", "minimal", "none")  # the plan tries
TILE_ORDER = ("tensor", "expert", "sequence", "fsdp", "stage", "data")  # TPU: innermost tile first


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


def ici_links(shape: tuple[int, ...], wraps: bool, ici: dict[str, int]) -> dict[str, int]:
    """ICI links each axis' collectives use: axes tile the chip grid innermost first (TILE_ORDER);
    per grid dimension an axis spans, 2 links if it closes a ring through the wraparound, else 1."""
    return dict(_ici_links(tuple(shape), wraps, tuple(ici.get(axis, 1) for axis in TILE_ORDER)))


@functools.lru_cache(maxsize=4096)  # the planner scores each ICI mesh once per DCN mesh and batch
def _ici_links(shape: tuple[int, ...], wraps: bool, tile_ways: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    remaining, links = list(shape), {}
    for axis, ways in zip(TILE_ORDER, tile_ways):
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
    return tuple(links.items())


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
        links = {a: 1 for a in mesh.ici}
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
    q, k, v, ctx = attention_widths(m)
    out = ctx * d
    qkv = mla_matmul_params(m) - out if m.decoder_block == "deepseek" else d * (q + k + v)  # MLA: its latents'
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


@dataclasses.dataclass(frozen=True)
class ModelTerms:
    """What the MFU and memory estimates take from the model alone, the same for every mesh and batch of a
    search."""

    executed: float  # executed_ratio
    recomputed: dict[str, float]  # recomputed_share per remat policy
    # estimate.param_layout, for the weights a mesh copies whole; None for a model only counted, not built (the
    # sizing guide's MoE examples: experts on a dense block)
    params: tuple | None

    @classmethod
    def of(cls, cfg: Config) -> ModelTerms:
        try:
            params = param_layout(cfg)
        except ConfigError:
            params = None
        return cls(executed_ratio(cfg), {p: recomputed_share(cfg, p) for p in REMAT_POLICIES}, params)


def estimate_mfu(axes: tuple[Axis, ...], bubble: float, recomputed: float, executed: float = 1.0) -> float:
    ratio = min((a.ratio for a in axes), default=1e6)
    base = TENSOR_MFU if any(a.axis == "tensor" for a in axes) else BASE_MFU
    return base * min(1.0, ratio) * (1.0 - bubble) * 3 / (3 + recomputed) / executed
