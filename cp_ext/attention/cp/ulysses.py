"""Ulysses (DeepSpeed-Ulysses) attention: sequence shards <-> head shards by all-to-all.

Each of the U ranks of a Ulysses group holds a consecutive piece of the sequence,
``[s, b, h, d]``. An all-to-all turns that into the *whole* group sequence for h/U heads,
``[U*s, b, h/U, d]``; attention is then local (the plain causal mask, since every rank holds
the whole sequence), and a second all-to-all turns the output back::

    U = 2, pieces P0 | P1, heads H0 | H1          seq -> heads            heads -> seq
    rank 0: P0 x (H0, H1)                    rank 0: (P0, P1) x H0     rank 0: P0 x (H0, H1)
    rank 1: P1 x (H0, H1)                    rank 1: (P0, P1) x H1     rank 1: P1 x (H0, H1)

The all-to-all is one function (`all_to_all`, differentiable: its backward is the inverse
all-to-all). The entry point (`cp_ext.attention.cp.context_parallel`) runs it around the core (a local
kernel call here, the ring in the Ulysses x ring hybrid), with ``ulysses_attention`` the case R = 1.
A sink (``softmax_offset``) is per head: after the exchange rank u applies the offsets of its
heads ``[u*h/U, (u+1)*h/U)`` and returns their gradient share.

Heads: rank u gets query heads ``[u*h/U, (u+1)*h/U)``. Query head j uses KV head
``j // (h/hk)``, so KV heads are split the same way: with hk % U == 0 rank u gets KV heads
``[u*hk/U, (u+1)*hk/U)``, exactly those of its query heads. With fewer KV heads than U
(GQA, hk < U) each KV head is first replicated ``rep = U / gcd(hk, U)`` times
(``repeat_interleave``, so replica i is KV head i // rep) and then split: every rank gets the
copies its query heads use, and the autograd of ``repeat_interleave`` sums dK/dV over the
replicas. Query heads not divisible by U are a ValueError.
"""

import math
from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.perf.counter import COMM_COUNTER


def _all_to_all_forward(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all-to-all over {size} ranks: dim {scatter_dim} of {tuple(x.shape)} does not split evenly")
    # [.., size * n, ..] -> [size, .., n, ..]: chunk i is what rank i receives (one contiguous copy).
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    if COMM_COUNTER.enabled:  # opt-in byte count: what leaves this rank, (U-1)/U of the buffer
        COMM_COUNTER.add("ulysses_a2a", send.nbytes * (size - 1) // size)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] came from rank i: concatenate along gather_dim in rank order.
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.args = (group, scatter_dim, gather_dim)
        return _all_to_all_forward(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim = ctx.args
        return _all_to_all_forward(grad, group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: Optional[dist.ProcessGroup], scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: split ``x`` along ``scatter_dim`` into one chunk per rank,
    send chunk i to rank i, concatenate what arrives along ``gather_dim`` in rank order.

    The backward is the inverse exchange (scatter and gather dims swapped). Identity on a
    group of size 1. Returns a new tensor (never a view of ``x``) on groups of size > 1.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def seq_to_heads(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``[s, b, h, d]`` sequence piece -> ``[U*s, b, h/U, d]``: the group's sequence, this rank's heads."""
    return all_to_all(x, group, scatter_dim=2, gather_dim=0)


def heads_to_seq(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Inverse of `seq_to_heads`: ``[U*s, b, h/U, d]`` -> ``[s, b, h, d]``."""
    return all_to_all(x, group, scatter_dim=0, gather_dim=2)


def kv_replicas(num_heads: int, num_kv_heads: int, size: int) -> int:
    """How often each KV head is replicated so the KV heads split over ``size`` ranks in step
    with the query heads (1 when ``num_kv_heads % size == 0``). Raises ValueError on bad head counts."""
    if num_heads % size:
        raise ValueError(
            f"Ulysses attention shards the {num_heads} query heads (per tensor-parallel rank) over "
            f"--ulysses-size {size} ranks, but {num_heads} is not divisible by {size}; choose a --ulysses-size "
            f"that divides {num_heads} ({[u for u in range(1, num_heads + 1) if num_heads % u == 0]})"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"GQA needs the query heads ({num_heads}) divisible by the KV heads ({num_kv_heads})")
    return size // math.gcd(num_kv_heads, size)
