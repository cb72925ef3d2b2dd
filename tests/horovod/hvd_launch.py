"""Helpers for the Horovod tests (imported by the test modules as ``hvd_launch``).

Scripts are launched with ``horovodrun -np N --gloo`` as subprocesses.  The default tier's cases share two launches
(:data:`TWO_RANKS`, :data:`FOUR_RANKS`: the ``two_ranks`` and ``four_ranks`` fixtures of conftest.py).

Tests that need Horovod use ``requires_horovod``; without Horovod they are skipped with a reason that says how
to install it (scripts/install-horovod.sh), so the README test command reports them as skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

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


#: the strategy against DDP (test_horovod_strategy.py): 2 epochs x 5 batches per rank, accumulate_grad_batches=2
DIGITS_EPOCHS, DIGITS_BATCHES, DIGITS_ACCUMULATE = 2, 5, 2
DIGITS_ARGS = ["--batches", str(DIGITS_BATCHES), "--epochs", str(DIGITS_EPOCHS), "--accumulate", str(DIGITS_ACCUMULATE)]
# non-default fusion buffer, cycle time and grouped allreduce: same sums, so still equal to DDP
HVD_OPTIONS = '{"fusion_threshold_mb": 1, "cycle_time_ms": 2, "num_groups": 2}'
KFAC_DIGITS_ARGS = ["--kfac", "--batches", "4", "--epochs", "1", "--accumulate", "1"]

#: [folder, case, args] in launch order.  The first fit of each launch is the one whose torch threads are checked
#: (Lightning sets them once per process): the 2-process launch runs without OMP_NUM_THREADS, so the strategy
#: must give each rank its share of the CPUs; the 4-process one with a value the user chose, which must be kept.
TWO_RANKS = [
    ["digits_vs_ddp", "train_digits", ["--strategy", "horovod", "--hvd-options", HVD_OPTIONS, *DIGITS_ARGS]],
    ["launch_checks", "launch_checks", []],
    ["kfac_callback", "train_digits", ["--strategy", "horovod", *KFAC_DIGITS_ARGS]],
    ["kfac_case", "kfac_case", []],
    ["digits_recipe", "cli_train", ["recipe=digits", "strategy=horovod", "trainer.fast_dev_run=true"]],
]
FOUR_RANKS = [
    ["threads_user", "threads", []],
    ["collectives", "collectives", []],
    ["layered_case", "layered_case", []],
    ["layered_trainer", "layered_trainer", []],
]


def user_threads() -> int:
    """An OMP_NUM_THREADS for the 4-process launch that is not the share the strategy would pick (so keeping it
    is told apart from setting the share)."""
    from lightning.fabric.utilities.distributed import _num_cpus_available

    return max(1, _num_cpus_available() // 4) + 1


class SharedLaunch:
    """One ``horovodrun -np N`` of workers/run_cases.py, started at once, waited for when a result is first read."""

    def __init__(self, processes: int, out: Path, spec: list, env: dict[str, str], timeout_s: float) -> None:
        self.processes, self.out, self.timeout_s = processes, out, timeout_s
        script = str(WORKERS / "run_cases.py")
        cmd = [*horovodrun_command(processes), sys.executable, script, str(out), json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.output: str | None = None

    def finish(self) -> str:
        """The launch's whole output (ranks' lines prefixed ``[rank]<stdout>:`` by horovodrun), once it ended."""
        if self.output is None:
            try:
                self.output, _ = self.proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                out, _ = self.proc.communicate()
                self.output = f"{out}\ntimed out after {self.timeout_s:.0f}s"
        return self.output

    def case_dir(self, folder: str) -> Path:
        """The folder the case wrote; fails with the launch's output when the launch did not end cleanly."""
        out = self.finish()
        if self.proc.returncode != 0:
            pytest.fail(f"horovodrun -np {self.processes} run_cases.py exited with {self.proc.returncode} "
                        f"(reading {folder}):\n{out[-12000:]}")
        return self.out / folder

    def ranks(self, folder: str) -> list[dict]:
        """Every rank's ``rank{r}.pt`` of the case run in ``folder``."""
        files = [self.case_dir(folder) / f"rank{r}.pt" for r in range(self.processes)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            pytest.fail(f"{folder}: no {missing}:\n{self.finish()[-12000:]}")
        return [torch.load(f, weights_only=False) for f in files]

    def omp_at_start(self, folder: str) -> list[str | None]:
        """OMP_NUM_THREADS as each rank found it when the case started."""
        return [json.loads((self.case_dir(folder) / f"omp_at_start_rank{r}.json").read_text())
                for r in range(self.processes)]
