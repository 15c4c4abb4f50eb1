"""The DSA lightning indexer's tiled top-k (`cp_ext.attention.dsa.indexer`) against a float64 dense reference.

The reference (`dense_scores`, `reference_order`) is written here independently: dense fp64 scores
[b, s, s] and, per query, its causal keys sorted by (score descending, position ascending) in
Python. Every random input is drawn so that no query's k-th and (k+1)-th reference scores lie within
1e-4 relative of each other (`draw_inputs` re-draws the seed until none do), so the fp32 selection
agreeing with the fp64 one is not luck; the tie inputs (`tie_inputs`) use small integers instead,
whose scores are exact in every dtype and summation order, so their many equal scores are truly equal.

Worker (`python -m torch.distributed.run --nproc-per-node=4 tests/attention/dsa/test_indexer.py
--results-dir DIR`): one launch for every CP case. Each rank builds the same full inputs, runs
`indexer_topk` on its shard (ring 2 and 4, zigzag and contiguous; all-gather 2 and 4; rings of 2
are the pairs [0, 1] and [2, 3]) with ragged tiles (key_tile 5, query_tile 6), and records how its
rows differ from the reference. The single-process cases, the memory bound and the checks that a
broken merge or tie rule fails run in the pytest process.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.launch import case_params, launch, selected, worker_args, write_results  # noqa: E402

NPROC = 4
B, H, D = 2, 4, 16
S = 64  # zigzag over 4 ranks: 8 chunks of 8
TOPKS = (3, 20, 64, 100)  # within one chunk; across several ranks' chunks; = s; > s
GAP = 1e-4
KEY_TILE, QUERY_TILE = 5, 6  # ragged: neither divides a shard


def _cases():
    cases = []
    for mode, cp, layout in [("ring", 2, "zigzag"), ("ring", 2, "contiguous"), ("ring", 4, "zigzag"),
                             ("ring", 4, "contiguous"), ("all_gather", 2, "zigzag"), ("all_gather", 4, "zigzag"),
                             ("all_gather", 4, "contiguous")]:
        for topk in TOPKS:
            for dtype in ("fp32", "bf16"):
                cases.append(dict(name=f"{mode}{cp}-{layout}-k{topk}-{dtype}", mode=mode, cp=cp, layout=layout,
                                  topk=topk, dtype=dtype))
    return cases


CASES = _cases()
QUICK = ["ring4-zigzag-k20-fp32", "all_gather4-zigzag-k20-bf16"]


# ----------------------------------------------------------------------------- reference
def _dtype(name):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[name]


def dense_scores(q, w, k):
    """The dense float64 scores [b, s, s] of full q [s, b, H, D], w [s, b, H], k [s, b, D]."""
    import torch

    per_head = torch.einsum("tbhd,sbd->bths", q.double(), k.double()).clamp(min=0)
    return (per_head * w.double().permute(1, 0, 2).unsqueeze(-1)).sum(2)


def reference_order(dense):
    """[b][t]: query t's causal keys sorted by (score descending, position ascending)."""
    rows = dense.tolist()
    return [[sorted(range(t + 1), key=lambda j, row=row: (-row[j], j)) for t, row in enumerate(sample)]
            for sample in rows]


def gaps_ok(dense, order, topk):
    """No query's k-th and (k+1)-th reference scores within GAP relative of each other."""
    rows = dense.tolist()
    for b, sample in enumerate(order):
        for t, keys in enumerate(sample):
            if len(keys) > topk:
                a, c = rows[b][t][keys[topk - 1]], rows[b][t][keys[topk]]
                if abs(a - c) <= GAP * max(abs(a), abs(c)):
                    return False
    return True


def draw_inputs(s, dtype, topks, first_seed=0):
    """Random inputs (in ``dtype``) whose top-k boundaries are all separated, with their dense
    reference: the first seed from ``first_seed`` that passes `gaps_ok` for every k (deterministic, so
    every rank draws the same). Means of 0.5 make most dot products positive, so few scores are exactly 0."""
    import torch

    for seed in range(first_seed, first_seed + 50):
        g = torch.Generator().manual_seed(seed)
        q = (torch.randn(s, B, H, D, generator=g) + 0.5).to(dtype)
        w = torch.randn(s, B, H, generator=g).to(dtype)
        k = (torch.randn(s, B, D, generator=g) + 0.5).to(dtype)
        dense = dense_scores(q, w, k)
        order = reference_order(dense)
        if all(gaps_ok(dense, order, t) for t in topks):
            return (q, w, k), dense, order
    raise AssertionError(f"no seed in 50 separates every top-k boundary at s={s}")


def tie_inputs(s, dtype):
    """Integer inputs with many exactly equal scores: 3 distinct keys repeated, every 5th query 0 (all
    its scores 0: it selects the lowest positions), the others' scores small exact integers or halves."""
    import torch

    g = torch.Generator().manual_seed(7)
    q = torch.randint(-2, 3, (s, B, H, D), generator=g).float()
    q[::5] = 0
    w = torch.randint(-2, 3, (s, B, H), generator=g).float() / 2
    base = torch.randint(-2, 3, (3, B, D), generator=g).float()
    k = base[torch.arange(s) % 3]
    q, w, k = q.to(dtype), w.to(dtype), k.to(dtype)
    dense = dense_scores(q, w, k)
    return (q, w, k), dense, reference_order(dense)


def compare(positions, scores, q_positions, dense, order, topk):
    """How this rank's (positions, scores) [b, s_local, width] differ from the reference."""
    s = dense.shape[-1]
    res = dict(width=positions.shape[-1], want_width=min(topk, s), dtype=str(scores.dtype), wrong_sets=0,
               bad_padding=0, bad_order=0, order_differs=0, max_score_err=0.0)
    pos, val, ref = positions.tolist(), scores.double().tolist(), dense.tolist()
    for b in range(dense.shape[0]):
        for i, t in enumerate(q_positions.tolist()):
            want = order[b][t][:topk]
            n = len(want)
            got, got_val = pos[b][i][:n], val[b][i][:n]
            res["wrong_sets"] += sorted(got) != sorted(want)
            res["order_differs"] += got != want
            res["bad_padding"] += any(p != -1 for p in pos[b][i][n:]) or any(v != float("-inf") for v in val[b][i][n:])
            res["bad_order"] += any((got_val[j], -got[j]) <= (got_val[j + 1], -got[j + 1]) for j in range(n - 1))
            if 0 <= min(got, default=0) and max(got, default=0) <= t:
                err = max((abs(v - ref[b][t][p]) for v, p in zip(got_val, got)), default=0.0)
                res["max_score_err"] = max(res["max_score_err"], err / max(1.0, *map(abs, ref[b][t][:t + 1])))
            else:
                res["wrong_sets"] += 1
    return res


def check(res, exact=False):
    """Assert a `compare` result: the reference's selection, canonical order, -1/-inf padding, scores
    within fp32 rounding (exact for exact inputs)."""
    assert res["width"] == res["want_width"], res
    assert res["wrong_sets"] == 0 and res["bad_padding"] == 0 and res["bad_order"] == 0, res
    assert res["max_score_err"] <= (0.0 if exact else 2e-5), res
    if exact:
        assert res["order_differs"] == 0, res


# ----------------------------------------------------------------------------- worker
def _shard(tensors, positions):
    return [t.index_select(0, positions) for t in tensors]


def main():
    import torch
    import torch.distributed as dist

    from cp_ext.attention.cp import primitives as utils
    from cp_ext.attention.dsa import indexer as dsa_indexer
    from cp_ext.attention.dsa.indexer import indexer_topk
    from cp_ext.token_partition import context_parallel_positions
    from tests.attention.reference import init_four_ranks

    args = worker_args()
    rank, groups = init_four_ranks()
    events = []  # ring posts / waits and tile scorings, in order
    orig_send, orig_wait, orig_score = utils.RingComm.send_recv, utils.RingComm.wait, dsa_indexer.index_scores
    utils.RingComm.send_recv = lambda self, *a, **kw: events.append("post") or orig_send(self, *a, **kw)
    utils.RingComm.wait = lambda self: events.append("wait") or orig_wait(self)
    dsa_indexer.index_scores = lambda *a: events.append("score") or orig_score(*a)

    def positions_of(cp, layout):
        r = dist.get_rank(groups[cp])
        return context_parallel_positions(S, ring_rank=r, ring_size=cp, layout=layout)

    inputs = {name: draw_inputs(S, _dtype(name), TOPKS) for name in ("fp32", "bf16")}
    results = {}
    for case in selected(CASES, args):
        (q, w, k), dense, order = inputs[case["dtype"]]
        positions = positions_of(case["cp"], case["layout"])
        out = indexer_topk(*_shard((q, w, k), positions), topk=case["topk"], q_positions=positions,
                           group=groups[case["cp"]], layout=case["layout"], mode=case["mode"],
                           key_tile=KEY_TILE, query_tile=QUERY_TILE)
        results[case["name"]] = compare(*out, positions, dense, order, case["topk"])

    # Ties: ring 4 zigzag (blocks arrive out of position order) against the reference and against CP1.
    for dtype in ("fp32", "bf16"):
        (q, w, k), dense, order = tie_inputs(S, _dtype(dtype))
        positions = positions_of(4, "zigzag")
        ring = indexer_topk(*_shard((q, w, k), positions), topk=10, q_positions=positions, group=groups[4],
                            layout="zigzag", key_tile=KEY_TILE, query_tile=QUERY_TILE)
        cp1 = indexer_topk(q, w, k, topk=10, q_positions=torch.arange(S), key_tile=KEY_TILE, query_tile=QUERY_TILE)
        results[f"ties-{dtype}"] = dict(compare(*ring, positions, dense, order, 10), same_as_cp1=all(
            torch.equal(r, c[:, positions]) for r, c in zip(ring, cp1)))

    # The ring's order of work, with one tile per block: post the next block, score, wait.
    (q, w, k), _, _ = inputs["fp32"]
    for layout in ("zigzag", "contiguous"):
        positions = positions_of(4, layout)
        events.clear()
        indexer_topk(*_shard((q, w, k), positions), topk=5, q_positions=positions, group=groups[4], layout=layout,
                     key_tile=S, query_tile=S)
        results[f"events-{layout}"] = list(events)

    try:  # contiguous positions under a zigzag ring: refused, not silently wrong
        positions = positions_of(4, "contiguous")
        indexer_topk(*_shard((q, w, k), positions), topk=5, q_positions=positions, group=groups[4], layout="zigzag")
        results["wrong_layout_msg"] = None
    except ValueError as e:
        results["wrong_layout_msg"] = str(e)
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest: CP cases
@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, NPROC, cases=QUICK if quick else None)


@pytest.mark.parametrize("case", case_params(CASES, quick=QUICK))
def test_cp_matches_float64_reference(results, case):
    for res in results.values():
        check(res[case["name"]])
        assert res[case["name"]]["dtype"] == "torch.float32"


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ties_lowest_position_wins_at_ring4_zigzag_as_at_cp1(results, dtype):
    for res in results.values():
        check(res[f"ties-{dtype}"], exact=True)
        assert res[f"ties-{dtype}"]["same_as_cp1"]


@pytest.mark.quick
def test_ring_posts_next_block_before_scoring_and_skips_future_blocks(results):
    for rank, res in results.items():
        assert res["events-zigzag"] == ["post", "score", "wait"] * 3 + ["score"], res["events-zigzag"]
        # contiguous: rank r's own block, then r-1, ..., 0 are scored; blocks after rank r's are passed on unscored
        want = [e for step in range(3) for e in ["post"] + ["score"] * (step <= rank) + ["wait"]]
        want += ["score"] * (rank == 3)
        assert res["events-contiguous"] == want, (rank, res["events-contiguous"])


def test_wrong_layout_positions_are_refused(results):
    msg = results[0]["wrong_layout_msg"]
    assert msg is not None and "zigzag" in msg and "all_gather" in msg, msg


# ----------------------------------------------------------------------------- pytest: one process
def _cp1(inputs, topk, **kw):
    """`indexer_topk` on one process (ragged tiles of 7 keys x 10 queries unless ``kw`` says otherwise)."""
    import torch

    from cp_ext.attention.dsa.indexer import indexer_topk

    kw = dict(dict(key_tile=7, query_tile=10, q_positions=torch.arange(inputs[0].shape[0])), **kw)
    return indexer_topk(*inputs, topk=topk, **kw)


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_single_process_matches_float64_reference(dtype):
    import torch

    inputs, dense, order = draw_inputs(S, _dtype(dtype), TOPKS)
    for topk in TOPKS:
        positions, scores = _cp1(inputs, topk)
        assert positions.dtype == torch.int64 and scores.dtype == torch.float32
        check(compare(positions, scores, torch.arange(S), dense, order, topk))


def test_fp64_inputs_score_in_fp64():
    import torch

    inputs, dense, order = draw_inputs(S, torch.float64, (20,))
    positions, scores = _cp1(inputs, 20)
    assert scores.dtype == torch.float64
    res = compare(positions, scores, torch.arange(S), dense, order, 20)
    check(res)
    assert res["max_score_err"] < 1e-12, res


@pytest.mark.quick
def test_single_process_ties_lowest_position_wins_in_any_row_order():
    """Rows handed over in a shuffled order (keys then arrive out of position order too) select the
    same keys, in the same order, as the reference's (score desc, position asc)."""
    import torch

    inputs, dense, order = tie_inputs(S, torch.float32)
    check(compare(*_cp1(inputs, 10), torch.arange(S), dense, order, 10), exact=True)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(3))
    shuffled = _cp1([t[perm] for t in inputs], 10, q_positions=perm)
    check(compare(*shuffled, perm, dense, order, 10), exact=True)


@pytest.mark.quick
def test_packed_selection_orders_as_the_sort():
    """fp32's one-pass selection (score and position packed in one int64, `topk`) picks and orders exactly
    what the two stable sorts pick: negative, zero, subnormal, tied and -inf scores, many positions."""
    import torch

    from cp_ext.attention.dsa.indexer import RunningTopK

    g = torch.Generator().manual_seed(5)
    values = torch.randint(-4, 5, (3, 40, 300), generator=g).float() * 0.25
    values[0] *= 1e-40  # subnormals
    values[1, :, ::7] = float("-inf")
    values[2, :, 50:] = torch.randn(40, 250, generator=g) * 1e30
    positions = torch.stack([torch.randperm(1 << 20, generator=g)[:300] for _ in range(3 * 40)]).view(3, 40, 300)
    positions = positions.masked_fill(values == float("-inf"), -1)
    for k in (1, 17, 300):
        packed = RunningTopK._best(values, positions, k)
        sorted_ = RunningTopK._canonical_order(values, positions)[..., :k]
        finite = values.gather(-1, sorted_) > float("-inf")
        assert torch.equal(values.gather(-1, packed), values.gather(-1, sorted_))
        assert torch.equal(positions.gather(-1, packed)[finite], positions.gather(-1, sorted_)[finite])


def test_broken_merge_or_tie_rule_fails_the_checks(monkeypatch):
    """The checks above can fail: a merge that drops the running state, and a tie rule that keeps
    arrival order, are both caught."""
    import torch

    from cp_ext.attention.dsa.indexer import RunningTopK

    inputs, dense, order = draw_inputs(S, torch.float32, (20,))
    original_add = RunningTopK.add

    def forgetful_add(self, *a, **kw):
        self.values.fill_(float("-inf"))
        self.positions.fill_(-1)
        return original_add(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(RunningTopK, "add", forgetful_add)
        with pytest.raises(AssertionError):
            check(compare(*_cp1(inputs, 20), torch.arange(S), dense, order, 20))

    inputs, dense, order = tie_inputs(S, torch.float32)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(3))
    arrival_order = classmethod(lambda cls, values, positions, k:
                                values.argsort(dim=-1, descending=True, stable=True)[..., :k])
    with monkeypatch.context() as m:
        m.setattr(RunningTopK, "_best", arrival_order)
        with pytest.raises(AssertionError):
            check(compare(*_cp1([t[perm] for t in inputs], 10, q_positions=perm), perm, dense, order, 10), exact=True)


def _largest_allocation_per_batch_row(fn, inputs):
    """Run ``fn`` and return the most elements any op allocated during it (a new storage, not a view
    of ``inputs``), per batch row."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    given = {t.untyped_storage().data_ptr() for t in inputs}

    class Largest(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                    Largest.elements = max(Largest.elements, t.untyped_storage().nbytes() // t.element_size())
            return out

    with Largest():
        fn()
    return Largest.elements / B


def test_memory_stays_below_a_quarter_of_the_dense_scores():
    """At s = 256, key_tile 32, query_tile 64: nothing `indexer_topk` allocates reaches s*s/4 elements
    per batch row (the tile is 64 x H x 32 = s*s/8), while the dense reference allocates H * s*s: the
    check tells them apart (untiled queries, 256 x H x 32, would fail it too). The result is still exact."""
    import torch

    s, topk = 256, 16
    inputs, dense, order = draw_inputs(s, torch.float32, (topk,))
    got = {}
    tiled = _largest_allocation_per_batch_row(lambda: got.update(out=_cp1(inputs, topk, key_tile=32, query_tile=64)),
                                              inputs)
    assert tiled < s * s / 4, tiled
    assert _largest_allocation_per_batch_row(lambda: dense_scores(*inputs), inputs) >= s * s / 4
    check(compare(*got["out"], torch.arange(s), dense, order, topk))


def test_bad_arguments_are_clear_errors():
    import torch

    (q, w, k), _, _ = tie_inputs(8, torch.float32)
    for kw, words in [(dict(mode="dense"), "mode"), (dict(layout="spiral"), "layout"), (dict(topk=0), "topk"),
                      (dict(q_positions=torch.arange(4)), "one position per row")]:
        topk = kw.pop("topk", 3)
        with pytest.raises(ValueError, match=words):
            _cp1((q, w, k), topk, **kw)
    with pytest.raises(ValueError, match="expected q"):
        _cp1((q, w, k[:, :, :4]), 3)


if __name__ == "__main__":
    main()
