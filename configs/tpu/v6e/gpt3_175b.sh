#!/usr/bin/env bash
# Recipe: GPT-3 175B (174.6B parameters)
# on one TPU v6e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Mesh: 4-way tensor parallelism (64-way FSDP), one sequence per 2 chips. With FSDP alone every
# chip would gather each whole 1.8B-parameter layer for only 2048 tokens, which the estimator's
# roofline (tessera.tools.estimate) puts on the communication-bound side.
# Expected performance and how it was derived: configs/tpu/v6e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v6e/gpt3_175b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v6e/gpt3_175b.sh EXECUTABLE=train_compile      # AOT-compile for v6e-256 on any host
#   bash configs/tpu/v6e/gpt3_175b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v6e recipe

run_recipe v6e-256 \
  model_name=gpt3-175b \
  ici_tensor_parallelism=4 per_device_batch_size=0.5 max_target_length=2048 dtype=bfloat16 remat_policy=save_dot_except_mlp \
  steps=100 log_period=10
