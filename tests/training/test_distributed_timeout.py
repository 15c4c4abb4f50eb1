"""A stopped rank ends the job within --distributed-timeout-minutes, with a message; no 30-minute wait.

A real 2-rank run (DP2 over gloo) with --distributed-timeout-minutes 1: once it trains, rank 1
is frozen with SIGSTOP (as a debugger, a swapped-out node or a stuck driver would). Every
collective of rank 0 runs on some megatron or cp_ext group; each must carry the timeout, so
rank 0 must exit non-zero within the timeout plus a minute, saying which flag ran out.

The minute of waiting overlaps the rest of the suite: `start_early` (called by tests/conftest.py
once the session has collected this test) starts the run and a thread that watches it; the test
reads what the thread saw.
"""

import os
import signal
import tempfile
import threading
import time

import psutil
import pytest

from tests.launch import REPO_ROOT, TORCHRUN_ENV, session_dir, start_script

TIMEOUT_MINUTES = 1
_WATCH = {}


def _wait_for(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _watch(job):
    """Stop rank 1 once the run trains, then time how long rank 0 takes to give up."""
    out = job.log_dir / "rank0.out"
    try:
        _wait_for(lambda: (out.exists() and "iteration        3/" in out.read_text()) or job.poll() is not None, 240,
                  "iteration 3")
        assert job.poll() is None, job.logs()
        ranks = {str(r): psutil.Process(pid) for r, pid in job.rank_pids().items()}
        ranks["1"].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        _wait_for(lambda: not ranks["0"].is_running() or ranks["0"].status() == psutil.STATUS_ZOMBIE,
                  TIMEOUT_MINUTES * 60 + 90, "rank 0 to give up")
        _WATCH["waited"] = time.monotonic() - stopped
    except BaseException as e:  # noqa: BLE001 - re-raised by the test
        _WATCH["error"] = e
    finally:
        job.kill()  # every rank, the stopped one too (SIGKILL needs no cooperation)


def start_early():
    log_dir = tempfile.mkdtemp(prefix="timeout_run_", dir=session_dir())
    job = start_script(2, REPO_ROOT / "pretrain_moe.py", "--num-experts", "4", "--train-iters", "100000",
                       "--distributed-timeout-minutes", TIMEOUT_MINUTES, "--log-dir", log_dir)
    _WATCH.update(job=job, thread=threading.Thread(target=_watch, args=(job,), daemon=True))
    _WATCH["thread"].start()


@pytest.mark.quick
def test_stopped_rank_ends_the_run_within_the_timeout():
    if "job" not in _WATCH:  # run on its own, outside a session that started it early
        start_early()
    _WATCH["thread"].join(timeout=240 + TIMEOUT_MINUTES * 60 + 120)
    assert not _WATCH["thread"].is_alive(), "the watcher hung"
    if "error" in _WATCH:
        raise _WATCH["error"]
    waited, text = _WATCH["waited"], _WATCH["job"].output("err")
    assert waited < TIMEOUT_MINUTES * 60 + 60, f"rank 0 gave up after {waited:.0f} s"
    assert f"rank 0: a collective waited longer than --distributed-timeout-minutes {TIMEOUT_MINUTES}" in text, text[-3000:]
    assert "[rank0]: Traceback" not in text



def test_killed_rank_ends_the_run_at_once_naming_the_peer(tmp_path):
    """A rank's process dies (SIGKILL: a node crash, an OOM kill): its sockets close, and a rank on another
    node exits 1 within seconds, with one line naming the lost peer's address, no traceback and no wait for
    the timeout (`cp_ext.training.peer_failures`). Two processes, one rank each, as on two nodes (torchrun
    would end a dead rank's siblings on its own node itself). Rank 0 exited 0.06 s after the kill (measured
    here); the test takes about 15 s, most of it the run's start."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = dict({k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO_ROOT), RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(tmp_path / f"rank{rank}.out", "w") as out, open(tmp_path / f"rank{rank}.err", "w") as err:
            ranks.append(subprocess.Popen([sys.executable, str(REPO_ROOT / "pretrain_moe.py"), "--num-experts", "4",
                                           "--train-iters", "100000", "--distributed-timeout-minutes", "5",
                                           "--log-dir", str(tmp_path / "run")], stdout=out, stderr=err, env=env,
                                          cwd=REPO_ROOT, start_new_session=True))
    try:
        out = tmp_path / "rank0.out"
        _wait_for(lambda: "iteration        3/" in out.read_text() or ranks[0].poll() is not None, 240, "iteration 3")
        assert ranks[0].poll() is None, (tmp_path / "rank0.err").read_text()[-3000:]
        ranks[1].kill()
        killed = time.monotonic()
        ranks[0].wait(timeout=60)
        waited = time.monotonic() - killed
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    text = (tmp_path / "rank0.err").read_text()
    assert ranks[0].returncode == 1 and waited < 30, f"rank 0 exited {ranks[0].returncode} after {waited:.0f} s"
    lines = [line for line in text.splitlines() if "lost the connection to the rank at 127.0.0.1" in line]
    assert len(lines) == 1 and lines[0].startswith("pretrain_moe.py: rank 0: "), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
