"""Keys set away from their defaults that a run does not read: each gets one warning line at
set-up (`keys_without_effect`), where they used to be accepted without a word. They are not
errors: the value is valid, only this run's other keys leave it unused."""

from __future__ import annotations

from tessera.config.layers import llama4_nope, mlp_dim_unused
from tessera.config.schema import Config


PIPELINE_KEYS = ("num_pipeline_microbatches", "num_pipeline_repeats", "num_layers_per_pipeline_stage",
                 "pipeline_delay_activation_forwarding")
# the keys that name training data: with dataset_type=synthetic (Tessera's default; MaxText's is tfds, so a MaxText
# command with dataset_path and dataset_name but no dataset_type) the run trained on random tokens without a word
DATA_KEYS = ("dataset_name", "dataset_path", "hf_path", "hf_train_files", "grain_train_files")
# every data key and the dataset_type values whose input pipeline reads it (tessera.data): another pipeline's keys
# (dataset_type=hf with grain_eval_files, data_shuffle_seed with hf, which does not shuffle) were ignored silently
DATA_KEY_READERS = {
    **dict.fromkeys(("hf_path", "hf_train_files", "hf_eval_files", "hf_streaming"), ("hf",)),
    **dict.fromkeys(("dataset_name", "dataset_path", "eval_dataset_name"), ("tfds",)),
    **dict.fromkeys(("grain_train_files", "grain_eval_files", "grain_file_type"), ("grain",)),
    "grain_worker_count": ("grain", "tfds"),
    **dict.fromkeys(("train_split", "eval_split"), ("hf", "tfds")),
    "data_shuffle_seed": ("synthetic", "grain", "tfds"),
    **dict.fromkeys(("train_data_columns", "tokenizer_path", "tokenizer_type", "add_bos", "add_eos", "packing"),
                    ("hf", "grain", "tfds")),
}
CHECKPOINT_KEYS = ("checkpoint_period", "max_num_checkpoints_to_keep", "async_checkpointing")
TILE_KEYS = ("tile_batch_seq", "tile_activation_dim", "tile_weight_dim")
WSD_KEYS = ("wsd_decay_steps_fraction", "wsd_decay_style")
MOE_KEYS = ("sparse_matmul", "megablox", "capacity_factor", *TILE_KEYS)


def keys_without_effect(cfg: Config, mesh_shape: dict[str, int]) -> list[str]:
    """One line per key set away from its default that this run does not read (a typo of intent:
    per-tensor remat keys without remat_policy=custom, pipeline keys on a mesh without stages (and
    pipeline_fsdp_ag_once on one without fsdp, shard_optimizer_over_data on one without data), MoE
    routing keys on a dense model, a sequence or expert axis that does not divide what it would
    split, another input pipeline's data keys, checkpoint keys without checkpoints, HLO dump keys
    without the dump), for a warning at set-up; they were accepted without a word."""
    from tessera.config.loader import changed_keys
    from tessera.config.fields import REMAT_TENSORS

    changed = changed_keys(cfg)
    lines = []
    if not cfg.data.eval_interval and (keys := [k for k in ("eval_steps", "eval_per_device_batch_size") if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect, this run never evaluates (eval_interval=N evaluates every "
                     "N steps)")
    lines += _data_keys(cfg.data.dataset_type, changed)
    if not cfg.checkpoint.enable_checkpointing and (keys := [k for k in CHECKPOINT_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect with enable_checkpointing=false, which saves no checkpoint")
    if not cfg.profiler.profiler and (keys := [k for k in ("skip_first_n_steps_for_profiler", "profiler_steps")
                                               if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect without profiler=xplane")
    lines += _hlo_dump_keys(cfg.profiler, changed)
    if not cfg.gpu.enable_pgle and "pgle_profiling_runs" in changed:
        lines.append(f"pgle_profiling_runs={changed['pgle_profiling_runs']}: no effect without enable_pgle=true (JAX's "
                     "automatic PGLE, which it sizes)")
    if "gcs_metrics" in changed and cfg.run.gcs_metrics and "://" not in cfg.run.base_output_directory:
        lines.append("gcs_metrics=true: no effect with a local base_output_directory (metrics.jsonl in the run "
                     "folder holds every record)")
    lines += _mesh_keys(cfg, mesh_shape, changed)
    if cfg.model.remat_policy != "custom" and (keys := [k for k in REMAT_TENSORS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect with remat_policy={cfg.model.remat_policy}; the per-tensor "
                     "keys are read with remat_policy=custom")
    if cfg.model.num_experts <= 1 and (keys := [k for k in MOE_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect on a dense model (num_experts=1); they route a mixture of "
                     "experts")
    elif not cfg.model.megablox and (keys := [k for k in TILE_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect without megablox=true; they size the tiles of the Pallas "
                     "megablox kernel's grouped matmuls (TPUs), which this run's experts do not use")
    elif cfg.model.quantization and (keys := [k for k in TILE_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect with quantization={cfg.model.quantization}, whose experts "
                     "run qwix's quantized ragged dot instead of the Pallas megablox kernel these tiles size")
    lines += _family_keys(cfg.model, changed)
    lines += _quantized_logits(cfg.model)
    lines += _optimizer_and_decoding_keys(cfg, changed)
    return lines


def _mesh_keys(cfg: Config, mesh_shape: dict[str, int], changed: dict) -> list[str]:
    """Keys (and axes) this mesh leaves without effect: pipeline keys without stages, fsdp and data sharding
    keys without those axes, sequence and expert axes that do not divide what they would split."""
    lines = []
    if mesh_shape.get("stage", 1) == 1 and (keys := [k for k in PIPELINE_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect, this mesh has no pipeline stages (ici_pipeline_parallelism "
                     "or dcn_pipeline_parallelism above 1 makes them)")
    if mesh_shape.get("stage", 1) > 1 and mesh_shape.get("fsdp", 1) == 1 and cfg.mesh.pipeline_fsdp_ag_once:
        lines.append("pipeline_fsdp_ag_once=true: no effect, this mesh has no fsdp axis (ici_fsdp_parallelism x "
                     "dcn_fsdp_parallelism is 1), so a stage's weights are not split over one to gather")
    if cfg.optim.shard_optimizer_over_data and mesh_shape.get("data", 1) == 1:
        lines.append("shard_optimizer_over_data=true: no effect, this mesh has no data axis (ici_data_parallelism x "
                     "dcn_data_parallelism is 1); the optimizer state is split with the weights already")
    seq, length = mesh_shape.get("sequence", 1), cfg.data.max_target_length
    if seq > 1 and length % seq:  # mesh.logical_spec drops an axis that does not divide the dimension
        lines.append(f"the sequence axis ({seq} ways) does not divide max_target_length={length}: the tokens are not "
                     f"split over it, and its devices repeat each other's work; choose a length {seq} divides")
    experts, ways = cfg.model.num_experts, mesh_shape.get("expert", 1)
    if ways > 1 and experts > 1 and experts % ways:
        lines.append(f"the expert axis ({ways} ways) does not divide num_experts={experts}: the experts are not "
                     "split over it (it splits their weights like fsdp instead); choose an expert parallelism that "
                     "divides num_experts")
    dropless = cfg.model.sparse_matmul or cfg.model.megablox
    if experts > 1 and dropless and ways == 1 and "ragged_buffer_factor" in changed:  # no exchange, no buffer
        lines.append(f"{_listed(['ragged_buffer_factor'], changed)}: no effect without an expert axis "
                     "(ici_expert_parallelism x dcn_expert_parallelism is 1); it sizes the buffer an expert shard "
                     "receives token copies into, and here every device runs all the experts on its own copies")
    return lines


def _hlo_dump_keys(p, changed: dict) -> list[str]:
    """keys_without_effect's line for the dump_hlo_* keys without dump_hlo=true, or beside dump_hlo_xla_flags."""
    dump = ("dump_hlo_local_dir", "dump_hlo_module_name") + (("dump_hlo_xla_flags",) if not p.dump_hlo else ())
    if (p.dump_hlo and not p.dump_hlo_xla_flags) or not (keys := [k for k in dump if k in changed]):
        return []
    why = "without dump_hlo=true" if not p.dump_hlo else ("beside dump_hlo_xla_flags, whose flags XLA is given "
                                                         "instead of the dump folder and program filter")
    return [f"{_listed(keys, changed)}: no effect {why}"]


def _data_keys(dataset_type: str, changed: dict) -> list[str]:
    """keys_without_effect's lines for data keys that the input pipeline of `dataset_type` does not read."""
    unread = [k for k, readers in DATA_KEY_READERS.items() if k in changed and dataset_type not in readers]
    if not unread:
        return []
    if dataset_type == "synthetic":
        named, rest = [k for k in DATA_KEYS if k in unread], [k for k in unread if k not in DATA_KEYS]
        lines = [f"{_listed(named, changed)}: no effect with dataset_type=synthetic (Tessera's default; MaxText's is "
                 "tfds), which trains on random tokens; set dataset_type=tfds, hf or grain to read that data"]
        return lines * bool(named) + [f"{_listed(rest, changed)}: no effect with dataset_type=synthetic, whose random "
                                      "tokens need no files, tokenizer or documents"] * bool(rest)
    by_readers: dict[tuple[str, ...], list[str]] = {}
    for k in unread:
        by_readers.setdefault(DATA_KEY_READERS[k], []).append(k)
    readers = "; ".join(f"{' and '.join(keys)} {'is' if len(keys) == 1 else 'are'} read with dataset_type="
                        f"{' or '.join(types)}" for types, keys in by_readers.items())
    return [f"{_listed(unread, changed)}: no effect with dataset_type={dataset_type} ({readers})"]


def _quantized_logits(m) -> list[str]:
    """logits_dot_in_fp32=true with quantization=fp8_full, which multiplies the output logits in float8
    all the same (the float32 operands are quantized): the two keys ask for opposite things."""
    if m.quantization != "fp8_full" or not m.logits_dot_in_fp32 or m.logits_via_embedding:
        return []
    return ["logits_dot_in_fp32=true: the output logits' product still runs in float8 with quantization=fp8_full "
            "(its float32 operands are quantized first); quantization=fp8 leaves that product unquantized, in float32 "
            "with logits_dot_in_fp32=true"]


YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "rope_truncate")
EXPERT_KEYS = ("shared_experts", "base_moe_mlp_dim", "routed_score_func", "routed_scaling_factor", "routed_bias",
               "routed_bias_update_rate", "n_routing_groups", "topk_routing_group", "routing_group_score",
               "norm_topk_prob", "ragged_buffer_factor", "load_balance_loss_weight")
TEMPERATURE_KEYS = ("temperature_tuning_scale", "temperature_tuning_floor_scale")
LLAMA3_ROPE_KEYS = ("rope_low_freq_factor", "rope_high_freq_factor")
ROPE_KEYS = ("rope_max_timescale", "rope_scaling", "rope_scaling_factor", "rope_original_max_position", *YARN_KEYS,
             *LLAMA3_ROPE_KEYS)
GDN_KEYS = ("gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim", "gdn_value_head_dim", "gdn_conv_kernel_dim",
            "gdn_chunk_size", "gdn_kernel")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _family_keys(m, changed: dict) -> list[str]:
    """Model keys only some families or rotary scalings read, set for a model that does not read them."""
    lines = []
    if "trainable_position_size" in changed and m.decoder_block != "gpt3":
        lines.append(f"{_listed(['trainable_position_size'], changed)}: no effect, decoder_block={m.decoder_block} "
                     "rotates its queries and keys; only decoder_block=gpt3 learns a position table")
    if "local_rope_max_timescale" in changed and m.decoder_block not in ("gemma3", "olmo3"):
        lines.append(f"{_listed(['local_rope_max_timescale'], changed)}: no effect, it is the rotary theta of the "
                     f"local layers of decoder_block=gemma3 and olmo3; decoder_block={m.decoder_block} uses "
                     "rope_max_timescale")
    if m.decoder_block != "qwen3_next" and (keys := [k for k in GDN_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect, they size the Gated DeltaNet layers of "
                     f"decoder_block=qwen3_next; decoder_block={m.decoder_block} has none")
    if m.num_experts <= 1 and (keys := [k for k in EXPERT_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect on a dense model (num_experts=1), whose MLP is "
                     "base_mlp_dim wide; they size or route a mixture of experts")
    elif m.num_experts > 1:
        # (llama4's files keep base_mlp_dim for the Hugging Face config's intermediate_size_mlp)
        if mlp_dim_unused(m) and "base_mlp_dim" in changed and m.decoder_block != "llama4":
            lines.append(f"{_listed(['base_mlp_dim'], changed)}: no effect, every layer's MLP is experts of "
                         f"base_moe_mlp_dim={m.base_moe_mlp_dim}; base_mlp_dim sizes only dense layers "
                         "(deepseek's first_num_dense_layers, llama4's between its expert layers)")
        if not m.routed_bias and "routed_bias_update_rate" in changed:
            lines.append(f"{_listed(['routed_bias_update_rate'], changed)}: no effect without routed_bias=true")
        if m.n_routing_groups <= 1 and (keys := [k for k in ("topk_routing_group", "routing_group_score")
                                                 if k in changed]):
            lines.append(f"{_listed(keys, changed)}: no effect without n_routing_groups (above 1)")
        if not (m.sparse_matmul or m.megablox) and "ragged_buffer_factor" in changed:
            lines.append(f"{_listed(['ragged_buffer_factor'], changed)}: no effect with capacity routing; it sizes "
                         "dropless routing's buffer (sparse_matmul=true or megablox=true)")
    if m.decoder_block == "gpt3" and (keys := [k for k in ("attention_bias", "mlp_bias") if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect, decoder_block=gpt3 always has biases on its attention "
                     "and MLP projections")
    if m.decoder_block != "deepseek" and (keys := [k for k in MLA_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect, they size decoder_block=deepseek's latent attention (MLA); "
                     f"decoder_block={m.decoder_block}'s heads are head_dim={m.head_dim} wide")
    if m.decoder_block == "deepseek" and m.num_kv_heads != m.num_query_heads:  # the model files set them equal
        lines.append(f"base_num_kv_heads={m.base_num_kv_heads}: no effect, decoder_block=deepseek's latent attention "
                     f"(MLA) derives a key and a value for each of its {m.num_query_heads} query heads from one latent "
                     "per token; set base_num_kv_heads to base_num_query_heads")
    lines += _llama4_pattern_keys(m)
    if not m.temperature_tuning and (keys := [k for k in TEMPERATURE_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect without temperature_tuning=true (decoder_block=llama4)")
    if not m.mtp_num_layers and "mtp_loss_scaling_factor" in changed:
        lines.append(f"{_listed(['mtp_loss_scaling_factor'], changed)}: no effect without mtp_num_layers (above 0)")
    if m.decoder_block == "gpt3" and (keys := [k for k in ROPE_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect, decoder_block=gpt3 adds position embeddings and has no "
                     "rotary embedding")
    else:
        unread = [k for k in YARN_KEYS if k in changed and m.rope_scaling != "yarn"] + \
            [k for k in ("rope_scaling_factor",) if k in changed and m.rope_scaling == "none"] + \
            [k for k in ("rope_original_max_position",) if k in changed and m.rope_scaling in ("none", "linear")] + \
            [k for k in LLAMA3_ROPE_KEYS if k in changed and m.rope_scaling != "llama3"]
        if unread:
            lines.append(f"{_listed(unread, changed)}: no effect with rope_scaling={m.rope_scaling}")
    return lines


def _llama4_pattern_keys(m) -> list[str]:
    """Llama 4's keys that act on one kind of its layers, with nope_layer_interval leaving none of that kind:
    temperature_tuning scales the NoPE layers' queries, use_qk_norm and chunk_attn_window_size act on the
    rotary layers."""
    if m.decoder_block != "llama4":
        return []
    nope = sum(llama4_nope(m, j) for j in range(4))
    if m.temperature_tuning and not nope:
        return ["temperature_tuning=True: no effect, nope_layer_interval=0 leaves no layer without rotary positions, "
                "whose queries it scales; set nope_layer_interval (Llama 4: 4) or temperature_tuning=false"]
    rotary = [f"{k}={getattr(m, k)}" for k in ("use_qk_norm", "chunk_attn_window_size") if getattr(m, k)]
    if nope == 4 and rotary:
        return [f"{', '.join(rotary)}: no effect, nope_layer_interval=1 makes every layer a layer without rotary "
                "positions, and they act on the rotary layers only; set nope_layer_interval=4 (Llama 4) or leave "
                "them at their defaults"]
    return []


def decoding_keys_without_effect(cfg: Config) -> list[str]:
    """`keys_without_effect` for decode.py, which logged none of them: the model keys its model does
    not read, the KV cache's quantization keys without quantize_kvcache=true (`kv_quant_dtype=int4`
    alone decoded with a float cache) and kv_quant_axis where a slot holds one kv head,
    logits_dot_in_fp32 under fp8_full, compile_topology (train_compile's: decode.py runs on the
    devices it finds), capacity routing, whose decoding steps drop no token, ragged_buffer_factor, whose
    bound decoding lifts (decode.decoding_model), and load_full_state_path
    beside load_parameters_path (training refuses the pair)."""
    from tessera.config.loader import changed_keys

    changed, m = changed_keys(cfg), cfg.model
    lines = _family_keys(m, changed) + _quantized_logits(m)
    if m.num_experts <= 1 and (keys := [k for k in MOE_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect on a dense model (num_experts=1); they route a mixture of "
                     "experts")
    elif m.num_experts > 1 and m.capacity_factor > 0 and not (m.sparse_matmul or m.megablox):
        lines.append(f"capacity_factor={m.capacity_factor:g}: a decoding step routes one token per prompt, so none is "
                     "dropped and the tokens can differ from a forward pass over the whole sequence (Decode.md, "
                     "Limitations); capacity_factor=-1 or sparse_matmul=true route without dropping")
    if m.num_experts > 1 and (m.sparse_matmul or m.megablox) and m.ragged_buffer_factor > 0:
        lines.append(f"ragged_buffer_factor={m.ragged_buffer_factor:g}: no effect, decoding gives each expert shard "
                     "room for every token copy, so that none is dropped (a bounded buffer saves training memory)")
    if not m.quantize_kvcache and (keys := [k for k in ("kv_quant_dtype", "kv_quant_axis") if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect without quantize_kvcache=true; the KV cache is stored in "
                     f"dtype={m.dtype}")
    elif m.quantize_kvcache and "kv_quant_axis" in changed and (m.decoder_block == "deepseek" or m.num_kv_heads == 1):
        heads = "MLA caches one latent per token" if m.decoder_block == "deepseek" else "num_kv_heads is 1"
        lines.append(f"kv_quant_axis={m.kv_quant_axis}: no effect, {heads}: one scale per slot either way")
    if cfg.compile.compile_topology:
        lines.append(f"compile_topology={cfg.compile.compile_topology}: no effect, decode.py decodes on the devices "
                     "it finds (tessera.train_compile compiles training ahead of time for a slice)")
    ckpt = cfg.checkpoint
    if ckpt.load_parameters_path and ckpt.load_full_state_path not in ("", ckpt.load_parameters_path):
        lines.append(f"load_full_state_path={ckpt.load_full_state_path}: no effect, decode.py decodes the parameters "
                     f"of load_parameters_path={ckpt.load_parameters_path}; give that path as load_parameters_path to "
                     "decode it")
    return lines


ADAM_KEYS = ("adam_b1", "adam_b2", "adam_eps", "adam_eps_root", "adam_weight_decay", "adamw_mask")  # muon's AdamW part reads them too
MUON_KEYS = ("muon_beta", "muon_weight_decay", "muon_consistent_rms")


def _optimizer_and_decoding_keys(cfg: Config, changed: dict) -> list[str]:
    """keys_without_effect's lines for the other optimizers' keys, the other schedule's keys (and the final fraction
    of a WSD schedule that never decays), and decoding keys in training."""
    lines, opt = [], cfg.optim.opt_type
    if not cfg.optim.skip_step_on_spikes and (keys := [k for k in ("skip_step_interval", "skip_step_scaling_factor")
                                                       if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect without skip_step_on_spikes=true")
    if cfg.optim.lr_schedule_type != "wsd" and (keys := [k for k in WSD_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect with lr_schedule_type={cfg.optim.lr_schedule_type}; they "
                     "shape lr_schedule_type=wsd's decay")
    elif (cfg.optim.lr_schedule_type == "wsd" and cfg.optim.wsd_decay_steps_fraction == 0
          and "cosine_learning_rate_final_fraction" in changed):
        lines.append(f"{_listed(['cosine_learning_rate_final_fraction'], changed)}: no effect with "
                     "wsd_decay_steps_fraction=0, whose schedule holds the peak to its end and never decays")
    if opt == "sgd" and (keys := [k for k in ADAM_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect with opt_type=sgd (plain SGD: no moments, no weight decay)")
    if opt != "muon" and (keys := [k for k in MUON_KEYS if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect with opt_type={opt}; they are read with opt_type=muon")
    if not cfg.model.quantize_kvcache and (keys := [k for k in ("kv_quant_dtype", "kv_quant_axis") if k in changed]):
        lines.append(f"{_listed(keys, changed)}: no effect without quantize_kvcache=true (and only in decoding)")
    elif cfg.model.quantize_kvcache and "quantize_kvcache" in changed:
        more = "".join(f", {_listed([k], changed)}" for k in ("kv_quant_dtype", "kv_quant_axis") if k in changed)
        lines.append(f"quantize_kvcache=true{more}: no effect on training, which keeps no KV cache; decode.py stores "
                     "its cache quantized (`quantization` quantizes the training matmuls)")
    if "save_quantized_params_path" in changed:
        lines.append("save_quantized_params_path: no effect on training; decode.py writes the loaded weights quantized "
                     "there (checkpoints of a run with `quantization` hold them in weight_dtype)")
    return lines


def attention_keys_without_effect(cfg: Config, kernel: str, mesh_shape: dict[str, int]) -> list[str]:
    """Lines for splash attention's keys (sa_*, context_parallel_load_balance) that the run's
    attention kernel (`select_attention`'s pick) does not read: all of them with another kernel than
    splash (a TPU recipe's tiles on a GPU), the dQ kernel's blocks with sa_use_fused_bwd_kernel=true
    (one backward kernel, whose blocks are the dK/dV ones), and the load balance without a sequence
    axis. They were accepted without a word."""
    from tessera.config.loader import changed_keys

    changed = changed_keys(cfg)
    names = [k for k in changed if k.startswith("sa_") or k == "context_parallel_load_balance"]
    if not kernel.startswith("splash"):
        return [f"{_listed(names, changed)}: no effect, this run's attention kernel is {kernel}; they tune Pallas "
                "splash attention, the TPU kernel of attention=flash or autoselected"] if names else []
    lines = []
    if cfg.model.sa_use_fused_bwd_kernel and (dq := [k for k in ("sa_block_q_dq", "sa_block_kv_dq") if k in names]):
        lines.append(f"{_listed(dq, changed)}: no effect with sa_use_fused_bwd_kernel=true, whose one backward kernel "
                     "computes dQ with dK and dV in the dK/dV kernel's blocks (sa_block_q_dkv, sa_block_kv_dkv)")
    if "context_parallel_load_balance" in names and mesh_shape.get("sequence", 1) == 1:
        lines.append("context_parallel_load_balance=false: no effect without a sequence axis (ici_sequence_parallelism "
                     "x dcn_sequence_parallelism is 1), whose parts it balances")
    return lines


def _listed(keys: list[str], values: dict) -> str:
    return ", ".join(f"{k}={values[k]}" for k in keys)

