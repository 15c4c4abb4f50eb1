"""Checkpoints that do not stop training: Megatron-LM's --async-save, fully parallel save and load, and
non-persistent checkpoints (global and local), in real 2-rank runs of pretrain_moe.py (DP2, EP2).

- An asynchronous run has the synchronous run's losses, and its checkpoints hold the same tensors, bit for
  bit, although training changed the weights while they were written (the one of iteration 2 most of all).
- A rank killed (SIGKILL) while its background write is in flight: the tracker names the last complete
  checkpoint, the staging directory is never published, and the resumed run removes it and continues the
  synchronous run's loss curve exactly. SIGTERM while one is in flight: it finishes, the exit save is
  written, and the run resumes exactly.
- Fully parallel save spreads the replicated tensors' bytes over the DP ranks; without it rank 0 writes
  them all (counted per rank's files). Fully parallel load resumes at another grid (EP2 -> EP1) within 1e-5.
- --load takes the newest of the persistent, global and local checkpoints and says which; a rank's lost
  local part makes it fall back to the newest one every rank can read, saying so.

``CP_EXT_ASYNC_WRITE_DELAY`` holds each background write for that many seconds, so that a test can act
while one is in flight.
"""

import json
import os
import shutil
import signal
import time

import pytest

from cp_ext.arguments import ConfigError, parse_args
from cp_ext.arguments.checkpointing import has_local_checkpoints
from cp_ext.checkpoint.disk_format import TRACKER
from tests.launch import REPO_ROOT, run_script, start_script

FLAGS = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu",
         "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--global-batch-size", "4", "--train-iters", "40", "--lr-decay-iters", "40",
         "--lr", "1e-3", "--lr-warmup-iters", "2", "--seed", "5", "--log-interval", "1", "--device", "cpu",
         "--expert-model-parallel-size", "2"]


def _run(*args, env=None):
    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, *args, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _losses(log_dir):
    rows = map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())
    return {r["iteration"]: r["train/lm_loss"] for r in rows}


def _tensors(directory):
    """Every tensor of a torch_dist checkpoint, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.parent / f"{directory.name}.pt"
    dcp_to_torch_save(directory, target)
    try:
        return {k: v for k, v in torch.load(target, weights_only=False).items() if isinstance(v, torch.Tensor)}
    finally:
        target.unlink()


def _rank_bytes(directory):
    return [sum(f.stat().st_size for f in directory.glob(f"__{rank}_*.distcp")) for rank in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The synchronous run and the asynchronous one (with global non-persistent checkpoints at every
    iteration and the constant-structure cache), both to iteration 6."""
    root = tmp_path_factory.mktemp("async")
    sync_proc = _run("--save", root / "sync", "--save-interval", "2", "--exit-interval", "6", "--log-dir", root / "sync-log")
    proc = _run("--save", root / "async", "--save-interval", "2", "--exit-interval", "6", "--async-save",
                "--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "1",
                "--ckpt-assume-constant-structure", "--use-persistent-ckpt-worker", "--log-dir", root / "async-log")
    return root, _losses(root / "sync-log"), proc, sync_proc


def test_async_save_has_the_same_losses_and_bytes(runs):
    root, sync, proc, sync_proc = runs
    assert _losses(root / "async-log") == sync and sorted(sync) == list(range(1, 7))
    for iteration in (2, 6):
        name = f"iter_{iteration:07d}"
        a, s = _tensors(root / "async" / name), _tensors(root / "sync" / name)
        assert sorted(a) == sorted(s) and len(a) > 20
        assert all(a[k].equal(s[k]) for k in a), [k for k in a if not a[k].equal(s[k])]
    assert (root / "async" / TRACKER).read_text() == "6\n"
    # global non-persistent ones: only the newest kept, next to the persistent ones by default
    assert [p.name for p in (root / "async" / "non_persistent").glob("iter_*")] == ["iter_0000005"]
    # --ckpt-assume-constant-structure: megatron's cached plan is reused from the second of the six saves on
    assert proc.stdout.count("(save plan reused: --ckpt-assume-constant-structure)") == 5, proc.stdout[-3000:]
    assert "save plan reused" not in sync_proc.stdout and sync_proc.stdout.count("saved checkpoint at") == 3
    assert proc.stdout.count("--use-persistent-ckpt-worker: cp_ext's --async-save forks one writer per save") == 1
    # a save due while the previous one still writes waits for it, said once
    assert proc.stdout.count("was still being written when iteration") <= 1


def test_fully_parallel_save_spreads_the_bytes_and_load_resumes_exactly(runs, tmp_path):
    root, sync, _, _ = runs
    spread = _rank_bytes(root / "sync" / "iter_0000006")
    _run("--save", tmp_path / "nofp", "--no-ckpt-fully-parallel-save", "--exit-interval", "2",
         "--log-dir", tmp_path / "nofp-log")
    first = _rank_bytes(tmp_path / "nofp" / "iter_0000002")
    total = sum(spread)
    assert abs(sum(first) - total) < 0.02 * total  # each tensor written once either way
    # without it rank 0 writes every replicated tensor and rank 1 only its experts; with it they are spread
    assert first[0] - first[1] > 0.15 * total and abs(spread[0] - spread[1]) < (first[0] - first[1]) / 4, (spread, first)
    # fully parallel load at another grid (EP1: the experts replicated now): resharding still holds
    _run("--load", tmp_path / "nofp", "--ckpt-fully-parallel-load", "--exit-interval", "4",
         "--expert-model-parallel-size", "1", "--log-dir", tmp_path / "fp-load")
    resumed = _losses(tmp_path / "fp-load")
    assert sorted(resumed) == [3, 4] and all(abs(resumed[i] - sync[i]) <= 1e-5 * abs(sync[i]) for i in resumed), resumed


def test_load_takes_the_newest_global_non_persistent_checkpoint(runs, tmp_path):
    root, sync, _, _ = runs
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(root / "sync" / "iter_0000004", load / "iter_0000004")
    (load / TRACKER).write_text("4\n")
    shutil.copytree(root / "async" / "non_persistent", load / "non_persistent")
    proc = _run("--load", load, "--save", load, "--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "100",
                "--exit-interval", "6", "--log-dir", tmp_path / "log")
    assert f"the non-persistent checkpoint of iteration 5 in {load / 'non_persistent'} is the newest (persistent: 4)" \
        in proc.stdout
    assert _losses(tmp_path / "log") == {6: sync[6]}


@pytest.mark.skipif(not has_local_checkpoints(), reason="nvidia-resiliency-ext is not installed (the dev extra "
                    "installs it on Python < 3.12: megatron-core 0.19 fails to import beside its release 0.4.1)")
def test_local_checkpoints_resume_and_fall_back_when_a_rank_lost_its_part(runs, tmp_path):
    root, sync, _, _ = runs
    local = tmp_path / "node-local"
    _run("--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", local,
         "--non-persistent-save-interval", "2", "--async-save", "--exit-interval", "5", "--log-dir", tmp_path / "a")
    assert sorted(p.name for p in local.rglob("*.pt")) == ["iter_0000004_0_local.pt", "iter_0000004_1_local.pt"]
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(root / "sync" / "iter_0000002", load / "iter_0000002")
    (load / TRACKER).write_text("2\n")
    flags = ["--load", load, "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", local,
             "--non-persistent-save-interval", "100", "--exit-interval", "6"]
    proc = _run(*flags, "--log-dir", tmp_path / "b")
    assert "the non-persistent local checkpoint of iteration 4 is the newest (persistent and global: 2)" in proc.stdout
    assert _losses(tmp_path / "b") == {5: sync[5], 6: sync[6]}

    (local / "1" / "iter_0000004_1_local.pt").unlink()  # rank 1's node lost its disk
    proc = _run(*flags, "--log-dir", tmp_path / "c")
    assert ("the local checkpoint of iteration 4 is not held by every rank (ranks 1 lack their part: a lost node "
            "or disk?); resuming from iteration 2 instead") in proc.stdout, proc.stdout[-3000:]
    assert _losses(tmp_path / "c") == {i: sync[i] for i in (3, 4, 5, 6)}


def _wait_for(condition, run, what, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and run.poll() is None:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {what}:\n{run.logs()}")


def test_a_rank_killed_mid_write_leaves_the_last_complete_checkpoint(runs, tmp_path):
    """SIGKILL of one rank while its background write of iteration 4 is in flight (held 4 s each)."""
    _, sync, _, _ = runs
    save = tmp_path / "ck"
    run = start_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--save", save, "--save-interval", "2",
                       "--async-save", "--log-dir", tmp_path / "a", env={"CP_EXT_ASYNC_WRITE_DELAY": "4"})
    staged = save / "iter_0000004.tmp"
    _wait_for(lambda: (save / TRACKER).exists() and staged.exists(), run, "iteration 4's save in flight")
    os.kill(run.rank_pids()[1], signal.SIGKILL)
    assert run.finish(120).returncode != 0
    assert (save / TRACKER).read_text() == "2\n" and staged.is_dir() and not (save / "iter_0000004").exists()

    proc = _run("--load", save, "--save", save, "--exit-interval", "6", "--log-dir", tmp_path / "b")
    assert f"--save {save}: removed what an unfinished save left: iter_0000004.tmp" in proc.stdout
    assert "loaded checkpoint of iteration 2" in proc.stdout
    assert _losses(tmp_path / "b") == {i: sync[i] for i in (3, 4, 5, 6)}
    assert (save / TRACKER).read_text() == "6\n"


def test_sigterm_during_an_async_write_finishes_it_then_saves_and_resumes(runs, tmp_path):
    _, sync, _, _ = runs
    save = tmp_path / "ck"
    run = start_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--save", save, "--save-interval", "2",
                       "--async-save", "--exit-signal-handler", "--log-dir", tmp_path / "a",
                       env={"CP_EXT_ASYNC_WRITE_DELAY": "3"})
    _wait_for(lambda: (save / "iter_0000002.tmp").exists(), run, "iteration 2's save in flight")
    for pid in run.rank_pids().values():
        os.kill(pid, signal.SIGTERM)
    proc = run.finish(180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stopped = int((save / TRACKER).read_text())
    assert "saved checkpoint at iteration 2 " in proc.stdout and f"saved checkpoint at iteration {stopped} " in proc.stdout
    assert 2 < stopped < 6, stopped  # the stop came while iteration 2's write was held
    proc = _run("--load", save, "--exit-interval", "6", "--log-dir", tmp_path / "b")
    assert _losses(tmp_path / "b") == {i: sync[i] for i in range(stopped + 1, 7)}


@pytest.mark.quick
def test_bad_checkpoint_flags_are_named(tmp_path):
    def error(*argv):
        with pytest.raises(ConfigError) as info:
            parse_args(FLAGS + list(map(str, argv)), world_size=2)
        return str(info.value)

    assert "--async-save needs --ckpt-format torch_dist" in error("--async-save", "--ckpt-format", "torch")
    assert "cp_ext reads and writes --ckpt-format torch_dist" in error("--ckpt-format", "torch_dcp")
    assert "needs --non-persistent-save-interval N" in error("--non-persistent-ckpt-type", "global", "--save", tmp_path)
    assert "needs --non-persistent-ckpt-type global or local" in error("--non-persistent-save-interval", "5")
    assert "needs --non-persistent-local-ckpt-dir DIR" in error("--non-persistent-ckpt-type", "local",
                                                                "--non-persistent-save-interval", "5")
    assert "needs --non-persistent-global-ckpt-dir DIR, or --save DIR" in error(
        "--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "5")
    assert "in_memory is not supported" in error("--non-persistent-ckpt-type", "in_memory")
    parse_args(FLAGS + ["--async-save", "--save", str(tmp_path), "--non-persistent-ckpt-type", "global",
                        "--non-persistent-save-interval", "5"], world_size=2)


def test_dist_ckpt_strictness_is_megatrons(runs, tmp_path):
    """raise_all refuses a load that leaves the checkpoint's optimizer state unread (--no-load-optim), naming
    the flag; an unknown value is argparse's error, exit 2, one message."""
    root, _, _, _ = runs
    proc = run_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--load", root / "sync", "--no-load-optim",
                      "--dist-ckpt-strictness", "raise_all", "--exit-interval", "7", "--log-dir", tmp_path / "a",
                      check=False)
    assert proc.returncode != 0 and proc.stderr.count("--dist-ckpt-strictness raise_all:") == 1, proc.stderr[-3000:]
    proc = run_script(0, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--dist-ckpt-strictness", "strict", check=False)
    assert proc.returncode == 2 and proc.stderr.count("--dist-ckpt-strictness") == 1, proc.stderr[-2000:]


@pytest.mark.quick
def test_ranks_compare_the_common_state_without_their_own_flags():
    """Before rank 0 writes the common state, megatron compares every rank's: the flags that are each rank's own
    (the default --log-dir carries each rank's clock) are left out, as Megatron-LM leaves out rank and local_rank."""
    import argparse

    from cp_ext.checkpoint.common_state import comparable_common_state

    common = {"iteration": 3, "args": argparse.Namespace(log_dir="runs/run-20261207-235959", lr=1e-3, rank=1)}
    assert comparable_common_state(common) == {"iteration": 3, "args": {"lr": 1e-3}}
    assert isinstance(common["args"], argparse.Namespace)  # what is saved keeps them
