"""Sliding windows, attention sinks and MLA's head dims on every CP type, against float64 truth.

Worker (4 gloo ranks, one launch): every case draws seeded full-sequence q, k, v, dout and a sink
``offset`` [h]; the float64 truth is explicit attention with the case's mask (causal, the window
``i - left <= j <= i + right``, documents) and the sink as one more logit per row with value 0,
differentiated by autograd (out, dq, dk, dv and d offset). The single-device fp32 references: the
same explicit attention in fp32 in two summation orders, and cp_ext's CP = 1 path (`local_attention`,
the CPU kernel with the mask: its blocked online softmax rounds more than the explicit one, and a
CP variant is held to the single device it replaces); the larger error of the three sets the scale,
and the CP = 1 path itself must stay within 1e-5. Each variant runs on its shard:

* ring 2 (the pairs [0, 1], [2, 3]) and ring 4, zigzag and contiguous;
* Ulysses 4 and 2, the hybrid U2 x R2, all-gather over 4 ranks (zigzag positions);
* the recompute pair (`cp_attention_forward` kept, `cp_attention_backward` replayed).

Bounds, per tensor, max over ranks (`tests.attention.reference`): fp32 max error <= 2 x the
single-device fp32 error + 1 ulp + (T - 1) u G, G the merge sensitivity of the case's own mask and
T = 2 per ring step (a q run against the block's two k runs), 2 per all-gather rank, 1 for
Ulysses. A windowed strip splits into up to 3 blocks (masked edge, full middle, causal edge), so a
row may merge more partial results than T counts: the bound is that much stricter than first order;
RMS <= 1.5 x the single-device RMS; and <= 1e-5. The sink's gradient: the max bound alone (h values).

Also here: a window, a sink and each of the three head-dim pairs change the output (none is
silently dropped), a row that sees nothing but the sink gives 0 and no NaN, and the ring sends
a block only as far as a window reaches.
"""

import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.reference import (  # noqa: E402
    FP32_ABS, FP32_ULP, RMS_FACTOR, U, explicit_attention, full_mask, init_four_ranks, sample_document_ids,
)
from tests.launch import case_params, launch, selected, worker_args, write_results  # noqa: E402

NPROC = 4
GRADS = ("out", "dq", "dk", "dv", "doffset")


def _case(via, *, causal=True, window=None, sink=False, docs=False, h=4, hk=2, d=32, dv=None, s=32, layout="zigzag"):
    parts = [via, layout if via.startswith("ring") else "", "causal" if causal else "full",
             f"w{window[0]}_{window[1]}" if window else "", "sink" if sink else "", "docs" if docs else "",
             f"h{h}kv{hk}", f"d{d}" + (f"v{dv}" if dv else ""), f"s{s}"]
    return dict(via=via, causal=causal, window=window, sink=sink, docs=docs, h=h, hk=hk, d=d, dv=dv or d, s=s,
                layout=layout, name="-".join(p for p in parts if p))


def _cases():
    cases = []
    for via in ("ring2", "ring4", "ulysses4", "hybrid", "all_gather"):
        cases += [
            _case(via, window=(3, 0)),                        # smaller than a chunk (s 32 over ring 4: chunks of 4)
            _case(via, window=(13, 0), sink=True),            # spans several ranks, with a sink
            _case(via, causal=False, window=(5, 7)),          # two-sided
            _case(via, window=(64, 0), hk=1),                 # larger than the sequence; KV heads < U
            _case(via, sink=True, h=4, hk=4),                 # sink alone, MHA
            _case(via, sink=True, docs=True, window=(6, 0)),  # sink, window and documents together
            _case(via, d=72, dv=40, window=(9, 0)),           # an odd pair of head dims
        ]
    cases += [
        _case("ring4", layout="contiguous", window=(5, 0), sink=True),
        _case("ring2", layout="contiguous", causal=False, window=(2, 9), docs=True),
        _case("ulysses2", window=(4, 0), sink=True, hk=1),
        _case("hybrid", d=192, dv=128, sink=True, s=16),      # MLA's 192 / 128
        _case("ring4", d=192, dv=128, window=(5, 0), s=16),
        _case("kept", window=(7, 0), sink=True),              # the recompute pair, U2 x R2
        _case("kept_ag", window=(7, 0), sink=True, docs=True),
        # long enough for the row strips of a narrow band (cp_ext.attention.masks.tiles._band_block)
        _case("ring2", window=(40, 0), sink=True, h=2, hk=1, d=16, s=1024),
        _case("all_gather", window=(100, 0), h=2, d=16, s=1024),
        _case("ulysses4", window=(30, 0), d=16, s=512),
        _case("hybrid", causal=False, window=(20, 30), docs=True, d=16, s=512),
        # wide enough for window-sized strips: mirrored causal squares, unmasked middles, causal squares
        _case("ring4", layout="contiguous", window=(96, 0), sink=True, h=2, hk=1, d=16, s=1024),
        _case("ring2", causal=False, window=(70, 90), d=16, s=512),
    ]
    return cases


CASES = _cases()


def _variant(case, groups, rank):
    """(attention on this rank's shard, its positions, the merges T a row makes)."""
    import torch.distributed as dist

    from cp_ext.attention import all_gather_attention, hybrid_attention, ring_attention, ulysses_attention
    from cp_ext.token_partition import context_parallel_positions

    via, s, kw = case["via"], case["s"], dict(causal=case["causal"], window_size=case["window"])
    if via.startswith("ring"):
        g = groups[int(via[4:])]
        n = dist.get_world_size(g)
        pos = context_parallel_positions(s, ring_rank=dist.get_rank(g), ring_size=n, layout=case["layout"])
        return (lambda q, k, v, o, ids: ring_attention(q, k, v, group=g, layout=case["layout"], document_ids=ids,
                                                       softmax_offset=o, **kw)), pos, 2 * n
    if via.startswith("ulysses"):
        g = groups[int(via[7:])]
        pos = context_parallel_positions(s, ring_rank=0, ring_size=1, ulysses_rank=dist.get_rank(g),
                                         ulysses_size=dist.get_world_size(g))
        return (lambda q, k, v, o, ids: ulysses_attention(q, k, v, group=g, document_ids=ids, softmax_offset=o,
                                                          **kw)), pos, 1
    if via in ("hybrid", "kept"):
        ug, rg = groups["u2"], groups["r2"]
        pos = context_parallel_positions(s, ring_rank=dist.get_rank(rg), ring_size=2, ulysses_rank=dist.get_rank(ug),
                                         ulysses_size=2)
        if via == "kept":
            return (lambda q, k, v, o, ids: _kept(q, k, v, o, ids, case, ug, rg, None)), pos, 4
        return (lambda q, k, v, o, ids: hybrid_attention(q, k, v, ulysses_group=ug, ring_group=rg, document_ids=ids,
                                                         softmax_offset=o, **kw)), pos, 4
    pos = context_parallel_positions(s, ring_rank=rank, ring_size=4)
    if via == "kept_ag":
        return (lambda q, k, v, o, ids: _kept(q, k, v, o, ids, case, None, None, pos)), pos, 8
    return (lambda q, k, v, o, ids: all_gather_attention(q, k, v, group=dist.group.WORLD, positions=pos,
                                                         document_ids=ids, softmax_offset=o, **kw)), pos, 8


def _kept(q, k, v, offset, ids, case, ug, rg, positions):
    """CP-aware recompute's pair: the forward kept (no autograd), the backward replayed from it."""
    from cp_ext.attention.cp.context_parallel import cp_attention_forward
    from cp_ext.transformer.recompute import ReplayAttention

    kwargs = dict(causal=case["causal"], softmax_scale=q.shape[-1] ** -0.5, ulysses_group=ug, ring_group=rg,
                  layout="zigzag", document_ids=ids, window_size=case["window"])
    if positions is not None:
        import torch.distributed as dist

        kwargs.update(comm_type="all_gather", all_gather_group=dist.group.WORLD, positions=positions)
    out, lse, plan = cp_attention_forward(q, k, v, softmax_offset=offset, **kwargs)
    return ReplayAttention.apply(q, k, v, offset, out, lse, plan)


def _measure(case, groups, rank):
    import torch

    b, s, h, hk, d, dv = 2, case["s"], case["h"], case["hk"], case["d"], case["dv"]
    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q = torch.randn(s, b, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(s, b, hk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(s, b, hk, dv, generator=gen, dtype=torch.float64)
    dout = torch.randn(s, b, h, dv, generator=gen, dtype=torch.float64)
    offset = torch.randn(h, generator=gen, dtype=torch.float64) + 1.0 if case["sink"] else None
    mask, scale = full_mask(case, b, s), d ** -0.5

    def run(fn, dtype, perm=None, shard=lambda x: x):
        xs = [x.to(dtype) for x in (q, k, v, dout)]
        if perm is not None:  # another summation order: permuted head dims, results permuted back
            xs = [xs[0][..., perm[0]], xs[1][..., perm[0]], xs[2][..., perm[1]], xs[3][..., perm[1]]]
        ins = [x.detach().requires_grad_() for x in xs[:3]]
        off = None if offset is None else offset.to(dtype).detach().requires_grad_()
        out = fn(*ins, off)
        out.backward(shard(xs[3]))
        got = [out.detach(), ins[0].grad, ins[1].grad, ins[2].grad]
        if perm is not None:
            inv = [torch.argsort(p) for p in perm]
            got = [got[0][..., inv[1]], got[1][..., inv[0]], got[2][..., inv[0]], got[3][..., inv[1]]]
        return [x.double() for x in got] + [None if off is None else off.grad.double()]

    truth = run(lambda q_, k_, v_, o_: explicit_attention(q_, k_, v_, o_, mask, scale), torch.float64)
    gen2 = torch.Generator().manual_seed(7)
    perm = (torch.randperm(d, generator=gen2), torch.randperm(dv, generator=gen2))
    refs = [run(lambda q_, k_, v_, o_: explicit_attention(q_, k_, v_, o_, mask, scale), torch.float32, p)
            for p in (None, perm)]
    # cp_ext's own single-device path (CP = 1: the CPU kernel with the mask) is a single device too
    from cp_ext.attention import local_attention

    full_ids = sample_document_ids(b, s) if case["docs"] else None
    refs.append(run(lambda q_, k_, v_, o_: local_attention(q_, k_, v_, causal=case["causal"], window_size=case["window"],
                                                           document_ids=full_ids, softmax_offset=o_), torch.float32))
    attn, pos, merges = _variant(case, groups, rank)
    ids = sample_document_ids(b, s)[:, pos] if case["docs"] else None
    sh = lambda x: x.index_select(0, pos)  # noqa: E731
    got = run(lambda q_, k_, v_, o_: attn(sh(q_), sh(k_), sh(v_), o_, ids), torch.float32, shard=sh)
    if got[4] is not None:  # each rank holds its share of the sink's gradient: the group's sum is the whole
        import torch.distributed as dist

        share = got[4].clone()
        dist.all_reduce(share, group=groups[2] if case["via"] in ("ring2", "ulysses2") else None)
        got[4] = share
    # run() fed the shard function full tensors: its grads are full-size with zeros off this shard
    res = {"merges": merges, "err": {}, "ref_err": {}, "ref_rms": {}, "sq_err": {}, "numel": {}, "max_truth": {}}
    for i, t in enumerate(GRADS):
        if truth[i] is None:
            continue
        tr, g = truth[i], got[i]
        if t == "out":  # the variant's output is this shard's rows
            tr = sh(tr)
            ref_e = [sh(r[i]) - tr for r in refs]
        elif t == "doffset":
            ref_e = [r[i] - tr for r in refs]
        else:
            g, tr = sh(g), sh(tr)
            ref_e = [sh(r[i]) - tr for r in refs]
        e = g - tr
        res["err"][t] = e.abs().max().item()
        res["sq_err"][t], res["numel"][t] = e.pow(2).sum().item(), e.numel()
        res["ref_err"][t] = max(x.abs().max().item() for x in ref_e)
        res["ref_rms"][t] = max(x.pow(2).mean().sqrt().item() for x in ref_e)
        res.setdefault("local_err", {})[t] = ref_e[-1].abs().max().item()
        res["max_truth"][t] = tr.abs().max().item()
        res.setdefault("nan", False)
        res["nan"] |= bool(torch.isnan(got[i]).any())
    res["merge_g"] = _sensitivity(q, k, v, dout, offset, mask, scale)
    return res


def _sensitivity(q, k, v, dout, offset, mask, scale):
    """G per tensor (`tests.attention.reference.merge_sensitivity`, with the sink in the softmax)."""
    import torch

    qk, kk, vk, do = (x.permute(1, 2, 0, 3) for x in (q, k, v, dout))
    g = qk.shape[1] // kk.shape[1]
    kk, vk = kk.repeat_interleave(g, 1), vk.repeat_interleave(g, 1)
    sc = (qk @ kk.transpose(-1, -2) * scale).masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(sc, -1)
    if offset is not None:
        lse = torch.logaddexp(lse, offset.view(1, -1, 1))
    p = torch.exp(sc - lse[..., None]).nan_to_num(0.0)
    out = p @ vk
    dd = (do * out).sum(-1, keepdim=True)
    ds = p * (do @ vk.transpose(-1, -2) - dd)
    finite = lse[torch.isfinite(lse)]
    L = finite.abs().max().item() if finite.numel() else 0.0
    grp = lambda x: x.unflatten(1, (k.shape[2], g)).sum(2)  # noqa: E731
    res = {"out": (2 + L) * v.abs().max().item(), "dq": L * (scale * ds @ kk).abs().max().item(),
           "dk": (L + 1) * grp(scale * ds.abs().transpose(-1, -2) @ qk.abs()).max().item(),
           "dv": (L + 1) * grp(p.transpose(-1, -2) @ do.abs()).max().item()}
    if offset is not None:
        p_sink = torch.exp(offset.view(1, -1, 1) - lse).nan_to_num(0.0)
        res["doffset"] = (L + 1) * (p_sink * dd.squeeze(-1).abs()).sum((0, 2)).max().item()
    return res


def _probes(groups):
    """A window / a sink / another v head dim each change the output; a row that sees only the sink."""
    import torch

    from cp_ext.attention import ring_attention

    g = groups[4]
    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 1, 2, 16, dtype=torch.float64) for _ in range(3))
    base = ring_attention(q, k, v, causal=True, group=g)
    windowed = ring_attention(q, k, v, causal=True, group=g, window_size=(2, 0))
    sunk = ring_attention(q, k, v, causal=True, group=g, softmax_offset=torch.tensor([3.0, -1.0], dtype=torch.float64))
    # documents where every token is padding: nothing to see but the sink
    ids = torch.full((1, 8), -1)
    off = torch.tensor([0.5, 2.0], dtype=torch.float64, requires_grad=True)
    qq = q.clone().requires_grad_()
    blind = ring_attention(qq, k, v, causal=True, group=g, document_ids=ids, softmax_offset=off)
    blind.sum().backward()
    return {"window_changes": (windowed - base).abs().max().item(), "sink_changes": (sunk - base).abs().max().item(),
            "blind_max": blind.abs().max().item(), "blind_nan": bool(torch.isnan(blind).any() or torch.isnan(qq.grad).any()
                                                                      or torch.isnan(off.grad).any())}


def _ring_reach(groups):
    """Ring posts with a window of 3 on ring 4 (chunks of 4): each block reaches one rank at most."""
    import torch

    from cp_ext.attention import ring_attention
    from cp_ext.attention.cp import primitives as utils

    posts = []
    real = utils.post_p2p

    def counting(ops, group):
        posts.extend(op.__name__ for op, _, _ in ops)
        return real(ops, group)

    utils.post_p2p = counting
    try:
        q, k, v = (torch.randn(32, 1, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
        counts = {}
        for name, w in (("none", None), ("w3", (3, 0))):
            posts.clear()
            out = ring_attention(q, k, v, causal=True, group=groups[4], layout="contiguous", window_size=w)
            counts[name] = {"fwd": len(posts)}
            posts.clear()
            out.sum().backward()
            counts[name]["bwd"] = len(posts)
    finally:
        utils.post_p2p = real
    return counts


def main():
    import torch.distributed as dist

    args = worker_args()
    rank, groups = init_four_ranks()
    # the U2 x R2 grouping of cp_ext.parallel_state: Ulysses rank = rank % 2, ring rank = rank // 2
    ug = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rg = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups.update(u2=ug[rank // 2], r2=rg[rank % 2])
    results = {case["name"]: _measure(case, groups, rank) for case in selected(CASES, args)}
    if args.cases is None or "probes" in args.extra:
        results["probes"] = _probes(groups)
        results["reach"] = _ring_reach(groups)
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
QUICK = ["hybrid-causal-w13_0-sink-h4kv2-d32-s32"]


@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, NPROC, "probes", cases=QUICK if quick else None)


@pytest.mark.parametrize("case", case_params(CASES, quick=QUICK))
def test_mask_and_sink_match_float64_truth(results, case):
    name = case["name"]
    mx = lambda key, t: max(r[name][key][t] for r in results.values())  # noqa: E731
    assert not any(r[name]["nan"] for r in results.values())
    assert max(results[0][name]["local_err"].values()) <= FP32_ABS  # the CP = 1 path is a sane reference
    merges = results[0][name]["merges"]
    for t in GRADS:
        if t not in results[0][name]["err"]:
            continue
        err, ref = mx("err", t), mx("ref_err", t)
        bound = 2 * ref + FP32_ULP * mx("max_truth", t) + (merges - 1) * U * results[0][name]["merge_g"][t]
        assert err <= bound, f"{t}: error {err:.3g} > bound {bound:.3g} (2 x single-device {ref:.3g} + 1 ulp + merges)"
        assert err <= FP32_ABS, f"{t}: error {err:.3g} > {FP32_ABS}"
        if t != "doffset":  # an RMS over the whole tensor (every rank's shard once; doffset: each rank's share)
            n = sum(r[name]["numel"][t] for r in results.values())
            rms = (sum(r[name]["sq_err"][t] for r in results.values()) / n) ** 0.5
            assert rms <= RMS_FACTOR * mx("ref_rms", t), f"{t}: RMS {rms:.3g} > {RMS_FACTOR} x {mx('ref_rms', t):.3g}"


@pytest.mark.quick
def test_window_sink_never_dropped_and_blind_rows_are_zero(results):
    p = results[0]["probes"]
    assert p["window_changes"] > 1e-3 and p["sink_changes"] > 1e-3
    assert p["blind_max"] == 0.0 and not p["blind_nan"]


def test_window_shortens_the_ring(results):
    """Contiguous ring 4, s 32, window 3: a block is read by its own rank and the next only, so the
    forward posts one send and one receive per rank (not 3 + 3), and the backward as few."""
    reach = results[1]["reach"]  # rank 1 receives rank 0's block and sends its own to rank 2
    assert reach["none"]["fwd"] == 6 and reach["w3"]["fwd"] == 2, reach
    assert reach["w3"]["bwd"] < reach["none"]["bwd"], reach


if __name__ == "__main__":
    main()
