"""The requeues that the batch script makes itself: preemption, and the time-limit warning, on 2 nodes.

A 2-node SLURM cluster (tests/scripts/multinode_cluster.py: each node its own namespaces, hostname,
address and slurmd) with SLURM's partition-priority preemption: partition ``low`` (PriorityTier 1,
PreemptMode REQUEUE, GraceTime 60 s) and ``high`` (PriorityTier 2). Each test trains
scripts/slurm_multi_node.sbatch's CPU job, one rank on each node (the CP ring across the bridge), in
``low`` with sbatch's ``--requeue`` and ``--save``/``--load`` but no periodic save, and stops it once it
has logged iteration 3:

* preemption: a one-node job in ``high`` preempts it. SLURM SIGTERMs the step on both nodes: the ranks
  save at the same iteration (``--exit-signal-handler``) and exit, torchrun exits 1, and the script,
  seeing PreemptTime set, requeues its own job (without that SLURM ends it FAILED inside its grace time
  and never requeues it);
* preemption under ``SlurmctldParameters=preempt_send_user_signal`` (SLURM 22.05's spelling; 23.02 and
  later: ``PreemptParameters=send_user_signal``) on a second cluster, the setting being cluster-wide:
  SLURM sends the job's own ``--signal`` (B:USR1) to the batch shell instead; the script SIGTERMs the
  ranks on every node, which save and exit 0, and requeues the job as preempted;
* the time-limit warning (``#SBATCH --signal=B:USR1@180``), sent by hand (``scancel --signal=USR1 --batch``):
  the script SIGTERMs the ranks on every node, which save and exit 0, and requeues the job, so that a
  run longer than the time limit goes on in the next allocation.

The requeued run loads the checkpoint and trains to the end. Checked: one save, at the same iteration on
every rank; each iteration in metrics.jsonl once, with the lm losses of the same flags run uninterrupted
on one node (one reference run for the module; 2 x 1 nodes equal it bit for bit, tests/scripts/test_multinode.py).

``AuthInfo=cred_expire=10`` and ``sched_interval=5`` let the requeued job start within seconds (SLURM's
defaults, 120 s and 60 s, are a real cluster's business). Measured on 2 cores, run alone: the module
163-264 s on Python 3.12 (two clusters of 2 nodes, 1.1 s each to start; the one-node reference about 10 s;
each scenario 50-80 s), 227 s with megatron's and torch's bytecode caches cold.
"""

import re
import time

import pytest

from tests.launch import REPO_ROOT, lm_losses, run_script
from tests.scripts.multinode_cluster import running_cluster
from tests.scripts.slurm_cluster import free_port

# SLURM's preemption and the sbatch script, the same on either megatron-core: the 3.12 leg (the 3.11 leg
# has the other multi-node faults).
pytestmark = [pytest.mark.multinode, pytest.mark.ci_leg("3.12")]

SCRIPT = REPO_ROOT / "scripts" / "slurm_multi_node.sbatch"
ITERS = 14  # at about 0.6 s each, the stop (at most 2-3 s after iteration 3) lands mid-run
FLAGS = ["--tensor-model-parallel-size", "1", "--train-iters", str(ITERS), "--lr-warmup-iters", "1",
         "--log-interval", "1"]
SETTINGS = {"PreemptType": "preempt/partition_prio", "PreemptMode": "REQUEUE", "AuthInfo": "cred_expire=10",
            "SchedulerParameters": "sched_interval=5"}
PARTITIONS = {"low": "PriorityTier=1 PreemptMode=REQUEUE GraceTime=60", "high": "PriorityTier=2 PreemptMode=OFF"}
SAVED = re.compile(r"received SIGTERM \(--exit-signal-handler\): saving and exiting after iteration (\d+)")


# Each cluster's slurm.conf changes and the scenarios run on it, one after the other.
CLUSTERS = (({}, ("preempt", "usr1")),
            ({"SlurmctldParameters": "preempt_send_user_signal"}, ("preempt_signal",)))


def _scenarios(root):
    """Every scenario: {name: what it saw, or the exception it raised}. A cluster that cannot be built
    skips (or, under CP_EXT_REQUIRE_MULTINODE=1, fails) its own scenarios' tests with the reason
    (`running_cluster`)."""
    seen = {}
    for i, (extra, names) in enumerate(CLUSTERS):
        try:
            with running_cluster(root / f"c{i}", num_nodes=2, settings={**SETTINGS, **extra},
                                 partitions=PARTITIONS) as cluster:
                for name in names:
                    (root / name).mkdir()
                    try:  # one scenario's failure is its test's, not the others'
                        seen[name] = SCENARIOS[name](cluster, root / name)
                    except Exception as e:
                        seen[name] = e
        except (pytest.skip.Exception, pytest.fail.Exception) as e:
            seen.update((name, e) for name in names)
    return seen


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    # a short root: slurmstepd's socket path (spool/<node>/<node>_<job>.<step>) must stay under 108 bytes
    return _scenarios(tmp_path_factory.mktemp("pre"))


def seen(scenarios, name):
    if isinstance(scenarios[name], (Exception, pytest.skip.Exception, pytest.fail.Exception)):
        raise scenarios[name]
    return scenarios[name]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The lm losses of the same flags, run uninterrupted on 2 ranks of one node (the same grid)."""
    ref_dir = tmp_path_factory.mktemp("ref")
    ref = run_script(2, REPO_ROOT / "pretrain_moe.py", "--config", "configs/cpu_demo.yaml", *FLAGS, "--device", "cpu",
                     "--log-dir", ref_dir, check=False, timeout=300)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-6000:]
    return lm_losses(ref_dir)


def job_state(cluster, job):
    """JobState from `scontrol show job`, None once the record is purged."""
    return cluster.job_fields(job).get("JobState")


def interrupted_run(cluster, tmp_path, stop):
    """Submit the job in ``low``, call ``stop(job)`` once it has logged iteration 3, wait until it has ended
    (requeued and finished, or not); return (job, its log, run dir, save dir, state, log context)."""
    out, save, run_dir = tmp_path / "low.out", tmp_path / "ck", tmp_path / "run"
    env = cluster.cpu_job_env(MASTER_PORT=str(free_port()))
    # the script's #SBATCH --exclusive: the job holds both nodes whole
    job = cluster.run(["sbatch", "--parsable", "--requeue", "--partition=low", "--nodes=2", f"--output={out}",
                       "--open-mode=append", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", "--job-name=low",
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
    # a state in ENDED (not SIGNALING, which a preempted job shows for a moment) or the record gone
    state = cluster.wait_ended(job, timeout=300).get("JobState")
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
        preemptor.append(cluster.run(["sbatch", "--parsable", "--partition=high", "--nodes=1", "--cpus-per-task=1",
                                      f"--output={tmp_path / 'high.out'}", "--wrap", "sleep 2"],
                                     check=True, env=cluster.env).stdout.strip().split(";")[0])

    outcome = interrupted_run(cluster, tmp_path, preempt)
    state = cluster.wait_ended(preemptor[0], timeout=120).get("JobState")  # on a busy machine it may still be ending
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


def test_preempted_job_warned_with_its_signal_saves_requeues_and_resumes_exactly(scenarios, reference):
    """``SlurmctldParameters=preempt_send_user_signal``: at preemption SLURM sends the job's --signal (B:USR1) to the
    batch shell rather than SIGTERM to the step; the script stops the ranks on both nodes, they save and exit
    0, and the job is requeued as preempted (not as at the time limit), then resumes exactly."""
    (job, text, run_dir, save, state, context), preemptor_state = seen(scenarios, "preempt_signal")
    assert state in ("COMPLETED", None), context
    assert preemptor_state in ("COMPLETED", None), context
    assert text.count("cp_ext: USR1 (preempted, send_user_signal): SIGTERM to the training ranks") == 1, context
    assert "time limit near" not in text, context
    assert_resumed_exactly(job, text, run_dir, save, context, reference, "was preempted")


SCENARIOS = {"preempt": _preempted, "usr1": _warned, "preempt_signal": _preempted}
