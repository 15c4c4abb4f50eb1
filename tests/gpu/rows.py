"""The GPU check's summary rows, how a measured row is judged, and the verdict over all rows.

A row is one line of tools/gpu_check.py's table and of ``summary.json``'s "rows": ``part``
("single": one device, "multi": every GPU), ``check`` (its name), ``status`` (PASS, FAIL, or
"not covered": not run here, which never counts as a pass), ``figure`` (what was measured),
``bound`` and ``detail``. Each test of tests/gpu reports its rows (conftest's ``report`` fixture).
"""

from tests.attention.bounds import gpu_check_bound, ratio_to_bound

PASS, FAIL, NOT_COVERED = "PASS", "FAIL", "not covered"
CUDA_KERNELS = "pytest tests/attention/kernels/test_cuda_kernels.py"
FAMILIES = "Megatron-LM's MoE scripts on 1 GPU"
ASYNC_SAVE = "--async-save on 1 GPU"
MULTI_GPU = ("NCCL attention: ring / Ulysses / hybrid", "demo training --bf16: loss falls",
             "bench_attention: bytes == formula", "model grid equivalence CP2 ring/Ulysses vs 1 GPU (fp32, 1e-5)")


def row(part, check, status, figure="", bound="", **detail):
    return dict(part=part, check=check, status=status, figure=figure, bound=bound, detail=detail)


def judge(part, check, dtype, err, ref_err, max_truth, ok=True, **detail):
    """One row from per-tensor errors: FAIL if any tensor is over its bound (NaN is over) or not ``ok``
    (a result in the wrong dtype)."""
    bounds = {t: gpu_check_bound(dtype, ref_err[t], max_truth[t]) for t in err}
    ratio = {t: ratio_to_bound(err[t], bounds[t]) for t in err}
    worst = max(ratio, key=ratio.get)
    passed = ok and all(r <= 1 for r in ratio.values())
    return row(part, check, PASS if passed else FAIL, f"{worst} {err[worst]:.2e}", f"{bounds[worst]:.2e}",
               err=err, ref_err=ref_err, max_truth=max_truth, bounds=bounds, dtypes_ok=ok, **detail)


def verdict(rows):
    """(exit status, final line): 1 on any FAIL or when the ring on one device did not run, else 0."""
    failed = [r["check"] for r in rows if r["status"] == FAIL]
    ran = [r for r in rows if r["status"] != NOT_COVERED]
    missing = [r["check"] for r in rows if r["status"] == NOT_COVERED]
    if failed:
        return 1, f"gpu_check: FAILED: {len(failed)} of {len(ran)} checks failed: {'; '.join(failed[:5])}"
    if not any(r["part"] == "single" and r["check"].startswith("sim-ring") and r["status"] == PASS for r in rows):
        return 1, "gpu_check: FAILED: the simulated ring did not run (no kernel could run here)"
    line = f"gpu_check: PASSED: all {len(ran)} checks that ran passed"
    if missing:
        line += f"; NOT covered (not run, so not vouched for): {'; '.join(missing)}"
    return 0, line
