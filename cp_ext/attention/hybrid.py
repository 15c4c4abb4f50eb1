"""Ulysses x ring hybrid: Ulysses inside, ring outside, for any C = U x R.

The CP group of C ranks is split into Ulysses groups of U ranks and ring groups of R ranks
(`cp_ext.parallel_state`). The sequence layout (`cp_ext.data.sharding.context_parallel_positions`)
shards the sequence over the ring first (zigzag chunks (r, 2R-1-r), or contiguous block r)
and then cuts each ring shard into U consecutive pieces, one per Ulysses rank::

    C = 4 = U2 x R2, zigzag, 16 tokens = 4 chunks of 4; Ulysses [0,1] [2,3], rings [0,2] [1,3]
    ring shard 0 = chunks (0, 3): rank 0 tokens 0-3,  rank 1 tokens 12-15
    ring shard 1 = chunks (1, 2): rank 2 tokens 4-7,  rank 3 tokens 8-11

1. all-to-all over the Ulysses group (`cp_ext.attention.ulysses.seq_to_heads`): each rank
   holds its whole ring shard, in order, for h/U heads (zigzag shard = its two chunks);
2. ring attention (`cp_ext.attention.ring.RingAttnFunc`) over the ring group on those heads;
   the R ranks of a ring all hold the same head slice (same Ulysses rank);
3. all-to-all back (`heads_to_seq`).

Autograd composes through the differentiable all-to-all and the ring's own backward. KV
heads < U are replicated before the exchange as in pure Ulysses, and travel around the ring
with the replicated count hk * rep / U (at least 1 per rank). R = 1 is pure Ulysses (local
attention, no ring), U = 1 pure ring (the all-to-all is the identity).
"""

from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.kernels import get_kernel
from cp_ext.attention.ring import RingAttnFunc, ring_attn_backward, ring_attn_forward, ring_attention
from cp_ext.attention.ulysses import heads_to_seq, kv_replicas, seq_to_heads, ulysses_attention, ulysses_exchange
from cp_ext.data.sharding import LAYOUTS


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    ulysses_group: Optional[dist.ProcessGroup] = None,
    ring_group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    kernel: Optional[str] = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded over Ulysses x ring groups.

    Args:
        q: local shard ``[s, b, h, d]`` laid out per `context_parallel_positions` (h divisible
            by U); k, v: ``[s, b, hk, d]`` with h % hk == 0.
        causal: causal mask over the global sequence, or full attention.
        softmax_scale: defaults to ``1 / sqrt(d)``.
        ulysses_group / ring_group: None means `cp_ext.parallel_state.get_ulysses_group()` /
            `get_ring_group()`. Ring rank r and Ulysses rank u are ranks within them.
        layout: ring sharding, ``"zigzag"`` (default) or ``"contiguous"``.
        kernel: local kernel name (see `cp_ext.attention.kernels.KERNELS`); None picks one.

    Returns the local output shard ``[s, b, h, d]`` in q's dtype; differentiable in q, k, v.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if ulysses_group is None or ring_group is None:
        from cp_ext import parallel_state

        ulysses_group = parallel_state.get_ulysses_group() if ulysses_group is None else ulysses_group
        ring_group = parallel_state.get_ring_group() if ring_group is None else ring_group
    if dist.get_world_size(ring_group) == 1:
        return ulysses_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=ulysses_group, kernel=kernel)
    if dist.get_world_size(ulysses_group) == 1:
        return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=ring_group, layout=layout, kernel=kernel)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    attn = lambda q_, k_, v_: RingAttnFunc.apply(q_, k_, v_, scale, causal, ring_group, layout, kernel)
    return ulysses_exchange(q, k, v, group=ulysses_group, attn=attn)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    layout: str = "zigzag",
    kernel: Optional[str] = None,
) -> torch.Tensor:
    """The model's CP attention: ring (U = 1), Ulysses (R = 1) or the hybrid, on the groups
    of `cp_ext.parallel_state` (local ``[s, b, h, d]`` shards, per `get_context_parallel_positions`).
    ``kernel``: the local kernel name (None or "auto": picked per call by dtype and head dim)."""
    from cp_ext import parallel_state

    return hybrid_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, kernel=kernel,
        ulysses_group=parallel_state.get_ulysses_group(), ring_group=parallel_state.get_ring_group(),
    )


# ---------------------------------------------------------------------------------------------
# The same algorithm as two plain functions (no autograd), for callers that keep the forward's
# output and LSE and run the backward later themselves: CP-aware activation recompute
# (`cp_ext.transformer.recompute`). Ulysses x ring with U = 1 is the ring, R = 1 Ulysses, and
# U = R = 1 a single local kernel call, so one pair covers every CP size, CP = 1 included.


def _to_heads(x: torch.Tensor, group, rep: int = 1) -> torch.Tensor:
    """[s, b, h, d] sequence piece -> kernel layout [b, h*rep/U, U*s, d] (this rank's heads)."""
    if rep > 1:
        x = x.repeat_interleave(rep, dim=2)
    return seq_to_heads(x, group).permute(1, 2, 0, 3)


def _from_heads(x: torch.Tensor, group) -> torch.Tensor:
    return heads_to_seq(x.permute(2, 0, 1, 3), group)


def cp_attention_forward(q, k, v, *, causal, softmax_scale, ulysses_group, ring_group, layout="zigzag", kernel=None):
    """`hybrid_attention`'s forward on [s, b, h, d] shards, returning ``(out, lse)``.

    ``out`` is the local output shard [s, b, h, d]; ``lse`` the fp32 log-sum-exp of this
    rank's heads over the whole sequence, [b, h/U, U*s] (what the backward needs besides q, k, v).
    """
    with torch.no_grad():
        kernel = get_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1])
        rep = kv_replicas(q.shape[2], k.shape[2], dist.get_world_size(ulysses_group))
        qh, kh, vh = _to_heads(q, ulysses_group), _to_heads(k, ulysses_group, rep), _to_heads(v, ulysses_group, rep)
        if dist.get_world_size(ring_group) == 1:
            out, lse = kernel.forward(qh, kh, vh, causal=causal, scale=softmax_scale)
        else:
            out, lse = ring_attn_forward(qh, kh, vh, softmax_scale=softmax_scale, causal=causal, group=ring_group,
                                         layout=layout, kernel=kernel)
        return _from_heads(out, ulysses_group), lse


def cp_attention_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, ulysses_group, ring_group,
                          layout="zigzag", kernel=None):
    """dq, dk, dv of `cp_attention_forward` from its (out, lse); all tensors [s, b, h, d] shards.

    With U > 1 the head layout of q, k, v, out and dout is rebuilt here by all-to-all (the forward's
    exchange, run once more); the ring moves K/V and dK/dV exactly as `ring_attn_backward` does.
    """
    with torch.no_grad():
        kernel = get_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1])
        hk = k.shape[2]
        rep = kv_replicas(q.shape[2], hk, dist.get_world_size(ulysses_group))
        qh, kh, vh = _to_heads(q, ulysses_group), _to_heads(k, ulysses_group, rep), _to_heads(v, ulysses_group, rep)
        outh, douth = _to_heads(out, ulysses_group), _to_heads(dout, ulysses_group)
        if dist.get_world_size(ring_group) == 1:
            dq, dk, dv = kernel.backward(douth, qh, kh, vh, outh, lse, causal=causal, scale=softmax_scale)
        else:
            dq, dk, dv = ring_attn_backward(douth, qh, kh, vh, outh, lse, softmax_scale=softmax_scale, causal=causal,
                                            group=ring_group, layout=layout, kernel=kernel)
        dq, dk, dv = (_from_heads(g.to(t.dtype), ulysses_group) for g, t in ((dq, q), (dk, k), (dv, v)))
        if rep > 1:  # the replicas' gradients sum back onto their KV head
            dk, dv = (g.unflatten(2, (hk, rep)).sum(3) for g in (dk, dv))
        return dq, dk, dv
