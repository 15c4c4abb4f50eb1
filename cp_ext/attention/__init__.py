"""Context-parallel attention on local ``[s, b, h, d]`` sequence shards.

    ring_attention(q, k, v, *, causal, softmax_scale=None, group=None, layout="zigzag")
        KV blocks travel around a ring; zigzag or contiguous shards
    ulysses_attention(q, k, v, *, causal, softmax_scale=None, group=None)
        all-to-all sequence shards <-> head shards, local attention
    hybrid_attention(q, k, v, *, causal, softmax_scale=None, ulysses_group=None,
                     ring_group=None, layout="zigzag")
        Ulysses inside, ring outside, for any C = U x R
    all_gather_attention(q, k, v, *, causal, softmax_scale=None, group=None, layout="zigzag", positions=None)
        K/V all-gathered over the group, local queries against all of it
    context_parallel_attention(q, k, v, *, causal, softmax_scale=None, layout="zigzag", kernel=None, comm_type=None)
        the one the model calls: picks the variant from cp_ext.parallel_state
    local_attention(q, k, v, *, causal, ...)
        the same on one rank (CP = 1), through the same kernels and masks

All of them take ``document_ids=None`` (packed documents), ``window_size=None`` (sliding windows,
``(left, right)``, -1 unbounded), ``softmax_offset=None`` (attention sinks, ``[h]``) and a v whose
head dim may differ from q/k's (MLA). The ring, all-gather and local calls also take ``up_weight``
(MLA's latent exchange: k is the latent ``[c | k_pe]``, v None).

One sub-package per concern:

    cp/       the exchange: the entry point (cp/context_parallel.py), the ring, Ulysses, all-gather,
              what travels (kv_message.py) and the shared ring primitives
    masks/    the mask as data: causal, windows, packed documents, and the tiles they leave
    dsa/      DeepSeek sparse attention: the indexer's top-k, sparse attention, its loss, the key-block ring
    kernels/  the local kernels behind one interface, one file per backend, and their selection

The layout contract (who holds which tokens) is `cp_ext.token_partition.context_parallel_positions`.
"""

from cp_ext.attention.cp.context_parallel import (
    CPAttnFunc, all_gather_attention, context_parallel_attention, cp_attention_backward, cp_attention_forward,
    hybrid_attention, local_attention, ring_attention, ulysses_attention,
)
from cp_ext.attention.cp.primitives import RingComm, add_sink, update_out_and_lse
from cp_ext.attention.cp.ring import RingSchedule, ring_attn_backward, ring_attn_forward
from cp_ext.attention.cp.ulysses import all_to_all
from cp_ext.attention.kernels import AttnKernel, get_kernel

__all__ = [
    "AttnKernel",
    "CPAttnFunc",
    "RingComm",
    "RingSchedule",
    "add_sink",
    "all_gather_attention",
    "all_to_all",
    "context_parallel_attention",
    "cp_attention_backward",
    "cp_attention_forward",
    "get_kernel",
    "hybrid_attention",
    "local_attention",
    "ring_attention",
    "ring_attn_backward",
    "ring_attn_forward",
    "ulysses_attention",
    "update_out_and_lse",
]
