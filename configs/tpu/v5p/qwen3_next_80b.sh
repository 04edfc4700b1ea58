#!/usr/bin/env bash
# Recipe: Qwen3-Next-80B-A3B (79.7B parameters, 3.8B active per token; 3 Gated DeltaNet : 1 gated attention
# layers, 512 experts of width 512, dropless routing) on one TPU v5p-128 slice (64 chips, 128 TensorCores);
# PLATFORM=gce runs rto_setup.sh first.
# Mesh (.venv/bin/python -m tessera.tools.plan qwen3-next-80b-a3b max_target_length=4096 dtype=bfloat16
# --hardware v5p-128 --tokens-per-device 4096): 4-way expert parallelism (128 experts per chip, tokens exchanged
# with ragged all-to-alls) and FSDP over the other 16; one 4096-token sequence per chip.
# Expected performance and how it was derived: configs/tpu/v5p/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v5p/qwen3_next_80b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v5p/qwen3_next_80b.sh EXECUTABLE=train_compile      # AOT-compile for v5p-128 on any host
#   bash configs/tpu/v5p/qwen3_next_80b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v5p recipe

run_recipe v5p-128 \
  model_name=qwen3-next-80b-a3b \
  ici_fsdp_parallelism=16 ici_expert_parallelism=4 \
  per_device_batch_size=1 max_target_length=4096 dtype=bfloat16 remat_policy=minimal \
  steps=100 log_period=10
