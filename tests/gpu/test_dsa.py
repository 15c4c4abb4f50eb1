"""DeepSeek sparse attention's kernels on the check's device (`cp_ext.attention.dsa.sparse_attention`, `dsa_loss`), fp32.

* ``dsa sparse attention k20``: the indexer's top-20 (`indexer_topk`, tiled) and the sparse MQA attention over
  the latent, out and the gradients of q_nope, q_pe, c, k_pe, W_up, on the device, against float64 dense
  masked per-head MLA on the CPU (tests/attention/dsa/test_sparse_attention.py's model and reference); the selection must
  be the reference's.
* ``dsa sparse attention timing``: DSA and dense MLA timed on the device, each beside its counted floor.
* ``dsa indexer loss dense|sparse-k20``: the indexer loss and the gradients of the indexer's q, w, k on the
  device against float64 (tests/attention/dsa/test_indexer_loss.py's model and reference).

"ref" is the same model's dense fp32 reference on the CPU plus half an fp32 ulp of the largest true value, so
`gpu_check_bound`'s fp32 rule (2 x ref) is the CPU tests' bound.
On the CPU (the tool's CPU mode) the rows run there too, so the suite keeps them working.
"""

import pytest
import torch

from tests.attention.bounds import FP32_ULP
from tests.gpu.rows import FAIL, PASS, judge, row

pytestmark = pytest.mark.gpu


def _errors(got, truth, names):
    """{name: max |error|}, {name: max |truth|} of full-sequence results (got on any device)."""
    err = {n: (got[n].detach().cpu().double() - truth[n]).abs().max().item() for n in names}
    return err, {n: truth[n].abs().max().item() for n in names}


def _with_ulp(ref_err, max_truth):
    """"ref" plus half an fp32 ulp of each largest true value: the fp32 rule's 2 x ref then is the CPU tests'
    bound, 2 x ref + 1 ulp (`tests.attention.bounds.check_twice_single_device`)."""
    return {n: e + FP32_ULP / 2 * max_truth[n] for n, e in ref_err.items()}


def test_dsa_sparse_attention(report, device):
    from tests.attention.dsa import test_sparse_attention as sparse

    report.start("single", "dsa sparse attention k20")
    attn, indexer, order = sparse.model_inputs()
    truth, ref = sparse.reference(attn, order, 20, torch.float64), sparse.reference(attn, order, 20, torch.float32)
    on = lambda ts: [t.to(device) for t in ts]  # noqa: E731
    got, chosen = sparse.cp_path(on(attn), on(indexer), 20, torch.arange(sparse.S, device=device))
    err, max_truth = _errors(got, truth, sparse.TENSORS)
    ref_err, _ = _errors(ref, truth, sparse.TENSORS)
    wrong = sparse.selection_wrong(chosen.cpu(), torch.arange(sparse.S), order, 20)
    r = report.add(judge("single", "dsa sparse attention k20", "fp32", err, _with_ulp(ref_err, max_truth), max_truth,
                         ok=wrong == 0,
                         wrong_selection=wrong))
    assert r["status"] == PASS, r


@pytest.mark.parametrize("topk", [None, 20], ids=["dense", "sparse-k20"])
def test_dsa_indexer_loss(report, device, topk):
    from tests.attention.dsa import test_indexer_loss as loss

    check = f"dsa indexer loss {'dense' if topk is None else 'sparse-k20'}"
    report.start("single", check)
    q, kv, indexer, order = loss.loss_inputs()
    truth, ref = (loss.reference(q, kv, indexer, order, topk, dtype) for dtype in (torch.float64, torch.float32))
    everywhere = torch.arange(loss.S, device=device)
    idx = [t.to(device) for t in indexer]
    chosen = loss.chosen_keys(idx, topk, everywhere)
    got = loss.cp_path(q.to(device), kv.to(device), idx, chosen, everywhere)
    err, max_truth = _errors(got, truth, loss.TENSORS)
    ref_err, _ = _errors(ref, truth, loss.TENSORS)
    r = report.add(judge("single", check, "fp32", err, _with_ulp(ref_err, max_truth), max_truth))
    assert r["status"] == PASS, r


def test_dsa_timing_against_dense(report, device):
    """``dsa sparse attention timing``: DSA (the indexer's top-k, the sparse attention, fwd + bwd) against dense
    causal MLA with per-head K/V on this device, at V3.2's 128 heads (s = 8192, k = 512 on a GPU; a toy size on
    the CPU), each time beside its counted floor (`cp_ext.bench.dsa_floor`). A measurement, not a judgement:
    the row passes when both ran and their gradients are finite; the figures are in its detail."""
    from cp_ext.bench.dsa_floor import time_single_device

    report.start("single", "dsa sparse attention timing")
    big = device.type == "cuda"
    res = time_single_device(device, s=8192 if big else 256, topk=512 if big else 32, heads=128 if big else 8,
                             index_heads=64 if big else 4)
    r = report.add(row("single", "dsa sparse attention timing", PASS if res["finite"] else FAIL,
                       f"sparse {res['sparse_over_floor']:.2f}x floor; dsa / dense {res['dsa_over_dense']:.3f}",
                       f"counted dsa / dense {res['counted_dsa_over_dense']:.3f}", **res))
    assert r["status"] == PASS, r
