"""Datasets, tokenizers and packed documents. The CP layout (which positions each CP rank holds) is
`cp_ext.token_partition`; its sharding helpers stay importable from here, where earlier releases had them."""

from cp_ext.token_partition import (
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
