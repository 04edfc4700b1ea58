"""The choice of attention kernel (`attention`): the fastest fused kernel the device has that
computes every feature of the model's attention, else the reference (`attention.py`).

`flash`, `cudnn_flash_te` and `autoselected` ask for the fused kernel: on TPUs Pallas splash
attention (`splash.py`: every feature of the reference, packed segments included); on NVIDIA GPUs
cuDNN's fused attention, except for soft-capped scores (Gemma 2), sink logits (gpt-oss) and
chunks shorter than the sequence (Llama 4), which cuDNN cannot apply. Where no fused kernel
applies (CPU, an unsupported dtype, head size or sequence length) the reference runs and
`select_attention` says why; the trainer logs it once.
"""

from __future__ import annotations

from typing import NamedTuple

from tessera.config import ModelConfig


class AttentionChoice(NamedTuple):
    kernel: str  # "dot_product", "cudnn" or "splash" ("splash_interpret": splash in Pallas' interpreter, for tests)
    reason: str


def select_attention(m: ModelConfig, platform: str, length: int | None = None,
                     mesh_shape: dict[str, int] | None = None) -> AttentionChoice:
    """Pick the attention kernel for model config `m` on `platform` ("cpu", "gpu", "tpu", ...),
    for sequences of `length` tokens on a mesh of `mesh_shape`.

    It takes the whole model config, so that every feature a family's attention has (score soft
    caps, windows, head size, dtype) is checked against the kernel: a kernel that would ignore
    one is never chosen. On TPU, splash attention has them all; its block sizes (sa_block_*)
    are checked against `length` here (ConfigError)."""
    requested, dtype, head_dim, logits_soft_cap = m.attention, m.dtype, m.head_dim, m.attn_logits_soft_cap
    if requested == "dot_product":
        return AttentionChoice("dot_product", "attention=dot_product requested")
    if platform == "tpu":
        from tessera.models import splash

        why = splash.unsupported(m, length or 0, mesh_shape)
        if why:
            return AttentionChoice("dot_product", why)
        shards = (mesh_shape or {}).get("sequence", 1)
        blocks = splash.block_sizes(m, length, shards)
        split = ""
        if shards > 1:
            if splash.load_balanced(m, length, shards):
                how = "load-balanced"
            elif m.context_parallel_load_balance:
                how = f"in contiguous parts (a balanced split needs a multiple of {2 * shards * splash.LANE})"
            else:
                how = "in contiguous parts"
            split = f", queries split {shards} ways over the sequence axis, {how}"
        return AttentionChoice("splash", f"attention={requested}: Pallas splash attention on TPU "
                                         f"(blocks q {blocks.block_q}, kv {blocks.block_kv}{split})")
    if logits_soft_cap:
        return AttentionChoice("dot_product", f"attn_logits_soft_cap={logits_soft_cap:g} needs the reference kernel "
                                              "(no fused kernel here caps scores)")
    if m.attention_sink:
        return AttentionChoice("dot_product", "attention_sink=true needs the reference kernel (cuDNN's fused "
                                              "attention has no sink logits)")
    if attends_in_chunks(m, length):
        return AttentionChoice("dot_product", f"chunk_attn_window_size={m.chunk_attn_window_size} is shorter than the "
                                              f"sequences ({length} tokens): Llama 4's chunked layers need the "
                                              "reference kernel (cuDNN's fused attention has no chunk mask)")
    if platform not in ("gpu", "cuda"):
        return AttentionChoice("dot_product", f"no fused attention kernel is wired for platform {platform!r}")
    if dtype not in ("bfloat16", "float16"):
        return AttentionChoice("dot_product", f"cuDNN fused attention needs bfloat16/float16 compute, not dtype={dtype}")
    if head_dim > 256 or head_dim % 8:
        return AttentionChoice("dot_product", f"cuDNN fused attention needs head_dim <= 256 and a multiple of 8, not {head_dim}")
    return AttentionChoice("cudnn", f"attention={requested}: cuDNN fused attention on {platform}")


def attends_in_chunks(m: ModelConfig, length: int | None) -> bool:
    """Whether Llama 4's chunked layers see less than the causal past of sequences of `length` tokens."""
    chunk = m.chunk_attn_window_size if m.decoder_block == "llama4" else 0
    return bool(chunk) and (length is None or length > chunk)
