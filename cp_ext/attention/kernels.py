"""Local attention kernels behind one small interface: ``forward -> (out, lse)`` and ``backward``.

Every kernel takes the kernel layout ``[b, h, s, d]`` (views with any strides along b/h/s
are fine; the wrapper makes what its op needs contiguous):

    out, lse   = kernel.forward(q, k, v, causal=..., scale=...)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=..., scale=...)

* ``k``/``v`` may have fewer heads than ``q`` (GQA, ``h % hk == 0``). Kernels without native
  GQA expand KV *inside the call only* (``repeat_interleave``) and sum dK/dV back over each
  group, so KV never travels expanded.
* ``out`` has q's dtype; ``lse`` is ``[b, h, s_q]`` in fp32 (fp64 for fp64 inputs), the
  natural-log log-sum-exp of the scaled scores of each query row.
* ``causal`` is only used with ``s_q == s_k`` (the diagonal tile), where top-left and
  bottom-right alignment coincide.
* ``backward`` takes the *global* ``out``/``lse`` of the whole ring: the kernel recomputes
  P = exp(scale * q k^T - lse) and D = rowsum(dout * out) from them, so each per-block call
  yields that block's exact share of dq and the exact dk/dv of that block. dk/dv may come
  back in fp32 when they were summed over a GQA group; callers accumulate in fp32 anyway.

Kernels and their limits (`supported` encodes them; `choose_kernel` picks among them):

=============  ====================================  ===========  ==================================
kernel         what                                  dtypes       head dim d
=============  ====================================  ===========  ==================================
``cpu``        aten ``_scaled_dot_product_flash_     fp64, fp32,  any
               attention_for_cpu`` (CPU only)        bf16, fp16
``flash``      aten ``_scaled_dot_product_flash_     fp16, bf16   d % 8 == 0, d <= 256
               attention`` (FlashAttention-2, CUDA)
``efficient``  aten ``_scaled_dot_product_efficient  fp32, fp16,  d % 8 == 0 (fp16/bf16),
               _attention`` (cutlass mem-efficient)  bf16         d % 4 == 0 (fp32); no fp64
``cudnn``      aten ``_scaled_dot_product_cudnn_     fp16, bf16   d % 8 == 0, d <= 128;
               attention`` (cuDNN, torch >= 2.5)                  torch >= 2.5
``flash_attn`` the flash-attn package (2.x)          fp16, bf16   d % 8 == 0, d <= 256
``te``         TransformerEngine fused attention     fp16, bf16   d % 8 == 0, d <= 256
``unfused``    plain PyTorch (matmul, logsumexp):    any float    any
               any device, O(s_q x s_k) memory
=============  ====================================  ===========  ==================================

Sources: torch's ``sdp_utils.cpp`` (``check_head_dim_size_flash``: d <= 256;
``check_head_dim_size_mem_efficient``: d divisible by ``minimum_gemm_alignment``, which is 8
for fp16/bf16 and 4 for fp32 on sm80+; ``check_cudnn_tensor_shapes``: d % 8 == 0 and d <= 128,
256 only on sm90/sm100 with a recent cuDNN; the dtype lists of ``can_use_*``). The direct ops
do not pad the head dim (only ``F.scaled_dot_product_attention`` does), hence ``% 8`` for
flash. flash-attn asserts ``head_dim <= 256`` and pads to a multiple of 8 only in its autograd
wrappers, which cp_ext does not use. cuDNN's LSE is ``[b, h, s, 1]`` from torch 2.9 and
``[b, h, s]`` before; `cudnn_lse_for_backward` hands the backward the shape its forward gave.
Not checked here (they need the GPU): the architecture (flash and cudnn need sm80+, efficient
takes bf16 only on sm80+), cuDNN's version, and TE's own per-architecture limits.

Choosing (``--attention-backend``, `cp_ext.arguments`; the config's ``attention_kernel``):
``auto`` picks, per call, the first kernel of `PREFERENCE` that supports the dtype and head
dim: on CUDA ``flash``, else ``efficient``, else ``unfused``; on CPU ``cpu``. Megatron-LM's
choices map onto these kernels: ``flash`` -> ``flash`` (FlashAttention-2 as built into torch),
``fused`` -> ``cudnn`` (cuDNN's fused attention, the kernels behind TE's FusedAttention),
``unfused`` and ``local`` -> ``unfused`` (plain PyTorch math, as TE's unfused and megatron's
local DotProductAttention are). cp_ext's own names (``efficient``, ``cudnn``, ``flash_attn``,
``te``, ``cpu``) are accepted as they are. A named kernel that cannot run the call's dtype,
head dim or device raises ValueError with its limit (the argument parser reports the same
message at parse time). The optional packages are imported only when their kernel is built,
never by importing this module.

Only the ``cpu`` and ``unfused`` kernels run numerically in this repository's CPU test-suite;
the CUDA wrappers are checked on CPU for their op schemas and shapes (meta tensors) and the
arguments they pass, and numerically by tools/gpu_check.sh on a GPU.
"""

import importlib.util
import inspect
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from cp_ext.attention.utils import accum_dtype

aten = torch.ops.aten


class AttnKernel:
    """Base class: GQA handling around the backend's ``_forward``/``_backward``."""

    name = "base"
    native_gqa = True

    def forward(self, q, k, v, *, causal: bool, scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
        _check(q, k, v, causal)
        k, v = self._expand_kv(q, k, v)
        out, lse = self._forward(q, k, v, causal, scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        _check(q, k, v, causal)
        hk = k.shape[1]
        k, v = self._expand_kv(q, k, v)
        dq, dk, dv = self._backward(dout, q, k, v, out, lse, causal, scale)
        if dk.shape[1] != hk:  # sum the expanded heads of each KV group back, in fp32
            g = dk.shape[1] // hk
            dk = dk.unflatten(1, (hk, g)).sum(2, dtype=torch.float32 if dk.dtype != torch.float64 else dk.dtype)
            dv = dv.unflatten(1, (hk, g)).sum(2, dtype=dk.dtype)
        return dq, dk, dv

    def forward_segments(self, q, k, v, segments, *, causal: bool, scale: float):
        """Attention of packed documents: each `cp_ext.attention.documents.Segment` is one call.

        Returns (out [b, h, s_q, d] in q's dtype, lse [b, h, s_q] fp32/fp64); rows no segment
        covers (their document is not in k, or padding) get out 0 and lse -inf, which the LSE
        merge treats as "no keys here". ``causal`` segments are squares (diagonal tiles).
        Kernels with a native variable-length call may override this and `backward_segments`.
        """
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
        for g in segments:
            o, l = self.forward(q[g.b : g.b + 1, :, g.q0 : g.q1], k[g.b : g.b + 1, :, g.k0 : g.k1],
                                v[g.b : g.b + 1, :, g.k0 : g.k1], causal=causal, scale=scale)
            out[g.b, :, g.q0 : g.q1] = o[0]
            lse[g.b, :, g.q0 : g.q1] = l[0]
        return out, lse

    def backward_segments(self, dout, q, k, v, out, lse, segments, *, causal: bool, scale: float):
        """dq, dk, dv (fp32, fp64 for fp64) of `forward_segments` from the *global* out/lse; zero
        where no segment reaches."""
        acc = accum_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for g in segments:
            qs, ks = (g.b, slice(None), slice(g.q0, g.q1)), (g.b, slice(None), slice(g.k0, g.k1))
            one = lambda x, rows: x[rows].unsqueeze(0)
            dq_s, dk_s, dv_s = self.backward(one(dout, qs), one(q, qs), one(k, ks), one(v, ks), one(out, qs),
                                             one(lse, qs), causal=causal, scale=scale)
            dq[qs] += dq_s[0]
            dk[ks] += dk_s[0]
            dv[ks] += dv_s[0]
        return dq, dk, dv

    def _expand_kv(self, q, k, v):
        if self.native_gqa or k.shape[1] == q.shape[1]:
            return k, v
        g = q.shape[1] // k.shape[1]
        return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

    def _forward(self, q, k, v, causal, scale):  # pragma: no cover - abstract
        raise NotImplementedError

    def _backward(self, dout, q, k, v, out, lse, causal, scale):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"


def _check(q, k, v, causal):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"kernels take [b, h, s, d] tensors, got q{tuple(q.shape)} k{tuple(k.shape)}")
    if k.shape != v.shape or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"bad GQA shapes: q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("causal local attention is only used on square (diagonal) tiles")


class CpuSdpaKernel(AttnKernel):
    """aten's CPU flash kernel: fp64/fp32/bf16/fp16, native GQA, returns the LSE."""

    name = "cpu"
    native_gqa = True

    def _forward(self, q, k, v, causal, scale):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale
        )


class CudaFlashSdpaKernel(AttnKernel):
    """aten ``_scaled_dot_product_flash_attention`` (CUDA, fp16/bf16, head_dim % 8 == 0, <= 256)."""

    name = "flash"
    native_gqa = True  # the flash kernel accepts h % hk == 0

    def _forward(self, q, k, v, causal, scale):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # dropout_p == 0: unused
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None,
            q.shape[2], k.shape[2], 0.0, causal, no_rng, no_rng, scale=scale,
        )
        return dq, dk, dv


class CudaEfficientSdpaKernel(AttnKernel):
    """aten ``_scaled_dot_product_efficient_attention`` (CUDA, fp32/fp16/bf16; no native GQA).

    Its LSE comes back padded to a multiple of 32 along the sequence: sliced for the merge,
    padded again for the backward.

    Layouts: the op transposes its ``[b, h, s, d]`` arguments to ``[b, s, h, d]`` and the
    cutlass backward reads q/k/v/dout through their strides, but reads ``out`` with a fixed
    row stride of ``h * d`` (``o_strideM`` is never set from the tensor): the fp16/bf16
    kernels compute D = rowsum(dout * out) in-kernel from it (fp32 computes D with torch ops,
    which honour strides). So ``out`` must be packed as ``[b, s, h, d]`` -- the layout the
    forward returns, but not the ring's merged fp32 output cast back -- or dq/dk/dv are
    silently wrong. dout is passed in the same packing (the op would copy it there anyway);
    q/k/v only need a contiguous last dim.
    """

    name = "efficient"
    native_gqa = False

    def _forward(self, q, k, v, causal, scale):
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        s = q.shape[2]
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        lse = F.pad(lse.float(), (0, (-s) % 32)).contiguous()
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _bshd_packed(dout), q, k, v, None, _bshd_packed(out), lse, no_rng, no_rng,
            0.0, [True, True, True, False], causal, scale=scale,
        )
        return dq, dk, dv


def _bshd_packed(x):
    """``x`` [b, h, s, d] (same shape) stored as a contiguous [b, s, h, d]; no copy if it already is."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class CudaCudnnSdpaKernel(AttnKernel):
    """aten ``_scaled_dot_product_cudnn_attention`` (CUDA, fp16/bf16, torch >= 2.5). Only on request.

    cuDNN's LSE is ``[b, h, s, 1]`` from torch 2.9 (``[b, h, s]`` before): squeezed for the
    merge, and given back to the backward in the shape its forward returned
    (`cudnn_lse_for_backward`). cuDNN is strict about strides, so everything is made contiguous.
    """

    name = "cudnn"
    native_gqa = False

    def _forward(self, q, k, v, causal, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, (lse.squeeze(-1) if lse.dim() == 4 else lse)

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), cudnn_lse_for_backward(lse, torch.__version__),
            no_rng, no_rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        return dq, dk, dv


def cudnn_lse_for_backward(lse, torch_version):
    """The LSE as cuDNN's backward takes it: the shape its forward returned under ``torch_version``.

    From torch 2.9 the cuDNN forward returns ``[b, h, s, 1]`` and the backward takes it as is;
    before, the forward returned ``[b, h, s]`` and the backward unsqueezed it itself.
    """
    lse = lse.float()
    if _version(torch_version) >= (2, 9):
        return (lse if lse.dim() == 4 else lse.unsqueeze(-1)).contiguous()
    return (lse.squeeze(-1) if lse.dim() == 4 else lse).contiguous()


def _version(v) -> Tuple[int, int]:
    """(major, minor) of a version string such as ``2.13.0+cu128`` or ``2.9.0a0``."""
    if isinstance(v, tuple):
        return v[:2]
    major, minor = (str(v).split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


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

    Packed documents: `forward_segments` / `backward_segments` make *one* varlen call per tile
    (``_flash_attn_varlen_forward`` / ``_backward``): the segments' rows packed into
    ``[total, h, d]`` with cu_seqlens, one sequence per segment (causal segments are squares, so
    flash-attn's bottom-right causal alignment is the diagonal mask), then scattered back.
    """

    name = "flash_attn"
    native_gqa = True
    _padded_varlen_lse = False  # flash-attn < 2.6: the varlen backward reads [n, h, max_seqlen_q]

    def __init__(self):
        import flash_attn  # import-guarded by get_kernel
        from flash_attn import flash_attn_interface as fa

        self._fwd = fa._flash_attn_forward
        self._bwd = fa._flash_attn_backward
        self._varlen_fwd = fa._flash_attn_varlen_forward
        self._varlen_bwd = fa._flash_attn_varlen_backward
        self._padded_varlen_lse = _version(getattr(flash_attn, "__version__", "2.6")) < (2, 6)

    def forward_segments(self, q, k, v, segments, *, causal: bool, scale: float):
        _check(q, k, v, causal)
        return varlen_forward_segments(self._varlen_forward, q, k, v, segments, causal=causal, scale=scale)

    def backward_segments(self, dout, q, k, v, out, lse, segments, *, causal: bool, scale: float):
        _check(q, k, v, causal)
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

    def _forward(self, q, k, v, causal, scale):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [b, s, h, d], last dim contiguous
        ret = _call_by_name(self._fwd, dict(
            q=qt, k=kt, v=vt, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False,
        ))
        out, lse = (ret[0], ret[1]) if len(ret) == 4 else (ret[0], ret[5])  # >=2.6 / older
        return out.transpose(1, 2), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        _call_by_name(self._bwd, dict(
            dout=dout.transpose(1, 2).contiguous(), q=qt, k=kt, v=vt, out=out.transpose(1, 2).contiguous(),
            softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale,
            causal=causal, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False, rng_state=None,
        ))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class TransformerEngineKernel(AttnKernel):
    """TransformerEngine fused attention (F16 arbitrary-seqlen backend), layout bshd.

    Its softmax statistics (``aux_ctx_tensors[0]``, ``[b, h, s, 1]`` fp32) are the LSE.
    """

    name = "te"
    native_gqa = True

    def __init__(self):
        import transformer_engine_torch as tex  # import-guarded by get_kernel
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions.fused_attn import fused_attn_bwd, fused_attn_fwd

        self._fwd, self._bwd, self._te_dtype = fused_attn_fwd, fused_attn_bwd, TE_DType
        self._backend = tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen

    @staticmethod
    def _cu_seqlens(b, s, device):
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)

    def _forward(self, q, k, v, causal, scale):
        b, _, sq, _ = q.shape
        sk = k.shape[2]
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        out, aux = self._fwd(
            is_training=True, max_seqlen_q=sq, max_seqlen_kv=sk,
            cu_seqlens_q=self._cu_seqlens(b, sq, q.device), cu_seqlens_kv=self._cu_seqlens(b, sk, q.device),
            q=qt, k=kt, v=vt, fake_dtype=q.dtype, fused_attention_backend=self._backend,
            attn_scale=scale, dropout=0.0, qkv_layout="bshd_bshd_bshd",
            attn_mask_type="causal" if causal else "no_mask",
        )
        self._rng_state = aux[1] if len(aux) > 1 else None
        return out.transpose(1, 2), aux[0].squeeze(-1)

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        b, _, sq, _ = q.shape
        sk = k.shape[2]
        qt, kt, vt, ot, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, out, dout))
        aux = [lse.float().unsqueeze(-1).contiguous()]
        if getattr(self, "_rng_state", None) is not None:
            aux.append(self._rng_state)  # dropout is 0: its content is unused
        dq, dk, dv, *_ = self._bwd(
            max_seqlen_q=sq, max_seqlen_kv=sk,
            cu_seqlens_q=self._cu_seqlens(b, sq, q.device), cu_seqlens_kv=self._cu_seqlens(b, sk, q.device),
            q=qt, k=kt, v=vt, o=ot, d_o=dot, fake_dtype=q.dtype, dqkv_dtype=self._te_dtype[q.dtype],
            aux_ctx_tensors=aux, fused_attention_backend=self._backend, attn_scale=scale, dropout=0.0,
            qkv_layout="bshd_bshd_bshd", attn_mask_type="causal" if causal else "no_mask",
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class UnfusedKernel(AttnKernel):
    """Plain PyTorch: scores = scale * q k^T, LSE = logsumexp(scores), out = exp(scores - LSE) v.

    Any device and float dtype (math in fp32, fp64 for fp64), any head dim, at the cost of
    materializing the ``[b, h, s_q, s_k]`` scores. Megatron's ``unfused`` / ``local``, and auto's
    last resort on CUDA (fp64, or a head dim no fused kernel takes). The backward recomputes P
    from the global LSE: dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q.
    """

    name = "unfused"
    native_gqa = False

    @staticmethod
    def _scores(q, k, causal, scale):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
        if causal:
            sq, sk = scores.shape[-2:]
            scores.masked_fill_(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return scores

    def _forward(self, q, k, v, causal, scale):
        scores = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(scores.dtype))
        return out.to(q.dtype), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        scores = self._scores(q, k, causal, scale)
        acc = scores.dtype
        p = torch.exp(scores - lse.to(acc).unsqueeze(-1))
        do = dout.to(acc)
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, v.to(acc).transpose(-1, -2)) - (do * out.to(acc)).sum(-1, keepdim=True))
        dq = torch.matmul(ds, k.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


KERNELS = {
    "cpu": CpuSdpaKernel,
    "flash": CudaFlashSdpaKernel,
    "efficient": CudaEfficientSdpaKernel,
    "cudnn": CudaCudnnSdpaKernel,
    "flash_attn": FlashAttnKernel,
    "te": TransformerEngineKernel,
    "unfused": UnfusedKernel,
}
_CACHE = {}

# auto's order of preference per device type; the last entry runs everything.
PREFERENCE = {"cuda": ("flash", "efficient", "unfused"), "cpu": ("cpu", "unfused")}

_HALF = (torch.float16, torch.bfloat16)
_DEVICE = {"cpu": "cpu", "unfused": None}  # None: any device; every other kernel is CUDA-only
_DTYPES = {
    "flash": _HALF, "cudnn": _HALF, "flash_attn": _HALF, "te": _HALF,
    "efficient": (torch.float32,) + _HALF,
    "cpu": (torch.float64, torch.float32) + _HALF,
}
_MAX_HEAD_DIM = {"flash": 256, "flash_attn": 256, "te": 256, "cudnn": 128}
_PACKAGES = {"flash_attn": ("flash_attn", "flash-attn"), "te": ("transformer_engine", "transformer-engine[pytorch]")}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).replace("torch.", ""))


def supported(name: str, dtype: torch.dtype, head_dim: Optional[int], device_type: str,
              torch_version=None) -> Optional[str]:
    """None if kernel ``name`` runs ``dtype`` with ``head_dim`` on ``device_type``, else why not.

    Pure (looks at nothing installed): the reason names the kernel's limit. ``head_dim`` None
    skips the head-dim rules; ``torch_version`` (default: the installed one) matters for cudnn.
    """
    if name not in KERNELS:
        return f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}"
    wants = _DEVICE.get(name, "cuda")
    if wants is not None and device_type != wants:
        return f"the {name} kernel runs on {wants.upper()} tensors only, not {device_type}"
    allowed = _DTYPES.get(name)
    if not dtype.is_floating_point or (allowed is not None and dtype not in allowed):
        kinds = "/".join(map(dtype_name, allowed)) if allowed else "floating-point"
        return f"the {name} kernel takes {kinds} only, not {dtype_name(dtype)}"
    torch_version = torch_version or torch.__version__
    if name == "cudnn" and _version(torch_version) < (2, 5):
        return f"the cudnn kernel needs torch >= 2.5 (the op signature cp_ext calls), not {torch_version}"
    if head_dim is None:
        return None
    align = {"efficient": 8 if dtype in _HALF else 4, "cpu": 1, "unfused": 1}.get(name, 8)
    limit = _MAX_HEAD_DIM.get(name)
    if head_dim < 1 or head_dim % align or (limit and head_dim > limit):
        rule = " and ".join(r for r in (f"a multiple of {align}" if align > 1 else "",
                                        f"at most {limit}" if limit else "") if r) or "at least 1"
        return f"the {name} kernel needs a head dim that is {rule} for {dtype_name(dtype)}, not {head_dim}"
    return None


def kernel_problem(name: str, dtype: torch.dtype, head_dim: Optional[int], device_type: str) -> Optional[str]:
    """`supported`, plus whether an optional package the kernel needs is installed (not imported)."""
    reason = supported(name, dtype, head_dim, device_type)
    if reason is None and name in _PACKAGES and importlib.util.find_spec(_PACKAGES[name][0]) is None:
        reason = f"the {name} kernel needs the {_PACKAGES[name][1]} package, which is not installed"
    return reason


def choose_kernel(device_type: str, dtype: torch.dtype, head_dim: Optional[int] = None, torch_version=None) -> str:
    """auto's pick: the first kernel of ``PREFERENCE[device_type]`` that `supported` accepts."""
    for name in PREFERENCE.get(device_type, ("unfused",)):
        if supported(name, dtype, head_dim, device_type, torch_version) is None:
            return name
    raise ValueError(f"no attention kernel runs {dtype_name(dtype)} with head dim {head_dim} on {device_type}")


def get_kernel(device: torch.device, dtype: torch.dtype, name: Optional[str] = None,
               head_dim: Optional[int] = None) -> AttnKernel:
    """The local kernel for tensors on ``device`` of ``dtype`` and ``head_dim``.

    ``name`` None or ``"auto"`` picks with `choose_kernel`; a named kernel that cannot run
    the call raises ValueError with its limit. An optional backend that is not installed
    raises ImportError.
    """
    device = torch.device(device)
    if name in (None, "auto"):
        name = choose_kernel(device.type, dtype, head_dim)
    elif name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    else:
        reason = supported(name, dtype, head_dim, device.type)
        if reason is not None:
            raise ValueError(f"attention kernel {name!r} cannot run this call: {reason}; "
                             f"use --attention-backend auto, which picks a kernel that fits")
    if name not in _CACHE:
        _CACHE[name] = KERNELS[name]()
    return _CACHE[name]
