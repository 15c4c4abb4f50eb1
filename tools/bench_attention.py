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
* ``ring``: `cp_ext.attention.ring.ring_attention` on the s/C-token shard (``--layout``).
* ``compute``: the ring's own code (`ring_attn_forward` / `ring_attn_backward`, same step
  plan, same tiles, same merges and accumulators) with `RingComm` replaced by a no-op that
  hands back the local KV: the compute-only time of the same tiles. ring / compute is the
  overlap figure (1.0 = communication fully hidden).
* ``ulysses``: `cp_ext.attention.ulysses.ulysses_attention` over all C ranks (needs h % C == 0).
* ``hybrid``: `cp_ext.attention.dispatch.hybrid_attention` with ``--ulysses-size`` U and a ring
  of C/U (only when 1 < U < C).
* ``all_gather``: `cp_ext.attention.all_gather.all_gather_attention` over all C ranks (K/V
  all-gathered, dK/dV reduce-scattered); not in the default list, ask for it with --variants.

``--documents N``: every sample is N equal documents (ids made for the whole sequence and
sharded like the tokens, `cp_ext.data.sharding.context_parallel_positions`). The ring and
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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cp_ext.attention import ring as ring_mod  # noqa: E402
from cp_ext.attention import all_gather_attention  # noqa: E402
from cp_ext.attention.dispatch import hybrid_attention  # noqa: E402
from cp_ext.attention.kernels import get_kernel  # noqa: E402
from cp_ext.attention import ring_attention  # noqa: E402
from cp_ext.attention import ulysses_attention  # noqa: E402
from cp_ext.data.sharding import context_parallel_positions  # noqa: E402
from cp_ext.perf import comm as comm_formula  # noqa: E402
from cp_ext.perf.counter import count_comm, count_work  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


class _NoComm:
    """RingComm without communication: the "received" block is the one we hold (same shape)."""

    def __init__(self, group, shift=1):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def send_recv(self, to_send, recv_buf=None, *, send=True, recv=True):
        return (to_send if to_send is not None else recv_buf) if recv else None

    def wait(self):
        pass


@contextlib.contextmanager
def no_comm():
    saved = ring_mod.RingComm
    ring_mod.RingComm = _NoComm
    try:
        yield
    finally:
        ring_mod.RingComm = saved


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_groups(world, u):
    """Ulysses groups [i*U, (i+1)*U) and rings [j::U] over the world (every rank creates all)."""
    me = dist.get_rank()
    ug = rg = None
    for i in range(world // u):
        ranks = list(range(i * u, (i + 1) * u))
        g = dist.new_group(ranks)
        if me in ranks:
            ug = g
    for j in range(u):
        ranks = list(range(j, world, u))
        g = dist.new_group(ranks)
        if me in ranks:
            rg = g
    return ug, rg


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
        kw = options.get(option, {})
        if name == "ring" or name == "compute":
            return lambda q, k, v: ring_attention(q, k, v, causal=causal, softmax_scale=scale, group=world,
                                                  layout=args.layout, **kw)
        if name == "all_gather":
            return lambda q, k, v: all_gather_attention(q, k, v, causal=causal, softmax_scale=scale, group=world,
                                                        layout=args.layout, **kw)
        if name == "ulysses":
            return lambda q, k, v: ulysses_attention(q, k, v, causal=causal, softmax_scale=scale, group=world)
        return lambda q, k, v: hybrid_attention(q, k, v, causal=causal, softmax_scale=scale, ulysses_group=ulysses_group,
                                                ring_group=ring_group, layout=args.layout)

    def run_cp(name, option=None):
        q, k, v = leaf(q_l), leaf(k_l), leaf(v_l)
        ctx = no_comm() if name == "compute" else contextlib.nullcontext()
        with ctx:
            out = cp_call(name, option)(q, k, v)
            out.backward(do_l)

    runners = {}
    for n in variants:  # a variant's runs with each option right after its run without
        runners[n] = run_ideal if n == "ideal" else (lambda n=n: run_cp(n))
        if n in paired_variants:
            for option in options:
                runners[f"{n}+{option}"] = lambda n=n, o=option: run_cp(n, o)

    def timed(fn):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        for n in runners:
            timed(runners[n])
    times = {n: [] for n in runners}
    for _ in range(args.reps):
        for n in runners:
            times[n].append(timed(runners[n]))
    # a repetition takes as long as its slowest rank
    gathered = [None] * C
    dist.all_gather_object(gathered, times)
    slowest = {n: [max(g[n][i] for g in gathered) for i in range(args.reps)] for n in runners}

    def counted_call(name, option=None):
        """Bytes per collective (forward, backward) and the forward's work, counted at the call sites."""
        q, k, v = leaf(q_l), leaf(k_l), leaf(v_l)
        with count_comm() as c, count_work() as w:
            out = cp_call(name, option)(q, k, v)
        fwd, work = dict(c.bytes), {"tiles": w.calls["tiles"], "pairs": w.bytes["pairs"]}
        with count_comm() as c:
            out.backward(do_l)
        return fwd, dict(c.bytes), work

    # bytes per collective, counted at the call sites, forward and backward separately
    counted, paired_counts = {}, {option: {} for option in options}
    for n in variants:
        if n in ("ideal", "compute"):
            continue
        fwd, bwd, work = counted_call(n)
        u = {"ring": 1, "ulysses": C, "hybrid": u_h, "all_gather": 1}[n]
        formula = comm_formula.cp_attention_bytes(b=b, h=h, hk=hk, s=s, d=d, cp=C, ulysses=u, dtype=args.dtype,
                                                  comm_type="all_gather" if n == "all_gather" else None)
        used = [coll for coll in formula if any((*formula[coll].values(), fwd.get(coll), bwd.get(coll)))]
        counted[n] = {coll: {"fwd": fwd.get(coll, 0), "bwd": bwd.get(coll, 0),
                             "formula_fwd": formula[coll]["fwd"], "formula_bwd": formula[coll]["bwd"]} for coll in used}
        for option in options if n in paired_variants else ():
            dfwd, dbwd, dwork = counted_call(n, option)
            colls = sorted(set(fwd) | set(bwd) | set(dfwd) | set(dbwd))
            by_coll = lambda f, b_: {c: {"fwd": f.get(c, 0), "bwd": b_.get(c, 0)} for c in colls}  # noqa: E731
            paired_counts[option][n] = {"none": {"work": work, "bytes": by_coll(fwd, bwd)},
                                        option: {"work": dwork, "bytes": by_coll(dfwd, dbwd)}}
    all_counts = [None] * C
    dist.all_gather_object(all_counts, counted)
    all_paired = [None] * C
    dist.all_gather_object(all_paired, paired_counts)

    if me == 0:
        res = report(args, C, u_h, variants, slowest, all_counts, device, ideal_split)
        for option in options:
            key = {"docs": "documents"}.get(option, option)
            res[key] = report_paired(args, option, paired_variants, slowest, [r[option] for r in all_paired])
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


VARIANTS = ("ideal", "ring", "compute", "ulysses", "hybrid", "all_gather")


def _med(xs):
    return statistics.median(xs)


def report_paired(args, option, paired_variants, slowest, all_counts):
    """With the option (documents, a window, a sink) vs without, per variant: tiles and pairs per rank,
    time, bytes per rank."""
    s = args.seq_length
    if option == "docs":
        n_docs = args.documents
        print(f"documents: {n_docs} equal documents per sample ({s // n_docs} tokens each), ids sharded like the "
              f"tokens ({args.layout}); with document_ids / without, same run:")
        out = {"n": n_docs, "tokens_per_document": s // n_docs, "variants": {}}
    elif option == "window":
        print(f"window: window_size=({args.window}, 0) on s={s} ({args.window / s:.4f} of it); with / without, same run:")
        out = {"window": args.window, "variants": {}}
    else:
        print("sink: softmax_offset [h]; with / without, same run:")
        out = {"variants": {}}
    for n in paired_variants:
        per_rank = [r[n] for r in all_counts]
        keys = (option, "none")
        tiles = {k: [r[k]["work"]["tiles"] for r in per_rank] for k in keys}
        pairs = {k: [r[k]["work"]["pairs"] for r in per_rank] for k in keys}
        pair_ratio = sum(pairs[option]) / sum(pairs["none"]) if sum(pairs["none"]) else float("nan")
        per_rep = [a / b for a, b in zip(slowest[f"{n}+{option}"], slowest[n])]
        ms = {option: _med(slowest[f"{n}+{option}"]) * 1e3, "none": _med(slowest[n]) * 1e3}
        print(f"  {n:10s} tiles/rank (fwd) {tiles[option]} / {tiles['none']}; query-key pairs/rank {pairs[option]} / "
              f"{pairs['none']} = {pair_ratio:.4f}")
        print(f"  {'':10s} time {ms[option]:.1f} / {ms['none']:.1f} ms = {_med(per_rep):.3f} (median of {len(per_rep)} "
              f"paired reps; per rep: {' '.join(f'{x:.3f}' for x in per_rep)})")
        colls = per_rank[0]["none"]["bytes"]
        for coll in colls:
            d, w = per_rank[0][option]["bytes"][coll], per_rank[0]["none"]["bytes"][coll]
            same = all(r[k]["bytes"][coll] == per_rank[0][k]["bytes"][coll] for r in per_rank for k in keys)
            print(f"  {'':10s} {coll} bytes/rank fwd {d['fwd']} / {w['fwd']}, bwd {d['bwd']} / {w['bwd']}"
                  f"{'' if same else ' (rank 0; ranks differ)'}")
        out["variants"][n] = {"tiles": tiles, "pairs": pairs, "pair_ratio": pair_ratio, "median_ms": ms,
                              "time_ratio": _med(per_rep), "time_ratios": per_rep,
                              "bytes": {k: [r[k]["bytes"] for r in per_rank] for k in keys}}
    return out


def report(args, C, u_h, variants, slowest, all_counts, device, ideal_split):
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"] * 3
    hk = args.kv_heads or args.heads
    print(f"bench_attention: C={C} ranks on {device.type} ({'NCCL' if device.type == 'cuda' else 'gloo'}), "
          f"b={args.batch} s={args.seq_length} h={args.heads} h_kv={hk} d={args.head_dim} {args.dtype} "
          f"{'full' if args.full else 'causal'} layout={args.layout} hybrid U={u_h}; "
          f"{args.reps} interleaved reps (+{args.warmup} warmup), slowest rank per rep; load avg {' '.join(load)}")
    ideal = slowest.get("ideal")
    what = f"1 device, h/C = {args.heads // C} heads x full s" if ideal_split else "1 device, full attention / C"
    res = {"C": C, "load_avg": load, "variants": {}, "bytes": all_counts[0]}
    print(f"{'variant':10s} {'median ms':>10s} {'ideal ms':>10s} {'ratio':>7s}   (ideal = {what}, fwd+bwd)")
    for n in variants:
        ts = slowest[n]
        if n == "ideal":
            scale = 1.0 if ideal_split else 1.0 / C
            ts = [t * scale for t in ts]
            slowest[n] = ts
    ideal = slowest.get("ideal")
    for n in variants:
        med = _med(slowest[n]) * 1e3
        if ideal and n != "ideal":
            ratio = _med([a / b for a, b in zip(slowest[n], ideal)])
            print(f"{n:10s} {med:10.2f} {_med(ideal) * 1e3:10.2f} {ratio:7.3f}")
        else:
            ratio = None
            print(f"{n:10s} {med:10.2f} {'':>10s} {'':>7s}")
        res["variants"][n] = {"median_ms": med, "ratio_to_ideal": ratio, "ms": [t * 1e3 for t in slowest[n]]}
    if "ring" in variants and "compute" in variants:
        per_rep = [a / b for a, b in zip(slowest["ring"], slowest["compute"])]
        overlap = _med(per_rep)
        res["overlap"] = overlap
        print(f"overlap: ring fwd+bwd / compute-only same tiles = {overlap:.3f} (median of {len(per_rep)} paired reps; "
              f"ratio of medians {_med(slowest['ring']) / _med(slowest['compute']):.3f}; "
              f"per rep: {' '.join(f'{x:.2f}' for x in per_rep)})")
    print("bytes sent per rank, counted at the call sites vs formula (cp_ext.perf.comm):")
    ok = True
    for n, colls in all_counts[0].items():
        for coll, c in colls.items():
            same = all(rank_counts[n][coll] == c for rank_counts in all_counts)
            match = c["fwd"] == c["formula_fwd"] and c["bwd"] == c["formula_bwd"]
            ok &= match and same
            print(f"  {n:10s} {coll:18s} fwd {c['fwd']:>12d} (formula {c['formula_fwd']:>12d})  "
                  f"bwd {c['bwd']:>12d} (formula {c['formula_bwd']:>12d})  {'match' if match else 'MISMATCH'}"
                  f"{'' if same else ' (ranks differ)'}")
    res["bytes_match"] = ok
    print(f"load avg at end: {open('/proc/loadavg').read().split()[:3] if os.path.exists('/proc/loadavg') else '?'}")
    return res


if __name__ == "__main__":
    main()
