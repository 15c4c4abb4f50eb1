#!/usr/bin/env bash
# The embedded default: a 4-rank CPU (gloo) MoE training run. Extra flags pass through:
#   scripts/run_cpu_demo.sh --train-iters 20
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec torchrun --standalone --nproc-per-node "${NPROC:-4}" pretrain_moe.py --config configs/cpu_demo.yaml "$@"
