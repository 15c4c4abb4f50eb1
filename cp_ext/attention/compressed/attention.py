"""DeepSeek-V4's core attention on one rank: the sliding window and the compressed entries in one softmax.

For a query ``t`` with heads ``q_h`` and one K=V head::

    keys(t) = window(t) + entries(t)          window(t) = { j : t - W < j <= t, same document }
    out_h(t) = sum_k softmax_k( [q_h . k * scale for k in keys(t)] + [sink_h] ) * k     (the sink drops out)

(without sinks the softmax is over the keys alone).

``entries(t)``: HCA, every complete entry of the document with key position <= t; CSA, the indexer's
selection (`selection.select_entries`); sliding layers, none. This is transformers'
``eager_attention_forward`` with V4's sliding mask and block bias. Computed per tile of queries in
the accumulation dtype (fp32, fp64 for fp64 inputs) with torch autograd: a tile's window keys are
one slice of this rank's key table (its own rows and the fetched halo, in position order).
"""

from typing import Optional

import torch


def attend(q: torch.Tensor, q_positions: torch.Tensor, q_docs: torch.Tensor, keys: torch.Tensor,
           key_positions: torch.Tensor, key_docs: torch.Tensor, sinks: torch.Tensor, *, window: int, scale: float,
           entries: Optional[torch.Tensor] = None, entry_positions: Optional[torch.Tensor] = None,
           entry_docs: Optional[torch.Tensor] = None, selection: Optional[torch.Tensor] = None,
           query_tile: int = 256) -> torch.Tensor:
    """q [s, H, D] (accumulation dtype) at ``q_positions`` [s] -> out [s, H, D].

    ``keys`` [K, D] at ``key_positions`` (increasing); ``*_docs``: each row's document start (padding: a
    value no query shares); ``sinks`` [H], or None (no sink). ``entries`` [E, D] at ``entry_positions`` (increasing): read densely (HCA), or
    through ``selection`` [s, k] (CSA, -1 unused)."""
    outs = []
    sink = None if sinks is None else sinks.to(q.dtype).view(-1, 1, 1)
    for r0 in range(0, q.shape[0], query_tile):
        rows = slice(r0, min(q.shape[0], r0 + query_tile))
        qt, t, td = q[rows], q_positions[rows].view(-1, 1), q_docs[rows].view(-1, 1)
        lo = int(torch.searchsorted(key_positions, int(t.min()) - window + 1))
        hi = int(torch.searchsorted(key_positions, int(t.max()), right=True))
        kw, kp = keys[lo:hi], key_positions[lo:hi].view(1, -1)
        seen = (kp <= t) & (kp > t - window) & (key_docs[lo:hi].view(1, -1) == td)
        logits = [torch.einsum("thd,kd->htk", qt, kw).mul(scale).masked_fill(~seen, float("-inf"))]
        values = [kw]
        if entries is not None and selection is None:  # HCA: every readable entry
            hi_e = int(torch.searchsorted(entry_positions, int(t.max()), right=True))
            ke, ep = entries[:hi_e], entry_positions[:hi_e].view(1, -1)
            seen_e = (ep <= t) & (entry_docs[:hi_e].view(1, -1) == td)
            logits.append(torch.einsum("thd,ed->hte", qt, ke).mul(scale).masked_fill(~seen_e, float("-inf")))
            values.append(ke)
        elif entries is not None:  # CSA: each query's own selection
            chosen = selection[rows]
            picked = entries[chosen.clamp(min=0)]  # [T, k, D]
            logits.append(torch.einsum("thd,tkd->htk", qt, picked).mul(scale).masked_fill(chosen < 0, float("-inf")))
        if sink is not None:
            logits.append(sink.expand(-1, qt.shape[0], 1))
        else:  # a padding query reads nothing: a zero logit of its own keeps its softmax finite and its output 0
            nothing = torch.stack([(x == float("-inf")).all(-1) for x in logits]).all(0)
            logits.append(torch.zeros_like(nothing, dtype=qt.dtype).masked_fill(~nothing, float("-inf")).unsqueeze(-1))
        probs = torch.cat(logits, dim=-1).softmax(dim=-1)
        out = torch.einsum("htk,kd->thd", probs[..., :kw.shape[0]], kw)
        if entries is not None and selection is None:
            out = out + torch.einsum("hte,ed->thd", probs[..., kw.shape[0]:-1], values[1])
        elif entries is not None:
            out = out + torch.einsum("htk,tkd->thd", probs[..., kw.shape[0]:-1], picked)
        outs.append(out)
    return torch.cat(outs, dim=0)
