"""Benchmark cp_ext's context-parallel attention (fwd + bwd) against its ideal, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/bench_attention.py \
        --seq-length 8192 --heads 8 --kv-heads 8 --head-dim 64 --dtype fp32 --reps 9

Packed documents, 8 (or 64) equal documents per 16K-token sample, on a CPU box (a few minutes):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/bench_attention.py \
        --seq-length 16384 --heads 4 --head-dim 64 --reps 3 --warmup 1 --documents 8

C = the number of ranks (gloo on CPU, NCCL on GPU: one GPU per rank). Variants, interleaved
per repetition (ideal, ring, compute-only, ulysses, hybrid, ideal, ...) so a noisy machine
hits them alike; every timed call starts after a barrier and a repetition's time is the
slowest rank's:

* ``ideal``: single-device attention on 1/C of the work: the local kernel, fwd + bwd, on the
  whole sequence for h/C query heads (h_kv/C KV heads when divisible). No communication.
* ``ring``: `cp_ext.attention.cp.ring.ring_attention` on the s/C-token shard (``--layout``).
* ``compute``: the ring's own code (`ring_attn_forward` / `ring_attn_backward`, same step
  plan, same tiles, same merges and accumulators) with `RingComm` replaced by a no-op that
  hands back the local KV: the compute-only time of the same tiles. ring / compute is the
  overlap figure (1.0 = communication fully hidden).
* ``ulysses``: `cp_ext.attention.cp.ulysses.ulysses_attention` over all C ranks (needs h % C == 0).
* ``hybrid``: `cp_ext.attention.cp.context_parallel.hybrid_attention` with ``--ulysses-size`` U and a ring
  of C/U (only when 1 < U < C).
* ``all_gather``: `cp_ext.attention.cp.all_gather.all_gather_attention` over all C ranks (K/V
  all-gathered, dK/dV reduce-scattered); not in the default list, ask for it with --variants.

``--documents N``: every sample is N equal documents (ids made for the whole sequence and
sharded like the tokens, `cp_ext.token_partition.context_parallel_positions`). The ring and
all_gather (default variants then: ``ring,all_gather``) also run with these ``document_ids``,
interleaved with their own runs without (``ring+docs`` right after ``ring``), and are reported
side by side: forward tiles computed per rank and query-key pairs computed (`count_work`: a
tile that shares no document is skipped), time (ratio = with documents / without, median of
the per-repetition ratios), and bytes sent (the ring stops once no rank has work left, so
documents that fit the zigzag chunks send nothing; all_gather's bytes do not change).

``--window W`` and ``--sink`` pair the same way: ring and all_gather with ``window_size=(W, 0)``
(tiles outside the window compute nothing, a block travels only as far as its last reader) or
with a ``softmax_offset`` per head, against their own runs without.

Reported: median ms, the ideal's median, their ratio (median of the per-repetition ratios),
and the bytes each rank sent per collective, counted at the call sites
(`cp_ext.perf.counter`) next to the formula (`cp_ext.perf.comm`) for forward and backward.
"""

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from cp_ext.bench.attention import (
    DTYPES, VARIANTS, attention_call, build_groups, count_variants, report, report_paired, time_interleaved,
)
from cp_ext.attention.cp.primitives import communication_removed
from cp_ext.attention.kernels import get_kernel
from cp_ext.token_partition import context_parallel_positions


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=8192, help="global sequence length s")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="defaults to --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--ulysses-size", type=int, default=None, help="U of the hybrid (default: 2 when C >= 4)")
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--full", action="store_true", help="non-causal attention (default causal)")
    p.add_argument("--variants", default=None,
                   help="comma list of ideal,ring,compute,ulysses,hybrid,all_gather (default: the first five; "
                        "ring,all_gather with --documents)")
    p.add_argument("--documents", type=int, default=None,
                   help="N equal documents per sample: ring and all_gather also run with these document_ids")
    p.add_argument("--window", type=int, default=None,
                   help="a causal sliding window of this many tokens back (window_size=(W, 0)): ring and all_gather "
                        "also run with it")
    p.add_argument("--sink", action="store_true",
                   help="ring and all_gather also run with an attention sink per head (softmax_offset)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = p.parse_args(argv)

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    C, me = dist.get_world_size(), dist.get_rank()
    b, s, h, d = args.batch, args.seq_length, args.heads, args.head_dim
    hk = args.kv_heads or h
    dtype = DTYPES[args.dtype]
    causal = not args.full
    scale = d ** -0.5
    chunks = 2 * C if args.layout == "zigzag" else C
    if s % chunks:
        raise SystemExit(f"--seq-length {s} must be divisible by {chunks}")
    s_local = s // C
    u_h = args.ulysses_size or (2 if C >= 4 and C % 2 == 0 else 1)
    if args.documents is not None and not (0 < args.documents <= s and s % args.documents == 0):
        raise SystemExit(f"--documents {args.documents} must divide --seq-length {s} (equal documents)")
    paired = args.documents or args.window or args.sink
    default = "ring,all_gather" if paired else "ideal,ring,compute,ulysses,hybrid"
    variants = [v for v in (args.variants or default).split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    if "ulysses" in variants and (h % C or C == 1):
        variants.remove("ulysses")
    if "hybrid" in variants and not (1 < u_h < C and C % u_h == 0 and h % u_h == 0):
        variants.remove("hybrid")
    ulysses_group, ring_group = build_groups(C, u_h) if "hybrid" in variants else (None, None)
    world = dist.group.WORLD

    gen = torch.Generator().manual_seed(1234 + me)
    mk = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q_l, k_l, v_l, do_l = mk(s_local, b, h, d), mk(s_local, b, hk, d), mk(s_local, b, hk, d), mk(s_local, b, h, d)
    kernel = get_kernel(device, dtype)
    ideal_split = h % C == 0
    h_i, hk_i = (h // C, max(1, hk // C)) if ideal_split else (h, hk)
    if ideal_split and h_i % hk_i:
        hk_i = h_i
    q_i, k_i, v_i, do_i = mk(b, h_i, s, d), mk(b, hk_i, s, d), mk(b, hk_i, s, d), mk(b, h_i, s, d)

    # the paired runs (a variant with the option right after its run without): N equal documents over
    # the whole sample, sharded like q (ring layout over all C ranks); a window; a sink
    options = {}
    if args.documents:
        full_ids = (torch.arange(s) // (s // args.documents)).expand(b, s)
        positions = context_parallel_positions(s, ring_rank=me, ring_size=C, layout=args.layout)
        options["docs"] = {"document_ids": full_ids[:, positions].contiguous().to(device)}
    if args.window:
        options["window"] = {"window_size": (args.window, 0)}
    if args.sink:
        options["sink"] = {"softmax_offset": torch.randn(h, generator=gen).to(device=device, dtype=torch.float32)}
    paired_variants = [n for n in variants if n in ("ring", "all_gather")] if options else []

    def leaf(x):
        return x.detach().clone().requires_grad_()

    def run_ideal():
        out, lse = kernel.forward(q_i, k_i, v_i, causal=causal, scale=scale)
        kernel.backward(do_i, q_i, k_i, v_i, out, lse, causal=causal, scale=scale)

    def cp_call(name, option=None):
        return attention_call(name, causal=causal, scale=scale, group=world, layout=args.layout,
                              ulysses_group=ulysses_group, ring_group=ring_group, **options.get(option, {}))

    def run_cp(name, option=None):
        q, k, v = leaf(q_l), leaf(k_l), leaf(v_l)
        ctx = communication_removed() if name == "compute" else contextlib.nullcontext()
        with ctx:
            out = cp_call(name, option)(q, k, v)
            out.backward(do_l)

    runners = {}
    for n in variants:  # a variant's runs with each option right after its run without
        runners[n] = run_ideal if n == "ideal" else (lambda n=n: run_cp(n))
        if n in paired_variants:
            for option in options:
                runners[f"{n}+{option}"] = lambda n=n, o=option: run_cp(n, o)

    slowest = time_interleaved(runners, reps=args.reps, warmup=args.warmup, device=device)

    # bytes per collective, counted at the call sites, forward and backward separately
    all_counts, all_paired = count_variants(cp_call, variants, options, paired_variants, (q_l, k_l, v_l), do_l,
                                            shape=dict(b=b, h=h, hk=hk, s=s, d=d), cp=C, ulysses=u_h,
                                            dtype=args.dtype)

    if me == 0:
        res = report(args, C, u_h, variants, slowest, all_counts, device, ideal_split)
        for option in options:
            key = {"docs": "documents"}.get(option, option)
            res[key] = report_paired(args, option, paired_variants, slowest, [r[option] for r in all_paired])
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
