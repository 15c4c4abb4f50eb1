"""Issue #39's requeues that the batch script makes itself: preemption, and the time-limit warning.

A one-node SLURM cluster (tests/scripts/slurm_cluster.py) with SLURM's partition-priority preemption:
partition ``low`` (PriorityTier 1, PreemptMode REQUEUE, GraceTime 60 s) and ``high`` (PriorityTier 2).
Each test trains scripts/slurm_single_node.sbatch's 2-rank CPU job in ``low`` with sbatch's ``--requeue`` and
``--save``/``--load`` but no periodic save, and stops it once it has logged iteration 3:

* preemption: a 2-CPU job in ``high`` preempts it. SLURM SIGTERMs the step: the ranks save at the same
  iteration (``--exit-signal-handler``) and exit, torchrun exits 1, and the script, seeing PreemptTime set,
  requeues its own job (without that SLURM ends it FAILED inside its grace time and never requeues it);
* the time-limit warning (``#SBATCH --signal=B:USR1@180``), sent by hand (``scancel --signal=USR1 --batch``):
  the script SIGTERMs the ranks, which save and exit 0, and requeues the job, so that a run longer than
  the time limit goes on in the next allocation.

The requeued run loads the checkpoint and trains to the end. Checked: one save, at the same iteration on
every rank; each iteration in metrics.jsonl once, with the lm losses of the same flags run uninterrupted
(one reference run for the module).

``AuthInfo=cred_expire=10`` and ``sched_interval=5`` let the requeued job start within seconds (SLURM's
defaults, 120 s and 60 s, are a real cluster's business). Measured on 2 cores, run alone: the module 90 s
(cluster start and the reference 10 s; preemption 42 s; time-limit warning 38 s); 107 s at 20 iterations.
"""

import re
import time

import pytest

from tests.launch import REPO_ROOT, lm_losses, run_script
from tests.scripts.slurm_cluster import SlurmCluster, SlurmClusterError, free_port, slurm_unavailable

pytestmark = pytest.mark.ci_leg("3.12")  # SLURM's preemption and the sbatch script, on either megatron-core

SCRIPT = REPO_ROOT / "scripts" / "slurm_single_node.sbatch"
ITERS = 14  # at about 0.6 s each, the stop (at most 2-3 s after iteration 3) lands mid-run
FLAGS = ["--tensor-model-parallel-size", "1", "--train-iters", str(ITERS), "--lr-warmup-iters", "1",
         "--log-interval", "1"]
SETTINGS = {"PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE", "AuthInfo": "cred_expire=10",
            "SchedulerParameters": "sched_interval=5"}
PARTITIONS = {"low": "PriorityTier=1 PreemptMode=REQUEUE GraceTime=60", "high": "PriorityTier=2 PreemptMode=OFF"}
SAVED = re.compile(r"received SIGTERM \(--exit-signal-handler\): saving and exiting after iteration (\d+)")
LIVE = ("RUNNING", "PENDING", "REQUEUED", "COMPLETING", "CONFIGURING")


def _scenarios(root):
    """Both scenarios, one after the other on one cluster: {name: what it saw, or the exception it raised}."""
    reason = slurm_unavailable(timeout=300)
    if reason:
        pytest.skip(f"SLURM not available: {reason}")
    cluster, seen = SlurmCluster(root / "c", settings=SETTINGS, partitions=PARTITIONS), {}
    try:
        try:
            cluster.start(timeout=60)
        except SlurmClusterError as e:
            pytest.skip(f"SLURM installed but its daemons cannot start here: {e}")
        for name, scenario in (("preempt", _preempted), ("usr1", _warned)):
            (root / name).mkdir()
            try:  # one scenario's failure is its test's, not the other's
                seen[name] = scenario(cluster, root / name)
            except Exception as e:
                seen[name] = e
    finally:
        cluster.stop()
    return seen


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    # a short root: slurmstepd's socket path (spool/<node>/<node>_<job>.<step>) must stay under 108 bytes
    return _scenarios(tmp_path_factory.mktemp("pre"))


def seen(scenarios, name):
    if isinstance(scenarios[name], Exception):
        raise scenarios[name]
    return scenarios[name]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The lm losses of the same flags, run uninterrupted on 2 ranks."""
    ref_dir = tmp_path_factory.mktemp("ref")
    ref = run_script(2, REPO_ROOT / "pretrain_moe.py", "--config", "configs/cpu_demo.yaml", *FLAGS, "--device", "cpu",
                     "--log-dir", ref_dir, check=False, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-6000:]
    return lm_losses(ref_dir)


def job_state(cluster, job):
    """JobState from `scontrol show job`, None once the record is purged."""
    state = re.search(r"JobState=(\S+)", cluster.run(["scontrol", "show", "job", job], check=False).stdout)
    return state and state.group(1)


def interrupted_run(cluster, tmp_path, stop):
    """Submit the job in ``low``, call ``stop(job)`` once it has logged iteration 3, wait until it has ended
    (requeued and finished, or not); return (job, its log, run dir, save dir, state, log context)."""
    out, save, run_dir = tmp_path / "low.out", tmp_path / "ck", tmp_path / "run"
    env = dict(cluster.env, CP_EXT_CPU="1", NPROC_PER_NODE="2", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    job = cluster.run(["sbatch", "--parsable", "--requeue", "--partition=low", f"--output={out}", "--open-mode=append",
                       "--gpus-per-node=0", f"--cpus-per-task={min(2, cluster.cpus)}", "--time=10", "--job-name=low",
                       str(SCRIPT), "configs/cpu_demo.yaml", *FLAGS, "--save", str(save), "--load", str(save),
                       "--log-dir", str(run_dir)], check=True, env=env, cwd=REPO_ROOT).stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        if job_state(cluster, job) not in ("RUNNING", "PENDING", "CONFIGURING"):
            break
        time.sleep(0.5)
    log = lambda: out.read_text() if out.exists() else "(no job output)"  # noqa: E731
    assert metrics.exists(), f"the job never trained:\n{log()}\n{cluster.logs()}"
    stop(job)
    deadline, state = time.monotonic() + 300, None
    while time.monotonic() < deadline:
        state = job_state(cluster, job)
        if state not in LIVE:
            break
        time.sleep(0.5)
    text = log()
    return job, text, run_dir, save, state, f"{state}\n--- job log ---\n{text[-8000:]}\n{cluster.logs()}"


def assert_resumed_exactly(job, text, run_dir, save, context, reference, requeued_line):
    saved = SAVED.findall(text)
    assert len(saved) == 1 and 3 <= int(saved[0]) < ITERS, context
    assert text.count(f"cp_ext: job {job} {requeued_line}: requeued (scontrol requeue)") == 1, context
    assert f"cp_ext: job {job} was requeued (SLURM_RESTART_COUNT=1)" in text, context
    assert f"loaded checkpoint of iteration {saved[0]} from" in text, context
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS), context
    merged = lm_losses(run_dir)
    assert [i for i, _ in merged] == list(range(1, ITERS + 1)), merged
    for (i, got), (_, want) in zip(merged, reference):
        assert abs(got - want) <= 1e-6 * abs(want), (i, got, want, merged)


def _preempted(cluster, tmp_path):
    """A job in ``high`` preempts the training job; (the training run's outcome, the preemptor's state)."""
    preemptor = []

    def preempt(job):
        preemptor.append(cluster.run(["sbatch", "--parsable", "--partition=high", f"--cpus-per-task={min(2, cluster.cpus)}",
                                      f"--output={tmp_path / 'high.out'}", "--wrap", "sleep 2"],
                                     check=True, env=cluster.env).stdout.strip().split(";")[0])

    outcome = interrupted_run(cluster, tmp_path, preempt)
    deadline = time.monotonic() + 120  # on a busy machine the preemptor may still be ending
    while (state := job_state(cluster, preemptor[0])) in (*LIVE, "SIGNALING") and time.monotonic() < deadline:
        time.sleep(0.5)
    return outcome, state


def _warned(cluster, tmp_path):
    """The time-limit warning, sent by hand to the training job's batch shell."""
    return interrupted_run(cluster, tmp_path,
                           lambda job: cluster.run(["scancel", "--signal=USR1", "--batch", job], check=True))


def test_preempted_job_saves_requeues_and_resumes_exactly(scenarios, reference):
    (job, text, run_dir, save, state, context), preemptor_state = seen(scenarios, "preempt")
    assert state in ("COMPLETED", None), context
    assert preemptor_state in ("COMPLETED", None), context
    assert_resumed_exactly(job, text, run_dir, save, context, reference, "was preempted")


def test_time_limit_warning_saves_requeues_and_resumes_exactly(scenarios, reference):
    """The sbatch script's --signal=B:USR1@180 warning, sent by hand: save, requeue, resume. (With
    --no-requeue it saves and ends COMPLETED instead: tests/scripts/test_slurm.py.)"""
    job, text, run_dir, save, state, context = seen(scenarios, "usr1")
    assert state in ("COMPLETED", None), context
    assert text.count("cp_ext: USR1 (time limit near): SIGTERM to the training ranks") == 1, context
    assert_resumed_exactly(job, text, run_dir, save, context, reference, "stopped at the time-limit warning (USR1)")
