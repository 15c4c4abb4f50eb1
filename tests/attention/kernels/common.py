"""Helpers shared by the kernel tests (not a test module): inputs and per-dtype tolerances."""

import torch

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp64": 1e-12, "fp32": 1e-5, "bf16": 3e-2, "fp16": 4e-3}


def _qkv(b=2, h=4, hk=2, s=24, d=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    # [s, b, h, d] storage, permuted to [b, h, s, d] views: the ring's non-contiguous case.
    q = torch.randn(s, b, h, d, generator=g, dtype=torch.float64).permute(1, 2, 0, 3)
    k = torch.randn(s, b, hk, d, generator=g, dtype=torch.float64).permute(1, 2, 0, 3)
    v = torch.randn(s, b, hk, d, generator=g, dtype=torch.float64).permute(1, 2, 0, 3)
    dout = torch.randn(s, b, h, d, generator=g, dtype=torch.float64).permute(1, 2, 0, 3)
    return q, k, v, dout
