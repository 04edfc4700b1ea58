#!/usr/bin/env bash
# Recipe: a 52B Llama-family model, 64 layers of width 8192 (52.3B parameters)
# on one TPU v4-384 slice (192 chips, 384 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Mesh: 64-way FSDP x 3-way data parallelism; the model's widths divide by 64 but not by 192.
# Expected performance and how it was derived: configs/tpu/v4/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v4/52b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v4/52b.sh EXECUTABLE=train_compile      # AOT-compile for v4-384 on any host
#   bash configs/tpu/v4/52b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v4 recipe

run_recipe v4-384 \
  model_name=1b base_emb_dim=8192 base_num_query_heads=64 base_num_kv_heads=64 base_mlp_dim=22016 base_num_decoder_layers=64 \
  ici_data_parallelism=-1 ici_fsdp_parallelism=64 per_device_batch_size=1 max_target_length=2048 dtype=bfloat16 remat_policy=save_qkv_proj \
  steps=100 log_period=10
