"""CUDA equivalence of cp_ext's attention (skipped without a GPU; run by tools/gpu_check.sh).

Single process, single GPU: the CUDA kernels (`cp_ext.attention.kernels.get_kernel`) forward
and backward against float64 SDPA on the CPU, and the ring / Ulysses / hybrid code paths on a
group of one rank (NCCL), which exercise the step plan, LSE merge and accumulators on CUDA.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _truth(q, k, v, dout, causal):
    xs = [x.double().cpu().detach().requires_grad_() for x in (q, k, v)]
    o = F.scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=True)
    o.backward(dout.double().cpu())
    return [o.detach()] + [x.grad for x in xs]


@pytest.fixture(scope="module")
def nccl_world():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hk", [4, 2])
def test_kernel_forward_backward(dtype, causal, hk):
    from cp_ext.attention.kernels import get_kernel

    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 4, 256, 64, generator=g) for _ in range(2))
    k, v = (torch.randn(2, hk, 256, 64, generator=g) for _ in range(2))
    dev = [x.to("cuda", dtype) for x in (q, k, v, dout)]
    kernel = get_kernel(torch.device("cuda"), dtype)
    out, lse = kernel.forward(*dev[:3], causal=causal, scale=64 ** -0.5)
    grads = kernel.backward(dev[3], *dev[:3], out, lse, causal=causal, scale=64 ** -0.5)
    truth = _truth(q, k, v, dout, causal)
    for got, want in zip([out, *grads], truth):
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, want.abs().max().item()), (dtype, causal, hk, err)


@pytest.mark.parametrize("variant", ["ring", "ulysses", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cp_paths_on_one_gpu(nccl_world, variant, dtype):
    from cp_ext.attention.cp.context_parallel import hybrid_attention
    from cp_ext.attention import ring_attention
    from cp_ext.attention import ulysses_attention

    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(512, 2, 8, 64, generator=g) for _ in range(2))  # [s, b, h, d]
    k, v = (torch.randn(512, 2, 2, 64, generator=g) for _ in range(2))
    xs = [x.to("cuda", dtype).requires_grad_() for x in (q, k, v)]
    w = nccl_world
    fn = {"ring": lambda *a: ring_attention(*a, causal=True, group=w),
          "ulysses": lambda *a: ulysses_attention(*a, causal=True, group=w),
          "hybrid": lambda *a: hybrid_attention(*a, causal=True, ulysses_group=w, ring_group=w)}[variant]
    out = fn(*xs)
    out.backward(dout.to("cuda", dtype))
    perm = lambda x: x.permute(1, 2, 0, 3)  # noqa: E731
    truth = _truth(perm(q), perm(k), perm(v), perm(dout), True)
    for got, want in zip([out, *(x.grad for x in xs)], truth):
        err = (perm(got).double().cpu() - want).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, want.abs().max().item()), (variant, dtype, err)
