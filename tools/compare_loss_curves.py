#!/usr/bin/env python
"""Compare two training runs' loss curves iteration by iteration; pass or fail on a tolerance.

    python tools/compare_loss_curves.py RUN_A RUN_B [--tolerance 1e-5] [--band 0.01] [--plot out.png]

RUN_A and RUN_B may be any mix of:

* a ``metrics.jsonl`` file, or a run directory holding one (``--log-dir`` of pretrain_moe.py);
* an offline wandb run: its ``run-*.wandb`` file, its ``offline-run-*`` directory, or a
  directory with exactly one run under ``wandb/`` (read with wandb's own reader,
  ``wandb leet inspect --json``; the tool never parses the binary log itself);
* an online wandb run path ``entity/project/run_id`` (or ``wandb:entity/project/run_id``,
  or its ``https://wandb.ai/entity/project/runs/run_id`` URL), read through ``wandb.Api``.

A run directory holding both ``metrics.jsonl`` and a wandb log is read from metrics.jsonl.

The curves are aligned by iteration (wandb's step). The tool prints the number of aligned
iterations, the iterations only one run has, the max and mean absolute and relative
differences, and one PASS/FAIL line. Relative difference is |a - b| / max(|a|, |b|).
A point agrees when its relative difference is <= --tolerance (or its absolute difference
<= --atol, when given); the curves agree when every aligned point does, no value is NaN/inf,
and both runs cover the same iterations (--allow-partial compares the overlap only).

Where the curves part, the report names the first iteration past the tolerance and compares
every other metric the two runs both log (timing and memory aside) the same way, to say which
one moved first: the MoE load-balancing (aux) loss before the LM loss points at a flipped
top-k routing decision (rounding on the router), the LM loss first at attention or data.

--band REL judges long runs whose curves part by rounding (MoE routing, bf16): from the first
iteration past the tolerance on, an exponential moving average (weight --band-ema, default
0.9) of each curve must stay within REL relative of the other's. The verdict then says
"PASS (by the band, not strictly)" (exit 0) or FAIL (exit 1).

Exit status: 0 the curves agree (or stay within --band), 1 they do not, 2 bad input: a
missing or unreadable run, a malformed metrics.jsonl (invalid JSON before its last line,
non-UTF-8 bytes, an iteration that is not a non-negative integer, a metric value that is not
a number or null), an unknown key, no common iteration, a tolerance that is not a finite
number >= 0, or a --plot that cannot be written. The plot is written before the verdict line.
"""

import sys

from cp_ext.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
