"""A loss target computed from a parameter (a learned gain on the label: whole on every rank, needing a gradient)
beside split logits: ``Trainer.fit`` under the spatial strategy equals one process, the target's parameter
included.  Its gradient comes through every tile's part of the target; cut with a plain index, each rank kept only
its tile's share (a different value on each rank)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

TOL = 1e-5
N, C, H, W, BATCH, STEPS = 4, 2, 9, 8, 2, 3


class LearnedGain(pl.LightningModule):
    """A user's regression module: the label is scaled by a learned gain before the mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 3, padding=1))
        self.gain = nn.Parameter(torch.tensor(0.5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y * self.gain)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, C, H, W, generator=g), torch.randn(N, 1, H, W, generator=g)


def _gain_run(rank: int, world: int, parts: tuple[int, int] | None):
    """The learned-gain module's parameters after training: on one process where ``parts`` is None, else split."""
    module = LearnedGain()
    strategy = "auto" if parts is None else SpatialParallelStrategy(spatial_parts=parts)
    return fit(module, DataLoader(TensorDataset(*_data()), batch_size=BATCH, shuffle=False), devices=world,
               strategy=strategy, max_steps=STEPS, max_epochs=1, use_distributed_sampler=False).params


def test_learned_target_trains_as_one_process():
    ref = _gain_run(0, 1, None)
    for parts in ((2, 1), (1, 2)):
        for rank, params in enumerate(run_in_processes(_gain_run, 2, parts, timeout_s=300, collective_timeout_s=60)):
            for k, (p, r) in enumerate(zip(params, ref)):
                err = float((p - r).abs().max())
                assert err <= TOL * max(1.0, float(r.abs().max())), (parts, rank, k, err)
