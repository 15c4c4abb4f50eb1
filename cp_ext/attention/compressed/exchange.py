"""What crosses CP ranks in DeepSeek-V4's attention, with its gradient riding home.

Two exchanges, both differentiable:

* `fetch_rows`: a rank receives the rows at some global positions from the ranks that hold them
  (the window's K/V halo, the compressor projections of a block that straddles a shard boundary).
  Point to point, one message per peer that holds anything wanted; the backward sends each row's
  gradient back to its owner, which adds it into its own rows' gradient.
* `gather_entries`: every rank's compressed entries (and CSA's indexer keys, in the same rows) to
  every rank, in key-position order. The backward all-reduces the entries' gradient and each rank
  keeps its own rows' share.

Who sends what is planned on every rank from the same `SequencePlan`, so no request travels.
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from cp_ext.attention.compressed.plan import SequencePlan
from cp_ext.attention.cp.primitives import post_p2p


def _peers(group) -> List[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _exchange(pieces: List[torch.Tensor], recv_shapes: List[Tuple[int, ...]], rank: int, group,
              like: torch.Tensor) -> List[torch.Tensor]:
    """Send ``pieces[p]`` to group rank p and receive a ``recv_shapes[p]`` tensor from it (empty ones skipped)."""
    peers = _peers(group)
    received = [like.new_empty(shape) for shape in recv_shapes]
    ops = []
    for p, (piece, buf) in enumerate(zip(pieces, received)):
        if p == rank:
            continue
        if piece.numel():
            ops.append((dist.isend, piece.contiguous(), peers[p]))
        if buf.numel():
            ops.append((dist.irecv, buf, peers[p]))
    for req in post_p2p(ops, group):
        req.wait()
    return received


class _FetchRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_rows, recv_counts, rank, group):
        ctx.save_for_backward(*send_rows)
        ctx.meta = (x.shape, recv_counts, rank, group)
        tail = tuple(x.shape[1:])
        pieces = [x.index_select(0, rows) for rows in send_rows]
        return torch.cat(_exchange(pieces, [(n,) + tail for n in recv_counts], rank, group, x), dim=0)

    @staticmethod
    def backward(ctx, grad):
        send_rows = ctx.saved_tensors
        shape, recv_counts, rank, group = ctx.meta
        pieces = list(grad.split(list(recv_counts), dim=0))
        back = _exchange(pieces, [(rows.numel(),) + tuple(shape[1:]) for rows in send_rows], rank, group, grad)
        grad_x = grad.new_zeros(shape)
        for rows, piece in zip(send_rows, back):
            if rows.numel():
                grad_x.index_add_(0, rows, piece)
        return grad_x, None, None, None, None


def fetch_rows(x: torch.Tensor, plan: SequencePlan, needs: List[torch.Tensor], rank: int,
               group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``x`` [s_local, ...] (this rank's) that ``needs[rank]`` names, from their owners.

    ``needs[r]``: the positions rank r wants (held elsewhere), computed alike on every rank. Returns
    (rows [n, ...], their positions [n]) grouped by owner in rank order."""
    size = len(plan.positions)
    mine = needs[rank].to(torch.int64)
    from_peer = [mine[plan.owner[mine] == p] for p in range(size)]
    send_rows = []
    for p in range(size):
        wanted = needs[p][plan.owner[needs[p]] == rank] if p != rank else needs[p][:0]
        send_rows.append(plan.row[wanted].to(x.device))
    recv_counts = [0 if p == rank else from_peer[p].numel() for p in range(size)]
    rows = _FetchRows.apply(x, send_rows, recv_counts, rank, group)
    return rows, torch.cat(from_peer).to(x.device)


class _GatherEntries(torch.autograd.Function):
    @staticmethod
    def forward(ctx, entries, counts, rank, group):
        ctx.meta = (counts, rank, group)
        most = max(counts)
        padded = entries.new_zeros((most,) + tuple(entries.shape[1:]))
        padded[:entries.shape[0]] = entries
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)], dim=0)

    @staticmethod
    def backward(ctx, grad):
        counts, rank, group = ctx.meta
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        start = sum(counts[:rank])
        return grad[start:start + counts[rank]], None, None, None


def gather_entries(entries: torch.Tensor, key_positions: List[torch.Tensor], rank: int,
                   group: Optional[dist.ProcessGroup]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``entries`` [E_r, F] (``key_positions[r]``: their key positions, increasing, known on every
    rank) gathered on every rank in increasing key position: (entries [E, F], key positions [E])."""
    counts = [int(k.numel()) for k in key_positions]
    every = torch.cat(key_positions)
    if len(counts) == 1 or group is None:
        return entries, every.to(entries.device)
    if sum(counts) == 0:
        return entries.new_zeros((0,) + tuple(entries.shape[1:])), every.to(entries.device)
    gathered = _GatherEntries.apply(entries, counts, rank, group)
    order = every.argsort()
    return gathered.index_select(0, order.to(entries.device)), every[order].to(entries.device)
