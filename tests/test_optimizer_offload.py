"""optimizer_memory_host_offload: the moments in pinned host memory, the update streamed a layer at a
time (tessera.optimizer_offload). The streamed steps equal the plain ones; the state stays where it
belongs; checkpoints move between runs with and without it; what it cannot run with is refused; the
TPU compile shows the moments in host memory and the rest in HBM."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY, tiny_config
from tessera.config import ConfigError
from tessera.step import create_state, make_train_step, setup
from tessera.train import run

MOE = dict(decoder_block="mixtral", num_experts=4, num_experts_per_tok=2)
# DeepSeek-V3's layout: one dense layer, then layers of experts (two stacks, two lengths); routing biases that move
# after the update
DEEPSEEK = dict(decoder_block="deepseek", base_num_decoder_layers=3, first_num_dense_layers=1, head_dim=24,
                q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=10, num_experts=8,
                num_experts_per_tok=3, n_routing_groups=4, topk_routing_group=2, shared_experts=1,
                routed_score_func="sigmoid", routed_bias=True, sparse_matmul=True)


def _batch(trainer, vocab, seed=0):
    t = trainer.plan.max_target_length + 1
    rng = np.random.default_rng(seed)
    segments = np.ones((trainer.plan.global_batch, t), np.int32)
    segments[0, t // 2:] = 0  # padding: the mean is over fewer tokens than the batch holds
    return {"tokens": jnp.asarray(rng.integers(0, vocab, segments.shape), jnp.int32),
            "segment_ids": jnp.asarray(segments),
            "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segments.shape)}


def _steps(offload: bool, steps: int = 3, poison: int | None = None, **keys):
    """(trainer, the state after `steps` steps on 4 devices, their stats); `poison`: the step whose batch
    makes the loss non-finite (a NaN in the embedding table's gradient), so it is skipped."""
    cfg = tiny_config(**{"per_device_batch_size": 1, "ici_fsdp_parallelism": 4,
                         "optimizer_memory_host_offload": offload, **keys})
    trainer = setup(cfg, jax.devices()[:4])
    state = create_state(trainer, 0)
    step = jax.jit(make_train_step(trainer, 0), out_shardings=(trainer.state_shardings, None), donate_argnums=0)
    stats = []
    with jax.set_mesh(trainer.mesh):
        for i in range(steps):
            if i == poison:
                state["params"]["final_norm"]["scale"] = state["params"]["final_norm"]["scale"] * jnp.nan
            state, s = step(state, _batch(trainer, cfg.model.vocab_size, i))
            stats.append(jax.device_get(s))
            if i == poison:  # put it back: the skipped step left the poisoned scale in place
                state["params"]["final_norm"]["scale"] = jnp.ones_like(state["params"]["final_norm"]["scale"])
    return trainer, state, stats


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("keys", [
    {},
    dict(gradient_clipping_threshold=0.05),  # every step clipped (the norm is about 1)
    dict(mu_dtype="bfloat16", adamw_mask=["mlp/wo_fd"], adam_eps_root=1e-8),
    dict(trainable_parameters_mask=["layers/attention"]),  # a partitioned state: the others' moments are MaskedNode
    MOE,
    DEEPSEEK,  # two stacks (one dense layer, two of experts): a scan for each length
    # ZeRO-1: the moments split over data as well, unlike their parameters
    dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, shard_optimizer_over_data=True),
    dict(per_device_batch_size=2, gradient_accumulation_steps=2),  # the micro-batches' sums, then the stream
], ids=["adamw", "clipped", "mu_bf16_masked", "trainable_mask", "moe", "deepseek_two_stacks", "zero1", "accumulated"])
def test_the_streamed_update_equals_the_plain_one(keys):
    """Three steps with the moments streamed from host memory leave the parameters and the optimizer state
    bitwise as the plain update does (the same element-wise arithmetic, on slices), with equal losses. Moments
    kept in bfloat16 (mu_dtype) may round one way or the other where the float32 value is a tie: within one
    bfloat16 step (2 of 5,184 elements after three steps with adamw_mask and adam_eps_root on a Xeon host). A
    step's parameters read its float32 moment, so they stay bitwise unless a moment stored by an earlier step
    rounded the other way: then the elements that read it differ, by a bfloat16 step of their update (on an
    AMD EPYC host one moment of wv_dkh rounded apart at step 2 and moved its parameter by 1.2e-6 at step 3); no
    more elements than moments differ, each within the learning rate x 2**-7."""
    trainer, plain, plain_stats = _steps(False, **keys)
    _, streamed, stats = _steps(True, **keys)
    assert [s["loss"] for s in stats] == [s["loss"] for s in plain_stats]
    want, got = _flat(plain), _flat(streamed)
    assert want.keys() == got.keys()
    moments_apart = sum(int(np.sum(np.asarray(got[k]) != np.asarray(want[k]))) for k in want
                        if want[k].dtype == jnp.bfloat16)
    params_apart = 0
    for k in want:
        if want[k].dtype == jnp.bfloat16:
            np.testing.assert_allclose(got[k].astype(np.float32), want[k].astype(np.float32), rtol=2 ** -7, atol=0,
                                       err_msg=k)
        elif moments_apart and k.startswith("['params']"):
            params_apart += int(np.sum(np.asarray(got[k]) != np.asarray(want[k])))
            rate = max(float(trainer.schedule(i)) for i in range(len(stats)))
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=rate * 2 ** -7, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert params_apart <= moments_apart
    # the moments stay in host memory from step to step; the counts, the parameters and the moments of stacked
    # vectors (the norms' scales, [layers, embed]) on the devices
    kinds = {k: v.sharding.memory_kind for k, v in
             ((jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_flatten_with_path(streamed)[0])}
    moments = {k for k, v in _flat(plain["opt_state"]).items() if np.ndim(v) and not (
        np.ndim(v) == 2 and re.search(r"\['(dense_)?layers'\]", k))}
    assert moments and all(kinds[f"['opt_state']{k}"] == "pinned_host" for k in moments)
    assert {kinds[k] for k in kinds if not k.startswith("['opt_state']") or k[len("['opt_state']"):] not in moments
            } == {"device"}


def test_bfloat16_weights_stream_to_the_plain_update_within_one_rounding():
    """weight_dtype=bfloat16 (parameters, gradients and moments in bfloat16): one step streamed leaves the moments
    bitwise as the plain update does, and the parameters too but for the last rounding of p + update, which XLA
    fuses differently in a layer's slice than in the whole stack: 2 of 18,600 elements one bfloat16 step apart.
    (Over more steps this tiny model at learning rate 1e-2 amplifies such a difference, as it would any.)"""
    _, plain, _ = _steps(False, steps=1, weight_dtype="bfloat16")
    _, streamed, _ = _steps(True, steps=1, weight_dtype="bfloat16")
    want, got = _flat(plain), _flat(streamed)
    differ = 0
    for k in want:
        w, g = np.asarray(want[k], np.float32), np.asarray(got[k], np.float32)
        if k.startswith("['params']"):
            np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=0, err_msg=k)
            differ += int(np.sum(g != w))
        else:
            np.testing.assert_array_equal(g, w, err_msg=k)
    assert differ <= 8


def test_a_skipped_step_keeps_every_slice():
    """A non-finite step (skipped) leaves the streamed state as the plain update leaves it: unchanged, the
    schedule's count included; the next step goes on equal."""
    _, plain, plain_stats = _steps(False, steps=3, poison=1)
    _, streamed, stats = _steps(True, steps=3, poison=1)
    assert [bool(s["finite"]) for s in stats] == [True, False, True] == [bool(s["finite"]) for s in plain_stats]
    want, got = _flat(plain), _flat(streamed)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_checkpoints_move_between_runs_with_and_without_offload(tmp_path):
    """A run with offload saves and resumes (the moments come back into host memory), and its checkpoint
    resumes in a run without it, and back: every run's losses are the uninterrupted plain run's."""
    devices = jax.devices()[:4]
    keys = dict(per_device_batch_size=1, ici_fsdp_parallelism=4, checkpoint_period=2, learning_rate_schedule_steps=6)
    run(tiny_config(tmp_path / "plain", steps=6, **keys), devices)
    want = _losses(tmp_path / "plain" / "test" / "metrics.jsonl")
    switched = tmp_path / "switched"
    for steps, offload in ((2, True), (4, False), (6, True)):
        run(tiny_config(switched, steps=steps, optimizer_memory_host_offload=offload, **keys), devices)
    assert _losses(switched / "test" / "metrics.jsonl") == want


@pytest.mark.parametrize("keys, problem", [
    (dict(opt_type="muon"), r"opt_type=muon \(the streamed update slices the state by layer"),
    (dict(opt_type="sgd"), r"opt_type=sgd \(the streamed update slices the state by layer.*SGD keeps no state"),
    (dict(scan_layers=False), r"scan_layers=false \(the update streams the state one layer"),
    (dict(ici_pipeline_parallelism=2), r"pipeline parallelism \(ici_pipeline_parallelism=2: stages split the layer "
                                       r"stack.*\): set ici_pipeline_parallelism=1"),
])
def test_what_the_streamed_update_cannot_run_with_is_refused_as_the_config_loads(keys, problem):
    """Refused as the config loads, so that the trainer, train_compile and the estimator agree."""
    with pytest.raises(ConfigError, match=r"^optimizer_memory_host_offload=true cannot run with " + problem
                       + r".*; or set optimizer_memory_host_offload=false$"):
        tiny_config(optimizer_memory_host_offload=True, **keys)
    with pytest.raises(ConfigError, match=r"with opt_type=muon .*; nor with scan_layers=false "):
        tiny_config(optimizer_memory_host_offload=True, opt_type="muon", scan_layers=False)


def test_devices_without_pinned_host_memory_are_refused(monkeypatch):
    from tessera.optimizer_offload import check_offload

    class Memory:
        kind = "device"

    class Device:
        platform = "gpu"

        def addressable_memories(self):
            return [Memory()]

    class Mesh:
        devices = np.array([Device()])

    with pytest.raises(ConfigError, match=r"^optimizer_memory_host_offload=true keeps the moments in pinned host "
                                          r"memory, which gpu devices here do not have \(memories: \['device'\]\); "
                                          r"set optimizer_memory_host_offload=false$"):
        check_offload(Mesh())
    check_offload(setup(tiny_config(), jax.devices()[:1]).mesh)  # CPU devices have it


def test_the_tpu_compile_keeps_the_moments_in_host_memory(tmp_path):
    """AOT for v5p-8: the moments (two copies of the parameters) are host arguments, reported apart from the
    HBM total; the device's arguments shrink by as much, and its temporaries do not take them back (one layer of
    8 at a time). In bfloat16 (the weights here), moving one layer of the norms' scales from host memory did not
    compile ("Strided Host<->HBM DMAs are not supported when slicing partial tiles along sublanes"): their
    moments stay on the devices."""
    from tessera.config import load_config
    from tessera.train_compile import compile_for_topology

    def report(offload):
        values = {**TINY, "base_emb_dim": 256, "base_mlp_dim": 512, "base_num_query_heads": 4, "base_num_kv_heads": 4,
                  "head_dim": 64, "base_num_decoder_layers": 8, "vocab_size": 512, "max_target_length": 128,
                  "base_output_directory": str(tmp_path), "run_name": f"aot_{offload}",
                  "weight_dtype": "bfloat16", "compile_topology": "v5p-8",
                  "optimizer_memory_host_offload": offload}
        return compile_for_topology(load_config(["configs/base.yml", *(f"{k}={v}" for k, v in values.items())],
                                                env={}))

    plain, offloaded = report(False), report(True)
    params = plain.argument_bytes - 2 * plain.argument_bytes // 3  # parameters + two moments of their size
    assert plain.host_bytes == 0 and offloaded.host_bytes == pytest.approx(2 * params, rel=0.02)
    assert offloaded.argument_bytes == pytest.approx(plain.argument_bytes - offloaded.host_bytes, rel=0.02)
    # what the update brings in at a time: the moments outside the stack and a layer's, well under the moments
    # (7.6 MB here); the whole state moved in at once added twice the moments, old and new. The figure varies with
    # what the process compiled before (both steps' temporaries did): 0.9 MB more in a process of its own, 2.6 MB
    # in a CI worker after its other TPU compiles
    assert offloaded.temp_bytes - plain.temp_bytes < 2 * params / 2
    assert offloaded.total_bytes < plain.total_bytes - params


def test_on_cpu_devices_it_says_it_saves_nothing(caplog):
    """CPU devices' memory is the host's: the offload runs (the tests above) but saves nothing, and says so."""
    setup(tiny_config(optimizer_memory_host_offload=True), jax.devices()[:1])
    assert ("optimizer_memory_host_offload=true saves no memory on CPU devices, whose memory is the host's; the "
            "update runs a layer at a time all the same (set it to false here)") in caplog.text


def test_moments_the_host_cannot_hold_stop_the_run_before_anything_is_allocated(monkeypatch):
    """On an accelerator the moments live in the host's memory, one share per local device: more than the host
    has left is an OutOfMemory that says what to change (here the platform is made to read as a TPU's, and the
    host's room as a byte short of the moments)."""
    from tessera import memory_fit

    trainer = setup(tiny_config(per_device_batch_size=1, ici_fsdp_parallelism=4, optimizer_memory_host_offload=True),
                    jax.devices()[:4])
    memory_fit.check_host_holds_offloaded_state(trainer)  # CPU devices: their memory is the host's, counted already
    per_device = memory_fit.state_bytes(trainer)["opt_state"]
    monkeypatch.setattr(memory_fit, "offloaded_to_host", lambda _: True)
    monkeypatch.setattr(memory_fit, "host_bounds", lambda: [(4 * per_device, "ulimit -v", True),  # not resident
                                                            (4 * per_device - 1, "available host memory", False)])
    with pytest.raises(memory_fit.OutOfMemory) as e:
        memory_fit.check_host_holds_offloaded_state(trainer)
    assert str(e.value) == (
        f"not enough host memory for the offloaded optimizer state: optimizer_memory_host_offload=true keeps "
        f"{memory_fit.format_bytes(4 * per_device)} of AdamW's moments in this host's memory "
        f"({memory_fit.format_bytes(per_device)} for each of its 4 device(s)), and it has "
        f"{memory_fit.format_bytes(4 * per_device - 1)} left (available host memory). Nothing was allocated; set optimizer_memory_host_offload=false, or spread the state over more "
        "chips (a larger slice, or more slices with dcn_fsdp_parallelism)")
    assert memory_fit.device_state_bytes(trainer) == memory_fit.state_bytes(trainer)["params"]


def test_the_gradients_reach_the_streamed_update_sharded_as_their_parameters():
    """AOT for v6e-256 at fsdp 16 x tensor 16 (splash attention, bf16): the gradients of the stacked query, key and
    value weights are held at their share, [layers, embed / 16, heads / 16, head]. Read a layer at a time by the
    streamed update, nothing told XLA their layout, and it kept them whole over `tensor`, 16 times their share (the
    sizing guide's 900B dense model: 38.55 GiB per chip, 30.69 with them sharded)."""
    from tessera.config import load_config
    from tessera.step import compile_step
    from tessera.train_compile import compile_slice, topology_devices

    values = {"model_name": "1b", "base_emb_dim": 4096, "base_mlp_dim": 16384, "head_dim": 256,
              "base_num_query_heads": 64, "base_num_kv_heads": 16, "base_num_decoder_layers": 2, "vocab_size": 32000,
              "max_target_length": 2048, "per_device_batch_size": 0.0625, "dtype": "bfloat16",
              "weight_dtype": "bfloat16", "attention": "flash", "remat_policy": "minimal",
              "ici_fsdp_parallelism": 16, "ici_tensor_parallelism": 16, "compile_topology": "v6e-256",
              "optimizer_memory_host_offload": True}
    cfg = load_config(["configs/base.yml", *(f"{k}={v}" for k, v in values.items())], env={})
    trainer = setup(cfg, topology_devices(compile_slice(cfg), 1))
    hlo = compile_step(trainer, 0)[0].as_text()
    shares = {"query": "bf16[2,256,4,256]", "key and value": "bf16[2,256,1,256]"}
    whole = {"query": "bf16[2,256,64,256]", "key and value": "bf16[2,256,16,256]"}
    assert all(shape in hlo for shape in shares.values())
    assert [name for name, shape in whole.items() if shape in hlo] == []
