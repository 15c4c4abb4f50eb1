"""All-gather-KV attention (TE's ``cp_comm_type="all_gather"``, Llama 3's long-context recipe).

Every rank of the group all-gathers K and V (one collective, forward), puts them in global
sequence order, and computes its local queries against the whole sequence; the backward
gathers K/V again (the gathered copy is not kept between forward and backward) and
reduce-scatters the full-sequence dK/dV back to their owners. There is no ring, so any mask
is simple: each local query run ``[p0, p1)`` (a contiguous range of global positions) is one
full tile against the keys before it and one causal square against itself::

    zigzag, C = 2, 4 chunks; rank 0 holds q chunks (0, 3):
    chunk 0:  K[0:c]  causal square                       (no keys before it)
    chunk 3:  K[0:3c] full  +  K[3c:4c] causal square
    rank 1 (chunks 1, 2): c + 2c full rows, two squares   -> the same work as rank 0

so the zigzag layout balances the causal work as it does for the ring. Packed documents
(``document_ids``) turn each tile into its segments (`cp_ext.attention.documents`): a query
run only meets the keys of its own documents. Works with any CP layout: the positions each
rank holds are all-gathered with K/V, so the same function serves a ring layout and a
Ulysses x ring one (``--cp-comm-type`` lists mixing ``all_gather`` with another type).

Cost per rank: one all-gather of (C-1)/C of the sequence's K/V forward and backward, and a
reduce-scatter of dK/dV; the transient full-sequence K/V (and, in the backward, its fp32
dK/dV) live only inside the call.
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from cp_ext.attention.documents import (
    Runs, check_document_ids, clip_runs, diagonal_segments, document_runs, segment_pairs, tile_segments,
)
from cp_ext.attention.kernels import AttnKernel, get_kernel
from cp_ext.attention.utils import accum_dtype, update_out_and_lse
from cp_ext.perf.counter import COMM_COUNTER, WORK_COUNTER


def _runs_of_positions(positions: List[int]) -> List[Tuple[int, int, int]]:
    """(first local row, end row, first global position) of each contiguous range of positions."""
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i, positions[start]))
            start = i
    return runs


class AllGatherPlan:
    """The tiles of this rank: per local query run, (q rows, global key columns, causal, segments)."""

    def __init__(self, positions: torch.Tensor, group, causal: bool, document_ids=None):
        size = dist.get_world_size(group)
        s = positions.numel()
        parts = [torch.empty_like(positions) for _ in range(size)]
        dist.all_gather(parts, positions.contiguous(), group=group)
        self.order = torch.cat(parts)  # global position of each gathered row, in rank order
        self.seq_len = self.order.numel()
        mine = positions.tolist()
        if sorted(mine) != mine:
            raise ValueError("all-gather attention needs each rank's tokens in increasing global order")
        full_runs: Optional[Runs] = None
        local_runs: Optional[Runs] = None
        if document_ids is not None:
            ids = [torch.empty_like(document_ids) for _ in range(size)]
            dist.all_gather(ids, document_ids.contiguous(), group=group)
            full_ids = torch.empty(document_ids.shape[0], self.seq_len, dtype=torch.int64)
            full_ids[:, self.order.cpu()] = torch.cat(ids, dim=1).cpu().long()
            # Every rank checks the whole sequence (same data, same verdict: all raise together).
            full_runs = document_runs(full_ids, name="document_ids (whole sequence)")
            local_runs = document_runs(document_ids)
        self.tiles = []
        for r0, r1, p0 in _runs_of_positions(mine):
            p1 = p0 + (r1 - r0)
            rows = slice(r0, r1)
            blocks = [(slice(0, p0), False), (slice(p0, p1), True)] if causal else [(slice(0, self.seq_len), False)]
            for cols, diagonal in blocks:
                if cols.stop <= cols.start:
                    continue
                segments = None
                if document_ids is not None:
                    q_runs = clip_runs(local_runs, rows, s)
                    segments = (diagonal_segments(q_runs) if diagonal
                                else tile_segments(q_runs, clip_runs(full_runs, cols, self.seq_len)))
                    if not segments:
                        continue
                self.tiles.append((rows, cols, diagonal, segments))

    def count(self):
        if WORK_COUNTER.enabled:
            for rows, cols, diagonal, segments in self.tiles:
                n = rows.stop - rows.start
                dense = n * (n + 1) // 2 if diagonal else n * (cols.stop - cols.start)
                WORK_COUNTER.add("tiles", 1)
                WORK_COUNTER.add("pairs", dense if segments is None else segment_pairs(segments, diagonal))


def _gather_kv(k: torch.Tensor, v: torch.Tensor, plan: AllGatherPlan, group) -> torch.Tensor:
    """[2, b, hk, S, d]: every rank's K/V, in global sequence order."""
    size = dist.get_world_size(group)
    kv = torch.stack([k, v])  # [2, b, hk, s, d]
    gathered = torch.empty((size * 2,) + kv.shape[1:], dtype=kv.dtype, device=kv.device)  # ranks along dim 0
    if COMM_COUNTER.enabled:
        COMM_COUNTER.add("all_gather_kv", kv.nbytes * (size - 1))
    dist.all_gather_into_tensor(gathered, kv.contiguous(), group=group)
    # [C, 2, b, hk, s, d] -> [2, b, hk, C*s, d] (rank order) -> global order
    by_rank = gathered.unflatten(0, (size, 2)).permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
    full = torch.empty_like(by_rank)
    full.index_copy_(3, plan.order.to(kv.device), by_rank)
    return full


def all_gather_attn_forward(q, k, v, *, softmax_scale: float, causal: bool, group, plan: AllGatherPlan,
                            kernel: AttnKernel):
    """Local queries q [b, h, s, d] against the gathered K/V; returns (out in q.dtype, lse fp32)."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    full = _gather_kv(k, v, plan, group)
    plan.count()
    for rows, cols, diagonal, segments in plan.tiles:
        args = (q[:, :, rows], full[0][:, :, cols], full[1][:, :, cols])
        if segments is None:
            o, l = kernel.forward(*args, causal=diagonal, scale=softmax_scale)
        else:
            o, l = kernel.forward_segments(*args, segments, causal=diagonal, scale=softmax_scale)
        update_out_and_lse(out, lse, o, l, rows)
    del full  # the gathered K/V lives only inside the call
    return out.to(q.dtype), lse


def all_gather_attn_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, group,
                             plan: AllGatherPlan, kernel: AttnKernel):
    """dq, dk, dv of `all_gather_attn_forward` (K/V gathered again, dK/dV reduce-scattered)."""
    acc = accum_dtype(q.dtype)
    size = dist.get_world_size(group)
    full = _gather_kv(k, v, plan, group)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dfull = torch.zeros(full.shape, dtype=acc, device=q.device)
    for rows, cols, diagonal, segments in plan.tiles:
        args = (dout[:, :, rows], q[:, :, rows], full[0][:, :, cols], full[1][:, :, cols], out[:, :, rows],
                lse[:, :, rows])
        if segments is None:
            dq_t, dk_t, dv_t = kernel.backward(*args, causal=diagonal, scale=softmax_scale)
        else:
            dq_t, dk_t, dv_t = kernel.backward_segments(*args, segments, causal=diagonal, scale=softmax_scale)
        dq[:, :, rows] += dq_t
        dfull[0][:, :, cols] += dk_t
        dfull[1][:, :, cols] += dv_t
    del full
    # Back to rank order, one [2, b, hk, s, d] block per rank, and summed onto its owner.
    by_rank = dfull.index_select(3, plan.order.to(q.device)).unflatten(3, (size, -1)).permute(3, 0, 1, 2, 4, 5)
    del dfull
    mine = torch.empty(by_rank.shape[1:], dtype=acc, device=q.device)
    if COMM_COUNTER.enabled:
        COMM_COUNTER.add("reduce_scatter_dkv", mine.nbytes * (size - 1))
    dist.reduce_scatter_tensor(mine, by_rank.flatten(0, 1).contiguous(), group=group)
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


class AllGatherAttnFunc(torch.autograd.Function):
    """Autograd wrapper on kernel-layout [b, h, s, d] tensors; the plan is made once per call."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, group, positions, kernel_name, document_ids=None):
        kernel = get_kernel(q.device, q.dtype, kernel_name, head_dim=q.shape[-1])
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[0], q.shape[2], q.device)
        plan = AllGatherPlan(positions, group, causal, document_ids)
        kw = dict(softmax_scale=softmax_scale, causal=causal, group=group, plan=plan, kernel=kernel)
        out, lse = all_gather_attn_forward(q, k, v, **kw)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kw = kw
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = all_gather_attn_backward(dout, q, k, v, out, lse, **ctx.kw)
        return dq, dk, dv, None, None, None, None, None, None


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    positions: Optional[torch.Tensor] = None,
    kernel: Optional[str] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across ``group``, by all-gathering K/V.

    Args:
        q: local shard ``[s, b, h, d]``; k, v: ``[s, b, hk, d]`` with h % hk == 0.
        causal: causal mask over the global sequence, or full attention.
        group: None means megatron's context-parallel group.
        layout / positions: which global positions this rank holds: ``positions`` when given
            (any layout, in increasing order), else ``layout`` (zigzag or contiguous) over ``group``.
        kernel: local kernel name (see `cp_ext.attention.kernels.KERNELS`); None picks one.
        document_ids: packed documents, integer ``[b, s]`` laid out like q (`cp_ext.attention.documents`).

    Returns the local output shard ``[s, b, h, d]`` in q's dtype; differentiable in q, k, v.
    """
    if group is None:
        from megatron.core import parallel_state as mpu

        group = mpu.get_context_parallel_group()
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected [s, b, h, d] q, k, v with k.shape == v.shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if positions is None:
        from cp_ext.data.sharding import context_parallel_positions

        size = dist.get_world_size(group)
        positions = context_parallel_positions(q.shape[0] * size, ring_rank=dist.get_rank(group), ring_size=size,
                                               layout=layout)
    positions = positions.to(q.device, torch.int64)
    if positions.numel() != q.shape[0]:
        raise ValueError(f"positions holds {positions.numel()} tokens but q holds {q.shape[0]}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    to_kernel = lambda x: x.permute(1, 2, 0, 3)
    out = AllGatherAttnFunc.apply(to_kernel(q), to_kernel(k), to_kernel(v), scale, causal, group, positions, kernel,
                                  document_ids)
    return out.permute(2, 0, 1, 3)
