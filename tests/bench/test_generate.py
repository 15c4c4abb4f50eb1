"""tools/bench_generate.py: one run at CP1 and CP2 (ring, Ulysses); the counted decode bytes equal the
formula and each rank's cache is half of CP1's."""

import os
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT


@pytest.mark.quick
def test_bench_generate_counts_match_the_formula():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_generate.py"), "--nproc", "2",
                           "--prompt-length", "256", "--new-tokens", "2", "--repeats", "1"],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {" ".join(line.split()[:-8]): line.split()[-8:] for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"1", "2 ring", "2 ulysses"}, proc.stdout
    for name, (cache, vs_cp1, *_, sent, formula) in rows.items():
        assert sent == formula, (name, proc.stdout)
        assert float(vs_cp1) == (1.0 if name == "1" else 0.5), (name, proc.stdout)
    assert rows["2 ring"][-1] == str(4 * 4 * (16 + 1))  # b=1, h=4 heads of d=16 over a ring of 2
