#!/usr/bin/env bash
# Recipe: GPT-3 175B (174.6B parameters)
# on one or more TPU v5e-256 slices (256 chips each); PLATFORM=gce runs rto_setup.sh first.
# Mesh: 8-way tensor parallelism (32-way FSDP), one sequence per 8 chips, and bfloat16 weights
# and AdamW moments as in 128b.sh (in float32 those alone would take 7.6 GiB of the chip's 16).
# With 4-way tensor parallelism and one sequence per 4 chips the AOT compile needs 14.6 GiB per
# chip (remat_policy=full), 0.6 GiB under the budget; 8-way needs 7.15 GiB with full and 12.12 GiB
# with remat_policy=minimal, which recomputes no matmul (the plan's first choice).
# Slices add data parallelism over DCN (NUM_SLICES=n with EXECUTABLE=train_compile;
# dcn_data_parallelism fills from the slice count): the global batch, 32 sequences per slice,
# grows n times; two slices compile to 13.07 GiB per chip (2026-11-29).
# Expected performance and how it was derived: configs/tpu/v5e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5e/gpt3_175b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5e/gpt3_175b.sh EXECUTABLE=train_compile      # AOT-compile for v5e-256 on any host
#   bash configs/tpu/v5e/gpt3_175b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5e recipe

run_recipe v5e-256 \
  model_name=gpt3-175b \
  ici_tensor_parallelism=8 per_device_batch_size=0.125 max_target_length=2048 dtype=bfloat16 weight_dtype=bfloat16 remat_policy=minimal \
  steps=100 log_period=10
