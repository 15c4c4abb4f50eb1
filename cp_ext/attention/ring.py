"""Ring attention with its own backward, zigzag load-balanced for causal masks.

Each rank of a ring group of size C holds a shard of q, k, v. KV blocks travel around the
ring (rank r sends to r+1, receives from r-1), so at step ``t`` rank ``r`` holds the KV of
ring rank ``src = (r - t) mod C``. The next block is already in flight while the current
one is computed. Partial outputs are merged with the LSE rule in fp32
(`cp_ext.attention.utils.update_out_and_lse`).

Zigzag layout (`cp_ext.data.zigzag_shard`): the sequence is cut into 2C chunks, ring rank
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

Packed documents (``document_ids``, `cp_ext.attention.documents`): the ids of every ring
rank are all-gathered once per call, so every rank knows every tile's segments. A step whose
q rows share no document with the arriving KV block computes nothing (the block still passes
on), tiles that do compute only their segments, and once no rank has work left the ring
stops: the remaining hops are not sent, and in the backward each dK/dV accumulator goes home
in one direct hop instead of the rest of the ring.

``ring_attn_forward`` / ``ring_attn_backward`` work on kernel-layout tensors
``[b, h, s, d]`` and any process group, so the Ulysses x ring hybrid calls them on the
ring sub-group after its all-to-all. ``ring_attention`` is the public [s, b, h, d] API.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.documents import all_document_runs, check_document_ids, clip_runs, segment_pairs, tile_segments
from cp_ext.attention.kernels import AttnKernel, get_kernel
from cp_ext.attention.utils import RingComm, accum_dtype, update_out_and_lse
from cp_ext.data.sharding import LAYOUTS, check_seq_len
from cp_ext.perf.counter import WORK_COUNTER

ALL, FIRST, SECOND = "all", "first", "second"


@dataclass(frozen=True)
class Step:
    """What one ring step computes: q rows ``q_part`` against KV rows ``kv_part`` of block ``src``."""

    src: int
    q_part: str
    kv_part: str
    causal: bool


def step_plan(rank: int, size: int, step: int, causal: bool, layout: str = "zigzag") -> Optional[Step]:
    """The work of ring rank ``rank`` at ``step`` (None: nothing to compute, only pass KV on)."""
    src = (rank - step) % size
    if not causal:
        return Step(src, ALL, ALL, False)
    if src == rank:
        return Step(src, ALL, ALL, True)  # diagonal
    if layout == "contiguous":
        return Step(src, ALL, ALL, False) if src < rank else None
    if src < rank:
        return Step(src, ALL, FIRST, False)
    return Step(src, SECOND, ALL, False)


def _rows(part: str, s: int) -> slice:
    return {ALL: slice(None), FIRST: slice(0, s // 2), SECOND: slice(s // 2, None)}[part]


class RingSchedule:
    """What this rank computes at each ring step, and how many steps the ring runs.

    Without documents: `step_plan` at every one of the C steps, dense tiles (``segments`` None).
    With ``document_ids`` (this rank's [b, s] ids): the segments of every (rank, step) tile
    are known on every rank (one all-gather of the ids), so this rank skips its empty tiles and
    every rank agrees on ``num_steps``: one past the last step at which any rank has work.
    """

    def __init__(self, rank, size, s, causal, layout, group=None, document_ids=None):
        self.steps, self.num_steps = [], size
        if document_ids is None:
            for step in range(size):
                plan = step_plan(rank, size, step, causal, layout)
                self.steps.append(None if plan is None else (plan, None))
            return
        runs = all_document_runs(document_ids, group)
        last = 0
        for r in range(size):
            for step in range(size):
                plan = step_plan(r, size, step, causal, layout)
                segments = None
                if plan is not None:
                    q_runs = clip_runs(runs[r], _rows(plan.q_part, s), s)
                    segments = tile_segments(q_runs, clip_runs(runs[plan.src], _rows(plan.kv_part, s), s))
                if segments:
                    last = max(last, step)
                if r == rank:
                    self.steps.append((plan, segments) if segments else None)
        self.num_steps = last + 1
        del self.steps[self.num_steps:]

    def tile(self, step):
        """(Step, segments or None for a dense tile), or None when this rank computes nothing."""
        return self.steps[step]


def _count(plan, segments, s):
    if WORK_COUNTER.enabled:  # opt-in (tools/bench_attention.py): tiles and query-key pairs computed
        rows = len(range(*_rows(plan.q_part, s).indices(s)))
        cols = len(range(*_rows(plan.kv_part, s).indices(s)))
        dense = rows * (rows + 1) // 2 if plan.causal else rows * cols
        WORK_COUNTER.add("tiles", 1)
        WORK_COUNTER.add("pairs", dense if segments is None else segment_pairs(segments, plan.causal))


def _check_local(q, k, v, size, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected 4-d q, k, v with k.shape == v.shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
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


def ring_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    group: Optional[dist.ProcessGroup],
    layout: str = "zigzag",
    kernel: Optional[AttnKernel] = None,
    document_ids: Optional[torch.Tensor] = None,
    schedule: Optional[RingSchedule] = None,
):
    """Forward over the ring on local shards q [b, h, s, d], k/v [b, hk, s, d].

    ``document_ids`` [b, s]: this rank's document ids (packed documents), or None.
    Returns (out [b, h, s, d] in q.dtype, lse [b, h, s] in fp32 / fp64 for fp64 inputs).
    """
    comm = RingComm(group)
    _check_local(q, k, v, comm.world_size, layout)
    kernel = kernel or get_kernel(q.device, q.dtype, head_dim=q.shape[-1])
    acc = accum_dtype(q.dtype)
    s = q.shape[2]
    if schedule is None:
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[0], s, q.device)
        schedule = RingSchedule(comm.rank, comm.world_size, s, causal, layout, group, document_ids)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v])  # one message per step; KV keeps its own (GQA) head count
    steps = schedule.num_steps
    for step in range(steps):
        if step + 1 < steps:
            next_kv = comm.send_recv(kv)  # in flight while we compute on `kv`
        tile = schedule.tile(step)
        if tile is not None:
            plan, segments = tile
            qs, ks = _rows(plan.q_part, s), _rows(plan.kv_part, s)
            _count(plan, segments, s)
            args = (q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks])
            if segments is None:
                block_out, block_lse = kernel.forward(*args, causal=plan.causal, scale=softmax_scale)
            else:
                block_out, block_lse = kernel.forward_segments(*args, segments, causal=plan.causal, scale=softmax_scale)
            update_out_and_lse(out, lse, block_out, block_lse, qs)
        if step + 1 < steps:
            comm.wait()
            kv = next_kv
    return out.to(q.dtype), lse


def ring_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    softmax_scale: float,
    causal: bool,
    group: Optional[dist.ProcessGroup],
    layout: str = "zigzag",
    kernel: Optional[AttnKernel] = None,
    document_ids: Optional[torch.Tensor] = None,
    schedule: Optional[RingSchedule] = None,
):
    """Backward over the ring; ``out``/``lse`` are what ``ring_attn_forward`` returned
    (``document_ids`` / ``schedule`` as there).

    Returns (dq, dk, dv) in the dtypes and shapes of (q, k, v).
    """
    kv_comm, dkv_comm = RingComm(group), RingComm(group)
    size, rank = kv_comm.world_size, kv_comm.rank
    kernel = kernel or get_kernel(q.device, q.dtype, head_dim=q.shape[-1])
    acc = accum_dtype(q.dtype)
    s = q.shape[2]
    if schedule is None:
        schedule = RingSchedule(rank, size, s, causal, layout, group, document_ids)
    steps = schedule.num_steps
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    dkv = next_dkv = None
    for step in range(steps):
        if step + 1 < steps:
            next_kv = kv_comm.send_recv(kv)
        tile = schedule.tile(step)
        if tile is not None:
            plan, segments = tile
            qs, ks = _rows(plan.q_part, s), _rows(plan.kv_part, s)
            args = (dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs], lse[:, :, qs])
            if segments is None:
                dq_s, dk_s, dv_s = kernel.backward(*args, causal=plan.causal, scale=softmax_scale)
            else:
                dq_s, dk_s, dv_s = kernel.backward_segments(*args, segments, causal=plan.causal, scale=softmax_scale)
            dq[:, :, qs].add_(dq_s)
        # dK/dV accumulator of block `src`: started here at step 0, received from rank-1 after.
        if step == 0:
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        else:
            dkv_comm.wait()
            dkv = next_dkv
        if tile is not None:
            dkv[0][:, :, ks].add_(dk_s)
            dkv[1][:, :, ks].add_(dv_s)
        if step + 1 < steps:
            next_dkv = dkv_comm.send_recv(dkv)  # to the rank that holds this block next step
            kv_comm.wait()
            kv = next_kv
    # Each accumulator goes home: after all C steps that is one more hop along the ring; a ring
    # that a document mask ended after `steps` steps sends it to its owner directly.
    if (1 - steps) % size:
        home = RingComm(group, shift=1 - steps)
        dkv = home.send_recv(dkv)
        home.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttnFunc(torch.autograd.Function):
    """Thin autograd wrapper: kernel-layout [b, h, s, d] tensors, any ring group.

    With ``document_ids`` the schedule (every tile's segments) is planned once in the forward
    and reused by the backward."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, group, layout, kernel_name, document_ids=None):
        kernel = get_kernel(q.device, q.dtype, kernel_name, head_dim=q.shape[-1])
        comm = RingComm(group)
        _check_local(q, k, v, comm.world_size, layout)
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[0], q.shape[2], q.device)
        schedule = RingSchedule(comm.rank, comm.world_size, q.shape[2], causal, layout, group, document_ids)
        out, lse = ring_attn_forward(
            q, k, v, softmax_scale=softmax_scale, causal=causal, group=group, layout=layout, kernel=kernel,
            schedule=schedule,
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = dict(softmax_scale=softmax_scale, causal=causal, group=group, layout=layout, kernel=kernel,
                        schedule=schedule)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attn_backward(dout, q, k, v, out, lse, **ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    group: Optional[dist.ProcessGroup] = None,
    layout: str = "zigzag",
    kernel: Optional[str] = None,
    document_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact attention over a sequence sharded across a process group.

    Args:
        q: local shard ``[s, b, h, d]`` (megatron layout); k, v: ``[s, b, hk, d]``, h % hk == 0.
        causal: causal mask over the *global* sequence, or full attention.
        softmax_scale: defaults to ``1 / sqrt(d)``.
        group: the ring; None means `cp_ext.parallel_state.get_ring_group()`. Any process
            group may be passed; shards are by rank within it.
        layout: ``"zigzag"`` (shards from `cp_ext.data.zigzag_shard`, the default) or
            ``"contiguous"`` (rank r holds the r-th slice).
        kernel: local kernel name (see `cp_ext.attention.kernels.KERNELS`); None picks one.
        document_ids: packed documents, integer ``[b, s]`` laid out like q (see
            `cp_ext.attention.documents`): a token attends only within its document. None:
            one document per sample.

    Returns the local output shard ``[s, b, h, d]`` in q's dtype; differentiable in q, k, v.
    """
    if group is None:
        from cp_ext import parallel_state

        group = parallel_state.get_ring_group()
    if q.dim() != 4:
        raise ValueError(f"ring_attention takes [s, b, h, d] tensors, got q of shape {tuple(q.shape)}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    to_kernel = lambda x: x.permute(1, 2, 0, 3)  # [s, b, h, d] -> [b, h, s, d] (a view)
    out = RingAttnFunc.apply(to_kernel(q), to_kernel(k), to_kernel(v), scale, causal, group, layout, kernel,
                             document_ids)
    return out.permute(2, 0, 1, 3)
