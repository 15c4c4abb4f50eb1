"""torch's own CUDA attention ops, called directly (no padding, no dispatch): flash, efficient, cudnn.

Limits (`Limits`), from torch's ``sdp_utils.cpp``: ``check_head_dim_size_flash`` (d <= 256, and
the direct op does not pad, hence d % 8 == 0); ``check_head_dim_size_mem_efficient`` (d divisible
by 8 for fp16/bf16, 4 for fp32 on sm80+); ``check_cudnn_tensor_shapes`` (d % 8 == 0, d <= 128).
Only ``efficient`` takes a mask (its additive ``attn_bias``) and a v head dim of its own; the
others run windows never (a configuration error) and MLA's v zero-padded to q's head dim.
"""

import torch
import torch.nn.functional as F

from cp_ext.attention.kernels.base import HALF, AttnKernel, Limits
from cp_ext.attention.kernels.version import version

aten = torch.ops.aten


class CudaFlashSdpaKernel(AttnKernel):
    """aten ``_scaled_dot_product_flash_attention`` (CUDA, fp16/bf16, head_dim % 8 == 0, <= 256)."""

    name = "flash"
    native_gqa = True  # the flash kernel accepts h % hk == 0
    limits = Limits(max_head_dim=256)

    def _forward(self, q, k, v, causal, scale, mask):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
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
    # the cutlass kernel takes an additive bias (windows) and a v head dim of its own
    limits = Limits(dtypes=(torch.float32,) + HALF, align={torch.float32: 4, None: 8}, masks=True, distinct_v=True)

    def _forward(self, q, k, v, causal, scale, mask):
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, _bias(mask, q), True, 0.0, causal,
                                                                      scale=scale)
        return out, lse[..., : q.shape[2]]

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
        s = q.shape[2]
        q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
        lse = F.pad(lse.float(), (0, (-s) % 32)).contiguous()
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _bshd_packed(dout), q, k, v, _bias(mask, q), _bshd_packed(out), lse, no_rng, no_rng,
            0.0, [True, True, True, False], causal, scale=scale,
        )
        return dq, dk, dv


def _bias(mask, q):
    """The boolean mask as the op's additive ``attn_bias`` [b, h, s_q, s_k], its rows stored at a
    multiple of 16 elements (the cutlass kernel's alignment; torch's SDPA wrapper pads the same way)."""
    if mask is None:
        return None
    sq, sk = mask.shape
    bias = torch.zeros(sq, sk + (-sk) % 16, dtype=q.dtype, device=q.device)[:, :sk]
    bias.masked_fill_(~mask, float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], sq, sk)


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
    limits = Limits(max_head_dim=128)

    def _forward(self, q, k, v, causal, scale, mask):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, (lse.squeeze(-1) if lse.dim() == 4 else lse)

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
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
    if version(torch_version) >= (2, 9):
        return (lse if lse.dim() == 4 else lse.unsqueeze(-1)).contiguous()
    return (lse.squeeze(-1) if lse.dim() == 4 else lse).contiguous()
