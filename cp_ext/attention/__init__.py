"""Context-parallel attention on local ``[s, b, h, d]`` sequence shards.

    ring_attention(q, k, v, *, causal, softmax_scale=None, group=None, layout="zigzag")
        KV blocks travel around a ring; zigzag or contiguous shards   (ring.py)
    ulysses_attention(q, k, v, *, causal, softmax_scale=None, group=None)
        all-to-all sequence shards <-> head shards, local attention    (ulysses.py)
    hybrid_attention(q, k, v, *, causal, softmax_scale=None, ulysses_group=None,
                     ring_group=None, layout="zigzag")
        Ulysses inside, ring outside, for any C = U x R
    all_gather_attention(q, k, v, *, causal, softmax_scale=None, group=None, layout="zigzag", positions=None)
        K/V all-gathered over the group, local queries against all of it (all_gather.py)
    context_parallel_attention(q, k, v, *, causal, softmax_scale=None, layout="zigzag", kernel=None, comm_type=None)
        the one the model calls: picks the variant from cp_ext.parallel_state
    local_attention(q, k, v, *, causal, ...)
        the same on one rank (CP = 1), through the same kernels and masks

All of them live in dispatch.py, the one dispatcher, and take ``document_ids=None`` (packed
documents, documents.py), ``window_size=None`` (sliding windows, ``(left, right)``, -1 unbounded),
``softmax_offset=None`` (attention sinks, ``[h]``) and a v whose head dim may differ from q/k's
(MLA). masks.py turns the mask into each tile's blocks. The ring, all-gather and local calls also
take ``up_weight`` (MLA's latent exchange: k is the latent ``[c | k_pe]``, v None); kv_message.py
holds what travels, the K/V pair or the latent.

Building blocks: ``ring_attn_forward`` / ``ring_attn_backward`` on ``[b, h, s, d]``,
``RingComm``, ``update_out_and_lse`` and ``add_sink`` (utils.py), the differentiable ``all_to_all``,
and the local kernels behind ``get_kernel`` (kernels/, one file per backend; ``kernel=`` names
one, None or "auto" picks one per call by device, dtype, head dims and window). The layout
contract (who holds which tokens) is `cp_ext.layout.context_parallel_positions`.
"""

from cp_ext.attention.dispatch import (
    CPAttnFunc, all_gather_attention, context_parallel_attention, cp_attention_backward, cp_attention_forward,
    hybrid_attention, local_attention, ring_attention, ulysses_attention,
)
from cp_ext.attention.kernels import AttnKernel, get_kernel
from cp_ext.attention.ring import RingSchedule, ring_attn_backward, ring_attn_forward
from cp_ext.attention.ulysses import all_to_all
from cp_ext.attention.utils import RingComm, add_sink, update_out_and_lse

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
