"""gpu_check's single-GPU family rows: Megatron-LM's five MoE scripts train on one GPU as written.

One row per family of `tests/families` (Mixtral, Qwen3-MoE, DeepSeek-V2-Lite, DeepSeek-R1, GPT-OSS):
``pretrain_moe.py`` with the script's flags shrunk only in sizes (`tests.families.tiny`: --bf16,
the alltoall dispatcher on CUDA streams, MLA, sinks and windows through the kernel ``auto`` picks
for bf16, the script's recompute) on ``--device cuda``, one rank, 3 iterations. PASS when every
iteration logs a finite lm loss. Exactness against CP=1 needs 2+ GPUs (part 3's grid row);
these rows show the CUDA path of each family's modules builds and runs.
"""

import json
import math
import sys


def family_rows(out, timeout_each, run_logged, row, families=None):
    """The rows; ``run_logged``/``row`` are gpu_check's (its subprocess runner and table row)."""
    from tests.families import FAMILIES, tiny

    rows = []
    for family in families or FAMILIES:
        check = f"{family} flags train on 1 GPU (bf16, 3 it)"
        log, run_dir = out / f"family_{family}.log", out / f"family_{family}"
        metrics = run_dir / "metrics.jsonl"
        metrics.unlink(missing_ok=True)  # a stale run must not pass for this one
        rc = run_logged([sys.executable, "pretrain_moe.py", *tiny(family), "--device", "cuda", "--log-dir", run_dir],
                        log, timeout_each)
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
        loss = [r.get("train/lm_loss", math.nan) for r in lines]
        ok = rc == 0 and len(loss) == 3 and all(map(math.isfinite, loss))
        figure = f"lm loss {loss[0]:.3f} -> {loss[-1]:.3f}" if loss else f"exit {rc}, no loss logged"
        rows.append(row("single", check, "PASS" if ok else "FAIL", figure, "3 finite losses", rc=rc, log=str(log)))
    return rows
