#!/usr/bin/env bash
# Recipe: the 128B member of the scaling family (model_name=1b global_parameter_scale=128: 125.1B parameters)
# on one TPU v5p-256 slice (128 chips, 256 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/128b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/128b.sh EXECUTABLE=train_compile      # AOT-compile for v5p-256 on any host
#   bash configs/tpu/v5p/128b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-256 \
  model_name=1b global_parameter_scale=128 \
  per_device_batch_size=4 max_target_length=2048 dtype=bfloat16 remat_policy=full \
  steps=100 log_period=10
