"""How close each attention exactness bound comes to failing, in two summation orders.

    python tools/attention_margins.py            # ~2 min on 2 cores: both orders, the four modules
    python tools/attention_margins.py --min 1.2  # exit 1 if any margin is below 1.2

Runs tests/attention/test_{ring,ulysses,hybrid,documents}.py twice, in the default order and with
``CP_EXT_TEST_SUMMATION_ORDER=permuted`` (the head dim of q/k and of v/dout permuted: the same
mathematics, every score and gradient rounded differently; `tests.attention.reference`), and
prints, per module, order and bound, the smallest margin bound / error over its cases and the
case it belongs to. A margin of 1.2 means the error could grow by a fifth before the test fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULES = ("cp/test_ring", "cp/test_ulysses", "cp/test_hybrid", "masks/test_documents")


def run(order, path):
    env = dict(os.environ, CP_EXT_TEST_SUMMATION_ORDER=order, CP_EXT_MARGINS_FILE=str(path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *[f"tests/attention/{m}.py" for m in MODULES], "-k", "float64_truth"]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min", type=float, default=None, help="exit 1 when a margin is below this")
    args = p.parse_args(argv)
    worst_overall, failed = float("inf"), False
    print(f"{'module':<16}{'order':<10}{'bound':<9}{'min margin':>11}  case")
    for order in ("default", "permuted"):
        with tempfile.TemporaryDirectory(prefix="cp_ext_margins_") as tmp:
            path = Path(tmp, "margins.jsonl")
            proc = run(order, path)
            if proc.returncode != 0:
                failed = True
                print(f"pytest failed in the {order} order:\n{proc.stdout[-3000:]}", file=sys.stderr)
            rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        for module in MODULES:
            mine = [r for r in rows if Path(r["test"]).stem == Path(module).name]
            for bound in ("max", "rms"):
                best = min(((m, r["case"]) for r in mine for k, m in r["margins"].items()
                            if k.endswith("_rms") == (bound == "rms")), default=None)
                if best is None:
                    continue
                worst_overall = min(worst_overall, best[0])
                print(f"{Path(module).name:<16}{order:<10}{bound:<9}{best[0]:>11.2f}  {best[1]}")
    print(f"smallest margin: {worst_overall:.2f}")
    if failed or (args.min is not None and worst_overall < args.min):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
