"""DeepSeek-V3.2 sparse attention (DSA): the lightning indexer's exact top-k, tiled, under context parallelism.

The indexer scores every earlier token ``s`` for each query ``t``::

    I(t, s) = sum_h w(t, h) * ReLU(q_I(t, h) . k_I(s))

with ``H`` indexer heads of dim ``D``, one key shared by the heads, and per-head weights ``w`` that
already hold megatron's ``H**-0.5 * softmax_scale`` (megatron-core's ``DSAIndexer._compute_index_scores``).
Each query then attends to its top-k causal keys. megatron builds the dense fp32 ``[b, s, s]`` scores,
and ``[s, b, H, s]`` before the head sum: at s = 128K that is 64 GiB, and 4 TiB with 64 heads, per
sample. Here the scores exist one tile at a time (``query_tile x key_tile`` pairs, `index_scores`) and
are merged into a running top-k (`RunningTopK`), so the peak extra memory is
``O(b * query_tile * H * key_tile + b * s_local * k)``: one tile and the running result.

Usage, on this CP rank's shards in the training layout (sequence first, as megatron hands them)::

    positions, scores = indexer_topk(q, w, k, topk=2048, q_positions=context_parallel_positions(...),
                                     group=cp_group, layout="zigzag", mode="ring")
    # positions [b, s_local, min(topk, s)] int64 global key positions, -1 where a query has fewer keys
    # scores    [b, s_local, min(topk, s)] fp32 (fp64 for fp64 inputs), -inf beside each -1

What is selected: query ``t`` selects its top ``min(k, t + 1)`` causal keys (position <= t) by score,
which is what megatron's ``(scores + causal -inf mask).topk(min(k, s))`` followed by its causal mask
keeps. **Ties:** on equal scores the lower global position wins, whatever the CP layout or the order in
which key blocks arrive, so every layout, CP size and tile size selects the same keys (megatron's
``topk`` leaves ties to the kernel). Each query's row is in canonical order: score descending, then
position ascending; the padding ``(-inf, -1)`` last. Scores of finite inputs are finite; ``-0.0`` is
folded into ``0.0`` so that zero scores tie. The result is not differentiable (selection is not; the
indexer loss recomputes the scores of the keys it needs with autograd).

Under CP the indexer keys travel like KV blocks, and every block's global positions are known:
``mode="ring"``: around the ring group with `RingComm` (the next block is in flight while the current
one is scored); the block of ring rank ``src`` holds `ring_positions` (``layout``: zigzag or
contiguous); a block entirely in the future of all this rank's queries is passed on unscored.
``mode="all_gather"``: the keys and their positions are gathered from the group (any layout, a
Ulysses x ring one too); the gathered keys, one ``[s, b, D]`` copy, live for the call.
``group=None`` (or of size 1): one process holds the whole sequence, still tiled.
"""

import bisect
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from cp_ext.attention.masks.documents import gather_parts
from cp_ext.attention.cp.ring import ring_positions
from cp_ext.attention.cp.primitives import RingComm, accum_dtype
from cp_ext.token_partition import check_layout

MODES = ("ring", "all_gather")
# One tile's [b, query_tile, H, key_tile] fp32 scores: 256 MiB at b = 1, H = 64.
DEFAULT_QUERY_TILE = 512
DEFAULT_KEY_TILE = 2048


# Query rows per scoring GEMM, times the indexer heads: the per-head [rows, H, sk] ReLU term then stays
# in the last-level cache (16 MiB at sk = 2048), where the ReLU and the head sum read it back almost for
# free; one [query_tile * H, sk] GEMM spills it to memory and runs 1.6x slower on a 2-core Xeon.
SCORE_ROWS = 2048


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The indexer scores of one tile: q [b, sq, H, D], w [b, sq, H], k [b, sk, D] -> [b, sq, sk].

    Computed in fp32 (fp64 for fp64 inputs) whatever the input dtype, as megatron does: per
    ``SCORE_ROWS // H`` queries one GEMM ``[queries * H, D] @ [D, sk]``, its ReLU in place, and the
    head-weighted sum as a batched product over it, while it is still in cache.
    """
    acc = accum_dtype(q.dtype)
    b, sq, heads = w.shape
    kt = k.to(acc).transpose(1, 2)  # [b, D, sk]
    out = torch.empty((b, sq, k.shape[1]), dtype=acc, device=q.device)
    step = max(1, SCORE_ROWS // heads)
    for i in range(0, sq, step):
        rows = slice(i, min(i + step, sq))
        n = rows.stop - rows.start
        per_head = torch.bmm(q[:, rows].to(acc).reshape(b, n * heads, -1), kt).relu_().view(b, n, heads, -1)
        out[:, rows] = torch.matmul(w[:, rows].to(acc).unsqueeze(-2), per_head).squeeze(-2)
    return out


class RunningTopK:
    """The top-k keys of every query so far, merged tile by tile in any key order.

    ``values`` [b, sq, k] (fp32 / fp64) and ``positions`` [b, sq, k] (int64, global) of each query's
    best keys, in canonical order: score descending, position ascending; ``(-inf, -1)`` fill what a
    query has not got (fewer than k causal keys so far). `add` merges one tile's scores: keys after a
    query (position greater than the query's) are dropped, the survivors compete with the running
    entries, and the best k stay. Because the order is a total order on (score, position), the
    result does not depend on how the keys were cut into tiles or in which order the tiles came.
    """

    def __init__(self, batch: int, q_positions: torch.Tensor, k: int, dtype: torch.dtype):
        self.k = k
        self.q_positions = q_positions
        shape = (batch, q_positions.numel(), k)
        self.values = torch.full(shape, float("-inf"), dtype=dtype, device=q_positions.device)
        self.positions = torch.full(shape, -1, dtype=torch.int64, device=q_positions.device)

    def add(self, scores: torch.Tensor, key_positions: torch.Tensor, rows: slice = slice(None)) -> None:
        """Merge ``scores`` [b, rows, sk] of the keys at global ``key_positions`` [sk] into query ``rows``.

        ``scores`` is consumed (masked in place). A tile none of whose scores reaches any row's current
        k-th best changes nothing and is not merged (the running threshold)."""
        b, n, sk = scores.shape
        future = key_positions.view(1, sk) > self.q_positions[rows].view(n, 1)
        scores = scores.masked_fill_(future, float("-inf")).add_(0.0)  # + 0.0 turns -0.0 into 0.0
        # ties count: an equal score at a lower position would enter. (On a GPU the test would cost a host
        # sync per tile; the merge runs unconditionally there.)
        if scores.device.type == "cpu" and not bool((scores >= self.values[:, rows, -1:]).any()):
            return
        key_positions = key_positions.view(1, 1, sk).expand(b, n, sk).masked_fill(future, -1)
        values = torch.cat([self.values[:, rows], scores], dim=-1)
        positions = torch.cat([self.positions[:, rows], key_positions], dim=-1)
        best = self._best(values, positions, self.k)
        self.values[:, rows] = values.gather(-1, best)
        self.positions[:, rows] = positions.gather(-1, best)

    @classmethod
    def _best(cls, values: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        """The indices of the best ``k`` along the last dim, in canonical order. fp32 scores and their
        positions pack into one int64 that orders the same way, so one partial selection (``topk``) finds
        them without sorting what it discards; other dtypes sort (`_canonical_order`)."""
        if values.dtype == torch.float32:
            return _pack(values, positions).topk(k, dim=-1, sorted=True).indices
        return cls._canonical_order(values, positions)[..., :k]

    @staticmethod
    def _canonical_order(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The permutation of the last dim that orders by score descending, then position ascending:
        order by position, then stable-sort by score (a stable sort keeps equal scores by position)."""
        by_position = positions.argsort(dim=-1, stable=True)
        by_score = values.gather(-1, by_position).argsort(dim=-1, descending=True, stable=True)
        return by_position.gather(-1, by_score)

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(positions, values), each [b, sq, k]."""
        return self.positions, self.values


_LOW = 1 << 32


def _pack(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 per (fp32 score, position) whose order is the canonical one: the score's bits, made
    monotonic (a negative float's magnitude bits are flipped), in the high half; ``2**32 - 1 - position``
    in the low half, so a lower position wins a tie. -inf entries (any position) order last."""
    bits = values.view(torch.int32)
    monotonic = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return monotonic * _LOW + (_LOW - 1 - positions.clamp(min=0))


def _runs(positions: List[int], tile: int) -> List[Tuple[slice, int, int]]:
    """(rows, min position, max position) of each ``tile`` consecutive rows."""
    return [(slice(i, i + tile), min(positions[i:i + tile]), max(positions[i:i + tile]))
            for i in range(0, len(positions), tile)]


def _score_block(state: RunningTopK, q, w, q_runs, k_block, key_positions: List[int], key_tile: int) -> None:
    """Score this rank's queries (``q_runs``) against one key block [b, sk, D] tile by tile, skipping
    tile pairs whose keys all come after all their queries, and cutting a key tile whose positions rise
    where they pass the query tile's last position: what is scored is the causal pairs plus the triangle
    above each query tile's diagonal, not whole key tiles past it."""
    device_positions = torch.tensor(key_positions, dtype=torch.int64, device=q.device)
    k_runs = _runs(key_positions, key_tile)
    rising = [all(a < b for a, b in zip(key_positions[c.start:c.stop], key_positions[c.start + 1:c.stop]))
              for c, _, _ in k_runs]
    for rows, _, q_max in q_runs:
        for (cols, k_min, _), sorted_run in zip(k_runs, rising):
            if k_min > q_max:
                continue
            if sorted_run:
                cols = slice(cols.start, bisect.bisect_right(key_positions, q_max, cols.start,
                                                                min(cols.stop, len(key_positions))))
            state.add(index_scores(q[:, rows], w[:, rows], k_block[:, cols]), device_positions[cols], rows)


def _check(q, w, k, topk, q_positions, mode, layout, key_tile, query_tile):
    if mode not in MODES:
        raise ValueError(f"unknown indexer mode {mode!r}; choose one of {MODES}")
    check_layout(layout)
    if q.dim() != 4 or w.shape != q.shape[:3] or k.dim() != 3 or k.shape[:2] != q.shape[:2] or k.shape[2] != q.shape[3]:
        raise ValueError(f"expected q [s, b, H, D], w [s, b, H], k [s, b, D]; got q {tuple(q.shape)}, "
                         f"w {tuple(w.shape)}, k {tuple(k.shape)}")
    if q_positions.shape != (q.shape[0],):
        raise ValueError(f"q_positions {tuple(q_positions.shape)} must hold one position per row of q ({q.shape[0]})")
    if topk < 1 or key_tile < 1 or query_tile < 1:
        raise ValueError(f"topk ({topk}), key_tile ({key_tile}) and query_tile ({query_tile}) must be >= 1")


def indexer_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, *, topk: int, q_positions: torch.Tensor,
                 group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag", mode: str = "ring",
                 key_tile: int = DEFAULT_KEY_TILE, query_tile: int = DEFAULT_QUERY_TILE
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The top-``topk`` causal keys of each of this rank's queries, over the whole sequence.

    q [s_local, b, H, D], w [s_local, b, H], k [s_local, b, D]: this CP rank's shards (sequence
    first); ``q_positions`` [s_local]: their global positions (`cp_ext.token_partition.context_parallel_positions`;
    under ``mode="ring"`` they must be this ring rank's `ring_positions` for ``layout``). ``group``: the CP
    group the sequence is sharded over (None: one process, the whole sequence). Returns
    (positions, scores), each [b, s_local, min(topk, s)] (module docstring: order, ties, padding).
    """
    _check(q, w, k, topk, q_positions, mode, layout, key_tile, query_tile)
    size = 1 if group is None else dist.get_world_size(group)
    s_local, b = q.shape[0], q.shape[1]
    q_positions = q_positions.to(device=q.device, dtype=torch.int64)
    q_host = q_positions.tolist()  # one small copy: every tile skip is planned on the host
    if mode == "ring" and size > 1:
        rank = dist.get_rank(group)
        if q_host != list(ring_positions(s_local, rank, size, layout)):
            raise ValueError(f"q_positions are not ring rank {rank}'s {layout} positions of a ring of {size}; "
                             f"pass the layout the sequence was sharded with, or use mode='all_gather'")
    with torch.no_grad():
        state = RunningTopK(b, q_positions, min(topk, s_local * size), accum_dtype(q.dtype))
        qb, wb = q.transpose(0, 1), w.transpose(0, 1)  # [b, s_local, ...] views: tiles are slices of them
        q_runs = _runs(q_host, query_tile)
        if size == 1:
            _score_block(state, qb, wb, q_runs, k.transpose(0, 1), q_host, key_tile)
        elif mode == "all_gather":
            positions = gather_parts(q_positions, group)
            for block, block_positions in zip(gather_parts(k, group), positions):
                block_host = block_positions.tolist()
                if min(block_host) <= max(q_host):
                    _score_block(state, qb, wb, q_runs, block.transpose(0, 1), block_host, key_tile)
        else:
            _ring(state, qb, wb, q_runs, k, group, layout, key_tile, max(q_host))
        return state.result()


def _ring(state, q, w, q_runs, k, group, layout, key_tile, q_max):
    """The keys go around the ring: at step t this rank holds ring rank (rank - t)'s block, and the
    next one is already in flight while it is scored. Every block visits every rank (one rank may skip
    it, the next may need it), so each rank sends C - 1 times."""
    comm = RingComm(group)
    block = k.contiguous()
    for step in range(comm.world_size):
        last = step == comm.world_size - 1
        if not last:
            next_block = comm.send_recv(block)
        src = (comm.rank - step) % comm.world_size
        block_positions = list(ring_positions(k.shape[0], src, comm.world_size, layout))
        if min(block_positions) <= q_max:  # else every key is after every query of this rank
            _score_block(state, q, w, q_runs, block.transpose(0, 1), block_positions, key_tile)
        if not last:
            comm.wait()
            block = next_block
