"""Device mesh and logical axis rules.

Mesh axes, outermost first: data, stage, fsdp, sequence, tensor, expert. Their sizes come
from `ici_*_parallelism` (inside a slice) times `dcn_*_parallelism` (across slices); one of
each group may be -1 and is filled from the device or slice count.

Parameters and activations carry logical axis names; `LOGICAL_RULES` (one entry per name)
maps each to the mesh axes it is split over. A mesh axis of size 1, one already used by an
earlier dimension, or one that does not divide the dimension is skipped, so the same model
runs on any mesh; `logical_spec` is the single place that decision is made. The exceptions are
the `MUST_DIVIDE` dimensions (query heads, MLP width): a tensor axis that does not divide them
is refused before anything is compiled, as it would silently replicate those weights.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from tessera.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

MESH_AXES = ("data", "stage", "fsdp", "sequence", "tensor", "expert")
_KEY_NAME = {"data": "data", "stage": "pipeline", "fsdp": "fsdp", "sequence": "sequence",
             "tensor": "tensor", "expert": "expert", "fsdp_transpose": "fsdp_transpose"}

# logical name -> mesh axes it may be split over (in order). Activation names start with act_
# where the parameter of the same concept is split differently.
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "length": ("sequence",),
    # the residual stream [B, T, D] between blocks is split over tensor too, as in Megatron's
    # sequence parallelism: gathered before the projections, reduce-scattered after them. Left
    # whole, every tensor-parallel device keeps all of it: MaxText's v5p 128B config (tensor 8)
    # needed 97 GiB per chip that way, 68 GiB split (benchmarks/README.md)
    "act_embed": ("tensor",),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_exp": ("expert",),
    "act_batch_no_exp": ("data", "fsdp"),
    # parameters: stacked blocks are split over the pipeline stages (tessera.models.pipeline)
    "layers": ("stage",),
    "pipeline_repeats": (),
    # over expert too: with expert parallelism the attention and embedding weights, which have
    # no expert dimension, are split over it as over fsdp instead of copied to every device of
    # it (expert weights use that axis for their expert dimension first)
    "embed": ("fsdp", "sequence", "expert"),
    # the token table's embed dimension while it is looked up: gathered over sequence first, so
    # that the looked-up rows go to their batch x length split with one all-to-all over fsdp
    # (from a split over fsdp and sequence at once XLA copied every row to every device)
    "embed_lookup": ("fsdp", "expert"),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "linear_heads": ("tensor",),  # qwen3_next's Gated DeltaNet heads (query/key and value heads alike)
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "norm": (),
    "exp": ("expert",),
}

# Logical dimensions the mesh axes of their rule must divide. Left whole, the attention or MLP
# weights and their compute would be copied to every device of the axis, which is never what a
# tensor-parallel config means. kv_heads is not here: with grouped-query attention fewer kv heads
# than tensor ways is normal (each is then replicated over a few devices).
MUST_DIVIDE = {"heads": "attention query heads (num_query_heads)", "mlp": "MLP width (mlp_dim)",
               "linear_heads": "Gated DeltaNet heads (gdn_num_key_heads and gdn_num_value_heads)"}


def _resolve(kind: str, sizes: dict[str, int], total: int, units: tuple[str, str], note: str = "") -> dict[str, int]:
    """Fill a -1 entry and check that the product equals `total`; `note` ends an error (how `total` was found)."""
    counted = f"{total} {units[total != 1]}"  # "1 device in a slice", "8 devices in a slice"
    fixed = math.prod(v for v in sizes.values() if v != -1)
    fill = [axis for axis, v in sizes.items() if v == -1]
    if fill:
        if total % fixed:
            raise ConfigError(
                f"{_describe(kind, sizes)}: the fixed factors multiply to {fixed}, which does not divide "
                f"the {counted}; change them so their product divides {total}{note}"
            )
        sizes = {**sizes, fill[0]: total // fixed}
    if math.prod(sizes.values()) != total:
        raise ConfigError(
            f"{_describe(kind, sizes)} = {math.prod(sizes.values())}, but there {('is', 'are')[total != 1]} {counted}; "
            f"make the product {total} or set one of them to -1{note}"
        )
    return sizes


def _describe(kind: str, sizes: dict[str, int]) -> str:
    return " * ".join(f"{kind}_{_KEY_NAME[a]}_parallelism={v}" for a, v in sizes.items())


def mesh_shape(cfg: MeshConfig, num_devices: int, num_slices: int,
               slices_note: str = "") -> tuple[dict[str, int], dict[str, int]]:
    """(ici sizes, dcn sizes) per mesh axis after filling -1 and checking the products; `slices_note`
    ends an error of the dcn keys (where `num_slices` came from)."""
    if num_devices % num_slices:
        raise ConfigError(f"{num_devices} device{'s' if num_devices != 1 else ''} cannot be split evenly into "
                          f"num_slices={num_slices}; set num_slices to a divisor of {num_devices}, or -1 (found from "
                          "the devices)")
    ici = {a: getattr(cfg, f"ici_{_KEY_NAME[a]}_parallelism") for a in (*MESH_AXES, "fsdp_transpose")}
    dcn = {a: getattr(cfg, f"dcn_{_KEY_NAME[a]}_parallelism") for a in (*MESH_AXES, "fsdp_transpose")}
    ici = _resolve("ici", ici, num_devices // num_slices, ("device in a slice", "devices in a slice"))
    dcn = _resolve("dcn", dcn, num_slices, ("slice", "slices"), slices_note)
    return _fold_fsdp_transpose("ici", ici), _fold_fsdp_transpose("dcn", dcn)


def _fold_fsdp_transpose(kind: str, sizes: dict[str, int]) -> dict[str, int]:
    """MaxText's fsdp_transpose axis merged into fsdp. MaxText splits a weight's embed dimension
    over fsdp and its MLP/heads dimension over fsdp_transpose; Tessera splits the embed dimension
    over the whole fsdp axis instead: the same bytes per device and the same gather volume per
    weight, and the batch is split over both either way, so a separate axis buys nothing here."""
    ways = sizes.pop("fsdp_transpose")
    if ways > 1:
        log.info("%s_fsdp_transpose_parallelism=%d is folded into the fsdp axis: %s_fsdp_parallelism %d x %d = %d",
                 kind, ways, kind, sizes["fsdp"], ways, sizes["fsdp"] * ways)
    return {**sizes, "fsdp": sizes["fsdp"] * ways}


def create_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The device mesh for this config; ICI axes inside a slice, DCN axes across slices."""
    devices = list(jax.devices() if devices is None else devices)
    detected = len({getattr(d, "slice_index", 0) for d in devices})
    if cfg.num_slices not in (-1, detected) and devices[0].platform == "tpu":  # TPU devices know their slice
        raise ConfigError(f"num_slices={cfg.num_slices}, but the {len(devices)} TPU devices form {detected} slice(s): "
                          f"a slice is not split or joined by this key. Set num_slices=-1 (found from the devices) "
                          f"or {detected}; an AOT compile takes its slice count from compile_topology_num_slices")
    num_slices = detected if cfg.num_slices == -1 else cfg.num_slices
    note = "" if cfg.num_slices != -1 or devices[0].platform == "tpu" else (
        f"; or declare the slices: num_slices=-1 found {detected} among the {devices[0].platform.upper()} devices (from "
        "their slice_index: CPU devices report none, GPU ones one per host), and num_slices=N makes N slices of their "
        "consecutive devices (one per process when N is the process count)")
    ici, dcn = mesh_shape(cfg, len(devices), num_slices, note)
    ici_shape, dcn_shape = tuple(ici.values()), tuple(dcn.values())
    grid = _hybrid_grid(devices, ici_shape, dcn_shape, num_slices)
    mesh = Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    log.info("mesh %s over %d devices (%d slice(s))", dict(mesh.shape), len(devices), num_slices)
    return mesh


def slice_groups(devices: Sequence[jax.Device], num_slices: int) -> list[list[jax.Device]]:
    """Devices grouped by slice: by `slice_index` (TPU multi-slice), else by process, else in
    contiguous blocks (fake CPU devices declaring slices for tests)."""
    for attr in ("slice_index", "process_index"):
        keys = sorted({getattr(d, attr, 0) for d in devices})
        if len(keys) == num_slices:
            return [[d for d in devices if getattr(d, attr, 0) == k] for k in keys]
    per = len(devices) // num_slices
    return [list(devices[i * per:(i + 1) * per]) for i in range(num_slices)]


def _hybrid_grid(devices, ici_shape: tuple[int, ...], dcn_shape: tuple[int, ...], num_slices: int) -> np.ndarray:
    """Device array of shape ici*dcn per axis: each slice is laid out by `ici_shape` (physical
    topology aware), and slices are tiled along the axes by `dcn_shape`."""
    if num_slices == 1:
        return mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
    per_slice = [mesh_utils.create_device_mesh(ici_shape, g, allow_split_physical_axes=True)
                 for g in slice_groups(devices, num_slices)]
    n = len(ici_shape)
    tiled = np.stack(per_slice).reshape(dcn_shape + ici_shape)
    tiled = tiled.transpose([axis for i in range(n) for axis in (i, n + i)])  # (dcn_0, ici_0, dcn_1, ici_1, ...)
    return tiled.reshape([d * i for d, i in zip(dcn_shape, ici_shape)])


def logical_spec(names: Sequence[str | None], shape: Sequence[int], mesh_sizes: dict[str, int]) -> PartitionSpec:
    """PartitionSpec for an array with logical axis `names` on a mesh with `mesh_sizes`."""
    if len(names) != len(shape):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        if name is not None and name not in LOGICAL_RULES:
            raise KeyError(f"logical axis {name!r} has no entry in LOGICAL_RULES")
        axes = []
        for axis in LOGICAL_RULES.get(name, ()) if name else ():
            size = mesh_sizes.get(axis, 1)
            if size == 1 or axis in used:
                continue
            if dim % (math.prod(mesh_sizes[a] for a in axes) * size):
                continue
            axes.append(axis)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def traced_platform() -> str:
    """"cpu", "gpu", "tpu", ...: the platform of the devices the function being traced is
    compiled for (the current mesh's, so an AOT compile for a TPU topology on a CPU host says
    "tpu"); without a mesh, JAX's default backend. Kernels that differ by platform ask here."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


def shard_logically(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrain an activation to its logical sharding on the current mesh (no-op without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(names, x.shape, dict(mesh.shape)))


def named_shardings(mesh: Mesh, logical_tree, shape_tree):
    """NamedShardings for a pytree of logical-name tuples and a matching pytree of shapes.
    Raises ConfigError when a mesh axis does not divide a `MUST_DIVIDE` dimension."""
    sizes = dict(mesh.shape)

    def sharding(names, s):
        check_divides(names, s.shape, sizes)
        return NamedSharding(mesh, logical_spec(names, s.shape, sizes))

    return jax.tree.map(sharding, logical_tree, shape_tree, is_leaf=lambda x: isinstance(x, tuple))


def check_divides(names: Sequence[str | None], shape: Sequence[int], mesh_sizes: dict[str, int]) -> None:
    """Refuse a mesh whose axes would leave a `MUST_DIVIDE` dimension whole (see there)."""
    for name, dim in zip(names, shape):
        for axis in LOGICAL_RULES.get(name, ()) if name in MUST_DIVIDE else ():
            ways = mesh_sizes.get(axis, 1)
            if dim % ways:
                key = _KEY_NAME[axis]
                best = max(d for d in range(1, ways) if dim % d == 0)
                what = MUST_DIVIDE[name] if not (name == "mlp" and "exp" in names) else \
                    "expert MLP width (base_moe_mlp_dim, or base_mlp_dim when it is 0)"
                raise ConfigError(
                    f"the mesh's {axis} axis (ici_{key}_parallelism * dcn_{key}_parallelism) is {ways}, which does "
                    f"not divide the {dim} {what}: their weights would be copied whole to every device "
                    f"of that axis. Make it a divisor of {dim}, e.g. ici_{key}_parallelism={best} with "
                    f"dcn_{key}_parallelism=1, or change the model")


def sharding_report(mesh: Mesh, shardings, shapes, warn_mib: float, logical_axes=None) -> tuple[list[str], list[str]]:
    """A table (path, shape, spec) of every parameter, and a warning for each one larger than
    `warn_mib` MiB left fully replicated because its dimensions do not divide the mesh axes its
    logical names may use. Parameters the rules replicate on purpose (norm scales and biases of
    width D: `norm` maps to no axis) are not reported. Without `logical_axes` (the pytree of
    logical-name tuples) the cause is unknown and every large replicated parameter is reported."""
    rows, warnings = [], []
    sizes = dict(mesh.shape)
    flat_shapes = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])
    flat_names = {} if logical_axes is None else dict(
        jax.tree_util.tree_flatten_with_path(logical_axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    for path, sharding in jax.tree_util.tree_flatten_with_path(shardings)[0]:
        s = flat_shapes[path]
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        rows.append(f"{name:<48} {str(tuple(s.shape)):<24} {sharding.spec}")
        mib = np.prod(s.shape) * np.dtype(s.dtype).itemsize / 2**20
        if not sharding.is_fully_replicated or mib <= warn_mib or all(v == 1 for v in sizes.values()):
            continue
        cause = (replication_cause(flat_names[path], s.shape, sizes) if flat_names
                 else "no mesh axis splits any of its dimensions")
        if cause:
            warnings.append(f"parameter {name} {tuple(s.shape)} ({mib:.1f} MiB) is fully replicated on mesh "
                            f"{sizes}: {cause}")
    return rows, warnings


def replication_cause(names: Sequence[str | None], shape: Sequence[int], sizes: dict[str, int]) -> str | None:
    """Why a parameter its rules would shard ended up replicated; None when the rules replicate it."""
    misses = [f"{name} {dim} does not divide by {axis}={sizes[axis]}" for name, dim in zip(names, shape) if name
              for axis in LOGICAL_RULES[name] if sizes.get(axis, 1) > 1 and dim % sizes[axis]]
    return "; ".join(misses) + "; pad that dimension or choose mesh sizes that divide it" if misses else None
