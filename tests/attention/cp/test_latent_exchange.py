"""MLA's latent exchange (`cp_ext.attention.cp.kv_message.LatentKV`) equals up-projected K/V, in fp64.

Worker (4 gloo ranks, one launch). Per case every rank draws the same q, the latent
``[c | k_pe]`` and ``linear_kv_up_proj``'s weight; the truth up-projects the whole latent with
autograd (k = [c W_uk^T | k_pe], v = c W_uv^T, as megatron's MLASelfAttention) and runs explicit
fp64 attention with the case's mask and sink. Each variant gets its shard of q and the latent and
the weight; out, dq and the latent's gradient must equal the truth's rows at its positions, and
the weight's and the sink's gradients summed over the group the truth's, all to 1e-10.
Variants: ring 4 (zigzag, contiguous), ring 2, all-gather 4, the local call (CP = 1) and CP-aware
recompute's kept pair, under causal and full masks, a window, a sink and documents.
Bytes: on the same inputs the ring's messages shrink by (r + p) / (h (d_qk + d_v)), forward and back.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.reference import (  # noqa: E402
    explicit_attention, full_mask, init_four_ranks, sample_document_ids, value_errors,
)
from tests.launch import case_params, launch, selected, worker_args, write_results  # noqa: E402

NPROC = 4
S, B, H, RANK, POS, NOPE, DV = 32, 2, 4, 16, 6, 10, 8  # latent 22 wide; per-head K/V 16 + 8
TOL = 1e-10


def _cases():
    base = dict(layout="zigzag", causal=True, window=None, sink=False, docs=False)
    cases = [
        dict(base, via="ring4"),
        dict(base, via="ring4", layout="contiguous"),
        dict(base, via="ring2"),
        dict(base, via="ring4", causal=False),
        dict(base, via="ring4", window=(5, 0)),
        dict(base, via="ring4", layout="contiguous", window=(9, 0), sink=True, docs=True),
        dict(base, via="ring4", causal=False, window=(3, 7), sink=True),
        dict(base, via="ag4"),
        dict(base, via="ag4", window=(9, 0), sink=True, docs=True),
        dict(base, via="local", window=(5, 0), sink=True),
        dict(base, via="kept_ring4", sink=True),
        dict(base, via="kept_ag4", docs=True),
    ]
    for c in cases:
        w = "" if c["window"] is None else f"-w{c['window'][0]}_{c['window'][1]}"
        c["name"] = (f"{c['via']}-{c['layout']}-{'causal' if c['causal'] else 'full'}{w}"
                     f"{'-sink' if c['sink'] else ''}{'-docs' if c['docs'] else ''}")
    return cases


CASES = _cases()


def up_project(latent, weight):
    """megatron's MLA K/V from the latent [s, b, r + p]: k [s, b, h, NOPE + POS], v [s, b, h, DV]."""
    import torch

    kv = (latent[..., :RANK] @ weight.t()).unflatten(-1, (H, NOPE + DV))
    k_pe = latent[..., None, RANK:].expand(-1, -1, H, -1)
    return torch.cat([kv[..., :NOPE], k_pe], -1), kv[..., NOPE:]


def _variant(case, groups, rank):
    """(attention on this rank's shard: f(q, latent, weight, offset, ids), its positions)."""
    import torch
    import torch.distributed as dist

    from cp_ext.attention import all_gather_attention, local_attention, ring_attention
    from cp_ext.token_partition import context_parallel_positions

    kw = dict(causal=case["causal"], window_size=case["window"])
    via = case["via"]
    if via == "local":
        return (lambda q, lat, w, o, ids: local_attention(q, lat, None, up_weight=w, document_ids=ids,
                                                          softmax_offset=o, **kw)), torch.arange(S)
    if via.endswith("ring4") or via == "ring2":
        g = groups[int(via[-1])]
        pos = context_parallel_positions(S, ring_rank=dist.get_rank(g), ring_size=dist.get_world_size(g),
                                         layout=case["layout"])
        if via.startswith("kept"):
            return (lambda q, lat, w, o, ids: _kept(q, lat, w, o, ids, case, dict(ring_group=g))), pos
        return (lambda q, lat, w, o, ids: ring_attention(q, lat, None, up_weight=w, group=g, layout=case["layout"],
                                                         document_ids=ids, softmax_offset=o, **kw)), pos
    pos = context_parallel_positions(S, ring_rank=rank, ring_size=4)
    if via.startswith("kept"):
        return (lambda q, lat, w, o, ids: _kept(q, lat, w, o, ids, case, dict(
            ring_group=None, comm_type="all_gather", all_gather_group=dist.group.WORLD, positions=pos))), pos
    return (lambda q, lat, w, o, ids: all_gather_attention(q, lat, None, up_weight=w, group=dist.group.WORLD,
                                                           positions=pos, document_ids=ids, softmax_offset=o,
                                                           **kw)), pos


def _kept(q, latent, weight, offset, ids, case, groups):
    """CP-aware recompute's pair with the latent: the forward kept, the backward replayed."""
    from cp_ext.attention.cp.context_parallel import NO_GROUP, cp_attention_forward
    from cp_ext.transformer.recompute import ReplayAttention

    out, lse, plan = cp_attention_forward(q, latent, None, causal=case["causal"], softmax_scale=None,
                                          ulysses_group=NO_GROUP, layout=case["layout"], document_ids=ids,
                                          window_size=case["window"], softmax_offset=offset, up_weight=weight,
                                          **groups)
    return ReplayAttention.apply(q, latent, None, offset, out, lse, plan, weight)


def _measure(case, groups, rank):
    import zlib

    import torch
    import torch.distributed as dist


    gen = torch.Generator().manual_seed(zlib.crc32(case["name"].encode()))
    q = torch.randn(S, B, H, NOPE + POS, generator=gen, dtype=torch.float64)
    latent = torch.randn(S, B, RANK + POS, generator=gen, dtype=torch.float64)
    weight = torch.randn(H * (NOPE + DV), RANK, generator=gen, dtype=torch.float64) / RANK ** 0.5
    dout = torch.randn(S, B, H, DV, generator=gen, dtype=torch.float64)
    offset = torch.randn(H, generator=gen, dtype=torch.float64) + 1.0 if case["sink"] else None
    mask, scale = full_mask(case, B, S), (NOPE + POS) ** -0.5

    def run(fn, shard=lambda x: x):
        ins = [x.detach().requires_grad_() for x in (q, latent, weight)]
        off = None if offset is None else offset.detach().requires_grad_()
        out = fn(shard(ins[0]), shard(ins[1]), ins[2], off)
        out.backward(shard(dout))
        return [out.detach()] + [x.grad for x in ins] + [None if off is None else off.grad]

    truth = run(lambda q_, lat, w, o: explicit_attention(q_, *up_project(lat, w), o, mask, scale))
    attn, pos = _variant(case, groups, rank)
    ids = sample_document_ids(B, S)[:, pos] if case["docs"] else None
    sh = lambda x: x.index_select(0, pos)  # noqa: E731
    got = run(lambda q_, lat, w, o: attn(q_, lat, w, o, ids), shard=sh)
    group = None if case["via"] == "local" else groups[2] if case["via"] == "ring2" else dist.group.WORLD
    err = {"out": (got[0] - sh(truth[0])).abs().max().item()}
    for i, name in ((1, "dq"), (2, "dlatent")):
        err[name] = (sh(got[i]) - sh(truth[i])).abs().max().item()
    for i, name in ((3, "dweight"), (4, "doffset")):
        if truth[i] is None:
            continue
        share = got[i].clone()
        if group is not None:  # each rank's share, summed as the DP x CP reduction sums them
            dist.all_reduce(share, group=group)
        err[name] = (share - truth[i]).abs().max().item()
    return {"err": err, "nan": any(bool(torch.isnan(x).any()) for x in got if x is not None)}


def _bytes(groups):
    """Ring 4 P2P bytes of one forward and backward, the K/V pair vs the latent, on the same inputs."""
    import torch

    from cp_ext.attention import ring_attention
    from cp_ext.perf.counter import count_comm

    torch.manual_seed(1)
    q = torch.randn(S // 4, B, H, NOPE + POS, dtype=torch.float64, requires_grad=True)
    latent = torch.randn(S // 4, B, RANK + POS, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(H * (NOPE + DV), RANK, dtype=torch.float64, requires_grad=True)
    res = {}
    for name in ("kv", "latent"):
        with count_comm() as fwd:
            if name == "kv":
                out = ring_attention(q, *up_project(latent, weight), causal=True, group=groups[4])
            else:
                out = ring_attention(q, latent, None, up_weight=weight, causal=True, group=groups[4])
            res[name] = {"fwd": fwd.bytes["ring_p2p"]}
        with count_comm() as bwd:
            out.sum().backward()
            res[name]["bwd"] = bwd.bytes["ring_p2p"]
    return res


def _errors(groups):
    """Bad latent-exchange calls: each a ValueError naming what is wrong, before any exchange."""
    import torch

    from cp_ext.attention import hybrid_attention, ring_attention
    from cp_ext.attention.cp.context_parallel import NO_GROUP

    q = torch.randn(S // 4, B, H, NOPE + POS, dtype=torch.float64)
    latent = torch.randn(S // 4, B, RANK + POS, dtype=torch.float64)
    weight = torch.randn(H * (NOPE + DV), RANK, dtype=torch.float64)
    calls = {
        "ulysses": lambda: hybrid_attention(q, latent, None, up_weight=weight, causal=True, ulysses_group=groups[2],
                                            ring_group=NO_GROUP),
        "latent_with_heads": lambda: ring_attention(q, latent[:, :, None], None, up_weight=weight, causal=True,
                                                    group=groups[4]),
        "weight_rows": lambda: ring_attention(q, latent, None, up_weight=weight[:-1], causal=True, group=groups[4]),
        "no_value_dims": lambda: ring_attention(q, latent, None, up_weight=weight[: H * NOPE], causal=True,
                                                group=groups[4]),
    }
    return value_errors(calls)


def main():
    import torch.distributed as dist

    args = worker_args()
    rank, groups = init_four_ranks()
    results = {case["name"]: _measure(case, groups, rank) for case in selected(CASES, args)}
    if args.cases is None or "bytes" in args.extra:
        results["bytes"] = _bytes(groups)
        results["errors"] = _errors(groups)
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
QUICK = ["ring4-contiguous-causal-w9_0-sink-docs"]


@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, NPROC, "bytes", cases=QUICK if quick else None)


@pytest.mark.parametrize("case", case_params(CASES, quick=QUICK))
def test_latent_exchange_equals_up_projected_kv(results, case):
    name = case["name"]
    for rank, res in results.items():
        r = res[name]
        assert not r["nan"], rank
        expected = {"out", "dq", "dlatent", "dweight"} | ({"doffset"} if case["sink"] else set())
        assert set(r["err"]) == expected, r["err"]
        bad = {k: v for k, v in r["err"].items() if not v <= TOL}
        assert not bad, (rank, bad)


@pytest.mark.quick
def test_latent_exchange_sends_the_latent(results):
    """Forward: (R-1) blocks of [b, 1, s, r + p] instead of [b, h, s, d_qk + d_v]; the backward's
    accumulators shrink the same way (fp64 here, so both sides have the same element size)."""
    b = results[1]["bytes"]
    ratio = (RANK + POS) / (H * (NOPE + POS + DV))
    assert b["latent"]["fwd"] == b["kv"]["fwd"] * ratio and b["latent"]["fwd"] > 0, b
    assert b["latent"]["bwd"] == b["kv"]["bwd"] * ratio, b


@pytest.mark.quick
def test_bad_latent_calls_name_the_problem(results):
    e = results[0]["errors"]
    assert "Ulysses exchanges heads" in e["ulysses"] and "--cp-mla-exchange kv" in e["ulysses"]
    assert "latent [s, b, kv_lora_rank + qk_pos_emb_head_dim]" in e["latent_with_heads"]
    assert "linear_kv_up_proj weight" in e["weight_rows"]
    assert "leave no key / value dims" in e["no_value_dims"]


if __name__ == "__main__":
    main()
