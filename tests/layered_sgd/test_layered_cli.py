"""The digits recipe runs with strategy=layered_sgd through the CLI (2 processes as 2 node groups of 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_digits_recipe_fast_dev_run(tmp_path):
    cmd = [
        sys.executable, "-m", "lightning_hpc", "train", "recipe=digits", "strategy=layered_sgd",
        "strategy.procs_per_node=1",  # 2 groups: exercises the leaders' allreduce on the communicator thread
        "trainer.fast_dev_run=true", f"hydra.run.dir={tmp_path}",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["global_step"] == 1
    assert "val/loss" in summary["metrics"]


def test_bad_topology_fails_before_training(tmp_path):
    """World 6 with procs_per_node=4 is rejected when the Trainer is built, before any process starts."""
    cmd = [
        sys.executable, "-m", "lightning_hpc", "train", "recipe=digits", "strategy=layered_sgd",
        "strategy.procs_per_node=4", "trainer.devices=6", "trainer.fast_dev_run=true", f"hydra.run.dir={tmp_path}",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "world size 6 is not divisible by procs_per_node=4" in proc.stdout + proc.stderr
    assert not (tmp_path / "metrics.json").exists()
    assert "Initializing distributed" not in proc.stdout + proc.stderr
