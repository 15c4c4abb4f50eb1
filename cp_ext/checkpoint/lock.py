"""One job saves into a --save directory at a time: a lock file that rank 0 holds for the run.

A second job pointed at the same directory would interleave its checkpoints with the first one's and
roll the tracker back and forth; it stops before it builds anything, naming the other job.
"""

import json
import os
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


def acquire_save_lock(root):
    """One job saves into a directory at a time (collective; call before building the model).

    Rank 0 creates ``root/.cp_ext_save.lock`` naming its host and pid (``O_EXCL``). A lock whose
    process is gone from this host is stale and taken over; a live one, or one from another host,
    raises `ConfigError` on every rank, naming the other job (entry points print it once and exit 2).
    Released by `release_save_lock` (and left behind only by a killed job, where it is stale).
    """
    import socket

    problem = None
    if dist.get_rank() == 0:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        lock, me = root / LOCK, {"host": socket.gethostname(), "pid": os.getpid()}
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    other = json.loads(lock.read_text())
                except (OSError, ValueError):
                    other = {}
                if other.get("host") == me["host"] and isinstance(other.get("pid"), int) and not _pid_alive(other["pid"]):
                    lock.unlink(missing_ok=True)  # a killed job's lock: take it over
                    continue
                problem = (f"--save {root}: another job is saving there (host {other.get('host', '?')}, pid "
                           f"{other.get('pid', '?')}, lock file {lock}); give this run its own --save directory, "
                           f"or delete the lock file if that job is gone")
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


