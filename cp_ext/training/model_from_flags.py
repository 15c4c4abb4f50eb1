"""A model with its weights, for what needs a model and not a run (generation, the tools):

    stack, device = model_from_flags(args)
    ...
    leave_distributed()

`model_from_flags` is the trainer's start without the data, the optimizer and DDP: the platform, the
grid, the model from the one factory (`cp_ext.models.factory.build_model_stack`) and, with ``--load``,
the checkpoint's weights only (its iteration, optimizer and RNG states are a run's, not a model's).
"""

import torch.distributed as dist
from megatron.core import parallel_state

from cp_ext import __version__
from cp_ext import parallel_state as cp_state
from cp_ext.arguments import model_args
from cp_ext.checkpoint.checkpointer import Checkpointer
from cp_ext.console import print_rank_0
from cp_ext.data.datasets import data_vocab_size
from cp_ext.grid import initialize_distributed
from cp_ext.megatron_version import versions_line
from cp_ext.models.factory import build_model_stack
from cp_ext.platform import setup_platform


def model_from_flags(args):
    """This rank's model for the flags in ``args``, with ``--load``'s weights: (ModelStack, device). The
    ranks start as the trainer's do (`cp_ext.grid.initialize_distributed`). The vocabulary is the data's,
    as in training (`data_vocab_size`), so the embedding is the one the checkpoint holds; a model that
    is not the checkpoint's is a ConfigError naming the flags."""
    device = setup_platform(None if args.device == "auto" else args.device)
    grid = initialize_distributed(args, device)
    print_rank_0(versions_line(__version__))
    stack = build_model_stack(args, grid, vocab_size=data_vocab_size(args), device=device)
    if args.load:
        Checkpointer.for_weights(stack.chunks[0], args, model_args(args)).load(args.load)
    return stack, device


def leave_distributed(barrier: bool = True) -> None:
    """Leave the grid and torch.distributed, so torchrun sees every rank exit 0 (``barrier``: first wait
    for every rank; the trainer's shutdown has waited already)."""
    if barrier:
        dist.barrier()
    cp_state.destroy_context_parallel()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
