"""tools/bench_attention.py on 4 gloo ranks (tiny shapes), one launch: it runs every variant
(all_gather included), the bytes counted at the call sites equal the formulas of
cp_ext.perf.comm, forward and backward, and with --documents (8 documents = the 8 zigzag chunks)
the ring and all_gather compute fewer tiles and pairs, and the ring sends nothing."""

import json

import pytest

from tests.launch import REPO_ROOT, run_script


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = run_script(4, REPO_ROOT / "tools" / "bench_attention.py", "--seq-length", "256", "--heads", "4", "--kv-heads",
                      "2", "--head-dim", "16", "--reps", "2", "--warmup", "1", "--ulysses-size", "2", "--json", out,
                      "--variants", "ideal,ring,compute,ulysses,hybrid,all_gather", "--documents", "8")
    return json.loads(out.read_text()), proc.stdout


def test_all_variants_timed(bench):
    res, stdout = bench
    assert set(res["variants"]) == {"ideal", "ring", "compute", "ulysses", "hybrid", "all_gather"}
    for name, v in res["variants"].items():
        assert len(v["ms"]) == 2 and all(t > 0 for t in v["ms"])
        assert name == "ideal" or v["ratio_to_ideal"] > 0
    assert res["overlap"] > 0 and "overlap: ring fwd+bwd / compute-only" in stdout


@pytest.mark.quick
def test_bytes_counted_match_formula(bench):
    res, _ = bench
    b = res["bytes"]
    assert set(b) == {"ring", "ulysses", "hybrid", "all_gather"}
    assert set(b["ring"]) == {"ring_p2p"} and set(b["ulysses"]) == {"ulysses_a2a"}
    assert set(b["hybrid"]) == {"ring_p2p", "ulysses_a2a"}
    assert set(b["all_gather"]) == {"all_gather_kv", "reduce_scatter_dkv"}
    for colls in b.values():
        for c in colls.values():
            assert c["fwd"] + c["bwd"] > 0 and c["fwd"] == c["formula_fwd"] and c["bwd"] == c["formula_bwd"]
    # ring of 4, KV [2, b=1, hk=2, 64, 16] fp32 = 16 KiB: fwd 3 KV, bwd 3 KV + 4 dKV (fp32)
    assert b["ring"]["ring_p2p"]["fwd"] == 3 * 16384 and b["ring"]["ring_p2p"]["bwd"] == 7 * 16384
    # all-gather of 4: each rank's KV block to 3 others, forward and backward; dK/dV (fp32) 3 blocks back
    assert b["all_gather"]["all_gather_kv"] == {"fwd": 3 * 16384, "bwd": 3 * 16384,
                                                "formula_fwd": 3 * 16384, "formula_bwd": 3 * 16384}
    assert (b["all_gather"]["reduce_scatter_dkv"]["fwd"], b["all_gather"]["reduce_scatter_dkv"]["bwd"]) == (0, 3 * 16384)
    assert res["bytes_match"] is True


def test_documents_fewer_tiles_and_pairs_and_no_ring_bytes(bench):
    res, stdout = bench
    docs = res["documents"]
    assert docs["n"] == 8 and docs["tokens_per_document"] == 32 and "documents: 8 equal documents" in stdout
    assert set(docs["variants"]) == {"ring", "all_gather"}
    for name, v in docs["variants"].items():
        # every rank computes fewer tiles and fewer query-key pairs with the documents
        assert all(d < n for d, n in zip(v["tiles"]["docs"], v["tiles"]["none"])), (name, v["tiles"])
        assert all(0 < d < n for d, n in zip(v["pairs"]["docs"], v["pairs"]["none"])), (name, v["pairs"])
        assert v["pair_ratio"] < 0.15  # 8 documents: about 1/8 of the causal pairs
        assert len(v["time_ratios"]) == 2 and v["time_ratio"] > 0
    ring = docs["variants"]["ring"]
    # no document crosses a zigzag chunk: one diagonal tile per rank, and the ring stops before any hop
    assert ring["tiles"]["docs"] == [1, 1, 1, 1] and ring["tiles"]["none"] == [4, 4, 4, 4]
    for rank_docs, rank_none in zip(ring["bytes"]["docs"], ring["bytes"]["none"]):
        assert rank_docs["ring_p2p"] == {"fwd": 0, "bwd": 0}
        assert rank_none["ring_p2p"] == {"fwd": 3 * 16384, "bwd": 7 * 16384}
    # all_gather moves the same bytes with or without documents
    ag = docs["variants"]["all_gather"]
    assert ag["bytes"]["docs"] == ag["bytes"]["none"]
    assert ag["pairs"]["docs"] == ring["pairs"]["docs"]  # the same document-causal pairs, however tiled
