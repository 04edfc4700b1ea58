#!/usr/bin/env bash
# Recipe: the 1024B member of the scaling family (model_name=1b global_parameter_scale=1024: 997.5B parameters)
# on one TPU v5p-2048 slice (1024 chips, 2048 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Mesh: 8-way tensor parallelism; one layer has 7.8B parameters, too many to gather whole on
# every chip as pure FSDP would, and 8 ways leave room to recompute no matmul
# (remat_policy=minimal): the plan's first choice, 66.86 GiB per chip AOT.
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/1024b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/1024b.sh EXECUTABLE=train_compile      # AOT-compile for v5p-2048 on any host
#   bash configs/tpu/v5p/1024b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-2048 \
  model_name=1b global_parameter_scale=1024 \
  ici_tensor_parallelism=8 per_device_batch_size=0.25 max_target_length=2048 dtype=bfloat16 remat_policy=minimal \
  steps=100 log_period=10
