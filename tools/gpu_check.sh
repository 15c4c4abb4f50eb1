#!/usr/bin/env bash
# GPU check for cp_ext (one CUDA GPU, < 8 minutes): the attention equivalence tests on CUDA,
# then the attention benchmark on that GPU. Run from the repository root:
#     bash tools/gpu_check.sh            # writes gpu_check_out/ (or $OUT when set)
# Without a GPU it stops at once with exit status 2.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-gpu_check_out}"
mkdir -p "$OUT_DIR"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi missing or lists none); this check needs one CUDA GPU" >&2
    exit 2
fi
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch $(python3 -c 'import torch; print(torch.__version__)') cannot use CUDA (CPU wheel?); install the CUDA build of torch" >&2
    exit 2
fi
nvidia-smi -L | tee "$OUT_DIR/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT_DIR/gpu.txt"

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# 1. attention equivalence on CUDA (kernels + ring/Ulysses/hybrid code paths vs float64 truth)
timeout 450 bash -c 'set -euo pipefail
  python3 -m pytest -q tests/attention/test_cuda_kernels.py 2>&1 | tee "$0/tests.txt"
  # 2. benchmark on the single GPU: C = 1 (ring path vs the bare kernel), bf16 and fp32, 32K tokens
  for dt in bf16 fp32; do
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 tools/bench_attention.py \
      --device cuda --seq-length 32768 --heads 32 --kv-heads 8 --head-dim 128 --dtype $dt --reps 9 --warmup 3 \
      --json "$0/bench_$dt.json" 2>&1 | grep -v -i warn | tee "$0/bench_$dt.txt"
  done
' "$OUT_DIR"
echo "gpu_check: done; results in $OUT_DIR"
