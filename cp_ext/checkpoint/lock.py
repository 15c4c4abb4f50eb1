"""One job saves into a --save directory at a time: a lock file that rank 0 holds for the run.

A second job pointed at the same directory would interleave its checkpoints with the first one's and
roll the tracker back and forth; it stops before it builds anything, naming the other job.

Who holds a lock: under SLURM, the job (``SLURM_JOB_ID``). A requeued job keeps its id but usually starts
on other nodes, so rank 0's host and pid say nothing about it: the lock of the same job id is its own
earlier run's, and is taken over. Outside SLURM, the host and pid: a lock whose process is gone from this
host is a killed run's. A live holder, or one that cannot be checked (another host, no SLURM), refuses.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import torch.distributed as dist

from cp_ext.errors import ConfigError

LOCK = ".cp_ext_save.lock"


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder():
    """What this run writes into the lock: its SLURM job (when it is one), host and pid."""
    import socket

    me = {"host": socket.gethostname(), "pid": os.getpid()}
    if os.environ.get("SLURM_JOB_ID"):
        me["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        me["slurm_restart_count"] = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    return me


def slurm_job_running(job_id) -> bool:
    """Whether SLURM still runs (or will run) job ``job_id``; True where that cannot be asked (no squeue)."""
    if shutil.which("squeue") is None:
        return True
    try:
        proc = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if proc.returncode != 0:  # "Invalid job id specified": purged, long finished
        return "invalid job id" not in proc.stderr.lower()
    states = proc.stdout.split()
    return any(state in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")
               for state in states)


def _stale(other, me) -> bool:
    """A lock left by a run that cannot be saving any more."""
    if other.get("slurm_job_id"):
        if other["slurm_job_id"] == me.get("slurm_job_id"):
            return True  # this job's own run before a requeue (SLURM never runs two of them at once)
        return not slurm_job_running(other["slurm_job_id"])
    return other.get("host") == me["host"] and isinstance(other.get("pid"), int) and not _pid_alive(other["pid"])


def _describe(other):
    job = f"SLURM job {other['slurm_job_id']}, " if other.get("slurm_job_id") else ""
    return f"{job}host {other.get('host', '?')}, pid {other.get('pid', '?')}"


def acquire_save_lock(root):
    """One job saves into a directory at a time (collective; call before building the model).

    Rank 0 creates ``root/.cp_ext_save.lock`` naming its job, host and pid (``O_EXCL``). A stale lock
    (`_stale`) is taken over; a live one raises `ConfigError` on every rank, naming the other job (entry
    points print it once and exit 2). Released by `release_save_lock` (left behind only by a killed run).
    """
    problem = None
    if dist.get_rank() == 0:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        lock, me = root / LOCK, _holder()
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    other = json.loads(lock.read_text())
                except (OSError, ValueError):
                    other = {}
                if _stale(other, me):
                    lock.unlink(missing_ok=True)  # a killed or requeued run's lock: take it over
                    continue
                problem = (f"--save {root}: another job is saving there ({_describe(other)}, lock file {lock}); "
                           f"give this run its own --save directory, or delete the lock file if that job is gone")
                break
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            break
    decision = [problem]
    dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        raise ConfigError(f"  - {decision[0]}")


def release_save_lock(root):
    if dist.get_rank() == 0:
        lock = Path(root) / LOCK
        try:
            if json.loads(lock.read_text()).get("pid") == os.getpid():
                lock.unlink()
        except (OSError, ValueError):
            pass
