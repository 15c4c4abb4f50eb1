"""The context-parallel exchange: how a rank's shard of q meets every key of the sequence.

    context_parallel.py  the entry point: `context_parallel_attention` (what the model calls; picks the
                         variant from `cp_ext.parallel_state`), the named variants and their autograd
    ring.py              KV blocks travel around a ring (zigzag or contiguous shards), own backward
    ulysses.py           all-to-all: sequence shards <-> head shards, then local attention
    all_gather.py        K/V all-gathered over the group, local queries against all of it
    kv_message.py        what travels: the K/V pair, or MLA's latent with its up-projection
    primitives.py        written once, shared by every variant: `RingComm`, `update_out_and_lse`, `add_sink`

Masks (which pairs of a tile attend) are `cp_ext.attention.masks`; the local kernels are
`cp_ext.attention.kernels`.
"""
