"""Dynamic CP against static CP on the same documents, in one run: counted per-rank attention work and
ring bytes (max/mean over the ranks), and the modelled step time at an H100's rate, for static CP, Megatron-LM's
dynamic-CP scheduler and cp_ext's.

    python3 tools/bench_dynamic_cp.py                       # 128 documents, 1K-128K, 16 ranks, static CP 8

The mix: lognormal lengths with Megatron's example's sigma (1.5; examples' --dynamic-cp mix, mean 1024, 128 to
8192 tokens) scaled 16x: median 16384, clipped to 1K-128K. The model: a Qwen3-30B-A3B-like MoE layer (hidden
2048, 32 heads of 128, 4 KV groups, 8 of 128 experts of 768, 48 layers). What each number means and the model
of a step: `cp_ext.bench.dynamic_cp`. These are counts and a model, not timings: on a 2-core machine the
ranks share cores, so wall time cannot show a rank's imbalance.

``--timed`` also times what a CPU can show, with no communication: every rank's attention forward of each
microbatch, one rank at a time on one thread (fused SDPA over exactly the causal pairs of its runs of queries,
4 heads of 64), summed as the lockstep step (each microbatch's slowest rank), beside the counted pairs of the
same plans; at lengths / ``--timed-scale`` (default 16), which a CPU computes in seconds.
"""

import argparse
import json

from cp_ext.bench.dynamic_cp import BenchModel, Hardware, compare, lognormal_lengths


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=128, help="documents in the global batch")
    p.add_argument("--median", type=float, default=16384)
    p.add_argument("--sigma", type=float, default=1.5)
    p.add_argument("--min-length", type=int, default=1024)
    p.add_argument("--max-length", type=int, default=131072)
    p.add_argument("--steps", type=int, default=4, help="global batches (seeds seed .. seed + steps - 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=16, help="DP x CP ranks")
    p.add_argument("--context-parallel-size", type=int, default=8, help="static CP's size")
    p.add_argument("--seq-length", type=int, default=131072, help="static CP's packed sequence length")
    p.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=16384)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=32)
    p.add_argument("--num-query-groups", type=int, default=4)
    p.add_argument("--kv-channels", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=48)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=768)
    p.add_argument("--moe-router-topk", type=int, default=8)
    p.add_argument("--tflops", type=float, default=400.0, help="effective dense bf16 rate per GPU")
    p.add_argument("--link-gbps", type=float, default=200.0, help="ring link, GB/s per direction")
    p.add_argument("--timed", action="store_true", help="also time each rank's attention on this CPU (scaled mix)")
    p.add_argument("--timed-scale", type=int, default=16, help="--timed: lengths, budgets and --seq-length over this")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    model = BenchModel(hidden=a.hidden_size, heads=a.num_attention_heads, kv_groups=a.num_query_groups,
                       head_dim=a.kv_channels, layers=a.num_layers, ffn=a.moe_ffn_hidden_size, topk=a.moe_router_topk)
    hw = Hardware(flops=a.tflops * 1e12, link_bytes_per_s=a.link_gbps * 1e9)
    steps = []
    for step in range(a.steps):
        lengths = lognormal_lengths(a.documents, a.median, a.sigma, a.min_length, a.max_length, a.seed + step)
        steps.append(compare(lengths, world=a.world, static_cp=a.context_parallel_size, seq_length=a.seq_length,
                             max_tokens_per_rank=a.max_seqlen_per_dp_cp_rank, model=model, hw=hw))
    print(f"{a.documents} documents per step, lognormal median {a.median:.0f} sigma {a.sigma} in "
          f"[{a.min_length}, {a.max_length}], {a.steps} steps; {a.world} ranks, static CP {a.context_parallel_size}, "
          f"--max-seqlen-per-dp-cp-rank {a.max_seqlen_per_dp_cp_rank}; {a.tflops:.0f} TFLOP/s, {a.link_gbps:.0f} GB/s")
    summary = {}
    for plan in steps[0]:
        rows = [s[plan] for s in steps]
        summary[plan] = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
        summary[plan]["modelled step (s)"] = sum(r["modelled step (s)"] for r in rows)
    static = summary["static"]["modelled step (s)"]
    print(f"{'plan':10s} {'microbatches':>12s} {'pairs max/mean':>15s} {'bytes max/mean':>15s} "
          f"{'ring GB/layer':>14s} {'step/balanced':>14s} {'modelled s':>11s} {'x static':>9s}")
    for plan, r in summary.items():
        r["speed-up over static"] = static / r["modelled step (s)"]
        print(f"{plan:10s} {r['microbatches']:12.1f} {r['pairs max/mean']:15.3f} {r['bytes max/mean']:15.3f} "
              f"{r['bytes sent (GB, all ranks, per layer)']:14.1f} {r['step / balanced']:14.3f} "
              f"{r['modelled step (s)']:11.1f} "
              f"{r['speed-up over static']:9.2f}")
    timed = _timed(a, model, hw) if a.timed else None
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "steps": steps, "timed": timed}, f, indent=1)


def _timed(a, model, hw):
    """The same plans at lengths / --timed-scale: counted pairs in lockstep against the timed attention step."""
    k = a.timed_scale
    lengths = lognormal_lengths(a.documents, a.median / k, a.sigma, a.min_length // k, a.max_length // k, a.seed)
    result = compare(lengths, world=a.world, static_cp=a.context_parallel_size, seq_length=a.seq_length // k,
                     max_tokens_per_rank=a.max_seqlen_per_dp_cp_rank // k, model=model, hw=hw, timed_heads=4)
    print(f"timed at lengths / {k} (one step, {a.documents} documents, median {a.median / k:.0f}), attention "
          f"forward only, each rank in turn on one thread, no communication:")
    print(f"{'plan':10s} {'pairs step (M)':>15s} {'x static':>9s} {'timed step (s)':>15s} {'x static':>9s}")
    for plan, r in result.items():
        print(f"{plan:10s} {r['pairs step'] / 1e6:15.1f} {result['static']['pairs step'] / r['pairs step']:9.2f} "
              f"{r['timed attention step (s)']:15.2f} "
              f"{result['static']['timed attention step (s)'] / r['timed attention step (s)']:9.2f}")
    return result


if __name__ == "__main__":
    main()
