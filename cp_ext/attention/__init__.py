"""Context-parallel attention: ring attention (zigzag / contiguous) and its local kernels.

Public API: ``ring_attention(q, k, v, *, causal, softmax_scale=None, group=None,
layout="zigzag")`` on local ``[s, b, h, d]`` shards. Building blocks for other variants
(the Ulysses x ring hybrid): ``ring_attn_forward`` / ``ring_attn_backward`` on
``[b, h, s, d]``, ``RingComm``, ``update_out_and_lse`` and ``get_kernel``.
"""

from cp_ext.attention.kernels import AttnKernel, get_kernel
from cp_ext.attention.ring import RingAttnFunc, ring_attention, ring_attn_backward, ring_attn_forward, step_plan
from cp_ext.attention.utils import RingComm, update_out_and_lse

__all__ = [
    "AttnKernel",
    "RingAttnFunc",
    "RingComm",
    "get_kernel",
    "ring_attention",
    "ring_attn_backward",
    "ring_attn_forward",
    "step_plan",
    "update_out_and_lse",
]
