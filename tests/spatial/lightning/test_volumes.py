"""Volumes and signals under ``strategy="spatial"``: a 3-D U-Net written as a user would (Conv3d, BatchNorm3d,
GroupNorm, InstanceNorm3d, MaxPool3d, ConvTranspose3d, a replicate-padded Conv3d, a skip concatenation, a
voxel-wise cross entropy) and a 1-D signal net, trained by ``Trainer.fit`` with sub-volumes split along D, H and W,
against the same module fitted by ``Trainer(devices=1)`` in this process (float64).

Splits: 2x1x1, 1x1x2 and 1x2x1 on 2 processes, 2x2x1 on 4 (one sample group: the ranks read the same batches),
on uneven extents (D = 9, W = 7).  Each rank reads only its sub-volume (the data module's ``set_spatial_tile``).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import SpatialTensor, state
from lightning_hpc.spatial.layout.tiling import SpatialGrid, tile_slices
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

N, C_IN, CLASSES, BATCH = 4, 2, 3, 2
VOLUME = (9, 8, 7)
IMAGE = (9, 7)  # the images of tests that reuse these data (``kind="image"``)
SIGNAL = 23
TOL = 1e-9  # float64


class UNet3d(nn.Module):
    """A small 3-D U-Net as a user writes one."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        w = width
        self.enc1 = nn.Sequential(
            nn.Conv3d(C_IN, w, 3, padding=1), nn.BatchNorm3d(w), nn.ReLU(inplace=True),
            nn.Conv3d(w, w, 3, padding=1, padding_mode="replicate"), nn.ReLU(),
        )
        self.pool = nn.MaxPool3d(2, ceil_mode=True)
        self.enc2 = nn.Sequential(nn.Conv3d(w, 2 * w, 3, padding=1), nn.GroupNorm(2, 2 * w), nn.ReLU())
        self.up = nn.ConvTranspose3d(2 * w, w, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv3d(2 * w, w, 3, padding=1), nn.InstanceNorm3d(w, affine=True), nn.ReLU())
        self.head = nn.Conv3d(w, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        u = self.up(self.enc2(self.pool(e1)))
        # the decoder's upsampled volume is one voxel too large along odd extents: crop to the skip's
        u = u[:, :, : e1.shape[2], : e1.shape[3], : e1.shape[4]]
        return self.head(self.dec(torch.cat([u, e1], dim=1)))


class SignalNet(nn.Module):
    """A 1-D convolutional net over long signals (strided, dilated, pooled, upsampled back)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(C_IN, 6, 5, padding=2), nn.BatchNorm1d(6), nn.ReLU(),
            nn.Conv1d(6, 6, 3, padding=2, dilation=2), nn.ReLU(),
            nn.AvgPool1d(3, stride=1, padding=1),
            nn.Conv1d(6, CLASSES, 3, padding=1, padding_mode="reflect"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Segmenter(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = UNet3d() if kind == "volume" else SignalNet()
        self.tiles_seen: list[tuple[int, ...]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if isinstance(x, SpatialTensor):  # what this rank holds of the input (the test checks it is a tile)
            self.tiles_seen.append(tuple(x.local().shape[2:]))
        loss = F.cross_entropy(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    extent = {"volume": VOLUME, "image": IMAGE}.get(kind, (SIGNAL,))
    return (torch.randn(N, C_IN, *extent, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (N, *extent), generator=g))


class SubVolumes(pl.LightningDataModule):
    """Serves (volume, labels) and, once told its tile, reads only that sub-volume of both."""

    spatial_tiles = (0, 1)

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.tile: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def set_spatial_tile(self, tile_index, parts) -> None:
        self.tile = (tuple(tile_index), tuple(parts))

    def train_dataloader(self):
        x, y = _data(self.kind)
        if self.tile is not None:
            index, parts = self.tile
            cut = tile_slices(x.shape[2:], parts, index)
            x, y = x[(..., *cut)].contiguous(), y[(..., *cut)].contiguous()
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


#: the Trainer options of every run: two epochs in float64
OPTIONS = dict(max_epochs=2, precision="64-true")


def _split_run(rank, world, kind, parts):
    module = Segmenter(kind)
    strategy = SpatialParallelStrategy(spatial_parts=parts)
    st = state()
    gathers = st.gathers
    run = fit(module, datamodule=SubVolumes(kind), devices=world, strategy=strategy, use_distributed_sampler=False,
              **OPTIONS)
    return {"params": run.params, "tiles": module.tiles_seen, "loss": run.metric(), "gathers": st.gathers - gathers}


def _check(kind: str, world: int, grids: list[tuple[int, ...]]) -> list[dict]:
    ref = fit(Segmenter(kind), datamodule=SubVolumes(kind), **OPTIONS)
    ref_loss = ref.metric()
    out = []
    for parts in grids:
        results = run_in_processes(_split_run, world, kind, parts, timeout_s=600, collective_timeout_s=120)
        extent = VOLUME if kind == "volume" else (SIGNAL,)
        for rank, res in enumerate(results):
            what = f"{kind} at {parts} rank {rank}"
            index = tuple(SpatialGrid(parts=parts, ranks=list(range(world)), group=None, local_rank=rank).index)
            tile = tuple(s.stop - s.start for s in tile_slices(extent, parts, index))
            assert res["tiles"] == [tile] * (2 * N // BATCH), (what, res["tiles"], tile)
            assert abs(res["loss"] - ref_loss) <= TOL * max(1.0, abs(ref_loss)), (what, res["loss"], ref_loss)
            for k, (p, r) in enumerate(zip(res["params"], ref.params)):
                err = float((p - r).abs().max())
                assert err <= TOL, f"{what}: parameter {k} differs by {err:.3g}"
            # every op of these nets has a tiled form in 1-3 dimensions: nothing is gathered
            assert res["gathers"] == 0, (what, res["gathers"])
        out.append({"parts": parts, "gathers": [r["gathers"] for r in results]})
    return out


def test_3d_unet_sub_volumes_on_two_processes_equal_one_process():
    _check("volume", 2, [(2, 1, 1), (1, 1, 2), (1, 2, 1)])


@pytest.mark.slow
def test_3d_unet_sub_volumes_on_four_processes_equal_one_process():
    _check("volume", 4, [(2, 2, 1)])


def test_1d_signal_split_along_its_length_equals_one_process():
    _check("signal", 2, [(2,)])
