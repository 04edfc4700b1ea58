"""The model section of the config schema: the decoder's architecture (`ModelConfig`), its
base_* sizes and the sizes global_parameter_scale derives from them. The other sections, and
the root `Config`, are in `schema.py`; `key` and the allowed values in `fields.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tessera.config.fields import (ATTENTION_KINDS, DECODER_BLOCKS, DTYPES, MATMUL_PRECISIONS, MAX_HEAD_DIM,
                                   MAX_LAYERS, MAX_MTP_LAYERS, MAX_VOCAB, MAX_WINDOW, QUANTIZATION_MODES,
                                   REMAT_CHOICES, REMAT_POLICIES, SA_LAYOUTS, key)


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
    local_rope_max_timescale: int = key(10000, "gemma3 and olmo3: rotary theta of the local (sliding-window) "
                                        "layers, which rope_scaling leaves unscaled (the global layers use "
                                        "rope_max_timescale; -1: the same theta as theirs, MaxText's default)", minimum=-1)
    logits_via_embedding: bool = key(False, "tie the output projection to the token embedding")
    enable_dropout: bool = key(True, "apply dropout at dropout_rate during training (as MaxText; dropout_rate=0 "
                               "keeps it off)")
    dropout_rate: float = key(0.0, "dropout probability after attention and MLP (0: none; needs enable_dropout=true, "
                              "the default)", minimum=0.0)
    use_iota_embed: bool = key(False, "embed tokens with a one-hot matmul instead of a gather (faster on some TPUs)")
    dtype: str = key("float32", "activation (compute) dtype", DTYPES)
    weight_dtype: str = key("float32", "parameter storage dtype (optimizer state follows it; float16: decoding and "
                                        "conversion only, training refuses it)", DTYPES)
    activations_in_float32: bool = key(False, "the MLPs' and experts' activation functions, and their gated product, in "
                                       "float32 from projections in dtype, rounded to dtype once before the output "
                                       "projection (MaxText's key; with dtype=bfloat16 the nonlinearities are then "
                                       "exact to float32)")
    matmul_precision: str = key("default", "precision of the model's matmuls (MaxText's key; jax.lax.Precision): on TPUs "
                                "float32 operands take one bfloat16 pass (default), three (high) or full float32 "
                                "(highest); on GPUs high allows TF32; float32, tensorfloat32 and bfloat16 are JAX's "
                                "names of highest, high and default; default leaves JAX's own "
                                "(JAX_DEFAULT_MATMUL_PRECISION). CPUs multiply float32 in full whatever it says",
                                MATMUL_PRECISIONS)
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
    sa_block_kv_compute: int = key(0, "splash attention key/value compute block, dividing sa_block_kv (0: "
                                   "sa_block_kv's)", minimum=0)
    sa_block_q_dkv: int = key(0, "splash attention query block of the dK/dV backward kernel (0: auto)", minimum=0)
    sa_block_kv_dkv: int = key(0, "splash attention key/value block of the dK/dV backward kernel (0: auto)", minimum=0)
    sa_block_kv_dkv_compute: int = key(0, "splash attention key/value compute block of the dK/dV kernel, dividing "
                                          "sa_block_kv_dkv (0: sa_block_kv_dkv's)", minimum=0)
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
                                   "(0: all previous; mistral, and gemma2's local layers)", minimum=0,
                                   maximum=MAX_WINDOW)
    query_pre_attn_scalar: float = key(0.0, "attention scores are scaled by this**-0.5 (0: head_dim**-0.5)", minimum=0.0)
    attn_logits_soft_cap: float = key(0.0, "squash attention scores with c*tanh(s/c) (0: off; gemma2: 50)", minimum=0.0)
    final_logits_soft_cap: float = key(0.0, "squash output logits with c*tanh(l/c) (0: off; gemma2: 30)", minimum=0.0)
    attention_bias: bool = key(False, "a learned bias on the query, key, value and output projections of attention "
                               "(gpt-oss; gpt3 always has them; qwen2: on the query, key and value projections "
                               "only, as Qwen2 and Qwen2.5 have; not with deepseek's latent attention)")
    attention_sink: bool = key(False, "a learned logit per query head that every query's softmax also sees, as a key "
                               "with a zero value: attention can go nowhere (gpt-oss; not with deepseek's latent "
                               "attention, nor with cuDNN, which has no such input)")
    use_qk_norm: bool = key(False, "llama4: an RMS norm without a scale over each query and key head of the rotary "
                            "layers (Llama 4 Scout); qwen3, qwen3_moe, qwen3_next and gemma3 always norm them, with scales of their own, "
                            "olmo3 and olmo2 all heads of a token at once, and they take true (MaxText's qwen3 and olmo3 model "
                            "files) as that")
    chunk_attn_window_size: int = key(0, "llama4: the rotary layers attend within chunks of this many tokens (a query "
                                      "sees the earlier tokens of its own chunk; Llama 4: 8192; 0: no chunks)",
                                      minimum=0, maximum=MAX_WINDOW)
    nope_layer_interval: int = key(0, "llama4: every this-many-th layer has no rotary positions and attends to the "
                                   "whole causal past (Llama 4: 4; 0: every layer rotates)", minimum=0)
    temperature_tuning: bool = key(False, "llama4: the layers without rotary positions scale a query at position p by "
                                   "s * ln(1 + floor((p + 1) / f)) + 1, sharpening attention over long contexts")
    temperature_tuning_scale: float = key(0.1, "temperature_tuning: s (Llama 4: 0.1)", minimum=0.0)
    temperature_tuning_floor_scale: float = key(8192.0, "temperature_tuning: f, in tokens (Llama 4: 8192)", minimum=1.0)
    interleave_moe_layer_step: int = key(1, "llama4: every this-many-th layer has experts, the others a dense MLP of "
                                         "base_mlp_dim (Llama 4 Maverick: 2; Scout: 1, experts everywhere)", minimum=1)
    partial_rotary_factor: float = key(1.0, "the fraction of each query and key head that rotates (its first "
                                       "dimensions; the rest carry no position): qwen3_next's attention layers 0.25 "
                                       "(64 of 256)", minimum=0.0, maximum=1.0)
    gdn_num_key_heads: int = key(16, "qwen3_next: query and key heads of the Gated DeltaNet (linear attention) "
                                 "layers (Qwen3-Next: 16)", minimum=1)
    gdn_num_value_heads: int = key(32, "qwen3_next: value heads of the Gated DeltaNet layers, each with its own "
                                   "memory; a multiple of gdn_num_key_heads (Qwen3-Next: 32)", minimum=1)
    gdn_key_head_dim: int = key(128, "qwen3_next: dimension of a Gated DeltaNet query and key head", minimum=1)
    gdn_value_head_dim: int = key(128, "qwen3_next: dimension of a Gated DeltaNet value head", minimum=1)
    gdn_conv_kernel_dim: int = key(4, "qwen3_next: width of the causal depthwise convolution over the Gated "
                                   "DeltaNet's queries, keys and values (Qwen3-Next: 4)", minimum=1)
    gdn_chunk_size: int = key(64, "qwen3_next: the gated delta rule runs in chunks of this many tokens (matmuls "
                              "within a chunk, a sequential step between chunks); the same result for any size",
                              minimum=1)
    gdn_kernel: str = key("autoselected", "qwen3_next: what runs the gated delta rule's recurrence over the chunks in "
                          "training and a decoded prompt: pallas (a Pallas TPU kernel holding each head's memory in "
                          "VMEM; TPUs only, elsewhere xla with one logged line), xla (an XLA loop) or autoselected "
                          "(pallas on TPUs, else xla); a decoded token always uses xla", ("autoselected", "pallas", "xla"))
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
    base_moe_mlp_dim: int = key(0, "hidden width of one expert before scaling (0: base_mlp_dim); when set, "
                                "base_mlp_dim sizes only dense layers (deepseek's first ones, llama4's between "
                                "expert layers)", minimum=0)
    first_num_dense_layers: int = key(0, "deepseek: this many layers at the bottom have a dense MLP (base_mlp_dim) "
                                      "instead of experts", minimum=0)
    shared_experts: int = key(0, "deepseek and qwen3_next (behind a sigmoid gate): experts every token goes "
                              "through (one dense MLP shared_experts x the expert width wide), added to the routed "
                              "experts' output", minimum=0)
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
                                "topk_routing_group best groups (scored as routing_group_score says); -1: no groups")
    topk_routing_group: int = key(-1, "MoE with n_routing_groups: groups a token may take experts from")
    routing_group_score: str = key("top2_sum", "MoE with n_routing_groups: a group's score, by which a token's groups "
                                   "are chosen: the sum of its two best experts' scores (DeepSeek-V3) or its best "
                                   "expert's score (max: DeepSeek-V2)", ("top2_sum", "max"))
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
                              "not used in decoding (0: none)", minimum=0, maximum=MAX_MTP_LAYERS)
    mtp_loss_scaling_factor: float = key(0.1, "mtp_num_layers > 0: weight of the multi-token-prediction loss (the "
                                         "mean over its blocks) in the training loss (DeepSeek-V3: 0.3, then 0.1)",
                                         minimum=0.0)
    mtp_eval_target_module: int = key(0, "mtp_num_layers > 0: evaluation also reports how often block k's greedy "
                                      "guess equals the main model's k tokens later (the acceptance rate of "
                                      "speculative decoding with it, eval_mtp_acceptance_rate_percent; 0: not measured)",
                                      minimum=0)
    z_loss_multiplier: float = key(0.0, "weight of the z-loss in the training objective: z_loss_multiplier x log(Z)^2 "
                                   "per target token, Z the output softmax's normalizer (it keeps log Z near 0; PaLM: "
                                   "1e-4), of the main output (not the multi-token-prediction blocks'). The logged "
                                   "loss stays the cross-entropy; the term is logged as z_loss (0: none)", minimum=0.0)

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
        """The rotary theta of the local layers of gemma3 and olmo3: local_rope_max_timescale, or with -1 the
        global one."""
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
