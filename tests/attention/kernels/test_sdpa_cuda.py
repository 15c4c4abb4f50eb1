"""The CUDA SDPA wrappers (kernels/sdpa_cuda.py) without a GPU: the aten CUDA ops have meta
kernels, so calling a wrapper on meta tensors checks its arguments against the op schema and the
shapes it returns (no numbers); the layout the efficient backward receives (recorded aten calls);
and the cuDNN LSE shape each torch version's backward takes."""

import pytest
import torch

import cp_ext.attention.kernels.sdpa_cuda as sdpa_cuda
from cp_ext.attention.kernels import (
    CudaCudnnSdpaKernel,
    CudaEfficientSdpaKernel,
    CudaFlashSdpaKernel,
    cudnn_lse_for_backward,
)


@pytest.mark.parametrize("version, shape", [("2.4.0", (2, 4, 40)), ("2.8.0", (2, 4, 40)), ("2.9.0", (2, 4, 40, 1)),
                                            ("2.13.0+cu128", (2, 4, 40, 1))])
def test_cudnn_lse_matches_what_the_forward_of_that_torch_returned(version, shape):
    """Forward LSE: [b, h, s] before torch 2.9, [b, h, s, 1] from 2.9; the backward takes that shape."""
    for lse in (torch.randn(2, 4, 40), torch.randn(2, 4, 40, 1)):
        back = cudnn_lse_for_backward(lse, version)
        assert back.shape == shape and back.dtype == torch.float32 and back.is_contiguous()
        assert torch.equal(back.flatten(), lse.flatten())



def _meta_qkv(b=2, h=4, hk=2, s=40, d=64, dtype=torch.bfloat16):
    mk = lambda heads: torch.empty(s, b, heads, d, device="meta", dtype=dtype).permute(1, 2, 0, 3)  # noqa: E731
    return mk(h), mk(hk), mk(hk), mk(h)


@pytest.mark.parametrize("cls", [CudaFlashSdpaKernel, CudaEfficientSdpaKernel, CudaCudnnSdpaKernel])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cuda_wrappers_match_op_schemas_on_meta(cls, causal):
    q, k, v, dout = _meta_qkv()
    kern = cls()
    out, lse = kern.forward(q, k, v, causal=causal, scale=0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32  # efficient: padding sliced; cudnn: squeezed
    dq, dk, dv = kern.backward(dout, q, k, v, out.contiguous(), lse, causal=causal, scale=0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


class _RecordingAten:
    """Stands in for ``torch.ops.aten`` in kernels/sdpa_cuda.py: records each op's arguments, then runs the
    real op (on meta tensors: its schema and shape function, without a GPU)."""

    def __init__(self):
        self.calls = {}

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            self.calls[name] = args
            return op(*args, **kwargs)

        return call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_efficient_backward_gets_out_and_dout_packed_as_bshd(monkeypatch, dtype):
    """The cutlass backward reads ``out`` with a fixed row stride of h*d ([b, s, h, d] packing);
    the ring hands it a [b, h, s, d]-contiguous merged output. What reaches the op must be packed
    like the forward's own output, and q/k/v must have a contiguous last dim."""
    rec = _RecordingAten()
    monkeypatch.setattr(sdpa_cuda, "aten", rec)
    b, h, s, d = 2, 4, 40, 64
    q, k, v, dout = _meta_qkv(b, h, h, s, d, dtype)
    kern = CudaEfficientSdpaKernel()
    fwd_out, lse = kern.forward(q, k, v, causal=True, scale=0.125)
    out = fwd_out.contiguous()  # what ring_attn_forward returns: the merged fp32 output cast back
    kern.backward(dout.contiguous(), q, k, v, out, lse, causal=True, scale=0.125)
    args = rec.calls["_scaled_dot_product_efficient_attention_backward"]
    bshd = (s * h * d, d, h * d, 1)
    assert fwd_out.stride() == bshd  # the forward's own output layout (meta kernel = the CUDA allocation)
    assert args[5].shape == out.shape and args[5].stride() == bshd, args[5].stride()  # out
    assert args[0].shape == dout.shape and args[0].stride() == bshd, args[0].stride()  # dout
    assert all(x.stride(-1) == 1 for x in args[1:4])  # q, k, v
    assert args[6].shape == (b, h, 64) and args[6].dtype == torch.float32  # LSE padded to a multiple of 32
