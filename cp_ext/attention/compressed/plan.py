"""Where every token of one sample lives under CP, and which rows each rank needs from the others.

DeepSeek-V4's attention reads two things beyond a query's own rank: the raw K/V rows of its sliding
window (up to ``window - 1`` tokens before it, inside its document) and the compressed entries of
complete blocks. Every rank knows every rank's global positions (one all-gather of integers, or the
layout itself), so every rank can work out, without asking, what each peer needs from it: the plan
is the same computation on every rank. Nothing here is differentiable or touches model tensors.

Blocks: a document that starts at global position ``d`` is cut into blocks of ``m`` (the compress
rate) from its own start: block ``w`` holds positions ``d + m*w .. d + m*w + m - 1`` and is
*complete* when the document reaches its last token. Only complete blocks make entries (an open
block waits for its last token, as in the reference). Entry ``w`` is formed by the rank that holds
the block's last token (its *key position* ``L = d + m*w + m - 1``), and query ``t`` may read it
iff ``L <= t`` in the same document: the reference's ``w < (t - d + 1) // m``. CSA's entry ``w``
also pools the first half of block ``w - 1``'s projections (the overlap), so its former needs the
``2m`` positions before ``L``; entry 0 has no predecessor.

Padding (a negative document id) attends nothing and is read by nothing.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch


@dataclass
class SequencePlan:
    """One sample's global map: ``owner[p]`` / ``row[p]``: the rank holding position ``p`` and its row
    there; ``doc_start[p]`` / ``doc_end[p]``: the document around ``p`` (end exclusive); ``padding[p]``."""

    positions: List[torch.Tensor]
    owner: torch.Tensor
    row: torch.Tensor
    doc_start: torch.Tensor
    doc_end: torch.Tensor
    padding: torch.Tensor

    @classmethod
    def build(cls, positions: List[torch.Tensor], document_ids: Optional[List[torch.Tensor]] = None) -> "SequencePlan":
        """From every rank's global positions (and document ids, laid out like them), in group-rank order."""
        positions = [p.detach().to("cpu", torch.int64) for p in positions]
        every = torch.cat(positions)
        size = every.numel()
        if not torch.equal(every.sort().values, torch.arange(size)):
            raise ValueError(f"the CP ranks' positions do not cover 0..{size - 1} exactly once; "
                             f"shard the sequence with cp_ext.token_partition")
        owner = torch.empty(size, dtype=torch.int64)
        row = torch.empty(size, dtype=torch.int64)
        owner[every] = torch.cat([torch.full((p.numel(),), r, dtype=torch.int64) for r, p in enumerate(positions)])
        row[every] = torch.cat([torch.arange(p.numel()) for p in positions])
        ids = torch.zeros(size, dtype=torch.int64)
        if document_ids is not None:
            ids[every] = torch.cat([d.detach().to("cpu", torch.int64) for d in document_ids])
        new = torch.ones(size, dtype=torch.bool)
        new[1:] = ids[1:] != ids[:-1]
        starts = new.nonzero().flatten()
        run = new.cumsum(0) - 1
        ends = torch.cat([starts[1:], torch.tensor([size])])
        return cls(positions, owner, row, starts[run], ends[run], ids < 0)

    @property
    def size(self) -> int:
        return self.owner.numel()

    def window_needs(self, rank: int, window: int) -> torch.Tensor:
        """The positions (increasing) whose K/V rows some query of ``rank`` reads in its window, held elsewhere."""
        t = self.positions[rank]
        t = t[~self.padding[t]]
        first = torch.maximum(self.doc_start[t], t - window + 1)
        return self._held_elsewhere(rank, first, t + 1)

    def entries(self, rate: int) -> torch.Tensor:
        """Key positions ``L`` (increasing) of every complete block of ``rate`` tokens, all documents."""
        p = torch.arange(self.size)
        offset = p - self.doc_start
        last = (offset % rate == rate - 1) & ~self.padding
        return p[last]

    def owned_entries(self, rank: int, rate: int) -> torch.Tensor:
        """Key positions of the entries ``rank`` forms (it holds their block's last token)."""
        keys = self.entries(rate)
        return keys[self.owner[keys] == rank]

    def pool_needs(self, rank: int, rate: int, overlap: bool) -> torch.Tensor:
        """Positions (increasing) whose compressor rows ``rank`` needs to form its entries, held elsewhere:
        each block's ``rate`` tokens, and with ``overlap`` (CSA) the preceding block's in the same document."""
        keys = self.owned_entries(rank, rate)
        span = 2 * rate if overlap else rate
        first = torch.maximum(self.doc_start[keys], keys - span + 1)
        return self._held_elsewhere(rank, first, keys + 1)

    def _held_elsewhere(self, rank: int, first: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """Positions in the union of the ranges ``[first, end)`` that ``rank`` does not hold."""
        cover = torch.zeros(self.size + 1, dtype=torch.int64)
        cover.index_add_(0, first, torch.ones_like(first))
        cover.index_add_(0, end, -torch.ones_like(end))
        wanted = cover.cumsum(0)[:-1] > 0
        return (wanted & (self.owner != rank)).nonzero().flatten()
