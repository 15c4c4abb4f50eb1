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

Backends: ``cpu`` (aten ``_scaled_dot_product_flash_attention_for_cpu``), on CUDA ``flash``,
``efficient`` and ``cudnn`` (aten SDPA ops), and, when installed, ``flash_attn`` and ``te``
(TransformerEngine fused attention). The optional packages are imported only when their
backend is built, never by importing this module. ``get_kernel(device, dtype, name)``
picks one; the environment variable ``CP_EXT_ATTN_KERNEL`` overrides the automatic choice.

Only the ``cpu`` backend is exercised by this repository's CPU test-suite; the GPU
wrappers are written against the op schemas of torch 2.13 / flash-attn 2.x / TE 2.x.
"""

import inspect
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

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
    """

    name = "efficient"
    native_gqa = False

    def _forward(self, q, k, v, causal, scale):
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[2]]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        s = q.shape[2]
        lse = F.pad(lse.float(), (0, (-s) % 32)).contiguous()
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q, k, v, None, out.contiguous(), lse, no_rng, no_rng,
            0.0, [True, True, True, False], causal, scale=scale,
        )
        return dq, dk, dv


class CudaCudnnSdpaKernel(AttnKernel):
    """aten ``_scaled_dot_product_cudnn_attention`` (CUDA, fp16/bf16). Only on request.

    cuDNN returns the LSE as ``[b, h, s, 1]``; it is squeezed for the merge and restored
    for the backward. cuDNN is strict about strides, so everything is made contiguous.
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
            dout.contiguous(), q, k, v, out.contiguous(), lse.float().unsqueeze(-1).contiguous(),
            no_rng, no_rng, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        return dq, dk, dv


def _call_by_name(fn, values):
    """Call ``fn`` with the entries of ``values`` its signature names (flash-attn's API drifts)."""
    params = inspect.signature(fn).parameters
    kwargs = {}
    for name, p in params.items():
        if name in values:
            kwargs[name] = values[name]
        elif p.default is inspect.Parameter.empty:
            raise TypeError(f"{fn.__module__}.{fn.__name__}: no value for required argument {name!r}")
    return fn(**kwargs)


class FlashAttnKernel(AttnKernel):
    """The flash-attn package (``flash_attn.flash_attn_interface``), layout [b, s, h, d]."""

    name = "flash_attn"
    native_gqa = True

    def __init__(self):
        from flash_attn import flash_attn_interface as fa  # import-guarded by get_kernel

        self._fwd = fa._flash_attn_forward
        self._bwd = fa._flash_attn_backward

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


KERNELS = {
    "cpu": CpuSdpaKernel,
    "flash": CudaFlashSdpaKernel,
    "efficient": CudaEfficientSdpaKernel,
    "cudnn": CudaCudnnSdpaKernel,
    "flash_attn": FlashAttnKernel,
    "te": TransformerEngineKernel,
}
_CACHE = {}


def get_kernel(device: torch.device, dtype: torch.dtype, name: Optional[str] = None) -> AttnKernel:
    """The local kernel for tensors on ``device`` of ``dtype``.

    ``name`` (or ``$CP_EXT_ATTN_KERNEL``) picks one of ``KERNELS`` explicitly; otherwise CPU
    tensors get ``cpu`` and CUDA tensors ``flash`` for fp16/bf16 and ``efficient`` for fp32.
    An explicitly named optional backend that is not installed raises ImportError.
    """
    device = torch.device(device)
    name = name or os.environ.get("CP_EXT_ATTN_KERNEL") or None
    if name is None:
        if device.type != "cuda":
            name = "cpu"
        elif dtype in (torch.float16, torch.bfloat16):
            name = "flash"
        else:
            name = "efficient"
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)}")
    if name not in _CACHE:
        _CACHE[name] = KERNELS[name]()
    return _CACHE[name]
