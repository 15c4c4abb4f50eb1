"""Checkpoints: kill -9 and resume reproduces the uninterrupted run (with and without the
distributed optimizer); a kill inside a save leaves the last good checkpoint; a checkpoint
loads at another TP and CP size through the command line.

Real runs of pretrain_moe.py (2 gloo ranks, EP2, forked with torchrun's environment: `tests.launch`),
real files. Resharding
across every dimension: test_checkpoint_resharding.py.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, run_script, start_script

FLAGS = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-3",
         "--lr-warmup-iters", "2", "--seed", "5", "--log-interval", "1"]


def _train(nproc, *args, script=None, env=None, check=True):
    return run_script(nproc, script or REPO_ROOT / "pretrain_moe.py", *FLAGS, *args, env=env, check=check)


def _losses(log_dir):
    lines = Path(log_dir, "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r["train/lm_loss"] for r in map(json.loads, lines)}


def _uninterrupted(tmp_path_factory, *optimizer):
    log_dir = tmp_path_factory.mktemp("uninterrupted")
    _train(2, "--expert-model-parallel-size", "2", "--log-dir", log_dir, *optimizer)
    losses = _losses(log_dir)
    assert sorted(losses) == list(range(1, 9))
    return losses


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return _uninterrupted(tmp_path_factory)


@pytest.fixture(scope="module")
def uninterrupted_distributed(tmp_path_factory):
    """The distributed optimizer's own curve: its reduce-scatter sums in another order (~1e-8 apart)."""
    return _uninterrupted(tmp_path_factory, "--use-distributed-optimizer")


@pytest.mark.parametrize("optimizer", [pytest.param([], id="adam", marks=pytest.mark.quick),
                                       pytest.param(["--use-distributed-optimizer"], id="distributed-adam")])
def test_kill_9_then_resume_matches_uninterrupted(request, tmp_path, optimizer):
    uninterrupted = request.getfixturevalue("uninterrupted_distributed" if optimizer else "uninterrupted")
    save, log_dir = tmp_path / "ckpt", tmp_path / "run"
    run = start_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--expert-model-parallel-size", "2", "--log-dir",
                       log_dir, "--save", save, "--save-interval", "2", *optimizer)
    tracker = save / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while time.time() < deadline and run.poll() is None:
        if tracker.exists() and int(tracker.read_text()) >= 4:
            break
        time.sleep(0.05)
    run.kill()  # every rank, mid-run
    killed_at = max(_losses(log_dir))
    resumed_from = int(tracker.read_text())
    assert 4 <= resumed_from < 8, f"the kill landed after the run finished ({resumed_from}); make the run longer"

    _train(2, "--expert-model-parallel-size", "2", "--log-dir", log_dir, "--load", save, *optimizer)
    losses = _losses(log_dir)
    assert sorted(losses) == list(range(1, 9)), "metrics.jsonl must hold each iteration once after resume"
    assert losses == uninterrupted, f"killed at {killed_at}, resumed from {resumed_from}: {losses} vs {uninterrupted}"


def test_kill_inside_a_save_keeps_the_last_good_checkpoint(uninterrupted, tmp_path):
    save, log_dir = tmp_path / "ckpt", tmp_path / "run"
    proc = _train(2, "--expert-model-parallel-size", "2", "--log-dir", log_dir, "--save", save, "--save-interval", "2",
                  script=__file__, env={"KILL_AT_SAVE": "2"}, check=False)
    assert proc.returncode != 0, "the worker should have died inside its second save"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000004.tmp").exists() and not (save / "iter_0000004").exists()

    _train(2, "--expert-model-parallel-size", "2", "--log-dir", log_dir, "--load", save)
    assert _losses(log_dir) == uninterrupted


def test_checkpoint_loads_at_another_tp_and_cp_size(uninterrupted, tmp_path):
    save, log_dir = tmp_path / "ckpt", tmp_path / "run"
    _train(2, "--expert-model-parallel-size", "2", "--log-dir", log_dir, "--save", save, "--exit-interval", "4")
    for grid in (["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                 ["--expert-model-parallel-size", "2", "--context-parallel-size", "2"]):
        resumed = _train(2, *grid, "--log-dir", log_dir, "--load", save)
        assert "loaded checkpoint of iteration 4" in resumed.stdout
        losses = _losses(log_dir)
        for it in range(1, 9):
            assert abs(losses[it] - uninterrupted[it]) <= 1e-5 * abs(uninterrupted[it]), (grid, it, losses[it])


def _die_inside_second_save():
    """Worker: pretrain_moe.py, except that rank 0 is SIGKILLed inside a save, once every rank's
    tensor files are written and before the directory is renamed into place."""
    import cp_ext.checkpoint.checkpointer as checkpointing

    real_save, calls = checkpointing.dist_checkpointing.save, {"saves": 0}
    kill_at = int(os.environ["KILL_AT_SAVE"])

    def save_then_die(*args, **kwargs):
        result = real_save(*args, **kwargs)
        calls["saves"] += 1
        if calls["saves"] == kill_at and os.environ.get("RANK") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    checkpointing.dist_checkpointing.save = save_then_die
    sys.argv = [str(REPO_ROOT / "pretrain_moe.py"), *sys.argv[1:]]
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    _die_inside_second_save()
