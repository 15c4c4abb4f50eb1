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
(``document_ids``) turn each tile into its segments (`cp_ext.attention.masks.documents`): a query
run only meets the keys of its own documents. Works with any CP layout: the positions each
rank holds are all-gathered with K/V, so the same function serves a ring layout and a
Ulysses x ring one (``--cp-comm-type`` lists mixing ``all_gather`` with another type).

Cost per rank: one all-gather of (C-1)/C of the sequence's K/V forward and backward, and a
reduce-scatter of dK/dV. Memory: the gathered K/V (one full-sequence copy in the input dtype)
lives only inside the forward call; the backward holds it plus the fp32 full-sequence dK/dV
until the reduce-scatter. Tiles are chunk-sized, so their temporaries are small.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from cp_ext.attention.masks.documents import Runs, clip_runs, document_runs, gather_parts
from cp_ext.attention.kernels import AttnKernel
from cp_ext.attention.cp.kv_message import PairedKV
from cp_ext.attention.masks.tiles import make_window, plan_tile, position_runs, tile_span
from cp_ext.attention.cp.primitives import accum_dtype, add_sink, update_out_and_lse
from cp_ext.perf.counter import COMM_COUNTER, WORK_COUNTER
from cp_ext.perf.saved_tensors import ALL_GATHER_CALLS


class AllGatherPlan:
    """This rank's tiles: (q rows, rows of the gathered K/V, blocks shifted to them).

    The gathered K/V stays in *rank order* (what the all-gather gives: rank i's shard at rows
    ``[i*s, (i+1)*s)``), so nothing is copied into sequence order. Each rank's shard is a few
    runs of consecutive positions (2 zigzag chunks, or one block); a tile pairs one query run
    with one key run, planned from the mask (`cp_ext.attention.masks.tiles.plan_tile`): full when the
    keys come first, the causal square when it is the query run itself, nothing when the keys
    come after (causal) or lie outside the window.
    """

    def __init__(self, positions: torch.Tensor, group, causal: bool, document_ids=None, window_size=None):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        s = positions.numel()
        parts = [p.tolist() for p in gather_parts(positions, group)]
        if sorted(parts[me]) != parts[me]:
            raise ValueError("all-gather attention needs each rank's tokens in increasing global order")
        window = make_window(window_size, causal)
        runs: List[Optional[Runs]] = [None] * size
        if document_ids is not None:
            ids = [x.cpu().long() for x in gather_parts(document_ids, group)]
            runs = [document_runs(x, name=f"document_ids (CP rank {i})") for i, x in enumerate(ids)]
            # The whole sequence must be in order too: every rank checks it (same data, same verdict).
            full = torch.empty(ids[0].shape[0], s * size, dtype=torch.int64)
            full[:, torch.tensor(sum(parts, []))] = torch.cat(ids, dim=1)
            document_runs(full, name="document_ids (whole sequence)")
        docs = lambda rank, a, b: None if document_ids is None else clip_runs(runs[rank], slice(a, b), s)  # noqa: E731
        self.tiles = []
        for q0, q1, p0 in position_runs(parts[me]):
            for rank in range(size):
                for k0, k1, kp0 in position_runs(parts[rank]):
                    same = rank == me and (k0, k1) == (q0, q1)
                    blocks = plan_tile([(0, q1 - q0, p0)], [(0, k1 - k0, kp0)], window, same_tokens=same,
                                       q_docs=docs(me, q0, q1), k_docs=docs(rank, k0, k1))
                    if not blocks:
                        continue
                    rows, cols = tile_span(blocks)
                    self.tiles.append((slice(q0 + rows.start, q0 + rows.stop),
                                       slice(rank * s + k0 + cols.start, rank * s + k0 + cols.stop),
                                       [blk.shift(rows.start, cols.start) for blk in blocks]))

    def count(self):
        if WORK_COUNTER.enabled:
            for _, _, blocks in self.tiles:
                WORK_COUNTER.add("tiles", 1)
                WORK_COUNTER.add("pairs", sum(blk.pairs() for blk in blocks))


# torch 2.13 renames the tensor collectives (*_into_tensor / *_tensor are deprecated there).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_kv(k: torch.Tensor, v: Optional[torch.Tensor], group) -> torch.Tensor:
    """Every rank's K/V, rank after rank: ``[C*s, b, hk, d_qk + d_v]`` (sequence first, k and v side
    by side, so the all-gather writes it in place and the kernel views need no copy); with v None,
    k is MLA's latent ``[b, 1, s, r + p]`` (`cp_ext.attention.cp.kv_message.LatentKV`), gathered alone."""
    size, rank, s = dist.get_world_size(group), dist.get_rank(group), k.shape[2]
    width = k.shape[3] + (0 if v is None else v.shape[3])
    gathered = k.new_empty((size * s,) + k.shape[:2] + (width,))
    mine = gathered[rank * s : (rank + 1) * s]  # this rank's K/V go straight into their slot:
    mine[..., : k.shape[3]].copy_(k.permute(2, 0, 1, 3))  # an in-place all-gather, no local staging copy
    if v is not None:
        mine[..., k.shape[3]:].copy_(v.permute(2, 0, 1, 3))
    if COMM_COUNTER.enabled:
        COMM_COUNTER.add("all_gather_kv", mine.nbytes * (size - 1))
    all_gather_single(gathered, mine, group=group)
    return gathered


def _kernel_view(rows: torch.Tensor) -> torch.Tensor:
    """Rows ``[n, b, hk, D]`` of the gathered messages (or their gradient) in kernel layout [b, hk, n, D]."""
    return rows.permute(1, 2, 0, 3)


@ALL_GATHER_CALLS.around  # what the call holds while it runs is measurable (cp_ext.perf.saved_tensors)
def all_gather_attn_forward(q, k, v, *, softmax_scale: float, causal: bool, group, plan: AllGatherPlan,
                            kernel: AttnKernel, softmax_offset=None, message=None, **_):
    """Local queries q [b, h, s, d] against the gathered K/V; returns (out in q.dtype, lse fp32), finished.
    ``message``: what is gathered (`cp_ext.attention.cp.kv_message`; with `LatentKV`, k is the latent, v None)."""
    acc = accum_dtype(q.dtype)
    message = message or PairedKV(q.shape[-1], v.shape[-1])
    out = torch.zeros(q.shape[:3] + (message.d_v,), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = _gather_kv(k, v, group)
    plan.count()
    for rows, cols, blocks in plan.tiles:
        kb, vb = message.unpack(_kernel_view(kv[cols]))
        o, l = kernel.forward_blocks(q[:, :, rows], kb, vb, blocks, scale=softmax_scale)
        update_out_and_lse(out, lse, o, l, rows)
        del o, l
    out, lse = add_sink(out, lse, softmax_offset)
    return out.to(q.dtype), lse  # the gathered K/V is freed here: it lives only inside the call


@ALL_GATHER_CALLS.around
def all_gather_attn_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, group,
                             plan: AllGatherPlan, kernel: AttnKernel, message=None, **_):
    """dq, dk, dv of `all_gather_attn_forward` (K/V gathered again, dK/dV reduce-scattered); with a
    `LatentKV` ``message`` (dq, d latent, None), the message holding this rank's share of d W_up."""
    acc = accum_dtype(q.dtype)
    message = message or PairedKV(q.shape[-1], v.shape[-1])
    kv = _gather_kv(k, v, group)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # [C*s, b, hk, D], rank order
    for rows, cols, blocks in plan.tiles:
        kv_rows = _kernel_view(kv[cols])
        kb, vb = message.unpack(kv_rows)
        dq_t, dk_t, dv_t = kernel.backward_blocks(dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                                  lse[:, :, rows], blocks, scale=softmax_scale)
        dq[:, :, rows] += dq_t
        message.add_grad(_kernel_view(dkv[cols]), slice(None), dk_t, dv_t, kv_rows)
        del dq_t, dk_t, dv_t  # before the next tile's kernel call allocates its own
    del kv
    # Rank i's rows of dK/dV, summed over the ranks, land on rank i: already in rank order.
    mine = torch.empty((dkv.shape[0] // dist.get_world_size(group),) + dkv.shape[1:], dtype=acc, device=q.device)
    if COMM_COUNTER.enabled:
        COMM_COUNTER.add("reduce_scatter_dkv", mine.nbytes * (dist.get_world_size(group) - 1))
    reduce_scatter_single(mine, dkv, group=group)
    return (dq.to(q.dtype),) + message.grads(_kernel_view(mine), k, v)
