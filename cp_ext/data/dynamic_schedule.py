"""Dynamic context parallelism's plan for one global batch: which DP x CP ranks run each document, in which
microbatch, at which CP size (Megatron-LM's ``--dynamic-context-parallel``, called "hybrid context
parallel" in megatron-core 0.16-0.19). Pure Python: the same plan on every rank from the same lengths.

    sizes = group_sizes(world=8)                                   # 1, 2, 4, 8: every divisor
    plan = balanced_schedule(lengths, world=8, max_tokens_per_rank=4096, sizes=sizes, cost=CostModel(64.0))
    plan.microbatches[k].groups[j]   # Group(first=4, size=2, documents=[3, 9]): ranks 4 and 5 run 3 and 9 at CP2

The invariants megatron's dev-branch scheduler (``DefaultDynamicCPScheduler``) keeps, so that ranks stay in
step for the collectives outside a group (expert parallelism's all-to-all, the pipeline):

* every rank runs the same number of microbatches, and in each it belongs to one group (or none: idle);
* a group is an aligned block of ``size`` ranks, ``first % size == 0``, so its process group exists ahead
  of time (`group_sizes`), and a document is split over its group only;
* a rank holds at most ``max_tokens_per_rank`` tokens in a microbatch (each document gives it L / size).

The cost of a document of L tokens on a group of c ranks, per rank, is its causal attention (L (L + 1) / 2
query-key pairs; a per-document zigzag gives every rank of the group the same share) plus a linear part for
everything else (``per_token`` pairs' worth of work per token), over c: `CostModel.work`.

``balanced_schedule`` (cp_ext's) balances that cost over ranks within every microbatch (longest-processing-
time first over all microbatches at once, each document on the smallest group size that divides the ranks and
holds it, between the fewest microbatches the token budget allows and twice that), then lets groups with idle
ranks beside them grow onto them where that lowers their ranks' work. `megatron_schedule` is megatron's
dev-branch algorithm (power-of-two sizes, cost L^2 / c only, one microbatch at a time), re-implemented for the
comparison: the megatron-core releases cp_ext supports (0.16-0.19) ship only V1's per-document schedule.
On Megatron's example mix (lognormal mean 1024, sigma 1.5, 128-8192 tokens, M 2048) under this module's cost
with per_token 512 and exchange 256, the modelled step against every document at full CP: 4 ranks cp_ext 1.18,
megatron's 1.16; 8 ranks 1.54 and 1.50 (16 ranks on a 1K-128K mix: 1.15 and 1.20, where megatron's is ahead).
The runtime: `cp_ext.training.dynamic_batches` (docs/dynamic_cp.md); the benchmark: `cp_ext.bench.dynamic_cp`
(``tools/bench_dynamic_cp.py``).
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from cp_ext.errors import ConfigError


@dataclass(frozen=True)
class CostModel:
    """A document's work per rank in units of one query-key pair's: its causal attention and ``per_token``
    pairs' worth per token for the rest of the layer, over the group's ranks; and, for c > 1, the exchange:
    each rank passes (c - 1) / c of the document's K/V (``exchange_per_token`` pairs' worth per token)."""

    per_token: float = 0.0
    exchange_per_token: float = 0.0

    def work(self, length: int, size: int) -> float:
        compute = (length * (length + 1) / 2 + self.per_token * length) / size
        return compute + self.exchange_per_token * length * (size - 1) / size


@dataclass
class Group:
    """``size`` ranks from ``first`` (aligned) running ``documents`` (indices into the lengths) together."""

    first: int
    size: int
    documents: List[int] = field(default_factory=list)
    tokens: int = 0

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.size)


@dataclass
class Microbatch:
    groups: List[Group] = field(default_factory=list)

    def group_of(self, rank: int) -> Optional[Group]:
        return next((g for g in self.groups if rank in g.ranks), None)


@dataclass
class Schedule:
    world: int
    lengths: List[int]
    microbatches: List[Microbatch]

    def rank_work(self, cost: CostModel) -> List[List[float]]:
        """[microbatch][rank]: each rank's work (idle: 0)."""
        out = []
        for mb in self.microbatches:
            row = [0.0] * self.world
            for g in mb.groups:
                for r in g.ranks:
                    row[r] += sum(cost.work(self.lengths[d], g.size) for d in g.documents)
            out.append(row)
        return out

    def sizes_used(self) -> dict:
        """{CP size: documents run at it}."""
        out = {}
        for mb in self.microbatches:
            for g in mb.groups:
                out[g.size] = out.get(g.size, 0) + len(g.documents)
        return dict(sorted(out.items()))


def group_sizes(world: int, min_size: int = 1, power_of_two: bool = False) -> List[int]:
    """The CP group sizes a run can use over ``world`` DP x CP ranks: every divisor of it from ``min_size``
    (``--min-dynamic-context-parallel-size``), or only powers of two (megatron's)."""
    sizes = [c for c in range(1, world + 1) if world % c == 0 and c >= min_size]
    return [c for c in sizes if c & (c - 1) == 0] if power_of_two else sizes


def size_needed(length: int, max_tokens_per_rank: int, sizes: Sequence[int], index: Optional[int] = None) -> int:
    """The smallest group size whose ranks can hold a document of ``length`` tokens."""
    for c in sizes:
        if math.ceil(length / c) <= max_tokens_per_rank:
            return c
    which = f"document {index} " if index is not None else "a document "
    raise ConfigError(f"{which}has {length} tokens, more than the {max(sizes)} ranks' --max-seqlen-per-dp-cp-rank "
                      f"{max_tokens_per_rank} hold ({max(sizes) * max_tokens_per_rank}); raise "
                      f"--max-seqlen-per-dp-cp-rank or use more ranks")


class _Placer:
    """Microbatches being filled: per rank its work and its group in each."""

    def __init__(self, world, max_tokens_per_rank, cost, lengths):
        self.world, self.budget, self.cost, self.lengths = world, max_tokens_per_rank, cost, lengths
        self.microbatches: List[Microbatch] = []
        self.load: List[List[float]] = []
        self.owner: List[List[Optional[Group]]] = []

    def add_microbatch(self):
        self.microbatches.append(Microbatch())
        self.load.append([0.0] * self.world)
        self.owner.append([None] * self.world)

    def candidates(self, k, length, sizes):
        """(group or None, first, size) where the document could go in microbatch k."""
        for c in sizes:
            if math.ceil(length / c) > self.budget:
                continue
            for g in self.microbatches[k].groups:
                if g.size == c and math.ceil((g.tokens + length) / c) <= self.budget:
                    yield g, g.first, c
            for first in range(0, self.world, c):
                if all(self.owner[k][r] is None for r in range(first, first + c)):
                    yield None, first, c

    def place(self, k, doc, group, first, size):
        length = self.lengths[doc]
        if group is None:
            group = Group(first, size)
            self.microbatches[k].groups.append(group)
            for r in group.ranks:
                self.owner[k][r] = group
        group.documents.append(doc)
        group.tokens += length
        for r in group.ranks:
            self.load[k][r] += self.cost.work(length, size)


def balanced_schedule(lengths: Sequence[int], world: int, max_tokens_per_rank: int, sizes: Sequence[int],
                      cost: CostModel = CostModel(), min_microbatches: int = 1) -> Schedule:
    """cp_ext's scheduler (module doc): the fewest microbatches the token budget allows, each document placed
    longest first where it raises its microbatch's most loaded rank least (ties: the smaller group, then the
    earlier microbatch), then idle ranks taken by the neighbouring groups."""
    lengths = list(lengths)
    needed = [size_needed(n, max_tokens_per_rank, sizes, i) for i, n in enumerate(lengths)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    k_min = max(min_microbatches, math.ceil(sum(lengths) / (world * max_tokens_per_rank)), 1)
    best = None
    # The fewest microbatches pack every one full, so long documents drag the short ones into their large
    # groups; more microbatches let short documents run on small groups of their own. Up to twice the
    # fewest are tried; the plan with the least step time (the sum of the microbatches' most loaded ranks:
    # ranks meet at every microbatch's collectives outside a group) wins, the fewer microbatches on a tie.
    for k_count in range(k_min, min(2 * k_min, len(lengths)) + 1):
        placer = _Placer(world, max_tokens_per_rank, cost, lengths)
        for _ in range(k_count):
            placer.add_microbatch()
        # each document on the smallest group that holds it (the least exchange; a larger one only where that
        # cannot be placed), then groups grow onto the ranks left idle
        if not all(_place_best(placer, doc, [needed[doc]])
                   or _place_best(placer, doc, [c for c in sizes if c > needed[doc]]) for doc in order):
            continue
        for k in range(k_count):
            _grow_into_idle_ranks(placer, k, sizes)
        step = sum(max(row) for row in placer.load)
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, placer.microbatches)
    if best is None:  # only with more microbatches than documents could ask: one document each always fits
        return balanced_schedule(lengths, world, max_tokens_per_rank, sizes, cost, len(lengths))
    return Schedule(world, lengths, best[1])


def _place_best(placer, doc, sizes) -> bool:
    length = placer.lengths[doc]
    best = None
    for k in range(len(placer.microbatches)):
        makespan = max(placer.load[k])
        for group, first, c in placer.candidates(k, length, sizes):
            after = max(placer.load[k][r] for r in range(first, first + c)) + placer.cost.work(length, c)
            key = (max(after, makespan) - makespan, c, after, k, first)  # no worse makespan: the smaller group
            if best is None or key < best[0]:
                best = (key, k, group, first, c)
    if best is None:
        return False
    _, k, group, first, c = best
    placer.place(k, doc, group, first, c)
    return True


def _grow_into_idle_ranks(placer, k, sizes):
    """While some group of microbatch k can double into an aligned block of idle ranks (any larger size that
    contains its block), grow the most loaded such group: the same documents over more ranks."""
    mb = placer.microbatches[k]
    while True:
        options = []
        for g in mb.groups:
            for c in sizes:
                if c <= g.size or c % g.size:
                    continue
                first = g.first - g.first % c
                block = range(first, first + c)
                if all(placer.owner[k][r] in (None, g) for r in block):
                    options.append((placer.load[k][g.first], g, first, c))
                    break
        # worth it only where the group's ranks then work less, the exchange included
        options = [o for o in options
                   if sum(placer.cost.work(placer.lengths[d], o[3]) for d in o[1].documents) < o[0]]
        if not options:
            return
        _, g, first, c = max(options, key=lambda o: (o[0], -o[1].first))
        if math.ceil(g.tokens / c) > placer.budget:  # never: a larger group holds fewer tokens per rank
            return
        for r in g.ranks:
            placer.load[k][r] = 0.0
            placer.owner[k][r] = None
        g.first, g.size = first, c
        for r in g.ranks:
            placer.owner[k][r] = g
            placer.load[k][r] = sum(placer.cost.work(placer.lengths[d], c) for d in g.documents)


def megatron_schedule(lengths: Sequence[int], world: int, max_tokens_per_rank: int, min_size: int = 1,
                      delta: float = 0.05) -> Schedule:
    """megatron's dynamic-CP plan, for comparison: Megatron-LM dev's ``DefaultDynamicCPScheduler``
    (``next_hdp_group_packing_aware``, megatron/core/datasets/data_schedule_utils.py), re-implemented here as its
    source reads; the supported megatron-core releases do not ship it. One microbatch at a time: the longest
    remaining document opens it on ranks [0, c) with c its power of two (``2 ** ceil(log2(L / M))``, at least
    ``min_size``); each next one, longest first, takes the placement among its size and every larger power of
    two (joining a group of that size with token room, or a new group on the first free ranks) that keeps the
    microbatch's most loaded rank lowest, cost L^2 / c, if that stays within (1 + delta) x longest x M; the
    rest wait for the next microbatch. Idle ranks: the first smallest group doubles onto them (the groups
    after it shift), or, failing that, the microbatch becomes one group of all ranks."""
    sizes = group_sizes(world, min_size, power_of_two=True)
    for i, n in enumerate(lengths):
        size_needed(n, max_tokens_per_rank, sizes, i)

    def needed(n):
        return max(min_size, 2 ** max(0, math.ceil(math.log2(n / max_tokens_per_rank))))

    remaining = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable, as Python's sorted is there
    microbatches = []
    while remaining:
        groups, remaining = _megatron_microbatch(lengths, remaining, world, max_tokens_per_rank, needed, delta)
        microbatches.append(Microbatch(groups))
    return Schedule(world, list(lengths), microbatches)


def _megatron_microbatch(lengths, order, world, budget, needed, delta):
    work = lambda n, c: n * n / c  # noqa: E731
    cap = lengths[order[0]] * budget * (1 + delta)
    members, docs, packed = [], [], []  # per group: ranks (ascending), documents, tokens per rank
    exec_times, owner = [0.0] * world, [None] * world

    def add(g, doc, c):
        docs[g].append(doc)
        packed[g] += lengths[doc] / c
        for r in members[g]:
            exec_times[r] += work(lengths[doc], c)

    def new(ranks, doc, c):
        members.append(list(ranks)), docs.append([]), packed.append(0.0)
        for r in ranks:
            owner[r] = len(members) - 1
        add(len(members) - 1, doc, c)

    new(range(needed(lengths[order[0]])), order[0], needed(lengths[order[0]]))
    leftovers = []
    for doc in order[1:]:
        n, best, c = lengths[doc], None, needed(lengths[doc])
        while c <= world:
            for g in range(len(members)):
                if len(members[g]) == c and packed[g] + n / c <= budget:
                    proj = max(t + (work(n, c) if owner[r] == g else 0.0) for r, t in enumerate(exec_times))
                    if proj <= cap and (best is None or proj < best[0]):
                        best = (proj, c, g, None)
            free = [r for r in range(world) if owner[r] is None]
            if len(free) >= c:
                chosen = sorted(free, key=lambda r: exec_times[r])[:c]
                proj = max(t + (work(n, c) if r in chosen else 0.0) for r, t in enumerate(exec_times))
                if proj <= cap and (best is None or proj < best[0]):
                    best = (proj, c, None, chosen)
            c *= 2
        if best is None:
            leftovers.append(doc)
        elif best[2] is not None:
            add(best[2], doc, best[1])
        else:
            new(best[3], doc, best[1])
    while any(o is None for o in owner):
        if not _megatron_double_smallest(members, owner, world):
            selected, tokens, leftovers = [], 0.0, []
            for doc in order:  # megatron's fallback: the microbatch as one group of all ranks
                if tokens + lengths[doc] / world <= budget:
                    selected.append(doc)
                    tokens += lengths[doc] / world
                else:
                    leftovers.append(doc)
            return [Group(0, world, selected, sum(lengths[d] for d in selected))], leftovers
    groups = [Group(m[0], len(m), d, sum(lengths[x] for x in d)) for m, d in zip(members, docs)]
    return sorted(groups, key=lambda g: g.first), leftovers


def _megatron_double_smallest(members, owner, world) -> bool:
    """megatron's ``fill_empty_gpus_once``: the first group of the smallest size doubles (to at most all ranks),
    the groups after it move up by what it took; idle ranks are the tail."""
    empty = owner.index(None)
    smallest = min(len(m) for m in members)
    grow = min(2 * smallest, world) - smallest
    for g, m in enumerate(members):
        if len(m) != smallest or m[-1] + 1 > empty or m[-1] + grow >= world:
            continue
        end = m[-1]
        for other in members:
            if other is not m and min(other) > end:
                other[:] = [r + grow for r in other]
        m[:] = list(range(m[0], end + grow + 1))
        owner[:] = [None] * world
        for gi, mm in enumerate(members):
            for r in mm:
                owner[r] = gi
        return True
    return False
