"""A throwaway one-node SLURM cluster for tests: slurmctld + slurmd in a temp dir.

Debian's slurm-wlm 22.05 ships ``auth_none.so``/``cred_none.so``, so the cluster needs no
munge daemon and no key: ``AuthType=auth/none``, ``CredType=cred/none``. Everything the
daemons write (state, spool, logs, pid files) lives under the temp dir, both daemons run
in the foreground (``-D``) as children of the test, and `stop` ends exactly those two
processes (by pid, SIGTERM then SIGKILL) plus any job steps left in their process groups.

    with SlurmCluster(tmp_path) as cluster:
        proc = cluster.run(["sbatch", "--wait", script])

Nothing here touches /etc/slurm or a system slurm; client commands get ``SLURM_CONF``
pointing at the temp ``slurm.conf`` through `cluster.env`.
"""

import os
import shutil
import signal
import socket
import subprocess
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


class SlurmClusterError(RuntimeError):
    pass


class SlurmCluster:
    def __init__(self, root, cpus=None, name="cpexttest"):
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.name = name
        self.procs = {}
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del self.env[key]  # a surrounding allocation must not leak into the test cluster

    def write_conf(self):
        r = self.root
        for sub in ("state", "spool", "logs"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        # 0.9 x MemTotal: slurmd drains a node whose configured RealMemory exceeds what it finds.
        memory = max(256, int(node_memory_mb() * 0.9))
        self.conf.write_text("\n".join([
            f"ClusterName={self.name}",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'logs' / 'slurmd.log'}",
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
            # sbatch --wait polls after 2 s, then every 8 s while MinJobAge/2 <= 8 (slurm's
            # _job_wait backs off 2 -> 8 -> 32 s only while the interval is < MinJobAge/2).
            "MinJobAge=16",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _start(self, name, cmd):
        log = open(self.root / "logs" / f"{name}.out", "w")
        # Own session: the daemon's job steps stay in its process group, which `stop` ends.
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            cwd=self.root, start_new_session=True)
        log.close()

    def start(self, timeout=30):
        self.write_conf()
        self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, timeout, "slurmctld to answer")
        self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
        self._wait(self._node_idle, timeout, f"node {self.node} to be idle in sinfo")
        return self

    def _node_idle(self):
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
        return out and out[0].rstrip("*~#") == "idle"

    def _wait(self, ready, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmClusterError(f"{name} exited {proc.returncode} while waiting for {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.5)
        raise SlurmClusterError(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def run(self, cmd, check=True, timeout=60, env=None, **kwargs):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env or self.env, timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise SlurmClusterError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def logs(self, tail=3000):
        out = []
        for path in sorted((self.root / "logs").glob("*")):
            out.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self):
        """End exactly the daemons this cluster started (and their process groups)."""
        for name in ("slurmd", "slurmctld"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
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

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
