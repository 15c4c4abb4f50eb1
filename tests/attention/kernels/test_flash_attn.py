"""The local-kernel interface (out, lse) + backward, and the LSE merge, single process.

Also, without a GPU: the kernel choice (each kernel's dtype / head-dim / device / torch-version
limits and auto's pick), the CUDA wrappers against their op schemas (meta tensors), the layout
the efficient backward receives, and flash-attn >= 2.7's custom-op entry points.
"""

import contextlib
import inspect
import subprocess
import sys
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

import cp_ext.attention.kernels.sdpa_cuda as sdpa_cuda
from cp_ext.attention.kernels import (
    PREFERENCE,
    CpuSdpaKernel,
    CudaCudnnSdpaKernel,
    CudaEfficientSdpaKernel,
    CudaFlashSdpaKernel,
    FlashAttnKernel,
    UnfusedKernel,
    choose_kernel,
    cudnn_lse_for_backward,
    get_kernel,
    supported,
)
from cp_ext.attention.cp.primitives import update_out_and_lse
from cp_ext.attention.kernels.flash_attn import _call_by_name
from cp_ext.attention.kernels.version import version as _version

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


def test_kernel_selection_and_optional_backends_are_import_guarded():
    code = (
        "import sys, torch, cp_ext.attention as a\n"
        "assert type(a.get_kernel('cpu', torch.bfloat16)).__name__ == 'CpuSdpaKernel'\n"
        "bad = [m for m in sys.modules if m.startswith(('flash_attn', 'transformer_engine'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        get_kernel("cpu", torch.float32, "nope")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            get_kernel("cuda", torch.bfloat16, "flash_attn")


# ----------------------------------------------------------------------------- kernel choice (pure)

HALF, ALL_FLOATS = (torch.float16, torch.bfloat16), list(DTYPES.values())


@pytest.mark.parametrize(
    "device, dtype, head_dim, expected",
    [
        ("cuda", torch.bfloat16, 128, "flash"), ("cuda", torch.float16, 64, "flash"), ("cuda", torch.bfloat16, 256, "flash"),
        ("cuda", torch.bfloat16, 80, "flash"), ("cuda", torch.bfloat16, 8, "flash"),
        ("cuda", torch.bfloat16, 288, "efficient"),  # > 256: no flash, but 288 % 8 == 0
        ("cuda", torch.float16, 100, "unfused"),  # 100 % 8 != 0: neither flash nor half-precision efficient
        ("cuda", torch.float32, 128, "efficient"), ("cuda", torch.float32, 100, "efficient"),  # fp32: % 4
        ("cuda", torch.float32, 30, "unfused"), ("cuda", torch.float64, 64, "unfused"),
        ("cpu", torch.float64, 64, "cpu"), ("cpu", torch.float32, 30, "cpu"), ("cpu", torch.bfloat16, 300, "cpu"),
        ("cpu", torch.float16, 7, "cpu"), ("meta", torch.float32, 64, "unfused"),
    ],
)
def test_auto_picks_the_first_kernel_that_fits(device, dtype, head_dim, expected):
    assert choose_kernel(device, dtype, head_dim) == expected


def test_auto_choice_is_first_supported_for_every_combination():
    """Over every dtype x head dim 1..320 x device x torch version: auto's pick is supported and
    every kernel it prefers over it is not; it never picks a CUDA kernel for fp32-only/fp64 limits."""
    for device in ("cuda", "cpu"):
        for dtype in ALL_FLOATS:
            for head_dim in range(1, 321):
                for version in ("2.4.0", "2.8.1", "2.9.0", "2.13.0+cu128"):
                    pick = choose_kernel(device, dtype, head_dim, version)
                    assert supported(pick, dtype, head_dim, device, version) is None
                    order = PREFERENCE[device]
                    assert all(supported(n, dtype, head_dim, device, version) for n in order[: order.index(pick)])
                    if pick == "flash":
                        assert dtype in HALF and head_dim % 8 == 0 and head_dim <= 256
                    if pick == "efficient":
                        assert dtype != torch.float64 and head_dim % (8 if dtype in HALF else 4) == 0


@pytest.mark.quick
@pytest.mark.parametrize(
    "name, dtype, head_dim, device, version, must_say",
    [
        ("flash", torch.float32, 64, "cuda", None, "fp16/bf16 only, not fp32"),
        ("flash", torch.bfloat16, 260, "cuda", None, "at most 256"),
        ("flash", torch.bfloat16, 68, "cuda", None, "a multiple of 8"),
        ("flash_attn", torch.float16, 264, "cuda", None, "at most 256"),
        ("te", torch.float32, 64, "cuda", None, "fp16/bf16 only"),
        ("efficient", torch.float64, 64, "cuda", None, "fp32/fp16/bf16 only, not fp64"),
        ("efficient", torch.float32, 6, "cuda", None, "a multiple of 4 for fp32"),
        ("efficient", torch.bfloat16, 36, "cuda", None, "a multiple of 8 for bf16"),
        ("cudnn", torch.bfloat16, 192, "cuda", None, "at most 128"),
        ("cudnn", torch.bfloat16, 128, "cuda", "2.4.1", "torch >= 2.5"),
        ("cudnn", torch.float32, 128, "cuda", None, "fp16/bf16 only"),
        ("cpu", torch.bfloat16, 64, "cuda", None, "CPU tensors only"),
        ("flash", torch.bfloat16, 64, "cpu", None, "CUDA tensors only"),
        ("nope", torch.float32, 64, "cpu", None, "unknown attention kernel"),
    ],
)
def test_kernel_limits_name_the_limit(name, dtype, head_dim, device, version, must_say):
    reason = supported(name, dtype, head_dim, device, version)
    assert reason is not None and must_say in reason, reason


@pytest.mark.parametrize(
    "name, dtype, head_dim, device, version",
    [
        ("flash", torch.bfloat16, 256, "cuda", None), ("flash", torch.float16, 72, "cuda", None),
        ("efficient", torch.float32, 4, "cuda", None), ("efficient", torch.float16, 512, "cuda", None),
        ("cudnn", torch.bfloat16, 128, "cuda", "2.5.0"), ("te", torch.bfloat16, 128, "cuda", None),
        ("unfused", torch.float64, 7, "cuda", None), ("unfused", torch.float32, 3, "cpu", None),
        ("cpu", torch.float64, 5, "cpu", None),
    ],
)
def test_kernel_limits_accept(name, dtype, head_dim, device, version):
    assert supported(name, dtype, head_dim, device, version) is None


def test_named_kernel_that_cannot_run_raises_with_its_limit():
    with pytest.raises(ValueError, match="fp16/bf16 only, not fp32"):
        get_kernel("cuda", torch.float32, "flash", head_dim=64)
    with pytest.raises(ValueError, match="a multiple of 8"):
        get_kernel("cuda", torch.bfloat16, "flash", head_dim=100)
    with pytest.raises(ValueError, match="CPU tensors only"):
        get_kernel("cuda", torch.float32, "cpu", head_dim=64)
    assert isinstance(get_kernel("cuda", torch.float64, "auto", head_dim=64), UnfusedKernel)


def test_version_parsing_is_numeric():
    assert _version("2.10.0a0+git1234") == (2, 10) > _version("2.9.1") == (2, 9) > _version("2.8.0+cu126")


@pytest.mark.parametrize("version, shape", [("2.4.0", (2, 4, 40)), ("2.8.0", (2, 4, 40)), ("2.9.0", (2, 4, 40, 1)),
                                            ("2.13.0+cu128", (2, 4, 40, 1))])
def test_cudnn_lse_matches_what_the_forward_of_that_torch_returned(version, shape):
    """Forward LSE: [b, h, s] before torch 2.9, [b, h, s, 1] from 2.9; the backward takes that shape."""
    for lse in (torch.randn(2, 4, 40), torch.randn(2, 4, 40, 1)):
        back = cudnn_lse_for_backward(lse, version)
        assert back.shape == shape and back.dtype == torch.float32 and back.is_contiguous()
        assert torch.equal(back.flatten(), lse.flatten())


# ----------------------------------------------------------------------------- CUDA wrappers on CPU
# The aten CUDA ops have meta kernels: calling a wrapper on meta tensors checks its arguments
# against the op schema and the shapes it returns, without a GPU (no numbers).


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


# flash-attn >= 2.7 wraps its entry points in torch.library.custom_op; these two have the exact
# signatures of flash_attn/flash_attn_interface.py (flash-attn 2.7.x: `_flash_attn_forward` and
# `_flash_attn_backward`, registered as "flashattn::..." with device_types="cuda"), registered here
# for CPU and computed with the CPU kernel, recording what they receive.
FA_CALLS = {}


@torch.library.custom_op("cp_ext_test::_flash_attn_forward", mutates_args=("q", "k", "v"), device_types="cpu")
def _fa_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    FA_CALLS["fwd"] = dict(q=q.shape, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                           window=(window_size_left, window_size_right), softcap=softcap, alibi=alibi_slopes,
                           return_softmax=return_softmax)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  [b, s, h, d] -> [b, h, s, d]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(t(q), t(k), t(v), dropout_p, causal,
                                                                          scale=softmax_scale)
    return t(out).contiguous(), lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("cp_ext_test::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu")
def _fa_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    FA_CALLS["bwd"] = dict(dq=dq.shape, softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                           window=(window_size_left, window_size_right), lse=softmax_lse.shape, rng_state=rng_state)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        t(dout), t(q), t(k), t(v), t(out), softmax_lse.to(q.dtype), dropout_p, causal, scale=softmax_scale)
    for dst, src in zip((dq, dk, dv), grads):
        dst.copy_(t(src))
    return torch.empty(0, dtype=torch.float32)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attn_custom_op_entry_points(causal):
    """flash-attn >= 2.7: `_call_by_name` reads the wrapped function's signature and calls the op."""
    assert list(inspect.signature(_fa_forward).parameters) == ["args", "kwargs"]  # why `_init_fn` is needed
    assert not hasattr(_fa_forward, "__name__")
    kern = FlashAttnKernel.__new__(FlashAttnKernel)  # without importing flash_attn
    kern._fwd, kern._bwd = _fa_forward, _fa_backward
    q, k, v, dout = _qkv(hk=2, s=20, d=16)
    out, lse = kern.forward(q, k, v, causal=causal, scale=0.3)
    assert FA_CALLS["fwd"] == dict(q=(2, 20, 4, 16), dropout_p=0.0, softmax_scale=0.3, causal=causal, window=(-1, -1),
                                   softcap=0.0, alibi=None, return_softmax=False)
    ref = CpuSdpaKernel()
    out_r, lse_r = ref.forward(q, k, v, causal=causal, scale=0.3)
    assert out.shape == q.shape and (out - out_r).abs().max() < 1e-12 and (lse - lse_r).abs().max() < 1e-12
    grads = kern.backward(dout, q, k, v, out, lse, causal=causal, scale=0.3)
    assert FA_CALLS["bwd"] == dict(dq=(2, 20, 4, 16), softmax_scale=0.3, causal=causal, deterministic=False,
                                   window=(-1, -1), lse=(2, 4, 20), rng_state=None)
    lse_fp32 = lse_r.float().double()  # the wrapper hands flash-attn an fp32 LSE, as flash-attn stores it
    for g, gr in zip(grads, ref.backward(dout, q, k, v, out_r, lse_fp32, causal=causal, scale=0.3)):
        assert g.shape == gr.shape and (g - gr).abs().max() < 1e-12


def test_call_by_name_error_names_the_custom_op():
    with pytest.raises(TypeError, match=r"cp_ext_test::_flash_attn_forward: no value for required argument 'q'"):
        _call_by_name(_fa_forward, {})
    with pytest.raises(TypeError, match=r"test_kernels._needs_b: no value for required argument 'b'"):
        _call_by_name(_needs_b, {})


def _needs_b(b):
    return b


# ---------------------------------------------------------------- packed documents through flash-attn's varlen call
# Fakes of flash_attn_interface's `_flash_attn_varlen_forward` / `_backward` (no flash-attn here): each
# packed sequence cu_seqlens[i]:cu_seqlens[i+1] computed on its own with the CPU kernel. "new": the
# signatures of flash-attn 2.7-2.8 (custom ops; LSE [h, total_q]); "old": 2.5's plain functions (window
# as a tuple, 8 return values, LSE padded to [n, h, max_seqlen_q] in and out).
VARLEN_CALLS = []


def _per_sequence(cu_q, cu_k):
    return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(),
                                                             cu_k[:-1].tolist(), cu_k[1:].tolist())]


def _varlen_fwd_compute(q, k, v, cu_q, cu_k, causal, scale):
    t = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731  [L, h, d] -> [1, h, L, d]
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for qs, ks in _per_sequence(cu_q, cu_k):
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(t(q[qs]), t(k[ks]), t(v[ks]), 0.0, causal,
                                                                           scale=scale)
        out[qs], lse[:, qs] = o[0].transpose(0, 1), l[0]
    return out, lse


def _varlen_bwd_compute(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, causal, scale):
    t = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731
    for qs, ks in _per_sequence(cu_q, cu_k):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout[qs]), t(q[qs]), t(k[ks]), t(v[ks]), t(out[qs]), lse[:, qs].unsqueeze(0).to(q.dtype), 0.0, causal,
            scale=scale)
        for dst, g in zip((dq[qs], dk[ks], dv[ks]), grads):
            dst.copy_(g[0].transpose(0, 1))


def _record(kind, q, k, cu_q, cu_k, max_q, max_k, **flags):
    VARLEN_CALLS.append(dict(kind=kind, q=tuple(q.shape), k=tuple(k.shape), contiguous=q.is_contiguous(),
                             cu_dtype=(cu_q.dtype, cu_k.dtype), cu_q=cu_q.tolist(), cu_k=cu_k.tolist(),
                             max=(max_q, max_k), **flags))


@torch.library.custom_op("cp_ext_test::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _fa_varlen_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False, num_splits: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _record("fwd", q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
            causal=causal, window=(window_size_left, window_size_right), softcap=softcap, alibi=alibi_slopes,
            return_softmax=return_softmax)
    out, lse = _varlen_fwd_compute(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("cp_ext_test::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"),
                         device_types="cpu")
def _fa_varlen_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
    softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
    rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False,
) -> torch.Tensor:
    _record("bwd", q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
            window=(window_size_left, window_size_right), lse=(tuple(softmax_lse.shape), softmax_lse.dtype),
            deterministic=deterministic, rng_state=rng_state)
    _varlen_bwd_compute(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal,
                        softmax_scale)
    return torch.empty(0, dtype=torch.float32)


def _padded(lse, cu):  # [h, total] -> [n, h, max_seqlen], written independently of the kernel's converter
    n, lens = cu.numel() - 1, cu.diff().tolist()
    padded = torch.full((n, lse.shape[0], max(lens)), 123.0)
    for i, (a, length) in enumerate(zip(cu[:-1].tolist(), lens)):
        padded[i, :, :length] = lse[:, a:a + length]
    return padded


def _fa25_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size, alibi_slopes, return_softmax):
    _record("fwd", q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window=window_size)
    out, lse = _varlen_fwd_compute(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return out, q, k, v, out, _padded(lse, cu_seqlens_q), None, None


def _fa25_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                          rng_state=None):
    _record("bwd", q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window=window_size,
            lse=(tuple(softmax_lse.shape), softmax_lse.dtype))
    lens = cu_seqlens_q.diff().tolist()
    unpadded = torch.cat([softmax_lse[i, :, :n] for i, n in enumerate(lens)], dim=1)
    _varlen_bwd_compute(dout, q, k, v, out, unpadded, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
    return dq, dk, dv, None


def _fake_flash_attn(style):
    kern = FlashAttnKernel.__new__(FlashAttnKernel)  # without importing flash_attn
    if style == "new":
        kern._varlen_fwd, kern._varlen_bwd = _fa_varlen_forward, _fa_varlen_backward
    else:
        kern._varlen_fwd, kern._varlen_bwd, kern._padded_varlen_lse = _fa25_varlen_forward, _fa25_varlen_backward, True
    return kern


def _document_ids():
    """s = 40: sample 0 single-token documents between longer ones and 4 padding rows (-1);
    sample 1 one document spanning all but its first and last rows."""
    lengths = [[1, 1, 5, 1, 13, 2, 1, 6, 1, 5, -4], [1, 38, 1]]
    rows = []
    for sample in lengths:
        rows.append(sum(([-1] * -n if n < 0 else [d] * n for d, n in enumerate(sample)), []))
    return torch.tensor(rows)


def _tile_segments(tile):
    from cp_ext.attention.masks.documents import clip_runs, diagonal_segments, document_runs, tile_segments

    runs = document_runs(_document_ids())
    if tile == "diagonal":
        return diagonal_segments(runs), slice(0, 40), slice(0, 40)
    qs, ks = slice(0, 24), slice(12, 40)  # an off-diagonal tile: documents cut at both edges
    return tile_segments(clip_runs(runs, qs, 40), clip_runs(runs, ks, 40)), qs, ks


@pytest.mark.parametrize("style", ["new", "old"])
@pytest.mark.parametrize("tile, causal", [("diagonal", True), ("diagonal", False), ("off_diagonal", False)])
@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
def test_flash_attn_varlen_segments_equal_the_per_segment_loop(style, tile, causal, hk):
    """One varlen call per tile, packed and scattered back, gives the default per-segment loop's
    out, lse, dq, dk and dv (CPU kernel, fp64); rows no segment covers: out 0, lse -inf, grads 0."""
    segments, qs, ks = _tile_segments(tile)
    q, k, v, dout = _qkv(hk=hk, s=40, d=16, seed=3)
    q, dout, k, v = q[:, :, qs], dout[:, :, qs], k[:, :, ks], v[:, :, ks]  # strided views, as the ring passes
    kern, ref = _fake_flash_attn(style), CpuSdpaKernel()
    VARLEN_CALLS.clear()
    out, lse = kern.forward_segments(q, k, v, segments, causal=causal, scale=0.3)
    out_r, lse_r = ref.forward_segments(q, k, v, segments, causal=causal, scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert (out - out_r).abs().max() < 1e-12
    assert torch.equal(lse.isinf(), lse_r.isinf()) and (lse - lse_r)[lse_r.isfinite()].abs().max() < 1e-6  # fp32 LSE
    assert lse.isinf().any() and (out[lse.isinf()] == 0).all()  # padding rows (and rows outside the tile's docs)
    grads = kern.backward_segments(dout, q, k, v, out_r, lse_r, segments, causal=causal, scale=0.3)
    lse_fp32 = lse_r.float().double()  # flash-attn reads an fp32 LSE
    for g, gr in zip(grads, ref.backward_segments(dout, q, k, v, out_r, lse_fp32, segments, causal=causal, scale=0.3)):
        assert g.shape == gr.shape and g.dtype == torch.float64 and (g - gr).abs().max() < 1e-12

    lq, lk = [g.q1 - g.q0 for g in segments], [g.k1 - g.k0 for g in segments]
    cu = lambda lens: [0] + torch.tensor(lens).cumsum(0).tolist()  # noqa: E731
    assert [c["kind"] for c in VARLEN_CALLS] == ["fwd", "bwd"]  # one call per tile, not one per segment
    for c in VARLEN_CALLS:
        assert c["q"] == (sum(lq), 4, 16) and c["k"] == (sum(lk), hk, 16) and c["contiguous"]
        assert c["cu_dtype"] == (torch.int32, torch.int32) and c["cu_q"] == cu(lq) and c["cu_k"] == cu(lk)
        assert c["max"] == (max(lq), max(lk))
    fwd, bwd = VARLEN_CALLS
    n = len(segments)
    if style == "new":
        assert fwd["window"] == (-1, -1) and fwd["causal"] == causal and fwd["dropout_p"] == 0.0
        assert fwd["softcap"] == 0.0 and fwd["alibi"] is None and fwd["return_softmax"] is False
        assert bwd["lse"] == ((4, sum(lq)), torch.float32) and bwd["deterministic"] is False
        assert bwd["rng_state"] is None and bwd["causal"] == causal
    else:
        assert fwd["window"] == bwd["window"] == (-1, -1) and bwd["lse"] == ((n, 4, max(lq)), torch.float32)


def test_flash_attn_varlen_no_segments_calls_nothing():
    q, k, v, dout = _qkv(hk=2, s=8, d=16)
    kern = _fake_flash_attn("new")
    VARLEN_CALLS.clear()
    out, lse = kern.forward_segments(q, k, v, [], causal=False, scale=0.3)
    assert (out == 0).all() and lse.isneginf().all() and lse.dtype == torch.float64
    grads = kern.backward_segments(dout, q, k, v, out, lse, [], causal=False, scale=0.3)
    assert all((g == 0).all() and g.shape == x.shape for g, x in zip(grads, (q, k, v))) and not VARLEN_CALLS


def test_varlen_pack_and_lse_layouts():
    from cp_ext.attention.masks.documents import Segment
    from cp_ext.attention.kernels import flash_attn_padded_lse, flash_attn_varlen_lse, varlen_pack

    p = varlen_pack([Segment(1, 3, 5, 0, 4), Segment(0, 0, 1, 6, 9), Segment(0, 2, 2, 1, 3)], "cpu")  # last: empty
    assert p.q_b.tolist() == [1, 1, 0] and p.q_s.tolist() == [3, 4, 0]
    assert p.k_b.tolist() == [1] * 4 + [0] * 3 and p.k_s.tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert p.cu_seqlens_q.tolist() == [0, 2, 3] and p.cu_seqlens_k.tolist() == [0, 4, 7]
    assert p.cu_seqlens_q.dtype == p.cu_seqlens_k.dtype == torch.int32 and (p.max_seqlen_q, p.max_seqlen_k) == (2, 4)
    assert varlen_pack([Segment(0, 2, 2, 1, 3)], "cpu") is None
    lse = torch.arange(6.0).reshape(2, 3)  # [h, total_q]: sequences of 2 and 1 rows
    padded = flash_attn_padded_lse(lse, p.cu_seqlens_q, 2)
    assert padded.shape == (2, 2, 2) and padded[0].tolist() == [[0, 1], [3, 4]] and padded[1, :, 0].tolist() == [2, 5]
    assert torch.equal(flash_attn_varlen_lse(padded, p.cu_seqlens_q), lse)
    assert flash_attn_varlen_lse(lse, p.cu_seqlens_q) is lse


@contextlib.contextmanager
def varlen_flash_attn(kernel, report):
    """A ring hook (`tests.gpu.ring_harness`): the ring runs the fake flash-attn varlen kernel, and
    reports the packed q rows of each varlen call."""
    VARLEN_CALLS.clear()
    yield _fake_flash_attn("new")
    report["varlen_q_rows"] = [c["q"][0] for c in VARLEN_CALLS]


def test_flash_attn_varlen_in_the_ring_with_documents():
    """The library's ring on 4 CPU ranks (zigzag, C = 4, half tiles, global out/LSE in the backward;
    `tests.gpu.ring_harness`) with packed documents: the varlen path (fake, fp64) gives float64 truth
    within flash-attn's fp32 LSE, as the per-segment loop (the CPU kernel) does exactly, with one
    varlen call per tile (at most a rank's 20 rows of each of the 2 samples)."""
    from tests.gpu.ring_harness import ring_case, run_ring_cases

    cases = [ring_case(f"{kernel} {'causal' if causal else 'full'}", "cpu", "fp64", causal, True, docs=True, s=80,
                       hook=f"{__name__}:varlen_flash_attn" if kernel == "varlen" else None)
             for kernel in ("varlen", "loop") for causal in (True, False)]  # GQA 8/2; 8 chunks of 10
    results = run_ring_cases(cases, torch.device("cpu"), timeout=300)
    for mask in ("causal", "full"):
        got, want = results[f"varlen {mask}"], results[f"loop {mask}"]
        assert got["error"] is None and want["error"] is None and got["dtypes_ok"], got
        # max_err counts -inf against -inf (rows without keys) as 0 and against anything else as inf.
        # flash-attn's LSE is fp32: the merge weights and the backward read it (a wrong row or tile is O(1))
        assert all(got["err"][t] < 1e-5 and want["err"][t] < 1e-12 for t in got["err"]), (mask, got["err"], want["err"])
        rows = [n for rank in got["report"] for n in rank["varlen_q_rows"]]
        assert rows and all(n <= 2 * 20 for n in rows), rows  # a tile: both samples' rows of one rank
