"""``Trainer.fit`` with the ``lightning_hpc.KFAC`` callback on CNNs as users write them (``user_modules_run.py``): a
3-D U-Net (Conv3d, BatchNorm3d, GroupNorm, ConvTranspose3d), a MobileNet-style depthwise-separable CNN with
BatchNorm, a Conv1d signal net with InstanceNorm1d, an Embedding + LayerNorm text model. Under ``ddp`` on 2
processes the parameters equal one process running the ranks' shards as accumulated micro-batches (float64,
1e-9), and K-FAC registered the normalisation layers, the embedding, the grouped and transposed convolutions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASES = ("unet3d", "mobilenet", "signal", "text")
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")

#: what K-FAC must register in each case, (module name, type); every other trainable module is listed too
REGISTERED = {
    "unet3d": [("enc.0", "Conv3d"), ("enc.1", "BatchNorm3d"), ("down.0", "Conv3d"), ("down.1", "BatchNorm3d"),
               ("up", "ConvTranspose3d"), ("dec.0", "Conv3d"), ("dec.1", "GroupNorm"), ("head", "Conv3d")],
    "mobilenet": [("features.0", "Conv2d"), ("features.1", "BatchNorm2d"), ("features.3.0", "Conv2d"),
                  ("features.3.1", "BatchNorm2d"), ("features.3.3", "Conv2d"), ("features.3.4", "BatchNorm2d"),
                  ("features.4.0", "Conv2d"), ("features.4.1", "BatchNorm2d"), ("features.4.3", "Conv2d"),
                  ("features.4.4", "BatchNorm2d"), ("classifier", "Linear")],
    "signal": [("body.0", "Conv1d"), ("body.1", "InstanceNorm1d"), ("body.3", "Conv1d"), ("body.7", "Linear")],
    "text": [("embed", "Embedding"), ("norm", "LayerNorm"), ("mlp.0", "Linear"), ("mlp.2", "Linear"),
             ("out", "Linear")],
}


def _launch(devices: int, outdir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(HERE / "user_modules_run.py"), str(devices), str(outdir), *CASES]
    outdir.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, env=env, cwd=outdir.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("user_modules")
    out = {d: root / f"devices{d}" for d in (1, 2)}
    # the one-process and the two-process runs at once: each rank holds one thread, and most of a run is the
    # interpreter importing Lightning, which the other run overlaps
    procs = {d: _launch(d, path) for d, path in out.items()}
    try:
        for d, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"devices={d}:\n" + stdout[-3000:] + stderr[-6000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


@pytest.mark.parametrize("case", CASES)
def test_two_processes_equal_one_and_the_new_layers_are_preconditioned(case, runs):
    one = torch.load(runs[1] / f"{case}.pt", weights_only=False)
    two = torch.load(runs[2] / f"{case}.pt", weights_only=False)
    assert one["registered"] == two["registered"] == REGISTERED[case]
    assert one["steps"] == two["steps"] == 4
    # every registered layer (each group of a grouped convolution) has factors and decompositions
    for run in (one, two):
        assert sorted(run["factored"]) == sorted(run["decomposed"]) == sorted(run["handlers"])
    assert one["params"].keys() == two["params"].keys()
    for name, want in one["params"].items():
        torch.testing.assert_close(two["params"][name], want, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
