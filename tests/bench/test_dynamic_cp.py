"""tools/bench_dynamic_cp.py and its counts (`cp_ext.bench.dynamic_cp`): every plan counts the same causal pairs
(the documents' L (L + 1) / 2), a per-document zigzag splits a document's pairs evenly, static CP's packed
zigzag does not, the modelled step follows its formula on a hand-worked case, and the tool prints the three
plans of the same documents."""

import json
import subprocess
import sys

import numpy as np
import pytest

from cp_ext.data.dynamic_schedule import Group, Microbatch, Schedule
from cp_ext.bench.dynamic_cp import (
    BenchModel, Counts, Hardware, compare, dynamic_counts, lognormal_lengths, pack_sequences, static_counts,
    dynamic_segments, schedules, static_segments, suggest_max_seqlen_per_rank, timed_attention_step, zigzag_pairs,
)
from tests.launch import REPO_ROOT

MODEL = BenchModel(hidden=64, heads=4, kv_groups=2, head_dim=16, layers=2, ffn=32, topk=2)


@pytest.mark.quick
@pytest.mark.parametrize("length, size", [(64, 4), (61, 4), (7, 2), (1, 4), (100, 3)])
def test_a_document_zigzag_counts_its_causal_pairs(length, size):
    pairs = zigzag_pairs(length, size)
    assert len(pairs) == size and sum(pairs) == length * (length + 1) // 2
    if length % (2 * size) == 0:  # no padding: every rank the same share
        assert len(set(pairs)) == 1
    tail = -length % (2 * size)
    assert sum(zigzag_pairs(length, size, padding=True)) == sum(pairs) + tail * (tail + 1) // 2


def test_every_plan_counts_the_same_pairs():
    lengths = lognormal_lengths(40, 300, 1.0, 16, 1024, seed=1)
    total = sum(n * (n + 1) // 2 for n in lengths)
    assert static_counts(lengths, 8, 4, 1024, MODEL).pairs.sum() == total
    schedule = Schedule(8, lengths, [Microbatch([Group(0, 8, list(range(len(lengths))))])])
    assert dynamic_counts(schedule, MODEL).pairs.sum() == total
    assert sorted(d for seq in pack_sequences(lengths, 1024) for d in seq) == list(range(len(lengths)))


def test_static_zigzag_of_packed_documents_is_uneven_and_the_dynamic_plans_balance():
    lengths = lognormal_lengths(64, 2048, 1.5, 128, 16384, seed=2)
    result = compare(lengths, world=8, static_cp=4, seq_length=16384, max_tokens_per_rank=4096, model=MODEL)
    assert set(result) == {"static", "megatron", "cp_ext"}
    assert result["static"]["pairs max/mean"] > 1.05
    for plan in ("megatron", "cp_ext"):
        assert result[plan]["pairs max/mean"] < result["static"]["pairs max/mean"]
        assert result[plan]["bytes sent (GB, all ranks, per layer)"] < result["static"]["bytes sent (GB, all ranks, per layer)"]


def test_the_modelled_step_by_hand():
    """Two microbatches of two ranks: the step is the sum of each microbatch's slowest rank."""
    hw = Hardware(flops=1e12, link_bytes_per_s=1e9)
    c = Counts(pairs=np.array([[1e6, 0.0], [2e6, 3e6]]), tokens=np.array([[100.0, 100.0], [0.0, 0.0]]),
               bytes=np.array([[0.0, 4e6], [0.0, 0.0]]))
    linear = 3 * 100 * MODEL.flops_per_token / 1e12
    first = max(linear + 3 * 1e6 * MODEL.flops_per_pair / 1e12, linear + 2 * 4e6 / 1e9)
    second = 3 * 3e6 * MODEL.flops_per_pair / 1e12
    assert c.step(MODEL, hw) == pytest.approx(MODEL.layers * (first + second))


def test_the_tool_prints_the_three_plans(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_dynamic_cp.py"), "--documents", "48",
                           "--median", "2048", "--min-length", "128", "--max-length", "16384", "--steps", "2",
                           "--world", "8", "--context-parallel-size", "4", "--seq-length", "16384",
                           "--max-seqlen-per-dp-cp-rank", "4096", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    for plan in ("static", "megatron", "cp_ext"):
        assert f"\n{plan} " in proc.stdout, proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["static"]["speed-up over static"] == pytest.approx(1.0)
    assert summary["cp_ext"]["speed-up over static"] > 1.0


def test_the_suggested_budget_is_the_candidate_with_the_least_modelled_step():
    batches = [lognormal_lengths(32, 1024, 1.5, 64, 8192, seed) for seed in range(2)]
    best, table = suggest_max_seqlen_per_rank(batches, world=8, ceiling=4096, model=MODEL)
    assert [m for m, _ in table] == [1024, 2048, 4096]  # from the longest document's 8192 / 8 ranks
    fastest = min(s for _, s in table)
    assert best == min(m for m, s in table if s <= 1.01 * fastest)  # within 1%: the least memory
    with pytest.raises(ValueError, match="needs 1024 per rank"):
        suggest_max_seqlen_per_rank(batches, world=8, ceiling=512, model=MODEL)


def test_the_planner_suggests_a_budget(capsys):
    from cp_ext.cli.plan_parallelism import main

    assert main(["--model", "llama2-7b", "--seq-length", "32768", "--global-batch", "16", "--gpus-per-node", "8",
                 "--document-lengths", "4096,1.5,256,32768"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("dynamic CP on TP") and "--max-seqlen-per-dp-cp-rank " in line and "static CP" in line, line


def test_the_timed_runs_are_the_counted_pairs():
    """What --timed computes per rank (runs of queries inside their documents) covers exactly the counted pairs."""
    def pairs(segments):
        return np.array([[sum((b * (b + 1) - a * (a + 1)) // 2 for a, b in runs) for runs in row] for row in segments])

    lengths = lognormal_lengths(48, 512, 1.5, 32, 4096, seed=3)
    for name, schedule in schedules(lengths, 8, 1024, MODEL).items():
        assert (pairs(dynamic_segments(schedule)) == dynamic_counts(schedule, MODEL).pairs).all(), name
    assert (pairs(static_segments(lengths, 8, 4, 4096)) == static_counts(lengths, 8, 4, 4096, MODEL).pairs).all()
    step = timed_attention_step([[[(0, 64)], [(0, 32), (96, 128)]]], heads=2, head_dim=16, repeats=1)
    assert 0 < step < 10
