"""Every CP method of the gated delta rule (`cp_ext.linear_attention.context_parallel_linear_attention`) against
the float64 whole sequence, and the bytes each sends against `cp_ext.perf.comm`'s formulas.

Worker (one launch of 4 gloo ranks runs every case): as test_state_passing.py's, for each method:
state passing with the ring exchange and with the all-gather, head parallelism (all-to-all), and the
Ulysses x state-passing hybrid U2 x R2 (Ulysses groups [0, 1] [2, 3], rings [0, 2] [1, 3], cp_ext's hybrid
token layout) with either exchange; CP2 (the pairs [0, 1], [2, 3]) and CP4; zigzag and contiguous; Gated
DeltaNet's per-head decay and KDA's per-channel one. Each rank records the max abs error of the output and
of every input's gradient at its positions, and the bytes its torch.distributed calls sent
(`cp_ext.perf.sent_bytes`), forward and backward apart.

Shapes: segments that are not multiples of the chunk (5, 11 tokens), 1-, 2- and 3-token segments, documents
starting exactly at a segment boundary and 1-token documents (`reference.documents`), CP4 over 2 value heads
and 1 key head (state passing runs; the all-to-all and the hybrid's Ulysses level raise a ValueError naming
the heads, C and state passing). Bounds as test_state_passing.py's: fp32 <= 2 x the single-device fp32
error + FLOOR x max|truth|, fp64 <= 1e-10. Bytes: equal to the formula, per rank and per direction.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launch import case_params, launch, selected, worker_args, write_results  # noqa: E402
from tests.linear_attention.reference import TENSORS, documents, inputs, max_err, seed_of  # noqa: E402

NPROC = 4
FLOOR = 2.0 ** -22
EXACT = 1e-10
METHODS = {  # name: (method, exchange, hybrid)
    "ring": ("state_passing", "ring", False), "all_gather": ("state_passing", "all_gather", False),
    "all_to_all": ("all_to_all", "all_gather", False),
    "hybrid_ring": ("state_passing", "ring", True), "hybrid_all_gather": ("state_passing", "all_gather", True),
}


def _cases():
    cases = []

    def add(method, cp, layout, s, chunk, kind="gdn", dtype="fp32", hk=2, hv=4, docs=True, error=False):
        cases.append(dict(method=method, cp=cp, layout=layout, s=s, chunk=chunk, kind=kind, dtype=dtype, hk=hk,
                          hv=hv, docs=docs, error=error))

    for kind in ("gdn", "kda"):
        # segments of 5, 11, 11 and 18 tokens against chunks of 4 and 8
        for cp, layout, s, chunk in [(4, "zigzag", 40, 4), (4, "contiguous", 44, 8), (2, "zigzag", 44, 8),
                                     (2, "contiguous", 36, 8)]:
            for method in ("ring", "all_gather", "all_to_all"):
                add(method, cp, layout, s, chunk, kind, hk=cp, hv=2 * cp)
        for layout, s in [("zigzag", 40), ("contiguous", 44)]:
            for method in ("hybrid_ring", "hybrid_all_gather"):
                add(method, 4, layout, s, 4, kind)
        for method in ("ring", "all_to_all", "hybrid_ring"):
            add(method, 4, "zigzag", 40, 4, kind, dtype="fp64", hk=4, hv=8)
    # 1-, 3- and 2-token segments
    for method, layout, s in [("ring", "zigzag", 8), ("ring", "zigzag", 24), ("ring", "contiguous", 8),
                              ("all_gather", "zigzag", 8), ("all_to_all", "zigzag", 8),
                              ("hybrid_ring", "zigzag", 8), ("hybrid_all_gather", "contiguous", 16)]:
        add(method, 4, layout, s, 8, hk=4 if method == "all_to_all" else 2, hv=4)
    add("ring", 4, "zigzag", 8, 8, kind="kda", dtype="fp64")
    # CP 4 over 1 key head and 2 value heads
    for method in ("ring", "all_gather"):
        add(method, 4, "zigzag", 40, 4, hk=1, hv=2)
        add(method, 4, "zigzag", 40, 4, kind="kda", hk=1, hv=2)
    add("all_to_all", 4, "zigzag", 40, 4, hk=1, hv=2, error=True)
    add("hybrid_ring", 4, "zigzag", 40, 4, hk=1, hv=2, error=True)
    add("all_to_all", 4, "zigzag", 40, 4, hk=2, hv=4, error=True)
    for c in cases:
        c["name"] = (f"{c['method']}-{c['kind']}-cp{c['cp']}-{c['layout']}-s{c['s']}-c{c['chunk']}-hk{c['hk']}-"
                     f"hv{c['hv']}-{c['dtype']}{'-docs' if c['docs'] else ''}")
    # the conv's halo: bytes only (its values: test_state_passing.py)
    for cp, layout, s, docs in [(4, "zigzag", 16, True), (2, "contiguous", 20, False)]:
        cases.append(dict(method="conv", cp=cp, layout=layout, s=s, dtype="fp32", docs=docs, error=False,
                          name=f"conv-cp{cp}-{layout}-s{s}{'-docs' if docs else ''}"))
    return cases


CASES = _cases()
QUICK = ["ring-gdn-cp4-zigzag-s40-c4-hk4-hv8-fp32-docs", "all_to_all-kda-cp4-zigzag-s40-c4-hk4-hv8-fp32-docs",
         "hybrid_ring-gdn-cp4-zigzag-s40-c4-hk2-hv4-fp32-docs"]


# ----------------------------------------------------------------------------- worker
def _segment_len(case, ring):
    return case["s"] // (ring * (2 if case["layout"] == "zigzag" else 1))


def _run(fn, tensors, dout):
    """[out, grad of each input] of fn(*inputs), loss = <out, dout>, and the bytes sent (forward, backward)."""
    from cp_ext.perf.sent_bytes import record_sent_bytes

    leaves = [t.detach().requires_grad_() for t in tensors]
    with record_sent_bytes() as sent:
        out = fn(*leaves)
        fwd = sent.take()
        (out.double() * dout).sum().backward()
        bwd = sent.take()
    return [out] + [leaf.grad for leaf in leaves], dict(fwd=fwd, bwd=bwd)


def _rule_case(case, groups, rank):
    import torch
    import torch.distributed as dist

    from cp_ext.linear_attention import context_parallel_linear_attention, gated_delta_rule
    from cp_ext.token_partition import context_parallel_positions

    method, exchange, hybrid = METHODS[case["method"]]
    if hybrid:
        group, ulysses_group = groups["ring"], groups[2]
        ring, ring_rank = 2, dist.get_rank(group)
        positions = context_parallel_positions(case["s"], ring_rank=ring_rank, ring_size=2, layout=case["layout"],
                                               ulysses_rank=dist.get_rank(ulysses_group), ulysses_size=2)
    else:
        group, ulysses_group = groups[case["cp"]], None
        ring, ring_rank = case["cp"], dist.get_rank(group)
        positions = context_parallel_positions(case["s"], ring_rank=ring_rank, ring_size=ring, layout=case["layout"])
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[case["dtype"]]
    x = inputs(2, case["s"], case["hk"], case["hv"], 8, 6, seed_of(case["name"]), per_channel=case["kind"] == "kda")
    ids = documents(2, case["s"], _segment_len(case, ring)) if case["docs"] else None
    full = [x[n] for n in ("q", "k", "v", "g", "beta")]
    shard = lambda t: t.index_select(1, positions)  # noqa: E731
    whole = lambda *a: gated_delta_rule(*a, chunk_size=case["chunk"], document_ids=ids)[0]  # noqa: E731
    sharded = lambda *a: context_parallel_linear_attention(  # noqa: E731
        *a, group=group, layout=case["layout"], document_ids=None if ids is None else shard(ids), method=method,
        exchange=exchange, ulysses_group=ulysses_group, chunk_size=case["chunk"])
    res = dict(ring_rank=ring_rank)
    if case["error"]:
        try:
            sharded(*[shard(t).to(dtype) for t in full])
            res["error"] = None
        except ValueError as e:
            res["error"] = str(e)
        return res
    truth, _ = _run(whole, full, x["dout"])
    single, _ = _run(whole, [t.to(dtype) for t in full], x["dout"])
    cp, res["bytes"] = _run(sharded, [shard(t).to(dtype) for t in full], shard(x["dout"]))
    res["single"] = {n: max_err(r, t) for n, r, t in zip(TENSORS, truth, single)}
    res["cp"] = {n: max_err(r.index_select(1, positions), t) for n, r, t in zip(TENSORS, truth, cp)}
    res["scale"] = {n: r.abs().max().item() for n, r in zip(TENSORS, truth)}
    return res


def _conv_case(case, groups, rank):
    import torch
    import torch.distributed as dist

    from cp_ext.linear_attention import context_parallel_causal_conv1d
    from cp_ext.token_partition import context_parallel_positions

    group = groups[case["cp"]]
    positions = context_parallel_positions(case["s"], ring_rank=dist.get_rank(group), ring_size=case["cp"],
                                           layout=case["layout"])
    gen = torch.Generator().manual_seed(seed_of(case["name"]))
    x, w, bias, dout = (torch.randn(*shape, generator=gen) for shape in ((2, case["s"], 12), (12, 4), (12,),
                                                                          (2, case["s"], 12)))
    ids = documents(2, case["s"], _segment_len(case, case["cp"])).index_select(1, positions) if case["docs"] else None
    conv = lambda xx, ww, bb: context_parallel_causal_conv1d(  # noqa: E731
        xx, ww, bb, group=group, layout=case["layout"], document_ids=ids)
    _, sent = _run(conv, [x.index_select(1, positions), w, bias], dout.index_select(1, positions).double())
    return dict(bytes=sent)


def main():
    import torch.distributed as dist

    from tests.attention.reference import init_four_ranks

    args = worker_args()
    rank, groups = init_four_ranks()
    rings = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the hybrid's rings (every rank creates both)
    groups["ring"] = rings[rank % 2]
    results = {}
    for case in selected(CASES, args):
        results[case["name"]] = (_conv_case if case["method"] == "conv" else _rule_case)(case, groups, rank)
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest
@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, NPROC, cases=QUICK if quick else None, timeout=300)  # a hang: stacks after 5 min


def _formula(case, ring_rank):
    from cp_ext.perf import comm

    docs, dtype = case["docs"], case["dtype"]
    if case["method"] == "conv":
        return comm.conv_halo_bytes(b=2, channels=12, kernel_size=4, s_local=case["s"] // case["cp"], cp=case["cp"],
                                    layout=case["layout"], dtype=dtype, documents=docs)
    shape = dict(b=2, h=case["hv"], k_dim=8, v_dim=6, dtype=dtype, documents=docs)
    method, exchange, hybrid = METHODS[case["method"]]
    if hybrid:
        return comm.linear_hybrid_bytes(**shape, s=case["s"], hk=case["hk"], cp=4, ulysses=2, layout=case["layout"],
                                        exchange=exchange, per_channel=case["kind"] == "kda", ring_rank=ring_rank)
    if method == "all_to_all":
        return comm.linear_head_parallel_bytes(**shape, s=case["s"], hk=case["hk"], cp=case["cp"],
                                               per_channel=case["kind"] == "kda")
    return comm.linear_state_passing_bytes(**shape, cp=case["cp"], layout=case["layout"], exchange=exchange,
                                           rank=ring_rank)


CHECKED = [c for c in CASES if c["method"] != "conv" and not c["error"]]


@pytest.mark.parametrize("case", case_params(CHECKED, quick=QUICK))
def test_cp_matches_float64_whole_sequence(results, case):
    name = case["name"]
    for tensor in TENSORS:
        cp = max(res[name]["cp"][tensor] for res in results.values())
        if case["dtype"] == "fp64":
            assert cp <= EXACT, (tensor, cp)
            continue
        single = max(res[name]["single"][tensor] for res in results.values())
        bound = 2 * single + FLOOR * results[0][name]["scale"][tensor]
        assert cp <= bound, f"{tensor}: CP error {cp:.3g} > 2 x single-device {single:.3g} + floor = {bound:.3g}"


@pytest.mark.parametrize("case", case_params([c for c in CASES if not c["error"]], quick=QUICK))
def test_bytes_sent_equal_the_formulas(results, case):
    """What every rank's collectives sent, forward and backward, equals cp_ext.perf.comm's formula."""
    for rank, res in results.items():
        got = res[case["name"]]["bytes"]
        expect = _formula(case, res[case["name"]].get("ring_rank"))
        for direction in ("fwd", "bwd"):
            want = {c: v[direction] for c, v in expect.items() if v[direction]}
            assert got[direction] == want, (rank, direction, got[direction], want)
    if case["method"] == "ring":  # point to point only, ids included
        assert all(set(res[case["name"]]["bytes"]["fwd"]) | set(res[case["name"]]["bytes"]["bwd"]) <= {"p2p"}
                   for res in results.values())


@pytest.mark.parametrize("case", case_params([c for c in CASES if c["error"]]))
def test_too_few_heads_is_a_clear_error(results, case):
    if case["name"] not in results[0]:
        pytest.skip("not in the quick launch")
    for res in results.values():
        message = res[case["name"]]["error"]
        assert message is not None
        assert f"{case['hk']} key heads and {case['hv']} value heads" in message, message
        ranks = 2 if case["method"].startswith("hybrid") else case["cp"]
        assert f"over {ranks} ranks" in message and "state passing" in message and "no such limit" in message, message


def test_one_process_runs_every_method_and_bad_names_are_clear_errors():
    """Without torch.distributed each method is the rule itself (one rank holds every segment: the ring's chain
    stays local); unknown methods and exchanges name the choices."""
    from cp_ext.linear_attention import context_parallel_linear_attention, gated_delta_rule

    x = inputs(2, 20, 1, 2, 8, 6, seed=3)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    ids = documents(2, 20, 10)
    truth, _ = gated_delta_rule(*args, chunk_size=4, document_ids=ids)
    for method, exchange in [("state_passing", "ring"), ("state_passing", "all_gather"), ("all_to_all", "all_gather")]:
        out = context_parallel_linear_attention(*args, group=None, document_ids=ids, chunk_size=4, method=method,
                                                exchange=exchange)
        assert max_err(out, truth) < EXACT, (method, exchange)
    with pytest.raises(ValueError, match="'state_passing', 'all_to_all'"):
        context_parallel_linear_attention(*args, group=None, method="ulysses")
    with pytest.raises(ValueError, match="'all_gather', 'ring'"):
        context_parallel_linear_attention(*args, group=None, exchange="tree")
    with pytest.raises(ValueError, match="ulysses_group is for the state-passing hybrid"):
        context_parallel_linear_attention(*args, group=None, method="all_to_all", ulysses_group=object())


if __name__ == "__main__":
    main()
