"""scripts/torchrun_single_node.sh: a real 2-rank CPU run, and its usage error."""

import json
import os
import re
import subprocess

from tests.launch import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "torchrun_single_node.sh"


def test_torchrun_single_node_trains(tmp_path):
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(SCRIPT), "configs/cpu_demo.yaml", "--tensor-model-parallel-size", "1",
                           "--num-layers", "2", "--train-iters", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
                           "--log-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # any cwd works
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "training: world 2 = TP 1 x PP 1 x CP 2 (Ulysses 1 x ring 2) x DP 1" in proc.stdout
    assert re.findall(r"^ iteration +(\d+)/ +2 \|", proc.stdout, re.M) == ["1", "2"]
    assert "training done:" in proc.stdout
    assert [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_torchrun_single_node_needs_a_config():
    proc = subprocess.run([str(SCRIPT), "--train-iters", "2"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr
