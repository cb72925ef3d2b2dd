"""K-FAC with the spatial strategy on volumes and signals: ``Trainer.fit`` with ``callbacks=[KFAC(...)]`` under
``SpatialParallelStrategy(spatial_parts=(2, 1, 1))`` / ``(1, 1, 2)`` (a Conv3d net on sub-volumes) and ``(2,)`` (a
Conv1d net on halves of a signal), against ``Trainer(devices=1)`` with the same callback (float64).

Each rank's convolution factors are its tile's share of KFC's sums over the output positions (the halo- and
border-padded box the tile kernel records for the layer, :mod:`lightning_hpc.spatial.dispatch.kfac_contract`), summed
over the spatial group: the parameters after the steps equal one process's.  The batch norm of the net normalises over
every tile; K-FAC leaves it to the optimizer under the strategy (and the reference leaves it alike).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from test_volumes import CLASSES, SubVolumes
from torch import nn

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.kfac.callback import KFAC
from lightning_hpc.kfac.layers import TiledConvHandler
from lightning_hpc.spatial.dispatch import state
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

TOL = 1e-9
KFAC_OPTIONS = dict(factor_update_freq=1, inv_update_freq=2, damping=0.01, kl_clip=0.01,
                    decomposition_dtype="float64", layer_types=["conv"])


def _net(kind: str) -> nn.Module:
    torch.manual_seed(3)
    if kind == "volume":  # 3x3x3, dilated, strided and back up (nearest), a 1x1x1 head
        return nn.Sequential(
            nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
            nn.Conv3d(4, 4, 3, padding=2, dilation=2), nn.Tanh(),
            nn.Conv3d(4, CLASSES, 1),
        )
    return nn.Sequential(
        nn.Conv1d(2, 5, 5, padding=2), nn.ReLU(), nn.Conv1d(5, 5, 3, padding=1, bias=False), nn.Tanh(),
        nn.Conv1d(5, CLASSES, 3, padding=1),
    )


class Segmenter(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.model = _net(kind)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _kfac_run(rank: int, world: int, kind: str, parts) -> dict:
    module = Segmenter(kind)
    kfac = KFAC(**KFAC_OPTIONS)
    strategy = SpatialParallelStrategy(spatial_parts=parts) if parts else "auto"
    gathers = state().gathers
    run = fit(module, datamodule=SubVolumes(kind), devices=world, strategy=strategy, callbacks=[kfac], max_epochs=1,
              precision="64-true", use_distributed_sampler=False)
    pre = kfac.preconditioner
    assert pre is not None
    return {"params": run.params, "gathers": state().gathers - gathers,
            "tiled": sorted(h.name for h in pre.handlers if isinstance(h, TiledConvHandler)),
            "handlers": sorted(h.name for h in pre.handlers)}


def _check(kind: str, grids) -> None:
    ref = _kfac_run(0, 1, kind, None)
    convs = ["model.0", "model.3", "model.5"] if kind == "volume" else ["model.0", "model.2", "model.4"]
    assert ref["handlers"] == convs
    for parts in grids:
        results = run_in_processes(_kfac_run, 2, kind, parts, timeout_s=600, collective_timeout_s=120)
        for rank, res in enumerate(results):
            what = f"{kind} at {parts} rank {rank}"
            assert res["tiled"] == res["handlers"] == convs, (what, res["handlers"])
            assert res["gathers"] == 0, what
            for k, (p, q) in enumerate(zip(res["params"], ref["params"])):
                err = float((p - q).abs().max())
                assert err <= TOL, f"{what}: parameter {k} differs by {err:.3g}"


def test_kfac_on_sub_volumes_equals_one_process():
    _check("volume", [(2, 1, 1), (1, 1, 2)])


def test_kfac_on_a_split_signal_equals_one_process():
    _check("signal", [(2,)])
