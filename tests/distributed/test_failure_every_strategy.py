"""A failure on one rank ends every rank promptly with the failing rank's message under layered_sgd, hybrid_fc and
multigrid (the spatial strategy's own test is in tests/spatial/lightning/test_split_equals_one_process.py): one rank
fails before its second step while its peer enters the step's collectives; the peer must not wait for the collective
timeout (set longer than the run's deadline), and it ends with the failing rank's message, also when the failing
rank is rank 0 (which hosts the store the message travels through). The ranks are fresh interpreters, as torchrun
and Lightning start them."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc import HybridParallelStrategy, ImageClassifier, LayeredSGDStrategy, MultigridStrategy
from lightning_hpc.distributed import run_in_processes
from lightning_hpc.models import ode_resnet
from tests.fit_harness import fit


def _model(name: str) -> nn.Module:
    if name == "multigrid":
        return ode_resnet(in_channels=3, width=4, num_steps=4, num_classes=10, input_size=(8, 8))
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(1),
                         nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _strategy(name: str):
    if name == "layered_sgd":
        return LayeredSGDStrategy(procs_per_node=1)
    if name == "hybrid_fc":
        return HybridParallelStrategy()
    return MultigridStrategy(layer_parallel_size=2, mode="pm")


def _one_rank_fails(rank: int, world: int, name: str, failing: int) -> dict:
    torch.manual_seed(0)
    module = ImageClassifier(_model(name), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), num_classes=10)

    class FailOnOneRank(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == failing and batch_idx == 1:
                raise RuntimeError(f"bad sample on rank {failing}")

    loader = DataLoader(TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))), batch_size=4)
    run = fit(module, loader, devices=world, strategy=_strategy(name), max_steps=3, num_sanity_val_steps=0,
              limit_val_batches=0, callbacks=[FailOnOneRank()], refusal_is_result=True)
    return {"error": run.error}


# rank 0 failing (it hosts the store the message travels through) under hybrid_fc is the default tier's case (each
# case starts two fresh interpreters: seconds on a small machine); the other strategies and rank 1, the slow tier's
@pytest.mark.parametrize("failing", [pytest.param(1, marks=pytest.mark.slow), 0])
@pytest.mark.parametrize("name", [pytest.param("layered_sgd", marks=pytest.mark.slow), "hybrid_fc",
                                  pytest.param("multigrid", marks=pytest.mark.slow)])
def test_failure_on_one_rank_ends_every_rank_with_its_message(name, failing, monkeypatch):
    monkeypatch.setenv("LIGHTNING_HPC_START_METHOD", "spawn")
    # the collectives' timeout is longer than the run's deadline: a peer released by its timeout fails the run
    results = run_in_processes(_one_rank_fails, 2, name, failing, timeout_s=150, collective_timeout_s=900)
    peer = 1 - failing
    assert f"bad sample on rank {failing}" in results[failing]["error"]
    assert results[peer]["error"] is not None, f"rank {peer} finished although its peer failed"
    assert f"bad sample on rank {failing}" in results[peer]["error"], results[peer]["error"]
