"""The Lightning adapter: registration, per-cycle residual logging, the digits_odenet recipe."""

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hpc
from lightning_hpc import ImageClassifier, MultigridStrategy
from lightning_hpc.data import DigitsDataModule
from lightning_hpc.models import ode_resnet
from lightning_hpc.strategies.multigrid import MultigridODEBlock

ROOT = Path(__file__).resolve().parents[2]


def test_registered_and_exported():
    assert "multigrid" in StrategyRegistry
    assert lightning_hpc.MultigridStrategy is MultigridStrategy


def test_fit_logs_residuals_and_matches_serial_step():
    torch.manual_seed(0)
    net = ode_resnet(num_steps=16, width=4)
    serial = ImageClassifier(__import__("copy").deepcopy(net))
    module = ImageClassifier(net)
    strategy = MultigridStrategy(cfactor=4, levels=2, forward_cycles=4, backward_cycles=4)  # 4 = N/c: exact
    common = dict(accelerator="cpu", devices=1, max_steps=2, limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer = pl.Trainer(strategy=strategy, **common)
    pl.seed_everything(0)
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=16))
    assert isinstance(module.model.steps, MultigridODEBlock)
    metrics = trainer.callback_metrics
    assert {f"multigrid/forward_residual_{i}" for i in range(4)} <= set(metrics)
    assert "multigrid/backward_residual_0" in metrics
    assert float(metrics["multigrid/forward_residual_3"]) < float(metrics["multigrid/forward_residual_0"])
    # two optimizer steps with an exact solve = two serial steps
    trainer_serial = pl.Trainer(strategy=MultigridStrategy(mode="serial"), **common)  # same sampler, no multigrid
    pl.seed_everything(0)
    trainer_serial.fit(serial, datamodule=DigitsDataModule(batch_size=16))
    for (name, a), (_, b) in zip(serial.model.named_parameters(), module.model.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


def test_digits_odenet_recipe_fast_dev_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_hpc", "train", "recipe=digits_odenet", "trainer.fast_dev_run=true", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "multigrid/forward_residual_1" in proc.stdout
