"""Training: same losses on every mesh, accumulation, FLOPs formula, end-to-end runs."""

import dataclasses
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time
import tracemalloc

import jax
import numpy as np
import pytest

import tessera.train
from conftest import REPO, TINY, refused_or_one_devices_losses, tiny_config
from tessera.checkpointing import CheckpointError, Checkpointer
from tessera.config import ConfigError, load_config
from tessera.evaluation import Evaluator
from tessera import metrics
from tessera.hardware import peak_tflops
from tessera.loop_records import RunClock, time_line
from tessera.memory_fit import state_bytes
from tessera.metrics import run_report, training_flops_per_step
from tessera.run_folder import loss_text
from tessera.step import abstract_state, compile_step, setup
from tessera.train import format_changed_keys, run

MESHES = {
    "1 device": (1, {}),
    "8 data": (8, dict(ici_data_parallelism=8, ici_fsdp_parallelism=1)),
    "2 data x 4 fsdp": (8, dict(ici_data_parallelism=2, ici_fsdp_parallelism=4)),
    "2 fsdp x 4 tensor": (8, dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=4)),
    "2 data x 2 fsdp x 2 sequence": (8, dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_sequence_parallelism=2)),
    # a dense model's expert axis is one more fsdp axis (Parallelism.md)
    "2 fsdp x 2 expert x 2 tensor, dense": (8, dict(ici_fsdp_parallelism=2, ici_expert_parallelism=2,
                                                     ici_tensor_parallelism=2)),
    "8 data, ZeRO-1": (8, dict(ici_data_parallelism=8, ici_fsdp_parallelism=1, shard_optimizer_over_data=True)),
    "2 data x 4 fsdp, ZeRO-1": (8, dict(ici_data_parallelism=2, ici_fsdp_parallelism=4,
                                        shard_optimizer_over_data=True)),
}


def _losses(tmp_path, name, num_devices, **overrides):
    cfg = tiny_config(tmp_path / name, per_device_batch_size=8 / num_devices, **overrides)
    report = run(cfg, jax.devices()[:num_devices])
    records = [json.loads(line) for line in (tmp_path / name / "test" / "metrics.jsonl").read_text().splitlines()]
    assert report["steps"] == len(records) == cfg.run.steps
    return np.array([r["loss"] for r in records])


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("ref"), "ref", 1)


@pytest.mark.parametrize("mesh", [m for m in MESHES if m != "1 device"])
@pytest.mark.slow
def test_same_losses_on_every_mesh(mesh, reference_losses, tmp_path):
    # Tolerance: the first loss sees identical weights, so only the order of float32 sums
    # differs (1e-6 relative). Later steps follow AdamW updates, which divide by |g| and so
    # amplify those rounding differences in near-zero gradient entries: 1e-4 relative.
    num_devices, overrides = MESHES[mesh]
    losses = _losses(tmp_path, "m", num_devices, **overrides)
    np.testing.assert_allclose(losses[0], reference_losses[0], rtol=1e-6)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


def test_a_mesh_xla_cpu_miscompiles_is_refused_or_computes_one_devices_losses(tmp_path):
    """data 2 x fsdp 2 x tensor 2 trained other losses than one device on CPU (0.6% at step 1, with one
    sequence per batch shard): XLA:CPU exchanges rows in the attention's output projection
    (tessera.cpu_miscompile). Never silently wrong: either the mesh is refused, because the
    einsum is wrong on it here, or its losses are one device's."""
    refused_or_one_devices_losses(
        tmp_path, dict(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2),
        r"on CPU, this jax \(.*\) computes wrong results on a mesh with data 2, fsdp 2, tensor 2")


def test_gradient_accumulation_equals_one_big_batch(reference_losses, tmp_path, caplog):
    with caplog.at_level("INFO", logger="tessera"):
        losses = _losses(tmp_path, "acc", 1, gradient_accumulation_steps=4)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)
    # the batch is split, not multiplied as MaxText's key does: the log says which batch a run trains on
    assert re.search(r"parameters, global batch (\d+) x 12 tokens in 4 micro-batches of (\d+)", caplog.text)


def _state_bytes_per_device(trainer, part):
    return state_bytes(trainer)[part]


def test_zero1_adds_data_to_the_first_dimension_that_all_its_axes_divide():
    """over_data: the data axis goes in front of a dimension's axes only where the product of all of them
    divides the dimension (6 over tensor 2 x data 2 does not: the next dimension, or none)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tessera.step import over_data

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    cases = [(("fsdp", None), (4, 6), P(("data", "fsdp"), None)),
             (("tensor",), (6,), P("tensor")),  # 6 % (2 x 2): left as it was
             (("tensor", None), (6, 8), P("tensor", "data")),
             ((None, None), (3, 4), P(None, "data")),
             ((("data", "fsdp"),), (8,), P(("data", "fsdp")))]  # already split over data
    for spec, shape, want in cases:
        assert over_data(NamedSharding(mesh, P(*spec)), shape).spec == want, (spec, shape)


def test_zero1_splits_the_optimizer_state_over_data_and_not_the_parameters():
    mesh = dict(ici_data_parallelism=4, ici_fsdp_parallelism=2)
    plain = setup(tiny_config(**mesh), jax.devices())
    zero1 = setup(tiny_config(**mesh, shard_optimizer_over_data=True), jax.devices())
    assert _state_bytes_per_device(zero1, "params") == _state_bytes_per_device(plain, "params")
    # every matrix of AdamW's two moments is split 4 more ways; only small vectors (norm scales)
    # and scalars, whose dimensions data does not divide after fsdp, may stay as they were
    shapes = jax.tree.leaves(abstract_state(plain)["opt_state"])
    split = [sh.shard_shape(s.shape) for s, sh in zip(shapes, jax.tree.leaves(zero1.state_shardings["opt_state"]))]
    whole = [sh.shard_shape(s.shape) for s, sh in zip(shapes, jax.tree.leaves(plain.state_shardings["opt_state"]))]
    matrices = [(np.prod(a), np.prod(b)) for a, b, s in zip(split, whole, shapes) if len(s.shape) >= 2]
    assert matrices and all(a * 4 == b for a, b in matrices)
    assert _state_bytes_per_device(zero1, "opt_state") < 0.3 * _state_bytes_per_device(plain, "opt_state")
    for spec in (s.spec for s in jax.tree.leaves(zero1.state_shardings["params"])):
        assert "data" not in jax.tree.leaves(tuple(spec))
    # the compiler agrees: the step's arguments (state + batch) shrink by 3/4 of the moments
    args = [compile_step(t, 0)[0].memory_analysis().argument_size_in_bytes for t in (plain, zero1)]
    saved = _state_bytes_per_device(plain, "opt_state") - _state_bytes_per_device(zero1, "opt_state")
    assert args[0] - args[1] == saved


def test_training_reduces_loss(tmp_path):
    losses = _losses(tmp_path, "long", 8, steps=40, learning_rate=2e-2, warmup_steps_fraction=0.1)
    assert losses[-5:].mean() < losses[:5].mean() - 0.5


@pytest.mark.slow
def test_a_step_after_a_save_or_an_evaluation_is_timed_without_it(tmp_path, monkeypatch):
    """Host work between steps logs its own time (a save's log line, an evaluation's eval_seconds);
    the next step's step_seconds must not count it. Each save and evaluation here takes 1.5 s
    longer (a slow disk, a long eval set): saves after steps 2, 4, 6, evaluations after 3 and 6.
    Before, steps 3, 4 and 5 each reported over 1.5 s."""
    def slowed(original):
        def slow(*args, **kwargs):
            time.sleep(1.5)
            return original(*args, **kwargs)
        return slow

    monkeypatch.setattr(Checkpointer, "save", slowed(Checkpointer.save))
    monkeypatch.setattr(Evaluator, "run", slowed(Evaluator.run))
    cfg = tiny_config(tmp_path, steps=6, checkpoint_period=2, async_checkpointing=False, eval_interval=3,
                      eval_steps=1)
    report = run(cfg, jax.devices()[:1])
    records = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    steps = {r["step"]: r["step_seconds"] for r in records if "eval_loss" not in r}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6] and [r["step"] for r in evals] == [3, 6]
    assert max(steps.values()) < 0.75, steps
    # the report's time puts the 4.5 s of the three saves and the 3 s of the two evaluations in their
    # phases, not in training; the phases add up to the whole
    t = report["time"]
    assert t["checkpoint_seconds"] >= 4.5 and t["evaluation_seconds"] >= 3.0, t
    assert sum(steps.values()) <= t["training_seconds"] < 4.5, t
    assert 0 < t["input_seconds"] < t["training_seconds"], t
    phases = sum(t[f"{p}_seconds"] for p in ("setup", "state", "compile", "training", "evaluation", "checkpoint"))
    assert phases == pytest.approx(t["total_seconds"], abs=1e-6)
    assert t["goodput"] == pytest.approx(t["training_seconds"] / t["total_seconds"])
    assert json.loads((tmp_path / "test" / "report.json").read_text())["time"] == t


@pytest.mark.slow
def test_target_eval_loss_stops_at_the_first_evaluation_that_reaches_it(tmp_path, caplog):
    """A run without a target gives the eval losses; with a target just above the one of step 4
    the run stops at the first evaluation at or below it, with the same losses up to there and a
    checkpoint of that step. The same command again has nothing to do (its state is at the
    target); with the target unset it resumes there and ends with the losses of the run that never
    stopped."""
    caplog.set_level(logging.INFO, logger="tessera")
    keys = dict(steps=8, eval_interval=2, eval_steps=1, checkpoint_period=100, async_checkpointing=False)

    def records(folder):
        lines = (folder / "test" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    run(tiny_config(tmp_path / "plain", enable_checkpointing=False, **keys), jax.devices()[:1])
    plain = records(tmp_path / "plain")
    evals = {r["step"]: r["eval_loss"] for r in plain if "eval_loss" in r}
    target = evals[4] * (1 + 1e-6)
    stop = min(step for step, loss in evals.items() if loss <= target)  # 4, or 2 if step 2 is already below
    assert stop < 8

    cfg = tiny_config(tmp_path / "target", target_eval_loss=target, **keys)
    report = run(cfg, jax.devices()[:1])
    got = records(tmp_path / "target")
    assert [r["step"] for r in got if "eval_loss" not in r] == list(range(1, stop + 1))
    np.testing.assert_allclose([r["loss"] for r in got if "eval_loss" not in r],
                               [r["loss"] for r in plain if "eval_loss" not in r][:stop], rtol=1e-6)
    assert report["target_eval_loss_reached_at"] == stop and report["steps"] == stop
    assert Checkpointer(cfg.checkpoint, cfg_dir := str(tmp_path / "target" / "test" / "checkpoints")).latest_step() \
        == stop, cfg_dir
    assert f"is at or below target_eval_loss={target:g}: stopping at step {stop} of 8" in caplog.text

    again = run(cfg, jax.devices()[:1])
    assert again["steps"] == 0 and len(records(tmp_path / "target")) == len(got)
    assert f"the state of step {stop} has eval loss" in caplog.text

    run(tiny_config(tmp_path / "target", **keys), jax.devices()[:1])
    resumed = [r for r in records(tmp_path / "target")[len(got):] if "eval_loss" not in r]
    assert [r["step"] for r in resumed] == list(range(stop + 1, 9))
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in plain if "eval_loss" not in r][stop:],
                               rtol=1e-5)
    with pytest.raises(ConfigError, match="eval_interval=0 never evaluates"):
        tiny_config(target_eval_loss=2.0)


@pytest.mark.slow
def test_a_second_run_loads_its_steps_from_jax_cache_dir(tmp_path):
    """jax_cache_dir (relative, as a user types it): the first run compiles and writes its programs
    there; a second run of the same model (another run_name) loads the train and eval steps instead
    of compiling them, and says so."""
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # cache even these quick compiles
    tiny = [f"{k}={v}" for k, v in TINY.items()]

    def train(name):
        cmd = [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"), *tiny, f"run_name={name}",
               "base_output_directory=out", "jax_cache_dir=cache", "eval_interval=3", "eval_steps=1"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [line for line in proc.stderr.splitlines() if "step compiled in" in line]

    first = train("first")
    assert len(first) == 2 and not any("loaded from the compilation cache" in line for line in first), first
    assert any(p.name.startswith("jit_train_step-") for p in (tmp_path / "cache").iterdir())
    second = train("second")
    assert len(second) == 2 and all(line.endswith("(loaded from the compilation cache)") for line in second), second


def test_an_unreadable_jax_cache_entry_gets_a_line_that_says_to_delete_it(caplog, tmp_path):
    """JAX compiles again when an entry of the cache cannot be read (cut short by a kill while it was
    written), but never replaces it: every later run compiled it again, and JAX's UserWarning, with
    its own file and line, did not say to delete it."""
    import warnings

    from tessera import compile_cache

    def cache_probe_1729(x):
        return x * 3 + 1

    from jax._src import compilation_cache as jax_cache

    folder = str(tmp_path / "cache")  # the suite compiles without a persistent cache (conftest.py): one of its own
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        assert int(jax.jit(cache_probe_1729)(1)) == 4
        entry, = [p for p in os.listdir(folder) if p.startswith("jit_cache_probe_1729-")]
        with open(os.path.join(folder, entry), "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        jax.clear_caches()
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="tessera"):
            warnings.simplefilter("always")
            warnings.showwarning = compile_cache._explaining_unreadable_entries(warnings.showwarning)
            assert int(jax.jit(cache_probe_1729)(2)) == 7
    finally:  # the later tests of this process compile without it again
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        jax_cache.reset_cache()
    assert (f"compilation cache: the entry of jit_cache_probe_1729 in {folder} cannot be read (" in caplog.text
            and f"delete {folder}/jit_cache_probe_1729-*-cache" in caplog.text), caplog.text


def test_flops_formula_matches_xla_cost_analysis():
    # Unrolled layers: XLA's cost analysis counts a scanned loop body once, not per layer.
    cfg = tiny_config(scan_layers=False, base_emb_dim=128, base_mlp_dim=512, head_dim=32, vocab_size=256,
                      max_target_length=64, base_num_decoder_layers=2, per_device_batch_size=8)
    trainer = setup(cfg, jax.devices()[:1])
    compiled, _ = compile_step(trainer, 0)
    cost = compiled.cost_analysis()
    xla_flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    ours = training_flops_per_step(cfg.model, trainer.plan.global_batch, cfg.data.max_target_length, causal=False)
    # Ours counts matmuls only; XLA also counts elementwise work (norms, softmax, AdamW),
    # about 2% at these sizes. So: ours <= XLA <= 1.05 x ours.
    assert ours <= xla_flops <= 1.05 * ours, (ours, xla_flops)
    causal = training_flops_per_step(cfg.model, trainer.plan.global_batch, cfg.data.max_target_length)
    assert causal < ours


@pytest.mark.parametrize("keys", [
    dict(decoder_block="mistral", sliding_window_size=4),
    dict(decoder_block="gemma2", sliding_window_size=4),
    dict(decoder_block="gemma3", sliding_window_size=4, base_num_decoder_layers=8),
    dict(decoder_block="gpt_oss", sliding_window_size=4, num_experts=4, num_experts_per_tok=2,
         mlp_activations=["sigmoid", "linear"]),
    dict(decoder_block="llama2"),
    dict(decoder_block="llama4", chunk_attn_window_size=4, nope_layer_interval=4, num_experts=4,
         num_experts_per_tok=1, routed_score_func="sigmoid"),
], ids=lambda keys: keys["decoder_block"])
def test_flops_count_the_scores_inside_each_layers_window(keys):
    """The FLOPs formula reads each layer's window from `layer_windows` (and its chunk from
    `layer_chunks`), which must be what the built model's attention layers have, bottom to top; a
    layer of window W over T tokens counts T*W - W^2/2 scores (T^2/2 without one: the causal
    convention, the band's diagonal counted half), the exact count of its visible pairs less W/2;
    one of chunks of C, T*C/2 (each chunk's square halved)."""
    from flax import nnx

    from tessera.config.layers import layer_chunks, layer_windows
    from tessera.metrics import keys_per_query
    from tessera.models.decoder import Decoder

    m = tiny_config(scan_layers=False, **{"base_num_decoder_layers": 4, **keys}).model
    decoder = Decoder(m, "dot_product", nnx.Rngs(0))
    attentions = []
    for i in range(decoder.num_blocks):
        block = getattr(decoder, f"layers_{i}")
        layers = [getattr(block, name) for name in ("local_layer", "global_layer") if hasattr(block, name)]
        layers += [getattr(block, f"layer_{j}") for j in range(6) if hasattr(block, f"layer_{j}")]
        attentions += [layer.attention for layer in layers or [block]]
    for j in range(decoder.tail_layers):
        attentions.append(getattr(decoder.tail, f"layer_{j}").attention)
    built = [a.window for a in attentions]
    assert layer_windows(m) == built and len(built) == m.num_decoder_layers
    chunks = [a.chunk for a in attentions]
    assert layer_chunks(m) == chunks
    length = 16
    for window in set(built):
        pairs = sum(min(q + 1, window or length) for q in range(length))  # each query's visible keys
        convention = length * length / 2 if not window else length * window - window * window / 2
        assert keys_per_query(length, window) * length == convention == pairs - (window or length) / 2
    for c in set(chunks) - {0}:
        pairs = sum(q % c + 1 for q in range(length))  # a query sees its chunk's keys up to itself
        assert keys_per_query(length, 0, chunk=c) * length == length * c / 2 == pairs - length / 2
    full = training_flops_per_step(dataclasses.replace(m, sliding_window_size=0, chunk_attn_window_size=0), 1, length)
    per_score = 3 * 2 * m.num_query_heads * 2 * m.head_dim  # forward + backward, q.k and p.v, per (query, key)
    saved = sum(length * length / 2 - length * w + w * w / 2 for w in built if w)
    saved += sum(length * length / 2 - length * c / 2 for c in chunks if c)
    assert full - training_flops_per_step(m, 1, length) == pytest.approx(per_score * saved)


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    # the NVL cards are not the SXM parts their names contain (989 was taken: MFU 15% too low), nor a GB200 a B200
    assert peak_tflops("NVIDIA H100 NVL") == 835.5 and peak_tflops("NVIDIA H200 NVL") == 835.5
    assert peak_tflops("NVIDIA GB200") == 2500.0 and peak_tflops("NVIDIA B200") == 2250.0
    assert peak_tflops("NVIDIA GH200 480GB") == 989.0
    assert peak_tflops("TPU v5 lite") == 197.0 and peak_tflops("TPU v5p") == 459.0
    assert peak_tflops("TPU v6 lite") == 918.0 and peak_tflops("TPU v4") == 275.0
    for kind in ("NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA B200", "AMD Instinct MI300X", "AMD Instinct MI355X"):
        assert peak_tflops(kind) is not None, kind
    assert peak_tflops("cpu") is None


def test_run_clock_puts_every_second_in_exactly_one_phase():
    now = [100.0]
    clock = RunClock(clock=lambda: now[0])

    def spend(seconds):
        now[0] += seconds

    spend(1.0)  # setup
    clock.switch("state")
    spend(2.0)
    clock.switch("training")
    spend(3.0)
    with clock.taking_input():  # counted as input, and still as training
        spend(0.5)
    with clock.during("checkpoint"):
        spend(4.0)
        with clock.during("evaluation"):
            spend(0.25)
        spend(1.0)  # back in checkpoint
    spend(0.25)  # back in training
    t = clock.summary()
    assert t == {"total_seconds": 12.0, "setup_seconds": 1.0, "state_seconds": 2.0, "compile_seconds": 0.0,
                 "training_seconds": 3.75, "evaluation_seconds": 0.25, "checkpoint_seconds": 5.0,
                 "input_seconds": 0.5, "steps_redone": 0, "goodput": 3.75 / 12.0}
    assert clock.phase == "training"
    assert time_line(t) == ("time: 12.0 s in all; training 3.8 s (goodput 31%; taking batches 0.5 s of it), "
                            "checkpoint 5.0 s, state 2.0 s, setup 1.0 s, evaluation 0.2 s")
    with pytest.raises(ValueError, match="unknown phase 'saving'"):
        clock.switch("saving")


def test_run_report_uses_medians_after_warmup():
    records = [{"loss": 5.0 - i, "step_seconds": s, "tflops_per_sec_per_device": 1 / s,
                "tokens_per_sec_per_device": 10 / s, "mfu": None} for i, s in enumerate([9.0, 1.0, 2.0, 3.0])]
    report = run_report(records, warmup_steps=1)
    assert report["step_seconds"] == 2.0 and report["final_loss"] == 2.0 and report["mfu"] is None
    assert report["steps_in_medians"] == 3


def test_the_metrics_writer_does_not_keep_each_steps_record(tmp_path):
    """A long run's host memory: the writer kept every step's record dict for the report (about 420
    bytes a step, 0.4 GB over a million steps). It keeps the report's numbers (8 bytes a median a
    step) and the report is the same as over the records."""
    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", None, log_period=10**9, write_files=False)
    records = [{"step": step, "loss": 3.0 + step % 7, "grad_norm": 1.0 + step, "learning_rate": 1e-3 * step,
                "step_seconds": 0.5 + (step * 37 % 101) / 100, "tflops_per_sec_per_device": 1.0 / step,
                "tokens_per_sec_per_device": 10.0 * step, "mfu": None} for step in range(1, 20_001)]
    records[-1]["no_targets"] = records[5]["skipped"] = True
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for record in records:
            writer.write(dict(record))  # a fresh dict a step, as StepMeter.record makes
        per_step = (tracemalloc.get_traced_memory()[0] - before) / len(records)
    finally:
        tracemalloc.stop()
    assert per_step < 64, f"{per_step:.0f} bytes of host memory kept per step"
    assert run_report(writer.steps, warmup_steps=3) == run_report(records, warmup_steps=3)
    report = run_report(writer.steps, warmup_steps=3)
    assert (report["steps"], report["steps_in_medians"], report["steps_skipped"]) == (20_000, 19_997, 1)
    assert report["final_loss"] == records[-2]["loss"] and report["mfu"] is None
    assert report["step_seconds"] == statistics.median(r["step_seconds"] for r in records[3:])


def test_the_metrics_writer_does_not_keep_each_evaluations_record(tmp_path):
    """eval_interval=1 over a long run: the writer kept every evaluation's record (about 400 bytes each)
    where the report needs the last one (an evaluation at target_eval_loss ends the loop)."""
    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", None, log_period=1, write_files=False)
    records = [{"step": step, "eval_loss": 2.0 + 1 / step, "eval_perplexity": 7.0 + 1 / step, "eval_tokens": 96,
                "eval_batches": 2, "eval_seconds": 0.01 * step} for step in range(1, 5_001)]
    logging.getLogger("tessera.metrics").disabled = True  # a line per evaluation is not what is measured
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for record in records:
            writer.write_eval(dict(record))
        per_eval = (tracemalloc.get_traced_memory()[0] - before) / len(records)
    finally:
        tracemalloc.stop()
        logging.getLogger("tessera.metrics").disabled = False
    assert per_eval < 64, f"{per_eval:.0f} bytes of host memory kept per evaluation"
    assert writer.last_eval == records[-1]


def test_the_final_loss_is_the_last_step_with_target_tokens():
    """A last step without target tokens reports loss 0 and makes no update: the report's final loss
    is the step before it (it was 0, which read as a perfectly trained model); none if no step had any."""
    records = [{"loss": 3.0, "step_seconds": 1.0, "tflops_per_sec_per_device": 1.0, "tokens_per_sec_per_device": 1.0,
                "mfu": None}, {"loss": 0.0, "step_seconds": 1.0, "tflops_per_sec_per_device": 1.0,
                               "tokens_per_sec_per_device": 1.0, "mfu": None, "no_targets": True}]
    assert run_report(records, warmup_steps=0)["final_loss"] == 3.0
    assert run_report(records[1:], warmup_steps=0)["final_loss"] is None
    assert loss_text(None) == "none (no step had target tokens)" and loss_text(2.0) == "2.0000"


def test_metrics_and_the_report_are_strict_json_with_a_non_finite_loss(tmp_path):
    """A NaN loss or an infinite gradient norm (on_nonfinite_loss=skip_step trains on after one) is
    written as null: json.dumps wrote NaN and Infinity, which strict readers (JSON.parse, Go, DuckDB)
    refuse for the whole file. The report's medians still come from the numbers."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    writer = metrics.MetricsWriter(tmp_path / "metrics.jsonl", None, log_period=1)
    written = [{"step": step, "loss": loss, "grad_norm": float("inf"), "step_seconds": 1.0,
                "tflops_per_sec_per_device": 1.0, "tokens_per_sec_per_device": 1.0, "mfu": None}
               for step, loss in enumerate([float("nan"), 2.0], start=1)]
    for record in written:
        writer.write(record)
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(None, None), (2.0, None)]
    report = run_report(written[:1], warmup_steps=0, time={"goodput": float("nan")})
    assert json.loads(metrics.to_json(report, indent=2), parse_constant=refuse)["final_loss"] is None


def test_train_py_end_to_end(tmp_path):
    cmd = [sys.executable, str(REPO / "train.py"), str(REPO / "configs" / "base.yml"), "run_name=e2e",
           f"base_output_directory={tmp_path}", "steps=3", "steps=4", "per_device_batch_size=1", "max_target_length=32",
           "base_num_decoder_layers=2", "profiler=xplane", "skip_first_n_steps_for_profiler=1", "profiler_steps=2",
           "report_warmup_steps=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "e2e"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "step_seconds", "tflops_per_sec_per_device", "tokens_per_sec_per_device", "mfu"):
        assert key in records[0]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == 4 and report["steps_in_medians"] == 3 and report["num_devices"] == 8
    assert report["final_loss"] == records[-1]["loss"] and report["mfu"] is None  # cpu: not in the peak table
    assert len(report["config_digest"]) == 16 and report["device_kind"] == "cpu"
    # train.py starts the clock before it reads the config; compiling is part of the compile phase
    t = report["time"]
    assert t["setup_seconds"] > 0 and t["compile_seconds"] >= report["compile_seconds"] > 0
    assert 0 < t["goodput"] < 1 and t["checkpoint_seconds"] > 0  # the last step is saved
    assert f"time: {t['total_seconds']:.1f} s in all; training {t['training_seconds']:.1f} s" in proc.stderr
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run_dir / "profile").rglob("*.xplane.pb"))
    assert (run_dir / "config.yml").is_file()
    assert "step     4 | loss" in proc.stderr
    # the config is read before JAX's import (a config error ends there) and again by main: its notes once
    assert proc.stderr.count("steps is given twice on the command line (steps=3, then steps=4)") == 1
    # a CPU run restarts itself with mimalloc preloaded (Linux; the lock installs cmeel-mimalloc there)
    assert f"host malloc: {'mimalloc' if sys.platform == 'linux' else 'system'}" in proc.stderr


@pytest.mark.parametrize("bad, error", [
    (dict(dataset_type="hf", hf_path="json", hf_train_files="nowhere/*.json"), ConfigError),  # data
    (dict(ici_fsdp_parallelism=1, ici_tensor_parallelism=3), ConfigError),  # mesh
    (dict(load_parameters_path="nowhere/checkpoints/150"), CheckpointError),  # starting state
])
def test_a_run_that_fails_at_start_writes_nothing(tmp_path, monkeypatch, bad, error):
    monkeypatch.chdir(tmp_path)  # the relative paths above are resolved against it
    with pytest.raises(error):
        run(tiny_config(tmp_path / "out", **bad))
    assert not (tmp_path / "out").exists()


def test_a_finished_run_is_not_compiled_again(tmp_path, monkeypatch, caplog):
    run(tiny_config(tmp_path, steps=2))
    report = (tmp_path / "test" / "report.json").read_text()

    def no_compile(*args):
        raise AssertionError("a finished run must not compile the train step")

    monkeypatch.setattr(tessera.train, "compile_step", no_compile)
    with caplog.at_level("INFO", logger="tessera"):
        again = run(tiny_config(tmp_path, steps=2))
    assert again["steps"] == 0 and again["start_step"] == 2
    assert "nothing to do: the run is already at step 2 of 2" in caplog.text
    assert (tmp_path / "test" / "report.json").read_text() == report  # the first run's report is kept


def test_start_up_log_shows_only_the_keys_that_differ_from_base_yml():
    base = str(REPO / "configs" / "base.yml")
    assert format_changed_keys(load_config([base, "run_name=demo"], env={})) == "run_name=demo"
    cfg = load_config([base, "run_name=d", "steps=7", "mlp_activations=gelu"], env={})
    assert format_changed_keys(cfg) == 'run_name=d, steps=7, mlp_activations=["gelu"]'


def test_trainer_and_train_compile_pass_logical_axes_to_the_sharding_report(monkeypatch):
    # Without the logical axes every large replicated parameter is reported, including norm scales
    # the rules replicate on purpose (tests/test_mesh.py checks the report itself on gpt3-175b/v5e).
    import tessera.mesh
    from tessera import train_compile

    seen = []

    class Reported(Exception):
        pass

    def spy(mesh, shardings, shapes, warn_mib, logical_axes=None):
        seen.append(logical_axes)
        raise Reported  # stop before compiling

    cfg = tiny_config(compile_topology="v5e-4")
    trainer = setup(cfg)
    monkeypatch.setattr(tessera.train, "sharding_report", spy)
    monkeypatch.setattr(tessera.mesh, "sharding_report", spy)
    for call in (lambda: tessera.train._log_shardings(cfg, trainer), lambda: train_compile.compile_for_topology(cfg)):
        with pytest.raises(Reported):
            call()
    assert seen == [trainer.model.logical_axes()] * 2


@pytest.mark.parametrize("error, code, line", [
    ("DataError", 2, "data error: file x.parquet is damaged"),
    ("ConfigError", 2, "config error: file x.parquet is damaged"),
    ("CheckpointError", 2, "checkpoint error: file x.parquet is damaged"),
    ("CheckpointSaveError", 6, "checkpoint save error: file x.parquet is damaged (exit code 6)"),
    ("KeyboardInterrupt", 130, "interrupted (Ctrl-C) outside the training loop"),
])
def test_main_maps_each_failure_to_one_line_and_its_exit_code(monkeypatch, capsys, error, code, line):
    import tessera.checkpointing
    import tessera.data

    kinds = {"DataError": tessera.data.DataError, "ConfigError": ConfigError, "CheckpointError": CheckpointError,
             "CheckpointSaveError": tessera.checkpointing.CheckpointSaveError, "KeyboardInterrupt": KeyboardInterrupt}

    def fail(cfg, clock=None):
        raise kinds[error]("file x.parquet is damaged")

    monkeypatch.setattr(tessera.train, "run", fail)
    monkeypatch.setattr(tessera.train, "initialize", lambda: None)
    assert tessera.train.main([str(REPO / "configs" / "base.yml"), "run_name=x"]) == code
    err = capsys.readouterr().err
    assert line in err and "Traceback" not in err


def test_gradient_clipping_equals_optax_and_keeps_its_state():
    """tessera.optim.clip_by_global_norm against optax's: bit-identical below the threshold, the
    same up to the last bit above it, with or without the step's own norm passed in, and the
    same (empty) state, so checkpoints of the optimizer state keep their structure."""
    import jax.numpy as jnp
    import optax

    from tessera.optim import clip_by_global_norm

    rng = np.random.default_rng(0)
    grads = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
             "b": jnp.asarray(rng.normal(size=7), jnp.float32)}
    norm = optax.tree.norm(grads)
    ours, theirs = clip_by_global_norm, optax.clip_by_global_norm
    assert jax.tree.structure(ours(1.0).init(grads)) == jax.tree.structure(theirs(1.0).init(grads))
    for max_norm in (float(norm) * 2, float(norm) / 3):  # not clipped, clipped
        want, _ = theirs(max_norm).update(grads, theirs(max_norm).init(grads))
        for got, _ in (ours(max_norm).update(grads, optax.EmptyState()),
                       ours(max_norm).update(grads, optax.EmptyState(), global_norm=norm)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                if max_norm > float(norm):
                    np.testing.assert_array_equal(a, b)
                else:
                    np.testing.assert_allclose(a, b, rtol=2e-7, atol=0)
    clipped, _ = ours(float(norm) / 3).update(grads, optax.EmptyState())
    np.testing.assert_allclose(float(optax.tree.norm(clipped)), float(norm) / 3, rtol=1e-6)


def _one_step_inputs(**overrides):
    """(config, trainer on one device, initial state, a batch with padding) for the tiny model."""
    import jax.numpy as jnp

    from tessera.step import create_state

    cfg = tiny_config(**overrides)
    trainer = setup(cfg, jax.devices()[:1])
    t = trainer.plan.max_target_length + 1
    rng = np.random.default_rng(0)
    segments = np.ones((trainer.plan.global_batch, t), np.int32)
    segments[0, t // 2:] = 0  # padding: the mean is over fewer tokens than the batch holds
    batch = {"tokens": jnp.asarray(rng.integers(0, cfg.model.vocab_size, segments.shape), jnp.int32),
             "segment_ids": jnp.asarray(segments),
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segments.shape)}
    return cfg, trainer, create_state(trainer, 0), batch


@pytest.mark.parametrize("mean_in_update", [True, False])  # the CPU's form; the other platforms'
def test_the_gradient_norm_of_bfloat16_weights_is_taken_in_float32(mean_in_update, monkeypatch):
    """weight_dtype=bfloat16: the logged grad_norm (and the clip's) is the norm of the step's bfloat16
    gradients, summed in float32. It was summed in bfloat16, 8 bits: the norm came out rounded to a
    bfloat16 number, 0.2-0.4% off (4.15625 against 4.1619 on the tiny model)."""
    from tessera import step as step_module
    from tessera.losses import loss_sums

    monkeypatch.setattr(step_module, "gradient_mean_in_update", lambda platform: mean_in_update)
    cfg, trainer, state, batch = _one_step_inputs(weight_dtype="bfloat16", per_device_batch_size=4)
    _, stats = jax.jit(step_module.make_train_step(trainer, 0))(state, batch)
    params = state["params"]
    count = float(loss_sums(trainer.model, params, batch, None)[1])
    sums = jax.grad(lambda p: loss_sums(trainer.model, p, batch, None)[0])(params)
    assert {g.dtype for g in jax.tree.leaves(sums)} == {np.dtype(jax.numpy.bfloat16)}
    grads = [np.asarray(g, np.float64) * (1 if mean_in_update else 1 / count) for g in jax.tree.leaves(sums)]
    if not mean_in_update:  # the step divides first, in bfloat16
        grads = [np.asarray(np.asarray(g, jax.numpy.bfloat16), np.float64) for g in grads]
    want = np.sqrt(sum(np.sum(g * g) for g in grads)) / (count if mean_in_update else 1)
    np.testing.assert_allclose(float(stats["grad_norm"]), want, rtol=2e-5)


def test_a_huge_finite_gradient_norm_is_finite_on_cpu(monkeypatch):
    """On CPU the step takes the norm of the gradients' token sums and then x 1/count: their squares overflowed
    float32 count times sooner than the mean's, so that a mean gradient of norm 1e19 (its squares 1e38, below
    float32's 3.4e38) reported grad_norm inf, and the step was taken for a non-finite one (its update skipped, the
    run stopped with exit 3). The norm is that of the mean, as on other platforms, and the clipped update is made."""
    from tessera import step as step_module

    summed = step_module.summed_gradients

    def huge(*args):
        grads, loss_sum, count, auxes = summed(*args)
        factor = 1e19 / step_module.gradient_norm(grads, 1.0 / count)  # a mean gradient of norm 1e19
        return jax.tree.map(lambda g: g * factor, grads), loss_sum, count, auxes

    monkeypatch.setattr(step_module, "summed_gradients", huge)
    assert step_module.gradient_mean_in_update(jax.devices()[0].platform)
    _, trainer, state, batch = _one_step_inputs(gradient_clipping_threshold=1.0)
    before = jax.tree.map(np.asarray, state["params"])
    new_state, stats = jax.jit(step_module.make_train_step(trainer, 0))(state, batch)
    assert bool(stats["finite"]) and float(stats["tokens"]) >= 4  # the sums' norm: >= 4e19, its square past 3.4e38
    np.testing.assert_allclose(float(stats["grad_norm"]), 1e19, rtol=1e-4)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(new_state["params"]))]
    assert any(moved)


@pytest.mark.parametrize("clip", [0.0, 2.0])  # no clipping; clipped (the first gradient norm is about 10)
@pytest.mark.slow
def test_train_step_equals_the_textbook_update(clip):
    """One train step against the update written out plainly: gradient of the summed loss
    divided by the token count, its global norm, optax's clip and AdamW on the divided
    gradient. The step forms the mean inside the update (x 1/count) and the norm as the sum's
    norm x 1/count; both agree with the plain form up to float32 rounding."""
    import optax

    from tessera.losses import loss_sums
    from tessera.step import make_train_step

    cfg, trainer, state, batch = _one_step_inputs(gradient_clipping_threshold=clip)
    new_state, stats = jax.jit(make_train_step(trainer, 0))(state, batch)

    params = state["params"]
    # jitted, a program of its own (op by op, the two passes cost seconds in each case)
    (loss_sum, count), grads = jax.jit(jax.value_and_grad(lambda p: loss_sums(trainer.model, p, batch, None),
                                                          has_aux=True))(params)
    assert 0 < float(count) < batch["tokens"].size  # the padding is left out of the mean
    mean = jax.tree.map(lambda g: g / count, grads)
    o = cfg.optim
    no_decay = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: getattr(path[-1], "key", None) != "scale", p)
    plain = optax.adamw(trainer.schedule, b1=o.adam_b1, b2=o.adam_b2, eps=o.adam_eps,
                        weight_decay=o.adam_weight_decay, mask=no_decay)
    if clip:
        plain = optax.chain(optax.clip_by_global_norm(clip), plain)
    updates, plain_state = plain.update(mean, plain.init(params), params)
    want = optax.apply_updates(params, updates)
    np.testing.assert_allclose(float(stats["grad_norm"]), float(optax.tree.norm(mean)), rtol=1e-6)
    assert float(stats["grad_norm"]) > 2 * clip  # the clipped case does clip
    np.testing.assert_allclose(float(stats["loss"]), float(loss_sum / count), rtol=1e-6)
    # AdamW's step does not change when every gradient is scaled alike, so the moments (the
    # first is 0.1 x the mean, clipped gradient) are what show the mean and the clip.
    moments = [leaf for leaf in jax.tree.leaves(new_state["opt_state"]) if np.ndim(leaf)]
    plain_moments = [leaf for leaf in jax.tree.leaves(plain_state) if np.ndim(leaf)]
    assert len(moments) == len(plain_moments) == 2 * len(jax.tree.leaves(params))
    for got, expected in zip(moments, plain_moments):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(expected))))
    # The first update is lr * g / (|g| + eps): entries of g near zero (cancellations) amplify
    # the float32 rounding of a gradient computed in another program.
    lr = float(trainer.schedule(0))
    for got, expected, before in zip(*map(jax.tree.leaves, (new_state["params"], want, params))):
        np.testing.assert_allclose(got - before, expected - before, rtol=1e-4, atol=1e-3 * lr)


def test_train_step_does_not_divide_the_gradients_in_a_pass_of_their_own():
    """XLA:CPU does not duplicate a divide into its consumers, so g / count over every gradient
    was a pass of its own (about 1% of a step of benchmarks/cpu_llama.py): the compiled step
    must hold no array-sized fusion of the step's own division."""
    import re

    trainer = _one_step_inputs()[1]
    hlo = compile_step(trainer, 0)[0].as_text()
    assert re.findall(r"op_name=\"jit\(train_step\)/cond/", hlo)  # the pattern below can match
    divides = re.findall(r"= f32\[[\d,]+\]\S* fusion\([^\n]*op_name=\"jit\(train_step\)/div\"", hlo)
    assert not divides, divides


def test_a_run_that_waits_for_its_batches_says_the_input_pipeline_set_the_pace(tmp_path, monkeypatch, caplog):
    """Taking a batch takes 0.5 s here (a slow tokenizer, a slow disk): the steps wait for their
    input, the report's input_seconds shows it and one warning says what to change."""
    import tessera.data.synthetic

    original = tessera.data.synthetic.SyntheticData.__next__

    def slow(self):
        time.sleep(0.5)
        return original(self)

    monkeypatch.setattr(tessera.data.synthetic.SyntheticData, "__next__", slow)
    with caplog.at_level("INFO", logger="tessera"):
        report = run(tiny_config(tmp_path, steps=4), jax.devices()[:1])
    t = report["time"]
    assert 2.0 <= t["input_seconds"] <= t["training_seconds"], t
    assert t["input_seconds"] >= 0.5 * t["training_seconds"], t
    warnings = [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and "taking batches" in r.getMessage()]
    assert warnings == [f"taking batches took {t['input_seconds']:.1f} s of the {t['training_seconds']:.1f} s of "
                        f"training ({t['input_seconds'] / t['training_seconds']:.0%}): the input pipeline (synthetic), "
                        "not the devices, set the pace of this run; make the input pipeline cheaper or give it more "
                        "processes"]


def test_the_input_bound_warning_names_what_to_change_for_each_pipeline():
    from tessera.loop_records import input_bound_warning

    slow = {"input_seconds": 6.0, "training_seconds": 10.0}
    assert "raise grain_worker_count" in input_bound_warning(slow, "grain")
    assert "raise grain_worker_count" in input_bound_warning(slow, "tfds")
    assert "dataset_type=grain" in input_bound_warning(slow, "hf")
    assert input_bound_warning({"input_seconds": 4.0, "training_seconds": 10.0}, "hf") is None  # under half
    assert input_bound_warning({"input_seconds": 0.9, "training_seconds": 1.0}, "hf") is None  # under a second


def test_a_resumed_run_traces_the_steps_after_its_start(tmp_path, caplog):
    """skip_first_n_steps_for_profiler counts the steps this run takes (MaxText counts from the start
    step too). Before, a run resumed at step 2 compared its steps with 2 and never traced."""
    run(tiny_config(tmp_path, steps=2), jax.devices()[:1])
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=5, profiler="xplane", skip_first_n_steps_for_profiler=1, profiler_steps=2),
            jax.devices()[:1])
    assert list((tmp_path / "test" / "profile").rglob("*.xplane.pb"))
    assert "profile written to" in caplog.text


def test_the_trace_holds_exactly_profiler_steps_steps(tmp_path):
    """The loop reads a step's stats after dispatching the next one, and the trace stopped when the
    last traced step's stats were read: step last+1 was in every trace too (3 dispatches for
    profiler_steps=2)."""
    from jax._src.lib import _profile_data

    run(tiny_config(tmp_path, steps=6, profiler="xplane", skip_first_n_steps_for_profiler=1, profiler_steps=2),
        jax.devices()[:1])
    trace = _profile_data.ProfileData.from_file(str(next((tmp_path / "test" / "profile").rglob("*.xplane.pb"))))
    spans = sorted((event.start_ns, event.start_ns + event.duration_ns) for plane in trace.planes
                   for line in plane.lines for event in line.events if event.name == "PjitFunction(jit(train_step))")
    outermost = [a for a in spans if not any(b != a and b[0] <= a[0] and a[1] <= b[1] for b in spans)]
    assert len(outermost) == 2, spans  # (each dispatch shows as a pair of nested events of that name)


def test_writing_the_trace_is_not_counted_in_the_next_step(tmp_path, monkeypatch):
    """The trace is written (stop_trace, seconds on a large run) with no step in flight: its time went
    into the next step's step_seconds, a slow step in the metrics that the devices never took."""
    stop_trace = jax.profiler.stop_trace
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: (time.sleep(1.0), stop_trace()))
    run(tiny_config(tmp_path, steps=5, profiler="xplane", skip_first_n_steps_for_profiler=1, profiler_steps=2),
        jax.devices()[:1])
    seconds = {r["step"]: r["step_seconds"] for r in map(json.loads, (tmp_path / "test" / "metrics.jsonl").open())}
    assert seconds[4] < 0.5, seconds  # the trace held steps 2 and 3


def test_the_trace_starts_after_the_step_before_it_and_its_start_is_no_steps_time(tmp_path, monkeypatch):
    """The trace started while the step before its window still ran (its stats are read one step late):
    the trace held a part of that step too, and start_trace's time (a second or more on a large run)
    went into that step's step_seconds, a slow untraced step the devices never took."""
    metrics_file, logged_at_start = tmp_path / "test" / "metrics.jsonl", []
    start_trace = jax.profiler.start_trace

    def slow_start(folder):
        logged_at_start.append(len(metrics_file.read_text().splitlines()))
        time.sleep(1.0)
        start_trace(folder)

    monkeypatch.setattr(jax.profiler, "start_trace", slow_start)
    run(tiny_config(tmp_path, steps=5, profiler="xplane", skip_first_n_steps_for_profiler=2, profiler_steps=2),
        jax.devices()[:1])
    assert logged_at_start == [2]  # steps 1 and 2 done and read before the trace of steps 3-4 starts
    seconds = {r["step"]: r["step_seconds"] for r in map(json.loads, metrics_file.open())}
    assert seconds[2] < 0.5 and seconds[3] < 0.5, seconds


def test_a_trace_that_cannot_be_written_is_a_warning_and_a_profile_file_is_refused_first(tmp_path, caplog):
    """`profile` a file in the run folder: stop_trace raised after the window's last step, and the
    stop at the run's end raised "No profile started" on top of it: two tracebacks, exit 1, the
    rest of the run lost. Now the start refuses it (exit 2), and a trace that still cannot be
    written (a full disk) is a warning: the run trains on."""
    from tessera.loop_records import Profiler
    from tessera.output_folders import check_output_folders

    cfg = tiny_config(tmp_path, steps=3, profiler="xplane", skip_first_n_steps_for_profiler=0, profiler_steps=1)
    run_dir = tmp_path / "test"
    run_dir.mkdir()
    (run_dir / "profile").write_text("not a folder")
    with pytest.raises(ConfigError, match=f"{run_dir / 'profile'} \\(in the run folder, from base_output_directory\\) "
                                          "is a file, where the run writes a folder"):
        check_output_folders(cfg, "")
    profiler = Profiler(cfg, run_dir)
    with caplog.at_level("WARNING", logger="tessera"):
        profiler.before_step(1)
        assert profiler.after_step(1)
        profiler.stop()
    assert f"profiler=xplane: the trace could not be written to {run_dir / 'profile'} (" in caplog.text


WATCHED_TRACE_SCRIPT = """
import sys, time
import jax.profiler
stop_trace = jax.profiler.stop_trace
jax.profiler.stop_trace = lambda: (time.sleep(4), stop_trace())  # a large run's trace takes this long to write
from tessera.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_trace_that_outlasts_step_timeout_seconds_is_named_by_the_watchdog(tmp_path):
    """The watchdog said "no training step finished in 1.x s" while the trace was being written."""
    cmd = [sys.executable, "-c", WATCHED_TRACE_SCRIPT, str(REPO / "configs" / "base.yml"),
           *[f"{k}={v}" for k, v in TINY.items()], "steps=4", f"base_output_directory={tmp_path}", "run_name=t",
           "enable_checkpointing=false", "profiler=xplane", "profiler_steps=1", "step_timeout_seconds=1.5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert ("hang watchdog: writing the trace of steps 2-2 (profiler=xplane, fewer profiler_steps write less) did "
            "not finish in") in proc.stderr, proc.stderr[-3000:]


def test_a_profile_window_after_the_last_step_is_said_at_the_start(tmp_path, caplog):
    """A window past the run's end writes no trace, and one the run's end cuts short holds fewer
    steps than asked: both are said at the start (the short one, before, was not)."""
    from tessera.loop_records import Profiler

    cfg = tiny_config(tmp_path, steps=6, profiler="xplane", skip_first_n_steps_for_profiler=3, profiler_steps=2)
    with caplog.at_level("INFO", logger="tessera"):
        whole = Profiler(cfg, tmp_path, start_step=1)
        assert (whole.first, whole.last) == (5, 6) and not caplog.records  # steps 5 and 6 are traced
        resumed = Profiler(cfg, tmp_path, start_step=2)
        assert (resumed.first, resumed.last) == (6, 7)  # step 6 is traced, step 7 is past the run's end
        Profiler(cfg, tmp_path, start_step=3)
    assert [r.getMessage() for r in caplog.records] == [
        "profiler=xplane: the trace will hold 1 of profiler_steps=2 steps (6-6): the run ends at step 6; raise steps "
        "or lower skip_first_n_steps_for_profiler for all of them",
        "profiler=xplane: no trace will be written: after skip_first_n_steps_for_profiler=3 the trace would start at "
        "step 7, and the run ends at step 6 (it starts after step 3); lower skip_first_n_steps_for_profiler or raise "
        "steps"]


def test_a_second_process_cannot_train_in_a_run_folder_in_use(tmp_path, capsys):
    """The same command started twice: before, both resumed from the same checkpoint and saved into
    the same step folders and metrics. Now the second stops with one line naming the first, before it
    reads anything; once the first is gone (here killed with SIGKILL, which runs no clean-up) the
    run resumes normally."""
    cfg = tiny_config(tmp_path, steps=2)
    run(cfg, jax.devices()[:1])
    folder = tmp_path / "test"
    holder = subprocess.Popen(  # another process holding the lock, as a training process does
        [sys.executable, "-c", "import fcntl, sys, time\n"
         f"f = open({str(folder / '.tessera.lock')!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "f.write('pid 4242 on host elsewhere, since 2026-11-29 01:00:00\\n'); f.flush()\n"
         "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = [str(REPO / "configs" / "base.yml"), *[f"{k}={v}" for k, v in TINY.items()],
                f"base_output_directory={tmp_path}", "run_name=test", "steps=4"]
        assert tessera.train.main(argv) == 2
        err = capsys.readouterr().err
        assert (f"config error: the run folder {folder} is in use by another training process (pid 4242 on host "
                "elsewhere, since 2026-11-29 01:00:00)") in err
        assert "Traceback" not in err
        assert not (folder / "checkpoints" / "4").exists()
    finally:
        holder.kill()
        holder.wait()
    report = run(tiny_config(tmp_path, steps=4), jax.devices()[:1])
    assert report["start_step"] == 2 and report["steps"] == 2
    assert not (folder / ".tessera.lock").exists()  # removed when the run ended


@pytest.mark.parametrize("name", [".tessera.lock", "report.json", "config.yml"])
def test_a_folder_where_the_run_folder_writes_a_file_is_refused_before_compiling(tmp_path, name):
    """A folder named .tessera.lock in the run folder ended the start in an IsADirectoryError traceback (exit 1);
    one named report.json let the run train, then ended it with exit code 6 and 'free some space'; one named
    config.yml was 'the run folder cannot be written: Is a directory'."""
    (tmp_path / "test" / name).mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"test/{re.escape(name)} \(in the run folder, from base_output_directory\) "
                                          "is a folder, where the run writes a file; move it away"):
        run(tiny_config(tmp_path), jax.devices()[:1])


def test_a_resumed_run_counts_the_steps_it_trains_again(tmp_path, caplog):
    """A process that died after logging steps 3 and 4 but before saving them (simulated: their
    records appended to metrics.jsonl, the second cut mid-line by the crash) leaves a checkpoint of
    step 2; the next attempt says it trains 2 steps again and reports them."""
    run(tiny_config(tmp_path, steps=2), jax.devices()[:1])
    metrics_file = tmp_path / "test" / "metrics.jsonl"
    with metrics_file.open("a") as f:
        f.write(json.dumps({"step": 3, "loss": 5.0}) + "\n" + json.dumps({"step": 3, "eval_loss": 5.0}) + "\n")
        f.write(json.dumps({"step": 4, "loss": 5.0}) + "\n" + '{"step": 5, "lo')
    with caplog.at_level("INFO", logger="tessera"):
        report = run(tiny_config(tmp_path, steps=5), jax.devices()[:1])
    assert report["start_step"] == 2 and report["time"]["steps_redone"] == 2
    assert ("the attempt before this one logged 2 step(s) after step 2, lost before they were saved: they are trained "
            "again (metrics.jsonl keeps both records of each; the later one is this attempt's)") in caplog.text
    assert "; 2 step(s) trained again)" in caplog.text  # the time line


def test_a_resume_with_fewer_steps_counts_only_the_steps_it_trains_again(tmp_path, caplog):
    """Steps 3-6 logged and lost, then a resume with steps=4: it said (and reported) 4 steps trained again,
    where it trains 2 (steps 3 and 4) and leaves the lost attempt's records of steps 5 and 6."""
    run(tiny_config(tmp_path, steps=2), jax.devices()[:1])
    with (tmp_path / "test" / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in range(3, 7))
    with caplog.at_level("INFO", logger="tessera"):
        report = run(tiny_config(tmp_path, steps=4), jax.devices()[:1])
    assert report["start_step"] == 2 and report["time"]["steps_redone"] == 2
    assert ("the attempt before this one logged 4 step(s) after step 2, lost before they were saved: steps 3-4 are "
            "trained again (metrics.jsonl keeps both records of each; the later one is this attempt's); steps 5-6, "
            "past steps=4, are not, and their records stay from that attempt") in caplog.text


def test_a_resume_names_the_changed_settings_and_warns_when_the_learning_rate_jumps(tmp_path, caplog):
    """Training a finished run further by raising `steps` stretches the cosine schedule (as long as
    `steps` by default): the rate climbs from its end value back up. The resume says so, with the
    value the next step trains at (the one metrics.jsonl records) and the key that keeps the old
    schedule; with that key set, the rate goes on where it stopped and nothing is said about it."""
    from tessera.optim import learning_rate_schedule

    cfg = tiny_config(tmp_path, steps=2, cosine_learning_rate_final_fraction=0.1)
    run(cfg, jax.devices()[:1])
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=4, cosine_learning_rate_final_fraction=0.1, per_device_batch_size=2),
            jax.devices()[:1])
    records = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()]
    step3 = next(r["learning_rate"] for r in records if r["step"] == 3)
    end = float(learning_rate_schedule(cfg.optim, 2)(2))
    assert step3 > 2 * end  # the jump itself
    assert "settings changed since step 2 was saved: steps 2 -> 4, per_device_batch_size 1.0 -> 2.0" in caplog.text
    assert (f"the learning rate jumps at this resume: step 3 trains at {step3:.3g}, where the schedule step 2 was "
            f"saved with (2 steps long; 4 now) gives {end:.3g}. To continue the schedule it was saved with, add "
            f"learning_rate_schedule_steps=2 (its last step is 2; the steps after it train at its final rate, "
            f"{end:.3g}).") in caplog.text
    # step n trains at schedule(n - 1): the final rate is step 3's of the old schedule, not step 2's (it said
    # "it ends at step 2, at <final rate>", where metrics.jsonl has step 2 above it)
    step2 = next(r["learning_rate"] for r in records if r["step"] == 2)
    assert f"{step2:.3g}" != f"{end:.3g}"

    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):  # the hint followed: the rate stays at the end value
        run(tiny_config(tmp_path, steps=6, cosine_learning_rate_final_fraction=0.1, per_device_batch_size=2,
                        learning_rate_schedule_steps=2), jax.devices()[:1])
    records = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [r["learning_rate"] for r in records if r["step"] in (5, 6)] == pytest.approx([end, end], rel=1e-6)
    assert "steps 4 -> 6, learning_rate_schedule_steps -1 -> 2" in caplog.text
    assert "learning rate jumps" not in caplog.text

    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):  # nothing changed: nothing to say
        run(tiny_config(tmp_path, steps=6, cosine_learning_rate_final_fraction=0.1, per_device_batch_size=2,
                        learning_rate_schedule_steps=2), jax.devices()[:1])
    assert "nothing to do" in caplog.text and "settings changed" not in caplog.text


def test_the_resume_warning_reads_the_schedule_where_the_skipped_steps_left_it(tmp_path, caplog):
    """Skipped steps (on_nonfinite_loss=skip_step) do not advance the schedule: after steps 2 and 3 were
    skipped, step 4 trains at the schedule's rate for 1 update. The resume's warning quoted the rate for
    3 (its step), not the one metrics.jsonl then records for step 4."""
    keys = dict(learning_rate=1e38, warmup_steps_fraction=0.0, gradient_clipping_threshold=0,
                on_nonfinite_loss="skip_step")
    run(tiny_config(tmp_path, steps=3, **keys), jax.devices()[:1])  # step 1's update is finite, ruinous
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=4, **keys), jax.devices()[:1])
    records = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in records] == [False, True, True, True]
    step4 = records[-1]["learning_rate"]
    assert (f"the learning rate jumps at this resume: step 4 trains at {step4:.3g}, where the schedule step 3 was "
            "saved with (3 steps long; 4 now) gives ") in caplog.text
    assert "(its 2 skipped step(s) did not advance the schedule)" in caplog.text


def test_a_wsd_run_decays_from_a_checkpoint_of_its_stable_phase_without_a_jump(tmp_path, caplog):
    """The WSD workflow: a run held at the peak (its decay far off) is decayed from one of its checkpoints by a
    run whose schedule ends where the decay should, its last wsd_decay_steps_fraction the decay. The branch starts
    at the peak the checkpoint trained at (no jump warning) and its steps train at the decay's rates."""
    keys = dict(learning_rate=0.01, warmup_steps_fraction=0.0, lr_schedule_type="wsd",
                cosine_learning_rate_final_fraction=0.1)
    run(tiny_config(tmp_path / "stable", steps=2, learning_rate_schedule_steps=1000, **keys), jax.devices()[:1])
    path = str(tmp_path / "stable" / "test" / "checkpoints" / "2")
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path / "decay", steps=6, learning_rate_schedule_steps=6, wsd_decay_steps_fraction=4 / 6,
                        load_full_state_path=path, **keys), jax.devices()[:1])
    assert "loaded full state at step 2" in caplog.text and "learning rate jumps" not in caplog.text
    records = [json.loads(line) for line in (tmp_path / "decay" / "test" / "metrics.jsonl").read_text().splitlines()]
    # step n trains at the schedule's rate n - 1: the decay's 4 steps from the peak, 0.01, toward 0.001 at step 6's end
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    np.testing.assert_allclose([r["learning_rate"] for r in records], [0.01, 0.00775, 0.0055, 0.00325], rtol=1e-5)


def test_a_full_state_load_warns_when_the_learning_rate_jumps_too(tmp_path, caplog):
    """load_full_state_path continues another run's state at its step: with a longer schedule the rate
    jumps there as on a resume, and the warning says so; with the saved schedule's length it does not."""
    run(tiny_config(tmp_path / "src", steps=2, cosine_learning_rate_final_fraction=0.1), jax.devices()[:1])
    path = str(tmp_path / "src" / "test" / "checkpoints" / "2")
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path / "a", steps=4, cosine_learning_rate_final_fraction=0.1, load_full_state_path=path),
            jax.devices()[:1])
    assert ("the learning rate jumps after this full-state load: step 3 trains at " in caplog.text
            and "(2 steps long; 4 now)" in caplog.text and "add learning_rate_schedule_steps=2" in caplog.text)
    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path / "b", steps=4, cosine_learning_rate_final_fraction=0.1, load_full_state_path=path,
                        learning_rate_schedule_steps=2), jax.devices()[:1])
    assert "loaded full state at step 2" in caplog.text and "learning rate jumps" not in caplog.text


def test_a_resume_and_a_full_state_load_warn_of_model_keys_that_fit_but_compute_another_model(tmp_path, caplog):
    """Checkpointing.md promises a warning when parameters that fit were trained with other model keys
    (a rotary base, a window); load_parameters_path gave it, but a resume and load_full_state_path with
    rope_max_timescale changed trained on with an info line (resume) or no word at all (full state)."""
    run(tiny_config(tmp_path / "src", steps=2), jax.devices()[:1])
    step = tmp_path / "src" / "test" / "checkpoints" / "2"
    warning = (f"the parameters of {step} were trained with other model keys: rope_max_timescale=10000 (here "
               "500000). They fit, so they were loaded")
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path / "src", steps=3, rope_max_timescale=500000), jax.devices()[:1])
    assert warning in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path / "b", steps=3, rope_max_timescale=500000, load_full_state_path=str(step)),
            jax.devices()[:1])
    assert warning in caplog.text


def test_a_resume_on_fewer_devices_warns_that_the_global_batch_changed(tmp_path, caplog):
    """per_device_batch_size counts per device: a run saved on 8 devices and resumed on 1 (a smaller
    slice, another XLA_FLAGS device count) trained on with an eighth of its batch, and with the default
    ici_fsdp_parallelism=-1 not even the changed-settings line said anything. The checkpoint now keeps
    its global batch; the resume warns and names the per_device_batch_size that keeps it."""
    run(tiny_config(tmp_path, steps=2))
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=3), jax.devices()[:1])
    assert ("the global batch changes at this resume: 1 sequence per step now (per_device_batch_size=1 x 1 device), "
            "8 when step 2 was saved; the learning rate and the other optimizer settings were chosen for that batch. "
            "To train on with it, set per_device_batch_size=8") in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):  # the hint followed: per_device_batch_size is a named change
        run(tiny_config(tmp_path, steps=4, per_device_batch_size=8), jax.devices()[:1])
    assert "per_device_batch_size 1.0 -> 8.0" in caplog.text and "global batch changes" not in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):  # the same batch on another mesh: nothing to say
        run(tiny_config(tmp_path, steps=5))
    assert "resuming from step 4" in caplog.text and "global batch changes" not in caplog.text


def test_both_load_paths_at_a_first_start_are_refused_before_anything_is_written(tmp_path):
    """Both given, the full state was loaded and load_parameters_path ignored without a word."""
    params, full = str(tmp_path / "a" / "checkpoints" / "4"), str(tmp_path / "b" / "checkpoints" / "7")
    with pytest.raises(ConfigError) as e:
        run(tiny_config(tmp_path, steps=1, load_parameters_path=params, load_full_state_path=full), jax.devices()[:1])
    assert str(e.value).startswith(f"load_parameters_path={params} and load_full_state_path={full} are both set, but "
                                   "a run starts from one of them; keep load_full_state_path"), str(e.value)
    assert not (tmp_path / "test").exists()


def test_a_load_path_given_at_a_resume_is_named_as_not_read(tmp_path, caplog):
    """The run resumes from its own checkpoint; a load path added or changed since was ignored with only
    an info line among the changed settings."""
    run(tiny_config(tmp_path / "other", steps=1), jax.devices()[:1])
    other = str(tmp_path / "other" / "test" / "checkpoints" / "1")
    run(tiny_config(tmp_path, steps=1), jax.devices()[:1])
    with caplog.at_level("INFO", logger="tessera"):
        report = run(tiny_config(tmp_path, steps=2, load_parameters_path=other), jax.devices()[:1])
    assert report["start_step"] == 1
    assert (f"load_parameters_path={other} is not read: the run resumes from its own checkpoint of step 1 (a load "
            f"path is read only when the run has no checkpoint). To start from {other}, train in a new run_name"
            in caplog.text)
    caplog.clear()  # the run at its end: "nothing to do" said nothing of the load path
    with caplog.at_level("INFO", logger="tessera"):
        report = run(tiny_config(tmp_path, steps=2, load_full_state_path=other), jax.devices()[:1])
    assert report["start_step"] == 2
    assert (f"load_full_state_path={other} is not read: the run is already at step 2 of its own checkpoints (a load "
            f"path is read only when the run has no checkpoint). To start from {other}, train in a new run_name"
            in caplog.text)


def test_settings_changed_on_a_finished_run_are_named_as_not_used(tmp_path, caplog):
    """`run_name=demo base_emb_dim=128` on the finished demo said only "nothing to do" and exited 0: the new
    settings were dropped without a word."""
    run(tiny_config(tmp_path, steps=1), jax.devices()[:1])
    with caplog.at_level("INFO", logger="tessera"):
        report = run(tiny_config(tmp_path, steps=1, learning_rate=0.5), jax.devices()[:1])
    assert report["start_step"] == 1
    assert ("learning_rate=0.5 differs from the settings step 1 was saved with, and nothing is trained with them: the "
            "run is complete. For a run with these settings, choose a new run_name" in caplog.text), caplog.text
    caplog.clear()  # an empty value is shown as one ("dump_hlo_module_name=, ..." read as a cut-off line)
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=1, learning_rate=0.5, dump_hlo_module_name=""), jax.devices()[:1])
    assert ('dump_hlo_module_name="", learning_rate=0.5 differ from the settings step 1 was saved with'
            in caplog.text), caplog.text
    caplog.clear()  # the same settings again: nothing to say
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=1), jax.devices()[:1])
    assert "nothing to do" in caplog.text and "differ from the settings" not in caplog.text


def test_checkpoints_a_start_would_not_read_are_refused(tmp_path):
    """enable_checkpointing=false (or a checkpoint_dir with nothing in it) on a run folder with checkpoints
    trained again from step 0 beside them, appended to their metrics, replaced their config and report,
    and said the earlier steps were lost before they were saved."""
    run(tiny_config(tmp_path, steps=2), jax.devices()[:1])
    folder = tmp_path / "test"
    before = {p: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".tessera.lock"}
    own = folder / "checkpoints"
    for keys, why, leave_out in [({"enable_checkpointing": False}, "enable_checkpointing=false", "enable_checkpointing"),
                                 ({"checkpoint_dir": str(tmp_path / "elsewhere")},
                                  f"checkpoint_dir={tmp_path / 'elsewhere'} holds none", "checkpoint_dir")]:
        with pytest.raises(ConfigError) as e:
            run(tiny_config(tmp_path, steps=2, **keys), jax.devices()[:1])
        assert str(e.value) == (f"{own} holds this run's checkpoints up to step 2, which this start would not read "
                                f"({why}): it would train again from step 0 beside them. To continue the run, leave "
                                f"out {leave_out}; for a new run, choose a new run_name")
        assert {p: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".tessera.lock"} == before


def test_a_finished_run_without_checkpoints_is_not_trained_over(tmp_path):
    """The same command run twice with enable_checkpointing=false (or after deleting checkpoints/)
    trained again in the finished run's folder: both runs' records in one metrics.jsonl, the report
    replaced, and "3 step(s) ... lost before they were saved" counted as redone."""
    run(tiny_config(tmp_path, steps=3, enable_checkpointing=False), jax.devices()[:1])
    folder = tmp_path / "test"
    before = {p: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".tessera.lock"}
    for keys in ({"enable_checkpointing": False}, {}):
        with pytest.raises(ConfigError) as e:
            run(tiny_config(tmp_path, steps=3, **keys), jax.devices()[:1])
        assert str(e.value) == (f"{folder} holds a run that finished (report.json) and no checkpoint this start could "
                                "resume from: it would train again from step 0 and mix its metrics with the finished "
                                "run's. For a new run, choose a new run_name (or move that folder away)")
        assert {p: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".tessera.lock"} == before


def test_a_run_whose_checkpoints_are_in_another_checkpoint_dir_is_not_trained_over(tmp_path):
    """A run started with checkpoint_dir=X and interrupted, started again without it (or with checkpointing off),
    trained from step 0 in its folder and said the steps X holds were "lost before they were saved"."""
    elsewhere = tmp_path / "elsewhere"
    run(tiny_config(tmp_path, steps=2, checkpoint_dir=str(elsewhere)), jax.devices()[:1])
    folder = tmp_path / "test"
    (folder / "report.json").unlink()  # as if interrupted after its save of step 2
    before = {p: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".tessera.lock"}
    for keys, why in (({}, "checkpoint_dir=(not set)"), ({"enable_checkpointing": False}, "enable_checkpointing=false"),
                      ({"checkpoint_dir": str(tmp_path / "new")}, f"checkpoint_dir={tmp_path / 'new'}")):
        with pytest.raises(ConfigError) as e:
            run(tiny_config(tmp_path, steps=3, **keys), jax.devices()[:1])
        assert str(e.value) == (f"{folder} is a run whose checkpoints, up to step 2, are in {elsewhere} (checkpoint_dir "
                                f"in its config.yml), which this start would not read ({why}): it would train again "
                                f"from step 0. To continue the run, give checkpoint_dir={elsewhere}; for a new run, "
                                "choose a new run_name")
        assert {p: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".tessera.lock"} == before
    assert run(tiny_config(tmp_path, steps=3, checkpoint_dir=str(elsewhere)), jax.devices()[:1])["start_step"] == 2


def test_a_stop_signal_during_an_evaluation_saves_without_finishing_it(tmp_path, monkeypatch, caplog):
    """SIGTERM arriving during a long evaluation waited for every eval batch before the save (22 s with
    the first-run corpus), eating into a preemption's grace period: the evaluation now stops at its next
    batch, is not recorded, and the step is saved."""
    import signal

    from tessera import evaluation
    from tessera.stop_signals import TrainingStopped

    calls = []

    def place(*args):  # the signal arrives during the third eval batch of the evaluation at step 2
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return place_batch(*args)

    place_batch = evaluation.place_batch
    monkeypatch.setattr(evaluation, "place_batch", place)
    cfg = tiny_config(tmp_path, steps=6, eval_interval=2, eval_steps=40, checkpoint_period=100)
    with caplog.at_level("INFO", logger="tessera"), pytest.raises(TrainingStopped) as stopped:
        run(cfg, jax.devices()[:1])
    assert stopped.value.exit_code == 143 and len(calls) == 3
    # batch 3 was dispatched when the signal came; batch 2 was the last read (the host is one batch ahead)
    assert "evaluation of step 2 stopped after 2 batch(es) by the stop signal: not recorded" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and not any("eval_loss" in r for r in records)
    assert Checkpointer(cfg.checkpoint, str(tmp_path / "test" / "checkpoints")).latest_step() == 2


def test_an_evaluation_dispatches_each_batch_before_reading_the_last(tmp_path, monkeypatch):
    """The host read each eval batch's sums before it prepared and dispatched the next, so the device
    waited for the host at every eval batch; now it is one batch ahead, as in training, and never past
    eval_steps."""
    from tessera import evaluation

    events = []
    place_batch, device_get = evaluation.place_batch, jax.device_get
    monkeypatch.setattr(evaluation, "place_batch", lambda *a: (events.append("place"), place_batch(*a))[1])
    monkeypatch.setattr(evaluation.jax, "device_get", lambda x: (events.append("read"), device_get(x))[1])
    run(tiny_config(tmp_path, steps=1, eval_interval=1, eval_steps=3), jax.devices()[:1])
    first = events.index("place")
    assert events[first:first + 6] == ["place", "place", "read", "place", "read", "read"], events
    assert events.count("place") == 3  # no batch past eval_steps
    record = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").open()][-1]
    assert record["eval_batches"] == 3


def test_changes_since_save_compare_as_the_checkpoint_stored_them():
    from tessera.config import flat_dict
    from tessera.start_state import changes_since_save, saved_schedule

    cfg = tiny_config(None, steps=10)
    saved = json.loads(json.dumps(flat_dict(cfg)))  # tuples come back as lists
    assert changes_since_save(saved, cfg) == {}
    assert changes_since_save({**saved, "steps": 5, "a_key_of_another_version": 1}, cfg) == {"steps": (5, 10)}
    assert saved_schedule({**saved, "learning_rate": "garbled"}, cfg) is None
    assert saved_schedule({k: v for k, v in saved.items() if k != "steps"}, cfg) is None
    schedule, length = saved_schedule({**saved, "steps": 5}, cfg)
    assert length == 5 and float(schedule(5)) == pytest.approx(cfg.optim.learning_rate
                                                              * cfg.optim.cosine_learning_rate_final_fraction)


def test_a_resume_onto_other_training_data_says_what_its_saved_position_means(caplog):
    """The data position saved with a checkpoint is an index into the data it was saved with: with
    other files (or another shuffle seed), the resume says so and how to start the new data afresh;
    other changes (evaluation files, here) say nothing of the kind."""
    from tessera.config import flat_dict
    from tessera.optim import learning_rate_schedule
    from tessera.start_state import log_changes_since_save

    cfg = tiny_config(None, hf_train_files="/data/new/*.json", hf_eval_files="/data/eval2.json", learning_rate_schedule_steps=9)
    saved = {**json.loads(json.dumps(flat_dict(cfg))), "hf_train_files": "/data/old/*.json"}
    schedule = learning_rate_schedule(cfg.optim, 9)
    with caplog.at_level("INFO", logger="tessera"):
        log_changes_since_save(saved, cfg, schedule, 7, "outputs/x/checkpoints/7")
    assert "settings changed since step 7 was saved: hf_train_files /data/old/*.json -> /data/new/*.json" in caplog.text
    assert ("the training data changed since step 7 was saved (hf_train_files): the data position saved with it "
            "(which record comes next, and the tokens already used of it) is applied to the new data as it stands. "
            "That continues where the run stopped when files were only added after the old ones; otherwise it starts "
            "at an arbitrary point of the new data. To read the new data from its start, train in a new run_name with "
            "load_full_state_path=outputs/x/checkpoints/7") in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):
        log_changes_since_save({**saved, "hf_train_files": "/data/new/*.json", "hf_eval_files": "/data/eval1.json"}, cfg,
                               schedule, 7, "outputs/x/checkpoints/7")
    assert "hf_eval_files /data/eval1.json -> /data/eval2.json" in caplog.text and "training data changed" not in caplog.text
    assert "learning rate jumps" not in caplog.text  # the same schedule
    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):  # other shards (files vs. slices): the position moved silently
        log_changes_since_save({**saved, "hf_train_files": "/data/new/*.json", "hf_eval_files": "/data/eval2.json",
                                "hf_streaming": False}, cfg, schedule, 7, "outputs/x/checkpoints/7")
    assert "the training data changed since step 7 was saved (hf_streaming)" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="tessera"):  # other tokens per document: the offset into one moved silently
        log_changes_since_save({**saved, "hf_train_files": "/data/new/*.json", "hf_eval_files": "/data/eval2.json",
                                "add_bos": False, "add_eos": False}, cfg, schedule, 7, "outputs/x/checkpoints/7")
    assert "the training data changed since step 7 was saved (add_bos, add_eos)" in caplog.text


def test_steps_logged_after_reads_the_newest_records_only(tmp_path):
    from tessera.loop_records import steps_logged_after

    path = tmp_path / "metrics.jsonl"
    assert steps_logged_after(path, 7) == 0  # no file
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 3001)))
    assert steps_logged_after(path, 2990) == 10 and steps_logged_after(path, 3000) == 0
    assert steps_logged_after(path, 2990, tail_bytes=100) == 10  # a tail that starts mid-line


def test_a_metrics_file_that_is_a_pipe_is_written_and_not_read_back(tmp_path):
    """metrics_file=/dev/stdout piped to another program, or a named pipe: the records go into it. The
    start-up's reads of an earlier attempt's records skip it: they failed with a traceback (a pipe cannot
    seek), blocked for ever (opening a named pipe to read waits for a writer) or, at /dev/full, read zeros
    until the host ran out of memory."""
    import os
    import threading

    from tessera.loop_records import steps_logged_after
    from tessera.metrics import MetricsWriter

    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    found = []
    reading = threading.Thread(target=lambda: found.append(steps_logged_after(fifo, 7)), daemon=True)
    reading.start()
    reading.join(timeout=10)
    blocked = reading.is_alive()
    if blocked:  # let the blocked open go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert not blocked and found == [0]
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(open(fifo).read().splitlines()), daemon=True)
    reader.start()
    writer = MetricsWriter(fifo, None, log_period=10, first_step=0)  # step 1 not printed
    writer.write({"step": 1, "loss": 2.5})
    writer.close()
    reader.join(timeout=10)
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 2.5}]


def test_the_run_folder_lock_is_exclusive_and_released(tmp_path):
    from tessera.run_folder import LOCK_FILE, RunFolderInUse, RunFolderLock

    first, second = RunFolderLock(), RunFolderLock()
    first.take(tmp_path)
    assert f"pid {os.getpid()} on host " in (tmp_path / LOCK_FILE).read_text()
    with pytest.raises(RunFolderInUse, match=f"in use by another training process \\(pid {os.getpid()} on host"):
        second.take(tmp_path)
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    second.take(tmp_path)  # free again
    second.release()


def test_a_run_folder_another_process_created_while_this_one_started_is_refused(tmp_path):
    """The same command started twice: the second compiles while the first compiles, trains and ends
    (the folder did not exist at either start, so neither held its lock yet). The second then trained
    the whole run again from step 0 in the finished run's folder, over its checkpoints, and appended
    to its metrics. Now it stops when it comes to create the folder and finds the other's config.yml."""
    from tessera.run_folder import LOCK_FILE, RunFolderInUse, RunFolderLock, create_run_folder

    cfg = tiny_config(tmp_path)
    folder = tmp_path / "test"
    folder.mkdir()
    (folder / "config.yml").write_text("run_name: test\n")  # the other run's
    lock = RunFolderLock()  # this run found no folder at its start: its lock was not taken
    with pytest.raises(RunFolderInUse, match=f"the run folder {folder} was created by another training process "
                                             "while this one was starting"):
        create_run_folder(cfg, folder, lock)
    lock.release()
    assert (folder / "config.yml").read_text() == "run_name: test\n" and not (folder / LOCK_FILE).exists()
    resumed = RunFolderLock()
    resumed.take(folder)  # a resumed run holds it from its start: its own config.yml is rewritten
    create_run_folder(cfg, folder, resumed)
    resumed.release()
    assert "run_name: test\n" != (folder / "config.yml").read_text()


def test_a_file_system_without_locks_trains_unguarded_with_a_warning(tmp_path, monkeypatch, caplog):
    """flock fails with ENOLCK or EOPNOTSUPP on some FUSE mounts (a bucket mounted as a folder): the
    run must not end in a traceback there."""
    import errno
    import fcntl

    from tessera.run_folder import RunFolderLock

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = RunFolderLock()
    with caplog.at_level("WARNING", logger="tessera"):
        lock.take(tmp_path)
        lock.take(tmp_path)  # again when the run creates its folder (it existed at the start): said once
    assert [r.getMessage() for r in caplog.records] == [
        f"the run folder {tmp_path} is on a file system without file locks (No locks available): a second training "
        "process started in it would not be stopped"]
    lock.release()  # nothing held: nothing to do


def test_the_advice_after_a_non_finite_step_points_the_right_way():
    from tessera.step_stats import stability_advice as _stability_advice

    advice = _stability_advice(tiny_config(None, learning_rate=3e-4, warmup_steps_fraction=0.05,
                                           gradient_clipping_threshold=1.0, adam_weight_decay=0.1))
    assert advice == ("Lower learning_rate (now 0.0003), raise warmup_steps_fraction (now 0.05) or lower "
                      "gradient_clipping_threshold (now 1), or set on_nonfinite_loss=skip_step")


def test_skip_step_stops_when_the_parameters_themselves_are_broken(tmp_path, caplog):
    """learning_rate=1e38: step 1's update is finite but leaves the parameters at ~1e38, and every
    later step is non-finite. skip_step skipped them all, saved checkpoints of those parameters and
    ended with exit 0. Now SKIPS_IN_A_ROW skipped steps in a row stop the run as `stop` does, naming
    the checkpoints that hold them."""
    from tessera.step_stats import SKIPS_IN_A_ROW
    from tessera.stop_signals import TrainingStopped

    cfg = tiny_config(tmp_path, steps=SKIPS_IN_A_ROW + 10, learning_rate=1e38, gradient_clipping_threshold=0,
                      on_nonfinite_loss="skip_step", checkpoint_period=1)
    with caplog.at_level("WARNING", logger="tessera"), pytest.raises(TrainingStopped) as stopped:
        run(cfg, jax.devices()[:1])
    assert stopped.value.exit_code == 3
    message = str(stopped.value)
    assert f"at step {SKIPS_IN_A_ROW + 1}, the {SKIPS_IN_A_ROW}th skipped step in a row" in message, message
    assert "the parameters of step 1 fail on every batch" in message
    assert "the checkpoints of step 1 and later hold those parameters" in message and "set them aside" in message
    assert "or set on_nonfinite_loss=skip_step" not in message
    assert caplog.text.count("update skipped (on_nonfinite_loss=skip_step)") == SKIPS_IN_A_ROW - 1
    # step 1's update was finite, and saved; the skipped steps after it were not
    assert sorted(int(p.name) for p in (tmp_path / "test" / "checkpoints").iterdir() if p.name.isdigit()) == [1]


def test_skipped_steps_are_marked_in_the_metrics_and_counted_in_the_report(tmp_path, caplog):
    """on_nonfinite_loss=skip_step: a run whose updates were dropped ended with exit 0 and a report that
    did not say so (a step with a finite loss and an infinite gradient norm looked like any other in
    metrics.jsonl). Its records are marked "skipped", the report counts them and the run's end warns."""
    cfg = tiny_config(tmp_path, steps=3, learning_rate=1e38, warmup_steps_fraction=0.0, gradient_clipping_threshold=0,
                      on_nonfinite_loss="skip_step")
    with caplog.at_level("WARNING", logger="tessera"):
        report = run(cfg, jax.devices()[:1])
    records = [json.loads(line) for line in (tmp_path / "test" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in records] == [False, True, True]
    assert report["steps_skipped"] == 2
    assert json.loads((tmp_path / "test" / "report.json").read_text())["steps_skipped"] == 2
    assert "2 of the 3 steps trained were skipped (a non-finite loss or gradient" in caplog.text


def test_skipped_steps_never_push_the_good_checkpoints_out(tmp_path, caplog):
    """With max_num_checkpoints_to_keep, the periodic saves of a run of skipped steps (each of the
    same broken parameters) deleted every good checkpoint before the run stopped (exit 3), whose
    message then advised resuming from an earlier one. Periodic saves now leave skipped steps out."""
    from tessera.step_stats import SKIPS_IN_A_ROW
    from tessera.stop_signals import TrainingStopped

    keys = dict(checkpoint_period=2, max_num_checkpoints_to_keep=2, learning_rate_schedule_steps=100)
    run(tiny_config(tmp_path, steps=4, **keys), jax.devices()[:1])
    broken = tiny_config(tmp_path, steps=40, learning_rate=1e30, gradient_clipping_threshold=0,
                         on_nonfinite_loss="skip_step", **keys)
    with caplog.at_level("WARNING", logger="tessera"), pytest.raises(TrainingStopped) as stopped:
        run(broken, jax.devices()[:1])
    assert stopped.value.exit_code == 3 and f"at step {5 + SKIPS_IN_A_ROW}" in str(stopped.value), stopped.value
    assert "the parameters of step 5 fail on every batch" in str(stopped.value)
    assert "last good checkpoint: step 4" in str(stopped.value)
    saved = sorted(int(p.name) for p in (tmp_path / "test" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [2, 4], saved
    assert "step 6 was skipped (non-finite, on_nonfinite_loss=skip_step): its periodic checkpoint is left out" in caplog.text


def test_seeds_keep_all_64_bits_and_the_32_bit_ones_their_old_keys():
    """jax.random.key keeps only a seed's low 32 bits without 64-bit mode: init_weights_seed=2**32
    started from the weights of 0, and -1 from those of 2**32-1. prng_key tells them apart and gives
    the seeds 0..2**32-1 the keys they had (so those runs are unchanged)."""
    from tessera.seeds import prng_key
    from tessera.step import create_state

    for seed in (0, 1, 7, 2**31, 2**32 - 1):
        np.testing.assert_array_equal(jax.random.key_data(prng_key(seed)), jax.random.key_data(jax.random.key(seed)))
    seeds = (0, 2**32, -1, 2**32 - 1, 2**63 - 1, -2**63, 5, 5 + 2**40)
    data = {tuple(np.asarray(jax.random.key_data(prng_key(s)))) for s in seeds}
    assert len(data) == len(seeds)
    trainer = setup(tiny_config(), jax.devices()[:1])
    table = lambda seed: np.asarray(create_state(trainer, seed)["params"]["token_embedder"]["table_vd"])  # noqa: E731
    assert not np.array_equal(table(0), table(2**32))


def test_the_largest_seed_trains_with_dropout(tmp_path):
    """The dropout key is drawn from init_weights_seed + 1, which overflowed for 2**63-1
    (OverflowError in the step's tracing); it now wraps around, as a 64-bit seed does."""
    report = run(tiny_config(tmp_path, init_weights_seed=2**63 - 1, dropout_rate=0.1, steps=2), jax.devices()[:1])
    assert report["steps"] == 2 and np.isfinite(report["final_loss"])


def test_dropout_draws_new_masks_at_each_step_and_in_each_micro_batch():
    """summed_gradients: each micro-batch's dropout key is folded from the step's key with its index, and the
    step's key from the step number. Two identical rows in two micro-batches of one row: their losses differ
    (with one key for both, the step's loss sum was twice the first's); the same state and batch at the next
    step: a different loss (the step number reaches the loss only through the dropout key)."""
    import jax.numpy as jnp

    from tessera.losses import loss_sums
    from tessera.gradients import objective_fn, summed_gradients
    from tessera.step import create_state, make_train_step

    cfg = tiny_config(dropout_rate=0.5, gradient_accumulation_steps=2, per_device_batch_size=2)
    trainer = setup(cfg, jax.devices()[:1])
    state = create_state(trainer, 0)
    row = jax.random.randint(jax.random.key(1), (1, 13), 0, 96)
    batch = {"tokens": jnp.tile(row, (2, 1)), "segment_ids": jnp.ones((2, 13), jnp.int32),
             "positions": jnp.tile(jnp.arange(13), (2, 1))}
    key, model = jax.random.key(7), trainer.model
    summed = objective_fn(model, False)
    grad_fn = jax.grad(lambda p, b, k: summed(p, b, k, None), has_aux=True)
    total = jax.jit(lambda p: summed_gradients(grad_fn, p, batch, key, 2)[1])(state["params"])
    one = jax.jit(lambda p, k: loss_sums(model, p, {n: a[:1] for n, a in batch.items()}, k)[0])
    first, second = (float(one(state["params"], jax.random.fold_in(key, i))) for i in (0, 1))
    assert abs(first - second) > 1e-3, (first, second)
    np.testing.assert_allclose(float(total), first + second, rtol=1e-5)

    def losses(trainer):
        step = jax.jit(make_train_step(trainer, 0))
        fresh = create_state(trainer, 0)
        at_1 = step(create_state(trainer, 0), batch)[0]
        return [float(step(s, batch)[1]["loss"]) for s in (fresh, dict(fresh, step=at_1["step"]))]

    at_0, at_1 = losses(trainer)
    assert abs(at_0 - at_1) > 1e-3, (at_0, at_1)


def test_the_last_steps_line_is_printed_whatever_the_log_period(tmp_path, caplog):
    """log_period=4 with steps=6 printed steps 1 and 4: the last step's line, which the run ends on, was
    only in metrics.jsonl."""
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=6, log_period=4), jax.devices()[:1])
    printed = [int(m) for m in re.findall(r"\bstep +(\d+) \| loss", caplog.text)]
    assert printed == [1, 4, 6]


def _sigterm_while_taking_batch(n: int, monkeypatch) -> None:
    """SIGTERM to this process while the loop takes its n-th batch (train_loop.place_batch)."""
    import signal

    from tessera import train_loop

    calls, place_batch = [], train_loop.place_batch

    def place(*args):
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGTERM)
        return place_batch(*args)

    monkeypatch.setattr(train_loop, "place_batch", place)


def test_a_run_that_ends_early_prints_its_last_steps_line(tmp_path, monkeypatch, caplog):
    """A run that stops before `steps`, at target_eval_loss or after a stop signal, printed its last
    step's line only when log_period divided the step: `done: final loss ...` quoted a loss the log
    never showed."""
    from tessera.stop_signals import TrainingStopped

    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path / "target", steps=8, log_period=4, eval_interval=2, eval_steps=1,
                        target_eval_loss=100.0, enable_checkpointing=False), jax.devices()[:1])
    assert [int(m) for m in re.findall(r"\bstep +(\d+) \| loss", caplog.text)] == [1, 2]
    caplog.clear()

    _sigterm_while_taking_batch(3, monkeypatch)  # the run stops after a step before 8
    with caplog.at_level("INFO", logger="tessera"), pytest.raises(TrainingStopped) as stopped:
        run(tiny_config(tmp_path / "signal", steps=8, log_period=4, enable_checkpointing=False), jax.devices()[:1])
    after = int(re.search(r"after step (\d+)", str(stopped.value)).group(1))
    assert after not in (4, 8)
    assert [int(m) for m in re.findall(r"\bstep +(\d+) \| loss", caplog.text)] == [1, after]


def test_a_signals_last_step_line_comes_before_its_checkpoint(tmp_path, caplog, monkeypatch):
    """SIGTERM with log_period leaving the step out: its line was printed after its checkpoint's lines, the
    log reading as if the step came after its own save."""
    from tessera.stop_signals import TrainingStopped

    _sigterm_while_taking_batch(2, monkeypatch)
    with caplog.at_level("INFO", logger="tessera"), pytest.raises(TrainingStopped) as stopped:
        run(tiny_config(tmp_path, steps=8, log_period=4, checkpoint_period=100), jax.devices()[:1])
    after = int(re.search(r"after step (\d+)", str(stopped.value)).group(1))
    lines = [r.getMessage() for r in caplog.records]
    line = next(i for i, m in enumerate(lines) if re.match(rf"step +{after} \| loss", m))
    assert line < next(i for i, m in enumerate(lines) if m.startswith(f"checkpoint {after}")), lines


def test_a_resumed_run_prints_its_first_steps_line(tmp_path, caplog):
    """log_period=4, resumed at step 2 of 6: the first line came at step 4; step 3, the first this
    attempt trains (where a resume is checked), was printed only by a fresh run (step 1)."""
    run(tiny_config(tmp_path, steps=2, checkpoint_period=2), jax.devices()[:1])
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=6, log_period=4, checkpoint_period=2), jax.devices()[:1])
    printed = [int(m) for m in re.findall(r"\bstep +(\d+) \| loss", caplog.text)]
    assert printed == [3, 4, 6]


def test_a_record_cut_off_by_an_earlier_attempt_does_not_swallow_the_next(tmp_path, caplog):
    """A metrics.jsonl whose last record was cut (a full disk, a kill): the next attempt appended its
    first record to that line, and neither could be read. The cut line is removed."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n" + '{"step": 2, "lo')
    with caplog.at_level("WARNING", logger="tessera.metrics"):
        writer = metrics.MetricsWriter(path, None, log_period=1)
    writer.write({"step": 2, "loss": 4.0, "step_seconds": 1.0, "tflops_per_sec_per_device": 1.0,
                  "tokens_per_sec_per_device": 1.0, "mfu": None})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert "ended in a record cut off by the end of an earlier attempt (15 bytes without a newline)" in caplog.text
    path.write_text('{"step": 1, "lo')  # the first record, cut
    metrics.MetricsWriter(path, None, log_period=1).close()
    assert path.read_text() == ""


def test_a_finished_run_without_its_report_says_so(tmp_path, caplog):
    """A signal during the last step's evaluation saves that step and exits before the evaluation and
    the report; the same command again said only "nothing to do", and the report never came."""
    run(tiny_config(tmp_path, steps=2), jax.devices()[:1])
    (tmp_path / "test" / "report.json").unlink()  # as such a stop leaves the folder
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=2, eval_interval=2, eval_steps=1), jax.devices()[:1])
    assert (f"{tmp_path / 'test'} has no report.json: the run was stopped after saving step 2, before its report and "
            "its last evaluation; neither is made again (raise steps to train on)") in caplog.text


def test_a_resumed_attempt_sets_the_earlier_report_aside(tmp_path, caplog):
    """A finished run trained on (steps raised) and stopped by SIGTERM before its own report left the earlier
    attempt's report.json in place: the folder read as finished at step 2, with that attempt's figures."""
    first = run(tiny_config(tmp_path, steps=2), jax.devices()[:1])
    run(tiny_config(tmp_path, steps=3), jax.devices()[:1])
    kept = tmp_path / "test" / "report.until_step_2.json"
    assert json.loads(kept.read_text())["final_loss"] == first["final_loss"]
    assert json.loads((tmp_path / "test" / "report.json").read_text())["start_step"] == 2
    (tmp_path / "test" / "report.json").unlink()  # as a stop after the save of step 3 leaves the folder
    with caplog.at_level("INFO", logger="tessera"):
        run(tiny_config(tmp_path, steps=3), jax.devices()[:1])
    assert f"{tmp_path / 'test'} has no report.json: the run was stopped after saving step 3" in caplog.text


def test_a_report_set_aside_at_a_step_already_set_aside_keeps_both(tmp_path):
    """Attempts that ended at the same step (its checkpoint deleted and trained again) each had their report
    renamed report.until_step_3.json: the second replaced the first, whose figures were lost."""
    from tessera.run_folder import _set_aside_earlier_report

    for final_loss in (1.5, 1.25, 1.0):
        (tmp_path / "report.json").write_text(json.dumps({"start_step": 1, "steps": 2, "final_loss": final_loss}))
        _set_aside_earlier_report(tmp_path)
    kept = {p.name: json.loads(p.read_text())["final_loss"] for p in tmp_path.iterdir()}
    assert kept == {"report.until_step_3.json": 1.5, "report.until_step_3.2.json": 1.25,
                    "report.until_step_3.3.json": 1.0}


@pytest.mark.parametrize("name", ["report.json", ".tessera.lock", "config.yml", "report.until_step_3.json"])
def test_a_metrics_file_that_is_a_file_the_run_writes_itself_is_refused(tmp_path, name):
    """metrics_file=<run folder>/report.json: the report replaced the records at the end; the lock file was
    removed with them; config.yml got them after the config. Each run ended with exit code 0 and no word."""
    from tessera.output_folders import check_output_folders

    given = tmp_path / "test" / "." / name  # the same file by another spelling
    cfg = tiny_config(tmp_path, metrics_file=str(given), enable_checkpointing=False)
    with pytest.raises(ConfigError, match=f"metrics_file={re.escape(str(given))} is .*: its records would be lost or "
                                          f"mixed with it; give a file of its own, or leave metrics_file out"):
        check_output_folders(cfg, "")
    check_output_folders(tiny_config(tmp_path, metrics_file=str(tmp_path / "test" / "steps.jsonl")), "")


def _refusing_to_open_for_writing(module, monkeypatch, path):
    """`module`'s open() refuses to write `path` (chmod does not stop root, so refuse the open itself)."""
    def refuse(file, mode="r", *args, **kwargs):
        if str(file) == str(path) and mode != "rb":
            raise PermissionError(13, "Permission denied", str(file))
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(module, "open", refuse, raising=False)


@pytest.mark.parametrize("given", [True, False])
def test_an_existing_metrics_file_that_cannot_be_written_is_refused_before_compiling(tmp_path, monkeypatch, given):
    """A read-only metrics file (another user's, a resumed run's own after a chmod): the writer opened it
    after compiling, a PermissionError traceback (exit code 1)."""
    from tessera import output_folders

    path = tmp_path / ("mine.jsonl" if given else "test/metrics.jsonl")
    path.parent.mkdir(exist_ok=True)
    path.write_text('{"step": 1, "loss": 2.0}\n')
    cfg = tiny_config(tmp_path, enable_checkpointing=False, **({"metrics_file": str(path)} if given else {}))
    _refusing_to_open_for_writing(output_folders, monkeypatch, path)
    key, other = ("metrics_file", "metrics_file") if given else ("base_output_directory", "run_name")
    with pytest.raises(ConfigError) as e:
        output_folders.check_output_folders(cfg, "")
    assert str(e.value) == (f"the metrics file {path} (from {key}) cannot be written (Permission denied): the run "
                            f"appends each step's record to it; make it writable, or choose another {other}")
    _refusing_to_open_for_writing(metrics, monkeypatch, path)  # made read-only after the check: one line, exit 6
    with pytest.raises(metrics.MetricsWriteError, match=f"the metrics file {re.escape(str(path))} could not be "
                                                        "opened for writing \\(Permission denied\\); make it"):
        metrics.MetricsWriter(path, None, 1)


def test_an_existing_tensorboard_folder_that_cannot_be_written_is_refused_before_compiling(tmp_path):
    """A resumed run's tensorboard/ that cannot be written: the writer's PermissionError traceback came
    after compiling (exit code 1)."""
    from tessera.output_folders import check_output_folders

    folder = tmp_path / "test" / "tensorboard"
    folder.mkdir(parents=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
    elif subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:  # root: chmod is no bar
        pytest.skip("root, on a file system without the immutable attribute: nothing makes a folder read-only")
    try:
        with pytest.raises(ConfigError, match=f"the TensorBoard folder {re.escape(str(folder))} \\(from "
                                              "base_output_directory\\) cannot be written"):
            check_output_folders(tiny_config(tmp_path, enable_tensorboard=True, enable_checkpointing=False), "")
        with pytest.raises(metrics.MetricsWriteError, match=f"the TensorBoard folder {re.escape(str(folder))} "
                                                            "could not be opened for writing"):
            metrics.MetricsWriter(tmp_path / "m.jsonl", folder, 1)
    finally:
        folder.chmod(0o755) if os.geteuid() != 0 else subprocess.run(["chattr", "-i", str(folder)])


def test_another_runs_records_in_a_shared_metrics_file_are_not_steps_trained_again(tmp_path, caplog):
    """Two runs given one metrics_file: the second (a new run, no earlier attempt of its own) found
    the first's 3 records and said it trained 3 steps again (report: steps_redone 3)."""
    shared = tmp_path / "all.jsonl"
    run(tiny_config(tmp_path / "a", metrics_file=str(shared), enable_checkpointing=False), jax.devices()[:1])
    with caplog.at_level("INFO", logger="tessera"):
        report = run(tiny_config(tmp_path / "b", metrics_file=str(shared), enable_checkpointing=False),
                     jax.devices()[:1])
    assert report["start_step"] == 0 and report["time"]["steps_redone"] == 0, report["time"]
    assert "trained again" not in caplog.text
    assert [json.loads(line)["step"] for line in shared.read_text().splitlines()] == [1, 2, 3, 1, 2, 3]


def test_a_report_that_cannot_be_written_is_one_error_line_exit_6(tmp_path, monkeypatch, capsys):
    """A full disk when the run writes report.json at its end: an OSError traceback (exit 1); now the
    metrics write error's line and exit code 6, with the figures the report would have held."""
    import errno
    from pathlib import Path

    write_text = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "report.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    argv = [str(REPO / "configs" / "base.yml"), *(f"{k}={v}" for k, v in TINY.items()),
            f"base_output_directory={tmp_path}", "run_name=test", "enable_checkpointing=false"]
    assert tessera.train.main(argv) == 6
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (f"metrics write error: the run's report could not be written to {tmp_path / 'test' / 'report.json'} (No "
            "space left on device); its steps are trained (final loss ") in err
    assert "(exit code 6)" in err


@pytest.mark.parametrize("entry", ["train", "decode"])
def test_main_leaves_the_callers_logging_as_it_was(tmp_path, capsys, entry):
    """Called from a notebook or a sweep, main() used logging.basicConfig(force=True): it closed the caller's own
    handlers (here a log file, which then took no more lines), left its own on that call's stderr and the root
    logger at INFO, for the rest of the process. While it runs its lines still go to stderr, one per line."""
    import tessera.decode

    root, jax_logger = logging.getLogger(), logging.getLogger("jax")
    theirs = logging.FileHandler(tmp_path / "mine.log")
    handlers, levels = list(root.handlers), (root.level, jax_logger.level)
    root.addHandler(theirs)
    try:
        root.setLevel(logging.WARNING)
        jax_logger.setLevel(logging.DEBUG)
        keys = [str(REPO / "configs" / "base.yml"), f"base_output_directory={tmp_path}", "run_name=x"]
        if entry == "train":  # a mesh that does not fit the 8 devices: stops after its first log lines
            assert tessera.train.main([*keys, "ici_fsdp_parallelism=3"]) == 2
        else:
            assert tessera.decode.main([*keys, f"load_parameters_path={tmp_path / 'none'}", "--tokens", "1,2"]) == 2
        assert root.handlers == [*handlers, theirs] and not theirs.stream.closed
        assert (root.level, jax_logger.level) == (logging.WARNING, logging.DEBUG)
        assert re.search(r"^\d\d:\d\d:\d\d I ", capsys.readouterr().err, re.M)  # its own lines, while it ran
        logging.getLogger("tessera").warning("the caller's line")
        theirs.flush()
        assert "the caller's line" in (tmp_path / "mine.log").read_text()
    finally:
        root.removeHandler(theirs)
        theirs.close()
        root.setLevel(levels[0])
        jax_logger.setLevel(levels[1])


def test_the_input_pipelines_workers_end_with_a_run_stopped_before_its_loop(tmp_path, monkeypatch):
    """The input pipeline's worker processes (grain_worker_count, started by the first read: reuse_example_batch
    reads at start-up) were stopped only once the loop had started: a run stopped by Ctrl-C while compiling, or by a
    step that does not fit (exit 7, a sweep's next batch size goes on), left them running in the process."""
    stopped = []
    make_input = tessera.train.make_input

    def watched_input(*args, **kwargs):
        data = make_input(*args, **kwargs)
        data.stop_workers = lambda: stopped.append("train")
        return data

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tessera.train, "make_input", watched_input)
    monkeypatch.setattr(tessera.train, "compile_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(tmp_path))
    assert stopped == ["train"]


def test_trainable_parameters_mask_trains_only_what_it_finds():
    """trainable_parameters_mask (MaxText's key): two steps move only the MLP's weights (the others bitwise as
    they were), the optimizer keeps moments for those alone, the gradient norm is theirs (the step against the
    same step without the mask: the MLP's part of its gradient), and XLA drops the other weights' gradient
    products from the compiled step."""
    import optax

    from tessera.losses import loss_sums
    from tessera.step import make_train_step

    cfg, trainer, state, batch = _one_step_inputs(trainable_parameters_mask=["layers/mlp"])
    step = jax.jit(make_train_step(trainer, 0))
    new, stats = step(state, batch)
    new, _ = step(new, batch)
    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v)  # noqa: E731
                         for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    before, after = flat(state["params"]), flat(new["params"])
    moved = sorted(k for k in before if not np.array_equal(before[k], after[k]))
    assert moved == ["['layers']['mlp']['wi_0']", "['layers']['mlp']['wi_1']", "['layers']['mlp']['wo_fd']"]
    moments = [leaf for leaf in jax.tree.leaves(new["opt_state"]) if np.ndim(leaf)]
    assert len(moments) == 2 * 3  # mu and nu of the three MLP weights
    (_, count), grads = jax.value_and_grad(lambda p: loss_sums(trainer.model, p, batch, None), has_aux=True)(
        state["params"])
    mlp_norm = float(optax.tree.norm(jax.tree.map(lambda g: g / count, grads["layers"]["mlp"])))
    np.testing.assert_allclose(float(stats["grad_norm"]), mlp_norm, rtol=1e-5)
    dots = lambda t: step.lower(state, batch).compile().as_text().count(" dot(")  # noqa: E731
    _, whole, whole_state, _ = _one_step_inputs()
    whole_dots = jax.jit(make_train_step(whole, 0)).lower(whole_state, batch).compile().as_text().count(" dot(")
    assert dots(trainer) < whole_dots


def test_a_trainable_parameters_mask_that_finds_nothing_or_with_muon_is_refused():
    with pytest.raises(ConfigError, match=r"trainable_parameters_mask: 'decoder' is found in no parameter's path; "
                                          r"this model's parameters are final_norm/scale, "):
        setup(tiny_config(trainable_parameters_mask=["decoder"]), jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"trainable_parameters_mask with opt_type=muon is not supported"):
        tiny_config(trainable_parameters_mask=["mlp"], opt_type="muon")


def test_a_resume_with_another_trainable_parameters_mask_says_how_to_train_other_parameters(tmp_path):
    """The mask shapes the optimizer state (moments for the trained parameters only): a resume with another one
    cannot read it, and the error says so and how to go on, where it listed the state's paths."""
    from tessera.checkpointing import CheckpointMismatch

    run(tiny_config(tmp_path, steps=2), jax.devices()[:1])
    with pytest.raises(CheckpointMismatch) as e:
        run(tiny_config(tmp_path, steps=4, trainable_parameters_mask=["mlp"]), jax.devices()[:1])
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'test' / 'checkpoints' / '2'} was saved with trainable_parameters_mask=[] (here "
        "[\"mlp\"]), which shapes the optimizer state (moments for the trained parameters only); to train other "
        f"parameters, start a new run_name with load_parameters_path={tmp_path / 'test' / 'checkpoints' / '2'} (its "
        "parameters, with a fresh optimizer state). Nothing was loaded or overwritten.")
