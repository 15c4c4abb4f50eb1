"""DeepSeek-V4's attention under context parallelism: the entry point.

``compressed_attention`` takes this rank's shard (sequence first, any CP layout: zigzag, contiguous,
a Ulysses x ring one, dynamic CP's per-document zigzag) and returns exactly what one device computes
on the whole sequence. Per sample:

1. `plan.SequencePlan`: every rank's positions and documents (one all-gather of integers per call).
2. The window's halo: the K/V rows of the ``window - 1`` positions before each local query that other
   ranks hold (`exchange.fetch_rows`, one message per peer; several peers when shards are shorter than
   the window). Rows, never heads: V4 has one K=V head.
3. Compressed layers: each rank forms the entries whose block ends on it (`compressor.form_entries`),
   fetching first the compressor rows of a block that straddles a shard boundary (and, for CSA, of
   the preceding block: the overlap); the entries (with CSA's indexer keys in the same rows) are
   gathered on every rank in key order (`exchange.gather_entries`). CSA selects each query's top-k
   (`selection.select_entries`).
4. `attention.attend`: window and entries in one softmax with the sinks.

Gradients of halo rows, straddling-block rows and entries travel back to their owners. The query
heads never move: under Ulysses the layer still runs this exchange over the whole CP group, because
a query needs only its window and the entries, both smaller than a head all-to-all of its queries.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from cp_ext.attention.compressed.attention import attend
from cp_ext.attention.compressed.compressor import Compressor, form_entries, interleaved_rope
from cp_ext.attention.compressed.exchange import fetch_rows, gather_entries
from cp_ext.attention.compressed.plan import SequencePlan
from cp_ext.attention.compressed.selection import select_entries
from cp_ext.attention.cp.primitives import accum_dtype
from cp_ext.attention.dsa.sparse_tiles import check_path
from cp_ext.attention.masks.documents import gather_parts

KINDS = ("sliding", "hca", "csa")


@dataclass(frozen=True)
class CompressedAttentionSpec:
    """A V4 layer type: ``kind`` (sliding window only, heavily compressed, compressed sparse), the window,
    the softmax scale (``head_dim ** -0.5``), and CSA's ``index_topk`` (``dense``: CSA reads every complete
    entry, no indexer: ``--csa-dense-mode``); tiles bound the memory. ``sparse_path``: how a CSA tile reads
    its selected entries (`cp_ext.attention.dsa.sparse_tiles`: ``auto`` by the count, or ``gather`` /
    ``union``)."""

    kind: str
    window: int
    scale: float
    index_topk: int = 0
    dense: bool = False
    query_tile: int = 256
    key_tile: int = 4096
    sparse_path: str = "auto"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown V4 attention kind {self.kind!r}; choose one of {KINDS}")
        if self.window < 1:
            raise ValueError(f"the sliding window must be >= 1, got {self.window}")
        if self.kind == "csa" and not self.dense and self.index_topk < 1:
            raise ValueError(f"CSA's index_topk must be >= 1, got {self.index_topk}")
        check_path(self.sparse_path)


@dataclass
class Indexer:
    """CSA's lightning indexer inputs: queries [s_local, b, Hi, Di] (RoPE applied), head weights
    [s_local, b, Hi] (with both of transformers' scales), and its own compressor (``overlap``)."""

    q: torch.Tensor
    weights: torch.Tensor
    compressor: Compressor


def compressed_attention(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, spec: CompressedAttentionSpec, *,
                         positions: torch.Tensor, document_ids: Optional[torch.Tensor] = None,
                         group: Optional[dist.ProcessGroup] = None, compressor: Optional[Compressor] = None,
                         indexer: Optional[Indexer] = None, rope_inv_freq: Optional[torch.Tensor] = None,
                         keep: Optional[list] = None) -> torch.Tensor:
    """q [s_local, b, H, D], kv [s_local, b, D] (normed), sinks [H] -> [s_local, b, H, D] in q's dtype.

    ``positions`` [s_local]: this rank's global positions (`cp_ext.token_partition`); ``document_ids``
    [b, s_local] (packed documents; negative: padding); ``group``: the CP group (None: one process).
    ``compressor``: HCA's or CSA's; ``indexer``: CSA's. ``rope_inv_freq``: V4's RoPE of q and kv (the
    output rotated back); with it, each token's position is its offset in its document, and the indexer's
    queries are rotated with the compressor's ``inv_freq``. Without it, q, kv and the indexer's queries
    come rotated and the output is not rotated back.

    ``keep`` (a list; a generation's prefill, `cp_ext.inference.compressed_cache`): each sample's `Kept`, what
    this rank holds for decoding on: its K=V rows (rotated) and the entries it formed, at their positions."""
    sparse = spec.kind == "csa" and not spec.dense
    if (spec.kind == "sliding") != (compressor is None) or sparse != (indexer is not None):
        raise ValueError(f"a {spec.kind} layer{' in dense mode' if spec.dense else ''} takes "
                         f"{'no' if spec.kind == 'sliding' else 'a'} compressor and {'an' if sparse else 'no'} indexer")
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if size == 1 else dist.get_rank(group)
    positions = positions.to(device=q.device, dtype=torch.int64)
    every_position = gather_parts(positions, group) if size > 1 else [positions]
    outs = []
    for b in range(q.shape[1]):
        docs = None
        if document_ids is not None:
            sample = document_ids[b:b + 1].to(q.device)
            docs = [d[0] for d in gather_parts(sample, group)] if size > 1 else [sample[0]]
        plan = SequencePlan.build(every_position, docs)
        outs.append(_one_sample(q[:, b], kv[:, b], sinks, spec, plan, rank, group, b, compressor, indexer,
                                rope_inv_freq, keep))
    return torch.stack(outs, dim=1).to(q.dtype)


def _table(x, plan, needs, rank, group, positions):
    """This rank's rows of ``x`` and the fetched ones, in position order: (rows, positions)."""
    if len(plan.positions) == 1:
        return x, positions
    fetched, fetched_positions = fetch_rows(x, plan, needs, rank, group)
    rows, at = torch.cat([x, fetched]), torch.cat([positions, fetched_positions])
    order = at.argsort()
    return rows.index_select(0, order), at[order]


@dataclass
class Kept:
    """One sample's share on this rank after a forward, for a generation's cache: the sequence's ``length``; this
    rank's ``positions`` and its K=V rows ``kv`` there (rotated); on a compressed layer, its compressor rows
    ``rows`` there (the indexer's after the compressor's) and the ``entries`` it formed ([E, width (+ the
    indexer's)] in the activations' dtype, as they travel) at ``entry_positions``."""

    length: int
    positions: torch.Tensor
    kv: torch.Tensor
    rows: Optional[torch.Tensor] = None
    entries: Optional[torch.Tensor] = None
    entry_positions: Optional[torch.Tensor] = None


def _one_sample(q, kv, sinks, spec, plan, rank, group, b, compressor, indexer, rope_inv_freq, keep):
    acc = accum_dtype(q.dtype)
    device = q.device
    size = len(plan.positions)
    positions = plan.positions[rank].to(device)
    index_q = None if indexer is None else indexer.q[:, b]
    if rope_inv_freq is not None:  # each document is a sequence of its own: RoPE at the offset in it
        offset = positions - plan.doc_start.to(device)[positions]
        q, kv = interleaved_rope(q, offset, rope_inv_freq), interleaved_rope(kv, offset, rope_inv_freq)
        if indexer is not None:
            index_q = interleaved_rope(index_q, offset, indexer.compressor.inv_freq)
    doc = (plan.doc_start.masked_fill(plan.padding, -1)).to(device)
    key_doc = (plan.doc_start.masked_fill(plan.padding, -2)).to(device)
    needs = [plan.window_needs(r, spec.window) for r in range(size)]
    keys, key_positions = _table(kv, plan, needs, rank, group, positions)
    if keep is not None:
        keep.append(Kept(plan.size, positions, kv.detach()))
    entries = entry_positions = entry_docs = selection = None
    if compressor is not None:
        comps = [compressor] + ([indexer.compressor] if indexer is not None else [])
        rows = torch.cat([c.rows[:, b] for c in comps], dim=-1)
        needs = [plan.pool_needs(r, compressor.rate, compressor.overlap) for r in range(size)]
        table, table_positions = _table(rows, plan, needs, rank, group, positions)
        table_index = torch.full((plan.size,), -1, dtype=torch.int64, device=device)
        table_index[table_positions] = torch.arange(table_positions.numel(), device=device)
        owned = [plan.owned_entries(r, compressor.rate) for r in range(size)]
        mine = owned[rank].to(device)
        formed, column = [], 0
        for c in comps:
            formed.append(form_entries(table, table_index, mine, plan.doc_start.to(device)[mine], c, column))
            column += c.row_width
        # the entries travel in the activations' dtype (bf16 training: half the bytes of the fp32 they are formed in)
        formed = torch.cat(formed, dim=-1).to(rows.dtype)
        if keep is not None:
            keep[-1].rows, keep[-1].entries, keep[-1].entry_positions = rows.detach(), formed.detach(), mine
        gathered, entry_positions = gather_entries(formed, owned, rank, group)
        gathered = gathered.to(acc)
        entries = gathered[:, :compressor.width]
        entry_docs = key_doc[entry_positions]
        if indexer is not None:
            selection = select_entries(index_q, indexer.weights[:, b], gathered[:, compressor.width:],
                                       entry_positions, entry_docs, positions, doc[positions], spec.index_topk,
                                       spec.query_tile, spec.key_tile)
    out = attend(q.to(acc), positions, doc[positions], keys.to(acc), key_positions, key_doc[key_positions], sinks,
                 window=spec.window, scale=spec.scale, entries=entries, entry_positions=entry_positions,
                 entry_docs=entry_docs, selection=selection, query_tile=spec.query_tile,
                 sparse_path=spec.sparse_path)
    return out if rope_inv_freq is None else interleaved_rope(out, offset, rope_inv_freq, inverse=True)
