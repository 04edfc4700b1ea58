"""The choice of attention kernel (`attention`): the fastest fused kernel the device has that
computes every feature of the model's attention, else the reference (`attention.py`).

`flash`, `cudnn_flash_te` and `autoselected` ask for the fused kernel: on TPUs Pallas splash
attention (`splash.py`: every feature of the reference, packed segments included); on NVIDIA GPUs
cuDNN's fused attention, except for soft-capped scores (Gemma 2), sink logits (gpt-oss) and
chunks shorter than the sequence (Llama 4), which cuDNN cannot apply. Where no fused kernel
applies (CPU, AMD GPUs, NVIDIA GPUs before Ampere, an unsupported dtype, head size or sequence
length, a mesh that splits the sequence, or keys split unlike the queries) the reference runs and
`select_attention` says why; the trainer logs it once.

cuDNN's limits as `jax.nn.dot_product_attention(implementation="cudnn")` (jax 0.12) checks them:
head_dim a multiple of 8 and at most 256 on Hopper and later, 128 before (compute capability
< 9.0); queries, keys and values split alike over the mesh, and never along the sequence
("Sharding on sequence dim is not allowed"); cuDNN itself, which ROCm builds of JAX lack. And
cuDNN's own: an Ampere or later GPU (its documentation: "cudnn SDPA operation requires SM80
(Ampere) or newer"), which JAX does not check, so a V100 or T4 was handed the fused kernel.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from tessera.config import ModelConfig


class AttentionChoice(NamedTuple):
    kernel: str  # "dot_product", "cudnn" or "splash" ("splash_interpret": splash in Pallas' interpreter, for tests)
    reason: str


def select_attention(m: ModelConfig, platform: str, length: int | None = None,
                     mesh_shape: dict[str, int] | None = None, device_kind: str = "",
                     compute_capability: str = "", packed: bool = False) -> AttentionChoice:
    """Pick the attention kernel for model config `m` on `platform` ("cpu", "gpu", "tpu", ...),
    for sequences of `length` tokens on a mesh of `mesh_shape`. On a GPU, `device_kind` and
    `compute_capability` (a jax device's, "" when unknown, as for the estimator) tell NVIDIA from
    AMD and Hopper from older GPUs. `packed`: the batches hold several documents per row
    (packing=true with a dataset), whose segments cuDNN's call here cannot keep apart.

    It takes the whole model config, so that every feature a family's attention has (score soft
    caps, windows, head size, dtype) is checked against the kernel: a kernel that would ignore
    one is never chosen. On TPU, splash attention has them all; its block sizes (sa_block_*)
    are checked against `length` here (ConfigError)."""
    requested, dtype, logits_soft_cap = m.attention, m.dtype, m.attn_logits_soft_cap
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
    if platform not in ("gpu", "cuda"):  # (before the features: no fused kernel at all is the reason here)
        return AttentionChoice("dot_product", f"no fused attention kernel is wired for platform {platform!r}")
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
    if dtype not in ("bfloat16", "float16"):
        return AttentionChoice("dot_product", f"cuDNN fused attention needs bfloat16/float16 compute, not dtype={dtype}")
    why = _cudnn_unsupported(m, mesh_shape or {}, device_kind, compute_capability)
    if why:
        return AttentionChoice("dot_product", why)
    if packed:
        return AttentionChoice("dot_product", "packing=true: rows hold several documents, and cuDNN's fused attention "
                                              "as JAX calls it has no segment ids; packing=false (one document per "
                                              "row, padded) lets cuDNN run")
    return AttentionChoice("cudnn", f"attention={requested}: cuDNN fused attention on {platform}")


def _cudnn_unsupported(m: ModelConfig, mesh_shape: dict[str, int], device_kind: str,
                       compute_capability: str) -> str | None:
    """Why cuDNN's fused attention cannot run this model on this GPU and mesh, or None if it can."""
    if compute_capability.startswith("gfx") or "amd" in device_kind.lower().split():  # ROCm: "gfx942"
        return (f"cuDNN fused attention runs on NVIDIA GPUs, not on {device_kind or 'AMD GPUs'}"
                f"{f' ({compute_capability})' if compute_capability else ''}; no fused kernel is wired for them")
    nvidia_cc = re.fullmatch(r"(\d+)\.(\d+)", compute_capability)
    if nvidia_cc and int(nvidia_cc.group(1)) < 8:  # cuDNN's attention needs SM80; JAX does not check (V100, T4)
        return (f"cuDNN fused attention needs an Ampere or later GPU (compute capability 8.0 or above), not "
                f"{device_kind or 'this GPU'} (compute capability {compute_capability})")
    hopper = not nvidia_cc or int(nvidia_cc.group(1)) >= 9  # unknown: as the recipes' H100, H200, B200
    limit = 256 if hopper else 128
    # MLA pads queries and keys to a wider v_head_dim (models.mla): the kernel sees that width
    wide = m.decoder_block == "deepseek" and m.v_head_dim > m.head_dim
    width = m.v_head_dim if wide else m.head_dim
    if width > limit or width % 8:
        where = "" if hopper else f" before Hopper (compute capability {compute_capability})"
        return (f"cuDNN fused attention needs head_dim <= {limit}{where} and a multiple of 8, not {width}"
                + (" (v_head_dim, to which latent attention pads its queries and keys)" if wide else ""))
    sequence, tensor = mesh_shape.get("sequence", 1), mesh_shape.get("tensor", 1)
    if sequence > 1:
        return (f"cuDNN fused attention cannot take queries split over the sequence axis (sequence={sequence}); "
                "set ici_sequence_parallelism=1 (and dcn_) to use it")
    kv_heads = m.num_query_heads if m.decoder_block == "deepseek" else m.num_kv_heads  # MLA: a key per head
    if tensor > 1 and kv_heads % tensor:
        return (f"cuDNN fused attention needs keys split like the queries, but tensor={tensor} does not divide "
                f"num_kv_heads={kv_heads}, so the keys are not split over it")
    return None


def attends_in_chunks(m: ModelConfig, length: int | None) -> bool:
    """Whether Llama 4's chunked layers see less than the causal past of sequences of `length` tokens."""
    chunk = m.chunk_attn_window_size if m.decoder_block == "llama4" else 0
    return bool(chunk) and (length is None or length > chunk)
