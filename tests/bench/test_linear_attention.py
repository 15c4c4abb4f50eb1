"""tools/bench_linear_attention.py at toy size (CP4, 256 tokens, 4 key / 8 value heads of 16): its command line
(`cp_ext.bench.linear_attention.main`) on forked ranks (`tests.launch.fork_workers` in place of torchrun), one
launch: every variant is timed, the bytes every rank's collectives sent equal cp_ext.perf.comm's formulas (and
the numbers worked out here), the all-to-all sends more than state passing, and the CP table stops the
all-to-all at 16 key heads while state passing goes on. The script itself: its --help."""

import contextlib
import io
import json

import pytest

from cp_ext.bench import linear_attention as B
from tests.launch import REPO_ROOT, fork_workers, run_script

C, S, HK, H, D = 4, 256, 4, 8, 16


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_linear") / "bench.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(B, "run_workers", fork_workers)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = B.main(["--cp", str(C), "--seq-length", str(S), "--key-heads", str(HK), "--heads", str(H),
                                 "--head-dim", str(D), "--chunk-size", "16", "--reps", "2", "--warmup", "0",
                                 "--json", str(out)])
    return code, json.loads(out.read_text()), printed.getvalue()


@pytest.mark.quick
def test_bytes_recorded_equal_the_formulas(bench):
    code, res, stdout = bench
    assert code == 0 and res["summary"]["match"] is True and "MISMATCH" not in stdout
    b = res["summary"]["bytes"]
    acc, summary = 4, 2 * H * D * 2 * D * 4  # per rank: 2 zigzag segments x h x K x (K + V) fp32
    assert b["state_passing"]["measured"] == b["state_passing"]["formula"] == 2 * (C - 1) * summary  # gather + scatter
    # ring: the middle ranks send two K x V states each way, the end ranks one (C-1 holds segments C-1 and C)
    assert [r["measured"] for r in b["ring"]["per_rank"]] == [2 * n * H * D * D * acc for n in (1, 2, 2, 1)]
    s_local, e = S // C, 4
    moved = (2 * HK * D + 2 * H * D + 2 * H) * s_local * e * (C - 1) // C  # q, k, v, out, g, beta
    assert b["all_to_all"]["measured"] == b["all_to_all"]["formula"] == 2 * moved
    assert "all_to_all / ring" in stdout


def test_every_variant_timed_and_ratios_printed(bench):
    _, res, stdout = bench
    assert set(res["times"]) == {"state_passing", "ring", "compute", "ideal", "all_to_all"}
    assert all(len(t) == 2 and min(t) > 0 for t in res["times"].values())
    ratios = res["summary"]["ratios"]
    assert ratios["compute"]["vs_compute"] == 1.0 and ratios["state_passing"]["vs_compute"] > 0
    assert "state passing / compute-only" in stdout and "scaled down" in stdout


def test_cp_table_all_to_all_stops_at_16_key_heads(bench):
    _, res, stdout = bench
    rows = {r["C"]: r for r in res["summary"]["cp_limits"]}
    assert res["summary"]["largest_cp"] == {"all_to_all": 16, "state_passing": 128}
    assert "16 key heads and 32 value heads" in rows[32]["all_to_all_error"] and rows[16]["all_to_all_error"] is None
    assert rows[128]["segment_tokens"] == [S // 256] and rows[128]["state_passing_error"] is None
    # the ring's bytes per rank do not grow with C; the all-gather's do
    assert rows[128]["ring_layer_bytes"] < rows[128]["all_gather_layer_bytes"]


def test_all_to_all_refused_when_heads_do_not_divide():
    args = B.parse(["--cp", "4", "--seq-length", "64", "--key-heads", "2", "--heads", "4", "--head-dim", "8"])
    calls, refused = B.variants(args, None, 4, 0)
    assert "all_to_all" not in calls and "2 key heads and 4 value heads" in refused and "state passing" in refused
    with pytest.raises(SystemExit):
        B.parse(["--cp", "4", "--seq-length", "60"])


def test_the_script_is_the_command_line():
    proc = run_script(0, REPO_ROOT / "tools" / "bench_linear_attention.py", "--help")
    assert "Qwen3-Next's per-head dims" in proc.stdout and "--seq-length" in proc.stdout and "--cp" in proc.stdout
