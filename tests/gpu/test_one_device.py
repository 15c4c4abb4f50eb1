"""The ring on one device with every kernel that runs here, and packed documents through every kernel.

* ``sim-ring C4 s200 KERNEL DTYPE causal|full MHA 8/8|GQA 8/2``: the library's ring on C = 4 ranks
  of this device (`tests.gpu.ring_harness`: zigzag, s = 200, half tiles of 25 rows, so the
  efficient kernel pads its LSE from 25 / 50 rows to 32 / 64), every kernel of `KERNELS` that can
  run here x fp64/fp32/bf16/fp16 (where `kernel_problem` allows) x causal/full x MHA/GQA (h 8,
  kv 8 or 2, d 64): out, LSE, dq, dk, dv against float64 truth on the CPU.
* ``docs kernel ...``: every kernel x dtype's ``forward_segments`` / ``backward_segments`` on the
  tiles of `DOC_TILES` (diagonal causal and full, an off-diagonal tile cutting documents at both
  edges, q documents of one row each) against float64 per-document truth.
* ``docs sim-ring ...``: the ring with ``document_ids`` (causal / full, GQA 8/2); rows without keys
  must give out 0 and LSE -inf.
* ``dynamic-cp sim-ring ...``: dynamic CP's layout (`cp_ext.token_partition.DocumentZigzag`: documents of
  `PER_DOCUMENT` tokens, each zigzagged over the 4 ranks on its own, as a dynamic group runs them),
  causal, GQA 8/2, every kernel x dtype.

Bounds: `tests.attention.bounds.gpu_check_bound`, "ref" the same attention on one device in the dtype.
"""

import pytest

from cp_ext.attention.kernels import KERNELS, kernel_problem
from tests.gpu.one_device import (DOC_VARIANTS, DTYPES, RING_VARIANTS, SIM, doc_kernel_row, doc_label, doc_sim_label,
                                  sim_label)
from tests.gpu.ring_harness import PER_DOCUMENT, ring_case, ring_row, run_ring_cases
from tests.gpu.rows import PASS

pytestmark = pytest.mark.gpu

RING = [(k, dt, causal, gqa) for k in KERNELS for dt in DTYPES for causal, gqa in RING_VARIANTS]
DOCS_RING = [(k, dt, causal) for k in KERNELS for dt in DTYPES for causal in (True, False)]
DOCS_KERNEL = [(k, dt, tile, gqa) for k in KERNELS for dt in DTYPES for tile, gqa in DOC_VARIANTS]
DYNAMIC_RING = [(k, dt) for k in KERNELS for dt in DTYPES]


def dynamic_label(kernel, dtype):
    return f"dynamic-cp sim-ring C{SIM['ring']} docs {'/'.join(map(str, PER_DOCUMENT))} {kernel} {dtype} causal GQA 8/2"


RING_CASES = ([ring_case(sim_label(*c), *c) for c in RING]
              + [ring_case(doc_sim_label(k, dt, causal), k, dt, causal, True, docs=True) for k, dt, causal in DOCS_RING]
              + [ring_case(dynamic_label(k, dt), k, dt, True, True, docs=True, per_document=True)
                 for k, dt in DYNAMIC_RING])


def _runs_here(report, device, kernel, dtype, what):
    reason = kernel_problem(kernel, DTYPES[dtype], SIM["d"], device.type)
    if reason:
        report.not_run_here(kernel, dtype, reason, what)


@pytest.fixture(scope="module")
def ring_results(device, budget, out_dir):
    """Every case the device runs, in one launch of the ring's ranks. Tests ask for it after
    ``report.start`` (``request.getfixturevalue``), so a launch that fails is a FAIL row of each check."""
    cases = [c for c in RING_CASES if kernel_problem(c["kernel"], DTYPES[c["dtype"]], SIM["d"], device.type) is None]
    return run_ring_cases(cases, device, timeout=budget.left(180), log_dir=out_dir)


@pytest.fixture(scope="module")
def truth_cache():
    """The document tiles' float64 truth and in-dtype references, computed once for every kernel."""
    return {}


def _ids(params):
    return [" ".join(str(p) for p in c) for c in params]


@pytest.mark.parametrize("kernel, dtype, causal, gqa", RING, ids=_ids(RING))
def test_ring_on_one_device(request, report, device, kernel, dtype, causal, gqa):
    _runs_here(report, device, kernel, dtype, "ring")
    check = sim_label(kernel, dtype, causal, gqa)
    report.start("single", check)
    r = report.add(ring_row(check, dtype, request.getfixturevalue("ring_results")[check]))
    assert r["status"] == PASS, r


@pytest.mark.parametrize("kernel, dtype, tile, gqa", DOCS_KERNEL, ids=_ids(DOCS_KERNEL))
def test_document_segments_of_each_kernel(report, device, budget, truth_cache, kernel, dtype, tile, gqa):
    _runs_here(report, device, kernel, dtype, "docs")
    report.start("single", doc_label(kernel, dtype, tile, gqa))
    budget.left(60)
    r = report.add(doc_kernel_row(kernel, dtype, tile, gqa, device, truth_cache))
    assert r["status"] == PASS, r


@pytest.mark.parametrize("kernel, dtype, causal", DOCS_RING, ids=_ids(DOCS_RING))
def test_ring_with_documents(request, report, device, kernel, dtype, causal):
    _runs_here(report, device, kernel, dtype, "docs")
    check = doc_sim_label(kernel, dtype, causal)
    report.start("single", check)
    r = report.add(ring_row(check, dtype, request.getfixturevalue("ring_results")[check]))
    assert r["status"] == PASS, r



@pytest.mark.parametrize("kernel, dtype", DYNAMIC_RING, ids=_ids(DYNAMIC_RING))
def test_ring_on_dynamic_cps_per_document_zigzag(request, report, device, kernel, dtype):
    _runs_here(report, device, kernel, dtype, "docs")
    check = dynamic_label(kernel, dtype)
    report.start("single", check)
    r = report.add(ring_row(check, dtype, request.getfixturevalue("ring_results")[check]))
    assert r["status"] == PASS, r
