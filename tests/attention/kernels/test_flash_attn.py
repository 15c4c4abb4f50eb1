"""flash-attn (kernels/flash_attn.py) without flash-attn: fakes of its entry points registered as
CPU custom ops (flash-attn >= 2.7) or plain functions (2.5), computed with the CPU kernel. The
custom-op entry points and `_call_by_name`, and the varlen path for packed documents: one varlen
call per tile equals the per-segment loop, the pack / LSE layouts, and the ring with documents."""

import contextlib
import inspect
from typing import Optional, Tuple

import pytest
import torch

from cp_ext.attention.kernels import CpuSdpaKernel, FlashAttnKernel
from cp_ext.attention.kernels.flash_attn import _call_by_name
from tests.attention.kernels.common import _qkv

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
    with pytest.raises(TypeError, match=r"test_flash_attn._needs_b: no value for required argument 'b'"):
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
