"""The composable attention mask (causal, sliding window, packed documents) and the tiles it leaves.

Query at global position i sees key j iff ``i - left <= j <= i + right`` (the window,
flash-attn's and Megatron's ``window_size=(left, right)``, -1 meaning unbounded; ``causal`` is
``right = 0``) and both are in the same document (`cp_ext.attention.masks.documents`). A CP variant
computes *tiles*: some of this rank's q rows against some rows of one KV block. Every rank's
shard is a few runs of consecutive positions (zigzag: two chunks; contiguous and Ulysses: one),
so for one q run against one k run the mask is a *band* on the tile's local indices::

    q run at positions [p0, p0 + nq), k run at [k0, k0 + nk), delta = p0 - k0:
    local (i, j) visible  <=>  delta - left <= j - i <= delta + right      Band(lo, hi)

`plan_tile` turns one tile into `Block` s: rectangles of (q rows, k rows), each with its band
(None: every pair visible) and, with documents, the one sample it belongs to. Rules:

* a band that excludes the whole rectangle is dropped, one that includes it becomes None;
* a causal tile whose q and k are the *same* tokens (the ring's diagonal, Ulysses' local call)
  without a finite left window is one block with Band(None, 0): on any increasing positions,
  "key before query" is "local column <= local row";
* unmasked neighbours coalesce into one rectangle, so without a window a tile is exactly one
  kernel call, as before windows existed (same work, same roundings);
* any other band (a window, or the corner of a neighbour's chunk a window reaches) is cut into
  row strips as wide as the window, each against only the columns its band reaches: a mirrored
  causal square (``j >= i``, which kernels run as causal with rows and columns reversed), the
  columns every row sees (no mask) and a causal square. Work: the band's pairs and no more, in
  kernel calls the kernels run natively; only where the rectangle's edges clip the band, and for
  bands under 64 wide (masked strips of 64 rows), does a block carry a mask;
* documents cut every block into its segments (one document's rows against its rows).

Blocks of a tile may share q rows (a q run against two k runs); kernels merge them by LSE
(`cp_ext.attention.kernels.base.AttnKernel.forward_blocks`).
"""

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import torch

from cp_ext.attention.masks.documents import Runs, clip_runs, tile_segments

Run = Tuple[int, int, int]  # (first local row, end row, global position of the first row)


@dataclass(frozen=True)
class Window:
    """Normalized ``window_size``: how far a query looks back (left) and ahead (right); None: unbounded."""

    left: Optional[int] = None
    right: Optional[int] = None


def make_window(window_size, causal: bool, name: str = "window_size") -> Optional[Window]:
    """``window_size`` (None or (left, right), -1 = unbounded) with ``causal`` folded in as right = 0.

    None when nothing is masked beyond plain causal/full. ValueError naming ``name`` for a
    malformed window, or ``right > 0`` under ``causal`` (a causal model never looks ahead).
    """
    if window_size is None:
        return Window(None, 0) if causal else None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in window_size)):
        raise ValueError(f"{name} must be (left, right) with integers >= -1 (-1: unbounded), got {window_size!r}")
    left, right = (None if x == -1 else x for x in window_size)
    if causal:
        if right not in (None, 0):
            raise ValueError(f"{name}={tuple(window_size)} looks {right} tokens ahead, but the attention is causal; "
                             f"use right = 0 (or -1) with a causal mask, e.g. ({window_size[0]}, 0)")
        right = 0
    return Window(left, right) if (left, right) != (None, None) else None


@dataclass(frozen=True)
class Band:
    """Visible local pairs of a block: ``lo <= j - i <= hi`` (None: no bound on that side)."""

    lo: Optional[int]
    hi: Optional[int]

    def mask(self, nq: int, nk: int, device) -> torch.Tensor:
        """The block's ``[nq, nk]`` boolean mask (True: visible)."""
        diff = torch.arange(nk, device=device)[None, :] - torch.arange(nq, device=device)[:, None]
        m = torch.ones(nq, nk, dtype=torch.bool, device=device)
        if self.lo is not None:
            m &= diff >= self.lo
        if self.hi is not None:
            m &= diff <= self.hi
        return m

    def is_causal(self, nq: int, nk: int) -> bool:
        """Whether this is the plain causal square every kernel takes natively."""
        return nq == nk and self.lo is None and self.hi == 0

    def is_anti_causal(self, nq: int, nk: int) -> bool:
        """Whether this is the mirrored causal square (key at or after the query, ``j >= i``): causal
        with rows and columns reversed, which is how every kernel runs it (`kernels.base`)."""
        return nq == nk and self.lo == 0 and self.hi is None


@dataclass(frozen=True)
class Block:
    """Rows ``[q0, q1)`` of the tile's q against rows ``[k0, k1)`` of its k, under ``band``
    (None: all visible), for every sample (``b`` None) or sample ``b`` only (a document segment)."""

    q0: int
    q1: int
    k0: int
    k1: int
    band: Optional[Band] = None
    b: Optional[int] = None

    def shift(self, dq: int, dk: int) -> "Block":
        return replace(self, q0=self.q0 - dq, q1=self.q1 - dq, k0=self.k0 - dk, k1=self.k1 - dk)

    def pairs(self) -> int:
        """Query-key pairs the kernel computes (what the work counter reports): the triangle of the
        causal square (kernels skip its upper half), else the rectangle (any other band is a dense mask)."""
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        triangle = self.band is not None and (self.band.is_causal(nq, nk) or self.band.is_anti_causal(nq, nk))
        return nq * (nq + 1) // 2 if triangle else nq * nk


def position_runs(positions: Sequence[int]) -> List[Run]:
    """(first local row, end row, first global position) of each range of consecutive positions."""
    positions = list(positions)
    runs, start = [], 0
    for i in range(1, len(positions) + 1):
        if i == len(positions) or positions[i] != positions[i - 1] + 1:
            runs.append((start, i, positions[start]))
            start = i
    return runs


def _normalized(lo, hi, nq, nk) -> Tuple[bool, Optional[Band]]:
    """(empty?, band or None when every pair is visible) of ``lo <= j - i <= hi`` on an nq x nk block."""
    if (hi is not None and hi < -(nq - 1)) or (lo is not None and lo > nk - 1):
        return True, None
    lo = None if lo is not None and lo <= -(nq - 1) else lo
    hi = None if hi is not None and hi >= nk - 1 else hi
    if lo is not None and hi is not None and lo > hi:
        return True, None
    return False, (None if lo is None and hi is None else Band(lo, hi))


def _band_block(q0, q1, k0, k1, lo, hi) -> List[Block]:
    """One q run x k run rectangle under ``lo <= j - i <= hi``, as blocks the kernels run natively.

    The rows that see anything are cut where the band stops being clipped by the rectangle's
    edges (row -lo: before it a row sees from column 0; row nk - hi: from it a row sees to the
    end), then into row strips (a two-sided band: its width ``hi - lo`` rows, so each strip is a
    mirrored causal square, the unmasked columns every row sees, and a causal square;
    `_split_strip`). Work: the band's own pairs, in kernel calls of window size. A band narrower
    than 64 uses masked strips of 64 rows instead (one masked rectangle when they would compute
    more than 3/4 of it)."""
    nq, nk = q1 - q0, k1 - k0
    empty, band = _normalized(lo, hi, nq, nk)
    if empty:
        return []
    if band is None or band.is_causal(nq, nk):  # every kernel's own case: one call
        return [Block(q0, q1, k0, k1, band)]
    lo, hi = band.lo, band.hi
    width = None if lo is None or hi is None else hi - lo
    if width is not None and width < 64:
        return _masked_strips(q0, q1, k0, k1, band)
    r0, r1 = (0 if hi is None else max(0, -hi)), (nq if lo is None else min(nq, nk - lo))  # rows that see keys
    cuts = sorted({r0, r1} | {c for c in ((None if lo is None else -lo), (None if hi is None else nk - hi))
                              if c is not None and r0 < c < r1})
    blocks = []
    for a, z in zip(cuts, cuts[1:]):
        step = z - a if width is None else width
        for i0 in range(a, z, step):
            i1 = min(z, i0 + step)
            blocks += _strip(q0, k0, nk, i0, i1, band)
    return blocks


def _strip(q0, k0, nk, i0, i1, band) -> List[Block]:
    """Rows [i0, i1) of a band block against only the columns they reach."""
    c0 = 0 if band.lo is None else max(0, i0 + band.lo)
    c1 = nk if band.hi is None else min(nk, i1 - 1 + band.hi + 1)
    if c0 >= c1:
        return []
    shift = i0 - c0  # strip-local: j' - i' = (j - i) + i0 - c0, so the band shifts by i0 - c0
    empty, s_band = _normalized(None if band.lo is None else band.lo + shift,
                                None if band.hi is None else band.hi + shift, i1 - i0, c1 - c0)
    return [] if empty else _split_strip(q0 + i0, q0 + i1, k0 + c0, k0 + c1, s_band)


def _masked_strips(q0, q1, k0, k1, band) -> List[Block]:
    """A narrow band (< 64 wide): masked row strips of 64 rows, or one masked rectangle."""
    nq, nk = q1 - q0, k1 - k0
    strips = [b for i0 in range(0, nq, 64) for b in _strip(q0, k0, nk, i0, min(nq, i0 + 64), band)]
    if sum((b.q1 - b.q0) * (b.k1 - b.k0) for b in strips) > 0.75 * nq * nk:
        return [Block(q0, q1, k0, k1, band)]  # the band covers most of the rectangle anyway
    return strips


def _split_strip(q0, q1, k0, k1, band) -> List[Block]:
    """A strip's columns, left to right: the mirrored causal square its first column starts
    (``j - i >= 0``: the band's left edge when it is unclipped), the columns every row sees (no
    mask), the causal square its last column ends (the right edge); an edge that is not such a
    square is a masked block, and a strip whose unmasked middle would be under 64 columns one."""
    if band is None:
        return [Block(q0, q1, k0, k1)]
    nq, nk = q1 - q0, k1 - k0
    lo, hi = band.lo, band.hi
    full_lo = 0 if lo is None else max(0, nq - 1 + lo)  # the last row's first visible column
    full_hi = nk - 1 if hi is None else min(nk - 1, hi)  # the first row's last visible column
    left_square = lo == 0 and (hi is None or hi >= nq - 1) and nk >= nq
    right_square = hi is not None and hi >= 0 and hi + nq == nk and (lo is None or lo <= hi - nq + 1)
    a = nq if left_square else full_lo  # the unmasked middle: columns [a, z)
    z = hi if right_square else full_hi + 1
    if a > z or (not (left_square or right_square) and z - a < 64):  # not worth more calls
        return [Block(q0, q1, k0, k1, band)]
    blocks = []
    if left_square:
        blocks.append(Block(q0, q1, k0, k0 + nq, Band(0, None)))
    elif a > 0:
        empty, left = _normalized(lo, hi, nq, a)
        if not empty:
            blocks.append(Block(q0, q1, k0, k0 + a, left))
    if z > a:
        blocks.append(Block(q0, q1, k0 + a, k0 + z))
    if right_square:
        blocks.append(Block(q0, q1, k0 + z, k1, Band(None, 0)))
    elif z < nk:
        shift = -z  # columns renumbered from the edge's first
        empty, right = _normalized(None if lo is None else lo + shift, None if hi is None else hi + shift, nq, nk - z)
        if not empty:
            blocks.append(Block(q0, q1, k0 + z, k1, right))
    return blocks


def _coalesce(blocks: List[Block]) -> List[Block]:
    """Merge unmasked neighbours: same rows and adjacent columns, then same columns and adjacent rows."""
    for key, near in ((lambda x: (x.q0, x.q1, x.k0), lambda a, x: a.q0 == x.q0 and a.q1 == x.q1 and a.k1 == x.k0),
                      (lambda x: (x.k0, x.k1, x.q0), lambda a, x: a.k0 == x.k0 and a.k1 == x.k1 and a.q1 == x.q0)):
        merged: List[Block] = []
        for x in sorted(blocks, key=lambda x: (x.band is not None,) + key(x)):
            a = merged[-1] if merged else None
            if a is not None and a.band is None and x.band is None and near(a, x):
                merged[-1] = replace(a, q1=x.q1, k1=x.k1)
            else:
                merged.append(x)
        blocks = merged
    return sorted(blocks, key=lambda x: (x.q0, x.k0))


def plan_tile(q_runs: Sequence[Run], k_runs: Sequence[Run], window: Optional[Window], *, same_tokens: bool,
              q_docs: Optional[Runs] = None, k_docs: Optional[Runs] = None) -> List[Block]:
    """The blocks of one tile (module docstring); an empty list: the tile computes nothing.

    ``q_runs`` / ``k_runs``: the `position_runs` of the tile's q and k rows. ``window``: from
    `make_window` (None: full attention). ``same_tokens``: q and k are the same tokens.
    ``q_docs`` / ``k_docs``: the documents' runs over those rows (`cp_ext.attention.masks.documents`).
    """
    nq, nk = (max((r[1] for r in runs), default=0) for runs in (q_runs, k_runs))
    if window is None:
        blocks = [Block(0, nq, 0, nk)] if nq and nk else []
    elif same_tokens and window.left is None and window.right == 0:
        blocks = [Block(0, nq, 0, nk, Band(None, 0))]
    else:
        blocks = []
        for q0, q1, p0 in q_runs:
            for k0, k1, kp0 in k_runs:
                delta = p0 - kp0
                lo = None if window.left is None else delta - window.left
                hi = None if window.right is None else delta + window.right
                blocks += _band_block(q0, q1, k0, k1, lo, hi)
        blocks = _coalesce(blocks)
    if q_docs is None:
        return blocks
    return [seg for block in blocks for seg in _document_blocks(block, q_docs, k_docs)]


def _document_blocks(block: Block, q_docs: Runs, k_docs: Runs) -> List[Block]:
    """``block`` cut into its document segments, each with the band moved to its own corner."""
    out = []
    q_rows, k_rows = slice(block.q0, block.q1), slice(block.k0, block.k1)
    for g in tile_segments(clip_runs(q_docs, q_rows, block.q1), clip_runs(k_docs, k_rows, block.k1)):
        nq, nk = g.q1 - g.q0, g.k1 - g.k0
        band = block.band
        if band is not None:
            shift = g.q0 - g.k0  # j - i within the segment = block's j - i - (k0 - q0) offsets
            empty, band = _normalized(None if band.lo is None else band.lo + shift,
                                      None if band.hi is None else band.hi + shift, nq, nk)
            if empty:
                continue
        out.append(Block(block.q0 + g.q0, block.q0 + g.q1, block.k0 + g.k0, block.k0 + g.k1, band, g.b))
    return out


def tile_span(blocks: Sequence[Block]) -> Tuple[slice, slice]:
    """The q rows and k rows a tile's blocks touch (the slices a caller hands the kernel)."""
    return (slice(min(b.q0 for b in blocks), max(b.q1 for b in blocks)),
            slice(min(b.k0 for b in blocks), max(b.k1 for b in blocks)))
