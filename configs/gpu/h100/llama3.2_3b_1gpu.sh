#!/usr/bin/env bash
# Recipe: Llama 3.2 3B on one NVIDIA H100 80GB GPU: the largest Llama that trains with AdamW
# (float32 weights and moments) on one 80 GB GPU; our single-GPU MFU showcase.
# Sequence length 4096, 2 sequences per step, bf16 compute, cuDNN fused attention.
# Expected performance and how it was derived: configs/gpu/h100/README.md. Flags: configs/README.md.
#
#   bash configs/gpu/h100/llama3.2_3b_1gpu.sh RUN_NAME=my_run OUTPUT_PATH=outputs
#   bash configs/gpu/h100/llama3.2_3b_1gpu.sh DRY_RUN=1        # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false \
  --xla_disable_hlo_passes=rematerialization"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9

run_recipe gpu \
  model_name=llama3.2-3b \
  per_device_batch_size=2 max_target_length=4096 dtype=bfloat16 remat_policy=save_qkv_proj attention=cudnn_flash_te \
  steps=100 log_period=10
