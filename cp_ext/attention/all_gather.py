"""All-gather-KV attention (TE's ``cp_comm_type="all_gather"``, Llama 3's long-context recipe).

Every rank of the group all-gathers K and V (one collective, forward) and computes its local
queries against the whole sequence; the backward gathers K/V again (the gathered copy is not
kept between forward and backward) and reduce-scatters the full-sequence dK/dV back to their
owners. The gathered K/V stays in rank order, sequence first (``[C*s, 2, b, hk, d]``: what the
all-gather writes, and what the reduce-scatter reads), so nothing is copied into sequence
order. There is no ring, so any mask is simple: each run of consecutive positions this rank
holds (a zigzag chunk, or two adjacent ones) meets each run of the other ranks as a full tile
when those keys come first, and itself as a causal square::

    zigzag, C = 2, 4 chunks of c; rank 0 holds chunks (0, 3), rank 1 chunks (1, 2) = one run:
    rank 0, chunk 0:      chunk 0 causal square                         c^2/2
            chunk 3:      chunk 0 full, chunks 1-2 full, chunk 3 square c^2 + 2c^2 + c^2/2
    rank 1, chunks 1-2:   chunk 0 full, chunks 1-2 square               2c^2 + 2c^2
    -> 4 c^2 query-key pairs on each rank

so the zigzag layout balances the causal work as it does for the ring. Packed documents
(``document_ids``) turn each tile into its segments (`cp_ext.attention.documents`): a query
run only meets the keys of its own documents. Works with any CP layout: the positions each
rank holds are all-gathered with K/V, so the same function serves a ring layout and a
Ulysses x ring one (``--cp-comm-type`` lists mixing ``all_gather`` with another type).

Cost per rank: one all-gather of (C-1)/C of the sequence's K/V forward and backward, and a
reduce-scatter of dK/dV. Memory: the gathered K/V (one full-sequence copy in the input dtype)
lives only inside the forward call; the backward holds it plus the fp32 full-sequence dK/dV
until the reduce-scatter. Tiles are chunk-sized, so their temporaries are small.
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from cp_ext.attention.documents import (
    Runs, check_document_ids, clip_runs, diagonal_segments, document_runs, gather_parts, segment_pairs,
    tile_segments,
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
    """This rank's tiles: (q rows, rows of the gathered K/V, diagonal?, segments or None).

    The gathered K/V stays in *rank order* (what the all-gather gives: rank i's shard at rows
    ``[i*s, (i+1)*s)``), so nothing is copied into sequence order. Each rank's shard is a few
    runs of consecutive positions (2 zigzag chunks, or one block), and another rank's run lies
    wholly before or after each of this rank's query runs; so a tile pairs one query run with
    one key run: full when the keys come first, the causal square when it is the query run
    itself, nothing when the keys come after (causal).
    """

    def __init__(self, positions: torch.Tensor, group, causal: bool, document_ids=None):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        s = positions.numel()
        parts = [p.tolist() for p in gather_parts(positions, group)]
        if sorted(parts[me]) != parts[me]:
            raise ValueError("all-gather attention needs each rank's tokens in increasing global order")
        runs: List[Optional[Runs]] = [None] * size
        if document_ids is not None:
            ids = [x.cpu().long() for x in gather_parts(document_ids, group)]
            runs = [document_runs(x, name=f"document_ids (CP rank {i})") for i, x in enumerate(ids)]
            # The whole sequence must be in order too: every rank checks it (same data, same verdict).
            full = torch.empty(ids[0].shape[0], s * size, dtype=torch.int64)
            full[:, torch.tensor(sum(parts, []))] = torch.cat(ids, dim=1)
            document_runs(full, name="document_ids (whole sequence)")
        self.tiles = []
        for q0, q1, p0 in _runs_of_positions(parts[me]):
            p1 = p0 + (q1 - q0)
            q_runs = None if document_ids is None else clip_runs(runs[me], slice(q0, q1), s)
            for rank in range(size):
                for k0, k1, kp0 in _runs_of_positions(parts[rank]):
                    diagonal = causal and rank == me and (k0, k1) == (q0, q1)
                    if causal and not diagonal and kp0 >= p1:
                        continue  # keys after the queries
                    segments = None
                    if document_ids is not None:
                        segments = (diagonal_segments(q_runs) if diagonal
                                    else tile_segments(q_runs, clip_runs(runs[rank], slice(k0, k1), s)))
                        if not segments:
                            continue
                    self.tiles.append((slice(q0, q1), slice(rank * s + k0, rank * s + k1), diagonal, segments))

    def count(self):
        if WORK_COUNTER.enabled:
            for rows, cols, diagonal, segments in self.tiles:
                n = rows.stop - rows.start
                dense = n * (n + 1) // 2 if diagonal else n * (cols.stop - cols.start)
                WORK_COUNTER.add("tiles", 1)
                WORK_COUNTER.add("pairs", dense if segments is None else segment_pairs(segments, diagonal))


# torch 2.13 renames the tensor collectives (*_into_tensor / *_tensor are deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Every rank's K/V, rank after rank: ``[C*s, 2, b, hk, d]`` (sequence first, so the
    all-gather writes it in place and the kernel views need no copy)."""
    size, rank, s = dist.get_world_size(group), dist.get_rank(group), k.shape[2]
    gathered = k.new_empty((size * s, 2) + k.shape[:2] + k.shape[3:])
    mine = gathered[rank * s : (rank + 1) * s]  # this rank's K/V go straight into their slot:
    mine[:, 0].copy_(k.permute(2, 0, 1, 3))  # an in-place all-gather, no local staging copy
    mine[:, 1].copy_(v.permute(2, 0, 1, 3))
    if COMM_COUNTER.enabled:
        COMM_COUNTER.add("all_gather_kv", mine.nbytes * (size - 1))
    _all_gather_single(gathered, mine, group=group)
    return gathered


def _kernel_view(kv_rows: torch.Tensor, which: int) -> torch.Tensor:
    """Rows of the gathered ``[n, 2, b, hk, d]`` K (0) or V (1) as a kernel-layout [b, hk, n, d] view."""
    return kv_rows[:, which].permute(1, 2, 0, 3)


def all_gather_attn_forward(q, k, v, *, softmax_scale: float, causal: bool, group, plan: AllGatherPlan,
                            kernel: AttnKernel):
    """Local queries q [b, h, s, d] against the gathered K/V; returns (out in q.dtype, lse fp32)."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = _gather_kv(k, v, group)
    plan.count()
    for rows, cols, diagonal, segments in plan.tiles:
        args = (q[:, :, rows], _kernel_view(kv[cols], 0), _kernel_view(kv[cols], 1))
        if segments is None:
            o, l = kernel.forward(*args, causal=diagonal, scale=softmax_scale)
        else:
            o, l = kernel.forward_segments(*args, segments, causal=diagonal, scale=softmax_scale)
        update_out_and_lse(out, lse, o, l, rows)
        del o, l
    return out.to(q.dtype), lse  # the gathered K/V is freed here: it lives only inside the call


def all_gather_attn_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, group,
                             plan: AllGatherPlan, kernel: AttnKernel):
    """dq, dk, dv of `all_gather_attn_forward` (K/V gathered again, dK/dV reduce-scattered)."""
    acc = accum_dtype(q.dtype)
    kv = _gather_kv(k, v, group)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # [C*s, 2, b, hk, d], rank order
    args = None
    for rows, cols, diagonal, segments in plan.tiles:
        args = (dout[:, :, rows], q[:, :, rows], _kernel_view(kv[cols], 0), _kernel_view(kv[cols], 1),
                out[:, :, rows], lse[:, :, rows])
        if segments is None:
            dq_t, dk_t, dv_t = kernel.backward(*args, causal=diagonal, scale=softmax_scale)
        else:
            dq_t, dk_t, dv_t = kernel.backward_segments(*args, segments, causal=diagonal, scale=softmax_scale)
        dq[:, :, rows] += dq_t
        dkv[cols, 0] += dk_t.permute(2, 0, 1, 3)
        dkv[cols, 1] += dv_t.permute(2, 0, 1, 3)
        del dq_t, dk_t, dv_t  # before the next tile's kernel call allocates its own
    del kv, args
    # Rank i's rows of dK/dV, summed over the ranks, land on rank i: already in rank order.
    mine = torch.empty((dkv.shape[0] // dist.get_world_size(group),) + dkv.shape[1:], dtype=acc, device=q.device)
    if COMM_COUNTER.enabled:
        COMM_COUNTER.add("reduce_scatter_dkv", mine.nbytes * (dist.get_world_size(group) - 1))
    _reduce_scatter_single(mine, dkv, group=group)
    to_kernel = lambda x, like: x.permute(1, 2, 0, 3).to(like.dtype)  # [s, b, hk, d] -> [b, hk, s, d]
    return dq.to(q.dtype), to_kernel(mine[:, 0], k), to_kernel(mine[:, 1], v)


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
