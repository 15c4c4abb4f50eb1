"""Local attention kernels behind one small interface: ``forward -> (out, lse)`` and ``backward``.

One file per backend (cpu.py, sdpa_cuda.py, flash_attn.py, te.py, unfused.py); the contract
and what every kernel gets for free (GQA, a v head dim of its own, masks, blocks) is base.py.
Every kernel takes the kernel layout ``[b, h, s, d]`` (views with any strides along b/h/s
are fine; the wrapper makes what its op needs contiguous):

    out, lse   = kernel.forward(q, k, v, scale=..., causal=..., band=...)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, scale=..., causal=..., band=...)
    out, lse   = kernel.forward_blocks(q, k, v, blocks, scale=...)     (a tile, `cp_ext.attention.masks.tiles`)

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

* ``v`` may have its own head dim (MLA); ``band`` is a `cp_ext.attention.masks.tiles.Band` (windows,
  banded document tiles); each kernel's ``limits`` (`base.Limits`) says what it runs natively.

Kernels and their limits (each kernel's ``limits``; `supported` reads them, `choose_kernel` picks):

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

Masks (a window, or any band other than the causal square): ``cpu`` (an additive mask),
``efficient`` (its ``attn_bias``) and ``unfused``; the others refuse a window. A v head dim of its
own: ``efficient`` and ``unfused`` natively; every other kernel zero-pads v (or q and k) to the
larger head dim, whose limit then applies (MLA's 192 / 128 runs at 192).

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

The selection itself (the registry, `supported`, `choose_kernel`, `get_kernel`) is registry.py; this
module only names what the package offers.
"""

from cp_ext.attention.kernels.base import AttnKernel, Limits
from cp_ext.attention.kernels.cpu import CpuSdpaKernel
from cp_ext.attention.kernels.flash_attn import (
    FlashAttnKernel, flash_attn_padded_lse, flash_attn_varlen_lse, varlen_pack,
)
from cp_ext.attention.kernels.registry import (
    KERNELS, PREFERENCE, choose_kernel, dtype_name, get_kernel, kernel_problem, supported,
)
from cp_ext.attention.kernels.sdpa_cuda import (
    CudaCudnnSdpaKernel, CudaEfficientSdpaKernel, CudaFlashSdpaKernel, cudnn_lse_for_backward,
)
from cp_ext.attention.kernels.te import TransformerEngineKernel
from cp_ext.attention.kernels.unfused import UnfusedKernel

__all__ = [
    "AttnKernel", "Limits", "KERNELS", "PREFERENCE", "choose_kernel", "dtype_name", "get_kernel", "kernel_problem",
    "supported", "CpuSdpaKernel", "CudaFlashSdpaKernel", "CudaEfficientSdpaKernel", "CudaCudnnSdpaKernel",
    "FlashAttnKernel", "TransformerEngineKernel", "UnfusedKernel",
    "cudnn_lse_for_backward", "flash_attn_padded_lse", "flash_attn_varlen_lse", "varlen_pack",
]
