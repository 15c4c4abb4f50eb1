"""The pieces of ``tools/bench_dsa.py``: DeepSeek-V3.2's sparse attention (DSA) on the CP ring against dense
MLA causal ring attention on the same shapes, fwd + bwd; the ring bytes of each beside their formulas; the
query-key pairs each computes; and the memory the indexer's top-k allocates against megatron's dense scores.

**DSA** (`run_dsa`): the indexer's top-k (`cp_ext.attention.dsa.indexer.indexer_topk`: its keys go around the
ring, ``index_head_dim`` values per token, forward only: the selection is not differentiable), the query
absorbed into the latent's space, `cp_ext.attention.dsa.sparse_attention.sparse_attention` over the selected latents (the
latent ``[c | k_pe]`` goes around the ring, ``kv_lora_rank + qk_pos_emb_head_dim`` values per token, and
again in the backward with its fp32 gradient riding home), the output up-projected. The indexer loss (a
training-time extra) is not part of it.

**Dense** (`run_dense`), the same q, latent and ``linear_kv_up_proj`` weight, the same gradients at k >= s:
``latent``: `ring_attention(..., up_weight=)` (``--cp-mla-exchange latent``: the latent travels and every
block is up-projected where it is used); ``kv``: each rank up-projects its tokens to per-head K/V, which the
ring moves (megatron's path).

Bytes per rank (``e`` bytes per activation value, ``acc`` per fp32 accumulator value, C ranks, b, s_local)::

    DSA    fwd (C-1) b s_local (r + p + D) e          (latent + indexer key)
           bwd (C-1) b s_local (r + p) e + C b s_local (r + p) acc
    dense  `cp_ext.perf.comm.mla_exchange_bytes`: per token r + p (latent) or h (d_qk + p + d_v) (kv)

Memory (`allocation_peak`): every storage an op allocates inside the call while it lives (a
`TorchDispatchMode`, as `cp_ext.perf.saved_tensors.AttentionTransient`: a kernel's internal workspace is
not seen), and the process's resident high-water mark above its level at the start (``VmHWM``, reset
through ``/proc/self/clear_refs``; Linux only, None elsewhere). megatron-core 0.16.1's
``DSAIndexer._compute_index_scores`` builds ``einsum('sbhd,tbd->sbht', q.float(), k.float())``: a fp32
``[s, b, H, s]``, then ``relu`` and ``* weights`` each make a new one while the previous one is alive,
and the head sum a ``[s, b, s]`` (`megatron_index_scores_bytes`); under CP = 1 only (it asserts CP = 1).
"""

import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cp_ext.attention.cp.context_parallel import local_attention, ring_attention
from cp_ext.attention.dsa.indexer import indexer_topk
from cp_ext.attention.cp.ring import ring_positions
from cp_ext.attention.dsa.sparse_attention import absorb_query, sparse_attention, up_project_output
from cp_ext.perf.comm import DTYPE_BYTES, acc_bytes, mla_exchange_bytes
from cp_ext.perf.counter import count_comm, count_work

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
DENSE = ("latent", "kv")


# ----------------------------------------------------------------------------- formulas
def dsa_ring_bytes(*, b, s_local, cp, kv_lora_rank, qk_pos_emb_head_dim, index_head_dim, dtype):
    """Ring bytes sent per rank by one DSA attention call (indexer top-k + sparse attention), fwd and bwd."""
    if cp <= 1:
        return {"ring_p2p": {"fwd": 0, "bwd": 0}}
    latent = b * s_local * (kv_lora_rank + qk_pos_emb_head_dim)
    e, acc = DTYPE_BYTES[dtype], acc_bytes(dtype)
    return {"ring_p2p": {"fwd": (cp - 1) * (latent + b * s_local * index_head_dim) * e,
                         "bwd": (cp - 1) * latent * e + cp * latent * acc}}


def dense_ring_bytes(shape, cp, dtype, exchange):
    return {"ring_p2p": mla_exchange_bytes(b=shape["b"], h=shape["h"], s_local=shape["s_local"],
                                           qk_head_dim=shape["dn"], qk_pos_emb_head_dim=shape["p"],
                                           v_head_dim=shape["dv"], kv_lora_rank=shape["r"], cp=cp, dtype=dtype,
                                           exchange=exchange)["ring_p2p"]}


def megatron_index_scores_bytes(*, s, b, index_heads):
    """megatron-core 0.16.1's indexer scores at CP = 1: one fp32 [s, b, H, s] (``tensor``) and the peak of
    ``_compute_index_scores`` (two of them alive at once in ``relu`` and ``* weights``; ``peak``)."""
    one = s * b * index_heads * s * 4
    return {"tensor": one, "peak": 2 * one}


def macs_per_pair(shape):
    """Forward multiply-adds per query-key pair: dense per head (q.k over d_qk + p, p.v over d_v), DSA's
    MQA mode per head (q'.kv over r + p, p.c over r), the indexer (H heads of D, shared key)."""
    h = shape["h"]
    return {"dense": h * (shape["dn"] + shape["p"] + shape["dv"]), "sparse": h * (2 * shape["r"] + shape["p"]),
            "indexer": shape["index_heads"] * (shape["index_dim"] + 1)}


# ----------------------------------------------------------------------------- memory
class _Allocations(TorchDispatchMode):
    """Bytes of the storages the ops inside allocate, while they live, and their peak."""

    def __init__(self):
        super().__init__()
        self.storages, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                known = self.storages.get(ptr)
                if ptr and ptr not in inputs and (known is None or known[0].expired()):
                    self.storages[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.storages = {p: (r, n) for p, (r, n) in self.storages.items() if not r.expired()}
        self.peak = max(self.peak, sum(n for _, n in self.storages.values()))
        return out


def _status_kib(field):
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


@contextmanager
def allocation_peak():
    """``{"tensors": peak bytes of the storages allocated inside, "rss": VmHWM - VmRSS at entry (bytes) or
    None}``, filled when the block ends."""
    res = {}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        rss0 = _status_kib("VmRSS")
    except OSError:
        rss0 = None
    with _Allocations() as mode:
        yield res
    hwm = _status_kib("VmHWM")
    res["tensors"] = mode.peak
    res["rss"] = None if rss0 is None or hwm is None else (hwm - rss0) * 1024


# ----------------------------------------------------------------------------- the two calls
def make_inputs(shape, dtype, rank, seed=1):
    """This rank's q_nope, q_pe, latent, the indexer's q, w, k, the output grad, and the shared W_up."""
    s, b, h = shape["s_local"], shape["b"], shape["h"]
    dn, p, dv, r, hi, di = (shape[k] for k in ("dn", "p", "dv", "r", "index_heads", "index_dim"))
    g = torch.Generator().manual_seed(seed + rank)
    mk = lambda *size: torch.randn(*size, generator=g).to(dtype)  # noqa: E731
    x = dict(q_nope=mk(s, b, h, dn), q_pe=mk(s, b, h, p), latent=mk(s, b, r + p), index_q=mk(s, b, hi, di),
             index_w=mk(s, b, hi) * (hi ** -0.5 * di ** -0.5), index_k=mk(s, b, di), dout=mk(s, b, h, dv))
    x["w_up"] = (torch.randn(h * (dn + dv), r, generator=torch.Generator().manual_seed(seed)) * r ** -0.5).to(dtype)
    return x


def _leaves(x):
    return [x[k].detach().clone().requires_grad_() for k in ("q_nope", "q_pe", "latent", "w_up")]


def select(x, shape, *, topk, group, layout):
    """The indexer's top-k of this rank's queries (global key positions [b, s_local, k]), on the ring."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    positions = torch.tensor(ring_positions(shape["s_local"], rank, size, layout), dtype=torch.int64)
    return indexer_topk(x["index_q"], x["index_w"], x["index_k"], topk=topk, q_positions=positions, group=group,
                        layout=layout, mode="ring", query_tile=shape["index_query_tile"],
                        key_tile=shape["index_key_tile"])[0]


def indexer_memory(x, shape, *, topk, group, layout):
    """`allocation_peak` of one indexer top-k call (its result included)."""
    with allocation_peak() as peak:
        select(x, shape, topk=topk, group=group, layout=layout)
    return peak


def run_dsa(x, shape, *, topk, group, layout, timings=None, mark=None):
    """DSA fwd + bwd; returns the grads of (q_nope, q_pe, latent, w_up). ``timings``: a list the indexer's
    seconds are appended to; ``mark``: called between the forward and the backward."""
    q_nope, q_pe, latent, w_up = _leaves(x)
    t0 = time.perf_counter()
    selected = select(x, shape, topk=topk, group=group, layout=layout)
    if timings is not None:
        timings.append(time.perf_counter() - t0)
    q = absorb_query(q_nope, q_pe, w_up)
    out = sparse_attention(q, latent, selected, softmax_scale=shape["scale"], v_head_dim=shape["r"], group=group,
                           layout=layout, mode="ring")
    out = up_project_output(out, w_up, shape["dn"])
    if mark is not None:
        mark()
    out.backward(x["dout"])
    return q_nope.grad, q_pe.grad, latent.grad, w_up.grad


def run_dense(x, shape, *, exchange, group, layout, mark=None):
    """Dense MLA causal ring attention fwd + bwd (``exchange`` latent or kv); the grads as `run_dsa`.
    ``group`` None: one process, no process group, per-head K/V only (`local_attention`)."""
    if group is None and exchange != "kv":
        raise ValueError("dense MLA without a process group runs per-head K/V only (exchange='kv')")
    q_nope, q_pe, latent, w_up = _leaves(x)
    h, dn, dv, r = shape["h"], shape["dn"], shape["dv"], shape["r"]
    q = torch.cat([q_nope, q_pe], dim=-1)
    if exchange == "kv":
        kv = (latent[..., :r] @ w_up.t()).unflatten(-1, (h, dn + dv))
        k = torch.cat([kv[..., :dn], latent[..., None, r:].expand(-1, -1, h, -1)], -1)
        if group is None:
            out = local_attention(q, k, kv[..., dn:].contiguous(), causal=True, softmax_scale=shape["scale"])
        else:
            out = ring_attention(q, k, kv[..., dn:], causal=True, softmax_scale=shape["scale"], group=group,
                                 layout=layout)
    else:
        out = ring_attention(q, latent, None, up_weight=w_up, causal=True, softmax_scale=shape["scale"], group=group,
                             layout=layout)
    if mark is not None:
        mark()
    out.backward(x["dout"])
    return q_nope.grad, q_pe.grad, latent.grad, w_up.grad


def counting(fn, sink):
    """``fn(mark=)`` as a call that appends (ring bytes fwd + bwd, the forward's query-key pairs), counted at the
    call sites, and this process's CPU seconds to ``sink`` each time (the timed runs count themselves: a 32K run
    has no time for another; CPU seconds are the work's measure that a shared, oversubscribed box leaves alone)."""

    def call():
        pairs, cpu0 = [], time.process_time()
        with count_comm() as c, count_work() as w:
            fn(mark=lambda: pairs.append(w.bytes["pairs"]))
        sink.append({"bytes": c.bytes["ring_p2p"], "pairs": pairs[0], "cpu_s": time.process_time() - cpu0})

    return call


def max_grad_diff(a, b, group):
    """The largest difference of the gradients of two runs (W_up's summed over the ranks first)."""
    a, b = list(a), list(b)
    for g in (a[3], b[3]):
        dist.all_reduce(g, group=group)
    diff = torch.tensor(max((u - v).abs().max().item() for u, v in zip(a, b)), dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    return diff.item()


def median(xs):
    return statistics.median(xs)


def report(res):
    """Print the run's results (rank 0): times and their ratio, bytes beside the formulas, pairs, memory."""
    sh, t = res["shape"], res["times"]
    gib = 2 ** 30
    print(f"bench_dsa: C={res['C']} ring ({res['layout']}), s={res['s']} b={sh['b']}, {sh['h']} heads x "
          f"(d_qk {sh['dn']}+{sh['p']}, d_v {sh['dv']}), kv_lora_rank {sh['r']}, indexer {sh['index_heads']} heads x "
          f"{sh['index_dim']}, "
          f"top-{res['topk']}, {res['dtype']}; fwd + bwd; {res['reps']} interleaved reps (+{res['warmup']} warm-up), "
          f"slowest rank per rep; load avg {' '.join(res['load_avg'])}")
    for name, ts in t.items():
        print(f"  {name:13s} {median(ts):10.2f} s   per rep {' '.join(f'{v:.2f}' for v in ts)}")
    if res.get("indexer_s"):
        print(f"  of which the indexer's top-k {median(res['indexer_s']):.2f} s")
    for name, ratio in res["ratios"].items():
        print(f"  dsa / {name}: {ratio['median']:.3f} (median of paired reps: "
              f"{' '.join(f'{v:.3f}' for v in ratio['per_rep'])}); CPU seconds (all ranks) {ratio['cpu']:.3f}")
    print(f"  CPU seconds per call, all ranks: {' '.join(f'{n} {median(v):.1f}' for n, v in res['cpu_s'].items())}")
    print("ring bytes sent per rank (fwd + bwd), counted at the call sites vs formula:")
    for name, c in res["bytes"].items():
        print(f"  {name:13s} {c['counted']:>14d} (formula {c['formula']:>14d} = fwd {c['formula_fwd']} + bwd "
              f"{c['formula_bwd']}) {'match' if c['match'] else 'MISMATCH'}; values/token/hop fwd {c['per_token_fwd']}")
    w = res["work"]
    print(f"query-key pairs per rank (forward, counted): dense {w['dense_pairs']}, DSA sparse attention "
          f"{w['sparse_pairs']} (= {w['sparse_pairs'] / max(w['dense_pairs'], 1):.4f} of dense); forward "
          f"multiply-adds per pair {w['macs_per_pair']} -> DSA / dense forward MACs {w['fwd_macs_ratio']:.3f} "
          f"(indexer {w['indexer_share']:.3f} of it, scored as the causal pairs)")
    m = res["memory"]
    rss = "n/a" if m["rss"] is None else f"{m['rss'] / gib:.3f} GiB"
    print(f"indexer top-k, largest rank: tensors allocated peak {m['tensors'] / gib:.4f} GiB, resident high-water "
          f"{rss}; megatron-core 0.16.1's dense scores (CP = 1) [s, b, H, s] fp32 {m['megatron_tensor'] / gib:.2f} "
          f"GiB, peak {m['megatron_peak'] / gib:.2f} GiB -> {m['tensors'] / m['megatron_tensor']:.2e} of one")
    print(f"peak resident memory per rank (ru_maxrss, through the timed runs): "
          f"{' '.join(f'{v / gib:.2f}' for v in res['peak_rss'])} GiB")
    if res.get("check_diff") is not None:
        print(f"check: DSA at top-{res['s']} (every causal key) vs dense {res['check_against']}: max grad diff "
              f"{res['check_diff']:.2e}")
