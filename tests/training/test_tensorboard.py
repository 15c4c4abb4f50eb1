"""--tensorboard-dir: real pretrain_moe.py runs, their event files read back with TensorBoard's own reader.

A 2-rank CP2 run writes Megatron-LM's scalar names from rank 0 only, every
--tensorboard-log-interval iterations, with the values metrics.jsonl holds (TensorBoard stores
float32); evaluations as ``lm loss validation`` (+ ppl). A run stopped by Ctrl-C still has every
iteration metrics.jsonl logged in its events, and a run starting at iteration 0 moves an earlier
run's event files aside. (The writer's thread writes each event soon after it is queued, so this
run would keep them without `Trainer.train` closing the writer on the way out too; the close
matters where the process ends at once after an error: pretrain_moe.py's ``os._exit`` on a
collective timeout.)
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT, run_script, start_script

FLAGS = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization",
         "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--global-batch-size", "4", "--seed", "3", "--device", "cpu"]
TRAIN = {"lm loss": "train/lm_loss", "learning-rate": "train/learning_rate", "grad-norm": "train/grad_norm",
         "load_balancing_loss": "train/load_balancing_loss", "z_loss": "train/z_loss"}
FLOAT32 = 1e-6  # TensorBoard keeps scalars as float32


def scalars(directory):
    """{tag: [(step, value), ...]} of every event file in `directory`, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def records(log_dir):
    return [json.loads(line) for line in Path(log_dir, "metrics.jsonl").read_text().splitlines()]


@pytest.mark.quick
def test_megatron_scalar_names_from_rank_0_equal_metrics_jsonl(tmp_path):
    tb = tmp_path / "tb"
    run_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--context-parallel-size", "2", "--moe-z-loss-coeff", "1e-3",
               "--train-iters", "4", "--log-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
               "--split", "80,10,10", "--log-dir", tmp_path, "--tensorboard-dir", tb, "--tensorboard-log-interval", "2",
               "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard", timeout=300)
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1  # rank 0's; rank 1 writes none
    got = scalars(tb)
    names = {*TRAIN, "batch-size", "loss-scale", "lm loss validation", "lm loss validation ppl", "lm loss test",
             "lm loss test ppl"}
    assert set(got) == names | {f"{n} vs samples" for n in names} | {"iteration-time"}, sorted(got)

    lines = records(tmp_path)
    train = {r["iteration"]: r for r in lines if "train/lm_loss" in r}
    for tag, key in TRAIN.items():  # every --tensorboard-log-interval 2 iterations
        assert [s for s, _ in got[tag]] == [2, 4], tag
        assert [v for _, v in got[tag]] == pytest.approx([train[s][key] for s in (2, 4)], rel=FLOAT32), tag
        assert got[f"{tag} vs samples"] == [(8, got[tag][0][1]), (16, got[tag][1][1])]  # consumed samples
    assert got["batch-size"] == [(2, 4.0), (4, 4.0)] and got["loss-scale"] == [(2, 1.0), (4, 1.0)]
    # --log-timers-to-tensorboard: seconds per iteration, the mean over each --log-interval 2 line's iterations
    assert [s for s, _ in got["iteration-time"]] == [2, 4]
    for (step, value), first in zip(got["iteration-time"], (1, 3)):
        mean_ms = (train[first]["train/iteration_time_ms"] + train[first + 1]["train/iteration_time_ms"]) / 2
        assert value == pytest.approx(mean_ms / 1000, rel=FLOAT32)

    evaluated = {(r["iteration"], k): v for r in lines for k, v in r.items() if k.startswith(("valid/", "test/"))}
    for tag, split, steps in (("lm loss validation", "valid", [2, 4]), ("lm loss test", "test", [4])):
        assert [s for s, _ in got[tag]] == steps
        assert [v for _, v in got[tag]] == pytest.approx([evaluated[s, f"{split}/lm_loss"] for s in steps], rel=FLOAT32)
        assert [v for _, v in got[f"{tag} ppl"]] == pytest.approx([evaluated[s, f"{split}/lm_loss_ppl"] for s in steps],
                                                                  rel=FLOAT32)


def test_ctrl_c_keeps_every_logged_iteration_and_a_new_run_moves_old_events_aside(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    tb = tmp_path / "tb"
    earlier = SummaryWriter(log_dir=str(tb))  # another run's events in the same directory
    earlier.add_scalar("lm loss", 9.0, 1)
    earlier.close()
    # A queue far larger than the run: nothing reaches the disk before the writer is closed.
    run = start_script(1, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--train-iters", "500", "--log-dir", tmp_path,
                       "--tensorboard-dir", tb, "--tensorboard-queue-size", "100000")
    metrics, deadline = tmp_path / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and run.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    [pid] = run.rank_pids().values()
    os.kill(pid, signal.SIGINT)  # Ctrl-C
    proc = run.finish(120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr, proc.stderr[-3000:]
    logged = [r["iteration"] for r in records(tmp_path)]
    assert len(logged) >= 3 and logged[-1] < 500
    got = scalars(tb)  # the top directory only: this run's file
    steps = [s for s, _ in got["lm loss"]]  # written before each metrics.jsonl line: at most one more
    assert steps[:len(logged)] == logged and len(steps) - len(logged) <= 1, (steps, logged)
    [aside] = tb.glob("previous-*")
    assert scalars(aside)["lm loss"] == [(1, 9.0)]
    assert "moved them to" in proc.stdout
