"""Shared pieces of the ring algorithms: the ring P2P exchange and the log-sum-exp merge.

Written once here and used by every variant (the ring, and the ring inside the Ulysses x ring hybrid).
All attention tensors in this package use the *kernel layout* ``[b, h, s, d]``; the
log-sum-exp (LSE) is ``[b, h, s]`` in fp32 (fp64 for fp64 inputs).
"""

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.perf.counter import COMM_COUNTER


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged / accumulated in: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_COMPUTE_ONLY = [False]  # set only by `communication_removed`


@contextlib.contextmanager
def communication_removed():
    """Inside: every `RingComm` exchange is a no-op whose "received" block is the one this rank holds
    (same shape), so the ring runs its own code (step plan, tiles, merges, accumulators) without
    communicating: the compute-only time of the same tiles (``tools/bench_attention.py``). Results
    are wrong by design; only benchmarks enter it."""
    _COMPUTE_ONLY[0] = True
    try:
        yield
    finally:
        _COMPUTE_ONLY[0] = False


class RingComm:
    """Send a tensor to the next rank of a ring group and receive one from the previous rank.

    ``send_recv`` posts the exchange and returns the (not yet filled) receive buffer at once,
    so the caller computes on the current block while the next one is in flight; ``wait``
    blocks until every exchange posted since the last ``wait`` has finished. With NCCL the
    pair is posted as one ``batch_isend_irecv`` group (two separate isend/irecv on a ring of
    2 could deadlock); with gloo, plain ``isend``/``irecv``.

    ``group`` may be any process group (the ring group of `cp_ext.parallel_state` by
    default); prev/next are the *global* ranks of the neighbours inside it.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], shift: int = 1):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        # ``shift`` other than 1: send to rank + shift, receive from rank - shift (the ring's
        # last dK/dV hop when a document mask ends the ring early).
        self.send_rank = ranks[(self.rank + shift) % self.world_size]
        self.recv_rank = ranks[(self.rank - shift) % self.world_size]
        self._reqs = []

    def send_recv(self, to_send: torch.Tensor, recv_buf: Optional[torch.Tensor] = None, *,
                  send: bool = True, recv: bool = True) -> Optional[torch.Tensor]:
        """Post: send ``to_send`` to the next rank, receive the previous rank's into a buffer.

        ``send=False`` / ``recv=False`` post one direction only (a document mask leaves some
        hops without a reader); without ``send``, ``to_send`` (or ``recv_buf``) only gives the
        received block's shape.
        Returns the receive buffer, or None without ``recv``.
        """
        if _COMPUTE_ONLY[0]:
            return (to_send if to_send is not None else recv_buf) if recv else None
        to_send = to_send.contiguous() if send else to_send
        buf = (torch.empty_like(to_send) if recv_buf is None else recv_buf) if recv else None
        ops = ([(dist.isend, to_send, self.send_rank)] if send else []) + ([(dist.irecv, buf, self.recv_rank)] if recv else [])
        self._reqs.extend(post_p2p(ops, self.group))
        return buf

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []


def post_p2p(ops, group: Optional[dist.ProcessGroup]) -> list:
    """Post ``ops`` ([(dist.isend or dist.irecv, tensor, global peer rank)]) as one batch and
    return their requests. With NCCL the batch is one ``batch_isend_irecv`` group, so no
    rank's send waits behind another pair's; with gloo, plain isend/irecv. Sends count as
    ``"ring_p2p"`` bytes (`cp_ext.perf.counter`, opt-in)."""
    if COMM_COUNTER.enabled:
        for op, t, _ in ops:
            if op is dist.isend:
                COMM_COUNTER.add("ring_p2p", t.nbytes)
    if not ops:
        return []
    if dist.get_backend(group) != "gloo":
        return dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for op, t, peer in ops])
    return [op(t, peer, group=group) for op, t, peer in ops]


def update_out_and_lse(
    out: torch.Tensor,
    lse: torch.Tensor,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    seq_slice: slice = slice(None),
) -> None:
    """Merge one partial attention result into the running one, in place, in ``out``'s dtype.

    ``out`` [b, h, s, d] / ``lse`` [b, h, s] are the running (normalised) output and LSE over
    the keys seen so far (set A); ``block_out`` / ``block_lse`` are the kernel's result over a
    new, disjoint key set B for the query rows ``seq_slice`` (all rows by default; the zigzag
    ring updates only the second half of the rows on some steps). Over A u B:

        lse_new = log(exp(lse_A) + exp(lse_B))            (torch.logaddexp)
        out_new = (exp(lse_A) out_A + exp(lse_B) out_B) / exp(lse_new)
                = out_A + sigmoid(lse_B - lse_A) * (out_B - out_A)

    Rows outside ``seq_slice`` keep (out_A, lse_A): B contributed nothing to them, which is
    exactly the merge with lse_B = -inf. The sigmoid/softplus form never exponentiates a
    large number (and lse_B = -inf gives weight 0). ``block_out`` may be bf16/fp16; it is upcast before use.
    A row with no keys in A nor B (lse -inf in both, possible under a document mask with
    padding) would get weight NaN: it gets 0, so the row stays out 0, lse -inf.
    """
    o = out[:, :, seq_slice]
    l = lse[:, :, seq_slice]
    b_lse = block_lse.to(lse.dtype)
    weight = torch.sigmoid(b_lse - l).nan_to_num_(0.0)
    o.add_(weight.unsqueeze(-1) * (block_out.to(out.dtype) - o))
    l.copy_(torch.logaddexp(l, b_lse))


def add_sink(out: torch.Tensor, lse: torch.Tensor, softmax_offset: Optional[torch.Tensor]):
    """The finish step, where an attention sink enters: ``softmax_offset`` [h] (one logit per head of
    ``out`` [b, h, s, d], ``lse`` [b, h, s]) joins every row's softmax denominator and no value:

        lse' = logaddexp(lse, offset_h)      out' = out * exp(lse - lse') = out * sigmoid(lse - offset_h)

    A row that saw no key (lse -inf) gets out 0 and lse' = offset_h, never NaN. Returns (out', lse')
    (new tensors, out' in out's dtype); None changes nothing. The backward needs nothing else: with
    the finished out' and lse' every kernel's P = exp(s - lse') and D = rowsum(dout * out') are the
    sink-softmax's own, and `sink_grad` gives the offset's gradient."""
    if softmax_offset is None:
        return out, lse
    off = softmax_offset.to(lse.dtype).view(1, -1, 1)
    weight = torch.sigmoid(lse - off)
    return (out * weight.unsqueeze(-1).to(out.dtype)), torch.logaddexp(lse, off)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, softmax_offset: torch.Tensor) -> torch.Tensor:
    """d loss / d offset_h = -sum over rows of p_sink * D, with p_sink = exp(offset_h - lse') and
    D = rowsum(dout * out') (the sink's value is 0, so its dP is 0): this rank's share, [h]."""
    acc = lse.dtype
    d = (dout.to(acc) * out.to(acc)).sum(-1)
    p_sink = torch.exp(softmax_offset.to(acc).view(1, -1, 1) - lse)
    return -(p_sink * d).sum((0, 2))
