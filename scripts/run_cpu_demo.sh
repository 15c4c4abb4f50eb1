#!/usr/bin/env bash
# The embedded default: a 4-rank CPU (gloo) MoE training run. Extra flags pass through:
#   scripts/run_cpu_demo.sh --train-iters 20
# NPROC: ranks (default 4; a whole number >= 1, else exit 2). TORCHRUN: launcher command
# (default torchrun), as in the other launch scripts.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_checks.sh"
cd "$(dirname "$0")/.."
cp_ext_int NPROC 4 1 "" "set it to the number of CPU ranks (e.g. NPROC=2) or unset it (4)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec ${TORCHRUN:-torchrun} --standalone --nproc-per-node "$NPROC" pretrain_moe.py --config configs/cpu_demo.yaml "$@"
