"""The CPU kernels (kernels/cpu.py, kernels/unfused.py) against float64 SDPA truth: the (out, lse)
interface and the backward for every dtype, the GQA expansion path, and the LSE merge
(`update_out_and_lse`): KV split in two and merged, backward with the global (out, lse)."""

import pytest
import torch
import torch.nn.functional as F

from cp_ext.attention.cp.primitives import update_out_and_lse
from cp_ext.attention.kernels import CpuSdpaKernel, UnfusedKernel, get_kernel
from tests.attention.kernels.common import DTYPES, TOL, _qkv


def _truth(q, k, v, dout, causal, scale):
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*xs, is_causal=causal, scale=scale, enable_gqa=True)
    out.backward(dout)
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    lse = torch.logsumexp(q @ kk.transpose(-1, -2) * scale + _mask(q.shape[2], causal), -1)
    return out.detach(), lse, [x.grad for x in xs]


def _mask(s, causal):
    m = torch.zeros(s, s, dtype=torch.float64)
    return m.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")) if causal else m


@pytest.mark.parametrize("name", ["cpu", "unfused"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_cpu_kernel_forward_backward(dt, causal, gqa, name):
    q, k, v, dout = _qkv(hk=2 if gqa else 4)
    scale = 0.3
    x = [t.to(DTYPES[dt]) for t in (q, k, v, dout)]
    out_t, lse_t, grads_t = _truth(*(t.double() for t in x), causal, scale)  # truth of the rounded inputs
    kern = get_kernel("cpu", DTYPES[dt], None if name == "cpu" else name, head_dim=q.shape[-1])
    assert isinstance(kern, CpuSdpaKernel if name == "cpu" else UnfusedKernel)
    out, lse = kern.forward(*x[:3], causal=causal, scale=scale)
    assert out.dtype == DTYPES[dt] and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dt == "fp64" else torch.float32) and lse.shape == q.shape[:3]
    tol = TOL[dt]
    assert (out.double() - out_t).abs().max() < tol
    assert (lse.double() - lse_t).abs().max() < (tol if dt in ("fp64", "fp32") else 1e-4)  # lse is fp32
    grads = kern.backward(x[3], *x[:3], out, lse, causal=causal, scale=scale)
    for g, gt in zip(grads, grads_t):
        assert g.shape == gt.shape
        assert (g.double() - gt).abs().max() < 4 * tol


class _ExpandingCpuKernel(CpuSdpaKernel):
    """The CPU kernel forced through the GQA expansion path the GPU kernels use."""

    native_gqa = False


@pytest.mark.quick
def test_gqa_expansion_path_matches_native():
    q, k, v, dout = _qkv(hk=2)
    nat, exp = CpuSdpaKernel(), _ExpandingCpuKernel()
    o1, l1 = nat.forward(q, k, v, causal=True, scale=0.2)
    o2, l2 = exp.forward(q, k, v, causal=True, scale=0.2)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    g1 = nat.backward(dout, q, k, v, o1, l1, causal=True, scale=0.2)
    g2 = exp.backward(dout, q, k, v, o2, l2, causal=True, scale=0.2)
    for a, b in zip(g1, g2):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-12


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_split_kv_merge_and_backward_with_global_lse(causal):
    """Attention over KV split in two = merged halves; per-half backward with the global
    (out, lse) gives exactly the full gradients. This is the identity the ring relies on."""
    q, k, v, dout = _qkv(hk=2, s=32)
    kern, s, scale = CpuSdpaKernel(), q.shape[2], q.shape[-1] ** -0.5
    out_t, lse_t, (dq_t, dk_t, dv_t) = _truth(q, k, v, dout, causal, scale)
    h = s // 2
    # rows [h:] see keys [:h] fully; rows [:h] see keys [:h] causally; rows [h:] see keys [h:] causally
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    parts = [(slice(0, h), slice(0, h), causal), (slice(h, None), slice(h, None), causal),
             (slice(h, None), slice(0, h), False)]
    if not causal:
        parts.append((slice(0, h), slice(h, None), False))
    for qs, ks, c in parts:
        bo, bl = kern.forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], causal=c, scale=scale)
        update_out_and_lse(out, lse, bo, bl, qs)
    assert (out - out_t).abs().max() < 1e-12 and (lse - lse_t).abs().max() < 1e-12
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, ks, c in parts:
        a, b, cc = kern.backward(dout[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs], lse[:, :, qs],
                                 causal=c, scale=scale)
        dq[:, :, qs] += a
        dk[:, :, ks] += b
        dv[:, :, ks] += cc
    for g, gt in zip((dq, dk, dv), (dq_t, dk_t, dv_t)):
        assert (g - gt).abs().max() < 1e-12


@pytest.mark.quick
def test_update_out_and_lse_touches_only_its_rows_and_never_aliases():
    out = torch.randn(1, 2, 6, 4)
    lse = torch.randn(1, 2, 6)
    before_out, before_lse = out.clone(), lse.clone()
    bo, bl = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3)
    update_out_and_lse(out, lse, bo, bl, slice(3, None))
    assert torch.equal(out[:, :, :3], before_out[:, :, :3]) and torch.equal(lse[:, :, :3], before_lse[:, :, :3])
    w_a, w_b = torch.exp(before_lse[:, :, 3:]), torch.exp(bl)
    ref = (w_a[..., None] * before_out[:, :, 3:] + w_b[..., None] * bo) / (w_a + w_b)[..., None]
    assert (out[:, :, 3:] - ref).abs().max() < 1e-6
    assert (lse[:, :, 3:] - torch.log(w_a + w_b)).abs().max() < 1e-6
    # From the empty state (out 0, lse -inf) the first merge is an exact copy, not an alias.
    out0, lse0 = torch.zeros(1, 2, 3, 4), torch.full((1, 2, 3), float("-inf"))
    update_out_and_lse(out0, lse0, bo, bl)
    assert torch.equal(out0, bo) and torch.equal(lse0, bl) and out0.data_ptr() != bo.data_ptr()

