#!/usr/bin/env bash
# Recipe: GPT-3 175B (174.6B parameters)
# on one TPU v5p-1024 slice (512 chips, 1024 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Mesh: 128-way FSDP x 4-way data parallelism. 128 chips hold the float32 weights and AdamW
# moments (2.1 TB, 15 GiB each); over all 512 the biases and norms, which no axis splits, would
# be more than 2% of a chip's parameters (tests/test_recipes.py counts that as replication).
# Batch: 1536 sequences of 2048 tokens (3.1M tokens), about the 3.2M of the GPT-3 paper.
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/gpt3_175b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/gpt3_175b.sh EXECUTABLE=train_compile      # AOT-compile for v5p-1024 on any host
#   bash configs/tpu/v5p/gpt3_175b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-1024 \
  model_name=gpt3-175b \
  ici_data_parallelism=-1 ici_fsdp_parallelism=128 per_device_batch_size=3 max_target_length=2048 dtype=bfloat16 remat_policy=full \
  steps=100 log_period=10
