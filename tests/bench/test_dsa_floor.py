"""tools/bench_dsa_floor.py on 2 gloo ranks at toy size (top-32, s/k 4 and 8, small heads), one launch: every
point is timed at CP1 and on the ring; each op's counted multiply-adds are the hand formulas' (the indexer
every causal pair, the sparse attention every selected pair: sum min(k, t + 1), dense every causal pair),
floors are counted over the measured GEMM rate, and the union path computes at least the selected pairs."""

import json

import pytest

from tests.launch import REPO_ROOT, run_script

C, TOPK, H, R, P, DN, DV, H_I, D_I = 2, 32, 2, 32, 8, 16, 16, 4, 16
DIMS = ["--heads", str(H), "--qk-head-dim", str(DN), "--qk-pos-emb-head-dim", str(P), "--v-head-dim", str(DV),
        "--kv-lora-rank", str(R), "--index-heads", str(H_I), "--index-head-dim", str(D_I),
        "--index-query-tile", "64", "--index-key-tile", "128"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_dsa_floor") / "bench.json"
    proc = run_script(C, REPO_ROOT / "tools" / "bench_dsa_floor.py", "--topk", TOPK, "--s-over-k", "4,8", *DIMS,
                      "--reps", "1", "--json", out, timeout=300)
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.quick
def test_every_point_counted_and_timed(bench):
    res, stdout = bench
    rows = res["rows"]
    assert [(r["s_over_k"], r["cp"]) for r in rows] == [(4, 1), (4, C), (8, 1), (8, C)]
    for r in rows:
        s = r["s"]
        assert s == TOPK * r["s_over_k"]
        selected = sum(min(TOPK, t + 1) for t in range(s))
        causal = s * (s + 1) // 2
        per_rank = [c["selected"] for c in r["counts"]]
        assert sum(per_rank) == (selected if r["cp"] == C else C * selected)  # CP1: every rank the whole sequence
        assert sum(c["causal"] for c in r["counts"]) == (causal if r["cp"] == C else C * causal)
        for c, m in zip(r["counts"], r["macs"]):
            assert m["sparse"] == c["selected"] * H * (4 * (R + P) + 3 * R)
            assert m["indexer"] == c["causal"] * H_I * (D_I + 1)
            assert m["dense"] == c["causal"] * H * (4 * (DN + P) + 3 * DV)
            assert c["computed"] >= c["selected"]
        assert set(r["times"]) == {"indexer", "sparse", "dsa", "dense_latent", "dense_kv"}
        assert all(t > 0 for t in r["times"].values()) and all(v > 0 for v in r["rates"].values())
        for name, floor in r["floors"].items():
            assert floor > 0, name
        assert r["floors"]["sparse"] == pytest.approx(max(m["sparse"] for m in r["macs"]) / r["rates"]["sparse"])
    assert stdout.count("dsa / dense_latent:") == 4 and "floor" in stdout
