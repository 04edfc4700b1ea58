"""Mesh construction, -1 filling, clear product errors, logical specs, replication report."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import tiny_config
from tessera.config import ConfigError, build_config
from tessera.mesh import LOGICAL_RULES, create_mesh, logical_spec, named_shardings, sharding_report


def test_fill_minus_one_from_device_count():
    mesh = create_mesh(build_config({"ici_data_parallelism": 2, "ici_fsdp_parallelism": -1}).mesh)
    assert dict(mesh.shape) == {"data": 2, "stage": 1, "fsdp": 4, "sequence": 1, "tensor": 1, "expert": 1}


def test_product_mismatch_quotes_every_factor():
    cfg = build_config({"ici_data_parallelism": 2, "ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 3}).mesh
    with pytest.raises(ConfigError) as e:
        create_mesh(cfg)
    msg = str(e.value)
    for part in ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=3", "= 12", "8 devices"):
        assert part in msg


def test_fill_that_cannot_divide():
    cfg = build_config({"ici_tensor_parallelism": 3, "ici_fsdp_parallelism": -1}).mesh
    with pytest.raises(ConfigError, match="does not divide"):
        create_mesh(cfg)


def test_mesh_on_a_subset_of_devices():
    mesh = create_mesh(build_config({}).mesh, jax.devices()[:2])
    assert mesh.size == 2 and mesh.shape["fsdp"] == 2


def test_logical_spec_rules():
    sizes = {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 1, "expert": 1, "stage": 1}
    assert logical_spec(("embed", "mlp"), (8, 6), sizes) == P("fsdp", "tensor")
    assert logical_spec(("batch", "length", "act_embed"), (8, 5, 3), sizes) == P(("data", "fsdp"), None, None)
    # a dimension that does not divide keeps only the axes that do, and an axis is used once
    assert logical_spec(("embed", "mlp"), (7, 6), sizes) == P(None, "tensor")
    assert logical_spec(("heads", "mlp"), (4, 4), sizes) == P("tensor", None)
    with pytest.raises(KeyError, match="no entry in LOGICAL_RULES"):
        logical_spec(("nonsense",), (4,), sizes)


def test_every_rule_names_real_mesh_axes():
    from tessera.mesh import MESH_AXES

    for name, axes in LOGICAL_RULES.items():
        assert set(axes) <= set(MESH_AXES), name


def test_replication_report_flags_large_replicated_params():
    mesh = create_mesh(tiny_config().mesh)  # 8-way fsdp
    shapes = {"ok": jax.ShapeDtypeStruct((1024, 512), np.float32), "odd": jax.ShapeDtypeStruct((1023, 511), np.float32)}
    logical = {"ok": ("embed", "mlp"), "odd": ("embed", "mlp")}
    rows, warnings = sharding_report(mesh, named_shardings(mesh, logical, shapes), shapes, warn_mib=1.0)
    assert len(rows) == 2
    assert len(warnings) == 1 and "odd" in warnings[0] and "fully replicated" in warnings[0]


def test_declared_slices_on_cpu_build_a_hybrid_mesh():
    cfg = build_config({"num_slices": 2, "dcn_data_parallelism": 2, "ici_fsdp_parallelism": 4}).mesh
    mesh = create_mesh(cfg)
    assert dict(mesh.shape)["data"] == 2 and dict(mesh.shape)["fsdp"] == 4
    devices = jax.devices()
    # the DCN axis (data) separates the two slices; ICI axes stay inside one slice
    first = {d.id for d in mesh.devices[0].flat}
    assert first == {d.id for d in devices[:4]}


def test_dcn_axes_tile_whole_slices():
    cfg = build_config({"num_slices": 4, "dcn_fsdp_parallelism": 2, "dcn_data_parallelism": 2,
                        "ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 2}).mesh
    mesh = create_mesh(cfg)
    assert mesh.shape["data"] == 2 and mesh.shape["fsdp"] == 2 and mesh.shape["tensor"] == 2
    for row in mesh.devices.reshape(2, 2, 2):  # (data, fsdp, tensor): tensor pairs are one slice
        for pair in row:
            ids = sorted(d.id for d in pair)
            assert ids[1] - ids[0] == 1 and ids[0] % 2 == 0
