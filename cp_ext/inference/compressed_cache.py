"""DeepSeek-V4's generation cache, sharded over the CP group, and a decode step on it.

A V4 layer's query at position ``t`` reads the K=V rows of its window (``t - W < j <= t``) and the compressed
entries of complete blocks (HCA: all of them; CSA: the indexer's top-k; sliding layers: none;
`cp_ext.attention.compressed`). The prefill runs the training layout (`compressed_attention` hands each rank
its share as `Kept`); then CP rank r holds, per V4 layer:

    window       its own tokens' K=V rows that a later query's window still reaches (rotated)
    entries      the entries it formed (their blocks' last tokens were its), CSA's indexer keys beside them
    open block   the compressor rows of the block not complete yet and, for CSA, of the block before it
                 (the overlap half the next entry pools): the same rows on every rank

which is what transformers' V4 cache keeps on one device (the window, the compressor's and indexer's
entries, the open block's projections, CSA's overlap state), the entries and the window split over the CP
group. The window is at most W rows in all and an entry is one per ``m`` tokens, so a rank's share of a
million-token cache is about 1/C of 2^20/m entries per compressed layer.

A decoded token (the same hidden state on every rank) is dealt round robin: rank ``n mod C`` keeps the n-th
decoded token's K=V row, and forms (and keeps) the entry of a block that token completes. Every rank appends
the token's compressor rows to the open block, so whichever rank's turn it is has the block's rows. One step::

    1. every rank appends the token's compressor rows; the rank whose turn it is keeps its K=V row and, if
       ``t`` ends a block, forms that entry from the open block (`form_entries`, as the prefill forms them)
    2. CSA: each rank scores its entries' indexer keys and keeps its top-k candidates; one all-gather over
       the CP group, merged in the order every layout uses (score descending, then position ascending:
       `cp_ext.inference.dsa_decode.global_topk`): exactly the entries one rank holding them all would pick
    3. each rank: one softmax of the query over its window rows and its (chosen) entries -> (out, lse)
    4. all-gather (out, lse) over the CP group, LSE merge in rank order (`merge_partials`); the sinks enter
       after the merge, as in training

Per token and V4 layer a rank sends ``H x (D + 1)`` values of (out, lse) to each of the C - 1 others, and
on a CSA layer ``2k`` values of candidates (k = --dsa-indexer-topk), whatever the sequence's length.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from cp_ext.attention.compressed import Compressor
from cp_ext.attention.compressed.compressor import form_entries
from cp_ext.attention.compressed.context_parallel import CompressedAttentionSpec, Kept
from cp_ext.attention.cp.primitives import accum_dtype, add_sink
from cp_ext.attention.dsa.indexer import RunningTopK, index_scores
from cp_ext.attention.masks.documents import gather_parts
from cp_ext.inference.dsa_decode import global_topk
from cp_ext.inference.kv_cache import merge_partials


class _Rows:
    """Rows [n, F] at increasing positions: appended one at a time (the buffer doubles), dropped from the front."""

    def __init__(self, rows: torch.Tensor, positions: torch.Tensor):
        self.data, self.positions, self.length = rows, positions, rows.shape[0]

    def append(self, row: torch.Tensor, position: int) -> None:
        if self.length == self.data.shape[0]:
            grow = max(self.length, 16)
            self.data = torch.cat([self.data, self.data.new_empty((grow,) + tuple(self.data.shape[1:]))])
            self.positions = torch.cat([self.positions, self.positions.new_empty(grow)])
        self.data[self.length], self.positions[self.length] = row, position
        self.length += 1

    def view(self):
        return self.data[:self.length], self.positions[:self.length]

    def drop_before(self, first: int) -> None:
        """Keep the rows at positions >= ``first``."""
        rows, positions = self.view()
        keep = positions >= first
        if not bool(keep.all()):
            self.data, self.positions = rows[keep].clone(), positions[keep].clone()
            self.length = self.data.shape[0]

    def nbytes(self) -> int:
        return self.length * self.data[:1].nelement() * self.data.element_size()


def open_block_start(next_position: int, rate: int, overlap: bool) -> int:
    """The first position whose compressor rows the next entry pools: the start of the block that holds
    ``next_position`` (the next token), a block earlier for CSA's overlap."""
    return max(next_position // rate * rate - (rate if overlap else 0), 0)


def _group(group):
    size = 1 if group is None else dist.get_world_size(group)
    return size, 0 if size == 1 else dist.get_rank(group)


class CompressedLayerCache:
    """One V4 layer's share on this CP rank (see the module docstring); ``rate`` None on a sliding layer."""

    def __init__(self, spec: CompressedAttentionSpec, rate: Optional[int], group, window: _Rows,
                 entries: Optional[_Rows] = None, open_rows: Optional[_Rows] = None):
        self.spec, self.rate, self.group = spec, rate, group
        self.size, self.rank = _group(group)
        self.window, self.entries, self.open = window, entries, open_rows

    @classmethod
    def from_prefill(cls, kept: Kept, spec: CompressedAttentionSpec, rate: Optional[int], group):
        """This rank's share after a prefill of ``kept.length`` tokens (one document, positions from 0)."""
        n, order = kept.length, kept.positions.argsort()
        positions = kept.positions[order]
        seen = positions > n - spec.window  # what the next query's (t = n) window reaches, and every later one's
        window = _Rows(kept.kv[order][seen], positions[seen])
        if rate is None:
            return cls(spec, None, group, window)
        entries = _Rows(kept.entries, kept.entry_positions.to(kept.entries.device))
        return cls(spec, rate, group, window, entries, _gather_open_block(kept, rate, spec.kind == "csa", group))

    @classmethod
    def empty(cls, spec: CompressedAttentionSpec, compressors: List[Compressor], group, kv: torch.Tensor):
        """Nothing prefilled (a prompt shorter than the CP layout splits): rows like ``kv`` [D] and the compressors'."""
        none = torch.empty(0, dtype=torch.int64, device=kv.device)
        window = _Rows(kv.new_empty(0, kv.shape[-1]), none)
        if not compressors:
            return cls(spec, None, group, window)
        rows = _token_rows(compressors)
        entries = rows.new_empty(0, sum(c.width for c in compressors))
        return cls(spec, compressors[0].rate, group, window, _Rows(entries, none),
                   _Rows(rows.new_empty(0, rows.numel()), none))

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in (self.window, self.entries, self.open) if part is not None)

    def step(self, q: torch.Tensor, kv: torch.Tensor, compressors: List[Compressor], sinks: Optional[torch.Tensor],
             index_q: Optional[torch.Tensor], index_w: Optional[torch.Tensor], position: int,
             turn: bool) -> torch.Tensor:
        """One token at ``position``: q [H, D] and its K=V row kv [D] (rotated), the layer's compressors (then its
        indexer's) holding the token's rows, CSA's indexer query [Hi, Di] (rotated) and head weights [Hi]; ``turn``:
        this rank keeps the token. Returns the attention [H, D] (not rotated back), the same on every rank."""
        if turn:
            self.window.append(kv, position)
        self.window.drop_before(position - self.spec.window + 1)
        if self.rate is not None:
            self._extend_open_block(_token_rows(compressors), compressors, position, turn)
        acc = accum_dtype(q.dtype)
        keys = [self.window.view()[0].to(acc)]
        if self.rate is not None:
            keys.append(self._readable_entries(index_q, index_w, position, compressors[0].width).to(acc))
        keys = torch.cat(keys)
        logits = (q.to(acc) @ keys.t()).mul_(self.spec.scale)  # [H, n]
        lse = torch.logsumexp(logits, dim=-1)  # -inf where this rank holds nothing the token reads
        out = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num_(0.0) @ keys
        out, lse = merge_partials(out[None, :, None], lse[None, :, None], self.group, self.size)
        out, _ = add_sink(out, lse, sinks)
        return out[0, :, 0].to(q.dtype)

    def _extend_open_block(self, rows, compressors, position, turn) -> None:
        """Append the token's compressor rows; if it completes a block, the owner forms and keeps the entry."""
        self.open.append(rows, position)
        if (position + 1) % self.rate:
            return
        if turn:
            table, table_positions = self.open.view()
            base = int(table_positions[0])
            # positions relative to the open block's first row: the document starts at -base
            key, start = (torch.tensor([p], device=table.device) for p in (position - base, -base))
            index = torch.arange(table.shape[0], device=table.device)
            formed, column = [], 0
            for comp in compressors:
                formed.append(form_entries(table, index, key, start, comp, column))
                column += comp.row_width
            self.entries.append(torch.cat(formed, dim=-1)[0].to(table.dtype), position)
        self.open.drop_before(open_block_start(position + 1, self.rate, self.spec.kind == "csa"))

    def _readable_entries(self, index_q, index_w, position, width) -> torch.Tensor:
        """This rank's entries the token reads: all (HCA, dense CSA), or those of the global top-k (CSA)."""
        entries, entry_positions = self.entries.view()
        if self.spec.kind != "csa" or self.spec.dense:
            return entries[:, :width]
        acc = accum_dtype(index_q.dtype)
        state = RunningTopK(1, torch.tensor([position], device=entries.device), self.spec.index_topk, acc)
        if entries.shape[0]:
            state.add(index_scores(index_q[None, None], index_w[None, None], entries[None, :, width:]),
                      entry_positions)
        chosen = global_topk(state, self.group, self.size)  # [1, k], -1 where fewer entries exist
        picked = (entry_positions.view(-1, 1) == chosen.view(1, -1)).any(-1)
        return entries[picked, :width]


def _token_rows(compressors: List[Compressor]) -> torch.Tensor:
    """The decoded token's compressor rows [F], the indexer's after the compressor's (their first copy: under
    sequence parallelism the token comes once per TP rank)."""
    return torch.cat([c.rows[0, 0] for c in compressors])


def _gather_open_block(kept: Kept, rate: int, overlap: bool, group) -> _Rows:
    """The open block's compressor rows (and CSA's overlap block's), from the ranks that hold them, on every rank."""
    first = open_block_start(kept.length, rate, overlap)
    span = kept.length - first  # < 2 * rate rows
    mine = (kept.positions >= first).nonzero()[:, 0]
    rows = kept.rows.new_zeros(span, kept.rows.shape[-1])
    at = torch.full((span,), -1, dtype=torch.int64, device=rows.device)
    rows[:mine.numel()], at[:mine.numel()] = kept.rows[mine], kept.positions[mine]
    if group is not None:  # every rank's share, padded to the span (one all-gather of rows, one of positions)
        rows, at = torch.cat(gather_parts(rows, group)), torch.cat(gather_parts(at, group))
    held = at >= 0
    order = at[held].argsort()
    return _Rows(rows[held][order], at[held][order])
