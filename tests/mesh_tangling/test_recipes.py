import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fast_dev_run(recipe, tmp_path, devices, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "lightning_hpc", "train", f"recipe={recipe}", "trainer.fast_dev_run=true",
        "input_shape=[18,128,128]", "data.train_samples=2", "data.val_samples=1", "trainer.accelerator=cpu",
        f"trainer.devices={devices}", f"hydra.run.dir={tmp_path}", *extra,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "val/iou" in proc.stdout and "train/loss" in proc.stdout
    return proc.stdout + proc.stderr


def test_mesh_tangling_1k_fast_dev_run_ddp(tmp_path):
    _fast_dev_run("mesh_tangling_1k", tmp_path, devices=2)


@pytest.mark.slow
def test_mesh_tangling_2k_fast_dev_run_ddp(tmp_path):
    _fast_dev_run("mesh_tangling_2k", tmp_path, devices=2)


def test_mesh_tangling_1k_fast_dev_run_spatial_tiles(tmp_path):
    """The recipe under the spatial strategy: each of 2 ranks reads and computes one half (W split) of the sample."""
    out = _fast_dev_run("mesh_tangling_1k", tmp_path, 2, "strategy=spatial", "strategy.spatial_parts=[1,2]")
    assert "MEMBER: 2/2" in out
