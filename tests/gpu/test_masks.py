"""Windows, sinks and MLA's head dims through every kernel the device runs: ``masks VARIANT KERNEL DTYPE``.

``local_attention`` (the dispatcher's local path: the kernel's band masks, row strips, head-dim
padding and the sink's finish step) on ``s = 200`` tokens against float64 explicit attention with
the same mask and sink on the CPU (`tests.attention.reference.explicit_attention`); "ref" is that
explicit attention in the dtype on the device. Variants:

* ``window 24 + sink``, causal, GQA 8/2, d 64: kernels that apply masks (cpu, efficient,
  unfused); every other kernel must refuse the window with a ValueError naming ``--window-size``
  (a PASS row when it does, FAIL when it runs or fails otherwise);
* ``MLA 192/128 + sink``, causal, MHA 8/8: every kernel whose limits take head dim 192 (native
  v dim, or v zero-padded to 192);
* ``MLA latent r64 + sink``: the same dims through the latent exchange's machinery
  (``--cp-mla-exchange latent``: k is the latent [c | k_pe] (64 + 64), v None, ``up_weight`` the
  up-projection, `cp_ext.attention.cp.kv_message.LatentKV`) against explicit attention over the
  up-projected K/V; the gradients are dq, the latent's and the weight's, and "ref" is also the
  same kernel on the up-projected K/V (``--cp-mla-exchange kv``), whichever rounds more.
"""

import pytest
import torch

from cp_ext.attention import local_attention
from cp_ext.attention.kernels import KERNELS, kernel_problem
from tests.attention.reference import explicit_attention
from tests.gpu.one_device import DTYPES
from tests.gpu.rows import FAIL, PASS, judge, row

pytestmark = pytest.mark.gpu

S, B, H = 200, 1, 8
VARIANTS = {"window 24 + sink": dict(hk=2, d=64, dv=64, window=(24, 0)),
            "MLA 192/128 + sink": dict(hk=8, d=192, dv=128, window=None),
            "MLA latent r64 + sink": dict(hk=8, d=192, dv=128, window=None, rank=64)}
POS = 64  # qk_pos_emb_head_dim of the latent variant (DeepSeek-V3's)
CASES = [(label, name, dtype) for label in VARIANTS for name in KERNELS for dtype in DTYPES]


def _inputs(d, dv, hk, rank=None):
    """(q, k, v, dout, offset); with ``rank`` (the latent variant) k is the latent [s, b, rank + POS]
    and v the up-projection's weight [H (d - POS + dv), rank]."""
    gen = torch.Generator().manual_seed(d * 1000 + dv + hk)
    q = torch.randn(S, B, H, d, generator=gen, dtype=torch.float64)
    if rank is None:
        k = torch.randn(S, B, hk, d, generator=gen, dtype=torch.float64)
        v = torch.randn(S, B, hk, dv, generator=gen, dtype=torch.float64)
    else:
        k = torch.randn(S, B, rank + POS, generator=gen, dtype=torch.float64)
        v = torch.randn(H * (d - POS + dv), rank, generator=gen, dtype=torch.float64) / rank ** 0.5
    dout = torch.randn(S, B, H, dv, generator=gen, dtype=torch.float64)
    offset = torch.randn(H, generator=gen, dtype=torch.float64)
    return q, k, v, dout, offset


def _up_project(latent, weight, d, dv):
    """megatron's MLA K/V from the latent (what ``--cp-mla-exchange kv`` moves)."""
    rank, nope = weight.shape[1], d - POS
    kv = (latent[..., :rank] @ weight.t()).unflatten(-1, (H, nope + dv))
    return torch.cat([kv[..., :nope], latent[..., None, rank:].expand(-1, -1, H, -1)], -1), kv[..., nope:]


def _run(fn, xs, dtype, device, names):
    ins = [x.to(device, dtype).detach().requires_grad_() for x in xs[:3]]
    off = xs[4].to(device, torch.float32 if dtype != torch.float64 else dtype).detach().requires_grad_()
    out = fn(*ins, off)
    out.backward(xs[3].to(device, dtype))
    return {t: g.detach().double().cpu() for t, g in zip(names, (out, *(x.grad for x in ins), off.grad))}


def _sink_probability(xs, mask, scale):
    """exp(offset_h - lse') of every row: the share of the softmax the sink takes (float64)."""
    q, k, _, _, offset = xs
    kk = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("ibhd,jbhd->bhij", q, kk) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logaddexp(torch.logsumexp(scores, -1), offset.view(1, -1, 1))
    return torch.exp(offset.view(1, -1, 1) - lse).permute(2, 0, 1)


class _Variant:
    """One variant's inputs, mask, explicit attention and float64 truth (computed once for every kernel)."""

    def __init__(self, var):
        self.var, self.latent = var, var.get("rank") is not None
        self.xs = _inputs(var["d"], var["dv"], var["hk"], var.get("rank"))
        self.names = ("out", "dq") + (("dlatent", "dweight") if self.latent else ("dk", "dv")) + ("doffset",)
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        self.mask = (j <= i) if var["window"] is None else (j <= i) & (j >= i - var["window"][0])
        self.scale = var["d"] ** -0.5
        self.truth = _run(self.explicit, self.xs, torch.float64, "cpu", self.names)
        kv = _up_project(self.xs[1], self.xs[2], var["d"], var["dv"]) if self.latent else self.xs[1:3]
        self.p_sink = _sink_probability((self.xs[0], *kv, self.xs[3], self.xs[4]), self.mask, self.scale)  # [s, b, h]

    def explicit(self, q, k, v, off):
        if self.latent:  # k, v: the latent and the weight
            k, v = _up_project(k, v, self.var["d"], self.var["dv"])
        return explicit_attention(q, k, v, off, self.mask.to(q.device).expand(B, S, S), self.scale)

    def kernel(self, name, up_projected=False):
        var = self.var
        if self.latent and up_projected:  # the same kernel on the up-projected K/V (kv)
            return lambda q, lat, w, off: local_attention(q, *_up_project(lat, w, var["d"], var["dv"]), causal=True,
                                                          kernel=name, softmax_offset=off)
        if self.latent:
            return lambda q, lat, w, off: local_attention(q, lat, None, up_weight=w, causal=True, kernel=name,
                                                          softmax_offset=off)
        return lambda q, k, v, off: local_attention(q, k, v, causal=True, kernel=name, window_size=var["window"],
                                                    softmax_offset=off)


@pytest.fixture(scope="module")
def variants():
    return {}


def mask_row(check, name, dtype_name, variant, device):
    """One kernel x dtype on one variant: a judged row, or the refusal of a window the kernel cannot apply."""
    dtype, var = DTYPES[dtype_name], variant.var
    cannot_window = var["window"] is not None and not KERNELS[name].limits.masks
    try:
        got = _run(variant.kernel(name), variant.xs, dtype, device, variant.names)
    except ValueError as e:
        refused = cannot_window and "--window-size" in str(e)
        return row("single", check, PASS if refused else FAIL, f"ValueError: {e}"[:200])
    if cannot_window:
        return row("single", check, FAIL, "ran a window it cannot apply")
    truth = variant.truth
    ref = _run(variant.explicit, variant.xs, dtype, device, variant.names)
    err = {t: (got[t] - truth[t]).abs().max().item() for t in truth}
    ref_err = {t: (ref[t] - truth[t]).abs().max().item() for t in truth}
    if variant.latent:  # the single-device error is also the same kernel's on the up-projected K/V (kv)
        kv_path = _run(variant.kernel(name, up_projected=True), variant.xs, dtype, device, variant.names)
        ref_err = {t: max(e, (kv_path[t] - truth[t]).abs().max().item()) for t, e in ref_err.items()}
    # The sink's gradient sums p_sink x rowsum(dout * out) over the rows: its error is the kernel's own
    # out error carried through that sum (explicit math rounds out less than any blocked kernel, so its
    # doffset is no scale for a kernel's).
    carried = (variant.p_sink * (variant.xs[3].abs() * (got["out"] - truth["out"]).abs()).sum(-1)).sum((0, 1))
    ref_err["doffset"] = max(ref_err["doffset"], carried.max().item())
    max_truth = {t: truth[t].abs().max().item() for t in truth}
    return judge("single", check, dtype_name, err, ref_err, max_truth, True)


@pytest.mark.parametrize("label, kernel, dtype", CASES, ids=[" ".join(c) for c in CASES])
def test_masks_through_each_kernel(report, device, budget, variants, label, kernel, dtype):
    var = VARIANTS[label]
    reason = kernel_problem(kernel, DTYPES[dtype], var["d"], device.type, v_head_dim=var["dv"])
    if reason:
        report.not_run_here(kernel, dtype, reason, "masks")
    check = f"masks {label} {kernel} {dtype}"
    report.start("single", check)
    budget.left(60)
    if label not in variants:
        variants[label] = _Variant(var)
    r = report.add(mask_row(check, kernel, dtype, variants[label], device))
    assert r["status"] == PASS, r
