"""The flash-attn package (2.x): dense tiles through ``_flash_attn_forward`` / ``_backward``, and a
tile of packed documents through *one* variable-length call (``_flash_attn_varlen_*``).

Limits: fp16/bf16, d % 8 == 0 and d <= 256 (flash-attn asserts it and pads only in its autograd
wrappers, which cp_ext does not use); no mask beyond causal (its own window is aligned to the
bottom-right corner of each call, which a CP tile's band is not in general: a window on this
kernel is a configuration error); one head dim (MLA's v is zero-padded by the base class).
"""

import inspect
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from cp_ext.attention.masks.documents import Segment
from cp_ext.attention.kernels.base import AttnKernel, Limits
from cp_ext.attention.kernels.version import version
from cp_ext.attention.cp.primitives import accum_dtype


def _call_by_name(fn, values):
    """Call ``fn`` with the entries of ``values`` its signature names (flash-attn's API drifts).

    From flash-attn 2.7, ``_flash_attn_forward``/``_backward`` are ``torch.library.custom_op``
    objects (``CustomOpDef``): their own signature is ``(*args, **kwargs)`` and they have no
    ``__name__``. The parameters are read from the function they wrap (``_init_fn``); the op
    itself is called, so it dispatches to the CUDA kernel as flash-attn's own wrappers do.
    """
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    kwargs = {}
    for name, p in params.items():
        if name in values:
            kwargs[name] = values[name]
        elif p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{_fn_name(fn)}: no value for required argument {name!r}")
    return fn(**kwargs)


def _fn_name(fn):
    """A printable name for a function or a custom op (``flashattn::_flash_attn_forward``)."""
    name = getattr(fn, "_qualname", None) or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if name and module and "::" not in name else (name or repr(fn))


class VarlenPack(NamedTuple):
    """Segments packed as one variable-length batch: sequence i is segment i (empty ones dropped).

    Packed row j of q is ``q[q_b[j], :, q_s[j]]`` (``[total_q, h, d]``), of k/v ``k[k_b[j], :, k_s[j]]``;
    ``cu_seqlens_*`` (int32, ``[n + 1]``) are the running sums of the segment lengths.
    """

    q_b: torch.Tensor
    q_s: torch.Tensor
    k_b: torch.Tensor
    k_s: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_pack(segments, device) -> Optional[VarlenPack]:
    """The `VarlenPack` of ``segments`` on ``device``; None when no segment has rows."""
    segments = [g for g in segments if g.q1 > g.q0 and g.k1 > g.k0]
    if not segments:
        return None

    def rows(b, lo, hi):  # the (sample, row) of every row of the segments, in order; cu_seqlens
        b, lo, n = torch.tensor(b), torch.tensor(lo), torch.tensor(hi) - torch.tensor(lo)
        cu = F.pad(n.cumsum(0), (1, 0))
        first = (lo - cu[:-1]).repeat_interleave(n)  # row = packed index + (lo - start of its sequence)
        return [b.repeat_interleave(n), torch.arange(int(cu[-1])) + first, cu], int(n.max())

    q_rows, max_q = rows([g.b for g in segments], [g.q0 for g in segments], [g.q1 for g in segments])
    k_rows, max_k = rows([g.b for g in segments], [g.k0 for g in segments], [g.k1 for g in segments])
    parts = q_rows + k_rows  # built on the CPU, sent to the device in one copy
    q_b, q_s, cu_q, k_b, k_s, cu_k = torch.cat(parts).to(device).split([len(x) for x in parts])
    return VarlenPack(q_b, q_s, k_b, k_s, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k)


def _packed(x, b, s):
    """Rows (b[j], s[j]) of ``x`` [b, h, s, d] (any strides) as a contiguous [n, h, d]."""
    return x[b, :, s].contiguous()


def varlen_forward_segments(varlen_forward, q, k, v, segments, *, causal: bool, scale: float):
    """`AttnKernel.forward_segments` through one variable-length kernel call.

    ``varlen_forward(q, k, v, pack, causal, scale)`` takes the packed ``[total, h, d]`` rows and the
    `VarlenPack` and returns (out ``[total_q, h, d]``, lse ``[h, total_q]``); the result is scattered
    back to ``[b, h, s_q, d]`` / ``[b, h, s_q]``, with out 0 and lse -inf on rows no segment covers.
    The segments' q rows must be disjoint (one document per row, as `tile_segments` gives).
    """
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
    p = varlen_pack(segments, q.device)
    if p is None:
        return out, lse
    o, l = varlen_forward(_packed(q, p.q_b, p.q_s), _packed(k, p.k_b, p.k_s), _packed(v, p.k_b, p.k_s), p,
                          causal, scale)
    out[p.q_b, :, p.q_s] = o.to(out.dtype)
    lse[p.q_b, :, p.q_s] = l.t().to(lse.dtype)
    return out, lse


def varlen_backward_segments(varlen_backward, dout, q, k, v, out, lse, segments, *, causal: bool, scale: float):
    """`AttnKernel.backward_segments` through one variable-length call: dq, dk, dv fp32 (fp64), 0 elsewhere.

    ``varlen_backward(dout, q, k, v, out, lse, pack, causal, scale)`` takes the packed rows (the
    *global* out and lse of the packed q rows, lse as ``[h, total_q]`` fp32) and returns the packed
    dq ``[total_q, h, d]``, dk, dv ``[total_k, hk, d]``; they are added into zeros (index_put_).
    """
    acc = accum_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
    p = varlen_pack(segments, q.device)
    if p is None:
        return dq, dk, dv
    at_q, at_k = (lambda x: _packed(x, p.q_b, p.q_s)), (lambda x: _packed(x, p.k_b, p.k_s))
    lse_p = lse[p.q_b, :, p.q_s].t().float().contiguous()
    grads = varlen_backward(at_q(dout), at_q(q), at_k(k), at_k(v), at_q(out), lse_p, p, causal, scale)
    for full, packed, (b, s) in zip((dq, dk, dv), grads, ((p.q_b, p.q_s), (p.k_b, p.k_s), (p.k_b, p.k_s))):
        full.transpose(1, 2).index_put_((b, s), packed.to(acc), accumulate=True)  # [b, s, h, d] view of full
    return dq, dk, dv


def varlen_segments(blocks, q, k, v):
    """(segments, causal) when ``blocks`` are document segments one varlen call computes (each of one
    sample, disjoint rows, all full or all causal squares, one head dim); else None."""
    if not blocks or q.shape[-1] != v.shape[-1] or any(b.b is None for b in blocks):
        return None
    if any(b.band is not None and not b.band.is_causal(b.q1 - b.q0, b.k1 - b.k0) for b in blocks):
        return None
    causal = {b.band is not None for b in blocks if (b.q1 - b.q0, b.k1 - b.k0) != (1, 1)}  # 1 x 1: either
    if len(causal) > 1:
        return None
    rows = sorted((b.b, b.q0, b.q1) for b in blocks)
    if any(x[0] == y[0] and y[1] < x[2] for x, y in zip(rows, rows[1:])):
        return None
    return [Segment(b.b, b.q0, b.q1, b.k0, b.k1) for b in blocks], bool(causal and causal.pop())


def _varlen_rows(cu_seqlens):
    """(sequence, position in it) of every packed row, from ``cu_seqlens`` [n + 1]."""
    cu = cu_seqlens.long()
    seq = torch.arange(cu.numel() - 1, device=cu.device).repeat_interleave(cu.diff())
    return seq, torch.arange(int(cu[-1]), device=cu.device) - cu[seq]


def flash_attn_varlen_lse(lse, cu_seqlens):
    """flash-attn's varlen LSE as ``[h, total_q]``, from either layout its versions return.

    flash-attn >= 2.6 (PR #970, "Support unpadded LSE layout") returns ``[h, total_q]``; 2.0 to
    2.5 return ``[n, h, max_seqlen_q]``, sequence i's rows at ``[i, :, :len_i]`` (``mha_varlen_fwd``
    in csrc/flash_attn/flash_api.cpp). The decode trick (``seqlenq_ngroups_swapped``: max_seqlen_q
    == 1 with GQA) gives the same layouts (2.6+: ``get_lse_tile`` in flash_fwd_kernel.h writes
    [h, total_q]; before, ``mha_varlen_fwd`` reshapes it to [n, h, 1]).
    """
    if lse.dim() == 2:
        return lse
    seq, pos = _varlen_rows(cu_seqlens)
    return lse[seq, :, pos].t()


def flash_attn_padded_lse(lse, cu_seqlens, max_seqlen):
    """``[h, total_q]`` LSE in the ``[n, h, max_seqlen]`` layout flash-attn < 2.6's varlen backward reads."""
    seq, pos = _varlen_rows(cu_seqlens)
    padded = lse.new_zeros(cu_seqlens.numel() - 1, lse.shape[0], max_seqlen)  # padding: never read
    padded[seq, :, pos] = lse.t()
    return padded


class FlashAttnKernel(AttnKernel):
    """The flash-attn package (``flash_attn.flash_attn_interface``), layout [b, s, h, d].

    Packed documents: `forward_blocks` / `backward_blocks` make *one* varlen call per tile
    (``_flash_attn_varlen_forward`` / ``_backward``): the segments' rows packed into
    ``[total, h, d]`` with cu_seqlens, one sequence per segment (causal segments are squares, so
    flash-attn's bottom-right causal alignment is the diagonal mask), then scattered back.
    """

    name = "flash_attn"
    native_gqa = True
    limits = Limits(max_head_dim=256, package=("flash_attn", "flash-attn"))
    _padded_varlen_lse = False  # flash-attn < 2.6: the varlen backward reads [n, h, max_seqlen_q]

    def __init__(self):
        import flash_attn  # import-guarded by get_kernel
        from flash_attn import flash_attn_interface as fa

        self._fwd = fa._flash_attn_forward
        self._bwd = fa._flash_attn_backward
        self._varlen_fwd = fa._flash_attn_varlen_forward
        self._varlen_bwd = fa._flash_attn_varlen_backward
        self._padded_varlen_lse = version(getattr(flash_attn, "__version__", "2.6")) < (2, 6)

    def forward_blocks(self, q, k, v, blocks, *, scale: float):
        varlen = varlen_segments(blocks, q, k, v)
        if varlen is None:
            return super().forward_blocks(q, k, v, blocks, scale=scale)
        segments, causal = varlen
        return varlen_forward_segments(self._varlen_forward, q, k, v, segments, causal=causal, scale=scale)

    def backward_blocks(self, dout, q, k, v, out, lse, blocks, *, scale: float):
        varlen = varlen_segments(blocks, q, k, v)
        if varlen is None:
            return super().backward_blocks(dout, q, k, v, out, lse, blocks, scale=scale)
        segments, causal = varlen
        return varlen_backward_segments(self._varlen_backward, dout, q, k, v, out, lse, segments,
                                        causal=causal, scale=scale)

    @staticmethod
    def _varlen_args(p, causal, scale):
        return dict(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_k=p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
                    max_seqlen_k=p.max_seqlen_k, dropout_p=0.0, softmax_scale=scale, causal=causal,
                    window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None)

    def _varlen_forward(self, q, k, v, p, causal, scale):
        ret = _call_by_name(self._varlen_fwd, dict(q=q, k=k, v=v, return_softmax=False,
                                                   **self._varlen_args(p, causal, scale)))
        out, lse = (ret[0], ret[1]) if len(ret) == 4 else (ret[0], ret[5])  # >= 2.7 / older
        return out, flash_attn_varlen_lse(lse, p.cu_seqlens_q)

    def _varlen_backward(self, dout, q, k, v, out, lse, p, causal, scale):
        if self._padded_varlen_lse:
            lse = flash_attn_padded_lse(lse, p.cu_seqlens_q, p.max_seqlen_q)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_by_name(self._varlen_bwd, dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(),
                                             dq=dq, dk=dk, dv=dv, deterministic=False, rng_state=None,
                                             **self._varlen_args(p, causal, scale)))
        return dq, dk, dv

    def _forward(self, q, k, v, causal, scale, mask):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [b, s, h, d], last dim contiguous
        ret = _call_by_name(self._fwd, dict(
            q=qt, k=kt, v=vt, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False,
        ))
        out, lse = (ret[0], ret[1]) if len(ret) == 4 else (ret[0], ret[5])  # >=2.6 / older
        return out.transpose(1, 2), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        _call_by_name(self._bwd, dict(
            dout=dout.transpose(1, 2).contiguous(), q=qt, k=kt, v=vt, out=out.transpose(1, 2).contiguous(),
            softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale,
            causal=causal, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False, rng_state=None,
        ))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
