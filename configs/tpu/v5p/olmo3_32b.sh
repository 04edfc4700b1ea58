#!/usr/bin/env bash
# Recipe: OLMo 3 32B (32.2B parameters; 3 sliding-window layers : 1 global layer, YaRN on the global ones)
# on one TPU v5p-128 slice (64 chips, 128 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/olmo3_32b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/olmo3_32b.sh EXECUTABLE=train_compile      # AOT-compile for v5p-128 on any host
#   bash configs/tpu/v5p/olmo3_32b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-128 \
  model_name=olmo3-32b \
  per_device_batch_size=1 max_target_length=8192 dtype=bfloat16 remat_policy=save_dot_except_mlp \
  steps=100 log_period=10
