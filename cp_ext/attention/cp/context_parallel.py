"""The entry point of context-parallel attention: every variant, the autograd path and the recompute path.

    q, k, v [s, b, h, d] shards --(Ulysses all-to-all: this rank's heads, the ring shard)-->
    [b, h/U, U*s, d] --(core: one local call, the ring, or all-gather)--> (out, lse)
    --(finish: the sink, `cp_ext.attention.cp.primitives.add_sink`)--> --(all-to-all back)--> out

`_CallContext` is made once per call from the groups and the mask (causal, ``window_size``,
``document_ids``; `cp_ext.attention.masks.tiles`): the kernel, and the core's tiles (the local call's
blocks, the ring's `RingSchedule`, or the `AllGatherPlan`). `cp_attention_forward` /
`cp_attention_backward` run it with no autograd; `CPAttnFunc` is their autograd Function (it
keeps the head-layout tensors for its backward, so the backward exchanges only dout and the
gradients), and CP-aware recompute (`cp_ext.transformer.recompute`) keeps the forward's out and
LSE and calls the same backward later. The public functions differ only in the groups they pass:

    ring_attention        U = 1, the ring group          (cp_ext.attention.cp.ring)
    ulysses_attention     R = 1, the Ulysses group        (cp_ext.attention.cp.ulysses)
    hybrid_attention      U x R, any sizes
    all_gather_attention  K/V all-gathered over a group   (cp_ext.attention.cp.all_gather)
    context_parallel_attention  the model's: the groups of cp_ext.parallel_state, or all_gather

All take ``window_size=None`` ((left, right), -1 unbounded; causal is right = 0),
``softmax_offset=None`` (``[h]`` sink logits, one per local head; its gradient is this rank's
share, from its queries: the DP x CP reduction sums the shares), ``document_ids=None``, and a v
whose head dim may differ from q/k's (MLA). The ring and all-gather (and the local call) also take
``up_weight``: MLA's latent exchange, k the latent and v None (`cp_ext.attention.cp.kv_message`).
"""

from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.cp.all_gather import AllGatherPlan, all_gather_attn_backward, all_gather_attn_forward
from cp_ext.attention.masks.documents import check_document_ids, document_runs, gather_document_ids
from cp_ext.attention.kernels import get_kernel
from cp_ext.attention.cp.kv_message import LatentKV, PairedKV
from cp_ext.attention.masks.tiles import make_window, plan_tile
from cp_ext.attention.cp.ring import RingSchedule, ring_attn_backward, ring_attn_forward
from cp_ext.attention.cp.ulysses import heads_to_seq, kv_replicas, seq_to_heads
from cp_ext.attention.cp.primitives import accum_dtype, add_sink, sink_grad
from cp_ext.token_partition import check_layout


def _check_inputs(q, k, v, softmax_offset, up_weight=None):
    if up_weight is not None:  # MLA's latent exchange: k is the latent [s, b, r + p], v None
        if v is not None or q.dim() != 4 or k.dim() != 3 or k.shape[:2] != q.shape[:2]:
            raise ValueError(f"the latent exchange takes q [s, b, h, d_qk] and latent [s, b, kv_lora_rank + "
                             f"qk_pos_emb_head_dim] (v None), got q {tuple(q.shape)}, latent {tuple(k.shape)}, "
                             f"v {None if v is None else tuple(v.shape)}")
        _check_offset(q, softmax_offset)
        return
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"expected [s, b, h, d] q and [s, b, hk, d] k, v (v may have its own head dim), got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on sequence, batch or head dim")
    _check_offset(q, softmax_offset)


def _check_offset(q, softmax_offset):
    if softmax_offset is not None and (not isinstance(softmax_offset, torch.Tensor) or softmax_offset.dim() != 1
                                       or softmax_offset.shape[0] != q.shape[2]
                                       or not softmax_offset.dtype.is_floating_point):
        got = tuple(softmax_offset.shape) if isinstance(softmax_offset, torch.Tensor) else type(softmax_offset).__name__
        raise ValueError(f"softmax_offset must be a float [h] = [{q.shape[2]}] tensor (one sink logit per query "
                         f"head of q), got {got}")


class _CallContext:
    """What forward and backward share: the groups, the kernel, KV replicas, the core's tiles."""

    def __init__(self, q, k, v, *, causal, softmax_scale, ulysses_group, ring_group, layout, kernel,
                 document_ids, comm_type, window_size, all_gather_group=None, positions=None, up_weight=None):
        check_layout(layout)
        make_window(window_size, causal)  # a malformed window fails here, before any exchange
        self.causal, self.layout, self.window_size = causal, layout, window_size
        self.scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        # What the core moves (cp_ext.attention.cp.kv_message): K/V, or MLA's latent with its up-projection.
        if up_weight is None:
            self.message = PairedKV(q.shape[-1], v.shape[-1])
        else:
            self.message = LatentKV(up_weight, q.shape[2], q.shape[3], k.shape[-1])
            if comm_type != "all_gather" and _size(ulysses_group) > 1:
                raise ValueError("the latent exchange runs on the ring and all-gather: Ulysses exchanges heads, "
                                 "which the latent does not have (--cp-mla-exchange kv on a2a / a2a+p2p)")
        self.kernel = get_kernel(q.device, q.dtype, kernel, head_dim=q.shape[-1], v_head_dim=self.message.d_v,
                                 window=window_size is not None)
        self.ring_group, self.all_gather, self.schedule, self.blocks = ring_group, None, None, None
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[1], q.shape[0], q.device)
        if comm_type == "all_gather":
            group, positions = _all_gather_layout(q, layout, all_gather_group, positions)
            self.ulysses_group, self.rep, self.heads = None, 1, slice(None)
            self.all_gather = dict(group=group, plan=AllGatherPlan(positions, group, causal, document_ids, window_size))
            return
        self.ulysses_group = None if _size(ulysses_group) == 1 else ulysses_group
        size, rank = _size(ulysses_group), _rank(ulysses_group)
        self.rep = 1 if up_weight is not None else kv_replicas(q.shape[2], k.shape[2], size)
        per = q.shape[2] // size
        self.heads = slice(rank * per, (rank + 1) * per)  # this rank's query heads after the exchange
        ids = document_ids if document_ids is None or size == 1 else gather_document_ids(document_ids, ulysses_group)
        n = q.shape[0] * size  # the ring shard this rank's heads see
        if _size(ring_group) == 1:
            docs = document_runs(ids) if ids is not None else None
            self.blocks = plan_tile([(0, n, 0)], [(0, n, 0)], make_window(window_size, causal), same_tokens=True,
                                    q_docs=docs, k_docs=docs)
        else:
            self.schedule = RingSchedule(dist.get_rank(ring_group), dist.get_world_size(ring_group), n, causal, layout,
                                         ring_group, ids, window_size)

    # the exchange: [s, b, h, d] pieces <-> kernel layout [b, h/U, U*s, d] (a view when U = 1)
    def to_heads(self, x, rep=1):
        if rep > 1:
            x = x.repeat_interleave(rep, dim=2)
        if self.ulysses_group is not None:
            x = seq_to_heads(x, self.ulysses_group)
        return x.permute(1, 2, 0, 3)

    def from_heads(self, x):
        x = x.permute(2, 0, 1, 3)
        return heads_to_seq(x, self.ulysses_group) if self.ulysses_group is not None else x

    def core_forward(self, qh, kh, vh, offset):
        kw = dict(softmax_scale=self.scale, causal=self.causal, kernel=self.kernel, softmax_offset=offset,
                  message=self.message)
        if self.all_gather is not None:
            return all_gather_attn_forward(qh, kh, vh, **kw, **self.all_gather)
        if self.schedule is not None:
            return ring_attn_forward(qh, kh, vh, group=self.ring_group, layout=self.layout, schedule=self.schedule,
                                     window_size=self.window_size, **kw)
        out, lse = self.kernel.forward_blocks(qh, *self.message.unpack(self.message.pack(kh, vh)), self.blocks,
                                              scale=self.scale)
        out, lse = add_sink(out.to(accum_dtype(qh.dtype)) if offset is not None else out, lse, offset)
        return out.to(qh.dtype), lse

    def core_backward(self, douth, qh, kh, vh, outh, lse):
        kw = dict(softmax_scale=self.scale, causal=self.causal, kernel=self.kernel, message=self.message)
        if self.all_gather is not None:
            return all_gather_attn_backward(douth, qh, kh, vh, outh, lse, **kw, **self.all_gather)
        if self.schedule is not None:
            return ring_attn_backward(douth, qh, kh, vh, outh, lse, group=self.ring_group, layout=self.layout,
                                      schedule=self.schedule, window_size=self.window_size, **kw)
        msg = self.message.pack(kh, vh)
        dq, dk, dv = self.kernel.backward_blocks(douth, qh, *self.message.unpack(msg), outh, lse, self.blocks,
                                                 scale=self.scale)
        if isinstance(self.message, PairedKV):
            return dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype)
        dmsg = torch.zeros(msg.shape, dtype=accum_dtype(msg.dtype), device=msg.device)
        self.message.add_grad(dmsg, slice(None), dk, dv, msg)
        return (dq.to(qh.dtype),) + self.message.grads(dmsg, kh)

    def kv_to_heads(self, k, v):
        """k, v (or MLA's latent [s, b, r + p] and None) in the core's layout."""
        if v is None:
            return self.to_heads(k.unsqueeze(2)), None
        return self.to_heads(k, self.rep), self.to_heads(v, self.rep)

    def weight_grad(self, up_weight):
        """The latent exchange's share of d W_up on this rank (None for K/V)."""
        grad = getattr(self.message, "weight_grad", None)
        return None if up_weight is None or grad is None else grad.to(up_weight.dtype)

    def grads_to_seq(self, dqh, dkh, dvh, dtypes):
        if dvh is None:  # the latent's gradient [b, 1, s, r + p] -> [s, b, r + p]
            return self.from_heads(dqh.to(dtypes[0])), self.from_heads(dkh.to(dtypes[1])).squeeze(2), None
        dq, dk, dv = (self.from_heads(g.to(dt)) for g, dt in zip((dqh, dkh, dvh), dtypes))
        if self.rep > 1:  # the replicas' gradients sum back onto their KV head
            dk, dv = (g.unflatten(2, (g.shape[2] // self.rep, self.rep)).sum(3) for g in (dk, dv))
        return dq, dk, dv

    def my_offset(self, softmax_offset):
        """The sink logits of this rank's heads (after the exchange), or None."""
        return None if softmax_offset is None else softmax_offset.detach()[self.heads]

    def offset_grad(self, douth, outh, lse, softmax_offset):
        """This rank's share of the sink's gradient, as a full [h] tensor (zero off this rank's heads)."""
        g = torch.zeros_like(softmax_offset)
        g[self.heads] = sink_grad(douth, outh, lse, self.my_offset(softmax_offset)).to(g.dtype)
        return g


def cp_attention_forward(q, k, v, *, causal, softmax_scale, ulysses_group, ring_group, layout="zigzag", kernel=None,
                         document_ids=None, comm_type=None, window_size=None, softmax_offset=None,
                         all_gather_group=None, positions=None, up_weight=None):
    """The forward with no autograd, on [s, b, h, d] shards: ``(out, lse, plan)``.

    ``out`` is the local output shard [s, b, h, d_v]; ``lse`` the finished fp32 log-sum-exp of this
    rank's heads over the whole sequence, [b, h/U, U*s] ([b, h, s] for all_gather); ``plan`` what
    the backward reuses. Together with q, k, v that is all `cp_attention_backward` needs.
    With ``up_weight`` (MLA's ``linear_kv_up_proj.weight``), k is the latent [s, b, r + p] and v None.
    """
    _check_inputs(q, k, v, softmax_offset, up_weight)
    with torch.no_grad():
        plan = _CallContext(q, k, v, causal=causal, softmax_scale=softmax_scale, ulysses_group=ulysses_group,
                     ring_group=ring_group, layout=layout, kernel=kernel, document_ids=document_ids,
                     comm_type=comm_type, window_size=window_size, all_gather_group=all_gather_group,
                     positions=positions, up_weight=up_weight)
        outh, lse = plan.core_forward(plan.to_heads(q), *plan.kv_to_heads(k, v), plan.my_offset(softmax_offset))
        return plan.from_heads(outh), lse, plan


def cp_attention_backward(dout, q, k, v, out, lse, plan, softmax_offset=None, up_weight=None):
    """(dq, dk, dv, d_offset or None, d_up_weight or None) of `cp_attention_forward` from its
    (out, lse, plan); all [s, b, h, d] (the latent exchange: dk the latent's gradient, dv None).

    With U > 1 the head layout of q, k, v, out and dout is rebuilt here by all-to-all (the
    forward's exchange, once more); the core moves K/V and dK/dV as its forward did."""
    with torch.no_grad():
        qh, (kh, vh) = plan.to_heads(q), plan.kv_to_heads(k, v)
        outh, douth = plan.to_heads(out), plan.to_heads(dout)
        grads = plan.grads_to_seq(*plan.core_backward(douth, qh, kh, vh, outh, lse), (q.dtype, k.dtype, _dtype(v)))
        d_offset = None if softmax_offset is None else plan.offset_grad(douth, outh, lse, softmax_offset)
        return grads + (d_offset, plan.weight_grad(up_weight))


class CPAttnFunc(torch.autograd.Function):
    """Autograd over the whole entry point; keeps the head-layout q, k, v, out for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_offset, up_weight, args):
        _check_inputs(q, k, v, softmax_offset, up_weight)
        plan = _CallContext(q, k, v, up_weight=up_weight, **args)
        qh, (kh, vh) = plan.to_heads(q), plan.kv_to_heads(k, v)
        outh, lse = plan.core_forward(qh, kh, vh, plan.my_offset(softmax_offset))
        ctx.save_for_backward(qh, kh, vh, outh, lse, softmax_offset, up_weight)
        ctx.plan, ctx.dtypes = plan, (q.dtype, k.dtype, _dtype(v))
        return plan.from_heads(outh)

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, outh, lse, softmax_offset, up_weight = ctx.saved_tensors
        plan = ctx.plan
        douth = plan.to_heads(dout)
        dqh, dkh, dvh = plan.core_backward(douth, qh, kh, vh, outh, lse)
        dq, dk, dv = plan.grads_to_seq(dqh, dkh, dvh, ctx.dtypes)
        d_offset = None if softmax_offset is None else plan.offset_grad(douth, outh, lse, softmax_offset)
        return dq, dk, dv, d_offset, plan.weight_grad(up_weight), None


def _attention(q, k, v, softmax_offset, up_weight=None, **args):
    return CPAttnFunc.apply(q, k, v, softmax_offset, up_weight, args)


def _dtype(t):
    return None if t is None else t.dtype


def hybrid_attention(q, k, v, *, causal: bool, softmax_scale: Optional[float] = None, ulysses_group=None,
                     ring_group=None, layout: str = "zigzag", kernel: Optional[str] = None, document_ids=None,
                     window_size=None, softmax_offset=None, up_weight=None) -> torch.Tensor:
    """Exact attention over a sequence sharded over Ulysses x ring groups (`cp_ext.attention.cp.context_parallel`'s
    layout: the ring shards the sequence, each ring shard is cut into U consecutive pieces).

    q: local shard ``[s, b, h, d]`` (h divisible by U); k ``[s, b, hk, d]``, v ``[s, b, hk, d_v]``
    with h % hk == 0 (hk < U: KV heads are replicated). Groups None: `cp_ext.parallel_state`'s.
    Returns the local output shard ``[s, b, h, d_v]`` in q's dtype; differentiable in q, k, v and
    ``softmax_offset``.

    MLA's latent exchange (ring and all-gather, U = 1): ``up_weight`` is ``linear_kv_up_proj.weight``
    ``[h (d_nope + d_v), kv_lora_rank]``, k the latent ``[s, b, kv_lora_rank + qk_pos_emb_head_dim]``
    (normalised c, then the roped shared key) and v None; the latent travels, each block is
    up-projected where it is used (`cp_ext.attention.cp.kv_message.LatentKV`), and ``up_weight`` gets
    this rank's share of its gradient.
    """
    if ulysses_group is None or ring_group is None:
        from cp_ext import parallel_state

        ulysses_group = parallel_state.get_ulysses_group() if ulysses_group is None else ulysses_group
        ring_group = parallel_state.get_ring_group() if ring_group is None else ring_group
    return _attention(q, k, v, softmax_offset, up_weight, causal=causal, softmax_scale=softmax_scale,
                      ulysses_group=ulysses_group, ring_group=ring_group, layout=layout, kernel=kernel,
                      document_ids=document_ids, comm_type=None, window_size=window_size)


def ring_attention(q, k, v, *, causal: bool, softmax_scale: Optional[float] = None, group=None, layout="zigzag",
                   kernel: Optional[str] = None, document_ids=None, window_size=None, softmax_offset=None,
                   up_weight=None):
    """Ring attention over ``group`` (None: `cp_ext.parallel_state.get_ring_group()`), zigzag or
    contiguous shards (`cp_ext.attention.cp.ring`); arguments as `hybrid_attention`."""
    if group is None:
        from cp_ext import parallel_state

        group = parallel_state.get_ring_group()
    return hybrid_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, ulysses_group=NO_GROUP, ring_group=group,
                            layout=layout, kernel=kernel, document_ids=document_ids, window_size=window_size,
                            softmax_offset=softmax_offset, up_weight=up_weight)


def ulysses_attention(q, k, v, *, causal: bool, softmax_scale: Optional[float] = None, group=None,
                      kernel: Optional[str] = None, document_ids=None, window_size=None, softmax_offset=None):
    """Ulysses attention over ``group`` (None: `cp_ext.parallel_state.get_ulysses_group()`): rank u
    holds tokens ``[u*s, (u+1)*s)`` (`cp_ext.attention.cp.ulysses`); arguments as `hybrid_attention`."""
    if group is None:
        from cp_ext import parallel_state

        group = parallel_state.get_ulysses_group()
    return hybrid_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, ulysses_group=group,
                            ring_group=NO_GROUP, kernel=kernel, document_ids=document_ids, window_size=window_size,
                            softmax_offset=softmax_offset)


def all_gather_attention(q, k, v, *, causal: bool, softmax_scale: Optional[float] = None, group=None,
                         layout: str = "zigzag", positions=None, kernel: Optional[str] = None, document_ids=None,
                         window_size=None, softmax_offset=None, up_weight=None):
    """K/V all-gathered over ``group`` (None: megatron's CP group), this rank holding ``positions``
    (default: ``layout`` over ``group``) (`cp_ext.attention.cp.all_gather`); arguments as `hybrid_attention`."""
    if group is None:
        from megatron.core import parallel_state as mpu

        group = mpu.get_context_parallel_group()
    return _attention(q, k, v, softmax_offset, up_weight, causal=causal, softmax_scale=softmax_scale,
                      ulysses_group=None, ring_group=None, layout=layout, kernel=kernel, document_ids=document_ids,
                      comm_type="all_gather", window_size=window_size, all_gather_group=group, positions=positions)


def context_parallel_attention(q, k, v, *, causal: bool, softmax_scale: Optional[float] = None, layout="zigzag",
                               kernel: Optional[str] = None, document_ids=None, comm_type: Optional[str] = None,
                               window_size=None, softmax_offset=None, up_weight=None) -> torch.Tensor:
    """The model's CP attention on the groups of `cp_ext.parallel_state` (local ``[s, b, h, d]``
    shards, per `get_context_parallel_positions`): ring (U = 1), Ulysses (R = 1) or the hybrid;
    with ``comm_type="all_gather"``, K/V all-gathered over the whole CP group on the same layout."""
    from cp_ext import parallel_state

    if comm_type == "all_gather":
        return _attention(q, k, v, softmax_offset, up_weight, causal=causal, softmax_scale=softmax_scale,
                          ulysses_group=None, ring_group=None, layout=layout, kernel=kernel,
                          document_ids=document_ids, comm_type="all_gather", window_size=window_size)
    return hybrid_attention(q, k, v, causal=causal, softmax_scale=softmax_scale, layout=layout, kernel=kernel,
                            document_ids=document_ids, ulysses_group=parallel_state.get_ulysses_group(),
                            ring_group=parallel_state.get_ring_group(), window_size=window_size,
                            softmax_offset=softmax_offset, up_weight=up_weight)


NO_GROUP = object()  # the absent level of the hybrid (ring_attention has no Ulysses group, ulysses_attention no ring)


def _size(group):
    return 1 if group is NO_GROUP else dist.get_world_size(group)


def _rank(group):
    return 0 if group is NO_GROUP else dist.get_rank(group)


def _all_gather_layout(q, layout, group, positions):
    """The all-gather group and this rank's global positions: those `all_gather_attention` was given
    (``group``; ``positions``, default ``layout`` over it), else the run's CP group and layout."""
    from cp_ext.token_partition import context_parallel_positions

    if group is not None:
        if positions is None:
            size = dist.get_world_size(group)
            positions = context_parallel_positions(q.shape[0] * size, ring_rank=dist.get_rank(group), ring_size=size,
                                                   layout=layout)
        positions = positions.to(q.device, torch.int64)
        if positions.numel() != q.shape[0]:
            raise ValueError(f"positions holds {positions.numel()} tokens but q holds {q.shape[0]}")
        return group, positions
    from megatron.core import parallel_state as mpu

    from cp_ext import parallel_state

    group = mpu.get_context_parallel_group()
    seq_len = q.shape[0] * dist.get_world_size(group)
    return group, parallel_state.get_context_parallel_positions(seq_len, layout, device=q.device)


def local_attention(q, k, v, *, causal: bool, softmax_scale: Optional[float] = None, kernel: Optional[str] = None,
                    document_ids=None, window_size=None, softmax_offset=None, up_weight=None) -> torch.Tensor:
    """Attention on one rank (CP = 1) through the same kernels, masks and sink; as `hybrid_attention`."""
    return _attention(q, k, v, softmax_offset, up_weight, causal=causal, softmax_scale=softmax_scale, ulysses_group=NO_GROUP,
                      ring_group=NO_GROUP, layout="contiguous", kernel=kernel, document_ids=document_ids, comm_type=None,
                      window_size=window_size)
