#!/usr/bin/env bash
# Recipe: Mixtral 8x7B at sequence length 4096 (46.7B parameters, 12.9B active per token)
# on one TPU v6e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Routing: capacity routing (capacity_factor=1.25, sparse_matmul=false) instead of the model
# file's dropless routing: AOT-compiled, capacity needs 13.21 GiB per chip and dropless
# (sparse_matmul=true, each device sorting its own tokens) 14.62.
# Mesh: 2-way tensor parallelism, so the 8 experts of a layer gathered by FSDP are half as
# large and FSDP has twice the tokens per gather.
# Expected performance and how it was derived: configs/tpu/v6e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v6e/mixtral_8x7b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v6e/mixtral_8x7b.sh EXECUTABLE=train_compile      # AOT-compile for v6e-256 on any host
#   bash configs/tpu/v6e/mixtral_8x7b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v6e recipe

run_recipe v6e-256 \
  model_name=mixtral-8x7b sparse_matmul=false capacity_factor=1.25 \
  ici_tensor_parallelism=2 per_device_batch_size=2 max_target_length=4096 dtype=bfloat16 remat_policy=full \
  steps=100 log_period=10
