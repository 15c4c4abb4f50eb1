"""tools/bench_checkpoint.py on 2 ranks at toy size, saves only, one launch: every kind of save is measured
(the local ones where nvidia-resiliency-ext is installed), and the bytes each rank wrote follow fully parallel
save: spread over the ranks by default, rank 0 writing every replicated tensor without it. No time is judged."""

import re

from cp_ext.arguments.checkpointing import has_local_checkpoints
from tests.launch import REPO_ROOT, run_script

TINY = ["--num-experts", "4", "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu",
        "--normalization", "RMSNorm", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--global-batch-size", "4", "--train-iters", "100", "--lr", "1e-3", "--seed", "5",
        "--device", "cpu", "--expert-model-parallel-size", "2", "--log-dir", "{log}"]


def test_every_kind_of_save_is_measured_with_its_bytes(tmp_path):
    flags = [f.format(log=tmp_path / "log") for f in TINY]
    proc = run_script(0, REPO_ROOT / "tools" / "bench_checkpoint.py", "--nproc", "2", "--repeats", "1",
                      "--only", "saves", "--", *flags, timeout=600)
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) ([\d.]+)$",
                     line)
        if m:
            rows[m.group(1)] = [float(x) for x in m.groups()[1:]]
    kinds = ["synchronous", "async (--async-save)", "async, constant structure", "sync, not fully parallel"]
    if has_local_checkpoints():
        kinds += ["non-persistent local", "non-persistent local, async"]
    assert sorted(rows) == sorted(kinds), proc.stdout
    assert rows["synchronous"][1] == 1.0  # held ÷ sync
    spread, first = rows["synchronous"][-2:], rows["sync, not fully parallel"][-2:]
    assert abs(sum(spread) - sum(first)) < 0.02 * sum(spread)
    assert first[0] - first[1] > 4 * abs(spread[0] - spread[1]), (spread, first)
    assert rows["async (--async-save)"][-2:] == spread  # the same checkpoint, written in the background
