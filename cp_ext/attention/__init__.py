"""Context-parallel attention on local ``[s, b, h, d]`` sequence shards.

    ring_attention(q, k, v, *, causal, softmax_scale=None, group=None, layout="zigzag")
        KV blocks travel around a ring; zigzag or contiguous shards   (ring.py)
    ulysses_attention(q, k, v, *, causal, softmax_scale=None, group=None)
        all-to-all sequence shards <-> head shards, local attention    (ulysses.py)
    hybrid_attention(q, k, v, *, causal, softmax_scale=None, ulysses_group=None,
                     ring_group=None, layout="zigzag")
        Ulysses inside, ring outside, for any C = U x R                (hybrid.py)
    all_gather_attention(q, k, v, *, causal, softmax_scale=None, group=None, layout="zigzag", positions=None)
        K/V all-gathered over the group, local queries against all of it (all_gather.py)
    context_parallel_attention(q, k, v, *, causal, softmax_scale=None, layout="zigzag", kernel=None, comm_type=None)
        the one the model calls: picks the variant from cp_ext.parallel_state

Every variant takes ``document_ids=None``: packed documents, an integer ``[b, s_local]``
tensor laid out like q; a token attends only within its document (documents.py).

Building blocks: ``ring_attn_forward`` / ``ring_attn_backward`` on ``[b, h, s, d]``,
``RingComm`` and ``update_out_and_lse`` (utils.py), the differentiable ``all_to_all``,
and the local kernels behind ``get_kernel`` (kernels.py; ``kernel=`` names one, None or
"auto" picks one per call by device, dtype and head dim). The layout contract (who holds
which tokens) is `cp_ext.data.sharding.context_parallel_positions`.
"""

from cp_ext.attention.all_gather import all_gather_attention
from cp_ext.attention.hybrid import context_parallel_attention, hybrid_attention
from cp_ext.attention.kernels import AttnKernel, get_kernel
from cp_ext.attention.ring import RingAttnFunc, ring_attention, ring_attn_backward, ring_attn_forward, step_plan
from cp_ext.attention.ulysses import all_to_all, ulysses_attention
from cp_ext.attention.utils import RingComm, update_out_and_lse

__all__ = [
    "AttnKernel",
    "all_gather_attention",
    "RingAttnFunc",
    "RingComm",
    "all_to_all",
    "context_parallel_attention",
    "get_kernel",
    "hybrid_attention",
    "ring_attention",
    "ring_attn_backward",
    "ring_attn_forward",
    "step_plan",
    "ulysses_attention",
    "update_out_and_lse",
]
