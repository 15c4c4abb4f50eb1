"""The two ways a tile of queries reads its selected keys from one key block, and the count that picks one.

Sparse attention in MQA mode (`cp_ext.attention.dsa.sparse_attention`) scores every head of a query
against the same selected latent rows, so its work per selected (query, key) pair is ``h`` heads times
``4 d + 3 d_v`` multiply-adds (forward and backward). What costs more than that work is moving rows:

- **gather** (`GatherTile`): each query's own selected rows, ``[b, T, m, d]``, one small GEMM per query
  (``[h, d] @ [d, m]``). No wasted pairs, but every row is copied once per query that selected it, and at
  few heads each copied value feeds only ``h`` multiply-adds: memory, not arithmetic, sets the time.
- **union** (`UnionTile`): the union of the tile's selections, ``u`` rows gathered once, and one GEMM for
  all of the tile's heads and queries (``[h T, d] @ [d, u]``), the unselected pairs masked to -inf. It
  computes ``T u`` pairs for the tile's selected ones; consecutive queries share most of their top-k, so
  ``T u`` is a small multiple of them, and the latent's gradient is accumulated per union row and scattered
  once.

`plan_tile` picks by the count: union while ``T u <= pairs * (GATHER_SLOWDOWN + GATHER_COST_HEADS / h)``,
the gather path's cost per pair relative to a GEMM's (a constant factor, and the row's move in
head-equivalents of work). Either path gives the same result up to float rounding
(tests/attention/dsa/test_sparse_attention.py runs both).
"""

import functools
from typing import Optional

import torch

from cp_ext.attention.cp.primitives import accum_dtype
from cp_ext.attention.dsa.key_block_ring import compact, scatter_add
from cp_ext.perf.counter import WORK_COUNTER

PATHS = ("auto", "gather", "union")
# What a gathered pair costs beside a GEMM's pair of the same heads: GATHER_SLOWDOWN times, plus
# GATHER_COST_HEADS heads' worth of moving its row. Measured on a 2-core Xeon (fp32, d = 576, k = 512; time
# over counted multiply-adds at GEMM rate): gather 40x at 4 heads, 5-6x at 32, 3x at 128 (one small GEMM per
# query runs at half a large one's rate); union 1.2-1.3x its computed pairs. tools/bench_dsa_floor.py
# --path gather|union measures both on a machine.
GATHER_SLOWDOWN = 2.0
GATHER_COST_HEADS = 64
# Query rows x heads per union GEMM: a union tile takes max(1, UNION_ROWS // h) queries (at most a query
# tile), so the union (and its masked waste) stays small at many heads, and the GEMM tall enough at few.
UNION_ROWS = 4096


class GatherTile:
    """Each query's selected rows of the block: ``cols`` [b, T, m] block rows, -1 padding.

    Tiles take queries as q [b, T, h, d] (sequence before heads: a tile's queries and heads are one
    contiguous [T h, d] matrix at b = 1) and return (out [b, T, h, d_v], lse [b, T, h])."""

    path = "gather"

    def __init__(self, block, cols: torch.Tensor):
        self.block, self.cols = block, cols

    def _probs(self, qa, keys, scale, lse=None):
        scores = torch.einsum("bthd,btmd->bthm", qa, keys).mul_(scale)
        return softmax_in_place(scores, (self.cols >= 0).unsqueeze(2), lse)

    def forward(self, q, scale, d_v):
        acc = accum_dtype(q.dtype)
        keys = self.block.gather(self.cols).to(acc)
        p, lse = self._probs(q.to(acc), keys, scale)
        return torch.einsum("bthm,btmv->bthv", p, keys[..., :d_v]), lse

    def backward(self, dout, q, out, lse, scale, d_v, dblock):
        """dq [b, T, h, d] of the tile; the gathered rows' gradient is added into ``dblock`` [b, n, w]."""
        acc = accum_dtype(q.dtype)
        qa, ka, do = q.to(acc), self.block.gather(self.cols).to(acc), dout.to(acc)
        p, _ = self._probs(qa, ka, scale, lse)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)  # D = rowsum(dout * out)
        ds = torch.einsum("bthv,btmv->bthm", do, ka[..., :d_v]).sub_(delta).mul_(p).mul_(scale)
        dq = torch.einsum("bthm,btmd->bthd", ds, ka)
        dkeys = torch.einsum("bthm,bthd->btmd", ds, qa)
        dkeys[..., :d_v] += torch.einsum("bthm,bthv->btmv", p, do)
        scatter_add(dblock, self.cols, dkeys)
        return dq


class UnionTile:
    """The union of the tile's selections: ``rows`` [b, u] block rows (padded with row 0 where a batch
    entry has fewer) and ``mask`` [b, T, u], True where a query selected the row. The same layouts as
    `GatherTile`."""

    path = "union"

    def __init__(self, block, rows: torch.Tensor, mask: torch.Tensor):
        self.block, self.rows, self.mask = block, rows, mask

    def _keys(self, dtype):
        return self.block.gather(self.rows).to(dtype)  # [b, u, w]

    def _probs(self, qa, keys, scale, lse=None):
        """Probabilities [b, T h, u] of the flattened queries qa [b, T h, d] (the scale in the GEMM), and lse."""
        b, th, _ = qa.shape
        t, u = self.mask.shape[1:]
        scores = torch.baddbmm(_ZERO.to(qa), qa, keys.transpose(1, 2), beta=0, alpha=scale)
        p, lse = softmax_in_place(scores.view(b, t, th // t, u), self.mask.unsqueeze(2),
                                  None if lse is None else lse.view(b, t, th // t))
        return p.view(b, th, u), lse

    def forward(self, q, scale, d_v):
        acc = accum_dtype(q.dtype)
        b, t, h, d = q.shape
        keys = self._keys(acc)
        p, lse = self._probs(q.to(acc).reshape(b, t * h, d), keys, scale)
        return torch.bmm(p, keys[..., :d_v]).view(b, t, h, d_v), lse

    def backward(self, dout, q, out, lse, scale, d_v, dblock):
        acc = accum_dtype(q.dtype)
        b, t, h, d = q.shape
        keys = self._keys(acc)
        qa = q.to(acc).reshape(b, t * h, d)
        do = dout.to(acc).reshape(b, t * h, d_v)
        p, _ = self._probs(qa, keys, scale, lse)
        delta = (do * out.to(acc).reshape(b, t * h, d_v)).sum(-1, keepdim=True)
        ds = torch.bmm(do, keys[..., :d_v].transpose(1, 2)).sub_(delta).mul_(p).mul_(scale)  # scaled once here
        dq = torch.bmm(ds, keys).view(b, t, h, d)
        dkeys = torch.bmm(ds.transpose(1, 2), qa)  # [b, u, d]: per union row, summed over the tile
        dkeys[..., :d_v].baddbmm_(p.transpose(1, 2), do)
        scatter_add(dblock, self.rows.unsqueeze(1), dkeys.unsqueeze(1))  # padding rows add zeros (masked)
        return dq


_ZERO = torch.zeros(())


# exp() below this underflows towards the subnormals, where torch's vectorised exp takes a slow path
# (x20 per element on AVX-512, and for -inf too): scores under it are clamped to it and masked keys
# zeroed after exp. A probability under e^-80 = 1.8e-35 of the row's largest is not representable
# beside 1 at any float precision, so nothing changes but the time.
_EXP_FLOOR = -80.0


def softmax_in_place(scores: torch.Tensor, keep: torch.Tensor, lse: Optional[torch.Tensor] = None):
    """(p, lse) over the last dim of ``scores`` [..., n] where ``keep`` (broadcast) is True, overwriting
    ``scores``; with ``lse`` [...] given (the backward's recompute from the final LSE), only p. Either
    way p is the same expression, exp(score - lse), so the backward's p is the forward's bit for bit. A
    row with nothing kept gets p 0 and lse -inf."""
    scores.masked_fill_(~keep, float("-inf"))
    if lse is None:
        top = _finite(scores.amax(dim=-1)).unsqueeze(-1)
        total = (scores - top).clamp_(min=_EXP_FLOOR).exp_().masked_fill_(~keep, 0.0).sum(dim=-1, keepdim=True)
        lse = (top + total.log()).squeeze(-1)
    return scores.sub_(_finite(lse).unsqueeze(-1)).clamp_(min=_EXP_FLOOR).exp_().masked_fill_(~keep, 0.0), lse


def _finite(x: torch.Tensor) -> torch.Tensor:
    """-inf (a row with no key in this block) as 0, so exp(-inf - x) is 0, not NaN."""
    return x.masked_fill(x == float("-inf"), 0.0)


class Union:
    """The union of a tile's selections ``cols`` [b, T, k] (rows of an n-row table, -1 padding). Counted at
    once (``pairs`` selected, ``u`` the largest batch entry's union); built only when read: ``rows`` [b, u]
    (each batch entry's in increasing order, padded with row 0) and ``mask`` [b, T, u], True where the query
    selected the row."""

    def __init__(self, cols: torch.Tensor, n: int):
        self.cols, b = cols, cols.shape[0]
        self.valid = cols >= 0
        self.pairs = int(self.valid.sum())
        marked = torch.zeros((b, n + 1), dtype=torch.bool, device=cols.device)
        marked.scatter_(1, cols.masked_fill(~self.valid, n).view(b, -1), True)
        self.marked = marked[:, :n]
        self.u = int(self.marked.sum(1).max()) if self.pairs else 0

    @functools.cached_property
    def _slot(self) -> torch.Tensor:
        return self.marked.cumsum(1) - 1  # each marked row's place in its batch entry's union

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        where = self.marked.nonzero()
        rows = torch.zeros((self.cols.shape[0], self.u), dtype=torch.int64, device=self.cols.device)
        rows[where[:, 0], self._slot[where[:, 0], where[:, 1]]] = where[:, 1]
        return rows

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        b, t, _ = self.cols.shape
        slots = self._slot.gather(1, self.cols.clamp(min=0).view(b, -1)).view(b, t, -1)
        mask = torch.zeros((b, t, self.u + 1), dtype=torch.bool, device=self.cols.device)
        mask.scatter_(2, torch.where(self.valid, slots, self.u), True)  # padding into the spare last column
        return mask[..., :self.u]

    @property
    def computed(self) -> int:
        """The pairs the union path computes: every query of the tile against the whole (padded) union."""
        b, t, _ = self.cols.shape
        return b * t * self.u

    def cheaper_than_gather(self, heads: int) -> bool:
        """The count's choice (module docstring)."""
        return self.computed <= self.pairs * (GATHER_SLOWDOWN + GATHER_COST_HEADS / heads)


def plan_tile(block, selected: torch.Tensor, heads: int, path: str = "auto"):
    """How one tile of queries reads ``block``: a `GatherTile`, a `UnionTile`, or None when no query
    selected a key in it. ``selected`` [b, T, k]: global positions, -1 padding. Counts (opt-in,
    tools/bench_attention.py, tools/bench_dsa_floor.py) the selected pairs and the pairs each path computes."""
    cols = block.columns(selected)
    union = None if path == "gather" else Union(cols, block.msg.shape[1])
    if union is None or not union.cheaper_than_gather(heads) and path == "auto":
        cols = compact(cols)  # counts the selected pairs
        if cols is not None and WORK_COUNTER.enabled:
            WORK_COUNTER.add("gather_pairs", int((cols >= 0).sum()))
        return None if cols is None else GatherTile(block, cols)
    if union.pairs == 0:
        return None
    if WORK_COUNTER.enabled:
        WORK_COUNTER.add("pairs", union.pairs)
        WORK_COUNTER.add("union_pairs", union.computed)
    return UnionTile(block, union.rows, union.mask)


def query_tiles(rows: slice, heads: int, path: str):
    """``rows`` cut into the union path's tiles (``UNION_ROWS // heads`` queries), or whole for ``gather``."""
    if path == "gather":
        return [rows]
    step = max(1, UNION_ROWS // heads)
    return [slice(i, min(i + step, rows.stop)) for i in range(rows.start, rows.stop, step)]


def check_path(path: Optional[str]) -> str:
    if path not in PATHS:
        raise ValueError(f"unknown sparse path {path!r}; choose one of {PATHS}")
    return path
