"""Where a checkpoint's tensor files are written: in the training process, or (``--async-save``) in a
background process while training goes on, through megatron-core's own machinery
(``dist_checkpointing.strategies.async_utils.AsyncCallsQueue``).

An asynchronous save is megatron's ``AsyncRequest``: its write function runs in a process forked at the
save iteration (``TemporalAsyncCaller``). The fork is the copy to host memory: the child sees the tensors
as they were at the fork, while the parent trains on (on a GPU, megatron first copies them to the host).
Its finalize functions (megatron's ``.metadata``, then cp_ext's meta.json, publish and tracker) run on
every rank only once every rank's writer has finished, polled once per iteration (`AsyncWrites.poll`).

Two things make it safe on any host, and both are about processes, not megatron's logic:

- **Results through a file, not a Manager.** megatron's writer hands its results back through a queue.
  Its default is a ``multiprocessing.Manager`` queue, whose server process outlives a rank that is killed
  and keeps the job's stdout open, so the launcher never sees the job end; a pipe-backed queue deadlocks
  once the results outgrow the pipe, since the child cannot exit before the parent reads. `FileResults`
  is the queue megatron's writer gets: the child pickles its results into the staging directory, the
  parent reads them at finalize time.
- **The writer dies with its rank.** The forked writer asks the kernel for SIGKILL when its parent dies
  (``PR_SET_PDEATHSIG``): a rank killed mid-save leaves no process writing behind it, only a staging
  directory that the next run removes (`cp_ext.checkpoint.disk_format.remove_staging_debris`).
"""

import ctypes
import functools
import os
import pickle
import queue
import signal
import time
from pathlib import Path

from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
RESULTS_FILE = ".write_results_rank{rank}.pkl"  # in the staging directory; read and removed before publish


class FileResults:
    """The queue megatron's torch_dist writer puts its results into (``filesystem_async._results_queue``):
    ``put`` pickles them into a file that `target` names, ``get_nowait`` reads and removes it. One save
    at a time per rank writes (`AsyncWrites` finishes one before it starts the next)."""

    def __init__(self):
        self.path = None

    def target(self, staging_dir, rank):
        self.path = Path(staging_dir) / RESULTS_FILE.format(rank=rank)

    def put(self, results):
        tmp = self.path.with_suffix(".part")
        with open(tmp, "wb") as f:
            pickle.dump(results, f)
        os.replace(tmp, self.path)

    def get_nowait(self):
        if self.path is None or not self.path.exists():
            raise queue.Empty
        with open(self.path, "rb") as f:
            results = pickle.load(f)  # noqa: S301 - written by this rank's own writer, a moment ago
        self.path.unlink()
        return results


def install_file_results():
    """Give megatron's writer a `FileResults` (once per process); returns it."""
    if not isinstance(filesystem_async._results_queue, FileResults):
        filesystem_async._results_queue = FileResults()
    return filesystem_async._results_queue


def _die_with_parent(write, *args, **kwargs):
    """The forked writer: SIGKILL when the rank that forked it dies, then megatron's write function."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux's; elsewhere the writer may outlive
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the rank died between the fork and the prctl
        os._exit(1)
    delay = float(os.environ.get("CP_EXT_ASYNC_WRITE_DELAY", "0"))  # tests: a write still in flight
    if delay:
        time.sleep(delay)
    write(*args, **kwargs)


class AsyncWrites:
    """The rank's background checkpoint writes (``--async-save``): at most one in flight.

    `schedule` starts one; `poll` (every iteration, on every rank) finalizes it once every rank's writer
    is done; `finish` waits for it. Each is collective while a write is in flight, and all ranks agree
    on whether one is (they schedule at the same iterations)."""

    def __init__(self):
        self.queue = AsyncCallsQueue(persistent=False)
        self.in_flight = None  # (iteration, directory) of the write in flight

    def schedule(self, request, iteration, directory):
        request = request._replace(async_fn=functools.partial(_die_with_parent, request.async_fn))
        self.queue.schedule_async_request(request)
        self.in_flight = (iteration, directory)

    def poll(self):
        """Finalize the write in flight if every rank's writer has finished (collective). Returns the
        iteration finalized, or None. A failed write raises here, on every rank."""
        if self.in_flight is None:
            return None
        return self._finalize(blocking=False)

    def finish(self):
        """Wait for the write in flight, then finalize it (collective). Returns its iteration or None."""
        if self.in_flight is None:
            return None
        return self._finalize(blocking=True)

    def _finalize(self, blocking):
        iteration = self.in_flight[0]
        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException:
            self.in_flight = None
            raise
        if not done:
            return None
        self.in_flight = None
        return iteration

    def abort(self):
        """Kill the writer without finalizing (the run is failing): its staging directory stays debris.
        (megatron's ``AsyncCallsQueue.close(abort=True)`` stops a persistent worker only.)"""
        while self.queue.async_calls:
            self.queue.async_calls.popleft().async_caller.close(abort=True)
        self.in_flight = None
