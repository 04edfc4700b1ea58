"""MaxText's keys: aliases are renamed and logged, `hardware` is accepted, missing features are refused with a reason."""

import dataclasses
import json
import logging
import re

import pytest

from conftest import REPO
from tessera.config import ConfigError, load_config
from tessera.config import maxtext
from tessera.config.schema import all_fields
from tessera.config.yaml_file import RUN_CONFIG_HEADER
from tessera.mesh import mesh_shape
from tessera.tools import validate_file as validate

BASE = str(REPO / "configs" / "base.yml")
GUIDE = REPO / "getting_started" / "Coming_from_MaxText.md"


def test_tables_name_only_keys_we_lack_and_aliases_name_keys_we_have():
    fields = all_fields()
    assert not maxtext.maxtext_keys() & set(fields), "a schema key is also aliased, accepted or refused"
    assert {target for target, _ in maxtext.ALIASES.values()} <= set(fields)
    assert not set(maxtext.ALIASES) & set(maxtext.REFUSED) | set(maxtext.ACCEPTED) & set(maxtext.REFUSED)
    assert validate.ALIASES == {a: t for a, (t, _) in maxtext.ALIASES.items()}  # one mapping


def test_the_guide_mentions_every_maxtext_key():
    text = GUIDE.read_text()
    missing = [k for k in sorted(maxtext.maxtext_keys()) if f"`{k}`" not in text]
    assert not missing, f"getting_started/Coming_from_MaxText.md does not mention {missing}"


def test_alias_is_renamed_and_logged_once(caplog):
    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        cfg = load_config([BASE, "ici_context_parallelism=2", "ici_fsdp_parallelism=4"], env={})
        load_config([BASE, "ici_context_parallelism=2"], env={"M_DCN_CONTEXT_PARALLELISM": "1"})
    assert cfg.mesh.ici_sequence_parallelism == 2
    message = "ici_context_parallelism=2 is MaxText's name for ici_sequence_parallelism; using that"
    assert caplog.text.count(message) == 1


def test_alias_that_disagrees_with_its_key_is_refused():
    with pytest.raises(ConfigError, match="disagrees with ici_sequence_parallelism='1'"):
        load_config([BASE, "ici_context_parallelism=2", "ici_sequence_parallelism=1"], env={})
    cfg = load_config([BASE, "ici_context_parallelism=2"], env={"M_ICI_SEQUENCE_PARALLELISM": "1"})
    assert cfg.mesh.ici_sequence_parallelism == 1  # the environment is applied after the command line


def test_hardware_is_accepted_and_checked():
    load_config([BASE, "hardware=gpu_multiprocess"], env={})
    with pytest.raises(ConfigError, match="hardware='tpu7' is not allowed; choose one of: 'tpu', 'gpu'"):
        load_config([BASE, "hardware=tpu7"], env={})


def test_override_model_config_is_accepted_and_the_command_line_wins():
    """MaxText's way to shrink a model file's model (its keys on the command line need it) runs unchanged."""
    cfg = load_config([BASE, "model_name=llama2-7b", "override_model_config=true", "base_num_decoder_layers=2"], env={})
    assert cfg.model.num_decoder_layers == 2
    with pytest.raises(ConfigError, match="override_model_config='maybe' is not allowed"):
        load_config([BASE, "override_model_config=maybe"], env={})


def test_allow_split_physical_axes_is_accepted_as_tessera_always_splits(caplog):
    """mesh.py always builds its mesh with allow_split_physical_axes=True; MaxText's `true` was refused as a
    feature "not in Tessera", and its `false` logged as "the feature off, as in Tessera"."""
    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        load_config([BASE, "allow_split_physical_axes=true"], env={})
        load_config([BASE, "allow_split_physical_axes=false"], env={})
    assert "allow_split_physical_axes=true has no effect: Tessera always lets a mesh axis span" in caplog.text
    assert "as in Tessera" not in caplog.text
    with pytest.raises(ConfigError, match="allow_split_physical_axes='sometimes' is not allowed"):
        load_config([BASE, "allow_split_physical_axes=sometimes"], env={})


def test_missing_feature_is_refused_with_a_reason_unless_off():
    load_config([BASE, "quant_cfg_path=", "replicate_quant_scale=false", "opt_type=adamw"], env={})
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "quant_cfg_path=layers.yml", "ici_autoregressive_parallelism=2"],
                    env={"M_PARAM_MEMORY_HOST_OFFLOAD": "true"})
    msg = str(e.value)
    assert msg.startswith("3 problems in the config:") and "unknown" not in msg
    assert ("quant_cfg_path='layers.yml' is a MaxText key Tessera does not implement: file of per-layer "
            "quantization settings") in msg
    # MaxText's quantization keys that Tessera implements now load as its own
    cfg = load_config([BASE, "quantization=int8", "quantize_kvcache=true", "kv_quant_axis=dkv"], env={})
    assert (cfg.model.quantization, cfg.model.quantize_kvcache, cfg.model.kv_quant_axis) == ("int8", True, "dkv")
    assert "use ici_tensor_parallelism (from the command line)" in msg
    assert ("keep parameters in host memory; not in Tessera" in msg
            and "(from the environment variable M_PARAM_MEMORY_HOST_OFFLOAD)" in msg)
    # adam_eps_root, refused here until Tessera had it, loads from MaxText's environment variable too
    assert load_config([BASE], env={"M_ADAM_EPS_ROOT": "1e-6"}).optim.adam_eps_root == 1e-6
    # and optimizer_memory_host_offload likewise
    assert load_config([BASE], env={"M_OPTIMIZER_MEMORY_HOST_OFFLOAD": "true"}).optim.optimizer_memory_host_offload


def test_maxtexts_pipeline_subset_keys_are_refused_for_what_they_do():
    """scan_pipeline_iterations=false was refused because "Tessera pipelines every decoder layer", which is
    not what it asks; both reasons name whole keys (ici/dcn_pipeline_parallelism named neither)."""
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "scan_pipeline_iterations=false", "pipeline_parallel_layers=4"], env={})
    msg = str(e.value)
    assert "scan over pipeline iterations; Tessera's pipeline schedule is always a scan" in msg
    assert ("layers run by the pipeline; Tessera pipelines every decoder layer (but DeepSeek's first_num_dense_layers, "
            "which run before the pipeline), over ici_pipeline_parallelism x dcn_pipeline_parallelism stages") in msg
    assert "ici/dcn" not in msg


def test_maxtexts_optimizer_keys_choose_the_optimizer():
    """opt_type and the muon keys mean what they mean in MaxText (muon_consistent_rms: None, its default,
    is the width scaling, 0 here); adam_pax is not implemented and the error lists what is."""
    cfg = load_config([BASE, "opt_type=muon", "muon_beta=0.9", "muon_weight_decay=0.1", "muon_consistent_rms=None"],
                      env={}).optim
    assert (cfg.opt_type, cfg.muon_beta, cfg.muon_weight_decay, cfg.muon_consistent_rms) == ("muon", 0.9, 0.1, 0.0)
    assert load_config([BASE, "muon_consistent_rms=0.2"], env={}).optim.muon_consistent_rms == 0.2
    with pytest.raises(ConfigError, match="opt_type='adam_pax' is not allowed; choose one of: 'adamw', 'sgd', 'muon'"):
        load_config([BASE, "opt_type=adam_pax"], env={})


def test_custom_remat_takes_maxtexts_per_tensor_keys():
    cfg = load_config([BASE, "remat_policy=custom", "query_proj=offload", "mlpwi_0=device"], env={}).model
    assert (cfg.query_proj, cfg.mlpwi_0, cfg.decoder_layer_input, cfg.mlpwo) == ("offload", "device", "device", "remat")
    with pytest.raises(ConfigError, match="mlpwo='keep' is not allowed; choose one of: 'remat', 'device', 'offload'"):
        load_config([BASE, "remat_policy=custom", "mlpwo=keep"], env={})


def test_maxtexts_remat_values_with_context_are_ours_or_refused_with_the_custom_keys(caplog):
    """Tessera's save_dot_except_mlp keeps `context` too: it is MaxText's save_dot_with_context_except_mlp, which
    was refused with a list of values; minimal_with_context was refused without saying what to use."""
    from tessera.models import remat

    assert "context" in remat._ATTENTION_DOTS  # what the guide says: MaxText's save_dot_except_mlp recomputes it
    with caplog.at_level(logging.INFO, logger="tessera"):
        cfg = load_config([BASE, "remat_policy=save_dot_with_context_except_mlp"], env={}).model
    assert cfg.remat_policy == "save_dot_except_mlp"
    assert "MaxText's name for remat_policy=save_dot_except_mlp" in caplog.text
    for value in ("minimal_with_context", "minimal_flash"):
        with pytest.raises(ConfigError, match=f"remat_policy='{value}' is a MaxText value Tessera does not have") as e:
            load_config([BASE, f"remat_policy={value}"], env={})
        custom = re.search(r"(remat_policy=custom .*=device) keeps", str(e.value))[1].split()
        cfg = load_config([BASE, *custom], env={}).model
        kept = {name for name, choice in remat.custom_choices(cfg).items() if choice == "device"}
        # MaxText's minimal_policy(with_context=True), of the names Tessera's blocks have, and the block's input
        assert kept == {"query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo",
                        "context", "decoder_layer_input"}
    text = GUIDE.read_text()
    for value in ("save_dot_with_context_except_mlp", "minimal_with_context", "minimal_flash"):
        assert f"`{value}`" in text


def test_maxtexts_data_keys_without_dataset_type_say_the_run_is_synthetic():
    """MaxText's default dataset_type is tfds and Tessera's synthetic: MaxText's README command with
    dataset_path (and dataset_name) but no dataset_type trained on random tokens without a word."""
    from tessera.config.unread_keys import keys_without_effect

    cfg = load_config([BASE, "dataset_path=gs://my-dataset", "dataset_name=c4/en:3.1.0"], env={})
    assert keys_without_effect(cfg, {"fsdp": 8}) == [
        "dataset_name=c4/en:3.1.0, dataset_path=gs://my-dataset: no effect with dataset_type=synthetic (Tessera's "
        "default; MaxText's is tfds), which trains on random tokens; set dataset_type=tfds, hf or grain to read "
        "that data"]
    tfds = load_config([BASE, "dataset_type=tfds", "dataset_path=gs://my-dataset", "dataset_name=c4/en:3.1.0"], env={})
    assert keys_without_effect(tfds, {"fsdp": 8}) == []
    assert "`dataset_type` (`synthetic`, `hf`, `tfds`, `grain`; Tessera's default is `synthetic`" in GUIDE.read_text()


def test_the_guide_gives_tesseras_defaults_that_differ_from_maxtexts_truly():
    """A MaxText command that leaves learning_rate out trained at 3e-3 here, 100 times MaxText's 3e-5, and the
    guide only said "defaults differ in places"; each default it now names must be Tessera's."""
    text = " ".join(GUIDE.read_text().split())
    pairs = re.findall(r"`([a-z_]+)` (\S+) -> ([^,; )]+)", text.split("These change what a MaxText command")[1][:1200])
    assert len(pairs) >= 12, pairs
    fields, defaults = all_fields(), load_config([BASE], env={})
    for key, _, ours in pairs:
        section = getattr(defaults, fields[key][0])
        want = getattr(section, key)
        assert str(want).lower() == ours.lower() or (isinstance(want, float) and float(ours) == want), (key, ours, want)
    model = load_config([BASE, "model_name=mixtral-8x7b"], env={}).model
    assert model.load_balance_loss_weight == 0.02


def test_a_typo_of_an_alias_suggests_it_and_our_key():
    with pytest.raises(ConfigError, match=r"did you mean .*ici_context_parallelism \(= ici_sequence_parallelism\)"):
        load_config([BASE, "ici_context_paralelism=2"], env={})


def test_every_validation_file_key_has_a_meaning():
    """Each model_params key of the GPU validation files is a train key, an alias, a MaxText key or explained."""
    known = set(all_fields()) | maxtext.maxtext_keys() | set(validate.IGNORED_WHY) | {"xla_flags", "result_dict"}
    for path in sorted((REPO / "configs" / "gpu").glob("*/*.json")):
        for models in json.loads(path.read_text())["model_params"].values():
            for gpus in models.values():
                for entry in gpus.values():
                    assert not set(entry) - known, f"{path.name}: {sorted(set(entry) - known)}"


def test_fsdp_transpose_folds_into_the_fsdp_axis(caplog):
    # MaxText's v6e Gemma recipes: ici_fsdp_transpose_parallelism=256 with ici_fsdp_parallelism=-1
    cfg = load_config([BASE, "ici_fsdp_transpose_parallelism=256", "ici_fsdp_parallelism=-1"], env={})
    with caplog.at_level(logging.INFO, logger="tessera"):
        ici, dcn = mesh_shape(cfg.mesh, 256, 1)
    assert ici["fsdp"] == 256 and all(v == 1 for a, v in ici.items() if a != "fsdp")
    assert "folded into the fsdp axis" in caplog.text
    cfg = load_config([BASE, "ici_fsdp_transpose_parallelism=2", "ici_tensor_parallelism=2",
                       "dcn_fsdp_transpose_parallelism=2", "dcn_data_parallelism=1"], env={})
    ici, dcn = mesh_shape(cfg.mesh, 64, 2)
    assert (ici["fsdp"], ici["tensor"], dcn["fsdp"]) == (16, 2, 2)
    with pytest.raises(ConfigError, match="fsdp_transpose_parallelism=3"):
        mesh_shape(load_config([BASE, "ici_fsdp_transpose_parallelism=3"], env={}).mesh, 8, 1)


def test_maxtexts_defaults_load_with_the_same_meaning(tmp_path, caplog):
    """A config file written for MaxText holds its base.yml's values: "unset" spelled -1, None or ""
    for keys Tessera shares (each taken as Tessera's spelling of the same thing, logged), and the
    defaults of decoding and inference keys that do nothing in training. All of them load; a value
    that turns such a feature on is still refused."""
    (tmp_path / "mine.yml").write_text("""base_config: base.yml
eval_interval: -1
base_moe_mlp_dim: -1
trainable_position_size: -1
nope_layer_interval: -1
compile_topology_num_slices: -1
max_num_checkpoints_to_keep: None
routed_score_func: ""
local_rope_max_timescale: -1
expansion_factor_real_data: -1.0
max_corpus_chars: 10_000_000
max_prefill_predict_length: 64
prompt: "I love to"
load_from_prefill_dir: false
decode_sampling_strategy: "greedy"
decode_sampling_nucleus_p: -1
decode_sampling_top_k: 0
decode_sampling_temperature: 1.
inference_microbenchmark_prefill_lengths: "64,128,256,512,1024"
inference_microbenchmark_loop_iters: 10
ragged_block_size: 256
""")
    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        cfg = load_config([str(tmp_path / "mine.yml")], env={})
    m = cfg.model
    assert (cfg.data.eval_interval, m.base_moe_mlp_dim, m.trainable_position_size, m.nope_layer_interval) == (0, 0, 0, 0)
    assert cfg.compile.compile_topology_num_slices == 1 and cfg.checkpoint.max_num_checkpoints_to_keep == -1
    assert m.routed_score_func == "softmax" and m.expert_mlp_dim == m.mlp_dim
    assert m.local_rope_max_timescale == -1 and m.local_rope_theta == m.rope_max_timescale
    assert "eval_interval=-1 is MaxText's spelling of never evaluate; using eval_interval=0" in caplog.text
    assert "prompt='I love to' is MaxText's setting with the feature off" in caplog.text

    with pytest.raises(ConfigError) as e:
        load_config([BASE, "eval_interval=-2", "prompt=Hello", "decode_sampling_temperature=0.7",
                     "expansion_factor_real_data=2", "local_rope_max_timescale=0"], env={})
    msg = str(e.value)
    assert msg.startswith("4 problems in the config:")  # the range check of local_rope_max_timescale comes later
    assert "eval_interval='-2' is too small; it must be >= 0" in msg
    assert "prompt='Hello' is a MaxText key Tessera does not implement: decode.py's prompt; Tessera's decode.py " \
           "takes it as a flag: --prompt TEXT" in msg
    assert "decode_sampling_temperature='0.7'" in msg and "expansion_factor_real_data='2'" in msg
    with pytest.raises(ConfigError, match="local_rope_max_timescale=0 is not a rotary theta"):
        load_config([BASE, "local_rope_max_timescale=0"], env={})


def test_a_local_theta_of_minus_one_is_the_global_one():
    import numpy as np

    from conftest import tiny_config
    from tessera.models.attention import rope_frequencies_of

    local = tiny_config(None, local_rope_max_timescale=-1, rope_max_timescale=500_000).model
    glob = tiny_config(None, local_rope_max_timescale=500_000, rope_max_timescale=500_000).model
    np.testing.assert_array_equal(rope_frequencies_of(local, local=True), rope_frequencies_of(glob, local=True))
    assert not np.array_equal(rope_frequencies_of(tiny_config(None).model, local=True),
                              rope_frequencies_of(local, local=True))


def test_maxtexts_defaults_of_stack_traces_and_cache_axis_orders_load():
    """Older MaxText base.yml files hold stack_trace_interval_seconds: 600 and the KV cache axis orders
    "1,2,0,3", their defaults (the feature off, or a decoding setting); they were refused whatever the value."""
    orders = [f"{k}=1,2,0,3" for k in ("prefill_key_axis_order", "prefill_value_axis_order", "ar_key_axis_order",
                                        "ar_value_axis_order")]
    load_config([BASE, "stack_trace_interval_seconds=600", "collect_stack_trace=false", *orders], env={})
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "stack_trace_interval_seconds=60", "ar_key_axis_order=0,1,2,3"], env={})
    assert str(e.value).startswith("2 problems in the config:")
    assert "stack_trace_interval_seconds='60' is a MaxText key Tessera does not implement" in str(e.value)


def test_upload_all_profiler_results_says_every_process_is_traced_already():
    """The refusal said "Tessera's profiler writes host 0's", but every process of a job writes its own
    trace (profile/process_<i>/ in its local run folder): what Tessera lacks is the upload alone."""
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "upload_all_profiler_results=true"], env={})
    assert "writes host 0's" not in str(e.value)
    assert "Tessera's profiler traces every process, each into profile/process_<i>/ of its local run folder" \
        in str(e.value)
    load_config([BASE, "upload_all_profiler_results=false"], env={})


def test_an_alias_and_its_key_with_the_same_number_agree():
    cfg = load_config([BASE, "ici_context_parallelism=2", "ici_sequence_parallelism=02"], env={})
    assert cfg.mesh.ici_sequence_parallelism == 2
    with pytest.raises(ConfigError, match="disagrees with ici_sequence_parallelism='4'"):
        load_config([BASE, "ici_context_parallelism=2", "ici_sequence_parallelism=4"], env={})


def test_a_long_refused_value_is_shortened_in_its_error(tmp_path):
    """MaxText's logical_axis_rules (thousands of characters) made one error line a screenful."""
    rules = [[f"activation_{i}", ["data", "fsdp", "fsdp_transpose", "expert"]] for i in range(60)]
    (tmp_path / "mine.yml").write_text(f"base_config: base.yml\nlogical_axis_rules: {json.dumps(rules)}\n")
    with pytest.raises(ConfigError) as e:
        load_config([str(tmp_path / "mine.yml")], env={})
    shown = repr(rules)[:maxtext.SHOWN_CHARS - 3]
    assert str(e.value) == (f"logical_axis_rules={shown}... is a MaxText key Tessera does not implement: the table "
                            f"from logical to mesh axes; Tessera's is LOGICAL_RULES in mesh.py "
                            f"(from {tmp_path}/mine.yml)")


def test_an_alias_and_its_key_in_the_environment_must_agree():
    """Each M_ variable was a layer of its own, in alphabetical order: M_ICI_SEQUENCE_PARALLELISM=1
    silently won over M_ICI_CONTEXT_PARALLELISM=2 (and the other way round for names sorting so)."""
    env = {"M_ICI_CONTEXT_PARALLELISM": "2", "M_ICI_SEQUENCE_PARALLELISM": "1"}
    with pytest.raises(ConfigError) as e:
        load_config([BASE], env=env)
    assert str(e.value) == ("M_ICI_CONTEXT_PARALLELISM=2 (MaxText's name for ici_sequence_parallelism) disagrees with "
                            "M_ICI_SEQUENCE_PARALLELISM=1; set only M_ICI_SEQUENCE_PARALLELISM")
    env["M_ICI_SEQUENCE_PARALLELISM"] = "2"
    assert load_config([BASE], env=env).mesh.ici_sequence_parallelism == 2


def test_rope_type_points_to_rope_scaling():
    """MaxText's rope_type was an unknown key whose closest keys were opt_type, rope_truncate and tokenizer_type."""
    load_config([BASE, "rope_type=default"], env={})
    with pytest.raises(ConfigError, match=r"rope_type='yarn' is a MaxText key .*Tessera's key is rope_scaling: "
                                          r"rope_scaling=llama3 or rope_scaling=yarn"):
        load_config([BASE, "rope_type=yarn"], env={})


def test_steps_of_minus_one_is_the_schedules_length(caplog):
    """MaxText's steps=-1: as many steps as learning_rate_schedule_steps (it was refused as "too small");
    with the schedule's length unset too, one line says neither key gives the other a length."""
    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        cfg = load_config([BASE, "steps=-1", "learning_rate_schedule_steps=40"], env={})
    assert cfg.run.steps == 40 and cfg.total_steps_in_schedule == 40
    assert "steps=-1 is MaxText's spelling of 'as many steps as learning_rate_schedule_steps'; using steps=40" \
        in caplog.text
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "steps=-1"], env={})
    assert str(e.value).startswith("steps=-1 (MaxText's spelling of 'as many steps as learning_rate_schedule_steps') "
                                   "needs learning_rate_schedule_steps set") and "too small" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # a bad schedule length is reported once, under its own name
        load_config([BASE, "steps=-1", "learning_rate_schedule_steps=abc"], env={})
    assert str(e.value).startswith("learning_rate_schedule_steps='abc' is not a valid int") and "steps=" not in \
        str(e.value).replace("learning_rate_schedule_steps=", "")
    with pytest.raises(ConfigError, match="steps='-2' is too small; it must be >= 1"):
        load_config([BASE, "steps=-2", "learning_rate_schedule_steps=40"], env={})


def test_steps_of_minus_one_takes_the_schedules_length_however_it_is_written(tmp_path):
    """The length was read as digits only: learning_rate_schedule_steps=1e3 (a valid int, 1000) or a file's
    `1000.0` left steps at base.yml's 150 without a word. A run's config.yml given as the config file
    refused steps=-1 as "too small"."""
    for value in ("1e3", "1000.0", "1_000", "+1000"):
        cfg = load_config([BASE, "steps=-1", f"learning_rate_schedule_steps={value}"], env={})
        assert (cfg.run.steps, cfg.total_steps_in_schedule) == (1000, 1000), value
    mine = tmp_path / "mine.yml"
    mine.write_text("base_config: base.yml\nsteps: -1\nlearning_rate_schedule_steps: 1000.0\n")
    assert load_config([str(mine)], env={}).run.steps == 1000
    saved = tmp_path / "config.yml"
    saved.write_text(RUN_CONFIG_HEADER + "run_name: x\n")
    assert load_config([str(saved), "steps=-1", "learning_rate_schedule_steps=40"], env={}).run.steps == 40


def test_newer_maxtexts_schedule_and_decay_keys_load_and_wsd_is_the_same_schedule():
    """MaxText's current base.yml names the final fraction learning_rate_final_fraction and has lr_schedule_type,
    wsd_*, adamw_mask and parameter_memory_host_offload: each was an unknown key, so a command spelling out
    MaxText's defaults stopped, and the final fraction could not be given by its MaxText name. lr_schedule_type=wsd
    and adamw_mask (refused until Tessera had them) read their keys under MaxText's names and values."""
    cfg = load_config([BASE, "learning_rate_final_fraction=0.01", "lr_schedule_type=cosine", "wsd_decay_style=linear",
                       "wsd_decay_steps_fraction=0.1", "adamw_mask=[]", "parameter_memory_host_offload=False"], env={})
    assert cfg.optim.cosine_learning_rate_final_fraction == 0.01
    wsd = load_config([BASE, "lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.2", "wsd_decay_style=cosine",
                       "learning_rate_final_fraction=0.0", "adamw_mask=['.*norm']"], env={}).optim
    assert (wsd.lr_schedule_type, wsd.wsd_decay_steps_fraction, wsd.wsd_decay_style,
            wsd.cosine_learning_rate_final_fraction, wsd.adamw_mask) == ("wsd", 0.2, "cosine", 0.0, [".*norm"])
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "parameter_memory_host_offload=true"], env={})
    assert str(e.value).startswith("parameter_memory_host_offload=") and "unknown" not in str(e.value)


def test_the_guide_gives_the_schedules_and_the_batchs_differences_from_maxtext_with_true_numbers():
    """The guide said the schedule keys keep MaxText's meaning, but Tessera's cosine reaches its final value
    one step after MaxText's (the last step trains above it), and a fractional per_device_batch_size must
    give a batch the mesh splits (MaxText trains on part of one sequence per device): its numbers hold."""
    import re

    from tessera.config.derived import global_batch
    from tessera.optim import learning_rate_schedule

    text = " ".join(GUIDE.read_text().split())
    quoted = re.search(r"the last one above the final value: ([\d.]+) x `learning_rate` at the defaults \(150 steps, "
                       r"final fraction 0\.1\), ([\d.]+) x with `steps=10`", text)
    assert quoted, "the guide no longer gives the last step's rate"
    for steps, rate in zip((150, 10), quoted.groups()):
        optim = load_config([BASE, "learning_rate=1", f"steps={steps}"], env={}).optim
        last = float(learning_rate_schedule(optim, steps)(steps - 1))  # the count of updates before the last step
        assert f"{last:.{len(rate) - 2}f}" == rate and last > 0.1 + 1e-5
        assert float(learning_rate_schedule(optim, steps)(steps)) == pytest.approx(0.1)  # the step after
    assert "0.25 on 8 devices (a batch of 2) needs at most 2 batch shards (e.g. `ici_tensor_parallelism=4`)" in text
    assert global_batch(0.25, 1, {"data": 1, "stage": 1, "fsdp": 2, "sequence": 1, "tensor": 4, "expert": 1}) == 2
    with pytest.raises(ConfigError, match="global batch 2 must be divisible by data\\*fsdp\\*expert=8"):
        global_batch(0.25, 1, {"data": 1, "stage": 1, "fsdp": 8, "sequence": 1, "tensor": 1, "expert": 1})


def test_a_quoted_command_line_value_is_read_as_maxtext_reads_it():
    """MaxText reads a command-line value as YAML (its own tests pass `metrics_dir=""`): the quotes were kept,
    so metrics_file="" wrote the metrics to a file named "" in the working directory and run_name='x' named
    the run folder 'x', quotes and all."""
    cfg = load_config([BASE, 'metrics_file=""', "run_name='x'", "steps=\"5\"", "mlp_activations=\"['gelu']\"",
                       "dump_hlo_xla_flags='--xla_a=1 --xla_b=2'"], env={})
    assert (cfg.run.metrics_file, cfg.run.run_name, cfg.run.steps) == ("", "x", 5)
    assert cfg.model.mlp_activations == ["gelu"] and cfg.profiler.dump_hlo_xla_flags == "--xla_a=1 --xla_b=2"
    assert load_config([BASE, 'run_name="a" "b"', "hf_path='"], env={}).run.run_name == '"a" "b"'  # not one value


def test_a_hub_name_as_tokenizer_path_is_told_it_is_not_downloaded(tmp_path, monkeypatch):
    """MaxText's commands give Hub names (tokenizer_path=openai/gpt-oss-20b) and MaxText downloads them; here the
    error said only that /cwd/openai/gpt-oss-20b does not exist."""
    from tessera.data.tokenizers import load_tokenizer

    monkeypatch.chdir(tmp_path)
    for name, hint in (("openai/gpt-oss-20b", True), ("tok.model", False), ("../x/y", False)):
        path = load_config([BASE, f"tokenizer_path={name}"], env={}).data.tokenizer_path
        with pytest.raises(ConfigError) as e:
            load_tokenizer(path)
        assert str(e.value).startswith(f"tokenizer_path={path!r} does not exist")
        assert (f"a Hugging Face Hub name such as {name} is not downloaded here" in str(e.value)) == hint, str(e.value)


def test_a_schedule_of_no_steps_is_a_config_error_also_with_steps_of_minus_one():
    """learning_rate_schedule_steps=0 (or below -1) passed the config checks (python -m tessera.config printed it)
    and was refused only when the optimizer was set up; with steps=-1 the error was about steps=0."""
    for args in (["learning_rate_schedule_steps=0"], ["steps=-1", "learning_rate_schedule_steps=-3"]):
        with pytest.raises(ConfigError) as e:
            load_config([BASE, *args], env={})
        value = args[-1].split("=")[1]
        assert str(e.value) == (f"learning_rate_schedule_steps={value} gives a learning-rate schedule of no steps (its "
                                "rate would drop to the final value after step 0); set it to -1 (as long as steps) or "
                                ">= 1 (from the command line)")


def test_the_guides_unknown_maxtext_keys_are_reported_as_it_says():
    """Coming_from_MaxText.md's examples of MaxText keys it does not name: unknown, with the closest
    keys it quotes where some are close, else a pointer to base.yml (it promised three closest keys
    for `matmul_precision`, which had none). Its former examples are a key of Tessera's (`matmul_precision`) and
    a refused MaxText key (`save_checkpoint_on_completion`) now (their recipes set them)."""
    text = " ".join(GUIDE.read_text().split())
    quoted = re.search(r"where some are close \(`save_checkpoint_on_start`: (.+?)\), else with a pointer to "
                       r"`configs/base.yml` \(`vllm_hf_overrides`\)", text)
    assert quoted, "the guide no longer says how its unknown MaxText keys are reported: update this test"
    closest = ", ".join(re.findall(r"`(\w+)`", quoted.group(1)))
    with pytest.raises(ConfigError, match=re.escape(f"unknown config key 'save_checkpoint_on_start' in the "
                                                    f"command line; did you mean {closest}?")):
        load_config([BASE, "save_checkpoint_on_start=true"], env={})
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'vllm_hf_overrides' in the command line; see "
                                                    "configs/base.yml for every key")):
        load_config([BASE, "vllm_hf_overrides={}"], env={})


def test_maxtexts_qwen3_model_file_loads_as_a_model_file_of_ones_own(tmp_path):
    """The guide says to write models/<name>.yml for MaxText's other Qwen3 sizes; MaxText's own qwen3-4b.yml, so
    written, was refused twice: use_qk_norm=True as "Llama 4's settings, which decoder_block=qwen3 does not have"
    (Tessera's qwen3 always norms queries and keys, as MaxText's does with true), and
    normalize_embedding_logits=False, which is what Tessera's tied qwen3 does (MaxText's true divides the logits)."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "qwen3-4b.yml").write_text("""base_emb_dim: 2560
base_num_query_heads: 32
base_num_kv_heads: 8
base_mlp_dim: 9728
base_num_decoder_layers: 36
head_dim: 128
mlp_activations: ["silu", "linear"]
vocab_size: 151936
decoder_block: "qwen3"
normalization_layer_epsilon: 1.0e-6
rope_max_timescale: 1000000
use_qk_norm: true
logits_via_embedding: true
normalize_embedding_logits: false
enable_dropout: false
tokenizer_type: "huggingface"
""")
    (tmp_path / "mine.yml").write_text("base_config: base.yml\n")
    m = load_config([str(tmp_path / "mine.yml"), "model_name=qwen3-4b"], env={}).model
    assert (m.decoder_block, m.use_qk_norm, m.logits_via_embedding, m.emb_dim) == ("qwen3", True, True, 2560)
    assert load_config([BASE, "model_name=qwen3-30b-a3b", "use_qk_norm=true"], env={}).model.use_qk_norm
    with pytest.raises(ConfigError, match="use_qk_norm=True: Llama 4's settings, which decoder_block=llama2"):
        load_config([BASE, "use_qk_norm=true"], env={})


def test_maxtexts_qwen2_5_model_file_describes_the_model_of_ours(tmp_path):
    """MaxText's qwen2.5-7b.yml (decoder_block qwen2, attention_bias true, its keys without effect here) written
    as a model file of one's own describes the model of Tessera's qwen2.5-7b: the same keys, so the same model."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "theirs.yml").write_text("""base_emb_dim: 3584
base_num_query_heads: 28
base_num_kv_heads: 4
base_mlp_dim: 18944
base_num_decoder_layers: 28
head_dim: 128
mlp_activations: ["silu", "linear"]
vocab_size: 152064
decoder_block: "qwen2"
normalization_layer_epsilon: 1e-06
rope_max_timescale: 1000000.0
use_qk_norm: False
attention_bias: True
logits_via_embedding: False
normalize_embedding_logits: False
tokenizer_type: "huggingface"
""")
    (tmp_path / "mine.yml").write_text("base_config: base.yml\n")
    theirs = load_config([str(tmp_path / "mine.yml"), "model_name=theirs"], env={}).model
    ours = load_config([BASE, "model_name=qwen2.5-7b"], env={}).model
    assert (theirs.decoder_block, theirs.attention_bias) == ("qwen2", True)
    assert theirs == dataclasses.replace(ours, model_name="theirs")



def _loads_or_is_refused(args: list[str], error: str) -> str | None:
    """Load base.yml with `args`: it loads when `error` is empty, else it is refused with a message that
    starts with `error` (returned)."""
    if not error:
        load_config([BASE, *args], env={})
        return None
    with pytest.raises(ConfigError) as e:
        load_config([BASE, *args], env={})
    assert str(e.value).startswith(error), str(e.value)
    return str(e.value)

@pytest.mark.parametrize("args, error", [
    (["model_name=gpt3-52k", "normalize_embedding_logits=false"], ""),
    (["model_name=gemma-2b", "normalize_embedding_logits=true"], ""),
    (["normalize_embedding_logits=true"], ""),  # untied logits: MaxText does not read it either
    (["model_name=gpt3-52k", "normalize_embedding_logits=true"],
     "normalize_embedding_logits=true divides the tied logits (logits_via_embedding=true) by sqrt(emb_dim) in "
     "MaxText; Tessera's decoder_block=gpt3 does not"),
    (["model_name=gemma-2b", "normalize_embedding_logits=false"],
     "normalize_embedding_logits=false: MaxText's Gemma stores its token table times sqrt(emb_dim)"),
    (["model_name=gemma2-2b", "use_post_attn_norm=true", "use_post_ffw_norm=True"], ""),
    (["model_name=gemma3-4b", "use_post_ffw_norm=false"],
     "use_post_ffw_norm=false: Tessera's decoder_block=gemma3 always has a norm after the MLP"),
    (["use_post_attn_norm=false"], ""),
    (["use_post_attn_norm=true"], "use_post_attn_norm=true adds a norm after attention in MaxText's gemma2 and gemma3 "
                                  "blocks; decoder_block=llama2 has none"),
    (["model_name=llama4-17b-16e", "inhomogeneous_layer_cycle_interval=4"], ""),
    # MaxText's olmo3_32b file: its layer cycle, q/k norms; its olmo3 block has its post norms whatever these say
    (["model_name=olmo3_32b", "inhomogeneous_layer_cycle_interval=4", "use_qk_norm=true"], ""),
    (["model_name=olmo3-7b", "use_post_attn_norm=false", "use_post_ffw_norm=true"], ""),
    (["model_name=olmo3-7b", "inhomogeneous_layer_cycle_interval=6"],
     "inhomogeneous_layer_cycle_interval=6: MaxText scans the layers in groups of this many, for families whose "
     "kinds of layer repeat; Tessera's decoder_block=olmo3 repeats its kinds of layer every 4 layers"),
    (["model_name=gpt-oss-20b", "inhomogeneous_layer_cycle_interval=2"], ""),
    (["inhomogeneous_layer_cycle_interval=1"], ""),
    (["model_name=gpt-oss-20b", "inhomogeneous_layer_cycle_interval=4"],
     "inhomogeneous_layer_cycle_interval=4: MaxText scans the layers in groups of this many, for families whose "
     "kinds of layer repeat; Tessera's decoder_block=gpt_oss repeats its kinds of layer every 2 layers"),
    (["normalize_embedding_logits=maybe"], "normalize_embedding_logits='maybe' is not a valid bool"),
    (["model_name=deepseek-small", "attention_type=mla"], ""),  # MaxText's deepseek files
    (["attention_type=global"], ""),
    (["model_name=deepseek-small", "attention_type=global"],
     "attention_type=global: Tessera's decoder_block=deepseek always attends with latent attention"),
    (["attention_type=mla"], "attention_type=mla: Tessera's decoder_block=llama2 has no latent attention"),
    (["attention_type=local_sliding"], "attention_type='local_sliding' is MaxText's; in Tessera decoder_block "
                                       "decides the kind of attention, with sliding_window_size"),
])
def test_maxtext_keys_that_depend_on_the_model_are_checked_against_it(args, error):
    """MaxText's gemma2/gemma3 files set use_post_attn_norm and use_post_ffw_norm true, its llama4 files
    inhomogeneous_layer_cycle_interval 4 and gpt-oss's 2, its gpt3 files normalize_embedding_logits false: each
    is what Tessera's block does, and each was refused as a feature Tessera lacks; the values that ask for
    something else (normalize_embedding_logits=true on a tied gpt3 divides its logits in MaxText) are refused."""
    message = _loads_or_is_refused(args, error)
    assert message is None or "from the command line" in message


def test_a_yaml_style_key_on_the_command_line_is_told_its_key_value_form():
    """MaxText's llama3.1 405B GPU recipe passes `enable_checkpointing: False` (two arguments): the error said only
    that 'enable_checkpointing:' is not of the form key=value, without the key=value to give."""
    for args, want in ((["enable_checkpointing:", "False"], "enable_checkpointing=False"), (["steps:5"], "steps=5"),
                       (["--steps:", "steps=5"], "steps=<value>")):
        with pytest.raises(ConfigError) as e:
            load_config([BASE, *args], env={})
        assert str(e.value) == (f"argument {args[0]!r} is YAML's `key: value` form, which config files take; on the "
                                f"command line give key=value: {want}")
    with pytest.raises(ConfigError, match=r"argument 'foo:' is not of the form key=value \(e.g. steps=100\)"):
        load_config([BASE, "foo:", "3"], env={})


def test_maxtexts_segment_cap_of_its_gpu_configs_is_accepted_without_effect(caplog):
    """Every MaxText GPU config (gpu_smoke_test.yml, its gpu model files, the llama3.1 405B recipe) sets
    max_segments_per_seq=32 for TransformerEngine's packed attention: it was an unknown key whose closest key was
    max_num_checkpoints_to_keep. Tessera's cuDNN path hands packed batches to the reference attention."""
    from tessera.models.attention_choice import select_attention

    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        m = load_config([BASE, "max_segments_per_seq=32", "dtype=bfloat16", "attention=cudnn_flash_te"], env={}).model
        load_config([BASE, "max_segments_per_seq=-1"], env={})
    assert "max_segments_per_seq=32 has no effect: Tessera's cuDNN attention runs packed batches" in caplog.text
    choice = select_attention(m, "gpu", 128, {}, device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                              packed=True)
    assert choice.kernel == "dot_product" and "packing=true" in choice.reason
    for bad in ("0", "-2", "many"):
        with pytest.raises(ConfigError, match=f"max_segments_per_seq='{bad}' is not allowed; choose one of: '-1', "
                                              "'a whole number >= 1'"):
            load_config([BASE, f"max_segments_per_seq={bad}"], env={})


def test_maxtexts_rotary_and_multimodal_keys_point_to_tesseras():
    """MaxText's rope_use_scale, rope_linear_scaling_factor, rope_min_timescale and use_multimodal (in its llama4
    and gemma3 model files) were unknown keys, with closest keys such as rope_truncate and attention_sink; at
    MaxText's defaults they load, otherwise the error names Tessera's keys."""
    load_config([BASE, "rope_use_scale=true", "rope_linear_scaling_factor=1.0", "rope_min_timescale=1",
                 "use_multimodal=false"], env={})
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "rope_use_scale=false", "rope_linear_scaling_factor=8.0", "rope_min_timescale=2",
                     "use_multimodal=true"], env={})
    msg = str(e.value)
    assert msg.startswith("4 problems in the config:") and "unknown" not in msg
    assert "rope_scaling=none does not" in msg and "rope_scaling=linear rope_scaling_factor=<it>" in msg
    assert "Tessera trains and decodes text only" in msg
    gemma3 = load_config([BASE, "model_name=gemma3-4b"], env={}).model
    assert (gemma3.rope_scaling, gemma3.rope_scaling_factor) == ("linear", 8.0)  # what the message says


def test_maxtexts_yarn_keys_do_not_change_the_llama3_or_linear_scaling(tmp_path):
    """MaxText reads rope_factor and original_max_position_embeddings with rope_type=yarn only (its llama3.1 scaling
    keeps 8 and 8192, and its base.yml holds 40 and 4096): as aliases of rope_scaling_factor and
    rope_original_max_position they changed the llama3 scaling of llama3.1-8b to a factor of 40 over 4096 tokens
    without a word. YaRN models take them as before."""
    mine = tmp_path / "mine.yml"
    mine.write_text("base_config: base.yml\nrope_factor: 40\noriginal_max_position_embeddings: 4096\n")
    with pytest.raises(ConfigError) as e:
        load_config([str(mine), "model_name=llama3.1-8b"], env={})
    assert str(e.value).startswith("2 problems in the config:")
    assert ("rope_factor=40 is MaxText's YaRN setting (read with rope_type=yarn only; its llama3.1 scaling keeps its "
            "own factor 8 and context 8192), but here it sets rope_scaling_factor, which rope_scaling=llama3 reads: "
            "give rope_scaling_factor=40 to mean that, or leave rope_factor out") in str(e.value)
    assert "give rope_original_max_position=4096 to mean that" in str(e.value)
    with pytest.raises(ConfigError, match="rope_factor=8 is MaxText's YaRN setting .* rope_scaling=linear reads"):
        load_config([BASE, "model_name=gemma3-4b", "rope_factor=8"], env={})
    m = load_config([BASE, "model_name=gemma3-4b", "original_max_position_embeddings=4096"], env={}).model
    assert m.rope_scaling == "linear"  # which does not read it
    m = load_config([BASE, "model_name=gpt-oss-20b", "rope_factor=16", "original_max_position_embeddings=2048"],
                    env={}).model
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position) == ("yarn", 16.0, 2048)
    assert load_config([BASE, "model_name=llama3.1-8b"], env={}).model.rope_scaling_factor == 8.0


def test_the_vision_keys_of_maxtexts_gemma3_and_llama4_files_have_no_effect_as_in_maxtext_without_images(caplog):
    """MaxText's gemma3 and llama4 model files (the estimator's and a models/ folder's input) hold ten vision encoder
    keys, which it reads with use_multimodal=true only: each was an unknown key (11 problems for gemma3-4b.yml)."""
    maxtext._logged.clear()
    vision = ["vision_encoder_block=gemma3", "image_size_for_vit=896", "num_channels_for_vit=3",
              "patch_size_for_vit=14", "conv_stride_for_vit=14", "hidden_size_for_vit=1152",
              "intermediate_size_for_vit=4304", "num_hidden_layers_for_vit=27", "num_attention_heads_for_vit=16",
              "image_placeholder=<start_of_image>"]
    assert {a.split("=")[0] for a in vision} == set(maxtext.VISION_KEYS)
    with caplog.at_level(logging.INFO, logger="tessera"):
        load_config([BASE, "model_name=gemma3-4b", *vision], env={})
    assert ("hidden_size_for_vit=1152 has no effect: MaxText reads it with use_multimodal=true only (a vision encoder "
            "before the decoder); Tessera trains and decodes text only") in caplog.text
    with pytest.raises(ConfigError, match="use_multimodal='true' is a MaxText key Tessera does not implement"):
        load_config([BASE, "use_multimodal=true", *vision], env={})
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "hiden_size_for_vit=3"], env={})  # the vision keys are not offered as close keys
    assert str(e.value).startswith("unknown config key 'hiden_size_for_vit'") and "_vit" not in str(e.value)[40:]


def test_gradient_accumulation_says_at_start_up_that_it_splits_the_batch_where_maxtexts_multiplies_it(caplog):
    """The shared key whose meaning differs most (the guide's first difference): a MaxText command with
    per_device_batch_size=2 gradient_accumulation_steps=4 trains a quarter of MaxText's batch here, and the run said
    only "global batch 16 x T tokens in 4 micro-batches of 4"."""
    import jax

    from conftest import tiny_config
    from tessera.step import setup

    with caplog.at_level(logging.INFO, logger="tessera"):
        setup(tiny_config(None, per_device_batch_size=2, gradient_accumulation_steps=4, ici_tensor_parallelism=4),
              jax.devices())
    assert ("gradient_accumulation_steps=4 splits the global batch of 16 sequences (per_device_batch_size=2 x 8 "
            "devices) into 4 micro-batches of 4; MaxText's multiplies it (64 sequences in micro-batches of 16): "
            "per_device_batch_size=8 trains MaxText's batch here") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        setup(tiny_config(None, per_device_batch_size=2), jax.devices())
    assert "gradient_accumulation_steps" not in caplog.text


@pytest.mark.parametrize("args, error", [
    (["model_name=gpt-oss-20b", "rope_attention_scaling=true", "max_position_embeddings=131072",
      "rope_interleave=false"], ""),  # MaxText's gpt-oss files
    (["model_name=deepseek-small", "rope_attention_scaling=false", "max_position_embeddings=163840",
      "rope_interleave=true"], ""),  # MaxText's deepseek files
    (["rope_attention_scaling=false", "max_position_embeddings=16"], ""),  # no YaRN: MaxText does not read them
    (["model_name=gpt-oss-20b", "rope_attention_scaling=false"],
     "rope_attention_scaling=false leaves the attention scores of MaxText's YaRN unscaled; Tessera's "
     "decoder_block=gpt_oss with rope_scaling=yarn always multiplies them"),
    (["model_name=deepseek-small", "rope_attention_scaling=true"],
     "rope_attention_scaling=true would scale YaRN's attention scores a second time in MaxText's deepseek"),
    (["model_name=deepseek-small", "max_position_embeddings=1024"],
     "max_position_embeddings=1024 is not above rope_original_max_position="),
    (["rope_interleave=sometimes"], "rope_interleave='sometimes' is not allowed; choose one of: 'true', 'false'"),
])
def test_maxtexts_yarn_keys_of_its_deepseek_and_gpt_oss_files(args, error):
    """rope_attention_scaling, max_position_embeddings and rope_interleave (MaxText's deepseek and gpt-oss files) were
    unknown keys; the values that ask for what Tessera's YaRN does load, the others say what it does."""
    _loads_or_is_refused(args, error)


def test_rope_type_yarn_says_maxtexts_yarn_defaults_are_not_tesseras():
    """MaxText's rope_type=yarn alone is a factor of 40 over 4096 tokens; rope_scaling=yarn alone is 8 over 8192."""
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "rope_type=yarn"], env={})
    assert "MaxText's defaults, 40 and 4096, are not Tessera's 8 and 8192" in str(e.value)
    m = load_config([BASE, "rope_scaling=yarn"], env={}).model
    assert (m.rope_scaling_factor, m.rope_original_max_position) == (8.0, 8192)


def test_the_guide_says_tesseras_model_files_keep_dropout_on_where_maxtexts_turn_it_off():
    """MaxText's llama2-7b (and most of its model files) set enable_dropout: false, so its dropout_rate=0.1 has no
    effect with them; here it applies, which the guide now says (a MaxText command's dropout changed silently)."""
    from tessera.config.derived import dropout_rate

    text = " ".join(GUIDE.read_text().split())
    assert "Add `enable_dropout=false` for MaxText's run." in text
    for name in ("llama2-7b", "mistral-7b", "qwen3-8b", "gpt3-6b"):
        m = load_config([BASE, f"model_name={name}", "dropout_rate=0.1"], env={}).model
        assert m.enable_dropout and dropout_rate(m) == 0.1, name
        assert dropout_rate(load_config([BASE, f"model_name={name}", "dropout_rate=0.1", "enable_dropout=false"],
                                        env={}).model) == 0


def test_a_yarn_alias_a_later_layer_overrides_is_not_held_against_the_model(tmp_path):
    """rope_factor in a config file with rope_scaling_factor on the command line: the command line's value is the
    one in effect, so nothing of MaxText's YaRN setting reaches the llama3 scaling; and the estimator, which merges
    the layers before building, read the kept alias as a second spelling that disagreed with its key."""
    from tessera.tools.estimate import load_model_config

    mine = tmp_path / "mine.yml"
    mine.write_text("base_config: base.yml\nrope_factor: 40\n")
    m = load_config([str(mine), "model_name=llama3.1-8b", "rope_scaling_factor=8"], env={}).model
    assert (m.rope_scaling, m.rope_scaling_factor) == ("llama3", 8.0)
    model = tmp_path / "yarn.yml"
    lines = (REPO / "configs" / "models" / "deepseek-small.yml").read_text().splitlines()
    model.write_text("\n".join(line for line in lines if not line.startswith("rope_scaling_factor:")) +
                     "\nrope_factor: 40\n")
    assert load_model_config(str(model), ["rope_scaling_factor=8"]).model.rope_scaling_factor == 8.0
    assert load_model_config(str(model), []).model.rope_scaling_factor == 40.0


def test_maxtexts_cudnn_through_jax_is_tesseras_cudnn_attention(caplog):
    """MaxText's attention=cudnn_flash_jax calls cuDNN's fused attention through JAX, the kernel Tessera's
    cudnn_flash_te selects on NVIDIA GPUs; it was refused with the list of Tessera's values."""
    from tessera.models.attention_choice import select_attention

    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        m = load_config([BASE, "attention=cudnn_flash_jax", "dtype=bfloat16", "packing=false"], env={}).model
    assert m.attention == "cudnn_flash_te"
    assert "attention=cudnn_flash_jax is MaxText's name for attention=cudnn_flash_te; using that" in caplog.text
    choice = select_attention(m, "gpu", 128, {}, device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    assert choice.kernel == "cudnn"


def test_maxtexts_implementation_switches_and_print_outs_are_accepted_without_effect(caplog):
    """pure_nnx, enable_nnx, pure_nnx_decoder, log_config and debug_sharding are among the MaxText keys its docs and
    test commands pass most (74 times for pure_nnx): each was an unknown key."""
    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        load_config([BASE, "pure_nnx=true", "enable_nnx=False", "pure_nnx_decoder=1", "log_config=false",
                     "debug_sharding=true"], env={})
    assert "pure_nnx=true has no effect: MaxText builds its model in Flax Linen or NNX" in caplog.text
    assert "debug_sharding=true has no effect: Tessera logs every parameter's shape and sharding" in caplog.text
    with pytest.raises(ConfigError, match="log_config='yes please' is not allowed"):
        load_config([BASE, "log_config=yes please"], env={})


def test_base_config_repeated_on_the_command_line_is_told_apart(tmp_path, caplog):
    """MaxText's llama3.1 405B GPU recipe passes base_config=base.yml after its config file, which MaxText ignores:
    it was an unknown key whose closest keys were base_mlp_dim and base_emb_dim."""
    with caplog.at_level(logging.INFO, logger="tessera"):
        load_config([BASE, "base_config=base.yml"], env={})
    assert "base_config=base.yml on the command line has no effect: base.yml is read already" in caplog.text
    (tmp_path / "mine.yml").write_text("base_config: base.yml\nsteps: 7\n")
    assert load_config([str(tmp_path / "mine.yml"), "base_config=base.yml"], env={}).run.steps == 7
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "base_config=mine.yml"], env={})
    assert str(e.value) == ("base_config=mine.yml on the command line has no effect: a config file names its parent "
                            "with a `base_config: <file>` line in it; give mine.yml as the first argument instead (the "
                            "config file comes first)")


# MaxText keys its recipes, benchmark configs and documented commands set (its tree of 2026-08-22), each an
# unknown key before: the value of each recipe, then a value that asks for what Tessera lacks
RECIPE_KEYS_REFUSED_UNLESS_OFF = [
    ("checkpoint_storage_concurrent_gb", "96", "1024", "Tessera's is 96"),  # the DeepSeek scripts
    ("shard_mode", "auto", "explicit", "auto mode"),
    ("context_parallel_strategy", "all_gather", "ring", "gathers them along the axis"),
    ("save_checkpoint_on_completion", "true", "false", "enable_checkpointing=false to save none"),
    ("use_tokamax_gmm", "false", "true", "megablox=true"),
    ("use_tokamax_splash", "false", "true", "attention=flash"),
    ("enable_pathways_goodput", "false", "true", "report"),  # the trillium benchmarks' base
    ("subslice_shape", "", "8,8", "every device JAX sees"),
]


@pytest.mark.parametrize("key,off,on,advice", RECIPE_KEYS_REFUSED_UNLESS_OFF)
def test_maxtext_recipe_keys_load_at_their_default_and_are_refused_with_what_to_use(key, off, on, advice):
    """Each was 'unknown config key' (shard_mode's closest keys were shared_experts, head_dim, hardware)."""
    load_config([BASE, f"{key}={off}"], env={})
    with pytest.raises(ConfigError) as e:
        load_config([BASE, f"{key}={on}"], env={})
    assert str(e.value).startswith(f"{key}={on!r} is a MaxText key Tessera does not implement: ")
    assert advice in str(e.value) and "unknown" not in str(e.value)


def test_maxtext_recipe_keys_without_effect_are_accepted_checked_and_logged(caplog):
    """profile_cleanly (trillium benchmarks), use_custom_sort_vjp (v5p benchmarks), sharding_tolerance (qwen2.5
    test) and goodput_upload_interval_seconds (trillium benchmarks' base) were unknown keys."""
    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        load_config([BASE, "profile_cleanly=False", "use_custom_sort_vjp=True", "sharding_tolerance=0.03",
                     "goodput_upload_interval_seconds=30"], env={})
    assert "profile_cleanly=False has no effect: Tessera's trace always starts and ends between" in caplog.text
    assert "sharding_tolerance=0.03 has no effect: Tessera does not check" in caplog.text
    assert "goodput_upload_interval_seconds=30 has no effect" in caplog.text
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "sharding_tolerance=5", "goodput_upload_interval_seconds=-3", "use_custom_sort_vjp=x"],
                    env={})
    assert "sharding_tolerance='5' is not allowed; choose one of: 'a number from 0 to 1'" in str(e.value)
    assert "goodput_upload_interval_seconds='-3' is not allowed; choose one of: 'a whole number >= 0'" in str(e.value)
    assert "use_custom_sort_vjp='x' is not allowed" in str(e.value)


def test_maxtexts_olmo3_32b_name_reads_our_olmo3_32b():
    """MaxText's model_name=olmo3_32b (its OLMo 3 32B file) was refused as an unknown model; it reads Tessera's
    olmo3-32b file, the same sizes as MaxText's (5120 wide, 40 query and 8 kv heads of 128, 64 layers, mlp 27648,
    vocabulary 100278, window 4096, YaRN x8 over 8192 tokens at theta 500k)."""
    m = load_config([BASE, "model_name=olmo3_32b"], env={}).model
    assert dataclasses.replace(m, model_name="olmo3-32b") == load_config([BASE, "model_name=olmo3-32b"], env={}).model
    assert (m.decoder_block, m.emb_dim, m.num_query_heads, m.num_kv_heads, m.head_dim, m.num_decoder_layers,
            m.mlp_dim, m.vocab_size, m.sliding_window_size) == ("olmo3", 5120, 40, 8, 128, 64, 27648, 100278, 4096)
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_original_max_position, m.rope_max_timescale,
            m.local_rope_theta, m.beta_fast, m.beta_slow, m.normalization_layer_epsilon) == (
        "yarn", 8.0, 8192, 500000, 500000, 32.0, 1.0, 1e-6)


def test_maxtexts_float32_score_switches_are_accepted_as_what_tessera_always_does(caplog):
    """float32_qk_product and float32_logits were refused when true (MaxText's files for accuracy runs set them).
    Tessera's attention forms the scores with float32 accumulation; for bfloat16 queries and keys that is the
    product of their float32 casts (each product of two bfloat16 numbers is exact in float32; the sums may run in
    another order), which is what MaxText's true computes: checked here on the reference attention's score
    product, against scores rounded to bfloat16 (MaxText's false), which are further off."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tessera.models.layers import project

    maxtext._logged.clear()
    with caplog.at_level(logging.INFO, logger="tessera"):
        load_config([BASE, "float32_qk_product=true", "float32_logits=True"], env={})
        load_config([BASE, "float32_qk_product=false"], env={})
    assert "float32_qk_product=true has no effect: Tessera's attention (every kernel) forms" in caplog.text
    assert "float32_logits=True has no effect" in caplog.text
    with pytest.raises(ConfigError, match="float32_logits='yes' is not allowed"):
        load_config([BASE, "float32_logits=yes"], env={})
    q, k = (jax.random.normal(jax.random.key(i), (2, 3, 1, 16, 64), jnp.bfloat16) for i in (0, 1))
    ours = project("bkgth,bkgsh->bkgts", q, k, preferred_element_type=jnp.float32)
    exact = jnp.einsum("bkgth,bkgsh->bkgts", q.astype(jnp.float32), k.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(ours), np.asarray(exact), rtol=1e-6, atol=1e-5)
    rounded = np.asarray(ours.astype(jnp.bfloat16).astype(jnp.float32))  # MaxText's false: the scores in dtype
    assert np.abs(rounded - np.asarray(exact)).max() > 1e-3


@pytest.mark.parametrize("value", ["default", "highest", "float32", "high"])
def test_maxtexts_matmul_precision_is_a_key_with_its_values(value):
    """matmul_precision=highest (21 of MaxText's commands) and its older float32 were refused, with the environment
    variable to set instead; they load now (what they do to the step: test_model.py), and a value JAX does not
    name is refused with the choices."""
    assert load_config([BASE, f"matmul_precision={value}"], env={}).model.matmul_precision == value
    with pytest.raises(ConfigError, match="matmul_precision='fastest' is not allowed; choose one of: 'default', "
                                          "'high', 'highest'"):
        load_config([BASE, "matmul_precision=fastest"], env={})
