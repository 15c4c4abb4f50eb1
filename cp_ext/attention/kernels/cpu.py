"""aten's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``): the CPU default.

fp64/fp32/bf16/fp16, any head dim, native GQA, returns the LSE. It takes an additive mask in
q's dtype (a boolean one is refused), so windows and banded document tiles run here; q, k
and v must share one head dim (MLA's v is padded by the base class). For a row that sees no
key it returns lse 0 (the base class sets -inf).
"""

import torch

from cp_ext.attention.kernels.base import AttnKernel, Limits

aten = torch.ops.aten


def additive(mask, dtype):
    """A boolean mask (True: visible) as the additive one the SDPA ops take (0 / -inf)."""
    return None if mask is None else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class CpuSdpaKernel(AttnKernel):
    name = "cpu"
    native_gqa = True
    limits = Limits(device="cpu", dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16), align=1,
                    masks=True)

    def _forward(self, q, k, v, causal, scale, mask):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=additive(mask, q.dtype),
                                                                    scale=scale)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale, mask):
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=additive(mask, q.dtype), scale=scale
        )
