"""DeepSeek-V3.2's sparse attention (DSA) on the CP ring against dense MLA causal ring attention, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 tools/bench_dsa.py \
        --seq-length 32768 --topk 2048 --heads 4 --reps 1 --warmup 0

V3.2's per-head dims by default (qk_head_dim 128 + qk_pos_emb_head_dim 64, v_head_dim 128, kv_lora_rank 512,
indexer head dim 128), fewer heads (attention and indexer: 4), fp32. Fwd + bwd of each, from the same q,
latent and ``linear_kv_up_proj`` weight, interleaved per repetition after a barrier each, a repetition's time
being the slowest rank's; the ratio is the median of the per-repetition DSA / dense ratios, printed beside
the ratio of CPU seconds (every rank's, summed: what a shared box's other load does not change)
(`cp_ext.bench.dsa`: what each side runs). ``--dense latent,kv`` picks the dense baselines (the
latent ring, ``--cp-mla-exchange latent``, and megatron's per-head K/V); the ratio is printed against each.

Also reported: the ring bytes per rank, counted at the call sites in every timed call (each must equal
the formula) and the query-key pairs each computes; each rank's peak resident memory through the timed runs;
from one more (untimed) indexer top-k, its allocation peak and resident high-water mark (the largest rank's)
against the fp32 ``[s, b, H, s]`` scores megatron-core 0.16.1 builds.
Each op against its counted floor, at several s/k, at CP = 1 and on the ring: tools/bench_dsa_floor.py.
``--dense none`` runs DSA alone (long sequences: ``--seq-length 65536`` on 4 ranks). ``--check`` (short
sequences) also runs DSA with every causal key selected (top-k = s), which must give dense's gradients.
"""

import argparse
import json
import os
import resource
from pathlib import Path

import torch
import torch.distributed as dist

from cp_ext.bench import dsa as B
from cp_ext.bench.attention import time_interleaved
from cp_ext.attention.dsa.indexer import DEFAULT_KEY_TILE, DEFAULT_QUERY_TILE


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=32768, help="global sequence length s")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--index-heads", type=int, default=4)
    p.add_argument("--index-head-dim", type=int, default=128)
    p.add_argument("--index-query-tile", type=int, default=DEFAULT_QUERY_TILE, help="the indexer's score tile")
    p.add_argument("--index-key-tile", type=int, default=DEFAULT_KEY_TILE)
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag")
    p.add_argument("--dtype", choices=sorted(B.DTYPES), default="fp32")
    p.add_argument("--dense", default="latent", help="comma list of latent,kv, or none")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--check", action="store_true", help="DSA at top-k = s equals dense (short sequences)")
    p.add_argument("--json", default=None, help="rank 0 writes the results here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    C, me, world = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    dense = [] if args.dense == "none" else [n for n in args.dense.split(",") if n]
    if set(dense) - set(B.DENSE) or args.seq_length % (2 * C):
        raise SystemExit(f"--dense: a comma list of {','.join(B.DENSE)} or none; --seq-length divisible by {2 * C}")
    s, s_local, dtype = args.seq_length, args.seq_length // C, B.DTYPES[args.dtype]
    shape = dict(b=args.batch, s_local=s_local, h=args.heads, dn=args.qk_head_dim, p=args.qk_pos_emb_head_dim,
                 dv=args.v_head_dim, r=args.kv_lora_rank, index_heads=args.index_heads, index_dim=args.index_head_dim,
                 index_query_tile=args.index_query_tile, index_key_tile=args.index_key_tile,
                 scale=(args.qk_head_dim + args.qk_pos_emb_head_dim) ** -0.5)
    x = B.make_inputs(shape, dtype, me)
    walk = dict(group=world, layout=args.layout)
    indexer_s, counts = [], {}
    runners = {"dsa": lambda mark: B.run_dsa(x, shape, topk=args.topk, timings=indexer_s, mark=mark, **walk)}
    for n in dense:
        runners[f"dense_{n}"] = lambda mark, n=n: B.run_dense(x, shape, exchange=n, mark=mark, **walk)
    runners = {name: B.counting(fn, counts.setdefault(name, [])) for name, fn in runners.items()}
    times = time_interleaved(runners, reps=args.reps, warmup=args.warmup, device=torch.device("cpu"))
    indexer_s = indexer_s[args.warmup:]
    gathered = [None] * C
    dist.all_gather_object(gathered, indexer_s)
    indexer_s = [max(g[i] for g in gathered) for i in range(len(indexer_s))]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB; the timed runs' peak
    # one more indexer top-k, untimed: its allocations
    memory = B.indexer_memory(x, shape, topk=args.topk, **walk)
    check_diff = None
    if args.check:
        check_diff = B.max_grad_diff(B.run_dsa(x, shape, topk=s, **walk),
                                     B.run_dense(x, shape, exchange=(dense or ["latent"])[0], **walk), world)
    per_rank = [None] * C
    dist.all_gather_object(per_rank, {"counts": counts, "memory": memory, "peak_rss": peak_rss})

    if me == 0:
        formula = {"dsa": B.dsa_ring_bytes(b=args.batch, s_local=s_local, cp=C, kv_lora_rank=args.kv_lora_rank,
                                           qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
                                           index_head_dim=args.index_head_dim, dtype=args.dtype)["ring_p2p"]}
        per_token = {"dsa": args.kv_lora_rank + args.qk_pos_emb_head_dim + args.index_head_dim}
        for n in dense:
            formula[f"dense_{n}"] = B.dense_ring_bytes(shape, C, args.dtype, n)["ring_p2p"]
            per_token[f"dense_{n}"] = (args.kv_lora_rank + args.qk_pos_emb_head_dim if n == "latent" else
                                       args.heads * (args.qk_head_dim + args.qk_pos_emb_head_dim + args.v_head_dim))
        bytes_ = {}
        for name, f in formula.items():
            counted = [c["bytes"] for r in per_rank for c in r["counts"][name]]  # every rank, every call
            want = f["fwd"] + f["bwd"]
            bytes_[name] = {"counted": counted[0], "calls": len(counted), "formula": want, "formula_fwd": f["fwd"],
                            "formula_bwd": f["bwd"], "match": all(c == want for c in counted),
                            "per_token_fwd": per_token[name]}
        pairs = {name: sum(r["counts"][name][-1]["pairs"] for r in per_rank) // C for name in counts}
        macs = B.macs_per_pair(shape)
        causal = s * (s + 1) // 2 * args.batch // C  # the indexer scores every causal pair (per rank, on average)
        dense_pairs = pairs.get(f"dense_{dense[0]}", causal) if dense else causal
        dsa_macs = pairs["dsa"] * macs["sparse"] + causal * macs["indexer"]
        work = {"dense_pairs": dense_pairs, "sparse_pairs": pairs["dsa"], "indexer_pairs": causal,
                "macs_per_pair": macs, "fwd_macs_ratio": dsa_macs / (dense_pairs * macs["dense"]),
                "indexer_share": causal * macs["indexer"] / dsa_macs}
        mega = B.megatron_index_scores_bytes(s=s, b=args.batch, index_heads=args.index_heads)
        mem = {"tensors": max(r["memory"]["tensors"] for r in per_rank),
               "rss": None if any(r["memory"]["rss"] is None for r in per_rank) else
               max(r["memory"]["rss"] for r in per_rank),
               "per_rank": [r["memory"] for r in per_rank], "megatron_tensor": mega["tensor"],
               "megatron_peak": mega["peak"]}
        cpu = {name: [sum(r["counts"][name][i]["cpu_s"] for r in per_rank) for i in range(args.warmup, len(c))]
               for name, c in counts.items()}  # per timed call, summed over the ranks
        ratios = {}
        for n in dense:
            per_rep = [a / b for a, b in zip(times["dsa"], times[f"dense_{n}"])]
            ratios[f"dense_{n}"] = {"median": B.median(per_rep), "per_rep": per_rep,
                                    "cpu": B.median(cpu["dsa"]) / B.median(cpu[f"dense_{n}"])}
        load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"] * 3
        res = {"C": C, "s": s, "topk": args.topk, "layout": args.layout, "dtype": args.dtype, "reps": args.reps,
               "warmup": args.warmup, "shape": shape, "load_avg": load, "times": times, "indexer_s": indexer_s,
               "ratios": ratios, "bytes": bytes_, "peak_rss": [r["peak_rss"] for r in per_rank], "work": work,
               "cpu_s": cpu,
               "memory": mem, "check_diff": check_diff,
               "check_against": f"dense_{(dense or ['latent'])[0]}"}
        B.report(res)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
