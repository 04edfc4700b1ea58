"""MaxText's keys for features Tessera does not implement (`REFUSED`, one group of those
`tessera.config.maxtext` sorts MaxText's keys into): a value that leaves the feature off (MaxText's
default) is accepted and logged; any other is refused with what the key does in MaxText and what to
use in Tessera. getting_started/Coming_from_MaxText.md names every one (a test keeps it so). This
module imports nothing from JAX."""

from __future__ import annotations

from dataclasses import dataclass


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
    "shard_mode": Refused("JAX's sharding mode; MaxText's explicit types every array with its sharding (jax's "
                          "explicit mode); Tessera's model runs in auto mode, MaxText's default, where the compiler "
                          "places what the annotations leave open", ("auto",)),
    "context_parallel_strategy": Refused(
        "how the sequence (context) axis shares keys and values: ring passes them from device to device, ulysses "
        "and usp split the heads instead; Tessera's ici_sequence_parallelism gathers them along the axis (MaxText's "
        "all_gather, its default)", ("all_gather",)),
    "subslice_shape": Refused("a part of a TPU slice under Pathways; Tessera uses every device JAX sees", ("",)),
    "custom_mesh": Refused("a hand-made device order for some TPU slices; Tessera uses JAX's device mesh", ("",)),
    # pipeline parallelism
    "pipeline_parallel_layers": Refused("layers run by the pipeline" + _PIPE, ("-1",)),
    "scan_pipeline_iterations": Refused("scan over pipeline iterations; Tessera's pipeline schedule is always a "
                                        "scan (scan_layers decides whether a stage scans its layers)", ("true", "1")),
    # optimizer
    "param_memory_host_offload": Refused("keep parameters in host memory; not in Tessera", ("false", "0")),
    "parameter_memory_host_offload": Refused("keep parameters in host memory (MaxText's newer name of "
                                             "param_memory_host_offload); not in Tessera", ("false", "0")),
    # model variants
    "use_tokamax_gmm": Refused("the experts' grouped matmul from the Tokamax library; Tessera's is megablox's Pallas "
                               "kernel (megablox=true, on TPUs) or jax.lax.ragged_dot", ("false", "0")),
    "use_tokamax_splash": Refused("splash attention from the Tokamax library; Tessera's attention=flash runs JAX's "
                                  "Pallas splash attention", ("false", "0")),
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
    "save_checkpoint_on_completion": Refused(
        "false skips the save after the last step; Tessera saves after the last step whenever enable_checkpointing "
        "is true: give enable_checkpointing=false to save none", ("true", "1")),
    "checkpoint_storage_concurrent_gb": Refused(
        "how many GB Orbax reads or writes at once (more: faster for large models, more host memory); Tessera's is "
        "96, MaxText's default", ("96",)),
    "checkpoint_storage_use_ocdbt": Refused("Orbax's OCDBT storage; Tessera uses Orbax's defaults", ("true", "1")),
    "checkpoint_storage_use_zarr3": Refused("Orbax's zarr3 storage; Tessera uses Orbax's defaults", ("true", "1")),
    "enable_checkpoint_cloud_logger": Refused("log checkpoint events to Cloud Logging" + _GCP, ("false", "0")),
    "enable_checkpoint_standard_logger": Refused("log checkpoint events as JSON" + _GCP, ("false", "0")),
    # ahead-of-time compilation
    # metrics, profiling and cloud services
    "save_config_to_gcs": Refused("write the config to GCS; Tessera logs the changed keys at start-up",
                                  ("false", "0")),
    "upload_all_profiler_results": Refused(
        "trace every host, not host 0 alone, and upload the traces; Tessera's profiler traces every process, each "
        "into profile/process_<i>/ of its local run folder, and uploads none: leave the key out and copy the "
        "traces from each host", ("false", "0")),
    "use_vertex_tensorboard": Refused("Vertex AI TensorBoard" + _GCP, ("false", "0")),
    "vertex_tensorboard_project": Refused("Vertex AI TensorBoard project" + _GCP, ("",)),
    "vertex_tensorboard_region": Refused("Vertex AI TensorBoard region" + _GCP, ("",)),
    "enable_goodput_recording": Refused("record goodput with Google's ml-goodput library; Tessera's report.json "
                                        "has the run's goodput and where its time went (`time`), and the last "
                                        "log line before `done:` says it" + _GCP, ("false", "0")),
    "enable_pathways_goodput": Refused("goodput of a Pathways run" + _GCP, ("false", "0")),
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
