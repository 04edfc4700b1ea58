#!/usr/bin/env bash
# Recipe: the 128B member of the scaling family (model_name=1b global_parameter_scale=128: 125.1B parameters)
# on one TPU v5e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Mesh: 8-way tensor parallelism (32-way FSDP) and remat_policy=save_dot_except_mlp, the plan's
# first choice at this batch (tessera.tools.plan; 11.22 GiB per chip AOT), and bfloat16 weights
# and AdamW moments: with float32 ones the state alone is 5.5 GiB of the chip's 16 GiB.
# Expected performance and how it was derived: configs/tpu/v5e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5e/128b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5e/128b.sh EXECUTABLE=train_compile      # AOT-compile for v5e-256 on any host
#   bash configs/tpu/v5e/128b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5e recipe

run_recipe v5e-256 \
  model_name=1b global_parameter_scale=128 \
  ici_tensor_parallelism=8 per_device_batch_size=0.25 max_target_length=2048 dtype=bfloat16 weight_dtype=bfloat16 remat_policy=save_dot_except_mlp \
  steps=100 log_period=10
