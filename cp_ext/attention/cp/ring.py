"""Ring attention with its own backward, zigzag load-balanced for causal masks.

Each rank of a ring group of size C holds a shard of q, k, v. KV blocks travel around the
ring (rank r sends to r+1, receives from r-1), so at step ``t`` rank ``r`` holds the KV of
ring rank ``src = (r - t) mod C``. The next block is already in flight while the current
one is computed. Partial outputs are merged with the LSE rule in fp32
(`cp_ext.attention.cp.primitives.update_out_and_lse`).

Zigzag layout (`cp_ext.token_partition.zigzag_shard`): the sequence is cut into 2C chunks, ring rank
r holds chunks (r, 2C-1-r) as its [first half | second half]. What a step computes
follows from the chunk order alone::

    C = 4 (8 chunks), seen from rank r = 1, which holds q chunks (1, 6):

    step 0  src = 1, KV (1, 6)   diagonal: local causal on both halves
            q1 . .                      q1 attends k1 causally, k6 not at all
            q6 # .     ('#' full, '.' causal diagonal)
    src < r src = 0, KV (0, 7)   0 < 1 < 6 < 7: k0 is before both q chunks, k7 after both
                                 -> all q x FIRST half of KV, no mask           (half a tile)
    src > r src = 2, KV (2, 5)   1 < 2 < 5 < 6: q1 is before both KV chunks, q6 after both
                                 -> SECOND half of q x all KV, no mask          (half a tile)

So every step after the first computes exactly half a tile, on every rank. For the
"second half of q" steps only the rows [s/2:] of (out, lse) are merged; the rows [:s/2]
keep their values, which is the LSE merge with lse_B = -inf for them. In the backward the
same half-tiles feed dq[s/2:] (src > r) or dk/dv[:s/2] (src < r).

Contiguous layout (``layout="contiguous"``): rank r holds slice r of C. Causal steps with
src > r are skipped (all keys are in the future; KV still passes through), src == r is
the diagonal, src < r is a full tile: the imbalance that zigzag removes. Non-causal
attention computes full tiles on every step in either layout.

Backward (``ring_attn_backward``): KV goes around the ring again, and with it an fp32
dK/dV accumulator: at step t rank r adds its contribution for block src to the
accumulator it just received, then passes it on, so after C hops every block's dK/dV
returns to its owner. dQ accumulates locally in fp32. Each step calls the local kernel's
backward with the *global* out and LSE saved by the forward. All accumulators are fresh
fp32 tensors (never ``x.to(float32)`` of a kernel output, which aliases under fp32); the
cast to the input dtype happens once, at the end.

Packed documents (``document_ids``, `cp_ext.attention.masks.documents`): the ids of every ring
rank are all-gathered once per call, so every rank knows every tile's segments (`RingSchedule`).
A step whose q rows share no document with the arriving KV block computes nothing, tiles that
do compute only their segments, and a KV block travels only as far as its last reader: the
ranks before it pass it on, the hops after it are not sent (nor received), and the ring stops
once no block travels further. In the backward each dK/dV accumulator rides with its block
and goes home from its last reader in one direct message, instead of the rest of the ring.

``ring_attn_forward`` / ``ring_attn_backward`` work on kernel-layout tensors
``[b, h, s, d]`` and any process group, so the Ulysses x ring hybrid calls them on the
ring sub-group after its all-to-all. The public [s, b, h, d] ``ring_attention`` and the autograd
Function live in the entry point (`cp_ext.attention.cp.context_parallel`). A window plans its tiles like
documents do (`cp_ext.attention.masks.tiles`); a sink is added by ``ring_attn_forward``'s finish step;
what travels is a message (`cp_ext.attention.cp.kv_message`): k and v (side by side when their head
dims differ), or MLA's latent, up-projected on each rank that computes with the block.
"""

import functools
from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.masks.documents import all_document_runs, check_document_ids
from cp_ext.attention.kernels import AttnKernel, get_kernel
from cp_ext.attention.cp.kv_message import PairedKV
from cp_ext.attention.masks.tiles import make_window, plan_tile, position_runs, tile_span
from cp_ext.attention.cp.primitives import RingComm, accum_dtype, add_sink, post_p2p, update_out_and_lse
from cp_ext.token_partition import check_layout, check_seq_len, context_parallel_positions
from cp_ext.perf.counter import WORK_COUNTER

class RingSchedule:
    """What this rank computes at each ring step, and which KV blocks travel how far.

    Every (rank, step) tile is planned from the mask (`cp_ext.attention.masks.tiles.plan_tile`: the
    ring ranks' positions, the window, and with ``document_ids`` every rank's documents, from one
    all-gather of the ids), so each rank knows every tile: it skips its empty ones, and a block
    travels only as far as a rank still reads it: ``reach[src]`` is the last step at which some
    rank computes with block ``src`` (rank ``src + reach`` at step ``reach``), the ranks in between
    pass it on, and the ring runs ``num_steps = max(reach) + 1`` steps on every rank. A window
    shortens the reach as documents do. Without either, every block goes all the way round and
    each tile is one rectangle: the causal diagonal, or the half tile of the module docstring.
    """

    def __init__(self, rank, size, s, causal, layout, group=None, document_ids=None, window_size=None):
        self.rank, self.size = rank, size
        window = make_window(window_size, causal)
        runs = [position_runs(ring_positions(s, r, size, layout)) for r in range(size)]
        docs = all_document_runs(document_ids, group) if document_ids is not None else None
        planned = range(size) if docs is not None or window_size is not None else [rank]
        self.reach = [size - 1] * size if len(planned) == 1 else [0] * size
        self.steps = []
        for r in planned:
            for step in range(size):
                src = (r - step) % size
                blocks = plan_tile(runs[r], runs[src], window, same_tokens=src == r,
                                   q_docs=None if docs is None else docs[r], k_docs=None if docs is None else docs[src])
                if blocks and len(planned) > 1:
                    self.reach[src] = max(self.reach[src], step)
                if r == rank:
                    self.steps.append(_tile(blocks))
        self.num_steps = max(self.reach) + 1
        del self.steps[self.num_steps:]

    def tile(self, step):
        """(q rows, k rows, blocks shifted to them), or None when this rank computes nothing."""
        return self.steps[step]

    def holds(self, step, rank=None):
        """Whether ``rank`` (this one by default) holds a KV block at ``step`` (step 0: its own)."""
        rank = self.rank if rank is None else rank
        return 0 <= step < self.num_steps and step <= self.reach[(rank - step) % self.size]

    def passes_on(self, step):
        """Whether this rank sends the block it holds at ``step`` to the next rank."""
        return self.holds(step + 1, (self.rank + 1) % self.size)


def _tile(blocks):
    if not blocks:
        return None
    rows, cols = tile_span(blocks)
    return rows, cols, [b.shift(rows.start, cols.start) for b in blocks]


@functools.lru_cache(maxsize=256)
def ring_positions(s: int, rank: int, size: int, layout: str):
    """Global positions (in the ring's sequence) of ring rank ``rank``'s ``s`` local rows."""
    return tuple(context_parallel_positions(s * size, ring_rank=rank, ring_size=size, layout=layout).tolist())


def _count(blocks):
    if WORK_COUNTER.enabled:  # opt-in (tools/bench_attention.py): tiles and query-key pairs computed
        WORK_COUNTER.add("tiles", 1)
        WORK_COUNTER.add("pairs", sum(b.pairs() for b in blocks))


def _check_local(q, k, v, size, layout):
    check_layout(layout)
    if v is None:  # k is MLA's latent message [b, 1, s, r + p] (`cp_ext.attention.cp.kv_message.LatentKV`)
        if k.dim() != 4 or k.shape[1] != 1 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
            raise ValueError(f"expected the latent [b, 1, s, r + p] beside q {tuple(q.shape)}, got {tuple(k.shape)}")
        return
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"expected 4-d q, k, v with k and v of one [b, hk, s], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    s = q.shape[2]
    if k.shape[2] != s or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, sequence or head_dim")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"GQA needs q heads ({q.shape[1]}) divisible by kv heads ({k.shape[1]})")
    if layout == "zigzag" and s % 2 != 0:
        try:
            check_seq_len(s * size, size, layout)
        except ValueError as e:
            raise ValueError(f"local zigzag shard of length {s} is not two equal chunks: {e}") from None


def ring_attn_forward(q, k, v, *, softmax_scale: float, causal: bool, group: Optional[dist.ProcessGroup],
                      layout: str = "zigzag", kernel: Optional[AttnKernel] = None,
                      document_ids: Optional[torch.Tensor] = None, schedule: Optional[RingSchedule] = None,
                      window_size=None, softmax_offset: Optional[torch.Tensor] = None, message=None):
    """Forward over the ring on local shards q [b, h, s, d], k [b, hk, s, d], v [b, hk, s, d_v].

    ``document_ids`` [b, s]: this rank's document ids (packed documents), or None; ``window_size``
    (left, right) as in `cp_ext.attention.masks.tiles`; ``softmax_offset`` [h]: the sink logits of these
    heads, added in the finish step (`cp_ext.attention.cp.primitives.add_sink`); ``message``: what travels
    (`cp_ext.attention.cp.kv_message`; default the K/V pair; with `LatentKV`, k is MLA's latent and v None).
    Returns (out [b, h, s, d_v] in q.dtype, lse [b, h, s] in fp32 / fp64 for fp64 inputs), finished.
    """
    comm = RingComm(group)
    _check_local(q, k, v, comm.world_size, layout)
    message = message or PairedKV(q.shape[-1], v.shape[-1])
    kernel = kernel or get_kernel(q.device, q.dtype, head_dim=q.shape[-1], v_head_dim=message.d_v,
                                  window=window_size is not None)
    acc = accum_dtype(q.dtype)
    s = q.shape[2]
    if schedule is None:
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[0], s, q.device)
        schedule = RingSchedule(comm.rank, comm.world_size, s, causal, layout, group, document_ids, window_size)
    out = torch.zeros(q.shape[:3] + (message.d_v,), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = message.pack(k, v)  # one message per step; KV keeps its own (GQA) head count
    shape = kv.shape  # of every block: a receive buffer while this rank holds none
    for step in range(schedule.num_steps):
        send, recv = schedule.passes_on(step), schedule.holds(step + 1)
        if send or recv:  # the next block is in flight while we compute on `kv`
            next_kv = comm.send_recv(kv, None if kv is not None else k.new_empty(shape), send=send, recv=recv)
        tile = schedule.tile(step)
        if tile is not None:
            rows, cols, blocks = tile
            _count(blocks)
            kb, vb = message.unpack(kv, cols)
            block_out, block_lse = kernel.forward_blocks(q[:, :, rows], kb, vb, blocks, scale=softmax_scale)
            update_out_and_lse(out, lse, block_out, block_lse, rows)
        if send or recv:
            comm.wait()
            kv = next_kv if recv else None
    out, lse = add_sink(out, lse, softmax_offset)
    return out.to(q.dtype), lse


def ring_attn_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool,
                       group: Optional[dist.ProcessGroup], layout: str = "zigzag", kernel: Optional[AttnKernel] = None,
                       document_ids: Optional[torch.Tensor] = None, schedule: Optional[RingSchedule] = None,
                       window_size=None, message=None, **_):
    """Backward over the ring; ``out``/``lse`` are what ``ring_attn_forward`` returned (finished:
    a sink needs nothing more here; its own gradient is `cp_ext.attention.cp.primitives.sink_grad`).

    Returns (dq, dk, dv) in the dtypes and shapes of (q, k, v); with a `LatentKV` ``message``
    (dq, d latent, None), and the message holds this rank's share of the up-projection's gradient.
    """
    kv_comm, dkv_comm = RingComm(group), RingComm(group)
    size, rank = kv_comm.world_size, kv_comm.rank
    message = message or PairedKV(q.shape[-1], v.shape[-1])
    kernel = kernel or get_kernel(q.device, q.dtype, head_dim=q.shape[-1], v_head_dim=message.d_v,
                                  window=window_size is not None)
    acc = accum_dtype(q.dtype)
    s = q.shape[2]
    if schedule is None:
        schedule = RingSchedule(rank, size, s, causal, layout, group, document_ids, window_size)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = message.pack(k, v)
    shape = kv.shape  # of every block and accumulator
    block = lambda dtype: torch.empty(shape, dtype=dtype, device=q.device)  # a receive buffer
    dkv = next_dkv = own = None
    ended = []  # (accumulator, owner) of blocks whose last reader is this rank: they go home at the end
    for step in range(schedule.num_steps):
        src = (rank - step) % size
        send, recv = schedule.passes_on(step), schedule.holds(step + 1)
        if send or recv:
            next_kv = kv_comm.send_recv(kv, None if kv is not None else block(k.dtype), send=send, recv=recv)
        tile = schedule.tile(step)
        if tile is not None:
            rows, cols, blocks = tile
            kb, vb = message.unpack(kv, cols)
            dq_s, dk_s, dv_s = kernel.backward_blocks(dout[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows],
                                                      lse[:, :, rows], blocks, scale=softmax_scale)
            dq[:, :, rows].add_(dq_s)
        # dK/dV accumulator of block `src`: started here at step 0, received from rank-1 after.
        if step == 0:
            dkv = torch.zeros(shape, dtype=acc, device=q.device)
        else:
            dkv_comm.wait()
            dkv = next_dkv
        if tile is not None:
            message.add_grad(dkv, cols, dk_s, dv_s, kv)
        if dkv is not None and not send:  # no rank after this one reads block `src`
            if step == 0:
                own = dkv  # nobody else reads this rank's own block: its dK/dV is complete
            else:
                ended.append((dkv, src))
        if send or recv:  # to the rank that holds this block next step; the next one in
            next_dkv = dkv_comm.send_recv(dkv, None if dkv is not None else block(acc), send=send, recv=recv)
            kv_comm.wait()
            kv = next_kv if recv else None
        else:
            next_dkv = None
    # Each accumulator goes home from its last reader, `reach` ranks after its owner. Around the
    # whole ring that is one hop on (the last reader is the owner's predecessor): one exchange.
    back_from = schedule.reach[rank]
    if len(ended) == 1 and back_from > 0 and (ended[0][1] - rank) % size == (-back_from) % size:
        home = RingComm(group, shift=-back_from)
        own = home.send_recv(ended[0][0])
        home.wait()
    elif ended or back_from > 0:
        received = _send_home(group, ended, back_from, block(acc) if back_from > 0 else None)
        if back_from > 0:
            own = received
    return (dq.to(q.dtype),) + message.grads(own, k, v)


def _send_home(group, ended, back_from, buf):
    """Post every ended accumulator to its owner and (``back_from`` > 0) receive this rank's own
    into ``buf`` from ``back_from`` ranks ahead, in one batch (NCCL: one group, so no pair waits
    on another). Returns ``buf``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    ops = [(dist.isend, t.contiguous(), ranks[owner]) for t, owner in ended]
    if back_from > 0:
        ops.append((dist.irecv, buf, ranks[(rank + back_from) % size]))
    for req in post_p2p(ops, group):
        req.wait()
    return buf
