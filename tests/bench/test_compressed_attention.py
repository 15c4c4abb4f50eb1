"""tools/bench_compressed_attention.py at toy size (CP2, 1000 tokens, V4's 512-wide K=V head, 4 query heads, top-16):
its command line (`cp_ext.bench.compressed_attention.main`) on forked ranks (`tests.launch.fork_workers` in place of
torchrun), one launch: every variant is timed, and the bytes are the ones worked out here. A sliding layer sends
each rank's window halo, 127 rows of 512 fp32 values (zigzag CP2: one chunk boundary per rank crosses ranks), and
the positions' all-gather; its backward sends the halo rows' gradient back; the dense ring sends more than any V4
layer. Chunks of 250 tokens cut CSA's and HCA's blocks, so the straddling rows travel too: every rank's bytes, of
every kind, forward and backward, are the planner's (`cp_ext.perf.compressed_layers.compressed_layer_bytes`). The
script itself: its --help."""

import contextlib
import io
import json

import pytest

from cp_ext.bench import compressed_attention as B
from tests.launch import REPO_ROOT, fork_workers, run_script

C, S, D = 2, 1000, 512


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_compressed") / "bench.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(B, "run_workers", fork_workers)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = B.main(["--cp", str(C), "--seq-length", str(S), "--topk", "16", "--reps", "1", "--warmup", "0",
                           "--json", str(out)])
    return code, json.loads(out.read_text()), printed.getvalue()


def test_every_variant_is_timed_and_printed(bench):
    code, result, printed = bench
    assert code == 0
    for name in ("sliding", "csa", "hca", "dense"):
        assert name in printed and result["summary"][name]["seconds"] > 0


def test_bytes_are_the_halo_the_entries_and_the_ring(bench):
    _, result, _ = bench
    halo, positions = 127 * D * 4, 8 * (S // C)
    for rank in result["ranks"]:
        sliding = rank["bytes"]["sliding"]
        assert sliding == {"fwd": halo + positions, "bwd": halo}, sliding
        for kind in ("csa", "hca"):  # the halo, the straddling rows and the entries
            assert rank["bytes"][kind]["fwd"] > sliding["fwd"]
            assert rank["bytes"][kind]["fwd"] < rank["bytes"]["dense"]["fwd"]
    for kind in ("sliding", "csa", "hca"):
        measured = [rank["bytes"][kind] for rank in result["ranks"]]
        assert measured == result["summary"][kind]["modelled"], (kind, measured)
    dense_exchange = (C - 1) * (S // C) * D * 4
    assert result["summary"]["sliding"]["vs_exchange"] == pytest.approx((halo + positions) / dense_exchange)


def test_the_tool_prints_its_help():
    proc = run_script(0, REPO_ROOT / "tools" / "bench_compressed_attention.py", "--help")
    assert "DeepSeek-V4" in proc.stdout and "--topk" in proc.stdout
