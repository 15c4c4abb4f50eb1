"""tools/eval_long_context.py: the same passkey accuracy and loss-by-position at CP=1 and CP=2.

A passkey model is trained for a few iterations and saved (real run), then the tool evaluates it
under torchrun at CP=1 (1 rank) and CP=2 ring (2 ranks) at two lengths, one of them twice the
training length: accuracies are equal and losses agree to 1e-5 relative (fp32); the JSON, the
PNG and the table are written. Bad input exits 2 with one message before any model is built.
"""

import json

import pytest

from tests.launch import REPO_ROOT, run_script as _torchrun

TRAIN = ["--config", "configs/cpu_passkey.yaml", "--seq-length", "64", "--global-batch-size", "16",
         "--micro-batch-size", "8"]
TOOL = ["--lengths", "64", "128", "--depths", "0.2", "0.8", "--samples", "16", "--position-buckets", "4"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("long_context")
    _torchrun(2, REPO_ROOT / "pretrain_moe.py", *TRAIN, "--context-parallel-size", "2", "--train-iters", "30",
              "--save", root / "ck", "--log-dir", root / "train")
    tool = REPO_ROOT / "tools" / "eval_long_context.py"
    out = {}
    for cp in (1, 2):
        proc = _torchrun(cp, tool, *TRAIN, "--context-parallel-size", cp, "--load", root / "ck", *TOOL,
                         "--out-dir", root / f"cp{cp}")
        out[cp] = (json.loads((root / f"cp{cp}" / "results.json").read_text()), proc.stdout, root / f"cp{cp}")
    return out


def test_cp2_equals_cp1(evaluated):
    one, two = evaluated[1][0]["results"], evaluated[2][0]["results"]
    assert sorted(one) == sorted(two) == ["128", "64"]
    for length in one:
        assert one[length]["accuracy"] == two[length]["accuracy"], length
        for a, b in zip(one[length]["loss_by_position"], two[length]["loss_by_position"]):
            assert (a is None and b is None) or abs(a - b) <= 1e-5 * abs(a), (length, a, b)
        assert len(two[length]["peak_memory_bytes"]) == 2 and min(two[length]["peak_memory_bytes"]) > 0


def test_outputs_and_table(evaluated):
    record, stdout, out_dir = evaluated[2]
    assert record["layout"].startswith("TP 1 x PP 1 x CP 2")
    assert (out_dir / "long_context.png").stat().st_size > 10_000
    assert "length d=0.2   d=0.8" in stdout and stdout.count("\n64 ") == 1 and stdout.count("\n128 ") == 1
    # passkey data: only the answer digits (the last bucket) carry loss; the answers are judged
    for length in ("64", "128"):
        losses = record["results"][length]["loss_by_position"]
        assert losses[:3] == [None, None, None] and 0 < losses[3] < 10
        assert all(0.0 <= v <= 1.0 for v in record["results"][length]["accuracy"].values())


@pytest.mark.quick
@pytest.mark.parametrize("extra, message", [
    (["--lengths", "65"], "--lengths 65: must be >= 32 and divisible by 2 x --context-parallel-size = 2"),
    (["--lengths", "66"], "--lengths 66: must be divisible by --position-buckets 8"),
    (["--lengths", "64", "--depths", "1.5"], "--depths 1.5: fractions in [0, 1]"),
    (["--lengths", "64", "--samples", "5"], "--samples 5 must be a multiple of --micro-batch-size x DP = 8"),
])
def test_bad_input_exits_2_with_one_message(tmp_path, extra, message):
    proc = _torchrun(1, REPO_ROOT / "tools" / "eval_long_context.py", *TRAIN, "--context-parallel-size", "1",
                     "--load", tmp_path, *extra,
                     check=False)
    assert proc.returncode != 0 and proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("configuration error")[0]
