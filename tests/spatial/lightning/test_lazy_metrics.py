"""torchmetrics objects made after the strategy's setup count every pixel and every sample once, as on one
process: made lazily at the first training batch by the LightningModule (a ``SumMetric`` of the replicated loss,
a ``SumMetric`` of a split probability map and a confusion matrix of the split logits, the latter two in a
``MetricCollection``, a ``clone()`` of the loss sum, and a confusion matrix fed tiles cut out with
``local_tile``), made in ``on_validation_epoch_start`` (a confusion matrix of the validation logits) and made by
a callback in ``on_train_start`` (a ``CatMetric`` of the loss, whose length shows a value counted once per tile);
also a metric made before the run and kept in a plain list.  Logged values (``self.log`` of the metric objects)
and computed values equal the same fit on one process.  Spatial: 2 ranks, 2x1 and 1x2 tiles of an uneven
13 x 10 image.

A metric made before the run and kept where the strategy does not look (a module-level global) is refused when it
synchronises, rather than counted once per tile."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from test_callback_metrics import BATCH, CLASSES, C, H, N, W
from test_callback_metrics import Data as CallbackData
from torch import nn
from torchmetrics.classification import MulticlassConfusionMatrix

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.dispatch import SpatialDispatchError, local_tile
from lightning_hpc.spatial.layout.tiling import create_hybrid_layout
from lightning_hpc.spatial.lightning import metrics
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit


class LazySegmenter(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Conv2d(C, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, CLASSES, 3, padding=1))
        self.in_list = [torchmetrics.SumMetric()]  # made before the run, in a plain list (not a submodule)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        if batch_idx == 0:  # made at the first batch, after the strategy's setup
            self.loss_sum = torchmetrics.SumMetric()
            self.pixels = torchmetrics.MetricCollection(
                {"positive": torchmetrics.SumMetric(), "confusion": MulticlassConfusionMatrix(CLASSES)})
        self.loss_sum.update(loss.detach())
        self.in_list[0].update(loss.detach())
        if batch_idx == 0:
            self.loss_sum_copy = self.loss_sum.clone()  # a clone made after its original's first update
        else:
            self.loss_sum_copy.update(loss.detach())
        self.pixels["positive"].update(logits.detach().softmax(1)[:, 0])
        self.pixels["confusion"].update(logits.detach(), y)
        if batch_idx == 0:
            self.by_hand = MulticlassConfusionMatrix(CLASSES)
        self.by_hand.update(local_tile(logits.detach()), local_tile(y))  # tiles cut out by hand
        self.log("train_loss", loss)
        self.log("loss_sum", self.loss_sum, on_step=False, on_epoch=True)
        return {"loss": loss, "logits": logits.detach()}

    def on_validation_epoch_start(self) -> None:
        self.val_confusion = MulticlassConfusionMatrix(CLASSES)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_confusion.update(self.model(x), y)

    def on_validation_epoch_end(self) -> None:
        self.val_final = self.val_confusion.compute().clone()

    def on_train_epoch_end(self) -> None:
        self.final = {"loss_sum": self.loss_sum.compute().clone(), "copy": self.loss_sum_copy.compute().clone(),
                      "in_list": self.in_list[0].compute().clone(),
                      "positive": self.pixels["positive"].compute().clone(),
                      "confusion": self.pixels["confusion"].compute().clone(),
                      "by_hand": self.by_hand.compute().clone()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LateCallback(pl.Callback):
    """Makes its metric in ``on_train_start`` (after the strategy's setup)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.losses = torchmetrics.CatMetric()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.update(outputs["loss"].detach())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.final = self.losses.compute().clone()


class Data(CallbackData):
    """The training data of the callback test, and validation data of the same shapes."""

    def val_dataloader(self):
        return self.loader(1)


def _metrics_run(rank=0, world=1, parts=None):
    """One epoch of the lazy metrics: on one process where ``parts`` is None, else split."""
    callback, module = LateCallback(), LazySegmenter()
    strategy = SpatialParallelStrategy(spatial_parts=parts) if parts else "auto"
    run = fit(module, datamodule=Data(), devices=world, strategy=strategy, max_epochs=1, callbacks=[callback],
              use_distributed_sampler=False, num_sanity_val_steps=0)
    return {**module.final, "val_confusion": module.val_final, "losses": callback.final,
            "logged_loss_sum": run.metrics["loss_sum"],
            "hooks_removed": not getattr(metrics, "_ORIGINAL", None) and not getattr(metrics, "_ACTIVE", None)}


@pytest.mark.parametrize("parts", [(2, 1), (1, 2)], ids=["2x1", "1x2"])
def test_metrics_made_after_setup_count_once(parts):
    ref = _metrics_run()
    assert int(ref["confusion"].sum()) == N * H * W and int(ref["val_confusion"].sum()) == N * H * W
    assert ref["losses"].numel() == N // BATCH
    fails = []
    for rank, got in enumerate(run_in_processes(_metrics_run, 2, parts, timeout_s=300, collective_timeout_s=60)):
        for key in ("confusion", "by_hand", "val_confusion", "loss_sum", "copy", "in_list", "positive", "losses",
                    "logged_loss_sum"):
            if got[key].shape != ref[key].shape or not torch.allclose(got[key], ref[key], rtol=1e-5, atol=1e-6):
                fails.append(f"rank {rank} {key}: {got[key].tolist()} != {ref[key].tolist()}")
        if not got["hooks_removed"]:
            fails.append(f"rank {rank}: the class-level metric hooks outlived the run")
    assert not fails, "\n".join(fails)


_KEPT_ELSEWHERE = torchmetrics.SumMetric()  # made before the run, held by neither the module nor a callback


def _unknown_form(rank: int, world: int) -> str:
    layout = create_hybrid_layout((2, 1))
    metrics.activate(layout)
    try:
        _KEPT_ELSEWHERE.update(torch.tensor(1.0))
        made_during = torchmetrics.SumMetric()
        made_during.update(torch.tensor(1.0))
        assert float(made_during.compute()) == 1.0  # replicated: counted once, not once per tile
        try:
            _KEPT_ELSEWHERE.compute()
        except SpatialDispatchError as e:
            return str(e)
        return "not refused"
    finally:
        metrics.deactivate(layout)


def test_metric_of_unknown_form_is_refused_at_sync():
    for message in run_in_processes(_unknown_form, 2, timeout_s=120):
        assert "SumMetric was updated during the run without spatial counting" in message, message
