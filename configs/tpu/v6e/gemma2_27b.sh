#!/usr/bin/env bash
# Recipe: Gemma 2 27B at sequence length 8192 (27.2B parameters)
# on one TPU v6e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Mesh: 4-way tensor parallelism splits the attention and the 256000-token logits of a
# sequence over four chips, with room to keep the attention matmuls' outputs
# (remat_policy=save_dot_except_mlp; the plan's first choice, 21.43 GiB per chip AOT); with
# FSDP alone and one sequence per chip the estimator puts the step at 39 GiB per chip.
# Expected performance and how it was derived: configs/tpu/v6e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v6e/gemma2_27b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v6e/gemma2_27b.sh EXECUTABLE=train_compile      # AOT-compile for v6e-256 on any host
#   bash configs/tpu/v6e/gemma2_27b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v6e recipe

run_recipe v6e-256 \
  model_name=gemma2-27b \
  ici_tensor_parallelism=4 per_device_batch_size=0.5 max_target_length=8192 dtype=bfloat16 remat_policy=save_dot_except_mlp \
  steps=100 log_period=10
