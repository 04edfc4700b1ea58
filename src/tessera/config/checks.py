"""Checks of a config that involve more than one key, or a model that is to be built.

Single-key checks (types, ranges, choices) happen while values are coerced (`values.coerce`);
`validate` runs on every loaded config, `validate_for_build` only where a model is built from it,
`check_trainable_dtypes` where a step is set up for training (or planned). Keys that are valid
but have no effect in a run are warned of by `tessera.config.unread_keys`.
"""

from __future__ import annotations

import math
import re

from tessera.config.family_checks import validate_family
from tessera.config.fields import MOE_BLOCKS
from tessera.config.schema import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig


def validate(cfg: Config) -> None:
    """Checks that involve more than one key (single-key checks happen in `values.coerce`)."""
    from tessera.config.fields import ACTIVATIONS

    m = cfg.model
    scale = m.global_parameter_scale
    if scale & (scale - 1):
        raise ConfigError(f"global_parameter_scale={scale} must be a power of two (1, 2, 4, ..., 128, ...)")
    _validate_scaled_sizes(m)
    if m.num_query_heads % m.num_kv_heads:
        raise ConfigError(
            f"query heads ({m.num_query_heads}) must be a multiple of kv heads ({m.num_kv_heads}); "
            "change base_num_query_heads or base_num_kv_heads"
        )
    if not 1 <= len(m.mlp_activations) <= 2 or any(a not in ACTIVATIONS for a in m.mlp_activations):
        raise ConfigError(
            f"mlp_activations={m.mlp_activations} must be one or two of {', '.join(ACTIVATIONS)} "
            "(two make a gated MLP, e.g. [\"silu\",\"linear\"])"
        )
    if cfg.mesh.num_slices == 0:
        raise ConfigError("num_slices=0: give the number of slices (1 or more), or -1 to detect it from the devices")
    if not 0.0 <= m.dropout_rate < 1.0:  # with enable_dropout=false too: the value is wrong either way
        raise ConfigError(f"dropout_rate={m.dropout_rate} must be in [0, 1): the probability that a value is dropped")
    _validate_rope_scaling(m)
    if m.num_experts_per_tok > m.num_experts:
        raise ConfigError(f"num_experts_per_tok={m.num_experts_per_tok} is more than num_experts={m.num_experts}; "
                          "a token cannot be routed to more experts than there are")
    tiles = {n: getattr(m, n) for n in ("tile_batch_seq", "tile_activation_dim", "tile_weight_dim")}
    if any(v % 128 for v in tiles.values()):
        raise ConfigError(", ".join(f"{n}={v}" for n, v in tiles.items() if v % 128) + " must be a multiple of 128 "
                          "(the TPU's lane width: the Pallas grouped matmul's tiles are whole lanes), e.g. 512 or 1024")
    if m.head_dim % 2:
        raise ConfigError(f"head_dim={m.head_dim} must be even (rotary embeddings rotate pairs)")
    validate_family(m)
    _validate_mesh(cfg.mesh)
    if cfg.data.per_device_batch_size <= 0:
        raise ConfigError(f"per_device_batch_size={cfg.data.per_device_batch_size:g} must be > 0 (a fraction such as "
                          "0.5 is allowed: a global batch of fewer sequences than devices)")
    if cfg.checkpoint.save_quantized_params_path and not cfg.model.quantization:
        raise ConfigError("save_quantized_params_path needs quantization=int8, fp8, fp8_full or nanoo_fp8 (the stored "
                          "type)")
    if cfg.checkpoint.checkpoint_is_quantized and not (cfg.model.quantization and cfg.checkpoint.load_parameters_path):
        raise ConfigError("checkpoint_is_quantized=true needs load_parameters_path=<the quantized checkpoint> and the "
                          "quantization=int8|fp8|fp8_full|nanoo_fp8 it was written with")
    _validate_optim(cfg.optim)
    keep = cfg.checkpoint.max_num_checkpoints_to_keep
    if keep == 0 or keep < -1:
        raise ConfigError(f"max_num_checkpoints_to_keep={keep} is not allowed; use -1 to keep every checkpoint, "
                          "or N >= 1 to keep the newest N")
    fraction = cfg.compile.compile_hbm_budget_fraction
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"compile_hbm_budget_fraction={fraction:g} must be in (0, 1]: the share of a chip's HBM the "
                          "compiled step may use, e.g. 0.95")
    _validate_run_name(cfg.run.run_name)
    _validate_eval(cfg.data)
    _validate_vocab_tiling(cfg)
    _validate_mtp(cfg)
    _validate_offload(cfg)


def _validate_mesh(mesh: MeshConfig) -> None:
    """The parallelism sizes: one -1 (fill) per ici/dcn group at most, none zero, the stage count chosen."""
    for prefix in ("ici", "dcn"):
        values = {n: getattr(mesh, n) for n in vars(mesh) if n.startswith(prefix)}
        fills = [n for n, v in values.items() if v == -1]
        if len(fills) > 1:
            named = " and ".join(fills) if len(fills) == 2 else f"{', '.join(fills[:-1])} and {fills[-1]}"
            left = "devices left in a slice" if prefix == "ici" else "slices left"
            raise ConfigError(f"only one {prefix}_*_parallelism may be -1 (the axis that takes the {left}), but "
                              f"{named} {'both' if len(fills) == 2 else 'all'} are; give the others a size")
        for n, v in values.items():
            if v == 0 or v < -1:
                raise ConfigError(f"{n}={v} must be a positive integer or -1 (fill from device count)")
    for n in ("ici_pipeline_parallelism", "dcn_pipeline_parallelism"):
        if getattr(mesh, n) == -1:
            raise ConfigError(f"{n} cannot be -1: the stage count must be chosen (1: no pipelining)")
    for n in ("num_pipeline_microbatches", "num_pipeline_repeats", "num_layers_per_pipeline_stage"):
        if getattr(mesh, n) == 0 or getattr(mesh, n) < -1:
            raise ConfigError(f"{n}={getattr(mesh, n)} must be a positive integer or -1 (derived)")


def _validate_optim(optim: OptimConfig) -> None:
    """The optimizer's decays below 1, AdamW's epsilon above 0, a WSD schedule's warm-up and decay within it, a
    learning-rate schedule of at least one step."""
    for name in ("adam_b1", "adam_b2", "muon_beta"):
        beta = getattr(optim, name)
        if beta >= 1.0:
            what = ("Muon's momentum decay (1 would never update it)" if name == "muon_beta" else "AdamW's decay "
                    "of a moment average (1 would never update it, and the bias correction would divide by zero)")
            raise ConfigError(f"{name}={beta:g} must be below 1: it is {what}; e.g. 0.9 or 0.95")
    if optim.adam_eps <= 0.0:  # optax's adamw divides by sqrt(v) + eps, with nothing inside the root
        raise ConfigError(f"adam_eps={optim.adam_eps:g} must be above 0: AdamW divides each update by sqrt(v) + "
                          "adam_eps, and a parameter whose gradient is zero (the embedding rows of tokens not in the "
                          "batch) would get 0 / 0 = NaN at the first step; e.g. 1e-8")
    if optim.lr_schedule_type == "wsd" and optim.warmup_steps_fraction + optim.wsd_decay_steps_fraction > 1 + 1e-9:
        raise ConfigError(f"warmup_steps_fraction={optim.warmup_steps_fraction:g} + wsd_decay_steps_fraction="
                          f"{optim.wsd_decay_steps_fraction:g} is more than the whole schedule: lr_schedule_type=wsd "
                          "warms up over the first fraction of learning_rate_schedule_steps and decays over the last; "
                          "lower one of them so that they add up to 1 at most")
    for name in ("adamw_mask", "trainable_parameters_mask"):
        for pattern in getattr(optim, name):
            try:
                re.compile(str(pattern))
            except re.error as e:
                raise ConfigError(f"{name}: {pattern!r} is not a regular expression ({e}); e.g. {name}="
                                  "\"['token_embedder', 'bias']\"") from None
    if optim.trainable_parameters_mask and optim.opt_type == "muon":
        raise ConfigError("trainable_parameters_mask with opt_type=muon is not supported (Muon splits the parameters "
                          "between its two parts already); use opt_type=adamw or sgd to train part of the model")
    schedule = optim.learning_rate_schedule_steps  # optim.learning_rate_schedule refuses it too, at set-up
    if schedule == 0 or schedule < -1:
        raise ConfigError(f"learning_rate_schedule_steps={schedule} gives a learning-rate schedule of no steps (its "
                          "rate would drop to the final value after step 0); set it to -1 (as long as steps) or >= 1")


def _validate_scaled_sizes(m: ModelConfig) -> None:
    """The sizes global_parameter_scale makes stay within what the base_* keys may hold: the layer
    count within MAX_LAYERS (the scale took 4 layers to 4 million, and listing the layers' windows
    exhausted the host's memory), and each weight within MAX_WEIGHT_ELEMENTS (beyond, compiling the
    initialization raised a traceback, "overflow in static extent product", or aborted in XLA)."""
    from tessera.config.fields import MAX_LAYERS, MAX_WEIGHT_ELEMENTS

    sizes = (f"base_num_decoder_layers={m.base_num_decoder_layers} and global_parameter_scale="
             f"{m.global_parameter_scale}")
    if m.num_decoder_layers > MAX_LAYERS:
        raise ConfigError(f"{sizes} make {m.num_decoder_layers:,} decoder layers, more than the {MAX_LAYERS:,} a "
                          "model may have (the deepest model file has 126); lower global_parameter_scale or "
                          "base_num_decoder_layers")
    weights = _largest_weights(m)
    elements = {what: math.prod(size for _, size, _ in dims) for what, dims in weights.items()}
    what = max(elements, key=elements.get)
    if elements[what] > MAX_WEIGHT_ELEMENTS:
        dims = weights[what]
        keys = sorted({k for _, size, k in dims if size > 1}, key=lambda k: -getattr(m, k))
        raise ConfigError(f"{what} [{', '.join(f'{label} {size}' for label, size, _ in dims)}] would hold "
                          f"{elements[what]:.3g} elements, more than the {MAX_WEIGHT_ELEMENTS:.3g} a weight may hold "
                          f"(beyond, compiling overflows XLA's 64-bit byte counts); lower {', '.join(keys)} or "
                          f"global_parameter_scale={m.global_parameter_scale}")


def _largest_weights(m: ModelConfig) -> dict[str, tuple[tuple[str, int, str], ...]]:
    """The weights whose sizes the keys set, each as its dimensions (label, size, the key that sets it):
    the projections of every family, and those only some families build (GPT-3's position table, DeepSeek's
    latent attention, the shared experts), whose keys took a run to a traceback while the model was
    initialized ("random bits array of size exceeding 2 ** 64") when set to 10^19."""
    layers, d = ("layers", m.num_decoder_layers, "base_num_decoder_layers"), ("emb", m.emb_dim, "base_emb_dim")
    heads = ("heads", m.num_query_heads, "base_num_query_heads")
    expert_key = "base_moe_mlp_dim" if m.base_moe_mlp_dim else "base_mlp_dim"
    weights = {"the query projection": (layers, d, heads, ("head_dim", m.head_dim, "head_dim")),
               "the MLP's first projection": (layers, d, ("mlp", m.mlp_dim, "base_mlp_dim")),
               "the experts' first projection": (layers, ("experts", m.num_experts, "num_experts"), d,
                                                 ("mlp", m.expert_mlp_dim, expert_key)),
               "the token embedding": (("vocab", m.vocab_size, "vocab_size"), d)}
    if m.decoder_block == "gpt3":
        weights["the position embedding"] = (("positions", m.trainable_position_size, "trainable_position_size"), d)
    if m.shared_experts:
        weights["the shared experts' first projection"] = (
            layers, d, ("mlp", m.shared_experts * m.expert_mlp_dim, "shared_experts"))
    if m.decoder_block == "deepseek":
        rank, q_rank = ("rank", m.kv_lora_rank, "kv_lora_rank"), ("rank", m.q_lora_rank, "q_lora_rank")
        qk = ("head", m.qk_nope_head_dim + m.qk_rope_head_dim, "qk_nope_head_dim")
        weights |= {"the key/value latent projection": (layers, d, rank),
                    "the key/value up-projection": (layers, rank, heads, ("head", m.qk_nope_head_dim + m.v_head_dim,
                                                                            "v_head_dim")),
                    "the query's low-rank projection": (layers, d, q_rank),
                    "the query's up-projection": (layers, q_rank, heads, qk)}
    return weights


def _validate_rope_scaling(m: ModelConfig) -> None:
    """The rotary scaling's factors: llama3's in order, YaRN's without a division by zero."""
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor < m.rope_low_freq_factor:
        raise ConfigError(f"rope_high_freq_factor={m.rope_high_freq_factor} must be at least "
                          f"rope_low_freq_factor={m.rope_low_freq_factor} with rope_scaling=llama3 (Llama 3.1: 4 and 1; "
                          "Llama 4 Scout: 1 and 1)")
    if m.rope_scaling == "yarn" and m.decoder_block != "gpt3":  # (gpt3 has no rotary embedding: warned, not read)
        _validate_yarn(m)


def _validate_yarn(m: ModelConfig) -> None:
    """YaRN finds the (fractional) dimensions that turn beta_fast and beta_slow times in the original
    context: log(original / (2 pi beta)) / log(theta), which a count of 0 or a theta of 1 divides by
    zero (a ZeroDivisionError traceback when the model was built)."""
    zero = [f"{n}={getattr(m, n):g}" for n in ("beta_fast", "beta_slow") if getattr(m, n) <= 0]
    if zero:
        raise ConfigError(f"{' and '.join(zero)}: rope_scaling=yarn mixes the rotary frequencies between the one "
                          "turning beta_fast times and the one turning beta_slow times in rope_original_max_position "
                          "tokens, and no frequency turns 0 times; give counts above 0 (DeepSeek-V3 and gpt-oss: "
                          "beta_fast=32 beta_slow=1)")
    if m.rope_max_timescale == 1:
        raise ConfigError("rope_max_timescale=1 with rope_scaling=yarn: every rotary frequency is 1 (theta**0), so "
                          "YaRN has no wavelengths to tell apart (it divides by ln(theta) = 0); give a theta above 1 "
                          "(DeepSeek-V3: 10000, gpt-oss: 150000), or rope_scaling=none")


NAME_MAX_BYTES = 255  # the longest file or folder name Linux's and macOS's file systems take (NAME_MAX)


def _validate_run_name(name: str) -> None:
    """The run's folder is base_output_directory/run_name, and the run writes its checkpoints,
    config.yml, metrics and report there: `run_name=..` spread them over the folder above the base
    (the repository root, for the default `outputs`), `.` over the base itself, among the other
    runs' folders, and an absolute path left the base aside. Sub-folders (`sweep1/lr_3e-4`) are fine."""
    where = "its folder is base_output_directory/run_name"
    if name != name.strip():
        raise ConfigError(f"run_name={name!r} starts or ends with white space ({where}); quote the name on the "
                          "command line without the spaces, e.g. run_name=my_run")
    if name.startswith(("/", "\\")) or "://" in name:
        raise ConfigError(f"run_name={name!r} is a path, not a name ({where}): put the folder above it in "
                          "base_output_directory and its last part in run_name")
    if any(part in (".", "..") for part in name.replace("\\", "/").split("/")):
        raise ConfigError(f"run_name={name!r} has a '.' or '..' part, which would put the run's checkpoints and "
                          f"files outside a folder of its own ({where}); use a plain name, e.g. run_name=my_run "
                          "(sub-folders such as sweep1/lr_3e-4 are fine)")
    longest = max(name.split("/"), key=lambda part: len(part.encode()))
    if len(longest.encode()) > NAME_MAX_BYTES:  # the run folder's check said "choose another base_output_directory"
        raise ConfigError(f"run_name={name[:40]!r}... has a folder name of {len(longest.encode())} bytes, and file "
                          f"systems take names of at most {NAME_MAX_BYTES} bytes ({where}); use a shorter run_name "
                          "(sub-folders such as sweep1/lr_3e-4 split a long one)")


def _pipeline_keys(cfg: Config) -> list[str]:
    """The pipeline-parallelism keys set above 1, as key=value (each named in full for the errors)."""
    return [f"{n}={getattr(cfg.mesh, n)}" for n in ("ici_pipeline_parallelism", "dcn_pipeline_parallelism")
            if getattr(cfg.mesh, n) > 1]


def _validate_offload(cfg: Config) -> None:
    """optimizer_memory_host_offload: what its streamed update needs (tessera.optimizer_offload); every problem
    in one message. Whether the devices have pinned host memory is checked at set-up."""
    if not cfg.optim.optimizer_memory_host_offload:
        return
    problems = []
    if cfg.optim.opt_type != "adamw":
        problems.append(f"opt_type={cfg.optim.opt_type} (the streamed update slices the state by layer, which is "
                        "exact for AdamW's element-wise update only; Muon orthogonalizes whole matrices, SGD keeps no "
                        "state): use opt_type=adamw")
    if not cfg.model.scan_layers:
        problems.append("scan_layers=false (the update streams the state one layer of the scanned stack at a time; "
                        "unstacked, it would move in whole and raise the peak): set scan_layers=true")
    staged = _pipeline_keys(cfg)
    if staged:
        problems.append(f"pipeline parallelism ({' and '.join(staged)}: stages split the layer stack across devices, "
                        f"so one layer's slice is not on every device): set "
                        f"{' and '.join(s.split('=')[0] + '=1' for s in staged)}")
    if problems:
        raise ConfigError("optimizer_memory_host_offload=true cannot run with " + "; nor with ".join(problems)
                          + "; or set optimizer_memory_host_offload=false")


def _validate_mtp(cfg: Config) -> None:
    """Multi-token prediction: a family of one layer per block, no pipeline, room in the sequence."""
    from tessera.config.layers import LAYERS_PER_BLOCK
    pattern = {"gemma2": "local and global", "gemma3": "5 local and 1 global", "gpt_oss": "local and global",
               "llama4": "3 chunked rotary and 1 NoPE", "olmo3": "3 local and 1 global",
               "qwen3_next": "3 linear-attention and 1 full-attention"}

    m, depth = cfg.model, cfg.model.mtp_num_layers
    target = m.mtp_eval_target_module
    if target > depth:
        fix = f"it has {depth} (mtp_num_layers); use 1 to {depth}, or 0" if depth else \
            "mtp_num_layers=0 builds none; set mtp_num_layers, or mtp_eval_target_module=0"
        raise ConfigError(f"mtp_eval_target_module={target} names a depth of the model's multi-token prediction, "
                          f"but {fix}")
    if not depth:
        return
    if LAYERS_PER_BLOCK.get(m.decoder_block, 1) != 1:
        raise ConfigError(f"mtp_num_layers={depth}: multi-token prediction adds one decoder layer per depth, but "
                          f"decoder_block={m.decoder_block}'s blocks hold {LAYERS_PER_BLOCK[m.decoder_block]} layers "
                          f"({pattern[m.decoder_block]}); set mtp_num_layers=0")
    staged = _pipeline_keys(cfg)
    if staged:  # each key named in full, so that the error says where the one set was given
        raise ConfigError(f"mtp_num_layers={depth} is not supported with pipeline parallelism ({' and '.join(staged)}: "
                          f"its layers would run after the last stage); set mtp_num_layers=0 or "
                          f"{' and '.join(s.split('=')[0] + '=1' for s in staged)}")
    if depth >= cfg.data.max_target_length:
        raise ConfigError(f"mtp_num_layers={depth} predicts {depth} tokens past the next one, which leaves nothing "
                          f"to predict in a sequence of max_target_length={cfg.data.max_target_length}; use fewer")


def _validate_vocab_tiling(cfg: Config) -> None:
    """num_vocab_tiling splits the tokens one device holds in a forward pass into equal chunks."""
    tiles, d, accum = cfg.model.num_vocab_tiling, cfg.data, cfg.optim.gradient_accumulation_steps
    tokens = d.per_device_batch_size * d.max_target_length / accum
    if tiles > 1 and (tokens != int(tokens) or int(tokens) % tiles):
        raise ConfigError(f"num_vocab_tiling={tiles} must divide the tokens per device of one forward pass: "
                          f"per_device_batch_size={d.per_device_batch_size:g} x max_target_length={d.max_target_length}"
                          f" / gradient_accumulation_steps={accum} = {tokens:g}; change num_vocab_tiling")


def _validate_eval(d) -> None:
    """eval_steps, when evaluation is on (eval_interval > 0); target_eval_loss needs evaluations."""
    if not d.eval_interval:
        if d.target_eval_loss:
            raise ConfigError(f"target_eval_loss={d.target_eval_loss:g} stops the run at an evaluation, and "
                              "eval_interval=0 never evaluates; set eval_interval (and eval_steps)")
        return
    if d.eval_steps == 0 or d.eval_steps < -1:
        raise ConfigError(f"eval_steps={d.eval_steps}: use a positive number of batches, or -1 for all of "
                          "the eval data")
    if d.eval_steps == -1 and d.dataset_type == "synthetic":
        raise ConfigError("eval_steps=-1 reads the eval data to its end, but synthetic data never ends; "
                          "set eval_steps (e.g. eval_steps=4)")


def validate_for_build(m: ModelConfig) -> None:
    """Checks for a model that is to be built, not only sized: `build_model`, `python3 -m
    tessera.config`, train_compile and `tessera.tools.plan --compile` run them before any model
    exists (the plan without --compile does not: it sizes any expert count on any block family,
    as the sizing guide's MoE examples)."""
    moe = m.decoder_block in MOE_BLOCKS
    if m.num_experts > 1 and not moe:
        raise ConfigError(f"num_experts={m.num_experts}: decoder_block={m.decoder_block} has a dense MLP; use "
                          f"a mixture-of-experts family ({', '.join(MOE_BLOCKS)}), or set num_experts=1")
    if moe and m.num_experts < 2:
        raise ConfigError(f"decoder_block={m.decoder_block} needs num_experts >= 2 (and num_experts_per_tok); e.g. "
                          "num_experts=8 num_experts_per_tok=2")


def check_tpu_compiler_limits(m: ModelConfig, platform: str, mesh_shape: dict[str, int]) -> None:
    """ConfigError for settings XLA's TPU compiler aborts on (libtpu 0.0.50.1): a CHECK in its SPMD
    partitioner (`partition_group_list`) ends the process with a core dump. decoder_block=qwen3_next with
    pipeline stages and tensor parallelism together: every size tried (2026-12-04, v5e-8, emb 24 to 256,
    stages beside fsdp or data, scanned or not, either gdn_kernel); without the Gated DeltaNets' decay and
    step gradients it compiles; stages with fsdp alone, and tensor without stages, compile."""
    if (platform == "tpu" and m.decoder_block == "qwen3_next" and mesh_shape.get("stage", 1) > 1
            and mesh_shape.get("tensor", 1) > 1):
        raise ConfigError(f"decoder_block=qwen3_next with pipeline stages ({mesh_shape['stage']}) and tensor "
                          f"parallelism ({mesh_shape['tensor']}) together: XLA's TPU compiler aborts on it (a CHECK "
                          "in its partitioner, libtpu 0.0.50.1); with stages, use fsdp or data instead of tensor "
                          "(ici_tensor_parallelism=1), or no stages")


def check_trainable_dtypes(m: ModelConfig, platform: str) -> None:
    """ConfigError for dtypes training cannot run on `platform` ("cpu", "gpu", "tpu"). float16
    parameters: AdamW keeps its moments in the parameters' dtype, where epsilon (1e-8) and the
    squares of small gradients round to zero and squares above 65504 overflow, so the first update
    is NaN; there is no loss scaling (decoding and conversion take them). float16 compute on
    TPUs: Pallas' kernels there (splash attention, megablox, the grouped matmul XLA lowers
    ragged_dot to) do not compile it (jax 0.12, v6e); GPUs without bfloat16 need it."""
    if platform == "tpu" and m.dtype == "float16":
        raise ConfigError("dtype=float16 on TPU: the TPU kernels (splash attention, the experts' grouped "
                          "matmuls) do not compile float16; use dtype=bfloat16, the TPUs' native half precision")
    if m.weight_dtype == "float16":
        raise ConfigError(
            "weight_dtype=float16 cannot be trained: AdamW's moments would be float16 too, where its epsilon "
            "(1e-8) and small squared gradients round to 0 and squares above 65504 overflow, so the first "
            "update is NaN. Use weight_dtype=bfloat16 (the same size, float32's range) or float32; "
            "dtype=float16 (the compute dtype) trains")
