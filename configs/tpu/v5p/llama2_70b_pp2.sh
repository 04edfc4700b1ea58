#!/usr/bin/env bash
# Recipe: Llama 2 70B (69.0B parameters), pipelined over DCN
# on two TPU v5p-128 slices (2 x 64 chips): the 80 layers are split into 2 pipeline stages, one
# per slice, so only activations cross the data-center network (no gradient all-reduce); FSDP
# over the 64 chips inside each slice; circular schedule with 4 repeats (10 layers per group),
# 8 microbatches, bubble 1/33. PLATFORM=gce runs rto_setup.sh first.
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/llama2_70b_pp2.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/llama2_70b_pp2.sh EXECUTABLE=train_compile   # AOT-compile for 2 x v5p-128 on any host
#   bash configs/tpu/v5p/llama2_70b_pp2.sh DRY_RUN=1                  # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
NUM_SLICES=${NUM_SLICES:-2}  # the recipe's slice count (EXECUTABLE=train_compile compiles for it)
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-128 \
  model_name=llama2-70b \
  per_device_batch_size=4 max_target_length=2048 dtype=bfloat16 remat_policy=save_dot_except_mlp \
  dcn_pipeline_parallelism=2 num_pipeline_repeats=4 \
  steps=100 log_period=10
