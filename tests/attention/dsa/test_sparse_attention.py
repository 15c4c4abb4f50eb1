"""DSA's sparse attention (`cp_ext.attention.dsa.sparse_attention`) under CP against a float64 reference of the same model.

The model is DeepSeek-V3.2's attention at toy size: MLA (a latent c of rank R, a shared RoPE key k_pe,
W_up = linear_kv_up_proj.weight) whose queries attend only to the top-k keys of the lightning indexer
(`tests.attention.dsa.test_indexer.draw_inputs`: no query's k-th and (k+1)-th scores within 1e-4 relative,
so the fp32 selection agreeing with the float64 one is not luck). The reference (`reference`) is written
independently: per-head K/V up-projected in float64, the dense [s, s] scores masked to each query's
reference top-k, a softmax, and autograd. The path under test is what cp_ext runs: `indexer_topk` on the
rank's shard, the query absorbed into the latent's space, `sparse_attention` on the ring or all-gather,
the output up-projected.

Bounds: out and every gradient (q_nope, q_pe, c, k_pe, W_up) within 2x the single-device fp32 error of the
same path at CP = 1, plus one fp32 ulp of the largest true value (`check`).

Worker (4 gloo ranks, one launch): ring 2 and 4 (zigzag, contiguous) and all-gather 2 and 4, each with
k = 3 (within one zigzag chunk), 20 (spanning several ranks; queries before position 19 have fewer keys),
64 (= s: DSA is dense MLA) and 100 (> s), ragged query tiles of 6, each through both ways a tile reads its
keys (``gather``: each query's own rows; ``union``: the tile's union, masked) and the count's choice
(``auto``). Rings of 2 are the pairs [0, 1], [2, 3].
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.bounds import check_twice_single_device, shard_errors  # noqa: E402
from tests.attention.dsa.test_indexer import B, S, draw_inputs  # noqa: E402
from tests.launch import case_params, launch, selected, worker_args, write_results  # noqa: E402

NPROC = 4
HEADS, D_NOPE, ROPE, D_V, RANK = 4, 8, 4, 6, 12  # MLA: d_qk = 12, latent R + P = 16
SCALE = (D_NOPE + ROPE) ** -0.5
TOPKS = (3, 20, 64, 100)
QUERY_TILE = 6
TENSORS = ("out", "q_nope", "q_pe", "c", "k_pe", "w_up")
PATHS = ("gather", "union", "auto")


def _cases():
    return [dict(name=f"{mode}{cp}-{layout}-k{topk}-{path}", mode=mode, cp=cp, layout=layout, topk=topk, path=path)
            for mode, cp, layout in [("ring", 2, "zigzag"), ("ring", 2, "contiguous"), ("ring", 4, "zigzag"),
                                     ("ring", 4, "contiguous"), ("all_gather", 2, "zigzag"),
                                     ("all_gather", 4, "zigzag"), ("all_gather", 4, "contiguous")]
            for topk in TOPKS for path in PATHS]


CASES = _cases()
QUICK = ["ring4-zigzag-k20-union", "ring4-zigzag-k20-gather", "all_gather4-contiguous-k3-auto"]


# ----------------------------------------------------------------------------- the model and its reference
def model_inputs(seed=1):
    """(q_nope, q_pe, c, k_pe, w_up, grad_out) in fp32, plus the indexer's (q, w, k) and reference order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    attn = [torch.randn(S, B, HEADS, D_NOPE, generator=g), torch.randn(S, B, HEADS, ROPE, generator=g),
            torch.randn(S, B, RANK, generator=g), torch.randn(S, B, ROPE, generator=g),
            torch.randn(HEADS * (D_NOPE + D_V), RANK, generator=g) * RANK ** -0.5,
            torch.randn(S, B, HEADS, D_V, generator=g)]
    indexer, _, order = draw_inputs(S, torch.float32, TOPKS)
    return attn, indexer, order


def reference(attn, order, topk, dtype):
    """out and the gradients of sum(out * grad_out) by dense masked per-head MLA in ``dtype``."""
    import torch

    q_nope, q_pe, c, k_pe, w_up = [t.to(dtype, copy=True).requires_grad_() for t in attn[:5]]
    kv = torch.einsum("sbr,xr->sbx", c, w_up).view(S, B, HEADS, D_NOPE + D_V)
    k = torch.cat([kv[..., :D_NOPE], k_pe[:, :, None].expand(-1, -1, HEADS, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    mask = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for t in range(S):
            mask[b, t, order[b][t][:topk]] = True
    scores = torch.einsum("tbhd,sbhd->bhts", q, k).mul(SCALE).masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("bhts,sbhd->tbhd", scores.softmax(-1), kv[..., D_NOPE:])
    (out * attn[5].to(dtype)).sum().backward()
    return dict(out=out.detach(), q_nope=q_nope.grad, q_pe=q_pe.grad, c=c.grad, k_pe=k_pe.grad, w_up=w_up.grad)


def cp_path(attn, indexer, topk, positions, *, group=None, mode="ring", layout="zigzag", query_tile=QUERY_TILE,
            path="auto"):
    """cp_ext's DSA on this rank's shard (``positions``): out and the gradients; W_up's summed over ``group``."""
    import torch
    import torch.distributed as dist

    from cp_ext.attention.dsa.indexer import indexer_topk
    from cp_ext.attention.dsa.sparse_attention import absorb_query, sparse_attention, up_project_output

    q_nope, q_pe, c, k_pe = [t.index_select(0, positions).requires_grad_() for t in attn[:4]]
    w_up = attn[4].clone().requires_grad_()
    iq, iw, ik = [t.index_select(0, positions) for t in indexer]
    chosen, _ = indexer_topk(iq, iw, ik, topk=topk, q_positions=positions, group=group, layout=layout, mode=mode)
    q = absorb_query(q_nope, q_pe, w_up)
    latent = sparse_attention(q, torch.cat([c, k_pe], dim=-1), chosen, softmax_scale=SCALE, v_head_dim=RANK,
                              group=group, layout=layout, mode=mode, positions=positions, query_tile=query_tile,
                              path=path)
    out = up_project_output(latent, w_up, D_NOPE)
    (out * attn[5].index_select(0, positions)).sum().backward()
    if group is not None:
        dist.all_reduce(w_up.grad, group=group)  # each rank's share of d W_up: DDP's reduction, here by hand
    return dict(out=out.detach(), q_nope=q_nope.grad, q_pe=q_pe.grad, c=c.grad, k_pe=k_pe.grad, w_up=w_up.grad), chosen


def errors(got, truth, positions):
    """{tensor: (max |error|, max |truth|)} of this rank's shard (W_up: whole)."""
    return shard_errors(got, truth, positions, TENSORS, whole=("w_up",))


def check(err, ref_err):
    """Every tensor within 2x the single-device fp32 error plus one ulp of its largest true value."""
    check_twice_single_device(err, ref_err, TENSORS)


def selection_wrong(chosen, positions, order, topk):
    """How many of this rank's queries did not select the reference's top-k set."""
    rows = chosen.tolist()
    return sum(sorted(p for p in rows[b][i] if p >= 0) != sorted(order[b][t][:topk])
               for b in range(B) for i, t in enumerate(positions.tolist()))


# ----------------------------------------------------------------------------- worker
def main():
    import torch
    import torch.distributed as dist

    from cp_ext.token_partition import context_parallel_positions
    from tests.attention.reference import init_four_ranks

    args = worker_args()
    _, groups = init_four_ranks()
    attn, indexer, order = model_inputs()
    everything = torch.arange(S)
    results = {}
    truths, single = {}, {}
    for case in selected(CASES, args):
        topk, path = case["topk"], case["path"]
        if topk not in truths:
            truths[topk] = reference(attn, order, topk, torch.float64)
        if (topk, path) not in single:  # the same path's error at CP = 1
            single[topk, path] = errors(cp_path(attn, indexer, topk, everything, path=path)[0], truths[topk],
                                        everything)
        group = groups[case["cp"]]
        positions = context_parallel_positions(S, ring_rank=dist.get_rank(group), ring_size=case["cp"],
                                               layout=case["layout"])
        got, chosen = cp_path(attn, indexer, topk, positions, group=group, mode=case["mode"], layout=case["layout"],
                              path=case["path"])
        results[case["name"]] = dict(err=errors(got, truths[topk], positions), ref_err=single[topk, path],
                                     wrong_selection=selection_wrong(chosen, positions, order, topk))
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest: CP cases
@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, NPROC, cases=QUICK if quick else None)


@pytest.mark.parametrize("case", case_params(CASES, quick=QUICK))
def test_cp_matches_float64_reference(results, case):
    for res in results.values():
        assert res[case["name"]]["wrong_selection"] == 0
        check(res[case["name"]]["err"], res[case["name"]]["ref_err"])


# ----------------------------------------------------------------------------- pytest: one process
@pytest.mark.quick
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("topk", TOPKS)
def test_single_process_matches_float64_reference(topk, path):
    """CP = 1, ragged query tiles: within 2x the fp32 error of the dense masked model in fp32."""
    import torch

    attn, indexer, order = model_inputs()
    truth, everything = reference(attn, order, topk, torch.float64), torch.arange(S)
    got, chosen = cp_path(attn, indexer, topk, everything, path=path)
    assert selection_wrong(chosen, everything, order, topk) == 0
    check(errors(got, truth, everything), errors(reference(attn, order, topk, torch.float32), truth, everything))


@pytest.mark.parametrize("path", PATHS)
def test_topk_at_least_s_is_dense_mla(path):
    """k >= s selects every causal key: the result is cp_ext's dense causal MLA attention (the latent
    ring's kernels, `LatentKV`) within fp32 rounding."""
    import torch

    from cp_ext.attention.cp.context_parallel import local_attention
    from cp_ext.attention.dsa.sparse_attention import absorb_query, sparse_attention, up_project_output

    attn, indexer, order = model_inputs()
    q_nope, q_pe, c, k_pe, w_up = attn[:5]
    kv = torch.einsum("sbr,xr->sbx", c, w_up).view(S, B, HEADS, D_NOPE + D_V)
    k = torch.cat([kv[..., :D_NOPE], k_pe[:, :, None].expand(-1, -1, HEADS, -1)], dim=-1)
    dense = local_attention(torch.cat([q_nope, q_pe], -1), k, kv[..., D_NOPE:].contiguous(), causal=True,
                            softmax_scale=SCALE)
    every = torch.tensor([[list(range(t + 1)) + [-1] * (S - t - 1) for t in range(S)]] * B)
    sparse = up_project_output(sparse_attention(absorb_query(q_nope, q_pe, w_up), torch.cat([c, k_pe], -1), every,
                                                softmax_scale=SCALE, v_head_dim=RANK, query_tile=QUERY_TILE,
                                                path=path), w_up, D_NOPE)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ("gather", "union"))
def test_broken_backward_or_merge_fails_the_check(monkeypatch, path):
    """The bounds can fail: a backward that drops the values' gradient, or a tile that drops one
    selected key of each query, is far outside them, on either path."""
    import torch

    import cp_ext.attention.dsa.sparse_tiles as tiles
    from cp_ext.attention.dsa.key_block_ring import KeyBlock

    attn, indexer, order = model_inputs()
    truth, everything = reference(attn, order, 20, torch.float64), torch.arange(S)
    ref_err = errors(reference(attn, order, 20, torch.float32), truth, everything)
    original_scatter, original_columns = tiles.scatter_add, KeyBlock.columns

    def no_value_grad(dblock, cols, dkeys):
        dkeys[..., :RANK] = 0
        original_scatter(dblock, cols, dkeys)

    def one_key_dropped(self, chosen):
        cols = original_columns(self, chosen)
        last = cols.argmax(dim=-1, keepdim=True)  # each query's highest block row (a query with none: stays -1)
        return cols.scatter(-1, last, -1)

    for target, name, broken in [(tiles, "scatter_add", no_value_grad), (KeyBlock, "columns", one_key_dropped)]:
        with monkeypatch.context() as m:
            m.setattr(target, name, broken)
            with pytest.raises(AssertionError):
                check(errors(cp_path(attn, indexer, 20, everything, query_tile=4, path=path)[0], truth, everything),
                      ref_err)


@pytest.mark.parametrize("path", ("gather", "union"))
def test_tiles_compute_only_selected_keys_or_their_union(path):
    """At s = 64, k = 3, query tile 8: nothing allocated is larger than the query itself (a quarter of the
    dense [b, h, s, s] scores); the gather path scores exactly the selection's query-key pairs, the union
    path each tile's queries against the union of their selections (counted, at least the selection)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from cp_ext.attention.dsa.sparse_attention import sparse_attention
    from cp_ext.perf.counter import count_work

    attn, indexer, order = model_inputs()
    q = torch.randn(S, B, HEADS, RANK + ROPE)
    kv = torch.cat([attn[2], attn[3]], -1)
    chosen = torch.tensor([[order[b][t][:3] + [-1] * (3 - len(order[b][t][:3])) for t in range(S)] for b in range(B)])

    class Largest(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and func.__name__ not in ("randn.default",):
                Largest.elements = max(Largest.elements, out.numel())
            return out

    with count_work() as counts, Largest():
        sparse_attention(q, kv, chosen, softmax_scale=SCALE, v_head_dim=RANK, query_tile=8, path=path)
    selected = int((chosen >= 0).sum())
    assert counts.bytes["pairs"] == selected
    if path == "union":
        unions = sum(8 * B * max(len({p for t in range(r, r + 8) for p in order[b][t][:3]}) for b in range(B))
                     for r in range(0, S, 8))  # a tile's union is padded to its largest batch entry's
        assert counts.bytes["union_pairs"] == unions > selected
    else:
        assert "union_pairs" not in counts.bytes
    assert Largest.elements <= q.numel() < B * HEADS * S * S, Largest.elements
    assert Largest.elements >= S * B * HEADS * RANK  # the output itself, so the counter sees allocations


def test_auto_path_follows_the_count():
    """``auto`` reads a tile through its union when the selections overlap and the heads are few, and
    through per-query gathers when they are scattered and the heads many (`sparse_tiles.plan_tile`)."""
    import torch

    from cp_ext.attention.dsa.key_block_ring import KeyBlock
    from cp_ext.attention.dsa.sparse_tiles import GATHER_COST_HEADS, plan_tile

    n, t, k = 4096, 16, 64
    block = KeyBlock(torch.zeros(1, n, 8), torch.arange(n), n)
    shared = torch.arange(k).expand(1, t, k)  # every query the same keys: the union is the selection
    scattered = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:t * k].view(1, t, k)  # disjoint
    assert plan_tile(block, shared, heads=4).path == "union"
    assert plan_tile(block, shared, heads=512).path == "union"
    assert plan_tile(block, scattered, heads=4).path == "union"  # 16x the pairs, under 2 + 64 / 4 = 18x
    assert plan_tile(block, scattered, heads=GATHER_COST_HEADS).path == "gather"
    assert plan_tile(block, scattered, heads=4, path="gather").path == "gather"
    assert plan_tile(block, torch.full((1, t, k), -1), heads=4) is None


def test_bad_arguments_are_clear_errors():
    import torch

    from cp_ext.attention.dsa.sparse_attention import sparse_attention

    q, kv, chosen = torch.zeros(8, 1, 2, 6), torch.zeros(8, 1, 6), torch.zeros(1, 8, 2, dtype=torch.int64)
    for kw, words in [(dict(mode="dense"), "mode"), (dict(layout="spiral"), "layout"), (dict(v_head_dim=7), "v_head_dim"),
                      (dict(kv=torch.zeros(8, 1, 5)), "expected q"), (dict(path="dense"), "sparse path")]:
        call = dict(dict(kv=kv, softmax_scale=1.0, v_head_dim=4), **kw)
        with pytest.raises(ValueError, match=words):
            sparse_attention(q, call.pop("kv"), chosen, **call)


if __name__ == "__main__":
    main()
