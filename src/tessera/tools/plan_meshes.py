"""The meshes `tessera.tools.plan` tries: every split of a slice's devices (or of every GPU) over
the mesh axes that keeps the model's dimensions whole, and the slices' split across the data
center network. `plan`'s docstring says which sizes are kept and why.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Iterator, Sequence

from tessera.config import Config, ConfigError
from tessera.config.checks import check_tpu_compiler_limits
from tessera.config.layers import mlp_dim_unused
from tessera.hardware import GPUS_PER_NODE
from tessera.tools.estimate import Hardware

ICI_AXES = ("data", "stage", "fsdp", "sequence", "tensor", "expert")
DCN_AXES = ("data", "stage", "fsdp")
GPU_ORDER = ("expert", "tensor", "sequence", "fsdp", "stage", "data")  # tessera.mesh's order, innermost first
KEY = {"data": "data", "stage": "pipeline", "fsdp": "fsdp", "sequence": "sequence", "tensor": "tensor",
       "expert": "expert"}
MIN_SEQUENCE_SHARE = 1024  # a sequence split's tokens per device at least: two of splash's default 512-query tiles


@dataclasses.dataclass(frozen=True)
class Mesh:
    ici: dict[str, int]  # ways per axis inside a slice (a GPU node)
    dcn: dict[str, int]  # ways per axis across slices (nodes)
    gpu: bool = False  # one grid over every GPU (ici and dcn: the parts inside and across nodes)

    @functools.cached_property  # read many times per candidate (do not change the dict it returns)
    def sizes(self) -> dict[str, int]:
        """Each mesh axis' total ways, as estimate.mesh_sizes gives them."""
        axes = ("data", "stage", "fsdp", "sequence", "tensor", "expert")
        return {a: self.ici.get(a, 1) * self.dcn.get(a, 1) for a in axes}

    def keys(self) -> list[str]:
        """key=value overrides that build this mesh (GPUs: one ICI mesh over every GPU, as the GPU recipes)."""
        if self.gpu:
            return [f"ici_{KEY[a]}_parallelism={self.sizes[a]}" for a in ICI_AXES]
        ici = [f"ici_{KEY[a]}_parallelism={self.ici.get(a, 1)}" for a in ICI_AXES]
        return ici + [f"dcn_{KEY[a]}_parallelism={self.dcn.get(a, 1)}" for a in DCN_AXES]

    def describe(self) -> str:
        inner = " x ".join(f"{a} {n}" for a, n in self.ici.items() if n > 1) or "one device"
        outer = " x ".join(f"{a} {n}" for a, n in self.dcn.items() if n > 1)
        return inner + (f" | {'nodes' if self.gpu else 'dcn'} {outer}" if outer else "")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_ok(m, t: int) -> bool:
    mlp = m.expert_mlp_dim % t == 0 and (mlp_dim_unused(m) or m.mlp_dim % t == 0)  # as tessera.mesh checks the weights
    return m.num_query_heads % t == 0 and m.num_kv_heads % t == 0 and mlp


def sequence_ways(cfg: Config, hw: Hardware, devices: int) -> list[int]:
    """Sequence-axis sizes to try: 1, and on TPUs each split of `devices` that splash attention serves
    load-balanced (context_parallel_load_balance: every device an early and a late part of the
    sequence, so a causal mask leaves them equal work) with the model's sa_block_* keys, leaving each
    device at least MIN_SEQUENCE_SHARE tokens of a sequence (shorter shares buy little memory for
    their key/value gathers). GPUs keep the sequence whole: their fused attention is not verified
    with the split."""
    m, length = cfg.model, cfg.data.max_target_length
    if hw.accelerator.torus_dims == 0:
        return [1]
    from tessera.models.attention_choice import select_attention  # imported here: `--help` runs without jax
    from tessera.models.splash import load_balanced

    ways = [1]
    for q in divisors(devices)[1:]:
        if length // q < MIN_SEQUENCE_SHARE or not load_balanced(m, length, q):
            continue
        try:
            if select_attention(m, "tpu", length, {"sequence": q}).kernel == "splash":
                ways.append(q)
        except ConfigError:  # a sa_block_q* key that does not divide one device's parts
            continue
    return ways


def ici_meshes(cfg: Config, devices: int, sequence: Sequence[int] = (1,)) -> Iterator[dict[str, int]]:
    """Every split of one slice's devices over ICI_AXES that keeps the model's dimensions whole (the sequence
    axis: the sizes in `sequence`)."""
    m = cfg.model
    experts = m.num_experts if m.num_experts > 1 else 1
    for t in (t for t in divisors(devices) if tensor_ok(m, t)):
        for e in (e for e in divisors(devices // t) if experts % e == 0):
            for s in (s for s in divisors(devices // (t * e)) if m.num_decoder_layers % s == 0):
                for q in (q for q in sequence if (devices // (t * e * s)) % q == 0):
                    rest = devices // (t * e * s * q)
                    for f in divisors(rest):
                        yield {"data": rest // f, "stage": s, "fsdp": f, "sequence": q, "tensor": t, "expert": e}


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
    per_slice = hw.num_devices // hw.num_slices
    for ici in ici_meshes(cfg, per_slice, sequence_ways(cfg, hw, per_slice)):
        for dcn in dcn_meshes(hw.num_slices):
            mesh = Mesh(ici, dcn)
            try:  # (meshes set-up refuses for TPUs, as their compiler aborts on them)
                check_tpu_compiler_limits(cfg.model, "tpu", mesh.sizes)
            except ConfigError:
                continue
            yield mesh
