"""DeepSeek-V4's compressors: one entry per complete block of ``m`` tokens, a per-channel softmax pool.

For a block ``w`` of a document, with each token's projections ``C_j`` (K=V values) and ``Z_j`` (gate
logits) and a learned position bias ``B`` [m, ...] added by the token's slot in its block::

    entry_w = RoPE( kv_norm( sum_j softmax_j(Z_j + B_slot(j)) * C_j ),  position m * w )

the softmax taken per channel over the pool's tokens, in fp32. HCA pools the block's ``m`` tokens.
CSA projects to twice the width and pools ``2m`` slots: the first half of block ``w - 1``'s
projections (its ``Ca`` series) and the second half of block ``w``'s (``Cb``); block 0's first half
is empty (zero values, ``-inf`` gates). This is transformers' ``DeepseekV4HCACompressor`` /
``DeepseekV4CSACompressor`` without a cache, per document. Each rank forms the entries whose block
ends on it, from a table of rows that holds its own tokens and the ones `exchange.fetch_rows` brought.
"""

from dataclasses import dataclass

import torch

from cp_ext.attention.cp.primitives import accum_dtype


def rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV4RMSNorm`` (``weight`` None: its ``DeepseekV4UnweightedRMSNorm``), computed in fp32
    (fp64 for fp64 inputs), the result in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out if weight is None else out * weight.to(acc)).to(x.dtype)


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """V4's RoPE on the trailing ``2 * len(inv_freq)`` channels of ``x`` [n, ..., D], pairs of adjacent channels
    rotated (``positions`` [n]); ``inverse`` rotates back (the output's de-rotation at the query position)."""
    freqs = positions.to(torch.float64 if x.dtype == torch.float64 else torch.float32).unsqueeze(-1) * inv_freq.to(
        device=x.device, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    shape = (freqs.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[1],)
    cos, sin = freqs.cos().view(shape), freqs.sin().view(shape)
    if inverse:
        sin = -sin
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    out = rope.to(cos.dtype) * cos + rotated.to(cos.dtype) * sin
    return torch.cat([nope, out.to(x.dtype)], dim=-1)


@dataclass
class Compressor:
    """One compressor's per-token rows and parameters.

    ``rows`` [s_local, b, 2F]: each token's ``[C | Z]`` projections, F = width (HCA) or 2 x width (CSA,
    ``overlap``); ``position_bias`` [rate, F]; ``norm_weight`` [width]; ``inv_freq``: RoPE of the entries."""

    rows: torch.Tensor
    rate: int
    width: int
    overlap: bool
    position_bias: torch.Tensor
    norm_weight: torch.Tensor
    eps: float
    inv_freq: torch.Tensor

    @property
    def row_width(self) -> int:
        return 4 * self.width if self.overlap else 2 * self.width


def form_entries(table: torch.Tensor, table_index: torch.Tensor, keys: torch.Tensor, doc_start: torch.Tensor,
                 comp: Compressor, column: int) -> torch.Tensor:
    """The entries whose blocks end at key positions ``keys`` [E]: [E, width] in the accumulation dtype.

    ``table`` [n, ...]: rows by table index; ``table_index`` [S]: the table row of each global position
    (-1 where absent); this compressor's rows are ``table[:, column: column + comp.row_width]``;
    ``doc_start`` [E]: the start of each entry's document."""
    acc = accum_dtype(table.dtype)
    m, width = comp.rate, comp.width
    half = comp.row_width // 2
    slots = torch.arange(m, device=keys.device)

    def pool_rows(first: torch.Tensor):
        pos = first.unsqueeze(1) + slots  # [E, m]
        valid = pos >= doc_start.unsqueeze(1)
        rows = table[table_index[pos.clamp(min=0)].clamp(min=0)][..., column:column + comp.row_width].to(acc)
        gate = rows[..., half:] + comp.position_bias.to(acc)
        return rows[..., :half], gate, valid

    kv, gate, _ = pool_rows(keys - m + 1)
    if comp.overlap:
        prev_kv, prev_gate, valid = pool_rows(keys - 2 * m + 1)
        valid = valid.unsqueeze(-1)
        prev_kv = torch.where(valid, prev_kv[..., :width], torch.zeros((), dtype=acc))
        prev_gate = torch.where(valid, prev_gate[..., :width], torch.full((), float("-inf"), dtype=acc))
        kv = torch.cat([prev_kv, kv[..., width:]], dim=1)
        gate = torch.cat([prev_gate, gate[..., width:]], dim=1)
    pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
    entries = rms_norm(pooled, comp.norm_weight, comp.eps)
    return interleaved_rope(entries, (keys - doc_start) // m * m, comp.inv_freq)
