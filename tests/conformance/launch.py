"""Launching conformance cases (imported by the tests and conftest.py as ``launch``).

One launch runs many cases in sequence in one process group (``run_case.py``): all cells of one strategy on 2
processes, all one-process references of one kind.  Results are read back per case.  :func:`launch` starts
``run_case.py`` as a script (Lightning, or ``horovodrun``, starts the other ranks); :func:`launch_forked` forks
the ranks from the test-suite's forkserver, which has Lightning imported already (seconds saved per launch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "run_case.py"
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")


def horovod_importable() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except Exception:  # ImportError, or a build that does not match this torch
        return False
    return True


@dataclass
class CaseResult:
    """What one case left on disk."""

    path: Path
    ranks: list[dict]
    log: str

    @property
    def error(self) -> str | None:
        errors = [r["error"] for r in self.ranks if "error" in r]
        return errors[0] if errors else None

    def params(self) -> dict[str, torch.Tensor]:
        state = torch.load(self.path / "final.ckpt", map_location="cpu", weights_only=False)["state_dict"]
        return {k: v for k, v in state.items() if v.is_floating_point()}


def launch(devices: int, outdir: Path, items: list[str], data_parallel: int = 2, horovod: bool = False,
           env_extra: dict[str, str] | None = None, timeout: float = 900, log_name: str = "launch.log",
           processes: int = 2) -> str:
    """Run ``items`` (``strategy:case``) in one process group; returns the combined output."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env_extra or {}))
    outdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(SCRIPT), str(devices), str(outdir), str(data_parallel), *items]
    if horovod:
        sys.path.insert(0, str(REPO / "tests" / "horovod"))
        from hvd_launch import horovodrun_command

        cmd = [*horovodrun_command(processes), *cmd]
        env.update(HOROVOD_STALL_CHECK_TIME_SECONDS="60", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="120")
    proc = subprocess.run(cmd, cwd=outdir, env=env, capture_output=True, text=True, timeout=timeout)
    log = f"exit code {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-8000:]}"
    (outdir / log_name).write_text(log)
    return log


def launch_forked(devices: int, outdir: Path, items: list[str], data_parallel: int = 2,
                  env_extra: dict[str, str] | None = None, timeout: float = 900, log_name: str = "launch.log") -> str:
    """:func:`launch` on ranks forked by ``run_in_processes`` (CPU, torch.distributed): the same cases in one
    process group, which the ranks join before the first ``Trainer`` (Lightning takes it as launched externally);
    each rank's output goes to ``<log_name>.rank<r>``.  Returns the combined output."""
    from lightning_hpc.distributed import DistributedRunError, run_in_processes

    outdir.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    status = "exit code 0"
    try:
        run_in_processes(_run_items, devices, str(outdir), data_parallel, items, log_name, timeout_s=timeout,
                         collective_timeout_s=300, env=env)
    except DistributedRunError as e:
        status = f"exit code 1\n{e}"
    logs = [f"--- rank {r}\n{(outdir / f'{log_name}.rank{r}').read_text()[-6000:]}"
            for r in range(devices) if (outdir / f"{log_name}.rank{r}").exists()]
    log = "\n".join([status, *logs])
    (outdir / log_name).write_text(log)
    return log


def _run_items(rank: int, world: int, outdir: str, data_parallel: int, items: list[str], log_name: str) -> None:
    """One rank of :func:`launch_forked`: ``run_case.main`` with ``OUTDIR`` its working directory, as the script."""
    import warnings

    import torch.distributed as dist

    with open(Path(outdir) / f"{log_name}.rank{rank}", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "HOROVOD_"))]:
        del os.environ[key]
    if world == 1:  # one process: nothing distributed, as the script alone
        dist.destroy_process_group()
        for key in LAUNCH_VARS:
            os.environ.pop(key, None)
    warnings.simplefilter("ignore")
    os.chdir(outdir)
    sys.path.insert(0, str(HERE))
    import run_case

    run_case.main(world, outdir, data_parallel, items)
    sys.stdout.flush()
    sys.stderr.flush()


def read(outdir: Path, strategy: str, case: str, log: str, world: int) -> CaseResult:
    path = outdir / strategy / case
    ranks = []
    for r in range(world):
        f = path / f"result_rank{r}.json"
        if not f.exists():
            raise AssertionError(f"{strategy}:{case} left no result for rank {r} (the launch ended before it):\n{log}")
        ranks.append(json.loads(f.read_text()))
    return CaseResult(path, ranks, log)
