"""A throwaway one-node SLURM cluster for tests: slurmctld + slurmd in a temp dir.
(tests/scripts/multinode_cluster.py builds several nodes on the same base.)

Debian's slurm-wlm 22.05 ships ``auth_none.so``/``cred_none.so``, so the cluster needs no
munge daemon and no key: ``AuthType=auth/none``, ``CredType=cred/none``. Everything the
daemons write (state, spool, logs, pid files) lives under the temp dir, both daemons run
in the foreground (``-D``) as children of the test, and `stop` ends exactly those two
processes (by pid, SIGTERM then SIGKILL) plus any job steps left in their process groups.

    with SlurmCluster(tmp_path) as cluster:
        job = cluster.run(["sbatch", "--parsable", script]).stdout.strip().split(";")[0]
        fields = cluster.wait_ended(job)  # polls `scontrol show job` every 0.5 s
        status = sbatch_exit_status(fields)  # what `sbatch --wait` would have exited with

Nothing here touches /etc/slurm or a system slurm; client commands get ``SLURM_CONF``
pointing at the temp ``slurm.conf`` through `cluster.env`.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "srun")
APT_PACKAGES = ("slurm-wlm",)  # pulls slurmctld, slurmd, slurm-client, basic plugins (auth/none included)


def missing_binaries():
    return [name for name in DAEMONS if shutil.which(name) is None]


def try_install(timeout=600):
    """Best effort: `apt-get install slurm-wlm` when running as root with apt. Returns a reason or None."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"slurm binaries missing ({', '.join(missing_binaries())}) and cannot apt-get install (not root or no apt)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *APT_PACKAGES]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:  # stale package lists: update once and retry
            subprocess.run(["apt-get", "update"], capture_output=True, text=True, timeout=timeout, env=env)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (subprocess.TimeoutExpired, OSError) as e:
        return f"apt-get install {' '.join(APT_PACKAGES)} failed: {e}"
    if proc.returncode != 0 or missing_binaries():
        return f"apt-get install {' '.join(APT_PACKAGES)} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
    return None


def slurm_unavailable(timeout=300):
    """Why slurm cannot be used here (None if it can): installs it first (`try_install`) unless
    ``CP_EXT_NO_APT=1``. A test fixture skips with this reason."""
    if os.environ.get("CP_EXT_NO_APT") != "1":
        return try_install(timeout=timeout)
    return f"slurm binaries missing: {missing_binaries()}" if missing_binaries() else None


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_memory_mb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


# JobState values (scontrol show job) of a job that has ended, or is held and will not run again unasked.
# Anything else may still change: PENDING, RUNNING, and the transient ones scontrol shows in their place
# (COMPLETING, CONFIGURING, REQUEUED, RESIZING, SIGNALING while a preemption's or scancel's signal is
# delivered, STAGE_OUT, ...): a wait that stops at those reads a job mid-way.
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
         "OUT_OF_MEMORY", "REQUEUE_HOLD", "SPECIAL_EXIT")


def sbatch_exit_status(fields):
    """The exit status `sbatch --wait` gives for an ended job, from its ExitCode "a:b" (`job_fields`; a: the batch
    script's exit status, b: the signal that ended it): a, or 128 + b when a is 0 and b is not."""
    status, sig = (int(x) for x in fields["ExitCode"].split(":"))
    return status or (128 + sig if sig else 0)


class SlurmClusterError(RuntimeError):
    pass


class SlurmCluster:
    """slurmctld and one slurmd on this host (127.0.0.1). `tests.scripts.multinode_cluster.MultiNodeCluster`
    overrides where the nodes live (`nodes`, `controller`, `start_nodes`, `stop_nodes`); the rest is shared."""

    def __init__(self, root, cpus=None, name="cpexttest", settings=None, partitions=None):
        self.root = Path(root)
        self.settings = dict(settings or {})  # slurm.conf lines to set or replace, e.g. {"SlurmdTimeout": 10}
        # {partition: its settings beyond Nodes (every node), MaxTime and State}; the first is the default
        self.partitions = dict(partitions or {"debug": ""})
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.name = name
        self.procs = {}
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del self.env[key]  # a surrounding allocation must not leak into the test cluster
        # The jobs launch with this test's interpreter, not whichever torchrun is first on PATH: CI's 3.12 leg runs
        # pytest from a venv it does not activate, and a job on 3.11's torchrun would train on another megatron-core.
        self.env.setdefault("TORCHRUN", f"{sys.executable} -m torch.distributed.run")
        self.nodes = {self.node: "127.0.0.1"}  # node name -> the address slurmctld reaches its slurmd at
        self.controller = (self.node, "127.0.0.1")  # SlurmctldHost: this host's name (slurmctld checks it), address

    def node_memory(self):
        """RealMemory per node: 0.9 x MemTotal (slurmd drains a node whose configured RealMemory exceeds what it finds)."""
        return max(256, int(node_memory_mb() * 0.9))

    def write_conf(self):
        r = self.root
        for sub in ("state", "logs", *(f"spool/{node}" for node in self.nodes)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        host, addr = self.controller
        nodes = ",".join(self.nodes)
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        lines = [
            f"ClusterName={self.name}",
            f"SlurmctldHost={host}({addr})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            f"StateSaveLocation={r / 'state'}",
            # %n: the node name, so that several slurmd on one host keep apart
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'spool' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'logs' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=5",
            # How long an ended job's record stays: `wait_ended` polls scontrol every 0.5 s, well within it;
            # sbatch --wait (test_network_faults.py) polls after 2 s, then every 8 s while MinJobAge/2 <= 8
            # (slurm's _job_wait backs off 2 -> 8 -> 32 s only while the interval is < MinJobAge/2).
            "MinJobAge=16",
        ]
        settings = dict(self.settings)
        lines = [f"{key}={settings.pop(key)}" if (key := line.split("=", 1)[0]) in settings else line for line in lines]
        self.conf.write_text("\n".join([
            *lines,
            *(f"{key}={value}" for key, value in settings.items()),
            *(f"NodeName={node} NodeAddr={naddr} CPUs={self.cpus} RealMemory={self.node_memory()} State=UNKNOWN"
              for node, naddr in self.nodes.items()),
            *(f"PartitionName={name} Nodes={nodes} Default={'YES' if i == 0 else 'NO'} MaxTime=INFINITE State=UP {extra}".rstrip()
              for i, (name, extra) in enumerate(self.partitions.items())),
            "",
        ]))

    def _start(self, name, cmd, **kwargs):
        log = open(self.root / "logs" / f"{name}.out", "w")
        # Own session: the daemon's job steps stay in its process group, which `stop` ends.
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            cwd=self.root, start_new_session=True, **kwargs)
        log.close()

    def start(self, timeout=30):
        self.write_conf()
        self.prepare()
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, timeout, "slurmctld to answer")
        self.start_nodes()
        self._wait(self.nodes_idle, timeout, f"node(s) {','.join(self.nodes)} to be idle in sinfo")
        return self

    def prepare(self):
        """What must exist before slurmctld starts (the multi-node cluster's bridge); nothing here."""

    def start_nodes(self):
        self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])

    def node_states(self):
        """{node: state} as sinfo reports it (flags such as ``*`` (not responding) stripped)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split("\n")
        return {name: state.rstrip("*~#$@^-!%") for name, state in (line.split() for line in out if line.strip())}

    def nodes_idle(self):
        states = self.node_states()
        return all(states.get(node) == "idle" for node in self.nodes)

    def _wait(self, ready, timeout, what, poll=0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmClusterError(f"{name} exited {proc.returncode} while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(poll)
        raise SlurmClusterError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def run(self, cmd, check=True, timeout=60, env=None, **kwargs):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env or self.env, timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise SlurmClusterError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def job_fields(self, job):
        """`scontrol show job -o` as {field: value} (JobState, ExitCode, NodeList, ...); {} once slurmctld has
        purged the record (MinJobAge)."""
        out = self.run(["scontrol", "show", "job", "-o", str(job)], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_ended(self, job, timeout=300, poll=0.5) -> dict:
        """Wait for ``job`` to end: `job_fields` every ``poll`` s until its JobState is one of ENDED, then its fields;
        {} if the record is gone (purged MinJobAge after the end). Not at the transient states a job shows on its way
        (SIGNALING, COMPLETING, ...). After ``timeout`` s: AssertionError naming the job, its last state, the tail of
        its output (StdOut) and the daemons' logs."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job_fields(job)
            if not fields or fields.get("JobState") in ENDED:
                return fields
            if time.monotonic() >= deadline:
                break
            time.sleep(poll)
        try:
            out = Path(fields["StdOut"]).read_text(errors="replace")[-4000:]
        except (KeyError, OSError):
            out = "(no job output)"
        raise AssertionError(f"job {job} did not end within {timeout} s: last JobState={fields.get('JobState')}\n"
                             f"--- job output ---\n{out}\n{self.logs()}")

    def logs(self, tail=3000):
        out = []
        for path in sorted((self.root / "logs").glob("*")):
            out.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop_process(self, name):
        """End one daemon this cluster started (SIGTERM, then SIGKILL after 15 s) and its process group."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        try:  # leftovers of job steps in the daemon's own process group (pgid == its pid)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_nodes(self):
        self.stop_process("slurmd")

    def stop(self):
        """End exactly the daemons this cluster started (and their process groups): nodes first."""
        try:
            self.stop_nodes()
        finally:
            for name in list(self.procs)[::-1]:
                self.stop_process(name)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
