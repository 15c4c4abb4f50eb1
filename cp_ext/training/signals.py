"""Megatron-LM's ways to stop a run cleanly, saving first: --exit-interval, --exit-duration-in-mins and
--exit-signal-handler; and a rank that dies with its launcher.

SLURM sends SIGTERM before a time limit (``#SBATCH --signal=TERM@120``) or on preemption. The
handler only records that it arrived; at the end of the current iteration all ranks agree
(any rank that received it counts, one all-reduce), the trainer saves a checkpoint when
``--save`` is set and exits with status 0, so the job can be resumed with ``--load``. A duration
is agreed the same way: ranks' clocks and start times differ by a little, and all must stop together.
"""

import time

import signal

import torch
import torch.distributed as dist


def any_rank(condition: bool, device) -> bool:
    """Collective: True on every rank where ``condition`` holds on any rank (so all ranks stop together)."""
    flag = torch.tensor([1.0 if condition else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class ExitSignalHandler:
    def __init__(self, sig=signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._previous = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank_received(self, device) -> bool:
        """Collective: True on every rank once any rank received the signal."""
        return any_rank(self.received, device)

    def restore(self):
        signal.signal(self.sig, self._previous)


def _kill_me_when_parent_dies(parent):
    """``PR_SET_PDEATHSIG``: the kernel sends this process SIGKILL when ``parent`` (the thread that started
    it) exits. False where the call is unavailable."""
    import ctypes
    import os

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the prctl took hold
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def die_with_launcher():
    """Under torchrun: this rank, and every process it forks, gets SIGKILL when its torchrun agent dies.

    torchrun ends its workers when it exits normally or on a signal it can catch. A SIGKILL of torchrun (an
    out-of-memory kill, ``kill -9``, a job step torn down by SLURM's ``proctrack/linuxproc``, which finds
    processes by parent) leaves the ranks behind, re-parented to init: a rank blocked in a collective then
    holds its sockets, its memory and the run's log, until someone finds it. ``PR_SET_PDEATHSIG`` makes the
    kernel kill the rank with its launcher.

    A fork does not inherit it, and a rank forks: megatron's torch_dist writer starts ``thread_count`` (2)
    processes for every save (``FileSystemWriterAsync.write_preloaded_data_multiproc``). A writer whose rank
    is killed mid-save outlives it, blocked for good on the queues it shares with the dead rank (one full
    suite found one asleep 20 s after torchrun's kill). So each child forked here sets it too, against the
    rank: the kill reaches the whole tree, however deep. (The kernel ties it to the forking *thread*; the
    writers are forked by the rank's main thread, and cp_ext saves synchronously.)"""
    import os
    import sys

    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    if _kill_me_when_parent_dies(os.getppid()):
        os.register_at_fork(before=_note_forking_process,
                            after_in_child=lambda: _kill_me_when_parent_dies(_forking_process))


_forking_process = None


def _note_forking_process():
    """Before a fork, in the parent: its pid, which the child compares with its own parent's (a child whose
    parent died during the fork is killed at once). A child of a child records its own parent likewise."""
    import os

    global _forking_process
    _forking_process = os.getpid()


class ExitConditions:
    """Whether to stop after an iteration, and why (`reason`): each of Megatron-LM's exit flags that is set."""

    def __init__(self, args, device, started=None):
        self.args, self.device = args, device
        self.started = time.time() if started is None else started
        self.signals = ExitSignalHandler() if args.exit_signal_handler else None

    def reason(self, iteration):
        """The line to print when the run stops after ``iteration``, else None (collective with a signal
        handler or a duration)."""
        args = self.args
        if self.signals is not None and self.signals.any_rank_received(self.device):
            return (f"received SIGTERM (--exit-signal-handler): {'saving and ' if args.save else ''}exiting after "
                    f"iteration {iteration}")
        minutes = (time.time() - self.started) / 60
        if args.exit_duration_in_mins and any_rank(minutes > args.exit_duration_in_mins, self.device):
            return (f"exiting program after {minutes:.2f} minutes (--exit-duration-in-mins "
                    f"{args.exit_duration_in_mins:g}) at iteration {iteration}")
        if args.exit_interval and iteration % args.exit_interval == 0:
            return f"exiting at iteration {iteration} (--exit-interval {args.exit_interval})"
        return None

    def restore(self):
        if self.signals is not None:
            self.signals.restore()
