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

**Sparse tiles.** For a tile of ``query_tile`` queries and one key block (a ring step's block, or the
gathered sequence), each query's selected keys that lie in the block are looked up (global position ->
block row), compacted to the tile's largest count ``m``, and gathered: ``[b, T, m, d_qk]``, scored
``[b, h, T, m]`` in fp32, and merged into the running (out, LSE) with the LSE rule
(`cp_ext.attention.cp.primitives.update_out_and_lse`). A tile with no selected key in the block computes
nothing. The backward recomputes each tile's probabilities from the final LSE (as the dense ring does),
and scatter-adds the gathered keys' gradient into the block's gradient, which rides home with the block
(ring) or is reduce-scattered (all-gather). Every query has at least one selected key (itself), so no
row is empty once all blocks are in.

**Exactness.** Which keys a query attends to is the selection alone (``selected``: global positions,
-1 for padding), the same on every layout; causality is in the selection. The result differs from a
dense masked attention only by float rounding (tests/attention/dsa/test_sparse_attention.py: against float64).
"""

from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.dsa.key_block_ring import KeyRingSchedule, key_blocks, key_blocks_with_grads, scatter_add
from cp_ext.attention.cp.primitives import accum_dtype, update_out_and_lse

DEFAULT_QUERY_TILE = 256  # one tile's gathered keys: [b, 256, m, d_qk]; 1.2 GiB fp32 at k = m = 2048, d_qk = 576


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


class _Args:
    """What forward and backward share: where this rank's queries and keys are, the selection, the scale."""

    def __init__(self, q, kv, selected, softmax_scale, v_head_dim, group, layout, mode, positions, query_tile):
        s, b = q.shape[:2]
        if q.dim() != 4 or kv.shape != (s, b, q.shape[3]) or selected.dim() != 3 or selected.shape[:2] != (b, s):
            raise ValueError(f"expected q [s, b, h, d], kv [s, b, d] and selected [b, s, k]; got q {tuple(q.shape)}, "
                             f"kv {tuple(kv.shape)}, selected {tuple(selected.shape)}")
        if not 0 < v_head_dim <= q.shape[3]:
            raise ValueError(f"v_head_dim ({v_head_dim}) must be in 1..{q.shape[3]}")
        self.plan = KeyRingSchedule(s, q.device, group=group, layout=layout, mode=mode, positions=positions,
                            query_tile=query_tile)
        self.scale, self.d_v, self.selected = softmax_scale, v_head_dim, selected.to(torch.int64)


def sparse_forward(args: _Args, q, kv):
    """q [b, h, s, d], kv [s, b, d] -> (out [b, h, s, d_v] in q.dtype, lse [b, h, s] fp32)."""
    acc = accum_dtype(q.dtype)
    out = torch.zeros(q.shape[:3] + (args.d_v,), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    for block in key_blocks(args.plan, kv):
        for rows in args.plan.tiles:
            cols = block.selected_columns(args.selected[:, rows])
            if cols is not None:
                o, l = _tile_forward(q[:, :, rows], block.gather(cols), cols, args.scale, args.d_v)
                update_out_and_lse(out, lse, o, l, rows)
    return out.to(q.dtype), lse


def sparse_backward(args: _Args, dout, q, kv, out, lse):
    """(dq [b, h, s, d], dkv [s, b, d]) of `sparse_forward`."""
    acc = accum_dtype(q.dtype)
    dq, dkv = torch.zeros(q.shape, dtype=acc, device=q.device), []
    for block, dblock in key_blocks_with_grads(args.plan, kv, acc, dkv):
        for rows in args.plan.tiles:
            cols = block.selected_columns(args.selected[:, rows])
            if cols is not None:
                dq_t, dkeys = _tile_backward(dout[:, :, rows], q[:, :, rows], out[:, :, rows], lse[:, :, rows],
                                             block.gather(cols), cols, args.scale, args.d_v)
                dq[:, :, rows] += dq_t
                scatter_add(dblock, cols, dkeys)
    return dq.to(q.dtype), dkv[0].to(kv.dtype)


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
