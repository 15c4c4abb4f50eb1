"""Ulysses (DeepSpeed-Ulysses) attention: sequence shards <-> head shards by all-to-all.

Each of the U ranks of a Ulysses group holds a consecutive piece of the sequence,
``[s, b, h, d]``. An all-to-all turns that into the *whole* group sequence for h/U heads,
``[U*s, b, h/U, d]``; attention is then local (the plain causal mask, since every rank holds
the whole sequence), and a second all-to-all turns the output back::

    U = 2, pieces P0 | P1, heads H0 | H1          seq -> heads            heads -> seq
    rank 0: P0 x (H0, H1)                    rank 0: (P0, P1) x H0     rank 0: P0 x (H0, H1)
    rank 1: P1 x (H0, H1)                    rank 1: (P0, P1) x H1     rank 1: P1 x (H0, H1)

The all-to-all is one differentiable function (`all_to_all`): its backward is the inverse
all-to-all, so autograd goes through the exchange; the attention in between is any
differentiable function of kernel-layout tensors (a local kernel here, the ring of
`cp_ext.attention.ring` in the Ulysses x ring hybrid, `cp_ext.attention.hybrid`).

Heads: rank u gets query heads ``[u*h/U, (u+1)*h/U)``. Query head j uses KV head
``j // (h/hk)``, so KV heads are split the same way: with hk % U == 0 rank u gets KV heads
``[u*hk/U, (u+1)*hk/U)``, exactly those of its query heads. With fewer KV heads than U
(GQA, hk < U) each KV head is first replicated ``rep = U / gcd(hk, U)`` times
(``repeat_interleave``, so replica i is KV head i // rep) and then split: every rank gets the
copies its query heads use, and the autograd of ``repeat_interleave`` sums dK/dV over the
replicas. Query heads not divisible by U are a ValueError.
"""

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from cp_ext.attention.documents import check_document_ids, diagonal_segments, document_runs, gather_document_ids
from cp_ext.attention.kernels import get_kernel
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


def ulysses_exchange(q, k, v, *, group: Optional[dist.ProcessGroup], attn: Callable) -> torch.Tensor:
    """Run ``attn`` between the two all-to-alls of the Ulysses group.

    q ``[s, b, h, d]``, k/v ``[s, b, hk, d]`` are this rank's sequence piece; ``attn(q, k, v)``
    gets the group's whole sequence for this rank's heads in kernel layout ``[b, h', U*s, d]``
    (views) and returns ``[b, h', U*s, d]``. Returns this rank's output piece ``[s, b, h, d]``.
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected [s, b, h, d] q, k, v with k.shape == v.shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    size = dist.get_world_size(group)
    rep = kv_replicas(q.shape[2], k.shape[2], size)
    if rep > 1:  # KV heads < U: every rank gets the copies its query heads use; grads sum back
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    to_kernel = lambda x: seq_to_heads(x, group).permute(1, 2, 0, 3)  # -> [b, h/U, U*s, d]
    out = attn(to_kernel(q), to_kernel(k), to_kernel(v))
    return heads_to_seq(out.permute(2, 0, 1, 3), group)


class LocalAttnFunc(torch.autograd.Function):
    """One local kernel call (`cp_ext.attention.kernels`) on kernel-layout ``[b, h, s, d]`` tensors.

    ``document_ids`` [b, s] (packed documents): one square segment per document
    (`cp_ext.attention.documents.diagonal_segments`), q and k being the same tokens."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, kernel_name, document_ids=None):
        kernel = get_kernel(q.device, q.dtype, kernel_name, head_dim=q.shape[-1])
        ctx.segments = None
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[0], q.shape[2], q.device)
            ctx.segments = diagonal_segments(document_runs(document_ids))
            out, lse = kernel.forward_segments(q, k, v, ctx.segments, causal=causal, scale=softmax_scale)
        else:
            out, lse = kernel.forward(q, k, v, causal=causal, scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = dict(causal=causal, scale=softmax_scale)
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.segments is not None:
            dq, dk, dv = ctx.kernel.backward_segments(dout, q, k, v, out, lse, ctx.segments, **ctx.args)
        else:
            dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, **ctx.args)
        # dk/dv may come back in fp32 (GQA sums); cast to the input dtypes.
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    kernel: Optional[str] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across a Ulysses group, by head all-to-all.

    Args:
        q: local piece ``[s, b, h, d]`` (megatron layout), h divisible by the group size U;
            k, v: ``[s, b, hk, d]`` with h % hk == 0 (hk < U: KV heads are replicated).
            Ulysses rank u holds tokens ``[u*s, (u+1)*s)`` of the group's sequence.
        causal: causal mask over the group's whole sequence, or full attention.
        softmax_scale: defaults to ``1 / sqrt(d)``.
        group: the Ulysses group; None means `cp_ext.parallel_state.get_ulysses_group()`.
        kernel: local kernel name (see `cp_ext.attention.kernels.KERNELS`); None picks one.
        document_ids: packed documents, integer ``[b, s]`` laid out like q
            (`cp_ext.attention.documents`); all-gathered over the group with the heads' exchange.

    Returns the local output piece ``[s, b, h, d]`` in q's dtype; differentiable in q, k, v.
    """
    if group is None:
        from cp_ext import parallel_state

        group = parallel_state.get_ulysses_group()
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if document_ids is not None:
        check_document_ids(document_ids, q.shape[1], q.shape[0], q.device)
        document_ids = gather_document_ids(document_ids, group)
    attn = lambda q_, k_, v_: LocalAttnFunc.apply(q_, k_, v_, scale, causal, kernel, document_ids)
    return ulysses_exchange(q, k, v, group=group, attn=attn)
