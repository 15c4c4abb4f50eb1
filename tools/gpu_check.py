"""The one command a GPU user runs first: does cp_ext compute exact attention and train on this node?

    bash tools/gpu_check.sh [--out DIR]          # every GPU of the node, <= 9 minutes
    python3 tools/gpu_check.py --device cpu      # part 2 only, on CPU: tests this script itself

Every check is one row of the summary: PASS, FAIL, or "not covered" (not run here, e.g. the
multi-GPU part on a one-GPU node; it never counts as a pass). The table is printed and
written with the environment to ``DIR/summary.json`` (default gpu_check_out/).

1. Preflight: torch, CUDA, the GPUs. No usable CUDA: exit 2 (unless ``--device cpu``).
2. Simulated ring, one device (`simulate_ring`): C = 4 virtual ring ranks, zigzag, s = 200
   tokens = 8 chunks of 25, so every step after the first is a half tile of 25 rows and the
   efficient kernel pads its LSE from 25 / 50 rows to 32 / 64. The forward and backward are
   ring_attn_forward / ring_attn_backward's loops with "receive block src" replaced by
   indexing it: `plan_tile`'s tiles, ``kernel.forward_blocks``, `update_out_and_lse`; the backward
   on each block with the *global* out / LSE, dq summed locally and dk / dv on the block's
   owner, in fp32. For every kernel of `KERNELS` that can run here x fp64/fp32/bf16/fp16
   (where `kernel_problem` allows) x causal/full x MHA/GQA (h 8, kv 8 or 2, d 64): out, LSE,
   dq, dk, dv against float64 truth on the CPU (SDPA; the LSE by an explicit logsumexp).
   Packed documents (`document_rows`; ids from `document_ids`: single-token documents, a
   document spanning the sequence, padding rows with id -1): every kernel x dtype's
   ``forward_segments`` / ``backward_segments`` on the tiles of `DOC_TILES` (diagonal causal
   and full, an off-diagonal tile cutting documents at both edges, and q documents of one row
   each), and the simulated ring with ``document_ids`` (causal / full, GQA 8/2), against
   float64 truth by one SDPA per document (`document_attention`); rows without keys must give
   out 0 and LSE -inf. Same bounds, "ref" = the same per-document SDPA in the dtype.
   Windows, sinks and MLA's 192/128 head dims through every kernel (`tools/gpu_check_masks.py`:
   ``local_attention`` against float64 explicit attention; kernels without masks must refuse a
   window). Then ``pytest tests/attention/test_cuda_kernels.py`` (one GPU), and Megatron-LM's five MoE
   scripts' flags (tests/families, shrunk in sizes, bf16) training 3 iterations on one GPU
   (`tools/gpu_check_families.py`).
3. Two or more GPUs (torchrun, NCCL, one rank per GPU): ring (C = all GPUs), Ulysses
   (U = all, when the 8 heads split) and the hybrid (U2 x R(n/2), n >= 4 even) on ~4096
   tokens, bf16 and fp32, against float64 truth (`tests.attention.reference.measure` on the
   GPU); a 30-iteration ``--bf16`` demo run whose loss must fall; tools/bench_attention.py
   whose counted bytes must equal `cp_ext.perf.comm`'s formula; the model grid-equivalence test's
   CP2 ring and Ulysses cases (fp32, losses and every gradient within 1e-5 of one GPU).

Bounds, per tensor, on max |error| against float64 truth ("ref" = the same full-sequence
attention on one device in the dtype: SDPA for out/dq/dk/dv, and for the LSE, which SDPA does
not return, logsumexp of the dtype-rounded q, k in fp32 -- the kernels' own precision):

* fp32: <= 2 x ref and <= 1e-4. 2 x ref is the rounding a correct ring may add (its extra
  sums are LSE merges and C-term fp32 accumulations); 1e-4 is ~100x the fp32 error at these
  sizes (unit-variance inputs, max|truth| <~ 10) and ~1000x below what a wrong merge, half
  tile or LSE gives, so a reference that is itself broken cannot carry the ring through.
  TF32 is switched off (``torch.set_float32_matmul_precision("highest")``): fp32 means fp32.
* fp64: <= 2 x ref + 1e-12 (on the CPU the float64 reference is the truth itself, error 0),
  and <= 1e-10.
* bf16/fp16: <= 2 x ref + 2**-8 x max|truth| (the ring's bound, tests/attention/test_ring.py:
  each step's block output is rounded to the dtype before the fp32 merge), and <= 2**-5 x
  max|truth| (~3x the worst bf16 error measured on CPU, 1.1%): as for fp32, a broken
  reference must not widen the bound.

Exit status: 0 when every row that ran passed and the simulated ring ran; 1 on any FAIL
(an exception, a timeout or a missing result is a FAIL); 2 when CUDA is not usable.
Each subprocess is time-boxed and the whole run keeps to ``--budget`` seconds (default 540).
"""

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cp_ext.attention.documents import diagonal_segments, document_runs, tile_segments  # noqa: E402
from cp_ext.attention.kernels import KERNELS, get_kernel, kernel_problem  # noqa: E402
from cp_ext.attention.masks import make_window, plan_tile, position_runs, tile_span  # noqa: E402
from cp_ext.attention.utils import accum_dtype, update_out_and_lse  # noqa: E402
from cp_ext.data.sharding import zigzag_positions  # noqa: E402

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIM = dict(ring=4, s=200, b=2, h=8, d=64)  # 8 zigzag chunks of 25 tokens
NCCL = dict(h=8, hk=2, d=64, tokens=4096)
FP32_ABS, FP64_FLOOR, FP64_ABS, LOW_PREC_SLACK, LOW_PREC_CAP = 1e-4, 1e-12, 1e-10, 2.0 ** -8, 2.0 ** -5
NOT_COVERED = "not covered"
MULTI_GPU = ("NCCL attention: ring / Ulysses / hybrid", "demo training --bf16: loss falls",
             "bench_attention: bytes == formula", "model grid equivalence CP2 ring/Ulysses vs 1 GPU (fp32, 1e-5)")


def row(part, check, status, figure="", bound="", **detail):
    return dict(part=part, check=check, status=status, figure=figure, bound=bound, detail=detail)


def bound_for(dtype, ref_err, max_truth):
    if dtype == "fp64":
        return min(2 * ref_err + FP64_FLOOR, FP64_ABS)
    if dtype == "fp32":
        return min(2 * ref_err, FP32_ABS)
    return min(2 * ref_err + LOW_PREC_SLACK * max_truth, LOW_PREC_CAP * max_truth)


def judge(part, check, dtype, err, ref_err, max_truth, ok=True, **detail):
    """One row from per-tensor errors: FAIL if any tensor is over its bound (NaN is over)."""
    bounds = {t: bound_for(dtype, ref_err[t], max_truth[t]) for t in err}
    ratio = {t: 0.0 if err[t] == 0 else err[t] / bounds[t] if bounds[t] > 0 else math.inf for t in err}
    ratio = {t: r if r == r else math.inf for t, r in ratio.items()}  # a NaN error or bound is over
    worst = max(ratio, key=ratio.get)
    passed = ok and all(r <= 1 for r in ratio.values())
    return row(part, check, "PASS" if passed else "FAIL", f"{worst} {err[worst]:.2e}", f"{bounds[worst]:.2e}",
               err=err, ref_err=ref_err, max_truth=max_truth, bounds=bounds, dtypes_ok=ok, **detail)


# ----------------------------------------------------------------------------- part 2
def simulate_ring(kernel, q, k, v, dout, *, ring, causal, scale, document_ids=None):
    """ring_attn_forward / ring_attn_backward over ``ring`` virtual ranks on one device.

    q, dout [s, b, h, d] and k, v [s, b, hk, d] are the full sequence in the dtype under
    test. Virtual rank r holds its zigzag shard as ring_attention hands it to the ring (a
    [b, h, s/C, d] view of a [s/C, b, h, d] tensor) and KV stacked as the ring sends it.
    Each (rank, step) tile is planned as `RingSchedule` plans it (`cp_ext.attention.masks.plan_tile`
    on the ranks' positions, with ``document_ids`` [b, s] (the full sequence's, CPU) cut into
    document segments; a tile without blocks is skipped) and computed by ``kernel.forward_blocks``
    / ``backward_blocks``. Returns the full-sequence out, dq, dk, dv [s, b, ., d] and lse [b, h, s].
    """
    s, dev = q.shape[0], q.device
    pos = [zigzag_positions(s, r, ring, device=dev) for r in range(ring)]
    local = lambda x, r: x.index_select(0, pos[r]).permute(1, 2, 0, 3)  # noqa: E731
    Q, DO = [local(q, r) for r in range(ring)], [local(dout, r) for r in range(ring)]
    KV = [torch.stack([local(k, r), local(v, r)]) for r in range(ring)]
    acc = accum_dtype(q.dtype)
    runs = [position_runs(p.tolist()) for p in pos]
    docs = None if document_ids is None else [document_runs(document_ids[:, pos[r].cpu()]) for r in range(ring)]

    def tiles(r):  # rank r's tiles that compute: (block src, q rows, kv rows, blocks shifted to them)
        for step in range(ring):
            src = (r - step) % ring
            blocks = plan_tile(runs[r], runs[src], make_window(None, causal), same_tokens=src == r,
                               q_docs=None if docs is None else docs[r], k_docs=None if docs is None else docs[src])
            if blocks:
                qs, ks = tile_span(blocks)
                yield src, qs, ks, [blk.shift(qs.start, ks.start) for blk in blocks]

    outs, lses = [], []
    for r in range(ring):  # forward of rank r: at step t it holds block src = (r - t) mod C
        out = torch.zeros(Q[r].shape, dtype=acc, device=dev)
        lse = torch.full(Q[r].shape[:3], float("-inf"), dtype=acc, device=dev)
        for src, qs, ks, blocks in tiles(r):
            kv = KV[src]
            block_out, block_lse = kernel.forward_blocks(Q[r][:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], blocks,
                                                         scale=scale)
            update_out_and_lse(out, lse, block_out, block_lse, qs)
        outs.append(out.to(q.dtype))  # what the ring returns and saves for its backward
        lses.append(lse)

    dq = [torch.zeros(x.shape, dtype=acc, device=dev) for x in Q]
    dkv = [torch.zeros(x.shape, dtype=acc, device=dev) for x in KV]  # each block's, at its owner
    for r in range(ring):  # backward of rank r, with the global out / LSE of its rows
        for src, qs, ks, blocks in tiles(r):
            kv = KV[src]
            dq_s, dk_s, dv_s = kernel.backward_blocks(DO[r][:, :, qs], Q[r][:, :, qs], kv[0][:, :, ks],
                                                      kv[1][:, :, ks], outs[r][:, :, qs], lses[r][:, :, qs], blocks,
                                                      scale=scale)
            dq[r][:, :, qs].add_(dq_s)
            dkv[src][0][:, :, ks].add_(dk_s)
            dkv[src][1][:, :, ks].add_(dv_s)

    order = torch.cat(pos)  # the global position of each row of the shards, in rank order

    def full(parts, dtype):  # [b, h, s/C(, d)] per rank -> the full sequence, [s, b, h, d] / [b, h, s]
        cat = torch.cat(parts, 2).to(dtype)
        x = torch.empty_like(cat).index_copy_(2, order, cat)
        return x.permute(2, 0, 1, 3) if x.dim() == 4 else x

    return dict(out=full(outs, q.dtype), lse=full(lses, acc), dq=full(dq, q.dtype),
                dk=full([x[0] for x in dkv], k.dtype), dv=full([x[1] for x in dkv], v.dtype))


def _inputs(causal, gqa):
    """Seeded unit-variance float64 q, k, v, dout [s, b, h, d] on the CPU."""
    s, b, h, d = SIM["s"], SIM["b"], SIM["h"], SIM["d"]
    hk = 2 if gqa else h
    gen = torch.Generator().manual_seed(zlib.crc32(f"sim-{causal}-{gqa}".encode()))
    return [torch.randn(s, b, n, d, generator=gen, dtype=torch.float64) for n in (h, hk, hk, h)]


def single_device(q, k, v, dout, causal, dtype, device):
    """Full-sequence attention on one device in ``dtype``: SDPA's out and grads, logsumexp's LSE.

    The LSE is computed from the dtype-rounded q, k in the kernels' accumulation dtype
    (SDPA does not return it). Results come back as float64 on the CPU.
    """
    xs = [x.to(device, dtype).permute(1, 2, 0, 3).detach().requires_grad_() for x in (q, k, v)]
    o = F.scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=True)
    o.backward(dout.to(device, dtype).permute(1, 2, 0, 3))
    acc = accum_dtype(dtype)
    qa, ka = xs[0].detach().to(acc), xs[1].detach().to(acc).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    scores = qa @ ka.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool, device=device).triu(1), float("-inf"))
    back = lambda x: x.detach().permute(2, 0, 1, 3).double().cpu()  # noqa: E731
    return dict(out=back(o), lse=torch.logsumexp(scores, -1).double().cpu(),
                dq=back(xs[0].grad), dk=back(xs[1].grad), dv=back(xs[2].grad))


def sim_label(kernel_name, dtype_name, causal, gqa):
    return (f"sim-ring C{SIM['ring']} s{SIM['s']} {kernel_name} {dtype_name} {'causal' if causal else 'full'} "
            f"{'GQA 8/2' if gqa else 'MHA 8/8'}")


def sim_ring_row(kernel_name, dtype_name, causal, gqa, device, cache):
    """Simulated ring with one kernel and dtype against float64 truth: one summary row."""
    dtype = DTYPES[dtype_name]
    key = (causal, gqa)
    if key not in cache:
        x = _inputs(causal, gqa)
        cache[key] = (x, single_device(*x, causal, torch.float64, "cpu"))
    x, truth = cache[key]
    if (key, dtype_name) not in cache:
        cache[key, dtype_name] = single_device(*x, causal, dtype, device)
    ref = cache[key, dtype_name]
    kernel = get_kernel(device, dtype, kernel_name, head_dim=SIM["d"])
    got = simulate_ring(kernel, *(t.to(device, dtype) for t in x), ring=SIM["ring"], causal=causal,
                        scale=SIM["d"] ** -0.5)
    ok = all(got[t].dtype == dtype for t in ("out", "dq", "dk", "dv")) and got["lse"].dtype == accum_dtype(dtype)
    err = {t: (got[t].double().cpu() - truth[t]).abs().max().item() for t in truth}
    ref_err = {t: (ref[t] - truth[t]).abs().max().item() for t in truth}
    max_truth = {t: truth[t].abs().max().item() for t in truth}
    return judge("single", sim_label(kernel_name, dtype_name, causal, gqa), dtype_name, err, ref_err, max_truth, ok)


def kernel_rows(device, deadline, variants, label, run):
    """``run(kernel, dtype, *variant)`` for every kernel that can run on ``device`` x dtype x variant: one row
    each (an exception, or the deadline passed: a FAIL row); and the (kernel, dtypes) skipped, with why."""
    rows, skipped = [], {}
    for name in KERNELS:
        for dtype_name, dtype in DTYPES.items():
            reason = kernel_problem(name, dtype, SIM["d"], device.type)
            if reason:
                skipped.setdefault((name, reason), []).append(dtype_name)
                continue
            for variant in variants:
                if time.monotonic() > deadline:
                    rows.append(row("single", label(name, dtype_name, *variant), "FAIL", "not run: time budget spent"))
                    continue
                try:
                    rows.append(run(name, dtype_name, *variant))
                except Exception as e:  # a kernel that crashes is a failed check, not a crashed script
                    rows.append(row("single", label(name, dtype_name, *variant), "FAIL",
                                    f"{type(e).__name__}: {e}"[:300]))
    return rows, [dict(kernel=k, dtypes=d, reason=r) for (k, r), d in skipped.items()]


def sim_ring_rows(device, deadline):
    """Every kernel that can run on ``device`` x dtype x causal/full x MHA/GQA; and what was skipped."""
    cache = {}
    return kernel_rows(device, deadline, [(c, g) for c in (True, False) for g in (False, True)], sim_label,
                       lambda name, dt, causal, gqa: sim_ring_row(name, dt, causal, gqa, device, cache))


# ----------------------------------------------------------------------------- part 2: packed documents
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


def document_attention(q, k, v, dout, ids_q, ids_k, causal, dtype, device):
    """Attention within documents, one SDPA per (sample, document), in ``dtype`` on ``device``.

    q, dout [b, h, s_q, d] and k, v [b, hk, s_k, d] float64; ids_q [b, s_q], ids_k [b, s_k]: the
    rows of a document in q attend its rows in k (``causal``: they are the same tokens, causal
    among themselves). Rows with a negative id or whose document has no rows in k: out 0, LSE
    -inf, no gradient. The LSE is logsumexp of the dtype-rounded q, k in the kernels'
    accumulation dtype (as `single_device`). Returns float64 CPU out, lse, dq, dk, dv.
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


def _max_err(got, want):
    """max |got - want|, equal entries (-inf == -inf: a row with no keys in both) counting 0; NaN stays NaN."""
    got = got.double().cpu()
    return torch.where(got == want, 0.0, (got - want).abs()).max().item()


def _reference_errors(ref, truth):
    """(ref_err, max_truth) per tensor for `judge`; max |truth| over its finite entries (the LSE of a row
    without keys is -inf)."""
    return ({t: _max_err(ref[t], truth[t]) for t in truth},
            {t: torch.where(truth[t].isfinite(), truth[t], 0.0).abs().max().item() for t in truth})


def doc_label(kernel_name, dtype_name, tile, gqa):
    return f"docs kernel {kernel_name} {dtype_name} {tile} {'GQA 8/2' if gqa else 'MHA 8/8'}"


def doc_kernel_row(kernel_name, dtype_name, tile, gqa, device, cache):
    """``forward_segments`` / ``backward_segments`` of one kernel on one tile of packed documents
    (the backward with the forward's own out / LSE) against float64 per-document truth: one row."""
    dtype = DTYPES[dtype_name]
    qs, ks, causal, which = DOC_TILES[tile]
    key = (tile, gqa)
    if key not in cache:
        ids = document_ids() if which == "docs" else None
        ids_q = ids[:, qs] if ids is not None else torch.arange(qs.stop - qs.start).expand(2, -1)
        ids_k = ids[:, ks] if ids is not None else (torch.arange(ks.stop - ks.start) // 8).expand(2, -1)
        q, k, v, dout = (x.permute(1, 2, 0, 3) for x in _inputs(False, gqa))  # [b, h, s, d] views, as the ring's
        x = (q[:, :, qs], k[:, :, ks], v[:, :, ks], dout[:, :, qs])
        cache[key] = (x, ids_q, ids_k, document_attention(*x, ids_q, ids_k, causal, torch.float64, "cpu"))
    x, ids_q, ids_k, truth = cache[key]
    if (key, dtype_name) not in cache:
        cache[key, dtype_name] = _reference_errors(document_attention(*x, ids_q, ids_k, causal, dtype, device), truth)
    runs_q = document_runs(ids_q)
    segments = diagonal_segments(runs_q) if qs == ks else tile_segments(runs_q, document_runs(ids_k))
    kernel = get_kernel(device, dtype, kernel_name, head_dim=SIM["d"])
    q, k, v, dout = (t.to(device, dtype) for t in x)
    out, lse = kernel.forward_segments(q, k, v, segments, causal=causal, scale=SIM["d"] ** -0.5)
    dq, dk, dv = kernel.backward_segments(dout, q, k, v, out, lse, segments, causal=causal, scale=SIM["d"] ** -0.5)
    got = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    acc = accum_dtype(dtype)
    ok = out.dtype == dtype and all(got[t].dtype == acc for t in ("lse", "dq", "dk", "dv"))
    err = {t: _max_err(got[t], truth[t]) for t in truth}
    return judge("single", doc_label(kernel_name, dtype_name, tile, gqa), dtype_name, err, *cache[key, dtype_name], ok,
                 segments=len(segments))


def doc_sim_label(kernel_name, dtype_name, causal):
    mask = "causal" if causal else "full"
    return f"docs sim-ring C{SIM['ring']} s{SIM['s']} {kernel_name} {dtype_name} {mask} GQA 8/2"


def doc_sim_ring_row(kernel_name, dtype_name, causal, device, cache):
    """The simulated ring with `document_ids` (GQA 8/2) against float64 per-document truth: one row."""
    dtype = DTYPES[dtype_name]
    ids = document_ids()
    to_bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    if causal not in cache:
        x = _inputs(causal, True)
        cache[causal] = (x, document_attention(*map(to_bhsd, x), ids, ids, causal, torch.float64, "cpu"))
    x, truth = cache[causal]
    if (causal, dtype_name) not in cache:
        cache[causal, dtype_name] = _reference_errors(
            document_attention(*map(to_bhsd, x), ids, ids, causal, dtype, device), truth)
    kernel = get_kernel(device, dtype, kernel_name, head_dim=SIM["d"])
    got = simulate_ring(kernel, *(t.to(device, dtype) for t in x), ring=SIM["ring"], causal=causal,
                        scale=SIM["d"] ** -0.5, document_ids=ids)
    ok = all(got[t].dtype == dtype for t in ("out", "dq", "dk", "dv")) and got["lse"].dtype == accum_dtype(dtype)
    got = {t: to_bhsd(got[t]) if got[t].dim() == 4 else got[t] for t in got}
    err = {t: _max_err(got[t], truth[t]) for t in truth}
    return judge("single", doc_sim_label(kernel_name, dtype_name, causal), dtype_name, err, *cache[causal, dtype_name],
                 ok)


def document_rows(device, deadline):
    """Packed documents: every kernel that can run on ``device`` x dtype on `DOC_VARIANTS` tiles, and
    the simulated ring with documents (causal / full, GQA)."""
    kernel_cache, sim_cache = {}, {}
    rows, _ = kernel_rows(device, deadline, DOC_VARIANTS, doc_label,
                          lambda name, dt, tile, gqa: doc_kernel_row(name, dt, tile, gqa, device, kernel_cache))
    sim, _ = kernel_rows(device, deadline, [(True,), (False,)], doc_sim_label,
                         lambda name, dt, causal: doc_sim_ring_row(name, dt, causal, device, sim_cache))
    return rows + sim


# ----------------------------------------------------------------------------- subprocesses
def run_logged(cmd, log, timeout):
    """Run ``cmd`` (output to ``log``) in its own session; on timeout kill its whole group (rc 124)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # torchrun's ranks die with it
        try:
            return proc.wait(timeout=max(1, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124


def _tail(log, n=600):
    text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    return " ".join(text[-n:].split())


def _failed_run(part, check, rc, log):
    why = "timed out" if rc == 124 else f"exit {rc}"
    return row(part, check, "FAIL", f"{why}; see {log}", tail=_tail(log))


def guarded(check, fn, *args):
    """``fn(*args)``'s rows, as a list; an exception in the check itself is a FAIL row, not a lost summary."""
    try:
        got = fn(*args)
        return got if isinstance(got, list) else [got]
    except Exception as e:
        part = "single" if "pytest" in check or "1 GPU" in check else "multi"
        return [row(part, check, "FAIL", f"{type(e).__name__}: {e}"[:300])]


def torchrun(n):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", n]


def pytest_row(part, check, out, name, pytest_args, timeout):
    """One pytest run as one row: PASS only if it passed something and skipped nothing."""
    log = out / f"{name}.log"
    rc = run_logged([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *pytest_args], log, timeout)
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|error)", _tail(log, 400))}
    figure = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no result"
    ok = rc == 0 and counts.get("passed", 0) > 0 and not counts.get("skipped")  # skipped on a GPU: not run
    return row(part, check, "PASS" if ok else "FAIL", figure, "all passed, none skipped", rc=rc, log=str(log))


def cuda_pytest_row(out, timeout):
    return pytest_row("single", "pytest tests/attention/test_cuda_kernels.py", out, "test_cuda_kernels",
                      ["tests/attention/test_cuda_kernels.py"], timeout)


def grid_row(out, timeout):
    """The whole model at CP2 (ring, Ulysses) over NCCL against one GPU: losses, grad norms and
    every parameter gradient within 1e-5 (tests/training/test_grid_equivalence.py, fp32)."""
    return pytest_row("multi", MULTI_GPU[3], out, "grid_equivalence",
                      ["tests/training/test_grid_equivalence.py", "-k", "cp2_ring or cp2_ulysses"], timeout)


def nccl_cases(n):
    """The ring, Ulysses and hybrid cases for ``n`` GPUs; and the variants that cannot run on n."""
    s = 2 * n * (NCCL["tokens"] // (2 * n))  # ~4096 tokens in 2n equal zigzag chunks
    cases, missing = [], []
    for dtype in ("bf16", "fp32"):
        variants = [("ring", 1, n, True), ("ring", 1, n, False)]
        if NCCL["h"] % n == 0:
            variants.append(("ulysses", n, 1, True))
        else:
            missing.append(f"Ulysses U{n}: {NCCL['h']} heads do not split over {n} GPUs")
        if n >= 4 and n % 2 == 0:
            variants.append(("hybrid", 2, n // 2, True))
        else:
            missing.append(f"hybrid U2 x R{n // 2}: needs an even number >= 4 of GPUs, not {n}")
        for via, u, r, causal in variants:
            name = (f"nccl {via} U{u}xR{r} {'causal' if causal else 'full'} {dtype} s{s} "
                    f"h{NCCL['h']}/kv{NCCL['hk']}")
            cases.append(dict(name=name, via=via, U=u, R=r, causal=causal, dtype=dtype, s=s,
                              h=NCCL["h"], hk=NCCL["hk"], d=NCCL["d"]))
    return cases, sorted(set(missing))


def attention_worker(out):
    """One rank of the NCCL check (``--worker attention`` under torchrun); rank 0 writes the errors."""
    import torch.distributed as dist

    from cp_ext.attention import hybrid_attention, ring_attention, ulysses_attention
    from cp_ext.data.sharding import context_parallel_positions
    from tests.attention.reference import measure

    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    n, rank, world = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    ulysses_group = ring_group = None
    if n >= 4 and n % 2 == 0:  # hybrid groups as in test_hybrid: Ulysses rank = rank % 2, ring rank = rank // 2
        for i in range(0, n, 2):  # Ulysses pairs [i, i+1]; every rank creates every group, in order
            g = dist.new_group([i, i + 1])
            ulysses_group = g if rank // 2 == i // 2 else ulysses_group
        for j in range(2):  # rings [j, j+2, ...]
            g = dist.new_group(list(range(j, n, 2)))
            ring_group = g if rank % 2 == j else ring_group
    results = {}
    for case in nccl_cases(n)[0]:
        kw = dict(causal=case["causal"])
        if case["via"] == "ring":
            pos = context_parallel_positions(case["s"], ring_rank=rank, ring_size=n)
            attn = lambda q, k, v: ring_attention(q, k, v, group=world, **kw)  # noqa: E731
        elif case["via"] == "ulysses":
            pos = context_parallel_positions(case["s"], ring_rank=0, ring_size=1, ulysses_rank=rank, ulysses_size=n)
            attn = lambda q, k, v: ulysses_attention(q, k, v, group=world, **kw)  # noqa: E731
        else:
            pos = context_parallel_positions(case["s"], ring_rank=dist.get_rank(ring_group), ring_size=case["R"],
                                             ulysses_rank=dist.get_rank(ulysses_group), ulysses_size=case["U"])
            attn = lambda q, k, v: hybrid_attention(q, k, v, ulysses_group=ulysses_group,  # noqa: E731
                                                    ring_group=ring_group, **kw)
        results[case["name"]] = measure(case, attn, pos, device=device)
    gathered = [None] * n
    dist.all_gather_object(gathered, results)
    if rank == 0:
        (out / "attention.json").write_text(json.dumps(gathered, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def nccl_attention_rows(out, n, timeout):
    cases, missing = nccl_cases(n)
    log, path = out / "attention.log", out / "attention.json"
    path.unlink(missing_ok=True)  # a stale result must not pass for this run's
    rc = run_logged(torchrun(n) + [Path(__file__), "--worker", "attention", "--out", out], log, timeout)
    if rc != 0 or not path.exists():
        return [_failed_run("multi", MULTI_GPU[0], rc, log)]
    ranks = json.loads(path.read_text())
    rows = [row("multi", f"NCCL {m}", NOT_COVERED, "cannot run on this GPU count") for m in missing]
    for case in cases:
        got = [r.get(case["name"]) for r in ranks]
        if len(got) != n or None in got:
            rows.append(row("multi", case["name"], "FAIL", f"results from {len(got) - got.count(None)} of {n} ranks"))
            continue
        mx = lambda key: {t: max(g[key][t] for g in got) for t in got[0][key]}  # noqa: E731  worst rank
        rows.append(judge("multi", case["name"], case["dtype"], mx("err"), mx("ref_err"), mx("max_truth"),
                          all(g["dtypes_ok"] for g in got)))
    return rows


def demo_flags(n):
    """Grid flags that make configs/cpu_demo.yaml (CP2 x DP2, EP2 on 4 ranks) valid on ``n`` GPUs."""
    cp = 2 if n % 2 == 0 else 1
    dp = n // cp
    ep = 2 if n >= 4 and n % 2 == 0 else 1  # experts fold into DP x CP; 2 ranks keep them whole
    return ["--context-parallel-size", cp, "--expert-model-parallel-size", ep,
            "--micro-batch-size", 4, "--global-batch-size", 4 * dp * max(1, 4 // dp)]


def demo_row(out, n, timeout, iters=30):
    check = MULTI_GPU[1]
    log, run_dir = out / "demo.log", out / "demo"
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    rc = run_logged(torchrun(n) + ["pretrain_moe.py", "--config", "configs/cpu_demo.yaml", "--device", "cuda", "--bf16",
                                   "--train-iters", iters, "--log-interval", 5, "--log-dir", run_dir] + demo_flags(n),
                    log, timeout)
    if rc != 0 or not metrics.exists():
        return _failed_run("multi", check, rc, log)
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    loss = [r.get("train/lm_loss", math.nan) for r in lines]
    ok = len(loss) == iters and all(map(math.isfinite, loss)) and loss[-1] < loss[0]
    return row("multi", check, "PASS" if ok else "FAIL", f"lm loss {loss[0]:.3f} -> {loss[-1]:.3f} ({len(loss)} it)"
               if loss else "no loss logged", f"finite, {iters} it, last < first", loss=loss, flags=demo_flags(n))


def bench_row(out, n, timeout):
    """tools/bench_attention.py on every GPU: each collective's counted bytes == cp_ext.perf.comm's formula."""
    from cp_ext.perf import comm as comm_formula

    check = MULTI_GPU[2]
    s, h, hk, d = 2 * n * (4096 // n), 8, 2, 64
    log, path = out / "bench.log", out / "bench.json"
    path.unlink(missing_ok=True)
    rc = run_logged(torchrun(n) + ["tools/bench_attention.py", "--device", "cuda", "--seq-length", s, "--heads", h,
                                   "--kv-heads", hk, "--head-dim", d, "--dtype", "bf16", "--reps", 3, "--warmup", 1,
                                   "--json", path], log, timeout)
    if rc != 0 or not path.exists():
        return _failed_run("multi", check, rc, log)
    res = json.loads(path.read_text())
    u_of = {"ring": 1, "ulysses": n, "hybrid": 2}
    bad, total = [], 0
    for variant, colls in res.get("bytes", {}).items():  # and the formula recomputed here, not only the bench's copy
        formula = comm_formula.cp_attention_bytes(b=1, h=h, hk=hk, s=s, d=d, cp=n, ulysses=u_of[variant], dtype="bf16")
        for coll, c in colls.items():
            total += 1
            want = (formula[coll]["fwd"], formula[coll]["bwd"])
            if not (c["fwd"] > 0 and (c["fwd"], c["bwd"]) == (c["formula_fwd"], c["formula_bwd"]) == want):
                bad.append(f"{variant}/{coll}")
    ok = total > 0 and "ring" in res.get("bytes", {}) and not bad and res.get("bytes_match") is True
    ratios = {k: v["ratio_to_ideal"] for k, v in res.get("variants", {}).items()}
    return row("multi", check, "PASS" if ok else "FAIL", f"{total - len(bad)}/{total} collectives match",
               "counted == formula, ranks agree", mismatched=bad, ratio_to_ideal=ratios, overlap=res.get("overlap"))


# ----------------------------------------------------------------------------- summary
def verdict(rows):
    """(exit status, final line): 1 on any FAIL or when the simulated ring did not run, else 0."""
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    ran = [r for r in rows if r["status"] != NOT_COVERED]
    missing = [r["check"] for r in rows if r["status"] == NOT_COVERED]
    if failed:
        return 1, f"gpu_check: FAILED: {len(failed)} of {len(ran)} checks failed: {'; '.join(failed[:5])}"
    if not any(r["part"] == "single" and r["check"].startswith("sim-ring") and r["status"] == "PASS" for r in rows):
        return 1, "gpu_check: FAILED: the simulated ring did not run (no kernel could run here)"
    line = f"gpu_check: PASSED: all {len(ran)} checks that ran passed"
    if missing:
        line += f"; NOT covered (not run, so not vouched for): {'; '.join(missing)}"
    return 0, line


def print_table(rows):
    w = max(len(r["check"]) for r in rows)
    print(f"\n{'check':{w}s}  {'figure measured':34s} {'bound':34s} status")
    for r in rows:
        print(f"{r['check']:{w}s}  {r['figure'][:34]:34s} {r['bound'][:34]:34s} {r['status']}")
    for r in rows:
        if r["status"] == "FAIL":
            print(f"FAIL {r['check']}: {r['figure']} {r['detail'].get('tail', '')}".rstrip())


def environment(device):
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if device.type == "cuda" else []
    return dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None, device=device.type,
                gpu_count=len(gpus), gpus=gpus, python=sys.version.split()[0])


def preflight(args):
    """The device to check on, or exit 2 with the reason CUDA is not usable."""
    if args.device == "cpu":
        return torch.device("cpu")
    from cp_ext.platform import cuda_unusable_reason

    reason = cuda_unusable_reason()
    if reason is None:
        try:  # a driver or architecture mismatch shows up at the first kernel, not in is_available()
            torch.ones(1, device="cuda").add_(1).item()
        except Exception as e:
            reason = f"a first CUDA op failed: {type(e).__name__}: {e}"
    if reason:
        print(f"gpu_check: CUDA is not usable: {reason}. This check needs an NVIDIA GPU; "
              f"`--device cpu` checks only the script's own logic on the CPU.", file=sys.stderr)
        sys.exit(2)
    return torch.device("cuda", 0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: only the simulated ring, with the CPU kernels (tests this script)")
    p.add_argument("--out", default="gpu_check_out", help="directory for summary.json and the logs")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole check (each step is time-boxed)")
    p.add_argument("--worker", choices=["attention"], help=argparse.SUPPRESS)  # one torchrun rank of part 3
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return attention_worker(out)
    start = time.monotonic()
    left = lambda cap: min(cap, args.budget - (time.monotonic() - start))  # noqa: E731
    device = preflight(args)
    torch.set_float32_matmul_precision("highest")  # no TF32: fp32 rows mean fp32
    if device.type == "cpu":
        torch.set_num_threads(1)
    env = environment(device)
    print(f"gpu_check: torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, {env['gpu_count']} GPU(s)"
          f"{': ' + ', '.join(env['gpus']) if env['gpus'] else ''}; checking on {device.type}; output in {out}")

    rows, skipped = sim_ring_rows(device, time.monotonic() + left(180))
    for s in skipped:
        print(f"  not run here: {s['kernel']} {'/'.join(s['dtypes'])}: {s['reason']}")
    rows += document_rows(device, time.monotonic() + left(60))
    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_check_masks import mask_rows  # part 2b: windows, sinks, MLA head dims

    mrows, mskipped = mask_rows(device, time.monotonic() + left(60), DTYPES, judge, row)
    rows += mrows
    for s in mskipped:
        print(f"  masks, not run here: {s['kernel']} {'/'.join(s['dtypes'])}: {s['reason']}")
    n = env["gpu_count"]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        rows += guarded("pytest tests/attention/test_cuda_kernels.py", cuda_pytest_row, out, left(150))
        from gpu_check_families import family_rows  # Megatron-LM's five MoE scripts on one GPU

        rows += guarded("Megatron-LM's MoE scripts on 1 GPU", family_rows, out, left(40), run_logged, row)
    else:
        rows.append(row("single", "pytest tests/attention/test_cuda_kernels.py", NOT_COVERED, "needs CUDA"))
        rows.append(row("single", "Megatron-LM's MoE scripts on 1 GPU", NOT_COVERED, "needs CUDA"))
    if n >= 2:
        rows += guarded(MULTI_GPU[0], nccl_attention_rows, out, n, left(150))
        rows += guarded(MULTI_GPU[1], demo_row, out, n, left(200))
        rows += guarded(MULTI_GPU[2], bench_row, out, n, left(120))
        rows += guarded(MULTI_GPU[3], grid_row, out, left(120))
    else:
        why = "needs 2+ GPUs" + ("" if device.type == "cuda" else " (--device cpu)")
        rows += [row("multi", check, NOT_COVERED, why) for check in MULTI_GPU]

    code, line = verdict(rows)
    print_table(rows)
    summary = dict(environment=env, seconds=round(time.monotonic() - start, 1), exit_status=code, verdict=line,
                   rows=rows, skipped=skipped)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{line}\n(summary: {out / 'summary.json'}, {summary['seconds']} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
