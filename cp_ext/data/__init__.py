"""Data-side helpers for context parallelism: sharding a sequence over the CP ranks."""

from cp_ext.data.sharding import (
    LAYOUTS,
    check_seq_len,
    contiguous_shard,
    zigzag_chunk_ids,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "LAYOUTS",
    "check_seq_len",
    "contiguous_shard",
    "zigzag_chunk_ids",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_unshard",
]
