"""Optimizers (opt_type): which axes Muon orthogonalizes, its update against optax's own Muon and
AdamW, plain SGD, and training with each on one device and on a mesh."""

import contextlib
import json
import logging
import re

import jax
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as Dims

from conftest import REPO, tiny_config
from tessera.config import ConfigError, load_config
from tessera.models import build_model
from tessera import optim
from tessera.muon_layout import MatrixGroups
from tessera.optim import MUON_NAMED, learning_rate_schedule, make_optimizer, muon_dimension_numbers
from tessera.start_state import warn_if_no_step_learns
from tessera.step import create_state, setup
from tessera.train import run

MODEL_FILES = sorted(p.stem for p in (REPO / "configs" / "models").glob("*.yml"))


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or isinstance(x, (tuple, Dims)))[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def _dims_and_axes(**keys):
    cfg = load_config([str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in keys.items())], env={})
    axes = build_model(cfg.model, "dot_product", None).logical_axes()
    return _flat(muon_dimension_numbers(axes)), _flat(axes)


def test_muon_takes_the_blocks_weight_matrices_whole():
    dims, _ = _dims_and_axes(model_name="default")
    assert dims == {
        "['final_norm']['scale']": None,
        "['layers']['attention']['wq_dnh']": Dims((1,), (2, 3)),  # [embed] -> [heads x head_dim], per layer
        "['layers']['attention']['wk_dkh']": Dims((1,), (2, 3)),
        "['layers']['attention']['wv_dkh']": Dims((1,), (2, 3)),
        "['layers']['attention']['wo_nhd']": Dims((1, 2), (3,)),  # [heads x head_dim] -> [embed]
        "['layers']['mlp']['wi_0']": Dims((1,), (2,)),
        "['layers']['mlp']['wi_1']": Dims((1,), (2,)),
        "['layers']['mlp']['wo_fd']": Dims((1,), (2,)),
        "['layers']['pre_attention_norm']['scale']": None,
        "['layers']['pre_mlp_norm']['scale']": None,
        "['logits_dense_dv']": None,  # the output layer and the token table stay with AdamW
        "['token_embedder']['table_vd']": None,
    }
    moe, _ = _dims_and_axes(model_name="mixtral-8x7b")
    assert moe["['layers']['mlp']['wi_0']"] == Dims((2,), (3,))  # [layers, experts, embed, mlp]: one matrix each
    assert moe["['layers']['mlp']['wo_efd']"] == Dims((2,), (3,))
    assert moe["['layers']['mlp']['router_de']"] == Dims((1,), (2,))
    fused, _ = _dims_and_axes(model_name="gpt3-175b")  # [layers, embed, q|k|v, heads, head_dim]: q, k, v each alone
    assert fused["['layers']['attention']['wqkv_dcnh']"] == Dims((1,), (3, 4))
    assert fused["['layers']['attention']['bqkv_cnh']"] is None and fused["['position_embedder_pd']"] is None
    mtp, _ = _dims_and_axes(model_name="deepseek-small", mtp_num_layers=1)  # MaxText gives it to Muon too
    assert mtp["['mtp_1']['projection_ced']"] == Dims((0, 1), (2,))  # one [2 x embed, embed] matrix


def test_muon_takes_a_circular_pipelines_stacked_layers_as_batches_of_matrices():
    """With num_pipeline_repeats > 1 the blocks are stored [repeats, layers / repeats, ...]: the repeats axis was
    taken as a matrix axis, so wq_dnh [R, L/R, D, N, H] was orthogonalized as R x (D N H) matrices mixing the
    layers of a stage, and a circular pipeline trained other losses than the same model without it."""
    from tessera.config.derived import pipeline_layout

    cfg = load_config([str(REPO / "configs" / "base.yml"), "ici_pipeline_parallelism=2", "num_pipeline_repeats=2"],
                      env={})
    mesh = {"data": 1, "stage": 2, "fsdp": 4, "sequence": 1, "tensor": 1, "expert": 1}
    axes = build_model(cfg.model, "dot_product", pipeline_layout(cfg, mesh, 64)).logical_axes()
    assert axes["layers"]["attention"]["wq_dnh"][:2] == ("pipeline_repeats", "layers")
    dims = _flat(muon_dimension_numbers(axes))
    assert dims["['layers']['attention']['wq_dnh']"] == Dims((2,), (3, 4))  # as without a pipeline, one axis on
    assert dims["['layers']['attention']['wo_nhd']"] == Dims((2, 3), (4,))
    assert dims["['layers']['mlp']['wi_0']"] == Dims((2,), (3,))


@pytest.mark.parametrize("model", MODEL_FILES)
def test_muon_dimension_numbers_of_every_model_cover_each_weight_once(model):
    """Every weight of a block (w..., the router) is a batch of matrices: its input and output axes are
    distinct, hold no layers or experts axis, and one of them is embed (or MLA's rank, sharded as embed)."""
    dims, axes = _dims_and_axes(model_name=model)
    assert set(dims) == set(axes)
    for path, d in dims.items():
        name = path.rsplit("['", 1)[-1].rstrip("']")
        if d is None:
            assert not name.startswith("w") or {"vocab", "norm"} & set(axes[path]) or \
                len([a for a in axes[path] if a not in ("layers", "exp")]) < 2, (path, axes[path])
            continue
        assert name.startswith("w") or name in MUON_NAMED, path
        used = (*d.reduction_axis, *d.output_axis)
        assert len(set(used)) == len(used) and d.reduction_axis and d.output_axis, (path, d)
        assert not {axes[path][i] for i in used} & {"layers", "exp", "vocab", "norm"}, (path, axes[path], d)
        assert "embed" in {axes[path][i] for i in used}, (path, axes[path], d)


def _update_inputs(devices=1, **keys):
    cfg = tiny_config(gradient_clipping_threshold=0.0, **keys)
    trainer = setup(cfg, jax.devices()[:devices])
    params = create_state(trainer, 0)["params"]
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape, p.dtype), params)
             for i in range(3)]
    return cfg, trainer, params, grads


def _run_updates(opt, params, grads, mesh=None):
    """Three updates, jitted (one compile, not one per operation); under `mesh` (as the train step runs them)
    with the params' shardings."""
    def step(g, state, params):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    if mesh is None:
        # the params on the device alone, not on the trainer's 1-device mesh: the state opt.init makes (its zeros
        # depend on no input) and the state a step returns then have the same types, and the step compiles once
        params, where, placed = jax.device_put(params, jax.devices()[0]), contextlib.nullcontext(), {}
    else:
        where, placed = jax.set_mesh(mesh), {"out_shardings": (jax.tree.map(lambda p: p.sharding, params), None)}
    with where:
        state, out, step = jax.jit(opt.init)(params), [], jax.jit(step, **placed)
        for g in grads:
            params, state = step(g, state, params)
            out.append(params)
    return out


GROUPS = {  # the Muon matrices stacked over the mesh for the Newton-Schulz iterations, by mesh
    # every weight split along its embed axis only: the MLP's 9 [24, 40] matrices (3 layers x wi_0, wi_1
    # and wo transposed) over all 8 devices (padded to 16); q and o (6 of [24, 24]) and k and v (6 of [12, 24],
    # transposed) over data, each computed by the 4 fsdp devices
    "data 2 x fsdp 4": ({"ici_data_parallelism": 2, "ici_fsdp_parallelism": 4},
                        {((3,), (), 24, 40, "float32"): ["mlp/wi_0", "mlp/wi_1", "mlp/wo_fd"],
                         ((3,), (), 24, 24, "float32"): ["attention/wo_nhd", "attention/wq_dnh"],
                         ((3,), (), 12, 24, "float32"): ["attention/wk_dkh", "attention/wv_dkh"]},
                        {"mlp/wi_0": ("data", "fsdp"), "attention/wo_nhd": ("data",), "attention/wk_dkh": ("data",)}),
    # q, o and the MLP are split along two axes (fsdp and tensor), left to GSPMD; k and v (2 heads, whole on
    # the tensor axis) are stacked over fsdp
    "fsdp 2 x tensor 4": ({"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 4},
                          {((3,), (), 12, 24, "float32"): ["attention/wk_dkh", "attention/wv_dkh"]},
                          {"attention/wk_dkh": ("fsdp",)}),
}


@pytest.mark.parametrize("consistent_rms, weight_decay, mesh", [(0.0, 0.0, None), (0.2, 0.1, None),
                                                               (0.2, 0.1, "data 2 x fsdp 4"),
                                                               (0.2, 0.1, "fsdp 2 x tensor 4")])
def test_muon_steps_equal_optax_muon_on_the_matrices_and_adamw_on_the_rest(consistent_rms, weight_decay, mesh):
    """Three updates of the tiny model: the matrices as optax.contrib.muon moves them (given only matrices,
    with the same dimension numbers), the other parameters as AdamW with its decay mask (opt_type=adamw).
    On 8 devices the matrices of one shape are stacked, split over the mesh, for the Newton-Schulz
    iterations (muon_layout), as on a TPU slice: GROUPS says which."""
    mesh_keys, want_groups, want_split = GROUPS[mesh] if mesh else ({}, {}, {})
    cfg, trainer, params, grads = _update_inputs(8 if mesh else 1, opt_type="muon", muon_consistent_rms=consistent_rms,
                                                 muon_weight_decay=weight_decay, adam_weight_decay=0.05, **mesh_keys)
    if mesh:
        axes = trainer.model.logical_axes()
        with jax.set_mesh(trainer.mesh):
            groups = MatrixGroups(grads[0], optim.masked(muon_dimension_numbers(axes)), axes)
        names = ["/".join(str(k.key) for k in path[1:]) for path, _ in jax.tree_util.tree_flatten_with_path(
            grads[0], is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]]
        assert {key: [names[i] for i in members] for key, members in groups.stacked.items()} == want_groups
        split = {names[members[0]]: groups.split[key] for key, members in groups.stacked.items()}
        assert split == want_split
    ours = [_flat(p) for p in _run_updates(trainer.optimizer, params, grads, trainer.mesh if mesh else None)]
    dims = _flat(muon_dimension_numbers(trainer.model.logical_axes()))
    matrices = [k for k, d in dims.items() if d is not None]
    schedule = learning_rate_schedule(cfg.optim, cfg.run.steps)
    reference = optax.contrib.muon(schedule, beta=cfg.optim.muon_beta, eps=cfg.optim.adam_eps,
                                   weight_decay=weight_decay, consistent_rms=consistent_rms or None,
                                   muon_weight_dimension_numbers={k: dims[k] for k in matrices})
    pick = lambda tree, keys: {k: _flat(tree)[k] for k in keys}  # noqa: E731
    expected = _run_updates(reference, pick(params, matrices), [pick(g, matrices) for g in grads])
    adamw = make_optimizer(cfg.optim.__class__(**{**vars(cfg.optim), "opt_type": "adamw"}), cfg.run.steps)
    expected_rest = [_flat(p) for p in _run_updates(adamw, params, grads)]
    for step in range(3):
        for k in dims:
            want = expected[step][k] if k in matrices else expected_rest[step][k]
            np.testing.assert_allclose(ours[step][k], want, rtol=2e-6, atol=1e-7, err_msg=f"step {step + 1} {k}")
    # and Muon moved the matrices differently from AdamW (the check above compares something)
    assert not np.allclose(ours[0][matrices[0]], expected_rest[0][matrices[0]], rtol=1e-3)


def test_sgd_is_the_learning_rate_times_the_gradient():
    cfg, trainer, params, grads = _update_inputs(opt_type="sgd", adam_weight_decay=0.1)
    after = _run_updates(trainer.optimizer, params, grads[:1])[0]
    lr = learning_rate_schedule(cfg.optim, cfg.run.steps)(0)
    jax.tree.map(lambda a, p, g: np.testing.assert_allclose(a, p - lr * g, rtol=1e-6, atol=1e-7), after, params,
                 grads[0])
    assert sum(x.size for x in jax.tree.leaves(trainer.optimizer.init(params))) <= 1  # no moments (a step count)


def _losses(tmp_path, name, devices, **keys):
    run(tiny_config(tmp_path / name, steps=4, **keys), devices)
    lines = (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()
    return np.array([json.loads(line)["loss"] for line in lines])


@pytest.mark.parametrize("opt_type", ["muon", "sgd"])
def test_each_optimizer_trains_the_same_on_one_device_and_on_a_mesh(tmp_path, opt_type):
    """fsdp 2 x tensor 4 (the matrices Muon orthogonalizes are split over both) against one device;
    both lower the loss. Tolerance as in test_train's mesh test: the order of float32 sums differs."""
    one = _losses(tmp_path, "one", jax.devices()[:1], opt_type=opt_type, per_device_batch_size=8)
    mesh = _losses(tmp_path, "mesh", None, opt_type=opt_type, ici_fsdp_parallelism=2, ici_tensor_parallelism=4)
    np.testing.assert_allclose(mesh, one, rtol=1e-4)
    assert one[-1] < one[0]


def test_an_optimizer_that_is_not_there_is_named():
    with pytest.raises(ConfigError, match=r"opt_type='adam_pax' is not allowed; choose one of: 'adamw', 'sgd', 'muon'"):
        tiny_config(opt_type="adam_pax")


def test_a_muon_run_resumes_exactly(tmp_path):
    """Muon's state (its momentum, and AdamW's moments, each with the other part's parameters masked out)
    goes through a checkpoint: 2 steps, then 2 more after a restart, equal 4 straight steps."""
    common = dict(opt_type="muon", checkpoint_period=100, learning_rate_schedule_steps=4)
    run(tiny_config(tmp_path / "a", steps=4, **common))
    run(tiny_config(tmp_path / "b", steps=2, **common))
    report = run(tiny_config(tmp_path / "b", steps=4, **common))
    assert report["start_step"] == 2
    read = lambda name: [json.loads(line)["loss"] for line in  # noqa: E731
                         (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]
    assert read("a")[2:] == read("b")[-2:]  # bitwise: CPU is deterministic


def test_the_schedule_warms_up_decays_and_keeps_its_end_and_a_schedule_of_no_steps_is_refused():
    """base.yml's schedule keys at the edge steps: 0 at step 0, the peak where the warm-up ends, the final
    fraction at the schedule's last step and after it (also without warm-up); a length of 0 or below -1
    (-1 is `steps`) is a config error, where it used to drop the rate to its end value after step 0."""
    cfg = tiny_config(learning_rate=0.5, warmup_steps_fraction=0.2, cosine_learning_rate_final_fraction=0.1)
    schedule = learning_rate_schedule(cfg.optim, 10)
    got = [float(schedule(s)) for s in (0, 1, 2, 6, 10, 11, 1000)]
    np.testing.assert_allclose(got, [0.0, 0.25, 0.5, 0.5 * (0.1 + 0.9 * 0.5), 0.05, 0.05, 0.05], rtol=1e-6)
    flat = learning_rate_schedule(tiny_config(learning_rate=0.5, warmup_steps_fraction=0.0).optim, 10)
    np.testing.assert_allclose([float(flat(s)) for s in (0, 5, 10, 20)], [0.5, 0.275, 0.05, 0.05], rtol=1e-6)
    for steps in (0, -2, -5):
        with pytest.raises(ConfigError, match=rf"learning_rate_schedule_steps={steps} .*set it to -1 .* or >= 1"):
            setup(tiny_config(learning_rate_schedule_steps=steps), jax.devices()[:1])


def _wsd_by_hand(step, peak, final, warmup, decay, total, style):
    """The WSD rate of update `step` written out: up from 0 over `warmup` steps, the peak until `total - decay`,
    then linear or cosine to `final` at `total`, which the steps after keep."""
    if step < warmup:
        return peak * step / warmup
    if step < total - decay:
        return peak
    done = min(step - (total - decay), decay) / decay
    shape = done if style == "linear" else (1 - np.cos(np.pi * done)) / 2
    return peak + (final - peak) * shape


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_the_wsd_schedule_warms_up_holds_the_peak_and_decays_over_its_last_fraction(style):
    """lr_schedule_type=wsd (MaxText's keys): 10 warm-up steps of 100, the peak until step 80, then a linear or
    cosine decay over wsd_decay_steps_fraction=0.2 to the final fraction, reached at step 100 (where the cosine
    schedule ends too) and kept after it; every step equals the schedule written out."""
    cfg = tiny_config(learning_rate=0.5, warmup_steps_fraction=0.1, lr_schedule_type="wsd",
                      wsd_decay_steps_fraction=0.2, wsd_decay_style=style, cosine_learning_rate_final_fraction=0.1)
    schedule = learning_rate_schedule(cfg.optim, 100)
    steps = np.arange(0, 131)
    want = [_wsd_by_hand(s, 0.5, 0.05, 10, 20, 100, style) for s in steps]
    np.testing.assert_allclose(np.asarray(schedule(steps)), want, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose([float(schedule(s)) for s in (0, 10, 80, 90, 100, 130)],
                               [0.0, 0.5, 0.5, 0.275, 0.05, 0.05], rtol=1e-6, atol=1e-9)


def test_a_wsd_schedule_without_warm_up_stable_phase_or_decay_is_each_of_its_other_parts():
    """No warm-up starts at the peak; warm-up and decay covering the schedule leave no stable phase (the decay
    starts where the warm-up ends); wsd_decay_steps_fraction=0 holds the peak to the end and after it (a run to
    decay later from one of its checkpoints); each fraction is its whole steps of the schedule."""
    def rates(steps, total, **keys):
        cfg = tiny_config(learning_rate=1.0, lr_schedule_type="wsd", cosine_learning_rate_final_fraction=0.0, **keys)
        return [float(learning_rate_schedule(cfg.optim, total)(s)) for s in steps]

    np.testing.assert_allclose(rates((0, 5, 6, 8, 10), 10, warmup_steps_fraction=0.0, wsd_decay_steps_fraction=0.4),
                               [1.0, 1.0, 1.0, 0.5, 0.0], atol=1e-7)
    np.testing.assert_allclose(rates((0, 2, 4, 7, 10), 10, warmup_steps_fraction=0.4, wsd_decay_steps_fraction=0.6),
                               [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-7)
    np.testing.assert_allclose(rates((0, 1, 2, 9, 10, 50), 10, warmup_steps_fraction=0.2, wsd_decay_steps_fraction=0.0),
                               [0.0, 0.5, 1.0, 1.0, 1.0, 1.0], atol=1e-7)
    # whole steps of each fraction: 0.55 x 3 is 1 warm-up step and 0.45 x 3 one decay step, the peak between
    np.testing.assert_allclose(rates((0, 1, 2, 3), 3, warmup_steps_fraction=0.55, wsd_decay_steps_fraction=0.45),
                               [0.0, 1.0, 1.0, 0.0], atol=1e-7)


def test_a_wsd_warm_up_and_decay_longer_than_the_schedule_are_refused():
    with pytest.raises(ConfigError, match=r"warmup_steps_fraction=0\.6 \+ wsd_decay_steps_fraction=0\.5 is more than "
                                          r"the whole schedule: .*add up to 1 at most"):
        load_config([str(REPO / "configs" / "base.yml"), "lr_schedule_type=wsd", "warmup_steps_fraction=0.6",
                     "wsd_decay_steps_fraction=0.5"], env={})
    # the cosine schedule does not read the decay's fraction
    load_config([str(REPO / "configs" / "base.yml"), "warmup_steps_fraction=0.6", "wsd_decay_steps_fraction=0.5"],
                env={})


def test_the_other_schedules_keys_are_named_as_unread():
    from tessera.config.unread_keys import keys_without_effect

    base = str(REPO / "configs" / "base.yml")
    cosine = load_config([base, "wsd_decay_steps_fraction=0.2", "wsd_decay_style=cosine"], env={})
    assert keys_without_effect(cosine, {"fsdp": 1}) == [
        "wsd_decay_steps_fraction=0.2, wsd_decay_style=cosine: no effect with lr_schedule_type=cosine; they shape "
        "lr_schedule_type=wsd's decay"]
    never = load_config([base, "lr_schedule_type=wsd", "wsd_decay_steps_fraction=0", "learning_rate_final_fraction=0"],
                        env={})
    assert keys_without_effect(never, {"fsdp": 1}) == [
        "cosine_learning_rate_final_fraction=0.0: no effect with wsd_decay_steps_fraction=0, whose schedule holds the "
        "peak to its end and never decays"]
    assert keys_without_effect(load_config([base, "lr_schedule_type=wsd", "wsd_decay_style=cosine"], env={}),
                               {"fsdp": 1}) == []


def test_a_checkpoint_from_before_wsd_is_read_as_the_cosine_schedule_it_was_saved_with():
    """A checkpoint's config from before lr_schedule_type lacks the key: its schedule was the cosine one, whatever
    this run's lr_schedule_type (the resume's learning-rate warning compares against it)."""
    from tessera.config import flat_dict
    from tessera.start_state import saved_schedule

    now = tiny_config(steps=10, lr_schedule_type="wsd", learning_rate=1.0, warmup_steps_fraction=0.0)
    saved = {k: v for k, v in flat_dict(now).items() if k not in ("lr_schedule_type", "wsd_decay_steps_fraction",
                                                                   "wsd_decay_style")}
    schedule, length = saved_schedule(saved, now)
    cosine = learning_rate_schedule(tiny_config(learning_rate=1.0, warmup_steps_fraction=0.0).optim, 10)
    assert length == 10 and [float(schedule(s)) for s in (0, 5, 10)] == [float(cosine(s)) for s in (0, 5, 10)]
    assert float(schedule(5)) < 0.9  # decaying, where this run's wsd holds the peak
    schedule, _ = saved_schedule(flat_dict(now), now)
    assert float(schedule(5)) == 1.0


@pytest.mark.parametrize("keys, start, said", [
    (dict(steps=1, warmup_steps_fraction=1.0), 0, r"\(step 1\) .*warm-up \(warmup_steps_fraction=1\) starts from 0"),
    (dict(steps=3, learning_rate=0.0), 0, r"\(steps 1-3\) .*learning_rate=0\. Set it above 0"),
    (dict(steps=6, learning_rate_schedule_steps=4, cosine_learning_rate_final_fraction=0.0), 4,
     r"\(steps 5-6\) .*schedule's 4 steps are over .*final_fraction=0\. Raise learning_rate_schedule_steps"),
    (dict(steps=2, warmup_steps_fraction=0.5), 0, None),  # step 2 learns at 0.5 x the rate
    (dict(steps=6, learning_rate_schedule_steps=4), 4, None),  # the final fraction (0.1) of the rate
])
def test_a_run_none_of_whose_steps_learns_is_warned_of(keys, start, said, caplog):
    """Every step this run trains at learning rate 0 moves no weight: one step at the start of a warm-up
    (which starts from 0; warmup_steps_fraction=1 with steps=1), learning_rate=0, or the steps after a
    schedule that ends at 0. Each gets one warning naming the steps and the key to change."""
    cfg = tiny_config(**keys)
    length = cfg.total_steps_in_schedule
    opt_state = make_optimizer(cfg.optim, length).init({"w": np.zeros(2, np.float32)})
    state = {"opt_state": optax.tree_utils.tree_set(opt_state, count=np.int32(start))}
    caplog.clear()
    warn_if_no_step_learns(cfg, learning_rate_schedule(cfg.optim, length), state, start)
    got = [r.getMessage() for r in caplog.records if "applies learning rate 0" in r.getMessage()]
    if said is None:
        assert got == []
    else:
        assert len(got) == 1 and re.search(said, got[0]), got


def test_the_warm_up_is_the_fraction_of_the_schedule_and_an_all_warm_up_schedule_ends_at_the_final_rate():
    """warmup_steps_fraction=0.29 of 100 steps warms up for 29 steps (0.29 x 100 is 28.999999999999996 in
    floating point: it warmed up for 28, the peak one step early); warmup_steps_fraction=1 warms up
    over the whole schedule, and the steps after it keep the final rate (the first of them trained at
    the peak: the cosine decay began one step after the schedule's end)."""
    cfg = tiny_config(learning_rate=1.0, warmup_steps_fraction=0.29, cosine_learning_rate_final_fraction=0.1)
    schedule = learning_rate_schedule(cfg.optim, 100)
    np.testing.assert_allclose([float(schedule(s)) for s in (1, 28, 29)], [1 / 29, 28 / 29, 1.0], rtol=1e-6)
    cfg = tiny_config(learning_rate=1.0, warmup_steps_fraction=1.0, cosine_learning_rate_final_fraction=0.1)
    schedule = learning_rate_schedule(cfg.optim, 10)
    np.testing.assert_allclose([float(schedule(s)) for s in (0, 5, 9, 10, 11, 100)], [0.0, 0.5, 0.9, 0.1, 0.1, 0.1],
                               rtol=1e-6)


def test_the_learning_rate_reported_after_a_skipped_step_is_the_one_applied():
    """A non-finite step leaves parameters and optimizer state as they were, the schedule's count too:
    the steps after it apply the rates of one step earlier, and report those (they reported the train
    step's). [good, bad, good] ends in the state of [good, good], with the second good step's rate."""
    import jax.numpy as jnp

    from tessera.step import make_train_step

    trainer = setup(tiny_config(steps=10, warmup_steps_fraction=0.5, on_nonfinite_loss="skip_step"), jax.devices()[:1])
    step = jax.jit(make_train_step(trainer, 0))
    b, t = trainer.plan.global_batch, trainer.plan.max_target_length + 1
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, 96)
    good = {"tokens": tokens, "segment_ids": jnp.ones((b, t), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}
    bad = dict(good, tokens=tokens.at[0, 3].set(10**6))  # a token past the table: its embedding is NaN

    def train(batches):
        state, rates, finite = create_state(trainer, 0), [], []
        for batch in batches:
            state, stats = step(state, batch)
            rates.append(float(stats["learning_rate"]))
            finite.append(bool(stats["finite"]))
        return state, rates, finite

    skipped, rates, finite = train([good, bad, good])
    plain, plain_rates, _ = train([good, good])
    assert finite == [True, False, True]
    assert plain_rates[1] > plain_rates[0] == 0.0  # warming up: each step's rate differs
    assert rates == [plain_rates[0], plain_rates[1], plain_rates[1]]
    jax.tree.map(np.testing.assert_array_equal, skipped["params"], plain["params"])
    assert int(skipped["step"]) == 3


def test_a_batch_without_targets_makes_no_update():
    """A batch with no target token (all padding here) has loss 0 and gradient 0, and AdamW still stepped on it: its
    weight decay (and any momentum) moved the weights, and the schedule advanced. The step now leaves parameters and
    optimizer state as they were, reports 0 tokens, and the metrics record says "no_targets"."""
    import jax.numpy as jnp

    from tessera.loop_records import StepMeter
    from tessera.step import make_train_step

    trainer = setup(tiny_config(adam_weight_decay=0.1), jax.devices()[:1])
    b, t = trainer.plan.global_batch, trainer.plan.max_target_length + 1
    empty = {"tokens": jnp.zeros((b, t), jnp.int32), "segment_ids": jnp.zeros((b, t), jnp.int32),
             "positions": jnp.zeros((b, t), jnp.int32)}
    state = create_state(trainer, 0)
    before = jax.tree.map(np.asarray, state)
    after, stats = jax.jit(make_train_step(trainer, 0))(state, empty)
    jax.tree.map(np.testing.assert_array_equal, after["params"], before["params"])
    jax.tree.map(np.testing.assert_array_equal, after["opt_state"], before["opt_state"])
    assert float(stats["tokens"]) == 0 and bool(stats["finite"])
    assert int(after["step"]) == 1
    assert StepMeter(trainer).record(1, jax.device_get(stats))["no_targets"] is True


def test_a_step_without_targets_is_warned_of_by_its_step_number(caplog):
    """First_run.md: a step whose batch held no target token makes no update, "and a warning names it". The
    loop's reader of the step stats warns for that step only (stubs for the writer, meter, profiler and watchdog)."""
    from types import SimpleNamespace

    from tessera.step_stats import StatsReader

    records = []
    reader = StatsReader(tiny_config(), SimpleNamespace(write=records.append),
                         SimpleNamespace(record=lambda step, stats: {"step": step}), SimpleNamespace(active=False),
                         SimpleNamespace(beat=lambda: None), None)
    for step, tokens in ((1, 0.0), (2, 40.0)):
        reader.add(step, {"tokens": np.float32(tokens), "finite": np.bool_(True), "loss": np.float32(0.0),
                          "grad_norm": np.float32(0.0)})
    with caplog.at_level(logging.WARNING, logger="tessera"):
        reader.finish()
    warned = [r.getMessage() for r in caplog.records if "no target token" in r.getMessage()]
    assert records == [{"step": 1}, {"step": 2}]
    assert len(warned) == 1 and warned[0].startswith("step 1: its batch holds no target token"), warned


def test_bfloat16_gradients_of_microbatches_add_up_in_float32():
    """gradient_accumulation_steps with weight_dtype=bfloat16: the microbatches' gradients were summed in
    bfloat16 (8 bits, one rounding per addition); the scan's running sums are float32, the result is
    rounded once to the weights' type, and the update gets gradients of that type."""
    import jax.numpy as jnp

    from tessera.step import make_train_step

    trainer = setup(tiny_config(weight_dtype="bfloat16", gradient_accumulation_steps=4, per_device_batch_size=4),
                    jax.devices()[:1])
    state = create_state(trainer, 0)
    b, t = trainer.plan.global_batch, trainer.plan.max_target_length + 1
    batch = {"tokens": jax.random.randint(jax.random.key(1), (b, t), 0, 96), "segment_ids": jnp.ones((b, t), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}
    jaxpr = jax.make_jaxpr(make_train_step(trainer, 0))(state, batch)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1  # the accumulation loop (the layers' scan is inside its body)
    n_params = len(jax.tree.leaves(state["params"]))
    carried = [v.aval.dtype for v in scans[0].outvars[:n_params]]  # the carry (grads, loss sum, count) comes first
    assert {jnp.dtype(p.dtype) for p in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
    assert carried[:n_params] == [jnp.dtype(jnp.float32)] * n_params
    new_state, _ = jax.jit(make_train_step(trainer, 0))(state, batch)
    assert jax.tree.map(lambda p: p.dtype, new_state) == jax.tree.map(lambda p: p.dtype, state)


def test_adamw_decays_every_weight_but_the_norm_scales_and_the_routing_biases():
    """make_optimizer's docstring: AdamW's weight decay applies to every parameter but the norms' scales and
    DeepSeek's routing biases (NO_DECAY). With a zero gradient AdamW's own step is 0, so one update at the peak
    rate moves each decayed weight by exactly -learning_rate x adam_weight_decay x weight, and the others not
    at all. (The other AdamW tests compare with make_optimizer's own mask, which cannot catch a wrong one.)"""
    from test_families import FAMILIES

    cfg, trainer, params, _ = _update_inputs(**FAMILIES["deepseek"], adam_weight_decay=0.5, learning_rate=0.1,
                                             warmup_steps_fraction=0.0)
    params = jax.jit(lambda ps: jax.tree.map(lambda p: p + 1.0, ps))(params)  # no zero weights (biases start at 0)
    zeros = jax.jit(lambda ps: jax.tree.map(lambda p: p * 0.0, ps))(params)
    after = _flat(_run_updates(trainer.optimizer, params, [zeros])[0])
    kept = [k for k in after if "['scale']" in k or "['routed_bias_e']" in k]
    assert any("scale" in k for k in kept) and any("routed_bias_e" in k for k in kept), kept
    for k, p in _flat(params).items():
        want = p if k in kept else p * (1 - 0.1 * 0.5)
        np.testing.assert_allclose(after[k], want, rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("opt_type", ["adamw", "muon"])
def test_mu_dtype_keeps_the_first_moment_in_bfloat16_and_trains_like_float32(tmp_path, opt_type):
    """mu_dtype=bfloat16 (MaxText's large recipes): AdamW's first moment (and Muon's momentum) in bfloat16, the
    second moment in the parameters' float32; the first loss is the same and the next ones follow float32's
    within the rounding of a bfloat16 momentum (1e-3 relative over 4 steps of the tiny model)."""
    cfg = tiny_config(opt_type=opt_type, mu_dtype="bfloat16")
    state = jax.eval_shape(lambda p: make_optimizer(cfg.optim, 10, build_model(cfg.model, "dot_product", None)
                                                    .logical_axes()).init(p),
                           build_model(cfg.model, "dot_product", None).param_shapes())
    mus = optax.tree_utils.tree_get_all_with_path(state, "mu")
    nus = optax.tree_utils.tree_get_all_with_path(state, "nu")
    assert mus and all(leaf.dtype == np.dtype("bfloat16") for _, tree in mus for leaf in jax.tree.leaves(tree))
    assert all(leaf.dtype == np.float32 for _, tree in nus for leaf in jax.tree.leaves(tree))

    def losses(name, **keys):
        run(tiny_config(tmp_path / name, steps=4, opt_type=opt_type, **keys), jax.devices()[:1])
        return [json.loads(line)["loss"] for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]

    half, full = losses("bf16", mu_dtype="bfloat16"), losses("f32")
    assert half[0] == full[0] and half != full
    np.testing.assert_allclose(half, full, rtol=1e-3)


def test_mu_dtype_may_change_at_a_resume_and_the_estimate_counts_it(tmp_path, caplog):
    """A run saved with float32 first moments resumes with mu_dtype=bfloat16 (they are read as saved and cast,
    where the dtype mismatch stopped the resume): the first resumed step's loss is the uninterrupted run's; and
    the memory estimate counts the first moment at 2 bytes a parameter (AdamW, float32 weights: 6 instead of 8)."""
    from tessera.tools.memory_model import count_params, estimate_memory

    keys = dict(learning_rate_schedule_steps=6)
    run(tiny_config(tmp_path / "whole", steps=6, **keys), jax.devices()[:1])
    run(tiny_config(tmp_path / "a", steps=3, **keys), jax.devices()[:1])
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path / "a", steps=6, mu_dtype="bfloat16", **keys), jax.devices()[:1])
    assert "optimizer-state arrays saved in float32, restored as bfloat16 (mu_dtype)" in caplog.text
    read = lambda name: [json.loads(line)["loss"] for line in  # noqa: E731
                         (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]
    assert read("a")[:4] == read("whole")[:4]
    np.testing.assert_allclose(read("a"), read("whole"), rtol=1e-3)
    mesh = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, "sequence": 1, "stage": 1}
    full, half = (tiny_config(mu_dtype=d) for d in ("", "bfloat16"))
    opt = [estimate_memory(c, count_params(c.model), mesh, True).optimizer for c in (full, half)]
    assert opt[1] == pytest.approx(0.75 * opt[0])


def test_grad_dtype_rounds_the_gradients_the_update_reads_to_bfloat16(tmp_path):
    """grad_dtype=bfloat16 (MaxText's key, beside mu_dtype in its large recipes): float32 gradients rounded once
    before the norm and the update. The parameters stay float32, the first loss is the same, the next ones and the
    gradient norms follow float32 gradients' within that rounding; the estimate counts 2 bytes a parameter."""
    from tessera.tools.memory_model import count_params, estimate_memory

    def records(name, **keys):
        run(tiny_config(tmp_path / name, steps=4, **keys), jax.devices()[:1])
        return [json.loads(line) for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]

    half, full = records("bf16", grad_dtype="bfloat16"), records("f32")
    assert half[0]["loss"] == full[0]["loss"] and [r["loss"] for r in half] != [r["loss"] for r in full]
    np.testing.assert_allclose([r["loss"] for r in half], [r["loss"] for r in full], rtol=1e-3)
    np.testing.assert_allclose([r["grad_norm"] for r in half], [r["grad_norm"] for r in full], rtol=1e-2)
    # float32, MaxText's default, keeps float32 gradients: the default's losses exactly
    assert [r["loss"] for r in records("f32_named", grad_dtype="float32")] == [r["loss"] for r in full]
    mesh = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, "sequence": 1, "stage": 1}
    full_cfg, half_cfg = tiny_config(), tiny_config(grad_dtype="bfloat16")
    grads = [estimate_memory(c, count_params(c.model), mesh, True).grads for c in (full_cfg, half_cfg)]
    assert grads[1] == pytest.approx(0.5 * grads[0])


def test_adamw_mask_keeps_the_parameters_it_finds_from_decaying(caplog):
    """adamw_mask (MaxText's key): regular expressions searched in Tessera's parameter paths; AdamW does not decay
    what they find, beside the norm scales it never decays. With zero gradients the update is the decay alone:
    -lr x adam_weight_decay x p for the others, 0 for those."""
    from tessera.optim import decay_mask

    params = {"token_embedder": {"table_vd": np.ones((4, 2), np.float32)},
              "layers": {"mlp": {"wi_0": np.ones((2, 3), np.float32)}, "pre_mlp_norm": {"scale": np.ones(2, np.float32)}},
              "logits_dense_dv": np.ones((2, 4), np.float32)}
    # leaves in key order: layers/mlp/wi_0, layers/pre_mlp_norm/scale, logits_dense_dv, token_embedder/table_vd
    assert jax.tree.leaves(decay_mask(["token_embedder", "^logits"])(params)) == [True, False, False, False]
    cfg = tiny_config(learning_rate=1.0, warmup_steps_fraction=0.0, adam_weight_decay=0.1,
                      gradient_clipping_threshold=0.0, adamw_mask=["token_embedder"])
    opt = make_optimizer(cfg.optim, 10)
    updates, _ = opt.update(jax.tree.map(np.zeros_like, params), opt.init(params), params)
    got = {k: float(np.max(np.abs(v))) for k, v in zip(["layers/mlp/wi_0", "layers/pre_mlp_norm/scale",
                                                        "logits_dense_dv", "token_embedder/table_vd"],
                                                       jax.tree.leaves(updates))}
    assert got == pytest.approx({"layers/mlp/wi_0": 0.1, "layers/pre_mlp_norm/scale": 0.0, "logits_dense_dv": 0.1,
                                 "token_embedder/table_vd": 0.0})
    with caplog.at_level("INFO", logger="tessera"):
        setup(tiny_config(adamw_mask=["token_embedder", "wi_"]), jax.devices()[:1])
    assert "adamw_mask: AdamW does not decay layers/mlp/wi_0, layers/mlp/wi_1, token_embedder/table_vd" in caplog.text


def test_an_adamw_mask_that_finds_nothing_or_does_not_parse_is_refused():
    """MaxText's parameter names are not Tessera's: a pattern found in no path is a config error that lists the
    model's parameters, where it would have decayed them all without a word."""
    with pytest.raises(ConfigError, match=r"adamw_mask: 'embedding' is found in no parameter's path; this model's "
                                          r"parameters are final_norm/scale, layers/attention/wk_dkh, .*token_embedder"):
        setup(tiny_config(adamw_mask=["embedding"]), jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"adamw_mask: '\(' is not a regular expression \(missing \), "):
        tiny_config(adamw_mask=["("])


def test_adam_eps_root_is_inside_the_square_root():
    """adam_eps_root (MaxText's key): the first AdamW update of a gradient g is -lr x g / (sqrt(g^2 + eps_root) +
    eps) (the bias-corrected moments of one step are g and g^2), no decay and no clipping here."""
    g = np.array([1e-3, 0.5, -2.0], np.float32)
    cfg = tiny_config(learning_rate=1.0, warmup_steps_fraction=0.0, adam_weight_decay=0.0, adam_eps=1e-8,
                      gradient_clipping_threshold=0.0, adam_eps_root=1e-4)
    opt = make_optimizer(cfg.optim, 10)
    params = {"w": np.zeros(3, np.float32)}
    updates, _ = opt.update({"w": g}, opt.init(params), params)
    np.testing.assert_allclose(updates["w"], -g / (np.sqrt(g * g + 1e-4) + 1e-8), rtol=1e-5)
    assert abs(float(updates["w"][0])) < 0.2  # without eps_root it would be about -1: sign(g)
