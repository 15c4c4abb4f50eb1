"""scripts/slurm_single_node.sbatch on a real one-node SLURM cluster started by the test.

The cluster (tests/scripts/slurm_cluster.py): Debian's slurm-wlm 22.05, slurmctld + slurmd in
the foreground as children of this test, auth/none (no munge), state and logs in a temp dir,
ports picked free. The job is the real sbatch script in CPU mode: 2 gloo ranks of the CPU demo
config shrunk by flags, submitted with `sbatch --parsable` and waited for by polling `scontrol show job`
every 0.5 s (`SlurmCluster.wait_ended`; its exit status as `sbatch --wait` gives it, `sbatch_exit_status`).
Afterwards exactly the two daemons started here are stopped.

Skipped (with the reason) only when slurm is not installed and `apt-get install slurm-wlm`
is not possible or fails, or when the daemons cannot start on this machine.
CI installs it up front: `apt-get install -y --no-install-recommends slurm-wlm`.
"""

import os
import re

import pytest

from tests.launch import REPO_ROOT
from tests.scripts.slurm_cluster import (SlurmCluster, SlurmClusterError, free_port, sbatch_exit_status,
                                         slurm_unavailable)

pytestmark = pytest.mark.ci_leg("3.11")  # the sbatch scripts and SLURM's signals, on either megatron-core

SCRIPT = REPO_ROOT / "scripts" / "slurm_single_node.sbatch"
SHRINK = ["--tensor-model-parallel-size", "1", "--train-iters", "3", "--lr-warmup-iters", "1", "--log-interval", "1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_unavailable(timeout=300)
    if reason:
        pytest.skip(f"SLURM not available: {reason}")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start(timeout=60)
    except SlurmClusterError as e:
        c.stop()
        pytest.skip(f"SLURM installed but its daemons cannot start here: {e}")
    yield c
    pids = [p.pid for p in c.procs.values()]
    c.stop()
    for pid in pids:  # exactly the daemons started above are gone
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def submit(cluster, tmp_path, *args, **env_vars):
    """sbatch the single-node script and wait for the job to end: (sbatch's process, its returncode the job's exit
    status as `sbatch --wait` gives it; the job log; the job id; its `scontrol show job` fields at the end)."""
    out = tmp_path / "job.out"
    env = dict(cluster.env, CP_EXT_CPU="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               **env_vars)
    cpus = min(2, cluster.cpus)
    cmd = ["sbatch", "--parsable", f"--output={out}", "--gpus-per-node=0", f"--cpus-per-task={cpus}",
           "--time=10", "--job-name=cp_ext_test", str(SCRIPT), *map(str, args)]
    proc = cluster.run(cmd, check=False, timeout=60, env=env, cwd=REPO_ROOT)
    job = proc.stdout.strip().split(";")[0] if proc.returncode == 0 else None
    fields = {}
    if job:  # sbatch's exit status becomes the job's, as with sbatch --wait (which would poll every 8 s here)
        fields = cluster.wait_ended(job, timeout=300)
        assert fields, f"job {job}: its record was purged before its end was seen\n{cluster.logs()}"
        proc.returncode = sbatch_exit_status(fields)
    log = out.read_text() if out.exists() else "(no job output)"
    return proc, log, job, fields


def test_sbatch_two_rank_cpu_run(cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc, log, job, fields = submit(cluster, tmp_path, "configs/cpu_demo.yaml", *SHRINK, "--log-dir", run_dir)
    context = f"sbatch exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n--- job log ---\n{log[-6000:]}\n{cluster.logs()}"
    assert proc.returncode == 0 and job, context
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", fields
    # the script's own banner: CPU mode, 2 ranks, rendezvous on the node list's first host, and the
    # one timeout (pretrain_moe.py's default; also torchrun's --rdzv-conf join_timeout=600 on this run)
    assert re.search(rf"cp_ext: job {job} on 1 node\(s\) \[{cluster.node}\], 2 ranks/node, rendezvous {cluster.node}:\d+, "
                     r"config configs/cpu_demo.yaml, OMP_NUM_THREADS=1 \(CPU/gloo\), distributed timeout 10 min", log), context
    assert "training: world 2 = TP 1 x PP 1 x CP 2 (Ulysses 1 x ring 2) x DP 1" in log, context
    # the cluster's JobRequeue=1 (SLURM's default): a requeue would start over without --save, and rank 0 says so
    assert log.count(f"note: SLURM may requeue job {job} (Requeue=1: after a node failure, a preemption or the "
                     "time-limit warning) but this run has no --save") == 1, context
    iterations = re.findall(r"^ iteration +(\d+)/ +3 \|.*\| lm loss: \d\.\d+E[+-]\d+ \|", log, re.M)
    assert iterations == ["1", "2", "3"], context
    assert re.search(r"^training done: lm loss [\d.]+ \(iteration 1\) -> [\d.]+ \(iteration 3\)", log, re.M), context
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_sbatch_failure_is_the_job_exit_code(cluster, tmp_path):
    """A configuration error on every rank: the job fails and its exit status (as sbatch --wait gives it) says so."""
    proc, log, job, fields = submit(cluster, tmp_path, "configs/cpu_demo.yaml", *SHRINK, "--position-embedding-type", "rope", "--disable-bias-linear", "--swiglu", "--normalization", "RMSNorm", "--num-layers", "3",
                            "--pipeline-model-parallel-size", "2")
    assert proc.returncode != 0 and job, f"{proc.stdout}\n{proc.stderr}\n{log}"
    assert fields["JobState"] == "FAILED", fields
    assert "training done" not in log


def test_a_master_addr_of_another_host_fails_the_job_at_once(cluster, tmp_path):
    """MASTER_ADDR exported for another host (here TEST-NET-2's 198.51.100.7): no node would host torchrun's
    rendezvous store and every node would wait 60 s for it; instead the batch script ends the job with exit
    2 and one message naming MASTER_ADDR and the fix, before srun starts anything."""
    proc, log, job, fields = submit(cluster, tmp_path, "configs/cpu_demo.yaml", *SHRINK, MASTER_ADDR="198.51.100.7")
    assert proc.returncode != 0 and job, f"{proc.stdout}\n{proc.stderr}\n{log}"
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", fields
    assert log.count("error: MASTER_ADDR=198.51.100.7 (198.51.100.7) is not an address of the job's first node "
                     f"{cluster.node} (") == 1, log
    assert "cp_ext: job" not in log and "Traceback" not in log, log


@pytest.mark.quick
def test_multi_node_script_is_accepted(cluster):
    """The multi-node script's #SBATCH headers parse and schedule (sized down to this one node)."""
    script = REPO_ROOT / "scripts" / "slurm_multi_node.sbatch"
    proc = cluster.run(["sbatch", "--test-only", "--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={min(2, cluster.cpus)}",
                        "--time=10", str(script), "configs/cpu_demo.yaml"], check=False, cwd=REPO_ROOT)
    assert proc.returncode == 0 and "to start at" in proc.stderr + proc.stdout, proc.stdout + proc.stderr


def test_time_limit_warning_without_requeue_saves_and_exits_0(cluster, tmp_path):
    """The sbatch script's --signal=B:USR1@180 warning, sent by hand (`scancel --signal=USR1 --batch`), to a
    job submitted with --no-requeue: the batch shell forwards SIGTERM to the training ranks only, they
    finish the iteration, save and exit 0, the script says to resubmit with --load (it cannot requeue),
    and the job ends COMPLETED with the checkpoint in place. (A requeueable job requeues itself and goes
    on: tests/scripts/test_preemption.py.)"""
    import time

    run_dir, save, out = tmp_path / "run", tmp_path / "ck", tmp_path / "job.out"
    env = dict(cluster.env, CP_EXT_CPU="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    cmd = ["sbatch", "--parsable", "--no-requeue", f"--output={out}", "--gpus-per-node=0",
           f"--cpus-per-task={min(2, cluster.cpus)}", "--time=10", "--job-name=cp_ext_signal", str(SCRIPT),
           "configs/cpu_demo.yaml", "--tensor-model-parallel-size", "1", "--train-iters", "500", "--lr-warmup-iters", "1",
           "--log-interval", "1", "--save", str(save), "--log-dir", str(run_dir)]
    job = cluster.run(cmd, check=True, env=env, cwd=REPO_ROOT).stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    assert metrics.exists(), f"the job never trained:\n{out.read_text() if out.exists() else ''}\n{cluster.logs()}"
    cluster.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    fields = cluster.wait_ended(job, timeout=240)  # past SIGNALING/COMPLETING: a state in ENDED, or the record gone
    log = out.read_text()
    context = f"{fields}\n--- job log ---\n{log[-6000:]}"
    assert not fields or (fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0"
                          and fields.get("Restarts") == "0"), context
    assert "cp_ext: USR1 (time limit near): SIGTERM to the training ranks" in log, context
    assert "received SIGTERM (--exit-signal-handler): saving and exiting after iteration" in log, context
    assert (f"cp_ext: job {job} stopped at the time-limit warning (USR1) and is not requeued (Requeue=0: sbatch "
            "--no-requeue") in log, context
    assert "requeued (scontrol requeue)" not in log, context
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= stopped < 500 and len(metrics.read_text().splitlines()) == stopped, context
