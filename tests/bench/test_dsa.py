"""tools/bench_dsa.py on 2 gloo ranks at toy size (1024 tokens, top-32, small heads and indexer tiles), one
launch: DSA and both dense baselines are timed; every timed call's ring bytes equal the formulas of
`cp_ext.bench.dsa` (and the numbers worked out by hand here); DSA computes sum min(k, t + 1) query-key
pairs against dense's causal s (s + 1) / 2; the indexer's top-k allocates far less than the dense
[s, b, H, s] scores megatron-core 0.16.1 builds; and DSA with every causal key selected (--check) gives
dense's gradients, so both sides run the same problem."""

import json

import pytest

from tests.launch import REPO_ROOT, run_script

C, S, TOPK, R, P, D_I, H_I = 2, 1024, 32, 32, 8, 16, 4
DIMS = ["--heads", "2", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", str(P), "--v-head-dim", "16",
        "--kv-lora-rank", str(R), "--index-heads", str(H_I), "--index-head-dim", str(D_I),
        "--index-query-tile", "64", "--index-key-tile", "128"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_dsa") / "bench.json"
    proc = run_script(C, REPO_ROOT / "tools" / "bench_dsa.py", "--seq-length", S, "--topk", TOPK, *DIMS, "--reps", "2",
                      "--dense", "latent,kv", "--check", "--json", out, timeout=300)
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.quick
def test_bytes_counted_equal_formula(bench):
    res, stdout = bench
    b = res["bytes"]
    assert set(b) == {"dsa", "dense_latent", "dense_kv"}
    for name, c in b.items():
        # every rank, every timed call (2 reps) counted the formula's bytes
        assert c["match"] is True and c["calls"] == 2 * C and c["counted"] == c["formula"], (name, c)
    s_local, e = S // C, 4
    # DSA forward: latent (r + p) and the indexer key (D_I) per token, one hop; backward: the latent again,
    # and its fp32 gradient home (C hops)
    latent = s_local * (R + P) * e
    assert b["dsa"]["formula_fwd"] == (C - 1) * (latent + s_local * D_I * e)
    assert b["dsa"]["formula_bwd"] == (C - 1) * latent + C * latent
    assert b["dense_latent"]["formula_fwd"] == (C - 1) * s_local * (R + P) * e
    assert b["dense_kv"]["formula_fwd"] == (C - 1) * s_local * 2 * (16 + P + 16) * e
    assert b["dsa"]["per_token_fwd"] == R + P + D_I and "MISMATCH" not in stdout


def test_times_and_ratios(bench):
    res, stdout = bench
    assert set(res["times"]) == {"dsa", "dense_latent", "dense_kv"}
    assert all(len(ts) == 2 and all(t > 0 for t in ts) for ts in res["times"].values())
    assert set(res["ratios"]) == {"dense_latent", "dense_kv"}
    assert all(r["median"] > 0 and r["cpu"] > 0 and len(r["per_rep"]) == 2 for r in res["ratios"].values())
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in res["cpu_s"].values())
    assert len(res["indexer_s"]) == 2 and all(t > 0 for t in res["indexer_s"])
    assert len(res["peak_rss"]) == C and all(v > 0 for v in res["peak_rss"])
    assert "dsa / dense_latent:" in stdout


def test_pairs_and_check(bench):
    res, _ = bench
    w = res["work"]
    causal = S * (S + 1) // 2 // C
    assert w["dense_pairs"] == causal and w["indexer_pairs"] == causal
    # each query attends to min(k, t + 1) keys
    assert w["sparse_pairs"] == (sum(min(TOPK, t + 1) for t in range(S))) // C
    assert 0 < w["fwd_macs_ratio"] and 0 < w["indexer_share"] < 1
    assert res["check_diff"] is not None and res["check_diff"] < 1e-4


def test_indexer_peak_far_below_dense_scores(bench):
    res, _ = bench
    m = res["memory"]
    assert m["megatron_tensor"] == S * H_I * S * 4 and m["megatron_peak"] == 2 * m["megatron_tensor"]
    # one [b, 64, H, 128] fp32 tile (128 KiB), the running top-k and its merge, not [s, b, H, s] (16 MiB)
    assert 0 < m["tensors"] < m["megatron_tensor"] / 16, m
