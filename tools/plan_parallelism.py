"""Plan TP x PP x CP x DP (EP folded) for a model, a sequence length and a cluster (the code:
`cp_ext.cli.plan_parallelism`, also installed as ``cp-ext-plan``; the planner itself: `cp_ext.perf.parallelism_planner`).

    python tools/plan_parallelism.py --model llama2-7b --seq-length 131072 --global-batch 64 \
        --gpu-memory-gib 80 --gpus-per-node 8 --nodes 4
    python tools/plan_parallelism.py --model llama2-7b --kv-arithmetic    # the textbook KV numbers
    python tools/plan_parallelism.py --nodes 8 -- --config configs/qwen3_30b_a3b_128k_8x8gpu.yaml

``python tools/plan_parallelism.py --help`` says the rest.
"""

import sys

from cp_ext.cli.plan_parallelism import main

if __name__ == "__main__":
    sys.exit(main())
