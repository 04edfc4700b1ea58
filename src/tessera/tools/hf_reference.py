"""Hugging Face reference side of the parity checks: tiny random checkpoints and their logits.

Run BY THE REFERENCE INTERPRETER (.venv-hf, see requirements-hf.txt), never imported by
Tessera: it imports only the standard library, numpy, torch, transformers and safetensors.
It lives in the package only so that it ships with it; `tessera.tools.hf_env` calls it.

    python hf_reference.py tiny FAMILY OUT_DIR [--seed N] [--max-shard-size 20KB]
    python hf_reference.py logits HF_DIR IN_NPZ OUT_NPZ
    python hf_reference.py info HF_DIR
    python hf_reference.py mxfp4 IN_NPZ OUT_NPZ
    python hf_reference.py batch COMMANDS_JSON

`batch` runs the commands listed in COMMANDS_JSON (a JSON list of argument lists, such as
[["tiny", "llama2", "out/llama2"], ["logits", "out/llama2", "in.npz", "out.npz"]]) one after
another in this one process: starting the interpreter and importing torch and transformers
costs seconds, more than a tiny model's command.

`tiny` writes a plain Hugging Face checkpoint (config.json + safetensors, sharded with an
index when --max-shard-size is small) of a float32 model with small, unequal sizes (hidden 24,
4 query heads of head_dim 8, 2 kv heads, MLP 40, vocab 97) so that mixed-up dimensions fail,
and weights of std ~0.2 plus seeded noise on every parameter (norm scales and biases too) so
that differences are not hidden by near-zero activations.

`mxfp4` reads MXFP4 `blocks` and `scales` (uint8, as gpt-oss's released checkpoints store its experts)
from IN_NPZ and writes `values`, the float32 tensor transformers makes of them for its gpt-oss experts.

`logits` reads `input_ids` [B, T] and optional `attention_mask` / `position_ids` [B, T] from
IN_NPZ and writes `logits` float32 [B, T, V] (and, for MoE models, `router_logits`
[layers, B*T, E]) to OUT_NPZ. It runs eager attention in eval mode without a KV cache. Without
a cache, transformers treats `position_ids` that restart (and no attention_mask) as packed
sequences and masks across them; when position_ids is omitted it uses 0..T-1 for every row,
whatever the padding. Logits at padded positions are not meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; read when the hub is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

# Shared tiny sizes: small and pairwise different, with head_dim * heads != hidden.
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, MAX_POS = 97, 24, 4, 2, 8, 40, 2, 64
INIT_STD = 0.2  # initializer_range: 10x Hugging Face's default 0.02
NOISE_STD = 0.1  # added to every parameter after init, so norm scales and biases are random too
SLIDING_WINDOW = 5  # Mistral / Gemma 2: shorter than the 9-token test sequences
FAMILIES = ("llama2", "llama3", "mistral", "mixtral", "gemma", "gemma2", "gpt2", "qwen2", "qwen3", "qwen3_moe", "gemma3",
            "deepseek", "deepseek_v2", "gpt_oss", "llama_bias_yarn", "llama4", "gemma3_multimodal", "olmo3", "olmo2", "qwen3_next")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek", "deepseek_v2", "gpt_oss", "llama4", "qwen3_next")  # built by _moe_config


def _yarn(truncate: bool) -> dict:
    # head_dim 8 at theta 10000 over an original context of 1024: YaRN's ramp runs from dimension 0.71 to
    # 2.21, so of the 4 frequencies the first is kept, two are mixed and the last is divided by the factor,
    # and rounding the ramp's ends outwards (truncate) changes the mixed two
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate}


def _decoder_kwargs(**overrides) -> dict:
    """Llama-style config keys shared by the RoPE families."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, initializer_range=INIT_STD,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kwargs.update(overrides)
    return kwargs


def _llama3_rope() -> dict:
    # head_dim 8 at theta 500000 has wavelengths 6.3, 167, 4443 and 1.2e5 tokens. With an
    # original context of 256 (high-freq cut 256/4 = 64, low-freq cut 256/1 = 256) they hit
    # all three llama3 branches: kept, smoothed, divided by the factor.
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def _config(family: str):
    """Returns (model class, config) of one tiny family."""
    if family in MOE_FAMILIES:
        return _moe_config(family)
    t = transformers
    if family == "llama2":
        return t.LlamaForCausalLM, t.LlamaConfig(**_decoder_kwargs())
    if family == "llama3":
        # max_position_embeddings must exceed the original context (transformers warns otherwise)
        return t.LlamaForCausalLM, t.LlamaConfig(
            **_decoder_kwargs(rope_parameters=_llama3_rope(), max_position_embeddings=512))
    if family == "mistral":
        return t.MistralForCausalLM, t.MistralConfig(**_decoder_kwargs(sliding_window=SLIDING_WINDOW))
    if family == "gemma":
        # Gemma reads `hidden_act`, Gemma 2 `hidden_activation` (transformers 5.23)
        return t.GemmaForCausalLM, t.GemmaConfig(**_decoder_kwargs(
            hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True))
    if family == "gemma2":
        return t.Gemma2ForCausalLM, t.Gemma2Config(**_decoder_kwargs(
            num_hidden_layers=4, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
            tie_word_embeddings=True, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=12,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    if family == "qwen2":  # query, key and value biases, no output bias; untied, as in Qwen2.5 7B and larger
        return t.Qwen2ForCausalLM, t.Qwen2Config(**_decoder_kwargs(rms_norm_eps=1e-6))
    if family == "qwen3":  # the output tied to the embedding, as in Qwen3 0.6B to 4B (qwen3_moe's is untied)
        return t.Qwen3ForCausalLM, t.Qwen3Config(**_decoder_kwargs(rms_norm_eps=1e-6, tie_word_embeddings=True))
    if family == "gemma3":
        # 8 layers: one 5-local/1-global pattern and 2 more local layers; global rotary with linear scaling
        return t.Gemma3ForCausalLM, t.Gemma3TextConfig(**_decoder_kwargs(
            num_hidden_layers=8, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
            sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=12,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))
    if family == "olmo3":
        # 6 layers: one 3-local/1-global pattern and 2 more local layers; YaRN on the global layers only, and the
        # local layers at another theta, so that swapping them shows
        return t.Olmo3ForCausalLM, t.Olmo3Config(**_decoder_kwargs(
            num_hidden_layers=6, rms_norm_eps=1e-6, sliding_window=SLIDING_WINDOW, max_position_embeddings=4096,
            rope_parameters={"full_attention": _yarn(True),
                             "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}))
    if family == "olmo2":
        # OLMo 3's layer with every layer global and one rotary embedding; 5 layers (converted into olmo2, and into
        # olmo3 without windows: a whole 4-layer pattern, then a tail); Olmo2Config has no head_dim (hidden_size /
        # heads: 6)
        kwargs = _decoder_kwargs(num_hidden_layers=5, rms_norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 20000.0})
        del kwargs["head_dim"]
        return t.Olmo2ForCausalLM, t.Olmo2Config(**kwargs)
    if family == "gemma3_multimodal":
        # the tiny Gemma 3 as the language model of a Gemma3ForConditionalGeneration, beside a one-layer vision tower
        vision = t.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14)
        return t.Gemma3ForConditionalGeneration, t.Gemma3Config(
            text_config=_config("gemma3")[1], vision_config=vision, mm_tokens_per_image=4, initializer_range=INIT_STD)
    if family == "llama_bias_yarn":
        # Llama with biases on its attention and MLP projections, and YaRN rounded outwards
        return t.LlamaForCausalLM, t.LlamaConfig(**_decoder_kwargs(
            attention_bias=True, mlp_bias=True, max_position_embeddings=4096, rope_parameters=_yarn(True)))
    if family == "gpt2":
        return t.GPT2LMHeadModel, t.GPT2Config(
            vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
            n_inner=MLP, activation_function="gelu_new", layer_norm_epsilon=1e-5,
            initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")


def _moe_config(family: str):
    """Returns (model class, config) of one tiny family with experts."""
    t = transformers
    if family == "mixtral":
        return t.MixtralForCausalLM, t.MixtralConfig(**_decoder_kwargs(
            sliding_window=None, num_local_experts=4, num_experts_per_tok=2))
    if family == "qwen3_moe":
        # fine-grained: 8 experts narrower (16) than the dense width (40, unused), 3 chosen per token
        return t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(**_decoder_kwargs(
            rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True))
    if family == "deepseek":
        # MLA (query rank 20, latent 12, per head 6 + 16 rotary query/key and 10 value dims); YaRN x4 over an
        # original context of 1024, where the 8 rotary frequencies fall in all three of YaRN's regimes (index 0
        # kept, 1..5 mixed, 6..7 divided); 1 dense layer, then 2 layers of 8 experts in 4 groups (2 allowed
        # per token, 3 experts chosen) plus a shared expert
        kwargs = _decoder_kwargs(
            num_hidden_layers=3, num_key_value_heads=HEADS, rms_norm_eps=1e-6, moe_intermediate_size=12,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=20,
            kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=16, v_head_dim=10, max_position_embeddings=4096,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
        del kwargs["head_dim"]
        return t.DeepseekV3ForCausalLM, t.DeepseekV3Config(**kwargs)
    if family == "deepseek_v2":
        # DeepSeek-V2: MLA without query compression (a full query projection), YaRN x4 with V2's mscale 0.707;
        # 1 dense layer, then 2 layers of 8 experts in 4 groups ranked by their best expert's softmax score (2
        # allowed per token, 3 experts chosen, weighted by their scores x 1.5, not renormalized) and 2 shared experts
        kwargs = _decoder_kwargs(
            num_hidden_layers=3, num_key_value_heads=HEADS, rms_norm_eps=1e-6, moe_intermediate_size=12,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
            n_shared_experts=2, routed_scaling_factor=1.5, first_k_dense_replace=1, norm_topk_prob=False,
            q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=16, v_head_dim=10,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 0.707, "mscale_all_dim": 0.707})
        del kwargs["head_dim"]
        return t.DeepseekV2ForCausalLM, t.DeepseekV2Config(**kwargs)
    if family == "gpt_oss":
        # 2 pairs of a sliding-window and a full-attention layer; 4 experts, 2 chosen; a clamp low enough
        # (0.5) to clip many gate and up values of these weights; YaRN without truncation
        return t.GptOssForCausalLM, t.GptOssConfig(**_decoder_kwargs(
            num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
            swiglu_limit=0.5, attention_bias=True, max_position_embeddings=4096, rope_parameters=_yarn(False)))
    if family == "qwen3_next":
        # 6 layers: one 3-linear/1-full pattern, then 2 more linear layers; Gated DeltaNets of 2 key heads (8 wide)
        # serving 4 value heads (6 wide); attention rotating half of each head; 8 experts, 3 chosen, and a shared
        # expert twice as wide behind its gate
        return t.Qwen3NextForCausalLM, t.Qwen3NextConfig(**_decoder_kwargs(
            num_hidden_layers=6, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, norm_topk_prob=True))
    if family == "llama4":
        # 8 layers, two of each 4-layer pattern (three rotary layers in chunks of 5, then a NoPE layer with the
        # temperature, which a floor scale of 3 turns on from the third token), experts (4, one chosen, a shared
        # one) in every other layer and dense MLPs (40) between, q/k norms; Scout's rope scaling (both factors 1)
        # over an original context of 256, where the 4 frequencies are kept or divided
        return t.Llama4ForCausalLM, t.Llama4TextConfig(**_decoder_kwargs(
            num_hidden_layers=8, intermediate_size=16, intermediate_size_mlp=MLP, num_local_experts=4,
            num_experts_per_tok=1, interleave_moe_layer_step=2, use_qk_norm=True, attention_chunk_size=5,
            no_rope_layer_interval=4, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.1,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 1.0, "original_max_position_embeddings": 256}))
    raise ValueError(f"unknown family {family!r}; use one of {', '.join(MOE_FAMILIES)}")


def _shard_index(out_dir: Path) -> Path:
    return out_dir / "model.safetensors.index.json"


def make_tiny(family: str, out_dir: Path, seed: int, max_shard_size: str | None) -> None:
    """Builds the tiny random float32 model of `family` and saves it to `out_dir`."""
    torch.manual_seed(seed)
    model_cls, config = _config(family)
    model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():  # tied weights appear once
            param.add_(NOISE_STD * torch.randn(param.shape, generator=noise, dtype=param.dtype))
        for name, buffer in model.named_buffers():  # DeepSeek's routing biases are buffers (zero at init)
            if name.endswith("e_score_correction_bias"):
                buffer.add_(NOISE_STD * torch.randn(buffer.shape, generator=noise, dtype=buffer.dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    if max_shard_size:
        from transformers.utils.hub import convert_file_size_to_int
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        if total > convert_file_size_to_int(max_shard_size) and not _shard_index(out_dir).exists():
            raise RuntimeError(f"{family}: {total} bytes of parameters with max_shard_size={max_shard_size} "
                               f"but save_pretrained wrote no {_shard_index(out_dir).name} in {out_dir}")
    files = sorted(p.name for p in out_dir.glob("*.safetensors"))
    print(f"{family}: {model_cls.__name__}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"{len(files)} safetensors file(s) in {out_dir}")


def _check_checkpoint(hf_dir: Path) -> None:
    if not (hf_dir / "config.json").is_file():
        raise SystemExit(f"{hf_dir} has no config.json: not a Hugging Face checkpoint folder "
                         f"(make one with: hf_reference.py tiny FAMILY {hf_dir})")


def reference_logits(hf_dir: Path, in_npz: Path, out_npz: Path) -> None:
    """Runs the checkpoint in `hf_dir` on the inputs of `in_npz`; writes logits to `out_npz`."""
    _check_checkpoint(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    # every parameter copied into memory of its own: loaded, they are views into the checkpoint's files, whose
    # placement (one file or shards) changed torch's CPU results (Qwen3-Next: the same bytes, strides and buffers
    # gave logits 2.4e-6 apart, equal after this copy), so a round trip could not be compared exactly
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    with np.load(in_npz) as inputs:
        kwargs = {key: torch.from_numpy(inputs[key].astype(np.int64))
                  for key in ("input_ids", "attention_mask", "position_ids") if key in inputs}
    if "input_ids" not in kwargs:
        raise ValueError(f"{in_npz} has no input_ids (keys: {sorted(np.load(in_npz).keys())})")
    is_moe = getattr(model.config, "num_local_experts", None) is not None
    if is_moe:
        kwargs["output_router_logits"] = True
    with torch.no_grad():
        out = model(**kwargs, use_cache=False)
    arrays = {"logits": out.logits.float().numpy()}
    if is_moe and getattr(out, "router_logits", None):
        arrays["router_logits"] = torch.stack([r.float() for r in out.router_logits]).numpy()
    np.savez(out_npz, **arrays)
    print(", ".join(f"{k} {v.shape}" for k, v in arrays.items()))


def mxfp4(in_npz: Path, out_npz: Path) -> None:
    """transformers' dequantization of an MXFP4 pair (blocks, scales) of IN_NPZ, written as `values`."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    with np.load(in_npz) as arrays:
        blocks, scales = torch.from_numpy(arrays["blocks"]), torch.from_numpy(arrays["scales"])
    values = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    np.savez(out_npz, values=values.numpy())
    print(f"values {tuple(values.shape)}")


def checkpoint_tensors(hf_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, dtype) as stored in the safetensors files of `hf_dir`."""
    from safetensors import safe_open
    index = _shard_index(hf_dir)
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        with safe_open(hf_dir / name, framework="np") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                tensors[key] = (tuple(sl.get_shape()), sl.get_dtype())
    return tensors


def info(hf_dir: Path) -> None:
    """Prints model_type and the checkpoint's tensor names with shapes."""
    _check_checkpoint(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    print(f"model_type: {config.get('model_type')}  architectures: {config.get('architectures')}")
    for key, (shape, dtype) in sorted(checkpoint_tensors(hf_dir).items()):
        print(f"  {key:60s} {list(shape)} {dtype}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("tiny", help="save a tiny random checkpoint of one family")
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default=None, help='e.g. "20KB" for a sharded checkpoint')
    p = sub.add_parser("logits", help="logits of a checkpoint on input_ids from an .npz")
    p.add_argument("hf_dir", type=Path)
    p.add_argument("in_npz", type=Path)
    p.add_argument("out_npz", type=Path)
    p = sub.add_parser("info", help="model_type and tensor names/shapes of a checkpoint")
    p.add_argument("hf_dir", type=Path)
    p = sub.add_parser("mxfp4", help="transformers' values of MXFP4 blocks and scales from an .npz")
    p.add_argument("in_npz", type=Path)
    p.add_argument("out_npz", type=Path)
    p = sub.add_parser("batch", help="run the commands of a JSON list of argument lists, in order")
    p.add_argument("commands_json", type=Path)
    args = parser.parse_args(argv)

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.command == "tiny":
        make_tiny(args.family, args.out_dir, args.seed, args.max_shard_size)
    elif args.command == "logits":
        reference_logits(args.hf_dir, args.in_npz, args.out_npz)
    elif args.command == "mxfp4":
        mxfp4(args.in_npz, args.out_npz)
    elif args.command == "batch":
        for command in json.loads(args.commands_json.read_text()):
            if not command or command[0] == "batch":
                raise SystemExit(f"{args.commands_json}: {command!r} is not a command a batch can run")
            main([str(a) for a in command])
    else:
        info(args.hf_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
