"""What a run prints, once: rank 0's lines, and the one way a configuration error ends a run.

A leaf module (torch.distributed only), so every layer prints the same way."""

import os
import sys
import time

import torch.distributed as dist


def is_rank_0():
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank_0(message):
    if is_rank_0():
        print(message, flush=True)


def exit_with_config_error(prog, error):
    """Print a `cp_ext.errors.ConfigError` once (rank 0) and exit with status 2 on every rank.

    Read from the launcher's environment (RANK), not the process group: it also ends a run before
    any group exists."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: configuration error:\n{error}", file=sys.stderr, flush=True)
    else:
        # torchrun ends every rank once one exits; give rank 0 time to print first.
        time.sleep(5)
    sys.exit(2)
