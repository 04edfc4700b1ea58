"""The typed schema behind Tessera's flat config keys.

Every public key lives in exactly one section dataclass below, with its type, its default
and a one-line comment (units included). `configs/base.yml` is generated from this file
(`.venv/bin/python -m tessera.config > configs/base.yml`) and a test keeps the two equal, so
the documentation of a key and its behaviour cannot drift apart.

Keys that hold local paths carry `path=` (see `PATH_KINDS`): the loader makes them absolute
against the working directory when it builds the config, so nothing past the config ever sees
a relative path (Orbax refuses them) and the run writes where the command was typed.

Each component receives only its own section (`ModelConfig`, `MeshConfig`, ...); the root
`Config` groups them and holds the values derived from several sections.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

# The decoder blocks and attention kernels are listed here (not imported from the model
# package) so that validating a config never imports JAX.
DECODER_BLOCKS = ("llama2", "mistral", "mixtral", "gemma", "gemma2", "gpt3", "qwen3", "qwen3_moe", "gemma3", "deepseek",
                  "gpt_oss", "llama4")
# families whose MLP is a mixture of experts (num_experts >= 2)
MOE_BLOCKS = ("mixtral", "qwen3_moe", "deepseek", "gpt_oss", "llama4")
SA_LAYOUTS = ("HEAD_DIM_MINOR", "SEQ_MINOR")
ATTENTION_KINDS = ("dot_product", "flash", "cudnn_flash_te", "autoselected")
REMAT_POLICIES = (
    "none",
    "minimal",
    "save_dot_except_mlp",
    "save_dot_except_mlpwi",
    "save_qkv_proj",
    "save_out_proj",
    "qkv_proj_offloaded",
    "minimal_offloaded",
    "offload",
    "full",
    "custom",
)
# remat_policy=custom: each named activation is rematerialized, kept on the device or offloaded to host
REMAT_TENSORS = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi",
                 "mlpwi_0", "mlpwi_1", "mlpwo")
REMAT_CHOICES = ("remat", "device", "offload")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATION_MODES = ("", "int8", "fp8", "fp8_full", "nanoo_fp8")  # tessera.models.quantization.MODES
ACTIVATIONS = ("silu", "gelu", "relu", "linear", "tanh", "sigmoid")
DATASET_TYPES = ("synthetic", "hf", "tfds", "grain")
TOKENIZER_TYPES = ("auto", "sentencepiece", "tiktoken", "huggingface")
PROFILERS = ("", "xplane")
HF_FILE_FORMATS = ("parquet", "json", "arrow", "text", "csv")  # hf_path values that name a format, not a folder

# How the loader resolves a path key against the working directory (URLs, anything with "://",
# and empty values are kept as they are):
#   "path": one local path; "globs": comma-separated paths or globs, each resolved;
#   "local_or_name": hf_path, resolved only when it is a local file or folder (it exists, or it
#   starts with /, ./, ../ or ~); a format name (parquet, ...) or a Hub name (org/dataset) is kept.
PATH_KINDS = ("path", "globs", "local_or_name")
# Step counts reach jitted code as int32 (JAX's default integer; the optimizer's step counter is one).
MAX_STEPS = 2**31 - 1
OPTIMIZERS = ("adamw", "sgd", "muon")  # opt_type: MaxText's names (its adam_pax is not here)
# Widest attention head accepted (the widest of the model files: 256). Building a model keeps a
# rotary frequency per pair of head dimensions: a typo of 10^9 exhausted the host's memory.
MAX_HEAD_DIM = 65536
# Deepest model accepted (the deepest model file: 126 layers); the planner and the FLOPs count go
# through the layers one by one: a typo of 10^9 exhausted the host's memory there.
MAX_LAYERS = 65536
# Token ids are int32 (JAX's default integer), 0..V-1: a vocabulary of 3e9 was a traceback in the synthetic data.
MAX_VOCAB = 2**31
# Most elements one weight may hold once global_parameter_scale has scaled it (256 PiB in float32; the largest
# weight of a model file holds under 2^33): compiling the initialization sums every buffer's bytes in 64 bits, and a
# weight of 10^18 elements aborted the process in XLA (10^17 compiled and the memory check refused it, exit code 7).
MAX_WEIGHT_ELEMENTS = 2**56


def key(default: Any, doc: str, choices: tuple = (), minimum: float | None = None, path: str = "",
        maximum: float | None = None):
    """A config field: its default, a one-line comment, optionally the allowed values or range
    (`minimum`, `maximum`, both included), and for a key that holds local paths its `path` kind
    (one of PATH_KINDS)."""
    if path not in ("", *PATH_KINDS):
        raise ValueError(f"path={path!r} must be one of {PATH_KINDS}")
    meta = {"doc": doc, "choices": choices, "minimum": minimum, "maximum": maximum, "path": path}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    """Where a run writes and how long it lasts."""

    run_name: str = key("", "name of the run; outputs go to base_output_directory/run_name (empty: a timestamped name)")
    base_output_directory: str = key("outputs", "root folder for all runs (local path or gs://bucket/path)",
                                     path="path")
    steps: int = key(150, "number of optimizer steps to train", minimum=1, maximum=MAX_STEPS)
    log_period: int = key(1, "print one metrics line every this many steps (and the first step a start trains, and the last)", minimum=1)
    metrics_file: str = key("", "JSONL file of per-step metrics (empty: base_output_directory/run_name/metrics.jsonl)",
                            path="path")
    enable_tensorboard: bool = key(True, "write TensorBoard event files under base_output_directory/run_name/tensorboard")
    gcs_metrics: bool = key(False, "with a gs:// base_output_directory: also write the metrics there, as "
                            "run_name/metrics/metrics_<first>_<last>.jsonl files (the local copy stays)")
    init_weights_seed: int = key(0, "PRNG seed for parameter initialization and dropout (all 64 bits count)")
    jax_cache_dir: str = key("", "JAX's persistent compilation cache (local folder or gs://): a later run of the "
                             "same step loads it instead of compiling again (empty: off, unless "
                             "JAX_COMPILATION_CACHE_DIR is set)", path="path")
    report_warmup_steps: int = key(3, "steps left out of the run report's medians (compilation and warm-up)", minimum=0)
    step_timeout_seconds: float = key(1800.0, "hang watchdog: dump stacks and exit (code 5) when no step (nor eval "
                                      "batch) finishes within this many seconds (0: off); a checkpoint save that "
                                      "blocks the loop gets its bytes at 20 MB/s more", minimum=0.0)
    on_nonfinite_loss: str = key("stop", "a NaN/inf loss or gradient: 'stop' the run, or 'skip_step' (drop that update)",
                                 ("stop", "skip_step"))


@dataclass
class ProfilerConfig:
    """Trace capture and the compiler's HLO dump."""

    profiler: str = key("", "'' (off) or 'xplane' (JAX profiler trace, viewable in TensorBoard/Perfetto)", PROFILERS)
    skip_first_n_steps_for_profiler: int = key(1, "steps to run before the trace starts (skips compilation)", minimum=0)
    profiler_steps: int = key(5, "number of steps captured in the trace", minimum=1)
    dump_hlo: bool = key(False, "write XLA's dump of the compiled programs (HLO before and after optimization, buffer "
                                "assignment) as they compile; train.py and train_compile")
    dump_hlo_local_dir: str = key("", "folder of the HLO dump ('': the run folder's xla_dump/)", path="path")
    dump_hlo_module_name: str = key("jit_train_step", "dump only programs whose name matches this regular expression "
                                    "(jit_train_step: the train step; '': every program)")
    dump_hlo_xla_flags: str = key("", "XLA flags used instead of the dump flags dump_hlo sets (--xla_dump_to=<folder> "
                                      "--xla_dump_hlo_module_re=<name>), added to XLA_FLAGS")


@functools.cache
def _scale_exponents(scale: int) -> tuple[int, int, int]:
    """(emb, heads_and_mlp, layers) exponents of two for global_parameter_scale (remembered: the
    planner reads a scaled size millions of times)."""
    q, r = divmod(scale.bit_length() - 1, 3)
    return q + (r > 1), q + (r > 0), q


@dataclass
class ModelConfig:
    """Architecture of the decoder. The base_* sizes are scaled by global_parameter_scale."""

    model_name: str = key("default", "loads configs/models/<model_name>.yml over base.yml")
    decoder_block: str = key("llama2", "decoder block family", DECODER_BLOCKS)
    global_parameter_scale: int = key(
        1,
        "power of two S scaling base_* sizes: log2(S) = 3q + r; layers x2^q, emb x2^(q+[r>1]), "
        "heads and mlp x2^(q+[r>0]) (model_name=1b global_parameter_scale=128 is ~128B params)",
        minimum=1,
    )
    base_emb_dim: int = key(256, "model (embedding) width D before scaling", minimum=1)
    base_num_query_heads: int = key(4, "attention query heads N before scaling", minimum=1)
    base_num_kv_heads: int = key(4, "attention key/value heads K before scaling (K < N: grouped-query attention)", minimum=1)
    head_dim: int = key(64, "width H of one attention head", minimum=1, maximum=MAX_HEAD_DIM)
    base_mlp_dim: int = key(768, "hidden width F of the MLP before scaling", minimum=1)
    base_num_decoder_layers: int = key(4, "number of decoder blocks L before scaling", minimum=1,
                                       maximum=MAX_LAYERS)
    vocab_size: int = key(512, "vocabulary size V (token ids are 0..V-1)", minimum=2, maximum=MAX_VOCAB)
    mlp_activations: list = key(["silu", "linear"], "MLP activations; two entries make a gated MLP (act0(x W0) * act1(x W1))")
    normalization_layer_epsilon: float = key(1e-5, "epsilon of RMSNorm", minimum=0.0)
    rope_max_timescale: int = key(10000, "largest wavelength (theta) of the rotary position embedding", minimum=1)
    rope_scaling: str = key("none", "rotary frequency scaling for long context: llama3 stretches the low frequencies "
                            "(Llama 3.1 and later); linear divides every frequency by rope_scaling_factor (gemma3's "
                            "global layers); yarn: YaRN as DeepSeek-V3 uses it (beta_fast, beta_slow, mscale)",
                            ("none", "llama3", "linear", "yarn"))
    rope_scaling_factor: float = key(8.0, "rope_scaling=llama3: how much the lowest frequencies are divided by; "
                                     "linear: how much every frequency is divided by", minimum=1.0)
    rope_low_freq_factor: float = key(1.0, "rope_scaling=llama3: wavelengths longer than "
                                      "rope_original_max_position / this are fully scaled", minimum=0.0)
    rope_high_freq_factor: float = key(4.0, "rope_scaling=llama3: wavelengths shorter than "
                                       "rope_original_max_position / this are left as they are", minimum=0.0)
    rope_original_max_position: int = key(8192, "rope_scaling=llama3 or yarn: the context length the model was first "
                                          "trained with", minimum=1)
    beta_fast: float = key(32.0, "rope_scaling=yarn: frequencies that turn more than this many times in the original "
                           "context are kept", minimum=0.0)
    beta_slow: float = key(1.0, "rope_scaling=yarn: frequencies that turn fewer times than this are divided by "
                           "rope_scaling_factor (those between are mixed)", minimum=0.0)
    mscale: float = key(1.0, "rope_scaling=yarn: attention scores are multiplied by (0.1 * mscale * "
                        "ln(rope_scaling_factor) + 1)^2 (DeepSeek's mscale_all_dim)", minimum=0.0)
    rope_truncate: bool = key(True, "rope_scaling=yarn: round the dimensions where the kept and the divided "
                              "frequencies start outwards to whole dimensions (DeepSeek-V3; gpt-oss: false)")
    local_rope_max_timescale: int = key(10000, "gemma3: rotary theta of the local (sliding-window) layers, which "
                                        "rope_scaling leaves unscaled (the global layers use rope_max_timescale; -1: "
                                        "the same theta as theirs, MaxText's default)", minimum=-1)
    logits_via_embedding: bool = key(False, "tie the output projection to the token embedding")
    enable_dropout: bool = key(True, "apply dropout at dropout_rate during training (as MaxText; dropout_rate=0 "
                               "keeps it off)")
    dropout_rate: float = key(0.0, "dropout probability after attention and MLP (0: none; needs enable_dropout=true, "
                              "the default)", minimum=0.0)
    use_iota_embed: bool = key(False, "embed tokens with a one-hot matmul instead of a gather (faster on some TPUs)")
    dtype: str = key("float32", "activation (compute) dtype", DTYPES)
    weight_dtype: str = key("float32", "parameter storage dtype (optimizer state follows it; float16: decoding and "
                                        "conversion only, training refuses it)", DTYPES)
    num_vocab_tiling: int = key(1, "compute the output logits and cross-entropy in this many chunks of the tokens, "
                                "recomputed in the backward pass: the [tokens, vocab] logits never exist at once",
                                minimum=1)
    logits_dot_in_fp32: bool = key(False, "compute the output-logits matmul in float32")
    quantization: str = key(
        "", "quantized training of the dense projections, on qwix: '' off; int8 (per-channel int8 forward and "
        "gradients); fp8 (e4m3 forward, e5m2 gradients); fp8_full (fp8, the output logits too); nanoo_fp8 (as fp8 "
        "in AMD MI300's e4m3fnuz / e5m2fnuz formats)",
        QUANTIZATION_MODES)
    quantize_kvcache: bool = key(False, "decoding: store the KV cache quantized (kv_quant_dtype, scaled over kv_quant_axis)")
    kv_quant_axis: str = key("heads_and_dkv", "quantized KV cache: one scale per slot and kv head (dkv: reduced over "
                             "the head dimension) or per slot (heads_and_dkv: over heads and head dimension)",
                             ("dkv", "heads_and_dkv"))
    kv_quant_dtype: str = key("int8", "quantized KV cache: the stored type", ("int8", "int4"))
    scan_layers: bool = key(True, "stack the decoder blocks and run them with jax.lax.scan (faster compile); "
                                 "either way the same seed gives the same initial weights")
    remat_policy: str = key("full", "what the backward pass keeps vs recomputes per block ('none' keeps all; "
                            "'custom': the per-tensor keys decoder_layer_input to mlpwo)", REMAT_POLICIES)
    decoder_layer_input: str = key("device", "remat_policy=custom: a block's input [B, T, D]", REMAT_CHOICES)
    query_proj: str = key("remat", "remat_policy=custom: the query projection [B, T, N, H]", REMAT_CHOICES)
    key_proj: str = key("remat", "remat_policy=custom: the key projection [B, T, K, H]", REMAT_CHOICES)
    value_proj: str = key("remat", "remat_policy=custom: the value projection [B, T, K, H]", REMAT_CHOICES)
    context: str = key("remat", "remat_policy=custom: the attention output before its projection [B, T, N, H]",
                       REMAT_CHOICES)
    out_proj: str = key("remat", "remat_policy=custom: the attention output projection [B, T, D]", REMAT_CHOICES)
    mlpwi: str = key("remat", "remat_policy=custom: the MLP's activated (gated) hidden layer [B, T, F]", REMAT_CHOICES)
    mlpwi_0: str = key("remat", "remat_policy=custom: the MLP's first input projection [B, T, F]", REMAT_CHOICES)
    mlpwi_1: str = key("remat", "remat_policy=custom: the MLP's second (up) projection [B, T, F]", REMAT_CHOICES)
    mlpwo: str = key("remat", "remat_policy=custom: the MLP output projection [B, T, D]", REMAT_CHOICES)
    attention: str = key("autoselected", "attention kernel: dot_product (reference) or the fastest fused one", ATTENTION_KINDS)
    sa_block_q: int = key(0, "splash attention (TPU flash kernel) query block; 0: the largest of 512, 256, 128 that "
                          "divides max_target_length", minimum=0)
    sa_block_kv: int = key(0, "splash attention key/value block (0: auto, as sa_block_q)", minimum=0)
    sa_block_kv_compute: int = key(0, "splash attention key/value compute block (0: auto, as sa_block_q)", minimum=0)
    sa_block_q_dkv: int = key(0, "splash attention query block of the dK/dV backward kernel (0: auto)", minimum=0)
    sa_block_kv_dkv: int = key(0, "splash attention key/value block of the dK/dV backward kernel (0: auto)", minimum=0)
    sa_block_kv_dkv_compute: int = key(0, "splash attention key/value compute block of the dK/dV kernel (0: auto)",
                                       minimum=0)
    sa_block_q_dq: int = key(0, "splash attention query block of the dQ backward kernel (0: auto)", minimum=0)
    sa_block_kv_dq: int = key(0, "splash attention key/value block of the dQ backward kernel (0: auto)", minimum=0)
    sa_use_fused_bwd_kernel: bool = key(False, "splash attention: one fused backward kernel for dQ, dK and dV")
    sa_q_layout: str = key("HEAD_DIM_MINOR", "splash attention query layout in memory", SA_LAYOUTS)
    sa_k_layout: str = key("HEAD_DIM_MINOR", "splash attention key layout in memory", SA_LAYOUTS)
    sa_v_layout: str = key("HEAD_DIM_MINOR", "splash attention value layout in memory", SA_LAYOUTS)
    context_parallel_load_balance: bool = key(
        True, "with the sequence axis splitting splash attention's queries: each device takes an early and a late "
              "part of the sequence, so causal attention's work is even across the axis (needs a length that is a "
              "multiple of 256 times the axis; else the parts stay contiguous)")
    sliding_window_size: int = key(0, "sliding-window attention: a query sees its own and the W-1 previous positions "
                                   "(0: all previous; mistral, and gemma2's local layers)", minimum=0)
    query_pre_attn_scalar: float = key(0.0, "attention scores are scaled by this**-0.5 (0: head_dim**-0.5)", minimum=0.0)
    attn_logits_soft_cap: float = key(0.0, "squash attention scores with c*tanh(s/c) (0: off; gemma2: 50)", minimum=0.0)
    final_logits_soft_cap: float = key(0.0, "squash output logits with c*tanh(l/c) (0: off; gemma2: 30)", minimum=0.0)
    attention_bias: bool = key(False, "a learned bias on the query, key, value and output projections of attention "
                               "(gpt-oss; gpt3 always has them; not with deepseek's latent attention)")
    attention_sink: bool = key(False, "a learned logit per query head that every query's softmax also sees, as a key "
                               "with a zero value: attention can go nowhere (gpt-oss; not with deepseek's latent "
                               "attention, nor with cuDNN, which has no such input)")
    use_qk_norm: bool = key(False, "llama4: an RMS norm without a scale over each query and key head of the rotary "
                            "layers (Llama 4 Scout; qwen3 and gemma3 have norms with scales of their own)")
    chunk_attn_window_size: int = key(0, "llama4: the rotary layers attend within chunks of this many tokens (a query "
                                      "sees the earlier tokens of its own chunk; Llama 4: 8192; 0: no chunks)",
                                      minimum=0)
    nope_layer_interval: int = key(0, "llama4: every this-many-th layer has no rotary positions and attends to the "
                                   "whole causal past (Llama 4: 4; 0: every layer rotates)", minimum=0)
    temperature_tuning: bool = key(False, "llama4: the layers without rotary positions scale a query at position p by "
                                   "s * ln(1 + floor((p + 1) / f)) + 1, sharpening attention over long contexts")
    temperature_tuning_scale: float = key(0.1, "temperature_tuning: s (Llama 4: 0.1)", minimum=0.0)
    temperature_tuning_floor_scale: float = key(8192.0, "temperature_tuning: f, in tokens (Llama 4: 8192)", minimum=1.0)
    interleave_moe_layer_step: int = key(1, "llama4: every this-many-th layer has experts, the others a dense MLP of "
                                         "base_mlp_dim (Llama 4 Maverick: 2; Scout: 1, experts everywhere)", minimum=1)
    fused_qkv: bool = key(False, "one fused query/key/value projection [emb, 3, heads, head_dim] (multi-head attention "
                          "only: kv heads = query heads); from the same weights, the same results as three (at the same "
                          "seed it starts from other random weights)")
    fused_mlp: bool = key(False, "one fused gate/up projection [emb, 2, mlp] for gated MLPs (two mlp_activations; "
                          "dense blocks only); from the same weights, the same results as two (at the same seed it starts "
                          "from other random weights)")
    mlp_bias: bool = key(False, "a learned bias after every projection of the MLPs, experts included (gpt-oss's "
                         "experts; gpt3 always has them)")
    mlp_activations_limit: float = key(-1.0, "gpt_oss experts: the gate is clipped above at this and the up projection "
                                       "to [-this, this] before gate * act0(1.702 * gate) * (up + 1) (gpt-oss: 7; "
                                       "-1: no clipping)")
    trainable_position_size: int = key(0, "gpt3: rows of the learned position-embedding table (the longest sequence); "
                                       "0: fixed sinusoidal positions", minimum=0)
    num_experts: int = key(1, "experts per mixture-of-experts MLP (decoder_block=mixtral, qwen3_moe, deepseek or "
                           "gpt_oss; 1: dense MLP)",
                           minimum=1)
    num_experts_per_tok: int = key(1, "experts each token is routed to (top-k) when num_experts > 1", minimum=1)
    base_moe_mlp_dim: int = key(0, "hidden width of one expert before scaling (0: base_mlp_dim); deepseek's dense "
                                "layers use base_mlp_dim", minimum=0)
    first_num_dense_layers: int = key(0, "deepseek: this many layers at the bottom have a dense MLP (base_mlp_dim) "
                                      "instead of experts", minimum=0)
    shared_experts: int = key(0, "deepseek: experts every token goes through (one dense MLP shared_experts x the "
                              "expert width wide), added to the routed experts' output", minimum=0)
    routed_score_func: str = key("softmax", "MoE router scores: softmax over the experts (Mixtral, Qwen3) or an "
                                 "independent sigmoid per expert (DeepSeek-V3)", ("softmax", "sigmoid"))
    routed_scaling_factor: float = key(1.0, "MoE: the routed experts' weights are multiplied by this (DeepSeek-V3: 2.5)",
                                       minimum=0.0)
    routed_bias: bool = key(False, "MoE: a per-expert bias added to the router scores to choose the experts (not to "
                            "weight them), moved after every step towards balance instead of a load-balancing loss "
                            "(DeepSeek-V3's auxiliary-loss-free balancing)")
    routed_bias_update_rate: float = key(0.001, "routed_bias: how far each step moves an expert's bias: down when it "
                                         "took more than its share of the tokens, up when less", minimum=0.0)
    n_routing_groups: int = key(-1, "MoE: experts split into this many groups, and a token's experts come from its "
                                "topk_routing_group best groups (scored by their two best experts); -1: no groups")
    topk_routing_group: int = key(-1, "MoE with n_routing_groups: groups a token may take experts from")
    q_lora_rank: int = key(0, "deepseek (multi-head latent attention): rank of the low-rank query projection "
                           "(0: a full-rank query projection)", minimum=0)
    kv_lora_rank: int = key(512, "deepseek: width of the compressed key/value latent (what the KV cache stores)",
                            minimum=1)
    qk_nope_head_dim: int = key(128, "deepseek: per-head query/key width without rotary positions", minimum=1,
                                maximum=MAX_HEAD_DIM)
    qk_rope_head_dim: int = key(64, "deepseek: per-head query/key width with rotary positions (the key part is "
                                "shared by all heads)", minimum=2, maximum=MAX_HEAD_DIM)
    v_head_dim: int = key(128, "deepseek: per-head value width", minimum=1, maximum=MAX_HEAD_DIM)
    norm_topk_prob: bool = key(True, "MoE: renormalize the chosen experts' router probabilities to sum to one "
                               "(Mixtral, Qwen3-MoE); false: weight each expert by its softmax probability over all")
    capacity_factor: float = key(-1.0, "MoE capacity routing: an expert takes at most capacity_factor x its fair share "
                                 "(k*T/E) of a sequence's tokens, the others skip it (dropped); -1: no limit")
    sparse_matmul: bool = key(False, "dropless MoE: sort token copies by expert and run grouped (ragged) matmuls; "
                              "capacity_factor is not used")
    megablox: bool = key(False, "dropless MoE, as sparse_matmul, with the grouped matmuls in the Pallas megablox "
                         "kernel on TPUs; elsewhere jax.lax.ragged_dot")
    tile_batch_seq: int = key(512, "megablox=true: token-copy rows per tile of the grouped matmuls (a multiple of "
                              "128; a device's rows are padded to whole tiles)", minimum=128)
    tile_activation_dim: int = key(1024, "megablox=true: contraction columns per tile of the grouped matmuls (a "
                                   "multiple of 128; a narrower matrix is one tile)", minimum=128)
    tile_weight_dim: int = key(1024, "megablox=true: output columns per tile of the grouped matmuls (a multiple of "
                               "128; a narrower matrix is one tile)", minimum=128)
    ragged_buffer_factor: float = key(-1.0, "dropless MoE with an expert axis: each device's buffer for the token "
                                      "copies it receives holds ragged_buffer_factor x its own copies; the excess "
                                      "is dropped (reported); -1: room for every copy (never drops)")
    load_balance_loss_weight: float = key(0.01, "weight of the MoE router's load-balancing loss in the training loss "
                                          "(Mixtral: 0.02)", minimum=0.0)
    mtp_num_layers: int = key(0, "multi-token prediction (DeepSeek-V3): this many extra blocks after the decoder, "
                              "block k predicting the token k+1 places after the next; trained, and measured by evaluation, "
                              "not used in decoding (0: none)", minimum=0)
    mtp_loss_scaling_factor: float = key(0.1, "mtp_num_layers > 0: weight of the multi-token-prediction loss (the "
                                         "mean over its blocks) in the training loss (DeepSeek-V3: 0.3, then 0.1)",
                                         minimum=0.0)
    mtp_eval_target_module: int = key(0, "mtp_num_layers > 0: evaluation also reports how often block k's greedy "
                                      "guess equals the main model's k tokens later (the acceptance rate of "
                                      "speculative decoding with it, eval_mtp_acceptance_rate_percent; 0: not measured)",
                                      minimum=0)

    # --- derived sizes: global_parameter_scale's rule (_scale_exponents, above) ---
    @property
    def emb_dim(self) -> int:
        return self.base_emb_dim << _scale_exponents(self.global_parameter_scale)[0]

    @property
    def num_query_heads(self) -> int:
        return self.base_num_query_heads << _scale_exponents(self.global_parameter_scale)[1]

    @property
    def num_kv_heads(self) -> int:
        return self.base_num_kv_heads << _scale_exponents(self.global_parameter_scale)[1]

    @property
    def mlp_dim(self) -> int:
        return self.base_mlp_dim << _scale_exponents(self.global_parameter_scale)[1]

    @property
    def local_rope_theta(self) -> int:
        """The rotary theta of gemma3's local layers: local_rope_max_timescale, or with -1 the global one."""
        return self.local_rope_max_timescale if self.local_rope_max_timescale > 0 else self.rope_max_timescale

    @property
    def expert_mlp_dim(self) -> int:
        """Hidden width of one expert: base_moe_mlp_dim scaled as mlp_dim, or mlp_dim itself."""
        if not self.base_moe_mlp_dim:
            return self.mlp_dim
        return self.base_moe_mlp_dim << _scale_exponents(self.global_parameter_scale)[1]

    @property
    def num_decoder_layers(self) -> int:
        return self.base_num_decoder_layers << _scale_exponents(self.global_parameter_scale)[2]


@dataclass
class MeshConfig:
    """Device mesh. ici_* axes run inside a slice, dcn_* across slices; one of each may be -1."""

    ici_data_parallelism: int = key(1, "data-parallel ways inside a slice (-1: fill from device count)")
    ici_fsdp_parallelism: int = key(-1, "fully-sharded data-parallel ways inside a slice (-1: fill)")
    ici_sequence_parallelism: int = key(1, "sequence (context) parallel ways inside a slice (-1: fill)")
    ici_tensor_parallelism: int = key(1, "tensor (model) parallel ways inside a slice (-1: fill)")
    ici_fsdp_transpose_parallelism: int = key(1, "MaxText's second fsdp axis; Tessera folds it into the fsdp axis "
                                              "(fsdp ways = ici_fsdp x this; -1: fill)")
    ici_expert_parallelism: int = key(1, "expert-parallel ways inside a slice (-1: fill)")
    ici_pipeline_parallelism: int = key(1, "pipeline stages inside a slice (the decoder's layers are split over "
                                        "them; see num_pipeline_microbatches)")
    dcn_data_parallelism: int = key(-1, "data-parallel ways across slices (-1: fill from slice count)")
    dcn_fsdp_parallelism: int = key(1, "fsdp ways across slices")
    dcn_sequence_parallelism: int = key(1, "sequence-parallel ways across slices")
    dcn_tensor_parallelism: int = key(1, "tensor-parallel ways across slices")
    dcn_fsdp_transpose_parallelism: int = key(1, "as ici_fsdp_transpose_parallelism, across slices (folded into fsdp)")
    dcn_expert_parallelism: int = key(1, "expert-parallel ways across slices")
    dcn_pipeline_parallelism: int = key(1, "pipeline stages across slices (stages = ici x dcn pipeline parallelism)")
    num_pipeline_microbatches: int = key(
        -1, "microbatches the batch is cut into when pipelining, at least the stage count (-1: 4, 2 or 1 times the "
        "stages, the first that leaves each microbatch divisible over the batch axes)")
    num_pipeline_repeats: int = key(
        -1, "circular pipelining: times a microbatch goes round the stages, each stage holding this many "
        "non-adjacent groups of layers (-1: from num_layers_per_pipeline_stage, else 1, plain GPipe)")
    num_layers_per_pipeline_stage: int = key(
        -1, "decoder layers in one group of a stage; layers = stages x repeats x this (-1: from num_pipeline_repeats)")
    pipeline_delay_activation_forwarding: bool = key(
        False, "hand each stage's output on one iteration late, so the transfer overlaps the next iteration's "
        "compute instead of stalling it (worth it when it is slow, across slices); costs S - 1 more iterations "
        "of bubble, and a circular pipeline needs at least 2 x stages microbatches")
    pipeline_fsdp_ag_once: bool = key(
        False, "gather each stage's fsdp-split weights once per step, before the pipeline's iterations, instead of "
        "in every iteration: fewer, larger all-gathers for the memory of the stage's whole weights on every device")
    num_slices: int = key(-1, "number of slices (-1: detect from the devices)", minimum=-1)
    param_replication_warn_mib: float = key(
        1.0, "report parameters larger than this (MiB) that end up fully replicated on a sharded mesh", minimum=0.0
    )


@dataclass
class DataConfig:
    """Input pipeline."""

    dataset_type: str = key("synthetic", "input pipeline", DATASET_TYPES)
    per_device_batch_size: float = key(8.0, "sequences per device per step (global batch = this x device count)")
    max_target_length: int = key(128, "tokens per training sequence T", minimum=2)
    reuse_example_batch: bool = key(False, "feed the first batch at every step (for speed tests)")
    data_shuffle_seed: int = key(0, "seed of the synthetic token stream and of the grain/tfds record order "
                                 "(grain's shuffle takes 32 bits)", minimum=0, maximum=2**32 - 1)
    hf_path: str = key("", "dataset_type=hf: a file format (parquet, json, arrow, text, csv), a local dataset "
                       "directory, or a Hugging Face Hub dataset name (taken as local, and resolved, when it exists "
                       "or starts with /, ./, ../ or ~)", path="local_or_name")
    hf_train_files: str = key("", "training files for hf_path=<format>: comma-separated globs, e.g. /data/c4/000*.parquet",
                              path="globs")
    hf_eval_files: str = key("", "evaluation files, as hf_train_files (empty: no eval data)", path="globs")
    hf_streaming: bool = key(True, "stream files instead of converting them to an Arrow cache first (large corpora)")
    train_split: str = key("train", "split read for training from a dataset directory, Hub dataset or TFDS dataset")
    eval_split: str = key("validation", "split read for evaluation from a dataset directory, Hub dataset or TFDS "
                          "dataset")
    dataset_name: str = key("", "dataset_type=tfds: the TFDS dataset as name/config:version, e.g. c4/en:3.1.0 "
                            "(prepared in ArrayRecord format)")
    dataset_path: str = key("", "dataset_type=tfds: the TFDS data directory holding dataset_name (local or gs://; "
                            "empty: TFDS's default, ~/tensorflow_datasets)", path="path")
    eval_dataset_name: str = key("", "dataset_type=tfds: the TFDS dataset for evaluation (empty: dataset_name)")
    train_data_columns: list = key(["text"], "text columns, joined with a newline (a list-of-ints column is "
                                   "taken as already tokenized)")
    grain_train_files: str = key("", "dataset_type=grain: comma-separated globs of ArrayRecord or Parquet files",
                                  path="globs")
    grain_eval_files: str = key("", "evaluation files for dataset_type=grain, as grain_train_files", path="globs")
    grain_file_type: str = key("arrayrecord", "format of the grain files (ArrayRecord records: UTF-8 text or a JSON "
                               "object holding train_data_columns)", ("arrayrecord", "parquet"))
    grain_worker_count: int = key(0, "grain and tfds: processes that read and tokenize records (0: in the training "
                                  "process)",
                                  minimum=0)
    tokenizer_path: str = key("", "SentencePiece .model, tiktoken BPE file, or a folder/file with tokenizer.json",
                               path="path")
    tokenizer_type: str = key("auto", "tokenizer kind when the path does not make it clear", TOKENIZER_TYPES)
    add_bos: bool = key(True, "start every document with the tokenizer's begin-of-sequence token")
    add_eos: bool = key(True, "end every document with the tokenizer's end-of-sequence token")
    packing: bool = key(True, "pack several documents into each sequence (segment ids keep attention and loss "
                        "inside a document); false: one document piece per sequence, padding masked")
    eval_interval: int = key(0, "evaluate every this many steps (0: never)", minimum=0)
    eval_steps: int = key(-1, "batches per evaluation (-1: until the eval data ends)")
    eval_per_device_batch_size: float = key(0.0, "sequences per device in an evaluation batch (0: "
                                            "per_device_batch_size; an evaluation keeps no activations for a "
                                            "backward pass, so it may take more)", minimum=0.0)
    target_eval_loss: float = key(0.0, "stop after the first evaluation whose eval_loss is at or below this, "
                                  "saving a checkpoint there (0: train all `steps`)", minimum=0.0)


@dataclass
class OptimConfig:
    """The optimizer (AdamW, SGD or Muon), warm-up + cosine schedule, clipping and gradient accumulation."""

    opt_type: str = key("adamw", "optimizer: adamw; sgd (plain, no momentum or weight decay); muon (the blocks' "
                        "weight matrices by orthogonalized momentum, embeddings, output layer, norms and biases by "
                        "AdamW)", choices=OPTIMIZERS)
    learning_rate: float = key(3e-3, "peak learning rate", minimum=0.0)
    warmup_steps_fraction: float = key(0.1, "fraction of learning_rate_schedule_steps spent warming up linearly",
                                         minimum=0.0, maximum=1.0)
    learning_rate_schedule_steps: int = key(-1, "length of the schedule in steps (-1: steps)", maximum=MAX_STEPS)
    cosine_learning_rate_final_fraction: float = key(0.1, "final learning rate as a fraction of the peak", minimum=0.0,
                                                     maximum=1.0)
    adam_b1: float = key(0.9, "AdamW beta1", minimum=0.0)
    adam_b2: float = key(0.95, "AdamW beta2", minimum=0.0)
    adam_eps: float = key(1e-8, "AdamW epsilon", minimum=0.0)
    adam_weight_decay: float = key(0.1, "AdamW decoupled weight decay, times the learning rate; every parameter AdamW "
                                   "trains decays but the norms' scales and DeepSeek's routing biases", minimum=0.0)
    muon_beta: float = key(0.95, "muon: decay of the momentum the update orthogonalizes", minimum=0.0)
    muon_weight_decay: float = key(0.0, "muon: weight decay of the Muon-trained matrices, times the learning rate",
                                   minimum=0.0)
    muon_consistent_rms: float = key(0.0, "muon: 0 scales each orthogonalized update by sqrt(max(1, fan_out / "
                                     "fan_in)); > 0 by sqrt(max(fan_in, fan_out)) x this, an RMS like AdamW's at 0.2",
                                     minimum=0.0)
    gradient_clipping_threshold: float = key(1.0, "clip gradients to this global norm (0: no clipping)", minimum=0.0)
    gradient_accumulation_steps: int = key(1, "micro-batches accumulated per optimizer step", minimum=1)
    shard_optimizer_over_data: bool = key(False, "ZeRO-1: split the optimizer state over the data axis as well "
                                          "(parameters stay replicated there); less state memory per device")


@dataclass
class CheckpointConfig:
    """Orbax checkpoints: periodic saves, automatic resume, parameter-only and full-state loads."""

    enable_checkpointing: bool = key(True, "save checkpoints and resume from the newest one in checkpoint_dir")
    async_checkpointing: bool = key(True, "write checkpoints in the background (the step only waits for the copy to host)")
    checkpoint_period: int = key(100, "save every this many steps (the last step and a SIGTERM also save)", minimum=1)
    max_num_checkpoints_to_keep: int = key(-1, "keep only the newest N complete checkpoints (-1: keep all)")
    checkpoint_checksums: bool = key(True, "record a CRC32C of every checkpoint file at save and verify them before "
                                      "loading (local folders; a bucket checks its own)")
    checkpoint_dir: str = key("", "where checkpoints go (empty: base_output_directory/run_name/checkpoints)",
                               path="path")
    load_parameters_path: str = key("", "start from these parameters only (a checkpoint step folder or a params "
                                     "checkpoint)", path="path")
    checkpoint_is_quantized: bool = key(False, "decoding: load_parameters_path holds weights in quantized form "
                                        "(written by decode.py save_quantized_params_path=...)")
    save_quantized_params_path: str = key("", "decoding: also write the loaded weights quantized (as `quantization` "
                                          "says: int8 or float8) to this folder", path="path")
    load_full_state_path: str = key("", "start from this full state: parameters, optimizer state and step "
                                     "(a checkpoint step folder)", path="path")


@dataclass
class CompileConfig:
    """Ahead-of-time compilation of the train step for a TPU topology on any host (train_compile)."""

    compile_topology: str = key("", "TPU slice to AOT-compile for, e.g. v5p-256, v5e-256, v6e-256, v4-128 ('': none)")
    compile_topology_num_slices: int = key(1, "number of such slices joined over DCN (data center network); at most "
                                           "511, libtpu's limit (it aborts at 512)", minimum=1, maximum=511)
    compile_hbm_budget_fraction: float = key(
        0.95, "share of a chip's HBM the compiled step may use; the rest is left to the TPU runtime", minimum=0.0
    )
    compiled_trainstep_file: str = key("", "train_compile: also save the compiled step to this file (pickled "
                                       "jax serialize_executable payload, as MaxText); train.py compiles its own",
                                       path="path")


OPTIMIZATION_LEVELS = ("", "O0", "O1")


@dataclass
class GpuConfig:
    """GPU compiler and memory settings, set before JAX starts (gpu_tuning.py); the defaults change nothing."""

    optimization_level: str = key("", "JAX's optimization level (JAX_OPTIMIZATION_LEVEL); O1 turns on XLA's GPU bundle: "
                                  "latency-hiding scheduler, pipelined collectives, loop double buffering "
                                  "('': JAX's default)", OPTIMIZATION_LEVELS)
    enable_pgle: bool = key(False, "JAX's automatic profile-guided latency estimator: profile the first "
                            "pgle_profiling_runs calls of each jitted function, then recompile it with the measured "
                            "times (not the AOT-compiled train step: use pgle_profile_path)")
    pgle_profiling_runs: int = key(3, "enable_pgle: calls profiled before the recompile", minimum=1)
    pgle_profile_path: str = key("", "PGLE profile from an earlier run (.pb/.pbtxt file, or a folder of "
                                 "<fingerprint>.pb), passed to XLA as --xla_gpu_pgle_profile_file_or_directory_path",
                                 path="path")
    xla_python_client_mem_fraction: float = key(0.0, "share of each GPU's memory JAX takes at start-up, in (0, 1] "
                                                "(sets XLA_PYTHON_CLIENT_MEM_FRACTION; 0: leave it, JAX's default "
                                                "is 0.75)", minimum=0.0)

    def __post_init__(self):
        from tessera.gpu_tuning import check_gpu_config  # checks that choices/minimum cannot express

        check_gpu_config(self)


class ConfigError(ValueError):
    """A user error in the config: the message says which key, which value, and what to do."""


@dataclass
class Config:
    """The whole config, one attribute per section. Components receive only their section."""

    run: RunConfig = field(default_factory=RunConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)

    @property
    def total_steps_in_schedule(self) -> int:
        s = self.optim.learning_rate_schedule_steps
        return self.run.steps if s == -1 else s


SECTIONS = {
    "run": RunConfig,
    "profiler": ProfilerConfig,
    "model": ModelConfig,
    "mesh": MeshConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "compile": CompileConfig,
    "gpu": GpuConfig,
}


def path_keys() -> dict[str, str]:
    """Flat key -> path kind (PATH_KINDS), for every key that holds local paths."""
    return {name: f.metadata["path"] for name, (_, f) in all_fields().items() if f.metadata["path"]}


def all_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """Flat key -> (section name, dataclass field), for every public key."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            out[f.name] = (section, f)
    return out


def render_base_yml() -> str:
    """The text of configs/base.yml: every key, its default and its comment, by section."""
    import json

    lines = [
        "# Tessera base config: every key with its default. Generated from",
        "# src/tessera/config/schema.py; regenerate with",
        "#   .venv/bin/python -m tessera.config > configs/base.yml",
        "# Precedence: this file < configs/models/<model_name>.yml < key=value < M_<KEY> env vars.",
        "# Keys marked [path] take local paths or URLs (gs://...). A relative path is resolved against the",
        "# working directory when the config is loaded (outputs -> $PWD/outputs); URLs are kept as they are.",
    ]
    for section, cls in SECTIONS.items():
        lines += ["", f"# --- {section}: {cls.__doc__.strip()}"]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            value = json.dumps(default)  # JSON scalars and lists are valid YAML
            choices = f.metadata["choices"]
            extra = f" [one of: {', '.join(repr(c) for c in choices)}]" if choices else ""
            extra += " [path]" if f.metadata["path"] else ""
            lines.append(f"{f.name}: {value}  # {f.metadata['doc']}{extra}")
    from tessera.config.maxtext import render_aliases

    return "\n".join(lines + render_aliases()) + "\n"
