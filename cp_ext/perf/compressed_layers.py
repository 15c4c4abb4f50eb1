"""DeepSeek-V4's layers in the planner's arithmetic: parameters, saved activations and CP bytes per layer kind.

Pure arithmetic (no torch), for `cp_ext.perf.model_shape.ModelShape`'s ``compressed`` (``--experimental-attention-variant
dsv4_hybrid``) and ``residual_streams`` (``--enable-hyper-connections``). Per layer kind (sliding, CSA, HCA):

**Parameters**, as `cp_ext.transformer.compressed_attention` builds them (``h`` hidden, ``a`` heads, ``d`` the K=V
head dim, ``r_q`` q-LoRA, ``G x R`` the grouped output, ``m`` the compress rate)::

    every kind  linear_q_down_proj h r_q, q_down_norm r_q, linear_q_up_proj r_q a d, linear_kv_proj h d,
                kv_layernorm d, linear_o_group_proj R a d, linear_proj h G R, sinks a (unless --csa-no-attention-sink)
    compressor  linear_kv, linear_gate h F each, position_bias m F, kv_layernorm d   (F = d; CSA 2 d: the overlap)
    indexer     (CSA) linear_q_up_proj r_q H_i D_i, linear_weights h H_i, its compressor (F = 2 D_i, norm D_i)
    mHC         attn_hc and ffn_hc, each ((2 + n) n) x n h + (2 + n) n + 3; the last layer's hc_head n x n h + n + 1

**CP bytes** one rank sends per layer (`compressed_layer_bytes`), worked out from the token layout as
`cp_ext.attention.compressed` plans it: the positions' all-gather (int64), the window's halo (the ``W - 1`` K/V rows
before each of another rank's segments, in the activation dtype; the backward returns the gradient of the rows a
rank received), the rows of blocks that straddle a segment boundary (CSA: and the preceding block's, with the
indexer's columns; their gradient likewise), and the entries (in the activation dtype; CSA with the indexer key)
all-gathered, their gradient all-reduced. tests/bench checks it equal to the bytes torch.distributed sends, per
rank and kind.

**Activations** per token (`compressed_attention_elems`, `hyper_connection_elems`): the tensors the layer saves for
backward, counted from its code (q-LoRA and its norm, the per-head q norm, the K=V head and its norm, the attention's
fp32 inputs, the compressors' pooled rows, the output and the grouped projection; the streams' fp32 norms and the
mixings); measured against tools/measure_memory.py in tests/bench/test_memory_measure_families.py.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from cp_ext.perf.comm import segment_owners

KINDS = ("sliding", "csa", "hca")


@dataclass(frozen=True)
class CompressedLayers:
    """DeepSeek-V4's attention layers (``--csa-*``, ``--o-*``, the indexer's ``--dsa-indexer-*``)."""

    # per decoder layer, then per MTP layer: 0 sliding, csa_ratio, hca_ratio (--csa-compress-ratios)
    ratios: Tuple[int, ...]
    csa_ratio: int = 4
    hca_ratio: int = 128
    window: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    o_groups: int = 8
    o_lora_rank: int = 1024
    sink: bool = True
    dense_csa: bool = False  # --csa-dense-mode: CSA reads every entry, no indexer

    def kind(self, i: int) -> str:
        ratio = self.ratios[i]
        return "sliding" if ratio == 0 else "csa" if ratio == self.csa_ratio else "hca"

    def rate(self, kind: str) -> int:
        return {"csa": self.csa_ratio, "hca": self.hca_ratio}.get(kind, 0)

    def indexed(self, kind: str) -> bool:
        return kind == "csa" and not self.dense_csa

    @classmethod
    def from_args(cls, args) -> Optional["CompressedLayers"]:
        """The V4 layers `pretrain_moe.py` builds from ``args``, or None without ``dsv4_hybrid``."""
        if getattr(args, "experimental_attention_variant", None) != "dsv4_hybrid":
            return None
        return cls(ratios=tuple(args.csa_compress_ratios), csa_ratio=args.csa_compress_ratio_for_c,
                   hca_ratio=args.csa_compress_ratio_for_h, window=args.csa_window_size,
                   index_heads=args.dsa_indexer_n_heads or 0, index_head_dim=args.dsa_indexer_head_dim or 0,
                   index_topk=args.dsa_indexer_topk or 0, o_groups=args.o_groups, o_lora_rank=args.o_lora_rank,
                   sink=not args.csa_no_attention_sink, dense_csa=bool(args.csa_dense_mode))


def _compressor_params(h: int, rate: int, width: int, overlap: bool) -> int:
    projected = 2 * width if overlap else width
    return 2 * h * projected + rate * projected + width


def compressed_attention_params(c: CompressedLayers, kind: str, *, h: int, a: int, d: int, q_rank: int) -> int:
    """One V4 attention layer of ``kind`` (module docstring)."""
    out = (h * q_rank + q_rank + q_rank * a * d + h * d + d + c.o_lora_rank * a * d + h * c.o_groups * c.o_lora_rank
           + (a if c.sink else 0))
    if kind != "sliding":
        out += _compressor_params(h, c.rate(kind), d, kind == "csa")
    if c.indexed(kind):
        out += (q_rank * c.index_heads * c.index_head_dim + h * c.index_heads
                + _compressor_params(h, c.csa_ratio, c.index_head_dim, True))
    return out


def hyper_connection_params(n: int, h: int, last: bool) -> int:
    """A layer's two mixings of ``n`` streams (and the model's final collapse on the last layer); 0 without."""
    if not n:
        return 0
    mixing = (2 + n) * n * (n * h + 1) + 3
    return 2 * mixing + ((n * n * h + n + 1) if last else 0)


# --------------------------------------------------------------------------------------------- CP bytes
def _segments(s: int, cp: int, layout: str) -> List[Tuple[int, int, int]]:
    """(start, end, owner) of each segment of the sequence, in order (`comm.segment_owners`)."""
    owners = segment_owners(cp, layout)
    size = s // len(owners)
    return [(j * size, (j + 1) * size, owner) for j, owner in enumerate(owners)]


def _merge(intervals):
    out = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _rows_moved(segments, wants) -> Tuple[List[int], List[int]]:
    """(rows each rank sends, rows each rank receives): rank p reads the merged ranges ``wants[p]``, and
    receives the rows of them another rank holds; a row's gradient goes back the other way."""
    cp = 1 + max(o for _, _, o in segments)
    sent, received = [0] * cp, [0] * cp
    for p in range(cp):
        for lo, hi in _merge(wants[p]):
            for a, b, owner in segments:
                if owner != p:
                    rows = max(0, min(hi, b) - max(lo, a))
                    sent[owner] += rows
                    received[p] += rows
    return sent, received


def _entries_on(segments, rank: int, rate: int) -> List[Tuple[int, int]]:
    """The key positions (last tokens) of the complete blocks whose last token ``rank`` holds, per segment: a range
    of block indexes [first, end)."""
    return [(a // rate, b // rate) for a, b, owner in segments if owner == rank]


def compressed_layer_bytes(c: CompressedLayers, kind: str, *, s: int, cp: int, d: int, b: int = 1,
                           dtype: str = "bf16", layout: str = "zigzag") -> List[Dict[str, int]]:
    """Bytes each CP rank sends in one layer of ``kind`` (forward, backward), one sequence of ``s`` tokens
    without packed documents, ``b`` samples (module docstring)."""
    if cp == 1:
        return [{"fwd": 0, "bwd": 0}]
    e = 4 if dtype == "fp32" else 2
    segments = _segments(s, cp, layout)
    s_local = s // cp
    positions = (cp - 1) * s_local * 8  # the plan's all-gather of every rank's positions (once per call)
    halo, halo_back = _rows_moved(segments, [[(max(0, a - c.window + 1), a) for a, _, o in segments if o == p]
                                             for p in range(cp)])
    out = [{"fwd": positions + b * n * d * e, "bwd": b * back * d * e} for n, back in zip(halo, halo_back)]
    if kind == "sliding":
        return out
    rate = c.rate(kind)
    span = 2 * rate if kind == "csa" else rate
    width = 4 * d if kind == "csa" else 2 * d  # the [C | Z] rows (CSA: twice as wide, the overlap)
    entry = d
    if c.indexed(kind):
        width += 4 * c.index_head_dim
        entry += c.index_head_dim
    pools = []
    for p in range(cp):
        pools.append([(max(0, first * rate - span + rate), end * rate) for first, end in _entries_on(segments, p, rate)
                      if end > first])
    straddle, straddle_back = _rows_moved(segments, pools)
    counts = [sum(end - first for first, end in _entries_on(segments, p, rate)) for p in range(cp)]
    gather = (cp - 1) * max(counts) * entry * e  # padded to the largest share, in the activations' dtype
    reduce = 2 * (cp - 1) * sum(counts) * entry * e // cp
    for p in range(cp):
        out[p]["fwd"] += b * (straddle[p] * width * e + (gather if sum(counts) else 0))
        out[p]["bwd"] += b * (straddle_back[p] * width * e + (reduce if sum(counts) else 0))
    return out


# --------------------------------------------------------------------------------------------- activations
QUERY_TILE = 256  # `cp_ext.attention.compressed.CompressedAttentionSpec.query_tile`


def compressed_attention_elems(c: CompressedLayers, kind: str, *, h: int, a: int, d: int, q_rank: int, rope: int,
                               tp: int, sp: int, cp: int, s: int) -> Dict[str, float]:
    """A V4 attention layer's saved tensors per token, after its input norm's output: 'act' (activation dtype),
    'fp32', 'bytes' (masks and indexes the tiles keep for their recompute), 'copy' (what is saved after the
    attention call: the grouped projections' inputs). Whole per TP rank: q-LoRA, the K=V head, the compressors and
    the entries (each TP rank computes them on the whole sequence); split by TP: the query heads and output groups.

        q       q_res r_q, its norm 2 r_q + 1 (fp32); the per-head norm 2 a d + a and the fp32 q the tiles read
        kv      its norm 2 d + 1 and the fp32 keys the tiles read d (the halo's few rows left out)
        pools   HCA the pooled rows and the softmax 3 d; CSA both halves 4 d (fp32)
        entries every rank's, fp32, read by every tile: C (d [+ D_i]) / m per local token
        RoPE    cos and sin of q, kv and the output 6 p (fp32)
        output  the attention output a d, the grouped projection's G R (activation dtype)
        tiles   each query tile's window mask (tile + W bytes a query), CSA's selection (8 top-k), HCA's entry mask
                (the entries up to the query: s / 2m on average)
    """
    heads, groups = a / tp, c.o_groups / tp
    act = q_rank + heads * d + groups * c.o_lora_rank + h * (1 - 1 / sp)  # gathered under SP: the whole sequence
    fp32 = (2 * q_rank + 1) + (2 * heads * d + heads) + (3 * d + 1) + 6 * rope
    tiles = QUERY_TILE + c.window
    rate = c.rate(kind)
    if kind != "sliding":
        fp32 += 4 * d if kind == "csa" else 3 * d
        entry = d + (c.index_head_dim if c.indexed(kind) else 0)
        fp32 += cp * entry / rate + 3 * d / rate  # the entries, and each block's pooled row, norm and RoPE
        tiles += 8 * c.index_topk if c.indexed(kind) else s / (2 * rate)
    return {"act": act, "fp32": fp32, "bytes": tiles, "copy": heads * d + groups * c.o_lora_rank}


def hyper_connection_elems(n: int, *, h: int, sp: int, iterations: int, last: bool, upcast: bool = True
                           ) -> Dict[str, float]:
    """A layer's mHC saved tensors per token: each mixing's fp32 streams and their norm 2 n h + 1 (``upcast``: the
    activations are not fp32; in fp32 the streams are their own fp32 copy, n h + 1), its Sinkhorn steps (each
    division keeps the matrix and its sums: 2 iterations (n^2 + n)) and gates; the streams it reads n h and the
    block output it mixes in h (activation dtype); the last layer's head once more. Split by SP (per token)."""
    if not n:
        return {"act": 0.0, "fp32": 0.0}
    norm = (2 if upcast else 1) * n * h + 1
    act, fp32 = 2 * (n * h + h), 2 * (norm + 2 * iterations * (n * n + n) + 4 * n)
    if last:
        act, fp32 = act + n * h, fp32 + norm + n
    return {"act": act / sp, "fp32": fp32 / sp}
