"""Metrics that are not sums over pixels: per-sample scores (``segmentation.MeanIoU``, ``segmentation.DiceScore``,
accuracy with ``multidim_average="samplewise"``, PSNR with ``dim``) and windowed ones (SSIM) fed split activations
are computed on the whole samples (their split inputs gathered), so the computed and logged values equal one
process's; metrics that are sums over pixels (Jaccard) keep counting on the tiles, without a gather.  Fed a tile
cut out with ``local_tile``, a per-sample metric is refused by name."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure
from torchmetrics.segmentation import DiceScore, MeanIoU

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

N, C, CLASSES, H, W = 4, 3, 3, 13, 10
BATCH = 2
NAMES = ("miou", "dice", "ssim", "jaccard", "acc_samplewise", "psnr_per_sample")


class MetricModule(pl.LightningModule):
    def __init__(self, by_hand: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Conv2d(C, CLASSES, 3, padding=1)
        self.miou = MeanIoU(num_classes=CLASSES, input_format="index")
        self.dice = DiceScore(num_classes=CLASSES, input_format="index")
        self.ssim = StructuralSimilarityIndexMeasure(data_range=1.0)
        self.jaccard = MulticlassJaccardIndex(num_classes=CLASSES)
        # the per-sample forms of metrics whose global forms are sums over pixels
        self.acc_samplewise = MulticlassAccuracy(num_classes=CLASSES, average="micro", multidim_average="samplewise")
        self.psnr_per_sample = PeakSignalNoiseRatio(data_range=1.0, dim=(1, 2, 3))
        self.by_hand, self.final = by_hand, {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.model(x)
        loss = F.cross_entropy(out, y)
        pred = out.detach().argmax(1)
        if self.by_hand:
            from lightning_hpc.spatial.dispatch import local_tile

            self.miou(local_tile(pred), y)
            return loss
        self.miou(pred, y)
        self.dice(pred, y)
        self.ssim(out.detach().softmax(1), F.one_hot(y, CLASSES).permute(0, 3, 1, 2).float())
        self.jaccard(pred, y)
        self.acc_samplewise(pred, y)
        self.psnr_per_sample(out.detach().softmax(1), F.one_hot(y, CLASSES).permute(0, 3, 1, 2).float())
        self.log("miou", self.miou, on_step=False, on_epoch=True)
        self.log("ssim", self.ssim, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        if not self.by_hand:
            self.final = {name: getattr(self, name).compute().clone() for name in NAMES}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(N, C, H, W, generator=g), torch.randint(0, CLASSES, (N, H, W), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _metrics_run(rank=0, world=1, parts=None, by_hand=False):
    module = MetricModule(by_hand)
    strategy = SpatialParallelStrategy(spatial_parts=parts) if parts else "auto"
    run = fit(module, datamodule=Data(), devices=world, strategy=strategy, max_epochs=1, use_distributed_sampler=False,
              refusal_is_result=True, record_warnings=True)
    if run.error is not None:  # the refusal is the result
        return {"error": run.error, "steps": run.steps}
    return {"final": module.final, "logged": {k: run.metric(k) for k in ("miou", "ssim")},
            "warnings": run.warned("spatial:")}


@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_per_sample_metrics_equal_one_process(parts):
    ref = _metrics_run()
    results = run_in_processes(_metrics_run, 2, parts, timeout_s=300, collective_timeout_s=60)
    for res in results:
        for name in NAMES:
            diff = float((res["final"][name] - ref["final"][name]).abs().max())
            assert diff <= 1e-5, f"{name} at {parts}: {float(res['final'][name])} vs {float(ref['final'][name])}"
        for name, value in res["logged"].items():
            assert abs(value - ref["logged"][name]) <= 1e-5, (name, value, ref["logged"][name])
    warned = " ".join(results[0]["warnings"])
    # gathered, and said so once with the bytes
    for name in ("miou", "dice", "ssim", "acc_samplewise", "psnr_per_sample"):
        assert f"metric '{name}'" in warned and "bytes per rank" in warned, warned
    assert "metric 'jaccard'" not in warned, warned  # confusion counts: tiles summed, nothing gathered


def test_per_sample_metric_fed_a_hand_cut_tile_is_refused():
    results = run_in_processes(_metrics_run, 2, (2, 1), True, timeout_s=300, collective_timeout_s=60)
    for res in results:
        err = res.get("error")
        assert err is not None and "metric 'miou' (MeanIoU)" in err and "split tensor itself" in err, err
        assert res["steps"] == 0
