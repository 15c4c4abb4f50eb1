"""CSA's lightning indexer over compressed entries: each query's top-k entries, exact on every layout.

Query ``t`` scores every entry it may read (complete, same document, key position <= t)::

    I(t, e) = sum_h w(t, h) * ReLU(q_I(t, h) . k_I(e))

(``w`` already holds transformers' ``index_n_heads ** -0.5`` and ``index_head_dim ** -0.5``) and keeps
the best ``index_topk``. **Ties** (V4's ReLU makes exact-zero scores common): on equal scores the
earlier entry wins, and ``-0.0`` ties ``0.0``. The entries are gathered in key-position order on
every rank and the order is total on (score, position), so every CP layout, size and tile selects
the same entries (`cp_ext.attention.dsa.indexer.RunningTopK`, DSA's merge, reused). A query with
fewer readable entries than ``index_topk`` keeps them all. Not differentiable (selection is not).
"""

import torch

from cp_ext.attention.dsa.indexer import RunningTopK, index_scores
from cp_ext.attention.cp.primitives import accum_dtype


def select_entries(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_positions: torch.Tensor,
                   key_docs: torch.Tensor, q_positions: torch.Tensor, q_docs: torch.Tensor, topk: int,
                   query_tile: int = 256, key_tile: int = 4096) -> torch.Tensor:
    """q [s, Hi, Di], w [s, Hi], keys [E, Di] at ``key_positions`` [E] (increasing) -> [s, k] entry indices
    (into ``keys``), best first, -1 where a query has fewer than k readable entries; k = min(topk, E).

    ``key_docs`` / ``q_docs``: document of each entry / query (a query reads only its own document's)."""
    s, count = q.shape[0], keys.shape[0]
    k = min(topk, count)
    if k == 0:
        return torch.full((s, 0), -1, dtype=torch.int64, device=q.device)
    with torch.no_grad():
        state = RunningTopK(1, q_positions, k, accum_dtype(q.dtype))
        for r0 in range(0, s, query_tile):
            rows = slice(r0, min(s, r0 + query_tile))
            last = int(q_positions[rows].max())
            for c0 in range(0, count, key_tile):
                cols = slice(c0, min(count, c0 + key_tile))
                if int(key_positions[cols][0]) > last:
                    break
                scores = index_scores(q[None, rows], w[None, rows], keys[None, cols])
                other = key_docs[cols].view(1, 1, -1) != q_docs[rows].view(1, -1, 1)
                state.add(scores.masked_fill_(other, float("-inf")), key_positions[cols], rows)
        positions, values = state.result()
        index = torch.searchsorted(key_positions, positions[0].clamp(min=0))
        return torch.where(values[0] == float("-inf"), torch.full_like(index, -1), index)
