"""Pipeline parallelism over the `stage` mesh axis: same losses as no pipelining on the same
weights (GPipe and circular, with fsdp, tensor and expert splits inside a stage, scanned or
unrolled stages, remat, gradient accumulation, Gemma 2 and 3 and MoE blocks), DeepSeek's routing biases
moved as without a pipeline, checkpoints that move
between pipeline layouts, and the configurations that are refused before anything compiles."""

import json
import logging
import re

import jax
import numpy as np
import pytest
from conftest import tiny_config
from jax.extend.core import jaxprs_in_params

from tessera.config import ConfigError
from tessera.config.derived import PipelineLayout, plan_run
from tessera.config.layers import LAYERS_PER_BLOCK
from tessera.models import BLOCKS
from tessera.hlo_text import COLLECTIVE_OP, collectives_in_loops
from tessera.step import abstract_state, batch_shapes, compile_step, make_train_step, setup
from tessera.train import run

# 8 decoder layers, 8 sequences a step (per_device_batch_size=1 on 8 devices)
LAYERS = dict(base_num_decoder_layers=8, scan_layers=True, steps=3, enable_checkpointing=False)
_REFERENCE: dict = {}
_SAVED: dict = {}  # the folder of each saving layout's run, by its keys


def _records(tmp_path, name, **overrides):
    cfg = tiny_config(tmp_path / name, **{**LAYERS, **overrides})
    run(cfg, jax.devices())
    return [json.loads(line) for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]


def _reference(tmp_path, **model):
    """Losses of the same model without pipelining (fsdp over the 8 devices), computed once."""
    key = json.dumps(model, sort_keys=True)
    if key not in _REFERENCE:
        _REFERENCE[key] = _records(tmp_path, "reference", **model)
    return _REFERENCE[key]


def _assert_same(records, reference, keys=("loss", "grad_norm"), rtol=1e-5):
    for key in keys:
        got, want = [r[key] for r in records], [r[key] for r in reference]
        np.testing.assert_allclose(got, want, rtol=rtol, err_msg=key)


@pytest.mark.parametrize("mesh", [
    dict(ici_pipeline_parallelism=2),  # GPipe, 4 layers a stage, fsdp 4
    dict(ici_pipeline_parallelism=2, num_pipeline_repeats=2),  # circular: 2 groups of 2 layers a stage
    dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2),  # GPipe over 4 stages, fsdp 2 inside
    dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_layers_per_pipeline_stage=1),  # circular, 2 repeats
    dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2, scan_layers=False),
    dict(ici_pipeline_parallelism=2, remat_policy="full", gradient_accumulation_steps=2, per_device_batch_size=2,
         num_pipeline_microbatches=2),
    # outputs handed on one iteration late: GPipe; circular with M = 2 S (an output returns just in time)
    dict(ici_pipeline_parallelism=2, pipeline_delay_activation_forwarding=True),
    dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_layers_per_pipeline_stage=1, per_device_batch_size=2,
         pipeline_delay_activation_forwarding=True),
    # a stage's weights gathered over fsdp once per step: circular [R, L/R]; GPipe keeping the tensor split
    dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_layers_per_pipeline_stage=1, pipeline_fsdp_ag_once=True),
    dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2, pipeline_fsdp_ag_once=True),
    # remat around unrolled blocks that take their weights from the stage's by the repeat
    dict(ici_pipeline_parallelism=2, num_pipeline_repeats=2, scan_layers=False, remat_policy="full",
         pipeline_fsdp_ag_once=True),
])
@pytest.mark.slow
def test_pipelined_training_gives_the_losses_of_no_pipelining(mesh, tmp_path):
    """3 steps from the same weights and batches: float32 losses and gradient norms equal the
    unpipelined run's to 1e-5 (only the order of float32 sums differs)."""
    model = {k: mesh[k] for k in ("remat_policy", "gradient_accumulation_steps", "per_device_batch_size") if k in mesh}
    reference = _reference(tmp_path / "ref", **model)
    _assert_same(_records(tmp_path, "pipelined", **mesh), reference)


@pytest.mark.slow
def test_gemma2_pairs_pipeline_whole(tmp_path):
    """Gemma 2's block is a local/global pair: stages hold whole pairs (2 pairs each here)."""
    model = dict(decoder_block="gemma2", sliding_window_size=4, attn_logits_soft_cap=50.0,
                 final_logits_soft_cap=30.0)
    _assert_same(_records(tmp_path, "gemma2", ici_pipeline_parallelism=2, **model),
                 _reference(tmp_path / "ref", **model))
    with pytest.raises(ConfigError, match=r"whole blocks of 2 layers \(gemma2\)"):
        setup(tiny_config(**LAYERS, **model, ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=1))


@pytest.mark.slow
def test_gemma3_pipelines_its_patterns_and_runs_the_tail_after(tmp_path):
    """Gemma 3's block is a 6-layer pattern; 13 layers are 2 patterns, one per stage, and a tail of a
    local layer that runs after the pipeline (as deepseek's dense layers run before it). Such a
    count was refused: only multiples of 6 x stages pipelined (gemma3-4b's 34 and 27b's 62 did not).
    (One tail layer, not gemma3-4b's 4: each layer of the tail is unrolled in both programs.)"""
    model = dict(decoder_block="gemma3", sliding_window_size=4, base_num_decoder_layers=13)
    _assert_same(_records(tmp_path, "gemma3", ici_pipeline_parallelism=2, **model),
                 _reference(tmp_path / "ref", **model))


@pytest.mark.slow
def test_mixture_of_experts_pipelines_with_expert_parallelism(tmp_path):
    """Mixtral blocks, dropless, expert 2 x fsdp 2 inside each of 2 stages: the unpipelined
    losses, gradient norms and router statistics. The load-balancing loss (experts' token
    fraction times their mean probability) is formed from statistics gathered over the
    microbatches, so it is the whole batch's too (taken per microbatch it was 5% above it)."""
    model = dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2, sparse_matmul=True)
    records = _records(tmp_path, "moe", ici_pipeline_parallelism=2, ici_expert_parallelism=2,
                       ici_fsdp_parallelism=2, **model)
    reference = _reference(tmp_path / "ref", **model)
    _assert_same(records, reference, keys=("loss", "grad_norm", "moe_load_balance_loss", "moe_dropped_fraction"))
    assert all(r["moe_dropped_fraction"] == 0.0 for r in records)


# DeepSeek blocks: 1 dense layer below the pipeline, 4 expert layers over the stages; routing
# biases moved after every step (loss-free balancing), with a load-balancing loss as well.
DEEPSEEK = dict(decoder_block="deepseek", base_num_decoder_layers=5, first_num_dense_layers=1, head_dim=24,
                q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=10,
                base_moe_mlp_dim=24, num_experts=8, num_experts_per_tok=3, n_routing_groups=4, topk_routing_group=2,
                shared_experts=1, routed_score_func="sigmoid", routed_scaling_factor=2.5, routed_bias=True,
                routed_bias_update_rate=0.02, load_balance_loss_weight=0.01)


def _deepseek_step(**overrides):
    """Routing biases before and after one train step of DeepSeek blocks on 8 sequences of 12
    tokens (8 devices), and the step's stats."""
    from tessera.step import create_state, make_train_step

    trainer = setup(tiny_config(**{**LAYERS, **DEEPSEEK, **overrides}), jax.devices())
    state = create_state(trainer, 0)
    shape = (trainer.plan.global_batch, trainer.plan.max_target_length + 1)
    batch = {"tokens": jax.random.randint(jax.random.key(1), shape, 0, 96), "segment_ids": np.ones(shape, np.int32),
             "positions": np.tile(np.arange(shape[1]), (shape[0], 1))}
    with jax.set_mesh(trainer.mesh):
        new_state, stats = jax.jit(make_train_step(trainer, 0))(state, jax.device_put(batch, trainer.batch_sharding))
    bias = lambda s: np.asarray(s["params"]["layers"]["mlp"]["routed_bias_e"]).reshape(4, 8)  # noqa: E731
    return bias(state), bias(new_state), jax.device_get(stats)


_UNPIPELINED = {}  # the unpipelined DeepSeek step, computed once for both meshes below


@pytest.mark.parametrize("mesh", [
    dict(ici_pipeline_parallelism=2, ici_expert_parallelism=2, ici_fsdp_parallelism=2),  # GPipe, 2 layers a stage
    dict(ici_pipeline_parallelism=2, num_pipeline_repeats=2, scan_layers=False),  # circular [R, L/R], unrolled
])
@pytest.mark.slow
def test_routing_biases_move_as_without_pipelining(mesh):
    """One step of DeepSeek blocks from the same weights and batch: the expert loads each stage
    gathers, put back in layer order, move every layer's routing bias exactly as the unpipelined
    step does, and loss, gradient norm and the busiest-expert statistic agree (float32, 1e-5)."""
    if not _UNPIPELINED:
        _UNPIPELINED["step"] = _deepseek_step()  # no pipeline: fsdp over the 8 devices
    start, want, want_stats = _UNPIPELINED["step"]
    got_start, got, stats = _deepseek_step(**mesh)
    np.testing.assert_array_equal(got_start, start)
    assert (want != start).any()
    np.testing.assert_allclose(got, want, atol=1e-7)  # each entry moved by exactly +-0.02
    for key in ("loss", "grad_norm", "moe_max_expert_load", "moe_load_balance_loss"):
        np.testing.assert_allclose(stats[key], want_stats[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("saved, restored", [
    (dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2), {}),
    ({}, dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2)),
    (dict(ici_pipeline_parallelism=2, num_pipeline_repeats=2), {}),  # [R, L/R] saved, [L] restored
    ({}, dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_pipeline_repeats=2)),
    (dict(ici_pipeline_parallelism=2, num_pipeline_repeats=2), dict(ici_pipeline_parallelism=2, num_pipeline_repeats=4)),
])
@pytest.mark.slow
def test_checkpoints_move_between_pipeline_layouts(saved, restored, tmp_path, tmp_path_factory):
    """Save at step 2 with one layout, restore the full state with another: step 3's loss is
    the one the saving run reaches when it goes on."""
    common = dict(base_num_decoder_layers=8, scan_layers=True, checkpoint_period=2)
    key = json.dumps(saved, sort_keys=True)
    if key not in _SAVED:  # each saving layout runs once: 3 steps, checkpoints at 2 and 3
        src = tmp_path_factory.mktemp("saved")
        run(tiny_config(src, steps=3, **common, **saved))
        _SAVED[key] = src
    src = _SAVED[key]
    expected = [json.loads(x) for x in (src / "test" / "metrics.jsonl").read_text().splitlines()][-1]
    assert expected["step"] == 3
    path = str(src / "test" / "checkpoints" / "2")
    report = run(tiny_config(tmp_path / "dst", steps=3, load_full_state_path=path, **common, **restored))
    assert report["start_step"] == 2
    got = json.loads((tmp_path / "dst" / "test" / "metrics.jsonl").read_text().splitlines()[-1])
    assert got["step"] == 3
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)


def test_a_circular_checkpoint_is_restacked_for_another_repeat_count():
    """[R, L/R] saved, [R', L/R'] wanted (num_pipeline_repeats or the stage count changed): read as
    saved and reshaped, the blocks in the same order. It was refused as a model mismatch. Plain
    [L, ...] arrays whose leading axes merely multiply out alike are left alone."""
    from jax.sharding import NamedSharding, PartitionSpec

    from tessera.checkpointing.trees import restacked

    mesh = jax.make_mesh((2, 4), ("stage", "fsdp"))
    f32 = np.float32
    saved = {"layers": {"w": jax.ShapeDtypeStruct((2, 4, 3, 5), f32), "b": jax.ShapeDtypeStruct((2, 4, 3), f32)}}
    want = {"layers": {k: jax.ShapeDtypeStruct((4, 2, *a.shape[2:]), f32,
                                               sharding=NamedSharding(mesh, PartitionSpec(None, "stage")))
                       for k, a in saved["layers"].items()}}
    target, finish = restacked(saved, want)
    assert {k: a.shape for k, a in target["layers"].items()} == {"w": (2, 4, 3, 5), "b": (2, 4, 3)}
    values = {k: np.arange(np.prod(a.shape), dtype=f32).reshape(a.shape) for k, a in saved["layers"].items()}
    got = finish({"layers": values})["layers"]
    for k, v in values.items():  # flattened, both layouts give the blocks in the model's order
        np.testing.assert_array_equal(np.asarray(got[k]).reshape(8, *v.shape[2:]), v.reshape(8, *v.shape[2:]))
        assert got[k].shape == want["layers"][k].shape
    plain = {"layers": {"w": jax.ShapeDtypeStruct((8, 3, 5), f32), "v": jax.ShapeDtypeStruct((8, 5, 3), f32)}}
    other = {"layers": {"w": jax.ShapeDtypeStruct((4, 6, 5), f32, sharding=NamedSharding(mesh, PartitionSpec())),
                        "v": jax.ShapeDtypeStruct((4, 10, 3), f32, sharding=NamedSharding(mesh, PartitionSpec()))}}
    assert {k: a.shape for k, a in restacked(plain, other)[0]["layers"].items()} == {"w": (4, 6, 5), "v": (4, 10, 3)}


@pytest.mark.parametrize("pipelined_side", ["saved", "restored"])
def test_a_layout_change_to_or_from_a_pipeline_is_logged_as_it_is(pipelined_side, caplog):
    """A pipeline stacks the blocks whatever scan_layers says: a pipelined run saved with
    scan_layers=false and resumed without a pipeline was logged 'saved with scan_layers=true'.
    The saved side is read from Orbax's metadata (its shardings), the restored one from the config's."""
    from orbax.checkpoint._src.metadata.sharding import NamedShardingMetadata
    from orbax.checkpoint._src.metadata.value import ArrayMetadata

    from tessera.checkpointing.trees import restacked

    def params(**keys):
        return abstract_state(setup(tiny_config(base_num_decoder_layers=4, scan_layers=False, **keys)))["params"]

    pipelined, looped = params(ici_pipeline_parallelism=2), params()
    saved, wanted = (pipelined, looped) if pipelined_side == "saved" else (looped, pipelined)
    as_saved = jax.tree.map(lambda s: ArrayMetadata(name="", directory=None, shape=s.shape, dtype=s.dtype,
                                                    sharding=NamedShardingMetadata.from_jax_sharding(s.sharding)),
                            saved)
    with caplog.at_level(logging.INFO, logger="tessera"):
        target, _ = restacked({"params": as_saved}, {"params": wanted})
    assert jax.tree.map(lambda s: s.shape, target) == {"params": jax.tree.map(lambda s: s.shape, saved)}
    layouts = ("pipelined (the blocks stacked over the stages, whatever scan_layers)", "with scan_layers=false")
    then, now = layouts if pipelined_side == "saved" else layouts[::-1]
    assert f"checkpoint: saved {then}, restored {now}: the blocks' arrays are " in caplog.text
    assert "scan_layers=true" not in caplog.text


@pytest.mark.slow
def test_fsdp_weights_are_gathered_once_per_step_with_pipeline_fsdp_ag_once():
    """2 stages x fsdp 4: without the key every fsdp-split weight is gathered inside the
    pipeline's loops (each iteration, forward and backward); with it, before them, and the
    stage's gathered weights and gradients take more temporary memory. The gathered copies keep
    any tensor split (checked by the losses test above)."""
    compiled = {}
    for once in (False, True):
        trainer = setup(tiny_config(**LAYERS, ici_pipeline_parallelism=2, pipeline_fsdp_ag_once=once))
        compiled[once], _ = compile_step(trainer, 0)
    plain, once = (collectives_in_loops(compiled[k].as_text()) for k in (False, True))
    assert plain.get("all-gather", 0) >= 14 and "all-gather" not in once  # 7 weights a block, forward and backward
    assert "all-gather" in {op for op in COLLECTIVE_OP.findall(compiled[True].as_text())}  # gathered, outside
    assert compiled[True].memory_analysis().temp_size_in_bytes > compiled[False].memory_analysis().temp_size_in_bytes
    assert "weights gathered over fsdp once per step" in trainer.plan.pipeline.describe()
    with pytest.raises(ConfigError, match=r"pipeline_fsdp_ag_once=true .* this mesh has no pipeline stages"):
        setup(tiny_config(**LAYERS, pipeline_fsdp_ag_once=True))


def _weights_kept_per_iteration(trainer, compiled) -> set[str]:
    """Arrays of the compiled step shaped [iterations, blocks per stage, *a block weight's shape]
    (whole, or this device's share): a copy of a group's weights for every pipeline iteration."""
    layout, shapes = trainer.plan.pipeline, set()
    for shape, sharding in zip(jax.tree.leaves(trainer.model.param_shapes()["layers"]),
                               jax.tree.leaves(trainer.state_shardings["params"]["layers"])):
        for dims in (shape.shape, sharding.shard_shape(shape.shape)):
            if len(dims) > 3:  # [R, L/R, ...] matrices (norm scales are too small to matter)
                shapes.add(",".join(map(str, (layout.iterations, layout.blocks_per_stage, *dims[2:]))))
    return {m for m in re.findall(r"\[([\d,]+)\]", compiled.as_text()) if m in shapes}


@pytest.mark.slow
def test_a_pipeline_with_remat_keeps_no_copy_of_the_weights_per_iteration():
    """With a remat policy, a block takes its weights from the stage's (by the iteration's repeat)
    inside its remat region, so the pipeline's loop keeps no copy of them per iteration; before,
    it stacked one per iteration ([iterations, B, ...]), whole groups with pipeline_fsdp_ag_once.
    Without remat the blocks keep their weights for the backward pass, one copy per iteration
    (the check finds those)."""
    mesh = dict(**LAYERS, ici_pipeline_parallelism=2, num_pipeline_repeats=2)
    found = {}
    for policy, once in (("none", False), ("full", False), ("full", True), ("save_dot_except_mlp", True)):
        trainer = setup(tiny_config(**mesh, remat_policy=policy, pipeline_fsdp_ag_once=once))
        found[policy, once] = _weights_kept_per_iteration(trainer, compile_step(trainer, 0)[0])
    assert found["none", False]
    assert not found["full", False] and not found["full", True] and not found["save_dot_except_mlp", True], found


def _stage_shapes(trainer) -> set[tuple[int, ...]]:
    """[R, B, *a block weight's shape]: the shapes of a stage's share of the blocks' weights."""
    layout = trainer.plan.pipeline
    return {(layout.repeats, layout.blocks_per_stage, *s.shape[2:])
            for s in jax.tree.leaves(trainer.model.param_shapes()["layers"])}


def _train_step_equations(trainer):
    """(equation, how many scans enclose it) for every equation of the train step's jaxpr, nested
    ones included."""
    def walk(jaxpr, scans_around):
        for eqn in jaxpr.eqns:
            yield eqn, scans_around
            for sub in jaxprs_in_params(eqn.params):
                yield from walk(sub, scans_around + (eqn.primitive.name == "scan"))

    with jax.set_mesh(trainer.mesh):
        return list(walk(jax.make_jaxpr(make_train_step(trainer, 0))(abstract_state(trainer),
                                                                      batch_shapes(trainer)).jaxpr, 0))


@pytest.mark.parametrize("once, policy", [(False, "full"), (True, "full"), (True, "none")])
def test_a_stage_s_weight_gradients_are_summed_by_the_pipeline_loop_alone(once, policy):
    """A block's weights come from the stage's [R, B, ...] where it runs, but its gradient goes to
    the group's rows (`pipeline.group_weights`): no scan nested in the pipeline's loop
    returns a value of the stage's size in its iterations (a sum of the stage's gradient; before,
    the group's scan formed one besides the loop's: 826 -> 621 MiB of temporaries on v5e-4 for a
    1024-wide model with pipeline_fsdp_ag_once)."""
    trainer = setup(tiny_config(**LAYERS, ici_pipeline_parallelism=2, num_pipeline_repeats=2, remat_policy=policy,
                                pipeline_fsdp_ag_once=once))
    stage = _stage_shapes(trainer)
    found = {a.shape for eqn, scans in _train_step_equations(trainer) if eqn.primitive.name == "scan" and scans
             for a in eqn.params["jaxpr"].out_avals if a.shape in stage}
    assert found == set()


@pytest.mark.parametrize("policy", ["full", "save_dot_except_mlp", "none"])
def test_no_gradient_goes_through_a_stage_gathered_once(policy):
    """pipeline_fsdp_ag_once: the stage's weights are constrained to their gathered split once per
    leaf, for the forward pass. Their gradient goes to the fsdp shares (the group's sinks), so no
    cotangent takes the gathered split (before: twice per leaf) and no device holds a gradient of
    a whole stage (llama3.1-8b on 2 x v5p-128: 54.88 -> 29.01 GiB per chip; with remat_policy=none
    a 1024-wide model on v5e-4 1565 -> 1102 MiB of temporaries)."""
    trainer = setup(tiny_config(**LAYERS, ici_pipeline_parallelism=2, num_pipeline_repeats=2, remat_policy=policy,
                                pipeline_fsdp_ag_once=True))
    stage = _stage_shapes(trainer)
    gathered = [eqn for eqn, _ in _train_step_equations(trainer)
                if eqn.primitive.name == "sharding_constraint" and eqn.invars[0].aval.shape in stage]
    assert len(gathered) == len(jax.tree.leaves(trainer.model.param_shapes()["layers"]))
    assert all("fsdp" not in str(eqn.params["sharding"].spec) for eqn in gathered)


def test_layout_and_bubble_are_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tessera"):
        trainer = setup(tiny_config(**LAYERS, ici_pipeline_parallelism=4, ici_fsdp_parallelism=2,
                                    num_pipeline_repeats=2, num_pipeline_microbatches=4))
    assert trainer.plan.pipeline == PipelineLayout(stages=4, repeats=2, blocks_per_stage=1, microbatches=4,
                                                   microbatch_rows=2)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("pipeline:"))
    assert "4 stages (circular, 2 repeats), 1 layer(s) per stage group, 4 microbatches of 2 sequences" in line
    assert "bubble (S-1)/(M*R+S-1) = 3/11 = 27.3%" in line
    delayed = setup(tiny_config(**LAYERS, ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, per_device_batch_size=2,
                                num_pipeline_repeats=2, pipeline_delay_activation_forwarding=True)).plan.pipeline
    assert (delayed.microbatches, delayed.hop, delayed.iterations) == (8, 2, 22)
    assert "(circular, 2 repeats, outputs handed on one iteration late)" in delayed.describe()
    assert "bubble 2(S-1)/(M*R+2(S-1)) = 6/22 = 27.3%" in delayed.describe()
    # stacked [R, L/R, ...]: the second axis is split over the stages
    specs = jax.tree.leaves(jax.tree.map(lambda s: tuple(s.spec)[:2], trainer.state_shardings["params"]["layers"]),
                            is_leaf=lambda x: isinstance(x, tuple))
    assert set(specs) == {(None, "stage")}


@pytest.mark.parametrize("overrides, message", [
    (dict(base_num_decoder_layers=6, ici_pipeline_parallelism=4, ici_fsdp_parallelism=2),
     r"base_num_decoder_layers=6 cannot be split evenly over 4 pipeline stages: every stage holds the same number of "
     r"whole layers, and 6 is not a multiple of 4; num_pipeline_repeats and num_layers_per_pipeline_stage cannot "
     r"change that. Use a stage count \(ici_pipeline_parallelism x dcn_pipeline_parallelism\) that divides 6 "
     r"\(2, 3, 6\), or a layer count that is a multiple of 4$"),
    (dict(base_num_decoder_layers=2, ici_pipeline_parallelism=4, ici_fsdp_parallelism=2),  # more stages than layers
     r"base_num_decoder_layers=2 cannot be split evenly over 4 pipeline stages.* that divides 2 \(2\)"),
    # the key is named (num_decoder_layers is none), and the scale that multiplies it
    (dict(base_num_decoder_layers=3, global_parameter_scale=8, ici_pipeline_parallelism=4, ici_fsdp_parallelism=2),
     r"^6 decoder layers \(base_num_decoder_layers=3 scaled by global_parameter_scale=8\) cannot be split evenly "
     r"over 4 pipeline stages"),
    (dict(DEEPSEEK, base_num_decoder_layers=4, ici_pipeline_parallelism=2),
     r"the 3 expert layers \(base_num_decoder_layers=4 less first_num_dense_layers=1, which run before the pipeline\) "
     r"cannot be split evenly over 2 pipeline stages.* that divides 3 \(3\)"),
    # gemma3's layers after its last whole pattern run after the pipeline: 8 layers leave one pattern for 2 stages
    (dict(decoder_block="gemma3", sliding_window_size=4, base_num_decoder_layers=8, ici_pipeline_parallelism=2),
     r"^the 6 layers of whole patterns \(base_num_decoder_layers=8 less the 2 local layers after the last whole "
     r"pattern, which run after the pipeline\) cannot be split evenly over 2 pipeline stages: every stage holds the "
     r"same number of whole blocks of 6 layers \(gemma3\), and 1 is not a multiple of 2"),
    (dict(ici_pipeline_parallelism=2, num_pipeline_repeats=3),
     r"^base_num_decoder_layers=8 must equal pipeline stages 2 x num_pipeline_repeats 3"),
    (dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_pipeline_microbatches=2),
     r"num_pipeline_microbatches=2 is fewer than the 4 pipeline stages"),
    (dict(ici_pipeline_parallelism=2, num_pipeline_microbatches=4),
     r"cannot be cut into num_pipeline_microbatches=4 microbatches that each split over data\*fsdp\*expert=4"),
    (dict(ici_pipeline_parallelism=2, per_device_batch_size=0.5),
     r"cannot be cut into 2 pipeline microbatches .* raise per_device_batch_size"),
    (dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_layers_per_pipeline_stage=1,
          pipeline_delay_activation_forwarding=True, num_pipeline_microbatches=4),
     r"num_pipeline_microbatches=4 is fewer than 2 x 4 stages, which a circular pipeline with "
     r"pipeline_delay_activation_forwarding needs"),
    (dict(ici_pipeline_parallelism=4, ici_fsdp_parallelism=2, num_layers_per_pipeline_stage=1,
          pipeline_delay_activation_forwarding=True),
     r"cannot be cut into 8 pipeline microbatches \(two per stage at least\) .* a multiple of 16"),
    (dict(ici_pipeline_parallelism=2, ici_fsdp_parallelism=4, eval_interval=1, eval_steps=1,
          eval_per_device_batch_size=0.5),
     r"the evaluation batch of 4 sequences runs through the pipeline in its 2 microbatches, each split over "
     r"data\*fsdp\*expert=4 devices; set eval_per_device_batch_size so that the batch is a multiple of 8"),
])
def test_impossible_pipelines_are_refused_before_compiling(overrides, message):
    cfg = tiny_config(**{**LAYERS, **overrides})
    with pytest.raises(ConfigError, match=message):
        plan_run(cfg, {"data": 1, "stage": cfg.mesh.ici_pipeline_parallelism,
                       "fsdp": 8 // cfg.mesh.ici_pipeline_parallelism // max(1, cfg.mesh.ici_tensor_parallelism),
                       "sequence": 1, "tensor": cfg.mesh.ici_tensor_parallelism, "expert": 1})


def test_a_stage_group_cutting_a_layer_pair_is_named_as_such():
    """Gemma 2's 6 layers (3 local/global pairs) in 2 stages: the layer counts multiply out, so the
    error said "6 must equal 2 x 1 x 3 = 6"; it names the pairs that cannot be split evenly and what fits instead."""
    gemma2 = dict(decoder_block="gemma2", sliding_window_size=4)
    mesh = {"data": 1, "stage": 2, "fsdp": 4, "sequence": 1, "tensor": 1, "expert": 1}
    with pytest.raises(ConfigError, match=r"^base_num_decoder_layers=6 cannot be split evenly over 2 pipeline stages: "
                                          r"every stage holds the same number of whole blocks of 2 layers \(gemma2\), "
                                          r"and 3 is not a multiple of 2; .* that divides 3 \(3\), or a layer count "
                                          r"that is a multiple of 4$"):
        plan_run(tiny_config(**{**LAYERS, **gemma2, "base_num_decoder_layers": 6, "ici_pipeline_parallelism": 2}), mesh)
    with pytest.raises(ConfigError, match=r"groups of 1 layers.*; set num_pipeline_repeats=1 "
                                          r"num_layers_per_pipeline_stage=4 or num_pipeline_repeats=2 "
                                          r"num_layers_per_pipeline_stage=2$"):
        plan_run(tiny_config(**{**LAYERS, **gemma2, "ici_pipeline_parallelism": 2,
                                "num_layers_per_pipeline_stage": 1}), mesh)


def test_pipeline_keys_must_be_positive_or_derived():
    with pytest.raises(ConfigError, match=r"num_pipeline_repeats=0 must be a positive integer or -1"):
        tiny_config(num_pipeline_repeats=0)
    with pytest.raises(ConfigError, match=r"ici_pipeline_parallelism cannot be -1"):
        tiny_config(ici_pipeline_parallelism=-1, ici_fsdp_parallelism=4)


def test_layers_per_block_table_matches_the_blocks():
    assert {name: cls.layers_per_block for name, cls in BLOCKS.items() if cls.layers_per_block != 1} \
        == LAYERS_PER_BLOCK


def test_the_compiled_step_passes_activations_between_stages():
    """The program really pipelines: collective permutes between stages, and each stage holds a
    quarter of the blocks' parameters."""
    from tessera.step import compile_step

    trainer = setup(tiny_config(**LAYERS, ici_pipeline_parallelism=4, ici_fsdp_parallelism=2))
    compiled, _ = compile_step(trainer, 0)
    assert len(re.findall(r"collective-permute(?:-start)?\(", compiled.as_text())) >= 2
    wi = trainer.state_shardings["params"]["layers"]["mlp"]["wi_0"]
    assert wi.shard_shape(trainer.model.param_shapes()["layers"]["mlp"]["wi_0"].shape)[0] == 2


def test_estimator_splits_layers_over_stages_and_counts_the_bubble():
    """The estimator's memory puts a stage's share of the layers on each chip, and the MFU it
    quotes is the given one times the share of iterations outside the bubble."""
    from tessera.tools.estimate import load_model_config, parse_hardware, report
    from tessera.tools.memory_model import count_params, estimate_memory

    keys = ["per_device_batch_size=4", "max_target_length=2048", "dtype=bfloat16", "remat_policy=full"]
    piped = load_model_config("llama2-70b", [*keys, "dcn_pipeline_parallelism=2", "num_pipeline_repeats=4"])
    text = report(piped, parse_hardware("v5p-128", num_slices=2), 0.45)
    assert ("pipeline: 2 stages (circular, 4 repeats), 10 layer(s) per stage group, 8 microbatches of 64 sequences; "
            "bubble (S-1)/(M*R+S-1) = 1/33 = 3.0%") in text
    assert "at 43.6% MFU (45.0% outside the pipeline bubble x 0.970 busy = 43.6%)" in text
    # a stage axis across slices is checked against the DCN's intensity (it was compared with the ICI's)
    assert re.search(r"stage +dcn x2 +intensity +1,603,440 +compute-bound over DCN \(ok: above its 73,440\)", text)
    m = piped.model
    counts = count_params(m)
    mesh = {"data": 1, "stage": 2, "fsdp": 64, "sequence": 1, "tensor": 1, "expert": 1}
    layers, norms = m.num_decoder_layers * counts.per_layer, 2 * m.num_decoder_layers * m.emb_dim
    want = ((counts.total - layers - m.emb_dim) / 64 + (layers - norms) / 128 + norms / 2 + m.emb_dim) * 4
    assert estimate_memory(piped, counts, mesh, True).params == pytest.approx(want)
    plain = estimate_memory(piped, counts, {**mesh, "stage": 1}, True).params
    assert want < 0.55 * plain  # the layers are most of the model
    # the backward pass recomputes one layer of one microbatch (of the layout's 8), not of the stage's batch
    from tessera.tools.memory_model import _saved_per_token, activation_bytes

    acts = estimate_memory(piped, counts, mesh, True).activations["full"]
    assert acts == pytest.approx(activation_bytes(piped, mesh, "full", True, microbatches=8))
    tokens = 4 * 2 * 2048  # 4 sequences per device over 2 stages: a stage holds 8
    one_layer = tokens * 2 * _saved_per_token(m, "none", 1) * 2
    whole = activation_bytes(piped, mesh, "full", True, microbatches=1)
    assert whole - acts == pytest.approx(one_layer * (1 - 1 / 8))
