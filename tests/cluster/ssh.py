"""Passwordless ssh between the simulated nodes, as ``horovodrun`` needs it to start remote ranks.

Each node runs its own ``sshd`` (in its network namespace, on :data:`PORT`) that accepts one key made for the test;
:attr:`SshOnNodes.bin_dir` holds an ``ssh`` that uses that key and skips host-key checks (what a cluster's
``~/.ssh/config`` does), to be put first on ``PATH`` of the launcher; it logs every call to :attr:`calls`. Nothing
outside a temporary folder is read or written (no ``~/.ssh``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

PORT = 2222
SSHD = "/usr/sbin/sshd"


def unavailable_reason() -> str | None:
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y openssh-client)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not found (apt-get install -y openssh-server)"
    return None


class SshOnNodes:
    def __init__(self, nodes, workdir: Path) -> None:
        self.nodes, self.dir = nodes, workdir
        self.bin_dir = workdir / "bin"
        self.calls = workdir / "ssh_calls.log"

    def __enter__(self) -> SshOnNodes:
        d = self.dir
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        for key in ("client_key", "host_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
        shutil.copy(d / "client_key.pub", d / "authorized_keys")
        (d / "sshd_config").write_text(
            f"Port {PORT}\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPidFile none\n"
        )
        (d / "ssh_config").write_text(
            f"Host *\n  Port {PORT}\n  IdentityFile {d}/client_key\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
        )
        self.bin_dir.mkdir(exist_ok=True)
        wrapper = self.bin_dir / "ssh"
        # the wrapper also records each call, so a test can tell which commands ran on which node
        wrapper.write_text(f'#!/bin/sh\necho "$*" >> {self.calls}\nexec {shutil.which("ssh")} -F {d}/ssh_config "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for node in self.nodes:
            node.popen(
                [SSHD, "-D", "-e", "-f", str(d / "sshd_config")],
                stdout=open(d / f"sshd.{node.hostname}.log", "w"),
                service=True,
            )
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while True:
                res = self.nodes[0].run([str(self.bin_dir / "ssh"), node.hostname, "true"], timeout=10)
                if res.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ssh to {node.hostname} failed: {res.stderr.strip()}")
                time.sleep(0.3)

    def __exit__(self, *exc) -> None:
        pass  # the sshd processes are services of the nodes: SimNodes stops them with the nodes
