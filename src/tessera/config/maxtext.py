"""MaxText's config keys that are not Tessera keys: what the loader does with each.

MaxText users' commands should run unchanged where Tessera has the feature, and fail with a
reason where it does not. Every MaxText key falls in one of five groups:

- the same name (most keys: `steps`, `per_device_batch_size`, `ici_fsdp_parallelism`, ...):
  nothing to do, they are schema keys;
- `ALIASES`: another spelling of a key we have; the loader renames it and logs that once;
- `ACCEPTED`: a setting Tessera takes from elsewhere (`hardware`: the devices JAX sees); the
  value is checked, logged and has no effect;
- `REFUSED`: a feature Tessera does not implement. A value that leaves the feature off (the
  `off` values, MaxText's defaults) is accepted and logged; any other value is refused with
  what the key does in MaxText and what to use in Tessera;
- `IN_CONTEXT` (maxtext_model.py): a key whose meaning depends on the model (gemma2's post norms,
  the YaRN factor); kept, and checked against the built model by the loader.

getting_started/Coming_from_MaxText.md explains the same groups in prose (a test keeps it
mentioning every refused key). This module imports nothing from JAX.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tessera.config.maxtext_model import IN_CONTEXT
from tessera.config.schema import ConfigError

log = logging.getLogger("tessera")

# alias -> (our key, whose spelling it is). The GPU validation files' spellings are here too, so
# that tools/validate.py and train.py share one mapping.
ALIASES = {
    "ici_context_parallelism": ("ici_sequence_parallelism", "MaxText's"),
    "dcn_context_parallelism": ("dcn_sequence_parallelism", "MaxText's"),
    "dump_hlo_local_module_name": ("dump_hlo_module_name", "MaxText's local-dump filter"),
    "rope_factor": ("rope_scaling_factor", "MaxText's (rope_type=yarn models)"),
    "original_max_position_embeddings": ("rope_original_max_position", "MaxText's"),
    "learning_rate_final_fraction": ("cosine_learning_rate_final_fraction", "MaxText's newer"),
    "sequence_length": ("max_target_length", "the GPU validation files'"),
    "micro_batch_size": ("per_device_batch_size", "the GPU validation files'"),
    "tensor_parallelism": ("ici_tensor_parallelism", "the GPU validation files'"),
    "pipeline_parallelism": ("ici_pipeline_parallelism", "the GPU validation files'"),
}

COUNT = ("-1", "a whole number >= 1")  # allowed values of a count that is -1 (none) or positive
ANY = ("any value",)


def _allowed(choices: tuple[str, ...], text: str) -> bool:
    """`text` (lower-case) is one of `choices`, or a count when `choices` is COUNT, or anything for ANY."""
    if choices is COUNT:
        return text == "-1" or (text.isdigit() and int(text) >= 1)
    return choices is ANY or text in choices


# the vision encoder's keys in MaxText's gemma3 and llama4 model files, which it reads with use_multimodal=true only
VISION_KEYS = ("vision_encoder_block", "image_size_for_vit", "num_channels_for_vit", "patch_size_for_vit",
               "conv_stride_for_vit", "hidden_size_for_vit", "intermediate_size_for_vit", "num_hidden_layers_for_vit",
               "num_attention_heads_for_vit", "image_placeholder")


# key -> (allowed values, why it has no effect)
ACCEPTED = {
    "hardware": (("tpu", "gpu", "cpu", "gpu_multiprocess"),
                 "Tessera uses the platform of the devices JAX sees at start-up; detection wins over this key"),
    "dump_hlo_delete_local_after": (("true", "false", "1", "0"),
                                    "Tessera does not upload the HLO dump, so it keeps it in dump_hlo_local_dir"),
    # MaxText refuses a model file's key given on the command line unless this is true; here the command
    # line always wins (a shrunk model: model_name=llama2-7b base_num_decoder_layers=2)
    "override_model_config": (("true", "false", "1", "0"),
                              "a key=value on the command line always wins over the model file in Tessera"),
    # MaxText's default (false) refuses a mesh that needs a physical axis split; Tessera's mesh.py always
    # builds it (jax's create_device_mesh with allow_split_physical_axes=True), as MaxText does with true
    "allow_split_physical_axes": (("true", "false", "1", "0"),
                                  "Tessera always lets a mesh axis span part of a physical axis of the slice when "
                                  "the mesh needs it (as MaxText with true)"),
    # MaxText's implementation switches and print-outs (its test commands pass them): the same model and run here
    **{name: (("true", "false", "1", "0"), "MaxText builds its model in Flax Linen or NNX by these switches; Tessera's "
              "one implementation is NNX") for name in ("enable_nnx", "pure_nnx", "pure_nnx_decoder")},
    "log_config": (("true", "false", "1", "0"), "Tessera logs the keys that differ from base.yml at start-up and saves "
                                                "the whole config in the run folder (config.yml)"),
    "debug_sharding": (("true", "false", "1", "0"), "Tessera logs every parameter's shape and sharding at start-up"),
    # every MaxText GPU config sets 32: TransformerEngine's packed attention, and MaxText's grain packing, take at most
    # this many documents in a sequence; Tessera's cuDNN path hands packed batches to the reference attention
    "max_segments_per_seq": (COUNT, "Tessera's cuDNN attention runs packed batches (several documents in a sequence) "
                                    "with the reference attention, which needs no cap, and its packing puts no cap on "
                                    "the documents in a sequence"),
    # Tessera rotates the two halves of each head (MaxText's false, Hugging Face's layout); interleaved pairs are
    # the same model with the head's dimensions in another order
    "rope_interleave": (("true", "false", "1", "0"),
                        "Tessera's rotary embedding turns the two halves of each head (MaxText's false, the Hugging "
                        "Face layout); MaxText's true turns adjacent pairs: the same model with the dimensions of each "
                        "query and key head in another order, which training from scratch cannot tell apart"),
    **{name: (ANY, "MaxText reads it with use_multimodal=true only (a vision encoder before the decoder); Tessera "
                   "trains and decodes text only, as MaxText with use_multimodal=false") for name in VISION_KEYS},
}


@dataclass(frozen=True)
class Refused:
    """A MaxText key Tessera lacks: `off` values (lower-case text) mean the feature is off and are
    accepted; `why` says what the key does in MaxText and what to use in Tessera."""

    why: str
    off: tuple[str, ...] = ()


_QUANT = ("; Tessera quantizes the training matmuls (quantization), the KV cache (quantize_kvcache) and "
          "checkpoints for decoding (save_quantized_params_path, checkpoint_is_quantized), on qwix, without this setting")
_PIPE = ("; Tessera pipelines every decoder layer (but DeepSeek's first_num_dense_layers, which run before the "
         "pipeline), over ici_pipeline_parallelism x dcn_pipeline_parallelism stages")
_INFER = ("; Tessera's decode.py takes its prompt and sampling as flags (--prompt, --max_new_tokens, "
          "--temperature, --top_k, --top_p, --seed) and has no such setting")
_DECODE_FLAG = "; Tessera's decode.py takes it as a flag: "
_GCP = ("; Tessera keeps metrics.jsonl, TensorBoard files and the report in the run folder (with a gs:// "
        "base_output_directory, gcs_metrics=true writes the metrics there)")

REFUSED = {
    # quantization
    "quantization_local_shard_count": Refused("shards of the quantization range search" + _QUANT, ("-1",)),
    "quant_cfg_path": Refused("file of per-layer quantization settings" + _QUANT, ("",)),
    "use_qwix_quantization": Refused("quantize with the Qwix library (Tessera's quantization always does)" + _QUANT,
                                     ("false", "0", "true", "1")),
    "replicate_quant_scale": Refused("replicate quantization scales across devices" + _QUANT, ("false", "0")),
    # mesh axes Tessera does not have
    "ici_autoregressive_parallelism": Refused(
        "a mesh axis that shards heads for decoding; Tessera has no such axis: use ici_tensor_parallelism", ("1",)),
    "dcn_autoregressive_parallelism": Refused(
        "as ici_autoregressive_parallelism, across slices; use dcn_tensor_parallelism", ("1",)),
    "ici_tensor_sequence_parallelism": Refused(
        "a mesh axis sharding both tensor and sequence dimensions; use ici_tensor_parallelism and "
        "ici_sequence_parallelism", ("1",)),
    "dcn_tensor_sequence_parallelism": Refused("as ici_tensor_sequence_parallelism, across slices", ("1",)),
    "ici_tensor_transpose_parallelism": Refused(
        "a second tensor-parallel axis with transposed weight sharding; use ici_tensor_parallelism", ("1",)),
    "dcn_tensor_transpose_parallelism": Refused("as ici_tensor_transpose_parallelism, across slices", ("1",)),
    "ici_context_autoregressive_parallelism": Refused(
        "a context axis for decoding; use ici_sequence_parallelism for training", ("1",)),
    "mesh_axes": Refused("the names and order of the mesh axes; Tessera's mesh is fixed (see mesh.py)"),
    "logical_axis_rules": Refused("the table from logical to mesh axes; Tessera's is LOGICAL_RULES in mesh.py"),
    "data_sharding": Refused("mesh axes the batch is split over; Tessera splits it over data, fsdp and expert"),
    "custom_mesh": Refused("a hand-made device order for some TPU slices; Tessera uses JAX's device mesh", ("",)),
    # pipeline parallelism
    "pipeline_parallel_layers": Refused("layers run by the pipeline" + _PIPE, ("-1",)),
    "scan_pipeline_iterations": Refused("scan over pipeline iterations; Tessera's pipeline schedule is always a "
                                        "scan (scan_layers decides whether a stage scans its layers)", ("true", "1")),
    # optimizer
    "adam_eps_root": Refused("epsilon inside the square root of Adam's denominator; Tessera's AdamW uses "
                             "adam_eps only", ("0", "0.0")),
    "mu_dtype": Refused("dtype of Adam's first moment; in Tessera the optimizer state follows weight_dtype", ("",)),
    "optimizer_memory_host_offload": Refused("keep optimizer state in host memory; not in Tessera",
                                             ("false", "0")),
    "param_memory_host_offload": Refused("keep parameters in host memory; not in Tessera", ("false", "0")),
    "parameter_memory_host_offload": Refused("keep parameters in host memory (MaxText's newer name of "
                                             "param_memory_host_offload); not in Tessera", ("false", "0")),
    "adamw_mask": Refused("patterns of the parameters AdamW does not decay (MaxText's default, [], decays every "
                          "parameter); Tessera's AdamW leaves norm scales and DeepSeek's routing biases undecayed "
                          "and decays the rest", ("[]", "")),
    "lr_schedule_type": Refused("the schedule's shape: cosine (warm-up, cosine decay) or wsd (warm-up, a stable "
                                "rate, then a decay); Tessera's schedule is the cosine one", ("cosine",)),
    "wsd_decay_steps_fraction": Refused("the decay's share of lr_schedule_type=wsd's schedule; Tessera's schedule "
                                        "is the cosine one", ("0.1",)),
    "wsd_decay_style": Refused("the decay's shape in lr_schedule_type=wsd's schedule; Tessera's schedule is the "
                               "cosine one", ("linear",)),
    # model variants
    "rope_type": Refused("the kind of rotary scaling (default, llama3.1, yarn); Tessera's key is rope_scaling: "
                         "rope_scaling=llama3 or rope_scaling=yarn (rope_scaling=none: MaxText's default). llama3 "
                         "stretches by 8 over 8192 tokens, as MaxText's llama3.1; with yarn give rope_factor and "
                         "original_max_position_embeddings too: MaxText's defaults, 40 and 4096, are not Tessera's 8 "
                         "and 8192", ("default",)),
    "rope_use_scale": Refused("whether MaxText's llama3.1 rotary scaling (rope_type=llama3.1, or a llama3.1 "
                              "model_name) stretches the low frequencies; Tessera's key is rope_scaling: "
                              "rope_scaling=llama3 stretches them (its llama3.1, llama3.3 and llama4-17b-16e model "
                              "files set it), rope_scaling=none does not", ("true", "1")),
    "rope_linear_scaling_factor": Refused("divide every rotary frequency by this (MaxText's gemma3 files: 8, in the "
                                          "global layers); Tessera's keys: rope_scaling=linear rope_scaling_factor=<it>, "
                                          "which its gemma3 model files set", ("1",)),
    "rope_min_timescale": Refused("the shortest rotary wavelength; Tessera's is 1 (MaxText's default): the "
                                  "frequencies are rope_max_timescale^(-2i/head_dim)", ("1",)),
    "use_multimodal": Refused("a vision encoder before the decoder (MaxText's gemma3 and llama4); Tessera trains and "
                              "decodes text only", ("false", "0")),
    "use_untrainable_positional_embedding": Refused(
        "add fixed sinusoidal positions to the embeddings; Tessera's gpt3 family uses them when "
        "trainable_position_size=0", ("false", "0")),
    "param_scan_axis": Refused("which axis of the stacked parameters is the layer axis; Tessera's is fixed",
                               ("1",)),
    "float32_qk_product": Refused("compute query-key scores in float32; Tessera's attention kernels choose",
                                  ("false", "0")),
    "float32_logits": Refused("attention logits in float32; Tessera's attention kernels choose", ("false", "0")),
    "record_internal_nn_metrics": Refused("log activation statistics from inside the model; not in Tessera",
                                          ("0", "false")),
    # input pipeline
    "enable_data_shuffling": Refused(
        "shuffle the training records; Tessera's grain and tfds pipelines always shuffle with data_shuffle_seed",
        ("true", "1")),
    "expansion_factor_real_data": Refused("let only some hosts read data; every Tessera host reads its share",
                                          ("-1",)),
    "max_corpus_chars": Refused("characters read to train a tokenizer; Tessera does not train tokenizers",
                                ("10000000",)),
    "hf_data_dir": Refused("data_dir of a Hugging Face dataset; use hf_path (a local folder or Hub name)", ("",)),
    "hf_data_files": Refused("files of a Hugging Face dataset (older MaxText); use hf_train_files", ("",)),
    "hf_access_token": Refused("a Hugging Face token on the command line; set HF_TOKEN in the environment",
                               ("",)),
    "hf_eval_split": Refused("split of the Hugging Face eval data; use eval_split", ("",)),
    "tokenize_train_data": Refused("tokenize the training column; Tessera tokenizes text columns and takes "
                                   "list-of-ints columns as already tokenized", ("true", "1")),
    "tokenize_eval_data": Refused("as tokenize_train_data, for evaluation data", ("true", "1")),
    # checkpointing
    "enable_single_replica_ckpt_restoring": Refused(
        "one replica reads a checkpoint and broadcasts it; every Tessera host reads its own shards",
        ("false", "0")),
    "force_unroll": Refused("unroll the layers when writing a parameter-only checkpoint; not in Tessera",
                            ("false", "0")),
    "enable_emergency_checkpoint": Refused("local in-memory checkpoints for fast restarts; not in Tessera: "
                                           "use checkpoint_period", ("false", "0")),
    "local_checkpoint_directory": Refused("folder of emergency checkpoints; not in Tessera", ("",)),
    "local_checkpoint_period": Refused("steps between emergency checkpoints; not in Tessera", ("0",)),
    "checkpoint_storage_use_ocdbt": Refused("Orbax's OCDBT storage; Tessera uses Orbax's defaults", ("true", "1")),
    "checkpoint_storage_use_zarr3": Refused("Orbax's zarr3 storage; Tessera uses Orbax's defaults", ("true", "1")),
    "enable_checkpoint_cloud_logger": Refused("log checkpoint events to Cloud Logging" + _GCP, ("false", "0")),
    "enable_checkpoint_standard_logger": Refused("log checkpoint events as JSON" + _GCP, ("false", "0")),
    # ahead-of-time compilation
    # metrics, profiling and cloud services
    "save_config_to_gcs": Refused("write the config to GCS; Tessera logs the changed keys at start-up",
                                  ("false", "0")),
    "upload_all_profiler_results": Refused("upload every host's trace; Tessera's profiler writes host 0's",
                                           ("false", "0")),
    "use_vertex_tensorboard": Refused("Vertex AI TensorBoard" + _GCP, ("false", "0")),
    "vertex_tensorboard_project": Refused("Vertex AI TensorBoard project" + _GCP, ("",)),
    "vertex_tensorboard_region": Refused("Vertex AI TensorBoard region" + _GCP, ("",)),
    "enable_goodput_recording": Refused("record goodput with Google's ml-goodput library; Tessera's report.json "
                                        "has the run's goodput and where its time went (`time`), and the last "
                                        "log line before `done:` says it" + _GCP, ("false", "0")),
    "monitor_goodput": Refused("upload goodput to Cloud Monitoring; Tessera's report.json has the run's goodput "
                               "(`time`)" + _GCP, ("false", "0")),
    "collect_stack_trace": Refused("dump stacks periodically; Tessera dumps them when a step exceeds "
                                   "step_timeout_seconds", ("false", "0")),
    "stack_trace_to_cloud": Refused("send stack dumps to Cloud Logging; see step_timeout_seconds", ("false", "0")),
    "stack_trace_interval_seconds": Refused("seconds between stack dumps; see step_timeout_seconds", ("600",)),
    "max_checkify": Refused("extra runtime checks with jax.checkify; not in Tessera", ("false", "0")),
    "dump_hlo_gcs_dir": Refused("upload the HLO dump; Tessera keeps it in dump_hlo_local_dir (the run folder's "
                                "xla_dump/ by default), like the run's other files", ("",)),
    "dump_hlo_upload_all": Refused("upload every host's HLO dump; see dump_hlo_gcs_dir", ("false", "0")),
    "dump_step": Refused("the step after which the HLO dump is uploaded; Tessera's dump is written as each program "
                         "compiles, and not uploaded", ("-1",)),
    "enable_single_controller": Refused("Pathways single-controller mode; not in Tessera", ("false", "0")),
    "skip_jax_distributed_system": Refused("do not call jax.distributed.initialize; Tessera initializes when "
                                           "more than one process runs", ("false", "0")),
    # decoding and inference: no effect on training in MaxText either; each is off at MaxText's default
    "prompt": Refused("decode.py's prompt" + _DECODE_FLAG + "--prompt TEXT (or --tokens 1,2,3)", ("i love to",)),
    "decode_sampling_temperature": Refused("decode.py's sampling temperature" + _DECODE_FLAG + "--temperature T",
                                           ("1",)),
    "decode_sampling_top_k": Refused("decode.py's top-k sampling" + _DECODE_FLAG + "--top_k K", ("0",)),
    "decode_sampling_nucleus_p": Refused("decode.py's nucleus sampling" + _DECODE_FLAG + "--top_p P", ("-1",)),
    "decode_sampling_strategy": Refused(
        "decode.py's sampling strategy" + _DECODE_FLAG + "--temperature 0 for greedy (the default), else "
        "--temperature T with --top_k K (topk) or --top_p P (nucleus)", ("greedy",)),
    "max_prefill_predict_length": Refused(
        "the prompt length decoding prefills" + "; Tessera's decode.py prefills the whole prompt it is given "
        "and then samples --max_new_tokens more, within max_target_length", ("64",)),
    **{name: Refused("a decoding or inference-benchmark setting" + _INFER, off) for name, off in {
        "load_from_prefill_dir": ("false", "0"), "prefill_cache_dir": ("",), "autoregressive_decode_assert": ("",),
        "inference_microbenchmark_prefill_lengths": ("64,128,256,512,1024",),
        "inference_microbenchmark_stages": ("prefill,generate",), "inference_microbenchmark_loop_iters": ("10",),
        "inference_microbenchmark_log_file_path": ("",), "prefill_key_axis_order": ("1,2,0,3",),  # older MaxText's
        "prefill_value_axis_order": ("1,2,0,3",), "ar_key_axis_order": ("1,2,0,3",),  # KV cache layout, its default
        "ar_value_axis_order": ("1,2,0,3",),
        "use_ragged_attention": ("false", "0"), "ragged_block_size": ("256",),
        "enable_model_warmup": ("false", "0")}.items()},
}


# Values of a key Tessera shares with MaxText that MaxText spells otherwise: {key: {MaxText's value: ours}}.
# Tessera's save_dot_except_mlp keeps attention's output (context) with the projections, which MaxText's value
# of that name recomputes and its save_dot_with_context_except_mlp keeps.
# MaxText's cudnn_flash_jax is cuDNN's fused attention through JAX, which is what Tessera's cudnn_flash_te runs on
# NVIDIA GPUs (Tessera has no Transformer Engine path).
VALUE_ALIASES = {"remat_policy": {"save_dot_with_context_except_mlp": "save_dot_except_mlp"},
                 "attention": {"cudnn_flash_jax": "cudnn_flash_te"}}
_MINIMAL_WITH_CONTEXT = ("keep every projection's output and attention's output (context); Tessera's minimal keeps the "
                         "projections' outputs only: remat_policy=custom query_proj=device key_proj=device "
                         "value_proj=device context=device out_proj=device mlpwi_0=device mlpwi_1=device mlpwi=device "
                         "mlpwo=device keeps the same tensors")
# MaxText values of a shared key Tessera does not have: {key: {value: what it does in MaxText; what to use}}
REFUSED_VALUES = {"remat_policy": {"minimal_with_context": _MINIMAL_WITH_CONTEXT,
                                   "minimal_flash": _MINIMAL_WITH_CONTEXT}}


# Keys Tessera shares with MaxText whose "unset" MaxText spells differently (its base.yml holds
# these values): {key: (MaxText's values, Tessera's value, what it means)}. A config file or
# command line written for MaxText means the same here; the translation is logged once.
UNSET = {
    "eval_interval": (("-1",), 0, "never evaluate"),
    "base_moe_mlp_dim": (("-1",), 0, "experts as wide as base_mlp_dim"),
    "trainable_position_size": (("-1",), 0, "no learned position table"),
    "nope_layer_interval": (("-1",), 0, "rotary positions in every layer"),
    "compile_topology_num_slices": (("-1",), 1, "one slice"),
    "max_num_checkpoints_to_keep": (("none", "null", "~", ""), -1, "keep every checkpoint"),
    "routed_score_func": (("",), "softmax", "softmax router scores"),
    "muon_consistent_rms": (("none", "null", "~", ""), 0.0, "Muon's width scaling, sqrt(max(1, fan_out / fan_in))"),
}


def steps_from_schedule(merged: dict[str, Any], whole: Callable[[Any], int]) -> str:
    """MaxText's `steps=-1`: as many steps as `learning_rate_schedule_steps` (in `merged`, the
    config's keys after every layer; set in place and logged). `whole` reads the schedule's value
    as the schema does (1e3, 1000.0 and 1_000 are 1000; ConfigError for a bad one). With the
    schedule's length unset too, the error line to report (neither key gives the other a length);
    '' otherwise."""
    if "steps" not in merged or not spelled_as(merged["steps"], ("-1",)):
        return ""
    schedule = merged.get("learning_rate_schedule_steps", -1)
    if not spelled_as(schedule, ("-1",)):
        try:
            schedule = whole(schedule)
        except ConfigError:
            schedule = 0
        if schedule < 1:  # a bad schedule value (abc, 0, -2) is reported once, under its own name
            del merged["steps"]
            return ""
        _log_once(f"steps=-1 is MaxText's spelling of 'as many steps as learning_rate_schedule_steps'; "
                  f"using steps={schedule}")
        merged["steps"] = schedule
        return ""
    del merged["steps"]  # one line about it, not a second "too small"
    return ("steps=-1 (MaxText's spelling of 'as many steps as learning_rate_schedule_steps') needs "
            "learning_rate_schedule_steps set, and it is -1 (as many as steps) too; give steps=<the number of "
            "optimizer steps>")


def render_aliases() -> list[str]:
    """The comment block base.yml ends with: every other key name the loader accepts."""
    lines = ["", "# --- Aliases: other trainers' names for the keys above, accepted and logged when used"]
    lines += [f"# {alias} -> {target}  ({whose} name)" for alias, (target, whose) in ALIASES.items()]
    lines += [f"# {name} [one of: {', '.join(choices)}]: accepted; {why}" for name, (choices, why) in ACCEPTED.items()
              if choices is not ANY]
    lines += [f"# {', '.join(VISION_KEYS)}: accepted; {ACCEPTED[VISION_KEYS[0]][1]}"]
    lines += [f"# {name}={spelled[0] or '(empty)'} (MaxText's spelling of {meaning}) -> {name}={ours}"
              for name, (spelled, ours, meaning) in UNSET.items()]
    lines += [f"# {name}={theirs} (MaxText's name) -> {name}={ours}"
              for name, values in VALUE_ALIASES.items() for theirs, ours in values.items()]
    lines += [f"# {', '.join(IN_CONTEXT)}: MaxText's, accepted where the model does what they ask in MaxText "
              "(gemma2's post norms, ...), else refused with what it does"]
    lines += ["# MaxText keys Tessera does not implement are refused with a reason (left at MaxText's default, off,",
              "# they are ignored): see src/tessera/config/maxtext.py and getting_started/Coming_from_MaxText.md"]
    return lines


def is_off(refused: Refused, value) -> bool:
    """`value` (YAML value or command-line text) leaves the refused feature off."""
    return spelled_as(value, refused.off)


def spelled_as(value, spellings: tuple[str, ...]) -> bool:
    """`value` (YAML value or command-line text) is one of `spellings` (lower-case text; numbers
    compare as numbers: MaxText's base.yml writes -1.0 and 10_000_000)."""
    text = "" if value is None else str(value).strip().lower()
    return text in spellings or any(_same_number(text, s) for s in spellings)


def _same_number(text: str, off: str) -> bool:
    try:
        return float(text.replace("_", "")) == float(off)
    except ValueError:
        return False


def maxtext_keys() -> set[str]:
    """Every non-schema key the loader knows (aliased, accepted or refused)."""
    return set(ALIASES) | set(ACCEPTED) | set(REFUSED) | set(IN_CONTEXT)


def translate(values: Mapping[str, Any], source: str, fields: Mapping[str, Any], errors: list[str]) -> dict:
    """`values` (one layer of the config, set in `source`) with aliases renamed to our keys and
    keys without effect dropped; one line in `errors` per unknown key, refused MaxText key, bad
    `hardware` value or alias that disagrees with its key in the same layer."""
    out = {}
    for name, value in values.items():
        if name in UNSET and spelled_as(value, UNSET[name][0]):
            _, ours, meaning = UNSET[name]
            _log_once(f"{name}={value!r} is MaxText's spelling of {meaning}; using {name}={ours!r}")
            out[name] = ours
        elif name in fields and (ours := VALUE_ALIASES.get(name, {}).get(str(value).strip().lower())):
            _log_once(f"{name}={value} is MaxText's name for {name}={ours}; using that")
            out[name] = ours
        elif name in fields and (why := REFUSED_VALUES.get(name, {}).get(str(value).strip().lower())):
            errors.append(f"{name}={value!r} is a MaxText value Tessera does not have: it would {why} (from {source})")
        elif name in fields:
            out[name] = value
        elif name in ALIASES:
            target, whose = ALIASES[name]
            if target in values and not spelled_as(value, (str(values[target]).strip().lower(),)):
                errors.append(f"{name}={value!r} ({whose} name for {target}) disagrees with "
                              f"{target}={values[target]!r} in {source}; set only {target}")
                continue
            _log_once(f"{name}={value} is {whose} name for {target}; using that")
            out[target] = value
            if name in IN_CONTEXT:  # and checked against the model once it is built
                out[name] = value
        elif name in ACCEPTED:
            choices, why = ACCEPTED[name]
            if _allowed(choices, str(value).strip().lower()):
                _log_once(f"{name}={value} has no effect: {why}")
            else:
                errors.append(f"{name}={value!r} is not allowed; choose one of: {', '.join(map(repr, choices))} "
                              f"(from {source})")
        elif name in IN_CONTEXT:
            out[name] = value  # checked against the model once it is built
        elif name in REFUSED:
            if is_off(REFUSED[name], value):
                _log_once(f"{name}={value!r} is MaxText's setting with the feature off, as in Tessera; ignored")
            else:
                errors.append(f"{name}={_shown(value)} is a MaxText key Tessera does not implement: "
                              f"{REFUSED[name].why} (from {source})")
        else:
            errors.append(unknown_key(name, source, fields))
    return out


SHOWN_CHARS = 80  # of a refused value in its error line (MaxText's logical_axis_rules runs to 4,000)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS - 3]}..."


def unknown_key(name: str, source: str, fields: Mapping[str, Any]) -> str:
    """The error line for an unknown key: its 3 closest keys (an alias shows the key it stands for)."""
    named = [*fields, *ALIASES, *(k for k, (choices, _) in ACCEPTED.items() if choices is not ANY)]
    close = difflib.get_close_matches(name.lower().lstrip("-"), named, n=3, cutoff=0.5)
    shown = [f"{c} (= {ALIASES[c][0]})" if c in ALIASES else c for c in close]
    hint = f"; did you mean {', '.join(shown)}?" if close else "; see configs/base.yml for every key"
    return f"unknown config key {name!r} in {source}{hint}"


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)
