"""The gated delta rule under CP by head parallelism (megatron-core's method), and the Ulysses x state-passing
hybrid.

Head parallelism: an all-to-all turns each rank's sequence shard of every head into the whole sequence of
h/C heads; the plain `gated_delta_rule` runs there (nothing crosses ranks), and a second all-to-all returns
the outputs to their sequence shards::

    C = 2, zigzag shards (chunks 0,3 | 1,2), value heads H0 | H1
    rank 0: [0 3] x (H0, H1)  --all-to-all-->  [0 3 1 2] x H0  --reorder-->  [0 1 2 3] x H0  --rule-->
    rank 1: [1 2] x (H0, H1)                   [0 3 1 2] x H1                [0 1 2 3] x H1

The reorder undoes the layout (`cp_ext.token_partition.context_parallel_positions` of every rank), as
megatron-core's ``tensor_a2a_cp2hp`` undoes its attention load balancing. Value heads and key heads must
both divide by C (rank u takes value heads [u h_v/C, (u+1) h_v/C) and the key heads they read, value head j
reading key head j // (h_v/h_k)); state passing (`cp_ext.linear_attention.state_passing`) has no such
limit. Bytes per rank: (C-1)/C of q, k, v, g, beta and the output, forward and backward alike
(`cp_ext.perf.comm.linear_head_parallel_bytes`), against state passing's few K x (K + V) summaries.

The hybrid (`ulysses_state_passing`) is cp_ext's softmax-attention hybrid's token layout
(`cp_ext.attention.cp.context_parallel`): a rank holds its Ulysses piece of its ring position's shard
(`context_parallel_positions(ring_rank, ring_size, ulysses_rank, ulysses_size)`), so the all-to-all over the
U-rank Ulysses group hands it the whole ring shard (s/R tokens, already in order) for h/U heads, and state
passing over the R-rank ring group runs on that. Heads then divide by U only.

A layer calls `ulysses_conv_and_rule`, which does the all-to-all before its conv (on whole heads' channels, the
halo over the ring) and so covers pure Ulysses (megatron's method, R = 1) and the hybrid alike.

The all-to-all is its own small autograd Function here (its backward is the inverse all-to-all):
`cp_ext.attention`'s is a sibling package, which the layer contract keeps apart from this one.
"""

from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.linear_attention.conv import causal_conv1d, context_parallel_causal_conv1d
from cp_ext.linear_attention.gated_delta import gated_delta_rule
from cp_ext.linear_attention.segments import _all_gather_single, group_size_rank
from cp_ext.linear_attention.state_passing import context_parallel_gated_delta
from cp_ext.token_partition import context_parallel_positions


def check_head_parallel(key_heads: int, value_heads: int, size: int, *, what: str = "head-parallel CP") -> None:
    """ValueError unless both head counts divide by ``size`` (the ranks the heads are split over)."""
    if key_heads % size or value_heads % size:
        fits = [c for c in range(1, min(key_heads, value_heads) + 1) if key_heads % c == 0 and value_heads % c == 0]
        raise ValueError(
            f"{what} splits the heads over {size} ranks, but {key_heads} key heads and {value_heads} value heads "
            f"(per tensor-parallel rank) are not both divisible by {size}; use a size in {fits}, or state passing "
            f"(method='state_passing'), whose exchange has no such limit on the heads")


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()  # send[i]: rank i's chunk
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)  # rank i's chunk i-th along gather_dim


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = (group, scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.args
        return _exchange(grad, group, gather_dim, scatter_dim), None, None, None


def _sequence_to_heads(x, group, order=None):
    """[b, s_local, h, ...] -> [b, size * s_local, h / size, ...]: every rank's tokens in rank order, or in
    sequence order when ``order`` (the rank-order row of each global position) is given."""
    x = _AllToAll.apply(x, group, 2, 1)
    return x if order is None else x.index_select(1, order)


def _heads_to_sequence(x, group, positions=None):
    """The inverse of `_sequence_to_heads` (``positions``: the global position of each rank-order row)."""
    if positions is not None:
        x = x.index_select(1, positions)
    return _AllToAll.apply(x, group, 1, 2)


def _gather_ids(document_ids, group, size, order=None):
    """[b, s_local] ids of every rank, as `_sequence_to_heads` orders the tokens: [b, size * s_local]."""
    every = document_ids.new_empty((size * document_ids.shape[0], document_ids.shape[1]))  # rank after rank
    _all_gather_single(every, document_ids.contiguous(), group=group)
    every = every.unflatten(0, (size, -1)).transpose(0, 1).flatten(1)
    return every if order is None else every.index_select(1, order)


def head_parallel_gated_delta(q, k, v, g, beta, *, group, layout: str = "zigzag", document_ids=None,
                              chunk_size: int = 64, scale: Optional[float] = None,
                              qk_l2norm: bool = False, kernel: str = "auto") -> torch.Tensor:
    """`context_parallel_gated_delta`'s contract (same arguments and shard layout, o [b, s_local, h_v, V] in
    v's dtype) by head parallelism: all-to-all to h/C heads of the whole sequence, the rule, all-to-all back.
    Needs h_k and h_v divisible by C (a ValueError otherwise, on every rank before any exchange)."""
    size, rank = group_size_rank(group)
    if size == 1:
        return gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, document_ids=document_ids, scale=scale,
                                qk_l2norm=qk_l2norm, kernel=kernel)[0]
    check_head_parallel(k.shape[2], v.shape[2], size)
    s = q.shape[1] * size
    positions = torch.cat([context_parallel_positions(s, ring_rank=r, ring_size=size, layout=layout)
                           for r in range(size)]).to(q.device)
    order = torch.argsort(positions)
    heads = [_sequence_to_heads(x, group, order) for x in (q, k, v, g, beta)]
    ids = None if document_ids is None else _gather_ids(document_ids, group, size, order)
    o, _ = gated_delta_rule(*heads, chunk_size=chunk_size, document_ids=ids, scale=scale, qk_l2norm=qk_l2norm,
                            kernel=kernel)
    return _heads_to_sequence(o, group, positions)


def ulysses_state_passing(q, k, v, g, beta, *, ulysses_group, ring_group, layout: str = "zigzag",
                          document_ids=None, exchange: str = "all_gather", chunk_size: int = 64,
                          scale: Optional[float] = None, qk_l2norm: bool = False, kernel: str = "auto") -> torch.Tensor:
    """The hybrid: Ulysses all-to-all over ``ulysses_group`` (U ranks; heads divisible by U), state passing
    (``exchange``) over ``ring_group`` (R ranks) on the ring shard, all-to-all back. This rank's tokens are
    `context_parallel_positions(s, ring_rank, ring_size=R, ulysses_rank, ulysses_size=U, layout)` (cp_ext's
    hybrid layout, `cp_ext.parallel_state`'s groups); returns o [b, s / (U R), h_v, V] in v's dtype."""
    size, _ = group_size_rank(ulysses_group)
    if size == 1:
        return context_parallel_gated_delta(q, k, v, g, beta, group=ring_group, layout=layout, exchange=exchange,
                                            document_ids=document_ids, chunk_size=chunk_size, scale=scale,
                                            qk_l2norm=qk_l2norm, kernel=kernel)
    check_head_parallel(k.shape[2], v.shape[2], size, what="the Ulysses level of the hybrid")
    heads = [_sequence_to_heads(x, ulysses_group) for x in (q, k, v, g, beta)]
    ids = None if document_ids is None else _gather_ids(document_ids, ulysses_group, size)
    o = context_parallel_gated_delta(*heads, group=ring_group, layout=layout, exchange=exchange, document_ids=ids,
                                     chunk_size=chunk_size, scale=scale, qk_l2norm=qk_l2norm, kernel=kernel)
    return _heads_to_sequence(o, ulysses_group)


def _head_rows(weight: torch.Tensor, sections, heads, rank: int, size: int) -> torch.Tensor:
    """The conv weight's rows [channels, 1, w] of this Ulysses rank's heads: of each section (q, k, v; ``heads``
    heads each) the slice [rank h/size, (rank + 1) h/size) of its heads."""
    parts = torch.split(weight, sections, dim=0)
    return torch.cat([p.unflatten(0, (h, -1)).chunk(size, dim=0)[rank].flatten(0, 1) for p, h in zip(parts, heads)])


def ulysses_conv_and_rule(q, k, v, g, beta, conv_weight, *, ulysses_group, ring_group, layout: str = "zigzag",
                          document_ids=None, conv_activation: Optional[str] = "silu", exchange: str = "all_gather",
                          chunk_size: int = 64, scale: Optional[float] = None, qk_l2norm: bool = False,
                          kernel: str = "auto") -> torch.Tensor:
    """A linear-attention layer's conv and rule under the Ulysses x ring grid, from the conv's *inputs*: the
    Ulysses all-to-all first (each rank: its ring shard for h/U heads), then the depthwise conv on those heads'
    channels with its halo over the ring (``conv_weight`` [channels, 1, w] over [q | k | v], this rank's rows
    taken), then the rule by state passing over the ring (the plain rule when the ring is one rank: pure Ulysses,
    megatron-core's head-parallel method), and the all-to-all back. q, k [b, s_local, h_k, K], v [b, s_local, h_v,
    V] before the conv, g, beta as the rule takes them, in cp_ext's hybrid layout; returns o [b, s_local, h_v, V].
    The conv is per channel, so running it after the all-to-all on whole heads is the same conv."""
    size, rank = group_size_rank(ulysses_group)
    ring, _ = group_size_rank(ring_group)
    check_head_parallel(k.shape[2], v.shape[2], size, what="the Ulysses level of the linear layers")
    kd, vd = q.shape[-1], v.shape[-1]
    q, k, v, g, beta = (_sequence_to_heads(x, ulysses_group) for x in (q, k, v, g, beta))
    ids = None if document_ids is None else _gather_ids(document_ids, ulysses_group, size)
    hk, hv = k.shape[2], v.shape[2]
    weight = _head_rows(conv_weight, [hk * size * kd, hk * size * kd, hv * size * vd], [hk * size] * 2 + [hv * size],
                        rank, size)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    if ring == 1:
        w = weight.shape[-1]
        padded_ids = None if ids is None else torch.nn.functional.pad(ids, (w - 1, 0), value=-1)
        qkv = causal_conv1d(torch.nn.functional.pad(qkv, (0, 0, w - 1, 0)), weight, None, document_ids=padded_ids,
                            activation=conv_activation)
    else:
        qkv = context_parallel_causal_conv1d(qkv, weight, None, group=ring_group, layout=layout, document_ids=ids,
                                             activation=conv_activation)
    q, k, v = torch.split(qkv, [hk * kd, hk * kd, hv * vd], dim=-1)
    q, k, v = q.unflatten(-1, (hk, kd)), k.unflatten(-1, (hk, kd)), v.unflatten(-1, (hv, vd))
    if ring == 1:
        o, _ = gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, document_ids=ids, scale=scale,
                                qk_l2norm=qk_l2norm, kernel=kernel)
    else:
        o = context_parallel_gated_delta(q, k, v, g, beta, group=ring_group, layout=layout, exchange=exchange,
                                         document_ids=ids, chunk_size=chunk_size, scale=scale, qk_l2norm=qk_l2norm,
                                         kernel=kernel)
    return _heads_to_sequence(o, ulysses_group)
