#!/usr/bin/env bash
# Recipe: Mixtral 8x7B at sequence length 4096 (46.7B parameters, 12.9B active per token)
# on one TPU v6e-256 slice (256 chips); PLATFORM=gce runs rto_setup.sh first.
# Routing: the model file's dropless routing over 4-way expert parallelism (2 experts per chip;
# token copies exchanged with ragged all-to-alls, worst-case receive buffer: nothing dropped),
# FSDP over the other 64 ways, remat_policy=save_qkv_proj: 24.59 GiB per chip (AOT, 2026-11-29). The mesh
# is the one `tessera.tools.plan mixtral-8x7b max_target_length=4096 dtype=bfloat16
# --hardware v6e-256 --tokens-per-device 8192` ranks first (see configs/tpu/v6e/README.md).
# Expected performance and how it was derived: configs/tpu/v6e/README.md. Flags: configs/README.md.
#
#   bash configs/tpu/v6e/mixtral_8x7b.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs PLATFORM=gke
#   bash configs/tpu/v6e/mixtral_8x7b.sh EXECUTABLE=train_compile      # AOT-compile for v6e-256 on any host
#   bash configs/tpu/v6e/mixtral_8x7b.sh DRY_RUN=1                     # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../run_recipe.sh" "$@"

source "$(dirname "${BASH_SOURCE[0]}")/flags.inc"   # LIBTPU_INIT_ARGS of every v6e recipe

run_recipe v6e-256 \
  model_name=mixtral-8x7b \
  ici_expert_parallelism=4 per_device_batch_size=2 max_target_length=4096 dtype=bfloat16 remat_policy=save_qkv_proj \
  steps=100 log_period=10
