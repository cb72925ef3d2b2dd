"""Simulated cluster nodes on one Linux machine: network namespaces joined by a veth pair.

Each node is a network namespace with its own address on a private /24 (``10.213.17.0/24`` by default, which
exists only inside the namespaces created here) and its own hostname (every command is started in a fresh UTS
namespace), so launchers see separate machines: torchrun's rendezvous, SLURM's slurmd, and the hostnames the
ranks report all differ per node.  ``/etc/netns/<name>/hosts`` is mounted over ``/etc/hosts``
in the node (done here by a bind mount in a private mount namespace), so the node names resolve on every node.
:meth:`SimNode.shape_egress` limits a node's link rate (``tc tbf``).

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux).  :func:`unavailable_reason` says why not when one
is missing; :class:`SimNodes` cleans up (processes, namespaces, hosts files) on exit, also after a failure, and
its names carry the creating process id so a rerun never collides with a leftover of an earlier one.

    with SimNodes(2) as nodes:
        proc = nodes[0].popen(["hostname"])          # prints node0's hostname
        nodes[1].run(["ping", "-c1", nodes[0].address])
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["INTERFACE", "SimNode", "SimNodes", "unavailable_reason", "remove_stale"]

_PREFIX = "lhpc"
#: the name of every node's network interface (inside its namespace)
INTERFACE = "simnet0"
_NAME_RE = re.compile(rf"^{_PREFIX}(\d+)n(\d+)$")


def _sh(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=timeout)


def unavailable_reason() -> str | None:
    """Why simulated nodes cannot be made here (None when they can): not root, no ``ip``/``unshare``, or the
    kernel refuses network namespaces (e.g. inside an unprivileged container)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "no Linux network namespaces on this machine"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs root (CI runs as root)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y iproute2 util-linux)"
    probe = f"{_PREFIX}{os.getpid()}probe"
    try:
        res = _sh("ip", "netns", "add", probe, check=False)
        if res.returncode != 0:
            return f"cannot create a network namespace: {res.stderr.strip()}"
        res = _sh("ip", "netns", "exec", probe, "unshare", "--uts", "true", check=False)
        if res.returncode != 0:
            return f"cannot create a UTS namespace: {res.stderr.strip()}"
    finally:
        _sh("ip", "netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces (and their hosts files) left by a creator process that no longer runs."""
    removed = []
    res = _sh("ip", "netns", "list", check=False)
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_pids(name)
            _sh("ip", "netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            removed.append(name)
    return removed


def _kill_namespace_pids(name: str) -> None:
    res = _sh("ip", "netns", "pids", name, check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class SimNode:
    """One simulated node: network namespace ``netns``, hostname ``hostname``, IPv4 ``address``."""

    index: int
    netns: str
    hostname: str
    address: str
    veth: str
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _services: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run on this node: in its network namespace, under its own hostname."""
        # nsenter (not `ip netns exec`, which remounts /sys and so hides the cgroup mounts slurmd needs) into
        # the network namespace, then new UTS and mount namespaces for the hostname and the node's /etc/hosts.
        return [
            "nsenter", f"--net=/var/run/netns/{self.netns}",
            "unshare", "--uts", "--mount", "--propagation", "private", "--",
            "sh", "-c", 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
            self.hostname, f"/etc/netns/{self.netns}/hosts", *argv,
        ]

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
              stdout=None, stderr=subprocess.STDOUT, service: bool = False, **kwargs) -> subprocess.Popen:
        """Start ``argv`` on this node in its own process group (so :meth:`kill_jobs` reaches its children).

        ``service=True`` marks a daemon of the node (slurmd): :meth:`fail` and :meth:`kill_jobs` leave it alone.
        """
        proc = subprocess.Popen(
            self.command(argv), env=dict(env) if env is not None else None, cwd=cwd,
            stdout=stdout, stderr=stderr, start_new_session=True, **kwargs,
        )
        (self._services if service else self._procs).append(proc)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        """Every process running in this node's network namespace."""
        return [int(p) for p in _sh("ip", "netns", "pids", self.netns, check=False).stdout.split()]

    def job_pids(self) -> list[int]:
        """The processes of this node that are not services (daemons started with ``service=True``) or their
        descendants (e.g. a job step under slurmd)."""
        services = {p.pid for p in self._services if p.poll() is None}
        out = []
        for pid in self.pids():
            ancestor, seen = pid, 0
            while ancestor > 1 and ancestor not in services and seen < 64:
                ancestor, seen = _ppid(ancestor), seen + 1
            if ancestor not in services:
                out.append(pid)
        return out

    def shape_egress(self, rate_mbit: float | None, queue_ms: int = 500) -> None:
        """Limit what this node sends on its link to ``rate_mbit`` (``tc tbf``; rate only, no delay: the kernels
        this runs on often lack ``netem``); ``None`` removes the limit.  Shaping both nodes shapes both
        directions.  ``queue_ms`` is the tbf queue (its ``latency``): how long a message may wait behind a bulk
        transfer."""
        _sh("ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", self.veth, "root", check=False)
        if rate_mbit is not None:
            burst_kb = max(32, int(rate_mbit * 1e6 / 8 / 100 / 1024))  # >= one 10 ms timer tick of data
            _sh("ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev", self.veth, "root", "tbf",
                "rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", f"{queue_ms}ms")

    def set_link(self, up: bool) -> None:
        _sh("ip", "-n", self.netns, "link", "set", self.veth, "up" if up else "down", check=False)

    def fail(self) -> None:
        """Simulate a node failure for the jobs on it: the link goes down first (peers see silence, as after a
        power loss, not a closed connection), then every job process of the node is killed.  Services keep
        running; :meth:`set_link` brings the link back for later jobs."""
        self.set_link(False)
        self.kill_jobs()
        for pid in self.job_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_jobs(self) -> None:
        _kill_groups(self._procs)
        self._procs = [p for p in self._procs if p.poll() is None]

    def kill_all(self) -> None:
        _kill_groups(self._procs + self._services)
        _kill_namespace_pids(self.netns)
        self._procs, self._services = [], []


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _kill_groups(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class SimNodes:
    """``n`` simulated nodes (2 by default) joined by veth pairs through node 0 (a star; 2 nodes: one pair).

    Node ``i`` has hostname ``{hostname_prefix}{i}`` and address ``{subnet}.{i + 1}``.  Use as a context
    manager; :meth:`close` is idempotent and also runs at interpreter exit if the context was not left.
    """

    def __init__(self, n: int = 2, *, subnet: str = "10.213.17", hostname_prefix: str = "node") -> None:
        if not 2 <= n <= 8:
            raise ValueError(f"n={n}: between 2 and 8 simulated nodes")
        self.n = n
        self.subnet = subnet
        self.tag = f"{_PREFIX}{os.getpid()}"
        self.nodes: list[SimNode] = [
            SimNode(i, f"{self.tag}n{i}", f"{hostname_prefix}{i}", f"{subnet}.{i + 1}", f"lh{os.getpid() % 10**7}v{i}")
            for i in range(n)
        ]
        self._created: list[str] = []

    def __enter__(self) -> SimNodes:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, i: int) -> SimNode:
        return self.nodes[i]

    def __iter__(self):
        return iter(self.nodes)

    def hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{node.address} {node.hostname}" for node in self.nodes]
        return "\n".join(lines) + "\n"

    def create(self) -> None:
        remove_stale()
        hosts = self.hosts_text()
        for node in self.nodes:
            _sh("ip", "netns", "add", node.netns)
            self._created.append(node.netns)
            etc = Path("/etc/netns") / node.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "hostname").write_text(node.hostname + "\n")
            _sh("ip", "-n", node.netns, "link", "set", "lo", "up")
        hub = self.nodes[0]
        if self.n == 2:
            a, b = self.nodes
            _sh("ip", "link", "add", a.veth, "netns", a.netns, "type", "veth", "peer", "name", b.veth, "netns", b.netns)
            for node in (a, b):
                _sh("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.veth)
                _sh("ip", "-n", node.netns, "link", "set", node.veth, "up")
        else:
            # A bridge in node 0's namespace joins one veth pair per node.
            bridge = INTERFACE
            _sh("ip", "-n", hub.netns, "link", "add", bridge, "type", "bridge")
            _sh("ip", "-n", hub.netns, "addr", "add", f"{hub.address}/24", "dev", bridge)
            _sh("ip", "-n", hub.netns, "link", "set", bridge, "up")
            for node in self.nodes[1:]:
                peer = f"{node.veth}p"
                _sh("ip", "link", "add", node.veth, "netns", node.netns, "type", "veth", "peer", "name", peer,
                    "netns", hub.netns)
                _sh("ip", "-n", hub.netns, "link", "set", peer, "master", bridge)
                _sh("ip", "-n", hub.netns, "link", "set", peer, "up")
                _sh("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.veth)
                _sh("ip", "-n", node.netns, "link", "set", node.veth, "up")
            hub.veth = bridge
        # Every node's link gets the same name, as on a cluster whose nodes share an interface name (Horovod's
        # launcher only uses interfaces that every host has under the same name).  Names are per namespace; the
        # creation names above are unique because the pair is made from the root namespace.
        for node in self.nodes:
            if node.veth != INTERFACE:
                for step in (["down"], ["name", INTERFACE], ["up"]):
                    _sh("ip", "-n", node.netns, "link", "set", "dev", node.veth, *step)
                    if step[0] == "name":
                        node.veth = INTERFACE
        # Both ends up and reachable before anyone uses them.
        deadline = time.monotonic() + 10
        while True:
            res = self.nodes[-1].run(["ping", "-c", "1", "-W", "1", hub.address], timeout=5) if shutil.which("ping") \
                else None
            if res is None or res.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)

    def close(self) -> None:
        for node in self.nodes:
            node.kill_all()
        for name in self._created:
            _kill_namespace_pids(name)
            _sh("ip", "netns", "del", name, check=False)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        self._created = []
