"""The planner (tessera.tools.plan): the public TPU sizing guide's worked examples from the estimator alone (no
compile), GPU planning, the no-fit error, divisibility of every mesh it tries, and its command line."""

import contextlib
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from test_estimate import SEED_004
from tessera.hardware import DCN_BYTES_PER_S, GPUS
from tessera.tools.estimate import load_model_config, parse_hardware
from tessera.tools.memory_model import count_params
from tessera.tools.plan import Candidate, main, mesh_candidates, plan, search
from tessera.tools.plan_meshes import DCN_AXES, ICI_AXES, Mesh
from tessera.tools.plan_model import BASE_MFU, TENSOR_MFU, executed_ratio, ici_links

RUN = ["max_target_length=2048", "dtype=bfloat16", "attention=flash"]  # the guide's runs: splash attention, bf16


def guide_model(name, *overrides):
    keys, _, _ = SEED_004[name]
    return load_model_config("1b", [*(f"{k}={v}" for k, v in keys.items()), *RUN, *overrides])


def candidate(cfg, hw, tokens, ici, dcn=None, repeats=1, remat="full"):
    """The planner's score of one mesh at one batch."""
    mesh = Mesh({**{a: 1 for a in ICI_AXES}, **ici}, {**{a: 1 for a in DCN_AXES}, **(dcn or {})})
    found = mesh_candidates(cfg, count_params(cfg.model), hw, mesh, [tokens])
    return next(c for c in found if c.repeats == repeats and c.remat == remat)


def test_a_weight_the_mesh_does_not_divide_is_counted_whole_as_the_estimate_counts_it(capsys):
    """A vocabulary of 32001 over tensor 4: the trainer copies the logits' weight whole on each chip (the estimate
    counts it), and the plan ranked the mesh with the split it cannot have, 0.73 GiB per chip lower."""
    from tessera.tools.estimate import main as estimate_main

    hw = parse_hardware("v5e-16")
    mesh = {"fsdp": 4, "tensor": 4}
    keys = ["max_target_length=2048", "per_device_batch_size=0.5", "remat_policy=minimal"]
    for vocab in (32000, 32001):
        cfg = load_model_config("llama2-7b", [f"vocab_size={vocab}", *keys[:1]])
        planned = candidate(cfg, hw, 1024, mesh, remat="minimal").memory / 2**30
        assert estimate_main(["llama2-7b", f"vocab_size={vocab}", *keys, "ici_fsdp_parallelism=4",
                              "ici_tensor_parallelism=4", "--hardware", "v5e-16"]) == 0
        estimated = float(re.search(r"minimal +[\d.]+ +total +([\d.]+)", capsys.readouterr().out).group(1))
        assert planned == pytest.approx(estimated, abs=0.006), vocab
    assert estimated == pytest.approx(14.44, abs=0.006)  # the copied 49M elements, their gradients and moments


def test_links_follow_the_slice_shape():
    """The guide's 2 vs 4 ICI links on a 16x16 v6e pod: a 256-way axis closes rings in both dimensions."""
    assert ici_links((16, 16), True, {"fsdp": 256}) == {"fsdp": 4}
    assert ici_links((16, 16), True, {"tensor": 16, "fsdp": 16}) == {"tensor": 2, "fsdp": 4}
    # TP=4 as 2x2 sub-rings inside an 8x8 ring (the guide's custom mesh for its 10T model)
    assert ici_links((16, 16), True, {"tensor": 4, "expert": 64}) == {"tensor": 2, "expert": 4}
    assert ici_links((8, 8), False, {"fsdp": 64}) == {"fsdp": 2}  # v6e-64: no wraparound
    assert ici_links((4, 4, 8), True, {"fsdp": 128}) == {"fsdp": 6}  # v5p-256: a 3D torus


def test_900b_dense_picks_tensor_parallelism_16():
    """The guide: TP=16 needs mlp_dim > 16 x 5,100 = 81,600; the 900B model has 131,072. On one pod its
    bfloat16 weights, gradients and AdamW state alone take 26.6 of the 30.4 GiB budget per chip, and with two
    gathered layers in flight the smallest batch is about 0.5 GiB over it (the guide does not say how it fit
    the state): the closest candidates all split tensor 16 ways, and on two pods (pipelined over DCN) the first
    choice fits with fsdp 16 x tensor 16 inside each pod. With the AdamW moments in host memory
    (optimizer_memory_host_offload) the estimate fits one pod, fsdp 16 x tensor 16 and no pipeline (refused with
    it); compiled, that candidate needs 30.69 GiB of 30.4 by the compiler's memory analysis, 23.58 by its buffer
    assignment (Plan.md)."""
    cfg = guide_model("900B dense", "weight_dtype=bfloat16")
    closest = plan(cfg, parse_hardware("v6e-256"))[:5]
    assert not any(c.fits for c in closest) and all(c.mesh.sizes["tensor"] == 16 for c in closest)
    offloaded = plan(guide_model("900B dense", "weight_dtype=bfloat16", "optimizer_memory_host_offload=true"),
                     parse_hardware("v6e-256"))
    assert offloaded[0].fits and (offloaded[0].mesh.sizes["fsdp"], offloaded[0].mesh.sizes["tensor"]) == (16, 16)
    assert all(c.mesh.sizes["stage"] == 1 for c in offloaded)
    best = plan(cfg, parse_hardware("v6e-256", num_slices=2))[0]
    assert best.fits and best.mesh.ici["tensor"] == 16 and best.mesh.ici["fsdp"] == 16
    tensor = next(a for a in best.axes if a.axis == "tensor")
    assert (tensor.intensity, tensor.hardware) == (131072 / 16, pytest.approx(5100))
    narrow = guide_model("900B dense", "weight_dtype=bfloat16", "base_mlp_dim=65536")
    tp16 = candidate(narrow, parse_hardware("v6e-256"), 256, {"fsdp": 16, "tensor": 16})
    assert tp16.binding.axis == "tensor" and tp16.binding.ratio < 1  # 65,536 / 16 = 4,096 < 5,100


def test_900b_dense_in_float32_does_not_fit_one_pod(capsys):
    keys = [f"{k}={v}" for k, v in SEED_004["900B dense"][0].items()]
    assert main(["1b", *keys, *RUN, "--hardware", "v6e-256", "--top", "3"]) == 2
    out, err = capsys.readouterr()
    # a table, not empty; a 2-way sequence split (the most a 2,048-token sequence allows: 1,024 tokens a device)
    # halves the tokens the smallest batch leaves each device
    assert "nothing fits; the smallest candidates" in out and "fsdp 8 x sequence 2 x tensor 16" in out
    assert "does not fit on v6e-256 x1" in err and "GiB over the budget of 30.4 GiB" in err
    over = float(err.split("GiB per chip (")[0].rsplit("needs ", 1)[1])
    assert 50 < over < 60  # 55 GiB of float32 parameters, gradients and AdamW state per chip alone
    # 4 pods: on 2 the smallest candidate needs 30.90 GiB of 30.4 (the gathered layers are not split over pods)
    assert "--slices 4" in err and "weight_dtype=bfloat16" in err and "decoder_layer_input=offload" in err
    assert re.search(r"optimizer_memory_host_offload=true: AdamW's moments in host memory, streamed through HBM a "
                     r"layer at a time in the update \(\d+\.\d GiB less per chip\)", err)


def test_the_slices_the_no_fit_message_suggests_fit(capsys):
    """The suggestion counted the gathered layers, which more chips do not split, with the state: llama3.1-405b on
    v5e-16 was told "about 32x the chips (--slices 32)", where the smallest candidate still needs 16.5 GiB of
    15.2; 64 slices fit."""
    import re

    args = ["llama3.1-405b", "max_target_length=2048", "dtype=bfloat16", "--top", "1"]
    assert main([*args, "--hardware", "v5e-16"]) == 2
    slices = int(re.search(r"\(--slices (\d+)\)", capsys.readouterr().err).group(1))
    assert slices == 64
    cfg = load_model_config("llama3.1-405b", ["max_target_length=2048", "dtype=bfloat16"])
    assert plan(cfg, parse_hardware("v5e-16", slices))[0].fits
    assert not plan(cfg, parse_hardware("v5e-16", slices // 2))[0].fits


@pytest.mark.parametrize("experts, needed", [(16, 20400), (32, 40800)])
def test_700b_moe_pure_fsdp_needs_sparsity_times_the_hardware_intensity(experts, needed):
    """Pure FSDP on a full v6e pod (4 links, 2,550 FLOPs/byte) needs tokens per device / sparsity above it:
    the guide's example at sparsity 16 needs more than 40k tokens (2,550 x 16 = 40,800); the 700B model itself
    (16 experts, top 2: sparsity 8) needs 20,400, and at the guide's 8k tokens per device is FSDP-bound."""
    hw = parse_hardware("v6e-256")
    cfg = guide_model("700B MoE final", f"num_experts={experts}", "weight_dtype=bfloat16", "sparse_matmul=true")
    at_guide_batch = candidate(cfg, hw, 8192, {"fsdp": 256})
    assert at_guide_batch.binding.axis == "fsdp" and at_guide_batch.binding.hardware == pytest.approx(2550)
    assert at_guide_batch.tokens_needed() == needed
    below, above = (candidate(cfg, hw, t, {"fsdp": 256}).binding for t in (needed // 2048 * 2048, 40960 + 2048))
    assert below.ratio < 1 <= above.ratio


def test_10t_moe_on_16_pods_needs_pipelining_over_dcn():
    """At 2k tokens per device across 16 v6e pods, FSDP or data parallelism over DCN is DCN-bound; pipelining
    over DCN with expert x tensor inside the pod (the guide's EP 64, TP 4, PP 16) is compute-bound on every axis.
    The guide's MoE runs route dropless (MaxText's megablox): sparse_matmul=true."""
    hw = parse_hardware("v6e-256", num_slices=16)
    cfg = guide_model("10T MoE", "weight_dtype=bfloat16", "sparse_matmul=true")
    ranked = search(cfg, hw, tokens_per_device=2048)
    dcn_hw = hw.accelerator.peak_flops / DCN_BYTES_PER_S["v6e"]
    assert dcn_hw == pytest.approx(73440)  # 918 TFLOP/s over 100 Gb/s of DCN per chip
    for c in ranked:  # fsdp over DCN: 2048 x 256 / 32 = 16,384 (0.22x); data: 1.5 x that with bf16 gradients
        if c.mesh.dcn["stage"] == 1:
            assert min(a.ratio for a in c.axes if a.link == "dcn") < 0.34 and c.mfu < 0.34 * BASE_MFU
    guide = candidate(cfg, hw, 2048, {"tensor": 4, "expert": 64}, {"stage": 16}, repeats=8)
    assert min(a.ratio for a in guide.axes) >= 1
    assert {a.axis: a.link for a in guide.axes} == {"expert": "ici x4", "tensor": "ici x2", "stage": "dcn"}
    pp16 = [c for c in ranked if c.mesh.dcn["stage"] == 16 and c.mesh.sizes["fsdp"] == 1 and c.remat == "full"]
    sharded = [c for c in pp16 if c.mesh.sizes["data"] == 1]  # each pod's weights split 256 ways, as the guide's
    assert guide.mfu == max(c.mfu for c in sharded)  # tied with EP 32 x TP 8, ahead of the rest
    # without tensor parallelism (a 0.6 rather than 0.5 ceiling) the pod must copy the weights over a data axis:
    # 3.5x the guide mesh's memory at least (which splits its attention and embedding weights 256 ways: over
    # its expert axis as well as tensor). A 2-way sequence split (1,024 tokens a device) splits the weights as well:
    # it copies them over fewer data ways, for 1.6x the guide mesh's memory at least
    for c in pp16:
        if c.mfu > guide.mfu:
            assert c.mesh.sizes["tensor"] == 1
            if c.mesh.sizes["sequence"] == 1:
                assert c.mesh.sizes["data"] >= 8 and c.memory > 3.5 * guide.memory
            else:
                assert c.mesh.sizes["sequence"] == 2 and c.mesh.sizes["data"] >= 2 and c.memory > 1.6 * guide.memory
    tp16 = candidate(cfg, hw, 2048, {"tensor": 16, "expert": 16}, {"stage": 16}, repeats=8)
    assert tp16.binding.axis == "tensor" and tp16.binding.ratio < 0.6 and tp16.mfu < guide.mfu
    assert max(ranked, key=lambda c: c.roofline_key()).mesh.dcn["stage"] > 1


def test_10t_moe_fits_16_pods_with_a_bounded_receive_buffer(capsys):
    """Dropless routing's default receive buffer has room for every sender's token copies over the expert
    axis: at 2k tokens per device nothing fits 16 pods, and the message offers ragged_buffer_factor=2, with
    which the plan fits, pipelined over DCN with expert x tensor inside each pod."""
    keys = [f"{k}={v}" for k, v in SEED_004["10T MoE"][0].items()]
    args = ["1b", *keys, *RUN, "weight_dtype=bfloat16", "sparse_matmul=true", "--hardware", "v6e-256",
            "--slices", "16", "--tokens-per-device", "2048", "--top", "1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "does not fit on v6e-256 x16" in err and "ragged_buffer_factor=2: each device's buffer" in err
    cfg = guide_model("10T MoE", "weight_dtype=bfloat16", "sparse_matmul=true", "ragged_buffer_factor=2")
    best = plan(cfg, parse_hardware("v6e-256", num_slices=16), 2048)[0]
    assert best.fits and best.mesh.dcn["stage"] > 1 and best.mesh.ici["expert"] * best.mesh.ici["tensor"] == 256


def test_gpu_plan_uses_nvlink_inside_a_node_and_the_network_across(capsys):
    hw = parse_hardware("h100-64")
    cfg = load_model_config("llama3.1-70b", ["max_target_length=4096", "dtype=bfloat16"])
    ranked = plan(cfg, hw)
    assert ranked[0].fits and ranked[0].mfu > 0.4
    h100 = GPUS["h100"]
    for c in ranked[:20]:
        assert c.mesh.sizes["tensor"] <= 8  # tensor parallelism stays on NVLink
        for a in c.axes:
            bandwidth = h100.link_bytes_per_s if a.link == "nvlink" else DCN_BYTES_PER_S["h100"]
            assert a.link in ("nvlink", "network") and a.hardware == pytest.approx(h100.peak_flops / bandwidth)
    assert main(["llama3.1-8b", *RUN, "--hardware", "h100-8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "NVLink inside nodes of 8" in out and "compile confirmation is TPU-only" in out and "nvlink" in out


def test_every_mesh_splits_the_model_evenly():
    """Heads 12, kv heads 4, mlp 1,536, 6 experts, 6 layers on a v5e-64: only divisors that keep them whole."""
    cfg = load_model_config("1b", ["base_emb_dim=768", "base_num_query_heads=12", "base_num_kv_heads=4",
                                   "head_dim=64", "base_mlp_dim=1536", "num_experts=6", "num_experts_per_tok=2",
                                   "base_num_decoder_layers=6", "max_target_length=1024"])
    found = search(cfg, parse_hardware("v5e-64"))
    m = cfg.model
    assert found and {c.mesh.sizes["tensor"] for c in found} == {1, 2, 4}
    assert {c.mesh.sizes["expert"] for c in found} == {1, 2}  # 6 experts over a power-of-two slice
    for c in found:
        s = c.mesh.sizes
        assert math.prod(s.values()) == 64
        assert m.num_query_heads % s["tensor"] == m.num_kv_heads % s["tensor"] == m.mlp_dim % s["tensor"] == 0
        assert m.num_experts % s["expert"] == 0 and m.num_decoder_layers % s["stage"] == 0
        assert m.emb_dim % (s["fsdp"] * s["sequence"] * s["expert"]) == 0
        assert (c.per_device_batch * 64) % (s["data"] * s["fsdp"] * s["expert"]) == 0


def test_a_tensor_axis_need_not_divide_a_width_no_layer_has(capsys):
    """Experts of base_moe_mlp_dim and no dense layer: base_mlp_dim sizes no weight (the trainer's mesh checks
    never see it), yet an odd base_mlp_dim kept every tensor axis out of the plan, and the header named it as the
    model's MLP."""
    keys = ["base_emb_dim=768", "base_num_query_heads=12", "base_num_kv_heads=4", "head_dim=64", "base_mlp_dim=999",
            "base_moe_mlp_dim=1536", "num_experts=6", "num_experts_per_tok=2", "base_num_decoder_layers=6",
            "max_target_length=1024"]
    found = search(load_model_config("1b", keys), parse_hardware("v5e-64"))
    assert {c.mesh.sizes["tensor"] for c in found} == {1, 2, 4}
    assert main(["1b", *keys, "--hardware", "v5e-64", "--top", "1"]) == 0
    assert "emb 768, expert mlp 1536, heads 12/4" in capsys.readouterr().out


def test_explains_the_winner(capsys):
    assert main(["llama3.1-8b", *RUN, "--hardware", "v6e-256", "--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  mesh"))
    assert all(lines[header + k].lstrip().startswith(str(k)) for k in (1, 2, 3))
    assert "ranks first:" in out and "GiB per chip" in out and " Next: " in out


def _fake_train_compile(tmp_path, monkeypatch, body: str) -> None:
    """A script in place of the interpreter that runs train_compile: `body` runs with $r (run_name), $o
    (base_output_directory) and $p (remat_policy) taken from its arguments."""
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\nfor a; do case $a in run_name=*) r=${a#*=};; base_output_directory=*) "
                    "o=${a#*=};; remat_policy=*) p=${a#*=};; esac; done\n" + body)
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))


def _run(args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "tessera.tools.plan", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_cli_from_a_subprocess_with_a_relative_model_file(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "small.yml").write_text("base_emb_dim: 1024\nbase_num_decoder_layers: 8\n"
                                                   "base_mlp_dim: 4096\nbase_num_query_heads: 8\n")
    proc = _run(["models/small.yml", "max_target_length=1024", "--hardware", "v5e-16", "--top", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model small:" in proc.stdout and "ranks first:" in proc.stdout
    missing = _run(["models/none.yml", "--hardware", "v5e-16"], tmp_path)
    assert missing.returncode == 2 and "config error: model file models/none.yml does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = _run(["llama3.1-8b", "--hardware", "v9z-8"], tmp_path)
    assert bad.returncode == 2 and "neither a TPU slice type" in bad.stderr and "Traceback" not in bad.stderr
    helped = _run(["--help"], tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: .venv/bin/python -m tessera.tools.plan")
    assert "--tokens-per-device" in helped.stdout and "getting_started/Plan.md" in helped.stdout
    assert (REPO / "getting_started" / "Plan.md").is_file()


def test_the_chosen_overrides_build_the_chosen_mesh():
    """What a written recipe passes to train.py builds the mesh, batch and remat the plan scored."""
    from tessera.config import load_config
    from tessera.tools.estimate import mesh_sizes
    from tessera.tools.plan import run_args

    hw = parse_hardware("v5e-16", num_slices=2)
    cfg = load_model_config("llama2-7b", ["max_target_length=1024", "dtype=bfloat16"])
    for c in plan(cfg, hw)[:5]:
        built = load_config([str(REPO / "configs" / "base.yml"), "model_name=llama2-7b", *run_args(c, cfg)], env={})
        assert mesh_sizes(built, hw) == c.mesh.sizes
        assert built.data.per_device_batch_size == c.per_device_batch and built.model.remat_policy == c.remat


def test_mfu_model_charges_tensor_parallelism_and_capacity_routing(capsys):
    """The TPU recipes' READMEs' assumptions: 60% of peak for a compute-bound step, 50% with a tensor axis, times
    3 / (3 + recomputed); capacity routing executes its padded slots and one-hot dispatch/combine matmuls too
    (Mixtral 8x7B at 4096 tokens, capacity 1.25: 1.41 times the counted FLOPs, as configs/tpu/v6e/README.md
    derives by hand); dropless routing executes what is counted."""
    hw = parse_hardware("v6e-256")
    cfg = load_model_config("llama2-70b", ["max_target_length=2048", "dtype=bfloat16"])
    fsdp = candidate(cfg, hw, 4096, {"fsdp": 256})
    tensor = candidate(cfg, hw, 4096, {"fsdp": 64, "tensor": 4})
    assert min(a.ratio for a in fsdp.axes + tensor.axes) > 1  # both compute-bound: only the base differs
    assert fsdp.mfu == pytest.approx(BASE_MFU * 0.75) and tensor.mfu == pytest.approx(TENSOR_MFU * 0.75)
    assert candidate(cfg, hw, 4096, {"fsdp": 256}, remat="minimal").mfu == pytest.approx(BASE_MFU)
    keys = [f"{k}={v}" for k, v in SEED_004["10T MoE"][0].items()]  # base.yml's routing: no capacity limit
    # the note is the model's, printed before the search: one pod at one batch (over 16 pods at every batch
    # size the search took 29 s for the same line)
    assert main(["1b", *keys, *RUN, "--hardware", "v6e-256", "--tokens-per-device", "4096", "--top", "1"]) in (0, 2)
    assert "computes 28.15x the FLOPs MFU counts" in capsys.readouterr().out  # every expert takes every token
    mixtral = ["max_target_length=4096", "dtype=bfloat16", "capacity_factor=1.25"]
    capacity = load_model_config("mixtral-8x7b", [*mixtral, "sparse_matmul=false"])
    assert executed_ratio(capacity) == pytest.approx(1.41, abs=0.005)
    assert executed_ratio(load_model_config("mixtral-8x7b", [*mixtral, "sparse_matmul=true"])) == 1.0
    assert executed_ratio(cfg) == 1.0
    mesh = {"fsdp": 64, "expert": 4}
    assert candidate(capacity, hw, 8192, mesh).mfu * executed_ratio(capacity) == pytest.approx(
        candidate(load_model_config("mixtral-8x7b", [*mixtral, "sparse_matmul=true"]), hw, 8192, mesh).mfu)


def test_compile_confirms_on_the_tpu_compiler_and_writes_a_runnable_recipe(tmp_path):
    """--compile end to end, as a user runs it (relative model file and --output): the TPU compiler's memory
    replaces the estimate, the batch asked for stays, and the recipe's dry run trains the chosen configuration."""
    import json

    from tessera.tools.plan_compile import heavier_policies

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.yml").write_text(
        "base_emb_dim: 256\nbase_num_decoder_layers: 2\nbase_mlp_dim: 512\nbase_num_query_heads: 4\n"
        "base_num_kv_heads: 4\nhead_dim: 64\nvocab_size: 1024\n")
    proc = _run(["models/tiny.yml", "max_target_length=256", "dtype=bfloat16", "--hardware", "v5e-4",
                 "--tokens-per-device", "512", "--top", "1", "--compile", "--output", "recipes/tiny.sh"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "compiling 1/1:" in proc.stdout and "confirmed by the TPU compiler" in proc.stdout
    report = json.loads((tmp_path / "recipes" / "tiny.json").read_text())
    best = report["candidates"][0]
    assert best["tokens_per_device"] == 512 and 0 < best["gib_per_chip"] < 16 * 0.95
    recipe = tmp_path / "recipes" / "tiny.sh"
    assert os.access(recipe, os.X_OK)
    dry = subprocess.run(["bash", "recipes/tiny.sh", "DRY_RUN=1", "PLATFORM=gke"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr
    with_sh = subprocess.run(["sh", "recipes/tiny.sh", "DRY_RUN=1", "PLATFORM=gke"], capture_output=True, text=True,
                             cwd=tmp_path, timeout=60)  # a POSIX shell: the recipe runs itself again under bash
    assert with_sh.returncode == 0 and with_sh.stdout == dry.stdout, with_sh.stderr
    command = next(line for line in dry.stdout.splitlines() if " train.py " in line)
    for key in (*best["mesh"], f"remat_policy={best['remat']}", "per_device_batch_size=2", "base_emb_dim=256"):
        assert key in command.split(), key
    fallback = Candidate(Mesh({}, {}), 1, "minimal", 1, 1, 0, 0, (), 0.0, 0.0)
    assert heavier_policies(fallback) == ["save_dot_except_mlp", "save_qkv_proj", "full"]


def test_a_compile_that_fails_is_not_read_from_the_report_of_the_one_before(tmp_path, monkeypatch, capsys):
    """A fallback remat policy compiled under the run name of the policy before it (same candidate number and
    batch): when its train_compile failed, the plan read the other policy's compile_report.json as its own."""
    from tessera.tools.plan_compile import aot_compile

    # minimal does not fit (exit 3), full fails (exit 1)
    _fake_train_compile(tmp_path, monkeypatch,
                        "if [ $p = minimal ]; then mkdir -p $o/$r; echo '{\"total_bytes\": 20, \"budget_bytes\": 10, "
                        "\"temp_bytes\": 15, \"fits\": false}' > $o/$r/compile_report.json; exit 3; fi\n"
                        "echo 'RuntimeError: INTERNAL: the compiler crashed'; exit 1\n")
    cfg, hw = load_model_config("default", []), parse_hardware("v5e-8")
    light, heavy = (candidate(cfg, hw, 1024, {"fsdp": 8}, remat=r) for r in ("minimal", "full"))
    (tmp_path / "out").mkdir()
    assert aot_compile([], light, cfg, hw, tmp_path / "out", "1/1")["total_bytes"] == 20
    assert aot_compile([], heavy, cfg, hw, tmp_path / "out", "1/1") == {}
    assert "failed:\n    RuntimeError: INTERNAL: the compiler crashed" in capsys.readouterr().out


def test_a_compile_that_crashes_is_not_tried_again_with_heavier_remat(tmp_path, monkeypatch, capsys):
    """Only "does not fit" (exit 3) calls for a remat policy that keeps less: after a crash or a refused config
    (exit 1 or 2) the plan compiled the same candidate again with each heavier policy, minutes each on a real
    model, and every one failed the same way."""
    from tessera.tools.plan_compile import confirm

    _fake_train_compile(tmp_path, monkeypatch, f"echo $p >> {tmp_path / 'policies'}\n"
                        "echo 'RuntimeError: INTERNAL: the compiler crashed'; exit 1\n")
    cfg, hw = load_model_config("default", []), parse_hardware("v5e-8")
    (tmp_path / "out").mkdir()
    c = candidate(cfg, hw, 1024, {"fsdp": 8}, remat="minimal")
    assert confirm([], c, cfg, hw, tmp_path / "out", "1/1", move_batch=True) is None
    assert (tmp_path / "policies").read_text().split() == ["minimal"]
    assert "not trying heavier remat policies: this compile failed for a reason other than memory" in (
        capsys.readouterr().out)
    # a compile that does not fit still falls back, policy by policy
    _fake_train_compile(tmp_path, monkeypatch, f"echo $p >> {tmp_path / 'fits'}\nmkdir -p $o/$r; echo "
                        "'{\"total_bytes\": 20, \"budget_bytes\": 10, \"temp_bytes\": 15, \"fits\": false}' > "
                        "$o/$r/compile_report.json; exit 3\n")
    assert confirm([], c, cfg, hw, tmp_path / "out", "1/1", move_batch=False) is None
    assert (tmp_path / "fits").read_text().split() == ["minimal", "save_dot_except_mlp", "save_qkv_proj", "full"]


def test_the_compile_reads_the_callers_libtpu_flags_after_the_recipes(tmp_path, monkeypatch):
    """--compile set LIBTPU_INIT_ARGS to the generation's flags.inc alone: a flag of the caller's own, which the
    written recipe appends after its flags (run_recipe.sh), was left out of the compile that confirmed it."""
    from tessera.tools.plan_compile import aot_compile, libtpu_flags

    fake = tmp_path / "python"  # stands in for train_compile: keeps the flags it was given
    fake.write_text(f"#!/usr/bin/env bash\necho \"$LIBTPU_INIT_ARGS\" > {tmp_path / 'flags'}; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_mine=true")
    cfg, hw = load_model_config("default", []), parse_hardware("v5e-8")
    assert aot_compile([], candidate(cfg, hw, 1024, {"fsdp": 8}), cfg, hw, tmp_path, "1/1") == {}
    assert (tmp_path / "flags").read_text().split() == [*libtpu_flags("v5e").split(), "--xla_tpu_mine=true"]


def test_a_recipe_that_cannot_be_written_after_the_compiles_is_one_line(tmp_path, monkeypatch, capsys):
    """--output's folder checked before compiling can be gone (or the disk full) by the end: a traceback, and
    the recipe written without its report."""
    import tessera.tools.plan_compile as plan_compile

    def confirm(base, c, *args, **kwargs):  # the compile, meanwhile a file takes the folder's place
        (tmp_path / "r").write_text("not a folder")
        return dataclasses.replace(c, compiled=True)

    monkeypatch.setattr(plan_compile, "confirm", confirm)
    assert main(["default", "--hardware", "v5e-8", "--top", "1", "--compile", "--output",
                 str(tmp_path / "r" / "x.sh")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: cannot write {tmp_path / 'r'}") and "Traceback" not in err, err
    assert "choose another --output" in err and sorted(p.name for p in tmp_path.iterdir()) == ["r"]


@pytest.mark.parametrize("overrides, message", [
    (["compile_topology=v6e-8"], "compile_topology=v6e-8 is not read by the plan, which sizes for --hardware v5e-8; "
                                 "pass --hardware v6e-8 instead"),
    (["compile_topology_num_slices=2"], "compile_topology_num_slices=2 is not read by the plan, which sizes for "
                                        "--slices 1; pass --slices 2 instead"),
])
def test_config_keys_that_name_other_hardware_are_refused(overrides, message, capsys):
    """The plan ranked (and --compile compiled) for --hardware and wrote the other topology into the recipe's
    overrides, without a word; the estimator already refused these."""
    assert main(["default", *overrides, "--hardware", "v5e-8"]) == 2
    captured = capsys.readouterr()
    assert (captured.err, captured.out) == (f"config error: {message}\n", "")
    assert main(["default", "compile_topology=v5litepod-8", "--hardware", "v5e-8", "--top", "1"]) == 0  # one slice


def test_num_slices_is_the_estimators_name_for_slices(capsys):
    """tessera.tools.estimate's spelling of --slices is accepted too (it was: unrecognized arguments, exit 2)."""
    assert main(["default", "--hardware", "v5e-8", "--num_slices", "2", "--top", "1"]) == 0
    assert "hardware: v5e-8 x2 = 16 x" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--top", "0"], "--top 0: give at least 1"), (["--slices", "-2"], "--slices -2: give at least 1"),
    (["--tokens-per-device", "-8"], "--tokens-per-device -8: give at least 0 (0: the largest batch that fits)"),
])
def test_an_option_out_of_range_is_named_with_its_value(args, message, capsys):
    """The message was "--slices and --top must be at least 1 and --tokens-per-device at least 0" for each."""
    assert main(["default", "--hardware", "v5e-8", *args]) == 2
    assert capsys.readouterr().err == f"config error: {message}\n"


def test_batches_are_those_num_vocab_tiling_divides(capsys):
    """The trainer refuses num_vocab_tiling that does not divide a forward pass's tokens per device; the plan ranked
    (and would write a recipe with) such batches: 64 tokens per device with 128 tiles."""
    from tessera.tools.plan import token_options

    keys = ["max_target_length=64", "num_vocab_tiling=128", "dtype=bfloat16"]
    assert main(["default", *keys, "--hardware", "v5e-8", "--tokens-per-device", "64"]) == 2
    assert capsys.readouterr().err == ("config error: --tokens-per-device 64 / gradient_accumulation_steps=1 is not a "
                                       "whole number of tokens that num_vocab_tiling=128 divides, as the trainer "
                                       "requires; give a multiple of 128\n")
    cfg = load_model_config("default", [*keys, "gradient_accumulation_steps=2"])
    assert min(token_options(cfg, parse_hardware("v5e-8"), 0)) == 256


@pytest.mark.parametrize("keys", [
    # remat_policy=full or ici_tensor_parallelism=4 on the plan's command line were dropped without a word, and
    # --compile passed them to train_compile and into the recipe beside the plan's mesh (dcn_tensor_parallelism=2
    # stayed in both: a mesh the plan never scored)
    ["remat_policy=full", "ici_tensor_parallelism=4", "dcn_tensor_parallelism=2"],
    # tensor_parallelism=2 (the GPU validation files' name) or ici_context_parallelism=2 (MaxText's) were kept:
    # train_compile got them beside the plan's ici_tensor_parallelism=1, the loader refused the disagreement, and
    # --compile ended with "the compiler fits none of the top candidates"
    ["tensor_parallelism=2", "ici_context_parallelism=2", "pipeline_parallelism=2"],
], ids=["keys", "other spellings"])
def test_keys_the_plan_chooses_are_said_to_be_replaced_and_left_out_of_the_compile(keys, tmp_path, monkeypatch,
                                                                                  capsys):
    import tessera.tools.plan_compile as plan_compile

    seen = []

    def confirm(base, c, *args, **kwargs):
        seen.append(base)
        return dataclasses.replace(c, compiled=True)

    monkeypatch.setattr(plan_compile, "confirm", confirm)
    recipe = tmp_path / "x.sh"
    assert main(["default", *keys, "dtype=bfloat16", "--hardware", "v5e-8", "--top", "1", "--compile", "--output",
                 str(recipe)]) == 0
    assert ("replaced by the plan's own choice (the mesh, the batch and remat_policy are what it chooses): "
            f"{' '.join(keys)}\n") in capsys.readouterr().out
    assert seen == [["model_name=default", "dtype=bfloat16"]]
    assert not [k for k in keys if k in recipe.read_text()], recipe.read_text()
    assert "_parallelism=2" not in recipe.read_text()  # none of them under another spelling either


def test_keys_the_plan_chooses_in_a_model_file_are_said_to_be_replaced(tmp_path, capsys):
    """remat_policy or a mesh key in the model file were replaced without the line the command line's get."""
    model = tmp_path / "tiny.yml"
    model.write_text("base_emb_dim: 256\nbase_num_decoder_layers: 2\nremat_policy: none\nici_tensor_parallelism: 2\n")
    assert main([str(model), "dtype=bfloat16", "--hardware", "v5e-8", "--top", "1"]) == 0
    assert ("replaced by the plan's own choice (the mesh, the batch and remat_policy are what it chooses): "
            "remat_policy=none ici_tensor_parallelism=2\n") in capsys.readouterr().out


def test_a_gpu_count_of_zero_is_a_config_error(capsys):
    assert main(["llama3-8b", "--hardware", "h100-0"]) == 2
    err = capsys.readouterr().err
    assert err == "config error: --hardware='h100-0' has no GPUs; give the count after the name, e.g. h100-8\n"


def test_options_that_would_do_nothing_are_refused_before_the_search(tmp_path, capsys):
    """--output without --compile wrote nothing without a word; --compile on GPU hardware ranked the
    plans first and refused after them."""
    assert main(["default", "--hardware", "v5p-8", "--output", str(tmp_path / "x.sh")]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"config error: --output {tmp_path / 'x.sh'} names the recipe --compile writes; add "
                            "--compile, or leave --output out to print the plan only\n")
    assert main(["default", "--hardware", "h100-8", "--compile"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "GPU plans stay estimates (leave --compile out)" in captured.err
    # train_compile refuses 512 slices or more: each compile failed, then "the compiler fits none of the top
    # candidates"
    assert main(["default", "--hardware", "v5e-1", "--slices", "512", "--compile", "--output",
                 str(tmp_path / "y.sh")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ("config error: --slices 512 with --compile: train_compile compiles "
                                                   "for at most 511 slices (libtpu aborts at 512); leave --compile "
                                                   "out to plan without compiling\n")
    # the guide's MoE examples are sized on a dense block family; the trainer builds no such model
    assert main(["default", "num_experts=8", "num_experts_per_tok=2", "--hardware", "v5e-8", "--compile",
                 "--output", str(tmp_path / "z.sh")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("config error: num_experts=8: decoder_block=llama2 has a "
                                                          "dense MLP")
    assert list(tmp_path.iterdir()) == []


def test_compile_output_that_cannot_be_written_is_refused_before_compiling(tmp_path, capsys):
    compile_to = ["default", "--hardware", "v5p-8", "--top", "1", "--compile", "--output"]
    (tmp_path / "X").write_text("a file, not a folder")
    assert main([*compile_to, str(tmp_path / "X" / "x.sh")]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"config error: --output={tmp_path / 'X' / 'x.sh'} cannot be written: {tmp_path / 'X'} "
                            "is a file, not a folder; choose another --output\n")
    assert "compiling" not in captured.out and captured.out == ""  # refused before the search and any compile
    (tmp_path / "d" / "x.json").mkdir(parents=True)  # the JSON report's place is taken by a folder
    assert main([*compile_to, str(tmp_path / "d" / "x.sh")]) == 2
    assert f"{tmp_path / 'd' / 'x.json'} already exists and --compile would replace it" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X", "d"] and list((tmp_path / "d").iterdir()) == [
        tmp_path / "d" / "x.json"]



def test_compile_output_that_is_a_url_or_too_long_a_name_is_refused_before_compiling(tmp_path, capsys, monkeypatch):
    """--output gs://b/plans/x.sh compiled, then wrote the recipe to the local file ./gs:/b/plans/x.sh (pathlib
    drops a slash); a name over 255 bytes was an OSError "File name too long" traceback."""
    monkeypatch.chdir(tmp_path)
    compile_to = ["default", "--hardware", "v5p-8", "--top", "1", "--compile", "--output"]
    for output in ("gs://b/plans/x.sh", "file:///tmp/x.sh"):
        assert main([*compile_to, output]) == 2
        captured = capsys.readouterr()
        assert captured.err == (f"config error: --output={output} is a URL: the recipe and its JSON report are written "
                                "to local files; give a local path, e.g. --output x.sh, and copy them where they "
                                "should go\n") and captured.out == ""
    assert main([*compile_to, "p" * 300 + ".sh"]) == 2
    assert capsys.readouterr().err == (f"config error: --output={tmp_path}/{'p' * 20}... has a file or folder name of "
                                       "303 bytes, and file systems take names of at most 255 bytes; use a shorter "
                                       "name\n")
    assert list(tmp_path.iterdir()) == []


def test_compile_never_replaces_a_file(tmp_path, capsys, monkeypatch):
    """--output naming a shipped recipe (or any file) rewrote it after the compiles, without a word; an
    --output ending in .json was replaced by the JSON report, so the recipe was lost."""
    monkeypatch.chdir(tmp_path)
    compile_to = ["default", "--hardware", "v5p-8", "--top", "1", "--compile", "--output"]
    (tmp_path / "mine.sh").write_text("my recipe\n")
    (tmp_path / "notes.json").write_text("{}")
    for output, message in [
            ("mine.sh", "config error: mine.sh already exists and --compile would replace it; "
                        "move it away or choose another --output"),
            ("notes.sh", "config error: notes.json already exists"),  # the report's place
            ("r.json", "config error: --output=r.json names the recipe, a bash script, and its JSON report goes "
                       "beside it as r.json; give the recipe a .sh name")]:
        assert main([*compile_to, output]) == 2, output
        captured = capsys.readouterr()
        assert captured.err.startswith(message) and captured.out == "", captured.err
    assert (tmp_path / "mine.sh").read_text() == "my recipe\n" and (tmp_path / "notes.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.sh", "notes.json"]


def test_long_sequences_plan_a_load_balanced_sequence_split():
    """Llama 3.1 8B at 131,072 tokens on v5p-128: the plan splits the sequence (each device a share, splash attention
    load-balanced) instead of the tensor axis it chose when sequence splits were not tried, and its overrides build
    that mesh. At 2,048 tokens on v6e-256 the first choice keeps the sequence whole, as before (fsdp 256, 2 sequences
    a device)."""
    from tessera.config import load_config
    from tessera.models.attention_choice import select_attention
    from tessera.tools.estimate import mesh_sizes
    from tessera.tools.plan import run_args
    from tessera.tools.plan_report import explain

    hw = parse_hardware("v5p-128")
    cfg = load_model_config("llama3.1-8b", ["max_target_length=131072", "dtype=bfloat16"])
    best = plan(cfg, hw)[0]
    s = best.mesh.sizes
    assert best.fits and s["sequence"] > 1 and s["tensor"] == 1, best.mesh.describe()
    assert best.mfu == pytest.approx(BASE_MFU * 3 / (3 + 0))  # minimal: compute-bound, no tensor axis
    assert any(a.axis == "sequence" and a.ratio > 1 for a in best.axes)
    built = load_config([str(REPO / "configs" / "base.yml"), "model_name=llama3.1-8b", *run_args(best, cfg)], env={})
    assert f"ici_sequence_parallelism={s['sequence']}" in run_args(best, cfg) and mesh_sizes(built, hw) == s
    assert "load-balanced" in select_attention(built.model, "tpu", 131072, s).reason
    assert f"split {s['sequence']} ways (a chip holds {131072 // s['sequence']:,} of its tokens)" in explain(best, None)
    short = plan(load_model_config("llama3.1-8b", RUN), parse_hardware("v6e-256"))[0]
    assert short.mesh.describe() == "fsdp 256" and short.per_device_batch == 2 and short.remat == "minimal"


def test_no_tpu_mesh_set_up_refuses_is_a_candidate():
    """qwen3_next with pipeline stages and tensor parallelism together is refused for TPUs (their compiler aborts):
    the search never offers it there, and still offers stages and tensor apart."""
    from tessera.tools.plan_meshes import meshes

    cfg = load_model_config("qwen3-next-80b-a3b", ["max_target_length=4096"])
    sizes = [m.sizes for m in meshes(cfg, parse_hardware("v5p-128"))]
    assert not [s for s in sizes if s["stage"] > 1 and s["tensor"] > 1]
    assert [s for s in sizes if s["stage"] > 1] and [s for s in sizes if s["tensor"] > 1]


def test_sequence_splits_tried_are_those_splash_serves_balanced():
    """TPU: ways that leave each device >= 1,024 tokens in two whole 128-token parts, and whose query blocks divide a
    part; none without the load balance, none on GPUs."""
    from tessera.tools.plan_meshes import sequence_ways

    tpu, gpu = parse_hardware("v5e-64"), parse_hardware("h100-64")
    cfg = load_model_config("llama2-7b", ["max_target_length=4096"])
    assert sequence_ways(cfg, tpu, 64) == [1, 2, 4]
    assert sequence_ways(load_model_config("llama2-7b", ["max_target_length=32768"]), tpu, 64) == [1, 2, 4, 8, 16, 32]
    assert sequence_ways(load_model_config("llama2-7b", ["max_target_length=3840"]), tpu, 48) == [1, 3]  # 15 x 256
    blocks = load_model_config("llama2-7b", ["max_target_length=6144", "sa_block_q=1024"])
    assert sequence_ways(blocks, tpu, 48) == [1, 3, 4, 6]  # 2 ways: parts of 1,536 queries, not whole blocks
    contiguous = load_model_config("llama2-7b", ["max_target_length=4096", "context_parallel_load_balance=false"])
    assert sequence_ways(contiguous, tpu, 64) == [1]
    assert sequence_ways(cfg, gpu, 64) == [1]
    assert {c.mesh.sizes["sequence"] for c in search(cfg, tpu)} == {1, 2, 4}


def test_a_recipe_with_a_sequence_axis_is_scored_with_it():
    """own_candidates (the recipes' targets, plan_recipes.py) keeps the config's sequence axis, ICI and DCN."""
    from tessera.tools.plan import own_candidates

    cfg = load_model_config("llama3.1-8b", ["max_target_length=131072", "dtype=bfloat16", "ici_fsdp_parallelism=16",
                                            "ici_sequence_parallelism=4", "per_device_batch_size=0.25"])
    scored = own_candidates(cfg, parse_hardware("v5p-128"))["full"]
    assert scored.mesh.sizes["sequence"] == 4 and scored.mesh.sizes["fsdp"] == 16
    assert [a.axis for a in scored.axes] == ["fsdp", "sequence"]
    two = load_model_config("llama3.1-8b", ["max_target_length=131072", "ici_fsdp_parallelism=16",
                                            "ici_sequence_parallelism=4", "dcn_sequence_parallelism=2",
                                            "per_device_batch_size=0.25"])
    mesh = own_candidates(two, parse_hardware("v5p-128", num_slices=2))["full"].mesh
    assert mesh.sizes["sequence"] == 8 and mesh.ici["sequence"] == 4 and mesh.dcn["sequence"] == 2


def test_a_recipe_over_several_slices_is_scored_with_data_across_them():
    """dcn_data_parallelism=-1 (base.yml's) fills in the slice count; config_mesh took it as 1 and put the two
    slices' data ways inside one v6e-256 (ici data 2 x fsdp 256 = 512 chips), so plan_recipes.py scored a
    NUM_SLICES=2 recipe's data axis on ICI links instead of DCN."""
    from tessera.tools.plan import config_mesh, own_candidates

    cfg = load_model_config("llama3.1-8b", ["max_target_length=2048", "dtype=bfloat16", "per_device_batch_size=2"])
    hw = parse_hardware("v6e-256", num_slices=2)
    mesh = config_mesh(cfg, hw)
    assert (mesh.ici["data"], mesh.ici["fsdp"], mesh.dcn["data"]) == (1, 256, 2)
    assert [(a.axis, a.link) for a in own_candidates(cfg, hw)["full"].axes] == [("fsdp", "ici x4"), ("data", "dcn")]


def test_dtypes_training_refuses_are_refused_by_the_planner_and_the_estimate(capsys):
    """The planner and the estimate do not size a run that training would refuse: float16
    weights anywhere, float16 compute on TPUs (its kernels do not compile it); float16
    compute on GPUs is sized."""
    from tessera.tools.estimate import main as estimate

    assert main(["llama2-7b", "dtype=float16", "--hardware", "v5p-8", "--top", "1"]) == 2
    assert "config error: dtype=float16 on TPU" in capsys.readouterr().err
    assert estimate(["llama2-7b", "weight_dtype=float16", "--hardware", "h100-8"]) == 2
    assert "config error: weight_dtype=float16 cannot be trained" in capsys.readouterr().err
    assert estimate(["llama2-7b", "dtype=float16", "--hardware", "h100-8"]) == 0


def test_a_model_named_twice_differently_is_refused(tmp_path, capsys):
    """`plan m3.yml model_name=llama3.1-8b` planned m3 without a word about llama3.1-8b."""
    (tmp_path / "m3.yml").write_text("base_emb_dim: 64\nbase_num_decoder_layers: 2\n")
    assert main([str(tmp_path / "m3.yml"), "model_name=llama3.1-8b", "--hardware", "v5p-8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"config error: the model is named twice: {tmp_path / 'm3.yml'} and model_name=llama3.1-8b; give it once "
        "(a model name or YAML file as the first argument, or model_name=...)\n")


def test_a_candidate_is_valid_only_when_the_trainer_accepts_its_batch_with_accumulation():
    """The planner checked a pipeline against the whole batch, the trainer against each accumulation micro-batch:
    with gradient_accumulation_steps=2 it offered a mesh whose micro-batch does not split into microbatches."""
    from tessera.config import ConfigError
    from tessera.config.derived import plan_run
    from tessera.tools.plan import layout_or_none

    mesh = Mesh({**{a: 1 for a in ICI_AXES}, "stage": 2, "fsdp": 4}, {a: 1 for a in DCN_AXES})
    cfg = load_model_config("default", ["per_device_batch_size=1", "gradient_accumulation_steps=2"])
    with pytest.raises(ConfigError) as trainer:
        plan_run(cfg, mesh.sizes)
    with pytest.raises(ConfigError) as planner:
        layout_or_none(cfg, mesh)
    assert str(planner.value) == str(trainer.value)
    one = load_model_config("default", ["per_device_batch_size=2"])
    assert layout_or_none(one, mesh).microbatches == plan_run(one, mesh.sizes).pipeline.microbatches



def test_a_recipe_written_in_the_repository_sources_its_helpers_relative_to_itself(tmp_path):
    """--output my_recipes/x.sh wrote `source "/abs/path/of/this/clone/configs/run_recipe.sh"`: the
    recipe broke once the repository moved (another clone, a container at another path)."""
    from tessera.tools.plan_compile import CONFIGS, _sourced

    for recipe in (CONFIGS.parent / "my_recipes" / "x.sh", CONFIGS / "tpu" / "v6e" / "x.sh"):
        for target in (CONFIGS / "run_recipe.sh", CONFIGS / "tpu" / "v6e" / "flags.inc"):
            text = _sourced(recipe, target)
            prefix = '"$(dirname "${BASH_SOURCE[0]}")/'
            assert text.startswith(prefix) and str(CONFIGS.parent) not in text, text
            assert (recipe.parent / text[len(prefix):-1]).resolve() == target.resolve()
    assert _sourced(tmp_path / "x.sh", CONFIGS / "run_recipe.sh") == f'"{CONFIGS / "run_recipe.sh"}"'  # outside



def test_a_multi_slice_recipe_compiles_for_its_slices(tmp_path):
    """The written recipe set `export NUM_SLICES=${NUM_SLICES:-2}` after sourcing run_recipe.sh, which had set it
    to 1 already: `bash <recipe> EXECUTABLE=train_compile` compiled for one slice."""
    from tessera.tools.plan_compile import write_recipe

    cfg = load_model_config("default", ["max_target_length=256"])
    hw = parse_hardware("v5e-4", 2)
    recipe = tmp_path / "two.sh"
    write_recipe(recipe, plan(cfg, hw)[0], cfg, hw, ["max_target_length=256"])
    for args, slices in (((), 2), (("NUM_SLICES=3",), 3)):
        dry = subprocess.run(["bash", str(recipe), "DRY_RUN=1", "EXECUTABLE=train_compile", "PYTHON=python3", *args],
                             capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert dry.returncode == 0, dry.stderr
        assert f"compile_topology_num_slices={slices}" in dry.stdout.split(), dry.stdout


def test_a_slice_type_typed_in_capitals_is_written_as_reports_print_it(tmp_path):
    """--hardware " V5E-8" went into the recipe as typed (`run_recipe  V5E-8`), and into every header."""
    from tessera.tools.plan_compile import write_recipe

    cfg = load_model_config("default", [])
    hw = parse_hardware(" V5E-8")
    assert hw.name == "v5e-8" and parse_hardware("v5litepod-8").name == "v5litepod-8"
    recipe = tmp_path / "x.sh"
    write_recipe(recipe, plan(cfg, hw)[0], cfg, hw, [])
    assert "\nrun_recipe v5e-8 \\\n" in recipe.read_text()


def test_a_recipe_keeps_the_run_length_given_to_the_plan(tmp_path):
    """steps=1000 on the plan's command line went into the recipe before its own steps=100, which won: the
    recipe trained 100 steps."""
    from tessera.tools.plan_compile import write_recipe

    cfg = load_model_config("default", ["max_target_length=256", "steps=1000"])
    hw = parse_hardware("v5e-8")
    recipe = tmp_path / "x.sh"
    write_recipe(recipe, plan(cfg, hw)[0], cfg, hw, ["max_target_length=256", "steps=1000"])
    dry = subprocess.run(["bash", str(recipe), "DRY_RUN=1", "PYTHON=python3"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr
    words = next(line for line in dry.stdout.splitlines() if " train.py " in line).split()
    assert "steps=1000" in words and "steps=100" not in words and "log_period=10" in words, words


def test_a_recipe_for_a_generation_without_flags_runs(tmp_path):
    """A tpu7x plan's recipe sourced configs/tpu/tpu7x/flags.inc, which does not exist: under `set -e` it stopped
    at that line ("No such file or directory", exit 1) before running anything."""
    from tessera.tools.plan_compile import write_recipe

    cfg = load_model_config("default", ["max_target_length=256"])
    hw = parse_hardware("tpu7x-8")
    recipe = tmp_path / "x.sh"
    write_recipe(recipe, plan(cfg, hw)[0], cfg, hw, ["max_target_length=256"])
    dry = subprocess.run(["bash", str(recipe), "DRY_RUN=1", "EXECUTABLE=train_compile", "PYTHON=python3"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "compile_topology=tpu7x-8" in dry.stdout.split(), dry.stdout

def test_recipe_of_a_model_file_with_lists_and_booleans_runs_as_planned(tmp_path):
    """A model file copied from configs/models (lists, booleans) went into the recipe as Python's
    `mlp_activations=['silu', 'linear'] logits_via_embedding=True`, unquoted: the shell split the list in two
    and the recipe stopped with a config error. A model file's own model_name is not a model to load."""
    import shlex

    from tessera.config import load_config
    from tessera.tools.plan_compile import model_overrides, write_recipe

    model = tmp_path / "tiny.yml"
    model.write_text('base_emb_dim: 256\nbase_num_decoder_layers: 2\nmlp_activations: ["silu", "linear"]\n'
                     "logits_via_embedding: true\nnormalization_layer_epsilon: 1.0e-6\nmodel_name: tiny\n")
    base = model_overrides(str(model), ["max_target_length=256", "run_name=my run"])
    assert "model_name=tiny" not in base
    cfg = load_model_config(str(model), ["max_target_length=256"])
    hw = parse_hardware("v5e-4")
    best = plan(cfg, hw)[0]
    recipe = tmp_path / "recipes" / "tiny.sh"
    write_recipe(recipe, best, cfg, hw, base)
    dry = subprocess.run(["bash", str(recipe), "DRY_RUN=1", "PLATFORM=gke", "PYTHON=python3"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr
    command = shlex.split(next(line for line in dry.stdout.splitlines() if " train.py " in line))
    built = load_config([str(REPO / "configs" / "base.yml"), *command[3:]], env={})
    assert built.model.mlp_activations == ["silu", "linear"] and built.model.logits_via_embedding is True
    assert built.model.normalization_layer_epsilon == 1e-6 and built.model.emb_dim == 256
    assert built.run.run_name == "my run" and built.model.model_name == "default"
    assert built.model.remat_policy == best.remat and built.mesh.ici_fsdp_parallelism == best.mesh.ici["fsdp"]


def test_a_model_file_naming_another_model_is_refused(tmp_path, capsys):
    """`model_name: llama3.1-8b` in the file was dropped without a word: the plan sized the tiny default model
    with the file's keys (and --compile would have compiled llama3.1-8b)."""
    (tmp_path / "mine.yml").write_text("model_name: llama3.1-8b\nmax_target_length: 2048\n")
    assert main([str(tmp_path / "mine.yml"), "--hardware", "v5p-8"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        f"config error: {tmp_path / 'mine.yml'} sets model_name='llama3.1-8b', which a model file (a whole model, "
        "like configs/models/*.yml) cannot; remove that line, or name that model and give your keys as overrides: "
        "llama3.1-8b key=value ...\n")


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("signum, code, text", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                                (signal.SIGINT, 130, "interrupted (Ctrl-C)")])
def test_compile_stopped_by_a_signal_stops_the_compiler_in_one_line(tmp_path, signum, code, text):
    """Ctrl-C was a traceback; SIGTERM killed the plan and left its train_compile compiling on its own."""
    (tmp_path / "tiny.yml").write_text("base_emb_dim: 256\nbase_num_decoder_layers: 2\nbase_mlp_dim: 512\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "tessera.tools.plan", "tiny.yml", "max_target_length=256",
                             "--hardware", "v5e-4", "--top", "1", "--compile", "--output", "r/tiny.sh"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    compiler = []
    try:
        for line in proc.stdout:
            if line.startswith("compiling 1/1:"):
                break
        for _ in range(100):  # the compiler's process has started once the line is out
            compiler = _children(proc.pid)
            if compiler:
                break
            time.sleep(0.05)
        assert compiler, "no train_compile child"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        for pid in compiler:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == code, err
    assert err == f"plan: {text} while compiling; the compiler was stopped and no recipe was written\n"
    time.sleep(0.5)
    assert not [pid for pid in compiler if Path(f"/proc/{pid}").exists()
                and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not (tmp_path / "r").exists()


def test_no_mesh_because_of_gradient_accumulation_names_it(capsys):
    """Every batch the plan tries is a power of two of sequences, which 3 accumulation steps never divide: the
    message blamed the meshes and --tokens-per-device only."""
    assert main(["llama3.1-8b", "max_target_length=2048", "gradient_accumulation_steps=3", "--hardware", "v5p-64"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("config error: no mesh of 32 devices splits this model evenly with a whole global batch that "
                        "gradient_accumulation_steps=3 divides; change --tokens-per-device or the device count (or "
                        "leave gradient_accumulation_steps out)\n")


def test_an_eval_step_that_does_not_fit_does_not_send_the_batch_round_in_circles(monkeypatch, capsys):
    """With eval_interval, the compile report's `fits` includes the eval step, but the batch was predicted from
    the train step's memory alone: the train step fit at twice the batch, the eval step nowhere, and --compile
    went from the predicted batch one step down and back up again without end (two compiles a round)."""
    import tessera.tools.plan_compile as plan_compile

    cfg, hw = load_model_config("default", ["eval_interval=10", "eval_steps=1", "eval_per_device_batch_size=4096"]), \
        parse_hardware("v5e-8")
    gib, calls = 2**30, []

    def aot_compile(base, c, cfg, hw, out_dir, label):  # the train step small, the fixed eval batch too large
        calls.append(c.tokens_per_device)
        if len(calls) > 20:
            raise RuntimeError(f"compiled {len(calls)} times: {calls}")
        total = gib * c.tokens_per_device / 2048
        return {"total_bytes": total, "temp_bytes": total / 2, "budget_bytes": 15.2 * gib, "fits": False,
                "argument_bytes": total / 2, "code_bytes": 0,
                "eval_step": {"eval_batch": 4096, "temp_bytes": 20 * gib, "output_bytes": 0, "code_bytes": 0,
                              "total_bytes": 20 * gib + total / 2, "compiler_error": ""}}

    monkeypatch.setattr(plan_compile, "aot_compile", aot_compile)
    c = candidate(cfg, hw, 1024, {"fsdp": 8})
    assert plan_compile.fit_batch([], c, cfg, hw, Path("."), "1/1") is None
    assert len(calls) <= 3 and all(t <= 1024 for t in calls), calls


def test_a_compile_whose_eval_step_does_not_fit_says_so(tmp_path, monkeypatch, capsys):
    """The line printed for each compile gave the train step's memory only: "0.50 GiB per chip (does NOT fit in
    15.2)" when the eval step was what did not fit."""
    from tessera.tools.plan_compile import aot_compile

    # the train step fits, its eval step does not
    _fake_train_compile(tmp_path, monkeypatch,
                        "mkdir -p $o/$r; echo '{\"total_bytes\": 536870912, \"budget_bytes\": 16320875724, "
                        "\"temp_bytes\": 1, \"fits\": false, \"eval_step\": {\"total_bytes\": 21474836480}}' > "
                        "$o/$r/compile_report.json; exit 3\n")
    cfg, hw = load_model_config("default", []), parse_hardware("v5e-8")
    (tmp_path / "out").mkdir()
    aot_compile([], candidate(cfg, hw, 1024, {"fsdp": 8}), cfg, hw, tmp_path / "out", "1/1")
    assert "  0.50 GiB per chip, an evaluation 20.00 (does NOT fit in 15.2)" in capsys.readouterr().out


def test_an_eval_step_is_said_to_be_left_out_of_the_estimates(capsys):
    """eval_interval was left out of the plan's memory without a word (the estimate says so; train_compile
    compiles the eval step and refuses a run whose evaluation does not fit)."""
    assert main(["default", "--hardware", "v5e-8", "--top", "1"]) == 0
    assert "eval step" not in capsys.readouterr().out
    assert main(["default", "eval_interval=10", "eval_steps=1", "--hardware", "v5e-8", "--top", "1"]) == 0
    assert ("memory: the eval step (eval_interval=10) is not in these estimates; --compile compiles it too, and a "
            "candidate fits only when its evaluation does\n") in capsys.readouterr().out

