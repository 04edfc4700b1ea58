#!/usr/bin/env bash
# Recipe: Gemma 2 9B at sequence length 8192 (9.2B parameters)
# on one TPU v6e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Gemma 2 runs the reference attention (soft-capped scores), which keeps each layer's score
# matrix during the backward pass; with 256000-token logits that sets one sequence per chip.
# Expected performance and how it was derived: configs/tpu/v6e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v6e/gemma2_9b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v6e/gemma2_9b.sh EXECUTABLE=train_compile      # AOT-compile for v6e-256 on any host
#   bash configs/tpu/v6e/gemma2_9b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v6e recipe

run_recipe v6e-256 \
  model_name=gemma2-9b \
  per_device_batch_size=1 max_target_length=8192 dtype=bfloat16 remat_policy=full \
  steps=100 log_period=10
