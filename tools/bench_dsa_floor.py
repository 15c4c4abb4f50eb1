"""DSA's indexer and sparse attention against their counted floors, beside dense causal MLA, in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/bench_dsa_floor.py \
        --topk 512 --s-over-k 4,8,16 --heads 128 --index-heads 64 --reps 2

At DeepSeek-V3.2's sizes by default (128 heads of d_qk 128 + 64, d_v 128, kv_lora_rank 512; the indexer's 64
heads of 128), fp32, forward + backward, for each s = k x (s/k): at CP = 1 (every rank alone, at once, so
the machine is loaded as under the ring) and on a ring of all the ranks (zigzag). Printed per point:

- this machine's GEMM rate on each op's shapes (one thread per rank; the best of the repetitions);
- the indexer's top-k and the sparse attention (given the selection), each as time, counted
  multiply-adds, their floor (counted / rate) and time over floor;
- DSA as a layer core (indexer, absorbed query, sparse attention, up-projection, backward) and dense
  causal MLA (``latent``: the latent ring, ``--cp-mla-exchange latent``; ``kv``: per-head K/V), and
  DSA / dense beside the counted work's ratio.

A repetition's time is its slowest rank's; each figure is the best repetition (`cp_ext.bench.dsa_floor`:
what is counted and how the selections are drawn). ``--path gather|union`` forces one sparse path.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from cp_ext.attention.dsa.indexer import DEFAULT_KEY_TILE, DEFAULT_QUERY_TILE
from cp_ext.attention.dsa.sparse_tiles import PATHS
from cp_ext.bench import dsa_floor as F

OPS = ("indexer", "sparse", "dsa", "dense_latent", "dense_kv")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--s-over-k", default="4,8,16", help="comma list: s = topk x each")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--index-heads", type=int, default=64)
    p.add_argument("--index-head-dim", type=int, default=128)
    p.add_argument("--index-key-tile", type=int, default=DEFAULT_KEY_TILE)
    p.add_argument("--index-query-tile", type=int, default=DEFAULT_QUERY_TILE)
    p.add_argument("--selection", choices=["overlapping", "independent"], default="overlapping")
    p.add_argument("--index-query-noise", type=float, default=0.2,
                   help="overlapping: each token's own share of its indexer query")
    p.add_argument("--cp", default="1,world", help="comma list of 1 and/or world")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--path", choices=PATHS, default="auto")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _fmt(x):
    return f"{x / 1e9:.1f}G" if x >= 1e8 else f"{x / 1e6:.2f}M"


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, me = dist.get_world_size(), dist.get_rank()
    ops = [o for o in args.ops.split(",") if o]
    ratios = [int(r) for r in args.s_over_k.split(",") if r]
    sizes = [world if c == "world" else int(c) for c in args.cp.split(",") if c]
    if set(ops) - set(OPS) or set(sizes) - {1, world} or any(args.topk * r % (2 * world) for r in ratios):
        raise SystemExit(f"--ops: a comma list of {','.join(OPS)}; --cp: 1 and/or world; topk x s/k divisible "
                         f"by {2 * world}")
    alone = [dist.new_group([r]) for r in range(world)][me]  # CP = 1: every rank on its own
    shape = dict(b=1, h=args.heads, dn=args.qk_head_dim, p=args.qk_pos_emb_head_dim, dv=args.v_head_dim,
                 r=args.kv_lora_rank, index_heads=args.index_heads, index_dim=args.index_head_dim,
                 scale=(args.qk_head_dim + args.qk_pos_emb_head_dim) ** -0.5)
    rows = []
    for ratio in ratios:
        s = args.topk * ratio
        for size in sizes:
            case = F.Case(shape, s=s, topk=args.topk, group=alone if size == 1 else dist.group.WORLD,
                          layout="zigzag", selection=args.selection, noise=args.index_query_noise,
                          key_tile=args.index_key_tile, query_tile=args.index_query_tile, path=args.path)
            counts = case.counts()
            macs = F.counted_macs(shape, selected_pairs=counts["selected"], causal_pairs=counts["causal"])
            shapes = F.gemm_shapes(shape, args.topk, args.index_key_tile)
            best, rates, per_rep = F.time_case(case, ops, args.reps, shapes)
            every = [None] * world
            dist.all_gather_object(every, {"counts": counts, "macs": macs})
            floor_op = {"indexer": "indexer", "sparse": "sparse", "dense_latent": "dense", "dense_kv": "dense"}
            floors = {n: max(e["macs"][floor_op[n]] for e in every) / rates[floor_op[n]] for n in ops if n in floor_op}
            if "dsa" in ops:
                floors["dsa"] = max(e["macs"]["indexer"] / rates["indexer"] + e["macs"]["sparse"] / rates["sparse"]
                                    for e in every)
            selected = max(sum(e["counts"]["selected"] for e in every), 1)
            computed = sum(e["counts"]["computed"] for e in every) / selected
            union = sum(e["counts"]["union"] for e in every) / max(sum(e["counts"]["computed"] for e in every), 1)
            rows.append(dict(s=s, topk=args.topk, s_over_k=ratio, cp=size, times=best, per_rep=per_rep, rates=rates,
                             floors=floors, macs=[e["macs"] for e in every], counts=[e["counts"] for e in every],
                             computed_over_selected=computed, union_share=union))
            if me == 0:
                report(rows[-1], shape, args)
            del case
    if me == 0 and args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), shape=shape, rows=rows), indent=1))
    dist.barrier()
    dist.destroy_process_group()


def report(row, shape, args):
    t, f, r = row["times"], row["floors"], row["rates"]
    m = row["macs"][0]
    print(f"s={row['s']} k={row['topk']} (s/k {row['s_over_k']}) CP{row['cp']}, {shape['h']} heads, indexer "
          f"{shape['index_heads']}x{shape['index_dim']}, {args.selection} selections (--path {args.path} computes "
          f"{row['computed_over_selected']:.2f}x the selected pairs, {row['union_share']:.0%} of them in union tiles); "
          f"GEMM rate per rank: "
          + ", ".join(f"{op} {v / 1e9:.1f} GMAC/s" for op, v in r.items()), flush=True)
    counted = {"indexer": m["indexer"], "sparse": m["sparse"], "dsa": m["indexer"] + m["sparse"],
               "dense_latent": m["dense"], "dense_kv": m["dense"]}
    for n, sec in t.items():
        print(f"  {n:13s} {sec:9.3f} s   floor {f[n]:8.3f} s   x{sec / f[n]:5.2f}   counted {_fmt(counted[n])} "
              f"MACs (rank 0)", flush=True)
    for dense in ("dense_latent", "dense_kv"):
        if "dsa" in t and dense in t:
            print(f"  dsa / {dense}: {t['dsa'] / t[dense]:.3f} (counted: {counted['dsa'] / counted[dense]:.3f})",
                  flush=True)


if __name__ == "__main__":
    main()
