#!/usr/bin/env bash
# Recipe: Llama 3.2 3B on one NVIDIA H100 80GB GPU: the largest Llama that trains with AdamW
# (float32 weights and moments) on one 80 GB GPU; our single-GPU MFU showcase.
# Sequence length 4096, 2 sequences per step, bf16 compute, cuDNN fused attention.
# Expected performance and how it was derived: configs/gpu/h100/README.md. Flags: configs/README.md.
#
#   bash configs/gpu/h100/llama3.2_3b_1gpu.sh RUN_NAME=my_run OUTPUT_PATH=outputs
#   bash configs/gpu/h100/llama3.2_3b_1gpu.sh DRY_RUN=1        # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

# optimization_level=O1 (below) brings XLA's GPU bundle; on one GPU there are no collectives to
# overlap, so what it changes here is the unrolled (double-buffered) layer loop. The two flags
# are outside that bundle: cuBLAS matmuls, and no rematerialization of XLA's own (remat_policy decides).
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false \
  --xla_disable_hlo_passes=rematerialization"

run_recipe gpu \
  model_name=llama3.2-3b \
  per_device_batch_size=2 max_target_length=4096 dtype=bfloat16 remat_policy=save_qkv_proj attention=cudnn_flash_te \
  optimization_level=O1 xla_python_client_mem_fraction=0.9 \
  steps=100 log_period=10
