"""tools/bench_attention.py on 4 gloo ranks (tiny shapes): it runs every variant and the bytes
counted at the call sites equal the formulas of cp_ext.perf.comm, forward and backward."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    out = Path(tempfile.mkdtemp(prefix="cp_ext_bench_")) / "bench.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(ROOT / "tools" / "bench_attention.py"), "--seq-length", "256", "--heads", "4", "--kv-heads", "2",
           "--head-dim", "16", "--reps", "2", "--warmup", "1", "--ulysses-size", "2", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), proc.stdout


def test_all_variants_timed(bench):
    res, stdout = bench
    assert set(res["variants"]) == {"ideal", "ring", "compute", "ulysses", "hybrid"}
    for name, v in res["variants"].items():
        assert len(v["ms"]) == 2 and all(t > 0 for t in v["ms"])
        assert name == "ideal" or v["ratio_to_ideal"] > 0
    assert res["overlap"] > 0 and "overlap: ring fwd+bwd / compute-only" in stdout


def test_bytes_counted_match_formula(bench):
    res, _ = bench
    b = res["bytes"]
    assert set(b) == {"ring", "ulysses", "hybrid"}
    assert set(b["ring"]) == {"ring_p2p"} and set(b["ulysses"]) == {"ulysses_a2a"}
    assert set(b["hybrid"]) == {"ring_p2p", "ulysses_a2a"}
    for colls in b.values():
        for c in colls.values():
            assert c["fwd"] > 0 and c["fwd"] == c["formula_fwd"] and c["bwd"] == c["formula_bwd"]
    # ring of 4, KV [2, b=1, hk=2, 64, 16] fp32 = 16 KiB: fwd 3 KV, bwd 3 KV + 4 dKV (fp32)
    assert b["ring"]["ring_p2p"]["fwd"] == 3 * 16384 and b["ring"]["ring_p2p"]["bwd"] == 7 * 16384
    assert res["bytes_match"] is True
