"""AOT compile for TPU topologies on this CPU host (libtpu describes the chips): slice types,
the memory report, the does-not-fit exit with its knobs, the compiler's own refusal, and
multi-slice meshes. Models are tiny; compiling the real recipes is benchmarks/aot_recipes.py."""

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import pytest

from conftest import TINY
from tessera.config import ConfigError, build_config
from tessera import train_compile
from tessera.hardware import tpu_slice
from tessera.hlo_text import tpu_kernels
from tessera.train_compile import EXIT_DOES_NOT_FIT, compile_for_topology, main, memory_table, not_fits_message

BASE = ["configs/base.yml"]


@pytest.mark.parametrize("name, chips, shape, libtpu_name", [
    ("v5p-256", 128, (4, 4, 8), "v5p:4x4x8"),
    ("v5p-8", 4, (2, 2, 1), "v5p:2x2x1"),
    ("v4-384", 192, (4, 4, 12), "v4:4x4x12"),
    ("v5e-256", 256, (16, 16), "v5e:16x16"),
    ("v5litepod-16", 16, (4, 4), "v5e:4x4"),
    ("v6e-8", 8, (2, 4), "v6e:2x4"),
    ("tpu7x-16", 8, (2, 2, 2), "tpu7x:2x2x2"),
])
def test_slice_types(name, chips, shape, libtpu_name):
    s = tpu_slice(name)
    assert (s.chips, s.shape, s.topology_name) == (chips, shape, libtpu_name)


@pytest.mark.parametrize("name, message", [
    ("v5p-3", "multiple of 2"),
    ("v9-8", "is not a TPU slice type"),
    ("v5e-512", "at most 256 chips"),
    ("v6e-12", "not a v6e slice shape"),
    ("v5e-0", "a slice has at least one chip; the smallest v5e slice type is v5e-1"),
    ("v5p-1", "a slice has at least one chip; the smallest v5p slice type is v5p-2"),
])
def test_bad_slice_types_say_what_to_do(name, message):
    with pytest.raises(ConfigError, match=message):
        tpu_slice(name)


def test_a_slice_type_is_named_as_written_canonically():
    """"V5E-8 " was accepted and written into reports and plans exactly as typed."""
    assert tpu_slice(" V5E-8 ").name == "v5e-8" and tpu_slice("v5litepod-16").name == "v5litepod-16"


def overrides(tmp_path, **extra):
    values = {**TINY, "base_output_directory": str(tmp_path), "run_name": "aot", **extra}
    return [*BASE, *(f"{k}={v}" for k, v in values.items())]


@pytest.fixture(scope="module")
def small_report():
    cfg = build_config({**TINY, "compile_topology": "v5e-8", "dtype": "bfloat16"})
    return cfg, compile_for_topology(cfg)


def test_compiles_for_a_tpu_topology_and_reports_memory(small_report):
    cfg, r = small_report
    assert (r.num_devices, r.device_kind, r.mesh["fsdp"]) == (8, "TPU v5 lite", 8)
    assert r.fits and 0 < r.argument_bytes < r.total_bytes < 2**30
    assert r.hbm_bytes == 16 * 2**30 and r.budget_bytes == int(0.95 * 16 * 2**30)


def test_not_fits_message_names_the_knobs_for_the_larger_part(small_report):
    cfg, r = small_report
    activations_heavy = dataclasses.replace(r, temp_bytes=10 * r.argument_bytes, budget_bytes=1)
    text = not_fits_message(activations_heavy, cfg)
    assert text.startswith("does not fit") and "The larger part is activations/workspace" in text
    assert text.index("per_device_batch_size") < text.index("weight_dtype") and "remat_policy" in text
    state_heavy = dataclasses.replace(r, temp_bytes=0, budget_bytes=1)
    text = not_fits_message(state_heavy, cfg)
    assert "The larger part is the train state" in text and text.index("more chips") < text.index("per_device")
    assert "weight_dtype (now float32) bfloat16" in text
    bf16_weights = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weight_dtype="bfloat16"))
    text = not_fits_message(state_heavy, bf16_weights)  # a knob already turned is not offered again
    assert "weight_dtype=bfloat16 (already)" in text and "(now bfloat16) bfloat16" not in text
    # the moments' offload is offered for AdamW, and not again once it is on
    assert "optimizer_memory_host_offload=true: AdamW's moments in host memory between steps" in text
    offloaded = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer_memory_host_offload=True))
    muon = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, opt_type="muon"))
    assert all("optimizer_memory_host_offload" not in not_fits_message(state_heavy, c) for c in (offloaded, muon))


def test_the_report_shows_xlas_own_buffer_assignment_beside_the_total(small_report):
    """The TPU compiler's memory analysis reports more temporaries than its buffer assignment holds (llama2-7b on
    v5p-8: 13.19 GiB against 11.23; the 900B dense model with its moments offloaded: 23.97 against 16.86), and it
    refuses a program against the assignment. The total keeps the analysis' sum (MaxText's, so figures compare);
    the table shows the assignment, and a step over the budget by the sum only says so."""
    cfg, r = small_report
    assert 0 < r.allocated_bytes <= r.total_bytes and r.argument_bytes < r.allocated_bytes
    assert "XLA's buffer assignment + program" in memory_table(r)
    over_by_sum = dataclasses.replace(r, budget_bytes=r.total_bytes - 1, allocated_bytes=r.total_bytes // 2)
    text = not_fits_message(over_by_sum, cfg)
    assert text.startswith("does not fit") and text.splitlines()[-1] == (
        f"(XLA's own buffer assignment for this step is {r.total_bytes // 2 / 2**30:.2f} GiB per device, within the "
        f"budget: the total above sums the compiler's memory analysis, whose temporaries are "
        f"{(r.total_bytes - r.total_bytes // 2) / 2**30:.2f} GiB larger than what it assigns. Before relying on "
        "the smaller figure, run a step on the slice.)")
    over_by_both = dataclasses.replace(r, budget_bytes=1)
    assert "buffer assignment" not in not_fits_message(over_by_both, cfg)
    no_figure = dataclasses.replace(r, allocated_bytes=0)
    assert "buffer assignment" not in memory_table(no_figure)


def test_not_fits_message_offers_vocab_tiling_where_the_logits_weigh(small_report):
    """A large vocabulary's logits (gpt-oss-120b at 8192 tokens: 9 GiB per chip, 6 of them saved
    by num_vocab_tiling=8) are a knob of their own; not offered where tiles are set or the logits
    are small."""
    cfg, r = small_report
    over = dataclasses.replace(r, temp_bytes=10 * r.argument_bytes, budget_bytes=1)
    big_vocab = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=201088))
    d = cfg.data
    tokens = d.per_device_batch_size * d.max_target_length
    text = not_fits_message(dataclasses.replace(over, total_bytes=tokens * 201088 * 6), big_vocab)
    assert "num_vocab_tiling (now 1) higher" in text
    assert f"{tokens * 201088 * 6 / 2**30:.2f} GiB per device" in text
    assert text.index("per_device_batch_size") < text.index("num_vocab_tiling") < text.index("remat_policy")
    tiled = dataclasses.replace(big_vocab, model=dataclasses.replace(big_vocab.model, num_vocab_tiling=2))
    assert "num_vocab_tiling" not in not_fits_message(over, tiled)
    assert "num_vocab_tiling" not in not_fits_message(dataclasses.replace(over, total_bytes=2**40), big_vocab)


def test_the_table_does_not_claim_no_kernels_when_the_compiler_stopped(small_report):
    """The compiler's own out-of-memory leaves no program: the table said "custom calls in the program: none"
    and "collectives in the program: none", as if the step had neither."""
    _, r = small_report
    stopped = dataclasses.replace(r, custom_calls={}, tpu_kernels={}, collectives={},
                                  compiler_error="RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
    lines = memory_table(stopped).splitlines()
    assert lines[-2].endswith("custom calls in the program: unknown (the compiler stopped before the program was "
                              "complete)")
    assert lines[-1] == "  collectives in the program: unknown (the compiler stopped before the program was complete)"
    assert "custom calls in the program: none" in memory_table(dataclasses.replace(r, custom_calls={}))


def test_exit_code_and_report_when_it_does_not_fit(tmp_path, capsys, caplog, monkeypatch):
    monkeypatch.setattr(train_compile, "HEARTBEAT_SECONDS", 0.05)  # a line while the compiler works
    caplog.set_level(logging.INFO, logger="tessera")
    code = main(overrides(tmp_path, compile_topology="v5e-4", compile_hbm_budget_fraction=1e-6))
    assert code == EXIT_DOES_NOT_FIT
    assert any(re.fullmatch(r"compiling for v5e-4: \d+s elapsed", r.getMessage()) for r in caplog.records)
    assert "does not fit: the train step needs" in capsys.readouterr().err
    report = json.loads((tmp_path / "aot" / "compile_report.json").read_text())
    assert report["fits"] is False and report["topology"] == "v5e-4" and report["budget_bytes"] < 20000


def test_the_compilers_own_out_of_memory_becomes_a_report(tmp_path, capsys):
    # logits alone: 64 sequences x 1024 tokens x 131072 vocab x 4 bytes = 32 GiB per v5e chip
    code = main(overrides(tmp_path, compile_topology="v5e-1", vocab_size=131072, per_device_batch_size=64,
                          max_target_length=1024))
    assert code == EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    assert "The TPU compiler stopped with: RESOURCE_EXHAUSTED" in err and "per_device_batch_size (now 64)" in err


def test_with_evaluation_the_eval_step_is_compiled_and_must_fit_too(tmp_path, capsys):
    """eval_interval > 0: the eval step is compiled for the topology as well, and what it needs
    beside the train state counts. Here the train step fits a v5e chip (one sequence per chip) and
    an eval batch of 64 does not (its logits alone: 64 x 1024 x 131072 x 4 bytes = 32 GiB)."""
    fits = compile_for_topology(build_config({**TINY, "compile_topology": "v5e-4", "eval_interval": 5,
                                              "eval_steps": 1}))
    e = fits.eval_step
    assert fits.fits and e["eval_batch"] == 4 and e["temp_bytes"] > 0 and not e["compiler_error"]
    assert e["total_bytes"] == fits.argument_bytes + fits.code_bytes + e["temp_bytes"] + e["output_bytes"] + \
        e["code_bytes"]
    code = main(overrides(tmp_path, compile_topology="v5e-1", vocab_size=131072, max_target_length=1024,
                          eval_interval=5, eval_steps=1, eval_per_device_batch_size=64))
    assert code == EXIT_DOES_NOT_FIT
    err = capsys.readouterr().err
    assert "does not fit: the train step fits" in err and "but an evaluation needs" in err, err
    assert "eval_per_device_batch_size (now 64) lower" in err and "eval_interval=0" in err
    report = json.loads((tmp_path / "aot" / "compile_report.json").read_text())
    assert report["fits"] is False and report["total_bytes"] <= report["budget_bytes"]
    assert report["eval_step"]["eval_batch"] == 64 and report["eval_step"]["total_bytes"] > report["budget_bytes"]


def test_multi_slice_mesh_puts_data_parallelism_across_slices(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tessera")
    cfg = build_config({**TINY, "compile_topology": "v5e-4", "compile_topology_num_slices": 2,
                        "dcn_data_parallelism": -1})
    r = compile_for_topology(cfg)
    assert r.num_devices == 8 and r.mesh["data"] == 2 and r.mesh["fsdp"] == 4 and r.fits
    # the progress line names the slices (it said "v5e-4 (8 devices)", as if one slice had 8 chips)
    assert "lowering and compiling the train step for v5e-4 x2 (8 devices)" in caplog.text


def test_num_slices_other_than_the_devices_slices_is_refused(tmp_path, capsys):
    """num_slices=1 against compile_topology_num_slices=2 ended in an AssertionError traceback from JAX's
    mesh utilities; num_slices=2 on one slice cut it into two fake slices (its data axis then ran over
    ICI as if over DCN) and reported success."""
    for keys, slices in [(dict(compile_topology_num_slices=2, num_slices=1), 2), (dict(num_slices=2), 1),
                         (dict(compile_topology_num_slices=2, num_slices=4), 2)]:
        assert main(overrides(tmp_path, compile_topology="v5e-4", **keys)) == 2, keys
        err = capsys.readouterr().err
        assert f"config error: num_slices={keys['num_slices']}, but the " in err and f"TPU devices form {slices} " \
            f"slice(s)" in err and "Set num_slices=-1" in err and "Traceback" not in err, err


def test_empty_topology_is_a_config_error(tmp_path, capsys):
    assert main(overrides(tmp_path)) == 2
    assert "compile_topology is empty" in capsys.readouterr().err


def test_float16_compute_is_refused_for_tpus_before_compiling(tmp_path, capsys):
    """Splash attention and the experts' grouped matmuls do not compile float16 on TPUs (Mosaic):
    the step is refused at set-up, in one line, where the compile used to end in a traceback."""
    assert main(overrides(tmp_path, compile_topology="v6e-8", dtype="float16")) == 2
    err = capsys.readouterr().err
    assert "config error: dtype=float16 on TPU" in err and "use dtype=bfloat16" in err and "Traceback" not in err


def test_qwen3_next_with_stages_and_tensor_is_refused_for_tpus_before_compiling(tmp_path, capsys):
    """XLA's TPU compiler aborts the process (a CHECK in its partitioner, a core dump) on qwen3_next with pipeline
    stages and tensor parallelism: one line at set-up instead."""
    keys = dict(decoder_block="qwen3_next", base_num_decoder_layers=8, num_experts=4, num_experts_per_tok=2,
                shared_experts=1, gdn_num_key_heads=2, gdn_num_value_heads=4, gdn_key_head_dim=8,
                gdn_value_head_dim=6, ici_fsdp_parallelism=2, ici_tensor_parallelism=2, ici_pipeline_parallelism=2)
    assert main(overrides(tmp_path, compile_topology="v5e-8", **keys)) == 2
    err = capsys.readouterr().err
    assert ("config error: decoder_block=qwen3_next with pipeline stages (2) and tensor parallelism (2) together: "
            "XLA's TPU compiler aborts on it") in err and "ici_tensor_parallelism=1" in err and "Traceback" not in err


def test_a_relative_config_file_that_is_missing_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["nope.yml", "compile_topology=v5e-4"]) == 2
    assert f"error: config file {tmp_path / 'nope.yml'} does not exist" in capsys.readouterr().err


def test_tpu7x_compiles_with_two_devices_per_chip():
    # Ironwood: JAX sees each chip's two chiplets as devices, each with half the chip's 192 GiB
    cfg = build_config({**TINY, "compile_topology": "tpu7x-16", "dtype": "bfloat16"})
    r = compile_for_topology(cfg)
    assert (r.num_devices, r.device_kind, r.mesh["fsdp"]) == (16, "TPU7x", 16)
    assert r.hbm_bytes == 96 * 2**30 and r.fits and r.total_bytes > 0


def test_compiled_trainstep_file_holds_a_loadable_executable(tmp_path):
    # MaxText's key: the compiled step pickled as serialize_executable's (payload, in_tree, out_tree)
    import pickle

    target = tmp_path / "steps" / "compiled.pickle"
    cfg = build_config({**TINY, "compile_topology": "v5e-4", "compiled_trainstep_file": str(target)})
    assert compile_for_topology(cfg).fits
    payload, in_tree, out_tree = pickle.loads(target.read_bytes())
    assert len(payload) > 1000 and in_tree.num_leaves > 3 and out_tree.num_leaves > 3


def test_dropless_expert_parallelism_exchanges_tokens_with_ragged_all_to_all_on_tpu():
    # XLA:CPU has no ragged all-to-all (the CPU tests run the padded exchange, tested equal to
    # one device in test_families); on TPU only the routed rows cross the expert axis
    cfg = build_config({**TINY, "decoder_block": "mixtral", "num_experts": 4, "num_experts_per_tok": 2,
                        "sparse_matmul": True, "compile_topology": "v5e-8", "dtype": "bfloat16",
                        "ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2})
    r = compile_for_topology(cfg)
    assert r.fits and r.collectives.get("ragged-all-to-all", 0) >= 2, r.collectives
    assert "collectives in the program:" in train_compile.memory_table(r)


@pytest.mark.slow
def test_capacity_routing_over_an_expert_axis_does_not_gather_the_global_batch():
    # XLA's partitioner, left to itself, gathered every token of the global batch (and its dispatch masks) on
    # each chip for capacity routing over fsdp x expert (Mixtral 8x7B on a v6e-256: 82 GiB per chip; 180 MiB of
    # temporaries here). An expert group's rows are about a sixteenth of the global batch's activations.
    from tessera.step import compile_step, setup
    from tessera.train_compile import topology_devices

    cfg = build_config({**TINY, "decoder_block": "mixtral", "num_experts": 8, "num_experts_per_tok": 2,
                        "capacity_factor": 1.25, "dtype": "bfloat16", "base_emb_dim": 512, "base_mlp_dim": 1024,
                        "max_target_length": 1024, "per_device_batch_size": 1, "remat_policy": "full",
                        "ici_expert_parallelism": 4, "ici_fsdp_parallelism": 16})
    trainer = setup(cfg, topology_devices(tpu_slice("v6e-64"), 1))
    temp = compile_step(trainer, 0)[0].memory_analysis().temp_size_in_bytes
    global_batch_activations = trainer.plan.global_batch * 1024 * 512 * 2  # [64, 1024, 512] in bfloat16: 64 MiB
    assert temp < global_batch_activations / 2, temp / 2**20


def test_megablox_runs_the_pallas_grouped_matmul_on_tpu():
    # widths that are no multiple of the kernel's 128-column tile (192 and 200, as gpt-oss's 2880): the TPU
    # compiler takes the kernel's partial last tiles; without megablox, XLA's own grouped matmul
    from tessera.step import compile_step, setup
    from tessera.train_compile import topology_devices

    programs = {}
    for megablox in (False, True):
        cfg = build_config({**TINY, "decoder_block": "mixtral", "num_experts": 4, "num_experts_per_tok": 2,
                            "sparse_matmul": True, "megablox": megablox, "dtype": "bfloat16", "base_emb_dim": 192,
                            "base_mlp_dim": 200, "ici_expert_parallelism": 4, "ici_fsdp_parallelism": 2})
        programs[megablox] = compile_step(setup(cfg, topology_devices(tpu_slice("v5e-8"), 1)), 0)[0].as_text()
    kernels = {megablox: tpu_kernels(program) for megablox, program in programs.items()}
    assert "%ragged-dot" in programs[False] and not {"gmm", "tgmm"} & set(kernels[False])
    assert "%ragged-dot" not in programs[True] and not any(k.startswith("ragged-dot") for k in kernels[True])
    # per scanned layer: three grouped matmuls forward (two in, one out), three for the inputs' gradients (gmm)
    # and three for the weights' (tgmm)
    assert kernels[True] == {"gmm": 6, "tgmm": 3}


def test_megablox_tiles_fit_the_tpu_s_scoped_vmem_in_float32():
    """MaxText's default tiles (512 x 1024 x 1024) need 18-20 MiB of VMEM in float32, more than the 16 MiB a v5e
    gives a kernel (the compiler refused: CompileTimeScopedVmemOom); the column tiles are halved until they fit."""
    from tessera.models.grouped import TILE_VMEM_BYTES, megablox_tiles, tile_vmem_bytes
    from tessera.step import compile_step, setup
    from tessera.train_compile import topology_devices

    assert megablox_tiles(512, 1024, 1024, 2, 8192, 2048, 4096) == (512, 1024, 1024)  # bfloat16: 12 MiB
    assert megablox_tiles(512, 1024, 1024, 4, 8192, 2048, 4096) == (512, 512, 1024)
    assert megablox_tiles(512, 1024, 1024, 4, 8192, 200, 2880) == (512, 200, 1024)  # narrow: whole, and fits
    for itemsize, dims in [(4, (4096, 4096)), (4, (2880, 180)), (2, (8192, 8192))]:
        tm, tk, tn = megablox_tiles(2048, 4096, 4096, itemsize, 2048, *dims)
        assert tile_vmem_bytes(tm, tk, tn, itemsize) <= TILE_VMEM_BYTES
        assert all(t % 128 == 0 or t == d for t, d in zip((tk, tn), dims))
    cfg = build_config({**TINY, "decoder_block": "mixtral", "num_experts": 4, "num_experts_per_tok": 2,
                        "max_target_length": 256, "sparse_matmul": True, "megablox": True, "dtype": "float32", "attention": "dot_product",
                        "base_emb_dim": 1024, "base_mlp_dim": 1024, "ici_expert_parallelism": 4,
                        "ici_fsdp_parallelism": 2, "base_num_decoder_layers": 1})
    program = compile_step(setup(cfg, topology_devices(tpu_slice("v5e-8"), 1)), 0)[0].as_text()
    assert tpu_kernels(program) == {"gmm": 6, "tgmm": 3}
    assert all(" = f32[" in line for line in program.splitlines() if re.match(r"\s*%t?gmm[.\d]* = ", line))


def test_compiled_trainstep_file_under_a_file_is_refused_before_compiling(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="tessera")
    (tmp_path / "file").write_text("not a folder")
    target = tmp_path / "file" / "steps" / "compiled.pickle"
    assert main(overrides(tmp_path, compile_topology="v5e-4", compiled_trainstep_file=target)) == 2
    assert capsys.readouterr().err == (f"config error: compiled_trainstep_file={target} cannot be written: "
                                       f"{tmp_path / 'file'} is a file, not a folder; choose another path\n")
    assert not any("compiling" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "aot").exists()


def test_a_folder_named_compile_report_json_is_refused_before_compiling(tmp_path, capsys, caplog):
    """It was found after the compile (minutes on a large topology), with 'Is a directory; free some space
    there and compile again'."""
    caplog.set_level(logging.INFO, logger="tessera")
    report = tmp_path / "aot" / "compile_report.json"
    report.mkdir(parents=True)
    assert main(overrides(tmp_path, compile_topology="v5e-4")) == 2
    assert capsys.readouterr().err == (f"config error: the report {report} cannot be written: {report} is a folder; "
                                       "move it away, or choose another run_name\n")
    assert not any("compiling" in r.getMessage() for r in caplog.records)


def test_a_compiled_trainstep_file_url_is_refused_before_compiling(tmp_path, capsys):
    """gs://bucket/x.pkl was written to a local folder named gs: (Path() merges the slashes) and the
    compile reported it saved there."""
    assert main(overrides(tmp_path, compile_topology="v5e-4", compiled_trainstep_file="gs://bucket/x.pkl")) == 2
    assert capsys.readouterr().err == (
        "config error: compiled_trainstep_file=gs://bucket/x.pkl is a URL: the compiled step is written to a local "
        "file (as MaxText's); give a local path, e.g. compiled_trainstep_file=x.pkl, and copy it where it should go "
        "(gcloud storage cp)\n")
    assert not Path("gs:").exists() and not (tmp_path / "aot").exists()


def test_unwritable_file_names_what_is_in_the_way(tmp_path):
    (tmp_path / "taken").mkdir()
    assert train_compile.unwritable_file(str(tmp_path / "taken")) == f"{tmp_path / 'taken'} is a folder"
    assert train_compile.unwritable_file(str(tmp_path / "new" / "deeper" / "c.pickle")) == ""
    assert not (tmp_path / "new").exists()  # nothing is created by the check
    assert train_compile.unwritable_file("gs://bucket/c.pickle") == ""
    # a dangling link as a folder failed after the compile ("File exists; ... free some space there")
    (tmp_path / "mnt").symlink_to(tmp_path / "gone")
    assert train_compile.unwritable_file(str(tmp_path / "mnt" / "c.pickle")) == (
        f"{tmp_path / 'mnt'} is a symbolic link to {tmp_path / 'gone'}, which does not exist")
    (tmp_path / "c.pickle").symlink_to(tmp_path / "gone" / "c.pickle")  # as the file, into a folder not there
    assert train_compile.unwritable_file(str(tmp_path / "c.pickle")).endswith("gone/c.pickle, which does not exist")
    (tmp_path / "d.pickle").symlink_to(tmp_path / "d.real")  # as the file, where it can be written: fine
    assert train_compile.unwritable_file(str(tmp_path / "d.pickle")) == ""


def test_pipeline_fsdp_ag_once_takes_the_weight_gathers_out_of_the_loops_on_tpu():
    """2 stages x fsdp 2 on v5e-4: the fsdp-split weights are gathered inside the pipeline's loops
    (every iteration, forward and backward) unless pipeline_fsdp_ag_once gathers them before; the
    compile report counts the collectives left inside loops."""
    common = {**TINY, "compile_topology": "v5e-4", "ici_pipeline_parallelism": 2, "ici_fsdp_parallelism": 2,
              "base_num_decoder_layers": 4, "per_device_batch_size": 2, "dtype": "bfloat16"}
    plain = compile_for_topology(build_config(common))
    once = compile_for_topology(build_config({**common, "pipeline_fsdp_ag_once": True}))
    assert plain.fits and once.fits and once.pipeline["gather_fsdp_once"]
    assert plain.pipeline["collectives_in_loops"]["all-gather"] >= 8  # 4 weights a block or more, twice
    assert "all-gather" not in once.pipeline["collectives_in_loops"]
    assert "collectives inside loops (each runs every iteration): all-gather x" in train_compile.memory_table(plain)


def test_delayed_forwarding_hides_the_hand_over_between_slices():
    """Two slices, one pipeline stage each. Handed on at once, each iteration's activations (and,
    backward, their gradients) cross the data-center network while the next stage waits; handed
    on one iteration late, XLA's TPU scheduler runs both transfers under a stage's matmuls. The
    compile report counts them; the bubble grows from (S-1)/(M+S-1) to 2(S-1)/(M+2(S-1))."""
    common = {**TINY, "compile_topology": "v5e-4", "compile_topology_num_slices": 2, "dcn_pipeline_parallelism": 2,
              "dcn_data_parallelism": 1, "base_num_decoder_layers": 4, "per_device_batch_size": 2,
              "dtype": "bfloat16"}
    plain = compile_for_topology(build_config(common))
    delayed = compile_for_topology(build_config({**common, "pipeline_delay_activation_forwarding": True}))
    assert plain.mesh["stage"] == 2 and plain.fits and delayed.fits
    assert (plain.pipeline["stage_transfers"], plain.pipeline["overlapped_transfers"]) == (2, 0)
    assert (delayed.pipeline["stage_transfers"], delayed.pipeline["overlapped_transfers"]) == (2, 2)
    assert (plain.pipeline["bubble"], delayed.pipeline["bubble"]) == (0.2, 0.3333)
    assert "hand-overs between stages overlapping a matmul: 2 of 2" in train_compile.memory_table(delayed)


def test_tpu_step_forms_the_gradient_mean_before_the_update(monkeypatch):
    """On XLA:CPU the 1/count of the mean gradient is folded into the optimizer update (a pass of its own
    otherwise); on TPUs that form held more temporaries (the raw sums feed both the norm and the update;
    MaxText's Mixtral 8x7B command on v6e-256: 14.38 GiB per chip against 11.48), so the mean comes first there.
    Both forms of the same step (the default model, four sequences of 1024 per chip), compiled for a TPU slice."""
    from tessera import step
    from tessera.step import compile_step, setup
    from tessera.train_compile import topology_devices

    assert step.gradient_mean_in_update("cpu") and not step.gradient_mean_in_update("tpu")
    cfg = build_config({"per_device_batch_size": 4, "max_target_length": 1024, "dtype": "bfloat16",
                        "base_num_decoder_layers": 2})
    temp = {}
    for in_update in (False, True):
        monkeypatch.setattr(step, "gradient_mean_in_update", lambda platform, v=in_update: v)
        temp[in_update] = compile_step(setup(cfg, topology_devices(tpu_slice("v6e-8"), 1)), 0)[0] \
            .memory_analysis().temp_size_in_bytes
    assert temp[False] < 0.8 * temp[True], temp  # 19.3 against 28.3 MiB (at a few sequences of 64 tokens the two are within 10%)



def test_the_command_on_a_host_without_tpus_prints_no_probe_errors(tmp_path):
    """libtpu probes for TPU chips when JAX starts its backends; on a CPU host it printed "Failed to find host
    bounds" and an INVALID_ARGUMENT error with a source trace before every compile report. With JAX's own
    cache folder set (JAX_COMPILATION_CACHE_DIR, as on many TPU hosts), the compiled train step was written
    there, and the next compile of it warned "Error reading persistent compilation cache entry": JAX cannot
    load a program compiled for a topology back. It is not written."""
    import subprocess
    import sys

    from conftest import REPO

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    proc = subprocess.run([sys.executable, "-m", "tessera.train_compile", "configs/base.yml", "compile_topology=v5p-8",
                           f"base_output_directory={tmp_path}", "run_name=c"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fits: " in proc.stderr and (tmp_path / "c" / "compile_report.json").exists()
    assert "INVALID_ARGUMENT" not in proc.stderr and "host bounds" not in proc.stderr, proc.stderr[:1000]
    written = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert written and not [name for name in written if "train_step" in name or "eval_step" in name], written


@pytest.mark.parametrize("signum, code, text", [(15, 143, "stopped by SIGTERM"), (2, 130, "interrupted (Ctrl-C)")])
def test_a_signal_while_compiling_stops_it_in_one_line(tmp_path, signum, code, text):
    """Ctrl-C waited for the compile to end, then printed a traceback; SIGTERM reached libtpu's crash handler,
    which printed a stack dump. Both now stop with one line and the signal's exit code, and write no report."""
    import subprocess
    import sys

    from conftest import REPO

    # 32 unrolled layers: a compile of about 30 s, not 2, so that the signal, sent when the line is read, finds
    # it still running on a busy host (a CI run on a fast one read the line after the compile had ended)
    keys = {**TINY, "base_num_decoder_layers": 32, "scan_layers": False, "base_output_directory": tmp_path,
            "run_name": "s"}
    args = [f"{k}={v}" for k, v in keys.items()]
    proc = subprocess.Popen([sys.executable, "-m", "tessera.train_compile", "configs/base.yml", "compile_topology=v5e-4",
                             *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        for line in proc.stderr:
            if "lowering and compiling the train step" in line:
                break
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    last = err.strip().splitlines()[-1]
    assert text in last and f"(exit code {code})" in last, err
    assert "Traceback" not in err and "FailureSignalHandler" not in err, err
    assert not (tmp_path / "s" / "compile_report.json").exists()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_a_platform_this_host_does_not_have_is_one_line(tmp_path, platform):
    """JAX_PLATFORMS=tpu or cuda (set for a TPU VM or a GPU host, say) on a host without one: JAX's traceback
    (for cuda a bare AssertionError) from the run folder's check, exit code 1."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "tessera.train_compile", "configs/base.yml", "compile_topology=v5e-8",
                           f"base_output_directory={tmp_path}", "run_name=c"], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": platform}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"config error: JAX_PLATFORMS={platform}: JAX cannot start that platform here" in proc.stderr



def test_main_leaves_the_processes_environment_as_it_was(tmp_path, monkeypatch):
    """train_compile described the TPU slice to libtpu through ALLOW_MULTIPLE_LIBTPU_LOAD, TPU_WORKER_HOSTNAMES and
    TPU_ACCELERATOR_TYPE and left them set: in a notebook, a later compile for another slice kept the first one's
    accelerator type (setdefault), and a later run or a process it starts saw a slice of `localhost` of the
    compiled-for type, not this host's. With dump_hlo, the dump flags stayed in XLA_FLAGS and the persistent
    compilation cache off."""
    import jax

    from tessera.platforms import RUN_JAX_OPTIONS, RUN_VARIABLES

    for name in ("ALLOW_MULTIPLE_LIBTPU_LOAD", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ['XLA_FLAGS']} --xla_dump_to={tmp_path / 'dump'}")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))  # read by JAX at import only
    before = {name: os.environ.get(name) for name in RUN_VARIABLES}, {o: getattr(jax.config, o) for o in RUN_JAX_OPTIONS}
    assert main(overrides(tmp_path, compile_topology="v5e-4", compile_hbm_budget_fraction=1e-6)) == EXIT_DOES_NOT_FIT
    after = {name: os.environ.get(name) for name in RUN_VARIABLES}, {o: getattr(jax.config, o) for o in RUN_JAX_OPTIONS}
    assert after == before
    assert not {"ALLOW_MULTIPLE_LIBTPU_LOAD", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"} & set(os.environ)
