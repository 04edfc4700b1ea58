"""Accelerators by name: TPU slice types (`v5p-256`) and GPUs, with the figures that the AOT
memory check and the estimator need.

Figures come from the vendors' public specifications: HBM per chip, the one-way bandwidth of
one ICI link (TPU) or of a GPU's NVLink port, and peak dense bf16 TFLOP/s (`PEAK_BF16_TFLOPS`,
the one table behind every MFU figure).

A TPU slice type counts TensorCores for v4, v5p and TPU7x (two per chip: `v5p-256` is 128
chips) and chips for v5e and v6e (`v6e-256` is 256 chips). `tpu_slice` turns a type into the
physical topology libtpu understands (`v5p:4x4x8`). Nothing here imports JAX.

Figures are per JAX device. That is one chip everywhere except TPU7x (Ironwood), whose two
chiplets JAX sees as two devices, each with half the chip's HBM and compute (Google's TPU7x
page: 192 GiB HBM, 2,307 dense bf16 TFLOP/s, 1,200 GB/s bidirectional ICI per chip, two
TensorCores; `tpu7x-16` is 8 chips, 16 devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from tessera.config import ConfigError

GIB = 2**30

# Dense (no sparsity) bf16 peak TFLOP/s per device, from the vendors' data sheets. Matched
# against jax's device_kind by substring, first match wins (so "h100 pcie" precedes "h100"). The NVL
# cards (H100 NVL, H200 NVL: 1,671 TFLOP/s with sparsity) run at lower clocks than the SXM parts, and a
# GB200's GPU faster than a B200 (GB200 NVL72: 360 PFLOP/s sparse over 72 GPUs).
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("h100 pcie", 756.0),
    ("h100 nvl", 835.5),
    ("h100", 989.0),
    ("h200 nvl", 835.5),
    ("gh200", 989.0),
    ("h200", 989.0),
    ("gb200", 2500.0),
    ("b200", 2250.0),
    ("a100", 312.0),
    ("mi355x", 2516.6),
    ("mi300x", 1307.4),
    ("tpu v4", 275.0),
    ("tpu v5 lite", 197.0),
    ("tpu v5e", 197.0),
    ("tpu v5p", 459.0),
    ("tpu v5", 459.0),
    ("tpu v6 lite", 918.0),
    ("tpu v6e", 918.0),
    ("tpu7x", 1153.5),  # half of a chip's 2,307: each of its two chiplets is a device
]


@functools.lru_cache(maxsize=64)  # the planner reads it per candidate
def peak_tflops(device_kind: str) -> float | None:
    """Peak dense bf16 TFLOP/s for a device kind, or None when the device is not in the table."""
    kind = device_kind.lower()
    for pattern, peak in PEAK_BF16_TFLOPS:
        if pattern in kind:
            return peak
    return None


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str  # "v5p", "h100"
    device_kind: str  # what jax reports as device_kind
    hbm_bytes: int  # of one device
    link_bytes_per_s: float  # one-way bandwidth of one ICI link (TPU) or of the NVLink port (GPU), per device
    cores_per_chip: int = 1  # TensorCores counted per chip in a slice type's number
    devices_per_chip: int = 1  # JAX devices per chip (2 for TPU7x's chiplets)
    torus_dims: int = 0  # 3 (v4, v5p), 2 (v5e, v6e), 0 for GPUs
    max_slice_chips: int = 0
    compute_capability: str = ""  # an NVIDIA GPU's, as jax reports it ("9.0"): cuDNN's head sizes depend on it

    @property
    def peak_flops(self) -> float:
        """Dense bf16 FLOP/s of one device."""
        return peak_tflops(self.device_kind) * 1e12


TPUS = {
    "v4": Accelerator("v4", "TPU v4", 32 * GIB, 45e9, cores_per_chip=2, torus_dims=3, max_slice_chips=4096),
    "v5p": Accelerator("v5p", "TPU v5", 95 * GIB, 90e9, cores_per_chip=2, torus_dims=3, max_slice_chips=8960),
    "v5e": Accelerator("v5e", "TPU v5 lite", 16 * GIB, 45e9, torus_dims=2, max_slice_chips=256),
    "v6e": Accelerator("v6e", "TPU v6 lite", 32 * GIB, 90e9, torus_dims=2, max_slice_chips=256),
    # per device: half a chip (v5p's per-chip ICI bandwidth, shared by the two chiplets)
    "tpu7x": Accelerator("tpu7x", "TPU7x", 96 * GIB, 45e9, cores_per_chip=2, devices_per_chip=2, torus_dims=3,
                         max_slice_chips=9216),
}
GPUS = {
    "h100": Accelerator("h100", "NVIDIA H100 80GB HBM3", 80 * 10**9, 450e9, compute_capability="9.0"),
    "h200": Accelerator("h200", "NVIDIA H200", 141 * 10**9, 450e9, compute_capability="9.0"),
    "a100": Accelerator("a100", "NVIDIA A100-SXM4-80GB", 80 * 10**9, 300e9, compute_capability="8.0"),
    # HGX/DGX B200: 180 GB of HBM3e and fifth-generation NVLink (1.8 TB/s both ways) per GPU
    "b200": Accelerator("b200", "NVIDIA B200", 180 * 10**9, 900e9, compute_capability="10.0"),
}
_ALIASES = {"v5litepod": "v5e"}  # Google's own name for v5e slice types


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """One TPU slice: its generation, chip count and physical shape (e.g. (4, 4, 8))."""

    accelerator: Accelerator
    name: str
    chips: int
    shape: tuple[int, ...]

    @property
    def devices(self) -> int:
        """JAX devices in the slice."""
        return self.chips * self.accelerator.devices_per_chip

    @property
    def topology_name(self) -> str:
        """The name libtpu's topology API takes, e.g. "v5p:4x4x8"."""
        return f"{self.accelerator.name}:{'x'.join(map(str, self.shape))}"

    @property
    def has_wraparound(self) -> bool:
        """Whether the slice's ICI links close into rings (a full v5e/v6e pod, or a 3D slice of
        at least 4x4x4 chips); collectives along a ring axis then use links in both directions
        of two dimensions."""
        if self.accelerator.torus_dims == 2:
            return self.chips == self.accelerator.max_slice_chips
        return min(self.shape) >= 4


@functools.lru_cache(maxsize=256)  # the planner asks once per mesh it scores
def tpu_slice(name: str, key: str = "compile_topology") -> TpuSlice:
    """Parse a slice type such as "v5p-256", "v5e-256" (or "v5litepod-256"), "v6e-8", "v4-128", "tpu7x-16".
    The same (immutable) TpuSlice for the same arguments."""
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e|tpu7x)-(\d+)", name.strip().lower())
    if not match:
        raise ConfigError(
            f"{key}={name!r} is not a TPU slice type; use <generation>-<size> with a generation among "
            f"{', '.join(TPUS)} (e.g. v5p-256, v5e-256, v6e-256, v4-128, tpu7x-16)"
        )
    acc = TPUS[_ALIASES.get(match.group(1), match.group(1))]
    size = int(match.group(2))
    chips, rest = divmod(size, acc.cores_per_chip)
    if chips < 1:
        raise ConfigError(f"{key}={name!r}: a slice has at least one chip; the smallest {acc.name} slice type is "
                          f"{match.group(1)}-{acc.cores_per_chip}")
    if rest:
        raise ConfigError(f"{key}={name!r}: {acc.name} slice sizes count {acc.cores_per_chip} cores per chip, "
                          f"so the size must be a multiple of {acc.cores_per_chip}")
    if chips > acc.max_slice_chips:
        raise ConfigError(f"{key}={name!r}: a {acc.name} slice has at most {acc.max_slice_chips} chips; "
                          "use several slices (compile_topology_num_slices) instead")
    name = f"{match.group(1)}-{size}"  # as reports and plans print it, however it was typed ("V5E-8 ")
    return TpuSlice(acc, name, chips, _slice_shape(acc, chips, name, key))


def _slice_shape(acc: Accelerator, chips: int, name: str, key: str) -> tuple[int, ...]:
    """Physical chip grid: powers of two grow the smallest (last such) dimension one doubling at
    a time (2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...); other 3D sizes are 4x4xN."""
    if acc.torus_dims == 3:
        if chips >= 16 and chips % 16 == 0 and chips & (chips - 1):
            return (4, 4, chips // 16)
        shape, start = [2, 2, 1], 4
    else:
        shape, start = [1, 1], 1
    if chips < start or chips & (chips - 1):
        raise ConfigError(f"{key}={name!r}: {chips} chips is not a {acc.name} slice shape; use a power of two "
                          f"number of chips (>= {start})" + (" or a multiple of 16" if acc.torus_dims == 3 else ""))
    while math.prod(shape) < chips:
        smallest = min(shape)
        last = max(i for i, s in enumerate(shape) if s == smallest)
        shape[last] *= 2
    return tuple(shape)


def accelerator_for_device_kind(device_kind: str) -> Accelerator | None:
    """The table entry whose device_kind matches jax's `device.device_kind`, if any."""
    for acc in (*TPUS.values(), *GPUS.values()):
        if acc.device_kind.lower() == device_kind.lower():
            return acc
    return None


# Data-center network (DCN) bandwidth of one device, one way, in bytes/s: what a collective across slices (TPU) or
# across nodes (GPU) can use per device. The planner (tessera.tools.plan) compares an axis split over DCN with it.
#   v5e: Google's v5e page: 2 x 100 Gbps NICs per host of 8 chips (6.4 Tbps per 256-chip pod) -> 25 Gbps per chip
#   v6e: Google's v6e page: 4 x 200 Gbps NICs per host of 8 chips (25.6 Tbps per pod) -> 100 Gbps per chip
#   v5p: Google's v5p page: "Data center network (DCN) bandwidth per chip: 50 Gbps"
#   v4: an assumption (no per-chip figure published): v5p's 50 Gbps
#   tpu7x: an assumption (no per-chip figure published): v6e's 100 Gbps per chip, shared by its two devices
#   h100, h200: NVIDIA's DGX H100/H200 design: one 400 Gb/s InfiniBand NIC per GPU (a cloud VM may have less:
#               Google's A3 has 4 x 200 Gbps for 8 GPUs)
#   a100: NVIDIA's DGX A100 design: one 200 Gb/s HDR InfiniBand NIC per GPU
#   b200: NVIDIA's DGX B200 design: one 400 Gb/s NIC per GPU for the compute fabric
DCN_BYTES_PER_S = {
    "v4": 50e9 / 8, "v5e": 25e9 / 8, "v5p": 50e9 / 8, "v6e": 100e9 / 8, "tpu7x": 100e9 / 8 / 2,
    "h100": 400e9 / 8, "h200": 400e9 / 8, "a100": 200e9 / 8, "b200": 400e9 / 8,
}
# GPUs joined by NVLink in one node (HGX/DGX boards of 8); the planner treats nodes as it treats TPU slices
GPUS_PER_NODE = 8
