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

from cp_ext.attention.all_gather import AllGatherPlan, all_gather_attention, all_gather_attn_backward, all_gather_attn_forward
from cp_ext.attention.documents import check_document_ids, diagonal_segments, document_runs, gather_document_ids
from cp_ext.attention.kernels import get_kernel
from cp_ext.attention.ring import RingAttnFunc, RingSchedule, ring_attn_backward, ring_attn_forward, ring_attention
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
    document_ids: Optional[torch.Tensor] = None,
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
        document_ids: packed documents, integer ``[b, s]`` laid out like q
            (`cp_ext.attention.documents`): gathered over the Ulysses group (the ring shard's
            ids), then planned over the ring.

    Returns the local output shard ``[s, b, h, d]`` in q's dtype; differentiable in q, k, v.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if ulysses_group is None or ring_group is None:
        from cp_ext import parallel_state

        ulysses_group = parallel_state.get_ulysses_group() if ulysses_group is None else ulysses_group
        ring_group = parallel_state.get_ring_group() if ring_group is None else ring_group
    if dist.get_world_size(ring_group) == 1:
        return ulysses_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=ulysses_group, kernel=kernel,
                                 document_ids=document_ids)
    if dist.get_world_size(ulysses_group) == 1:
        return ring_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, group=ring_group, layout=layout,
                              kernel=kernel, document_ids=document_ids)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if document_ids is not None:
        check_document_ids(document_ids, q.shape[1], q.shape[0], q.device)
        document_ids = gather_document_ids(document_ids, ulysses_group)
    attn = lambda q_, k_, v_: RingAttnFunc.apply(q_, k_, v_, scale, causal, ring_group, layout, kernel, document_ids)
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
    document_ids: Optional[torch.Tensor] = None,
    comm_type: Optional[str] = None,
) -> torch.Tensor:
    """The model's CP attention on the groups of `cp_ext.parallel_state` (local ``[s, b, h, d]``
    shards, per `get_context_parallel_positions`): ring (U = 1), Ulysses (R = 1) or the hybrid;
    with ``comm_type="all_gather"``, K/V all-gathered over the whole CP group instead
    (`cp_ext.attention.all_gather`), on the same layout. ``kernel``: the local kernel name (None
    or "auto": picked per call by dtype and head dim); ``document_ids``: packed documents."""
    from cp_ext import parallel_state

    if comm_type == "all_gather":
        return all_gather_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, kernel=kernel,
                                    document_ids=document_ids, **_all_gather_layout(q, layout))
    return hybrid_attention(
        q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, kernel=kernel, document_ids=document_ids,
        ulysses_group=parallel_state.get_ulysses_group(), ring_group=parallel_state.get_ring_group(),
    )


def _all_gather_layout(q, layout):
    """The CP group and this rank's global positions under the run's (Ulysses x ring) layout."""
    from megatron.core import parallel_state as mpu

    from cp_ext import parallel_state

    group = mpu.get_context_parallel_group()
    seq_len = q.shape[0] * dist.get_world_size(group)
    return dict(group=group, positions=parallel_state.get_context_parallel_positions(seq_len, layout, device=q.device))


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


class _Plan:
    """What the recompute's forward and backward share: the kernel, and the document plan
    (segments of the local call, the ring schedule, or the all-gather tiles) made once."""

    def __init__(self, q, k, *, causal, ulysses_group, ring_group, layout, kernel, document_ids, comm_type):
        self.kernel = get_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1])
        self.all_gather = self.segments = self.schedule = None
        self.rep = kv_replicas(q.shape[2], k.shape[2], dist.get_world_size(ulysses_group))
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[1], q.shape[0], q.device)
        if comm_type == "all_gather":
            self.rep = 1
            self.all_gather = dict(_all_gather_layout(q, layout))
            self.all_gather["plan"] = AllGatherPlan(self.all_gather.pop("positions"), self.all_gather["group"],
                                                    causal, document_ids)
            return
        if document_ids is not None:
            ids = gather_document_ids(document_ids, ulysses_group)
            if dist.get_world_size(ring_group) == 1:
                self.segments = diagonal_segments(document_runs(ids))
            else:
                self.schedule = RingSchedule(dist.get_rank(ring_group), dist.get_world_size(ring_group), ids.shape[1],
                                             causal, layout, ring_group, ids)


def cp_attention_forward(q, k, v, *, causal, softmax_scale, ulysses_group, ring_group, layout="zigzag", kernel=None,
                         document_ids=None, comm_type=None):
    """`context_parallel_attention`'s forward on [s, b, h, d] shards, returning ``(out, lse, plan)``.

    ``out`` is the local output shard [s, b, h, d]; ``lse`` the fp32 log-sum-exp of this
    rank's heads over the whole sequence, [b, h/U, U*s] ([b, h, s] for all_gather); ``plan``
    what the backward reuses. Together with q, k, v that is all `cp_attention_backward` needs.
    """
    with torch.no_grad():
        plan = _Plan(q, k, causal=causal, ulysses_group=ulysses_group, ring_group=ring_group, layout=layout,
                     kernel=kernel, document_ids=document_ids, comm_type=comm_type)
        if plan.all_gather is not None:
            to_kernel = lambda x: x.permute(1, 2, 0, 3)
            out, lse = all_gather_attn_forward(to_kernel(q), to_kernel(k), to_kernel(v), softmax_scale=softmax_scale,
                                               causal=causal, kernel=plan.kernel, **plan.all_gather)
            return out.permute(2, 0, 1, 3), lse, plan
        qh, kh, vh = (_to_heads(q, ulysses_group), _to_heads(k, ulysses_group, plan.rep),
                      _to_heads(v, ulysses_group, plan.rep))
        if dist.get_world_size(ring_group) == 1:
            if plan.segments is not None:
                out, lse = plan.kernel.forward_segments(qh, kh, vh, plan.segments, causal=causal, scale=softmax_scale)
            else:
                out, lse = plan.kernel.forward(qh, kh, vh, causal=causal, scale=softmax_scale)
        else:
            out, lse = ring_attn_forward(qh, kh, vh, softmax_scale=softmax_scale, causal=causal, group=ring_group,
                                         layout=layout, kernel=plan.kernel, schedule=plan.schedule)
        return _from_heads(out, ulysses_group), lse, plan


def cp_attention_backward(dout, q, k, v, out, lse, plan, *, causal, softmax_scale, ulysses_group, ring_group,
                          layout="zigzag", **_):
    """dq, dk, dv of `cp_attention_forward` from its (out, lse, plan); all tensors [s, b, h, d] shards.

    With U > 1 the head layout of q, k, v, out and dout is rebuilt here by all-to-all (the forward's
    exchange, run once more); the ring moves K/V and dK/dV exactly as `ring_attn_backward` does.
    """
    with torch.no_grad():
        kernel = plan.kernel
        if plan.all_gather is not None:
            to_kernel = lambda x: x.permute(1, 2, 0, 3)
            grads = all_gather_attn_backward(to_kernel(dout), to_kernel(q), to_kernel(k), to_kernel(v),
                                             to_kernel(out), lse, softmax_scale=softmax_scale, causal=causal,
                                             kernel=kernel, **plan.all_gather)
            return tuple(g.permute(2, 0, 1, 3) for g in grads)
        hk, rep = k.shape[2], plan.rep
        qh, kh, vh = _to_heads(q, ulysses_group), _to_heads(k, ulysses_group, rep), _to_heads(v, ulysses_group, rep)
        outh, douth = _to_heads(out, ulysses_group), _to_heads(dout, ulysses_group)
        if dist.get_world_size(ring_group) == 1:
            if plan.segments is not None:
                dq, dk, dv = kernel.backward_segments(douth, qh, kh, vh, outh, lse, plan.segments, causal=causal,
                                                      scale=softmax_scale)
            else:
                dq, dk, dv = kernel.backward(douth, qh, kh, vh, outh, lse, causal=causal, scale=softmax_scale)
        else:
            dq, dk, dv = ring_attn_backward(douth, qh, kh, vh, outh, lse, softmax_scale=softmax_scale, causal=causal,
                                            group=ring_group, layout=layout, kernel=kernel, schedule=plan.schedule)
        dq, dk, dv = (_from_heads(g.to(t.dtype), ulysses_group) for g, t in ((dq, q), (dk, k), (dv, v)))
        if rep > 1:  # the replicas' gradients sum back onto their KV head
            dk, dv = (g.unflatten(2, (hk, rep)).sum(3) for g in (dk, dv))
        return dq, dk, dv
