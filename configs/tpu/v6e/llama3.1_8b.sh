#!/usr/bin/env bash
# Recipe: Llama 3.1 8B (8.0B parameters)
# on one TPU v6e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Expected performance and how it was derived: configs/tpu/v6e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v6e/llama3.1_8b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v6e/llama3.1_8b.sh EXECUTABLE=train_compile      # AOT-compile for v6e-256 on any host
#   bash configs/tpu/v6e/llama3.1_8b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v6e recipe

run_recipe v6e-256 \
  model_name=llama3.1-8b \
  per_device_batch_size=2 max_target_length=2048 dtype=bfloat16 remat_policy=minimal \
  steps=100 log_period=10
