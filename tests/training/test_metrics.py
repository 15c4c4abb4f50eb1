"""Run metrics: metrics.jsonl always, wandb when asked, never a crash because of wandb.

Real pretrain_moe.py runs and real wandb (offline / disabled / online without a key).
"""

import json
import os
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, run_script

FLAGS = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--global-batch-size", "4", "--train-iters", "2", "--seed", "3"]
KEYS = {"iteration", "train/lm_loss", "train/load_balancing_loss", "train/grad_norm", "train/learning_rate",
        "train/tokens_per_second", "train/iteration_time_ms", "train/memory_bytes"}


def _train(log_dir, *args, nproc=1, wandb_mode=None, extra_env=None):
    env = dict(WANDB_SILENT="true", **(extra_env or {}))
    if wandb_mode:
        env["WANDB_MODE"] = wandb_mode
    unset = [k for k in os.environ if k.startswith("WANDB_") and k not in env]
    proc = run_script(nproc, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--log-dir", log_dir, *args, env=env, unset=unset,
                      timeout=300)
    records = [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]
    return proc, records


@pytest.mark.quick
def test_offline_wandb_and_metrics_jsonl(tmp_path):
    _, records = _train(tmp_path, "--wandb-project", "cp-ext-test", "--wandb-exp-name", "offline", wandb_mode="offline")
    assert [r["iteration"] for r in records] == [1, 2] and all(set(r) == KEYS for r in records)
    assert all(r["train/memory_bytes"] > 0 for r in records)
    logs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1 and logs[0].stat().st_size > 0
    assert (tmp_path / "config.yaml").exists() and "num_experts: 4" in (tmp_path / "config.yaml").read_text()


@pytest.mark.parametrize("mode,env", [("disabled", {}), (None, {"WANDB_DISABLED": "true"})], ids=["WANDB_MODE", "WANDB_DISABLED"])
def test_wandb_switched_off(tmp_path, mode, env):
    _, records = _train(tmp_path, "--wandb-project", "cp-ext-test", wandb_mode=mode, extra_env=env)
    assert len(records) == 2 and not list(tmp_path.glob("wandb/*run-*"))


def test_missing_api_key_never_crashes_training(tmp_path):
    home = tmp_path / "home"  # no ~/.netrc, no key
    home.mkdir()
    proc, records = _train(tmp_path / "run", "--wandb-project", "cp-ext-test", wandb_mode="online",
                           extra_env={"HOME": str(home)})
    assert len(records) == 2
    assert "wandb: disabled for this run" in proc.stdout + proc.stderr


def test_last_pipeline_stage_loss_reaches_the_logging_rank(tmp_path):
    _, single = _train(tmp_path / "pp1")
    _, piped = _train(tmp_path / "pp2", "--pipeline-model-parallel-size", "2", nproc=2)
    for a, b in zip(single, piped):
        assert abs(a["train/lm_loss"] - b["train/lm_loss"]) <= 1e-5 * a["train/lm_loss"]
        assert abs(a["train/load_balancing_loss"] - b["train/load_balancing_loss"]) <= 1e-5 * a["train/load_balancing_loss"]


def test_mtp_losses_reach_the_iteration_line_metrics_and_evaluation(tmp_path):
    """--mtp-num-layers 2: Megatron-LM's ``mtp_1 loss`` / ``mtp_2 loss`` on the iteration line and in
    metrics.jsonl (train/mtp_1_loss), and each depth's value and PPL in the validation block (valid/mtp_1_loss)."""
    proc, records = _train(tmp_path / "mtp", "--mtp-num-layers", "2", "--eval-interval", "2", "--eval-iters", "1",
                           "--split", "90,10,0")
    assert all(record["train/mtp_1_loss"] > 0 and record["train/mtp_2_loss"] > 0 for record in records if "train/lm_loss" in record)
    assert proc.stdout.count("| mtp_1 loss: ") == 2 and proc.stdout.count("| mtp_2 loss: ") == 2, proc.stdout
    assert " validation loss at iteration 2 | lm loss value: " in proc.stdout
    assert "| mtp_1 loss value: " in proc.stdout and "| mtp_2 loss PPL: " in proc.stdout, proc.stdout
    valid = [record for record in records if "valid/lm_loss" in record]
    assert len(valid) == 1 and valid[0]["valid/mtp_1_loss"] > 0 and valid[0]["valid/mtp_2_loss"] > 0, valid
