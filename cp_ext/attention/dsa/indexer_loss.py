"""DeepSeek-V3.2's indexer loss under context parallelism, tile by tile, never an [s, s] matrix.

The lightning indexer learns to predict where the main attention looks (the V3.2 paper, section 2.1;
megatron-core's ``compute_dsa_indexer_loss``). For query t over its *support* S(t) (every causal key:
the dense loss; the indexer's selected keys: ``--dsa-indexer-use-sparse-loss``)::

    P(t, j) = (1/h) sum_heads softmax_S(t)(scale * q_h(t) . k(j))      the target: heads summed, L1-normalised
    Q(t, j) = softmax_S(t)(I(t, j)),   I(t, j) = sum_H w(t, H) ReLU(q_I(t, H) . k_I(j))
    KL(t)   = sum_j P log P - P log Q
    loss    = loss_coeff * mean over the batch and every query of the sequence of KL(t)

The main model's query and key come in detached: the indexer gets its gradient from this loss only, and
the main model none from it (megatron's ``query.detach(), key.detach()``).

**Two walks over the keys** (`cp_ext.attention.dsa.key_block_ring`: ring blocks, or one all-gather; each
message is a token's MLA latent key and its indexer key, ``[kv | k_I]``). The first finds every query's
final softmax normalisers, each head's attention's and the indexer's, as a running (max, sum of exp) per
row (`_RunningSoftmax`: it rounds like a softmax over the whole row; an LSE, with an error of its own size
in the exponent, gave gradients 2.5x less exact than megatron's dense fp32). The second recomputes each
tile's scores and, from the final normalisers, P and Q exactly; it adds up KL and, since the loss is a
scalar whose only differentiable inputs are the indexer's (q_I, w, k_I), their gradients too
(``dI = coeff / (b S) * (Q - P)`` on the support), so the backward is one multiplication by the
incoming gradient and no third walk. The indexer keys' gradient rides home with its block (ring) or is
reduce-scattered (all-gather), as dK/dV do in the ring's backward; the latent's is never formed.

Memory: one tile of ``query_tile`` queries against ``key_tile`` keys at a time (``[b, h, T, m]`` main
scores and ``[b, T, H, m]`` indexer terms), the running normalisers ``[b, h, s_local]``, and the indexer
inputs' gradients; the KL sum is kept in fp64 (one scalar: it rounds once, not per tile). Under tensor
parallelism (heads split) the target's head sum is one all-reduce of a ``[b, T, m]`` tile over
``tp_group``, as megatron all-reduces its ``[b, s, s]``.

**What a rank returns** is its share of the loss: ``loss_coeff * (sum of its queries' KL) / (b * S)``
with S the whole sequence's length, so the shares of the CP group add up to the CP = 1 loss, and the
gradients (each rank's indexer-parameter gradient, summed over the group by the data-parallel reduction)
to CP = 1's. megatron-core 0.19 divides by the local query count instead (its
``reduce_indexer_kl_sum``), which makes each rank's value CP times its share.

megatron-core 0.16.1 takes ``log(Q + 1e-10)`` where this takes ``log Q`` (as 0.19 does): the two differ
only where Q < ~1e-6, which the tests' models avoid (tests/attention/dsa/test_indexer_loss.py compares with both).
"""

from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.dsa.key_block_ring import KeyRingSchedule, key_blocks, key_blocks_with_grads, scatter_add
from cp_ext.attention.cp.primitives import accum_dtype

DEFAULT_QUERY_TILE = 128
DEFAULT_KEY_TILE = 1024  # one tile's main scores [b, h, 128, 1024] fp32: 64 MiB at b = 1, h = 128


class _Inputs:
    """This rank's inputs, in the dtype the loss is computed in, batch first: main query q [b, h, s, d],
    indexer query iq [b, s, H, D], weights iw [b, s, H]; and the key message [s, b, d + D]."""

    def __init__(self, q, kv, iq, iw, ik):
        s, b, h, d = q.shape
        if kv.shape != (s, b, d) or iq.dim() != 4 or iq.shape[:2] != (s, b) or iw.shape != iq.shape[:3] \
                or ik.shape != (s, b, iq.shape[3]):
            raise ValueError(f"expected q [s, b, h, d], kv [s, b, d], index q [s, b, H, D], weights [s, b, H] and "
                             f"index k [s, b, D]; got q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                             f"index q {tuple(iq.shape)}, weights {tuple(iw.shape)}, index k {tuple(ik.shape)}")
        acc = accum_dtype(q.dtype)
        self.acc, self.d, self.heads = acc, d, h
        self.q = q.detach().to(acc).permute(1, 2, 0, 3)
        self.iq, self.iw = iq.detach().to(acc).transpose(0, 1), iw.detach().to(acc).transpose(0, 1)
        self.msg = torch.cat([kv.detach().to(acc), ik.detach().to(acc)], dim=-1)


class _Chunk:
    """One tile of queries against up to ``key_tile`` keys of one block: ``keys`` shared by the tile's
    queries [b, m, w] (the dense loss: a run of the block) or per query [b, T, m, w] (the selection,
    gathered); ``valid`` [b, T, m] marks the support; ``where`` says which block rows they are."""

    def __init__(self, keys, valid, where):
        self.keys, self.valid, self.where = keys, valid, where
        self.shared = keys.dim() == 3

    def scores(self, x: _Inputs, rows: slice, scale: float):
        """(main scores [b, h, T, m], the indexer's per-head q_I . k_I [b, T, H, m], I [b, T, m]); -inf off
        the support in both scores."""
        kv, ik = self.keys[..., :x.d], self.keys[..., x.d:]
        k_dims = "bmd" if self.shared else "btmd"
        att = torch.einsum(f"bhtd,{k_dims}->bhtm", x.q[:, :, rows], kv).mul_(scale)
        per_head = torch.einsum(f"bthd,{k_dims}->bthm", x.iq[:, rows], ik)
        index = torch.einsum("bth,bthm->btm", x.iw[:, rows], per_head.relu())
        off = ~self.valid
        return att.masked_fill_(off.unsqueeze(1), float("-inf")), per_head, index.masked_fill_(off, float("-inf"))


def _chunks(block, plan: KeyRingSchedule, rows: slice, selected: Optional[torch.Tensor], key_tile: int):
    """The tile's support in ``block``, ``key_tile`` keys at a time."""
    b = block.msg.shape[0]
    if selected is not None:
        cols = block.selected_columns(selected[:, rows])
        if cols is None:
            return
        for j in range(0, cols.shape[-1], key_tile):
            part = cols[..., j:j + key_tile]
            yield _Chunk(block.gather(part), part >= 0, part)
        return
    q_positions = plan.positions[rows]
    for j in range(0, block.positions.numel(), key_tile):
        causal = block.positions[j:j + key_tile].view(1, -1) <= q_positions.view(-1, 1)  # [T, m]
        if causal.any():
            yield _Chunk(block.msg[:, j:j + key_tile], causal.unsqueeze(0).expand(b, -1, -1), slice(j, j + key_tile))


class _RunningSoftmax:
    """Each row's softmax normaliser over key chunks that arrive one at a time, as (max, sum of exp(x - max)):
    the probabilities are then ``exp(x - max) / sum``, which rounds like a softmax over the whole row
    (an LSE, ``exp(x - lse)``, carries an error of lse's size in the exponent)."""

    def __init__(self, shape, dtype, device):
        self.max = torch.full(shape, float("-inf"), dtype=dtype, device=device)
        self.sum = torch.zeros(shape, dtype=dtype, device=device)

    def add(self, x: torch.Tensor, rows: slice) -> None:
        """Take in scores ``x`` [..., T, m] (-inf off the support) of the rows ``rows`` (the last state dim)."""
        old = self.max[..., rows]
        new = torch.maximum(old, x.amax(dim=-1))
        base = torch.where(new == float("-inf"), 0.0, new)  # a row with no key yet: nothing to rescale
        self.sum[..., rows] = self.sum[..., rows] * torch.exp(old - base) + torch.exp(x - base.unsqueeze(-1)).sum(-1)
        self.max[..., rows] = new

    def probs(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """The final probabilities of ``x`` [..., T, m]; 0 off the support."""
        return torch.exp(x - self.max[..., rows, None]) / self.sum[..., rows, None]

    def log_probs(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        return x - self.max[..., rows, None] - torch.log(self.sum[..., rows, None])


def _normalisers(plan, x: _Inputs, selected, scale, key_tile):
    """Pass 1: every query's final softmax normalisers over its support: each head's attention [b, h, s]
    and the indexer's [b, s]."""
    b, h, s = x.q.shape[:3]
    att_norm = _RunningSoftmax((b, h, s), x.acc, x.q.device)
    index_norm = _RunningSoftmax((b, s), x.acc, x.q.device)
    for block in key_blocks(plan, x.msg):
        for rows in plan.tiles:
            for chunk in _chunks(block, plan, rows, selected, key_tile):
                att, _, index = chunk.scores(x, rows, scale)
                att_norm.add(att, rows)
                index_norm.add(index, rows)
    return att_norm, index_norm


def _index_score_grad(q, target, valid):
    """d KL / d I = Q - P on the support (the log-softmax's gradient; P does not depend on I)."""
    return torch.where(valid, q - target, 0.0)


def _kl_and_grads(plan, x: _Inputs, selected, scale, key_tile, att_norm, index_norm, total_heads, tp_group,
                  factor, want_grads):
    """Pass 2: this rank's KL sum, and (``want_grads``) the gradients of ``factor * KL`` in (iq, iw, ik)."""
    kl = torch.zeros((), dtype=torch.float64, device=x.q.device)  # a sum of b s s terms: kept in fp64, it rounds once
    diq, diw, dik = torch.zeros_like(x.iq), torch.zeros_like(x.iw), []
    index_width = x.iq.shape[-1]
    for block, dblock in key_blocks_with_grads(plan, x.msg, x.acc, dik, grad_width=index_width):
        for rows in plan.tiles:
            for chunk in _chunks(block, plan, rows, selected, key_tile):
                att, per_head, index = chunk.scores(x, rows, scale)
                target = att_norm.probs(att, rows).sum(1).div_(total_heads)  # [b, T, m]
                if tp_group is not None and dist.get_world_size(tp_group) > 1:
                    dist.all_reduce(target, group=tp_group)  # the heads of the other TP ranks
                log_q = index_norm.log_probs(index, rows)
                terms = torch.special.xlogy(target, target) - target * log_q
                kl += torch.where(chunk.valid, terms, 0.0).sum(dtype=torch.float64)
                if not want_grads:
                    continue
                d_index = _index_score_grad(index_norm.probs(index, rows), target, chunk.valid)
                d_index = d_index.mul_(factor).unsqueeze(2)  # [b, T, 1, m]
                iw = x.iw[:, rows]
                diw[:, rows] += (d_index * per_head.relu()).sum(-1)
                d_per_head = (d_index * iw.unsqueeze(-1)).masked_fill_(per_head <= 0, 0.0)  # [b, T, H, m]
                ik = chunk.keys[..., x.d:]
                if chunk.shared:
                    diq[:, rows] += torch.einsum("bthm,bmd->bthd", d_per_head, ik)
                    dblock[:, chunk.where] += torch.einsum("bthm,bthd->bmd", d_per_head, x.iq[:, rows])
                else:
                    diq[:, rows] += torch.einsum("bthm,btmd->bthd", d_per_head, ik)
                    scatter_add(dblock, chunk.where, torch.einsum("bthm,bthd->btmd", d_per_head, x.iq[:, rows]))
    return kl, (diq, diw, dik[0])


class _IndexerLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, iq, iw, ik, q, kv, settings):
        x = _Inputs(q, kv, iq, iw, ik)
        plan, selected, scale, coeff, key_tile, tp_group = settings
        b = x.q.shape[0]
        total_heads = x.heads * (1 if tp_group is None else dist.get_world_size(tp_group))
        factor = coeff / (b * plan.seq_len)
        att_norm, index_norm = _normalisers(plan, x, selected, scale, key_tile)
        want_grads = any(ctx.needs_input_grad[:3])
        kl, grads = _kl_and_grads(plan, x, selected, scale, key_tile, att_norm, index_norm, total_heads, tp_group,
                                  factor, want_grads)
        if want_grads:  # [b, s, ...] -> the inputs' [s, b, ...], dtypes
            diq, diw, dik = grads
            ctx.save_for_backward(diq.transpose(0, 1).to(iq.dtype), diw.transpose(0, 1).to(iw.dtype),
                                  dik.to(ik.dtype))
        return (kl * factor).to(q.dtype if q.dtype == torch.float64 else torch.float32)

    @staticmethod
    def backward(ctx, grad):
        diq, diw, dik = ctx.saved_tensors
        return diq * grad, diw * grad, dik * grad, None, None, None


def indexer_loss(q: torch.Tensor, kv: torch.Tensor, index_q: torch.Tensor, index_weights: torch.Tensor,
                 index_k: torch.Tensor, *, softmax_scale: float, loss_coeff: float,
                 selected: Optional[torch.Tensor] = None, group: Optional[dist.ProcessGroup] = None,
                 layout: str = "zigzag", mode: str = "ring", positions: Optional[torch.Tensor] = None,
                 tp_group: Optional[dist.ProcessGroup] = None, query_tile: int = DEFAULT_QUERY_TILE,
                 key_tile: int = DEFAULT_KEY_TILE) -> torch.Tensor:
    """This CP rank's share of the indexer loss (module docstring): a scalar, fp32 (fp64 for fp64 inputs),
    differentiable in the indexer's ``index_q`` [s, b, H, D], ``index_weights`` [s, b, H] (with megatron's
    scaling already in them, as `cp_ext.attention.dsa.indexer.index_scores` takes them) and ``index_k``
    [s, b, D]; ``q`` [s, b, h, d] and ``kv`` [s, b, d] are the main attention's query and key in MLA's MQA
    mode (`cp_ext.attention.dsa.sparse_attention`), taken detached.

    ``selected`` [b, s, k]: the indexer's choice (global positions, -1 padding) for the sparse loss; None
    for the dense loss over every causal key. ``group``, ``layout``, ``mode``, ``positions``: where this
    rank's tokens are, as for `cp_ext.attention.dsa.sparse_attention.sparse_attention`. ``tp_group``: the tensor-parallel
    group that holds the other heads of ``q`` (None: this rank has them all).
    """
    s = q.shape[0]
    plan = KeyRingSchedule(s, q.device, group=group, layout=layout, mode=mode, positions=positions, query_tile=query_tile)
    if key_tile < 1:
        raise ValueError(f"key_tile ({key_tile}) must be >= 1")
    if selected is not None:
        if selected.dim() != 3 or selected.shape[:2] != (q.shape[1], s):
            raise ValueError(f"expected selected [b, s, k] = [{q.shape[1]}, {s}, k]; got {tuple(selected.shape)}")
        selected = selected.to(device=q.device, dtype=torch.int64)
    settings = (plan, selected, softmax_scale, loss_coeff, key_tile, tp_group)
    return _IndexerLoss.apply(index_q, index_weights, index_k, q, kv, settings)
