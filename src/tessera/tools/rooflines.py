"""The roofline checks of the public TPU sizing guide, per parallel axis (tessera.tools.estimate prints
them; tessera.tools.plan scores meshes with them): an axis is worth its communication when the
arithmetic intensity (FLOPs per byte moved) it leaves is above the hardware's, peak FLOP/s over the
bandwidth of the link its collective uses (estimate's docstring gives each axis's formula)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tessera.config import Config
from tessera.config.derived import pipeline_layout
from tessera.hardware import DCN_BYTES_PER_S
from tessera.metrics import training_flops_per_step
from tessera.tools.memory_model import DTYPE_BYTES, attention_widths

if TYPE_CHECKING:
    from tessera.tools.estimate import Hardware


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
    # FSDP gathers the weights again for each micro-batch of gradient accumulation: its tokens are a micro-batch's
    tokens = cfg.data.per_device_batch_size * cfg.data.max_target_length / cfg.optim.gradient_accumulation_steps
    # on a dense model the expert axis splits the batch and every weight as fsdp does (tessera.mesh's rules): its
    # collectives are fsdp's gathers, at fsdp's intensity, with no all-to-all of routed tokens
    dense = m.num_experts <= 1
    fsdp = tokens * mesh["tensor"] * (1 if dense else mesh["expert"]) * mesh["stage"] / sparsity
    # a MoE layer's rows pass through experts of expert_mlp_dim (base_moe_mlp_dim), not the dense layers' mlp_dim
    width = m.mlp_dim if dense else m.expert_mlp_dim
    lines = [
        Roofline("fsdp", mesh["fsdp"], fsdp, hw.intensity),
        Roofline("expert", mesh["expert"], fsdp if dense else 4 * width / mesh["expert"], hw.intensity),
        Roofline("tensor", mesh["tensor"], width / mesh["tensor"], hw.intensity),
    ]
    if mesh["sequence"] > 1:
        from tessera.models.splash import load_balanced  # imported here: `--help` runs without jax

        balanced = hw.accelerator.torus_dims > 0 and load_balanced(m, cfg.data.max_target_length, mesh["sequence"])
        lines.append(Roofline("sequence", mesh["sequence"], sequence_intensity(cfg, mesh, fsdp, balanced),
                              hw.intensity))
    if mesh["stage"] > 1:  # a stage's FLOPs per token against the activation bytes it passes on per token
        layout = pipeline_plan(cfg, mesh, hw)
        flops = training_flops_per_step(m, 1, cfg.data.max_target_length) / cfg.data.max_target_length
        sent = 2 * layout.repeats * m.emb_dim * DTYPE_BYTES[m.dtype]  # forward activation + backward gradient
        lines.append(Roofline("stage", mesh["stage"], flops / mesh["stage"] / sent, hw.intensity))
    return lines


def sequence_intensity(cfg: Config, mesh: dict[str, int], weights: float, balanced: bool) -> float:
    """FLOPs per byte a sequence split leaves: the weights' gathers (split over the sequence axis as over fsdp,
    intensity `weights`) and attention's own traffic, combined as 1 / (1/weights + 1/attention).

    Per token of its share and per layer, a device receives the keys and values of the other
    `sequence - 1` shares (an all-gather), sends their gradients back (a reduce-scatter) and gathers
    them again when the remat policy recomputes attention: 3 x (sequence - 1) x 2 x kv heads x
    head_dim elements (MLA: a key and a value per query head, Hn + Hr + Hv wide). The load balance
    (`balanced`: splash attention's, on TPU) moves its queries and outputs out and back, forward,
    backward and recomputed: 6 x query heads x head_dim more. Heads are split over tensor, like the layer's FLOPs."""
    m = cfg.model
    length, tensor = cfg.data.max_target_length, mesh["tensor"]
    flops = training_flops_per_step(m, 1, length) / length / m.num_decoder_layers / tensor
    # MLA (deepseek) expands a key [Hn + Hr] and a value [Hv] for every query head, whatever num_kv_heads says
    heads = m.num_query_heads if m.decoder_block == "deepseek" else m.num_kv_heads
    kv_width = sum(attention_widths(m)[1:3]) / heads  # one head's key and value
    kv_heads, q_heads = max(heads // tensor, 1), max(m.num_query_heads // tensor, 1)
    moved = 3 * (mesh["sequence"] - 1) * kv_heads * kv_width + (6 * q_heads * m.head_dim if balanced else 0)
    moved *= DTYPE_BYTES[m.dtype]
    return 1.0 / (1.0 / weights + moved / flops)


def pipeline_plan(cfg: Config, mesh: dict[str, int], hw: Hardware):
    """The trainer's pipeline layout for this mesh and batch (None without a stage axis)."""
    rows = round(cfg.data.per_device_batch_size * hw.num_devices) // cfg.optim.gradient_accumulation_steps
    return pipeline_layout(cfg, mesh, rows)


def roofline_lines(cfg: Config, mesh: dict[str, int], hw: Hardware) -> list[str]:
    """One line per axis (its ICI ways against the ICI's intensity) and, for an axis split across slices
    (GPU nodes), one against the DCN's (the network's): peak / DCN_BYTES_PER_S per chip, with i ways inside
    each slice sending 1/i of the bytes over it, as tessera.tools.plan scores it. GPUs: nodes of
    hardware.GPUS_PER_NODE, the mesh's axes placed in tessera.mesh's order (plan_meshes.gpu_split)."""
    from tessera.mesh import mesh_shape
    from tessera.tools.plan_meshes import gpu_split  # imported here: these modules import this one
    from tessera.tools.plan_model import axis_intensities

    if hw.accelerator.torus_dims == 0:
        split = gpu_split(mesh)
        ici, dcn = split.ici, split.dcn
    else:
        ici, dcn = mesh_shape(cfg.mesh, hw.num_devices, hw.num_slices)
    values = axis_intensities(cfg, mesh, hw)
    acc = hw.accelerator
    across, link = acc.peak_flops / DCN_BYTES_PER_S[acc.name], "DCN" if acc.torus_dims else "network"
    out = []
    for r in rooflines(cfg, mesh, hw):
        if dcn[r.axis] == 1 or ici[r.axis] > 1:
            size, value = (r.size, r.intensity) if dcn[r.axis] == 1 else (ici[r.axis], r.intensity)
            shown = f"{value:12,.0f}" if size > 1 else f"{'-':>12}"
            out.append(f"  {r.axis:<8} x{size:<5} intensity {shown}   {Roofline(r.axis, size, value, hw.intensity).verdict}")
    for axis in ("data", "stage", "fsdp"):
        if dcn[axis] > 1 and axis in values:
            value = values[axis] * ici[axis]
            verdict = (f"compute-bound over {link} (ok: above its {across:,.0f})" if value >= across else
                       f"communication-bound over {link} (below its {across:,.0f}): grow the batch or keep this "
                       f"axis inside the {'slices' if acc.torus_dims else 'nodes'}")
            out.append(f"  {axis:<8} {link.lower()} x{dcn[axis]:<3} intensity {value:12,.0f}   {verdict}")
    return out
