"""torchrun SIGKILLed mid-save leaves no rank behind, and the checkpoint it points at still loads.

A `kill -9` of torchrun (an OOM kill, SLURM tearing a step down under ``proctrack/linuxproc``) used to leave
a rank re-parented to init, blocked in a futex, holding its sockets and the run's log for as long as nobody
looked (issue #39). Every rank now dies with its launcher (`cp_ext.training.signals.die_with_launcher`).
The run saves every iteration, so the kill lands in or near a save; the tracker then names a complete
checkpoint, which a new run loads (taking the killed run's save lock over) and trains on. About 30 s.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.launch import REPO_ROOT, TORCHRUN_ENV, run_script

TRACKER = "latest_checkpointed_iteration.txt"
pytestmark = pytest.mark.ci_leg("3.11")  # the kernel's PR_SET_PDEATHSIG, on either megatron-core
FLAGS = ["--num-experts", "4", "--log-interval", "1", "--lr-decay-iters", "100000"]


def sigkill_pending(proc):
    """Whether the kernel holds a SIGKILL for ``proc`` (its own or its process's pending set), or it is gone."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except FileNotFoundError:
        return True
    return any(mask & (1 << (signal.SIGKILL - 1)) for mask in pending) or proc.status() == psutil.STATUS_ZOMBIE


def describe(proc):
    try:
        return f"{proc.pid} ({proc.status()}) {' '.join(proc.cmdline()[-4:])}"
    except psutil.NoSuchProcess:
        return f"{proc.pid} (gone)"


def test_no_rank_outlives_a_killed_torchrun(tmp_path):
    save = tmp_path / "ck"
    env = dict({k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO_ROOT))
    with open(tmp_path / "torchrun.log", "w") as log:
        torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc-per-node", "2", str(REPO_ROOT / "pretrain_moe.py"), *FLAGS,
                                     "--train-iters", "100000", "--save", str(save), "--save-interval", "1",
                                     "--log-dir", str(tmp_path / "run")],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                    start_new_session=True)
    ranks = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and torchrun.poll() is None:
            if (save / TRACKER).exists() and int((save / TRACKER).read_text() or 0) >= 2:
                break
            time.sleep(0.2)
        assert torchrun.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
        ranks = psutil.Process(torchrun.pid).children(recursive=True)
        assert len(ranks) >= 2, ranks
        torchrun.send_signal(signal.SIGKILL)
        torchrun.wait()
        _, alive = psutil.wait_procs(ranks, timeout=20)
        # One full suite on 2 cores found both ranks alive 20 s after the kill. A rank inside a write to a busy
        # disk sleeps uninterruptibly with the kernel's SIGKILL queued, and dies when the write returns; a rank
        # with no SIGKILL pending is the bug, whatever its state (the messages give each one's).
        unsignalled = [describe(p) for p in alive if not sigkill_pending(p)]
        assert not unsignalled, f"outlived torchrun by 20 s with no SIGKILL pending: {unsignalled}"
        _, alive = psutil.wait_procs(alive, timeout=100)
        alive = [p for p in alive if describe(p).split()[1] not in ("(gone)", f"({psutil.STATUS_ZOMBIE})")]
        assert not alive, f"SIGKILLed but alive 120 s after torchrun: {[describe(p) for p in alive]}"
    finally:
        for proc in ranks:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        if torchrun.poll() is None:
            torchrun.kill()
    saved = int((save / TRACKER).read_text())
    resumed = run_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--train-iters", str(saved + 1), "--load", save,
                         "--log-dir", tmp_path / "resumed")
    assert f"iteration {saved + 1:>8}/" in resumed.stdout, resumed.stdout[-2000:]
