"""The building blocks of the config schema: `key`, which declares one key (default, comment,
allowed values or range, path kind), and the allowed values and limits the sections name. The
sections are in `schema.py` and, for the model's architecture, `model_schema.py`.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

# The decoder blocks and attention kernels are listed here (not imported from the model
# package) so that validating a config never imports JAX.
DECODER_BLOCKS = ("llama2", "mistral", "mixtral", "gemma", "gemma2", "gpt3", "qwen2", "qwen3", "qwen3_moe", "gemma3",
                  "deepseek", "gpt_oss", "llama4", "olmo3", "olmo2", "qwen3_next")
# families of OLMo's layer: norms after attention and the MLP only, query and key norms over all heads
OLMO_BLOCKS = ("olmo3", "olmo2")
# families whose MLP is a mixture of experts (num_experts >= 2)
MOE_BLOCKS = ("mixtral", "qwen3_moe", "deepseek", "gpt_oss", "llama4", "qwen3_next")
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
# matmul_precision: jax.lax.Precision's names (MaxText's), then JAX's aliases of them (older MaxText wrote float32)
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
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
MU_DTYPES = ("", "float32", "bfloat16")  # mu_dtype: MaxText's key ('': the parameters' dtype)
LR_SCHEDULES = ("cosine", "wsd")  # lr_schedule_type: MaxText's names
WSD_DECAY_STYLES = ("linear", "cosine")  # wsd_decay_style: MaxText's names
# Widest attention head accepted (the widest of the model files: 256). Building a model keeps a
# rotary frequency per pair of head dimensions: a typo of 10^9 exhausted the host's memory.
MAX_HEAD_DIM = 65536
# Deepest model accepted (the deepest model file: 126 layers); the planner and the FLOPs count go
# through the layers one by one: a typo of 10^9 exhausted the host's memory there.
MAX_LAYERS = 65536
# Most multi-token-prediction blocks accepted (DeepSeek-V3 has 1): each is a block of its own, built and compiled
# one after the other (not scanned), 27 ms apiece to build on a CPU host before any compile: a typo of 10^6 ran
# for hours without a line.
MAX_MTP_LAYERS = 1024
# Most data-loading worker processes accepted (grain_worker_count): Grain starts each as a Python process of its own
# (mp_prefetch), and a typo of 10^14 was accepted as it stood.
MAX_DATA_WORKERS = 1024
# Token positions are int32 (JAX's default integer): a window of attention past 2^31 - 1 tokens reached the attention
# mask as a Python int and stopped the first step with an OverflowError traceback.
MAX_WINDOW = 2**31 - 1
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
