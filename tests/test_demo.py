"""The README's main command: the embedded-default CPU run trains, in Megatron's log format."""

import os
import re
import subprocess

from tests.launch import REPO_ROOT

LINE = re.compile(
    r"^ iteration +(\d+)/ +(\d+) \| consumed samples: +\d+ \| elapsed time per iteration \(ms\): [\d.]+ \| "
    r"learning rate: [\d.]+E[+-]\d+ \| global batch size: +\d+ \| lm loss: (\d\.\d{6}E[+-]\d+) \| "
    r"load balancing loss: \d\.\d{6}E[+-]\d+ \| grad norm: [\d.]+ \| tokens per second: [\d.]+ \| eta: [\d:]+ \|$"
)


def test_cpu_demo_loss_falls(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(REPO_ROOT / "scripts" / "run_cpu_demo.sh"), "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = [m for m in map(LINE.match, proc.stdout.splitlines()) if m]
    assert lines, f"no Megatron-style iteration lines in:\n{proc.stdout[-3000:]}"
    assert int(lines[-1].group(1)) == int(lines[-1].group(2)), "the run must reach --train-iters"
    first = float(re.search(r"training done: lm loss ([\d.]+)", proc.stdout).group(1))
    last = float(lines[-1].group(3))
    assert last < first - 1.5, f"loss should fall clearly: iteration 1 {first:.3f} -> last {last:.3f}"
    assert (tmp_path / "metrics.jsonl").exists()
    # every rank's peak memory, gathered to rank 0 (metrics.jsonl holds rank 0's only)
    peaks = re.search(r"^peak RSS per rank \(MiB\): ([\d ]+)$", proc.stdout, re.M)
    assert peaks and len(peaks.group(1).split()) == 4 and all(int(x) > 100 for x in peaks.group(1).split()), proc.stdout[-2000:]
