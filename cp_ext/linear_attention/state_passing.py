"""The gated delta rule (Gated DeltaNet or KDA) under context parallelism by exact state passing: the CP op
and its fold.

Each rank runs each of its segments from a zero state (`cp_ext.linear_attention.gated_delta.segment_summary`):
outputs o0, the propagated queries Qtilde, and the segment's affine map on the state, S_out = M S_in + E.
The (M, E) of every segment are all-gathered (fp32, fp64 for fp64 inputs) and every rank folds them in
sequence order, S_in(0) = 0, S_in(j+1) = M_j S_in(j) + E_j, up to its own last segment; its outputs are
o = o0 + Qtilde S_in. Nothing is approximated: the fold is the recurrence's own associativity, and a
document start inside a segment is a reset inside its recurrence, so that segment's M is zero from there
on and the earlier segments cannot reach past it. Backward is autograd's: the gradient of each S_in flows
through the fold into the gathered M and E, and the gather's backward sums them back to their owners.

Cost per rank, per (batch, head): the summary pass on V + K value columns, one all-gather of
(segments x K x (K + V)) values, and a fold of up to 2C - 1 (zigzag) K x K by K x V products,
done redundantly on every rank. ``exchange="ring"`` (`cp_ext.linear_attention.ring_exchange`) passes the
running state point to point along the sequence instead: one K x V state per hop, no redundant fold, but
2C - 2 hops one after the other. megatron-core's GDN CP instead all-to-alls the activations to head
parallelism and back (`cp_ext.linear_attention.head_parallel`: O(s d) per rank and layer, heads divisible
by C); this moves O(K (K + V)) per head and segment and keeps every head.

The pieces are public so a benchmark can time the same rank's work without the exchange:
`local_summaries`, then an exchange, then `apply_states`.
"""

from typing import List, Optional

import torch

from cp_ext.linear_attention.gated_delta import SegmentSummary, segment_summary
from cp_ext.linear_attention.ring_exchange import previous_document_ids, ring_states
from cp_ext.linear_attention.segments import (RankSegments, gather_in_sequence_order, group_size_rank, rank_segments,
                                              zeros_reading)


def fold_states(transitions: torch.Tensor, contributions: torch.Tensor,
                count: Optional[int] = None) -> List[torch.Tensor]:
    """The state entering each of the first ``count`` segments (all by default), from their maps in
    sequence order: M [N, b, h, K, K], E [N, b, h, K, V]; S_in(0) = 0, S_in(j+1) = M_j S_in(j) + E_j."""
    count = transitions.shape[0] if count is None else count
    states = [zeros_reading(contributions, contributions.shape[1:])]  # the backward reaches the gather on every rank
    for j in range(count - 1):
        states.append(transitions[j] @ states[-1] + contributions[j])
    return states


EXCHANGES = ("all_gather", "ring")


def _previous_document_ids(document_ids, segments, group):
    """[b] id of the token just before each local segment in global order (None for the first segment):
    a segment whose first token starts a document must not receive the state before it."""
    ends = torch.stack([document_ids[:, sl][:, [0, -1]] for sl in segments.slices()])  # [per, b, (first, last)]
    every = gather_in_sequence_order(ends, group, segments)
    return [every[j - 1, :, 1] if j > 0 else None for j in segments.ids]


def local_summaries(q, k, v, g, beta, *, segments: RankSegments, previous, document_ids=None, chunk_size: int = 64,
                    scale: Optional[float] = None, qk_l2norm: bool = False,
                    kernel: str = "auto") -> List[SegmentSummary]:
    """`segment_summary` of each of this rank's segments (local order); ``previous``: each segment's
    previous document id (None: none known, or the first segment)."""
    return [segment_summary(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], chunk_size=chunk_size,
                            document_ids=None if document_ids is None else document_ids[:, sl],
                            previous_document_id=prev, scale=scale, qk_l2norm=qk_l2norm, kernel=kernel)
            for sl, prev in zip(segments.slices(), previous)]


def apply_states(summaries: List[SegmentSummary], states: List[torch.Tensor]) -> torch.Tensor:
    """o = o0 + Qtilde S_in for each local segment, concatenated: [b, s_local, h_v, V] (accumulation dtype)."""
    return torch.cat([s.o0 + torch.einsum("bshk,bhkv->bshv", s.qtilde, state) for s, state in zip(summaries, states)],
                     dim=1)


def context_parallel_gated_delta(q, k, v, g, beta, *, group, layout: str = "zigzag", document_ids=None,
                                 chunk_size: int = 64, scale: Optional[float] = None, qk_l2norm: bool = False,
                                 exchange: str = "all_gather", kernel: str = "auto", output_final_state: bool = False):
    """The gated delta rule on this rank's shard of a CP-sharded sequence; equals `gated_delta_rule` on the
    whole sequence (from a zero state) at this rank's positions. Returns o [b, s_local, h_v, V] in v's dtype.

    q, k [b, s_local, h_k, K], v [b, s_local, h_v, V], beta [b, s_local, h_v], g [b, s_local, h_v] (Gated
    DeltaNet) or [b, s_local, h_v, K] (KDA): this rank's tokens in `cp_ext.token_partition`'s ``layout``
    over ``group`` ("zigzag" or "contiguous"); ``scale``, ``qk_l2norm``: `gated_delta_rule`'s. ``document_ids``
    [b, s_local]: this rank's ids of packed documents (the state resets wherever the id changes in global
    order, across ranks included). ``exchange``: "all_gather" (every segment's (M, E) to every rank, one
    collective; two with documents) or "ring" (the state passed point to point along the sequence,
    `cp_ext.linear_attention.ring_exchange`). ``kernel``: `segment_summary`'s ("auto": fla on CUDA when it
    imports). Every rank of ``group`` must call it. ``output_final_state`` (all-gather exchange only, where every
    rank holds every summary): also the state after the sequence's last token, the same on every rank, by one
    more step of the fold: (o, S [b, h_v, K, V] fp32) -- what generation continues from.
    """
    if output_final_state and exchange != "all_gather":
        raise ValueError("output_final_state needs the all-gather exchange (every rank folds every segment)")
    if exchange not in EXCHANGES:
        raise ValueError(f"state passing's exchange is one of {EXCHANGES}, not {exchange!r}")
    size, rank = group_size_rank(group)
    segments = rank_segments(q.shape[1], layout, rank, size)
    if document_ids is None:
        previous = [None] * len(segments.ids)
    elif exchange == "ring":
        previous = previous_document_ids(document_ids, group=group, segments=segments, rank=rank)
    else:
        previous = _previous_document_ids(document_ids, segments, group)
    summaries = local_summaries(q, k, v, g, beta, segments=segments, previous=previous, document_ids=document_ids,
                                chunk_size=chunk_size, scale=scale, qk_l2norm=qk_l2norm, kernel=kernel)
    transitions = torch.stack([s.transition for s in summaries])  # [per-rank segments, b, h, K, K]
    contributions = torch.stack([s.contribution for s in summaries])  # [per-rank segments, b, h, K, V]
    if exchange == "ring":
        states = list(ring_states(transitions, contributions, group=group, segments=segments, rank=rank))
    else:
        kd = transitions.shape[-1]
        # M and E side by side: one gather; [all segments, b, h, K, K + V] in sequence order
        every = gather_in_sequence_order(torch.cat([transitions, contributions], dim=-1), group, segments)
        count = every.shape[0] + 1 if output_final_state else max(segments.ids) + 1
        folded = fold_states(every[..., :kd], every[..., kd:], count=count)
        states = [folded[j] for j in segments.ids]
    o = apply_states(summaries, states).to(v.dtype)
    return (o, folded[-1]) if output_final_state else o
