#!/usr/bin/env bash
# Recipe: Llama 2 7B on one A3 VM (8 NVIDIA H100 80GB GPUs), fully sharded data parallel
# over all 8 GPUs, sequence length 4096, 4 sequences per GPU (global batch 32).
# Expected performance and how it was derived: configs/gpu/a3/README.md. Flags: configs/README.md.
#
#   bash configs/gpu/a3/llama_2_7B/1vm.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs
#   bash configs/gpu/a3/llama_2_7B/1vm.sh DRY_RUN=1          # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../../run_recipe.sh" "$@"

export NNODES=1
export XLA_FLAGS="--xla_dump_to=/tmp/xla_dump/$RUN_NAME \
  --xla_gpu_enable_latency_hiding_scheduler=true \
  --xla_gpu_enable_triton_gemm=false \
  --xla_gpu_enable_command_buffer= \
  --xla_gpu_all_reduce_combine_threshold_bytes=1073741824 \
  --xla_gpu_all_gather_combine_threshold_bytes=1073741824 \
  --xla_gpu_reduce_scatter_combine_threshold_bytes=1073741824 \
  --xla_gpu_enable_pipelined_all_gather=true \
  --xla_gpu_enable_pipelined_reduce_scatter=true \
  --xla_gpu_enable_pipelined_all_reduce=true \
  --xla_gpu_enable_while_loop_double_buffering=true \
  --xla_gpu_enable_all_gather_combine_by_dim=false \
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false \
  --xla_disable_hlo_passes=rematerialization"
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_PROTO=SIMPLE,LL,LL128
export NCCL_LL_BUFFSIZE=-2
export NCCL_LL128_BUFFSIZE=-2

run_recipe gpu \
  model_name=llama2-7b ici_fsdp_parallelism=-1 \
  per_device_batch_size=4 max_target_length=4096 dtype=bfloat16 remat_policy=save_qkv_proj attention=cudnn_flash_te \
  steps=100 log_period=10
