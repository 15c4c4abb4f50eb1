"""DSA's indexer loss (`cp_ext.attention.dsa.indexer_loss`) under CP against a float64 reference and megatron-core's own.

The model is test_sparse's (MLA at toy size, its query absorbed into the latent's space) with
test_dsa_indexer's lightning indexer, whose weights are scaled by 2**-4 (a power of two: the same
selection, and the same separated top-k boundaries) so that the indexer's softmax is not one-hot.
The reference (`reference`) is written independently: dense float64 [b, h, s, s] attention scores and
[b, s, s] indexer scores, masked to the support (causal; with the sparse loss, the reference's top-k),
softmaxes, the KL summed over keys and averaged over every query, and autograd for the indexer's q, w, k.

Bounds: the loss and the gradients of the indexer's q, w and k within 2x the single-device fp32 error of
the same path at CP = 1, plus one fp32 ulp of the largest true value per rank whose share the loss sums
(`check`).

Worker (4 gloo ranks, one launch): ring 2 and 4 (zigzag, contiguous), all-gather 2 and 4, and TP2 x CP2
ring (each TP rank holds half the heads; the CP pairs are [0, 2] and [1, 3]); each with the dense loss and
the sparse loss at k = 3, 20 and 64; ragged query tiles of 6 and key tiles of 5. Each rank's loss is its
share: the CP group's shares are summed before the comparison, as the trainer reports it. Rank 0 also
runs megatron-core's ``compute_dsa_indexer_loss`` on the whole sequence (in fp32) for the comparison at
CP = 1.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.attention.bounds import check_twice_single_device, shard_errors  # noqa: E402
from tests.attention.dsa.test_sparse_attention import B, HEADS, SCALE, S, model_inputs  # noqa: E402
from tests.launch import case_params, launch, selected, worker_args, write_results  # noqa: E402

NPROC = 4
COEFF = 0.25
TOPKS = (None, 3, 20, 64)  # None: the dense loss
QUERY_TILE, KEY_TILE = 6, 5
TENSORS = ("loss", "iq", "iw", "ik")


def _name(topk):
    return "dense" if topk is None else f"sparse-k{topk}"


def _cases():
    return [dict(name=f"{mode}{cp}-{layout}-{_name(topk)}", mode=mode, cp=cp, layout=layout, topk=topk, tp=tp)
            for mode, cp, layout, tp in [("ring", 2, "zigzag", 1), ("ring", 2, "contiguous", 1),
                                         ("ring", 4, "zigzag", 1), ("ring", 4, "contiguous", 1),
                                         ("all_gather", 2, "zigzag", 1), ("all_gather", 4, "contiguous", 1),
                                         ("ring", 2, "zigzag", 2)]
            for topk in TOPKS]


def _fix_tp_names(cases):
    for case in cases:
        if case["tp"] > 1:
            case["name"] = "tp2-" + case["name"]
    return cases


CASES = _fix_tp_names(_cases())
QUICK = ["ring4-zigzag-dense", "all_gather4-contiguous-sparse-k20", "tp2-ring2-zigzag-sparse-k3"]


# ----------------------------------------------------------------------------- inputs and reference
def loss_inputs():
    """(q [s, b, h, r + p] absorbed, kv [s, b, r + p], (iq, iw, ik), reference order) in fp32."""
    import torch

    from cp_ext.attention.dsa.sparse_attention import absorb_query

    attn, (iq, iw, ik), order = model_inputs()
    q_nope, q_pe, c, k_pe, w_up = attn[:5]
    q = absorb_query(q_nope, q_pe, w_up).detach()
    return q, torch.cat([c, k_pe], -1), (iq, iw * 2.0 ** -4, ik), order


def support(order, topk):
    """[b, s, s] bool: each query's causal keys (topk None) or its reference top-k."""
    import torch

    mask = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for t in range(S):
            mask[b, t, order[b][t] if topk is None else order[b][t][:topk]] = True
    return mask


def reference(q, kv, indexer, order, topk, dtype):
    """{loss, iq, iw, ik}: the loss and its gradients by dense masked scores in ``dtype``."""
    import torch

    iq, iw, ik = [t.to(dtype, copy=True).requires_grad_() for t in indexer]
    mask = support(order, topk)
    att = torch.einsum("tbhd,sbd->bhts", q.to(dtype), kv.to(dtype)).mul(SCALE)
    target = att.masked_fill(~mask[:, None], float("-inf")).softmax(-1).sum(1)
    target = target / target.sum(-1, keepdim=True)
    index = torch.einsum("tbh,tbhs->bts", iw, torch.einsum("tbhd,sbd->tbhs", iq, ik).relu())
    log_q = index.masked_fill(~mask, float("-inf")).log_softmax(-1)
    kl = torch.where(mask, torch.special.xlogy(target, target) - target * log_q.masked_fill(~mask, 0), 0)
    loss = COEFF * kl.sum(-1).mean()
    loss.backward()
    return dict(loss=loss.detach().reshape(1), iq=iq.grad, iw=iw.grad, ik=ik.grad)


def cp_path(q, kv, indexer, chosen, positions, *, group=None, mode="ring", layout="zigzag", heads=slice(None),
            tp_group=None):
    """cp_ext's loss on this rank's shard: {loss (the group's shares summed), iq, iw, ik}."""
    import torch.distributed as dist

    from cp_ext.attention.dsa.indexer_loss import indexer_loss

    iq, iw, ik = [t.index_select(0, positions).requires_grad_() for t in indexer]
    loss = indexer_loss(q.index_select(0, positions)[:, :, heads], kv.index_select(0, positions), iq, iw, ik,
                        softmax_scale=SCALE, loss_coeff=COEFF, selected=chosen, group=group, layout=layout,
                        mode=mode, positions=positions, tp_group=tp_group, query_tile=QUERY_TILE, key_tile=KEY_TILE)
    loss.backward()
    total = loss.detach().clone().reshape(1)
    if group is not None:
        dist.all_reduce(total, group=group)
    return dict(loss=total, iq=iq.grad, iw=iw.grad, ik=ik.grad)


def errors(got, truth, positions):
    """{tensor: (max |error|, max |truth|)} of this rank's shard (the loss: whole)."""
    return shard_errors(got, truth, positions, TENSORS, whole=("loss",))


def check(err, ref_err, cp=1):
    """The bound; ``cp``: how many ranks' shares the loss sums (`check_twice_single_device`)."""
    check_twice_single_device(err, ref_err, TENSORS, shares={"loss": cp})


def chosen_keys(indexer, topk, positions, **kw):
    """The indexer's selection on this shard (cp_ext's `indexer_topk`), or None for the dense loss."""
    from cp_ext.attention.dsa.indexer import indexer_topk

    if topk is None:
        return None
    iq, iw, ik = [t.index_select(0, positions) for t in indexer]
    return indexer_topk(iq, iw, ik, topk=topk, q_positions=positions, **kw)[0]


def megatron_loss(q, kv, indexer, chosen, topk, tp_group):
    """megatron-core's compute_dsa_indexer_loss on the whole sequence at fp32: {loss, iq, iw, ik}."""
    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.experimental_attention_variant import dsa

    iq, iw, ik = [t.clone().requires_grad_() for t in indexer]
    scores_fn = getattr(dsa, "_compute_index_scores", None)
    if scores_fn is None:  # 0.16.1: a method of DSAIndexer that does not use self
        def scores_fn(*a):
            return dsa.DSAIndexer._compute_index_scores(None, *a)
    causal = torch.triu(torch.full((S, S), float("-inf")), diagonal=1)
    index_scores = scores_fn(iq, iw, ik) + causal  # what DSAttention hands the loss: masked scores
    positions = torch.arange(S).view(1, S, 1)
    topk_indices = positions.expand(B, S, 1) if chosen is None else torch.where(chosen >= 0, chosen, positions)
    loss = dsa.compute_dsa_indexer_loss(index_scores, topk_indices, q, kv[:, :, None].expand(-1, -1, HEADS, -1),
                                        SCALE, COEFF, topk is not None, ProcessGroupCollection(tp=tp_group))
    loss.backward()
    return dict(loss=loss.detach().reshape(1), iq=iq.grad, iw=iw.grad, ik=ik.grad)


# ----------------------------------------------------------------------------- worker
def main():
    import torch
    import torch.distributed as dist

    from cp_ext.token_partition import context_parallel_positions
    from tests.attention.reference import init_four_ranks

    args = worker_args()
    rank, groups = init_four_ranks()
    cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # TP2 x CP2: CP pairs across the TP pairs
    solo = [dist.new_group([r]) for r in range(NPROC)]
    q, kv, indexer, order = loss_inputs()
    everything = torch.arange(S)
    results, truths, single = {}, {}, {}
    for case in selected(CASES, args):
        topk = case["topk"]
        if topk not in truths:
            truths[topk] = reference(q, kv, indexer, order, topk, torch.float64)
            chosen = chosen_keys(indexer, topk, everything)
            single[topk] = errors(cp_path(q, kv, indexer, chosen, everything), truths[topk], everything)
            if rank == 0:
                results[f"megatron-{_name(topk)}"] = dict(
                    err=errors(megatron_loss(q, kv, indexer, chosen, topk, solo[rank]), truths[topk], everything),
                    ours=single[topk])
        tp_group, heads = None, slice(None)
        group = groups[case["cp"]]
        if case["tp"] > 1:
            group, tp_group = cross[rank % 2], groups[2]
            half = HEADS // 2
            heads = slice(half * (rank % 2), half * (rank % 2 + 1))  # the TP pair [0, 1] / [2, 3] splits the heads
        positions = context_parallel_positions(S, ring_rank=dist.get_rank(group), ring_size=case["cp"],
                                               layout=case["layout"])
        kw = dict(group=group, mode=case["mode"], layout=case["layout"])
        chosen = chosen_keys(indexer, topk, positions, **kw)
        got = cp_path(q, kv, indexer, chosen, positions, heads=heads, tp_group=tp_group, **kw)
        results[case["name"]] = dict(err=errors(got, truths[topk], positions), ref_err=single[topk])
    write_results(args.results_dir, results)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- pytest: CP cases
@pytest.fixture(scope="module")
def results(quick):
    return launch(__file__, NPROC, cases=QUICK if quick else None)


@pytest.mark.parametrize("case", case_params(CASES, quick=QUICK))
def test_cp_matches_float64_reference(results, case):
    for res in results.values():
        check(res[case["name"]]["err"], res[case["name"]]["ref_err"], cp=case["cp"])


@pytest.mark.parametrize("topk", [pytest.param(t, marks=[pytest.mark.quick] if t == 3 else []) for t in TOPKS],
                         ids=_name)
def test_cp1_matches_megatron_cores_loss(results, topk):
    """At CP = 1 cp_ext's loss and gradients are as close to float64 as megatron-core's own (the fp32
    formula DSAttention runs: dense [b, h, s, s] scores), within the same bound; whichever cases ran."""
    name = f"megatron-{_name(topk)}"
    if name not in results[0]:
        pytest.skip("the quick subset's launch ran other losses")
    res = results[0][name]
    check(res["ours"], res["err"])


# ----------------------------------------------------------------------------- pytest: one process
@pytest.mark.quick
@pytest.mark.parametrize("topk", TOPKS, ids=_name)
def test_single_process_matches_float64_reference(topk):
    """CP = 1, ragged tiles: within 2x the fp32 error of the dense masked reference in fp32."""
    import torch

    q, kv, indexer, order = loss_inputs()
    truth, everything = reference(q, kv, indexer, order, topk, torch.float64), torch.arange(S)
    got = cp_path(q, kv, indexer, chosen_keys(indexer, topk, everything), everything)
    check(errors(got, truth, everything), errors(reference(q, kv, indexer, order, topk, torch.float32), truth,
                                                  everything))


def test_broken_target_or_gradient_fails_the_check(monkeypatch):
    """The bounds can fail: a gradient that drops the target's term, or a support missing one key per query."""
    import torch

    import cp_ext.attention.dsa.indexer_loss as dsa_loss

    q, kv, indexer, order = loss_inputs()
    truth, everything = reference(q, kv, indexer, order, 20, torch.float64), torch.arange(S)
    ref_err = errors(reference(q, kv, indexer, order, 20, torch.float32), truth, everything)
    chosen = chosen_keys(indexer, 20, everything)

    def no_target_in_grad(q, target, valid):  # d I = Q alone: the target's term dropped
        return torch.where(valid, q, 0.0)

    for broken_chosen, patch in [(chosen, ("_index_score_grad", no_target_in_grad)), (chosen[..., 1:], None)]:
        with monkeypatch.context() as m:
            if patch:
                m.setattr(dsa_loss, *patch)
            with pytest.raises(AssertionError):
                check(errors(cp_path(q, kv, indexer, broken_chosen, everything), truth, everything), ref_err)


def test_no_square_tensor_and_no_gradient_for_the_main_model():
    """Dense loss at s = 64, query tile 8, key tile 8: nothing allocated is larger than the inputs (a quarter
    of the [b, h, s, s] scores megatron's loss builds); q and kv get no gradient even when they ask for one."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from cp_ext.attention.dsa.indexer_loss import indexer_loss

    q, kv, (iq, iw, ik), _ = loss_inputs()
    q, kv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    iq, iw, ik = [t.clone().requires_grad_() for t in (iq, iw, ik)]

    class Largest(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.elements = max(Largest.elements, t.numel())
            return out

    with Largest():
        loss = indexer_loss(q, kv, iq, iw, ik, softmax_scale=SCALE, loss_coeff=COEFF, query_tile=8, key_tile=8)
        loss.backward()
    assert Largest.elements <= max(q.numel(), iq.numel()) < B * HEADS * S * S, Largest.elements
    assert q.grad is None and kv.grad is None and ik.grad is not None


def test_bad_arguments_are_clear_errors():
    import torch

    from cp_ext.attention.dsa.indexer_loss import indexer_loss

    q, kv, (iq, iw, ik), _ = loss_inputs()
    kw = dict(softmax_scale=SCALE, loss_coeff=COEFF)
    for call, match in [(lambda: indexer_loss(q, kv[:, :, :-1], iq, iw, ik, **kw), "expected q"),
                        (lambda: indexer_loss(q, kv, iq, iw[..., :-1], ik, **kw), "weights"),
                        (lambda: indexer_loss(q, kv, iq, iw, ik, selected=torch.zeros(B, 3, 2), **kw), "selected"),
                        (lambda: indexer_loss(q, kv, iq, iw, ik, key_tile=0, **kw), "key_tile"),
                        (lambda: indexer_loss(q, kv, iq, iw, ik, mode="ulysses", **kw), "mode")]:
        with pytest.raises(ValueError, match=match):
            call()


if __name__ == "__main__":
    main()
