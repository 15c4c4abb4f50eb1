"""A megatron checkpoint written and read one unit (one layer's, one expert's tensor) at a time, so that
converting a model never holds it: the model is built on the meta device, which gives megatron's
sharded-state-dict map (every tensor's key, global shape and this rank's chunks) and no storage.

* `save_streaming`: megatron's ``torch_dist`` save (`dist_checkpointing.save`, so metadata.json, the
  common state and the tensor index are megatron's own) with a save planner that makes each chunk's data
  when torch.distributed.checkpoint's writer asks for it, and torch's plain FileSystemWriter, which asks
  for one chunk at a time and writes it before the next (megatron's own writer resolves every tensor
  first). Each rank writes its chunks only: at a grid, each reads only the units it holds.
* `load_units`: one layer's units at a time from any cp_ext checkpoint (megatron's reader reads only
  the requested chunks).
"""

import itertools
import re
from collections import defaultdict

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)

from cp_ext.grid import Grid
from cp_ext.megatron_compat import load_checkpoint
from cp_ext.models.factory import build_model_stack
from cp_ext.models.parameter_slices import sharded_tensors


def meta_model(args):
    """This rank's model (at the grid in ``args``) on the meta device, for its map only: the one model
    factory's (`cp_ext.models.factory`), so the embedding is padded as training pads it."""
    return build_model_stack(args, Grid.from_args(args), vocab_size=args.vocab_size, meta=True).chunks[0]


def stacks(model):
    """{checkpoint key: the stack's leading shape}: () for a tensor of its own, (layers,) for a stack of
    equal layers, (layers, experts) for experts; its units are ``key.<layer>[.<expert>]``."""
    return {t.key: tuple(t.global_shape[:t.prepend_axis_num]) for t in sharded_tensors(model.sharded_state_dict())}


def _unit_of(key, stack, offsets, sizes):
    """(unit, index inside the unit's full tensor) of the chunk at ``offsets``/``sizes`` of ``key``."""
    p = len(stack)
    assert all(size == 1 for size in sizes[:p]), (key, sizes)
    unit = ".".join(map(str, (key, *offsets[:p])))
    return unit, tuple(slice(o, o + s) for o, s in zip(offsets[p:], sizes[p:]))


class _MaterializingPlanner(MCoreSavePlanner):
    """megatron's planner whose tensor chunks are made when written: ``materialize(unit, index)``."""

    def __init__(self, materialize, stack_of, **kw):
        super().__init__(**kw)
        self.materialize, self.stack_of = materialize, stack_of

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        chunk, key = write_item.tensor_data.chunk, write_item.index.fqn
        unit, index = _unit_of(key, self.stack_of[key], tuple(chunk.offsets), tuple(chunk.sizes))
        data = self.materialize(unit, index)
        return data.to(write_item.tensor_data.properties.dtype).reshape(tuple(chunk.sizes)).contiguous()


class _StreamingSave(TorchDistSaveShardedStrategy):
    def __init__(self, materialize, stack_of):
        super().__init__("torch_dist", 1)
        self.materialize, self.stack_of = materialize, stack_of

    def save(self, sharded_state_dict, checkpoint_dir):
        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        planner = _MaterializingPlanner(self.materialize, self.stack_of, dedup_replicated_tensors=False,
                                        flatten_state_dict=False)
        writer = FileSystemWriter(checkpoint_dir, single_file_per_rank=True, thread_count=1, sync_files=True)
        dcp_save(pyt_state_dict, storage_writer=writer, planner=planner)


def save_streaming(model, directory, materialize, content_metadata=None):
    """Save meta-device ``model``'s weights as megatron's ``{"model": sharded_state_dict}`` under
    ``directory``, each chunk ``materialize(unit, index)`` (the slice ``index`` of the unit's full tensor)."""
    stack_of = stacks(model)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(directory),
                            sharded_strategy=_StreamingSave(materialize, stack_of), content_metadata=content_metadata)


def load_units(model, directory):
    """Yield (unit, full tensor, in the checkpoint's dtype) for every unit of meta-device ``model``, one
    layer's units per read."""
    saved_dtype = {key: t.dtype for key, t in dist_checkpointing.load_tensors_metadata(str(directory)).items()}
    by_layer = defaultdict(list)
    for t in sharded_tensors(model.sharded_state_dict()):
        stack, unit_shape = tuple(t.global_shape[:t.prepend_axis_num]), tuple(t.global_shape[t.prepend_axis_num:])
        listed = re.match(r"decoder\.layers\.(\d+)\.", t.key)  # a --moe-layer-freq list's layers
        for offsets in itertools.product(*map(range, stack)):  # every layer (and expert) of the stack
            layer = (int(listed.group(1)),) if listed else offsets[:1]
            by_layer[layer].append((t.key, stack, offsets, unit_shape))
    unit_shape_of = {}
    for layer in sorted(by_layer):
        request = {}
        for key, stack, offsets, unit_shape in by_layer[layer]:
            unit = ".".join(map(str, (key, *offsets)))
            unit_shape_of[unit] = unit_shape
            # The stack axes as ordinary axes of length 1 (not megatron's prepend axes, whose reader expects
            # every layer of the stack requested at once): one layer's slice of the stored [layers, ...] tensor.
            rank_offsets = [(axis, offset, count) for axis, (offset, count) in enumerate(zip(offsets, stack))]
            local = torch.empty((1,) * len(stack) + unit_shape, dtype=saved_dtype[key])
            request[unit] = ShardedTensor.from_rank_offsets(key, local, *rank_offsets)
        # a part of each stacked tensor: not the whole-tensor coverage megatron checks for a model load
        loaded = load_checkpoint({"model": request}, directory, validate_access_integrity=False)["model"]
        for unit in request:
            yield unit, loaded[unit].reshape(unit_shape_of[unit])

