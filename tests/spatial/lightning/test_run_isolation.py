"""A spatial run leaves nothing behind for the next run in the process: the user's modules come out of
``Trainer.fit`` with no attribute and no hook the strategy (or K-FAC under it) added, the dispatch's process state
holds no running module, and a later plain K-FAC run of the very same modules trains exactly as on a clean copy of
them (plain convolution handlers, normalisation layers preconditioned), not as the tiled layers of the spatial
run.  K-FAC learns the tiled convolutions from the strategy's registry (``kfac_tiled_layers``), which belongs to
that strategy and that run's grid alone, as do the gathers already warned about."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.kfac import KFACPreconditioner
from lightning_hpc.kfac.callback import KFAC
from lightning_hpc.kfac.layers import TiledConvHandler
from lightning_hpc.spatial.dispatch import split_tensor, state
from lightning_hpc.spatial.layout.tiling import SpatialGrid
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit
from tests.spatial.dispatch.test_spatial_models import data
from tests.spatial.spatial_checks import TileDataModule

KFAC_OPTIONS = dict(factor_update_freq=1, inv_update_freq=1, damping=0.01, kl_clip=0.01)


def _net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 1, 3, padding=1))


class _Segmenter(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _net()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.binary_cross_entropy_with_logits(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _marks(model: nn.Module) -> dict[str, tuple[set[str], int]]:
    """Each module's instance attributes and number of forward hooks."""
    return {name: (set(vars(m)), len(m._forward_hooks) + len(m._forward_pre_hooks))
            for name, m in model.named_modules()}


def _plain_kfac(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Two plain SGD + K-FAC steps of ``net`` on whole samples (every rank the same data: the factor averages are
    one process's)."""
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    pre = KFACPreconditioner(net, optimizer=opt, announce=False, **KFAC_OPTIONS)
    for _ in range(2):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(net(x), y).backward()
        pre.step()
        opt.step()
    pre.remove_hooks()
    return {"handlers": [type(h).__name__ for h in pre.handlers], "skipped": [s[0] for s in pre.skipped_modules],
            "params": [p.detach().clone() for p in net.parameters()]}


def _spatial_then_plain(rank: int, world: int) -> dict:
    x, y = data()
    x = x[:, :1]
    module = _Segmenter()
    before = _marks(module.model)
    kfac = KFAC(**KFAC_OPTIONS)
    run = fit(module, datamodule=TileDataModule(x, y, batch_size=2), devices=world, max_steps=2, callbacks=[kfac],
              strategy=SpatialParallelStrategy(spatial_parts=(2, 1), overlap=True, on_unsupported="error"))
    assert kfac.preconditioner is not None
    after = _marks(module.model)
    out = {
        "tiled_in_fit": sum(isinstance(h, TiledConvHandler) for h in kfac.preconditioner.handlers),
        "added": {n: sorted(after[n][0] - before[n][0]) for n in before if after[n][0] - before[n][0]},
        "hooks": {n: after[n][1] - before[n][1] for n in before if after[n][1] != before[n][1]},
        # the process's dispatch state: nothing of the run (only counters, which no run reads)
        "process": {k: v for k, v in vars(state()).items() if k not in ("gathers", "gathered_bytes")},
    }
    clean = _net()
    clean.load_state_dict(module.model.state_dict())  # the same weights and statistics, never under a strategy
    out["used"] = _plain_kfac(module.model, x, y)
    out["clean"] = _plain_kfac(clean, x, y)
    del run  # the record held the trainer (and its strategy) alive through the later runs, as a user's script does
    return out


def test_a_spatial_fit_leaves_nothing_on_the_modules_for_a_later_plain_run():
    for res in run_in_processes(_spatial_then_plain, 2, timeout_s=300, collective_timeout_s=120):
        assert res["tiled_in_fit"] == 2, res  # K-FAC under the spatial strategy: both convolutions tiled
        assert res["added"] == {} and res["hooks"] == {}, res
        assert res["process"] == {"on_unsupported": None, "depth": 0}, res
        used, clean = res["used"], res["clean"]
        assert used["handlers"] == clean["handlers"] == ["ConvHandler", "NormAffineHandler", "ConvHandler"], res
        assert used["skipped"] == clean["skipped"] == []
        for p, q in zip(used["params"], clean["params"]):
            assert torch.equal(p, q)


def test_each_grid_warns_once_about_its_own_gathers():
    """The one-time gather warning is once per op and module on each grid (each run), not once per process: a
    later run is told about its own gathers."""
    x = torch.randn(1, 1, 4, 4)
    for _ in range(2):
        grid = SpatialGrid.single()
        with pytest.warns(UserWarning, match="torch.flip"):
            torch.flip(split_tensor(x, grid, x.shape), dims=[3])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.flip(split_tensor(x, grid, x.shape), dims=[3])  # the same grid: warned already
