"""A stopped rank ends the job within --distributed-timeout-minutes, with a message; no 30-minute wait.

A real 2-rank run (DP2 over gloo) with --distributed-timeout-minutes 1: once it trains, rank 1
is frozen with SIGSTOP (as a debugger, a swapped-out node or a stuck driver would). Every
collective of rank 0 runs on some megatron or cp_ext group; each must carry the timeout, so
rank 0 must exit non-zero within the timeout plus a minute, saying which flag ran out.

The minute of waiting overlaps the rest of the suite: `start_early` (called by tests/conftest.py
once the session has collected this test) starts the run and a thread that watches it; the test
reads what the thread saw.
"""

import signal
import tempfile
import threading
import time

import psutil
import pytest

from tests.launch import REPO_ROOT, session_dir, start_script

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
