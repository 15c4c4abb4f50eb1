"""The one-device checks' inputs, float64 truth and labels, and the document kernel rows.

Inputs: seeded unit-variance float64 q, k, v, dout of ``SIM``'s sizes on the CPU; packed documents
(`document_ids`): single-token documents, a document spanning the sequence, padding rows with id -1.
Truth is float64 on the CPU: one SDPA over the sequence (`single_device`, the LSE by an explicit
logsumexp) or one SDPA per document (`document_attention`; rows without keys: out 0, LSE -inf).
"ref" is the same computation in the dtype under test on the device (the LSE of the dtype-rounded
q, k in the kernels' accumulation dtype: SDPA does not return it).
"""

import random
import zlib

import torch
import torch.nn.functional as F

from cp_ext.attention.masks.documents import diagonal_segments, document_runs, tile_segments
from cp_ext.attention.kernels import get_kernel
from cp_ext.attention.cp.primitives import accum_dtype
from tests.gpu.rows import judge

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIM = dict(ring=4, s=200, b=2, h=8, d=64)  # 8 zigzag chunks of 25 tokens: every step after the first a half tile
RING_VARIANTS = [(causal, gqa) for causal in (True, False) for gqa in (False, True)]
# Kernel tiles: (q rows, k rows of the s = 200 sequence, causal, which ids). "docs": `document_ids`;
# "one-row": every q row its own document, 8 k rows each (all q segments one row long: flash-attn's
# max_seqlen_q == 1 path, which swaps heads and rows under GQA).
DOC_TILES = {
    "diagonal causal": (slice(0, 200), slice(0, 200), True, "docs"),
    "diagonal full": (slice(0, 200), slice(0, 200), False, "docs"),
    "off-diagonal full": (slice(0, 100), slice(50, 200), False, "docs"),
    "one-row q docs full": (slice(0, 25), slice(0, 200), False, "one-row"),
}
DOC_VARIANTS = [("diagonal causal", False)] + [(tile, True) for tile in DOC_TILES]  # (tile, gqa)


def heads(gqa):
    return "GQA 8/2" if gqa else "MHA 8/8"


def sim_label(kernel, dtype, causal, gqa):
    return f"sim-ring C{SIM['ring']} s{SIM['s']} {kernel} {dtype} {'causal' if causal else 'full'} {heads(gqa)}"


def doc_sim_label(kernel, dtype, causal):
    return f"docs sim-ring C{SIM['ring']} s{SIM['s']} {kernel} {dtype} {'causal' if causal else 'full'} GQA 8/2"


def doc_label(kernel, dtype, tile, gqa):
    return f"docs kernel {kernel} {dtype} {tile} {heads(gqa)}"


def inputs(causal, gqa, s=SIM["s"]):
    """Seeded unit-variance float64 q, k, v, dout [b, h, s, d] on the CPU: views of [s, b, h, d] tensors,
    as ring_attention hands its shards to the ring."""
    h, hk = SIM["h"], 2 if gqa else SIM["h"]
    gen = torch.Generator().manual_seed(zlib.crc32(f"sim-{causal}-{gqa}".encode()))
    xs = [torch.randn(SIM["s"], SIM["b"], n, SIM["d"], generator=gen, dtype=torch.float64) for n in (h, hk, hk, h)]
    return [x[:s].permute(1, 2, 0, 3) for x in xs]


def document_ids(s=SIM["s"]):
    """[2, s] ids. Sample 0: seeded random document lengths (a third of the draws single-token),
    then 6 padding rows (id -1: attend to nothing); sample 1: one document over all but its first
    row and last 2 rows (it spans every tile and every ring rank)."""
    rng, lengths, left = random.Random(0), [], s - 6
    while left:
        lengths.append(min(left, rng.choice((1, 1, 1, 2, 3, 5, 8, 13, 21, 34))))
        left -= lengths[-1]
    first = [doc for doc, n in enumerate(lengths) for _ in range(n)] + [-1] * 6
    return torch.tensor([first, [0] + [1] * (s - 3) + [2, 2]])


def single_device(q, k, v, dout, causal, dtype, device):
    """Full-sequence attention on one device in ``dtype`` ([b, h, s, d] in and out): SDPA's out and
    grads, logsumexp's LSE. Results come back as float64 on the CPU."""
    xs = [x.to(device, dtype).detach().requires_grad_() for x in (q, k, v)]
    o = F.scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=True)
    o.backward(dout.to(device, dtype))
    acc = accum_dtype(dtype)
    qa, ka = xs[0].detach().to(acc), xs[1].detach().to(acc).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = qa @ ka.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=device).triu(1), float("-inf"))
    back = lambda x: x.detach().double().cpu()  # noqa: E731
    return dict(out=back(o), lse=back(torch.logsumexp(scores, -1)), dq=back(xs[0].grad), dk=back(xs[1].grad),
                dv=back(xs[2].grad))


def document_attention(q, k, v, dout, ids_q, ids_k, causal, dtype, device):
    """Attention within documents, one SDPA per (sample, document), in ``dtype`` on ``device``.

    q, dout [b, h, s_q, d] and k, v [b, hk, s_k, d] float64; ids_q [b, s_q], ids_k [b, s_k]: the
    rows of a document in q attend its rows in k (``causal``: they are the same tokens, causal
    among themselves). Rows with a negative id or whose document has no rows in k: out 0, LSE
    -inf, no gradient. The LSE as `single_device`'s. Returns float64 CPU out, lse, dq, dk, dv.
    """
    xs = [x.to(device, dtype).detach().requires_grad_() for x in (q, k, v)]
    acc, scale, group = accum_dtype(dtype), q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=dtype, device=device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=device)
    outs, grads = [], []
    for b in range(q.shape[0]):
        for doc in ids_q[b].unique().tolist():
            qi, ki = ((ids[b] == doc).nonzero()[:, 0].to(device) for ids in (ids_q, ids_k))
            if doc < 0 or ki.numel() == 0:
                continue
            qd, kd, vd = xs[0][b:b + 1, :, qi], xs[1][b:b + 1, :, ki], xs[2][b:b + 1, :, ki]
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale, enable_gqa=True)
            outs.append(o)
            grads.append(dout[b:b + 1, :, qi.cpu()].to(device, dtype))
            out[b, :, qi] = o[0].detach()
            scores = qd.detach().to(acc) @ kd.detach().to(acc).repeat_interleave(group, 1).transpose(-1, -2) * scale
            if causal:
                scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=device).triu(1),
                                    float("-inf"))
            lse[b, :, qi] = torch.logsumexp(scores, -1)[0]
    torch.autograd.backward(outs, grads)
    back = lambda x: x.detach().double().cpu()  # noqa: E731
    dq, dk, dv = (back(x.grad) if x.grad is not None else torch.zeros(x.shape, dtype=torch.float64) for x in xs)
    return dict(out=back(out), lse=back(lse), dq=dq, dk=dk, dv=dv)


def max_err(got, want):
    """max |got - want|, equal entries (-inf == -inf: a row with no keys in both) counting 0; NaN stays NaN."""
    got = got.double().cpu()
    return torch.where(got == want, 0.0, (got - want).abs()).max().item()


def reference_errors(ref, truth):
    """(ref_err, max_truth) per tensor for `judge`; max |truth| over its finite entries (the LSE of a row
    without keys is -inf)."""
    return ({t: max_err(ref[t], truth[t]) for t in truth},
            {t: torch.where(truth[t].isfinite(), truth[t], 0.0).abs().max().item() for t in truth})


def doc_kernel_row(kernel_name, dtype_name, tile, gqa, device, cache):
    """``forward_segments`` / ``backward_segments`` of one kernel on one tile of packed documents
    (the backward with the forward's own out / LSE) against float64 per-document truth: one row.
    ``cache`` keeps the truth and references between rows."""
    dtype = DTYPES[dtype_name]
    qs, ks, causal, which = DOC_TILES[tile]
    key = (tile, gqa)
    if key not in cache:
        ids = document_ids() if which == "docs" else None
        ids_q = ids[:, qs] if ids is not None else torch.arange(qs.stop - qs.start).expand(2, -1)
        ids_k = ids[:, ks] if ids is not None else (torch.arange(ks.stop - ks.start) // 8).expand(2, -1)
        q, k, v, dout = inputs(False, gqa)
        x = (q[:, :, qs], k[:, :, ks], v[:, :, ks], dout[:, :, qs])
        cache[key] = (x, ids_q, ids_k, document_attention(*x, ids_q, ids_k, causal, torch.float64, "cpu"))
    x, ids_q, ids_k, truth = cache[key]
    if (key, dtype_name) not in cache:
        cache[key, dtype_name] = reference_errors(document_attention(*x, ids_q, ids_k, causal, dtype, device), truth)
    runs_q = document_runs(ids_q)
    segments = diagonal_segments(runs_q) if qs == ks else tile_segments(runs_q, document_runs(ids_k))
    kernel = get_kernel(device, dtype, kernel_name, head_dim=SIM["d"])
    q, k, v, dout = (t.to(device, dtype) for t in x)
    out, lse = kernel.forward_segments(q, k, v, segments, causal=causal, scale=SIM["d"] ** -0.5)
    dq, dk, dv = kernel.backward_segments(dout, q, k, v, out, lse, segments, causal=causal, scale=SIM["d"] ** -0.5)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    acc = accum_dtype(dtype)
    ok = out.dtype == dtype and all(got[t].dtype == acc for t in ("lse", "dq", "dk", "dv"))
    err = {t: max_err(got[t], truth[t]) for t in truth}
    return judge("single", doc_label(kernel_name, dtype_name, tile, gqa), dtype_name, err, *cache[key, dtype_name], ok,
                 segments=len(segments))
