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

``--cp-comm-types a2a+p2p all_gather`` also plans every CP > 1 layout with all-gather
attention (``--cp-comm-type all_gather``: K/V all-gathered over the CP group, dK/dV
reduce-scattered; no Ulysses), ranked with the others: its transient full-sequence K/V (and
fp32 dK/dV) is in the activations (`cp_ext.perf.memory.all_gather_transient_bytes`) and its
bytes in the communication (`cp_ext.perf.comm.all_gather_bytes`). The default plans only
``a2a+p2p``: the Ulysses x ring layouts above (U = 1 is the ring).
"""

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cp_ext.perf import comm  # noqa: E402
from cp_ext.perf.activations import mla_takes_latent  # noqa: E402
from cp_ext.perf.memory import GiB, PRESETS, Grid, ModelShape, kv_state_bytes, rank_memory, replace, total_params  # noqa: E402
from cp_ext.perf.model_shape import active_params, describe  # noqa: E402


@dataclass
class Plan:
    grid: Grid
    valid: bool
    reason: str
    recompute: Optional[str] = None  # None or "full_cp_aware" (cp_ext's full recompute)
    comm_type: Optional[str] = None  # None (Ulysses x ring, U from _fold) or "all_gather"
    memory: dict = field(default_factory=dict)
    comm_per_layer: dict = field(default_factory=dict)
    comm_seconds: float = 0.0
    bubble: float = 0.0


def divisors(n: int) -> List[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def layer_comm(m: ModelShape, g: Grid, *, s: int, b: int, dtype: str, comm_type: Optional[str] = None) -> dict:
    """Bytes sent per rank per layer (forward + backward) by collective; EP's averaged over the layers.

    MLA: per-head K (d_qk + p) and V (d_v), or, where `cp_ext.transformer.mla` takes it (ring or
    all-gather, TP 1, smaller), the latent ``r + p`` per token (`comm.mla_exchange_bytes`)."""
    all_gather = comm_type == "all_gather"
    latent = mla_takes_latent(m, tp=g.tp, cp=g.cp, ulysses=1 if all_gather else g.ulysses, all_gather=all_gather)
    if latent:
        cpb = comm.mla_exchange_bytes(b=b, h=m.heads, s_local=s // g.cp, qk_head_dim=m.qk_head_dim,
                                      qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                                      kv_lora_rank=m.kv_lora_rank, cp=g.cp, dtype=dtype, exchange="latent",
                                      comm_type=comm_type)
        cpb["ulysses_a2a"] = {"fwd": 0, "bwd": 0}
    else:
        # K and V of d and d_v: the formulas' 2 d per KV head (and q + out per head) at their mean
        d = (m.head_dim + m.v_dim) / 2
        cpb = comm.cp_attention_bytes(b=b, h=m.heads // g.tp, hk=max(1, m.kv_heads // g.tp), s=s, d=d, cp=g.cp,
                                      ulysses=g.ulysses, dtype=dtype, comm_type=comm_type)
    tp = comm.tp_layer_bytes(b=b, s=s, hidden=m.hidden, tp=g.tp, cp=g.cp, dtype=dtype)
    ep = comm.ep_layer_bytes(b=b, s=s, hidden=m.hidden, topk=m.topk, ep=g.ep, tp=g.tp, cp=g.cp, dtype=dtype) if m.experts else {"fwd": 0, "bwd": 0}
    moe_share = sum(1 for i in range(m.layers) if m.is_moe_layer(i)) / m.layers  # dense-first layers dispatch nothing
    both = lambda x: x["fwd"] + x["bwd"]  # noqa: E731
    return {"tp": both(tp), "cp_ring": both(cpb["ring_p2p"]), "cp_ulysses": both(cpb["ulysses_a2a"]),
            "cp_all_gather": both(cpb["all_gather_kv"]) + both(cpb["reduce_scatter_dkv"]),
            "ep": both(ep) * moe_share, "mla_latent": latent}


# --cp-comm-types: Megatron's names; "a2a+p2p" is cp_ext's default Ulysses x ring (U picked per layout).
COMM_TYPES = {"a2a+p2p": None, "all_gather": "all_gather"}


def plan(m: ModelShape, *, s: int, global_batch: int, gpu_memory: float, gpus_per_node: int, nodes: int,
         micro_batch: int = 1, dtype: str = "bf16", distributed_optimizer: bool = True,
         intra_gbps: float = 300.0, inter_gbps: float = 25.0, headroom: float = 0.9,
         cp_comm_types=(None,)) -> List[Plan]:
    """Every TP x PP x CP x DP layout of nodes x gpus_per_node GPUs, valid or not, ranked.

    ``cp_comm_types``: the CP attentions to plan each CP > 1 layout with (None: Ulysses x ring,
    ``"all_gather"``: all-gather attention); CP = 1 layouts are planned once.
    """
    world = gpus_per_node * nodes
    plans: List[Plan] = []
    budget = gpu_memory * headroom
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                g = Grid(tp=tp, pp=pp, cp=cp, dp=dp)
                reason = _invalid_reason(m, g, s=s, global_batch=global_batch, micro_batch=micro_batch,
                                         gpus_per_node=gpus_per_node)
                if reason:
                    plans.append(Plan(g, False, reason))
                    continue
                folded = _fold(m, g, gpus_per_node)
                micro = global_batch // (dp * micro_batch)
                variants = [(c, folded if c is None else replace(folded, ulysses=1))  # all-gather: no Ulysses
                            for c in (cp_comm_types if cp > 1 else (None,))]
                if m.multi_latent_attention and folded.ulysses > 1 and None in cp_comm_types:
                    variants.append((None, replace(folded, ulysses=1)))  # the ring, where MLA's latent travels
                for comm_type, g in variants:
                    best = None
                    for recompute in (None, "full_cp_aware"):
                        mem = rank_memory(m, g, s=s, b=micro_batch, dtype=dtype, distributed_optimizer=distributed_optimizer,
                                          recompute=recompute, microbatches=micro, cp_comm_type=comm_type)
                        best = (recompute, mem)
                        if mem["total"] <= budget:
                            break
                    recompute, mem = best
                    per_layer = layer_comm(m, g, s=s, b=micro_batch, dtype=dtype, comm_type=comm_type)
                    secs = _comm_seconds(per_layer, g, gpus_per_node, intra_gbps, inter_gbps) * (m.layers // pp) * micro
                    bubble = (pp - 1) / (micro + pp - 1)
                    fits = mem["total"] <= budget
                    why = (f"fits: {mem['total'] / GiB:.1f} GiB <= {budget / GiB:.1f} GiB ({headroom:.0%} of {gpu_memory / GiB:.0f})"
                           + (", needs full recompute" if recompute else "")
                           if fits else f"does not fit: {mem['total'] / GiB:.1f} GiB > {budget / GiB:.1f} GiB even with full recompute")
                    plans.append(Plan(g, fits, why, recompute, comm_type, mem, per_layer, secs, bubble))
    valid = sorted((p for p in plans if p.valid), key=lambda p: (p.recompute is not None, round(p.comm_seconds * (1 + p.bubble), 6), p.grid.pp))
    return valid + [p for p in plans if not p.valid]


def _invalid_reason(m, g, *, s, global_batch, micro_batch, gpus_per_node) -> Optional[str]:
    if m.heads % g.tp or m.kv_heads % g.tp:
        return f"TP {g.tp} does not divide the {m.heads} heads / {m.kv_heads} KV heads"
    if g.tp > gpus_per_node:
        return f"TP {g.tp} spans nodes ({gpus_per_node} GPUs per node); TP stays inside NVLink"
    if m.vocab % g.tp:
        return f"TP {g.tp} does not divide the padded vocabulary {m.vocab}"
    if m.layers % g.pp:
        return f"PP {g.pp} does not divide the {m.layers} layers"
    if s % (2 * g.cp):
        return f"sequence {s} is not divisible by 2 x CP = {2 * g.cp} (zigzag chunks)"
    if (s // g.cp) % g.tp:
        return f"s / CP = {s // g.cp} is not divisible by TP {g.tp} (sequence parallelism)"
    if global_batch % (g.dp * micro_batch):
        return f"global batch {global_batch} is not divisible by DP {g.dp} x micro batch {micro_batch}"
    return None


def _fold(m: ModelShape, g: Grid, gpus_per_node: int) -> Grid:
    """Megatron's EP folding (ETP = TP, cp_ext's default, or 1 for biased experts, which cp_ext runs
    at expert-TP 1 only; EP | experts, EP x ETP | TP x CP x DP, the largest such EP) and the Ulysses
    size (the largest U | CP, U | heads/TP, TP x U within a node)."""
    ep, etp = 1, (1 if m.add_bias_linear else g.tp)
    if m.experts:
        ep = max(e for e in divisors(m.experts) if (g.dp * g.cp * g.tp // etp) % e == 0)
    ulysses = max(u for u in divisors(g.cp) if (m.heads // g.tp) % u == 0 and g.tp * u <= gpus_per_node)
    return Grid(tp=g.tp, pp=g.pp, cp=g.cp, dp=g.dp, ep=ep, etp=etp, ulysses=ulysses)


def _comm_seconds(per_layer, g, gpus_per_node, intra_gbps, inter_gbps) -> float:
    """Per-layer seconds if nothing overlapped: each collective over NVLink when its group fits a node."""
    bw = lambda span: (intra_gbps if span <= gpus_per_node else inter_gbps) * 1e9  # noqa: E731
    return (per_layer["tp"] / bw(g.tp) + per_layer["cp_ulysses"] / bw(g.tp * g.ulysses)
            + (per_layer["cp_ring"] + per_layer.get("cp_all_gather", 0)) / bw(g.tp * g.cp)
            + per_layer["ep"] / bw(g.tp * g.dp * g.cp))


def _fmt_grid(g: Grid, comm_type: Optional[str] = None, latent: bool = False) -> str:
    cp = ("AG" if comm_type == "all_gather" else f"U{g.ulysses}xR{g.cp // g.ulysses}") + (" latent" if latent else "")
    return f"TP{g.tp} PP{g.pp} CP{g.cp}({cp}) DP{g.dp} EP{g.ep}" + (f" ETP{g.etp}" if g.etp != g.tp else "")


def kv_arithmetic(m: ModelShape, s: int, mha: bool = True) -> str:
    kv = kv_state_bytes(m, s=s, dtype="bf16", mha=mha)["kv"]
    g = m.heads if mha else m.kv_heads
    if m.head_dim != m.v_dim:  # MLA: K of d_qk + p, V of d_v per head
        per = f"{g * (m.head_dim + m.v_dim)} ({g} heads x ({m.head_dim} + {m.v_dim}))"
        return f"KV = {m.layers} layers x {per} x {s} tokens x 2 B = {kv:.0f} B = {kv / GiB:.1f} GiB"
    return (f"KV = 2 (K,V) x {m.layers} layers x {g * m.head_dim} ({g} heads x {m.head_dim}) x {s} tokens x 2 B "
            f"= {kv:.0f} B = {kv / GiB:.1f} GiB")


def main(argv=None):
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
        print(f"{i:>3d} {_fmt_grid(pl.grid, pl.comm_type, c.get('mla_latent', False)):34s} {mm['weights'] / gib:8.2f} {mm['grads'] / gib:6.2f} "
              f"{mm['optimizer'] / gib:6.2f} {mm['activations'] / gib:7.2f} {mm['kv_state'] / gib:9.2f} {mm['total'] / gib:7.2f} "
              f"{c['tp'] / 2**20:7.1f} {c['cp_ring'] / 2**20:7.1f} {c['cp_ulysses'] / 2**20:7.1f} "
              f"{c['cp_all_gather'] / 2**20:7.1f} {c['ep'] / 2**20:7.1f} "
              f"{pl.comm_seconds:7.3f} {pl.bubble:6.2f}  {pl.reason}{transient}")
    if args.show_invalid or not valid:
        for pl in plans:
            if not pl.valid:
                print(f"    excluded {_fmt_grid(pl.grid, pl.comm_type):34s} {pl.reason}")
    return 0 if valid else 1


def _shape_from_planner_flags(p, args) -> ModelShape:
    base = PRESETS[args.model] if args.model else None
    vals = {}
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "topk", "moe_ffn"):
        v = getattr(args, key)
        vals[key] = v if v is not None else (getattr(base, key) if base else None)
    missing = [k for k in ("layers", "hidden", "heads", "ffn", "vocab") if vals[k] is None]
    if missing:
        p.error(f"give --model, all of --layers --hidden --heads --ffn --vocab (missing: {', '.join(missing)}), "
                f"or the trainer flags after --")
    vals["kv_heads"] = vals["kv_heads"] or vals["heads"]
    vals["experts"] = vals["experts"] or 0
    vals["topk"] = vals["topk"] or (base.topk if base else 1)
    return ModelShape(**vals, tied_embeddings=base.tied_embeddings if base else True)


def _shape_from_trainer_flags(p, args, flags) -> ModelShape:
    """The model (and unset sequence length, batch sizes, precision) from pretrain_moe.py's flags,
    parsed at the cluster's world size, as the trainer would."""
    from unittest import mock

    from cp_ext.arguments import ConfigError, parse_args

    try:
        # the plan is for the cluster's GPUs, not this host's: validate as on a CUDA host
        # (as tests/test_arguments.py does for the bundled configs)
        with mock.patch("cp_ext.platform.cuda_unusable_reason", lambda: None):
            a = parse_args(flags, world_size=args.gpus_per_node * args.nodes)
    except ConfigError as e:
        p.error(f"the trainer flags do not parse:\n{e}")
    for key, value in (("seq_length", a.seq_length), ("global_batch", a.global_batch_size),
                       ("micro_batch", a.micro_batch_size), ("dtype", "bf16" if a.bf16 else "fp32")):
        if getattr(args, key) is None:
            setattr(args, key, value)
    return ModelShape.from_args(a)


if __name__ == "__main__":
    sys.exit(main())
