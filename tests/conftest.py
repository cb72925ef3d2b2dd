import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(args, cwd, timeout=600, check=True, env=None):
    """Run ``python -m lightning_hpc <args>`` in ``cwd``; returns the CompletedProcess (stdout+stderr merged)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_hpc", *args],
        cwd=cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"lightning-hpc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


def run_dirs(cwd: Path, recipe: str) -> list[Path]:
    return sorted((cwd / "outputs" / recipe).iterdir())


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture
def cli(tmp_path):
    def _run(*args, **kwargs):
        return run_cli(list(args), tmp_path, **kwargs)

    _run.cwd = tmp_path
    return _run
