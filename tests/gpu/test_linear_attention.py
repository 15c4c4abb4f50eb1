"""Linear attention on the check's device (`tests.gpu.linear_attention`): fla's kernels against cp_ext's torch rule
(gated delta rule and segment summary, Gated DeltaNet and KDA, fp32 and bf16), and the state-passing CP op at CP2
over gloo against the single-device rule. Without CUDA or without fla the fla rows are one "not covered" row;
the CP rows run everywhere (on the CPU with the torch rule, at toy sizes)."""

import pytest

from tests.gpu.linear_attention import CP_CASES, CP_CHECK, FLA_CHECK, cp_row, fla_missing, fla_rows, run_cp_cases
from tests.gpu.rows import PASS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def truth_cache():
    """The float64 truth of each kind's inputs, computed once for both dtypes."""
    return {}


def test_fla_kernels_match_the_torch_rule(report, device, budget, truth_cache):
    report.start("single", FLA_CHECK)
    why = fla_missing(device)
    if why:
        report.not_covered(why)
    rows = [report.add(r) for r in fla_rows(device, budget, truth_cache)]
    assert all(r["status"] == PASS for r in rows), [r for r in rows if r["status"] != PASS]


def test_state_passing_cp2_over_gloo(report, device, budget, out_dir):
    report.start("single", CP_CHECK)
    results = run_cp_cases(device, budget.left(240), log_dir=out_dir)
    rows = [report.add(cp_row(case, results.get(case["name"]))) for case in CP_CASES]
    assert all(r["status"] == PASS for r in rows), [r for r in rows if r["status"] != PASS]
