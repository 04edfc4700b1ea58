#!/usr/bin/env bash
# Recipe: Llama 3.1 70B on 4 A3 VMs (8 NVIDIA H100 80GB GPUs each, 32 GPUs): 8-way tensor
# parallelism inside each VM (over NVLink) with collective matmul, 4-way fully sharded data
# parallelism across the VMs, sequence length 4096, global batch 16 (0.5 sequences per GPU).
# Expected performance and how it was derived: configs/gpu/a3/README.md. Flags: configs/README.md.
#
# Run the same command on each of the 4 VMs, with that VM's NODE_RANK (0..3) and the
# internal IP of the VM with NODE_RANK=0 (see getting_started/GPU_multi_node.md):
#   bash configs/gpu/a3/llama3.1_70b_tp8_4vm.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs \
#       JAX_COORDINATOR_IP=10.0.0.2 NODE_RANK=0
#   bash configs/gpu/a3/llama3.1_70b_tp8_4vm.sh DRY_RUN=1          # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

# What this recipe adds to the Llama 2 7B ones (a3_llama2_7b.inc explains the shared flags and
# what optimization_level=O1 replaces):
#   - collective matmul: XLA splits a matmul whose operand is sharded over the tensor axis into
#     chunks and sends each chunk while the next one computes (windowed einsum), on several
#     streams; threshold 0 applies it to every such matmul, whatever its size;
#   - NCCL user buffers: collectives read and write XLA's buffers directly, with no copy into
#     NCCL's own; they come from a separate pool, preallocated here at 2048 MiB
#     (XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB), which is why JAX takes 0.85 of the memory, not
#     0.9; NCCL_NVLS_ENABLE=1 lets all-gathers and reductions over NVSwitch use them;
#   - an HLO dump, to check that the matmuls were rewritten (getting_started/GPU_performance.md).
export NNODES=4
source "$(dirname "${BASH_SOURCE[0]}")/../shared_flags.inc"   # GPU_SHARED_XLA_FLAGS and the NCCL settings
export XLA_FLAGS="--xla_dump_to=/tmp/xla_dump/${RUN_NAME//[[:space:]]/_} \
  --xla_gpu_multi_streamed_windowed_einsum=true \
  --xla_gpu_threshold_for_windowed_einsum_mib=0 \
  --xla_gpu_enable_nccl_user_buffers=true \
  --xla_gpu_enable_command_buffer= \
  $GPU_SHARED_XLA_FLAGS"
export XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB=2048
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=1

run_recipe gpu \
  model_name=llama3.1-70b ici_tensor_parallelism=8 ici_fsdp_parallelism=-1 \
  per_device_batch_size=0.5 max_target_length=4096 dtype=bfloat16 remat_policy=full attention=cudnn_flash_te \
  optimization_level=O1 xla_python_client_mem_fraction=0.85 \
  steps=100 log_period=10
