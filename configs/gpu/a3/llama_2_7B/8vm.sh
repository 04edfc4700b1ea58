#!/usr/bin/env bash
# Recipe: Llama 2 7B on 8 A3 VMs (8 NVIDIA H100 80GB GPUs each, 64 GPUs), fully sharded data parallel
# over all 64 GPUs, sequence length 4096, 4 sequences per GPU (global batch 256).
# Expected performance and how it was derived: configs/gpu/a3/README.md. Flags: configs/README.md.
#
# Run the same command on each of the 8 VMs, with that VM's NODE_RANK (0..7) and the
# internal IP of the VM with NODE_RANK=0 (see getting_started/GPU_multi_node.md):
#   bash configs/gpu/a3/llama_2_7B/8vm.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs \
#       JAX_COORDINATOR_IP=10.0.0.2 NODE_RANK=0
#   bash configs/gpu/a3/llama_2_7B/8vm.sh DRY_RUN=1          # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../../run_recipe.sh" "$@"

export NNODES=8
source "$(dirname "${BASH_SOURCE[0]}")/a3_llama2_7b.inc"
