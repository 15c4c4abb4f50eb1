"""The ring variant of state passing's exchange: the running state travels point to point along the
sequence, instead of every segment's summary being all-gathered.

`cp_ext.linear_attention.state_passing` gives each segment j its affine map on the state, S_out = M_j S_in
+ E_j. Here the owner of segment j receives S_in(j) from the owner of segment j - 1, applies its own map
and sends S_out(j) to the owner of segment j + 1 (a segment whose neighbour it owns itself stays local).
Zigzag gives rank r segments r and 2C-1-r, so the state visits the ranks 0 -> 1 -> .. -> C-1 (which holds
segments C-1 and C back to back) -> C-2 -> .. -> 0; contiguous goes 0 -> 1 -> .. -> C-1::

    C = 3, zigzag:  segment 0   1   2 | 3   4   5
                    rank    0 > 1 > 2 > 2 > 1 > 0        (2 -> 2: no message)

Each hop moves one K x V state per (batch, head): b h_v K V values (fp32, fp64 for fp64 inputs), against
the all-gather's (C-1) x segments x b h_v K (K + V) per rank; the price is latency, 2C-2 hops one after the
other, while the all-gather is one collective. The backward runs the chain in reverse: the owner of segment
j + 1 sends dS_in(j + 1) = dS_out(j) back; from it the owner of j takes dM_j = dS_out S_in^T, dE_j = dS_out,
and sends dS_in(j) = M_j^T dS_out + (its outputs' dS_in) on to the owner of j - 1. Exact: the same products
autograd would form, in the same fp32 accumulation dtype.

Packed documents: the summaries need, for each segment, the id of the token before it
(`previous_document_ids`): one round of point-to-point messages of b ids each, every rank at once, along
the same edges. Blocking send/recv over any backend (gloo on CPU included); the chain has no cycle, so
no ordering of the ranks' posts can deadlock.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from cp_ext.linear_attention.segments import RankSegments


def segment_owners(segments: RankSegments) -> List[int]:
    """The group rank holding each global segment, in sequence order."""
    per = len(segments.ids)
    return [slot // per for slot in segments.order]


def _peer(group, group_rank: int) -> int:
    """The global rank torch.distributed's send/recv address (``group_dst`` is newer than our oldest torch)."""
    return group_rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, group_rank)


def _send(tensor, group, to):
    dist.send(tensor.contiguous(), _peer(group, to), group=group)


def _recv(like, group, src):
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    dist.recv(out, _peer(group, src), group=group)
    return out


def _global_order(segments: RankSegments) -> List[int]:
    """This rank's local segment slots, in sequence order."""
    return sorted(range(len(segments.ids)), key=lambda slot: segments.ids[slot])


class _RingStates(torch.autograd.Function):
    """(M [per, b, h, K, K], E [per, b, h, K, V], local order) -> S_in [per, b, h, K, V] of each local segment."""

    @staticmethod
    def forward(ctx, transitions, contributions, group, segments, rank):
        owners, count = segment_owners(segments), segments.count
        states = torch.zeros_like(contributions)
        local_out = {}  # S_out of a segment whose successor this rank also holds
        for slot in _global_order(segments):
            j = segments.ids[slot]
            if j > 0:
                before = owners[j - 1]
                states[slot] = local_out.pop(j - 1) if before == rank else _recv(states[slot], group, before)
            if j + 1 < count:
                out = transitions[slot] @ states[slot] + contributions[slot]
                if owners[j + 1] == rank:
                    local_out[j] = out
                else:
                    _send(out, group, owners[j + 1])
        ctx.save_for_backward(transitions, states)
        ctx.chain = (group, segments, rank)
        return states

    @staticmethod
    def backward(ctx, grad_states):
        transitions, states = ctx.saved_tensors
        group, segments, rank = ctx.chain
        owners, count = segment_owners(segments), segments.count
        d_transitions = torch.zeros_like(transitions)
        d_contributions = torch.zeros_like(states)
        local_in = {}  # dS_in of a segment whose predecessor this rank also holds
        for slot in reversed(_global_order(segments)):
            j = segments.ids[slot]
            d_in = grad_states[slot]
            if j + 1 < count:
                d_out = local_in.pop(j + 1) if owners[j + 1] == rank else _recv(d_in, group, owners[j + 1])
                d_transitions[slot] = d_out @ states[slot].transpose(-1, -2)
                d_contributions[slot] = d_out
                d_in = d_in + transitions[slot].transpose(-1, -2) @ d_out
            if j > 0:
                if owners[j - 1] == rank:
                    local_in[j] = d_in
                else:
                    _send(d_in, group, owners[j - 1])
        return d_transitions, d_contributions, None, None, None


def ring_states(transitions: torch.Tensor, contributions: torch.Tensor, *, group, segments: RankSegments,
                rank: int) -> torch.Tensor:
    """The state entering each of this rank's segments (local order), passed along the sequence from the
    maps of the segments before it; differentiable (the gradients travel the chain back). Every rank of
    ``group`` must call it, also one whose outputs read no incoming state (the chain passes through it)."""
    return _RingStates.apply(transitions, contributions, group, segments, rank)


def previous_document_ids(document_ids: torch.Tensor, *, group, segments: RankSegments,
                          rank: int) -> List[Optional[torch.Tensor]]:
    """[b] id of the token just before each local segment in global order (None for the first segment):
    every segment's last id goes to its successor's owner, all ranks at once (isend/irecv, then wait)."""
    owners, count = segment_owners(segments), segments.count
    last = {j: document_ids[:, sl][:, -1].contiguous() for j, sl in zip(segments.ids, segments.slices())}
    previous, pending = {}, []
    for j, sl in zip(segments.ids, segments.slices()):
        if j > 0 and owners[j - 1] != rank:
            previous[j] = torch.empty_like(last[j])
            pending.append(dist.irecv(previous[j], _peer(group, owners[j - 1]), group=group))
        if j + 1 < count and owners[j + 1] != rank:
            pending.append(dist.isend(last[j], _peer(group, owners[j + 1]), group=group))
    for work in pending:
        work.wait()
    return [None if j == 0 else previous[j] if j in previous else last[j - 1] for j in segments.ids]
