"""On one GPU: tests/attention/kernels/test_cuda_kernels.py passes with nothing skipped, and Megatron-LM's five MoE
scripts' flags (tests/families, shrunk in sizes, bf16) train 3 iterations each, and --async-save's checkpoints
equal the synchronous ones (`tests.gpu.runs`). Without CUDA these are "not covered" rows."""

import pytest

from tests.families import FAMILIES
from tests.gpu.rows import ASYNC_SAVE, CUDA_KERNELS, FAMILIES as FAMILIES_CHECK, PASS
from tests.gpu.runs import async_save_row, family_row, pytest_row

pytestmark = pytest.mark.gpu


def test_cuda_kernels_pass(report, device, budget, out_dir):
    report.start("single", CUDA_KERNELS)
    if device.type != "cuda":
        report.not_covered("needs CUDA")
    r = report.add(pytest_row("single", CUDA_KERNELS, out_dir, "test_cuda_kernels",
                              ["tests/attention/kernels/test_cuda_kernels.py"], budget.left(150)))
    assert r["status"] == PASS, r


def test_families_train_on_one_gpu(report, device, budget, out_dir):
    report.start("single", FAMILIES_CHECK)
    if device.type != "cuda":
        report.not_covered("needs CUDA")
    timeout_each = budget.left(40)  # for each family
    rows = [report.add(family_row(family, out_dir, timeout_each)) for family in FAMILIES]
    assert all(r["status"] == PASS for r in rows), rows


def test_async_save_on_one_gpu(report, device, budget, out_dir):
    report.start("single", ASYNC_SAVE)
    if device.type != "cuda":
        report.not_covered("needs CUDA")
    r = report.add(async_save_row(out_dir, budget.left(90)))
    assert r["status"] == PASS, r
