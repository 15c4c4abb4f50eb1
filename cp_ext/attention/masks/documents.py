"""Document masks for packed sequences: which query/key pairs of a tile share a document.

``document_ids`` is an integer tensor ``[b, s_local]`` laid out like q: the document of each
local token. Token i attends to token j only if ``doc[i] == doc[j]`` (and j <= i when causal).
Ids are non-decreasing along each sample's global sequence; a *negative* id marks padding
that attends to nothing and is attended by nothing (its output is 0), and may only end a
sample. Padding with its own non-negative id is just one more document.

Every CP shard holds its tokens in increasing global order (zigzag chunks (r, 2C-1-r),
contiguous blocks, and Ulysses pieces of either), so along any local tensor the ids are
non-decreasing and each document is one *run* of consecutive rows. A tile of attention (some
rows of q against some rows of k) therefore reduces to a list of `Segment` s: the rows of one
document in q against the rows of the same document in k::

    q docs  0 0 0 1 1 2 2 2          k docs  1 1 1 2 2 3
            -----=== -----                   ===== --- 
    segments: (q rows 3-4, k rows 0-2), (q rows 5-7, k rows 3-4); doc 0 and 3 meet nothing

A tile whose segment list is empty computes nothing, and one that has segments computes only
the rows and columns that interact (`cp_ext.attention.kernels.base.AttnKernel.forward_blocks`).
On a causal diagonal tile (q and k are the same tokens) every segment is square, so the
kernel's own causal mask is the document-causal mask.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

Runs = List[List[Tuple[int, int, int]]]  # per sample: (document id, first row, end row), ids >= 0 only


@dataclass(frozen=True)
class Segment:
    """Rows ``[q0, q1)`` of sample ``b`` of q attend rows ``[k0, k1)`` of k (one document)."""

    b: int
    q0: int
    q1: int
    k0: int
    k1: int


def check_document_ids(document_ids, batch: int, seq: int, device: torch.device, name: str = "document_ids") -> None:
    """ValueError naming ``name`` unless it is an integer [batch, seq] tensor on ``device``."""
    if not isinstance(document_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of document ids [b, s_local], got {type(document_ids).__name__}")
    if document_ids.dtype.is_floating_point or document_ids.dtype.is_complex or document_ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (int32/int64 document ids), got {document_ids.dtype}")
    if tuple(document_ids.shape) != (batch, seq):
        raise ValueError(f"{name} must be [b, s_local] = [{batch}, {seq}] like q's batch and local sequence, "
                         f"got {tuple(document_ids.shape)}")
    if document_ids.device != torch.device(device):
        raise ValueError(f"{name} is on {document_ids.device} but q is on {device}; move it to q's device")


def document_runs(ids: torch.Tensor, name: str = "document_ids") -> Runs:
    """Per sample, the runs of equal non-negative ids of ``ids`` [b, s] (any device).

    ValueError if the ids decrease along the sequence, or padding (negative ids) is followed
    by a document: the mask would otherwise be silently wrong.
    """
    ids = ids.detach().to("cpu", torch.int64)
    runs = []
    for row_index, row in enumerate(ids):
        values, counts = torch.unique_consecutive(row, return_counts=True)
        values, ends = values.tolist(), counts.cumsum(0).tolist()
        starts = [0] + ends[:-1]
        sample, padding_at = [], None
        for value, start, end in zip(values, starts, ends):
            if value < 0:
                padding_at = start if padding_at is None else padding_at
                continue
            if padding_at is not None:
                raise ValueError(f"{name}: sample {row_index} has document {value} at local token {start} after "
                                 f"padding (a negative id) at token {padding_at}; padding may only end a sample")
            if sample and value < sample[-1][0]:
                raise ValueError(f"{name}: ids decrease along the sequence in sample {row_index} (document {value} at "
                                 f"local token {start} follows document {sample[-1][0]}); document ids must be "
                                 f"non-decreasing along each sample")
            sample.append((value, start, end))
        runs.append(sample)
    return runs


def clip_runs(runs: Runs, rows: slice, length: int) -> Runs:
    """``runs`` restricted to the rows ``rows`` of a tensor of ``length`` rows, renumbered from 0."""
    lo, hi, _ = rows.indices(length)
    return [[(d, max(a, lo) - lo, min(b, hi) - lo) for d, a, b in sample if a < hi and b > lo] for sample in runs]


def tile_segments(q_runs: Runs, k_runs: Runs) -> List[Segment]:
    """The segments of a tile: every document that has rows in both q and k (ids sorted: one merge pass)."""
    segments = []
    for b, (qs, ks) in enumerate(zip(q_runs, k_runs)):
        i = j = 0
        while i < len(qs) and j < len(ks):
            (qd, q0, q1), (kd, k0, k1) = qs[i], ks[j]
            if qd == kd:
                segments.append(Segment(b, q0, q1, k0, k1))
            i, j = i + (qd <= kd), j + (kd <= qd)
    return segments


def diagonal_segments(runs: Runs) -> List[Segment]:
    """Segments of a tile whose q and k are the same tokens: one square per document."""
    return [Segment(b, a, e, a, e) for b, sample in enumerate(runs) for _, a, e in sample]


def gather_parts(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> List[torch.Tensor]:
    """Every rank's ``x`` (same shape on every rank), in group-rank order: one all-gather."""
    if dist.get_world_size(group) == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def gather_document_ids(document_ids: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = 1) -> torch.Tensor:
    """Concatenate every rank's ids along ``dim`` in group-rank order (Ulysses: the group's sequence)."""
    return torch.cat(gather_parts(document_ids, group), dim=dim)


def all_document_runs(document_ids: torch.Tensor, group: Optional[dist.ProcessGroup]) -> List[Runs]:
    """Every rank's runs (group-rank order), from one all-gather of the ids: each rank can plan every tile.

    Every rank checks every rank's ids in the same order, so a bad id raises on all ranks together
    (none is left waiting in a collective)."""
    parts = gather_parts(document_ids, group)
    if len(parts) == 1:
        return [document_runs(document_ids)]
    return [document_runs(p, name=f"document_ids (CP rank {i})") for i, p in enumerate(parts)]
