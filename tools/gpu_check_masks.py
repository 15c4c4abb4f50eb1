"""gpu_check's part 2b: windows, sinks and MLA's head dims through every kernel the device runs.

One row per kernel x dtype x variant, as part 2's rows (`tools/gpu_check.py`): ``local_attention``
(the dispatcher's local path: the kernel's band masks, row strips, head-dim padding and the sink's
finish step) on ``s = 200`` tokens against float64 explicit attention with the same mask and sink
on the CPU (`tests.attention.reference.explicit_attention`); "ref" is that explicit attention in
the dtype on the device. Variants:

* ``window 24 + sink``, causal, GQA 8/2, d 64: kernels that apply masks (cpu, efficient,
  unfused); every other kernel must refuse the window with a ValueError naming ``--window-size``
  (a PASS row when it does, FAIL when it runs or fails otherwise);
* ``MLA 192/128 + sink``, causal, MHA 8/8: every kernel whose limits take head dim 192 (native
  v dim, or v zero-padded to 192);
* ``MLA latent r64 + sink``: the same dims through the latent exchange's machinery
  (``--cp-mla-exchange latent``: k is the latent [c | k_pe] (64 + 64), v None, ``up_weight`` the
  up-projection, `cp_ext.attention.kv_message.LatentKV`) against explicit attention over the
  up-projected K/V; the gradients are dq, the latent's and the weight's, and "ref" is also the
  same kernel on the up-projected K/V (``--cp-mla-exchange kv``), whichever rounds more.
"""

import torch

from cp_ext.attention import local_attention
from cp_ext.attention.kernels import KERNELS, kernel_problem

S, B, H = 200, 1, 8
VARIANTS = {"window 24 + sink": dict(hk=2, d=64, dv=64, window=(24, 0)),
            "MLA 192/128 + sink": dict(hk=8, d=192, dv=128, window=None),
            "MLA latent r64 + sink": dict(hk=8, d=192, dv=128, window=None, rank=64)}
POS = 64  # qk_pos_emb_head_dim of the latent variant (DeepSeek-V3's)


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


def _run(fn, xs, dtype, device, names=("out", "dq", "dk", "dv", "doffset")):
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


def mask_rows(device, deadline, dtypes, judge, row):
    """The rows of this part (``judge`` / ``row`` / ``dtypes``: gpu_check's); what was skipped, with why."""
    import time

    from tests.attention.reference import explicit_attention

    rows, skipped = [], []
    for label, var in VARIANTS.items():
        latent = var.get("rank") is not None
        xs = _inputs(var["d"], var["dv"], var["hk"], var.get("rank"))
        names = ("out", "dq", "dlatent", "dweight", "doffset") if latent else ("out", "dq", "dk", "dv", "doffset")
        i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
        mask = (j <= i) if var["window"] is None else (j <= i) & (j >= i - var["window"][0])
        scale = var["d"] ** -0.5

        def explicit(q, k, v, off, mask=mask, latent=latent, var=var):
            if latent:  # k, v: the latent and the weight
                k, v = _up_project(k, v, var["d"], var["dv"])
            return explicit_attention(q, k, v, off, mask.to(q.device).expand(B, S, S), scale)

        truth = _run(explicit, xs, torch.float64, "cpu", names)
        kv = (*_up_project(xs[1], xs[2], var["d"], var["dv"]),) if latent else xs[1:3]
        p_sink = _sink_probability((xs[0], *kv, xs[3], xs[4]), mask, scale)  # [s, b, h]
        for name in KERNELS:
            for dtype_name, dtype in dtypes.items():
                check = f"masks {label} {name} {dtype_name}"
                reason = kernel_problem(name, dtype, var["d"], device.type, v_head_dim=var["dv"])
                if reason:
                    skipped.append(dict(kernel=name, dtypes=[dtype_name], reason=reason))
                    continue
                if time.monotonic() > deadline:
                    rows.append(row("single", check, "FAIL", "not run: time budget spent"))
                    continue
                if latent:
                    fn = lambda q, lat, w, off: local_attention(q, lat, None, up_weight=w, causal=True,  # noqa: E731
                                                                kernel=name, softmax_offset=off)
                else:
                    fn = lambda q, k, v, off: local_attention(q, k, v, causal=True, kernel=name,  # noqa: E731
                                                              window_size=var["window"], softmax_offset=off)
                try:
                    got = _run(fn, xs, dtype, device, names)
                except ValueError as e:
                    refused = var["window"] is not None and not KERNELS[name].limits.masks and "--window-size" in str(e)
                    rows.append(row("single", check, "PASS" if refused else "FAIL", f"ValueError: {e}"[:200]))
                    continue
                except Exception as e:  # a kernel that crashes is a failed check
                    rows.append(row("single", check, "FAIL", f"{type(e).__name__}: {e}"[:300]))
                    continue
                if var["window"] is not None and not KERNELS[name].limits.masks:
                    rows.append(row("single", check, "FAIL", "ran a window it cannot apply"))
                    continue
                ref = _run(explicit, xs, dtype, device, names)
                err = {t: (got[t] - truth[t]).abs().max().item() for t in truth}
                ref_err = {t: (ref[t] - truth[t]).abs().max().item() for t in truth}
                if latent:  # the single-device error is also the same kernel's on the up-projected K/V (kv)
                    kv_path = _run(lambda q, lat, w, off: local_attention(
                        q, *_up_project(lat, w, var["d"], var["dv"]), causal=True, kernel=name,
                        softmax_offset=off), xs, dtype, device, names)
                    ref_err = {t: max(e, (kv_path[t] - truth[t]).abs().max().item()) for t, e in ref_err.items()}
                # The sink's gradient sums p_sink x rowsum(dout * out) over the rows: its error is the
                # kernel's own out error carried through that sum (explicit math rounds out less than any
                # blocked kernel, so its doffset is no scale for a kernel's).
                carried = (p_sink * (xs[3].abs() * (got["out"] - truth["out"]).abs()).sum(-1)).sum((0, 1))
                ref_err["doffset"] = max(ref_err["doffset"], carried.max().item())
                max_truth = {t: truth[t].abs().max().item() for t in truth}
                rows.append(judge("single", check, dtype_name, err, ref_err, max_truth, True))
    return rows, skipped
