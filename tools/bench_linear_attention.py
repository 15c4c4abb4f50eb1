"""Linear attention (Gated DeltaNet's rule) under CP: state passing against its compute-only time and against
head parallelism's bytes, and how far each method scales in CP, in one run.

    OMP_NUM_THREADS=1 python tools/bench_linear_attention.py --cp 4 --seq-length 32768

Qwen3-Next's per-head dims (K = V = 128) with its 16 key / 32 value heads scaled down to ``--key-heads`` /
``--heads`` (4 / 8 by default: a CPU box, and enough key heads for the all-to-all to run at CP4); fwd + bwd
on ``--cp`` ranks (gloo, started under torchrun). Printed (`cp_ext.bench.linear_attention`: what each
variant runs):

* each variant's median time, its ratio to the same rank's work without the exchange (``compute``) and to the
  plain rule on s/C tokens (``ideal``), and the CPU-seconds ratio (every rank's, summed);
* the bytes every rank's torch.distributed calls sent (`cp_ext.perf.sent_bytes`) beside the formulas of
  `cp_ext.perf.comm`, the busiest rank shown, every rank checked;
* the CP sizes each method takes at Qwen3-Next's 16 key heads (the ops' own checks), with one layer's bytes.

Smaller quick runs: ``--seq-length 4096 --cp 2 --reps 1``.
"""

import sys

from cp_ext.bench.linear_attention import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
