"""torchmetrics objects held by a Lightning ``Callback`` (not by the LightningModule) under ``strategy="spatial"``
count every pixel and every sample once, as on one process: a confusion matrix fed the split logits that the
training step returns, and a ``SumMetric`` fed the replicated loss (which an all-rank sum would count once per
tile).  Reference: the same fit on one process.  Spatial: 2 ranks, 2x1 and 1x2 tiles of an uneven 13 x 10 image.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassConfusionMatrix

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.layout.tiling import tile_slices
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

N, C, H, W, CLASSES, BATCH = 4, 3, 13, 10, 3, 2


class Segmenter(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Conv2d(C, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, CLASSES, 3, padding=1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits.detach()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MetricsCallback(pl.Callback):
    """Metrics in a callback, one as an attribute and one in a dict, updated from the step's outputs."""

    def __init__(self) -> None:
        self.confusion = MulticlassConfusionMatrix(CLASSES)
        self.sums = {"loss": torchmetrics.SumMetric()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.confusion.update(outputs["logits"], batch[1])
        self.sums["loss"].update(outputs["loss"].detach())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.final = {"confusion": self.confusion.compute().clone(), "loss_sum": self.sums["loss"].compute().clone()}


class Data(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.tile = None
        self.spatial_tiles = (0, 1)  # both read as tiles

    def set_spatial_tile(self, tile_index, parts) -> None:
        self.tile = (tuple(tile_index), tuple(parts))

    def train_dataloader(self):
        return self.loader(0)

    def loader(self, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(N, C, H, W, generator=g), torch.randint(0, CLASSES, (N, H, W), generator=g)
        if self.tile is not None:
            rs, cs = tile_slices((H, W), self.tile[1], self.tile[0])
            x, y = x[..., rs, cs].contiguous(), y[..., rs, cs].contiguous()
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _metrics_run(rank=0, world=1, parts=None):
    """One epoch with the metrics callback: on one process where ``parts`` is None, else split."""
    callback = MetricsCallback()
    strategy = SpatialParallelStrategy(spatial_parts=parts) if parts else "auto"
    fit(Segmenter(), datamodule=Data(), devices=world, strategy=strategy, max_epochs=1, callbacks=[callback],
        use_distributed_sampler=False)
    return callback.final


@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_callback_metrics_count_once(parts):
    ref = _metrics_run()
    assert int(ref["confusion"].sum()) == N * H * W
    for rank, got in enumerate(run_in_processes(_metrics_run, 2, parts, timeout_s=300, collective_timeout_s=60)):
        assert torch.equal(got["confusion"], ref["confusion"]), f"rank {rank}: {got['confusion']} != {ref['confusion']}"
        torch.testing.assert_close(got["loss_sum"], ref["loss_sum"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
