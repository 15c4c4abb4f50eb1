"""A disk that fills during a save: every rank stops with one message naming --save, nothing half-written is
ever pointed at, and once there is room the run resumes exactly.

--save is a 6 MiB tmpfs (a mount namespace of the test's own: root only, else skipped with the reason); one
checkpoint of this model takes 4.3 MiB, so the save at iteration 2 fits and the one at iteration 4 does not.
Then the space is freed (the tmpfs grown, as an operator would clean up), a staging directory as a killed save
leaves it is planted, and a second run resumes with --load: it removes that debris, trains iterations 3 to 6,
and its losses equal an uninterrupted run's. About 60 s.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.launch import REPO_ROOT, TORCHRUN_ENV, run_script

FLAGS = ["--num-experts", "4", "--log-interval", "1", "--lr-decay-iters", "6", "--train-iters", "6"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO_ROOT / "pretrain_moe.py"), *FLAGS]


def _losses(log_dir):
    rows = map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())
    return {r["iteration"]: r["train/lm_loss"] for r in rows}


def _why_no_namespace():
    if os.geteuid() != 0:
        return "a tmpfs of the test's own needs root (a mount namespace)"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is missing"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1M tmpfs /mnt"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}"


def test_disk_full_during_a_save(tmp_path):
    reason = _why_no_namespace()
    if reason:
        pytest.skip(reason)
    save, first, second = tmp_path / "ck", tmp_path / "first", tmp_path / "second"
    save.mkdir()
    script = f"""
set -u
mount -t tmpfs -o size=6M tmpfs {save}
{' '.join(TORCHRUN)} --save {save} --save-interval 2 --log-dir {first} > {tmp_path}/first.out 2> {tmp_path}/first.err
echo $? > {tmp_path}/first.code
ls -A {save} > {tmp_path}/after_failure.txt
mount -o remount,size=64M {save}
mkdir {save}/iter_0000005.tmp && head -c 100000 /dev/zero > {save}/iter_0000005.tmp/__0_0.distcp
{' '.join(TORCHRUN)} --load {save} --save {save} --log-dir {second} > {tmp_path}/second.out 2> {tmp_path}/second.err
echo $? > {tmp_path}/second.code
ls -A {save} > {tmp_path}/after_resume.txt
"""
    env = dict({k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO_ROOT))
    subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script], env=env, cwd=REPO_ROOT,
                   timeout=400, check=True)
    err = (tmp_path / "first.err").read_text()
    context = f"{err[-4000:]}\n{(tmp_path / 'first.out').read_text()[-2000:]}"
    assert (tmp_path / "first.code").read_text().strip() == "1", context
    message = f"pretrain_moe.py: cannot save the checkpoint: --save {save}: the checkpoint of iteration 4 could not"
    assert err.count(message) == 1 and " MiB were free on its disk" in err, context
    assert "The tracker still names iteration 2" in err, context
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err, context  # (torchrun's own follows)
    assert (tmp_path / "after_failure.txt").read_text().split() == [
        ".cp_ext_save.lock", "iter_0000002", "latest_checkpointed_iteration.txt"], "no staging debris, tracker at 2"
    assert sorted(_losses(first)) == [1, 2, 3, 4]

    out = (tmp_path / "second.out").read_text()
    assert (tmp_path / "second.code").read_text().strip() == "0", (tmp_path / "second.err").read_text()[-4000:]
    assert f"--save {save}: removed what an unfinished save left: iter_0000005.tmp" in out, out[-3000:]
    assert "iter_0000005.tmp" not in (tmp_path / "after_resume.txt").read_text().split()
    straight = tmp_path / "straight"
    run_script(2, REPO_ROOT / "pretrain_moe.py", *FLAGS, "--log-dir", straight)
    resumed, uninterrupted = _losses(second), _losses(straight)
    assert sorted(resumed) == [3, 4, 5, 6] and resumed == {i: uninterrupted[i] for i in resumed}
