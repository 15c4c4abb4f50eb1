"""Megatron-LM's ``--exit-signal-handler``: a signal asks the run to save and stop cleanly.

SLURM sends SIGTERM before a time limit (``#SBATCH --signal=TERM@120``) or on preemption. The
handler only records that it arrived; at the end of the current iteration all ranks agree
(any rank that received it counts, one all-reduce), the trainer saves a checkpoint when
``--save`` is set and exits with status 0, so the job can be resumed with ``--load``.
"""

import signal

import torch
import torch.distributed as dist


class ExitSignalHandler:
    def __init__(self, sig=signal.SIGTERM):
        self.sig = sig
        self.received = False
        self._previous = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def any_rank_received(self, device) -> bool:
        """Collective: True on every rank once any rank received the signal."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        signal.signal(self.sig, self._previous)
