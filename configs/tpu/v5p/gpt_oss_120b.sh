#!/usr/bin/env bash
# Recipe: gpt-oss-120b (116.8B parameters, 5.1B active per token; 128 experts, dropless routing)
# on one TPU v5p-128 slice (64 chips, 128 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Mesh (.venv/bin/python -m tessera.tools.plan gpt-oss-120b max_target_length=8192 dtype=bfloat16 --hardware v5p-128
# --compile): 4-way expert parallelism (32 experts per chip, tokens exchanged with ragged all-to-alls) and
# FSDP over the other 16; one 8192-token sequence per chip (two need 112.39 GiB per chip).
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/gpt_oss_120b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/gpt_oss_120b.sh EXECUTABLE=train_compile      # AOT-compile for v5p-128 on any host
#   bash configs/tpu/v5p/gpt_oss_120b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-128 \
  model_name=gpt-oss-120b \
  ici_fsdp_parallelism=16 ici_expert_parallelism=4 \
  per_device_batch_size=1 max_target_length=8192 dtype=bfloat16 remat_policy=save_dot_except_mlp \
  steps=100 log_period=10
