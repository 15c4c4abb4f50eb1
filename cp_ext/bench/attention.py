"""The pieces of ``tools/bench_attention.py``: each CP attention variant as one call, the ring with its
communication removed (the compute-only time of the same tiles), interleaved timing over the slowest rank,
the bytes and work counted at the call sites next to `cp_ext.perf.comm`'s formulas, and the report.
"""

import os
import statistics
import time

import torch
import torch.distributed as dist

from cp_ext.attention.cp.context_parallel import all_gather_attention, hybrid_attention, ring_attention, ulysses_attention
from cp_ext.perf import comm as comm_formula
from cp_ext.perf.counter import count_comm, count_work

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
VARIANTS = ("ideal", "ring", "compute", "ulysses", "hybrid", "all_gather")


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


def attention_call(name, *, causal, scale, group, layout, ulysses_group=None, ring_group=None, **options):
    """Variant ``name`` (of `VARIANTS`, not ``ideal``) as ``f(q, k, v) -> out``; ``compute`` is the ring's
    call (run it inside `cp_ext.attention.cp.primitives.communication_removed`). ``options``: document_ids, window_size, softmax_offset (ring, all_gather)."""
    if name in ("ring", "compute"):
        return lambda q, k, v: ring_attention(q, k, v, causal=causal, softmax_scale=scale, group=group,
                                              layout=layout, **options)
    if name == "all_gather":
        return lambda q, k, v: all_gather_attention(q, k, v, causal=causal, softmax_scale=scale, group=group,
                                                    layout=layout, **options)
    if name == "ulysses":
        return lambda q, k, v: ulysses_attention(q, k, v, causal=causal, softmax_scale=scale, group=group)
    return lambda q, k, v: hybrid_attention(q, k, v, causal=causal, softmax_scale=scale, ulysses_group=ulysses_group,
                                            ring_group=ring_group, layout=layout)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(runners, *, reps, warmup, device):
    """Every runner once per repetition, in turn, so a noisy machine hits them alike; each call starts
    after a barrier. Returns {name: [seconds per repetition]}, a repetition taking its slowest rank's time."""

    def timed(fn):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        for n in runners:
            timed(runners[n])
    times = {n: [] for n in runners}
    for _ in range(reps):
        for n in runners:
            times[n].append(timed(runners[n]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return {n: [max(g[n][i] for g in gathered) for i in range(reps)] for n in runners}


def counted_call(call, inputs, grad_out):
    """Bytes per collective (forward, backward) and the forward's work, counted at the call sites."""
    q, k, v = (x.detach().clone().requires_grad_() for x in inputs)
    with count_comm() as c, count_work() as w:
        out = call(q, k, v)
    fwd, work = dict(c.bytes), {"tiles": w.calls["tiles"], "pairs": w.bytes["pairs"]}
    with count_comm() as c:
        out.backward(grad_out)
    return fwd, dict(c.bytes), work


def count_variants(calls, variants, options, paired_variants, inputs, grad_out, *, shape, cp, ulysses, dtype):
    """Every rank's counted bytes per variant next to the formula's, and the paired runs' (with each option
    and without): (all_counts, all_paired), one entry per rank. ``calls(name, option)`` is the variant's call;
    ``shape``: b, h, hk, s, d."""
    counted, paired_counts = {}, {option: {} for option in options}
    for n in variants:
        if n in ("ideal", "compute"):
            continue
        fwd, bwd, work = counted_call(calls(n, None), inputs, grad_out)
        u = {"ring": 1, "ulysses": cp, "hybrid": ulysses, "all_gather": 1}[n]
        formula = comm_formula.cp_attention_bytes(**shape, cp=cp, ulysses=u, dtype=dtype,
                                                  comm_type="all_gather" if n == "all_gather" else None)
        used = [coll for coll in formula if any((*formula[coll].values(), fwd.get(coll), bwd.get(coll)))]
        counted[n] = {coll: {"fwd": fwd.get(coll, 0), "bwd": bwd.get(coll, 0),
                             "formula_fwd": formula[coll]["fwd"], "formula_bwd": formula[coll]["bwd"]} for coll in used}
        for option in options if n in paired_variants else ():
            dfwd, dbwd, dwork = counted_call(calls(n, option), inputs, grad_out)
            colls = sorted(set(fwd) | set(bwd) | set(dfwd) | set(dbwd))
            by_coll = lambda f, b_: {c: {"fwd": f.get(c, 0), "bwd": b_.get(c, 0)} for c in colls}  # noqa: E731
            paired_counts[option][n] = {"none": {"work": work, "bytes": by_coll(fwd, bwd)},
                                        option: {"work": dwork, "bytes": by_coll(dfwd, dbwd)}}
    all_counts = [None] * dist.get_world_size()
    dist.all_gather_object(all_counts, counted)
    all_paired = [None] * dist.get_world_size()
    dist.all_gather_object(all_paired, paired_counts)
    return all_counts, all_paired


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
    """Each variant's median time and its ratio to the ideal's, the ring's overlap, and the counted bytes
    against the formula's; returns the same as a dict (``--json``)."""
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
