"""The Lightning adapter: registration, per-cycle residual logging, the digits_odenet recipe."""

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_hpc
from lightning_hpc import ImageClassifier, MultigridStrategy
from lightning_hpc.data import DigitsDataModule
from lightning_hpc.models import ode_resnet
from tests.fit_harness import fit

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
    common = dict(max_steps=2, limit_val_batches=0)
    pl.seed_everything(0)
    run = fit(module, datamodule=DigitsDataModule(batch_size=16), strategy=strategy, **common)
    assert type(module.model.steps) is torch.nn.Sequential  # handed back: the user's trunk (the residuals below
    # were logged by the MultigridODEBlock that replaced it during training)
    metrics = run.metrics
    assert {f"multigrid/forward_residual_{i}" for i in range(4)} <= set(metrics)
    assert "multigrid/backward_residual_0" in metrics
    assert float(metrics["multigrid/forward_residual_3"]) < float(metrics["multigrid/forward_residual_0"])
    # two optimizer steps with an exact solve = two serial steps
    pl.seed_everything(0)
    fit(serial, datamodule=DigitsDataModule(batch_size=16), strategy=MultigridStrategy(mode="serial"),
        **common)  # same sampler, no multigrid
    for (name, a), (_, b) in zip(serial.model.named_parameters(), module.model.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name


def test_digits_odenet_recipe_fast_dev_run(cli_in_process):
    proc = cli_in_process("train", "recipe=digits_odenet", "trainer.fast_dev_run=true",
                          f"hydra.run.dir={cli_in_process.cwd}")
    assert "multigrid/forward_residual_1" in proc.stdout


def test_two_layer_ranks_hold_half_and_checkpoint_loads_anywhere(tmp_path):
    """2 layer-parallel ranks through the Trainer: each rank's optimizer sees half of the residual steps; the
    checkpoint holds the full model (= one process's, loads into the plain model) and resumes on 2 ranks and
    on 1 (the optimizer state is full, in the serial layout: test_checkpoint_reshard.py checks it exactly)."""
    from mg_lightning_workers import NUM_STEPS, STEPS, train_and_save

    from lightning_hpc.distributed import run_in_processes

    two, one = str(tmp_path / "two.ckpt"), str(tmp_path / "one.ckpt")
    runs = run_in_processes(train_and_save, 2, STEPS, two, timeout_s=400, collective_timeout_s=200)
    train_and_save(0, 1, STEPS, one)
    n_trunk = sum(p.numel() for p in ode_resnet(num_steps=NUM_STEPS, width=4).steps.parameters())
    n_all = sum(p.numel() for p in ode_resnet(num_steps=NUM_STEPS, width=4).parameters())
    for r in runs:
        assert r["trunk_numel"] == n_trunk // 2
        assert r["optimizer_numel"] == r["momentum_numel"] == n_all - n_trunk // 2
    ck_two, ck_one = torch.load(two, weights_only=False), torch.load(one, weights_only=False)
    assert list(ck_two["state_dict"]) == list(ck_one["state_dict"])
    for key, value in ck_one["state_dict"].items():
        assert torch.allclose(ck_two["state_dict"][key], value, rtol=1e-5, atol=1e-6), key
    plain = ImageClassifier(ode_resnet(num_steps=NUM_STEPS, width=4))
    plain.load_state_dict(ck_two["state_dict"], strict=True)  # the plain serial model
    # resume on 2 ranks for one more step = one process resuming its own checkpoint
    again_two, again_one = str(tmp_path / "two_b.ckpt"), str(tmp_path / "one_b.ckpt")
    run_in_processes(train_and_save, 2, STEPS + 1, again_two, two, timeout_s=400, collective_timeout_s=200)
    train_and_save(0, 1, STEPS + 1, again_one, one)
    a, b = (
        torch.load(again_two, weights_only=False)["state_dict"],
        torch.load(again_one, weights_only=False)["state_dict"],
    )
    for key, value in b.items():
        assert torch.allclose(a[key], value, rtol=1e-5, atol=1e-6), key
    assert not torch.allclose(
        a["model.steps.15.branch.0.weight"], ck_two["state_dict"]["model.steps.15.branch.0.weight"]
    )
    # the 2-rank checkpoint resumed on 1 process = one process resuming its own checkpoint
    train_and_save(0, 1, STEPS + 1, str(tmp_path / "x.ckpt"), two)
    c = torch.load(str(tmp_path / "x.ckpt"), weights_only=False)["state_dict"]
    for key, value in b.items():
        assert torch.allclose(c[key], value, rtol=1e-5, atol=1e-6), key
