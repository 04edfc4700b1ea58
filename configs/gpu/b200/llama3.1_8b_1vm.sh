#!/usr/bin/env bash
# Recipe: Llama 3.1 8B on one VM with 8 NVIDIA B200 GPUs (180 GB each, e.g. an A4 VM), fully
# sharded data parallel over the 8 GPUs, sequence length 8192, 6 sequences per GPU (global batch 48).
# Expected performance and how it was derived: configs/gpu/b200/README.md. Flags: configs/README.md.
#
#   bash configs/gpu/b200/llama3.1_8b_1vm.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs
#   bash configs/gpu/b200/llama3.1_8b_1vm.sh DRY_RUN=1        # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

# Blackwell differs from the H100 recipes in three ways (getting_started/GPU_performance.md):
#   - CUDA graphs for fusions and custom calls (command buffers), to cut kernel-launch time;
#   - no CUDA_DEVICE_MAX_CONNECTIONS=1: on Blackwell a high-priority stream (collectives) gets
#     SMs without waiting, and one hardware queue only slows it down;
#   - 180 GB per GPU: 6 sequences per GPU instead of 4 and remat_policy=save_dot_except_mlp
#     (recompute only what is cheap) instead of save_qkv_proj.
# optimization_level=O1 brings the latency-hiding scheduler and pipelined collectives; the other
# flags are outside that bundle (see configs/gpu/a3/llama_2_7B/a3_llama2_7b.inc for why each stays).
export NNODES=1
source "$(dirname "${BASH_SOURCE[0]}")/../shared_flags.inc"   # GPU_SHARED_XLA_FLAGS and the NCCL settings
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL \
  $GPU_SHARED_XLA_FLAGS"

run_recipe gpu \
  model_name=llama3.1-8b ici_fsdp_parallelism=-1 \
  per_device_batch_size=6 max_target_length=8192 dtype=bfloat16 remat_policy=save_dot_except_mlp attention=cudnn_flash_te \
  optimization_level=O1 xla_python_client_mem_fraction=0.9 \
  steps=100 log_period=10
