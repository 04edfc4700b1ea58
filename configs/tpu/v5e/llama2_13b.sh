#!/usr/bin/env bash
# Recipe: Llama 2 13B (13.0B parameters)
# on one TPU v5e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Expected performance and how it was derived: configs/tpu/v5e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5e/llama2_13b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5e/llama2_13b.sh EXECUTABLE=train_compile      # AOT-compile for v5e-256 on any host
#   bash configs/tpu/v5e/llama2_13b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5e recipe

run_recipe v5e-256 \
  model_name=llama2-13b \
  per_device_batch_size=2 max_target_length=2048 dtype=bfloat16 remat_policy=save_dot_except_mlp \
  steps=100 log_period=10
