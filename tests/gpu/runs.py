"""The GPU check's subprocesses: each time-boxed, its output in a log beside the summary, read back as rows.

`run_logged` runs a command in its own session (torchrun's ranks die with it) and kills the whole
group past its time. `pytest_row` is one pytest run as one row; `family_row` one Megatron-LM MoE
script's flags training 3 iterations (`tests.families.tiny`: --bf16, the alltoall dispatcher, MLA,
sinks and windows through the kernel ``auto`` picks, the script's recompute). These show the CUDA
path of each family's modules builds and runs; exactness against CP = 1 is the multi-GPU grid row.
`async_save_row` trains one family's flags twice, saving every iteration synchronously and with --async-save (on
a GPU: the device-to-host copy, then the fork of a process that has CUDA), and compares the checkpoints.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.gpu.rows import FAIL, PASS, row

ROOT = Path(__file__).resolve().parents[2]


def run_logged(cmd, log, timeout):
    """Run ``cmd`` (output to ``log``) in its own session; on timeout kill its whole group (rc 124)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(1, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124


def torchrun(n):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", n]


def tail(log, n=600):
    text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    return " ".join(text[-n:].split())


def failed_run(part, check, rc, log):
    why = "timed out" if rc == 124 else f"exit {rc}"
    return row(part, check, FAIL, f"{why}; see {log}", tail=tail(log))


def pytest_row(part, check, out, name, pytest_args, timeout):
    """One pytest run as one row: PASS only if it passed something and skipped nothing."""
    log = out / f"{name}.log"
    rc = run_logged([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *pytest_args], log, timeout)
    counts = {w: int(n) for n, w in re.findall(r"(\d+) (passed|failed|skipped|error)", tail(log, 400))}
    figure = ", ".join(f"{n} {w}" for w, n in counts.items()) or "no result"
    ok = rc == 0 and counts.get("passed", 0) > 0 and not counts.get("skipped")  # skipped on a GPU: not run
    return row(part, check, PASS if ok else FAIL, figure, "all passed, none skipped", rc=rc, log=str(log))


def family_row(family, out, timeout, device="cuda", extra=()):
    """``pretrain_moe.py`` with one family's flags (`tests.families.tiny`) on ``device``, one rank,
    3 iterations: PASS when every iteration logs a finite lm loss. ``extra``: flags appended."""
    from tests.families import tiny

    check = f"{family} flags train on 1 GPU (bf16, 3 it)"
    log, run_dir = out / f"family_{family}.log", out / f"family_{family}"
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a stale run must not pass for this one
    rc = run_logged([sys.executable, "pretrain_moe.py", *tiny(family), "--device", device, "--log-dir", run_dir,
                     *extra], log, timeout)
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    loss = [r.get("train/lm_loss", math.nan) for r in lines]
    ok = rc == 0 and len(loss) == 3 and all(map(math.isfinite, loss))
    figure = f"lm loss {loss[0]:.3f} -> {loss[-1]:.3f}" if loss else f"exit {rc}, no loss logged"
    return row("single", check, PASS if ok else FAIL, figure, "3 finite losses", rc=rc, log=str(log))


def _checkpoint_tensors(directory):
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = Path(str(directory) + ".pt")
    dcp_to_torch_save(directory, target)
    try:
        return {k: v.float() for k, v in torch.load(target, weights_only=False).items() if isinstance(v, torch.Tensor)}
    finally:
        target.unlink()


def async_save_row(out, timeout, device="cuda", family="mixtral_8x7b", extra=()):
    """PASS when a synchronous and an --async-save run of ``family``'s flags (1 rank, 3 iterations, a save at
    each) both finish with every checkpoint published, the same losses and the same tensors in their last
    checkpoint. On a GPU, two runs may differ in the last bits (atomics in the backward), so both are compared
    within 2e-2 relative: what a broken device-to-host copy before the fork writes (zeros, stale or unwritten
    pinned memory) is far outside that."""
    from tests.families import tiny

    check = "--async-save on 1 GPU: its checkpoints equal the synchronous ones"
    out.mkdir(parents=True, exist_ok=True)
    runs, losses = {}, {}
    for kind, flags in (("sync", []), ("async", ["--async-save"])):
        log, run_dir, save = out / f"save_{kind}.log", out / f"save_{kind}", out / f"save_{kind}_ckpt"
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        rc = run_logged([sys.executable, "pretrain_moe.py", *tiny(family), "--device", device, "--log-dir", run_dir,
                         "--save", save, "--save-interval", "1", *flags, *extra], log, timeout / 2)
        if rc != 0:
            return failed_run("single", check, rc, log)
        metrics = run_dir / "metrics.jsonl"
        losses[kind] = [json.loads(x)["train/lm_loss"] for x in metrics.read_text().splitlines() if x.strip()]
        runs[kind] = save
    published = [sorted(p.name for p in runs[k].glob("iter_*")) for k in runs]
    if published != [["iter_0000001", "iter_0000002", "iter_0000003"]] * 2:
        return row("single", check, FAIL, f"published {published}", "iterations 1-3, each complete")
    a, s = (_checkpoint_tensors(runs[k] / "iter_0000003") for k in ("async", "sync"))
    worst = max((((a[k] - s[k]).abs().max() / s[k].abs().max().clamp_min(1e-6)).item() for k in s), default=math.inf)
    loss_gap = max(abs(x - y) / abs(y) for x, y in zip(losses["async"], losses["sync"]))
    ok = sorted(a) == sorted(s) and len(s) > 10 and worst <= 2e-2 and loss_gap <= 2e-2
    figure = f"{len(s)} tensors, worst {worst:.1e}; losses {loss_gap:.1e} apart"
    return row("single", check, PASS if ok else FAIL, figure, "2e-2 relative", losses=losses)
