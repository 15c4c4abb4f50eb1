"""DeepSeek-V4's core attention on one rank: the sliding window and the compressed entries in one softmax.

For a query ``t`` with heads ``q_h`` and one K=V head::

    keys(t) = window(t) + entries(t)          window(t) = { j : t - W < j <= t, same document }
    out_h(t) = sum_k softmax_k( [q_h . k * scale for k in keys(t)] + [sink_h] ) * k     (the sink drops out)

(without sinks the softmax is over the keys alone).

``entries(t)``: HCA, every complete entry of the document with key position <= t; CSA, the indexer's
selection (`selection.select_entries`), read as DSA's sparse attention reads its keys
(`cp_ext.attention.dsa.sparse_tiles`): each query's own entries gathered, or the union of the tile's
selections once with the unselected masked, whichever the count says is cheaper; sliding layers, none.
This is transformers' ``eager_attention_forward`` with V4's sliding mask and block bias. Computed per tile
of queries in the accumulation dtype (fp32, fp64 for fp64 inputs) with torch autograd: a tile's window keys are
one slice of this rank's key table (its own rows and the fetched halo, in position order), and each
tile is recomputed in the backward (`torch.utils.checkpoint`), so what stays alive between the passes
is the inputs, not a tile's scores or CSA's gathered entries (query_tile x topk x D values a tile).
"""

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from cp_ext.attention.dsa.sparse_tiles import Union


def attend(q: torch.Tensor, q_positions: torch.Tensor, q_docs: torch.Tensor, keys: torch.Tensor,
           key_positions: torch.Tensor, key_docs: torch.Tensor, sinks: torch.Tensor, *, window: int, scale: float,
           entries: Optional[torch.Tensor] = None, entry_positions: Optional[torch.Tensor] = None,
           entry_docs: Optional[torch.Tensor] = None, selection: Optional[torch.Tensor] = None,
           query_tile: int = 256, sparse_path: str = "auto") -> torch.Tensor:
    """q [s, H, D] (accumulation dtype) at ``q_positions`` [s] -> out [s, H, D].

    ``keys`` [K, D] at ``key_positions`` (increasing); ``*_docs``: each row's document start (padding: a
    value no query shares); ``sinks`` [H], or None (no sink). ``entries`` [E, D] at ``entry_positions``
    (increasing): read densely (HCA), or through ``selection`` [s, k] (CSA, -1 unused), each tile by
    ``sparse_path`` (``auto``, ``gather``, ``union``)."""
    outs = []
    sink = None if sinks is None else sinks.to(q.dtype).view(-1, 1, 1)
    for r0 in range(0, q.shape[0], query_tile):
        rows = slice(r0, min(q.shape[0], r0 + query_tile))
        t = q_positions[rows]
        lo = int(torch.searchsorted(key_positions, int(t.min()) - window + 1))
        hi = int(torch.searchsorted(key_positions, int(t.max()), right=True))
        dense_entries = entries is not None and selection is None
        hi_e = int(torch.searchsorted(entry_positions, int(t.max()), right=True)) if dense_entries else 0
        tile = _Tile(window, scale, t, q_docs[rows], key_positions[lo:hi], key_docs[lo:hi],
                     None if not dense_entries else entry_positions[:hi_e],
                     None if not dense_entries else entry_docs[:hi_e],
                     None if selection is None else selection[rows], sparse_path,
                     0 if entries is None else entries.shape[0])
        ke = None if entries is None else (entries[:hi_e] if dense_entries else entries)
        args = (q[rows], keys[lo:hi], ke, sink)
        # the tile's scores, probabilities and (CSA) gathered entries are recomputed in the backward, not kept:
        # a CSA tile gathers query_tile x topk x D values
        outs.append(checkpoint(tile, *args, use_reentrant=False) if torch.is_grad_enabled() else tile(*args))
    return torch.cat(outs, dim=0)


class _Tile:
    """One tile of queries: the window's keys and the entries in one softmax (the masks from positions)."""

    def __init__(self, window, scale, t, t_docs, key_positions, key_docs, entry_positions, entry_docs, chosen,
                 sparse_path="auto", n_entries=0):
        self.window, self.scale, self.chosen, self.path = window, scale, chosen, sparse_path
        self.union = None if chosen is None or sparse_path == "gather" else Union(chosen.unsqueeze(0), n_entries)
        t, td = t.view(-1, 1), t_docs.view(-1, 1)
        kp = key_positions.view(1, -1)
        self.seen = (kp <= t) & (kp > t - window) & (key_docs.view(1, -1) == td)
        self.seen_entries = None
        if entry_positions is not None:
            ep = entry_positions.view(1, -1)
            self.seen_entries = (ep <= t) & (entry_docs.view(1, -1) == td)

    def __call__(self, qt, kw, ke, sink):
        logits = [torch.einsum("thd,kd->htk", qt, kw).mul(self.scale).masked_fill(~self.seen, float("-inf"))]
        picked = None
        if self.seen_entries is not None:  # HCA (and CSA's dense mode): every readable entry
            logits.append(torch.einsum("thd,ed->hte", qt, ke).mul(self.scale)
                          .masked_fill(~self.seen_entries, float("-inf")))
        elif self.chosen is not None and self._union(qt.shape[1]):  # CSA: the tile's union, one GEMM
            union = ke[self.union.rows[0]]  # [u, D]
            logits.append(torch.einsum("thd,ud->htu", qt, union).mul(self.scale)
                          .masked_fill(~self.union.mask[0], float("-inf")))
        elif self.chosen is not None:  # CSA: each query's own selection
            picked = ke[self.chosen.clamp(min=0)]  # [T, k, D]
            logits.append(torch.einsum("thd,tkd->htk", qt, picked).mul(self.scale)
                          .masked_fill(self.chosen < 0, float("-inf")))
        if sink is not None:
            logits.append(sink.expand(-1, qt.shape[0], 1))
        else:  # a padding query reads nothing: a zero logit of its own keeps its softmax finite and its output 0
            nothing = torch.stack([(x == float("-inf")).all(-1) for x in logits]).all(0)
            logits.append(torch.zeros_like(nothing, dtype=qt.dtype).masked_fill(~nothing, float("-inf")).unsqueeze(-1))
        probs = torch.cat(logits, dim=-1).softmax(dim=-1)
        out = torch.einsum("htk,kd->thd", probs[..., :kw.shape[0]], kw)
        if self.seen_entries is not None:
            out = out + torch.einsum("hte,ed->thd", probs[..., kw.shape[0]:kw.shape[0] + ke.shape[0]], ke)
        elif picked is not None:
            out = out + torch.einsum("htk,tkd->thd", probs[..., kw.shape[0]:kw.shape[0] + picked.shape[1]], picked)
        elif self.chosen is not None:
            out = out + torch.einsum("htu,ud->thd", probs[..., kw.shape[0]:kw.shape[0] + union.shape[0]], union)
        return out

    def _union(self, heads: int) -> bool:
        """Read the selected entries through the tile's union (`sparse_tiles.Union`, the count's choice)."""
        return self.union is not None and (self.path == "union" or self.union.cheaper_than_gather(heads))
