"""Helpers for the Horovod tests (imported by the test modules as ``hvd_launch``).

Scripts are launched with ``horovodrun -np N --gloo`` as subprocesses.

Tests that need Horovod use ``requires_horovod``; without Horovod they are skipped with a reason that says how
to install it (scripts/install-horovod.sh), so the README test command reports them as skipped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from lightning_hpc.horovod.communicator import horovod_available

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"

requires_horovod = pytest.mark.skipif(
    not horovod_available(),
    reason="Horovod is not importable with this torch: build it with scripts/install-horovod.sh (see docs/horovod.md)",
)


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(
        OMP_NUM_THREADS="1",
        # a rank that never joins a collective ends the job instead of hanging it
        HOROVOD_STALL_CHECK_TIME_SECONDS="60",
        HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="120",
        PYTHONWARNINGS="ignore",
    )
    return env


def horovodrun_command(np: int) -> list[str]:
    exe = Path(sysconfig.get_path("scripts")) / "horovodrun"
    launcher = [str(exe)] if exe.exists() else [
        sys.executable, "-c", "from horovod.runner.launch import run_commandline; run_commandline()",
    ]
    return [*launcher, "-np", str(np), "--gloo", "--start-timeout", "120"]


def run_checked(cmd: list[str], timeout_s: float, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; kill the whole session on timeout; fail with the output on error."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout_s:.0f}s: {' '.join(cmd)}\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(cmd)}\n{out[-8000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout_s:.0f}s: {' '.join(proc.args)}\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"exit code {proc.returncode}: {' '.join(proc.args)}\n{out[-8000:]}")
    return out
