"""DeepSeek-V3.2's sparse attention (DSA) core under context parallelism: each query attends only to
the keys the lightning indexer selected for it (`cp_ext.attention.dsa.indexer.indexer_topk`), on the
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

**Sparse tiles.** For a tile of queries and one key block (a ring step's block, or the gathered
sequence), each query's selected keys that lie in the block are looked up (global position -> block
row) and read one of two ways (`cp_ext.attention.dsa.sparse_tiles`, picked per tile by the count): each
query's own rows gathered (``[b, T, m, d_qk]``), or the union of the tile's rows gathered once and
scored for every head and query in one GEMM, the unselected pairs masked. Scores are fp32 and merged into
the running (out, LSE) with the LSE rule (`cp_ext.attention.cp.primitives.update_out_and_lse`). A tile
with no selected key in the block computes nothing. The backward recomputes each tile's probabilities
from the final LSE (as the dense ring does), and scatter-adds the keys' gradient into the block's
gradient, which rides home with the block (ring) or is reduce-scattered (all-gather). Every query has at
least one selected key (itself), so no row is empty once all blocks are in.

**Exactness.** Which keys a query attends to is the selection alone (``selected``: global positions,
-1 for padding), the same on every layout; causality is in the selection. The result differs from a
dense masked attention only by float rounding (tests/attention/dsa/test_sparse_attention.py: against float64).
"""

from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.dsa.key_block_ring import KeyRingSchedule, key_blocks, key_blocks_with_grads
from cp_ext.attention.dsa.sparse_tiles import check_path, plan_tile, query_tiles
from cp_ext.attention.cp.primitives import accum_dtype, update_out_and_lse

DEFAULT_QUERY_TILE = 256  # one tile's gathered keys: [b, 256, m, d_qk]; 1.2 GiB fp32 at k = m = 2048, d_qk = 576


class _Args:
    """What forward and backward share: where this rank's queries and keys are, the selection, the scale."""

    def __init__(self, q, kv, selected, softmax_scale, v_head_dim, group, layout, mode, positions, query_tile, path):
        s, b = q.shape[:2]
        if q.dim() != 4 or kv.shape != (s, b, q.shape[3]) or selected.dim() != 3 or selected.shape[:2] != (b, s):
            raise ValueError(f"expected q [s, b, h, d], kv [s, b, d] and selected [b, s, k]; got q {tuple(q.shape)}, "
                             f"kv {tuple(kv.shape)}, selected {tuple(selected.shape)}")
        if not 0 < v_head_dim <= q.shape[3]:
            raise ValueError(f"v_head_dim ({v_head_dim}) must be in 1..{q.shape[3]}")
        self.plan = KeyRingSchedule(s, q.device, group=group, layout=layout, mode=mode, positions=positions,
                            query_tile=query_tile)
        self.scale, self.d_v, self.selected = softmax_scale, v_head_dim, selected.to(torch.int64)
        self.heads, self.path = q.shape[2], check_path(path)

    def tiles(self, block):
        """(query rows, `GatherTile` or `UnionTile`) of every tile that selected a key in ``block``."""
        for rows in self.plan.tiles:
            for part in query_tiles(rows, self.heads, self.path):
                tile = plan_tile(block, self.selected[:, part], self.heads, self.path)
                if tile is not None:
                    yield part, tile


def sparse_forward(args: _Args, q, kv):
    """q [b, s, h, d], kv [s, b, d] -> (out [b, s, h, d_v] in q.dtype, lse [b, s, h] fp32)."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(q.shape[:3] + (args.d_v,), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    merged = set()  # tiles with a result: a tile's first block is stored, not merged
    for block in key_blocks(args.plan, kv):
        for rows, tile in args.tiles(block):
            o, l = tile.forward(q[:, rows], args.scale, args.d_v)
            if rows.start in merged:
                update_out_and_lse(out.transpose(1, 2), lse.transpose(1, 2), o.transpose(1, 2), l.transpose(1, 2),
                                   rows)
            else:
                out[:, rows], lse[:, rows] = o, l
                merged.add(rows.start)
    return out.to(q.dtype), lse


def sparse_backward(args: _Args, dout, q, kv, out, lse):
    """(dq [b, s, h, d], dkv [s, b, d]) of `sparse_forward`."""
    acc = accum_dtype(q.dtype)
    dq, dkv = torch.zeros(q.shape, dtype=acc, device=q.device), []
    for block, dblock in key_blocks_with_grads(args.plan, kv, acc, dkv):
        for rows, tile in args.tiles(block):
            dq[:, rows] += tile.backward(dout[:, rows], q[:, rows], out[:, rows], lse[:, rows], args.scale, args.d_v,
                                         dblock)
    return dq.to(q.dtype), dkv[0].to(kv.dtype)


class SparseAttnFunc(torch.autograd.Function):
    # [s, b, ...] <-> [b, s, ...]: a view at b = 1, so a tile's queries and heads are one [T h, d] matrix
    @staticmethod
    def forward(ctx, q, kv, args):
        out, lse = sparse_forward(args, q.transpose(0, 1), kv)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.args = args
        return out.transpose(0, 1)  # [s, b, h, d_v]

    @staticmethod
    def backward(ctx, dout):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = sparse_backward(ctx.args, dout.transpose(0, 1), q.transpose(0, 1), kv, out, lse)
        return dq.transpose(0, 1), dkv, None


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
                     query_tile: int = DEFAULT_QUERY_TILE, path: str = "auto") -> torch.Tensor:
    """Each query of this CP rank attends to its ``selected`` keys of the whole sequence (MQA mode).

    q [s, b, h, d]: this rank's queries (in the latent's space: module docstring); kv [s, b, d]: this rank's
    keys, one per token for every head, whose first ``v_head_dim`` values are the value; ``selected``
    [b, s, k]: each query's keys as global positions, -1 padding (`indexer_topk`'s first result).
    ``group``: the CP group (None: one process holds the sequence); ``mode``: ``ring`` (``layout`` zigzag or
    contiguous: the ring's own positions) or ``all_gather`` (any layout, given ``positions`` [s], the global
    positions of this rank's tokens). Returns out [s, b, h, v_head_dim] in q's dtype; differentiable in q
    and kv. ``path``: how tiles read their keys (`cp_ext.attention.dsa.sparse_tiles`): ``auto`` picks per tile
    by the count, ``gather`` or ``union`` force one (the same result up to float rounding).
    """
    args = _Args(q, kv, selected, softmax_scale, v_head_dim, group, layout, mode, positions, query_tile, path)
    return SparseAttnFunc.apply(q, kv, args)
