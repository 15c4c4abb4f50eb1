"""Where each local parameter sits in the full, unsharded model.

megatron-core already knows this: `model.sharded_state_dict()` (the map its
checkpoints use) gives every local tensor a global key, the global shape and its
offset, with layers (and experts) stacked on leading "prepend" axes. This module
flattens that map into `GlobalSlice`s, one per local piece, keyed by *unit*: one
layer's (one expert's) full tensor, e.g. ``decoder.layers.mlp.experts.experts.linear_fc1.weight.3.1``
(layer 3, expert 1). Layout-invariant init and gradient comparisons across grids
both read it.
"""

import contextlib
from dataclasses import dataclass
from typing import Iterator, Tuple

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


@dataclass
class GlobalSlice:
    key: str  # megatron's checkpoint key, shared by all layers/experts of a stack
    unit: str  # global key of the full tensor (checkpoint key + prepend indices)
    unit_shape: Tuple[int, ...]  # shape of that full tensor
    index: Tuple[slice, ...]  # where `local` sits inside it
    local: torch.Tensor  # this rank's piece (a parameter or a view of one)


def sharded_tensors(sharded):
    if isinstance(sharded, dict):
        for value in sharded.values():
            yield from sharded_tensors(value)
    elif isinstance(sharded, (list, tuple)):
        for value in sharded:
            yield from sharded_tensors(value)
    elif isinstance(sharded, ShardedTensorFactory):
        yield from sharded_tensors(sharded.build())
    elif isinstance(sharded, ShardedTensor):
        yield sharded


def iter_global_slices(model: torch.nn.Module) -> Iterator[GlobalSlice]:
    """Every local parameter piece of `model` with its place in the full model."""
    for sharded in sharded_tensors(model.sharded_state_dict()):
        local = sharded.data
        if not isinstance(local, torch.Tensor) or local.numel() == 0:
            continue
        prepend = sharded.prepend_axis_num
        unit = ".".join(map(str, (sharded.key, *sharded.global_offset[:prepend])))
        index = tuple(
            slice(offset, offset + size) for offset, size in zip(sharded.global_offset[prepend:], local.shape)
        )
        yield GlobalSlice(sharded.key, unit, tuple(sharded.global_shape[prepend:]), index, local)


@contextlib.contextmanager
def parameters_showing_grads(model: torch.nn.Module):
    """Within the block, each parameter's data is its gradient (megatron's `main_grad`).

    Lets `iter_global_slices` place gradients exactly as it places weights.
    """
    saved = []
    for param in model.parameters():
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
        saved.append((param, param.data))
        param.data = grad.view_as(param).to(param.dtype)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data
