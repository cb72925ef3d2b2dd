"""Launching conformance cases (imported by the tests and conftest.py as ``launch``).

One launch runs many cases in sequence in one process group (``run_case.py``): all cells of one strategy on 2
processes, all one-process references of one kind.  Results are read back per case.
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


def read(outdir: Path, strategy: str, case: str, log: str, world: int) -> CaseResult:
    path = outdir / strategy / case
    ranks = []
    for r in range(world):
        f = path / f"result_rank{r}.json"
        if not f.exists():
            raise AssertionError(f"{strategy}:{case} left no result for rank {r} (the launch ended before it):\n{log}")
        ranks.append(json.loads(f.read_text()))
    return CaseResult(path, ranks, log)
