"""Which segments of the sequence a CP rank holds, and the differentiable all-gather the CP ops share.

A segment is a run of consecutive global positions that one rank holds, read from the CP layout contract
(`cp_ext.token_partition.context_parallel_positions`): zigzag cuts the sequence into 2C equal chunks and
rank r holds chunks r and 2C-1-r (two segments, even where they happen to be adjacent, so every rank sends
the same shapes); contiguous gives rank r the r-th of C blocks (one segment). A recurrence crosses segment
boundaries in global order, so the CP ops exchange one small tensor per segment (`gather_in_sequence_order`)
and every rank reads them in sequence order. Only the ring layouts: Ulysses hands the ring its shard first
(`head_parallel`), and dynamic CP's per-document zigzag runs one unit at a time, each a zigzag of its own
(`cp_ext.transformer.linear_mixer`).
"""

import collections
import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.distributed as dist

from cp_ext.token_partition import context_parallel_positions

SEGMENTS_PER_RANK = {"zigzag": 2, "contiguous": 1}

# torch 2.13 renames the tensor collectives (*_into_tensor / *_tensor are deprecated there). Looked up at
# each call, not bound at import: a recorder that wraps torch.distributed (cp_ext.perf.sent_bytes) sees them.
def _all_gather_single(out, x, group):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out, x, group):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)


def group_size_rank(group) -> Tuple[int, int]:
    """(size, rank) of ``group``; (1, 0) without torch.distributed, so the CP ops also run on one device."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass(frozen=True)
class RankSegments:
    """This rank's segments: their global indices (local order), their common length, and where each
    global segment sits in the all-gathered [size x per-rank] stack (``order[global index]``)."""

    ids: Tuple[int, ...]
    length: int
    order: Tuple[int, ...]

    @property
    def count(self) -> int:
        """Segments in the whole sequence (2C zigzag, C contiguous)."""
        return len(self.order)

    def slices(self) -> List[slice]:
        """Each local segment's tokens in this rank's shard, in local order."""
        return [slice(i * self.length, (i + 1) * self.length) for i in range(len(self.ids))]


def _segment_ids(local_len: int, layout, rank: int, size: int) -> Tuple[int, ...]:
    if not isinstance(layout, str) or layout not in SEGMENTS_PER_RANK:
        raise ValueError(f"linear attention under CP supports the layouts {tuple(SEGMENTS_PER_RANK)}, not {layout!r} "
                         f"(a per-document zigzag gives every rank different segments)")
    per = SEGMENTS_PER_RANK[layout]
    if local_len == 0 or local_len % per:
        raise ValueError(f"a {layout} shard holds {per} equal segment(s): its {local_len} tokens must be a positive "
                         f"multiple of {per}")
    length = local_len // per
    positions = context_parallel_positions(local_len * size, ring_rank=rank, ring_size=size, layout=layout)
    positions = positions.view(per, length)
    ids = positions[:, 0] // length
    # The contract this module relies on: each segment is an aligned run of consecutive positions.
    assert torch.equal(positions, ids[:, None] * length + torch.arange(length)), positions
    return tuple(ids.tolist())


@functools.lru_cache(maxsize=256)  # every CP op of every layer asks again; the answer depends on these only
def rank_segments(local_len: int, layout, rank: int, size: int) -> RankSegments:
    """`RankSegments` of rank ``rank`` of ``size`` holding ``local_len`` tokens under ``layout``."""
    per = SEGMENTS_PER_RANK.get(layout, 1)
    order = [0] * (per * size)
    for r in range(size):
        for slot, gid in enumerate(_segment_ids(local_len, layout, r, size)):
            order[gid] = r * per + slot
    return RankSegments(_segment_ids(local_len, layout, rank, size), local_len // per, tuple(order))


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 (rank after rank); the backward reduce-scatters (sums) every rank's gradient
    of the gathered tensor back to the owner of each slice: every rank reads every slice (its own fold,
    its own halos), so a slice's gradient is the sum of all the ranks' uses.

    megatron's ``gather_from_sequence_parallel_region`` does the same but allocates its output on
    ``torch.cuda.current_device()``, which a CPU run outside the model (no platform shims) does not have."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group = group
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group),) + tuple(grad.shape[1:]))
        _reduce_scatter_single(mine, grad.contiguous(), group=ctx.group)
        return mine, None, None


class _ZerosReading(torch.autograd.Function):
    """Zeros that autograd sees as read from ``gathered`` (their gradient to it: zeros). The gather's backward
    is a collective, so every rank's backward must reach it, also on a rank whose results happen not to
    read it: the first segment starts from a zero state and a zero halo (contiguous rank 0)."""

    @staticmethod
    def forward(ctx, gathered, shape):
        ctx.gathered_shape = gathered.shape
        return gathered.new_zeros(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(ctx.gathered_shape), None


def zeros_reading(gathered: torch.Tensor, shape) -> torch.Tensor:
    """Zeros of ``shape`` (the sequence start's state or halo) that keep ``gathered`` in the backward graph."""
    return _ZerosReading.apply(gathered, tuple(shape)) if gathered.requires_grad else gathered.new_zeros(shape)


class _ReplayGather(torch.autograd.Function):
    """What an all-gather gave in the first forward of a checkpointed layer, without gathering again; its
    backward is the gather's (`_AllGather`): every rank's gradient summed back to the owner of each slice."""

    @staticmethod
    def forward(ctx, x, kept, group):
        ctx.group = group
        return kept.clone()

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.backward(ctx, grad)[0], None, None


_EXCHANGES = contextvars.ContextVar("linear_attention_exchanges", default=None)


class KeptExchanges:
    """The gathers (summaries, halos, document ids) of one layer's forwards, kept for its recompute under
    CP-aware full recompute (`cp_ext.transformer.recompute`'s counterpart for linear layers): the first forward
    of a checkpointed layer records every gather's result, the recompute replays them in the same order, so
    it sends nothing; its backward still returns each gradient to its owner. One entry per forward, oldest
    first: megatron recomputes the microbatches in the order of their forwards."""

    def __init__(self):
        self._kept = collections.deque()
        self.replayed = 0  # recomputes served from kept gathers (tests read it)

    @contextlib.contextmanager
    def record(self):
        gathers = []
        token = _EXCHANGES.set(("record", gathers))
        try:
            yield
        finally:
            _EXCHANGES.reset(token)
        self._kept.append(gathers)

    @contextlib.contextmanager
    def replay(self):
        if not self._kept:
            raise RuntimeError("CP-aware recompute: a linear layer is recomputed whose first forward kept no "
                               "exchanges (recompute out of order); run with --no-cp-aware-recompute and report this")
        token = _EXCHANGES.set(("replay", iter(self._kept.popleft())))
        try:
            yield
        finally:
            _EXCHANGES.reset(token)
        self.replayed += 1


def gather_in_sequence_order(x: torch.Tensor, group, segments: RankSegments) -> torch.Tensor:
    """Every rank's ``x`` ([per-rank segments, ...], one row per local segment, local order) as
    [all segments, ...] in global sequence order; differentiable (gradients return to their owners). Inside
    `KeptExchanges.record` the result is kept; inside `KeptExchanges.replay` the kept one is used instead."""
    size, _ = group_size_rank(group)
    mode = _EXCHANGES.get()
    if size == 1:
        gathered = x
    elif mode is None:
        gathered = _AllGather.apply(x, group, size)
    elif mode[0] == "record":
        gathered = _AllGather.apply(x, group, size)
        mode[1].append(gathered.detach())
    else:
        kept = next(mode[1])
        gathered = _ReplayGather.apply(x, kept, group) if x.requires_grad else kept
    return gathered.index_select(0, torch.tensor(segments.order, device=x.device))
