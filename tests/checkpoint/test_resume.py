"""Resuming never destroys logs or repeats data; a new run never writes over an old one's logs.

Real `pretrain_moe.py` runs on one rank as plain ``python`` runs it (no torchrun environment; forked
from the suite's pre-imported server, `tests.launch`), a real checkpoint, and the run directory a
user would reuse.
"""

import json
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, run_script

FLAGS = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--lr-warmup-iters", "1", "--lr-decay-iters", "8", "--seed", "3"]


def _train(log_dir, *args):
    return run_script(0, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--log-dir", log_dir, *args, timeout=300)


def _iterations(path):
    return [json.loads(line)["iteration"] for line in Path(path).read_text().splitlines()]


def test_resume_after_torn_line_with_a_larger_batch(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    _train(run, "--train-iters", "2", "--global-batch-size", "4", "--save", ckpt)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "train/lm_lo')  # killed mid-write
    # --global-batch-size grows 4 -> 8: 4 x 8 samples are needed, past the 8 the first run ordered
    proc = _train(run, "--train-iters", "4", "--global-batch-size", "8", "--load", ckpt, "--save", ckpt)
    assert "dropped a torn last line" in proc.stdout
    assert "needs 32 train samples, more than the 8" in proc.stdout
    assert _iterations(run / "metrics.jsonl") == [1, 2, 3, 4]
    assert "consumed samples:           16" in proc.stdout and "consumed samples:           24" in proc.stdout
    # the same --train-iters again: nothing to train, said so, exit 0
    proc = _train(run, "--train-iters", "4", "--global-batch-size", "8", "--load", ckpt)
    assert "nothing to train" in proc.stdout and _iterations(run / "metrics.jsonl") == [1, 2, 3, 4]


def test_new_run_moves_the_previous_runs_logs_aside(tmp_path):
    _train(tmp_path, "--train-iters", "2")
    first = (tmp_path / "metrics.jsonl").read_text()
    proc = _train(tmp_path, "--train-iters", "1")
    assert "held another run's metrics.jsonl" in proc.stdout
    aside = list(tmp_path.glob("previous-*/metrics.jsonl"))
    assert len(aside) == 1 and aside[0].read_text() == first  # not a byte lost
    assert (aside[0].parent / "config.yaml").exists()
    assert _iterations(tmp_path / "metrics.jsonl") == [1]


@pytest.mark.quick
def test_train_samples_cover_what_a_resumed_run_needs(tmp_path):
    """The train dataset length on resume: the saving run's when it suffices (same order), else enough."""
    from cp_ext.arguments import parse_args
    from cp_ext.training.trainer import train_samples

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")
    (ckpt / "iter_0000010").mkdir()
    (ckpt / "iter_0000010" / "metadata.json").write_text("{}")
    meta = {"format": "torch_dist", "iteration": 10, "consumed_samples": 40, "train_samples": 80}
    (ckpt / "iter_0000010" / "meta.json").write_text(json.dumps(meta))

    def samples(*flags):
        return train_samples(parse_args(["--load", str(ckpt), *flags], world_size=1))

    assert samples("--train-iters", "20", "--global-batch-size", "4") == 80  # as saved: the same order
    assert samples("--train-iters", "15", "--global-batch-size", "4") == 80  # shorter: still the same order
    assert samples("--train-iters", "20", "--global-batch-size", "2") == 80  # smaller batch: 40 + 10 x 2 fit
    assert samples("--train-iters", "20", "--global-batch-size", "8") == 160  # a larger batch: 20 x 8
    # 50 x 2 = 100 samples would end inside what is still needed (40 consumed + 40 x 2): never wrap to sample 0
    assert samples("--train-iters", "50", "--global-batch-size", "2") == 120
    assert samples("--train-iters", "30", "--global-batch-size", "4") == 120  # longer run
    assert train_samples(parse_args(["--load", str(ckpt), "--finetune", "--train-iters", "5"], world_size=1)) == 5
