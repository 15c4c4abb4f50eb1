"""scripts/compare_cp.sh end to end: two real short runs, CP=2 and CP=1, compared by the tool.

2 gloo ranks, the CPU demo config shrunk by flags: CP=2 (TP1 x CP2, DP1) against CP=1
(TP1 x DP2), same seed, data and global batch, fp32, 4 iterations. The script must exit 0
(curves agree at its default 1e-5 relative tolerance) and leave both runs' metrics.jsonl,
their logs and the plot. The same two runs then go through the tool directly on other keys,
and with the CP=2 run read from its offline wandb log instead of its metrics.jsonl.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "compare_cp.sh"
TOOL = REPO_ROOT / "tools" / "compare_loss_curves.py"
ITERS = 4
FLAGS = ["--tensor-model-parallel-size", "1", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--train-iters", str(ITERS),
         "--lr-warmup-iters", "1", "--log-interval", "1", "--wandb-project", "cp_ext_test"]


def run_script(out_dir, *args, timeout=900):
    # offline wandb as well: each run dir then holds metrics.jsonl and wandb/offline-run-*/
    env = dict(os.environ, NPROC="2", OUT_DIR=str(out_dir), OMP_NUM_THREADS="1", WANDB_MODE="offline")
    env.pop("WANDB_DISABLED", None)
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO_ROOT)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare_cp")
    proc = run_script(out, "configs/cpu_demo.yaml", 2, *FLAGS)
    return out, proc


def test_cp2_matches_cp1(compared):
    out, proc = compared
    context = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, context
    print(proc.stdout)  # the tool's report, visible with pytest -s
    assert f"aligned iterations: {ITERS} (1-{ITERS})" in proc.stdout, context
    assert re.search(r"^PASS: 4 iterations agree, max rel diff [\d.e+-]+ <= rel tolerance 1e-05$", proc.stdout, re.M), context
    max_rel = float(re.search(r"max rel diff:\s+(\S+)", proc.stdout).group(1))
    assert max_rel < 1e-5
    # the two runs really were CP=2 and CP=1 on the same world size
    assert "training: world 2 = TP 1 x PP 1 x CP 2 (Ulysses 1 x ring 2) x DP 1" in (out / "cp2" / "train.log").read_text()
    assert "training: world 2 = TP 1 x PP 1 x CP 1 (Ulysses 1 x ring 1) x DP 2" in (out / "cp1" / "train.log").read_text()
    for cp in (1, 2):
        records = [json.loads(line) for line in (out / f"cp{cp}" / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("key, tolerance", [("train/load_balancing_loss", "1e-5"), ("train/grad_norm", "1e-4")])
def test_other_metrics_of_the_pair_agree(compared, key, tolerance):
    out, proc = compared
    if proc.returncode != 0:
        pytest.skip("the CP pair did not train (see test_cp2_matches_cp1)")
    tool = subprocess.run([sys.executable, str(TOOL), out / "cp2", out / "cp1", "--key", key, "--tolerance", tolerance],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert tool.returncode == 0, tool.stdout + tool.stderr


def test_perturbed_run_fails(compared, tmp_path):
    """The pair's own numbers, one iteration nudged by 1e-4: the tool must catch it."""
    out, proc = compared
    if proc.returncode != 0:
        pytest.skip("the CP pair did not train (see test_cp2_matches_cp1)")
    records = [json.loads(line) for line in (out / "cp1" / "metrics.jsonl").read_text().splitlines()]
    records[2]["train/lm_loss"] *= 1 + 1e-4
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tool = subprocess.run([sys.executable, str(TOOL), out / "cp2", tmp_path], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)
    assert tool.returncode == 1, tool.stdout + tool.stderr
    assert "first at iteration 3" in tool.stdout


@pytest.mark.quick
@pytest.mark.parametrize("args, message", [
    (["configs/cpu_demo.yaml"], "usage:"),
    (["configs/nope.yaml", "2"], "no such file"),
    (["configs/cpu_demo.yaml", "1"], "CP must be an integer >= 2"),
    (["configs/cpu_demo.yaml", "2", "--num-attention-heads", "6"], "configuration is invalid"),
])
def test_bad_arguments_exit_2_before_training(tmp_path, args, message):
    proc = run_script(tmp_path, *args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "cp2" / "train.log").exists()


def test_offline_wandb_log_of_the_cp2_run_matches_the_cp1_run(compared):
    """Mixed inputs on real runs: CP=2 from the trainer's offline wandb log, CP=1 from metrics.jsonl."""
    out, proc = compared
    if proc.returncode != 0:
        pytest.skip("the CP pair did not train (see test_cp2_matches_cp1)")
    tool = subprocess.run([sys.executable, str(TOOL), out / "cp2" / "wandb", out / "cp1" / "metrics.jsonl"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert tool.returncode == 0, tool.stdout + tool.stderr
    assert "[wandb-offline: " in tool.stdout and f"aligned iterations: {ITERS} (1-{ITERS})" in tool.stdout
