"""The parallelism planner: every TP x PP x CP x DP layout (EP folded) of a cluster for one model and
sequence length, each with its per-rank memory and communication, ranked. Pure arithmetic (no torch);
the command line is `cp_ext.cli.plan_parallelism` (``tools/plan_parallelism.py``, ``cp-ext-plan``).

For every TP (within a node, dividing the heads), PP (dividing the layers), CP (seq divisible by 2 CP) with
DP = GPUs / (TP PP CP) dividing the global batch, `plan` folds EP (the largest EP dividing both the experts
and DP x CP, as megatron-core does) and picks the Ulysses size U (U | CP, U | heads/TP, TP x U within a
node), estimates per-rank memory (`cp_ext.perf.memory`) without and then with cp_ext's CP-aware full
recompute, and the communication per layer (`cp_ext.perf.comm`). Layouts that fit are ranked: no
recompute first, then the least estimated communication time (per-layer bytes over NVLink or the
inter-node network, x layers per stage x microbatches), then the smallest pipeline bubble; the others
follow with their reason.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from cp_ext.perf import comm
from cp_ext.perf.activations import layer_activation_elems, mla_takes_latent
from cp_ext.perf.compressed_layers import KINDS, compressed_attention_params, compressed_layer_bytes
from cp_ext.perf.memory import GiB, PRESETS, Grid, ModelShape, kv_state_bytes, rank_memory, replace


@dataclass
class Plan:
    """One layout: its grid (EP and Ulysses folded in), whether it fits and why, and its estimates."""

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
    DeepSeek-V4's layers: their exchange (`cp_ext.perf.compressed_layers.compressed_layer_bytes`) under "cp_ring".

    MLA: per-head K (d_qk + p) and V (d_v), or, where `cp_ext.transformer.mla` takes it (ring or
    all-gather, TP 1, smaller), the latent ``r + p`` per token (`comm.mla_exchange_bytes`)."""
    all_gather = comm_type == "all_gather"
    latent = mla_takes_latent(m, tp=g.tp, cp=g.cp, ulysses=1 if all_gather else g.ulysses, all_gather=all_gather)
    if m.compressed is not None:  # V4: the halo, straddling rows and entries (the busiest rank's), in "cp_ring"
        per_kind = {kind: max(x["fwd"] + x["bwd"] for x in compressed_layer_bytes(
            m.compressed, kind, s=s, cp=g.cp, d=m.v_head_dim, b=b, dtype=dtype)) for kind in KINDS}
        sent = sum(per_kind[m.compressed.kind(i)] for i in range(m.layers)) / m.layers
        cpb = {k: {"fwd": 0, "bwd": 0} for k in ("ulysses_a2a", "all_gather_kv", "reduce_scatter_dkv")}
        cpb["ring_p2p"] = {"fwd": sent, "bwd": 0}
    elif latent:
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
    linear_share = sum(1 for i in range(m.layers) if m.is_linear_layer(i)) / m.layers
    cp_linear = linear_layer_bytes(m, g, s=s, b=b, dtype=dtype) if linear_share else 0
    tp = comm.tp_layer_bytes(b=b, s=s, hidden=m.hidden, tp=g.tp, cp=g.cp, dtype=dtype)
    ep = comm.ep_layer_bytes(b=b, s=s, hidden=m.hidden, topk=m.topk, ep=g.ep, tp=g.tp, cp=g.cp, dtype=dtype) if m.experts else {"fwd": 0, "bwd": 0}
    moe_share = sum(1 for i in range(m.layers) if m.is_moe_layer(i)) / m.layers  # dense-first layers dispatch nothing
    both = lambda x: x["fwd"] + x["bwd"]  # noqa: E731
    softmax_share = 1 - linear_share  # the linear layers exchange states and halos instead of K/V
    return {"tp": both(tp), "cp_ring": both(cpb["ring_p2p"]) * softmax_share,
            "cp_ulysses": both(cpb["ulysses_a2a"]) * softmax_share,
            "cp_all_gather": (both(cpb["all_gather_kv"]) + both(cpb["reduce_scatter_dkv"])) * softmax_share,
            "cp_linear": cp_linear * linear_share, "ep": both(ep) * moe_share, "mla_latent": latent}


def linear_layer_bytes(m: ModelShape, g: Grid, *, s: int, b: int, dtype: str, method: str = "state_passing",
                       exchange: str = "all_gather") -> int:
    """One linear-attention layer's CP bytes per rank (forward + backward): its conv halo and state exchange
    (`comm.gated_delta_layer_bytes`; the layers' own method, the all-gather exchange, by default)."""
    if g.cp == 1:
        return 0
    per = comm.gated_delta_layer_bytes(method=method, b=b, s=s, hk=m.linear_key_heads // g.tp,
                                       h=m.linear_value_heads // g.tp, k_dim=m.linear_key_dim,
                                       v_dim=m.linear_value_dim, cp=g.cp, dtype=dtype, exchange=exchange,
                                       kernel_size=m.linear_conv_kernel)
    return sum(x["fwd"] + x["bwd"] for x in per.values())


def linear_arithmetic(m: ModelShape, s: int, *, cp: int, tp: int = 1, b: int = 1, dtype: str = "bf16") -> str:
    """The linear layers' state, conv halo and CP bytes per method at ``cp`` ranks (one line each)."""
    layers = sum(1 for i in range(m.layers) if m.is_linear_layer(i))
    state = m.linear_value_heads * m.linear_key_dim * m.linear_value_dim * 4
    channels = 2 * m.linear_key_heads * m.linear_key_dim + m.linear_value_heads * m.linear_value_dim
    g = Grid(tp=tp, pp=1, cp=cp, dp=1)
    by = {f"state passing ({x})": linear_layer_bytes(m, g, s=s, b=b, dtype=dtype, exchange=x)
          for x in ("all_gather", "ring")}
    heads_limit = m.linear_key_heads // tp
    if cp <= heads_limit and heads_limit % cp == 0:
        by["all-to-all"] = linear_layer_bytes(m, g, s=s, b=b, dtype=dtype, method="all_to_all")
    else:
        by["all-to-all"] = None
    lines = [f"linear layers: {layers} of {m.layers}; state {m.linear_value_heads} heads x {m.linear_key_dim} x "
             f"{m.linear_value_dim} x 4 B = {state / 2**20:.1f} MiB per sequence and layer, whatever its length (the "
             f"generation cache, with the conv's last {m.linear_conv_kernel - 1} inputs of {channels} channels)",
             f"CP{cp} bytes per linear layer and rank (fwd + bwd, TP{tp}, {s} tokens): "
             + ", ".join(f"{k} {v / 2**20:.1f} MiB" if v is not None else
                         f"{k}: cannot split {m.linear_key_heads} key heads / TP{tp} over CP{cp}" for k, v in by.items())]
    return "\n".join(lines)


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
    linear = any(m.is_linear_layer(i) for i in range(m.layers))
    if linear and (m.linear_key_heads % g.tp or m.linear_value_heads % g.tp):
        return f"TP {g.tp} does not divide the linear layers' {m.linear_key_heads} key / {m.linear_value_heads} value heads"
    if m.compressed is not None and m.compressed.o_groups % g.tp:
        return f"TP {g.tp} does not divide the {m.compressed.o_groups} output groups (--o-groups)"
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
    """Megatron's EP folding (ETP = TP, cp_ext's default, or 1 for biased experts, as megatron-core
    requires of them (cp_ext also runs them at ETP = TP, `cp_ext.transformer.experts`); EP | experts, EP x ETP | TP x CP x DP, the largest such EP) and the Ulysses
    size (the largest U | CP, U | heads/TP, TP x U within a node)."""
    ep, etp = 1, (1 if m.add_bias_linear else g.tp)
    if m.experts:
        ep = max(e for e in divisors(m.experts) if (g.dp * g.cp * g.tp // etp) % e == 0)
    ulysses = max(u for u in divisors(g.cp) if (m.heads // g.tp) % u == 0 and g.tp * u <= gpus_per_node)
    if any(m.is_linear_layer(i) for i in range(m.layers)) or m.compressed is not None:
        # the linear layers pass their state on the ring; V4's layers exchange rows over the whole CP group
        ulysses = 1
    return Grid(tp=g.tp, pp=g.pp, cp=g.cp, dp=g.dp, ep=ep, etp=etp, ulysses=ulysses)


def _comm_seconds(per_layer, g, gpus_per_node, intra_gbps, inter_gbps) -> float:
    """Per-layer seconds if nothing overlapped: each collective over NVLink when its group fits a node."""
    bw = lambda span: (intra_gbps if span <= gpus_per_node else inter_gbps) * 1e9  # noqa: E731
    return (per_layer["tp"] / bw(g.tp) + per_layer["cp_ulysses"] / bw(g.tp * g.ulysses)
            + (per_layer["cp_ring"] + per_layer.get("cp_all_gather", 0) + per_layer.get("cp_linear", 0)) / bw(g.tp * g.cp)
            + per_layer["ep"] / bw(g.tp * g.dp * g.cp))


def format_grid(g: Grid, comm_type: Optional[str] = None, latent: bool = False) -> str:
    """``TP2 PP1 CP4(U2xR2) DP1 EP4``: the CP part names Ulysses x ring, all-gather (AG), MLA's latent."""
    cp = ("AG" if comm_type == "all_gather" else f"U{g.ulysses}xR{g.cp // g.ulysses}") + (" latent" if latent else "")
    return f"TP{g.tp} PP{g.pp} CP{g.cp}({cp}) DP{g.dp} EP{g.ep}" + (f" ETP{g.etp}" if g.etp != g.tp else "")


def kv_arithmetic(m: ModelShape, s: int, mha: bool = True) -> str:
    """The KV cache of the softmax layers (linear-attention layers keep a state instead: `linear_arithmetic`)."""
    softmax = sum(1 for i in range(m.layers) if not m.is_linear_layer(i))
    kv = kv_state_bytes(m, s=s, dtype="bf16", mha=mha)["kv"]
    if m.compressed is not None:
        return (f"KV = {m.layers} layers x one K=V head of {m.v_head_dim} (and each CSA / HCA layer's entries, 1 / "
                f"{m.compressed.csa_ratio} and 1 / {m.compressed.hca_ratio} of the tokens) x {s} tokens x 2 B = "
                f"{kv:.0f} B = {kv / GiB:.1f} GiB")
    layers = f"{softmax} layers" if softmax == m.layers else f"{softmax} softmax layers"
    g = m.heads if mha else m.kv_heads
    if m.head_dim != m.v_dim:  # MLA: K of d_qk + p, V of d_v per head
        per = f"{g * (m.head_dim + m.v_dim)} ({g} heads x ({m.head_dim} + {m.v_dim}))"
        return f"KV = {layers} x {per} x {s} tokens x 2 B = {kv:.0f} B = {kv / GiB:.1f} GiB"
    return (f"KV = 2 (K,V) x {layers} x {g * m.head_dim} ({g} heads x {m.head_dim}) x {s} tokens x 2 B "
            f"= {kv:.0f} B = {kv / GiB:.1f} GiB")


# The model as the planner's own flags give it (--layers, --hidden, ...), and what no default fills.
SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts", "topk", "moe_ffn")
REQUIRED_FIELDS = ("layers", "hidden", "heads", "ffn", "vocab")


def shape_from_fields(values: dict, preset: Optional[str] = None) -> ModelShape:
    """The model from the planner's own fields (``SHAPE_FIELDS``; None: unset), each unset one taken from
    the ``preset`` (`PRESETS`). Raises ValueError naming the ``REQUIRED_FIELDS`` neither gives."""
    base = PRESETS[preset] if preset else None
    vals = {}
    for key in SHAPE_FIELDS:
        v = values.get(key)
        vals[key] = v if v is not None else (getattr(base, key) if base else None)
    missing = [k for k in REQUIRED_FIELDS if vals[k] is None]
    if missing:
        raise ValueError(", ".join(missing))
    vals["kv_heads"] = vals["kv_heads"] or vals["heads"]
    vals["experts"] = vals["experts"] or 0
    vals["topk"] = vals["topk"] or (base.topk if base else 1)
    if base is not None:  # the preset's other fields (MLA, V4's layers, ...) stay
        return replace(base, **vals)
    return ModelShape(**vals)


def compressed_kinds(m: ModelShape, g: Grid, *, s: int, b: int = 1, dtype: str = "bf16") -> List[dict]:
    """DeepSeek-V4's layer kinds on grid ``g``: per kind its layers, attention parameters per layer, saved activations per
    layer and rank (no recompute), the busiest rank's CP bytes per layer (forward + backward) and their ratio to a
    dense all-gather of the K=V head's rows ((C - 1) s / C d, forward)."""
    e = 4 if dtype == "fp32" else 2
    tokens, rows = s * b / g.cp, []
    dense = (g.cp - 1) * s // g.cp * m.v_head_dim * e * b
    for kind in KINDS:
        layers = [i for i in range(m.layers) if m.compressed.kind(i) == kind]
        if not layers:
            continue
        i = layers[0]
        x = layer_activation_elems(m, i, tp=g.tp, cp=g.cp, dtype=dtype, s=s)
        per_rank = compressed_layer_bytes(m.compressed, kind, s=s, cp=g.cp, d=m.v_head_dim, b=b, dtype=dtype)
        sent, fwd = max(y["fwd"] + y["bwd"] for y in per_rank), max(y["fwd"] for y in per_rank)
        attention = compressed_attention_params(m.compressed, kind, h=m.hidden, a=m.heads, d=m.v_head_dim,
                                                q_rank=m.q_lora_rank)
        rows.append(dict(kind=kind, layers=len(layers), params=attention,
                         activations=tokens * (x["act"] * e + x["fp32"] * 4 + x["bytes"]), cp_bytes=sent,
                         vs_dense=fwd / dense if dense else 0.0))
    return rows
