"""Plan TP x PP x CP x DP (EP folded) for a model, a sequence length and a cluster.

Pure arithmetic (no torch): the formulas are in `cp_ext.perf.memory` (per-rank memory) and
`cp_ext.perf.comm` (bytes per collective), shared with tools/bench_attention.py and checked
against tools/measure_memory.py.

    python tools/plan_parallelism.py --model llama2-7b --seq-length 131072 --global-batch 64 \
        --gpu-memory-gib 80 --gpus-per-node 8 --nodes 4
    python tools/plan_parallelism.py --layers 32 --hidden 4096 --heads 32 --kv-heads 8 \
        --ffn 14336 --experts 8 --topk 2 --vocab 32000 --seq-length 32768 ...
    python tools/plan_parallelism.py --model llama2-7b --kv-arithmetic    # the textbook KV numbers
    python tools/plan_parallelism.py --nodes 8 -- --config configs/qwen3_30b_a3b_128k_8x8gpu.yaml
        # the model as pretrain_moe.py builds it from its flags (`ModelShape.from_args`); the
        # sequence length, batch sizes and precision default to the flags' too

For every TP (within a node, dividing the heads), PP (dividing the layers), CP (seq divisible
by 2 CP) with DP = GPUs / (TP PP CP) dividing the global batch, it folds EP (the largest
EP dividing both the experts and DP x CP, as megatron-core does) and picks the Ulysses size U
(U | CP, U | heads/TP, TP x U within a node), estimates per-rank memory with the distributed
optimizer, without and then with full recompute (cp_ext's CP-aware full recompute, which
keeps each layer's attention output and LSE: `--recompute-granularity full --recompute-method
uniform --recompute-num-layers 1`), and the communication per layer. Layouts
that fit are ranked: no recompute first, then the least estimated communication time
(per-layer bytes over NVLink or the inter-node network, x layers per stage x microbatches),
then the smallest pipeline bubble. Layouts that do not fit or are invalid are listed with
their reason (``--show-invalid``).

DeepSeek-V4 (``--model deepseek-v4-flash``, or its flags after ``--``): the ring column holds its layers' own
exchange (the window's halo, the straddling blocks' rows, the compressed entries), no Ulysses, and a table gives each
layer kind's parameters, activations and bytes on the first layout listed (`cp_ext.perf.compressed_layers`).

``--cp-comm-types a2a+p2p all_gather`` also plans every CP > 1 layout with all-gather
attention (``--cp-comm-type all_gather``: K/V all-gathered over the CP group, dK/dV
reduce-scattered; no Ulysses), ranked with the others: its transient full-sequence K/V (and
fp32 dK/dV) is in the activations (`cp_ext.perf.memory.all_gather_transient_bytes`) and its
bytes in the communication (`cp_ext.perf.comm.all_gather_bytes`). The default plans only
``a2a+p2p``: the Ulysses x ring layouts above (U = 1 is the ring).

``--document-lengths MEDIAN,SIGMA,MIN,MAX`` (a lognormal mix of document lengths) adds dynamic CP's budget
for the best layout it runs (not PP with TP): the ``--max-seqlen-per-dp-cp-rank`` whose cp_ext schedule has the
least modelled step over its DP x CP ranks, up to the tokens per rank the layout was sized for
(`cp_ext.bench.dynamic_cp.suggest_max_seqlen_per_rank`), beside static CP's modelled step on the same documents.
"""

import argparse

from cp_ext.perf.memory import GiB, PRESETS, ModelShape, total_params
from cp_ext.perf.model_shape import active_params, describe
from cp_ext.perf.parallelism_planner import (COMM_TYPES, SHAPE_FIELDS, compressed_kinds, format_grid, kv_arithmetic,
                                             linear_arithmetic, plan, shape_from_fields)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default=None, help="a preset; explicit flags override it")
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "experts", "topk", "moe-ffn"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None, help="default: the trainer flags', else 131072")
    p.add_argument("--global-batch", type=int, default=None, help="default: the trainer flags', else 64")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the trainer flags', else 1")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: the trainer flags', else bf16")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--intra-node-gbps", type=float, default=300.0, help="GB/s per GPU inside a node (NVLink)")
    p.add_argument("--inter-node-gbps", type=float, default=25.0, help="GB/s per GPU between nodes (IB)")
    p.add_argument("--cp-comm-types", nargs="+", choices=list(COMM_TYPES), default=["a2a+p2p"],
                   help="CP attention(s) to plan CP > 1 layouts with: a2a+p2p (Ulysses x ring, U picked per layout; "
                        "the default) and/or all_gather (K/V all-gathered: transient full-sequence K/V per rank)")
    p.add_argument("--top", type=int, default=10, help="valid layouts to print")
    p.add_argument("--show-invalid", action="store_true", help="also list the excluded layouts and why")
    p.add_argument("--kv-arithmetic", action="store_true", help="print the textbook KV-cache arithmetic and exit")
    p.add_argument("--document-lengths", default=None, metavar="MEDIAN,SIGMA,MIN,MAX",
                   help="a lognormal mix of document lengths: suggest dynamic CP's --max-seqlen-per-dp-cp-rank")
    p.add_argument("trainer_flags", nargs=argparse.REMAINDER,
                   help="after --: pretrain_moe.py flags (or --config YAML) describing the model instead of --model")
    args = p.parse_args(argv)
    flags = [f for f in args.trainer_flags if f != "--"]
    m = _shape_from_trainer_flags(p, args, flags) if flags else _shape_from_planner_flags(p, args)
    for key, default in (("seq_length", 131072), ("global_batch", 64), ("micro_batch", 1), ("dtype", "bf16")):
        if getattr(args, key) is None:
            setattr(args, key, default)

    if args.kv_arithmetic:
        print(f"MHA:  {kv_arithmetic(m, args.seq_length, mha=True)}")
        print(f"GQA:  {kv_arithmetic(m, args.seq_length, mha=False)}")
        return 0

    world = args.gpus_per_node * args.nodes
    gib = GiB
    print(f"model: {describe(m)} -> {total_params(m) / 1e9:.2f} B params ({active_params(m) / 1e9:.2f} B active); seq {args.seq_length}, global batch {args.global_batch}, "
          f"{args.nodes} node(s) x {args.gpus_per_node} GPUs x {args.gpu_memory_gib:g} GiB, {args.dtype}, "
          f"{'no ' if args.no_distributed_optimizer else ''}distributed optimizer")
    bpp = "2 + 4 + 12/D (bf16 weight, fp32 grad, fp32 main + Adam m, v; D = DP x CP)" if not args.no_distributed_optimizer \
        else "2 + 4 + 12 = 18"
    print(f"bytes/param: {bpp}; activations: cp_ext per-layer count (Korthikanti et al. 2022 without the 5as/h term), "
          f"/TP (SP) /CP; {kv_arithmetic(m, args.seq_length, mha=False)} per sequence before TP x CP")
    if any(m.is_linear_layer(i) for i in range(m.layers)):
        print(linear_arithmetic(m, args.seq_length, cp=min(world, 8), dtype=args.dtype))
    plans = plan(m, s=args.seq_length, global_batch=args.global_batch, gpu_memory=args.gpu_memory_gib * gib,
                 gpus_per_node=args.gpus_per_node, nodes=args.nodes, micro_batch=args.micro_batch, dtype=args.dtype,
                 distributed_optimizer=not args.no_distributed_optimizer, intra_gbps=args.intra_node_gbps,
                 inter_gbps=args.inter_node_gbps, cp_comm_types=tuple(COMM_TYPES[c] for c in args.cp_comm_types))
    valid = [p_ for p_ in plans if p_.valid]
    print(f"{len(valid)} of {len(plans)} layouts of {world} GPUs fit; best first (GiB per rank; comm MiB per layer fwd+bwd):")
    print(f"{'#':>3s} {'layout':34s} {'weights':>8s} {'grads':>6s} {'optim':>6s} {'activ':>7s} {'(KV+LSE)':>9s} {'total':>7s} "
          f"{'TP':>7s} {'ring':>7s} {'a2a':>7s} {'AG':>7s} {'EP':>7s} {'comm s':>7s} {'bubble':>6s}  reason")
    for i, pl in enumerate(valid[:args.top], 1):
        mm, c = pl.memory, pl.comm_per_layer
        transient = (f" (all-gather transient {mm['attention_transient'] / gib:.2f} GiB in activ)"
                     if pl.comm_type == "all_gather" else "")
        print(f"{i:>3d} {format_grid(pl.grid, pl.comm_type, c.get('mla_latent', False)):34s} {mm['weights'] / gib:8.2f} {mm['grads'] / gib:6.2f} "
              f"{mm['optimizer'] / gib:6.2f} {mm['activations'] / gib:7.2f} {mm['kv_state'] / gib:9.2f} {mm['total'] / gib:7.2f} "
              f"{c['tp'] / 2**20:7.1f} {c['cp_ring'] / 2**20:7.1f} {c['cp_ulysses'] / 2**20:7.1f} "
              f"{c['cp_all_gather'] / 2**20:7.1f} {c['ep'] / 2**20:7.1f} "
              f"{pl.comm_seconds:7.3f} {pl.bubble:6.2f}  {pl.reason}{transient}")
    if m.compressed is not None and plans and plans[0].memory:
        _print_compressed_kinds(m, plans[0], args)
    if args.document_lengths and valid:
        _suggest_dynamic_cp(p, args, m, valid)
    if args.show_invalid or not valid:
        for pl in plans:
            if not pl.valid:
                print(f"    excluded {format_grid(pl.grid, pl.comm_type):34s} {pl.reason}")
    return 0 if valid else 1


def _print_compressed_kinds(m, best, args):
    """DeepSeek-V4: each layer kind's parameters, activations and CP bytes on the first layout listed."""
    rows = compressed_kinds(m, best.grid, s=args.seq_length, b=args.micro_batch, dtype=args.dtype)
    print(f"DeepSeek-V4's layer kinds on {format_grid(best.grid)} (per layer and rank, no recompute; CP bytes fwd + bwd, "
          f"the busiest rank's; 'vs K/V' = forward bytes / a dense all-gather of the {m.v_head_dim}-wide K=V head):")
    print(f"    {'kind':8s} {'layers':>6s} {'attention params':>17s} {'activ GiB':>10s} {'CP MiB':>9s} {'vs K/V':>7s}")
    for r in rows:
        print(f"    {r['kind']:8s} {r['layers']:6d} {r['params'] / 1e6:16.1f}M {r['activations'] / GiB:10.3f} "
              f"{r['cp_bytes'] / 2**20:9.2f} {r['vs_dense']:7.4f}")


def _shape_from_planner_flags(p, args) -> ModelShape:
    try:
        return shape_from_fields({key: getattr(args, key) for key in SHAPE_FIELDS}, args.model)
    except ValueError as missing:
        p.error(f"give --model, all of --layers --hidden --heads --ffn --vocab (missing: {missing}), "
                f"or the trainer flags after --")


def _shape_from_trainer_flags(p, args, flags) -> ModelShape:
    """The model (and unset sequence length, batch sizes, precision) from pretrain_moe.py's flags,
    parsed at the cluster's world size, as the trainer would."""
    from unittest import mock

    from cp_ext.arguments import ConfigError, parse_args

    try:
        # the plan is for the cluster's GPUs, not this host's: validate as on a CUDA host
        # (as tests/arguments/test_yaml_config.py does for the bundled configs)
        with mock.patch("cp_ext.platform.cuda_unusable_reason", lambda: None):
            a = parse_args(flags, world_size=args.gpus_per_node * args.nodes)
    except ConfigError as e:
        p.error(f"the trainer flags do not parse:\n{e}")
    for key, value in (("seq_length", a.seq_length), ("global_batch", a.global_batch_size),
                       ("micro_batch", a.micro_batch_size), ("dtype", "bf16" if a.bf16 else "fp32")):
        if getattr(args, key) is None:
            setattr(args, key, value)
    return ModelShape.from_args(a)


def _suggest_dynamic_cp(p, args, m, valid):
    from cp_ext.bench.dynamic_cp import Hardware, bench_model_of, compare, lognormal_lengths, suggest_max_seqlen_per_rank

    try:
        median, sigma, low, high = (float(x) for x in args.document_lengths.split(","))
    except ValueError:
        p.error(f"--document-lengths {args.document_lengths}: give MEDIAN,SIGMA,MIN,MAX (e.g. 16384,1.5,1024,131072)")
    if high > args.seq_length:
        p.error(f"--document-lengths: MAX {high:.0f} is longer than --seq-length {args.seq_length}, where documents are cut")
    layout = next((pl for pl in valid if pl.grid.pp == 1 or pl.grid.tp == 1), None)
    if layout is None:
        print("dynamic CP: no fitting layout it runs (it does not run pipelining with TP + SP yet)")
        return
    g, model = layout.grid, bench_model_of(m)
    world, ceiling = g.dp * g.cp, args.seq_length // g.cp
    hw = Hardware(link_bytes_per_s=args.intra_node_gbps * 1e9)
    batches = [lognormal_lengths(args.global_batch, median, sigma, int(low), int(high), seed) for seed in range(2)]
    best, table = suggest_max_seqlen_per_rank(batches, world=world, ceiling=ceiling, model=model, hw=hw)
    static = sum(compare(b, world=world, static_cp=g.cp, seq_length=args.seq_length, max_tokens_per_rank=best,
                         model=model, hw=hw)["static"]["modelled step (s)"] for b in batches)
    steps = ", ".join(f"{c}: {s:.3g} s" for c, s in table)
    print(f"dynamic CP on TP{g.tp} CP{g.cp} DP{g.dp} (the ring; {world} DP x CP ranks), {args.global_batch} documents per batch of lognormal "
          f"median {median:.0f} sigma {sigma:g} in [{low:.0f}, {high:.0f}]: --dynamic-context-parallel "
          f"--max-seqlen-per-dp-cp-rank {best} (modelled step per candidate: {steps}; static CP {g.cp}: {static:.3g} s)")
