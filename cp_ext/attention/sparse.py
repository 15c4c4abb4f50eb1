"""DeepSeek-V3.2's sparse attention (DSA) core under context parallelism: each query attends only to
the keys the lightning indexer selected for it (`cp_ext.attention.dsa_indexer.indexer_topk`), on the
ring or through one all-gather, with its own backward.

**MQA mode.** DeepSeek-V3.2 runs DSA in MLA's MQA mode (the paper's section 2.1): the up-projection is
absorbed into the query and the output, so every head attends to the same per-token latent::

    q_h' = [q_nope_h W_uk_h | q_pe_h]          (r + p wide: 512 + 64 at V3.2's size)
    kv_j = [c_j | k_pe_j]                      the key of token j; its value is c_j = kv_j[:r]
    out_h = (sum_j p_hj c_j) W_uv_h^T          p_h = softmax_j(scale * q_h' . kv_j), j in top-k(t)

This module computes the middle line for selected keys only, on ``q`` [s, b, h, d_qk] and ``kv``
[s, b, d_qk] (one key row per token, shared by the heads; the value is its first ``v_head_dim``
values); the absorption on either side is plain differentiable tensor algebra
(`cp_ext.transformer.dsa`). So what a CP rank sends is what the dense ring's latent exchange sends,
``r + p`` values per token, and the work per query is k keys, not s.

**Sparse tiles.** For a tile of ``query_tile`` queries and one key block (a ring step's block, or the
gathered sequence), each query's selected keys that lie in the block are looked up (global position ->
block row), compacted to the tile's largest count ``m``, and gathered: ``[b, T, m, d_qk]``, scored
``[b, h, T, m]`` in fp32, and merged into the running (out, LSE) with the LSE rule
(`cp_ext.attention.utils.update_out_and_lse`). A tile with no selected key in the block computes
nothing. The backward recomputes each tile's probabilities from the final LSE (as the dense ring does),
and scatter-adds the gathered keys' gradient into the block's gradient, which rides home with the block
(ring) or is reduce-scattered (all-gather). Every query has at least one selected key (itself), so no
row is empty once all blocks are in.

**Exactness.** Which keys a query attends to is the selection alone (``selected``: global positions,
-1 for padding), the same on every layout; causality is in the selection. The result differs from a
dense masked attention only by float rounding (tests/attention/test_sparse.py: against float64).
"""

from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.all_gather import reduce_scatter_single
from cp_ext.attention.documents import gather_parts
from cp_ext.attention.ring import ring_positions
from cp_ext.attention.utils import RingComm, accum_dtype, update_out_and_lse
from cp_ext.layout import LAYOUTS
from cp_ext.perf.counter import WORK_COUNTER

MODES = ("ring", "all_gather")
DEFAULT_QUERY_TILE = 256  # one tile's gathered keys: [b, 256, m, d_qk]; 1.2 GiB fp32 at k = m = 2048, d_qk = 576


class KeyBlock:
    """One block of keys (a ring step's, or the gathered sequence) with the global positions of its rows."""

    def __init__(self, kv: torch.Tensor, positions: torch.Tensor, seq_len: int):
        self.kv = kv  # [b, n, d_qk]
        self.lookup = torch.full((seq_len,), -1, dtype=torch.int64, device=kv.device)
        self.lookup[positions] = torch.arange(positions.numel(), device=kv.device)

    def columns(self, selected: torch.Tensor) -> Optional[torch.Tensor]:
        """The block rows of ``selected`` [b, T, k] (global positions, -1 padding) that are in this block,
        compacted to the tile's largest count: [b, T, m], -1 padding; None when no query selects any."""
        cols = torch.where(selected >= 0, self.lookup[selected.clamp(min=0)], -1)
        m = int((cols >= 0).sum(-1).max())
        if m == 0:
            return None
        if WORK_COUNTER.enabled:  # opt-in (tools/bench_attention.py): query-key pairs computed
            WORK_COUNTER.add("pairs", int((cols >= 0).sum()))
        return cols.sort(dim=-1, descending=True).values[..., :m]

    def gather(self, cols: torch.Tensor) -> torch.Tensor:
        """[b, T, m, d_qk]: the rows ``cols`` (clamped; the caller masks the padding)."""
        batch = torch.arange(cols.shape[0], device=cols.device).view(-1, 1, 1)
        return self.kv[batch, cols.clamp(min=0)]


def _tile_forward(q, keys, cols, scale, d_v):
    """(out [b, h, T, d_v], lse [b, h, T]) of queries q [b, h, T, d] over the gathered ``keys``."""
    acc = accum_dtype(q.dtype)
    scores = torch.einsum("bhtd,btmd->bhtm", q.to(acc), keys.to(acc)).mul_(scale)
    scores.masked_fill_((cols < 0).unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a query with no key in this block: lse -inf, p 0
    return torch.einsum("bhtm,btmv->bhtv", p, keys[..., :d_v].to(acc)), lse


def _tile_backward(dout, q, out, lse, keys, cols, scale, d_v):
    """(dq [b, h, T, d], d keys [b, T, m, d_qk]) of one tile, from the final ``out``/``lse``."""
    acc = accum_dtype(q.dtype)
    qa, ka, do = q.to(acc), keys.to(acc), dout.to(acc)
    scores = torch.einsum("bhtd,btmd->bhtm", qa, ka).mul_(scale)
    scores.masked_fill_((cols < 0).unsqueeze(1), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    delta = (do * out.to(acc)).sum(-1, keepdim=True)  # D = rowsum(dout * out)
    ds = p * (torch.einsum("bhtv,btmv->bhtm", do, ka[..., :d_v]) - delta)
    dq = torch.einsum("bhtm,btmd->bhtd", ds, ka).mul_(scale)
    dkeys = torch.einsum("bhtm,bhtd->btmd", ds, qa).mul_(scale)
    dkeys[..., :d_v] += torch.einsum("bhtm,bhtv->btmv", p, do)
    return dq, dkeys


def _scatter_add(dkv, cols, dkeys):
    """Add the gathered keys' gradient ``dkeys`` [b, T, m, d] into ``dkv`` [b, n, d] at rows ``cols``
    (the padding's entries are zero: their probabilities are)."""
    b, n, d = dkv.shape
    rows = cols.clamp(min=0) + torch.arange(b, device=cols.device).view(-1, 1, 1) * n
    dkv.view(b * n, d).index_add_(0, rows.reshape(-1), dkeys.reshape(-1, d))


class _Args:
    """What forward and backward share: the selection in tiles, the scale, the group."""

    def __init__(self, q, kv, selected, softmax_scale, v_head_dim, group, layout, mode, positions, query_tile):
        if mode not in MODES:
            raise ValueError(f"unknown sparse attention mode {mode!r}; choose one of {MODES}")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
        s, b = q.shape[:2]
        if q.dim() != 4 or kv.shape != (s, b, q.shape[3]) or selected.dim() != 3 or selected.shape[:2] != (b, s):
            raise ValueError(f"expected q [s, b, h, d], kv [s, b, d] and selected [b, s, k]; got q {tuple(q.shape)}, "
                             f"kv {tuple(kv.shape)}, selected {tuple(selected.shape)}")
        if not 0 < v_head_dim <= q.shape[3] or query_tile < 1:
            raise ValueError(f"v_head_dim ({v_head_dim}) must be in 1..{q.shape[3]} and query_tile ({query_tile}) >= 1")
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.group, self.mode, self.layout = group, mode, layout
        self.scale, self.d_v, self.seq_len = softmax_scale, v_head_dim, s * self.size
        if positions is None:
            if mode == "all_gather" and self.size > 1 and layout not in ("zigzag", "contiguous"):
                raise ValueError("all-gather sparse attention needs the positions of this rank's tokens")
            positions = torch.tensor(ring_positions(s, self.rank, self.size, layout), dtype=torch.int64)
        elif mode == "ring" and self.size > 1 and positions.tolist() != list(ring_positions(s, self.rank, self.size, layout)):
            raise ValueError(f"positions are not ring rank {self.rank}'s {layout} positions; use mode='all_gather'")
        self.positions = positions.to(device=q.device, dtype=torch.int64)
        self.tiles = [slice(i, min(i + query_tile, s)) for i in range(0, s, query_tile)]
        self.selected = selected.to(torch.int64)

    def block_positions(self, src):
        if src == self.rank:
            return self.positions
        return torch.tensor(ring_positions(self.positions.numel(), src, self.size, self.layout),
                            dtype=torch.int64, device=self.positions.device)


def _forward_block(args, q, block, out, lse):
    for rows in args.tiles:
        cols = block.columns(args.selected[:, rows])
        if cols is not None:
            o, l = _tile_forward(q[:, :, rows], block.gather(cols), cols, args.scale, args.d_v)
            update_out_and_lse(out, lse, o, l, rows)


def _backward_block(args, dout, q, out, lse, block, dq, dkv):
    for rows in args.tiles:
        cols = block.columns(args.selected[:, rows])
        if cols is not None:
            dq_t, dkeys = _tile_backward(dout[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                         block.gather(cols), cols, args.scale, args.d_v)
            dq[:, :, rows] += dq_t
            _scatter_add(dkv, cols, dkeys)


def _all_gathered(args, kv):
    """The whole sequence's keys [b, C*s, d] (rank order) and their positions, from one all-gather each."""
    parts = gather_parts(kv, args.group)  # [s, b, d] per rank
    positions = torch.cat(gather_parts(args.positions, args.group))
    return KeyBlock(torch.cat(parts).transpose(0, 1), positions, args.seq_len)


def sparse_forward(args: _Args, q, kv):
    """q [b, h, s, d], kv [s, b, d] -> (out [b, h, s, d_v] in q.dtype, lse [b, h, s] fp32)."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(q.shape[:3] + (args.d_v,), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    if args.size == 1 or args.mode == "all_gather":
        block = KeyBlock(kv.transpose(0, 1), args.positions, args.seq_len) if args.size == 1 else _all_gathered(args, kv)
        _forward_block(args, q, block, out, lse)
        return out.to(q.dtype), lse
    comm, msg = RingComm(args.group), kv.contiguous()
    for step in range(args.size):  # the next block is in flight while this one is computed
        last = step == args.size - 1
        if not last:
            next_msg = comm.send_recv(msg)
        src = (args.rank - step) % args.size
        _forward_block(args, q, KeyBlock(msg.transpose(0, 1), args.block_positions(src), args.seq_len), out, lse)
        if not last:
            comm.wait()
            msg = next_msg
    return out.to(q.dtype), lse


def sparse_backward(args: _Args, dout, q, kv, out, lse):
    """(dq [b, h, s, d], dkv [s, b, d]) of `sparse_forward`."""
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    b, s = q.shape[0], q.shape[2]
    if args.size == 1 or args.mode == "all_gather":
        block = KeyBlock(kv.transpose(0, 1), args.positions, args.seq_len) if args.size == 1 else _all_gathered(args, kv)
        dkv = torch.zeros(block.kv.shape, dtype=acc, device=q.device)  # [b, C*s, d], rank order
        _backward_block(args, dout, q, out, lse, block, dq, dkv)
        dkv = dkv.transpose(0, 1)
        if args.size > 1:  # rank i's rows, summed over the ranks, land on rank i
            mine = torch.empty((s, b, kv.shape[-1]), dtype=acc, device=q.device)
            reduce_scatter_single(mine, dkv.contiguous(), group=args.group)
            dkv = mine
        return dq.to(q.dtype), dkv.to(kv.dtype)
    # Ring: the block and its gradient accumulator travel together; after the last step the
    # accumulator held here belongs to the next rank (block rank + 1), so one more hop takes it home.
    kv_comm, dkv_comm = RingComm(args.group), RingComm(args.group)
    msg, dkv = kv.contiguous(), torch.zeros((b, s, kv.shape[-1]), dtype=acc, device=q.device)
    for step in range(args.size):
        last = step == args.size - 1
        if not last:
            next_msg = kv_comm.send_recv(msg)
        src = (args.rank - step) % args.size
        block = KeyBlock(msg.transpose(0, 1), args.block_positions(src), args.seq_len)
        _backward_block(args, dout, q, out, lse, block, dq, dkv)
        next_dkv = dkv_comm.send_recv(dkv)
        if not last:
            kv_comm.wait()
            msg = next_msg
        dkv_comm.wait()
        dkv = next_dkv
    return dq.to(q.dtype), dkv.transpose(0, 1).to(kv.dtype)


class SparseAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, args):
        qk = q.permute(1, 2, 0, 3)  # [b, h, s, d]
        out, lse = sparse_forward(args, qk, kv)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.args = args
        return out.permute(2, 0, 1, 3)  # [s, b, h, d_v]

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = sparse_backward(ctx.args, dout.permute(1, 2, 0, 3), q.permute(1, 2, 0, 3), kv, out, lse)
        return dq.permute(2, 0, 1, 3), dkv, None


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, up_weight: torch.Tensor) -> torch.Tensor:
    """MLA's query in the latent's space: ``[q_nope_h W_uk_h | q_pe_h]`` [s, b, h, r + p], differentiable.

    q_nope [s, b, h, d_nope], q_pe [s, b, h, p]; ``up_weight``: ``linear_kv_up_proj.weight``
    [h (d_nope + d_v), r] of these heads (megatron's layout: each head's d_nope key rows, then its d_v value rows)."""
    s, b, h, d_nope = q_nope.shape
    w_uk = up_weight.view(h, -1, up_weight.shape[1])[:, :d_nope]  # [h, d_nope, r]
    return torch.cat([torch.einsum("sbhd,hdr->sbhr", q_nope, w_uk), q_pe], dim=-1)


def up_project_output(out_latent: torch.Tensor, up_weight: torch.Tensor, d_nope: int) -> torch.Tensor:
    """The attention output from the latent's space [s, b, h, r] to each head's values [s, b, h, d_v]:
    ``out_h W_uv_h^T``, differentiable."""
    h = out_latent.shape[2]
    w_uv = up_weight.view(h, -1, up_weight.shape[1])[:, d_nope:]  # [h, d_v, r]
    return torch.einsum("sbhr,hvr->sbhv", out_latent, w_uv)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, selected: torch.Tensor, *, softmax_scale: float,
                     v_head_dim: int, group: Optional[dist.ProcessGroup] = None, layout: str = "zigzag",
                     mode: str = "ring", positions: Optional[torch.Tensor] = None,
                     query_tile: int = DEFAULT_QUERY_TILE) -> torch.Tensor:
    """Each query of this CP rank attends to its ``selected`` keys of the whole sequence (MQA mode).

    q [s, b, h, d]: this rank's queries (in the latent's space: module docstring); kv [s, b, d]: this rank's
    keys, one per token for every head, whose first ``v_head_dim`` values are the value; ``selected``
    [b, s, k]: each query's keys as global positions, -1 padding (`indexer_topk`'s first result).
    ``group``: the CP group (None: one process holds the sequence); ``mode``: ``ring`` (``layout`` zigzag or
    contiguous: the ring's own positions) or ``all_gather`` (any layout, given ``positions`` [s], the global
    positions of this rank's tokens). Returns out [s, b, h, v_head_dim] in q's dtype; differentiable in q
    and kv.
    """
    args = _Args(q, kv, selected, softmax_scale, v_head_dim, group, layout, mode, positions, query_tile)
    return SparseAttnFunc.apply(q, kv, args)
