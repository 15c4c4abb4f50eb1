"""The network-partition and slow-node faults on a real 2-node job (scripts/slurm_multi_node.sbatch)
in the namespace cluster of tests/scripts/multinode_cluster.py.

One 8-node cluster, four 2-node jobs (one CPU rank per node, CP 2 across the bridge, as in
test_multinode.py), overlapped so that the file costs about one timeout, not four jobs:

* ``partition`` (n1, n2; --distributed-timeout-minutes 1, long training): once it trains, n2's link goes
  down (its veth on the bridge: no packet in or out, no RST either);
* ``stall`` (n5, n6; the same): once it trains, n6's ranks and torchrun are SIGSTOPped for longer than
  the timeout, then SIGCONTed;
* while those two wait for their timeout (their ranks blocked, the cores free): ``slow`` (n3, n4; 3
  iterations) with n4 capped at 30 % of one CPU (cgroup CFS quota on the whole node, from before the
  job starts), and ``ref`` (n7, n8) the same job unslowed, side by side.

--distributed-timeout-minutes takes whole minutes only (``POSITIVE``: an int >= 1), so 1 minute.

Each rank's stdout/stderr goes to a file per node written by that node's slurmstepd on the shared
filesystem (srun's ``SLURM_STDOUTMODE`` / ``SLURM_STDERRMODE``), so a partitioned node's last words are
kept even though its link to srun (on the batch node) is down. A watcher thread records when each
rank process (a ``pretrain_moe.py`` with ``RANK`` in its environment) appears and goes, on every node.
``SlurmdTimeout=300``: slurmctld must not mark the cut-off n2 DOWN (and requeue the job) while it is
partitioned; the test brings the link back once both ranks are gone.

Measured on the 2-core machine: the whole file 101 to 102 s alone (three runs; cluster start and stop
included): about 35 s until both long jobs log iteration 2, then the faults, 60 s of timeout (the
short jobs run meanwhile), then about 8 s until slurm has ended the jobs; 119 s with
tests/scripts/test_multinode.py running beside it on the same 2 cores (both passed).

    pytest -m multinode tests/scripts/test_network_faults.py      # root; skips where no cluster can be built
"""

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.launch import REPO_ROOT
from tests.scripts.multinode_cluster import PREFIX, running_cluster

pytestmark = [pytest.mark.multinode, pytest.mark.ci_leg("3.11")]  # faults: the launcher's, SLURM's and the kernel's

SCRIPT = REPO_ROOT / "scripts" / "slurm_multi_node.sbatch"
BASE = ["configs/cpu_demo.yaml", "--tensor-model-parallel-size", "1", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--distributed-timeout-minutes", "1"]
TIMEOUT_S = 60  # --distributed-timeout-minutes 1
MARGIN_S = 90  # what the slowest iteration, the 0.5 s polling and a busy machine may add
TIMEOUT_LINE = re.compile(r"pretrain_moe\.py: rank (\d+): a collective waited longer than --distributed-timeout-minutes 1: ")
LOST_LINE = re.compile(r"pretrain_moe\.py: rank (\d+): lost the connection to the rank at ")
QUOTA = 0.3


class Ranks(threading.Thread):
    """Every training rank on every node: {pid: [node, RANK, first seen, gone (monotonic) or None]}."""

    def __init__(self, cluster):
        super().__init__(daemon=True)
        self.cluster, self.done, self.seen = cluster, threading.Event(), {}

    def run(self):
        while not self.done.wait(0.5):
            now, alive = time.monotonic(), set()
            for node in self.cluster.nodes:
                for pid in self.cluster.node_pids(node, "pretrain_moe.py"):
                    try:
                        raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                    except OSError:
                        continue
                    env = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
                    if "RANK" in env and "LOCAL_RANK" in env:  # a rank, not torchrun
                        alive.add(pid)
                        self.seen.setdefault(pid, [node, env["RANK"], now, None])
            for pid, entry in self.seen.items():
                if entry[3] is None and pid not in alive:
                    entry[3] = now

    def on(self, nodes):
        return {pid: entry for pid, entry in self.seen.items() if entry[0] in nodes}


class Job(threading.Thread):
    """``sbatch --wait`` of the 2-node script on ``nodes`` in a thread; its output files in ``dir``."""

    def __init__(self, cluster, name, nodes, dir, flags):
        super().__init__(daemon=True)
        self.cluster, self.name, self.nodes, self.dir, self.flags = cluster, name, nodes, Path(dir), flags
        self.dir.mkdir(parents=True)
        self.proc, self.started, self.ended = None, None, None

    def run(self):
        env = self.cluster.cpu_job_env(SLURM_STDOUTMODE=str(self.dir / "task-%N.out"),
                                       SLURM_STDERRMODE=str(self.dir / "task-%N.err"))
        self.started = time.monotonic()
        try:
            self.proc = self.cluster.run(
                ["sbatch", "--wait", "--nodes=2", f"--nodelist={','.join(self.nodes)}", f"--output={self.dir / 'job.out'}",
                 "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", f"--job-name={self.name}", str(SCRIPT),
                 *self.flags, "--log-dir", self.dir / "run"], check=False, timeout=500, env=env, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired as e:
            self.proc = e
        self.ended = time.monotonic()

    def text(self, suffix):
        return "".join(p.read_text(errors="replace") for p in sorted(self.dir.glob(f"task-*.{suffix}")))

    def iterations(self):
        return [int(i) for i in re.findall(r"^ iteration +(\d+)/", self.text("out"), re.M)]

    def losses(self):
        path = self.dir / "run" / "metrics.jsonl"
        return [json.loads(line)["train/lm_loss"] for line in path.read_text().splitlines()] if path.exists() else []

    def iteration_ms(self):
        return [float(ms) for ms in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", self.text("out"))]

    def context(self):
        proc = self.proc
        head = f"{self.name}: sbatch {getattr(proc, 'returncode', 'timed out')}\n{getattr(proc, 'stdout', '')}\n{getattr(proc, 'stderr', '')}"
        job = (self.dir / "job.out").read_text(errors="replace") if (self.dir / "job.out").exists() else ""
        return (f"{head}\n--- job.out ---\n{job[-3000:]}\n--- tasks stdout ---\n{self.text('out')[-3000:]}"
                f"\n--- tasks stderr ---\n{self.text('err')[-4000:]}")


def wait_for(check, timeout, poll=0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(poll)
    return check()


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """What the scenario (``_faults``) saw; the tests below read it."""
    return _faults(tmp_path_factory.mktemp("netfaults"))


def _faults(root):
    with running_cluster(root / "cluster", num_nodes=8, settings={"SlurmdTimeout": 300}) as cluster:
        ranks = Ranks(cluster)
        ranks.start()
        long_run = [*BASE, "--train-iters", "500"]
        partition = Job(cluster, "partition", ["n1", "n2"], root / "partition", long_run)
        stall = Job(cluster, "stall", ["n5", "n6"], root / "stall", long_run)
        result = {"cluster": cluster, "ranks": ranks, "partition": partition, "stall": stall, "t0": time.monotonic()}
        try:
            partition.start()
            stall.start()
            # Both train (iteration 2 logged): then the faults, each as soon as its job is there.
            pending = {"partition", "stall"}
            deadline = time.monotonic() + 300
            while pending and time.monotonic() < deadline:
                if "partition" in pending and len(partition.iterations()) >= 2:
                    cluster.link_down("n2")
                    result["link_down"] = time.monotonic()
                    pending.discard("partition")
                if "stall" in pending and len(stall.iterations()) >= 2:
                    result["frozen_pids"] = cluster.freeze("n6", "pretrain_moe.py")
                    result["freeze"] = time.monotonic()
                    pending.discard("stall")
                if any(not job.is_alive() for job in (partition, stall)):
                    break
                time.sleep(0.5)
            result["fault_missed"] = sorted(pending)

            # Meanwhile (their ranks blocked in a collective): the slow node and its unslowed twin.
            cluster.cpu_quota("n4", QUOTA)
            short = [*BASE, "--train-iters", "3"]
            slow = Job(cluster, "slow", ["n3", "n4"], root / "slow", short)
            ref = Job(cluster, "ref", ["n7", "n8"], root / "ref", short)
            result.update(slow=slow, ref=ref)
            slow.start()
            ref.start()
            # The quota holds n4's rank too (slurmd is in the node's cgroup, and what it starts inherits it).
            wait_for(lambda: ranks.on({"n4"}), 300)  # its imports at 30 % of a CPU, beside the suite
            result["n4_rank_cgroup"] = [read_or_gone(f"/proc/{pid}/cgroup") for pid in ranks.on({"n4"})]

            # The stall lasts longer than the timeout: SIGCONT once n5's rank has given up (or 2 timeouts).
            if "freeze" in result:
                wait_for(lambda: any(e[3] for e in ranks.on({"n5"}).values()), 2 * TIMEOUT_S + MARGIN_S)
                time.sleep(5)
                result["n6_before_thaw"] = {pid: proc_state(pid) for pid in result["frozen_pids"]}
                cluster.thaw("n6", "pretrain_moe.py")
                result["thaw"] = time.monotonic()
            # The partition stays until both its ranks are gone (or the margin is spent); then the link
            # comes back so that slurm can finish the job on n2 and we can see what remains there.
            if "link_down" in result:
                wait_for(lambda: len(ranks.on({"n1", "n2"})) == 2 and all(e[3] for e in ranks.on({"n1", "n2"}).values()),
                         result["link_down"] + TIMEOUT_S + MARGIN_S - time.monotonic())
                result["ranks_gone_link_down"] = {e[0]: e[3] for e in ranks.on({"n1", "n2"}).values()}
                result["n2_left_while_down"] = [cluster.node_pids("n2", m) for m in ("torchrun", "pretrain_moe.py")]
                cluster.link_up("n2")
                result["link_up"] = time.monotonic()
            for job in (partition, stall, slow, ref):
                job.join(timeout=400)
            result["jobs_done"] = time.monotonic()
            # Nothing of the jobs may remain on any node (slurmstepd included) once slurm says they ended.
            wait_for(lambda: not any(cluster.node_pids(n, m) for n in cluster.nodes for m in ("slurmstepd", "pretrain_moe")), 60)
            result["left"] = {n: left for n in cluster.nodes
                              if (left := [p for m in ("slurmstepd", "pretrain_moe", "torchrun") for p in cluster.node_pids(n, m)])}
            result["states"] = cluster.run(["squeue", "-h", "-o", "%j %T"], check=False).stdout
            result["logs"] = cluster.logs()
            return result
        finally:
            ranks.done.set()
            ranks.join(timeout=30)


def repo_frames(text):
    """Traceback frames in cp_ext's own code (pretrain_moe.py, cp_ext/): none may appear. torchrun's own
    tracebacks (its agent losing the rendezvous store, or SIGTERMed by slurm) are torch's, not ours."""
    return [line for line in text.splitlines() if f'File "{REPO_ROOT}' in line or 'File "pretrain_moe.py"' in line]


def exited_with(job, pattern):
    """{rank: the line} of the ranks whose stderr has a line matching ``pattern``."""
    return {m.group(1): m.group(0) for line in job.text("err").splitlines() if (m := pattern.search(line))}


def test_partition_ends_every_rank_with_the_timeout(faults):
    """n2's link down while the job trains (after iteration 2): both ranks, n1's and the cut-off n2's,
    end with the timeout line (gloo sees no reset through a downed link, only silence), no traceback,
    both processes gone within the timeout + 90 s of the fault while the link is still down; the job
    ends (FAILED: sbatch exit 1) once the link is back, and nothing of it remains on any node.

    What happens: a partition shows as silence, so the pending gloo operation on each side waits out
    --distributed-timeout-minutes, and each rank prints `pretrain_moe.py: rank R: a collective waited
    longer than --distributed-timeout-minutes 1: ... (... Timed out waiting 60000ms ...)` and exits 1.
    While n2 is still cut off its torchrun agent stays (its rank is gone; it cannot reach the rendezvous
    store on n1 to shut the rendezvous down, and slurm cannot reach n2 to end the step); once the link
    is back torchrun prints its own RendezvousConnectionError traceback (torch's code, not cp_ext's)
    and slurm ends the step within seconds. No cp_ext traceback. (Measured once by hand: with the link
    left down for 270 s the job stayed RUNNING, both ranks gone but srun on n1 and torchrun on n2 still
    there; so the test brings the link back, as an operator would, or slurm's SlurmdTimeout would.)

    Measured on the 2-core machine (four runs, one beside test_multinode.py): both ranks gone 60.0 to
    60.1 s after the link went down (the detection time: the timeout itself; the watcher polls every
    0.5 s); the job ended (sbatch exit 1, FAILED) 67 to 72 s after the link went down, 3 to 8 s after
    it came back (sbatch --wait polls every 8 s); nothing left on any node."""
    job = faults["partition"]
    assert "partition" not in faults["fault_missed"], job.context()
    gone = faults["ranks_gone_link_down"]
    times = {node: t - faults["link_down"] for node, t in gone.items() if t}
    print(f"partition: ranks gone {times} s after link down; job ended {job.ended - faults['link_down']:.1f} s after it,"
          f" {job.ended - faults['link_up']:.1f} s after link up; on n2 while down [torchrun, pretrain_moe]:"
          f" {faults['n2_left_while_down']}; left after the jobs: {faults['left']}")
    assert set(times) == {"n1", "n2"}, (gone, job.context())
    assert all(t < TIMEOUT_S + MARGIN_S for t in times.values()), (times, job.context())
    lines = exited_with(job, TIMEOUT_LINE)
    assert set(lines) == {"0", "1"}, job.context()
    assert not repo_frames(job.text("err")), job.context()
    assert not isinstance(job.proc, subprocess.TimeoutExpired) and job.proc.returncode != 0, job.context()
    assert not any(faults["left"].values()), faults["left"]


def test_stall_longer_than_the_timeout_ends_every_rank(faults):
    """n6's rank and torchrun SIGSTOPped after iteration 2 (a stall longer than the timeout): n5's rank
    ends with the timeout line, as at a partition; then slurm ends the step (srun --kill-on-bad-exit),
    and slurmstepd's SIGCONT + SIGTERM wakes n6's rank, which ends at once with one line naming the
    cause: the timeout line (its own deadline has passed) or the lost-connection line (n5's rank is
    gone), whichever its gloo meets first (measured: the timeout line in two of four runs, the
    lost-connection line in the other two). The test's own SIGCONT, 5 s after n5's rank is gone,
    found n6's processes already woken by slurm (gone, or running / a zombie on the busy machine).
    No cp_ext traceback; the job ends (FAILED); nothing left on any node.

    Measured on the 2-core machine (four runs, one beside test_multinode.py): n5's rank gone 60.0 to
    60.1 s after the freeze, n6's 1.1 to 5.3 s after n5's; the job ended 65 to 73 s after the freeze."""
    job = faults["stall"]
    assert "stall" not in faults["fault_missed"], job.context()
    assert faults["frozen_pids"], job.context()
    gone = {e[0]: e[3] for e in faults["ranks"].on({"n5", "n6"}).values()}
    assert gone.get("n5") and gone.get("n6"), (gone, job.context())
    print(f"stall: n5's rank gone {gone['n5'] - faults['freeze']:.1f} s after the freeze; n6's "
          f"{gone['n6'] - gone['n5']:.1f} s after n5's (our SIGCONT {faults.get('thaw', 0) - gone['n5']:.1f} s after n5's);"
          f" job ended {job.ended - faults['freeze']:.1f} s after the freeze; n6's frozen pids just before our SIGCONT:"
          f" {faults['n6_before_thaw']}")
    assert gone["n5"] - faults["freeze"] < TIMEOUT_S + MARGIN_S, job.context()
    assert gone["n6"] - gone["n5"] < MARGIN_S, job.context()
    timeouts, lost = exited_with(job, TIMEOUT_LINE), exited_with(job, LOST_LINE)
    print(f"stall: timeout lines {timeouts}; lost-connection lines {lost}")
    assert len(set(timeouts) | set(lost)) == 2 and timeouts, job.context()
    assert not repo_frames(job.text("err")), job.context()
    assert not isinstance(job.proc, subprocess.TimeoutExpired) and job.proc.returncode != 0, job.context()
    assert not faults["left"], faults["left"]


def test_slow_node_gives_the_same_losses(faults):
    """n4 capped at 30 % of one CPU for the whole job: the same 3 lm losses as the unslowed twin job run
    beside it, bit for bit, and how much slower it was (each rank waits for the slow one in every
    collective, so the whole job goes at the slow node's pace; the numbers do not change).

    Measured on the 2-core machine (the twin jobs sharing the 2 cores; sbatch --wait polls every 8 s,
    so the job times are coarse): alone, 50 to 66 s against 26 to 34 s unslowed (1.7x to 1.9x), per
    iteration 2.1 to 3.7 s against 0.9 to 2.7 s (1.2x to 2.2x in sum); beside test_multinode.py
    66 s both (the unslowed job starved too), per iteration 2.7 to 3.7 s against 1.7 to 2.2 s (1.5x).
    The losses were bit-equal in every run."""
    slow, ref = faults["slow"], faults["ref"]
    for job in (slow, ref):
        assert not isinstance(job.proc, subprocess.TimeoutExpired) and job.proc.returncode == 0, job.context()
    group = f"{PREFIX}{faults['cluster'].tag}n4"  # the node's cgroup (multinode_cluster.cpu_quota)
    assert faults["n4_rank_cgroup"] and all(f"/{group}\n" in text for text in faults["n4_rank_cgroup"]), faults["n4_rank_cgroup"]
    assert len(slow.losses()) == 3 and slow.losses() == ref.losses(), (slow.losses(), ref.losses())
    s, r = slow.ended - slow.started, ref.ended - ref.started
    per_iter = sum(slow.iteration_ms()) / max(sum(ref.iteration_ms()), 1e-9)
    print(f"slow node: job {s:.1f} s vs {r:.1f} s unslowed ({s / r:.2f}x); per-iteration ms {slow.iteration_ms()} vs"
          f" {ref.iteration_ms()} ({per_iter:.2f}x)")


def proc_state(pid):
    """The process's state letter (T: stopped), or "gone"."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def read_or_gone(path):
    try:
        return Path(path).read_text()
    except OSError:
        return "gone"
