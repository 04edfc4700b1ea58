#!/usr/bin/env bash
# Recipe: a 22B Llama-family model, 48 layers of width 6144 (22.1B parameters)
# on one TPU v4-128 slice (64 chips, 128 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Expected performance and how it was derived: configs/tpu/v4/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v4/22b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v4/22b.sh EXECUTABLE=train_compile      # AOT-compile for v4-128 on any host
#   bash configs/tpu/v4/22b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v4 recipe

run_recipe v4-128 \
  model_name=1b base_emb_dim=6144 base_num_query_heads=48 base_num_kv_heads=48 base_mlp_dim=16384 base_num_decoder_layers=48 \
  per_device_batch_size=4 max_target_length=2048 dtype=bfloat16 remat_policy=full \
  steps=100 log_period=10
