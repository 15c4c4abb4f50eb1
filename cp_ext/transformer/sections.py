"""A checkpoint entry per section of a tensor whose TP shards are per-rank concatenations of sections (the linear
mixers' ``in_proj`` and ``conv1d``), so each section reshards over TP on its own."""

import dataclasses

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


def sections_factory(sharded: ShardedTensor, sections, names, dim: int) -> ShardedTensorFactory:
    """One checkpoint entry ``<key>.<name>`` per section of a TP-sharded tensor whose local rows are this TP rank's
    slice of every section, concatenated (GDN's ``in_proj`` and ``conv1d``): each entry is then an ordinary
    TP-sharded tensor, so the checkpoint reshards over TP. The keys and layout of megatron's own
    ``_split_tensor_factory`` (``megatron/core/ssm``), written here because 0.16.1's copy lives in a module that
    imports triton."""
    assert sum(sections) == sharded.local_shape[dim], (sections, sharded.local_shape)
    template = sharded.without_data()

    @torch.no_grad()
    def build(key, tensor, replica_id, flattened_range):
        whole = dataclasses.replace(template, key=key, data=tensor, dtype=tensor.dtype, replica_id=replica_id,
                                    flattened_range=flattened_range)
        pieces, start = [], 0
        for size, name in zip(sections, names):
            for piece in whole.narrow(dim, start, size):
                piece.key = f"{piece.key}.{name}"
                pieces.append(piece)
            start += size
        return pieces

    def merge(pieces):
        return torch.cat(pieces, dim=dim)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)
