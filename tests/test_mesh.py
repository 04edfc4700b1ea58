"""Mesh construction, -1 filling, clear product errors, logical specs, replication report."""

import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from conftest import REPO, refused_or_one_devices_losses, tiny_config
from tessera.config import ConfigError, build_config, load_config
from tessera.mesh import (
    LOGICAL_RULES, MESH_AXES, check_divides, create_mesh, logical_spec, named_shardings, sharding_report,
)
from tessera.models import build_model


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


def test_one_device_is_counted_in_the_singular():
    cfg = build_config({"ici_fsdp_parallelism": 3}).mesh
    with pytest.raises(ConfigError, match=r"= 3, but there is 1 device in a slice; make the product 1"):
        create_mesh(cfg, jax.devices()[:1])


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
    # the residual stream is split over tensor where it divides (sequence-parallel style)
    assert logical_spec(("batch", "length", "act_embed"), (8, 5, 4), sizes) == P(("data", "fsdp"), None, "tensor")
    # a dimension that does not divide keeps only the axes that do, and an axis is used once
    assert logical_spec(("embed", "mlp"), (7, 6), sizes) == P(None, "tensor")
    assert logical_spec(("heads", "mlp"), (4, 4), sizes) == P("tensor", None)
    with pytest.raises(KeyError, match="no entry in LOGICAL_RULES"):
        logical_spec(("nonsense",), (4,), sizes)


def test_every_rule_names_real_mesh_axes():
    for name, axes in LOGICAL_RULES.items():
        assert set(axes) <= set(MESH_AXES), name


def test_replication_report_flags_large_replicated_params():
    mesh = create_mesh(tiny_config().mesh)  # 8-way fsdp
    shapes = {"ok": jax.ShapeDtypeStruct((1024, 512), np.float32), "odd": jax.ShapeDtypeStruct((1023, 511), np.float32),
              "norm": jax.ShapeDtypeStruct((1023, 511), np.float32)}
    logical = {"ok": ("embed", "mlp"), "odd": ("embed", "mlp"), "norm": ("layers", "norm")}
    shardings = named_shardings(mesh, logical, shapes)
    rows, warnings = sharding_report(mesh, shardings, shapes, warn_mib=1.0, logical_axes=logical)
    assert len(rows) == 3
    # the norm is replicated by its rule (no warning); "odd" because 1023 does not divide by fsdp=8
    assert len(warnings) == 1 and "odd" in warnings[0] and "fully replicated" in warnings[0]
    assert "embed 1023 does not divide by fsdp=8" in warnings[0]
    # without the logical names the cause is unknown: every large replicated parameter is listed
    assert len(sharding_report(mesh, shardings, shapes, warn_mib=1.0)[1]) == 2


def test_gpt3_175b_on_v5e_256_has_no_replication_warnings():
    # configs/tpu/v5e/gpt3_175b.sh: 32-way fsdp x 8-way tensor. Its norm scales and biases, [96 layers,
    # 12288] (2.2 MiB in bfloat16), are replicated by the `norm` rule on purpose: not worth a warning.
    cfg = load_config([str(REPO / "configs" / "base.yml"), "model_name=gpt3-175b", "weight_dtype=bfloat16",
                       "ici_tensor_parallelism=8"], env={})
    model = build_model(cfg.model)
    sizes = {"data": 1, "stage": 1, "fsdp": 32, "sequence": 1, "tensor": 8, "expert": 1}
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    shardings = named_shardings(mesh, model.logical_axes(), model.param_shapes())
    rows, warnings = sharding_report(mesh, shardings, model.param_shapes(), cfg.mesh.param_replication_warn_mib,
                                     logical_axes=model.logical_axes())
    assert any("pre_mlp_norm/scale" in r and "(96, 12288)" in r for r in rows) and warnings == []


def test_tensor_axis_must_divide_query_heads_and_mlp_but_not_kv_heads():
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "sequence": 1, "tensor": 4, "expert": 1}
    check_divides(("embed", "kv_heads", "head_dim"), (24, 2, 6), sizes)  # GQA: 2 kv heads on 4 ways is fine
    with pytest.raises(ConfigError, match=r"tensor axis .* is 4, which does not divide the 6 attention query heads"):
        check_divides(("embed", "heads", "head_dim"), (24, 6, 6), sizes)
    with pytest.raises(ConfigError, match=r"does not divide the 42 MLP width \(mlp_dim\).*ici_tensor_parallelism=3"):
        check_divides(("layers", "embed", "mlp"), (3, 24, 42), sizes)
    # an expert's width has a key of its own: naming mlp_dim sent base_moe_mlp_dim=33's user to the wrong key
    with pytest.raises(ConfigError, match=r"does not divide the 33 expert MLP width \(base_moe_mlp_dim, or base_mlp_dim"):
        check_divides(("layers", "exp", "embed", "mlp"), (3, 4, 24, 33), {**sizes, "tensor": 2})


def test_train_py_refuses_more_tensor_ways_than_heads(tmp_path):
    # 4 query heads on an 8-way tensor axis: refused before compiling, exit code 2, no traceback
    cmd = [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"), "run_name=tp",
           f"base_output_directory={tmp_path}", "ici_tensor_parallelism=8", "ici_fsdp_parallelism=1",
           "base_num_query_heads=4", "base_num_kv_heads=4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("config error: the mesh's tensor axis (ici_tensor_parallelism * dcn_tensor_parallelism) is 8, which does "
            "not divide the 4 attention query heads (num_query_heads)") in proc.stderr
    assert "e.g. ici_tensor_parallelism=4" in proc.stderr and "compiled" not in proc.stderr


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


def test_a_sequence_split_compiles_without_copying_activations_to_every_device(capfd):
    """fsdp 4 x sequence 2: the looked-up token rows reach their batch x length split without XLA's
    "involuntary full rematerialization" (each device given every row of the global batch, then
    sliced). Before the token table was gathered over sequence for the lookup, the step had 3 such
    warnings, 6 with a multi-token-prediction depth (which looks tokens up again)."""
    from tessera.step import compile_step, setup

    for keys in ({}, {"mtp_num_layers": 1}):
        cfg = tiny_config(ici_fsdp_parallelism=4, ici_sequence_parallelism=2, **keys)
        compile_step(setup(cfg, jax.devices()), 0)
    err = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in err, err[-2000:]


def test_the_cpu_miscompile_refusal_names_the_axes_not_only_their_ici_keys(monkeypatch):
    """data 2 from the slices (dcn_data_parallelism=-1), fsdp and tensor 2 inside them: the refusal said "use at
    most two of ici_data_parallelism, ici_fsdp_parallelism and ici_tensor_parallelism above 1", and
    ici_data_parallelism was 1 already."""
    from tessera import cpu_miscompile

    monkeypatch.setattr(cpu_miscompile, "einsum_is_right", lambda mesh: False)  # as jax 0.12.0.1 computes it
    mesh = create_mesh(build_config({"num_slices": 2, "ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2}).mesh)
    with pytest.raises(ConfigError, match=r"data 2, fsdp 2, tensor 2: .* at most two of the data, fsdp and tensor "
                                          r"axes above 1 on CPU \(an axis is ici_<axis>_parallelism x "
                                          r"dcn_<axis>_parallelism"):
        cpu_miscompile.check_cpu_mesh(mesh)


def test_a_data_expert_tensor_mesh_is_refused_on_cpu_or_trains_one_devices_losses(tmp_path):
    """data 2 x expert 2 x tensor 2 (a dense model: the expert axis splits the batch and the weights as fsdp does)
    trained 5.1314 at the first step where one device trains 5.1034 (half a sequence per device), the wrong loss
    of data 2 x fsdp 2 x tensor 2, and only that mesh was refused (tessera.cpu_miscompile). Never silently
    wrong: either the mesh is refused, naming its axes, or its losses are one device's."""
    refused_or_one_devices_losses(
        tmp_path, dict(ici_data_parallelism=2, ici_fsdp_parallelism=1, ici_expert_parallelism=2,
                       ici_tensor_parallelism=2),
        r"on CPU, this jax \(.*\) computes wrong results on a mesh with data 2, tensor 2, expert 2: .* at most two of "
        r"the data, tensor and expert axes", steps=2)


def test_the_cpu_miscompile_check_runs_on_every_mesh_its_projection_splits_three_ways():
    """The check compiles the output projection with the shardings LOGICAL_RULES give it on the run's mesh, and only
    where they use three mesh axes or more (one, two: nothing to check)."""
    from tessera.cpu_miscompile import axes_used

    def used(**keys):
        return axes_used(dict(create_mesh(tiny_config(**keys).mesh).shape))

    assert used(ici_fsdp_parallelism=8) == ["fsdp"]
    assert used(ici_fsdp_parallelism=4, ici_tensor_parallelism=2) == ["fsdp", "tensor"]
    assert used(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2) == ["data", "fsdp", "tensor"]
    assert used(ici_data_parallelism=2, ici_fsdp_parallelism=1, ici_expert_parallelism=2,
                ici_tensor_parallelism=2) == ["data", "tensor", "expert"]
    assert used(ici_fsdp_parallelism=2, ici_sequence_parallelism=2, ici_tensor_parallelism=2) == \
        ["fsdp", "sequence", "tensor"]


def test_dcn_keys_on_undeclared_slices_and_an_uneven_slice_count_say_what_to_do():
    """dcn_fsdp_parallelism=2 on CPU (num_slices=-1 finds one slice there) said only "change them so their product
    divides 1", and num_slices=3 over 8 devices "8 devices cannot be split evenly into num_slices=3"; both now name
    num_slices and the values it may take."""
    with pytest.raises(ConfigError, match=r"which does not divide the 1 slice; change them so their product divides 1; "
                                          r"or declare the slices: num_slices=-1 found 1 among the CPU devices \(from "
                                          r"their slice_index: CPU devices report none, GPU ones one per host\), and "
                                          r"num_slices=N makes N slices"):
        create_mesh(build_config({"dcn_fsdp_parallelism": 2}).mesh)
    with pytest.raises(ConfigError, match=r"= 2, but there is 1 slice; make the product 1 or set one of them to -1; or "
                                          r"declare the slices: num_slices=-1 found 1"):
        create_mesh(build_config({"dcn_data_parallelism": 2}).mesh)
    with pytest.raises(ConfigError, match=r"^dcn_data_parallelism=4 .* = 4, but there are 2 slices; make the product 2 "
                                          r"or set one of them to -1$"):  # declared: nothing to add
        create_mesh(build_config({"num_slices": 2, "dcn_data_parallelism": 4}).mesh)
    with pytest.raises(ConfigError, match=r"^8 devices cannot be split evenly into num_slices=3; set num_slices to a "
                                          r"divisor of 8, or -1 \(found from the devices\)$"):
        create_mesh(build_config({"num_slices": 3}).mesh)


def test_a_tensor_axis_split_across_slices_is_not_told_to_set_its_ici_part_to_what_it_is():
    """ici_tensor_parallelism=4 x dcn_tensor_parallelism=2 over 4 query heads: the error said "Make it a divisor of 4,
    e.g. ici_tensor_parallelism=4", which it was already; the example now gives the whole product."""
    cfg = build_config({"num_slices": 2, "dcn_data_parallelism": 1, "dcn_tensor_parallelism": 2,
                        "ici_fsdp_parallelism": 1, "ici_tensor_parallelism": 4, "base_num_query_heads": 4,
                        "base_num_kv_heads": 4})
    model = build_model(cfg.model)
    with pytest.raises(ConfigError, match=r"tensor axis \(ici_tensor_parallelism \* dcn_tensor_parallelism\) is 8, which "
                                          r"does not divide the 4 attention query heads .* Make it a divisor of 4, e\.g\. "
                                          r"ici_tensor_parallelism=4 with dcn_tensor_parallelism=1, or change the model"):
        named_shardings(create_mesh(cfg.mesh), model.logical_axes(), model.param_shapes())
