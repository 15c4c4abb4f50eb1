"""The single-process reference every context-parallel attention test measures against, and its bounds.

`measure` draws seeded full-sequence q, k, v, dout (float64), runs float64 and in-dtype
`F.scaled_dot_product_attention` on the whole sequence, runs the variant under test on this
rank's tokens, and returns its errors. Used by test_ring, test_ulysses and test_hybrid (on CPU),
by test_documents through `error_stats`, and by the GPU check's NCCL worker (tests/gpu/multi_gpu.py)
(``device="cuda:<local rank>"``). `check_bounds` is the one place the bounds live.

The fp32 bounds, derived
------------------------
fp32 attention's error is dominated by the log-sum-exp: every probability P_ij = exp(s_ij - lse_i)
carries lse_i's absolute error as a relative error, and every gradient is linear in P. One device
computes lse_i in one kernel call. A CP variant merges T partial results per query row (T = 1 for
Ulysses, R ring steps for the ring and the hybrid, up to 2C key runs for all-gather): each partial
LSE is one kernel's own rounding, independent of the others, and each merge adds one rounding of
at most u |lse| (u = 2^-24); the dK/dV accumulators add R - 1 fp32 sums of partial gradients. To
first order, with delta_i the extra error of lse_i (|delta| <= (T - 1) u L, L = max |lse|):

    d out_i ~ merges of partial outputs          <= (T-1) u (2 + L) max|v|
    d dq_i  = -delta_i dq_i                      <= (T-1) u L max|dq|       (P scales row-wise)
    d dk_j  = -scale sum_i delta_i dS_ij q_i     <= (T-1) u (L+1) max_j scale sum_i |dS_ij| |q_i|
    d dv_j  = -sum_i delta_i P_ij dO_i           <= (T-1) u (L+1) max_j sum_i P_ij |dO_i|

summed over the g query heads of a KV group for dk and dv (GQA: g heads read each KV head, so g
times the rows; the single device sums the same g x n terms, so g enters only through these sums).
`merge_sensitivity` computes the right-hand sides from the float64 truth (dS = P (dP - D)).

So the bounds per tensor (max over ranks) are
  * max:  err <= 2 x single-device fp32 error + one fp32 ulp of max|truth| + (T - 1) u G
    (the single-device error: the larger of two summation orders, below; T = 1: the former
    "2x + 1 ulp"; the ulp is the final cast of the accumulators);
  * RMS:  rms(err) <= 1.5 x rms(single-device error).
The first is a worst case. The second is where the CP paths are held to the single device: with
the merge terms independent and of the same size as the kernel's own, the CP error field is a second
draw of the single device's, and an RMS over >= 10^3 elements concentrates (two draws' RMS ratio:
worst 1.18 of 960 on these shapes), while a max does not (worst 2.7 of the same 960: why
"2x the single-device max" alone failed at 2.41 on ring4 contiguous, full, GQA, padded documents).
fp32 accumulators throughout are not the limit: the same case with fp64 accumulation of out, lse,
dq and dK/dV gives the same error (1.64e-6), and exact (fp64) per-tile LSEs would give 0.56e-6.

Summation orders: ``CP_EXT_TEST_SUMMATION_ORDER=permuted`` permutes the head dim of q and k (one
permutation) and of v and dout (another) before the variant runs and un-permutes its results:
the same mathematics in other summation orders (every score, output and gradient rounds
differently). The single-device reference itself runs in two orders (the default and a third one),
and "the single-device max error" is the larger of the two: one draw's max is no stable scale
(in the default order Ulysses repeats the reference's own arithmetic; permuted, the same Ulysses
case drew 1.79x the single device's max). tools/attention_margins.py runs the suite both ways and
prints each bound's margin.
"""

import os
import zlib

TENSORS = ("out", "dq", "dk", "dv")
FP32_ULP = 2.0 ** -23
U = 2.0 ** -24  # unit roundoff of fp32
RMS_FACTOR = 1.5
FP32_ABS = 1e-5  # whatever the reference does, an fp32 CP error above this is a bug at these sizes
FP64_ABS = 1e-12  # fp64 checks the algebra of the merges exactly


def _perms(seed, d, device):
    import torch

    gen = torch.Generator().manual_seed(seed + d)
    return torch.randperm(d, generator=gen).to(device), torch.randperm(d, generator=gen).to(device)


def summation_order_perms(d, device="cpu"):
    """The order the variant under test runs in: (perm of q/k features, perm of v/dout features), or
    None in the default order (``CP_EXT_TEST_SUMMATION_ORDER``)."""
    if os.environ.get("CP_EXT_TEST_SUMMATION_ORDER", "default") != "permuted":
        return None
    return _perms(1234, d, device)


def reference_orders(d, device="cpu"):
    """The orders the single-device reference runs in: the default and one other (not the one under
    test), so "the single-device error" is the larger of two draws, as the docstring explains."""
    return [None, _perms(99, d, device)]


def in_order(fn, perms, q, k, v, dout):
    """``fn(q, k, v, dout) -> [out, dq, dk, dv]`` computed on head-dim-permuted inputs (q, k by one
    permutation, v, dout by another), its results permuted back: the same values, other roundings."""
    import torch

    if perms is None:
        return fn(q, k, v, dout)
    qk, vd = perms
    got = fn(q[..., qk], k[..., qk], v[..., vd], dout[..., vd])
    inv_qk, inv_vd = torch.argsort(qk), torch.argsort(vd)
    return [g[..., inv_vd if i in (0, 3) else inv_qk] for i, g in enumerate(got)]


def merge_sensitivity(q, k, v, dout, mask, scale):
    """The docstring's G per tensor, from float64 full tensors q [s, b, h, d], k/v [s, b, hk, d(v)],
    dout like q's output, and ``mask`` [b, s, s] (True: query row i sees key j)."""
    import torch

    qk, kk, vk, do = (x.permute(1, 2, 0, 3).double() for x in (q, k, v, dout))
    g = qk.shape[1] // kk.shape[1]
    kk, vk = kk.repeat_interleave(g, 1), vk.repeat_interleave(g, 1)
    s = (torch.matmul(qk, kk.transpose(-1, -2)) * scale).masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = p @ vk
    ds = p * (do @ vk.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    finite = lse[torch.isfinite(lse)]
    L = finite.abs().max().item() if finite.numel() else 0.0
    group_sum = lambda x: x.unflatten(1, (k.shape[2], g)).sum(2)  # noqa: E731 - over a KV group's query heads
    return {
        "out": (2 + L) * v.abs().max().item(),
        "dq": L * (scale * ds @ kk).abs().max().item(),
        "dk": (L + 1) * group_sum(scale * ds.abs().transpose(-1, -2) @ qk.abs()).max().item(),
        "dv": (L + 1) * group_sum(p.transpose(-1, -2) @ do.abs()).max().item(),
    }


def causal_mask(b, s, causal, device="cpu"):
    import torch

    m = torch.ones(s, s, dtype=torch.bool, device=device)
    return (m.tril() if causal else m).expand(b, s, s)


def error_stats(got, truth, refs, positions):
    """Errors of this rank's shard ``got`` (out, dq, dk, dv as [s_local, ...]) against the full
    float64 ``truth``, and of the full single-device results ``refs`` (one per `reference_orders`):
    max abs and sums of squares (the RMS is combined over ranks in `check_bounds`)."""
    sh = lambda x: x.index_select(0, positions)  # noqa: E731
    errs = [g.double() - sh(t) for g, t in zip(got, truth)]
    ref_errs = [[a - t for a, t in zip(ref, truth)] for ref in refs]
    return {
        "max_truth": {n: t.abs().max().item() for n, t in zip(TENSORS, truth)},
        "ref_err": {n: max(r[i].abs().max().item() for r in ref_errs) for i, n in enumerate(TENSORS)},
        "ref_rms": {n: ref_errs[0][i].pow(2).mean().sqrt().item() for i, n in enumerate(TENSORS)},
        "err": {n: e.abs().max().item() for n, e in zip(TENSORS, errs)},
        "sq_err": {n: e.pow(2).sum().item() for n, e in zip(TENSORS, errs)},
        "numel": {n: e.numel() for n, e in zip(TENSORS, errs)},  # this shard's
    }


def measure(case, attn, positions, on_forward=None, device="cpu"):
    """Run ``attn(q, k, v)`` on this rank's shard (tokens ``positions``) of seeded full tensors.

    Returns `error_stats` plus ``merge_g`` (`merge_sensitivity`) and ``dtypes_ok``.
    ``on_forward()`` is called between the forward and the backward. Everything (the float64
    truth, the in-dtype reference and the shards ``attn`` gets) lives on ``device``; the seeded
    draw is on the CPU, so every rank and device sees the same numbers.
    """
    import torch
    import torch.nn.functional as F

    dtype = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    b, h, hk, s, d = 2, case["h"], case["hk"], case["s"], case["d"]
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q, dout = (torch.randn(s, b, h, d, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    k, v = (torch.randn(s, b, hk, d, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    positions = positions.to(device)

    def full_sdpa(dt):  # single-process SDPA on the whole sequence, in dtype dt
        def run(q_, k_, v_, dout_):
            xs = [x.to(dt).permute(1, 2, 0, 3).detach().requires_grad_() for x in (q_, k_, v_)]
            o = F.scaled_dot_product_attention(*xs, is_causal=case["causal"], enable_gqa=True)
            o.backward(dout_.to(dt).permute(1, 2, 0, 3))
            return [t.permute(2, 0, 1, 3).double() for t in (o.detach(), xs[0].grad, xs[1].grad, xs[2].grad)]
        return run

    truth = full_sdpa(torch.float64)(q, k, v, dout)
    refs = [in_order(full_sdpa(dtype), perms, q, k, v, dout) for perms in reference_orders(d, device)]
    sh = lambda x: x.index_select(0, positions)  # noqa: E731 - a new tensor: this rank's tokens, in local order
    checks = {}

    def cp(ql, kl, vl, doutl):  # the variant under test on this rank's shard
        ql, kl, vl = (x.to(dtype).detach().requires_grad_() for x in (ql, kl, vl))
        out = attn(ql, kl, vl)
        if on_forward is not None:
            on_forward()
        out.backward(doutl.to(dtype))
        got = [out.detach(), ql.grad, kl.grad, vl.grad]
        checks["dtypes_ok"] = all(g.dtype == dtype and g.shape == x.shape for g, x in zip(got, (ql, ql, kl, vl)))
        return got

    got = in_order(cp, summation_order_perms(d, device), sh(q), sh(k), sh(v), sh(dout))
    res = error_stats(got, truth, refs, positions)
    res["merge_g"] = merge_sensitivity(q, k, v, dout, causal_mask(b, s, case["causal"], device), d ** -0.5)
    res["dtypes_ok"] = checks["dtypes_ok"]
    return res


def check_bounds(results, name, dtype, merges, low_prec_slack=0.0, key="err", record=None):
    """Assert the module docstring's bounds for case ``name`` over every rank's results.

    ``merges``: T, the partial results a query row merges (1: one kernel call). bf16/fp16:
    err <= 2 x single-device error + ``low_prec_slack`` x max|truth| (see docs/attention.md).
    Returns {tensor: (err, bound)} of the max-abs bound (tools/attention_margins.py reads it).
    """
    mx = lambda k, t: max(res[name][k][t] for res in results.values())  # noqa: E731
    margins = {}
    for t in TENSORS:
        err, ref, truth = mx(key, t), mx("ref_err", t), mx("max_truth", t)
        if dtype == "fp64":
            bound = FP64_ABS
        elif dtype == "fp32":
            bound = 2 * ref + FP32_ULP * truth + (merges - 1) * U * mx("merge_g", t)
            # Every group of ranks running a case covers the whole tensor once: the mean over every
            # (rank, element) held is the whole tensor's.
            rms = (sum(r[name]["sq_err"][t] for r in results.values()) / sum(r[name]["numel"][t] for r in results.values())) ** 0.5
            rms_bound = RMS_FACTOR * mx("ref_rms", t)
            margins[f"{t}_rms"] = (rms, rms_bound)
            assert rms <= rms_bound, (f"{t}: RMS error {rms:.3g} > {RMS_FACTOR} x single-device fp32 RMS error "
                                      f"{mx('ref_rms', t):.3g}")
            assert err <= FP32_ABS, f"{t}: error {err:.3g} > {FP32_ABS}"
        else:
            bound = 2 * ref + low_prec_slack * truth
        margins[t] = (err, bound)
        assert err <= bound, (f"{t}: {dtype} error {err:.3g} > bound {bound:.3g} (2 x single-device {ref:.3g}"
                              + (f" + 1 ulp + {merges - 1} merges x u x G" if dtype == "fp32" else "") + ")")
    _record_margins(name, margins)
    return margins


def _record_margins(name, margins):
    """With CP_EXT_MARGINS_FILE set, append {case: {bound: bound / err}} (tools/attention_margins.py)."""
    path = os.environ.get("CP_EXT_MARGINS_FILE")
    if not path:
        return
    import json

    row = {k: (b / e if e > 0 else float("inf")) for k, (e, b) in margins.items()}
    with open(path, "a") as f:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0]
        f.write(json.dumps({"test": test, "case": name, "margins": row}) + "\n")


def init_four_ranks():
    """Worker setup shared by the 4-rank attention tests: gloo, one thread per rank, and
    the groups {2: this rank's pair ([0, 1] or [2, 3]), 4: the world}. Returns (rank, groups)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both, in order
    return rank, {2: pairs[rank // 2], 4: dist.group.WORLD}


def value_errors(calls):
    """{name: the ValueError's message, or None when the call raised none} for ``{name: call}``."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


# ----------------------------------------------------------------------------- masks, windows, sinks
def sample_document_ids(b, s):
    """Documents of lengths 5, 11, rest (sample 0) and 13, rest (sample 1), the last 3 tokens padding."""
    import torch

    ids = torch.zeros(b, s, dtype=torch.int64)
    for i, cuts in enumerate(([5, 16], [13])):
        for c in cuts:
            ids[i, c:] += 1
    ids[:, s - 3:] = -1
    return ids


def full_mask(case, b, s, device="cpu"):
    """[b, s, s] True where query i sees key j under ``case``'s causal, window and documents
    (`sample_document_ids`)."""
    import torch

    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    m = torch.ones(s, s, dtype=torch.bool)
    if case["causal"]:
        m &= j <= i
    if case["window"]:
        left, right = case["window"]
        m &= (j >= i - left) if left >= 0 else m
        m &= (j <= i + right) if right >= 0 else m
    m = m.expand(b, s, s).clone()
    if case["docs"]:
        ids = sample_document_ids(b, s)
        m &= (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
    return m.to(device)


def explicit_attention(q, k, v, offset, mask, scale):
    """Attention with ``mask`` [b, s, s] and the sink, in q's dtype: q [s, b, h, d] -> out [s, b, h, dv]."""
    import torch

    qk, kk, vk = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    g = qk.shape[1] // kk.shape[1]
    kk, vk = kk.repeat_interleave(g, 1), vk.repeat_interleave(g, 1)
    scores = (qk @ kk.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
    if offset is not None:
        scores = torch.cat([scores, offset.view(1, -1, 1, 1).expand(*scores.shape[:3], 1).to(scores.dtype)], -1)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    if offset is not None:
        p = p[..., :-1]
    return (p @ vk).permute(2, 0, 1, 3)
