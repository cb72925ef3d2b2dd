"""A local SLURM cluster on simulated nodes: munged, slurmctld on node 0, one slurmd per node.

Everything lives in a private work folder (configuration, state, spool, logs, the munge key and socket), the
daemons run in the foreground as children of this process and are stopped at :meth:`LocalSlurm.close` (also
after a failure), so nothing of the machine's own SLURM or munge setup (if any) is used or changed.  Commands
(``srun``, ``sbatch``, ``squeue``) run on node 0 with ``SLURM_CONF`` pointing at the private configuration.

Needs Debian's ``slurm-wlm`` and ``munge`` packages (``slurmctld``, ``slurmd``, ``srun``, ``sbatch``,
``munged``); :func:`unavailable_reason` names what is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_hpc.testing.simulated_nodes import SimNodes

__all__ = ["LocalSlurm", "unavailable_reason"]

_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "squeue", "scontrol", "munged")


def unavailable_reason() -> str | None:
    missing = [t for t in _TOOLS if shutil.which(t) is None and not Path("/usr/sbin", t).exists()]
    if missing:
        return f"{', '.join(missing)} not found (apt-get install -y slurm-wlm munge)"
    return None


def _which(tool: str) -> str:
    return shutil.which(tool) or str(Path("/usr/sbin", tool))


class LocalSlurm:
    """SLURM 22.05+ on ``nodes``: partition ``debug`` with every node, ``cpus`` CPUs declared per node."""

    def __init__(self, nodes: SimNodes, workdir: str | os.PathLike, *, cpus: int = 4, port: int = 6817,
                 env: Mapping[str, str] | None = None) -> None:
        self.nodes = nodes
        self.dir = Path(workdir).resolve()
        self.cpus = cpus
        self.port = port
        self.env = dict(env if env is not None else os.environ)
        self._daemons: list[subprocess.Popen] = []
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("state", "munge", "log", *(f"spool-{n.hostname}" for n in self.nodes)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "munge").chmod(0o700)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        head = self.nodes[0]
        lines = [
            "ClusterName=lhpc",
            f"SlurmctldHost={head.hostname}({head.address})",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={self.port}",
            f"SlurmdPort={self.port + 1}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool-%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",
            "SlurmdTimeout=30",
            "SlurmctldTimeout=30",
            "MessageTimeout=20",
            "PropagateResourceLimits=NONE",
            "MailProg=/bin/true",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node.hostname} NodeAddr={node.address} CPUs={self.cpus} State=UNKNOWN")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES")
        self.conf.write_text("\n".join(lines) + "\n")

    def slurm_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(self.env)
        env["SLURM_CONF"] = str(self.conf)
        # Variables of an enclosing allocation (a CI job inside SLURM) must not leak into this cluster's jobs.
        for key in list(env):
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and key != "SLURM_CONF":
                del env[key]
        env.update(extra or {})
        return env

    def start(self, timeout: float = 60) -> None:
        self._write_config()
        d = self.dir
        munged = subprocess.Popen(
            [_which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
             f"--key-file={d / 'munge' / 'munge.key'}", f"--pid-file={d / 'munge' / 'munged.pid'}",
             f"--log-file={d / 'log' / 'munged.log'}", f"--seed-file={d / 'munge' / 'seed'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._daemons.append(munged)
        self._wait_for(lambda: self.munge_socket.exists(), "munged", munged, 15)
        env = self.slurm_env()
        head = self.nodes[0]
        self._daemons.append(head.popen([_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=env,
                                        stdout=open(d / "log" / "slurmctld.out", "ab"), service=True))
        for node in self.nodes:
            self._daemons.append(node.popen([_which("slurmd"), "-D", "-N", node.hostname, "-f", str(self.conf)],
                                            env=env, stdout=open(d / "log" / f"slurmd-{node.hostname}.out", "ab"),
                                            service=True))
        self._wait_for(self._nodes_idle, "the nodes to become idle", None, timeout)

    def _nodes_idle(self) -> bool:
        res = self.nodes[0].run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.slurm_env(), timeout=15)
        states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
        return len(states) == len(self.nodes.nodes) and all(s == "idle" for s in states.values())

    def _wait_for(self, cond, what: str, proc: subprocess.Popen | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            for p in [proc] if proc else self._daemons:
                if p.poll() is not None:
                    raise RuntimeError(f"local SLURM: a daemon exited (rc {p.returncode}) while waiting for {what}; "
                                       f"logs:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"local SLURM: timed out after {timeout:.0f}s waiting for {what}; logs:\n{self.logs()}"
                )
            time.sleep(0.5)

    def logs(self, tail: int = 40) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"== {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def close(self) -> None:
        # Jobs first (their steps run under slurmd), then the daemons, munged last.
        if self._daemons and self.conf.exists():
            try:
                self.nodes[0].run(["scancel", "--full", "--user=root"], env=self.slurm_env(), timeout=15)
            except Exception:
                pass
        for p in reversed(self._daemons):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 15)
                except ProcessLookupError:
                    pass
        for p in reversed(self._daemons):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        self._daemons = []

    # ------------------------------------------------------------------ commands on node 0
    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs) -> subprocess.Popen:
        return self.nodes[0].popen(argv, env=self.slurm_env(env), **kwargs)

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 60,
            **kwargs) -> subprocess.CompletedProcess:
        return self.nodes[0].run(argv, env=self.slurm_env(env), timeout=timeout, **kwargs)

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Wait until job ``job_id`` left the queue; returns its final state (scontrol), e.g. COMPLETED."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            res = self.run(["scontrol", "show", "job", "-o", job_id], timeout=15)
            for tok in res.stdout.split():
                if tok.startswith("JobState="):
                    state = tok.split("=", 1)[1]
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN"):
                return state
            time.sleep(1)
        raise TimeoutError(f"SLURM job {job_id} still {state} after {timeout:.0f}s")
