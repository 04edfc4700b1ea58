#!/usr/bin/env bash
# Recipe: Llama 2 7B on one A3 VM (8 NVIDIA H100 80GB GPUs), fully sharded data parallel
# over all 8 GPUs, sequence length 4096, 4 sequences per GPU (global batch 32).
# Expected performance and how it was derived: configs/gpu/a3/README.md. Flags: configs/README.md.
#
#   bash configs/gpu/a3/llama_2_7B/1vm.sh RUN_NAME=my_run OUTPUT_PATH=gs://my-bucket/runs
#   bash configs/gpu/a3/llama_2_7B/1vm.sh DRY_RUN=1          # print what would run
# Settings (KEY=VALUE) are described in configs/run_recipe.sh.
[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"   # `sh recipe.sh` starts a POSIX shell: run under bash
set -e
source "$(dirname "${BASH_SOURCE[0]}")/../../../run_recipe.sh" "$@"

export NNODES=1
source "$(dirname "${BASH_SOURCE[0]}")/a3_llama2_7b.inc"
