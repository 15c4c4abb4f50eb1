"""The pieces of ``tools/bench_linear_attention.py``: the gated delta rule under CP (Gated DeltaNet, fwd + bwd)
by each method against the same rank's work without the exchange, the bytes each sends (recorded from the
torch.distributed calls, `cp_ext.perf.sent_bytes`) beside `cp_ext.perf.comm`'s formulas, and how far each
method scales in CP at Qwen3-Next's 16 key heads.

Variants, timed interleaved per repetition (a barrier before each call, a repetition's time its slowest
rank's; CPU seconds per call summed over the ranks beside it, which a shared, oversubscribed box leaves
alone):

* ``state_passing``: `context_parallel_gated_delta` with the all-gather exchange (the default);
* ``ring``: the same with ``exchange="ring"`` (the state passed point to point along the sequence);
* ``compute``: the same rank's work without any exchange: its segments' summaries
  (`state_passing.local_summaries`), its own segments' maps folded locally (`fold_states`) and the outputs
  (`state_passing.apply_states`), forward and backward; state_passing / compute is the exchange's cost;
* ``all_to_all``: `head_parallel_gated_delta` (megatron-core's method), when the heads divide by C;
* ``ideal``: the plain rule on this rank's s/C tokens as one sequence (a device doing 1/C of the tokens
  with no summary): state_passing / ideal adds the summary pass's K extra value columns.

Worker: ``python -m cp_ext.bench.linear_attention --worker --out DIR ARGS`` on C ranks (`run`, through
`cp_ext.bench.workers.run_workers`); rank 0 writes every rank's numbers. `main` is the tool's command line.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_ext.bench.attention import time_interleaved
from cp_ext.bench.workers import WorkerError, run_workers
from cp_ext.linear_attention import (check_head_parallel, context_parallel_gated_delta, fold_states,
                                     gated_delta_rule, head_parallel_gated_delta, l2norm)
from cp_ext.linear_attention.segments import rank_segments
from cp_ext.linear_attention.state_passing import apply_states, local_summaries
from cp_ext.perf import comm
from cp_ext.perf.sent_bytes import record_sent_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
QWEN3_NEXT = dict(hk=16, h=32, k_dim=128, v_dim=128)  # Qwen3-Next-80B-A3B's linear attention, per layer


def worker_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--key-heads", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--head-dim", type=int, required=True)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    return p


def _inputs(b, s_local, hk, h, d, dtype, seed):
    """This rank's q, k (L2-normalized, as megatron feeds them), v, g = -softplus(.), beta in (0, 1), dout."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    x = dict(q=l2norm(randn(b, s_local, hk, d)), k=l2norm(randn(b, s_local, hk, d)), v=randn(b, s_local, h, d),
             g=-F.softplus(randn(b, s_local, h) - 1.0), beta=torch.sigmoid(randn(b, s_local, h)),
             dout=randn(b, s_local, h, d))
    return {n: t.to(dtype) for n, t in x.items()}


def compute_only(q, k, v, g, beta, *, segments, chunk_size):
    """State passing's work on this rank without its exchange: the summaries, the rank's own maps chained
    locally in place of the exchanged states, the outputs."""
    summaries = local_summaries(q, k, v, g, beta, segments=segments, previous=[None] * len(segments.ids),
                                chunk_size=chunk_size)
    states = fold_states(torch.stack([s.transition for s in summaries]),
                         torch.stack([s.contribution for s in summaries]))
    return apply_states(summaries, states).to(v.dtype)


def variants(args, group, size, rank):
    """{name: f(q, k, v, g, beta) -> o} of the variants this shape runs, and why all_to_all does not (or None)."""
    segments = rank_segments(args.seq_length // size, args.layout, rank, size)
    kw = dict(chunk_size=args.chunk_size)
    calls = {
        "state_passing": lambda *x: context_parallel_gated_delta(*x, group=group, layout=args.layout, **kw),
        "ring": lambda *x: context_parallel_gated_delta(*x, group=group, layout=args.layout, exchange="ring", **kw),
        "compute": lambda *x: compute_only(*x, segments=segments, **kw),
        "ideal": lambda *x: gated_delta_rule(*x, **kw)[0],
    }
    try:
        check_head_parallel(args.key_heads, args.heads, size)
        calls["all_to_all"] = lambda *x: head_parallel_gated_delta(*x, group=group, layout=args.layout, **kw)
        return calls, None
    except ValueError as e:
        return calls, str(e)


def _fwd_bwd(call, x, sink=None):
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    cpu = time.process_time()
    call(*leaves).backward(x["dout"])
    if sink is not None:
        sink.append(time.process_time() - cpu)


def worker(argv):
    """One rank: time the variants, record each one's bytes once, write the results (rank 0: everyone's)."""
    args = worker_parser().parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    size, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    x = _inputs(1, args.seq_length // size, args.key_heads, args.heads, args.head_dim, DTYPES[args.dtype], 1 + rank)
    calls, a2a_refused = variants(args, group, size, rank)
    cpu = {n: [] for n in calls}
    runners = {n: (lambda n=n: _fwd_bwd(calls[n], x, cpu[n])) for n in calls}
    times = time_interleaved(runners, reps=args.reps, warmup=args.warmup, device=torch.device("cpu"))
    sent = {}
    for n in ("state_passing", "ring", "all_to_all"):
        if n in calls:
            leaves = [x[k].detach().clone().requires_grad_() for k in ("q", "k", "v", "g", "beta")]
            with record_sent_bytes() as rec:
                out = calls[n](*leaves)
                fwd = rec.take()
                out.backward(x["dout"])
                sent[n] = {"fwd": fwd, "bwd": rec.take()}
    mine = {"cpu": {n: c[args.warmup:] for n, c in cpu.items()}, "sent": sent}
    every = [None] * size
    dist.all_gather_object(every, mine)
    if rank == 0:
        result = {"args": vars(args), "C": size, "times": times, "a2a_refused": a2a_refused,
                  "cpu": {n: [sum(r["cpu"][n][i] for r in every) for i in range(args.reps)] for n in calls},
                  "sent": [r["sent"] for r in every]}
        Path(args.out, "rank0.json").write_text(json.dumps(result))
    else:
        Path(args.out, f"rank{rank}.json").write_text("{}")
    dist.barrier()
    dist.destroy_process_group()


def run(*, cp, seq_length, key_heads, heads, head_dim, chunk_size=64, layout="zigzag", dtype="fp32", reps=3,
        warmup=1, timeout=3600):
    """The worker on ``cp`` ranks: rank 0's record."""
    args = ["--seq-length", seq_length, "--key-heads", key_heads, "--heads", heads, "--head-dim", head_dim,
            "--chunk-size", chunk_size, "--layout", layout, "--dtype", dtype, "--reps", reps, "--warmup", warmup]
    return run_workers("cp_ext.bench.linear_attention", cp, [str(a) for a in args], timeout=timeout)[0]


# ----------------------------------------------------------------------------- formulas and the report
def formula_bytes(name, *, C, s, hk, h, d, layout, dtype, rank=None):
    """cp_ext.perf.comm's bytes of variant ``name`` for one rank (the most any rank sends with rank None)."""
    if name == "all_to_all":
        return comm.linear_head_parallel_bytes(b=1, s=s, hk=hk, h=h, k_dim=d, v_dim=d, cp=C, dtype=dtype)
    exchange = "ring" if name == "ring" else "all_gather"
    return comm.linear_state_passing_bytes(b=1, h=h, k_dim=d, v_dim=d, cp=C, layout=layout, dtype=dtype,
                                           exchange=exchange, rank=rank)


def _total(by_collective):
    return sum(v["fwd"] + v["bwd"] for v in by_collective.values())


def _nonzero(by_collective, direction):
    return {c: v[direction] for c, v in by_collective.items() if v[direction]}


def cp_limits(*, s, key_heads=16, heads=32, tp=1, sizes=(2, 4, 8, 16, 32, 64, 128), d=128, layout="zigzag"):
    """For each CP size at ``key_heads`` / ``heads`` (per TP rank: / tp): whether the all-to-all takes it
    (`check_head_parallel`, the op's own check) and state passing (`rank_segments`, the op's own
    partition: every rank gets its segments), and the bytes per rank of each (bf16, one layer)."""
    rows = []
    hk, h = key_heads // tp, heads // tp
    for c in sizes:
        try:
            check_head_parallel(hk, h, c)
            a2a = None
        except ValueError as e:
            a2a = str(e)
        try:
            lengths = {rank_segments(s // c, layout, r, c).length for r in range(c)}
            passing = None
        except ValueError as e:
            lengths, passing = set(), str(e)
        shape = dict(b=1, s=s, hk=hk, h=h, k_dim=d, v_dim=d, cp=c, layout=layout, dtype="bf16")
        layer = lambda **kw: _total(comm.gated_delta_layer_bytes(**shape, **kw))  # noqa: E731
        rows.append({"C": c, "all_to_all_error": a2a, "state_passing_error": passing,
                     "segment_tokens": sorted(lengths), "all_to_all_layer_bytes": layer(method="all_to_all"),
                     "all_gather_layer_bytes": layer(method="state_passing"),
                     "ring_layer_bytes": layer(method="state_passing", exchange="ring")})
    return rows


def summarize(res):
    """Ratios, bytes against formulas and the CP table from rank 0's record; also printed."""
    a, C, t = res["args"], res["C"], res["times"]
    s, hk, h, d = a["seq_length"], a["key_heads"], a["heads"], a["head_dim"]
    shape = dict(C=C, s=s, hk=hk, h=h, d=d, layout=a["layout"], dtype=a["dtype"])
    med = statistics.median
    ratio = lambda x, y: med([p / q for p, q in zip(t[x], t[y])])  # noqa: E731  (median of per-rep ratios)
    out = {"ratios": {}, "bytes": {}, "match": True}
    print(f"bench_linear_attention: Gated DeltaNet's rule under CP{C} (gloo, CPU), s={s}, b=1, "
          f"{hk} key / {h} value heads of K = V = {d} (Qwen3-Next's per-head dims; its 16 key / 32 value heads scaled "
          f"down for a CPU), {a['dtype']}, {a['layout']}, chunk {a['chunk_size']}; fwd + bwd, {a['reps']} interleaved "
          f"reps (+{a['warmup']} warm-up), slowest rank per rep")
    print(f"{'variant':14s} {'median s':>9s} {'/ compute':>10s} {'/ ideal':>8s} {'CPU s / compute':>16s}")
    for n in t:
        out["ratios"][n] = {"median_s": med(t[n]), "vs_compute": ratio(n, "compute"), "vs_ideal": ratio(n, "ideal"),
                            "cpu_vs_compute": med(res["cpu"][n]) / med(res["cpu"]["compute"])}
        r = out["ratios"][n]
        print(f"{n:14s} {r['median_s']:9.2f} {r['vs_compute']:10.3f} {r['vs_ideal']:8.3f} {r['cpu_vs_compute']:16.3f}")
    print(f"state passing / compute-only (same rank's work, no exchange): "
          f"{out['ratios']['state_passing']['vs_compute']:.3f} all-gather, {out['ratios']['ring']['vs_compute']:.3f} "
          f"ring (aim <= 1.15)")
    if res["a2a_refused"]:
        print(f"all_to_all not run: {res['a2a_refused']}")
    print("bytes sent per rank (fwd + bwd), recorded from the torch.distributed calls vs cp_ext.perf.comm:")
    for n in ("state_passing", "ring", "all_to_all"):
        if n not in res["sent"][0]:
            formula = formula_bytes(n, **shape)
            out["bytes"][n] = {"formula": _total(formula), "measured": None}
            print(f"  {n:14s} formula {_total(formula):>12d}  (not run)")
            continue
        per_rank = []
        for rank, sent in enumerate(res["sent"]):
            formula = formula_bytes(n, **shape, rank=rank)
            ok = all(sent[n][dd] == _nonzero(formula, dd) for dd in ("fwd", "bwd"))
            per_rank.append({"measured": sum(sum(sent[n][dd].values()) for dd in ("fwd", "bwd")),
                             "formula": _total(formula), "match": ok})
        out["match"] &= all(r["match"] for r in per_rank)
        most = max(per_rank, key=lambda r: r["measured"])
        out["bytes"][n] = {"per_rank": per_rank, "measured": most["measured"], "formula": most["formula"]}
        print(f"  {n:14s} measured {most['measured']:>12d}  formula {most['formula']:>12d}  "
              f"{'match' if all(r['match'] for r in per_rank) else 'MISMATCH'} (busiest rank; every rank checked)")
    a2a = out["bytes"]["all_to_all"]["formula"]
    for n in ("state_passing", "ring"):
        print(f"  all_to_all / {n}: {a2a / out['bytes'][n]['formula']:.1f}x the bytes")
    out["cp_limits"] = cp_limits(s=s, layout=a["layout"])
    print(f"CP sizes at Qwen3-Next's 16 key / 32 value heads of 128 (TP1; all-to-all: heads divisible by C, so at "
          f"most 16/TP; state passing: any C whose segments get >= 1 token), by the ops' own checks; one layer's "
          f"bytes per rank (conv halo or gate included, bf16 activations) at s={s}:")
    print(f"{'C':>5s} {'all_to_all':>11s} {'a2a bytes':>12s} {'state passing':>14s} {'segment tokens':>15s} "
          f"{'all-gather bytes':>17s} {'ring bytes':>12s}")
    for row in out["cp_limits"]:
        verdict = lambda error: "runs" if error is None else "ValueError"  # noqa: E731
        print(f"{row['C']:5d} {verdict(row['all_to_all_error']):>11s} {row['all_to_all_layer_bytes']:12d} "
              f"{verdict(row['state_passing_error']):>14s} {','.join(map(str, row['segment_tokens'])):>15s} "
              f"{row['all_gather_layer_bytes']:17d} {row['ring_layer_bytes']:12d}")
    runs = [r["C"] for r in out["cp_limits"] if r["all_to_all_error"] is None]
    passing = [r["C"] for r in out["cp_limits"] if r["state_passing_error"] is None]
    out["largest_cp"] = {"all_to_all": max(runs), "state_passing": max(passing)}
    print(f"largest CP in the table: all_to_all {max(runs)}, state passing {max(passing)} (and beyond: "
          f"up to s/2 = {s // 2} ranks zigzag)")
    return out


# ----------------------------------------------------------------------------- the command line
def parse(argv=None, description=None):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=4, help="CP ranks (torchrun --nproc-per-node)")
    p.add_argument("--seq-length", type=int, default=32768, help="global sequence length s")
    p.add_argument("--heads", type=int, default=8, help="value heads (Qwen3-Next: 32)")
    p.add_argument("--key-heads", type=int, default=None, help="key heads (default: --heads / 2; Qwen3-Next: 16)")
    p.add_argument("--head-dim", type=int, default=128, help="K = V (Qwen3-Next: 128)")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    args.key_heads = args.key_heads or max(1, args.heads // 2)
    per = 2 * args.cp if args.layout == "zigzag" else args.cp
    if args.cp < 2 or args.seq_length % per:
        p.error(f"--cp must be >= 2 and --seq-length divisible by {per} ({args.layout} over {args.cp} ranks)")
    if args.heads % args.key_heads:
        p.error(f"--key-heads {args.key_heads} must divide --heads {args.heads}")
    return args


def main(argv=None, description=None):
    """``tools/bench_linear_attention.py``: run, print the summary, write --json; exit 1 on a failed run or on
    bytes that differ from the formulas."""
    args = parse(argv, description)
    try:
        res = run(cp=args.cp, seq_length=args.seq_length, key_heads=args.key_heads, heads=args.heads,
                  head_dim=args.head_dim, chunk_size=args.chunk_size, layout=args.layout, dtype=args.dtype,
                  reps=args.reps, warmup=args.warmup, timeout=int(os.environ.get("CP_EXT_BENCH_TIMEOUT", "3600")))
    except WorkerError as e:
        print(e, file=sys.stderr)
        return 1
    res["summary"] = summarize(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["summary"]["match"] else 1


if __name__ == "__main__":
    worker(sys.argv[1:])
