#!/usr/bin/env bash
# Recipe: DeepSeek-V3 (671B parameters, 37B active per token; multi-head latent attention, 256 experts)
# on one TPU v5p-1024 slice (512 chips, 1024 TensorCores); PLATFORM=gce runs rto_setup.sh first.
# Mesh (.venv/bin/python -m tessera.tools.plan deepseek-v3 max_target_length=4096 dtype=bfloat16 --hardware v5p-1024):
# 16-way expert parallelism (16 experts per chip, tokens exchanged with ragged all-to-alls), 4-way
# tensor parallelism over heads and expert widths, FSDP over the remaining 8. ragged_buffer_factor=2: each
# shard has room for twice its average share of token copies (the worst-case default needs 108.16 GiB).
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/deepseek_v3.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/deepseek_v3.sh EXECUTABLE=train_compile      # AOT-compile for v5p-1024 on any host
#   bash configs/tpu/v5p/deepseek_v3.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-1024 \
  model_name=deepseek-v3 \
  ici_fsdp_parallelism=8 ici_tensor_parallelism=4 ici_expert_parallelism=16 \
  ragged_buffer_factor=2 per_device_batch_size=0.25 max_target_length=4096 dtype=bfloat16 remat_policy=minimal \
  steps=100 log_period=10
