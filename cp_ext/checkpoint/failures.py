"""How a failed save or an unreadable checkpoint reaches the user: one error, raised on every rank alike,
naming the directory and the cause, with nothing published."""

import shutil

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from cp_ext.checkpoint.disk_format import latest_iteration


class CheckpointWriteError(RuntimeError):
    """A save that failed on some rank, raised on every rank: the message names the directory and the cause."""


def agree_on_write(failure, root, iteration, staged):
    """Collective: every rank learns whether any rank's part of the save failed, and stops alike. The staging
    directory goes (it is what filled a full disk); the tracker still names the last complete checkpoint."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if failure is None else cause(failure))
    failed = [(rank, text) for rank, text in enumerate(failures) if text is not None]
    if not failed:
        return
    free = shutil.disk_usage(root).free / 2**20  # before the staging directory goes: what the save met
    if dist.get_rank() == 0 and staged is not None:
        shutil.rmtree(staged, ignore_errors=True)
    last = latest_iteration(root)
    rank, text = next(((r, t) for r, t in failed if "Errno" in t), failed[0])  # an OS error says the most
    raise CheckpointWriteError(
        f"--save {root}: the checkpoint of iteration {iteration} could not be written ({len(failed)} of "
        f"{len(failures)} ranks failed; rank {rank}: {text}; {free:.1f} MiB were free on its disk). The tracker "
        f"still names {'iteration ' + str(last) if last is not None else 'no checkpoint'}; free space on {root} "
        f"(or give --save another directory) and resume with --load")


def cause(error):
    """One line for a failed save: torch's CheckpointException carries each rank's own error (the OS error,
    where there is one), and its text is their tracebacks."""
    if isinstance(error, CheckpointException) and error.failures:
        errors = [e[0] if isinstance(e, tuple) else e for e in error.failures.values()]  # (error, its frames)
        texts = [str(e).removeprefix("Worker failure: ") for e in errors]
        return next((t for t in texts if "Errno" in t), texts[0])[:300]
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


class CheckpointReadError(RuntimeError):
    """A checkpoint that cannot be read: the message names the directory and what failed."""
