"""Two or more GPUs: NCCL attention, a demo training, the bench's byte counts, the model's grid equivalence
(`tests.gpu.multi_gpu`). With fewer GPUs each is a "not covered" row."""

import pytest

from tests.gpu.multi_gpu import bench_row, demo_row, grid_row, nccl_attention_rows
from tests.gpu.rows import MULTI_GPU, NOT_COVERED, PASS

pytestmark = pytest.mark.gpu


@pytest.fixture
def gpus(report, device, gpu_count):
    def check(index):
        report.start("multi", MULTI_GPU[index])
        if gpu_count < 2:
            report.not_covered("needs 2+ GPUs" + ("" if device.type == "cuda" else " (--device cpu)"))
        return gpu_count
    return check


def test_nccl_attention(report, gpus, budget, out_dir):
    n = gpus(0)
    rows = [report.add(r) for r in nccl_attention_rows(out_dir, n, budget.left(150))]
    assert all(r["status"] in (PASS, NOT_COVERED) for r in rows), rows


def test_demo_training_loss_falls(report, gpus, budget, out_dir):
    n = gpus(1)
    r = report.add(demo_row(out_dir, n, budget.left(200)))
    assert r["status"] == PASS, r


def test_bench_attention_bytes_match_the_formula(report, gpus, budget, out_dir):
    n = gpus(2)
    r = report.add(bench_row(out_dir, n, budget.left(120)))
    assert r["status"] == PASS, r


def test_grid_equivalence_cp2(report, gpus, budget, out_dir):
    gpus(3)
    r = report.add(grid_row(out_dir, budget.left(120)))
    assert r["status"] == PASS, r
