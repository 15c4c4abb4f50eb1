"""A checkpoint written under the other end of the supported megatron-core range resumes here exactly.

megatron-core 0.16.1 writes a checkpoint's plain values (iteration, args, scheduler, Adam's step) to
common.pt, 0.19 into its torch_dist files (`cp_ext.megatron_compat`, row 2). Here the other end's
interpreter (``CP_EXT_OTHER_PYTHON``; .ci/run sets it in each leg to the other leg's) trains 4
iterations on 2 ranks at CP2, saving at iteration 2; this one resumes from that checkpoint and trains
iterations 3 and 4, which must give the uninterrupted run's losses and grad norms. Each leg reads the
other's: 0.19 reads 0.16.1's common.pt, and 0.16.1 reads 0.19's embedded form. The data is a corpus
written here, not the embedded default (each Python's own standard library).

Skipped where no other interpreter is named (a developer's machine with one environment).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, TORCHRUN_ENV, run_script

OTHER = os.environ.get("CP_EXT_OTHER_PYTHON")
pytestmark = pytest.mark.skipif(not OTHER, reason="CP_EXT_OTHER_PYTHON is unset: no interpreter with the other "
                                                  "end of the megatron-core range (.ci/run sets it)")

FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--lr", "3e-3", "--lr-warmup-iters", "1", "--lr-decay-iters", "4", "--seed", "7", "--clip-grad", "1.0",
         "--moe-z-loss-coeff", "0.01", "--context-parallel-size", "2", "--device", "cpu"]


def _other(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [OTHER, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO_ROOT / "pretrain_moe.py"), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _metrics(path):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return {row["iteration"]: (row["train/lm_loss"], row["train/grad_norm"]) for row in rows}


def _rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def test_the_other_ends_checkpoint_resumes_with_its_losses(tmp_path, short_documents):
    data = ["--data-path", short_documents]
    ckpt = tmp_path / "ckpt"
    other = _other(*FLAGS, *data, "--train-iters", "4", "--save", ckpt, "--save-interval", "2",
                   "--log-dir", tmp_path / "other", cwd=tmp_path)
    from cp_ext import MEGATRON_CORE_VERSION as here

    there = json.loads((ckpt / "iter_0000002" / "meta.json").read_text())["megatron_core"]
    assert there != here, f"CP_EXT_OTHER_PYTHON runs megatron-core {there}, the same as this interpreter"
    assert f"on megatron-core {there}," in other.stdout  # the startup line names the version in use
    # the other end keeps the common state in the form its release writes
    assert (ckpt / "iter_0000002" / "common.pt").exists() == (there == "0.16.1")

    # iteration 4's checkpoint would be the one loaded: resume from 2, as after a crash past it
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2\n")
    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, *data, "--train-iters", "4", "--load", ckpt,
                      "--log-dir", tmp_path / "here", timeout=600)
    assert "loaded checkpoint of iteration 2" in proc.stdout, proc.stdout[-3000:]
    newer = tuple(map(int, there.split(".")[:2])) > tuple(map(int, here.split(".")[:2]))
    assert (f"was written by megatron-core {there}; reading it with {here}" in proc.stderr) == newer, proc.stderr

    uninterrupted, resumed = _metrics(tmp_path / "other" / "metrics.jsonl"), _metrics(tmp_path / "here" / "metrics.jsonl")
    assert sorted(resumed) == [3, 4]
    for iteration in (3, 4):
        for name, a, b in zip(("lm loss", "grad norm"), uninterrupted[iteration], resumed[iteration]):
            assert _rel(a, b) < 1e-6, f"{name} at iteration {iteration}: {there} {a} vs resumed on {here} {b}"
