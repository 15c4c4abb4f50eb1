"""Issue #39's preemption with requeue: scripts/slurm_single_node.sbatch preempted by a higher partition.

A one-node SLURM cluster (tests/scripts/slurm_cluster.py) with SLURM's partition-priority preemption:
partition ``low`` (PriorityTier 1, PreemptMode REQUEUE, GraceTime 60 s) and ``high`` (PriorityTier 2).
A 2-rank CPU job trains in ``low`` with sbatch's ``--requeue`` and ``--save``/``--load`` but no periodic
save; once it has logged iteration 3 a 2-CPU job in ``high`` preempts it. SLURM SIGTERMs the step: the
ranks save at the same iteration (``--exit-signal-handler``) and exit, torchrun exits 1, and the script,
seeing PreemptTime set, requeues its own job (without that SLURM ends it FAILED inside its grace time and
never requeues it). The requeued run waits for the preemptor, loads the checkpoint and trains to the end.
Checked: each iteration in metrics.jsonl once, with the lm losses of the same flags run uninterrupted.

``AuthInfo=cred_expire=10`` and ``sched_interval=5`` let the requeued job start within seconds (SLURM's
defaults, 120 s and 60 s, are a real cluster's business). Measured on 2 cores: 64 to 66 s in all.
"""

import re
import time

import pytest

from tests.launch import REPO_ROOT, lm_losses, run_script
from tests.scripts.slurm_cluster import SlurmCluster, SlurmClusterError, free_port, slurm_unavailable

pytestmark = pytest.mark.ci_leg("3.12")  # SLURM's preemption and the sbatch script, on either megatron-core

SCRIPT = REPO_ROOT / "scripts" / "slurm_single_node.sbatch"
ITERS = 20  # at about 0.6 s each, the preemption (2-3 s after it is submitted) lands mid-run
FLAGS = ["--tensor-model-parallel-size", "1", "--train-iters", str(ITERS), "--lr-warmup-iters", "1",
         "--log-interval", "1"]
SETTINGS = {"PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE", "AuthInfo": "cred_expire=10",
            "SchedulerParameters": "sched_interval=5"}
PARTITIONS = {"low": "PriorityTier=1 PreemptMode=REQUEUE GraceTime=60", "high": "PriorityTier=2 PreemptMode=OFF"}



def job_state(cluster, job):
    """JobState from `scontrol show job`, None once the record is purged."""
    state = re.search(r"JobState=(\S+)", cluster.run(["scontrol", "show", "job", job], check=False).stdout)
    return state and state.group(1)


def test_preempted_job_saves_requeues_and_resumes_exactly(tmp_path, tmp_path_factory):
    reason = slurm_unavailable(timeout=300)
    if reason:
        pytest.skip(f"SLURM not available: {reason}")
    # a short root: slurmstepd's socket path (spool/<node>/<node>_<job>.<step>) must stay under 108 bytes
    cluster = SlurmCluster(tmp_path_factory.mktemp("preempt"), settings=SETTINGS, partitions=PARTITIONS)
    try:
        try:
            cluster.start(timeout=60)
        except SlurmClusterError as e:
            pytest.skip(f"SLURM installed but its daemons cannot start here: {e}")
        out, save, run_dir = tmp_path / "low.out", tmp_path / "ck", tmp_path / "run"
        env = dict(cluster.env, CP_EXT_CPU="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
        cpus = f"--cpus-per-task={min(2, cluster.cpus)}"
        job = cluster.run(["sbatch", "--parsable", "--requeue", "--partition=low", f"--output={out}", "--open-mode=append",
                           "--gpus-per-node=0", cpus, "--time=10", "--job-name=low", str(SCRIPT), "configs/cpu_demo.yaml",
                           *FLAGS, "--save", str(save), "--load", str(save), "--log-dir", str(run_dir)],
                          check=True, env=env, cwd=REPO_ROOT).stdout.strip().split(";")[0]
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            if job_state(cluster, job) not in ("RUNNING", "PENDING", "CONFIGURING"):
                break
            time.sleep(0.5)
        log = lambda: out.read_text() if out.exists() else "(no job output)"  # noqa: E731
        assert metrics.exists(), f"the job never trained:\n{log()}\n{cluster.logs()}"
        preemptor = cluster.run(["sbatch", "--parsable", "--partition=high", cpus, f"--output={tmp_path / 'high.out'}",
                                 "--wrap", "sleep 2"], check=True, env=env).stdout.strip().split(";")[0]
        deadline, state = time.monotonic() + 300, None
        while time.monotonic() < deadline:
            state = job_state(cluster, job)
            if state not in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING", "CONFIGURING"):
                break
            time.sleep(0.5)
        text = log()
        context = f"{state}\n--- job log ---\n{text[-8000:]}\n{cluster.logs()}"
        assert state in ("COMPLETED", None), context
        assert job_state(cluster, preemptor) in ("COMPLETED", None), context
    finally:
        cluster.stop()

    saved = re.findall(r"received SIGTERM \(--exit-signal-handler\): saving and exiting after iteration (\d+)", text)
    assert len(saved) == 1 and 3 <= int(saved[0]) < ITERS, context
    assert text.count(f"cp_ext: job {job} was preempted: requeued (scontrol requeue)") == 1, context
    assert f"cp_ext: job {job} was requeued (SLURM_RESTART_COUNT=1)" in text, context
    assert f"loaded checkpoint of iteration {saved[0]} from" in text, context
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS), context

    merged = lm_losses(run_dir)
    assert [i for i, _ in merged] == list(range(1, ITERS + 1)), merged
    ref_dir = tmp_path / "ref"
    ref = run_script(2, REPO_ROOT / "pretrain_moe.py", "--config", "configs/cpu_demo.yaml", *FLAGS, "--device", "cpu",
                     "--log-dir", ref_dir, check=False, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-6000:]
    for (i, got), (_, want) in zip(merged, lm_losses(ref_dir)):
        assert abs(got - want) <= 1e-6 * abs(want), (i, got, want, merged)
