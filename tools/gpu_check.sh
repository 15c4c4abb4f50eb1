#!/usr/bin/env bash
# The GPU check for cp_ext: one command, <= 9 minutes on one node (see tools/gpu_check.py).
#     bash tools/gpu_check.sh [--out DIR]     # summary table + DIR/summary.json (default gpu_check_out/)
# Exit status: 0 every check that ran passed, 1 a check failed, 2 no usable CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 tools/gpu_check.py "$@"
