"""The chaos cluster's network and CPU: each node in a network namespace of its own, joined to
the harness by a bridge, so the nemesis can take a node's link down, drop a share of its packets
in one direction, or starve it of CPU (scripts/cluster/run.py).

    bridge kvc<K> 10.213.<K>.1/24  (etcd and the prefills' proxies listen here)
      veth kvc<K>n<I>  <->  eth0 10.213.<K>.<10+I>/24 in netns kvc<K>-n<I>  (node I)

Needs root, iproute2, iptables (its legacy backend: the statistic match drops packets at random;
the kernel here has no sch_netem) and the cgroup `cpu` controller (v1 cpu.cfs_quota_us or v2
cpu.max). `Net.unavailable()` says why a machine cannot, in one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def iptables() -> Optional[str]:
    return shutil.which("iptables-legacy") or shutil.which("iptables")


def cgroup_cpu_root() -> Optional[str]:
    """Where a child cgroup with a CPU quota can be made, or None."""
    v1 = "/sys/fs/cgroup/cpu"
    if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
        return v1
    v2 = "/sys/fs/cgroup"
    try:
        with open(os.path.join(v2, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                return v2
    except OSError:
        pass
    return None


class Net:
    def __init__(self, nodes: int) -> None:
        self.k = os.getpid() % 200 + 20
        self.bridge = f"kvc{self.k}"
        self.gateway = f"10.213.{self.k}.1"
        self.nodes = nodes
        self.ipt = iptables()
        self.cg_root = cgroup_cpu_root()
        self.cg: Optional[str] = None
        self.made: List[str] = []

    @staticmethod
    def unavailable() -> Optional[str]:
        if os.geteuid() != 0:
            return "not root (network namespaces and a bridge need root)"
        for tool in ("ip",):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (iproute2)"
        if iptables() is None:
            return "iptables is not installed (apt-get install iptables)"
        if cgroup_cpu_root() is None:
            return "no cgroup cpu controller to starve a node with"
        return None

    def ns(self, i: int) -> str:
        return f"kvc{self.k}-n{i}"

    def host_veth(self, i: int) -> str:
        return f"kvc{self.k}n{i}"

    def address(self, i: int) -> str:
        return f"10.213.{self.k}.{10 + i}"

    def up(self) -> None:
        self.down(quiet=True)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.nodes):
            ns, veth = self.ns(i), self.host_veth(i)
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", veth, "master", self.bridge, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if self.cg_root is not None:
            self.cg = os.path.join(self.cg_root, f"kvwire-cluster-{os.getpid()}")
            os.makedirs(self.cg, exist_ok=True)
            if not self.cg_root.endswith("/cpu"):  # v2: the controller is enabled per level
                for level in (self.cg_root, self.cg):
                    try:
                        write(os.path.join(level, "cgroup.subtree_control"), "+cpu")
                    except OSError:
                        pass

    def down(self, quiet: bool = False) -> None:
        for i in range(self.nodes):
            sh("ip", "netns", "del", self.ns(i), check=False)
            sh("ip", "link", "del", self.host_veth(i), check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        if self.cg is not None:
            for d in sorted(os.listdir(self.cg)) if os.path.isdir(self.cg) else []:
                p = os.path.join(self.cg, d)
                if os.path.isdir(p):
                    try:
                        os.rmdir(p)
                    except OSError:
                        pass
            try:
                os.rmdir(self.cg)
            except OSError:
                pass

    def wrap(self, i: int, argv: List[str]) -> List[str]:
        """Run argv in node i's namespace (`ip netns exec` execs it: the pid is the node's)."""
        return ["ip", "netns", "exec", self.ns(i)] + argv

    # -- faults --------------------------------------------------------------------------
    def link(self, i: int, up: bool) -> None:
        sh("ip", "link", "set", self.host_veth(i), "up" if up else "down")

    def loss(self, i: int, direction: str, share: Optional[float]) -> None:
        """Drop `share` of node i's packets going `direction` ("out" or "in"); None heals."""
        assert self.ipt is not None
        chain = "OUTPUT" if direction == "out" else "INPUT"
        base = ["ip", "netns", "exec", self.ns(i), self.ipt]
        if share is None:
            sh(*base, "-F", "OUTPUT", check=False)
            sh(*base, "-F", "INPUT", check=False)
            return
        # Not lo: a node's own loopback (none used) stays whole; eth0 is its link.
        sh(*base, "-A", chain, "-o" if chain == "OUTPUT" else "-i", "eth0",
           "-m", "statistic", "--mode", "random", "--probability", f"{share:.2f}", "-j", "DROP")

    def starve(self, i: int, pid: int, share: Optional[float]) -> None:
        """Cap node i (process pid, all its threads) at `share` of one CPU; None lifts the cap."""
        assert self.cg is not None and self.cg_root is not None
        d = os.path.join(self.cg, f"n{i}")
        os.makedirs(d, exist_ok=True)
        v1 = self.cg_root.endswith("/cpu")
        if share is None:
            if v1:
                write(os.path.join(d, "cpu.cfs_quota_us"), "-1")
            else:
                write(os.path.join(d, "cpu.max"), "max 100000")
            return
        quota = max(1000, int(100000 * share))
        if v1:
            write(os.path.join(d, "cpu.cfs_period_us"), "100000")
            write(os.path.join(d, "cpu.cfs_quota_us"), str(quota))
        else:
            write(os.path.join(d, "cpu.max"), f"{quota} 100000")
        write(os.path.join(d, "cgroup.procs"), str(pid))


def write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
