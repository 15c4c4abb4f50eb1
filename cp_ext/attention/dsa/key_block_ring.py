"""How DSA's passes see the whole sequence's keys from one CP rank: blocks with global positions, on the
ring or all-gathered, and the per-query key sets inside them.

DSA's sparse attention (`cp_ext.attention.dsa.sparse_attention`) and its indexer loss (`cp_ext.attention.dsa.indexer_loss`) both
walk every key of the sequence for this rank's queries, one block at a time, and both need each key's
global position: the selection names keys by position, and causality compares positions. A `KeyRingSchedule`
holds what they share (group, layout, this rank's positions, the query tiles); `key_blocks` yields the
blocks (``ring``: CP steps, the next block in flight while this one is used; ``all_gather``: the gathered
sequence as one block), and `key_blocks_with_grads` does the same with a gradient accumulator per block
that ends on the block's owner (the ring: it rides with the block and takes one last hop home;
all-gather: one reduce-scatter).

Within a block, a tile of queries meets a *key set* (`KeyBlock.selected_columns`: its selected keys;
`KeyBlock.causal_columns`: every key at or before it), given as block rows per query, compacted to the
tile's largest count, -1 padding, and gathered (`KeyBlock.gather`): ``[b, T, m, width]``.

Why a ring of its own beside the dense one (`cp_ext.attention.cp.ring`): the dense ring hands each step's
K/V to a kernel as banded tiles (`cp_ext.attention.masks.tiles.Block`), which a per-query selection is
not; a sparse consumer needs each key's global position to match it against its selection, gathers rows
instead of multiplying tiles, and sends a block's gradient home with the block. A new attention whose
mask is a band per tile (windows, documents, sinks) belongs in the dense route; one whose queries choose
their own keys belongs here. docs/architecture.md says the same for adding a variant.
"""

from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from cp_ext.attention.cp.all_gather import reduce_scatter_single
from cp_ext.attention.cp.primitives import RingComm
from cp_ext.attention.cp.ring import ring_positions
from cp_ext.attention.masks.documents import gather_parts
from cp_ext.moved_modules import renamed
from cp_ext.perf.counter import WORK_COUNTER
from cp_ext.token_partition import check_layout

MODES = ("ring", "all_gather")


class KeyBlock:
    """One block of messages ``msg`` [b, n, width] (a ring step's, or the gathered sequence) with the
    global positions of its rows."""

    def __init__(self, msg: torch.Tensor, positions: torch.Tensor, seq_len: int):
        self.msg, self.positions = msg, positions
        self.lookup = torch.full((seq_len,), -1, dtype=torch.int64, device=msg.device)
        self.lookup[positions] = torch.arange(positions.numel(), device=msg.device)

    def columns(self, selected: torch.Tensor) -> torch.Tensor:
        """The block row of each of ``selected`` [b, T, k] (global positions, -1 padding): [b, T, k], -1
        where the key is padding or in another block."""
        return torch.where(selected >= 0, self.lookup[selected.clamp(min=0)], -1)

    def selected_columns(self, selected: torch.Tensor) -> Optional[torch.Tensor]:
        """The block rows of ``selected`` [b, T, k] (global positions, -1 padding) that are in this block:
        [b, T, m], -1 padding; None when no query selects any."""
        return compact(self.columns(selected))

    def causal_columns(self, q_positions: torch.Tensor, batch: int) -> Optional[torch.Tensor]:
        """The block rows at or before each query at ``q_positions`` [T]: [b, T, m], -1 padding; or None."""
        rows = torch.arange(self.positions.numel(), device=self.msg.device)
        cols = torch.where(self.positions.view(1, -1) <= q_positions.view(-1, 1), rows, -1)
        return compact(cols.unsqueeze(0).expand(batch, -1, -1))

    def gather(self, cols: torch.Tensor) -> torch.Tensor:
        """[b, T, m, width]: the rows ``cols`` [b, T, m] (clamped; the caller masks the padding)."""
        b, n, w = self.msg.shape
        batch = torch.arange(b, device=cols.device).view((-1,) + (1,) * (cols.dim() - 1))
        arrived = self.msg.transpose(0, 1)  # [n, b, w]: the layout blocks arrive in
        if not arrived.is_contiguous():
            return self.msg[batch, cols.clamp(min=0)]
        # one index_select of whole rows: 2-3x faster than advanced indexing on the CPU
        rows = cols.clamp(min=0) * b + batch
        return arrived.view(n * b, w).index_select(0, rows.reshape(-1)).view(*cols.shape, w)


def compact(cols: torch.Tensor) -> Optional[torch.Tensor]:
    """``cols`` [b, T, k] (-1 padding) with each row's columns first, cut to the largest count ``m``:
    [b, T, m]; None when there are none."""
    m = int((cols >= 0).sum(-1).max()) if cols.numel() else 0
    if m == 0:
        return None
    if WORK_COUNTER.enabled:  # opt-in (tools/bench_attention.py): query-key pairs computed
        WORK_COUNTER.add("pairs", int((cols >= 0).sum()))
    return cols.sort(dim=-1, descending=True).values[..., :m]


def scatter_add(dmsg: torch.Tensor, cols: torch.Tensor, dkeys: torch.Tensor) -> None:
    """Add the gathered rows' gradient ``dkeys`` [b, T, m, w] into ``dmsg`` [b, n, w] at rows ``cols``
    (the caller zeroes the padding's entries)."""
    b, n, w = dmsg.shape
    rows = cols.clamp(min=0) + torch.arange(b, device=cols.device).view(-1, 1, 1) * n
    dmsg.view(b * n, w).index_add_(0, rows.reshape(-1), dkeys.reshape(-1, w))


class KeyRingSchedule:
    """This rank's place in the sequence: ``s`` local tokens of ``group`` (None: the whole sequence)
    at ``positions`` (default: the ring rank's ``layout`` positions), walked in ``mode``, with query
    tiles of ``query_tile`` rows."""

    def __init__(self, s: int, device, *, group, layout: str, mode: str, positions: Optional[torch.Tensor],
                 query_tile: int):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        check_layout(layout)
        if query_tile < 1:
            raise ValueError(f"query_tile ({query_tile}) must be >= 1")
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.group, self.mode, self.layout, self.seq_len = group, mode, layout, s * self.size
        own = list(range(s)) if self.size == 1 else list(ring_positions(s, self.rank, self.size, layout))
        if positions is None:
            positions = torch.tensor(own, dtype=torch.int64)
        elif mode == "ring" and self.size > 1 and positions.tolist() != own:
            raise ValueError(f"positions are not ring rank {self.rank}'s {layout} positions; use mode='all_gather'")
        self.positions = positions.to(device=device, dtype=torch.int64)
        self.tiles = [slice(i, min(i + query_tile, s)) for i in range(0, s, query_tile)]

    def block_positions(self, src: int) -> torch.Tensor:
        if src == self.rank:
            return self.positions
        return torch.tensor(ring_positions(self.positions.numel(), src, self.size, self.layout),
                            dtype=torch.int64, device=self.positions.device)


def key_blocks(plan: KeyRingSchedule, msg: torch.Tensor) -> Iterator[KeyBlock]:
    """Every key of the sequence, block by block, for this rank; ``msg`` [s, b, width] is this rank's."""
    if plan.size == 1:
        yield KeyBlock(msg.transpose(0, 1), plan.positions, plan.seq_len)
    elif plan.mode == "all_gather":
        yield _gathered(plan, msg)
    else:
        comm, msg = RingComm(plan.group), msg.contiguous()
        for step in range(plan.size):
            last = step == plan.size - 1
            if not last:
                next_msg = comm.send_recv(msg)
            yield KeyBlock(msg.transpose(0, 1), plan.block_positions((plan.rank - step) % plan.size), plan.seq_len)
            if not last:
                comm.wait()
                msg = next_msg


def key_blocks_with_grads(plan: KeyRingSchedule, msg: torch.Tensor, dtype: torch.dtype, result: List[torch.Tensor],
                          grad_width: Optional[int] = None) -> Iterator[Tuple[KeyBlock, torch.Tensor]]:
    """`key_blocks` with each block's gradient accumulator [b, n, grad_width] (zeros, in ``dtype``) to
    add into, for the last ``grad_width`` values of each message (default: all of them; a walk that
    differentiates only part of the message sends only that part's accumulator); when the walk ends,
    ``result`` holds this rank's own messages' gradient [s, b, grad_width], summed over every rank that
    used them."""
    s, b = msg.shape[:2]
    w = msg.shape[2] if grad_width is None else grad_width
    if plan.size == 1 or plan.mode == "all_gather":
        block = next(key_blocks(plan, msg))
        dmsg = torch.zeros(block.msg.shape[:2] + (w,), dtype=dtype, device=msg.device)  # [b, C*s, w], rank order
        yield block, dmsg
        dmsg = dmsg.transpose(0, 1)
        if plan.size > 1:  # rank i's rows, summed over the ranks, land on rank i
            mine = torch.empty((s, b, w), dtype=dtype, device=msg.device)
            reduce_scatter_single(mine, dmsg.contiguous(), group=plan.group)
            dmsg = mine
        result.append(dmsg)
        return
    # The ring: the accumulator travels with its block; after the last step the one held here is
    # the next rank's (block rank + 1), so one more hop takes every accumulator home.
    comm = RingComm(plan.group)
    dmsg = torch.zeros((b, s, w), dtype=dtype, device=msg.device)
    for block in key_blocks(plan, msg):
        yield block, dmsg
        dmsg = comm.send_recv(dmsg)
        comm.wait()
    result.append(dmsg.transpose(0, 1))


def _gathered(plan: KeyRingSchedule, msg: torch.Tensor) -> KeyBlock:
    """The whole sequence's messages [b, C*s, width] (rank order) and positions, one all-gather each."""
    positions = torch.cat(gather_parts(plan.positions, plan.group))
    return KeyBlock(torch.cat(gather_parts(msg, plan.group)).transpose(0, 1), positions, plan.seq_len)


def __getattr__(name):  # KeyRingSchedule was called KeyPlan
    return renamed(__name__, name)
