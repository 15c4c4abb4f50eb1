"""Dynamic CP against static CP on the same documents: counted work and bytes per rank, and a modelled step
(`tools/bench_dynamic_cp.py` prints it).

Three plans of one global batch of whole documents over ``world`` = DP x CP ranks:

    static    every document on --context-parallel-size ranks: documents packed whole (first fit, longest
              first) into sequences of --seq-length, each sequence zigzagged over its CP group as one
              sequence (cp_ext's static layout with --reset-attention-mask), sequences dealt to the DP ranks
    megatron  Megatron-LM's dynamic-CP scheduler (`cp_ext.data.dynamic_schedule.megatron_schedule`)
    cp_ext    cp_ext's (`balanced_schedule`): any group size dividing the ranks, work-balanced

What is counted, per microbatch and rank: query-key pairs of causal attention inside documents (exact: the
rank's positions in its layout, padding excluded), the tokens it holds (padding included: the linear layers
run on them), and the K/V bytes it sends on the ring (each of its tokens' K/V, c - 1 hops, forward; the same
again for dK/dV in the backward). Ranks meet at every microbatch (expert parallelism's all-to-all, the
pipeline), so a step is the sum over microbatches of the slowest rank:

    rank time = layers x (3 x tokens x linear FLOPs per token + max(3 x pairs x FLOPs per pair,
                                                                     bytes / link bandwidth)) / FLOP rate
    (forward + backward = 3 x forward's FLOPs; the ring overlaps its exchange with attention only)
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from cp_ext.data.dynamic_schedule import CostModel, Schedule, balanced_schedule, group_sizes, megatron_schedule


@dataclass(frozen=True)
class BenchModel:
    """The per-token and per-pair sizes of one transformer layer (MoE: the active experts)."""

    hidden: int
    heads: int
    kv_groups: int
    head_dim: int
    layers: int
    ffn: int  # per active expert
    topk: int
    value_bytes: int = 2  # bf16 K/V on the wire

    @property
    def flops_per_pair(self) -> int:  # forward: q.k and p.v, a multiply-add each per head dim, every head
        return 4 * self.heads * self.head_dim

    @property
    def flops_per_token(self) -> int:  # forward: QKV and output projections, the active experts' SwiGLU
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_groups)
        return 2 * (attention + 3 * self.hidden * self.ffn * self.topk)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_groups * self.head_dim * self.value_bytes

    def cost(self) -> CostModel:
        """The scheduler's cost model in pairs' work (`cp_ext.training.dynamic_batches.cost_model`'s units)."""
        pair = self.flops_per_pair
        return CostModel(per_token=self.flops_per_token / pair, exchange_per_token=self.kv_bytes_per_token / pair)


@dataclass(frozen=True)
class Hardware:
    """An H100's effective dense bf16 rate and the ring's link (NVLink within a node)."""

    flops: float = 400e12
    link_bytes_per_s: float = 200e9


@dataclass
class Counts:
    """[microbatch, rank] arrays of one plan's step."""

    pairs: np.ndarray
    tokens: np.ndarray
    bytes: np.ndarray

    def seconds(self, model: BenchModel, hw: Hardware) -> np.ndarray:
        linear = 3 * self.tokens * model.flops_per_token / hw.flops
        attention = 3 * self.pairs * model.flops_per_pair / hw.flops
        exchange = 2 * self.bytes / hw.link_bytes_per_s  # K/V forward, dK/dV backward
        return model.layers * (linear + np.maximum(attention, exchange))

    def step(self, model: BenchModel, hw: Hardware) -> float:
        return float(self.seconds(model, hw).max(axis=1).sum())

    @staticmethod
    def balance(per_rank: np.ndarray) -> float:
        """The step's most loaded rank over the mean (1.0: balanced)."""
        total = per_rank.sum(axis=0)
        return float(total.max() / total.mean()) if total.mean() else 1.0


def lognormal_lengths(n: int, median: float, sigma: float, low: int, high: int, seed: int) -> List[int]:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(math.log(median), sigma, n), low, high).astype(int).tolist()


def _chunk_pairs(length: int, lo: int, hi: int) -> int:
    """Causal pairs of the queries at positions [lo, hi) of a document of ``length`` tokens (padding beyond)."""
    hi = min(hi, length)
    return (hi * (hi + 1) - lo * (lo + 1)) // 2 if hi > lo else 0


def zigzag_pairs(length: int, size: int, padding: bool = False) -> List[int]:
    """Each rank's causal pairs of one document zigzagged over ``size`` ranks on its own (`DocumentZigzag`).
    ``padding``: also the pairs of its padding tail, a document of its own the kernels compute too (what the
    ring's work counter reports; the model's cost leaves them out)."""
    chunk = -(-length // (2 * size))
    tail = 2 * size * chunk - length

    def pairs(lo, hi):
        out = _chunk_pairs(length, lo, hi)
        if padding:  # the tail's positions length + t count t + 1 keys
            out += _chunk_pairs(tail, max(lo - length, 0), max(hi - length, 0))
        return out

    return [pairs(r * chunk, (r + 1) * chunk) + pairs((2 * size - 1 - r) * chunk, (2 * size - r) * chunk)
            for r in range(size)]


def dynamic_counts(schedule: Schedule, model: BenchModel) -> Counts:
    shape = (len(schedule.microbatches), schedule.world)
    pairs, tokens, sent = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    for k, mb in enumerate(schedule.microbatches):
        for g in mb.groups:
            for d in g.documents:
                length = schedule.lengths[d]
                held = -(-length // (2 * g.size)) * 2  # this rank's share, padded to 2 x size
                for r, p in zip(g.ranks, zigzag_pairs(length, g.size)):
                    pairs[k, r] += p
                    tokens[k, r] += held
                    sent[k, r] += (g.size - 1) * held * model.kv_bytes_per_token
    return Counts(pairs, tokens, sent)


def pack_sequences(lengths: Sequence[int], seq_length: int) -> List[List[int]]:
    """Whole documents into sequences of ``seq_length`` tokens: first fit, longest first."""
    bins, room = [], []
    for d in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = next((i for i, r in enumerate(room) if r >= lengths[d]), None)
        if b is None:
            bins.append([]), room.append(seq_length)
            b = len(bins) - 1
        bins[b].append(d)
        room[b] -= lengths[d]
    return bins


def static_counts(lengths: Sequence[int], world: int, cp: int, seq_length: int, model: BenchModel) -> Counts:
    """Static CP: sequences of packed documents, each zigzagged over cp ranks as one sequence; DP rank i runs
    sequences i, i + DP, ... (a DP rank out of sequences idles)."""
    dp = world // cp
    sequences = pack_sequences(lengths, seq_length)
    steps = -(-len(sequences) // dp)
    pairs, tokens, sent = np.zeros((steps, world)), np.zeros((steps, world)), np.zeros((steps, world))
    chunk = seq_length // (2 * cp)
    for n, docs in enumerate(sequences):
        k, first = n // dp, (n % dp) * cp
        # per position: causal keys inside its document (0 on padding)
        keys = np.zeros(seq_length, dtype=np.int64)
        start = 0
        for d in docs:
            keys[start:start + lengths[d]] = np.arange(1, lengths[d] + 1)
            start += lengths[d]
        for r in range(cp):
            mine = np.r_[r * chunk:(r + 1) * chunk, (2 * cp - 1 - r) * chunk:(2 * cp - r) * chunk]
            pairs[k, first + r] = keys[mine].sum()
            tokens[k, first + r] = 2 * chunk
            sent[k, first + r] = (cp - 1) * 2 * chunk * model.kv_bytes_per_token
    return Counts(pairs, tokens, sent)


def schedules(lengths: Sequence[int], world: int, max_tokens_per_rank: int, model: BenchModel) -> Dict[str, Schedule]:
    """The two dynamic plans of the documents: Megatron-LM's and cp_ext's."""
    return {"megatron": megatron_schedule(lengths, world, max_tokens_per_rank),
            "cp_ext": balanced_schedule(lengths, world, max_tokens_per_rank, group_sizes(world), model.cost())}


def compare(lengths: Sequence[int], *, world: int, static_cp: int, seq_length: int, max_tokens_per_rank: int,
            model: BenchModel, hw: Hardware = Hardware(), timed_heads: int = 0) -> Dict[str, dict]:
    """{plan: its counted balance, bytes and modelled step} for the three plans of the same documents.
    ``timed_heads``: also time each rank's attention on this CPU (`timed_attention_step`, that many heads)."""
    dynamic = schedules(lengths, world, max_tokens_per_rank, model)
    plans = {"static": static_counts(lengths, world, static_cp, seq_length, model),
             **{name: dynamic_counts(sch, model) for name, sch in dynamic.items()}}
    segments = {"static": lambda: static_segments(lengths, world, static_cp, seq_length),
                **{name: (lambda sch=sch: dynamic_segments(sch)) for name, sch in dynamic.items()}}
    base = plans["static"].step(model, hw)
    out = {}
    for name, c in plans.items():
        step = c.step(model, hw)
        out[name] = {
            "microbatches": c.pairs.shape[0],
            "pairs max/mean": Counts.balance(c.pairs),
            "bytes max/mean": Counts.balance(c.bytes),
            "bytes sent (GB, all ranks, per layer)": float(c.bytes.sum()) / 1e9,
            "tokens held": int(c.tokens.sum()),
            "modelled step (s)": step,
            # the step over a perfectly balanced one (every rank's seconds summed, over the ranks): what lockstep
            # at every microbatch and uneven ranks cost
            "step / balanced": step * c.pairs.shape[1] / float(c.seconds(model, hw).sum()),
            "speed-up over static": base / step,
            # attention alone in lockstep: the sum over microbatches of the most pairs on a rank
            "pairs step": float(c.pairs.max(axis=1).sum()),
        }
        if timed_heads:
            out[name]["timed attention step (s)"] = timed_attention_step(segments[name](), heads=timed_heads)
    return out


def bench_model_of(shape) -> BenchModel:
    """A `cp_ext.perf.model_shape.ModelShape`'s layer in this module's terms (MLA: per-head q/k dims)."""
    if shape.multi_latent_attention:
        head_dim, groups = shape.qk_head_dim + shape.qk_pos_emb_head_dim, shape.heads
    else:
        head_dim, groups = shape.kv_channels or shape.hidden // shape.heads, shape.kv_heads
    moe = bool(shape.experts)
    return BenchModel(hidden=shape.hidden, heads=shape.heads, kv_groups=groups, head_dim=head_dim,
                      layers=shape.layers, ffn=(shape.moe_ffn or shape.ffn) if moe else shape.ffn,
                      topk=shape.topk if moe else 1)


def suggest_max_seqlen_per_rank(batches: Sequence[Sequence[int]], *, world: int, ceiling: int, model: BenchModel,
                                hw: Hardware = Hardware()):
    """--max-seqlen-per-dp-cp-rank for dynamic CP over ``world`` DP x CP ranks: the budget whose cp_ext plan of
    ``batches`` (lists of document lengths) has the least modelled step, among powers of two from what the
    longest document needs up to ``ceiling`` (the tokens a rank's memory holds), and ``ceiling`` itself; within
    1% the smaller (less activation memory). Returns (M, [(candidate, modelled seconds)])."""
    longest = max(max(b) for b in batches)
    floor = -(-longest // world)
    candidates, m = [], 1 << max(0, (floor - 1).bit_length())
    while m < ceiling:
        candidates.append(m)
        m *= 2
    candidates.append(ceiling)
    if ceiling < floor:
        raise ValueError(f"a rank holds {ceiling} tokens, but the longest document ({longest}) needs {floor} per rank "
                         f"over {world} ranks")
    table = []
    for m in candidates:
        steps = [dynamic_counts(balanced_schedule(b, world, m, group_sizes(world), model.cost()), model).step(model, hw)
                 for b in batches]
        table.append((m, sum(steps)))
    best = min(s for _, s in table)
    return next(m for m, s in table if s <= best * 1.01), table


# ---------------------------------------------------------------- measured: each rank's attention, one at a time

def _zigzag_segments(length: int, size: int, rank: int) -> List[tuple]:
    """The rank's query runs of one document on its own zigzag, document-relative [start, end)."""
    chunk = -(-length // (2 * size))
    runs = [(j * chunk, min((j + 1) * chunk, length)) for j in (rank, 2 * size - 1 - rank)]
    return [(a, b) for a, b in runs if b > a]


def dynamic_segments(schedule: Schedule) -> List[List[List[tuple]]]:
    """[microbatch][rank]: the (query start, query end) runs inside their documents each rank computes."""
    out = []
    for mb in schedule.microbatches:
        row = [[] for _ in range(schedule.world)]
        for g in mb.groups:
            for d in g.documents:
                for r in g.ranks:
                    row[r] += _zigzag_segments(schedule.lengths[d], g.size, r - g.first)
        out.append(row)
    return out


def static_segments(lengths: Sequence[int], world: int, cp: int, seq_length: int) -> List[List[List[tuple]]]:
    """The same for static CP: each packed sequence's zigzag over its CP group, cut at document bounds."""
    dp, chunk = world // cp, seq_length // (2 * cp)
    sequences = pack_sequences(lengths, seq_length)
    out = [[[] for _ in range(world)] for _ in range(-(-len(sequences) // dp))]
    for n, docs in enumerate(sequences):
        starts = np.cumsum([0] + [lengths[d] for d in docs])
        for r in range(cp):
            for lo, hi in ((r * chunk, (r + 1) * chunk), ((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)):
                for i in range(len(docs)):  # the documents this chunk overlaps, in their own coordinates
                    a, b = max(lo, starts[i]), min(hi, starts[i + 1])
                    if b > a:
                        out[n // dp][(n % dp) * cp + r].append((int(a - starts[i]), int(b - starts[i])))
    return out


def timed_attention_step(segments, heads: int = 4, head_dim: int = 64, repeats: int = 3) -> float:
    """Seconds of the modelled lockstep step with each rank's attention forward timed on this CPU, one rank at
    a time: the sum over microbatches of the slowest rank. A run of queries [a, b) of a document attends its
    keys [0, a) in full and [a, b) causally (two fused calls: the causal pairs exactly); each rank the best of
    ``repeats``; one thread (one rank's, whatever else the machine runs). No communication."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _timed_step(segments, heads, head_dim, repeats)
    finally:
        torch.set_num_threads(threads)


def _timed_step(segments, heads, head_dim, repeats):
    import time

    import torch
    import torch.nn.functional as F

    longest = max((b for row in segments for rank in row for _, b in rank), default=1)
    g = torch.Generator().manual_seed(0)
    q_all, k_all, v_all = (torch.randn(1, heads, longest, head_dim, generator=g) for _ in range(3))
    total = 0.0
    for row in segments:
        times = []
        for runs in row:
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for a, b in runs:
                    q = q_all[:, :, a:b]
                    F.scaled_dot_product_attention(q, k_all[:, :, a:b], v_all[:, :, a:b], is_causal=True)
                    if a:
                        F.scaled_dot_product_attention(q, k_all[:, :, :a], v_all[:, :, :a])
                best = min(best, time.perf_counter() - start)
            times.append(best)
        total += max(times)
    return total
