"""DeepSeek-V4's attention layers (sliding window, CSA, HCA) under CP against dense causal attention of the same dims,
and the bytes each sends against a dense 512-wide K/V exchange, in one run.

    OMP_NUM_THREADS=1 python tools/bench_compressed_attention.py --cp 4 --seq-length 16384

V4's per-token dims (one K=V head of 512, 64 of its channels rotated; the indexer's heads of 128 keeping 512 entries;
a window of 128; blocks of 4 and 128) with the query and indexer heads scaled down to ``--heads`` / ``--index-heads``
(4 / 4: a CPU box); fwd + bwd on ``--cp`` ranks (gloo, started under torchrun). Printed (`cp_ext.bench.
compressed_attention`): each layer kind's median time and its ratio to cp_ext's dense causal ring attention over the
same heads and K=V head, the busiest rank's bytes forward and backward, and the forward bytes over a dense all-gather
of the K=V head.
"""

import sys

from cp_ext.bench.compressed_attention import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
