"""The CP layout contract: which global positions of a sequence each CP rank holds. The data loader
shards samples by it, and attention, RoPE, MTP and the KV cache read positions from it.

The zigzag (load-balanced causal) layout: the sequence is cut into ``2*C`` equal chunks; rank ``r`` of a ring of size ``C`` holds
chunks ``r`` and ``2C-1-r`` (concatenated in that order)::

    C = 4, 8 chunks:   | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
    rank 0: [0, 7]     rank 1: [1, 6]     rank 2: [2, 5]     rank 3: [3, 4]

Under a causal mask, an early chunk is cheap and a late one expensive; pairing chunk r
with chunk 2C-1-r gives every rank the same amount of work. Everything here is
parameterised by ``(rank, size)`` of the group the sequence is sharded over (the whole CP
group for pure ring attention, the ring sub-group for the Ulysses x ring hybrid).
"""

from dataclasses import dataclass
from typing import Tuple, Union

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class DocumentZigzag:
    """Dynamic CP's layout: a sequence of whole documents, each zigzagged over the group on its own.

    Document ``d`` of ``lengths[d]`` tokens (a multiple of ``2 * size``) is cut into ``2 * size`` chunks and
    rank ``r`` holds chunks ``r`` and ``2 * size - 1 - r`` of every document, in sequence order::

        size 2, lengths (8, 4):   doc 0 | 0 1 | 2 3 | 4 5 | 6 7 |   doc 1 | 8 | 9 | 10 | 11 |
        rank 0: 0 1 6 7 8 11      rank 1: 2 3 4 5 9 10

    So every rank of the group gets the same share of every document's causal work (the plain zigzag
    over the whole sequence balances one document, not several of different lengths), and along each
    rank's rows the positions still increase, which the document masks rely on
    (`cp_ext.attention.masks.documents`). Hashable by its lengths: the ring's per-layout plans cache on it.
    """

    lengths: Tuple[int, ...]
    size: int

    def __post_init__(self):
        bad = [(i, n) for i, n in enumerate(self.lengths) if n <= 0 or n % (2 * self.size)]
        if self.size < 1 or bad:
            raise ValueError(f"a per-document zigzag over {self.size} ranks needs every document's length to be a "
                             f"positive multiple of 2 x {self.size}; documents (index, length) {bad[:4]} are not")

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """The global positions (in the group's sequence) rank ``rank`` holds, increasing."""
        a, b = zigzag_chunk_ids(rank, self.size)
        parts, start = [], 0
        for n in self.lengths:
            c = n // (2 * self.size)
            parts += [torch.arange(start + a * c, start + (a + 1) * c), torch.arange(start + b * c, start + (b + 1) * c)]
            start += n
        return torch.cat(parts).to(device)


Layout = Union[str, DocumentZigzag]


def check_layout(layout) -> None:
    """ValueError unless ``layout`` is one of `LAYOUTS` or a `DocumentZigzag`."""
    if not isinstance(layout, DocumentZigzag) and layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS} (or a DocumentZigzag)")


def check_seq_len(seq_len: int, size: int, layout: str = "zigzag") -> None:
    """Raise a ValueError that names the fix if ``seq_len`` cannot be sharded over ``size`` ranks."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown context-parallel layout {layout!r}; choose one of {LAYOUTS}")
    n = 2 * size if layout == "zigzag" else size
    if seq_len % n != 0:
        what = f"2 x C = 2 x {size} = {n}" if layout == "zigzag" else f"C = {size}"
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {what} ({layout} context-parallel sharding "
            f"over {size} ranks cuts the sequence into {n} equal chunks); pad or truncate the sequence "
            f"to a multiple of {n} (e.g. {seq_len + (-seq_len) % n}), or change --context-parallel-size"
        )


def zigzag_chunk_ids(rank: int, size: int) -> Tuple[int, int]:
    """The two chunks (of ``2*size``) that ring rank ``rank`` holds, in local order."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} out of range for size {size}")
    return rank, 2 * size - 1 - rank


def zigzag_positions(seq_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    """Global token positions held by ``rank`` (for position ids / RoPE), shape [seq_len // size]."""
    check_seq_len(seq_len, size, "zigzag")
    c = seq_len // (2 * size)
    a, b = zigzag_chunk_ids(rank, size)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def zigzag_shard(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's zigzag shard of the full tensor ``x`` along ``dim`` (a new tensor)."""
    check_seq_len(x.shape[dim], cp_size, "zigzag")
    chunks = x.chunk(2 * cp_size, dim=dim)
    a, b = zigzag_chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def zigzag_unshard(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Gather the zigzag shards of ``group`` and put the full sequence back in order.

    Inverse of ``zigzag_shard`` over the ranks of ``group`` (ordered by group rank). Not
    differentiable (it is meant for outputs, checks and evaluation).
    """
    size = dist.get_world_size(group)
    positions = zigzag_positions(x.shape[dim] * size, dist.get_rank(group), size, device=x.device)
    return context_parallel_unshard(x, dim, positions, group)


def contiguous_shard(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Plain sharding: rank r holds the r-th of ``cp_size`` equal slices (for layout="contiguous")."""
    check_seq_len(x.shape[dim], cp_size, "contiguous")
    return x.chunk(cp_size, dim=dim)[cp_rank].contiguous()


def context_parallel_positions(
    seq_len: int, *, ring_rank: int, ring_size: int, ulysses_rank: int = 0, ulysses_size: int = 1,
    layout: str = "zigzag", device=None,
) -> torch.Tensor:
    """Global positions of the tokens one CP rank holds, under the Ulysses x ring layout.

    The ring shards the sequence (zigzag or contiguous over ``ring_size``); inside each ring
    shard the ``ulysses_size`` ranks hold consecutive equal pieces, so an all-to-all over
    the Ulysses group gathers exactly that ring shard, in order::

        C = 4 = U2 x R2, zigzag, 16 tokens (4 chunks of 4):
        ring rank 0 holds chunks (0, 3) = tokens 0-3, 12-15 -> Ulysses ranks: [0-3] [12-15]
        ring rank 1 holds chunks (1, 2) = tokens 4-11       -> Ulysses ranks: [4-7] [8-11]

    ``ulysses_size == 1`` is the plain ring layout, ``ring_size == 1`` plain Ulysses
    (contiguous blocks). Shard any ``[.., s, ..]`` tensor with ``x.index_select(dim, positions)``.
    A `DocumentZigzag` layout (dynamic CP, a ring of its group only) gives its own positions.
    """
    if isinstance(layout, DocumentZigzag):
        if ulysses_size != 1 or ring_size != layout.size or seq_len != layout.seq_len:
            raise ValueError(f"a per-document zigzag of {layout.seq_len} tokens over {layout.size} ranks cannot lay out "
                             f"{seq_len} tokens over a ring of {ring_size} x Ulysses {ulysses_size}")
        return layout.positions(ring_rank, device=device)
    check_seq_len(seq_len, ring_size * ulysses_size if layout == "contiguous" else ring_size, layout)
    if layout == "zigzag":
        ring_shard = zigzag_positions(seq_len, ring_rank, ring_size, device=device) if ring_size > 1 else torch.arange(seq_len, device=device)
    else:
        per_ring = seq_len // ring_size
        ring_shard = torch.arange(ring_rank * per_ring, (ring_rank + 1) * per_ring, device=device)
    if ring_shard.numel() % ulysses_size:
        raise ValueError(
            f"a ring shard of {ring_shard.numel()} tokens does not split over --ulysses-size {ulysses_size}; "
            f"use a sequence length that is a multiple of {2 * ring_size * ulysses_size}"
        )
    return ring_shard.chunk(ulysses_size)[ulysses_rank].clone()


def context_parallel_unshard(x: torch.Tensor, dim: int, positions: torch.Tensor, group=None) -> torch.Tensor:
    """Gather every CP rank's shard (and its positions) and put the full sequence back in order."""
    size = dist.get_world_size(group)
    shards = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(shards, x.contiguous(), group=group)
    all_positions = [torch.empty_like(positions) for _ in range(size)]
    dist.all_gather(all_positions, positions.contiguous(), group=group)
    shape = list(x.shape)
    shape[dim] = sum(p.numel() for p in all_positions)
    full = x.new_empty(shape)
    full.index_copy_(dim, torch.cat(all_positions), torch.cat(shards, dim=dim))
    return full
