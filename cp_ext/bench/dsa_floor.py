"""The pieces of ``tools/bench_dsa_floor.py``: DSA's indexer and sparse attention against their counted
floors (counted multiply-adds over this machine's GEMM rate on the same shapes), beside dense causal MLA,
at several s/k, at CP = 1 and on a CP ring.

**Counted work** (fp32 multiply-adds, forward + backward, per rank):

- the indexer's top-k: every causal (query, key) pair scored, ``H (D + 1)`` each (H heads of D and the
  head weights; forward only: the selection is not differentiable);
- the sparse attention in MQA mode: every selected pair, ``h (4 (r + p) + 3 r)``: the scores over the
  latent and the rope key (r + p) in the forward and again in the backward, dq and the key's gradient
  (r + p each), the values (r) in the forward, dp and the values' gradient (r each);
- dense causal MLA per head: every causal pair, ``h (4 (d_nope + p) + 3 d_v)``.

The projections around them (absorbing the query, up-projecting the output; dense's up-projected K/V)
are outside these counts and inside the totals' times.

**Floors**: an op's counted work over the best rate of a GEMM of its own shapes on this rank (one
thread), measured between the repetitions: the sparse attention's ``[UNION_ROWS, r + p] @ [r + p, k]``
(a tile's flattened queries against k keys), the indexer's ``[SCORE_ROWS, D] @ [D, key_tile]``, dense
MLA's ``[query tile h, d_nope + p] @ [d_nope + p, key tile]``. Time over floor is how far an op is from
running its counted work at GEMM speed.

**Selections.** The indexer's inputs decide how much consecutive queries' top-k overlap, which is what
the union path batches: ``independent`` draws every query's indexer query on its own (selections share
only chance keys: the worst case), ``overlapping`` gives every query the same indexer query plus
``--index-query-noise`` of its own (consecutive queries share most of their top-k, as the DSA paper's
locality and trained indexers' shared heavy keys make them). The report prints the overlap measured:
the pairs computed (the union tiles' and the gathered ones) over the selected ones, and the share of them in
union tiles.
"""

import statistics
import time

import torch
import torch.distributed as dist

from cp_ext.attention.dsa.indexer import DEFAULT_KEY_TILE, DEFAULT_QUERY_TILE, SCORE_ROWS, indexer_topk
from cp_ext.attention.dsa.sparse_attention import absorb_query, sparse_attention, up_project_output
from cp_ext.attention.dsa.sparse_tiles import UNION_ROWS
from cp_ext.attention.cp.ring import ring_positions
from cp_ext.bench.dsa import make_inputs, run_dense
from cp_ext.perf.counter import count_work


def counted_macs(shape, *, selected_pairs, causal_pairs):
    """Counted multiply-adds (module docstring) of the indexer, the sparse attention and dense MLA."""
    h, r, p = shape["h"], shape["r"], shape["p"]
    return {"indexer": causal_pairs * shape["index_heads"] * (shape["index_dim"] + 1),
            "sparse": selected_pairs * h * (4 * (r + p) + 3 * r),
            "dense": causal_pairs * h * (4 * (shape["dn"] + p) + 3 * shape["dv"])}


def gemm_shapes(shape, topk, key_tile):
    """(M, K, N) of each op's GEMM (module docstring)."""
    h, dqk = shape["h"], shape["dn"] + shape["p"]
    return {"sparse": (max(UNION_ROWS // h, 1) * h, shape["r"] + shape["p"], topk),
            "indexer": (max(SCORE_ROWS // shape["index_heads"], 1) * shape["index_heads"], shape["index_dim"],
                        key_tile),
            "dense": (2048, dqk, 2048)}


def gemm_rate(m, k, n, reps=3, device="cpu"):
    """Best multiply-adds per second of an fp32 ``[m, k] @ [k, n]`` on this process, over ``reps`` runs."""
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b
    best = float("inf")
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return m * k * n / best


def causal_pairs_here(positions):
    """The causal (query, key) pairs of the queries at ``positions``: sum of (position + 1)."""
    return int((positions + 1).sum())


def overlap_inputs(x, shape, noise, seed=7):
    """The indexer queries and head weights of ``x`` replaced by one shared query (weight) per head plus
    ``noise`` times each token's own (the same shared ones on every rank)."""
    g = torch.Generator().manual_seed(seed)
    shared_q = torch.randn(1, 1, shape["index_heads"], shape["index_dim"], generator=g)
    shared_w = torch.randn(1, 1, shape["index_heads"], generator=g) * x["index_w"].std()
    x["index_q"] = (shared_q + noise * x["index_q"]).to(x["index_q"].dtype)
    x["index_w"] = (shared_w + noise * x["index_w"]).to(x["index_w"].dtype)
    return x


class Case:
    """One (s, k, CP) point: this rank's inputs and the timed calls. ``group`` None: one process, no
    process group (the GPU check's timing row; dense then runs per-head K/V only)."""

    def __init__(self, shape, *, s, topk, group, layout="zigzag", selection="overlapping", noise=0.2,
                 key_tile=DEFAULT_KEY_TILE, query_tile=DEFAULT_QUERY_TILE, path="auto", device="cpu"):
        self.shape, self.topk, self.group, self.layout, self.path = shape, topk, group, layout, path
        size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        self.s_local = s // size
        self.sh = dict(shape, s_local=self.s_local)
        self.x = make_inputs(self.sh, torch.float32, rank)
        if selection == "overlapping":
            overlap_inputs(self.x, self.sh, noise)
        self.x = {k: v.to(device) for k, v in self.x.items()}
        self.positions = torch.tensor(ring_positions(self.s_local, rank, size, layout) if size > 1 else
                                      range(s), dtype=torch.int64, device=device)
        self.key_tile, self.query_tile = key_tile, query_tile
        self.selected = self.select()
        self.q = absorb_query(self.x["q_nope"], self.x["q_pe"], self.x["w_up"]).detach()
        self.dout_latent = torch.randn(self.q.shape[:3] + (shape["r"],),
                                       generator=torch.Generator().manual_seed(3)).to(device)

    def select(self):
        x = self.x
        return indexer_topk(x["index_q"], x["index_w"], x["index_k"], topk=self.topk, q_positions=self.positions,
                            group=self.group, layout=self.layout, mode="ring", key_tile=self.key_tile,
                            query_tile=self.query_tile)[0]

    def sparse(self):
        q = self.q.clone().requires_grad_()
        latent = self.x["latent"].detach().clone().requires_grad_()
        out = sparse_attention(q, latent, self.selected, softmax_scale=self.sh["scale"], v_head_dim=self.sh["r"],
                               group=self.group, layout=self.layout, mode="ring", path=self.path)
        out.backward(self.dout_latent)

    def dsa(self):
        """The whole layer core: indexer, absorbed query, sparse attention, up-projection, backward."""
        leaves = [self.x[k].detach().clone().requires_grad_() for k in ("q_nope", "q_pe", "latent", "w_up")]
        q_nope, q_pe, latent, w_up = leaves
        selected = self.select()
        out = sparse_attention(absorb_query(q_nope, q_pe, w_up), latent, selected, softmax_scale=self.sh["scale"],
                               v_head_dim=self.sh["r"], group=self.group, layout=self.layout, mode="ring",
                               path=self.path)
        up_project_output(out, w_up, self.sh["dn"]).backward(self.x["dout"])
        return [t.grad for t in leaves]

    def dense(self, exchange):
        return list(run_dense(self.x, self.sh, exchange=exchange, group=self.group, layout=self.layout))

    def counts(self):
        """Selected and union pairs of this rank's sparse attention, and its queries' causal pairs."""
        with count_work() as w:
            sparse_attention(self.q, self.x["latent"], self.selected, softmax_scale=self.sh["scale"],
                             v_head_dim=self.sh["r"], group=self.group, layout=self.layout, mode="ring",
                             path=self.path)
        return {"selected": w.bytes["pairs"], "union": w.bytes.get("union_pairs", 0),
                "computed": w.bytes.get("union_pairs", 0) + w.bytes.get("gather_pairs", 0),
                "causal": causal_pairs_here(self.positions) * self.sh["b"]}


def time_case(case, names, reps, rates_shapes):
    """{name: best seconds over ``reps`` (slowest rank per rep)}, and {op: best GEMM rate over the reps},
    interleaved: every call once per repetition, each after a barrier, and the GEMM rates between them."""
    times = {n: [] for n in names}
    rates = {op: [] for op in rates_shapes}
    calls = {"indexer": case.select, "sparse": case.sparse, "dsa": case.dsa,
             "dense_latent": lambda: case.dense("latent"), "dense_kv": lambda: case.dense("kv")}
    for _ in range(reps):
        for op, mkn in rates_shapes.items():
            rates[op].append(gemm_rate(*mkn))
        for n in names:
            dist.barrier()
            t0 = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - t0)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times, rates))
    worst = {n: [max(g[0][n][i] for g in gathered) for i in range(reps)] for n in names}
    slowest_rate = {op: [min(g[1][op][i] for g in gathered) for i in range(reps)] for op in rates}
    return {n: min(v) for n, v in worst.items()}, {op: max(v) for op, v in slowest_rate.items()}, worst


def median(xs):
    return statistics.median(xs)


def time_single_device(device, *, s, topk, heads, index_heads, reps=2):
    """One device, no process group (tools/gpu_check.py's DSA timing row): the best of ``reps`` of the
    indexer's top-k, the sparse attention alone, DSA's layer core and dense causal MLA with per-head K/V
    (fwd + bwd each), with the GEMM rate on the sparse attention's shapes and the counted floors."""
    shape = dict(b=1, h=heads, dn=128, p=64, dv=128, r=512, index_heads=index_heads, index_dim=128, scale=192 ** -0.5)
    case = Case(shape, s=s, topk=topk, group=None, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    calls = {"indexer": case.select, "sparse": case.sparse, "dsa": case.dsa, "dense": lambda: case.dense("kv")}
    best = {}
    for name, fn in calls.items():
        fn()  # warm-up
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    counts = case.counts()
    macs = counted_macs(shape, selected_pairs=counts["selected"], causal_pairs=counts["causal"])
    m, k, n = gemm_shapes(shape, topk, DEFAULT_KEY_TILE)["sparse"]
    rate = gemm_rate(m, k, n, device=device)
    finite = all(bool(t.isfinite().all()) for t in case.dense("kv") + case.dsa())
    return {"device": str(device), "s": s, "topk": topk, "heads": heads, "seconds": best, "gemm_macs_per_s": rate,
            "counted_macs": macs, "sparse_over_floor": best["sparse"] / (macs["sparse"] / rate),
            "dsa_over_dense": best["dsa"] / best["dense"],
            "counted_dsa_over_dense": (macs["sparse"] + macs["indexer"]) / macs["dense"], "finite": finite}
