"""DeepSeek-V4's attention on the check's device: `cp_ext.attention.compressed.compressed_attention` (one device,
the whole sequence) for each layer kind (sliding window, CSA with its indexer, HCA), packed documents, fp32 and bf16,
against the float64 reference on the CPU (`tests.attention.compressed.reference`, pinned to transformers'
``DeepseekV4Attention``). "ref" is the same reference run on the device in the dtype; the bound per tensor is
`tests.attention.bounds.gpu_check_bound` (fp32: 2 x ref, capped at 1e-4; bf16: 2 x ref + 2**-8 x max|truth|).
Inputs: the CP test's (its exact-zero indexer ties included, which every dtype breaks alike: the earlier entry
wins), 40 tokens in three documents. The CP layouts of the same op are tests/attention/compressed's (gloo, CPU)."""

import pytest
import torch

from tests.attention.compressed import reference as ref
from tests.attention.compressed.test_context_parallel import TOPK, run_layer
from tests.gpu.rows import PASS, judge

pytestmark = pytest.mark.gpu

CHECK = "DeepSeek-V4 attention (sliding, CSA, HCA) vs float64"
S, WINDOW = 40, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _on(t, device, dtype):
    return {k: (v.detach().to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                .requires_grad_(v.requires_grad)) for k, v in t.items()}


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_v4_attention_matches_float64(report, device, kind, dtype):
    report.start("single", CHECK)
    lengths = ref.document_lengths(S, True)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    t, grad = ref.inputs(kind, S, seed=5)
    truth = ref.forward_backward(lambda t: ref.reference(t, kind, WINDOW, TOPK, lengths), t, grad)
    case = dict(kind=kind, window=WINDOW, s=S)
    on = _on(t, device, DTYPES[dtype])
    got = ref.forward_backward(lambda t: run_layer(t, case, torch.arange(S, device=device), None, ids.to(device)),
                               on, grad.to(device, DTYPES[dtype]))
    on_ref = _on(t, device, DTYPES[dtype])
    single = ref.forward_backward(lambda t: ref.reference(t, kind, WINDOW, TOPK, lengths), on_ref,
                                  grad.to(device, DTYPES[dtype]))
    names = [n for n in truth if n in got]
    err = {n: (got[n].double().cpu() - truth[n]).abs().max().item() for n in names}
    ref_err = {n: (single[n].double().cpu() - truth[n]).abs().max().item() for n in names}
    max_truth = {n: truth[n].abs().max().item() for n in names}
    row = report.add(judge("single", f"v4 {kind} {dtype}", dtype, err, ref_err, max_truth, device=str(device)))
    assert row["status"] == PASS, row
