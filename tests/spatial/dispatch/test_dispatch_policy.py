"""The dispatch policy and the record of tile parameters travel with the grid a split tensor holds, not with the
process: two grids in one process (two strategies, two Trainers) keep their own ``overlap``, ``on_unsupported``
and tile parameters, and a run's validation after another run's training uses its own settings."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from test_spatial_models import data
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import SpatialDispatchError, on_unsupported, split_tensor
from lightning_hpc.spatial.layout.policy import DispatchPolicy
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import trainer
from tests.spatial.spatial_checks import TileDataModule


def test_two_grids_keep_their_own_policy_and_tile_parameters():
    strict, lenient = SpatialGrid.single(), SpatialGrid.single()
    strict.policy = DispatchPolicy(on_unsupported="error")
    conv = nn.Conv2d(2, 2, 3, padding=1)
    x = torch.randn(1, 2, 4, 4)
    xs, xl = split_tensor(x, strict, x.shape), split_tensor(x, lenient, x.shape)
    with pytest.raises(SpatialDispatchError, match="torch.flip"):
        torch.flip(xs, dims=[3])
    assert torch.equal(torch.flip(xl, dims=[3]).local(), torch.flip(x, dims=[3]))  # gathered: its own policy
    conv(xl)
    assert set(lenient.tile_params) == {id(conv.weight), id(conv.bias)} and strict.tile_params == {}
    with on_unsupported("error"), pytest.raises(SpatialDispatchError):  # the explicit block overrides both
        torch.flip(xl, dims=[3])
    with pytest.raises(ValueError, match="'gather' or 'error'"):
        DispatchPolicy(on_unsupported="warn")


class _Flipper(pl.LightningModule):
    """A per-pixel model with an op that has no tiled form (a flip: gathered, or refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x):
        return torch.flip(self.conv(x), dims=[3])

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.binary_cross_entropy_with_logits(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", F.binary_cross_entropy_with_logits(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Data(TileDataModule):
    def val_dataloader(self):
        return self.train_dataloader()


def _two_trainers(rank: int, world: int) -> dict:
    x, y = data()
    x = x[:, :1]
    strict, lenient = (trainer(devices=world, max_steps=1, limit_val_batches=1, num_sanity_val_steps=0,
                               strategy=SpatialParallelStrategy(spatial_parts=(2, 1), on_unsupported=mode))
                       for mode in ("error", "gather"))
    out = {}
    try:
        strict.fit(_Flipper(), datamodule=_Data(x, y, batch_size=2))
    except SpatialDispatchError as e:
        out["fit"] = str(e)
    lenient.fit(_Flipper(), datamodule=_Data(x, y, batch_size=2))  # gathers the flip: trains
    out["lenient"] = float(lenient.callback_metrics["train_loss"])
    try:  # the strict run again, after the lenient one trained: its own setting, not the last one set
        strict.validate(_Flipper(), datamodule=_Data(x, y, batch_size=2), verbose=False)
        out["validate"] = None
    except SpatialDispatchError as e:
        out["validate"] = str(e)
    return out


def test_a_second_trainer_does_not_leak_its_settings_into_the_first():
    for res in run_in_processes(_two_trainers, 2, timeout_s=300, collective_timeout_s=120):
        assert "torch.flip" in res["fit"], res
        assert res["lenient"] > 0, res
        assert res["validate"] is not None and "torch.flip" in res["validate"], res
