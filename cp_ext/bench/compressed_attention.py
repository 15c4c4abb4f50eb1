"""The pieces of ``tools/bench_compressed_attention.py``: DeepSeek-V4's attention layers under CP (fwd + bwd) against
dense causal attention of the same dims on the same ranks, and the bytes each sends against a dense 512-wide K/V
exchange, in one run.

Per rank, V4's per-token dims (one K=V head of ``--head-dim`` 512, its last 64 channels rotated; ``--heads`` query
heads; CSA's indexer of ``--index-heads`` heads of 128 keeping ``--topk`` entries; a window of 128; blocks of 4 and
128), each variant timed interleaved (`cp_ext.bench.attention.time_interleaved`) and its bytes recorded from the
torch.distributed calls (`cp_ext.perf.sent_bytes`):

* ``sliding``, ``csa``, ``hca``: `cp_ext.attention.compressed.compressed_attention` on this rank's zigzag shard;
* ``dense``: cp_ext's ring attention (`ring_attention`), causal, the same query heads over the one
  K=V head (MQA), the K/V blocks travelling the ring: the attention a V4 layer replaces;
* the formula of a dense exchange of the 512-wide K=V head: every rank all-gathers the others' rows,
  (C - 1) x s/C x D values sent per rank, forward.

Worker: ``python -m cp_ext.bench.compressed_attention --worker --out DIR ARGS`` on C ranks (`run_workers`).
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cp_ext.attention.compressed import CompressedAttentionSpec, Compressor, Indexer, compressed_attention
from cp_ext.bench.attention import time_interleaved
from cp_ext.bench.workers import WorkerError, run_workers
from cp_ext.perf.compressed_layers import CompressedLayers, compressed_layer_bytes
from cp_ext.perf.sent_bytes import record_sent_bytes

KINDS = ("sliding", "csa", "hca")
RATES = {"csa": 4, "hca": 128}
WINDOW, INDEX_DIM = 128, 128


def _inputs(kind, s_local, a, gen):
    """This rank's tensors for one layer kind (leaves with grads where the loss reaches them)."""
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    d, h, hi, di = a.head_dim, a.heads, a.index_heads, INDEX_DIM
    inv = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    t = {"q": randn(s_local, 1, h, d), "kv": randn(s_local, 1, d), "sinks": randn(h)}
    comp = idx = None
    if kind != "sliding":
        width = 2 * d if kind == "csa" else d
        t.update(rows=randn(s_local, 1, 2 * width), bias=randn(RATES[kind], width) * 0.1, norm=torch.ones(d))
    for v in t.values():
        v.requires_grad_(True)
    if kind != "sliding":
        comp = Compressor(t["rows"], RATES[kind], d, kind == "csa", t["bias"], t["norm"], 1e-6, inv)
    if kind == "csa":
        idx = Indexer(randn(s_local, 1, hi, di), randn(s_local, 1, hi).abs() * (hi * di) ** -0.5,
                      Compressor(randn(s_local, 1, 4 * di), 4, di, True, torch.zeros(4, 2 * di), torch.ones(di), 1e-6,
                                 inv))
    return t, comp, idx, inv


def worker(argv):
    p = argparse.ArgumentParser()
    for flag in ("--out", "--seq-length", "--heads", "--head-dim", "--index-heads", "--topk", "--reps", "--warmup"):
        p.add_argument(flag, required=True, type=str if flag == "--out" else int)
    p.add_argument("--worker", action="store_true")
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    from cp_ext.attention.cp.context_parallel import ring_attention
    from cp_ext.token_partition import context_parallel_positions

    rank, size = dist.get_rank(), dist.get_world_size()
    positions = context_parallel_positions(a.seq_length, ring_rank=rank, ring_size=size)
    s_local, gen = positions.numel(), torch.Generator().manual_seed(rank)
    grad = torch.randn(s_local, 1, a.heads, a.head_dim, generator=gen)
    calls = {}
    for kind in KINDS:
        t, comp, idx, inv = _inputs(kind, s_local, a, gen)
        spec = CompressedAttentionSpec(kind, WINDOW, a.head_dim ** -0.5, index_topk=a.topk)
        calls[kind] = (lambda t=t, comp=comp, idx=idx, spec=spec, inv=inv: compressed_attention(
            t["q"], t["kv"], t["sinks"], spec, positions=positions, group=dist.group.WORLD, compressor=comp,
            indexer=idx, rope_inv_freq=inv))
    q = torch.randn(s_local, 1, a.heads, a.head_dim, generator=gen, requires_grad=True)
    kv = torch.randn(s_local, 1, 1, a.head_dim, generator=gen, requires_grad=True)
    calls["dense"] = lambda: ring_attention(q, kv, kv, causal=True, softmax_scale=a.head_dim ** -0.5,
                                            group=dist.group.WORLD)
    out = {"rank": rank, "bytes": {}}
    for name, call in calls.items():
        with record_sent_bytes() as sent:
            result = call()
            forward = sent.take()
            result.backward(grad)
            backward = sent.take()
        out["bytes"][name] = {"fwd": sum(forward.values()), "bwd": sum(backward.values())}
    runners = {name: (lambda call=call: call().backward(grad)) for name, call in calls.items()}
    out["seconds"] = time_interleaved(runners, reps=a.reps, warmup=a.warmup, device=torch.device("cpu"))
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def run(*, cp, seq_length, heads, head_dim, index_heads, topk, reps, warmup, timeout=3600):
    """Every rank's numbers, from one launch of ``cp`` workers."""
    args = ["--seq-length", seq_length, "--heads", heads, "--head-dim", head_dim, "--index-heads", index_heads,
            "--topk", topk, "--reps", reps, "--warmup", warmup]
    return run_workers("cp_ext.bench.compressed_attention", cp, args, timeout=timeout)


def modelled_bytes(cp, seq_length, head_dim, index_heads):
    """The planner's bytes per rank for each V4 kind at the benchmark's dims (`cp_ext.perf.compressed_layers`)."""
    layers = CompressedLayers(ratios=(0, RATES["csa"], RATES["hca"]), csa_ratio=RATES["csa"], hca_ratio=RATES["hca"],
                              window=WINDOW, index_heads=index_heads, index_head_dim=INDEX_DIM)
    return {kind: compressed_layer_bytes(layers, kind, s=seq_length, cp=cp, d=head_dim, dtype="fp32")
            for kind in KINDS}


def summarize(ranks, cp, seq_length, head_dim, index_heads=4):
    """The printed table: each variant's median time and its ratio to dense, the busiest rank's bytes (forward,
    backward; the planner's next to them) and their ratio to the dense 512-wide K/V all-gather's forward."""
    dense_exchange = (cp - 1) * (seq_length // cp) * head_dim * 4
    model = modelled_bytes(cp, seq_length, head_dim, index_heads)
    rows = {}
    print(f"DeepSeek-V4 attention at CP{cp}, s = {seq_length}, fp32, fwd + bwd (median of the slowest rank's time):")
    print(f"{'variant':10s} {'seconds':>9s} {'/ dense':>8s} {'fwd bytes':>12s} {'bwd bytes':>12s} "
          f"{'fwd / K/V all-gather':>21s} {'planner fwd + bwd':>18s}")
    dense_time = statistics.median(ranks[0]["seconds"]["dense"])
    for name in (*KINDS, "dense"):
        seconds = statistics.median(ranks[0]["seconds"][name])
        fwd = max(r["bytes"][name]["fwd"] for r in ranks)
        bwd = max(r["bytes"][name]["bwd"] for r in ranks)
        planned = max(x["fwd"] + x["bwd"] for x in model[name]) if name in model else None
        rows[name] = dict(seconds=seconds, ratio=seconds / dense_time, fwd=fwd, bwd=bwd,
                          vs_exchange=fwd / dense_exchange, modelled=None if name not in model else model[name])
        print(f"{name:10s} {seconds:9.3f} {seconds / dense_time:8.3f} {fwd:12d} {bwd:12d} {fwd / dense_exchange:21.4f} "
              f"{'' if planned is None else planned:>18}")
    print(f"a dense all-gather of the {head_dim}-wide K/V head sends {dense_exchange} bytes per rank forward "
          f"((C - 1) x s/C x {head_dim} x 4)")
    return rows


def main(argv=None, description=None):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=16384)
    p.add_argument("--heads", type=int, default=4, help="query heads (DeepSeek-V4-Flash: 64)")
    p.add_argument("--head-dim", type=int, default=512, help="the K=V head (V4: 512)")
    p.add_argument("--index-heads", type=int, default=4, help="CSA indexer heads of 128 (V4: 64)")
    p.add_argument("--topk", type=int, default=512, help="entries CSA keeps per query (V4: 512)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.cp < 2 or a.seq_length % (2 * a.cp) or a.head_dim <= 64:
        p.error(f"--cp >= 2, --seq-length a multiple of {2 * a.cp} and --head-dim > 64 (its last 64 rotate)")
    try:
        ranks = run(cp=a.cp, seq_length=a.seq_length, heads=a.heads, head_dim=a.head_dim, index_heads=a.index_heads,
                    topk=a.topk, reps=a.reps, warmup=a.warmup,
                    timeout=int(os.environ.get("CP_EXT_BENCH_TIMEOUT", "3600")))
    except WorkerError as e:
        print(e, file=sys.stderr)
        return 1
    rows = summarize(ranks, a.cp, a.seq_length, a.head_dim, a.index_heads)
    if a.json:
        Path(a.json).write_text(json.dumps({"ranks": ranks, "summary": rows}, indent=1))
    return 0


if __name__ == "__main__":
    worker(sys.argv[1:])
