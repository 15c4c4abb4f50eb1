"""The kernel contract every backend implements, and what the base class does around it.

A backend implements ``_forward(q, k, v, causal, scale, mask) -> (out, lse)`` and
``_backward(dout, q, k, v, out, lse, causal, scale, mask) -> (dq, dk, dv)`` on ``[b, h, s, d]``
tensors with one head dim and (unless ``native_gqa``) as many KV heads as query heads;
``mask`` is a boolean ``[s_q, s_k]`` (True: visible), given only to kernels whose
``limits.masks`` is True. The base class adds:

* GQA: KV heads expanded inside the call only, dK/dV summed back over each group in fp32;
* a v head dim that differs from q/k's (MLA: 192 / 128): kernels without ``limits.distinct_v``
  run on zero-padded heads (v, dout, out padded to q's dim, or q, k to v's), which leaves
  every score and every visible result unchanged, then slice;
* masks: `cp_ext.attention.masks.tiles.Band` -> the native causal flag when it is the causal square,
  else the boolean mask; rows that see no key get out 0 and lse -inf (what the LSE merge
  reads as "nothing here"; the CPU kernel itself returns lse 0 for them);
* blocks: `forward_blocks` / `backward_blocks` run a tile's `cp_ext.attention.masks.tiles.Block` s,
  merging blocks that share rows by LSE; `forward_segments` / `backward_segments` are the
  documents-only form of the same.

``backward`` takes the *global* out/lse (the finished ones, sink included): the kernel
recomputes P = exp(scale q k^T - lse) and D = rowsum(dout * out) from them, so each block's
call yields its exact share of dq and dk/dv. A row whose global lse is -inf (it sees nothing)
gets lse +inf there, so P = 0 instead of NaN.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from cp_ext.attention.masks.tiles import Band, Block
from cp_ext.attention.cp.primitives import accum_dtype, update_out_and_lse

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Limits:
    """What a kernel runs, as data (`cp_ext.attention.kernels.supported` reads it).

    device: "cpu" / "cuda" / None (any); dtypes: None (any float); align: head dims must be a
    multiple of it per dtype (a dict or one int); max_head_dim: None (any); masks: takes an
    arbitrary mask (windows, document bands), not only causal; distinct_v: runs a v head dim
    other than q's natively (otherwise padded to the larger one); package: (import name, pip name).
    """

    device: Optional[str] = "cuda"
    dtypes: Optional[Tuple[torch.dtype, ...]] = HALF
    align: object = 8
    max_head_dim: Optional[int] = None
    masks: bool = False
    distinct_v: bool = False
    package: Optional[Tuple[str, str]] = None

    def alignment(self, dtype) -> int:
        return self.align.get(dtype, self.align.get(None, 1)) if isinstance(self.align, dict) else self.align


def check_shapes(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"kernels take [b, h, s, d] tensors, got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or q.shape[1] % k.shape[1] != 0 or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"bad shapes: q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} (k and v share "
                         f"[b, hk, s], q and k the head dim, and h % hk == 0)")


class AttnKernel:
    """Base class: GQA, head-dim padding, masks and blocks around ``_forward`` / ``_backward``."""

    name = "base"
    native_gqa = True
    limits = Limits()

    # ------------------------------------------------------------------ one call
    def forward(self, q, k, v, *, scale: float, causal: bool = False, band: Optional[Band] = None):
        """(out [b, h, s_q, d_v] in q's dtype, lse [b, h, s_q] fp32 / fp64) of one rectangle.

        ``causal`` (square only) or ``band`` (a `Band` on local indices; None: all visible)."""
        check_shapes(q, k, v)
        if band is not None and band.is_anti_causal(q.shape[2], k.shape[2]):
            # j >= i on a square is the causal square with rows and columns reversed: every kernel's own case
            out, lse = self.forward(q.flip(2), k.flip(2), v.flip(2), scale=scale, causal=True)
            return out.flip(2), lse.flip(2)
        causal, mask = self._mask(causal, band, q, k)
        dv = v.shape[-1]
        q, k, v = self._pad_heads(q, k, v)
        k, v = self._expand_kv(q, k, v)
        out, lse = self._forward(q, k, v, causal, scale, mask)
        if mask is not None:
            blind = ~mask.any(-1)  # rows that see no key in this rectangle
            if bool(blind.any()):
                out = out.masked_fill(blind[:, None], 0.0)
                lse = lse.masked_fill(blind, float("-inf"))
        return out[..., :dv], lse

    def backward(self, dout, q, k, v, out, lse, *, scale: float, causal: bool = False, band: Optional[Band] = None):
        """(dq, dk, dv) of one rectangle from the global ``out`` / ``lse``; dk/dv may be fp32 (GQA sums)."""
        check_shapes(q, k, v)
        if band is not None and band.is_anti_causal(q.shape[2], k.shape[2]):
            flip = lambda x: x.flip(2)  # noqa: E731  (as forward: the causal square, reversed)
            grads = self.backward(*map(flip, (dout, q, k, v, out, lse)), scale=scale, causal=True)
            return tuple(map(flip, grads))
        causal, mask = self._mask(causal, band, q, k)
        hk, dqk, dv = k.shape[1], q.shape[-1], v.shape[-1]
        dout, out = dout.to(q.dtype), out.to(q.dtype)  # a tile's merged fp32 out: the kernel takes q's dtype
        q, k, v = self._pad_heads(q, k, v)
        dout, out = _pad_to(dout, v.shape[-1]), _pad_to(out, v.shape[-1])
        lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # sees nothing: P = 0, not NaN
        k, v = self._expand_kv(q, k, v)
        dq, dk, dvv = self._backward(dout, q, k, v, out, lse, causal, scale, mask)
        if dk.shape[1] != hk:  # sum the expanded heads of each KV group back, in fp32
            g = dk.shape[1] // hk
            acc = torch.float32 if dk.dtype != torch.float64 else dk.dtype
            dk, dvv = (x.unflatten(1, (hk, g)).sum(2, dtype=acc) for x in (dk, dvv))
        return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]

    # ------------------------------------------------------------------ a tile's blocks
    def forward_blocks(self, q, k, v, blocks: Sequence[Block], *, scale: float):
        """(out [b, h, s_q, d_v], lse [b, h, s_q]) of a tile: every block computed, merged by LSE
        where blocks share rows; rows no block covers get out 0, lse -inf. One block that covers
        the whole tile for every sample is one plain call (out in q's dtype)."""
        if len(blocks) == 1 and _covers(blocks[0], q, k):
            return self.forward(q, k, v, scale=scale, causal=False, band=blocks[0].band)
        acc = accum_dtype(q.dtype)
        out = torch.zeros(q.shape[:3] + v.shape[-1:], dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for blk in blocks:
            bs = slice(None) if blk.b is None else slice(blk.b, blk.b + 1)
            rows, cols = slice(blk.q0, blk.q1), slice(blk.k0, blk.k1)
            o, l = self.forward(q[bs, :, rows], k[bs, :, cols], v[bs, :, cols], scale=scale, band=blk.band)
            update_out_and_lse(out[bs], lse[bs], o, l, rows)
        return out, lse

    def backward_blocks(self, dout, q, k, v, out, lse, blocks: Sequence[Block], *, scale: float):
        """dq, dk, dv of `forward_blocks` from the global out/lse (fp32 / fp64; zero where no block reaches)."""
        if len(blocks) == 1 and _covers(blocks[0], q, k):
            return self.backward(dout, q, k, v, out, lse, scale=scale, band=blocks[0].band)
        acc = accum_dtype(q.dtype)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
        for blk in blocks:
            bs = slice(None) if blk.b is None else slice(blk.b, blk.b + 1)
            qs, ks = (bs, slice(None), slice(blk.q0, blk.q1)), (bs, slice(None), slice(blk.k0, blk.k1))
            g = self.backward(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs], scale=scale, band=blk.band)
            dq[qs] += g[0]
            dk[ks] += g[1]
            dv[ks] += g[2]
        return dq, dk, dv

    def forward_segments(self, q, k, v, segments, *, causal: bool, scale: float):
        """Packed documents (`cp_ext.attention.masks.documents.Segment` s, disjoint rows): `forward_blocks`
        with the causal band on each (square) segment when ``causal``; out in q's dtype (the segments'
        rows are disjoint, so nothing was merged in fp32)."""
        out, lse = self.forward_blocks(q, k, v, _segment_blocks(segments, causal), scale=scale)
        return out.to(q.dtype), lse

    def backward_segments(self, dout, q, k, v, out, lse, segments, *, causal: bool, scale: float):
        return self.backward_blocks(dout, q, k, v, out, lse, _segment_blocks(segments, causal), scale=scale)

    # ------------------------------------------------------------------ helpers
    def _mask(self, causal, band, q, k):
        """(causal flag, boolean mask or None) for the backend."""
        sq, sk = q.shape[2], k.shape[2]
        if causal:
            if sq != sk:
                raise ValueError("causal local attention is only used on square (diagonal) tiles")
            return True, None
        if band is None:
            return False, None
        if band.is_causal(sq, sk):
            return True, None
        if not self.limits.masks:
            raise ValueError(f"the {self.name} kernel cannot apply a sliding window or a banded mask (its limits: "
                             f"masks=False); get_kernel(..., window=True) picks a kernel that can")
        return False, band.mask(sq, sk, q.device)

    def _pad_heads(self, q, k, v):
        """q/k and v at one head dim (the larger), zero-padded, for kernels without ``distinct_v``."""
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv or self.limits.distinct_v:
            return q, k, v
        if dv < dqk:
            return q, k, F.pad(v, (0, dqk - dv))
        return F.pad(q, (0, dv - dqk)), F.pad(k, (0, dv - dqk)), v

    def _expand_kv(self, q, k, v):
        if self.native_gqa or k.shape[1] == q.shape[1]:
            return k, v
        g = q.shape[1] // k.shape[1]
        return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

    def _forward(self, q, k, v, causal, scale, mask):  # pragma: no cover - abstract
        raise NotImplementedError

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"


def _pad_to(x, d):
    """``x`` zero-padded on its last (head) dim to ``d``."""
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


def _covers(blk: Block, q, k) -> bool:
    return blk.b is None and (blk.q0, blk.q1, blk.k0, blk.k1) == (0, q.shape[2], 0, k.shape[2])


def _segment_blocks(segments, causal):
    return [Block(g.q0, g.q1, g.k0, g.k1, Band(None, 0) if causal and g.q1 - g.q0 > 1 else None, g.b)
            for g in segments if g.q1 > g.q0 and g.k1 > g.k0]
