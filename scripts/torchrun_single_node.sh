#!/usr/bin/env bash
# One node without SLURM: torchrun --standalone with one rank per GPU (or NPROC_PER_NODE).
#
#   scripts/torchrun_single_node.sh configs/X.yaml [pretrain_moe.py flags...]
#   NPROC_PER_NODE=4 scripts/torchrun_single_node.sh configs/cpu_demo.yaml --train-iters 20
#
# NPROC_PER_NODE defaults to the number of GPUs (nvidia-smi -L), else 4 (the CPU demo's grid);
# set, it must be a whole number >= 1 (else exit 2; empty counts as unset).
# DISTRIBUTED_TIMEOUT_MINUTES=N adds --distributed-timeout-minutes N to pretrain_moe.py's flags
# (a flag given on the command line wins). TORCHRUN: launcher command (default torchrun).
# GPU settings as in the SLURM scripts: CUDA_DEVICE_MAX_CONNECTIONS=1 (TP/SP overlap),
# NCCL_DEBUG=WARN; OMP_NUM_THREADS = cores / ranks. See docs/operations.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env_checks.sh"

config="${CONFIG:-}"
if [[ $# -gt 0 && ( "$1" == *.yaml || "$1" == *.yml ) ]]; then
    config="$1"
    shift
fi
# A config path relative to the caller's directory stays valid after the cd to the repository
# (else it is read relative to the repository, e.g. configs/cpu_demo.yaml from anywhere).
if [[ -n "$config" && -f "$config" ]]; then
    config="$(realpath "$config")"
fi
cd "$(dirname "$0")/.."
if [[ -z "$config" ]]; then
    echo "usage: $0 CONFIG.yaml [pretrain_moe.py flags...]   (or CONFIG=... $0 [flags...])" >&2
    exit 2
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | wc -l)"
fi
# Numbers from the environment are checked before any arithmetic (scripts/env_checks.sh).
if [[ "$gpus" -gt 0 ]]; then
    cp_ext_int NPROC_PER_NODE "$gpus" 1 "" "set it to the ranks per node (e.g. NPROC_PER_NODE=2) or unset it (one per GPU)"
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
else
    cp_ext_int NPROC_PER_NODE 4 1 "" "set it to the ranks per node (e.g. NPROC_PER_NODE=2) or unset it (4 on CPU)"
fi
nproc="$NPROC_PER_NODE"
cp_ext_timeout_minutes "$config" "$@"
cores="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}"

exec ${TORCHRUN:-torchrun} --standalone --nproc-per-node "$nproc" \
    pretrain_moe.py --config "$config" "${CP_EXT_TIMEOUT_FLAGS[@]}" "$@"
