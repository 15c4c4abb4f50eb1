"""A throwaway multi-node SLURM cluster on one machine: each node a set of Linux namespaces.

Each compute node is one ``unshare --net --uts --mount --pid --fork --mount-proc`` holder whose
PID-namespace init is a tiny reaper (Python, below). Inside it the node has

* its own hostname (``n1``, ``n2``, ...: the UTS namespace) and its own ``/proc`` (PID namespace:
  slurm's proctrack/linuxproc sees only the node's processes);
* its own network: a veth pair, ``eth0`` inside with the node's address, the other end
  (``cpx<tag>n<i>``) on the bridge ``cpx<tag>br`` in the root namespace, which also carries the
  controller's address (``.1``);
* a hosts file (every node name, and this host's name for the controller, -> bridge address)
  bind-mounted over ``/etc/hosts`` in its own mount namespace, so ``n1`` resolves to n1's bridge
  address on every node (torchrun's c10d rendezvous and gloo never see 127.0.x);
* its own ``slurmd -D -N n<i>`` (started by ``nsenter`` into the node's namespaces).

slurmctld runs in the root namespace, as in the one-node `SlurmCluster`, and listens on the bridge
address. The filesystem is shared (as a cluster's shared filesystem): the repository, the job's
output, the spool directories (``%n``: one per node). Everything is named with the prefix ``cpx``
and a random tag so two clusters (or a leftover) never clash.

``stop`` (also on any failure in ``start``) SIGKILLs every holder's init (which kills everything in
that PID namespace: slurmd, slurmstepd, torchrun, the ranks; the network namespace and the veth
pair go with it), stops slurmctld, deletes the veths and the bridge, and removes the cgroups
`cpu_quota` made. The holders also die with this process: ``unshare --kill-child`` plus a parent-death
signal on ``unshare``.

Fault injection (all by node name): `kill_node` (SIGKILL the node: everything on it dies at once),
`start_node` (bring a killed node back), `link_down` / `link_up`, `slow_link` (tbf rate limit) /
`delay` (netem, where the kernel has it) / `clear_link`, `freeze` / `thaw` (SIGSTOP / SIGCONT of the
node's processes, or those matching a pattern), `cpu_quota` (a cgroup-v1 CFS quota on the node).
"""

import contextlib
import ctypes
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.launch import TORCHRUN_ENV
from tests.scripts.slurm_cluster import SlurmCluster, SlurmClusterError, node_memory_mb, slurm_unavailable

PREFIX = "cpx"  # every bridge, veth and cgroup made here starts with it (.ci/run checks none remains)
NODE_IFNAME = "eth0"  # the node's bridge-facing interface, the same name on every node: GLOO_SOCKET_IFNAME
# The PID-namespace init of a node: reaps every orphan (slurmstepd double-forks), exits on SIGTERM.
INIT = ("import os, signal, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        time.sleep(0.2)\n")
TOOLS = ("unshare", "nsenter", "ip", "mount")


def unavailable():
    """Why a multi-node cluster cannot be built here (None if it can): root, the tools, the namespaces."""
    if os.geteuid() != 0:
        return "not root (namespaces, veths and a bridge need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing: {', '.join(missing)}"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"namespaces refused: unshare exited {probe.returncode}: {probe.stderr.strip()[-300:]}"
    return None


@contextlib.contextmanager
def running_cluster(root, num_nodes=2, timeout=60, settings=None, partitions=None):
    """A started `MultiNodeCluster` for a test (or a fixture); skips the test with the reason when slurm
    (installed first if it can be) or the namespaces are not available, or the cluster cannot start
    (``CP_EXT_REQUIRE_MULTINODE=1``: fails instead). Always stopped at the end, and then nothing of
    it may remain (SlurmClusterError naming what did)."""
    import pytest

    def unusable(reason):
        if os.environ.get("CP_EXT_REQUIRE_MULTINODE") == "1":
            pytest.fail(f"multi-node SLURM cluster required (CP_EXT_REQUIRE_MULTINODE=1) but: {reason}")
        pytest.skip(f"multi-node SLURM cluster not available here: {reason}")

    reason = slurm_unavailable(timeout=300) or unavailable()
    if reason:
        unusable(reason)
    cluster = MultiNodeCluster(root, num_nodes=num_nodes, settings=settings, partitions=partitions)
    try:
        try:
            cluster.start(timeout=timeout)
        except SlurmClusterError as e:
            unusable(f"it did not start: {e}")
        yield cluster
    finally:
        cluster.stop()
        left = cluster.leftovers()
        if left:
            raise SlurmClusterError(f"the cluster left these behind: {', '.join(left)}")


def _die_with_parent():
    """preexec_fn of a holder's unshare: SIGKILL when this (pytest's) process dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_subnet():
    """A /24 in 10.0.0.0/8 that no route of this host overlaps."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    used = []
    for line in routes.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "unicast", "multicast"):
            word = line.split()[1]
        try:
            used.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            pass
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{random.randint(1, 254)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise SlurmClusterError("no free 10.x.y.0/24 subnet for the cluster's bridge")


class MultiNodeCluster(SlurmCluster):
    """``num_nodes`` nodes n1, n2, ... (see the module's docstring); ``settings``: slurm.conf lines to set
    or replace (e.g. ``{"SlurmdTimeout": 10}`` for a quicker DOWN after `kill_node`); ``partitions``:
    {name: its settings}, each over every node (`SlurmCluster`'s)."""

    def __init__(self, root, num_nodes=2, cpus=None, name="cpextmulti", settings=None, partitions=None):
        super().__init__(root, cpus=cpus, name=name, settings=settings, partitions=partitions)
        self.tag = f"{random.randrange(16 ** 4):04x}"
        self.bridge = f"{PREFIX}{self.tag}br"
        self.net = _free_subnet()
        hosts = list(self.net.hosts())
        self.prefixlen = self.net.prefixlen
        self.controller = (self.node, str(hosts[0]))  # this host's name: slurmctld checks SlurmctldHost against it
        self.nodes = {f"n{i}": str(hosts[9 + i]) for i in range(1, num_nodes + 1)}
        self.num_nodes = num_nodes
        self.holders = {}  # node -> Popen of its `unshare`
        self.init_pids = {}  # node -> host pid of its PID-namespace init
        self.cgroups = []
        self.hosts_file = self.root / "hosts"

    def node_memory(self):
        return max(256, int(node_memory_mb() * 0.9) // self.num_nodes)

    def cpu_job_env(self, per_node=1, **extra):
        """The environment to sbatch a CPU job of scripts/slurm_multi_node.sbatch with: this cluster's, without
        a surrounding torchrun's variables, ``per_node`` ranks a node, gloo on the nodes' bridge interface."""
        env = {k: v for k, v in self.env.items() if k not in TORCHRUN_ENV}
        env.update(CP_EXT_CPU="1", NPROC_PER_NODE=str(per_node), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=NODE_IFNAME,
                   **extra)
        return env

    def veth(self, node):
        """The root-namespace end of the node's veth pair (on the bridge)."""
        return f"{PREFIX}{self.tag}{node}"

    # --- building ----------------------------------------------------------------------------

    def prepare(self):
        """The bridge with the controller's address, and the hosts file every node mounts."""
        self.hosts_file.write_text("".join(
            ["127.0.0.1 localhost\n", f"{self.controller[1]} {self.controller[0]}\n"]
            + [f"{addr} {node}\n" for node, addr in self.nodes.items()]))
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.controller[1]}/{self.prefixlen}", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")

    def start_nodes(self):
        for node in self.nodes:
            self.start_node(node)

    def start_node(self, node):
        """Build the node's namespaces, network and hosts file and start its slurmd (also: bring back a killed node)."""
        self._forget_node(node)
        holder = subprocess.Popen(
            ["unshare", "--net", "--uts", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL",
             sys.executable, "-I", "-S", "-c", INIT],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent)
        self.holders[node] = holder
        init = self._wait_init(holder)
        self.init_pids[node] = init
        addr = self.nodes[node]
        self._ip("link", "add", self.veth(node), "type", "veth", "peer", "name", NODE_IFNAME, "netns", str(init))
        self._ip("link", "set", self.veth(node), "master", self.bridge, "up")
        setup = (f"hostname {node} && mount --bind {self.hosts_file} /etc/hosts && ip link set lo up"
                 f" && ip addr add {addr}/{self.prefixlen} dev {NODE_IFNAME} && ip link set {NODE_IFNAME} up")
        self.in_node(node, ["sh", "-c", setup], check=True)
        self.start_in_node(node, "slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", node])

    def _wait_init(self, holder, timeout=10):
        children = Path(f"/proc/{holder.pid}/task/{holder.pid}/children")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if holder.poll() is not None:
                raise SlurmClusterError(f"unshare exited {holder.returncode} before its init started")
            pids = children.read_text().split() if children.exists() else []
            if pids:
                return int(pids[0])
            time.sleep(0.01)
        raise SlurmClusterError(f"unshare's init did not start within {timeout} s")

    def _ip(self, *args, check=True):
        return self.run(["ip", *args], check=check)

    # --- inside a node -----------------------------------------------------------------------

    def nsenter(self, node):
        """The command prefix that runs a command inside the node (all its namespaces)."""
        return ["nsenter", "-t", str(self.init_pids[node]), "--net", "--uts", "--mount", "--pid", "--"]

    def in_node(self, node, cmd, check=False, timeout=60, **kwargs):
        """Run ``cmd`` inside the node (its network, hostname, /etc/hosts, /proc); a CompletedProcess."""
        return self.run([*self.nsenter(node), *map(str, cmd)], check=check, timeout=timeout, **kwargs)

    def start_in_node(self, node, name, cmd):
        """Start ``cmd`` inside the node in the background (output: logs/<name>@<node>.out); the Popen
        (of nsenter). It ends with the node (`kill_node`, `stop`)."""
        self._start(f"{name}@{node}", [*self.nsenter(node), *map(str, cmd)])
        return self.procs[f"{name}@{node}"]

    def node_pids(self, node, match=None):
        """Host pids of the node's processes (its PID namespace), the init excepted; with ``match``,
        only those whose command line contains it."""
        init = self.init_pids.get(node)
        try:
            ns = os.readlink(f"/proc/{init}/ns/pid")
        except (OSError, TypeError):
            return []
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == init:
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                    continue
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if match is None or match in cmdline:
                pids.append(int(entry))
        return sorted(pids)

    def link_bytes(self, node):
        """(bytes into the node, bytes out of it) through its veth so far."""
        stats = Path(f"/sys/class/net/{self.veth(node)}/statistics")
        return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())

    # --- fault injection ---------------------------------------------------------------------

    def kill_node(self, node):
        """SIGKILL the node's PID-namespace init: every process on the node dies at once (as at a power
        loss; slurmctld notices after SlurmdTimeout), its network namespace and veth pair go too."""
        init, holder = self.init_pids.pop(node, None), self.holders.get(node)
        if init is not None:
            try:
                os.kill(init, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if holder is not None:
            try:
                holder.wait(timeout=10 if init is not None else 0)
            except subprocess.TimeoutExpired:  # no init known yet: unshare's --kill-child takes it along
                holder.kill()
                holder.wait(timeout=30)
        # The nsenter processes that started slurmd (and `start_in_node`'s): they sit in the node's network
        # namespace themselves (keeping it, and the veth, alive) and stop when their child is SIGSTOPped.
        for name in [name for name in self.procs if name.endswith(f"@{node}")]:
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)

    def link_down(self, node):
        """Cut the node off the bridge (its processes keep running; packets to and from it are lost)."""
        self._ip("link", "set", self.veth(node), "down")

    def link_up(self, node):
        self._ip("link", "set", self.veth(node), "up")

    def slow_link(self, node, rate="1mbit", burst="32kbit", latency="400ms"):
        """Rate-limit traffic into and out of the node (tbf on both ends of its veth pair)."""
        qdisc = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        self._ip_tc(node, qdisc)

    def delay(self, node, ms):
        """Add ``ms`` of latency each way (netem on both ends); SlurmClusterError where the kernel lacks netem."""
        try:
            self._ip_tc(node, ["root", "netem", "delay", f"{ms}ms"])
        except SlurmClusterError as e:
            self.clear_link(node)
            raise SlurmClusterError(f"no netem delay here (a kernel without CONFIG_NET_SCH_NETEM?): {e}") from e

    def clear_link(self, node):
        """Remove what `slow_link` / `delay` put on the node's link."""
        self.run(["tc", "qdisc", "del", "dev", self.veth(node), "root"], check=False)
        self.in_node(node, ["tc", "qdisc", "del", "dev", NODE_IFNAME, "root"])

    def _ip_tc(self, node, qdisc):
        self.run(["tc", "qdisc", "replace", "dev", self.veth(node), *qdisc])
        self.in_node(node, ["tc", "qdisc", "replace", "dev", NODE_IFNAME, *qdisc], check=True)

    def freeze(self, node, match=None):
        """SIGSTOP the node's processes (those whose command line contains ``match``, e.g. "pretrain_moe.py");
        returns the pids stopped, for `thaw`."""
        return self._signal(node, match, signal.SIGSTOP)

    def thaw(self, node, match=None):
        return self._signal(node, match, signal.SIGCONT)

    def _signal(self, node, match, sig):
        pids = self.node_pids(node, match)
        launchers = []  # nsenter stops itself when its child stops, and waits for a SIGCONT
        if sig == signal.SIGCONT:
            launchers = [p.pid for name, p in self.procs.items() if name.endswith(f"@{node}") and p.poll() is None]
        for pid in pids + launchers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def cpu_quota(self, node, fraction):
        """Cap the node (every process on it, and what it starts later) at ``fraction`` of one CPU
        (cgroup v1 CFS quota; None lifts the cap)."""
        group = Path(f"/sys/fs/cgroup/cpu/{PREFIX}{self.tag}{node}")
        if not group.parent.is_dir():
            raise SlurmClusterError("no cgroup-v1 cpu controller at /sys/fs/cgroup/cpu")
        if not group.exists():
            group.mkdir()
            self.cgroups.append(group)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("-1" if fraction is None else str(max(1000, int(fraction * 100000))))
        for pid in [self.init_pids[node], *self.node_pids(node)]:
            try:
                (group / "cgroup.procs").write_text(str(pid))
            except OSError:  # exited meanwhile
                pass

    # --- teardown ----------------------------------------------------------------------------

    def _forget_node(self, node):
        self.kill_node(node)
        self.holders.pop(node, None)
        if Path(f"/sys/class/net/{self.veth(node)}").exists():
            self._ip("link", "del", self.veth(node), check=False)

    def stop_nodes(self):
        """Kill every node (holder init), then remove veths, bridge and cgroups; each step runs even if one fails."""
        errors = []
        for node in list(self.nodes):
            try:
                self._forget_node(node)
            except Exception as e:  # noqa: BLE001 - go on with the rest, report at the end
                errors.append(f"{node}: {e}")
        if Path(f"/sys/class/net/{self.bridge}").exists():
            self._ip("link", "del", self.bridge, check=False)
        for group in self.cgroups:
            for _ in range(50):  # a cgroup goes once its last (killed) process is reaped
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
        self.cgroups = [g for g in self.cgroups if g.exists()]
        if errors:
            raise SlurmClusterError("could not stop: " + "; ".join(errors))

    def leftovers(self):
        """What of this cluster still exists (should be nothing after `stop`)."""
        left = [f"link {name}" for name in os.listdir("/sys/class/net") if name.startswith(f"{PREFIX}{self.tag}")]
        left += [f"process {h.pid}" for h in self.holders.values() if h.poll() is None]
        left += [f"process {p.pid} ({name})" for name, p in self.procs.items() if p.poll() is None]
        left += [f"cgroup {g}" for g in self.cgroups if g.exists()]
        return left
