"""Lightning features a user's classifier relies on, under ``strategy="spatial"`` against one process: Lightning's
own distributed sampler, a step-interval LR scheduler, validation with ``sync_dist`` logging and a torchmetrics
``Accuracy`` object, ``EarlyStopping`` on the synced validation loss, ``ModelCheckpoint``, and resuming the
spatial run's checkpoint in one process (the checkpoint is the whole model: it continues exactly as an
uninterrupted one-process run).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_hpc.distributed import run_in_processes
from lightning_hpc.spatial.lightning.strategy import SpatialParallelStrategy
from tests.fit_harness import fit

N, C, H, W, CLASSES, BATCH = 8, 3, 13, 10, 3, 2
TOL = 1e-5


class Classifier(pl.LightningModule):
    """A typical user CNN: conv-BN-ReLU, max-pool, conv, global average pool, Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(C, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES),
        )
        self.val_acc = MulticlassAccuracy(CLASSES, average="micro")
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)

    def on_validation_epoch_end(self) -> None:
        self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Data(pl.LightningDataModule):
    """``reference=True``: one process reading the training samples in the order Lightning's own distributed
    sampler gives one sample group (``DistributedSampler(shuffle=True, seed=0)``, re-seeded per epoch), which
    Lightning injects for every distributed strategy (DDP included) whatever the loader's ``shuffle``."""

    def __init__(self, reference: bool = False) -> None:
        super().__init__()
        self.reference = reference

    def _loader(self, offset: int, train: bool = False) -> DataLoader:
        g = torch.Generator().manual_seed(offset)
        data = TensorDataset(torch.randn(N, C, H, W, generator=g), torch.randint(0, CLASSES, (N,), generator=g))
        if train and self.reference:
            return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))
        return DataLoader(data, batch_size=BATCH, shuffle=False)

    def train_dataloader(self):
        return self._loader(0, train=True)

    def val_dataloader(self):
        return self._loader(1)


def _options(root) -> dict:
    """The Trainer options of every run: checkpoints into ``root`` (on: ``ModelCheckpoint`` writes them), no
    sanity validation, 6 epochs at most."""
    # patience 0 with a large lr: the validation loss rises after some epoch and training stops there
    callbacks = [EarlyStopping(monitor="val_loss", patience=0, mode="min"),
                 ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{epoch}", save_top_k=-1)]
    return dict(default_root_dir=root, enable_checkpointing=True, num_sanity_val_steps=0, max_epochs=6,
                callbacks=callbacks)


def _state(module: Classifier, trained: pl.Trainer) -> dict:
    return {"params": [p.detach().clone() for p in module.parameters()], "val_losses": module.val_losses,
            "val_acc": float(trained.callback_metrics["val_acc"]), "epoch": trained.current_epoch,
            "step": trained.global_step}


def _spatial_run(rank, world, root):
    run = fit(Classifier(), datamodule=Data(), devices=world, strategy=SpatialParallelStrategy(spatial_parts=(1, 2)),
              **_options(root))
    return _state(run.module, run.trainer)


def test_validation_early_stopping_and_resume_in_one_process_equal_one_process(tmp_path):
    ref_run = fit(Classifier(), datamodule=Data(reference=True), **_options(tmp_path / "ref"))
    ref = _state(ref_run.module, ref_run.trainer)
    assert ref["epoch"] < 6, "EarlyStopping never triggered: the test would not check it"

    for rank, res in enumerate(run_in_processes(_spatial_run, 2, str(tmp_path / "spatial"), timeout_s=600,
                                                collective_timeout_s=120)):
        what = f"rank {rank}"
        assert (res["epoch"], res["step"]) == (ref["epoch"], ref["step"]), (what, "stopped elsewhere")
        assert len(res["val_losses"]) == len(ref["val_losses"])
        assert all(abs(a - b) <= TOL for a, b in zip(res["val_losses"], ref["val_losses"])), (what, res["val_losses"])
        assert abs(res["val_acc"] - ref["val_acc"]) <= 1e-6, what
        for k, (p, r) in enumerate(zip(res["params"], ref["params"])):
            assert (p - r).abs().max() <= TOL, f"{what}: parameter {k} differs by {(p - r).abs().max():.3g}"

    # the spatial run's checkpoint after its first epoch, resumed in one process, continues as one process did
    resumed = fit(Classifier(), datamodule=Data(reference=True), **_options(tmp_path / "resumed"),
                  ckpt_path=str(tmp_path / "spatial" / "ckpt" / "epoch=0.ckpt"))
    got = _state(resumed.module, resumed.trainer)
    assert (got["epoch"], got["step"]) == (ref["epoch"], ref["step"])
    for k, (p, r) in enumerate(zip(got["params"], ref["params"])):
        assert (p - r).abs().max() <= TOL, f"resumed: parameter {k} differs by {(p - r).abs().max():.3g}"
